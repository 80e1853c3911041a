"""What the benchmark scripts share: arguments, interleaved timing, spreads,
compiled memory, the machine, and writing the results file.

Every script writes one JSON (its measurements and the machine), nothing
else: ``render.py`` makes every table from the JSON files.
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
from _models import MB as MB

import optax_accum

# Where `make bench` leaves its results (render.py reads them there).
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --- Arguments. -----------------------------------------------------------


def benchmark_parser(description: str) -> argparse.ArgumentParser:
  """A script's parser; its --help shows every default."""
  return argparse.ArgumentParser(
    description=description,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )


def add_run_arguments(
  parser: argparse.ArgumentParser, *, rounds: int, warmup: int, repeats: int
) -> None:
  """--rounds, --warmup, --repeats and --out, with a script's defaults."""
  parser.add_argument("--rounds", type=positive_int, default=rounds)
  parser.add_argument("--warmup", type=positive_int, default=warmup)
  parser.add_argument("--repeats", type=positive_int, default=repeats)
  parser.add_argument("--out", default=str(RESULTS_DIR))


def positive_int(text: str) -> int:
  """An integer >= 1 (an argparse type)."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"need an integer >= 1, got {text!r}")
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


def csv_list() -> Callable[[str], list[str]]:
  """An argparse type: ``"a,b"`` -> ``["a", "b"]``."""

  def parse(text: str) -> list[str]:
    return [x for x in text.split(",") if x]

  parse.__name__ = "list"
  return parse


def set_cpu_devices(count: int) -> None:
  """Simulated CPU devices; must run before anything touches a device."""
  jax.config.update("jax_num_cpu_devices", count)


# --- Timing. --------------------------------------------------------------


def timed_call(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
  """Seconds for one call, waiting for every output; returns the outputs too."""
  start = time.perf_counter()
  out = fn(*args)
  jax.block_until_ready(out)
  return time.perf_counter() - start, out


def interleaved(
  turns: dict[str, Callable[[int], Any]],
  *,
  rounds: int,
  warmup: int,
  advance: Callable[[], None] = lambda: None,
) -> dict[str, list[Any]]:
  """Runs every variant's turn once a round, rotating who goes first; the
  measurements of the `rounds` rounds after `warmup` untimed ones, per
  name. Interleaving puts every variant under the same machine load."""
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


# --- Memory, the machine, the results file. --------------------------------


def tree_bytes(tree: Any) -> int:
  """Total bytes of the arrays in `tree`."""
  return sum(
    int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )


def compiled_memory(compiled: Any) -> dict[str, int]:
  """``memory_analysis()`` in bytes, with the footprint: argument + temp +
  output - alias (the donated state counts once)."""
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


def machine_info() -> dict[str, Any]:
  """Where and with what the numbers were measured."""
  device = jax.devices()[0]
  versions = {}
  for name in ("flax", "equinox"):
    try:
      versions[name] = __import__(name).__version__
    except ImportError:
      versions[name] = None
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
    **versions,
    "optax_accum": optax_accum.__version__,
    "backend": jax.default_backend(),
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "load_average": list(os.getloadavg())
    if hasattr(os, "getloadavg")
    else None,
  }


def write_json(out_dir: str | os.PathLike, stem: str, payload: Any) -> Path:
  """Writes `<out_dir>/<stem>.json`; returns its path."""
  path = Path(out_dir) / f"{stem}.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=1, default=_json_default))
  return path


def _json_default(x: Any) -> Any:
  if isinstance(x, (np.generic, jax.Array)):
    return np.asarray(x).item()
  return str(x)
