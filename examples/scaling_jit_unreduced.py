"""One all-reduce per optimizer step under plain ``jax.jit``: unreduced grads.

Data parallelism with ``jax.jit`` on a mesh whose ``data`` axis is
``AxisType.Explicit``, no ``shard_map`` in sight. Each micro-step computes
every device's local gradient with :func:`optax_accum.distributed.local_value_and_grad`,
typed unreduced over ``data`` (no communication), and hands it to
``optax_accum.accumulate(adam, k, axis_name="data")``, whose accumulator
stays unreduced in the optimizer state across jitted calls. The call that
ends a cycle of ``k`` micro-batches sums the accumulator over the devices
once, inside the branch that runs adam on the token-weighted mean.

The example checks itself against one big batch on one device and prints
the collectives of the compiled step: those every call pays, and those only
emitting calls pay::

  python examples/scaling_jit_unreduced.py [--steps 3] [--every-k 4]
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
# Run and check.
# ---------------------------------------------------------------------------


def run(steps: int, every_k: int, micro_batch: int, lr: float) -> float:
  """Trains `steps` optimizer steps both ways; returns the max param diff."""
  n = jax.device_count()
  mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
  inner = optax.adam(lr)
  tx = optax_accum.accumulate(inner, every_k, axis_name=AXIS)
  # Host copies: the device params are donated to the step.
  params0 = jax.tree.map(np.asarray, init_params(jax.random.key(0)))
  batches = [
    make_batch(jax.random.key(i + 1), micro_batch)
    for i in range(steps * every_k)
  ]
  # Each device's gradient, typed unreduced over AXIS, and the micro-batch's
  # global token count as its weight.
  grad_fn = optax_accum.distributed.local_value_and_grad(
    token_loss, axis_name=AXIS, has_weight=True
  )

  def micro_step(params, state, batch):
    (_, tokens), grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params, weight=tokens)
    return optax_accum.apply_updates(params, updates, state), state

  with jax.set_mesh(mesh):
    params = jax.device_put(params0, NamedSharding(mesh, P()))
    state = tx.init(params)  # accumulators typed unreduced over AXIS
    step = jax.jit(micro_step, donate_argnums=(0, 1))
    sharded = [jax.device_put(b, NamedSharding(mesh, P(AXIS))) for b in batches]
    compiled = step.lower(params, state, sharded[0]).compile()
    for batch in sharded:  # the state is carried (and donated) across calls
      params, state = step(params, state, batch)
    print("accumulator:", jax.typeof(state.acc_grads["w"]))

  ops = optax_accum.inspect.collectives(compiled)
  param_bytes = sum(4 * p.size for p in jax.tree.leaves(params0))
  print(f"{n} devices, k={every_k}, params {param_bytes} bytes")
  print(optax_accum.inspect.format_collectives(ops))
  every_call = [o for o in ops if o.opcode == "all-reduce" and o.unconditional]
  emitting = [o for o in ops if o.opcode == "all-reduce" and o.emitting]
  print(
    f"all-reduces per micro-step: {len(every_call)}"
    f" ({sum(o.bytes for o in every_call)} bytes);"
    f" extra on the emitting step: {len(emitting)}"
    f" ({sum(o.bytes for o in emitting)} bytes)"
  )
  # Raises if a reduction of >= 1 KiB runs outside the emitting branch.
  optax_accum.inspect.assert_reduction_deferred(compiled)

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
  print(f"max |params - big-batch reference| after {steps} steps: {diff:.2e}")
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
