"""Cross-device communication per optimizer step: reduce every micro-batch, or once.

Data-parallel training of an MLP on ``--devices`` simulated host devices
(one mesh axis ``data``, params replicated, each device its own slice of
every micro-batch), ``k`` micro-batches per optimizer step, four recipes:

* ``gspmd``: ``jit`` with the batch sharded over ``data`` and
  ``optax_accum.accumulate(inner, k)``; XLA all-reduces every micro-batch
  gradient (the usual data-parallel step);
* ``psum_each``: ``shard_map``, ``lax.pmean`` of each micro-batch gradient,
  then ``accumulate(inner, k)``: the same traffic, written by hand;
* ``axis_name``: ``shard_map``, each device's local gradient into
  ``accumulate(inner, k, axis_name="data")``: one reduction per step, in the
  conditional branch that emits the update;
* ``jit_unreduced``: plain ``jit`` on a mesh whose ``data`` axis is
  ``AxisType.Explicit``; ``optax_accum.distributed.local_value_and_grad`` gives each
  device's gradient typed unreduced over ``data`` and the same
  ``accumulate(inner, k, axis_name="data")`` reduces once per step, in the
  emitting branch. The helper also all-reduces the loss and the token
  count (8 bytes) every call: the all-reduces under 1 KiB are counted apart.

Bytes come from the compiled micro-step, read by
``optax_accum.inspect.collectives``: each all-reduce's payload (bytes
per device) counts ``k`` times per optimizer step when it runs on every
call, once when it sits in the emitting branch of a conditional, and
``k - 1`` times in the branch that holds. A ring all-reduce moves about
``2 (n - 1) / n`` times the payload per device.

Time is one optimizer step (``k`` micro-step calls, params and state donated,
``block_until_ready`` at the end) after warm-up; the recipes take turns in
every round (the first rotates); each repeat gives a median over its rounds
and the report shows the median over repeats with their min-max. All
recipes compute the same update; the script checks that their params agree.

On simulated CPU devices an all-reduce is a memory copy inside one process,
so times say little about a real interconnect: the bytes are the portable
result.

Then, with params sharded (``benchmarks/_comm_sharded.py``): FSDP reducing
every call, 1-D FSDP deferred and HSDP deferred, float32 and bfloat16 on
the wire, bytes per optimizer step per mesh axis, compiled for
``--sharded-targets`` (8 simulated CPU devices, and without the devices 8
H100s and a TPU v5e 2x4 when the accelerator compilers are on the path, as
``make bench`` puts them; nothing timed).

Usage::

  python benchmarks/bench_comm.py                 # a few minutes
  JAX_PLATFORMS=cpu PYTHONPATH=.venv/accel python benchmarks/bench_comm.py
  python benchmarks/bench_comm.py --width 2048 --ks 1,4,16,64

It writes ``bench_comm.json``; its tables are ``render.py``'s.
"""

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import _comm_sharded
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
  add_run_arguments,
  csv_list,
  int_list,
  interleaved,
  machine_info,
  median,
  set_cpu_devices,
  spread,
  timed_call,
  tree_bytes,
  write_json,
)
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.inspect import collectives

RECIPES = ("gspmd", "psum_each", "axis_name", "jit_unreduced")
BASELINE = "psum_each"

# ----------------------------------------------------------------------------
# The problem: an MLP, data parallel over one mesh axis.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
  mesh: jax.sharding.Mesh  # AxisType.Auto
  params: dict[str, np.ndarray]  # on the host: each recipe gets a copy
  micro_batches: list[tuple[jax.Array, jax.Array]]  # sharded over "data"
  width: int
  explicit_mesh: jax.sharding.Mesh  # the same devices, AxisType.Explicit

  def for_recipe(self, recipe: str) -> tuple[Any, list]:
    """The mesh and micro-batches `recipe` runs on."""
    if recipe != "jit_unreduced":
      return self.mesh, self.micro_batches
    sharding = NamedSharding(self.explicit_mesh, P("data"))
    return self.explicit_mesh, [
      jax.device_put(b, sharding) for b in self.micro_batches
    ]


