"""Cost of one training step with gradient accumulation: time and memory.

For each configuration (inner optimizer, param dtype, model size, ``k``)
this jits ``grad -> tx.update -> optax.apply_updates``, params and state
donated, for the ``tx`` of each variant in ``VARIANTS``; times every call
on its own, variants interleaved in every round (`turn`); reads the
compiled step's memory (footprint = argument + temp + output - alias
bytes); and checks the ratios of ``TARGETS``, all measured in the same
process (`ratios`). The last call of a cycle is the emitting step, the
others are micro-steps.

Usage::

  python benchmarks/bench_step.py            # default subset, a few minutes
  python benchmarks/bench_step.py --full     # 1 MB .. 256 MB of params
"""

import argparse
import itertools
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from _common import (
  Carry,
  Run,
  Target,
  add_run_arguments,
  benchmark_parser,
  check_targets,
  compiled_memory,
  csv_list,
  describe_targets,
  int_list,
  median,
  median_tree,
  spread_tree,
  train_step,
  tree_bytes,
)
from _models import make_problem
from _report import step_console, step_figure, step_markdown
from _static import LEARNING_RATE, Static, prepare_floor

import optax_accum

MIN_CALLS_PER_ROUND = 4
DEFAULT_SIZES_MB = (1.0, 16.0)
FULL_SIZES_MB = (1.0, 4.0, 16.0, 64.0, 256.0)

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
  "adam": lambda: optax.adam(LEARNING_RATE),
  "clip_adamw": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(LEARNING_RATE)
  ),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

TARGETS = {
  "micro_vs_floor": Target(
    "micro/floor",
    "accumulate micro-step (optax_accum.apply_updates) / floor micro-step",
    "<=",
    1.3,
  ),
  "static_micro_vs_floor": Target(
    "static/floor",
    "static-cycle micro-step (emit=False) / floor micro-step",
    "<=",
    1.1,
  ),
  "emit_vs_plain": Target(
    "emit/plain", "accumulate emitting step / plain inner step", "<=", 1.3
  ),
  # The accumulator's bytes are the param bytes for float32 params.
  "extra_memory": Target(
    "extra mem/acc",
    "(accumulate - plain footprint) / accumulator bytes",
    "<=",
    1.05,
  ),
  "multisteps_speedup": Target(
    "MS/acc micro",
    "MultiSteps micro-step / accumulate micro-step (optax_accum.apply_updates)",
    ">=",
    2.0,
  ),
  "memory_vs_multisteps": Target(
    "mem acc/MS", "accumulate footprint / MultiSteps footprint", "<=", 1.0
  ),
  "noise_micro_vs_floor": Target(
    "noise micro/floor",
    "accumulate+noise micro-step / floor micro-step",
    "<=",
    1.3,
  ),
}


# --- The variants: prepare(inner, k) -> the transformation of the step. ---


def prepare_plain(inner, k: int) -> optax.GradientTransformation:
  """The inner optimizer alone, on every call."""
  del k
  return inner()


def prepare_accumulate(inner, k: int) -> optax.GradientTransformation:
  """``optax_accum.accumulate(inner, k)``; ``+apply``: the updates applied
  with ``optax_accum.apply_updates``; ``+static``: that, and ``emit=``
  from the host (`Static`)."""
  return optax_accum.accumulate(inner(), k)


def prepare_noise(inner, k: int) -> optax.GradientTransformation:
  """``optax_accum.accumulate(inner, k, track_noise_scale=True)``."""
  return optax_accum.accumulate(inner(), k, track_noise_scale=True)


def prepare_multisteps(inner, k: int) -> optax.GradientTransformation:
  """``optax.MultiSteps(inner, k)``."""
  return optax.MultiSteps(inner(), k).gradient_transformation()


def prepare_apply_every(inner, k: int) -> optax.GradientTransformation:
  """``optax.chain(inner, optax.apply_every(k))``."""
  return optax.chain(inner(), optax.apply_every(k))


VARIANTS = {
  "floor": prepare_floor,
  "plain": prepare_plain,
  "accumulate": prepare_accumulate,
  "accumulate+apply": prepare_accumulate,
  "accumulate+static": prepare_accumulate,
  "accumulate+noise": prepare_noise,
  "MultiSteps": prepare_multisteps,
  "apply_every": prepare_apply_every,
}
# How each variant's step applies its updates (default: optax.apply_updates
# on every call, one compiled step).
APPLY = {"accumulate+apply": "accum", "accumulate+static": "static"}
APPLY["floor"] = "static"


# --- Measuring one configuration. ------------------------------------------


