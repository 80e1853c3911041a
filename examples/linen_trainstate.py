"""optax_accum with Flax linen's TrainState: the shortest correct pattern.

``TrainState.apply_gradients(grads=..., **kwargs)`` does *not* forward
keyword arguments to ``tx.update``: it passes them to ``replace``, so
``apply_gradients(grads=g, weight=n)`` raises ``TypeError: ... unexpected
keyword argument 'weight'`` (flax 0.12), and ``flush=`` cannot reach the
optimizer either. ``optax_accum.flax.TrainState`` forwards them; subclass it
once (``AccumTrainState`` below) to decide what ``step`` counts:

* ``counts="calls"`` (the default): micro-batches, as TrainState's own
  ``step`` does. A trainer that uses ``state.step`` as its data position (to
  resume a loader, to name checkpoints) keeps working; the optimizer step is
  ``state.opt_state.step``.
* ``counts="optimizer_steps"``: updates of the params, as in the big-batch
  run, so logs and step-based schedules outside the optimizer line up with
  it. ``step`` is then no data position: keep one of your own.

Running this file checks, on a tiny regression with a different number of
real (unmasked) rows in every micro-batch and a last, partial window ended
with ``flush=True``, that both give the parameters of the big batches.

  python examples/linen_trainstate.py
"""

import argparse
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state

import optax_accum

STEP_COUNTS = ("calls", "optimizer_steps")


class AccumTrainState(optax_accum.flax.TrainState):
  """A TrainState whose `apply_gradients` passes `weight=`, `flush=` and
  `emit=` on, and leaves the params untouched on a micro-step
  (`optax_accum.apply_updates`).

  Attributes:
    counts: What `step` counts, "calls" or "optimizer_steps" (module
      docstring).
  """

  counts: str = struct.field(pytree_node=False, default="calls")

  def apply_gradients(self, *, grads: Any, **kwargs: Any):
    """``optax_accum.flax.TrainState.apply_gradients`` (``weight=``,
    ``flush=``, ``emit=`` reach ``tx.update``), counting as `counts` says."""
    new = super().apply_gradients(grads=grads, **kwargs)
    if self.counts == "calls":
      return new
    # params only move when a cycle completes
    return new.replace(step=self.step + optax_accum.has_updated(new.opt_state))


def loss_fn(params, apply_fn, x, y, mask):
  """Mean squared error over the real rows of one (micro-)batch."""
  err = jnp.sum(jnp.square(apply_fn(params, x) - y), axis=-1)
  return jnp.sum(err * mask) / jnp.sum(mask)


# Donate the state: its accumulator (and params) are updated in place, not
# copied on every micro-batch.
@functools.partial(jax.jit, donate_argnums=0)
def accumulate_step(state: AccumTrainState, x, y, mask, flush=False):
  grads = jax.grad(loss_fn)(state.params, state.apply_fn, x, y, mask)
  return state.apply_gradients(grads=grads, weight=jnp.sum(mask), flush=flush)


@jax.jit
def big_batch_step(state: train_state.TrainState, x, y, mask):
  grads = jax.grad(loss_fn)(state.params, state.apply_fn, x, y, mask)
  return state.apply_gradients(grads=grads)


def make_batches(steps: int, every_k: int, micro_batch: int, seed: int = 0):
  """`steps` big batches; micro-batch i of a step has its own count of real rows."""
  rng = np.random.default_rng(seed)
  size = every_k * micro_batch
  x = rng.normal(size=(steps, size, 3)).astype(np.float32)
  y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(
    np.float32
  )
  real = rng.integers(1, micro_batch + 1, size=(steps, every_k))
  mask = np.arange(micro_batch)[None, None, :] < real[:, :, None]
  return x, y, mask.reshape(steps, size).astype(np.float32)


def train_both(steps: int = 3, every_k: int = 4, micro_batch: int = 8):
  """Final states after `steps` big batches and a last one of half the size,
  and after accumulating the same rows with either step count.

  Returns:
    ``(big, {counts: state})``.
  """
  partial = max(every_k // 2, 1)  # micro-batches in the last window
  x, y, mask = make_batches(steps + 1, every_k, micro_batch)
  windows = [every_k] * steps + [partial]
  model = nn.Dense(1)
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 3), jnp.float32))
  inner = optax.adam(0.1)

  big = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=inner
  )
  for s, n in enumerate(windows):
    rows = slice(0, n * micro_batch)
    big = big_batch_step(big, x[s, rows], y[s, rows], mask[s, rows])

  states = {}
  for counts in STEP_COUNTS:
    state = AccumTrainState.create(
      apply_fn=model.apply,
      params=jax.tree.map(jnp.copy, params),  # its own: the step donates it
      tx=optax_accum.accumulate(inner, every_k),
      counts=counts,
    )
    for s, n in enumerate(windows):
      for i in range(n):
        rows = slice(i * micro_batch, (i + 1) * micro_batch)
        # The last window of the data is short: flush ends it.
        flush = i == n - 1 and n < every_k
        state = accumulate_step(
          state, x[s, rows], y[s, rows], mask[s, rows], flush
        )
    states[counts] = state
  assert int(states["calls"].step) == sum(windows)  # the data position
  assert int(states["optimizer_steps"].step) == int(big.step) == len(windows)
  assert int(states["calls"].opt_state.step) == len(windows)
  return big, states


def main() -> None:
  big, states = train_both()
  for counts, state in states.items():
    diff = max(
      float(jnp.max(jnp.abs(a - b)))
      for a, b in zip(
        jax.tree.leaves(big.params), jax.tree.leaves(state.params), strict=True
      )
    )
    print(
      f"counts={counts!r}: step {int(state.step)}, optimizer step"
      f" {int(state.opt_state.step)}, max |params(big batch) -"
      f" params(accumulated)| = {diff:.1e}"
    )
    assert diff < 1e-5, diff  # float32 rounding of two summation orders


if __name__ == "__main__":
  # No options: --help prints what the example shows.
  argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  ).parse_args()
  main()
