"""Why the tiny model's traced step dispatched slower than
``optax.MultiSteps``' on a GPU (issue 61): ``tiny_call_probe.py`` under each
variant that could matter, in one command of at most 3 minutes.

Each variant is one run of the probe in a process of its own (XLA reads its
flags when the backend starts): the program form (``--form`` of the probe)
and XLA:GPU's CUDA command buffers:

* ``library``: as shipped (a small state decides with selects);
* ``conditionals``: the two conditionals of the step before issue 61,
  with command buffers as XLA sets them (conditionals recorded as CUDA-graph
  conditional nodes), without command buffers, and with command buffers
  that leave conditionals out;
* ``one_switch``: one conditional instead of two.

Writes OUT/tiny_variants.json (every run's probe output, rewritten after
each) and prints a table: per variant and k, each loop's median dispatch
per call.

Usage::

  python benchmarks/tiny_variants.py OUT [--rounds 5] [--calls 400]

On CPU (a smoke run; the flags are XLA:GPU's and change nothing there):
``JAX_PLATFORMS=cpu python benchmarks/tiny_variants.py OUT --rounds 1
--calls 2``.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
# XLA:GPU's default command buffer types (jax 0.11-0.12), with and without
# CONDITIONAL; empty: no command buffers.
WITH_CONDITIONALS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL"
WITHOUT_CONDITIONALS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
VARIANTS = {
  "library": ("library", None),
  "conditionals": ("conditionals", None),
  "conditionals, no command buffers": ("conditionals", ""),
  "conditionals, not in command buffers": (
    "conditionals",
    WITHOUT_CONDITIONALS,
  ),
  "conditionals, in command buffers (explicit)": (
    "conditionals",
    WITH_CONDITIONALS,
  ),
  "one_switch": ("one_switch", None),
}


def run(form: str, command_buffer: str | None, args) -> dict:
  env = dict(os.environ)
  if command_buffer is not None:
    flag = f"--xla_gpu_enable_command_buffer={command_buffer}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
  argv = [sys.executable, str(HERE / "tiny_call_probe.py"), "--form", form]
  argv += ["--rounds", str(args.rounds), "--calls", str(args.calls)]
  argv += ["--k", *map(str, args.k)]
  out = subprocess.run(
    argv, env=env, capture_output=True, text=True, check=False
  )
  if out.returncode != 0:
    return {"error": out.stderr[-2000:]}
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out", type=pathlib.Path)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=400)
  p.add_argument("--k", type=int, nargs="+", default=[2, 8])
  p.add_argument("--variants", nargs="+", choices=list(VARIANTS))
  args = p.parse_args()
  args.out.mkdir(parents=True, exist_ok=True)
  results, start = {}, time.monotonic()
  for name in args.variants or VARIANTS:
    form, command_buffer = VARIANTS[name]
    results[name] = run(form, command_buffer, args)
    results[name]["seconds"] = round(time.monotonic() - start, 1)
    (args.out / "tiny_variants.json").write_text(json.dumps(results))
    print(f"{name}: done at {results[name]['seconds']} s", flush=True)
  for name, r in results.items():
    for k, loops in sorted(r.get("results", {}).items()):
      cells = [
        f"{loop} {statistics.median(v['dispatch_s']) * 1e6:.1f}"
        for loop, v in sorted(loops.items())
      ]
      print(f"{name:45s} k={k}: " + ", ".join(cells) + " (us per call)")
    if "error" in r:
      print(f"{name}: FAILED\n{r['error']}")
  sys.exit(1 if any("error" in r for r in results.values()) else 0)


if __name__ == "__main__":
  main()
