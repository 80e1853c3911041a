"""`optax_accum.microbatch` with a Flax NNX model, checked against unsplit.

``microbatch`` takes ``nnx.value_and_grad`` as it is and the model as
argument 0, like ``nnx.value_and_grad`` itself:

  grad_fn = optax_accum.microbatch(
      nnx.value_and_grad(loss_fn), num_microbatches,
      weight_fn=lambda micro: micro["mask"].sum())  # real tokens
  loss, grads = grad_fn(model, batch)  # grads: an nnx.State

It splits the model once outside its ``lax.scan`` and merges it inside for
every micro-batch (NNX refuses a model from outside a trace). Parameters are
the same at every micro-batch; other variables (BatchNorm statistics, RNG
counts) are carried from one micro-batch to the next and written back to the
model, as ``num_microbatches`` calls one after the other would leave them.

Running this file trains a small MLP on a token-level regression with a
different number of real (unmasked) tokens in every row, once with the whole
batch per step and once with micro-batches, and checks that the losses,
gradients and parameters agree (exit status 1 if not). With
``--no-weight-fn`` the micro-batches are averaged with equal weights, which
is not the per-token mean of ragged data: the check then fails, by design.

  python examples/nnx_microbatch.py [--num-microbatches 4] [--steps 3]
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_accum

FEATURES, HIDDEN, TOKENS = 3, 16, 6
# float32 sums in another order, over a few Adam steps.
TOLERANCE = 1e-5


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))[..., 0]


def loss_fn(model: MLP, batch) -> jax.Array:
  """Mean squared error over the real tokens of a (micro-)batch."""
  err = model(batch["x"]) - batch["y"]
  return jnp.sum(batch["mask"] * err**2) / jnp.sum(batch["mask"])


def tokens(batch) -> jax.Array:
  return jnp.sum(batch["mask"])


def make_batches(steps: int, batch_size: int, seed: int):
  """`steps` batches [batch_size, TOKENS]; row r has its own real length."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(steps, batch_size, TOKENS, FEATURES))
  y = np.sin(x @ np.array([1.0, -2.0, 0.5]))
  lengths = rng.integers(1, TOKENS + 1, size=(steps, batch_size))
  mask = np.arange(TOKENS) < lengths[..., None]
  as_f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  return [
    {"x": as_f32(x[s]), "y": as_f32(y[s]), "mask": as_f32(mask[s])}
    for s in range(steps)
  ]


def make_train_step(value_and_grad_fn):
  @nnx.jit
  def train_step(model, optimizer, batch):
    loss, grads = value_and_grad_fn(model, batch)
    optimizer.update(model, grads)
    return loss, grads

  return train_step


def max_difference(a, b) -> float:
  if jax.tree.structure(a) != jax.tree.structure(b):
    raise ValueError("the trees differ in structure")
  return max(
    float(jnp.max(jnp.abs(x - y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def train_both(args):
  """Trains the unsplit and the micro-batched step from the same init.

  Returns the largest difference seen in the loss, gradients and parameters.
  """
  value_and_grad = nnx.value_and_grad(loss_fn)
  grad_fn = optax_accum.microbatch(
    value_and_grad,
    args.num_microbatches,
    weight_fn=None if args.no_weight_fn else tokens,
  )
  steps = {"unsplit": value_and_grad, "microbatch": grad_fn}
  models = {name: MLP(nnx.Rngs(args.seed)) for name in steps}
  optimizers = {
    name: nnx.Optimizer(models[name], optax.adam(1e-2), wrt=nnx.Param)
    for name in steps
  }
  train_steps = {name: make_train_step(fn) for name, fn in steps.items()}
  worst = 0.0
  for batch in make_batches(args.steps, args.batch_size, args.seed):
    out = {
      name: train_steps[name](models[name], optimizers[name], batch)
      for name in steps
    }
    worst = max(worst, max_difference(out["unsplit"], out["microbatch"]))
    print(
      f"loss unsplit {float(out['unsplit'][0]):.6f}"
      f" microbatch {float(out['microbatch'][0]):.6f}"
    )
  params = {name: nnx.state(models[name], nnx.Param) for name in steps}
  return max(worst, max_difference(params["unsplit"], params["microbatch"]))


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--num-microbatches", type=int, default=4)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--no-weight-fn",
    action="store_true",
    help="weigh micro-batches equally (wrong for ragged data: fails)",
  )
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  worst = train_both(args)
  ok = worst <= TOLERANCE
  print(
    f"max |unsplit - microbatch| over losses, grads, params = {worst:.1e}"
    f" ({'ok' if ok else 'MISMATCH'}, tolerance {TOLERANCE:.0e})"
  )
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
