"""HSDP: params sharded within a replica, the gradient reduced across
replicas once per optimizer step.

A ``("replica", "fsdp")`` mesh whose axes are ``AxisType.Explicit``: the
params are sharded over ``"fsdp"`` (inside a slice or host, the fast links)
and replicated over ``"replica"`` (across slices or hosts, the slow ones).
:func:`optax_accum.distributed.local_value_and_grad` with ``axis_name="replica"``
returns each micro-batch's gradient reduce-scattered over ``"fsdp"`` (what
FSDP does anyway) and unreduced over ``"replica"``;
``optax_accum.accumulate(adam, k, axis_name="replica")`` holds one shard of
it per device and all-reduces the shards across the replicas once, in the
call that ends the cycle.

The example trains a small token-weighted MLP, prints the accumulator's
type and bytes per device and every collective of the compiled step with
the mesh axes it spans, checks that no reduction across ``"replica"`` runs
outside the emitting branch, and checks the params against one big batch
on one device::

  python examples/scaling_hsdp.py [--steps 2] [--every-k 4] [--replicas 2]
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

DIM, HIDDEN, OUT = 16, 32, 4
# Sharded over "fsdp" on their first axis; the bias is small: replicated.
SPECS = {"w1": P("fsdp", None), "w2": P("fsdp", None), "b1": P()}


def init_params(key: jax.Array) -> dict:
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (DIM, HIDDEN)) / DIM**0.5,
    "b1": jnp.zeros((HIDDEN,)),
    "w2": jax.random.normal(k2, (HIDDEN, OUT)) / HIDDEN**0.5,
  }


def gathered(params: dict) -> dict:
  """FSDP's all-gather of each param where it is used (explicit sharding:
  written out; nothing to do off the mesh)."""
  if jax.sharding.get_abstract_mesh().empty:
    return params
  return jax.tree.map(lambda p: jax.sharding.reshard(p, P()), params)


def token_loss(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Mean squared error over the rows the mask keeps, and their number."""
  p = gathered(params)
  h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"][None])
  err = jnp.sum((h @ p["w2"] - batch["y"]) ** 2, axis=-1)
  tokens = batch["mask"].sum()
  return jnp.sum(err * batch["mask"]) / jnp.maximum(tokens, 1.0), tokens


def make_batch(key: jax.Array, rows: int) -> dict:
  k = jax.random.split(key, 3)
  return {
    "x": jax.random.normal(k[0], (rows, DIM)),
    "y": jax.random.normal(k[1], (rows, OUT)),
    "mask": (jax.random.uniform(k[2], (rows,)) > 0.3).astype(jnp.float32),
  }


def axes_of(op: optax_accum.inspect.Collective, mesh: jax.sharding.Mesh) -> str:
  """The mesh axes a collective's device groups span (jit's device ids are
  positions in mesh.devices.flat)."""
  shape = mesh.devices.shape
  spanned = set()
  for group in op.replica_groups or ():
    coords = [np.unravel_index(i, shape) for i in group]
    spanned |= {a for a in range(len(shape)) if len({c[a] for c in coords}) > 1}
  return " + ".join(mesh.axis_names[a] for a in sorted(spanned)) or "-"


def run(steps: int, every_k: int, replicas: int, lr: float) -> float:
  n = jax.device_count()
  mesh = jax.make_mesh(
    (replicas, n // replicas),
    ("replica", "fsdp"),
    axis_types=(AxisType.Explicit,) * 2,
  )
  inner = optax.adam(lr)
  tx = optax_accum.accumulate(inner, every_k, axis_name="replica")
  grad_fn = optax_accum.distributed.local_value_and_grad(
    token_loss, axis_name="replica", has_weight=True
  )

  def micro_step(params, state, batch):
    (_, tokens), grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params, weight=tokens)
    return optax_accum.apply_updates(params, updates, state), state

  params0 = jax.tree.map(np.asarray, init_params(jax.random.key(0)))
  batches = [
    make_batch(jax.random.key(i + 1), 2 * n) for i in range(steps * every_k)
  ]
  with jax.set_mesh(mesh):
    params = {
      k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
      for k, v in params0.items()
    }
    state = tx.init(params)  # one fsdp shard per device, unreduced over replica
    acc = state.acc_grads["w1"]
    print(
      f"{mesh.devices.shape} mesh {mesh.axis_names}; accumulator of w1:"
      f" {jax.typeof(acc)}, {acc.addressable_shards[0].data.nbytes} of"
      f" {params0['w1'].nbytes} bytes per device"
    )
    step = jax.jit(micro_step, donate_argnums=(0, 1))
    by_rows = NamedSharding(mesh, P(("replica", "fsdp")))
    sharded = [jax.device_put(b, by_rows) for b in batches]
    compiled = step.lower(params, state, sharded[0]).compile()
    for batch in sharded:
      params, state = step(params, state, batch)

  print("collectives of one call (bytes per device, mesh axes spanned):")
  for op in optax_accum.inspect.collectives(compiled):
    where = (
      "every call"
      if op.unconditional
      else "emitting"
      if op.emitting
      else "other"
    )
    print(f"  {op.opcode:15s} {op.bytes:7d}  {where:10s}  {axes_of(op, mesh)}")
  # Raises if a reduction across "replica" of >= 64 bytes (the smallest
  # gradient shard here) runs outside the emitting branch.
  optax_accum.inspect.assert_reduction_deferred(
    compiled, axis_name="replica", mesh=mesh, min_bytes=64
  )

  ref, ref_state = params0, inner.init(params0)
  for s in range(steps):
    big = jax.tree.map(
      lambda *xs: jnp.concatenate(xs), *batches[s * every_k : (s + 1) * every_k]
    )
    grads = jax.grad(lambda p, b: token_loss(p, b)[0])(ref, big)
    updates, ref_state = inner.update(grads, ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  diff = max(
    float(np.max(np.abs(np.asarray(params[k]) - np.asarray(ref[k]))))
    for k in ref
  )
  print(f"max |params - big-batch reference| after {steps} steps: {diff:.2e}")
  if not diff < 1e-5:
    raise SystemExit(f"mismatch with the big batch: {diff}")
  return diff


def main(argv: Sequence[str] | None = None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
  parser.add_argument("--every-k", type=int, default=4, help="micro-batches")
  parser.add_argument(
    "--replicas", type=int, default=2, help="replica axis size"
  )
  parser.add_argument("--lr", type=float, default=1e-2, help="adam rate")
  args = parser.parse_args(argv)
  if jax.device_count() % args.replicas:
    parser.error(
      f"--replicas must divide the {jax.device_count()} devices; got"
      f" {args.replicas}"
    )
  return run(args.steps, args.every_k, args.replicas, args.lr)


if __name__ == "__main__":
  main()
