"""The models the benchmarks train, with their data.

* bench_loop: a stack of square tanh layers sized by its param bytes, and
  one micro-batch of random inputs and targets (`make_problem`);
* bench_plan (``_plan_models``): a small decoder-only transformer language
  model in plain JAX (`ModelConfig`, `init_params`, `make_loss`).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

# Bytes in a megabyte, as the benchmarks count them (also `_common.MB`).
MB = 2**20

# --- bench_loop: square tanh layers. ---------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
  params: dict[str, jax.Array]
  batch: tuple[jax.Array, jax.Array]
  loss: Callable[[Any, Any], jax.Array]
  width: int
  layers: int


def make_problem(
  size_mb: float, dtype: Any, micro_batch: int, seed: int = 0
) -> Problem:
  """`layers` square layers of a power-of-two `width`, about `size_mb` MB."""
  itemsize = jnp.dtype(dtype).itemsize
  num_params = max(int(size_mb * MB) // itemsize, 64)
  width = 8
  while 4 * (2 * width) ** 2 <= num_params:
    width *= 2
  layers = max(1, num_params // width**2)
  key = jax.random.PRNGKey(seed)
  params = {
    f"w{i:02d}": (
      jax.random.normal(jax.random.fold_in(key, i), (width, width))
      / math.sqrt(width)
    ).astype(dtype)
    for i in range(layers)
  }
  kx, ky = jax.random.split(jax.random.fold_in(key, layers))
  batch = (
    jax.random.normal(kx, (micro_batch, width)).astype(dtype),
    jax.random.normal(ky, (micro_batch, width)).astype(dtype),
  )

  def loss(params, batch):
    # Mixed precision: params (and so gradients, optimizer state and
    # accumulator traffic) in `dtype`, matmuls in float32. XLA:CPU's bf16
    # matmuls are slow enough to hide everything this benchmark measures.
    h, y = (x.astype(jnp.float32) for x in batch)
    for name in sorted(params):
      h = jnp.tanh(h @ params[name].astype(jnp.float32))
    return jnp.mean(jnp.square(h - y))

  return Problem(params, batch, loss, width, layers)


# --- bench_plan: a decoder-only transformer LM. ----------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab: int = 256
  seq_len: int = 64
  d_model: int = 128
  layers: int = 2
  heads: int = 4
  d_ff: int = 512


def init_params(key: jax.Array, cfg: ModelConfig) -> dict[str, Any]:
  keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))

  def dense(fan_in, fan_out):
    return jax.random.normal(next(keys), (fan_in, fan_out)) / math.sqrt(fan_in)

  d = cfg.d_model
  return {
    "embed": 0.02 * jax.random.normal(next(keys), (cfg.vocab, d)),
    "pos": 0.02 * jax.random.normal(next(keys), (cfg.seq_len, d)),
    "blocks": [
      {
        "ln1": jnp.ones(d),
        "qkv": dense(d, 3 * d),
        "proj": dense(d, d),
        "ln2": jnp.ones(d),
        "up": dense(d, cfg.d_ff),
        "down": dense(cfg.d_ff, d),
      }
      for _ in range(cfg.layers)
    ],
    "ln_f": jnp.ones(d),
  }


def _layer_norm(x, scale):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale[None, None, :]


def _attention(x, block, heads):
  b, t, d = x.shape
  q, k, v = jnp.split(x @ block["qkv"], 3, axis=-1)
  q, k, v = (y.reshape(b, t, heads, d // heads) for y in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None, :, :]
  scores = jnp.where(causal, scores, -1e9)
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
  return out.reshape(b, t, d) @ block["proj"]


def make_loss(
  cfg: ModelConfig, *, remat: bool = False
) -> Callable[[Any, jax.Array], jax.Array]:
  """Mean next-token cross-entropy over a batch of ``[B, seq_len + 1]``;
  with `remat`, each block under ``jax.checkpoint`` (recomputed in the
  backward pass instead of keeping its activations)."""

  def block_fn(x, block):
    x = x + _attention(_layer_norm(x, block["ln1"]), block, cfg.heads)
    h = jax.nn.gelu(_layer_norm(x, block["ln2"]) @ block["up"])
    return x + h @ block["down"]

  block_fn = jax.checkpoint(block_fn) if remat else block_fn

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + params["pos"][None, :, :]
    for block in params["blocks"]:
      x = block_fn(x, block)
    logits = _layer_norm(x, params["ln_f"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
    ).mean()

  return loss
