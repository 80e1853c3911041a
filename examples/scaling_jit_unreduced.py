"""One all-reduce per optimizer step under plain ``jax.jit``: unreduced grads.

Data parallelism with ``jax.jit`` on a mesh whose ``data`` axis is
``AxisType.Explicit``. Each micro-step computes every device's local
gradient with :func:`optax_accum._unreduced.local_value_and_grad`, typed
unreduced over ``data`` (no communication), and adds it to an accumulator
that stays unreduced in the optimizer state across jitted calls. The call
that ends a cycle of ``k`` micro-batches sums the accumulator over the
devices once (``jax.reshard``) inside the emitting branch of a ``lax.cond``
and runs adam on the token-weighted mean.

The accumulation loop here is a prototype of what ``accumulate(inner, k,
axis_name="data")`` will do under plain ``jit``; the example checks itself
against one big batch on one device and prints the collectives of the
compiled step: those every call pays, and those only emitting calls pay::

  python examples/scaling_jit_unreduced.py [--steps 3] [--every-k 4]
"""

import os

# Before JAX starts: 8 simulated devices unless the caller chose a count.
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from optax_accum import _collectives, _unreduced  # noqa: E402

AXIS = "data"
VOCAB, DIM, OUT, SEQ = 32, 16, 4, 6


# ---------------------------------------------------------------------------
# Model: embedding, layer norm, dense layer with a bias; a padded token loss.
# ---------------------------------------------------------------------------


def init_params(key: jax.Array) -> dict:
  k = jax.random.split(key, 3)
  return {
    "emb": jax.random.normal(k[0], (VOCAB, DIM)),
    "ln_scale": jnp.ones((DIM,)),
    "ln_bias": jnp.zeros((DIM,)),
    "w": 0.3 * jax.random.normal(k[1], (DIM, OUT)),
    "b": 0.1 * jax.random.normal(k[2], (OUT,)),
  }