class Config(NamedTuple):
  optimizer: str
  dtype: str
  size_mb: float
  k: int

  @property
  def label(self) -> str:
    return f"{self.optimizer} {self.dtype} {self.size_mb:g}MB k={self.k}"


def measure(config: Config, micro_batch: int, run: Run) -> dict[str, Any]:
  """Times and compiled memory of every variant for one configuration.

  The variants are compiled once; each repeat then times them afresh
  (warm-up, then interleaved rounds). Reported times and ratios are medians
  over repeats, with their min-max under ``"spread"``.
  """
  problem = make_problem(config.size_mb, DTYPES[config.dtype], micro_batch)
  carries, memory = {}, {}
  for name, prepare in VARIANTS.items():
    tx = prepare(OPTIMIZERS[config.optimizer], config.k)
    params = jax.tree.map(jnp.copy, problem.params)
    state = tx.init(params)
    grad_fn = jax.grad(problem.loss)
    if APPLY.get(name) == "static":
      step = Static(grad_fn, tx, config.k, params, state, problem.batch)
      memory[name] = step.memory()
    else:
      apply = optax_accum.apply_updates if APPLY.get(name) else None
      step = train_step(grad_fn, tx, apply=apply)
      step = step.lower(params, state, problem.batch).compile()
      memory[name] = compiled_memory(step)
    carries[name] = Carry(step, params, state)
    run.advance()

  param_bytes = tree_bytes(problem.params)
  itemsize = jnp.dtype(DTYPES[config.dtype]).itemsize
  result = {
    **config._asdict(),
    "width": problem.width,
    "layers": problem.layers,
    "param_bytes": param_bytes,
    "accumulator_bytes": param_bytes * 4 // itemsize,
  }
  turns = {n: turn(n, c, config.k, problem.batch) for n, c in carries.items()}
  # Per repeat: the times (ms), the ratios (a pair of dicts, see `ratios`).
  repeats = [call_times(rounds, config.k) for rounds in run.rounds(turns)]
  times_ms = [times for times, _ in repeats]
  pairs = [ratios(rounds, memory, result) for _, rounds in repeats]
  result["variants"] = {
    name: {"memory": memory[name], **medians}
    for name, medians in median_tree(times_ms).items()
  }
  result["ratios"] = median_tree([{**one, **per} for one, per in pairs])
  result["spread"] = {
    "times_ms": spread_tree(times_ms),
    "ratios": spread_tree([one for one, _ in pairs]),
  }
  result["checks"] = check_targets(TARGETS, result["ratios"])
  return result


def turn(name: str, carry: Carry, k: int, batch: Any) -> Callable[[int], Any]:
  """A variant's turn in a round: each call's (index, seconds).

  Every call is timed on its own (`Carry`). At least MIN_CALLS_PER_ROUND
  calls (whole cycles), so that k=1 gets as many samples as k=4. The first
  call finds the caches full of the previous variant's buffers: it is left
  out of every variant's statistics.
  """
  cycles = max(1, math.ceil(MIN_CALLS_PER_ROUND / k))

  def one_turn(_):
    calls = []
    for _ in range(cycles):
      calls += [carry(batch) for _ in range(k)]
      _, state = carry.values
      if name.startswith("accumulate") and not optax_accum.has_updated(state):
        raise RuntimeError(f"{name}: the last call of a cycle did not emit.")
    return list(enumerate(calls))[1:]

  return one_turn


def call_times(turns: dict[str, list], k: int) -> tuple[dict, dict]:
  """One repeat: each variant's median times (ms), and each round's medians
  (seconds) for ratios paired by round."""

  def medians(calls):
    micro = [t for i, t in calls if i % k != k - 1]
    return {
      "micro": median(micro) if k > 1 else None,
      "emit": median([t for i, t in calls if i % k == k - 1]),
      "call": median([t for _, t in calls]),
    }

  times_ms, rounds = {}, {}
  for name, per_turn in turns.items():
    rounds[name] = [
      {**medians(kept), "mean": sum(t for _, t in kept) / len(kept)}
      for kept in per_turn
    ]
    whole = medians([call for kept in per_turn for call in kept])
    times_ms[name] = {
      f"{what}_ms": None if value is None else 1e3 * value
      for what, value in whole.items()
    }
    times_ms[name]["cycle_mean_ms"] = 1e3 * median(
      [r["mean"] for r in rounds[name]]
    )
  return times_ms, rounds


