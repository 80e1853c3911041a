"""Compiled steps for CPU, an H100 and a TPU v5e, read without the devices.

Each variant's micro-step and emitting call is compiled ahead of time for
the target (``optax_accum.targets``: the CUDA plugin and libtpu compile for
an H100 or a TPU slice on a machine that has neither) and read from the
compiled program (``tools/program.py``): conditionals kept, whether an
optimizer op runs on every call, the kernels a micro-step and an emitting
call run and their bytes, parameter-sized copies, whether each
weight-gradient GEMM adds into the accumulator itself, compiled memory, the
collectives and, on an H100, whether the conditionals run inside CUDA
command buffers. Nothing is timed: every figure is a byte count or a
structure, the same on any machine.

The model: ``--layers`` dense ``--width``-square tanh layers, a batch of
``--batch`` rows per device, adam, ``every_k=8``. Variants: ``plain`` (the
inner optimizer alone; data parallel over the devices), ``floor`` (the
gradient added into a donated accumulator, nothing else), ``accumulate``
with ``optax.apply_updates`` and with ``optax_accum.apply_updates``, the
static cycle (``update(..., emit=False)`` / ``emit=True``),
``optax.MultiSteps`` and ``chain(adam, apply_every(k))``.

Needs the accelerator compilers on the path and ``JAX_PLATFORMS=cpu``::

  JAX_PLATFORMS=cpu PYTHONPATH=.venv/accel python benchmarks/bench_compiled.py

(``make bench`` does this). It writes ``bench_compiled.json``; its tables
are ``render.py``'s. ``tests/test_accelerators.py`` compiles the same steps
through :func:`measure`.
"""

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

import jax.numpy as jnp

from optax_accum import targets
from optax_accum.inspect import _collectives as _collectives_lib
from optax_accum.inspect import _hlo

# The repository's tools (not shipped) and this folder's helpers.
sys.path[:0] = [
  str(pathlib.Path(__file__).resolve().parents[i]) for i in (0, 1)
]
import _common  # noqa: E402
from _compiled_steps import (  # noqa: E402
  ADAM_OPS,
  APPLIES,
  DTYPES,
  Case,
  _explicit,
  _mesh,
  accumulator_bytes,
  compile_case,
  param_bytes,
)

from tools import program as program_reader  # noqa: E402

# ----------------------------------------------------------------------------
# What the compiled program says.
# ----------------------------------------------------------------------------


