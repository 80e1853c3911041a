"""Helpers shared by the benchmark scripts.

Machine information, compiled memory, per-call timing and the three output
files (JSON, Markdown, PNG). Kept here so that both scripts measure memory and
time the same way; each script stays runnable on its own
(``python benchmarks/bench_step.py``).
"""

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