def ratios(rounds: dict, memory: dict, result: dict) -> tuple[dict, dict]:
  """Every ratio the report shows, from one repeat's measurements: the
  single ratios, and those given for every variant."""

  def div(a, what_a, b, what_b):
    """Median over rounds of the ratio of two variants' round medians.

    Paired by round: both were measured seconds apart, so a change in the
    machine's load between rounds cancels out.
    """
    pairs = [
      x[what_a] / y[what_b]
      for x, y in zip(rounds[a], rounds[b], strict=True)
      if x[what_a] is not None and y[what_b] is not None
    ]
    return median(pairs) if pairs else None

  fp = {name: m["footprint"] for name, m in memory.items()}
  single = {
    "micro_vs_floor": div("accumulate+apply", "micro", "floor", "micro"),
    "static_micro_vs_floor": div(
      "accumulate+static", "micro", "floor", "micro"
    ),
    "optax_micro_vs_floor": div("accumulate", "micro", "floor", "micro"),
    "emit_vs_plain": div("accumulate", "emit", "plain", "call"),
    "static_emit_vs_plain": div("accumulate+static", "emit", "plain", "call"),
    "extra_memory": (fp["accumulate"] - fp["plain"])
    / result["accumulator_bytes"],
    "multisteps_speedup": div(
      "MultiSteps", "micro", "accumulate+apply", "micro"
    ),
    "memory_vs_multisteps": fp["accumulate"] / fp["MultiSteps"],
    "noise_micro_vs_floor": div("accumulate+noise", "micro", "floor", "micro"),
    "noise_micro_vs_accumulate": div(
      "accumulate+noise", "micro", "accumulate", "micro"
    ),
    "multisteps_cycle_speedup": div("MultiSteps", "mean", "accumulate", "mean"),
    "apply_every_micro_vs_accumulate": div(
      "apply_every", "micro", "accumulate", "micro"
    ),
  }
  return single, {
    "micro_vs_floor_by_variant": {
      name: div(name, "micro", "floor", "micro") for name in rounds
    },
    "emit_vs_plain_by_variant": {
      name: div(name, "emit", "plain", "call") for name in rounds
    },
    "extra_memory_vs_param_bytes": {
      name: (fp[name] - fp["plain"]) / result["param_bytes"] for name in fp
    },
  }


# --- Entry point. -----------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = benchmark_parser(
    "Time and compiled memory of one jitted training step with"
    " optax_accum.accumulate, optax.MultiSteps, optax.apply_every, the"
    " accumulation floor and the plain optimizer; prints ratios with"
    " PASS/FAIL against the performance targets."
  )
  add = parser.add_argument
  add(
    "--sizes-mb",
    type=csv_list(float),
    default=list(DEFAULT_SIZES_MB),
    help="comma-separated model sizes, in MB of params (in the param dtype)",
  )
  add(
    "--full",
    action="store_true",
    help=f"the full sweep: sizes {', '.join(map(str, FULL_SIZES_MB))} MB"
    " (overrides --sizes-mb; needs several GB of RAM and tens of minutes)",
  )
  add(
    "--ks",
    type=int_list,
    default=[1, 4],
    help="comma-separated micro-steps per cycle",
  )
  for option, choices, what in (
    ("--optimizers", OPTIMIZERS, "inner optimizers"),
    ("--dtypes", DTYPES, "param dtypes"),
  ):
    add(
      option,
      type=csv_list(str, list(choices)),
      default=list(choices),
      help=f"comma-separated {what}, from {list(choices)}",
    )
  add("--micro-batch", type=int, default=8, help="examples per micro-batch")
  add_run_arguments(parser, rounds=4, warmup=1, repeats=3)
  add(
    "--strict",
    action="store_true",
    help="exit with status 1 if any target fails",
  )
  args = parser.parse_args(argv)
  if args.full:
    args.sizes_mb = list(FULL_SIZES_MB)
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  grid = (args.optimizers, args.dtypes, args.sizes_mb, args.ks)
  configs = list(itertools.starmap(Config, itertools.product(*grid)))
  per_config = len(VARIANTS) + args.repeats * (args.warmup + args.rounds)
  with Run("bench_step", args, total=len(configs) * per_config) as run:
    results = []
    for config in configs:
      run.stage(config.label)
      results.append(measure(config, args.micro_batch, run))
  payload = run.payload(targets=describe_targets(TARGETS), results=results)
  run.finish(
    payload,
    lambda payload: step_markdown(payload, TARGETS),
    step_figure,
    step_console(payload, TARGETS),
  )
  passed = (c["pass"] for r in results for c in r["checks"].values())
  return 1 if args.strict and not all(passed) else 0


if __name__ == "__main__":
  sys.exit(main())
