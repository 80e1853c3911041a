"""Plans steps for accelerators without the devices; writes what it found.

Run by ``tests/test_plan.py`` in a subprocess, with ``JAX_PLATFORMS=cpu``
and the accelerator compilers on ``PYTHONPATH``::

  python tests/_plan_worker.py FACTS.json

One H100: an MLP whose global batch of 2**23 examples needs more than
80 GB in one step; and the MLP with and without ``jax.checkpoint`` on its
layers. (A transformer compiles 10 to 25 s a program for an H100 on the
2-core box, an MLP 2 to 4 s; the planner does not look inside the step, and
``make bench``'s ``benchmarks/bench_plan.py`` plans the transformer for an
H100.)
8 H100s: the MLP, 2**24 examples a step. A TPU v5e 2x2: a small convolutional net whose
global batch XLA:TPU refuses to compile for want of memory. For the H100, the
next larger divisor than the plan's is compiled here again, apart from the
planner; elsewhere the planner's own table gives its peak.
"""

import json
import pathlib
import sys

# tests/_common (this script's folder) before benchmarks/ goes on the path,
# which has a _common of its own.
import _common

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _plan_models  # noqa: E402
import jax  # noqa: E402

import optax_accum  # noqa: E402
from optax_accum import _plan  # noqa: E402


def _peak_here(model, target: str, n: int) -> int:
  """The compiled peak of `model`'s step for `n` examples on `target`."""
  where = _plan.where_to_compile(target, None)
  return _common.compiled_peak(
    model.step, _plan.placed(model.args_for(n), where.mesh)
  )


def _facts(model, target: str, *, check_next: bool = False) -> dict:
  plan = optax_accum.plan_micro_batch(
    model.step, model.args_for, model.global_batch, target=target
  )
  print(plan, flush=True)
  by_size = {c.micro_batch: c for c in plan.candidates}
  whole = by_size.get(model.global_batch)
  sizes = _plan._divisors(model.global_batch, plan.candidates[0].micro_batch)
  larger = [d for d in sizes if d > plan.micro_batch]
  return {
    "global_batch": model.global_batch,
    "micro_batch": plan.micro_batch,
    "every_k": plan.every_k,
    "peak_bytes": plan.peak_bytes,
    "limit_bytes": plan.limit_bytes,
    "compiles": plan.compiles,
    "estimated_step_seconds": plan.estimated_step_seconds["step"],
    "whole_batch_peak": whole and whole.peak_bytes,
    "whole_batch_fits": whole is not None and whole.fits,
    "next_larger_peak": larger and by_size[larger[0]].peak_bytes,
    "next_larger_peak_here": (
      larger and check_next and _peak_here(model, target, larger[0])
    ),
    "seconds": sum(c.compile_seconds for c in plan.candidates),
  }


def _variants_facts() -> dict:
  """jax.checkpoint on the layers against none, on one H100."""
  plain = _plan_models.mlp(global_batch=2**22)
  remat = _plan_models.mlp(global_batch=2**22, remat=True)
  plan = optax_accum.plan_micro_batch(
    None,
    plain.args_for,
    plain.global_batch,
    target="h100",
    memory_limit=40 * 2**30,  # `memory_limit` overrides the target's.
    variants={"plain": plain.step, "remat": remat.step},
  )
  print(plan, flush=True)
  best = {}
  for c in plan.candidates:
    if c.fits:
      best[c.variant] = max(best.get(c.variant, 0), c.micro_batch)
  return {
    "variant": plan.variant,
    "micro_batch": plan.micro_batch,
    "best": best,
    "compiles": plan.compiles,
    "limit_bytes": plan.limit_bytes,
    "estimates": plan.estimated_step_seconds,
  }


def main(out: str) -> None:
  assert jax.config.jax_platforms == "cpu"
  facts = {
    "h100": _facts(
      _plan_models.mlp(global_batch=2**23), "h100", check_next=True
    ),
    "h100x8": _facts(_plan_models.mlp(global_batch=2**24), "h100x8"),
    "v5e_2x2": _facts(_plan_models.convnet(global_batch=2**18), "v5e_2x2"),
    "variants": _variants_facts(),
  }
  pathlib.Path(out).write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
  main(sys.argv[1])
