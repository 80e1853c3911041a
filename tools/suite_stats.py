"""Where a test run's CPU seconds go: compiling, or everything else.

Run the suite with both measuring switches set (issue 40), then this::

  OPTAX_ACCUM_COMPILE_STATS=/tmp/cpu.jsonl \\
  OPTAX_ACCUM_ACCEL_STATS=/tmp/accel.jsonl make test
  python tools/suite_stats.py /tmp/cpu.jsonl /tmp/accel.jsonl

The first file has a line per pytest process (``tests/conftest.py``): its
CPU seconds, jax's compile events inside it, and its subprocesses' CPU
seconds. The second has a line per script the compile servers ran
(``tests/_accel_server.py``, which compiles for an H100 and a TPU without
them): a server's CPU seconds so far. Every leg of ``make test`` appends to
the first file; the table sums all of them. Compile seconds are
``backend_compile_duration`` (XLA, or a read of the persistent cache).
"""

import json
import sys


def main(cpu_path: str, accel_path: str | None = None) -> None:
  rows = [json.loads(line) for line in open(cpu_path)]
  own = sum(r["cpu_s"] for r in rows)
  children = sum(r["children_cpu_s"] for r in rows)

  def event(name: str, field: str) -> float:
    return sum(r["events"].get(name, {}).get(field, 0) for r in rows)

  compile_s = event("/jax/core/compile/backend_compile_duration", "seconds")
  compiles = event("/jax/core/compile/backend_compile_duration", "count")
  hits = event("/jax/compilation_cache/cache_retrieval_time_sec", "count")
  lower_s = event("/jax/core/compile/jaxpr_to_mlir_module_duration", "seconds")
  trace_s = event("/jax/core/compile/jaxpr_trace_duration", "seconds")
  by_name: dict[str, float] = {}
  for r in rows:
    for name, seconds in r.get("compile_s_by_name", {}).items():
      by_name[name] = by_name.get(name, 0.0) + seconds
  accel = 0.0
  if accel_path:
    last = {}  # a server's CPU seconds grow with each script: keep its last
    for line in open(accel_path):
      record = json.loads(line)
      last[record["pid"]] = record["cpu_s"]
    accel = sum(last.values())
  print(f"pytest processes: {len(rows)}, {own:.0f} CPU s in them")
  print(
    f"  XLA compiles for the CPU: {compile_s:.0f} s"
    f" ({compiles} compiles, {hits} of them read from the persistent cache)"
  )
  print(f"  lowering to MLIR: {lower_s:.0f} s, tracing: {trace_s:.0f} s")
  rest = own - compile_s - lower_s - trace_s
  print(f"  the rest (running, Python): {rest:.0f} s")
  top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
  print("  compile seconds by program name (jit_add, ...: eager operations):")
  for name, seconds in top:
    print(f"    {seconds:7.1f} {name}")
  print(f"subprocesses waited for: {children:.0f} CPU s")
  if accel_path:
    # Never waited for (each ends with its pytest process): apart.
    print(f"the accelerator compile servers: {accel:.0f} CPU s")


if __name__ == "__main__":
  main(*sys.argv[1:])