def token_loss(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Mean loss over the batch's real tokens, and their number."""
  x = params["emb"][batch["tok"]]
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  x = (x - mu) / jnp.sqrt(var + 1e-5) * params["ln_scale"][None, None]
  x = x + params["ln_bias"][None, None]
  y = jnp.tanh(x @ params["w"] + params["b"][None, None])
  per_token = ((y - batch["tgt"]) ** 2).sum(-1)
  count = batch["mask"].sum()
  return (per_token * batch["mask"]).sum() / count, count


def make_batch(key: jax.Array, size: int) -> dict:
  k = jax.random.split(key, 3)
  return {
    "tok": jax.random.randint(k[0], (size, SEQ), 0, VOCAB),
    "tgt": jax.random.normal(k[1], (size, SEQ, OUT)),
    # Uneven padding: micro-batches and devices hold different token counts.
    "mask": (jax.random.uniform(k[2], (size, SEQ)) > 0.4).astype(jnp.float32),
  }


# ---------------------------------------------------------------------------
# Prototype of the accumulation loop (to be replaced by `accumulate`).
# ---------------------------------------------------------------------------


class ProtoState(NamedTuple):
  micro_step: jax.Array  # int32[]
  acc_grads: Any  # like params, unreduced over AXIS
  acc_weight: jax.Array  # float32[], global tokens this cycle
  inner_state: Any


def proto_init(inner: optax.GradientTransformation, params: Any) -> ProtoState:
  return ProtoState(
    micro_step=jnp.zeros([], jnp.int32),
    acc_grads=jax.tree.map(_unreduced.unreduced_zeros_like, params),
    acc_weight=jnp.zeros([], jnp.float32),
    inner_state=inner.init(params),
  )


def proto_update(inner, every_k, grads, state, params, weight):
  """Adds `weight * grads` (unreduced); every `every_k` calls, reduces once
  and runs `inner` on the weighted mean."""
  _unreduced.check_unreduced(grads, AXIS)
  fresh = state.micro_step == 0
  # Lazy reset as a select between unreduced arrays (no eager zeroing).
  acc = jax.tree.map(
    lambda a, g: (
      _unreduced.where(fresh, jnp.zeros_like(a), a)
      + _unreduced.scale(g, weight)
    ),
    state.acc_grads,
    grads,
  )
  total = jnp.where(fresh, 0.0, state.acc_weight) + weight
  micro_step = state.micro_step + 1
  emit = micro_step >= every_k

  def run_inner(acc, total, inner_state, params):
    summed = _unreduced.reduce(acc, AXIS)  # the one all-reduce
    mean = jax.tree.map(lambda s: s * (1.0 / total), summed)
    return inner.update(mean, inner_state, params)

  def hold(acc, total, inner_state, params):
    return jax.tree.map(jnp.zeros_like, params), inner_state

  updates, inner_state = lax.cond(
    emit, run_inner, hold, acc, total, state.inner_state, params
  )
  new_state = ProtoState(
    micro_step=jnp.where(emit, 0, micro_step),
    acc_grads=acc,
    acc_weight=total,
    inner_state=inner_state,
  )
  return updates, new_state


# ---------------------------------------------------------------------------
# Run and check.
# ---------------------------------------------------------------------------


def run(steps: int, every_k: int, micro_batch: int, lr: float) -> float:
  """Trains `steps` optimizer steps both ways; returns the max param diff."""
  n = jax.device_count()
  mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
  inner = optax.adam(lr)
  # Host copies: the device params are donated to the step.
  params0 = jax.tree.map(np.asarray, init_params(jax.random.key(0)))
  batches = [
    make_batch(jax.random.key(i + 1), micro_batch)
    for i in range(steps * every_k)
  ]
  grad_fn = _unreduced.local_value_and_grad(token_loss, has_weight=True)

  def micro_step(params, state, batch):
    (_, weight), grads = grad_fn(params, batch)
    updates, state = proto_update(inner, every_k, grads, state, params, weight)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    params = jax.device_put(params0, NamedSharding(mesh, P()))
    state = jax.jit(proto_init, static_argnums=0)(inner, params)
    step = jax.jit(micro_step, donate_argnums=(0, 1))
    sharded = [jax.device_put(b, NamedSharding(mesh, P(AXIS))) for b in batches]
    compiled = step.lower(params, state, sharded[0]).compile()
    for batch in sharded:  # the state is carried (and donated) across calls
      params, state = step(params, state, batch)
    print("accumulator:", jax.typeof(state.acc_grads["w"]))

  ops = _collectives.collectives(compiled)
  param_bytes = sum(4 * p.size for p in jax.tree.leaves(params0))
  print(f"{n} devices, k={every_k}, params {param_bytes} bytes")
  print(_collectives.format_collectives(ops))
  every_call = [o for o in ops if o.opcode == "all-reduce" and o.unconditional]
  emitting = [o for o in ops if o.opcode == "all-reduce" and o.emitting]
  print(
    f"all-reduces per micro-step: {len(every_call)}"
    f" ({sum(o.bytes for o in every_call)} bytes);"
    f" extra on the emitting step: {len(emitting)}"
    f" ({sum(o.bytes for o in emitting)} bytes)"
  )
  # Raises if a reduction of >= 1 KiB runs outside the emitting branch.
  _collectives.assert_reduction_deferred(compiled)

  # Reference: one big batch of every_k micro-batches per step, one device.
  ref_params, ref_state = params0, inner.init(params0)
  for s in range(steps):
    big = jax.tree.map(
      lambda *xs: jnp.concatenate(xs),
      *batches[s * every_k : (s + 1) * every_k],
    )
    grads = jax.grad(lambda p, b: token_loss(p, b)[0])(ref_params, big)
    updates, ref_state = inner.update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
  diff = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(
      jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True
    )
  )
  print(f"max |params - big batch| after {steps} steps: {diff:.2e}")
  if not diff < 1e-5:
    raise SystemExit(f"mismatch with the big batch: {diff}")
  return diff


def main(argv: Sequence[str] | None = None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
  parser.add_argument("--every-k", type=int, default=4, help="micro-batches")
  parser.add_argument(
    "--micro-batch", type=int, default=16, help="examples per micro-batch"
  )
  parser.add_argument("--lr", type=float, default=1e-2, help="adam rate")
  args = parser.parse_args(argv)
  return run(args.steps, args.every_k, args.micro_batch, args.lr)


if __name__ == "__main__":
  main()
