"""bench_comm's sharded layouts: bytes per optimizer step, per mesh axis.

Three ways to train with params sharded, 8 devices, plain ``jit`` on an
explicit mesh (the steps of ``bench_compiled.py``, engines ``fsdp``,
``fsdp1d`` and ``hsdp``: 4 dense layers, adam):

* ``fsdp``: ``("replica", "fsdp") = (2, 4)``, params sharded over
  ``"fsdp"``, ``accumulate(inner, k)``: the gradient is reduced over every
  device on every call (no deferral);
* ``fsdp1d``: one axis ``"data"`` of 8, params sharded over it,
  ``accumulate(inner, k, axis_name="data")``: each device holds a full-size
  partial sum, reduced once per optimizer step;
* ``hsdp``: the ``(2, 4)`` mesh, ``local_value_and_grad(...,
  axis_name="replica")`` and ``accumulate(inner, k, axis_name="replica")``:
  reduce-scattered over ``"fsdp"`` on every call, all-reduced across
  ``"replica"`` once per optimizer step, one shard per device.

"wire" is ``accumulate(reduce_dtype=...)``: the dtype the deferred reduction
crosses devices in. Each step is compiled once (``every_k=8``) for each
target, without a device for the accelerators, and read with
``optax_accum.inspect.collectives``: a collective's bytes (per device) count ``k``
times per optimizer step when it runs on every call, once in the emitting
branch and ``k - 1`` times in a branch that holds. Each reduction is filed
under the mesh axes its device groups span.
"""

import math
from collections.abc import Sequence
from typing import Any

import _compiled_steps as steps
import bench_compiled
import jax

LAYOUTS = ("fsdp", "fsdp1d", "hsdp")
WIRES = ("f32", "bf16")
REDUCTIONS = ("all-reduce", "reduce-scatter")
# Reductions under this many bytes are scalars (the loss, a token count):
# left out of the tables, kept in the JSON's collectives.
SMALL_BYTES = 1024


def cases(target: str, width: int) -> list[steps.Case]:
  """The compiled steps of one target: each layout, each wire dtype of a
  deferred reduction."""
  out = []
  for layout in LAYOUTS:
    for wire in WIRES if layout != "fsdp" else ("f32",):
      out.append(
        steps.Case(
          target=target,
          engine=layout,
          apply="accum",
          width=width,
          reduce_dtype="bf16" if wire == "bf16" else "",
        )
      )
  return out


def _accumulator_bytes(state: Any) -> int:
  """The accumulator's bytes on one device, from its shardings."""
  return sum(
    math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    for leaf in jax.tree.leaves(state.acc_grads)
  )


def measure(case: steps.Case) -> dict[str, Any]:
  """Collectives (with the axes they span) and accumulator bytes."""
  step, args = steps.build(case)
  options = steps.compiler_options(case) or None
  compiled = step.lower(*args).compile(compiler_options=options)
  return {
    "target": case.target,
    "layout": case.engine,
    "wire": case.reduce_dtype or "f32",
    "param_bytes": steps.param_bytes(case),
    "accumulator_bytes_per_device": _accumulator_bytes(args[1]),
    "collectives": bench_compiled.collectives_with_axes(case, compiled),
  }


def _by_axes(collectives: list[dict[str, Any]], where: str) -> dict[str, int]:
  """Reduced bytes of the collectives that run `where`, by the mesh axes
  their groups span ("replica + fsdp": both)."""
  out: dict[str, int] = {}
  for c in collectives:
    if (
      c["opcode"] in REDUCTIONS
      and c["where"] == where
      and c["bytes"] >= SMALL_BYTES
    ):
      axes = " + ".join(c["axes"]) or "none"
      out[axes] = out.get(axes, 0) + c["bytes"]
  return out


def summary(facts: dict[str, Any], ks: Sequence[int]) -> dict[str, Any]:
  """Reduced bytes on every call and once per optimizer step (by axes),
  the total per optimizer step of each k, all-gathered bytes per call."""
  every, once, held = (
    _by_axes(facts["collectives"], w)
    for w in ("every call", "emitting", "other")
  )
  gathered = sum(
    c["bytes"]
    for c in facts["collectives"]
    if c["opcode"] == "all-gather" and c["where"] == "every call"
  )
  return {
    "reduced_every_call": every,
    "reduced_once": once,
    "reduced_per_step": {
      str(k): {
        axes: k * every.get(axes, 0)
        + once.get(axes, 0)
        + (k - 1) * held.get(axes, 0)
        for axes in sorted({*every, *once, *held})
      }
      for k in ks
    },
    "gathered_per_call": gathered,
    "deferred_opcodes": sorted(
      {
        c["opcode"]
        for c in facts["collectives"]
        if c["where"] == "emitting" and c["bytes"] >= SMALL_BYTES
      }
    ),
  }


def rows(
  targets: Sequence[str], ks: Sequence[int], width: int
) -> tuple[list[dict[str, Any]], dict[str, str]]:
  """Every (target, layout, wire); targets that could not be compiled (no
  accelerator compilers) map to the reason."""
  out, skipped = [], {}
  for target in targets:
    try:
      measured = [measure(case) for case in cases(target, width)]
    except Exception as e:  # noqa: BLE001 - reported, the rest goes on
      skipped[target] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      continue
    out += [{**facts, **summary(facts, ks)} for facts in measured]
  return out, skipped
