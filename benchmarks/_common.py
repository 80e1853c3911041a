"""The runner shared by the benchmark scripts.

A script declares its problem, its variants (each a small ``prepare``
function), what a variant's turn in a round runs and which ratios it
reports; the runner owns the rest, so that every script measures the same
way: the command-line options they share, the jitted training step, timed
calls that thread params and state (`Carry`), interleaved rounds over
repeats (`Run`), medians and spreads over repeats, targets on ratios,
compiled memory, machine information and the outputs (console, JSON,
Markdown, PNG). Each script stays runnable on its own
(``python benchmarks/bench_step.py``).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jaxlib
import numpy as np
import optax
from _models import MB as MB
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import optax_accum

# Where `make bench` leaves its results: benchmarks/README.md reads them.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --- Arguments. -----------------------------------------------------------


def benchmark_parser(description: str) -> argparse.ArgumentParser:
  """A script's parser; its --help shows every default."""
  return argparse.ArgumentParser(
    description=description,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )


def add_run_arguments(
  parser: argparse.ArgumentParser,
  *,
  rounds: int,
  warmup: int,
  repeats: int = 3,
) -> None:
  """--rounds, --warmup, --repeats and --out, with a script's defaults."""
  parser.add_argument(
    "--rounds",
    type=positive_int,
    default=rounds,
    help="timed rounds per repeat (the variants take turns in each)",
  )
  parser.add_argument(
    "--warmup",
    type=_non_negative_int,
    default=warmup,
    help="untimed rounds at the start of each repeat",
  )
  parser.add_argument(
    "--repeats",
    type=positive_int,
    default=repeats,
    help="independent measurements (each: warm-up, then rounds); the"
    " reports give the median over repeats and their min-max",
  )
  parser.add_argument(
    "--out",
    default=str(RESULTS_DIR),
    help="output folder for <name>.{json,md,png}",
  )


