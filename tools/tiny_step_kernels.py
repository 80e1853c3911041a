"""What one call of the tiny model's step launches on an H100: the kernels
(fusions), copies and conditionals at the top level of the compiled
program, for ours (traced, applied with ``optax_accum.apply_updates``) and
``optax.MultiSteps`` (applied with ``optax.apply_updates``). Compiled
without the device (``benchmarks/_compiled_steps.py``, width 128, 4 layers,
k=8): counts, never a time. The GPU loop page cites it where the tiny model
is bound by the host's dispatch (``benchmarks/render.py``, ``GPU_REASONS``).

Usage (the project's .venv python, from the repository root, with the
accelerator compilers that ``make test`` installs)::

  JAX_PLATFORMS=cpu PYTHONPATH=.venv/accel:. python tools/tiny_step_kernels.py
"""

import collections
import sys
from pathlib import Path

from optax_accum.inspect._hlo import HloModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _compiled_steps as cs  # noqa: E402  (benchmarks/)

STEPS = {
  "ours": ("accumulate", "accum"),
  "optax.MultiSteps": ("MultiSteps", "optax"),
}


def top_level_counts(variant: str, apply: str) -> dict[str, int]:
  case = cs.Case(
    target="h100", variant=variant, apply=apply, width=128, layers=4, batch=8
  )
  module = HloModule(cs.compile_case(case).as_text())
  ops = collections.Counter(i.opcode for i in module.computations[module.entry])
  return {
    op: ops[op] for op in ("fusion", "copy", "conditional", "custom-call")
  }


if __name__ == "__main__":
  for name, (variant, apply) in STEPS.items():
    print(name, top_level_counts(variant, apply))