def measure(case: Case) -> dict[str, Any]:
  """The facts of `case`'s compiled step, as JSON-able values."""
  on_gpu = (
    case.target != "cpu" and targets.TARGETS[case.target].platform == "cuda"
  )
  with tempfile.TemporaryDirectory() as dump:
    compiled = compile_case(case, dump if on_gpu else None)
    thunks = program_reader.thunk_sequence(dump) if on_gpu else ""
  program = program_reader.Program(compiled)
  leaf = case.width**2 * jnp.dtype(DTYPES[case.dtype]).itemsize
  wgrad = (
    f"{'f32' if case.dtype == 'f32' else 'bf16'}[{case.width},{case.width}]"
  )
  facts = {
    "case": dataclasses.asdict(case),
    "name": case.name,
    "conditionals": program.conditionals(),
    "adam_every_call": bool(program.runs_every_call(ADAM_OPS)),
    "bytes": {
      path: program.kernel_bytes(path)
      for path in (program_reader.MICRO_STEP, program_reader.EMITTING)
    },
    "copies": {
      path: [
        [k.name, k.result_bytes]
        for k in program.copies(path, min_bytes=leaf // 2)
      ]
      for path in (program_reader.MICRO_STEP, program_reader.EMITTING)
    },
    "held": [
      [k.name, k.result_bytes] for k in program.held(min_bytes=leaf // 2)
    ],
    "memory": _common.compiled_memory(compiled),
    "param_bytes": param_bytes(case),
    "accumulator_bytes": accumulator_bytes(case),
    "wgrad_gemms": [
      {"name": k.name, "fused": fused, "bytes": k.bytes}
      for shape in {wgrad, f"f32[{case.width},{case.width}]"}
      for k, fused in program.gemms(shape)
    ],
    "collectives": collectives_with_axes(case, compiled),
  }
  if not facts["conditionals"]:  # Where the reductions start.
    facts["overlap"] = program.overlap(wgrad, min_bytes=leaf // 2)
  if on_gpu:
    total, inside = program_reader.conditionals_in_command_buffers(thunks)
    facts["command_buffer"] = {"conditionals": total, "inside": inside}
  return facts


def collectives_with_axes(case: Case, compiled) -> list[dict[str, Any]]:
  """Each collective: opcode, bytes on one device, where it runs (every
  call, the emitting branch, another branch) and the mesh axes its device
  groups span."""
  hlo = _hlo.HloModule(compiled.as_text())  # parsed once for both
  records = _collectives_lib._records(hlo)
  mesh = _mesh(case, explicit=_explicit(case))
  coordinates = _collectives_lib._coordinates(mesh, compiled, hlo)
  return [
    {
      "opcode": c.opcode,
      "bytes": c.bytes,
      "where": "every call"
      if c.unconditional
      else ("emitting" if c.emitting else "other"),
      "axes": list(_collectives_lib._axes_of(c, mesh, coordinates)),
    }
    for c in records
  ]


# ----------------------------------------------------------------------------
# The benchmark.
# ----------------------------------------------------------------------------


def cases_for(target: str, args: argparse.Namespace) -> list[Case]:
  """The benchmark's rows for one target."""
  base = dict(
    target=target, width=args.width, layers=args.layers, batch=args.batch
  )
  out = []
  engines = (
    ("local",) if target in ("cpu", "h100") else ("shard_map", "unreduced")
  )
  for dtype in args.dtypes:
    for engine in engines:
      common = dict(base, dtype=dtype, engine=engine)
      out.append(Case(variant="plain", **common))
      out.append(Case(variant="floor", **common))
      for apply in APPLIES:
        out.append(Case(apply=apply, **common))
      out.append(Case(apply="accum", emit="micro", **common))
      # On TPU the reductions start during the backward only with the
      # asynchronous collective options (XLA_OPTIONS["tpu_async"]).
      tpu = target.startswith("v5e")
      out.append(
        Case(
          apply="accum", emit="emit", xla="tpu_async" if tpu else "", **common
        )
      )
      if engine == "local":
        out.append(Case(variant="MultiSteps", **common))
        out.append(Case(variant="apply_every", **common))
  return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--targets",
    default="cpu,h100,h100x8,v5e_2x2",
    type=_common.csv_list(),
    help="cpu and/or names of optax_accum.targets.TARGETS",
  )
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=16, help="rows per device")
  parser.add_argument("--dtypes", default="f32,bf16", type=_common.csv_list())
  parser.add_argument("--out", default=str(_common.RESULTS_DIR))
  parser.add_argument(
    "--no-recipes",
    dest="recipes",
    action="store_false",
    help="skip the documented recipes (tests/_recipes_accel_worker.py)",
  )
  args = parser.parse_args(argv)
  rows = []
  for target in args.targets:
    for case in cases_for(target, args):
      facts = measure(case)
      rows.append(facts)
      print(_summary(facts), flush=True)
  payload = {
    "machine": _common.machine_info(),
    "args": vars(args),
    "rows": rows,
    # The recipes are compiled for one H100 and 8 H100s.
    "recipes": recipes()
    if args.recipes and {"h100", "h100x8"} & set(args.targets)
    else {},
  }
  _common.write_json(args.out, "bench_compiled", payload)
  return payload


def recipes() -> dict[str, dict[str, Any]]:
  """The documented recipes, compiled from the docs' text for one H100
  (f32, bf16) and 8 H100s by the test suite's worker (its model: 4
  2048-square tanh layers, or one 4096-square matrix for the linear
  losses), with their floors: ``{"recipe/dtype": facts}``."""
  worker = pathlib.Path(__file__).resolve().parents[1] / "tests"
  out = subprocess.run(
    [
      sys.executable,
      str(worker / "_recipes_accel_worker.py"),
      "--plants",
      "clean",
    ],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  found = json.loads(out.strip().splitlines()[-1])
  return {key.split("/", 1)[1]: facts for key, facts in found.items()}


def _summary(facts: dict) -> str:
  mib = _common.MB
  return (
    f"{facts['name']:55s} conds={facts['conditionals']}"
    f" adam_every_call={facts['adam_every_call']}"
    f" micro={facts['bytes']['micro-step'] / mib:.1f}MiB"
    f" emit={facts['bytes']['emitting'] / mib:.1f}MiB"
    f" copies={len(facts['copies']['micro-step'])}"
    f" held={len(facts['held'])}"
    f" temp={facts['memory']['temp'] / mib:.1f}MiB"
  )


if __name__ == "__main__":
  main()