def positive_int(text: str) -> int:
  """An integer >= 1 (an argparse type)."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"need an integer >= 1, got {text!r}")
  return value


def _non_negative_int(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"need an integer >= 0, got {text!r}")
  return value


def int_list(text: str) -> list[int]:
  """``"1,4,16"`` -> ``[1, 4, 16]``, all >= 1 (an argparse type)."""
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
  return values


def csv_list(
  kind: Callable[[str], Any] = str, choices: Sequence[Any] | None = None
) -> Callable[[str], list[Any]]:
  """An argparse type: ``"a,b"`` -> ``[kind("a"), kind("b")]``, each one
  of `choices` when given."""

  def parse(text: str) -> list[Any]:
    values = [kind(x) for x in text.split(",") if x]
    unknown = [] if choices is None else sorted(set(values) - set(choices))
    if unknown:
      raise argparse.ArgumentTypeError(
        f"unknown {unknown}, choose from {list(choices)}"
      )
    return values

  parse.__name__ = f"{getattr(kind, '__name__', 'value')} list"
  return parse


def set_cpu_devices(count: int) -> None:
  """Simulated CPU devices; must run before anything touches a device."""
  jax.config.update("jax_num_cpu_devices", count)


# --- The step, and timing it. ---------------------------------------------


def train_step(
  grad_fn: Callable[..., Any],
  tx: optax.GradientTransformation,
  *,
  has_value: bool = False,
  apply: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
  """``jit(grad -> tx.update -> optax.apply_updates)``, params and state
  donated.

  `grad_fn(params, batch)` returns the gradients, or `(value, gradients)`
  with `has_value`; the step returns `(params, state)`, then the value.
  `apply`: ``optax_accum.apply_updates`` (called with the state) instead of
  ``optax.apply_updates``.
  """

  def step(params, state, batch):
    if has_value:
      value, grads = grad_fn(params, batch)
    else:
      grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params)
    if apply is None:
      params = optax.apply_updates(params, updates)
    else:
      params = apply(params, updates, state)
    return (params, state, value) if has_value else (params, state)

  return jax.jit(step, donate_argnums=(0, 1))


def timed_call(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
  """Seconds for one call, waiting for every output; returns the outputs too."""
  start = time.perf_counter()
  out = fn(*args)
  jax.block_until_ready(out)
  return time.perf_counter() - start, out


class Carry:
  """A step and the values (params, state) it threads from call to call.

  `step(*values, *inputs)` returns the new values first; whatever it
  returns after them is dropped. Calling a `Carry` times one call of the
  step (waiting for everything it returns) and keeps the new values.
  """

  def __init__(self, step: Callable[..., Any], *values: Any):
    self.step, self.values = step, values

  def __call__(self, *inputs: Any) -> float:
    seconds, out = timed_call(self.step, *self.values, *inputs)
    self.values = tuple(out[: len(self.values)])
    return seconds


def interleaved(
  turns: dict[str, Callable[[int], Any]],
  *,
  rounds: int,
  warmup: int,
  advance: Callable[[], None] = lambda: None,
  first: int = 0,
) -> dict[str, list[Any]]:
  """Runs every variant's turn once a round, rotating who goes first.

  `turns[name](first + round_index)` runs one turn and returns its
  measurement; the measurements of the `rounds` rounds after `warmup`
  untimed ones are returned per name. Interleaving puts every variant under
  the same machine load; rotating the order spreads the cost of going first
  (cold caches) evenly. `advance` is called after each round.
  """
  names = list(turns)
  out = {name: [] for name in names}
  for r in range(warmup + rounds):
    shift = r % max(len(names), 1)
    for name in names[shift:] + names[:shift]:
      value = turns[name](first + r)
      if r >= warmup:
        out[name].append(value)
    advance()
  return out


class Run:
  """One script's run: its console, progress bar, timing rounds and outputs.

  ``with Run(name, args, total) as run:`` shows the progress bar; `total`
  counts the calls to `advance` (one per round, and one per compiled
  variant or whatever else a script counts). After the block,
  `run.payload(...)` and `run.finish(...)` report.
  """

  def __init__(self, name: str, args: argparse.Namespace, total: int):
    self.name, self.args = name, args
    self.console = Console()
    if not self.console.is_terminal:  # a log file: 100 columns
      self.console = Console(width=100)
    self.progress = Progress(console=self.console)
    self.task = self.progress.add_task(name, total=total)

  def __enter__(self) -> "Run":
    self.progress.start()
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.progress.stop()

  def stage(self, description: str) -> None:
    self.progress.update(self.task, description=description)

  def advance(self) -> None:
    self.progress.advance(self.task)

  def rounds(
    self, turns: dict[str, Callable[[int], Any]]
  ) -> list[dict[str, list[Any]]]:
    """Per repeat (--repeats), each variant's measurements of --rounds
    interleaved rounds after --warmup untimed ones (see `interleaved`);
    a turn gets its round's index counted over all repeats."""
    a = self.args
    return [
      interleaved(
        turns,
        rounds=a.rounds,
        warmup=a.warmup,
        advance=self.advance,
        first=repeat * (a.warmup + a.rounds),
      )
      for repeat in range(a.repeats)
    ]

  def payload(self, **results: Any) -> dict[str, Any]:
    """The JSON: the benchmark's name, the machine, the arguments, results."""
    return {
      "benchmark": self.name,
      "machine": machine_info(),
      "args": vars(self.args),
      **results,
    }

  def finish(
    self,
    payload: dict[str, Any],
    markdown: Callable[[dict[str, Any]], str],
    figure: Callable[[dict[str, Any]], Any],
    lines: Sequence[Any] = (),
  ) -> list[Path]:
    """Prints `lines` (tables, text), then writes the three outputs."""
    for line in lines:
      self.console.print(line)
    paths = write_outputs(
      self.args.out, self.name, payload, markdown(payload), figure(payload)
    )
    self.console.print("Wrote " + ", ".join(str(p) for p in paths))
    return paths


