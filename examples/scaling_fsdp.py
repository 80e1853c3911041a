"""FSDP with gradient accumulation: params sharded, accumulators follow.

Fully sharded data parallelism under ``jit``: every big param is split over
all devices along the ``fsdp`` mesh axis, and so is each micro-batch. The
optimizer state must be split the same way, or the accumulator and adam's
moments would each cost a full copy of the params on every device. The
recipe:

1. put the params with a ``NamedSharding`` per leaf;
2. ``shardings = optax_accum.distributed.state_shardings(tx, params)``: the accumulator,
   ``mu`` and ``nu`` like their params, counters replicated;
3. ``jax.jit(tx.init, out_shardings=shardings)``: a jitted ``init`` does
   not see the params' shardings by itself (its zeros do not depend on the
   params) and would put everything on one device;
4. jit the step with the same shardings in and out and donate params and
   state: ``tx.update`` keeps every leaf where it is.

XLA reduces (reduce-scatters) each micro-batch gradient here; to reduce
once per optimizer step instead, see examples/scaling_shard_map.py.

Run it to see each param's layout next to its accumulator's, train a small
MLP for a few steps on 8 simulated CPU devices, and check the params against
one big batch on one device::

  python examples/scaling_fsdp.py [--steps 3] [--every-k 4]
"""

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

# 8 simulated CPU devices; JAX starts its backend at the first operation.
jax.config.update("jax_num_cpu_devices", 8)

AXIS = "fsdp"
DIM, HIDDEN, OUT = 16, 64, 4


def fsdp_spec(shape: tuple[int, ...], n_shards: int) -> P:
  """Split the largest dimension that divides evenly; else replicate."""
  dims = sorted(range(len(shape)), key=lambda d: -shape[d])
  for d in dims:
    if shape[d] % n_shards == 0 and shape[d] >= n_shards:
      return P(*(AXIS if i == d else None for i in range(len(shape))))
  return P()


def init_params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {
    "hidden": {
      "kernel": rng.normal(size=(DIM, HIDDEN)).astype(np.float32) / 4,
      "bias": np.zeros(HIDDEN, np.float32),
    },
    "out": {
      "kernel": rng.normal(size=(HIDDEN, OUT)).astype(np.float32) / 8,
      "bias": np.zeros(OUT, np.float32),  # too small to split: replicated
    },
  }


def loss_fn(params, x, y):
  h = jax.nn.relu(
    x @ params["hidden"]["kernel"] + params["hidden"]["bias"][None]
  )
  pred = h @ params["out"]["kernel"] + params["out"]["bias"][None]
  return jnp.mean((pred - y) ** 2)


def make_train_step(tx, param_shardings, state_shardings, batch_sharding):
  def train_step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax_accum.apply_updates(params, updates, state), state, loss

  return jax.jit(
    train_step,
    in_shardings=(
      param_shardings,
      state_shardings,
      batch_sharding,
      batch_sharding,
    ),
    out_shardings=(param_shardings, state_shardings, None),
    donate_argnums=(0, 1),
  )


def print_layout(params, state) -> None:
  print(
    f"{'param':22s} {'shape':10s} {'param spec':18s} {'acc_grads spec':18s}"
    " adam mu spec"
  )
  acc = jax.tree_util.tree_leaves_with_path(state.acc_grads)
  mu = jax.tree.leaves(state.inner_state[0].mu)
  for (path, p), (_, a), m in zip(
    jax.tree_util.tree_leaves_with_path(params), acc, mu, strict=True
  ):
    print(
      f"{jax.tree_util.keystr(path):22s} {str(p.shape):10s}"
      f" {str(p.sharding.spec):18s} {str(a.sharding.spec):18s}"
      f" {m.sharding.spec}"
    )


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument("--per-device-batch", type=int, default=2)
  args = parser.parse_args(argv)

  n_dev = jax.device_count()
  # Auto axes: GSPMD propagates the shardings through the step.
  mesh = jax.make_mesh((n_dev,), (AXIS,), axis_types=(AxisType.Auto,))
  host_params = init_params()
  param_shardings = jax.tree.map(
    lambda p: NamedSharding(mesh, fsdp_spec(p.shape, n_dev)), host_params
  )
  params = jax.device_put(host_params, param_shardings)

  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, args.every_k)
  state_shardings = optax_accum.distributed.state_shardings(tx, params)
  state = jax.jit(tx.init, out_shardings=state_shardings)(params)
  print(f"{n_dev} devices, k={args.every_k}")
  print_layout(params, state)

  batch_sharding = NamedSharding(mesh, P(AXIS))
  train_step = make_train_step(
    tx, param_shardings, state_shardings, batch_sharding
  )
  rng = np.random.default_rng(1)
  batch = n_dev * args.per_device_batch
  x = rng.normal(size=(args.steps, args.every_k, batch, DIM))
  y = np.sin(x[..., :OUT])
  x, y = x.astype(np.float32), y.astype(np.float32)
  for s in range(args.steps):
    losses = []
    for i in range(args.every_k):
      params, state, loss = train_step(params, state, x[s, i], y[s, i])
      losses.append(float(loss))
    print(
      f"step {int(state.step)}: mean micro-batch loss {np.mean(losses):.4f}"
    )

  # The accumulator and adam's moments never left their params' layout.
  for a, p in zip(
    jax.tree.leaves(state.acc_grads), jax.tree.leaves(params), strict=True
  ):
    assert a.sharding.is_equivalent_to(p.sharding, p.ndim), (
      a.sharding,
      p.sharding,
    )
  per_device = sum(
    a.addressable_shards[0].data.nbytes
    for a in jax.tree.leaves(state.acc_grads)
  )
  total = sum(a.nbytes for a in jax.tree.leaves(state.acc_grads))
  print(f"accumulator: {per_device} bytes per device of {total} in all")

  # The same steps on one device with the whole batch at once.
  reference = host_params
  ref_state = inner.init(reference)
  for s in range(args.steps):
    grads = jax.grad(loss_fn)(
      reference, x[s].reshape(-1, DIM), y[s].reshape(-1, OUT)
    )
    updates, ref_state = inner.update(grads, ref_state, reference)
    reference = optax.apply_updates(reference, updates)
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
  return {"error": error, "accumulator_bytes_per_device": per_device}


if __name__ == "__main__":
  main()