def make_problem(width: int, per_device_batch: int, count: int) -> Problem:
  """Params of a 2-layer MLP and `count` micro-batches."""
  mesh = jax.make_mesh(
    (jax.device_count(),), ("data",), axis_types=(AxisType.Auto,)
  )
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = jax.device_get(
    {
      "w1": jax.random.normal(k1, (width, width)) / np.sqrt(width),
      "b1": jnp.zeros(width),
      "w2": jax.random.normal(k2, (width, width)) / np.sqrt(width),
      "b2": jnp.zeros(width),
    }
  )
  rng = np.random.default_rng(0)
  rows = per_device_batch * jax.device_count()
  micro = [
    jax.device_put(
      tuple(
        rng.normal(size=(rows, width)).astype(np.float32) for _ in range(2)
      ),
      NamedSharding(mesh, P("data")),
    )
    for _ in range(count)
  ]
  explicit = jax.make_mesh(
    (jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,)
  )
  return Problem(mesh, params, micro, width, explicit)


def loss(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"][None])
  return jnp.mean((h @ params["w2"] + params["b2"][None] - y) ** 2)


# SGD with momentum: linear in the gradient, so the recipes' params can be
# compared tightly at the end (adam's normalisation would hide errors).
def make_inner() -> optax.GradientTransformation:
  return optax.sgd(1e-2, momentum=0.9)


# ----------------------------------------------------------------------------
# The recipes: (jitted micro-step, params, state).
# ----------------------------------------------------------------------------


def make_recipe(recipe: str, k: int, problem: Problem):
  """The jitted micro-step of `recipe`, with fresh params and state."""
  mesh, inner = problem.for_recipe(recipe)[0], make_inner()
  params = jax.device_put(problem.params, NamedSharding(mesh, P()))
  if recipe == "jit_unreduced":
    tx = optax_accum.accumulate(inner, k, axis_name="data")
    grad_fn = optax_accum.distributed.local_value_and_grad(loss)

    def unreduced_step(params, state, x, y):
      _, grads = grad_fn(params, x, y)  # typed unreduced over "data"
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
      state = tx.init(params)  # accumulators typed unreduced over "data"
    return jax.jit(unreduced_step, donate_argnums=(0, 1)), params, state

  if recipe == "gspmd":
    tx = optax_accum.accumulate(inner, k)

    def gspmd_step(params, state, x, y):
      updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
      return optax.apply_updates(params, updates), state

    state = jax.jit(
      tx.init, out_shardings=optax_accum.distributed.state_shardings(tx, params)
    )(params)
    return jax.jit(gspmd_step, donate_argnums=(0, 1)), params, state

  deferred = recipe == "axis_name"
  tx = optax_accum.accumulate(inner, k, axis_name="data" if deferred else None)
  if deferred:
    # The library owns the layout: the running sums are each device's own.
    specs = optax_accum.distributed.shard_map_specs(
      jax.eval_shape(tx.init, params), "data"
    )
    to_local, to_global = (
      optax_accum.distributed.drop_device_axis,
      optax_accum.distributed.add_device_axis,
    )
  else:
    # A gradient reduced every micro-batch: the whole state is the same on
    # every device, replicated.
    specs, to_local, to_global = P(), (lambda s: s), (lambda s: s)

  def local_step(params, state, x, y):
    # Varying params: jax.grad returns the local gradient instead of
    # all-reducing it itself on every micro-batch.
    grad = jax.grad(loss)(lax.pcast(params, "data", to="varying"), x, y)
    if not deferred:
      grad = lax.pmean(grad, "data")
    updates, state = tx.update(grad, to_local(state), params)
    return optax.apply_updates(params, updates), to_global(state)

  init = jax.jit(
    jax.shard_map(
      lambda p: to_global(tx.init(p)), mesh=mesh, in_specs=P(), out_specs=specs
    )
  )
  step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(P(), specs, P("data"), P("data")),
      out_specs=(P(), specs),
    ),
    donate_argnums=(0, 1),
  )
  return step, params, init(params)


# ----------------------------------------------------------------------------
# Measuring.
# ----------------------------------------------------------------------------


# All-reduces below this payload are scalars (a loss, a token count, a
# finiteness flag), not gradients: counted apart.
SMALL_BYTES = 1024


def traffic(compiled: Any, k: int) -> dict[str, int]:
  """All-reduce ops and payload bytes per optimizer step of `k` calls."""
  places = ("always", "emitting", "holding")
  out = dict.fromkeys(
    [f"{w}_{what}" for w in places for what in ("ops", "bytes", "small_ops")]
    + ["other_collective_ops"],
    0,
  )
  for c in collectives(compiled):
    if c.opcode != "all-reduce":
      out["other_collective_ops"] += 1
      continue
    where = (
      "always" if c.unconditional else "emitting" if c.emitting else "holding"
    )
    out[f"{where}_ops"] += 1
    out[f"{where}_bytes"] += c.bytes
    out[f"{where}_small_ops"] += c.bytes < SMALL_BYTES
  calls = {"always": k, "emitting": 1, "holding": k - 1}
  for total in ("ops", "bytes", "small_ops"):
    out[f"{total}_per_step"] = sum(
      n * out[f"{w}_{total}"] for w, n in calls.items()
    )
  return out