# --- Over repeats: medians, spreads, targets. -----------------------------


def median(values: Sequence[float]) -> float:
  """The median, or NaN for no values."""
  return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float | None]) -> dict[str, Any]:
  """Median, min and max of a measurement over repeats (None left out)."""
  kept = [v for v in values if v is not None]
  if not kept:
    return {"median": None, "min": None, "max": None, "values": []}
  return {
    "median": statistics.median(kept),
    "min": min(kept),
    "max": max(kept),
    "values": list(kept),
  }


def median_tree(trees: Sequence[Any]) -> Any:
  """The median of each number of (nested) dicts over repeats."""
  if isinstance(trees[0], dict):
    return {key: median_tree([t[key] for t in trees]) for key in trees[0]}
  return spread(trees)["median"]


def spread_tree(trees: Sequence[Any]) -> Any:
  """The `spread` of each number of (nested) dicts over repeats."""
  if isinstance(trees[0], dict):
    return {key: spread_tree([t[key] for t in trees]) for key in trees[0]}
  return spread(trees)


class Target(NamedTuple):
  """A threshold on a ratio; `column` heads its column in the reports."""

  column: str
  what: str
  op: str  # "<=" or ">="
  threshold: float

  @property
  def text(self) -> str:
    return f"{self.op} {self.threshold}"


def describe_targets(targets: dict[str, Target]) -> dict[str, dict[str, str]]:
  """What each target compares, and its threshold (for the JSON)."""
  return {
    name: {"what": t.what, "target": t.text} for name, t in targets.items()
  }


def check_targets(
  targets: dict[str, Target], values: dict[str, Any]
) -> dict[str, dict[str, Any]]:
  """PASS/FAIL of each target whose value was measured (is not None)."""
  out = {}
  for name, t in targets.items():
    value = values[name]
    if value is None:
      continue
    passed = value <= t.threshold if t.op == "<=" else value >= t.threshold
    out[name] = {
      "what": t.what,
      "value": value,
      "target": t.text,
      "pass": bool(passed),
    }
  return out


# --- Memory. --------------------------------------------------------------


def tree_bytes(tree: Any) -> int:
  """Bytes held by the array leaves of a tree (arrays or ShapeDtypeStructs)."""
  return sum(
    int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )


