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

from optax_accum import _accumulate, _control, _forms, _inner  # noqa: E402


def _plain_lax_cond(pred, true_fun, false_fun, *operands):
  """Before: a predicate conditional, which XLA:GPU turns into selects."""
  return lax.cond(pred, true_fun, false_fun, *operands)


def _holding_branch_last(pred, true_fun, false_fun, *operands):
  """The holding branch as HLO branch 1: XLA copies what it passes through."""
  index = 1 - jax.numpy.asarray(pred).astype(jax.numpy.int32)
  return _control.switch(index, (true_fun, false_fun), *operands)


def _cpu_form_everywhere(*args, cpu, accelerator, gpu=None):
  """The CPU form on an accelerator: the add reads the accumulator through a
  select (leftovers not read), which keeps it out of the GEMMs."""
  del accelerator, gpu
  return cpu(*args)


_reduce = _inner.reduce_cycle


def _reduction_after_the_whole_gradient(
  config, engine, inner, cycle, *, per_leaf
):
  """Every leaf's reduction waits for the whole accumulator."""
  cycle = cycle._replace(acc=lax.optimization_barrier(cycle.acc))
  return _reduce(config, engine, inner, cycle, per_leaf=per_leaf)


def _narrow_updates_shared(config, engine, inner, cycle):
  """Before issue 52: bf16 updates through the float32 accumulator's
  buffer, applied after the conditional."""
  return _forms.decide(config, engine, inner, cycle, shares=True)


_add = _accumulate._add
_ADDED: dict[str, Any] = {}


def _add_kept_apart(config, engine, state, grads, call, *, params):
  """The library's add, with its terms kept for :func:`_add_in_branches`
  (which leaves the add made here unused: XLA drops it)."""
  _ADDED.update(start=state.acc_buffer, grads=grads)
  return _add(config, engine, state, grads, call, params=params)


_apply_inside = _forms.apply_inside


def _add_in_branches(config, engine, inner, cycle):
  """The route to issue 52's 1.05 that costs memory: the library's own
  `_forms.apply_inside`, whose switch gets the add's terms as operands and makes
  the sum inside every branch (the default call: no weight, no skip), so
  that the updating branch fuses the add into the optimizer's kernels, as
  the static step does, and every gradient is an operand of the switch."""
  switch = _control.switch
  start, grads = _ADDED["start"], _ADDED["grads"]

  def summed(branch):
    def run(cycle, start, grads):
      acc = jax.tree.map(
        lambda a, g: _accumulate.add_term(a, g, ops=engine), start, grads
      )
      return branch(cycle._replace(acc=acc))

    return run

  def switch_with_the_add(index, branches, cycle):
    _control.switch = switch  # its own switch only: the branches' run plain
    return switch(index, [summed(b) for b in branches], cycle, start, grads)

  _control.switch = switch_with_the_add
  try:
    return _apply_inside(config, engine, inner, cycle)
  finally:
    _control.switch = switch


# name -> [(module, attribute, replacement)]
PLANTS = {
  # Selects at every size on a GPU, and a conditional at every size.
  "selects_everywhere": (_control, "SELECTS_BELOW_BYTES", 1 << 62),
  "conditional_everywhere": (_control, "SELECTS_BELOW_BYTES", 0),
  # Selects under axis_name too (issue 70: the reduction on every call).
  "selects_with_axis_name": (
    _forms,
    "decides_with_selects",
    lambda axis_name, acc: True,
  ),
  # The three-branch switch of `apply_inside` on every jax, 0.10.2's too.
  "switch_on_every_xla": (_control, "LATER_BRANCHES_COPY", False),
  "add_in_branches": [
    (_accumulate, "_add", _add_kept_apart),
    (_forms, "apply_inside", _add_in_branches),
  ],
  "narrow_updates_shared": (
    _forms,
    "apply_inside",
    _narrow_updates_shared,
  ),
  "lax_cond": (_control, "cond", _plain_lax_cond),
  "holding_branch_last": (_control, "cond", _holding_branch_last),
  "cpu_form": (_control, "per_backend", _cpu_form_everywhere),
  "one_reduction": (
    _inner,
    "reduce_cycle",
    _reduction_after_the_whole_gradient,
  ),
}


@contextlib.contextmanager
def planted(name: str | None):
  if name is None:
    yield
    return
  plants = PLANTS[name]
  plants = plants if isinstance(plants, list) else [plants]
  originals = [(m, a, getattr(m, a)) for m, a, _ in plants]
  for module, attribute, replacement in plants:
    setattr(module, attribute, replacement)
  try:
    yield
  finally:
    for module, attribute, original in originals:
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
