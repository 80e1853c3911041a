"""optax_accum with Flax NNX: the shortest correct training step.

``optax_accum.flax.Optimizer`` is ``nnx.Optimizer`` (same constructor, same
``update(model, grads, **kwargs)``, same fields) applying the updates with
``optax_accum.apply_updates``: a micro-step neither reads nor writes the
params. The micro-batch's weight goes straight through to ``tx.update``:

  optimizer = optax_accum.flax.Optimizer(model, optax_accum.accumulate(inner, k),
                                         wrt=nnx.Param)
  optimizer.update(model, grads, weight=n_real)  # once per micro-batch

Donate the model and the optimizer (``nnx.jit(..., donate_argnums=(0, 1))``):
the accumulator is a parameter-sized buffer that the step should update in
place, not copy. The parameters move on every k-th call only.
``optimizer.step`` counts calls (micro-batches); the optimizer step is
``optimizer.optimizer_step``.

Running this file checks, on a tiny regression with a different number of
real (unmasked) rows in every micro-batch, that k weighted micro-batches give
the parameters of one big batch.

  python examples/nnx_quickstart.py
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_accum


def loss_fn(model: nnx.Module, x, y, mask):
  """Mean squared error over the real rows of one (micro-)batch."""
  err = jnp.sum(jnp.square(model(x) - y), axis=-1)
  return jnp.sum(err * mask) / jnp.sum(mask)


# The model and the optimizer (its accumulator) are updated in place.
@nnx.jit(donate_argnums=(0, 1))
def accumulate_step(model, optimizer, x, y, mask):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y, mask)
  # The loss is a mean over sum(mask) rows: weigh the gradient by them.
  optimizer.update(model, grads, weight=jnp.sum(mask))
  return loss


@nnx.jit
def big_batch_step(model, optimizer, x, y, mask):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y, mask)
  optimizer.update(model, grads)
  return loss


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
  """Params after `steps` big batches, and after accumulating micro-batches."""
  x, y, mask = make_batches(steps, every_k, micro_batch)
  inner = optax.adam(0.1)

  big = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  big_opt = nnx.Optimizer(big, inner, wrt=nnx.Param)
  for s in range(steps):
    big_batch_step(big, big_opt, x[s], y[s], mask[s])

  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = optax_accum.flax.Optimizer(
    model, optax_accum.accumulate(inner, every_k), wrt=nnx.Param
  )
  for s in range(steps):
    for i in range(every_k):
      rows = slice(i * micro_batch, (i + 1) * micro_batch)
      accumulate_step(model, optimizer, x[s, rows], y[s, rows], mask[s, rows])
  assert int(optimizer.step[...]) == steps * every_k  # calls
  assert int(optimizer.optimizer_step) == steps  # optimizer steps
  return nnx.state(big, nnx.Param), nnx.state(model, nnx.Param)


def main() -> None:
  big, accumulated = train_both()
  diff = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(
      jax.tree.leaves(big), jax.tree.leaves(accumulated), strict=True
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