def abstract(tree: Any) -> Any:
  """The tree's arrays as ShapeDtypeStructs (to compile without data)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compiled_memory(compiled: Any) -> dict[str, int]:
  """The compiled step's memory, with its footprint.

  footprint = argument + temp + output - alias: arguments count because the
  accumulator and optimizer state live in the (donated) arguments, and the
  aliased outputs reuse the argument buffers, so they are subtracted once.
  """
  m = compiled.memory_analysis()
  out = {
    "argument": int(m.argument_size_in_bytes),
    "temp": int(m.temp_size_in_bytes),
    "output": int(m.output_size_in_bytes),
    "alias": int(m.alias_size_in_bytes),
  }
  out["footprint"] = (
    out["argument"] + out["temp"] + out["output"] - out["alias"]
  )
  return out


def largest_fitting(
  footprint: Callable[[int], int],
  budget: int,
  *,
  base: int,
  multiple: int,
  limit: int = 1 << 16,
) -> tuple[int, int]:
  """The largest size (rows of a batch, say) whose footprint fits `budget`.

  `footprint(size)` compiles the step at that size and returns its compiled
  footprint. Footprints grow about linearly with the size: compiles at
  `base` and `2 * base` estimate the line, then candidates at the estimate
  (rounded down to `multiple`) are compiled and stepped down until one
  fits. Returns (size, footprint); (0, footprint at `multiple`) when not
  even `multiple` fits.
  """
  small = footprint(base)
  if small > budget:
    if base == multiple:
      return 0, small
    return largest_fitting(
      footprint, budget, base=multiple, multiple=multiple, limit=limit
    )
  large = footprint(2 * base)
  per_row = max((large - small) / base, 1.0)
  size = int(base + (budget - small) / per_row)
  size = max(base, min(limit, size - size % multiple))
  for _ in range(8):
    used = footprint(size)
    if used <= budget or size == base:
      return size, used
    size = max(base, int(size * budget / used) // multiple * multiple)
  return size, used


# --- The machine. ---------------------------------------------------------


def machine_info() -> dict[str, Any]:
  """Where and with what the numbers were measured."""
  device = jax.devices()[0]
  return {
    "timestamp": datetime.datetime.now(datetime.UTC).isoformat(
      timespec="seconds"
    ),
    "platform": platform.platform(),
    "processor": platform.processor() or platform.machine(),
    "python": platform.python_version(),
    "cpu_count": os.cpu_count(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "optax": optax.__version__,
    "optax_accum": optax_accum.__version__,
    "backend": jax.default_backend(),
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "load_average": list(os.getloadavg())
    if hasattr(os, "getloadavg")
    else None,
  }


def machine_line(info: dict[str, Any]) -> str:
  """One line for the top of a Markdown report."""
  return (
    f"{info['platform']}, {info['cpu_count']} CPUs, backend"
    f" {info['backend']} ({info['device_kind']}), jax {info['jax']}, jaxlib"
    f" {info['jaxlib']}, optax {info['optax']}, optax_accum"
    f" {info['optax_accum']}, {info['timestamp']}"
  )


# --- Outputs. -------------------------------------------------------------


def write_outputs(
  out_dir: str | os.PathLike,
  stem: str,
  payload: dict[str, Any],
  markdown: str,
  figure: Any,
) -> list[Path]:
  """Writes `<stem>.json`, `<stem>.md` and `<stem>.png`; returns the paths."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
  paths[0].write_text(json.dumps(payload, indent=2, default=_json_default))
  paths[1].write_text(markdown)
  figure.savefig(paths[2], dpi=120, bbox_inches="tight")
  return paths


def _json_default(x: Any) -> Any:
  if isinstance(x, (np.generic, jax.Array)):
    return np.asarray(x).item()
  return str(x)


def markdown_page(title: str, machine: dict[str, Any], *parts: str) -> str:
  """``# title``, the machine line, then `parts` (paragraphs, headings,
  tables), a blank line between any two."""
  parts = (f"# {title}", f"Machine: {machine_line(machine)}.", *parts)
  return "\n\n".join(part.rstrip("\n") for part in parts) + "\n"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub Markdown table."""
  lines = [
    "| " + " | ".join(header) + " |",
    "|" + "|".join("---" for _ in header) + "|",
  ]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def console_table(
  title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]
) -> Table:
  """A rich table: the first column left-aligned, the others right."""
  table = Table(title=title)
  for i, name in enumerate(header):
    table.add_column(name, justify="right" if i else "left")
  for row in rows:
    table.add_row(*(str(c) for c in row))
  return table


def figure_title(fig: Any, payload: dict[str, Any]) -> None:
  """``<benchmark> on <backend> (<n> CPUs)`` above a figure."""
  m = payload["machine"]
  fig.suptitle(
    f"{payload['benchmark']} on {m['backend']} ({m['cpu_count']} CPUs)",
    fontsize=10,
  )


def fmt(x: float | None, digits: int = 2) -> str:
  """A number for a table; '-' for missing values."""
  if x is None or (isinstance(x, float) and not np.isfinite(x)):
    return "-"
  return f"{x:.{digits}f}"


def fmt_spread(s: dict[str, Any], digits: int = 2, suffix: str = "") -> str:
  """``0.71 (0.65-0.80)``: median (min-max); a single value alone."""
  if s["median"] is None:
    return "-"
  text = f"{s['median']:.{digits}f}{suffix}"
  if len(s["values"]) > 1:
    text += f" ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
  return text
