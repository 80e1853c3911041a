"""The demo's model: a byte-level, pre-norm, decoder-only transformer (NNX)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from config import Config
from input_pipeline import VOCAB


class Block(nnx.Module):
  """Causal self-attention and an MLP, each behind a LayerNorm."""

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.norm1 = nnx.LayerNorm(d_model, rngs=rngs)
    # No bias: softmax ignores a key bias, so its gradient is zero up to
    # rounding, which Adam would blow up into learning-rate-sized steps that
    # differ between any two summation orders.
    self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, rngs=rngs)
    self.norm2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
    self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:  # float32[b, t, d]
    b, t, d = x.shape
    heads = self.qkv(self.norm1(x)).reshape(b, t, 3 * self.num_heads, -1)
    q, k, v = jnp.split(heads, 3, axis=2)
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / np.sqrt(q.shape[-1])
    # With right padding a causal mask is all we need: no real token ever
    # attends to a pad (pads attend to real tokens, but their loss is masked).
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(x.dtype).min)
    mixed = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, axis=-1), v)
    x = x + self.out(mixed.reshape(b, t, d))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TransformerLM(nnx.Module):
  """Bytes in, next-byte logits out; input and output embeddings are tied."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
    self.pos = nnx.Param(
      0.02 * jax.random.normal(rngs.params(), (cfg.max_len, cfg.d_model))
    )
    self.blocks = nnx.List(
      [
        Block(cfg.d_model, cfg.num_heads, rngs=rngs)
        for _ in range(cfg.num_layers)
      ]
    )
    self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:  # int32[b, t]
    table = self.embed.embedding[...]
    # A one-hot matmul rather than a gather: its gradient is a matmul, which
    # is deterministic on GPU too (a gather's is a scatter-add with atomics),
    # and the bitwise resume check needs that. Cheap with 256 symbols.
    one_hot = jax.nn.one_hot(tokens, VOCAB, dtype=table.dtype)
    x = jnp.einsum("btv,vd->btd", one_hot, table)
    x = x + self.pos[...][None, : tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))
