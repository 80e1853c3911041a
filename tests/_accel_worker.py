"""Compiles steps for accelerators without the devices; writes their facts.

Run by ``tests/test_accelerators.py`` in a subprocess, with
``JAX_PLATFORMS=cpu`` and the accelerator compilers on ``PYTHONPATH`` (see
``optax_accum/targets/__init__.py``)::

  python tests/_accel_worker.py REQUESTS.json FACTS.json

``REQUESTS`` maps a key to ``{"case": {...}, "plant": name or null}``: the
fields of a ``benchmarks/bench_compiled.py`` ``Case``, and optionally a
fault to plant first (:data:`PLANTS`), so that the tests can show that each
check fails on the program it guards against. ``FACTS`` maps each key to
``bench_compiled.measure``'s facts.
"""

import contextlib
import json
import pathlib
import sys
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_compiled  # noqa: E402
import jax  # noqa: E402
from jax import lax  # noqa: E402

from optax_accum import _accumulate, _control  # noqa: E402


def _plain_lax_cond(pred, true_fun, false_fun, *operands):
  """Before: a predicate conditional, which XLA:GPU turns into selects."""
  return lax.cond(pred, true_fun, false_fun, *operands)


def _holding_branch_last(pred, true_fun, false_fun, *operands):
  """The holding branch as HLO branch 1: XLA copies what it passes through."""
  index = 1 - jax.numpy.asarray(pred).astype(jax.numpy.int32)
  return _control.switch(index, (true_fun, false_fun), *operands)


def _cpu_form_everywhere(*args, cpu, accelerator):
  """The CPU form on an accelerator: the add reads the accumulator through a
  select (leftovers not read), which keeps it out of the GEMMs."""
  del accelerator
  return cpu(*args)


_reduce = _accumulate._reduce


def _reduction_after_the_whole_gradient(
  config, engine, inner, cycle, *, per_leaf
):
  """Every leaf's reduction waits for the whole accumulator."""
  cycle = cycle._replace(acc=lax.optimization_barrier(cycle.acc))
  return _reduce(config, engine, inner, cycle, per_leaf=per_leaf)


def _narrow_updates_shared(config, engine, inner, cycle):
  """Before issue 52: bf16 updates through the float32 accumulator's
  buffer, applied after the conditional."""
  return _accumulate._decide(config, engine, inner, cycle, shares=True)


# name -> (module, attribute, replacement)
PLANTS = {
  "narrow_updates_shared": (
    _accumulate,
    "_apply_inside",
    _narrow_updates_shared,
  ),
  "lax_cond": (_control, "cond", _plain_lax_cond),
  "holding_branch_last": (_control, "cond", _holding_branch_last),
  "cpu_form": (_accumulate, "_per_backend", _cpu_form_everywhere),
  "one_reduction": (
    _accumulate,
    "_reduce",
    _reduction_after_the_whole_gradient,
  ),
}


@contextlib.contextmanager
def planted(name: str | None):
  if name is None:
    yield
    return
  module, attribute, replacement = PLANTS[name]
  original = getattr(module, attribute)
  setattr(module, attribute, replacement)
  try:
    yield
  finally:
    setattr(module, attribute, original)


def main(requests_path: str, facts_path: str) -> None:
  requests: dict[str, Any] = json.loads(pathlib.Path(requests_path).read_text())
  # Requests may name the same case (spelled with or without its
  # defaults): each distinct (case, plant) compiles once.
  measured: dict[tuple, dict] = {}
  facts = {}
  for key, request in requests.items():
    case = bench_compiled.Case(**request["case"])
    plant = request.get("plant")
    if (case, plant) not in measured:
      with planted(plant):
        measured[case, plant] = bench_compiled.measure(case)
    facts[key] = measured[case, plant]
  pathlib.Path(facts_path).write_text(json.dumps(facts))


if __name__ == "__main__":
  main(*sys.argv[1:])
