"""The whole training loop, as a user measures it: each path the docs
print against the loop the user had (``_loops.py``), examples per second.

For every configuration (params size, dtype, inner optimizer, ``k``) every
loop is built, compiled and warmed up, then timed in interleaved rounds
(the order rotates each round): per round each loop runs the same number
of whole cycles back to back, waited for once at the end (its throughput),
then one more cycle split into its ``k - 1`` micro-steps (dispatched back
to back, waited for once) and its emitting call (alone). Ratios are paired
by round: both loops measured seconds apart. Memory is each loop's
compiled footprint per step, and, apart, the temporary bytes of its
optimizer's ``init`` (``optax.MultiSteps.init`` makes a throwaway
``zeros_like(params)``: a one-off, not a step's cost).

Every number goes to one JSON (``--out``, default
``benchmarks/results/loop.json``): the raw seconds of every round, nothing
derived; ``render.py`` makes every table from it. Presets: ``cpu`` (``make
bench``), ``gpu`` (``benchmarks/gpu.sh``, 7 minutes at most) and
``smoke``; ``--only`` narrows them (fnmatch on ``size:dtype:inner:k``),
``--budget-s`` stops starting configurations when the time is spent.

Usage::

  python benchmarks/bench_loop.py                      # the cpu preset
  python benchmarks/bench_loop.py --preset smoke --out /tmp/loop.json
"""

import argparse
import fnmatch
import gc
import json
import math
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import machine_info
from _loops import INNERS, NEEDS, VARIANTS, Problem, build
from _models import make_problem

import optax_accum

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SCHEMA = "optax_accum.bench_loop/1"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TINY_MB = 0.25  # host-bound: a few 128-wide layers

