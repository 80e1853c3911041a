"""bench_step's static steps: the floor, and the static cycle's two programs.

Both pick, on the host, which of two compiled programs a call runs (every
k-th call emits), as the static cycle of ``optax_accum`` does with
``update(..., emit=...)``: no conditional in either program.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from _common import compiled_memory

import optax_accum

LEARNING_RATE = 1e-3


class FloorState(NamedTuple):
  """State of `prepare_floor`."""

  count: jax.Array  # int32[]
  acc: optax.Updates


def prepare_floor(inner, k: int) -> optax.GradientTransformation:
  """The least any accumulation pays, static (see `Static`): a micro-step
  adds the gradient into the accumulator and returns the params untouched;
  the last call of a cycle applies ``-lr * acc / k`` and resets (no inner
  optimizer, no conditional). ``update(..., emit=...)``: a Python bool."""
  del inner

  def init(params):
    return FloorState(
      count=jnp.zeros([], jnp.int32),
      acc=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
    )

  def update(updates, state, params=None, *, emit=False):
    del params
    acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), state.acc, updates)
    if not emit:
      return None, FloorState(state.count + 1, acc)
    new_updates = jax.tree.map(
      lambda a, g: ((-LEARNING_RATE / k) * a).astype(g.dtype), acc, updates
    )
    zeros = jax.tree.map(jnp.zeros_like, acc)
    return new_updates, FloorState(jnp.zeros([], jnp.int32), zeros)

  return optax.GradientTransformation(init, update)


def static_train_step(grad_fn, tx):
  """``jit(grad -> update(..., emit=) -> apply)``, params and state donated,
  `emit` static: ``optax.apply_updates`` for the floor (whose micro-step
  returns no updates), ``optax_accum.apply_updates`` for the others."""

  def step(params, state, batch, emit):
    updates, state = tx.update(grad_fn(params, batch), state, params, emit=emit)
    if isinstance(state, FloorState):  # the floor applies its own
      if updates is not None:
        params = optax.apply_updates(params, updates)
      return params, state
    return optax_accum.apply_updates(params, updates, state), state

  return jax.jit(step, donate_argnums=(0, 1), static_argnames="emit")


class Static:
  """The static cycle's step: two compiled programs, ``emit=False`` and
  ``emit=True`` (`static_train_step`), picked on the host by a call
  counter (every k-th call emits). Its memory is the larger program's."""

  def __init__(self, grad_fn, tx, k: int, params, state, batch):
    jitted = static_train_step(grad_fn, tx)
    self.programs = [
      jitted.lower(params, state, batch, emit=emit).compile()
      for emit in (False, True)
    ]
    self.k, self.calls = k, 0

  def __call__(self, params, state, batch):
    emit = self.calls % self.k == self.k - 1
    self.calls += 1
    return self.programs[emit](params, state, batch)

  def memory(self) -> dict[str, Any]:
    memories = [compiled_memory(p) for p in self.programs]
    return max(memories, key=lambda m: m["footprint"])
