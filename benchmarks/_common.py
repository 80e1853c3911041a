"""The runner shared by the benchmark scripts.

Command-line options every script has (rounds, warm-up, repeats, output
folder, device count), interleaved timing rounds, the spread over repeats,
machine information, compiled memory and the three output files (JSON,
Markdown, PNG). Kept here so that every script measures the same way; each
stays runnable on its own (``python benchmarks/bench_step.py``).
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
from typing import Any

import jax
import jaxlib
import numpy as np
import optax

import optax_accum

MB = 2**20
# Where `make bench` leaves its results: benchmarks/README.md reads them.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


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
    type=_positive_int,
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
    type=_positive_int,
    default=repeats,
    help="independent measurements (each: warm-up, then rounds); the"
    " reports give the median over repeats and their min-max",
  )
  parser.add_argument(
    "--out",
    default=str(RESULTS_DIR),
    help="output folder for <name>.{json,md,png}",
  )


def _positive_int(text: str) -> int:
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


def interleaved(
  turns: dict[str, Callable[[int], Any]],
  *,
  rounds: int,
  warmup: int,
  advance: Callable[[], None] = lambda: None,
) -> dict[str, list[Any]]:
  """Runs every variant's turn once a round, rotating who goes first.

  `turns[name](round_index)` runs one turn and returns its measurement;
  the measurements of the `rounds` rounds after `warmup` untimed ones are
  returned per name. Interleaving puts every variant under the same
  machine load; rotating the order spreads the cost of going first (cold
  caches) evenly. `advance` is called after each round.
  """
  names = list(turns)
  out = {name: [] for name in names}
  for r in range(warmup + rounds):
    shift = r % max(len(names), 1)
    for name in names[shift:] + names[:shift]:
      value = turns[name](r)
      if r >= warmup:
        out[name].append(value)
    advance()
  return out


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


def fmt_spread(s: dict[str, Any], digits: int = 2, suffix: str = "") -> str:
  """``0.71 (0.65-0.80)``: median (min-max); a single value alone."""
  if s["median"] is None:
    return "-"
  text = f"{s['median']:.{digits}f}{suffix}"
  if len(s["values"]) > 1:
    text += f" ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
  return text


def set_cpu_devices(count: int) -> None:
  """Simulated CPU devices; must run before anything touches a device."""
  jax.config.update("jax_num_cpu_devices", count)


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


def tree_bytes(tree: Any) -> int:
  """Bytes held by the array leaves of a tree (arrays or ShapeDtypeStructs)."""
  return sum(
    int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )


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


def timed_call(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
  """Seconds for one call, waiting for every output; returns the outputs too."""
  start = time.perf_counter()
  out = fn(*args)
  jax.block_until_ready(out)
  return time.perf_counter() - start, out


def median(values: Sequence[float]) -> float:
  """The median, or NaN for no values."""
  return statistics.median(values) if values else float("nan")


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


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub Markdown table."""
  lines = [
    "| " + " | ".join(header) + " |",
    "|" + "|".join("---" for _ in header) + "|",
  ]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def fmt(x: float | None, digits: int = 2) -> str:
  """A number for a table; '-' for missing values."""
  if x is None or (isinstance(x, float) and not np.isfinite(x)):
    return "-"
  return f"{x:.{digits}f}"
