"""Cost of one training step with gradient accumulation: time and memory.

For each configuration (inner optimizer, param dtype, model size, ``k``)
this jits ``grad -> tx.update -> optax.apply_updates`` with params and state
donated, for these transformations ``tx``:

* ``floor``: the least any accumulation pays: add the gradient into an
  accumulator, return ``where(emit, -lr * acc / k, 0)``, reset on emit (no
  inner optimizer, no conditional);
* ``plain``: the inner optimizer alone, on every call;
* ``accumulate``: ``optax_accum.accumulate(inner, k)``;
* ``accumulate+noise``: the same with ``track_noise_scale=True``;
* ``MultiSteps``: ``optax.MultiSteps(inner, k)``;
* ``apply_every``: ``optax.chain(inner, optax.apply_every(k))``.

Each round runs whole cycles of ``k`` calls (at least 4 calls) of every
variant, variants interleaved (the starting variant rotates); every call is
timed on its own with ``block_until_ready`` after warm-up rounds, leaving out
the first call of each variant's turn (cold caches). Times are medians; a
ratio is the median over rounds of the ratio of the two variants' medians in
that round (paired: a change of the machine's load between rounds cancels).
The last call of a cycle is the emitting step, the others are micro-steps. Memory comes from the compiled step's ``memory_analysis()``:
footprint = argument + temp + output - alias bytes.

Targets (ratios measured in the same process):

* accumulate micro-step <= 1.3x the floor's micro-step;
* accumulate emitting step <= 1.3x the plain inner step;
* accumulate footprint - plain footprint <= 1.05x the accumulator's bytes
  (= the param bytes for float32 params and accumulator);
* MultiSteps micro-step / accumulate micro-step >= 2;
* accumulate footprint <= MultiSteps footprint;
* accumulate+noise micro-step <= 1.3x the floor's micro-step.

Usage::

  python benchmarks/bench_step.py            # default subset, a few minutes
  python benchmarks/bench_step.py --full     # 1 MB .. 256 MB of params
"""

import argparse
import dataclasses
import itertools
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from _common import (
  MB,
  add_run_arguments,
  compiled_memory,
  fmt,
  fmt_spread,
  interleaved,
  machine_info,
  machine_line,
  markdown_table,
  median,
  spread,
  timed_call,
  tree_bytes,
  write_outputs,
)
from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import optax_accum

LEARNING_RATE = 1e-3
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

VARIANTS = (
  "floor",
  "plain",
  "accumulate",
  "accumulate+noise",
  "MultiSteps",
  "apply_every",
)

# name -> (column, description, comparison, threshold)
TARGETS = {
  "micro_vs_floor": (
    "micro/floor",
    "accumulate micro-step / floor micro-step",
    "<=",
    1.3,
  ),
  "emit_vs_plain": (
    "emit/plain",
    "accumulate emitting step / plain inner step",
    "<=",
    1.3,
  ),
  "extra_memory": (
    "extra mem/acc",
    "(accumulate - plain footprint) / accumulator bytes",
    "<=",
    1.05,
  ),
  "multisteps_speedup": (
    "MS/acc micro",
    "MultiSteps micro-step / accumulate micro-step",
    ">=",
    2.0,
  ),
  "memory_vs_multisteps": (
    "mem acc/MS",
    "accumulate footprint / MultiSteps footprint",
    "<=",
    1.0,
  ),
  "noise_micro_vs_floor": (
    "noise micro/floor",
    "accumulate+noise micro-step / floor micro-step",
    "<=",
    1.3,
  ),
}


# ----------------------------------------------------------------------------
# The model: a stack of square tanh layers, sized by its param bytes.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
  params: dict[str, jax.Array]
  batch: tuple[jax.Array, jax.Array]
  loss: Callable[[Any, Any], jax.Array]
  width: int
  layers: int


