"""optax_accum with Flax linen's TrainState: the shortest correct pattern.

``TrainState.apply_gradients(grads=..., **kwargs)`` does *not* forward
keyword arguments to ``tx.update``: it passes them to ``replace``, so
``apply_gradients(grads=g, weight=n)`` raises ``TypeError: ... unexpected
keyword argument 'weight'`` (flax 0.12). Subclass it once:

  class AccumTrainState(train_state.TrainState):
    def apply_gradients(self, *, grads, weight=None, **kwargs):
      updates, opt_state = self.tx.update(
          grads, self.opt_state, self.params, weight=weight)
      return self.replace(
          step=self.step + optax_accum.has_updated(opt_state),
          params=optax.apply_updates(self.params, updates),
          opt_state=opt_state, **kwargs)

``step`` then counts optimizer steps, not micro-batches.

Running this file checks, on a tiny regression with a different number of
real (unmasked) rows in every micro-batch, that k weighted micro-batches give
the parameters of one big batch.

  python examples/linen_trainstate.py
"""

import argparse
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import optax_accum


class AccumTrainState(train_state.TrainState):
  """A TrainState whose `apply_gradients` passes `weight=` to the optimizer."""

  def apply_gradients(self, *, grads: Any, weight: Any = None, **kwargs):
    updates, opt_state = self.tx.update(
      grads, self.opt_state, self.params, weight=weight
    )
    return self.replace(
      # Count optimizer steps: params only move when a cycle completes.
      step=self.step + optax_accum.has_updated(opt_state),
      params=optax.apply_updates(self.params, updates),
      opt_state=opt_state,
      **kwargs,
    )


def loss_fn(params, apply_fn, x, y, mask):
  """Mean squared error over the real rows of one (micro-)batch."""
  err = jnp.sum(jnp.square(apply_fn(params, x) - y), axis=-1)
  return jnp.sum(err * mask) / jnp.sum(mask)


@jax.jit
def accumulate_step(state: AccumTrainState, x, y, mask) -> AccumTrainState:
  grads = jax.grad(loss_fn)(state.params, state.apply_fn, x, y, mask)
  return state.apply_gradients(grads=grads, weight=jnp.sum(mask))


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
  """Final states after `steps` big batches, and after accumulation."""
  x, y, mask = make_batches(steps, every_k, micro_batch)
  model = nn.Dense(1)
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 3), jnp.float32))
  inner = optax.adam(0.1)

  big = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=inner
  )
  for s in range(steps):
    big = big_batch_step(big, x[s], y[s], mask[s])

  state = AccumTrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=optax_accum.accumulate(inner, every_k),
  )
  for s in range(steps):
    for i in range(every_k):
      rows = slice(i * micro_batch, (i + 1) * micro_batch)
      state = accumulate_step(state, x[s, rows], y[s, rows], mask[s, rows])
  assert int(state.step) == steps  # optimizer steps, not micro-batches
  return big, state


def main() -> None:
  big, state = train_both()
  diff = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(
      jax.tree.leaves(big.params), jax.tree.leaves(state.params), strict=True
    )
  )
  print(f"max |params(big batch) - params(accumulated)| = {diff:.1e}")
  assert diff < 1e-5, diff  # float32 rounding of two summation orders


if __name__ == "__main__":
  # No options: --help prints what the example shows.
  argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  ).parse_args()
  main()
