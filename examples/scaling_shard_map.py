"""Data parallelism that reduces gradients once per optimizer step.

Inside ``jax.shard_map`` every device computes the gradient of its own slice
of each micro-batch and hands it, unreduced, to
``optax_accum.accumulate(inner, k, axis_name="data")``. The accumulator is
device-local; only the call that ends a cycle sums the accumulated gradients
and weights over ``"data"`` (one all-reduce, inside the conditional that
runs the inner optimizer). The usual step (``jit`` with a batch-sharded
micro-batch, or a ``pmean`` of every micro-batch gradient) all-reduces ``k``
times as many bytes.

The state layout. Between steps the state lives outside ``shard_map`` as
global arrays. The leaves holding this device's own sums during a cycle get
a leading device axis (spec ``P("data")``); every other leaf is the same on
every device (``P()``). ``optax_accum.distributed.shard_map_specs`` gives these specs,
and ``optax_accum.distributed.add_device_axis`` / ``drop_device_axis`` convert inside
``shard_map``: nothing here needs to know which fields are which.

Run it to see the specs, train a token-weighted linear model for a few steps
on 8 simulated CPU devices, and check the params against one big batch on
one device::

  python examples/scaling_shard_map.py [--steps 3] [--every-k 4]
"""

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

# 8 simulated CPU devices; JAX starts its backend at the first operation.
jax.config.update("jax_num_cpu_devices", 8)

AXIS = "data"
SEQ, DIM, OUT = 8, 16, 4


def loss_fn(params, x, y, mask):
  """Token-mean squared error of a (micro-)batch, and its token count."""
  pred = jnp.einsum("btd,do->bto", x, params["w"]) + params["b"][None, None]
  err = jnp.sum((pred - y) ** 2, axis=-1)
  tokens = jnp.sum(mask)
  return jnp.sum(err * mask) / jnp.maximum(tokens, 1.0), tokens


def make_init(tx, mesh, params):
  return jax.jit(
    jax.shard_map(
      lambda params: optax_accum.distributed.add_device_axis(tx.init(params)),
      mesh=mesh,
      in_specs=P(),
      out_specs=state_specs(tx, params),
    )
  )


def state_specs(tx, params):
  """The PartitionSpecs of the state between steps (a prefix of its tree)."""
  return optax_accum.distributed.shard_map_specs(
    jax.eval_shape(tx.init, params), AXIS
  )


def make_train_step(tx, mesh, params):
  """One micro-batch: params and state in and out, donated."""

  def local_step(params, state, x, y, mask):
    # Mark the params as varying over the devices, so that jax.grad returns
    # this device's own gradient and does not all-reduce it itself on every
    # micro-batch (what it does for replicated params under check_vma=True).
    local_params = lax.pcast(params, AXIS, to="varying")
    (loss, tokens), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      local_params, x, y, mask
    )
    # The local gradient is a mean over this device's tokens: weigh it by
    # them, and the emitted update is the mean over every token of the step.
    state = optax_accum.distributed.drop_device_axis(state)
    updates, state = tx.update(grads, state, params, weight=tokens)
    # The params are untouched until the cycle ends (optax.apply_updates
    # would read and write them to add zeros).
    params = optax_accum.apply_updates(params, updates, state)
    # Per-device loss sums; added up on the host, no collective needed.
    state = optax_accum.distributed.add_device_axis(state)
    return params, state, (loss * tokens)[None], tokens[None]

  return jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(P(), state_specs(tx, params), P(AXIS), P(AXIS), P(AXIS)),
      out_specs=(P(), state_specs(tx, params), P(AXIS), P(AXIS)),
    ),
    donate_argnums=(0, 1),
  )


def make_data(steps: int, every_k: int, batch: int, seed: int = 0):
  """[step, micro-batch, example, token, ...], 1..SEQ real tokens each."""
  rng = np.random.default_rng(seed)
  shape = (steps, every_k, batch, SEQ)
  x = rng.normal(size=(*shape, DIM)).astype(np.float32)
  w_true = rng.normal(size=(DIM, OUT)).astype(np.float32)
  y = (x @ w_true + 0.1 * rng.normal(size=(*shape, OUT))).astype(np.float32)
  lengths = rng.integers(1, SEQ + 1, size=shape[:-1])
  mask = (np.arange(SEQ) < lengths[..., None]).astype(np.float32)
  return x, y, mask


def big_batch_reference(params, inner, x, y, mask):
  """One device, one batch of every micro-batch of a step, per step."""
  state = inner.init(params)
  for s in range(x.shape[0]):
    flat = [a[s].reshape(-1, *a.shape[3:]) for a in (x, y, mask)]
    grads, _ = jax.grad(loss_fn, has_aux=True)(params, *flat)
    updates, state = inner.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def print_layout(state) -> None:
  print("state layout (global shape, spec):")
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    print(
      f"  {jax.tree_util.keystr(path):28s} {str(leaf.shape):14s}"
      f" {leaf.sharding.spec}"
    )


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument("--per-device-batch", type=int, default=2)
  args = parser.parse_args(argv)

  n_dev = jax.device_count()
  mesh = jax.make_mesh((n_dev,), (AXIS,), axis_types=(AxisType.Auto,))
  inner = optax.adam(0.05)
  tx = optax_accum.accumulate(inner, args.every_k, axis_name=AXIS)

  # Host arrays: the device copies are donated to the step.
  params0 = {
    "w": np.zeros((DIM, OUT), np.float32),
    "b": np.zeros(OUT, np.float32),
  }
  params = jax.device_put(params0, NamedSharding(mesh, P()))
  state = make_init(tx, mesh, params0)(params)
  print(f"{n_dev} devices, k={args.every_k}")
  print_layout(state)

  train_step = make_train_step(tx, mesh, params0)
  batch = NamedSharding(mesh, P(AXIS))
  x, y, mask = make_data(
    args.steps, args.every_k, n_dev * args.per_device_batch
  )
  for s in range(args.steps):
    loss_sum = tokens = 0.0
    for i in range(args.every_k):
      micro = jax.device_put((x[s, i], y[s, i], mask[s, i]), batch)
      params, state, loss_sums, counts = train_step(params, state, *micro)
      loss_sum += float(jnp.sum(loss_sums))
      tokens += float(jnp.sum(counts))
    assert bool(state.emitted)
    print(
      f"step {int(state.step)}: loss {loss_sum / tokens:.4f}"
      f" over {int(tokens)} tokens"
    )

  reference = big_batch_reference(params0, inner, x, y, mask)
  error = max(
    float(jnp.max(jnp.abs(a - b)))
    for a, b in zip(
      jax.tree.leaves(jax.device_get(params)),
      jax.tree.leaves(reference),
      strict=True,
    )
  )
  print(f"max |params - big-batch reference| = {error:.2e}")
  if error > 1e-4:
    raise SystemExit(f"params differ from the big-batch reference: {error}")
  return {"error": error, "step": int(state.step)}


if __name__ == "__main__":
  main()