def op_count(row: dict[str, Any]) -> str:
  """All-reduces per step, those under 1 KiB apart: "1 + 16 tiny"."""
  small = row.get("small_ops_per_step", 0)
  large = row["ops_per_step"] - small
  return f"{large} + {small} tiny" if small else str(large)


def measure_k(
  k: int, problem: Problem, args: argparse.Namespace, advance: Callable
) -> list[dict[str, Any]]:
  """Traffic and step time of every recipe at `k` micro-batches a step."""
  runs, rows, batches = {}, {}, {}
  for recipe in RECIPES:
    mesh, batches[recipe] = problem.for_recipe(recipe)
    step, params, state = make_recipe(recipe, k, problem)
    with jax.set_mesh(mesh):
      compiled = step.lower(params, state, *batches[recipe][0]).compile()
    rows[recipe] = {"recipe": recipe, "k": k, **traffic(compiled, k)}
    rows[recipe]["ops_label"] = op_count(rows[recipe])
    runs[recipe] = [compiled, params, state]
    advance()

  def turn(recipe):
    def one_step(_):
      compiled, params, state = runs[recipe]
      seconds = 0.0
      for x, y in batches[recipe][:k]:
        t, (params, state) = timed_call(compiled, params, state, x, y)
        seconds += t
      runs[recipe][1:] = [params, state]
      return seconds

    return one_step

  repeats = []
  for _ in range(args.repeats):
    times = interleaved(
      {recipe: turn(recipe) for recipe in RECIPES},
      rounds=args.rounds,
      warmup=args.warmup,
      advance=advance,
    )
    repeats.append({recipe: median(times[recipe]) for recipe in RECIPES})

  # Same data, same maths: the recipes must reach the same params.
  finals = [jax.device_get(runs[recipe][1]) for recipe in RECIPES]
  for other in finals[1:]:
    for a, b in zip(
      jax.tree.leaves(finals[0]), jax.tree.leaves(other), strict=True
    ):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

  base = rows[BASELINE]
  for recipe, row in rows.items():
    row["step_ms"] = spread([1e3 * r[recipe] for r in repeats])
    row["time_ratio_vs_baseline"] = spread(
      [r[recipe] / r[BASELINE] for r in repeats]
    )
    row["bytes_ratio_vs_baseline"] = (
      row["bytes_per_step"] / base["bytes_per_step"]
      if base["bytes_per_step"]
      else None
    )
  return [rows[recipe] for recipe in RECIPES]


# ----------------------------------------------------------------------------
# Entry point.
# ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--devices", type=int, default=8, help="simulated host devices"
  )
  parser.add_argument(
    "--ks",
    type=int_list,
    default=[1, 4, 16],
    help="micro-batches per optimizer step, comma-separated (default 1,4,16)",
  )
  parser.add_argument(
    "--width",
    type=int,
    default=512,
    help="MLP width: params = 2 * width^2 + 2 * width floats (default 512)",
  )
  parser.add_argument(
    "--per-device-batch",
    type=int,
    default=8,
    help="examples per device per micro-batch (default 8)",
  )
  parser.add_argument(
    "--sharded-targets",
    default="cpu,h100x8,v5e_2x4",
    type=csv_list(),
    help="targets of the sharded-params table (default cpu,h100x8,v5e_2x4;"
    " empty: none)",
  )
  parser.add_argument(
    "--sharded-width",
    type=int,
    default=1024,
    help="width of the 4 square layers of the sharded table (default 1024)",
  )
  add_run_arguments(parser, rounds=3, warmup=1, repeats=3)
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  set_cpu_devices(args.devices)  # before anything touches a device
  problem = make_problem(args.width, args.per_device_batch, max(args.ks))
  results = []
  for k in args.ks:
    print(f"k={k}", flush=True)
    results += measure_k(k, problem, args, lambda: None)
  sharded, skipped = _comm_sharded.rows(
    args.sharded_targets, args.ks, args.sharded_width
  )
  payload = {
    "benchmark": "bench_comm",
    "machine": machine_info(),
    "args": vars(args),
    "config": {
      "devices": jax.device_count(),
      "param_bytes": tree_bytes(problem.params),
    },
    "results": results,
    "sharded": sharded,
    "sharded_skipped": skipped,
  }
  print(f"wrote {write_json(args.out, 'bench_comm', payload)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
