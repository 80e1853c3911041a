"""Train steps to plan (``optax_accum.plan_micro_batch``): an MLP, a
decoder-only transformer and a small convolutional net, each a jitted step
``(params, opt_state, batch)`` with ``accumulate(adam)`` inside, donated as
it runs, and ``args_for(n)``: ``jax.ShapeDtypeStruct``\\ s for a micro-batch
of ``n`` examples (nothing is allocated, so a model far larger than this
machine plans from here).

Used by ``tests/test_plan.py`` and ``benchmarks/bench_plan.py``.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _models import ModelConfig, init_params, make_loss

import optax_accum


@dataclasses.dataclass(frozen=True)
class Plannable:
  """A step to plan and its arguments for a micro-batch of ``n``."""

  name: str
  step: Callable[..., Any]
  args_for: Callable[[int], tuple]
  global_batch: int


def jitted_step(loss: Callable[[Any, Any], jax.Array]):
  """The train step users write: gradient, ``accumulate(adam)``, applied
  with ``optax_accum.apply_updates``, params and state donated. The plan
  does not depend on ``every_k``; train with the plan's."""
  tx = optax_accum.accumulate(optax.adam(1e-3), every_k=2)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax_accum.apply_updates(params, updates, opt_state), opt_state

  return step, tx


def _abstract_args(init: Callable[[], Any], tx, batch_for) -> Callable:
  params = jax.eval_shape(init)
  state = jax.eval_shape(tx.init, params)
  return lambda n: (params, state, batch_for(n))


def mlp(
  width: int = 512,
  layers: int = 4,
  features: int = 512,
  global_batch: int = 4096,
  *,
  remat: bool = False,
):
  """Dense tanh layers on ``(n, features)`` inputs; squared output (with
  `remat`, each layer under ``jax.checkpoint``)."""

  def init():
    shapes = [(features, width)] + [(width, width)] * (layers - 1)
    return [jnp.zeros(s, jnp.float32) for s in shapes]

  def layer(x, w):
    return jnp.tanh(jnp.tanh(x @ w) @ w.T @ w)

  layer = jax.checkpoint(layer) if remat else layer

  def loss(params, x):
    for w in params:
      x = layer(x, w)
    return jnp.mean(x**2)

  step, tx = jitted_step(loss)
  args_for = _abstract_args(
    init, tx, lambda n: jax.ShapeDtypeStruct((n, features), jnp.float32)
  )
  return Plannable("mlp", step, args_for, global_batch)


def transformer(
  cfg: ModelConfig | None = None, global_batch=256, *, remat: bool = False
):
  """The benchmarks' decoder-only language model on token sequences (with
  `remat`, each block under ``jax.checkpoint``)."""
  cfg = ModelConfig() if cfg is None else cfg
  step, tx = jitted_step(make_loss(cfg, remat=remat))
  args_for = _abstract_args(
    lambda: init_params(jax.random.key(0), cfg),
    tx,
    lambda n: jax.ShapeDtypeStruct((n, cfg.seq_len + 1), jnp.int32),
  )
  return Plannable("transformer", step, args_for, global_batch)


def convnet(channels: int = 32, image: int = 32, global_batch: int = 1024):
  """Three 3x3 convolutions (NHWC) and a mean: an image model."""

  def init():
    shapes = [(3, 3, 3, channels)] + [(3, 3, channels, channels)] * 2
    return [jnp.zeros(s, jnp.float32) for s in shapes]

  def loss(params, x):
    for w in params:
      x = jax.nn.relu(
        jax.lax.conv_general_dilated(
          x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
      )
    return jnp.mean(x**2)

  step, tx = jitted_step(loss)
  args_for = _abstract_args(
    init,
    tx,
    lambda n: jax.ShapeDtypeStruct((n, image, image, 3), jnp.float32),
  )
  return Plannable("convnet", step, args_for, global_batch)
