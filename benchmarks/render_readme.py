"""Writes the figures of benchmarks/README.md from benchmarks/results/*.json.

Every number in the README's performance guide sits between a pair of
markers, ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``, and is
rendered here from the JSON that ``make bench`` (the scripts with their
defaults) leaves in ``benchmarks/results/``: nobody types a figure by hand,
and ``tests/test_benchmarks_smoke.py`` fails when the README and the results
disagree.

Usage::

  python benchmarks/render_readme.py          # rewrite the README
  python benchmarks/render_readme.py --check  # exit 1 if it is stale
"""

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
RESULTS = HERE / "results"
MB = 2**20

BLOCK = re.compile(
  r"(<!-- results:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)",
  re.S,
)


def _spread(s: dict[str, Any] | None, digits: int = 2, suffix: str = "") -> str:
  if not s or s.get("median") is None:
    return "-"
  text = f"{s['median']:.{digits}f}{suffix}"
  if len(s["values"]) > 1:
    text += f" ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
  return text


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _machine(payload: dict[str, Any]) -> str:
  m, a = payload["machine"], payload["args"]
  return (
    f"Measured {m['timestamp'][:10]} on {m['cpu_count']} CPUs ({m['backend']}),"
    f" jax {m['jax']}, optax {m['optax']}; {a['repeats']} repeats of"
    f" {a['rounds']} rounds; median (min-max over repeats).\n"
  )


def bench_step(payload: dict[str, Any]) -> str:
  """The rows of the largest k at the largest size."""
  k = max(x["k"] for x in payload["results"])
  size = max(x["size_mb"] for x in payload["results"])
  rows = []
  for r in payload["results"]:
    if (r["k"], r["size_mb"]) != (k, size):
      continue
    ratio = r["spread"]["ratios"]
    rows.append(
      [
        f"{r['optimizer']}, {r['dtype']}, {r['param_bytes'] / MB:g} MB",
        _spread(ratio["micro_vs_floor"]),
        _spread(ratio["emit_vs_plain"]),
        f"{r['ratios']['extra_memory']:.2f}",
        _spread(ratio["multisteps_speedup"], suffix="x"),
        f"{r['ratios']['memory_vs_multisteps']:.2f}",
      ]
    )
  targets = "".join(
    f"- {t['what']} {t['target']}\n" for t in payload["targets"].values()
  )
  return (
    _machine(payload)
    + f"\nk={k}:\n\n"
    + _table(
      [
        "inner, params",
        "micro-step / floor",
        "emit / plain",
        "extra memory / acc. bytes",
        "MultiSteps micro / ours",
        "footprint / MultiSteps",
      ],
      rows,
    )
    + "\nTargets:\n\n"
    + targets
  )


def bench_train(payload: dict[str, Any]) -> str:
  rows = [
    [
      str(r["k"]),
      name,
      "over budget"
      if m["skipped"]
      else _spread(m.get("vs_big_batch_spread"), suffix="x"),
      f"{m['memory']['footprint'] / MB:.0f}",
    ]
    for r in payload["throughput"]
    for name, m in r["methods"].items()
  ]
  eq = payload["equivalence"]
  return (
    _machine(payload)
    + "\n"
    + _table(["k", "method", "tokens/s vs big batch", "footprint MB"], rows)
    + f"\nAfter {eq['steps']} steps of k={eq['k']}, max |params - big batch"
    f" params|: accumulate {eq['accumulate']['max_abs_diff']:.1e}.\n"
  )


def bench_comm(payload: dict[str, Any]) -> str:
  rows = [
    [
      r["recipe"],
      str(r["k"]),
      r["ops_label"],
      f"{r['bytes_per_step'] / MB:.2f}",
      _spread(r["step_ms"], 1),
      _spread(r["time_ratio_vs_baseline"]),
    ]
    for r in payload["results"]
  ]
  c = payload["config"]
  return (
    _machine(payload)
    + f"{c['devices']} simulated devices, {c['param_bytes'] / MB:.2f} MiB of"
    " params:\n\n"
    + _table(
      [
        "recipe",
        "k",
        "all-reduces / step",
        "MiB / step",
        "ms / step",
        "time vs psum_each",
      ],
      rows,
    )
  )


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
  "bench_step": bench_step,
  "bench_train": bench_train,
  "bench_comm": bench_comm,
}


def render(text: str, results: Path = RESULTS) -> str:
  """`text` with every results block rendered from its JSON file."""

  def block(match: re.Match) -> str:
    name = match.group("name")
    path = results / f"{name}.json"
    if not path.is_file():
      body = f"(no `{path.name}` yet: run `make bench`)\n"
    else:
      body = RENDERERS[name](json.loads(path.read_text()))
    return f"{match.group(1)}{body}{match.group(4)}"

  return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--check",
    action="store_true",
    help="exit with status 1 if the README differs from the results",
  )
  args = parser.parse_args(argv)
  text = README.read_text()
  rendered = render(text)
  if args.check:
    if rendered != text:
      print("benchmarks/README.md is stale: run benchmarks/render_readme.py")
      return 1
    return 0
  README.write_text(rendered)
  return 0


if __name__ == "__main__":
  sys.exit(main())