def make_problem(
  size_mb: float, dtype: Any, micro_batch: int, seed: int = 0
) -> Problem:
  """`layers` square layers of a power-of-two `width`, about `size_mb` MB."""
  itemsize = jnp.dtype(dtype).itemsize
  num_params = max(int(size_mb * MB) // itemsize, 64)
  width = 8
  while 4 * (2 * width) ** 2 <= num_params:
    width *= 2
  layers = max(1, num_params // width**2)
  key = jax.random.PRNGKey(seed)
  params = {
    f"w{i:02d}": (
      jax.random.normal(jax.random.fold_in(key, i), (width, width))
      / math.sqrt(width)
    ).astype(dtype)
    for i in range(layers)
  }
  kx, ky = jax.random.split(jax.random.fold_in(key, layers))
  batch = (
    jax.random.normal(kx, (micro_batch, width)).astype(dtype),
    jax.random.normal(ky, (micro_batch, width)).astype(dtype),
  )

  def loss(params, batch):
    # Mixed precision: params (and so gradients, optimizer state and
    # accumulator traffic) in `dtype`, matmuls in float32. XLA:CPU's bf16
    # matmuls are slow enough to hide everything this benchmark measures.
    h, y = (x.astype(jnp.float32) for x in batch)
    for name in sorted(params):
      h = jnp.tanh(h @ params[name].astype(jnp.float32))
    return jnp.mean(jnp.square(h - y))

  return Problem(params, batch, loss, width, layers)


# ----------------------------------------------------------------------------
# The variants.
# ----------------------------------------------------------------------------


class FloorState(NamedTuple):
  """State of `floor`."""

  count: jax.Array  # int32[]
  acc: optax.Updates


def floor(
  k: int, learning_rate: float, accumulator_dtype: Any = jnp.float32
) -> optax.GradientTransformation:
  """The minimum any accumulation pays: an add, a `where`, a reset."""

  def init(params):
    return FloorState(
      count=jnp.zeros([], jnp.int32),
      acc=jax.tree.map(lambda p: jnp.zeros(p.shape, accumulator_dtype), params),
    )

  def update(updates, state, params=None):
    del params
    count = state.count + 1
    emit = count >= k
    acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), state.acc, updates)
    new_updates = jax.tree.map(
      lambda a, g: jnp.where(emit, (-learning_rate / k) * a, 0).astype(g.dtype),
      acc,
      updates,
    )
    acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc)
    return new_updates, FloorState(jnp.where(emit, 0, count), acc)

  return optax.GradientTransformation(init, update)


def make_variants(
  optimizer: str, k: int
) -> dict[str, optax.GradientTransformation]:
  inner = OPTIMIZERS[optimizer]
  return {
    "floor": floor(k, LEARNING_RATE),
    "plain": inner(),
    "accumulate": optax_accum.accumulate(inner(), k),
    "accumulate+noise": optax_accum.accumulate(
      inner(), k, track_noise_scale=True
    ),
    "MultiSteps": optax.MultiSteps(inner(), k).gradient_transformation(),
    "apply_every": optax.chain(inner(), optax.apply_every(k)),
  }