# preset -> [(sizes MB, dtypes, inners, ks, variants or None for all)]
PRESETS: dict[str, list[tuple]] = {
  "cpu": [
    ([TINY_MB, 64], ["float32"], ["adam"], [1, 2, 4, 8, 16], None),
    (
      [16],
      ["float32", "bfloat16"],
      ["adam", "clip_adamw"],
      [4],
      [
        "readme",
        "readme_bf16_stochastic",
        "bare",
        "static",
        "multisteps",
        "nnx_fast",
        "nnx_fast_multisteps",
        "floor",
      ],
    ),
  ],
  # In order of what a GPU run must not miss (the budget stops starting
  # configurations); at 2 GB only four loops' states fit at once in 80 GB.
  "gpu": [
    ([TINY_MB, 64], ["float32"], ["adam"], [2, 8], None),
    (
      [512],
      ["bfloat16", "float32"],
      ["adam"],
      [8],
      [
        "readme",
        "readme_bf16_stochastic",
        "static",
        "multisteps",
        "nnx_fast",
        "nnx_fast_multisteps",
        "nnx_jit",
        "nnx_jit_multisteps",
        "floor",
      ],
    ),
    (
      [2048],
      ["bfloat16", "float32"],
      ["adam"],
      [8],
      ["readme", "static", "multisteps", "floor"],
    ),
    (
      [512],
      ["bfloat16"],
      ["clip_adamw"],
      [2, 8],
      ["readme", "static", "multisteps", "floor"],
    ),
  ],
  "smoke": [
    ([0.05], ["float32"], ["adam"], [2], None),
  ],
}
PRESET_SETTINGS = {  # rounds, seconds a segment aims at, rows per micro-batch
  "cpu": (5, 0.25, 8),
  "gpu": (5, 0.15, 8),
  "smoke": (2, 0.01, 4),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  p.add_argument("--only", default="*", help="fnmatch on size:dtype:inner:k")
  p.add_argument("--variants", default=None, help="comma-separated subset")
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--segment-s", type=float, default=None)
  p.add_argument("--budget-s", type=float, default=None)
  p.add_argument("--out", default=str(RESULTS / "loop.json"))
  args = p.parse_args(argv)
  rounds, segment_s, rows = PRESET_SETTINGS[args.preset]
  args.rounds = args.rounds or rounds
  args.segment_s = args.segment_s or segment_s
  args.rows = rows
  if args.rounds < 2:
    p.error(f"--rounds must be at least 2 (a spread), got {args.rounds}")
  return args


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
  chosen = set(args.variants.split(",")) if args.variants else None
  unknown = (chosen or set()) - set(VARIANTS)
  if unknown:
    raise SystemExit(f"--variants: unknown {sorted(unknown)}; see _loops.py")
  out = []
  for sizes, dtypes, inners, ks, variants in PRESETS[args.preset]:
    for size in sizes:
      for dtype in dtypes:
        for inner in inners:
          for k in ks:
            key = f"{size}:{dtype}:{inner}:{k}"
            if not fnmatch.fnmatch(key, args.only):
              continue
            names = [v for v in (variants or VARIANTS)]
            if chosen is not None:
              names = [v for v in names if v in chosen]
            out.append(
              dict(size_mb=size, dtype=dtype, inner=inner, k=k, names=names)
            )
  return out


def available(name: str) -> str | None:
  """Why `name` cannot run here (a package missing), or None."""
  package = NEEDS.get(name)
  if package is None:
    return None
  try:
    __import__(package)
  except ImportError:
    return f"{package} is not installed"
  return None


def time_segment(loop: Any, start: int, calls: int) -> float:
  loop.block()
  t = time.perf_counter()
  for i in range(start, start + calls):
    loop.call(i)
  loop.block()
  return time.perf_counter() - t


def time_cycle(loop: Any, start: int, k: int) -> tuple[float | None, float]:
  """(seconds per micro-step, seconds of the emitting call) of one cycle."""
  loop.block()
  t0 = time.perf_counter()
  for i in range(start, start + k - 1):
    loop.call(i)
  loop.block()
  t1 = time.perf_counter()
  loop.call(start + k - 1)
  loop.block()
  t2 = time.perf_counter()
  return ((t1 - t0) / (k - 1) if k > 1 else None), t2 - t1


def run_config(config: dict[str, Any], args: argparse.Namespace) -> dict:
  size, dtype, k = config["size_mb"], config["dtype"], config["k"]
  base = make_problem(size, DTYPES[dtype], args.rows)
  problem = Problem(
    base.params, base.batch, base.loss, INNERS[config["inner"]], k
  )
  skipped = {n: why for n in config["names"] if (why := available(n))}
  names = {n for n in config["names"] if n not in skipped}
  started = time.perf_counter()
  loops = build(problem, names)
  # Warm-up: two cycles each (compiles what lower() did not, fills caches),
  # and how long a cycle takes, to size the segments.
  cycle_s = []
  for loop in loops.values():
    time_segment(loop, 0, k)
    cycle_s.append(time_segment(loop, k, k))
  compile_s = time.perf_counter() - started
  per_cycle = statistics.median(cycle_s)
  cycles = max(1, math.ceil(args.segment_s / max(per_cycle, 1e-9)))
  order = sorted(loops)
  rounds: dict[str, dict[str, list]] = {
    n: {"segment_s": [], "micro_s": [], "emit_s": []} for n in order
  }
  calls = {n: 2 * k for n in order}  # each loop's call count so far
  for r in range(args.rounds):
    shift = r % len(order)
    for name in order[shift:] + order[:shift]:
      loop, done = loops[name], calls[name]
      rounds[name]["segment_s"].append(time_segment(loop, done, cycles * k))
      micro, emit = time_cycle(loop, done + cycles * k, k)
      rounds[name]["micro_s"].append(micro)
      rounds[name]["emit_s"].append(emit)
      calls[name] = done + (cycles + 1) * k
  variants = {
    n: {
      **rounds[n],
      "footprint": loops[n].memory,
      "init_temp": loops[n].init,
    }
    for n in order
  }
  checked = _check_steps(loops, calls, k)
  del loops
  gc.collect()
  return {
    "size_mb": size,
    "dtype": dtype,
    "inner": config["inner"],
    "k": k,
    "rows": problem.rows,
    "param_bytes": sum(x.nbytes for x in jax.tree.leaves(base.params)),
    "cycles_per_segment": cycles,
    "warmup_and_compile_s": round(compile_s, 3),
    "variants": variants,
    "optimizer_steps": checked,
    "skipped": skipped,
  }


def _check_steps(loops: dict[str, Any], calls: dict[str, int], k: int) -> dict:
  """Each loop made one optimizer step per k calls: what was timed is a
  training loop, not a no-op."""
  kinds = (optax_accum.AccumulateState, optax.MultiStepsState)

  def is_state(x: Any) -> bool:
    return isinstance(x, kinds)

  out = {}
  for name, loop in loops.items():
    tree = getattr(loop, "optimizer", None)
    tree = loop.values if tree is None else tree.opt_state
    found = [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]
    if not found:  # the references
      continue
    state = found[0]
    steps = getattr(state, "gradient_step", None)
    steps = int(jnp.asarray(state.step if steps is None else steps))
    if steps != calls[name] // k:
      raise RuntimeError(
        f"{name}: {steps} optimizer steps after {calls[name]} calls, k={k}"
      )
    out[name] = steps
  return out


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  configs = configurations(args)
  if not configs:  # a run that measures nothing must not look like one
    print(
      f"no configuration of --preset {args.preset} matches --only"
      f" {args.only!r} (size:dtype:inner:k, e.g. '0.25:float32:adam:4')",
      file=sys.stderr,
    )
    return 2
  payload: dict[str, Any] = {
    "schema": SCHEMA,
    "machine": machine_info(),
    "args": {k: v for k, v in vars(args).items()},
    "configs": [],
    "failed": [],
    "not_run": [],
  }
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  for i, config in enumerate(configs):
    key = (
      f"{config['size_mb']}:{config['dtype']}:{config['inner']}:{config['k']}"
    )
    left = (
      None
      if args.budget_s is None
      else args.budget_s - (time.perf_counter() - start)
    )
    if left is not None and left <= 0:
      payload["not_run"] = [
        f"{c['size_mb']}:{c['dtype']}:{c['inner']}:{c['k']}"
        for c in configs[i:]
      ]
      print(f"budget spent: {len(configs) - i} configurations not run")
      break
    print(f"[{i + 1}/{len(configs)}] {key}", flush=True)
    try:
      payload["configs"].append(run_config(config, args))
    except Exception as exc:  # noqa: BLE001  (recorded; the run goes on)
      payload["failed"].append(
        {
          "config": key,
          "error": "".join(traceback.format_exception(exc))[-2000:],
        }
      )
      print(f"  failed: {exc!r}", file=sys.stderr)
    payload["elapsed_s"] = round(time.perf_counter() - start, 1)
    out.write_text(json.dumps(payload, indent=1))  # a run cut short keeps it
  print(f"wrote {out} ({payload['elapsed_s']} s)")
  return 1 if payload["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
