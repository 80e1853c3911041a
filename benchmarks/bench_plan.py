"""The planner against the truth: ``optax_accum.plan_micro_batch``'s choice
vs the largest fitting micro-batch found by compiling every candidate.

Three models (``_plan_models``: an MLP, a decoder-only transformer, a
convolutional net) x two targets: this machine's CPU with a memory limit
(``--cpu-limit-gib``; JAX reports none for a CPU) and one H100 compiled
without the device (60 GiB of its 80, JAX's default share). For each: the
planner's micro-batch and compile count (against its bound,
``ceil(log2(G)) + 2``) and seconds (``--repeats`` cold runs: jit caches
cleared), then every divisor of the global batch compiled once to find the
true largest that fits. Compiles are timed; nothing else is::

  JAX_PLATFORMS=cpu PYTHONPATH=.venv/accel python benchmarks/bench_plan.py

It writes ``bench_plan.json``; its table is ``render.py``'s.
"""

import math
import sys
import time
from typing import Any

import _common
import _plan_models
import jax

import optax_accum
from optax_accum import _plan

GIB = 2**30

# Global batches that do not fit the CPU's 4 GiB in one step (the
# transformer's fits an H100).
MODELS = {
  "mlp": lambda: _plan_models.mlp(global_batch=2**22),
  "transformer": lambda: _plan_models.transformer(global_batch=2**13),
  "convnet": lambda: _plan_models.convnet(global_batch=2**17),
}


def _plan_once(model, target, limit) -> tuple[Any, float]:
  jax.clear_caches()
  start = time.perf_counter()
  plan = optax_accum.plan_micro_batch(
    model.step,
    model.args_for,
    model.global_batch,
    target=target,
    memory_limit=limit,
  )
  return plan, time.perf_counter() - start


def _truth(model, target, budget: int) -> tuple[int, int, float]:
  """(largest fitting micro-batch, compiles, seconds), compiling every
  divisor of the global batch."""
  where = _plan.where_to_compile(target, 1)
  sizes = _plan._divisors(model.global_batch, 1)
  start, best = time.perf_counter(), 0
  for n in sizes:
    args = _plan.placed(model.args_for(n), where.mesh)
    memory = model.step.lower(*args).compile().memory_analysis()
    if _plan._peak(memory) <= budget:
      best = n
  return best, len(sizes), time.perf_counter() - start


def measure(name: str, target: str | None, limit: int | None, repeats: int):
  model = MODELS[name]()
  runs = [_plan_once(model, target, limit) for _ in range(repeats)]
  plan = runs[0][0]
  truth, all_compiles, all_seconds = _truth(model, target, plan.budget_bytes)
  row = {
    "model": name,
    "target": target or "cpu",
    "global_batch": model.global_batch,
    "limit_bytes": plan.limit_bytes,
    "micro_batch": plan.micro_batch,
    "every_k": plan.every_k,
    "true_micro_batch": truth,
    "compiles": plan.compiles,
    "bound": math.ceil(math.log2(model.global_batch)) + 2,
    "seconds": _common.spread([s for _, s in runs]),
    "all_compiles": all_compiles,
    "all_seconds": all_seconds,
  }
  print(
    f"{name:12s} {row['target']:5s} plan {plan.micro_batch} (true {truth})"
    f" in {plan.compiles} compiles, {row['seconds']['median']:.1f} s;"
    f" all {all_compiles} in {all_seconds:.1f} s",
    flush=True,
  )
  return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = _common.benchmark_parser(__doc__.split("\n\n")[0])
  parser.add_argument(
    "--models", default=",".join(MODELS), type=_common.csv_list()
  )
  parser.add_argument("--targets", default="cpu,h100", type=_common.csv_list())
  parser.add_argument("--cpu-limit-gib", type=float, default=4.0)
  parser.add_argument("--repeats", type=_common.positive_int, default=3)
  parser.add_argument("--out", default=str(_common.RESULTS_DIR))
  args = parser.parse_args(argv)
  if set(args.targets) - {"cpu"} and jax.config.jax_platforms != "cpu":
    sys.exit("bench_plan compiles for an H100: run it with JAX_PLATFORMS=cpu")
  rows = []
  for target in args.targets:
    limit = int(args.cpu_limit_gib * GIB) if target == "cpu" else None
    for name in args.models:
      rows.append(
        measure(name, None if target == "cpu" else target, limit, args.repeats)
      )
  payload = {
    "benchmark": "bench_plan",
    "machine": _common.machine_info(),
    "args": vars(args),
    "rows": rows,
  }
  print(f"wrote {_common.write_json(args.out, 'bench_plan', payload)}")
  return payload


if __name__ == "__main__":
  main()