def make_step(loss: Callable, tx: optax.GradientTransformation) -> Callable:
  """The jitted training step, params and state donated."""

  def step(params, state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


# ----------------------------------------------------------------------------
# Measuring one configuration.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  optimizer: str
  dtype: str
  size_mb: float
  k: int

  @property
  def label(self) -> str:
    return f"{self.optimizer} {self.dtype} {self.size_mb:g}MB k={self.k}"


def measure(
  config: Config,
  *,
  micro_batch: int,
  rounds: int,
  warmup: int,
  repeats: int,
  advance: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
  """Times and compiled memory of every variant for one configuration.

  The variants are compiled once; each repeat then times them afresh
  (warm-up, then interleaved rounds). Reported times and ratios are medians
  over repeats, with their min-max under ``"spread"``.
  """
  problem = make_problem(config.size_mb, DTYPES[config.dtype], micro_batch)
  runners, memory = {}, {}
  for name, tx in make_variants(config.optimizer, config.k).items():
    params = jax.tree.map(jnp.copy, problem.params)
    state = tx.init(params)
    compiled = (
      make_step(problem.loss, tx).lower(params, state, problem.batch).compile()
    )
    memory[name] = compiled_memory(compiled)
    runners[name] = [compiled, params, state]
    advance()

  param_bytes = tree_bytes(problem.params)
  result = {
    **dataclasses.asdict(config),
    "width": problem.width,
    "layers": problem.layers,
    "param_bytes": param_bytes,
    "accumulator_bytes": param_bytes
    * 4
    // jnp.dtype(DTYPES[config.dtype]).itemsize,
  }
  per_repeat = []
  for _ in range(repeats):
    variants = time_variants(
      runners, problem.batch, config.k, rounds, warmup, advance
    )
    for name, v in variants.items():
      v["memory"] = memory[name]
    per_repeat.append({**result, "variants": variants})
  del runners

  result["variants"] = {
    name: {
      "memory": memory[name],
      **{
        what: _median_or_none([r["variants"][name][what] for r in per_repeat])
        for what in TIMES
      },
    }
    for name in memory
  }
  repeat_ratios = [ratios(r) for r in per_repeat]
  result["ratios"] = _median_tree(repeat_ratios)
  result["spread"] = {
    "times_ms": {
      name: {
        what: spread([r["variants"][name][what] for r in per_repeat])
        for what in TIMES
      }
      for name in memory
    },
    "ratios": {
      name: spread([r[name] for r in repeat_ratios])
      for name in repeat_ratios[0]
      if not isinstance(repeat_ratios[0][name], dict)
    },
  }
  result["checks"] = checks(result["ratios"], config.k)
  return result


TIMES = ("micro_ms", "emit_ms", "call_ms", "cycle_mean_ms")


def _median_or_none(values):
  kept = [v for v in values if v is not None]
  return median(kept) if kept else None


def _median_tree(dicts: list[dict[str, Any]]) -> dict[str, Any]:
  """Element-wise median of dicts of numbers (or of such dicts)."""
  out = {}
  for key, value in dicts[0].items():
    if isinstance(value, dict):
      out[key] = _median_tree([d[key] for d in dicts])
    else:
      out[key] = _median_or_none([d[key] for d in dicts])
  return out


def time_variants(
  runners: dict[str, list],
  batch: Any,
  k: int,
  rounds: int,
  warmup: int,
  advance: Callable[[], None],
) -> dict[str, dict[str, Any]]:
  """One repeat: each variant's per-call times over interleaved rounds."""
  # At least MIN_CALLS_PER_ROUND calls a variant a round (whole cycles), so
  # that k=1 gets as many samples as k=4.
  cycles = max(1, math.ceil(MIN_CALLS_PER_ROUND / k))

  def turn(name):
    def run(_):
      compiled, params, state = runners[name]
      calls = []
      for _ in range(cycles):
        for _ in range(k):
          seconds, (params, state) = timed_call(compiled, params, state, batch)
          calls.append(seconds)
        if name.startswith("accumulate") and not bool(
          optax_accum.has_updated(state)
        ):
          raise RuntimeError(f"{name}: the last call of a cycle did not emit.")
      runners[name][1:] = [params, state]
      # The first call of a turn finds the caches full of the previous
      # variant's buffers: it is left out of every variant's statistics.
      return list(enumerate(calls))[1:]

    return run

  turns = interleaved(
    {name: turn(name) for name in runners},
    rounds=rounds,
    warmup=warmup,
    advance=advance,
  )
  variants = {}
  for name, per_turn in turns.items():
    calls = [call for kept in per_turn for call in kept]
    micro = [t for i, t in calls if i % k != k - 1]
    variants[name] = {
      "micro_ms": 1e3 * median(micro) if k > 1 else None,
      "emit_ms": 1e3 * median([t for i, t in calls if i % k == k - 1]),
      "call_ms": 1e3 * median([t for _, t in calls]),
      "cycle_mean_ms": 1e3
      * median([sum(t for _, t in kept) / len(kept) for kept in per_turn]),
      # Each round's medians, for ratios paired by round.
      "rounds": [
        {
          "micro": median([t for i, t in kept if i % k != k - 1])
          if k > 1
          else None,
          "emit": median([t for i, t in kept if i % k == k - 1]),
          "call": median([t for _, t in kept]),
          "mean": sum(t for _, t in kept) / len(kept),
        }
        for kept in per_turn
      ],
    }
  return variants


def ratios(result: dict[str, Any]) -> dict[str, Any]:
  """Every ratio the report shows, from one configuration's measurements."""
  v = result["variants"]

  def div(a, what_a, b, what_b):
    """Median over rounds of the ratio of two variants' round medians.

    Paired by round: both were measured seconds apart, so a change in the
    machine's load between rounds cancels out.
    """
    pairs = [
      x[what_a] / y[what_b]
      for x, y in zip(v[a]["rounds"], v[b]["rounds"], strict=True)
      if x[what_a] is not None and y[what_b] is not None
    ]
    return median(pairs) if pairs else None

  fp = {name: x["memory"]["footprint"] for name, x in v.items()}
  out = {
    "micro_vs_floor": div("accumulate", "micro", "floor", "micro"),
    "emit_vs_plain": div("accumulate", "emit", "plain", "call"),
    "extra_memory": (fp["accumulate"] - fp["plain"])
    / result["accumulator_bytes"],
    "multisteps_speedup": div("MultiSteps", "micro", "accumulate", "micro"),
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
  out["micro_vs_floor_by_variant"] = {
    name: div(name, "micro", "floor", "micro") for name in v
  }
  out["emit_vs_plain_by_variant"] = {
    name: div(name, "emit", "plain", "call") for name in v
  }
  out["extra_memory_vs_param_bytes"] = {
    name: (fp[name] - fp["plain"]) / result["param_bytes"] for name in fp
  }
  return out


def checks(ratio: dict[str, Any], k: int) -> dict[str, dict[str, Any]]:
  """PASS/FAIL of each target; micro-step targets need k > 1."""
  out = {}
  for name, (_, what, op, threshold) in TARGETS.items():
    value = ratio[name]
    if value is None:
      continue
    passed = value <= threshold if op == "<=" else value >= threshold
    out[name] = {
      "what": what,
      "value": value,
      "target": f"{op} {threshold}",
      "pass": bool(passed),
    }
  return out


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------


def _check_cell(result: dict[str, Any], name: str) -> str:
  check = result["checks"].get(name)
  if check is None:
    return "-"
  value = fmt_spread(result["spread"]["ratios"][name])
  return f"{value} {'PASS' if check['pass'] else 'FAIL'}"


def markdown_report(payload: dict[str, Any]) -> str:
  results = payload["results"]
  base = [
    lambda r: r["optimizer"],
    lambda r: r["dtype"],
    lambda r: f"{r['param_bytes'] / MB:g}",
    lambda r: r["k"],
  ]
  base_header = ["optimizer", "dtype", "params MB", "k"]

  target_header = base_header + [
    f"{col} ({op} {t})" for col, _, op, t in TARGETS.values()
  ]
  target_rows = [
    [f(r) for f in base] + [_check_cell(r, name) for name in TARGETS]
    for r in results
  ]

  time_header = base_header + [
    "floor micro",
    "plain",
    "accumulate micro",
    "accumulate emit",
    "acc+noise micro",
    "MultiSteps micro",
    "MultiSteps emit",
    "apply_every micro",
    "apply_every emit",
  ]
  time_rows = []
  for r in results:
    v = r["variants"]
    time_rows.append(
      [f(r) for f in base]
      + [
        fmt(v["floor"]["micro_ms"]),
        fmt(v["plain"]["call_ms"]),
        fmt(v["accumulate"]["micro_ms"]),
        fmt(v["accumulate"]["emit_ms"]),
        fmt(v["accumulate+noise"]["micro_ms"]),
        fmt(v["MultiSteps"]["micro_ms"]),
        fmt(v["MultiSteps"]["emit_ms"]),
        fmt(v["apply_every"]["micro_ms"]),
        fmt(v["apply_every"]["emit_ms"]),
      ]
    )

  memory_header = base_header + [
    f"{name} footprint MB (extra / param bytes)" for name in VARIANTS
  ]
  memory_rows = []
  for r in results:
    extra = r["ratios"]["extra_memory_vs_param_bytes"]
    memory_rows.append(
      [f(r) for f in base]
      + [
        f"{r['variants'][name]['memory']['footprint'] / MB:.1f}"
        f" ({extra[name]:+.2f})"
        for name in VARIANTS
      ]
    )

  num_checks = sum(len(r["checks"]) for r in results)
  num_failed = sum(not c["pass"] for r in results for c in r["checks"].values())
  a = payload["args"]
  return "\n".join(
    [
      "# bench_step: accumulation cost per call",
      "",
      f"Machine: {machine_line(payload['machine'])}.",
      "",
      f"Model: square tanh layers, micro-batch {a['micro_batch']}."
      f" {a['repeats']} repeats, each {a['warmup']} warm-up round(s) then"
      f" {a['rounds']} interleaved rounds; each round runs whole cycles of"
      " k calls (>= 4 calls) per variant, the first call of each turn left"
      " out. Times in ms. A ratio is the median over rounds of that round's"
      " ratio of medians; tables show the median over repeats and, in"
      " brackets, their min-max."
      " Footprint = argument + temp + output - alias bytes of the compiled"
      " step.",
      "",
      f"**{num_checks - num_failed}/{num_checks} targets pass.**",
      "",
      "## Targets",
      "",
      "\n".join(
        f"- {col}: {what} {op} {t}" for col, what, op, t in TARGETS.values()
      ),
      "",
      markdown_table(target_header, target_rows),
      "## Times (ms, medians)",
      "",
      markdown_table(time_header, time_rows),
      "## Compiled memory",
      "",
      markdown_table(memory_header, memory_rows),
    ]
  )


def figure(payload: dict[str, Any]) -> Any:
  """Micro-step / floor, emitting step / plain, extra memory; vs size."""
  results = payload["results"]
  panels = sorted({(r["optimizer"], r["dtype"]) for r in results})
  rows = [
    (
      "micro-step / floor",
      lambda r, n: r["ratios"]["micro_vs_floor_by_variant"][n],
      1.3,
    ),
    (
      "emitting step / plain",
      lambda r, n: r["ratios"]["emit_vs_plain_by_variant"][n],
      1.3,
    ),
    (
      "extra memory / param bytes",
      lambda r, n: r["ratios"]["extra_memory_vs_param_bytes"][n],
      None,
    ),
  ]
  shown = ("accumulate", "accumulate+noise", "MultiSteps", "apply_every")
  colors = dict(zip(shown, ("C0", "C1", "C3", "C2"), strict=True))
  # Distinct markers and a small horizontal offset per variant: equal values
  # (accumulate and accumulate+noise often coincide) stay visible.
  markers = dict(zip(shown, ("o", "s", "^", "x"), strict=True))
  offsets = dict(zip(shown, (0.94, 1.0, 1.06, 1.12), strict=True))
  fig = Figure(figsize=(4.2 * len(panels), 3.2 * len(rows)))
  axes = fig.subplots(len(rows), len(panels), squeeze=False)
  ks = sorted({r["k"] for r in results})
  styles = dict(zip(ks, itertools.cycle(("--", "-", ":", "-."))))
  for col, (opt, dtype) in enumerate(panels):
    for row, (title, value, target) in enumerate(rows):
      ax = axes[row][col]
      for name, k in itertools.product(shown, ks):
        points = [
          (r["param_bytes"] / MB, value(r, name))
          for r in results
          if (r["optimizer"], r["dtype"], r["k"]) == (opt, dtype, k)
        ]
        points = [(x, y) for x, y in points if y is not None]
        if points:
          xs, ys = zip(*sorted(points), strict=True)
          ax.plot(
            [x * offsets[name] for x in xs],
            ys,
            styles[k],
            marker=markers[name],
            markerfacecolor="none",
            color=colors[name],
            label=f"{name} k={k}",
          )
      if target is not None:
        ax.axhline(target, color="gray", lw=0.8, ls=":")
        ax.annotate(
          f"target {target}",
          (0.01, target),
          xycoords=("axes fraction", "data"),
          va="bottom",
          fontsize=7,
          color="gray",
        )
      ax.set_xscale("log", base=2)
      ax.set_xlabel("params (MB)")
      ax.set_ylabel(title)
      ax.set_title(f"{opt}, {dtype}", fontsize=9)
  # One legend, below the panels: it covers no data.
  handles, labels = axes[1][0].get_legend_handles_labels()
  fig.legend(
    handles,
    labels,
    loc="lower center",
    ncol=min(4, len(labels)),
    fontsize=7,
    bbox_to_anchor=(0.5, 0.0),
  )
  fig.suptitle(
    f"bench_step on {payload['machine']['backend']}"
    f" ({payload['machine']['cpu_count']} CPUs)",
    fontsize=10,
  )
  fig.tight_layout(rect=(0, 0.06, 1, 1))
  return fig


def console_table(results: list[dict[str, Any]]) -> Table:
  table = Table(title="accumulate vs targets (medians over repeats)")
  table.add_column("config")
  for col, _, op, t in TARGETS.values():
    table.add_column(f"{col}\n{op} {t}", justify="right")
  for r in results:
    cells = []
    for name in TARGETS:
      check = r["checks"].get(name)
      if check is None:
        cells.append("-")
      else:
        color = "green" if check["pass"] else "red"
        cells.append(f"[{color}]{check['value']:.2f}[/{color}]")
    dtype = {"float32": "f32", "bfloat16": "bf16"}[r["dtype"]]
    table.add_row(
      f"{r['optimizer']} {dtype} {r['param_bytes'] / MB:g}MB k={r['k']}",
      *cells,
    )
  return table


# ----------------------------------------------------------------------------
# Entry point.
# ----------------------------------------------------------------------------


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
  return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=(
      "Time and compiled memory of one jitted training step with"
      " optax_accum.accumulate, optax.MultiSteps, optax.apply_every, the"
      " accumulation floor and the plain optimizer; prints ratios with"
      " PASS/FAIL against the performance targets."
    ),
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--sizes-mb",
    type=_csv(float),
    default=list(DEFAULT_SIZES_MB),
    help="comma-separated model sizes, in MB of params (in the param dtype)",
  )
  parser.add_argument(
    "--full",
    action="store_true",
    help=f"the full sweep: sizes {', '.join(map(str, FULL_SIZES_MB))} MB"
    " (overrides --sizes-mb; needs several GB of RAM and tens of minutes)",
  )
  parser.add_argument(
    "--ks",
    type=_csv(int),
    default=[1, 4],
    help="comma-separated micro-steps per cycle",
  )
  parser.add_argument(
    "--optimizers",
    type=_csv(str),
    default=list(OPTIMIZERS),
    help=f"comma-separated inner optimizers, from {list(OPTIMIZERS)}",
  )
  parser.add_argument(
    "--dtypes",
    type=_csv(str),
    default=list(DTYPES),
    help=f"comma-separated param dtypes, from {list(DTYPES)}",
  )
  parser.add_argument(
    "--micro-batch", type=int, default=8, help="examples per micro-batch"
  )
  add_run_arguments(parser, rounds=4, warmup=1, repeats=3)
  parser.add_argument(
    "--strict",
    action="store_true",
    help="exit with status 1 if any target fails",
  )
  args = parser.parse_args(argv)
  if args.full:
    args.sizes_mb = list(FULL_SIZES_MB)
  for name, given, allowed in (
    ("--optimizers", args.optimizers, OPTIMIZERS),
    ("--dtypes", args.dtypes, DTYPES),
  ):
    unknown = sorted(set(given) - set(allowed))
    if unknown:
      parser.error(f"{name}: unknown {unknown}, choose from {list(allowed)}")
  if min(args.ks) < 1:
    parser.error(f"--ks must be >= 1, got {args.ks}")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  console = Console()
  if not console.is_terminal:  # a log file: 100 columns
    console = Console(width=100)
  configs = [
    Config(opt, dtype, size, k)
    for opt, dtype, size, k in itertools.product(
      args.optimizers, args.dtypes, args.sizes_mb, args.ks
    )
  ]
  steps_per_config = len(VARIANTS) + args.repeats * (args.warmup + args.rounds)
  results = []
  with Progress(console=console, transient=False) as progress:
    task = progress.add_task(
      "bench_step", total=len(configs) * steps_per_config
    )
    for config in configs:
      progress.update(task, description=config.label)
      results.append(
        measure(
          config,
          micro_batch=args.micro_batch,
          rounds=args.rounds,
          warmup=args.warmup,
          repeats=args.repeats,
          advance=lambda: progress.advance(task),
        )
      )
  payload = {
    "benchmark": "bench_step",
    "machine": machine_info(),
    "args": vars(args),
    "targets": {
      name: {"what": what, "target": f"{op} {t}"}
      for name, (_, what, op, t) in TARGETS.items()
    },
    "results": results,
  }
  console.print(console_table(results))
  paths = write_outputs(
    args.out,
    "bench_step",
    payload,
    markdown_report(payload),
    figure(payload),
  )
  failed = [
    f"{r['optimizer']} {r['dtype']} {r['size_mb']:g}MB k={r['k']}: {name}"
    for r in results
    for name, c in r["checks"].items()
    if not c["pass"]
  ]
  console.print(f"{len(failed)} target(s) failed" + (":" if failed else "."))
  for line in failed:
    console.print(f"  [red]{line}[/red]")
  console.print("Wrote " + ", ".join(str(p) for p in paths))
  return 1 if failed and args.strict else 0


if __name__ == "__main__":
  sys.exit(main())
