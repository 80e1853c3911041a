"""The whole GPU measurement in one run: the step's time and memory, the LM.

Made to run once, unattended, on a GPU machine as found (its own Python, no
package index; ``benchmarks/gpu.sh OUTDIR`` is the command) and to fit a
time budget (``--budget-s``): each section is guarded, what did not fit or
failed is recorded and the run goes on, and the JSON is rewritten after
every configuration, so a run cut short still leaves its results.

Sections, in order:

* ``step`` (inner ``adam``, then ``lm``, then ``step`` with
  ``clip_by_global_norm + adamw`` at ``--clip-sizes-mb``): the stack of
  square tanh layers of ``bench_step.py`` (``_models.make_problem``), params
  in float32 or bfloat16, for the variants of `VARIANTS`: the strict
  floor (the gradient added into a donated accumulator, nothing else:
  ``_static.prepare_floor``), the plain inner optimizer, the README's
  quick start (``tx.update(..., weight=)`` traced inside ``jax.jit``,
  params and state donated, ``optax_accum.apply_updates``), the static
  form (``emit=`` from the host), the NNX drop-in
  (``optax_accum.flax.Optimizer`` under ``nnx.jit``, donated) and
  ``optax.MultiSteps`` as its docs use it (jitted, donated,
  ``optax.apply_updates``).
* ``lm``: tokens/s of the LM demo (``examples/lm``: its NNX transformer on
  blocks of the Python standard library's source, which every machine
  with Python has), ``k`` = 1 and 8 micro-batches per optimizer step,
  ours (``optax_accum.flax.Optimizer``, token-weighted as the demo is)
  against ``nnx.Optimizer(model, optax.MultiSteps(...))``.

How it times (see `time_cycle`): every variant runs whole cycles of ``k``
calls; per cycle, its ``k - 1`` micro-steps are dispatched back to back and
waited for once (a training loop does not wait between steps, and on a GPU
waiting on every call adds a host round trip to each, which at 64 MB is a
sizeable share of a micro-step), then the emitting call is timed alone
(dispatched after a wait, waited for). Variants take turns in every round,
rotating who goes first; every ratio is paired by round (both measured
seconds apart) and reported as the median over rounds with min-max and
interquartile range.

Memory (see `probe_memory`): JAX cannot reset the device's peak counter,
so each variant's peak is measured alone (no other variant alive), on top
of a ballast buffer that lifts the bytes in use to just under the peak
reached so far: the peak one cycle of the variant reaches is then a new
high, and (peak - bytes in use before its state existed) is the variant's
own peak, arguments, optimizer state, batch and temporaries included. A
peak that sets no new high is recorded as not attributable (null). Each
variant's compiled footprint (``memory_analysis()``: argument + temp +
output - alias) is recorded beside it.

Nothing here is meant to run out of memory (an OOM costs tens of seconds
of allocator retries): the ballast is capped so that ballast + footprint +
`safety_margin` stays under the allocator's free bytes, and left out (with
the reason recorded) where the peak to beat is too close to the limit; the
interleaved timing keeps every variant alive at once, so before it the
configuration's live bytes (`timing_bytes`) are checked against the free
bytes and, where they do not fit, its timing is skipped with the reason
(probes and footprints stay). After every configuration, failed or not,
`release` deletes every array it left alive (a traceback's frames hold
device arrays), clears JAX's caches and records the bytes still in use.

``--only adam:bfloat16:2048,clip_adamw:*:512`` (fnmatch on
``inner:dtype:size_mb``) and ``--no-lm`` make a short run that fills gaps;
``--render A.json B.json`` merges runs into one page (a later run's
configuration replaces an earlier one's).

Usage::

  benchmarks/gpu.sh OUTDIR                      # on the GPU machine
  JAX_PLATFORMS=cpu benchmarks/gpu.sh OUT --smoke
  python benchmarks/bench_gpu.py --render OUT/bench_gpu.json [MORE.json]
"""

import argparse
import fnmatch
import functools
import gc
import json
import os
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
  MB,
  RESULTS_DIR,
  abstract,
  compiled_memory,
  csv_list,
  fmt,
  int_list,
  machine_info,
  markdown_table,
  positive_int,
  tree_bytes,
)
from _models import make_problem
from _static import LEARNING_RATE, prepare_floor, static_train_step

import optax_accum

NAME = "bench_gpu"
LM_DIR = pathlib.Path(__file__).resolve().parents[1] / "examples" / "lm"

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
  "adam": lambda: optax.adam(LEARNING_RATE),
  "clip_adamw": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(LEARNING_RATE)
  ),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The step variants, in the order of the tables. "ours" is the quick start.
VARIANTS = ("floor", "plain", "ours", "static", "nnx", "MultiSteps")
LABELS = {
  "floor": "floor (grad + add)",
  "plain": "plain inner",
  "ours": "ours, quick start",
  "static": "ours, emit=",
  "nnx": "ours, NNX drop-in",
  "MultiSteps": "optax.MultiSteps",
}

# The LM models: the demo's own configuration, and one a GPU has work in.
LM_METHODS = ("ours", "MultiSteps")
LM_MODELS = {
  "demo": {
    "d_model": 64,
    "num_heads": 4,
    "num_layers": 2,
    "max_len": 128,
    "micro_batch": 8,
  },
  "gpu": {
    "d_model": 512,
    "num_heads": 8,
    "num_layers": 6,
    "max_len": 256,
    "micro_batch": 32,
  },
  "tiny": {  # --smoke
    "d_model": 32,
    "num_heads": 2,
    "num_layers": 1,
    "max_len": 32,
    "micro_batch": 2,
  },
}

# First guesses, replaced by the measured mean as soon as there is one.
COMPILE_S_GUESS = {"gpu": 1.5, "cpu": 0.6}
LM_COMPILE_S_GUESS = {"gpu": 6.0, "cpu": 2.0}
STARTUP_S_GUESS = 15.0  # python, jax, CUDA, the stdlib's source


# --- Arguments. -------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description="Times the accumulation step on this machine's first"
    " device (a GPU, or the CPU with --smoke) in one run: micro-step and"
    " emitting step of optax_accum's quick start, its static form and NNX"
    " drop-in against the strict floor and optax.MultiSteps, per-variant"
    " peak device memory, and the LM demo's tokens/s; writes"
    " bench_gpu.{json,md,png} to --out. --render redraws the Markdown and"
    " PNG from a results file alone.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  add = parser.add_argument
  add(
    "--out",
    help="output folder (default: benchmarks/results/gpu; with --render,"
    " beside RESULTS_JSON)",
  )
  add(
    "--smoke",
    action="store_true",
    help="tiny sizes and few rounds (runs on a CPU in about a minute);"
    " overrides the sizes, rounds and LM models, and the budget unless"
    " --budget-s is given",
  )
  add(
    "--render",
    metavar="RESULTS_JSON",
    nargs="+",
    help="only render the Markdown and PNG of RESULTS_JSON (several: merged,"
    " a later file's configurations replacing an earlier one's) into --out"
    " if given, else beside the first, and exit",
  )
  add(
    "--only",
    type=csv_list(str),
    help="step configurations to run, fnmatch patterns on"
    " inner:dtype:size_mb (e.g. adam:bfloat16:2048,clip_adamw:*:512)",
  )
  add("--no-lm", action="store_true", help="skip the LM section")
  add(
    "--budget-s",
    type=float,
    default=None,
    help="seconds this script may take; a configuration whose estimated"
    " cost no longer fits (leaving the later sections their share) is"
    " skipped and recorded (default: 330, 240 with --smoke)",
  )
  add(
    "--sizes-mb",
    type=csv_list(float),
    default=[64.0, 512.0, 2048.0],
    help="param sizes (MB, in the param dtype) for inner adam",
  )
  add(
    "--clip-sizes-mb",
    type=csv_list(float),
    default=[64.0, 512.0],
    help="param sizes for clip_by_global_norm + adamw (fewer, for time)",
  )
  add(
    "--dtypes",
    type=csv_list(str, list(DTYPES)),
    default=list(DTYPES),
    help="param dtypes",
  )
  add("--k", type=positive_int, default=8, help="micro-steps per cycle")
  add("--micro-batch", type=positive_int, default=8, help="rows per call")
  add(
    "--rounds",
    type=positive_int,
    default=7,
    help="most timed rounds per configuration (at least 3 run while the"
    " budget allows)",
  )
  add(
    "--cycles",
    type=positive_int,
    default=2,
    help="cycles each variant runs per round",
  )
  add(
    "--seconds-per-config",
    type=float,
    default=6.0,
    help="timing time per configuration after which no new round starts"
    " (once 3 rounds are done)",
  )
  add(
    "--lm-models",
    type=csv_list(str, list(LM_MODELS)),
    default=["demo", "gpu"],
    help=f"LM configurations, from {list(LM_MODELS)}",
  )
  add("--lm-ks", type=int_list, default=[1, 8], help="LM micro-batches a step")
  add("--lm-rounds", type=positive_int, default=5, help="timed LM rounds")
  add(
    "--lm-steps",
    type=positive_int,
    default=3,
    help="optimizer steps per method per LM round",
  )
  add(
    "--no-memory-probe",
    action="store_true",
    help="skip the per-variant device peak (compiled footprints only)",
  )
  args = parser.parse_args(argv)
  if args.k < 2:
    parser.error(f"--k must be >= 2 (a micro-step and an emit), got {args.k}")
  if args.budget_s is None:
    args.budget_s = 240.0 if args.smoke else 330.0
  if args.smoke:
    args.sizes_mb, args.clip_sizes_mb = [0.0625, 0.25], [0.0625]
    args.k, args.micro_batch, args.rounds, args.cycles = 4, 4, 3, 1
    args.seconds_per_config = 0.5
    args.lm_models, args.lm_rounds, args.lm_steps = ["tiny"], 2, 1
  return args


# --- Small helpers. ---------------------------------------------------------


def spread(values: list[float | None]) -> dict[str, Any]:
  """Median, min, max and interquartile range (None values left out)."""
  kept = [float(v) for v in values if v is not None]
  if not kept:
    return {"median": None, "min": None, "max": None, "q1": None, "q3": None}
  q1, _, q3 = (
    statistics.quantiles(kept, n=4, method="inclusive")
    if len(kept) > 1
    else (kept[0],) * 3
  )
  return {
    "median": statistics.median(kept),
    "min": min(kept),
    "max": max(kept),
    "q1": q1,
    "q3": q3,
    "n": len(kept),
  }


def paired(a: list[float], b: list[float]) -> dict[str, Any]:
  """The spread of a[i] / b[i] over rounds i."""
  return spread([x / y for x, y in zip(a, b, strict=True) if x and y])


def log(text: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def error_text(exc: BaseException) -> str:
  lines = traceback.format_exception_only(type(exc), exc)
  return "".join(lines).strip()[-2000:]


def device_memory() -> dict[str, int] | None:
  """The first device's allocator counters, None where it has none (CPU)."""
  stats = jax.devices()[0].memory_stats()
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return {
    key: int(stats[key])
    for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    if key in stats
  }


def memory_of(compiled: Any) -> dict[str, Any]:
  """`_common.compiled_memory`, plus XLA's own peak where it reports one."""
  out = compiled_memory(compiled)
  peak = getattr(compiled.memory_analysis(), "peak_memory_in_bytes", None)
  out["xla_peak"] = int(peak) if peak else None
  return out


class Clock:
  """The budget: seconds left, and what a compile costs here so far."""

  def __init__(self, budget_s: float, backend: str):
    self.start, self.budget_s = time.perf_counter(), budget_s
    self.backend = "gpu" if backend == "gpu" else "cpu"
    self.compiles: list[float] = []
    self.lm_compiles: list[float] = []

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def left(self) -> float:
    return self.budget_s - self.elapsed()

  def compile_s(self, lm: bool = False) -> float:
    seen = self.lm_compiles if lm else self.compiles
    guess = (LM_COMPILE_S_GUESS if lm else COMPILE_S_GUESS)[self.backend]
    return statistics.mean(seen) if seen else guess


# --- The step section: variants. -------------------------------------------

# Compiled programs of a configuration: floor 2, plain 1, ours 1, static 2,
# MultiSteps 1, NNX 1 (compiled by nnx.jit on its first call).
PROGRAMS_PER_CONFIG = 8


class Stepper:
  """A variant ready to run: `call(emit)` dispatches one call (micro-step
  or emitting step), `block()` waits for everything it holds."""

  def __init__(self, calls, values, inputs, check_emit: bool):
    self.calls, self.values, self.inputs = calls, values, inputs
    self.check_emit = check_emit

  def call(self, emit: bool) -> None:
    out = self.calls[emit](*self.values, *self.inputs)
    self.values = tuple(out[:2])

  def block(self) -> None:
    jax.block_until_ready(self.values)

  def emitted(self) -> bool | None:
    if not self.check_emit:
      return None
    return bool(optax_accum.has_updated(self.values[1]))


class NnxStepper:
  """The NNX drop-in: model and optimizer updated in place by nnx.jit."""

  def __init__(self, step, model, optimizer, inputs, k: int):
    self.step, self.model, self.optimizer = step, model, optimizer
    self.inputs, self.k = inputs, k

  def call(self, emit: bool) -> None:
    del emit  # the device decides, as in the quick start
    self.step(self.model, self.optimizer, *self.inputs)

  def block(self) -> None:
    from flax import nnx

    jax.block_until_ready((nnx.state(self.model), nnx.state(self.optimizer)))

  def emitted(self) -> bool:
    """Whether every cycle so far ended with an optimizer step."""
    steps = int(self.optimizer.optimizer_step)
    return steps > 0 and steps * self.k == int(self.optimizer.step[...])


class Variants:
  """One configuration's problem and every variant's compiled step.

  `build(name)` makes a fresh `Stepper` (its own copy of the params, a
  fresh state); the compiled programs are shared by every build.
  """

  def __init__(self, optimizer: str, dtype: str, size_mb: float, args, clock):
    self.k = args.k
    self.problem = make_problem(size_mb, DTYPES[dtype], args.micro_batch)
    self.weight = jnp.asarray(float(args.micro_batch), jnp.float32)
    inner = OPTIMIZERS[optimizer]
    p = abstract(self.problem.params)
    batch = abstract(self.problem.batch)
    w = abstract(self.weight)
    grad_fn = jax.grad(self.problem.loss)
    loss = self.problem.loss
    self.txs = {
      "floor": prepare_floor(inner, self.k),
      "plain": inner(),
      "ours": optax_accum.accumulate(inner(), self.k),
      "static": optax_accum.accumulate(inner(), self.k),
      "nnx": optax_accum.accumulate(inner(), self.k),
      "MultiSteps": optax.MultiSteps(
        inner(), every_k_schedule=self.k
      ).gradient_transformation(),
    }
    # Per variant: {emit: the jitted callable a call makes}. Each is
    # compiled ahead (`lower(...).compile()`: its time and memory); the
    # jitted call then finds that executable in JAX's cache, and is the
    # call a training loop makes (JAX's C++ dispatch path).
    self.calls, self.memory, self.compile_s = {}, {}, {}
    static = static_step(loss, self.txs["static"])
    steps = {
      "floor": (static_train_step(grad_fn, self.txs["floor"]), (batch,), True),
      "plain": (plain_step(loss, self.txs["plain"]), (batch,), False),
      "MultiSteps": (plain_step(loss, self.txs["MultiSteps"]), (batch,), False),
      "ours": (quickstart_step(loss, self.txs["ours"]), (batch, w), False),
      "static": (static, (batch, w), True),
    }
    for name, (step, inputs, two) in steps.items():
      state = jax.eval_shape(self.txs[name].init, p)
      start = time.perf_counter()
      emits = (False, True) if two else (False,)
      compiled = [
        step.lower(p, state, *inputs, **({"emit": e} if two else {})).compile()
        for e in emits
      ]
      self.compile_s[name] = time.perf_counter() - start
      clock.compiles.append(self.compile_s[name] / len(compiled))
      self.memory[name] = max(
        (memory_of(c) for c in compiled), key=lambda m: m["footprint"]
      )
      self.calls[name] = {
        e: functools.partial(step, emit=e) if two else step
        for e in (False, True)
      }
    self.nnx_step = nnx_step_for(loss)
    # nnx.jit compiles on the first call: `warm_nnx` makes that call.
    self.memory["nnx"] = None

  def build(self, name: str):
    params = jax.tree.map(jnp.copy, self.problem.params)
    if name == "nnx":
      from flax import nnx

      model = nnx_stack(params)
      optimizer = optax_accum.flax.Optimizer(
        model, self.txs["nnx"], wrt=nnx.Param
      )
      commit(model, optimizer)
      return NnxStepper(
        self.nnx_step,
        model,
        optimizer,
        (self.problem.batch, self.weight),
        self.k,
      )
    state = self.txs[name].init(params)
    inputs = (self.problem.batch,)
    if name in ("ours", "static"):
      inputs += (self.weight,)
    return Stepper(
      self.calls[name],
      (params, state),
      inputs,
      check_emit=name in ("ours", "static"),
    )

  def warm_nnx(self, clock: "Clock") -> None:
    """Compiles the NNX step (one cycle on a throwaway model), and checks
    that its cycle ends with an optimizer step."""
    start = time.perf_counter()
    stepper = self.build("nnx")
    run_cycle(stepper, self.k)
    stepper.block()
    self.compile_s["nnx"] = time.perf_counter() - start
    clock.compiles.append(self.compile_s["nnx"])
    if not stepper.emitted():
      raise RuntimeError("nnx: the cycle's last call did not emit.")


def quickstart_step(loss, tx):
  """The README's quick start: traced, donated, optax_accum.apply_updates."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch, weight):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, weight=weight)
    return optax_accum.apply_updates(params, updates, opt_state), opt_state

  return train_step


def static_step(loss, tx):
  """The README's static form: ``emit=`` a Python bool, two programs."""

  @functools.partial(jax.jit, static_argnames="emit", donate_argnums=(0, 1))
  def train_step(params, opt_state, batch, weight, emit):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, weight=weight, emit=emit
    )
    return optax_accum.apply_updates(params, updates, opt_state), opt_state

  return train_step


def plain_step(loss, tx):
  """optax's own form (MultiSteps' docs, or the plain optimizer): jitted,
  donated, optax.apply_updates."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return train_step


def commit(model, optimizer) -> None:
  """Commits an NNX model's and optimizer's arrays to the device, as the
  step's outputs will be: otherwise nnx.jit compiles its second call again
  (examples/lm/train.py's `build` does the same)."""
  from flax import nnx

  pair = (model, optimizer)
  nnx.update(pair, jax.device_put(nnx.state(pair), jax.devices()[0]))


def nnx_stack(params: dict[str, jax.Array]):
  """The tanh stack as an NNX module (one nnx.Param a layer)."""
  from flax import nnx

  class Stack(nnx.Module):
    def __init__(self, params):
      self.layers = nnx.List([nnx.Param(params[n]) for n in sorted(params)])

  return Stack(params)


def nnx_step_for(loss):
  """examples/nnx_quickstart.py's step: nnx.jit, model and optimizer
  donated, ``optimizer.update(model, grads, weight=)``."""
  from flax import nnx

  import optax_accum.flax  # noqa: F401  (the drop-in)

  def nnx_loss(model, batch):
    layers = {f"w{i:02d}": layer[...] for i, layer in enumerate(model.layers)}
    return loss(layers, batch)

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def accumulate_step(model, optimizer, batch, weight):
    grads = nnx.grad(nnx_loss)(model, batch)
    optimizer.update(model, grads, weight=weight)

  return accumulate_step


# --- The step section: timing and memory. ----------------------------------


def run_cycle(stepper, k: int) -> None:
  for i in range(k):
    stepper.call(i == k - 1)


def time_cycle(stepper, k: int) -> tuple[float | None, float]:
  """One cycle: (seconds per micro-step, seconds of the emitting step).

  The k - 1 micro-steps are dispatched back to back and waited for once;
  the emitting call is then dispatched and waited for alone.
  """
  stepper.block()
  start = time.perf_counter()
  for _ in range(k - 1):
    stepper.call(False)
  stepper.block()
  middle = time.perf_counter()
  stepper.call(True)
  stepper.block()
  end = time.perf_counter()
  micro = (middle - start) / (k - 1) if k > 1 else None
  return micro, end - middle


BALLAST_CHUNK = 1 << 30  # bytes: fits fragmented memory, small indices


def allocate_ballast(nbytes: int) -> list[jax.Array]:
  """`nbytes` of device memory, held by the returned arrays."""
  chunks = [
    jnp.zeros((min(BALLAST_CHUNK, nbytes - start),), jnp.uint8)
    for start in range(0, nbytes, BALLAST_CHUNK)
  ]
  jax.block_until_ready(chunks)
  return chunks


def safety_margin(limit: int) -> int:
  """Bytes left free under the allocator's limit: 2 GiB or 5%."""
  return max(2 << 30, limit // 20)


def free_bytes(stats: dict[str, int]) -> int | None:
  """What may still be allocated without coming near an OOM."""
  if "bytes_limit" not in stats:
    return None
  limit = stats["bytes_limit"]
  return limit - stats["bytes_in_use"] - safety_margin(limit)


def ballast_bytes(before: dict[str, int], expected: int) -> tuple[int, str]:
  """(bytes, why none): bytes that lift the bytes in use to the peak seen
  so far, less the variant's expected peak (its compiled footprint) and a
  margin: the variant's cycle then sets a new high unless it needs less
  than ``expected - margin``. None (0) where ballast + footprint would not
  fit under `free_bytes`."""
  margin = max(expected // 16, 16 * MB)
  gap = before["peak_bytes_in_use"] - before["bytes_in_use"]
  want = max(0, gap - expected + margin)
  free = free_bytes(before)
  if want and free is not None and want + expected > free:
    return 0, (
      f"ballast {want / MB:,.0f} MiB + footprint {expected / MB:,.0f} MiB"
      f" > {free / MB:,.0f} MiB free (limit less margin)"
    )
  return want, ""


def timing_bytes(memory: dict[str, dict | None]) -> int:
  """Live bytes of the interleaved timing: every variant's arguments
  (params, state, batch; NNX: ours') and the largest temporaries."""
  compiled = [memory[n] or memory["ours"] for n in VARIANTS]
  return sum(m["argument"] for m in compiled) + max(m["temp"] for m in compiled)


def release(before: set[int]) -> dict[str, Any]:
  """Frees what a configuration left alive: deletes every array not in
  `before` (ids), clears JAX's caches; the bytes in use after."""
  gc.collect()
  left = [a for a in jax.live_arrays() if id(a) not in before]
  for array in left:
    array.delete()
  count = len(left)
  del left
  jax.clear_caches()
  gc.collect()
  mem = device_memory()
  return {"arrays_deleted": count, "bytes_in_use": mem and mem["bytes_in_use"]}


def attributed_peak(base: dict[str, int], after: dict[str, int]) -> int | None:
  """The peak reached since `base` less the bytes in use at `base`; None
  where no new high was set (the peak may be an earlier one)."""
  if after["peak_bytes_in_use"] <= base["peak_bytes_in_use"]:
    return None
  return after["peak_bytes_in_use"] - base["bytes_in_use"]


def probe_memory(variants: Variants, name: str) -> dict[str, Any]:
  """The device peak of one cycle of `name`, alone, attributable.

  JAX cannot reset the peak counter: a ballast (`ballast_bytes`) lifts the
  bytes in use to just under the peak seen so far, so that the variant's
  cycle sets a new high; that high less the bytes in use before its state
  existed is the variant's own peak (params, state, temporaries).
  """
  before = device_memory()
  if before is None:
    return {"device_peak": None, "attributable": None, "why": "no counters"}
  expected = (variants.memory.get(name) or variants.memory["ours"])["footprint"]
  nbytes, why = ballast_bytes(before, expected)
  out: dict[str, Any] = {"ballast": nbytes}
  if why:
    out["no_ballast"] = why
  ballast = []
  try:
    ballast = allocate_ballast(nbytes)
  except Exception as exc:  # noqa: BLE001  (recorded, measured without)
    out["ballast_error"] = error_text(exc)
  base = device_memory()
  stepper = variants.build(name)
  run_cycle(stepper, variants.k)
  stepper.block()
  after = device_memory()
  peak = attributed_peak(base, after)
  out.update(
    device_peak=peak,
    resident=after["bytes_in_use"] - base["bytes_in_use"],
    attributable=peak is not None,
    emitted=stepper.emitted(),
  )
  del stepper, ballast
  return out


def measure_config(
  optimizer: str, dtype: str, size_mb: float, args, clock: Clock, record
) -> dict[str, Any]:
  """One configuration: compile, memory probes, interleaved timing."""
  result: dict[str, Any] = {
    "optimizer": optimizer,
    "dtype": dtype,
    "size_mb": size_mb,
    "k": args.k,
    "micro_batch": args.micro_batch,
  }
  record(result)
  variants = Variants(optimizer, dtype, size_mb, args, clock)
  variants.warm_nnx(clock)
  result.update(
    param_bytes=tree_bytes(variants.problem.params),
    width=variants.problem.width,
    layers=variants.problem.layers,
    compile_s=dict(variants.compile_s),
  )
  log(f"  compiled in {sum(variants.compile_s.values()):.1f} s")

  memory = {name: {"compiled": variants.memory[name]} for name in VARIANTS}
  if not args.no_memory_probe:
    order = sorted(
      VARIANTS,
      key=lambda n: (variants.memory[n] or variants.memory["ours"])[
        "footprint"
      ],
    )
    for name in order:
      memory[name].update(probe_memory(variants, name))
  result["memory"] = memory
  record(result)
  need, stats = timing_bytes(variants.memory), device_memory()
  free = stats and free_bytes(stats)
  result.update(timing_bytes=need, free_bytes=free)
  if free is not None and need > free:
    result["skipped"] = (
      f"memory: six variants alive need ~{need / MB:,.0f} MiB, the device"
      f" has {free / MB:,.0f} MiB free (limit less margin); probes only"
    )
    return result

  steppers = {name: variants.build(name) for name in VARIANTS}
  del variants.problem  # keep only the variants' copies alive
  for stepper in steppers.values():  # warm-up: one untimed cycle each
    run_cycle(stepper, args.k)
    stepper.block()
  micro = {n: [] for n in VARIANTS}
  emit = {n: [] for n in VARIANTS}
  started = time.perf_counter()
  rounds = 0
  while rounds < args.rounds:
    if rounds >= 3 and (
      time.perf_counter() - started > args.seconds_per_config
      or clock.left() < 0
    ):
      break
    names = (
      VARIANTS[rounds % len(VARIANTS) :] + VARIANTS[: rounds % len(VARIANTS)]
    )
    for name in names:
      cycles = [time_cycle(steppers[name], args.k) for _ in range(args.cycles)]
      ms = [m for m, _ in cycles if m is not None]
      micro[name].append(statistics.median(ms) if ms else None)
      emit[name].append(statistics.median(e for _, e in cycles))
    rounds += 1
  emitted = {
    name: s.emitted() for name, s in steppers.items() if s.emitted() is not None
  }
  del steppers
  result.update(
    rounds=rounds,
    cycles_per_round=args.cycles,
    timing_s=time.perf_counter() - started,
    emitted=emitted,
  )
  result["times_ms"] = {
    name: {
      "micro": spread([None if m is None else 1e3 * m for m in micro[name]]),
      "emit": spread([1e3 * e for e in emit[name]]),
      "per_call": spread(
        [
          1e3 * ((args.k - 1) * (m or 0.0) + e) / args.k
          for m, e in zip(micro[name], emit[name], strict=True)
        ]
      ),
    }
    for name in VARIANTS
  }
  result["ratios"] = step_ratios(micro, emit, args.k)
  result["memory_ratios"] = memory_ratios(memory)
  return result


def step_ratios(micro, emit, k: int) -> dict[str, Any]:
  """Every time ratio, paired by round."""
  if k == 1:
    return {}

  def per_call(n):
    return [
      ((k - 1) * m + e) / k for m, e in zip(micro[n], emit[n], strict=True)
    ]

  return {
    "micro_vs_floor": {
      n: paired(micro[n], micro["floor"]) for n in VARIANTS if n != "floor"
    },
    "emit_vs_plain": {
      n: paired(emit[n], emit["plain"])
      for n in ("ours", "static", "nnx", "MultiSteps")
    },
    "multisteps_vs_ours_micro": paired(micro["MultiSteps"], micro["ours"]),
    "multisteps_vs_ours_per_call": paired(
      per_call("MultiSteps"), per_call("ours")
    ),
    "multisteps_vs_static_micro": paired(micro["MultiSteps"], micro["static"]),
    "nnx_vs_ours_micro": paired(micro["nnx"], micro["ours"]),
    "ours_minus_floor_micro_ms": spread(
      [
        1e3 * (a - b)
        for a, b in zip(micro["ours"], micro["floor"], strict=True)
      ]
    ),
  }


def memory_ratios(memory: dict[str, dict]) -> dict[str, Any]:
  """Device peaks and compiled footprints against the floor's and
  MultiSteps' (None where either side is missing)."""

  def value(name, what):
    if what == "compiled":
      return (memory[name]["compiled"] or {}).get("footprint")
    return memory[name].get("device_peak")

  def ratio(a, b, what):
    x, y = value(a, what), value(b, what)
    return x / y if x and y else None

  return {
    what: {
      "vs_floor": {n: ratio(n, "floor", what) for n in VARIANTS},
      "ours_vs_multisteps": ratio("ours", "MultiSteps", what),
      "nnx_vs_multisteps": ratio("nnx", "MultiSteps", what),
    }
    for what in ("device_peak", "compiled")
  }


# --- The LM section. -------------------------------------------------------


def lm_imports():
  """The demo's modules (examples/lm is a folder of scripts)."""
  if str(LM_DIR) not in sys.path:
    sys.path.insert(0, str(LM_DIR))
  import input_pipeline
  import models
  from config import Config

  return Config, input_pipeline, models


def lm_loss(model, tokens, lengths):
  """examples/lm/train.py's loss: the mean over real tokens, and their
  count (the demo's ``weight=``)."""
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  positions = jnp.arange(inputs.shape[1], dtype=jnp.int32)
  mask = positions[None, :] < (lengths - 1)[:, None]
  losses = optax.softmax_cross_entropy_with_integer_labels(
    model(inputs), targets
  )
  count = jnp.sum(mask, dtype=jnp.float32)
  return jnp.sum(jnp.where(mask, losses, 0.0)) / count, count


@functools.cache
def lm_steps() -> dict[str, Any]:
  """The two LM steps, nnx.jit, model and optimizer donated."""
  from flax import nnx

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def ours(model, optimizer, tokens, lengths):
    grad_fn = nnx.value_and_grad(lm_loss, has_aux=True)
    (loss, count), grads = grad_fn(model, tokens, lengths)
    optimizer.update(model, grads, weight=count)  # the demo's weighting
    return loss

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def multisteps(model, optimizer, tokens, lengths):
    grad_fn = nnx.value_and_grad(lm_loss, has_aux=True)
    (loss, _), grads = grad_fn(model, tokens, lengths)
    optimizer.update(model, grads)
    return loss

  return {"ours": ours, "MultiSteps": multisteps}


class LmMethod:
  """One LM method at one k: its model, optimizer and step."""

  def __init__(self, name: str, k: int, cfg, models):
    from flax import nnx

    import optax_accum.flax

    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3))
    if name == "ours":
      tx = optax_accum.accumulate(inner, k)
      make = optax_accum.flax.Optimizer
    else:
      tx = optax.MultiSteps(inner, every_k_schedule=k)
      tx, make = tx.gradient_transformation(), nnx.Optimizer
    self.model = models.TransformerLM(cfg, rngs=nnx.Rngs(0))
    self.optimizer = make(self.model, tx, wrt=nnx.Param)
    commit(self.model, self.optimizer)
    self.step = lm_steps()[name]

  def run(self, batches: list) -> None:
    """Optimizer steps, each a list of micro-batches; waits at the end."""
    from flax import nnx

    loss = None
    for micro_batches in batches:
      for tokens, lengths in micro_batches:
        loss = self.step(self.model, self.optimizer, tokens, lengths)
    jax.block_until_ready(
      (loss, nnx.state(self.model), nnx.state(self.optimizer))
    )


def measure_lm(model_name: str, args, clock: Clock, results: list, record):
  """Tokens/s of ours and MultiSteps at every k of --lm-ks, each entry
  appended to `results` as soon as it starts (`record` saves)."""
  Config, pipeline, models = lm_imports()
  shape = LM_MODELS[model_name]
  steps = 2 + args.lm_rounds * args.lm_steps  # 2 to warm up

  def config(k):
    return Config(steps=steps, every_k=k, heldout_samples=16, seed=0, **shape)

  need = 2 * clock.compile_s(lm=True) + 2 * args.lm_rounds * 1.0
  if clock.left() < need:  # not even the data
    why = f"budget: {clock.left():.0f} s left, needs ~{need:.0f}"
    results += [
      {"model": model_name, "k": k, "skipped": why} for k in args.lm_ks
    ]
    return
  start = time.perf_counter()
  files, source = pipeline.stdlib_files(), "stdlib"
  if len(files) < 64:  # an image without the stdlib's sources: jax's own
    files = sorted(pathlib.Path(jax.__file__).parent.rglob("*.py"))
    source = "jax package"
  data = pipeline.load_data(
    config(max(args.lm_ks)), files=files[: max(64, len(files) // 4)]
  )
  log(
    f"  {model_name}: data ({source}, {len(files)} files) in"
    f" {time.perf_counter() - start:.1f} s"
  )
  for k in args.lm_ks:
    entry = {"model": model_name, "k": k, "data": source, **shape}
    results.append(entry)
    record()
    need = 2 * clock.compile_s(lm=True) + 2 * args.lm_rounds * 1.0
    if clock.left() < need:
      entry["skipped"] = f"budget: {clock.left():.0f} s left, needs ~{need:.0f}"
      log(f"  skip LM {model_name} k={k}: {entry['skipped']}")
      record()
      continue
    cfg = config(k)
    batches = [
      [
        (jnp.asarray(m.tokens), jnp.asarray(m.lengths))
        for m in pipeline.micro_batches(
          cfg, pipeline.step_batch(cfg, data.train, s)
        )
      ]
      for s in range(steps)
    ]
    entry.update(time_lm(batches, cfg, k, models, args, clock))
    record()
    log(
      f"  LM {model_name} k={k}: ours"
      f" {fmt(entry['ours']['tokens_per_s']['median'], 0)} tok/s, MultiSteps"
      f" {fmt(entry['MultiSteps']['tokens_per_s']['median'], 0)} tok/s"
    )


def time_lm(batches, cfg, k: int, models, args, clock: Clock) -> dict:
  """Interleaved rounds of --lm-steps optimizer steps per method."""
  from flax import nnx

  methods = {name: LmMethod(name, k, cfg, models) for name in LM_METHODS}
  out: dict[str, Any] = {
    "param_bytes": tree_bytes(nnx.state(methods["ours"].model, nnx.Param)),
    "padded_tokens_per_step": k * cfg.micro_batch * cfg.max_len,
  }
  real = [
    sum(float(np.sum(np.maximum(np.asarray(ln) - 1, 0))) for _, ln in b)
    for b in batches
  ]
  for name, method in methods.items():  # compile, warm up: the first two
    start = time.perf_counter()
    method.run(batches[:2])
    out[f"compile_s_{name}"] = time.perf_counter() - start
    clock.lm_compiles.append(out[f"compile_s_{name}"])
  seconds = {name: [] for name in methods}
  tokens = []
  for r in range(args.lm_rounds):
    steps = slice(2 + r * args.lm_steps, 2 + (r + 1) * args.lm_steps)
    tokens.append(sum(real[steps]))
    for name in LM_METHODS[r % 2 :] + LM_METHODS[: r % 2]:
      start = time.perf_counter()
      methods[name].run(batches[steps])
      seconds[name].append(time.perf_counter() - start)
  for name in methods:
    out[name] = {
      "tokens_per_s": spread(
        [t / s for t, s in zip(tokens, seconds[name], strict=True)]
      ),
      "step_ms": spread([1e3 * s / args.lm_steps for s in seconds[name]]),
    }
  out["optimizer_steps_ours"] = int(methods["ours"].optimizer.optimizer_step)
  # The same tokens in each round: tokens/s ratio = inverse time ratio.
  out["ours_vs_multisteps"] = paired(seconds["MultiSteps"], seconds["ours"])
  return out


# --- The run. --------------------------------------------------------------


def step_configs(args) -> tuple[list, list]:
  """(optimizer, dtype, size) to run: adam's, then clip_adamw's, those
  `--only` matches."""

  def kept(configs):
    return [
      c
      for c in configs
      if not args.only
      or any(fnmatch.fnmatch("{}:{}:{:g}".format(*c), p) for p in args.only)
    ]

  adam = [("adam", d, s) for s in args.sizes_mb for d in args.dtypes]
  clip = [("clip_adamw", d, s) for s in args.clip_sizes_mb for d in args.dtypes]
  return kept(adam), kept(clip)


def estimate(args, backend: str) -> dict[str, Any]:
  """The run's expected seconds, before anything is measured."""
  kind = "gpu" if backend == "gpu" else "cpu"
  adam, clip = step_configs(args)
  configs = len(adam) + len(clip)
  compiles = configs * PROGRAMS_PER_CONFIG
  per_config_timing = args.seconds_per_config + 2.0  # + probes, set-up
  lm_runs = 0 if args.no_lm else len(args.lm_ks) * len(args.lm_models)
  lm_compiles = 2 * lm_runs
  lm_timing = lm_runs * (5.0 + args.lm_rounds)
  step_s = compiles * COMPILE_S_GUESS[kind] + configs * per_config_timing
  lm_s = lm_compiles * LM_COMPILE_S_GUESS[kind] + lm_timing
  total = STARTUP_S_GUESS + step_s + lm_s
  return {
    "configs": configs,
    "compiles": compiles,
    "compile_s_each": COMPILE_S_GUESS[kind],
    "lm_compiles": lm_compiles,
    "lm_compile_s_each": LM_COMPILE_S_GUESS[kind],
    "step_s": step_s,
    "lm_s": lm_s,
    "total_s": total,
    "formula": f"{STARTUP_S_GUESS:.0f} s start + {compiles} step programs x"
    f" {COMPILE_S_GUESS[kind]} s + {configs} configs x"
    f" {per_config_timing:.0f} s timing + {lm_compiles} LM compiles x"
    f" {LM_COMPILE_S_GUESS[kind]} s + {lm_timing:.0f} s LM timing",
  }


def versions() -> dict[str, Any]:
  out = machine_info()
  for module in ("flax", "chex", "numpy"):
    try:
      out[module] = __import__(module).__version__
    except Exception:  # noqa: BLE001  (a version we could not read)
      out[module] = None
  out["memory"] = device_memory()
  out["env"] = {
    key: os.environ.get(key)
    for key in (
      "JAX_PLATFORMS",
      "XLA_PYTHON_CLIENT_MEM_FRACTION",
      "XLA_PYTHON_CLIENT_PREALLOCATE",
      "CUDA_VISIBLE_DEVICES",
    )
  }
  return out


class Results:
  """The payload, rewritten to disk whenever it changes."""

  def __init__(self, out: pathlib.Path, args):
    self.path = out / f"{NAME}.json"
    self.payload: dict[str, Any] = {
      "benchmark": NAME,
      "complete": False,
      "args": {k: v for k, v in vars(args).items() if k != "render"},
      "step": [],
      "lm": [],
      "skipped": [],
      "errors": [],
      "sections": {},
    }

  def save(self) -> None:
    tmp = self.path.with_name(self.path.name + ".tmp")
    tmp.write_text(json.dumps(self.payload, indent=1, default=str))
    os.replace(tmp, self.path)

  def error(self, where: str, exc: BaseException) -> None:
    log(f"  ERROR in {where}: {error_text(exc).splitlines()[-1]}")
    self.payload["errors"].append({"where": where, "error": error_text(exc)})
    self.save()

  def skip(self, what: str, why: str) -> None:
    log(f"  skip {what}: {why}")
    self.payload["skipped"].append({"what": what, "why": why})
    self.save()


def run_step_section(section, configs, args, clock, results, reserve_s):
  """Each configuration guarded: an error (OOM) is recorded, the rest run."""
  t0 = time.perf_counter()
  done = 0
  for optimizer, dtype, size_mb in configs:
    label = f"{optimizer} {dtype} {size_mb:g} MB"
    need = (
      PROGRAMS_PER_CONFIG * clock.compile_s()
      + args.seconds_per_config
      + 2.0 * (1 + size_mb / 1024)
    )
    if clock.left() - reserve_s < need:
      results.skip(
        f"step {label}",
        f"budget: {clock.left():.0f} s left, {reserve_s:.0f} s reserved for"
        f" later sections, needs ~{need:.0f} s",
      )
      continue
    log(f"step {label} (k={args.k}), {clock.left():.0f} s left")
    entry: dict[str, Any] = {
      "optimizer": optimizer,
      "dtype": dtype,
      "size_mb": size_mb,
    }

    def record(partial=None, entry=entry):
      if partial is not None and partial is not entry:
        entry.update(partial)
      results.save()

    results.payload["step"].append(entry)
    gc.collect()
    alive = {id(a) for a in jax.live_arrays()}
    try:
      entry.update(
        measure_config(optimizer, dtype, size_mb, args, clock, record)
      )
      done += 1
      log_config(entry)
    except Exception as exc:  # noqa: BLE001  (recorded; OOM at the largest)
      entry["error"] = error_text(exc)
      results.error(f"step {label}", exc)
    if "skipped" in entry:
      results.skip(f"step {label}", entry["skipped"])
    entry["released"] = release(alive)
    log(f"  released: {entry['released']}")
    results.save()
  results.payload["sections"][section] = {
    "configs": len(configs),
    "done": done,
    "seconds": time.perf_counter() - t0,
  }
  results.save()


def log_config(r: dict[str, Any]) -> None:
  """One line of a configuration's headline figures (if it has them)."""
  if "times_ms" not in r or not r.get("ratios"):
    return
  ratios = r["ratios"]
  mvf = ratios.get("micro_vs_floor", {})

  def med(s):
    return fmt(s and s["median"])

  t = r["times_ms"]
  log(
    f"  floor micro {fmt(t['floor']['micro']['median'], 3)} ms; micro/floor:"
    f" ours {med(mvf.get('ours'))}, static {med(mvf.get('static'))}, nnx"
    f" {med(mvf.get('nnx'))}, MultiSteps {med(mvf.get('MultiSteps'))};"
    f" MultiSteps/ours {med(ratios.get('multisteps_vs_ours_micro'))}"
    f" ({r['rounds']} rounds)"
  )


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.render:
    sources = [pathlib.Path(p) for p in args.render]
    for path in render(sources, pathlib.Path(args.out or sources[0].parent)):
      print(f"Wrote {path}")
    return 0
  out = pathlib.Path(args.out or RESULTS_DIR / "gpu")
  out.mkdir(parents=True, exist_ok=True)
  results = Results(out, args)
  backend = jax.default_backend()
  clock = Clock(args.budget_s, backend)
  machine = versions()
  results.payload["machine"] = machine
  est = estimate(args, backend)
  results.payload["estimate"] = est
  log(
    f"{NAME}: backend {backend} ({machine['device_kind']}), jax"
    f" {machine['jax']}, jaxlib {machine['jaxlib']}, optax {machine['optax']},"
    f" flax {machine['flax']}, python {machine['python']}"
  )
  log(
    f"estimate ~{est['total_s']:.0f} s ({est['formula']}); budget"
    f" {args.budget_s:.0f} s"
  )
  results.save()
  adam, clip = step_configs(args)
  lm_est = est["lm_s"]
  sections = (
    (
      "step:adam",
      lambda: run_step_section(
        "step:adam", adam, args, clock, results, reserve_s=lm_est
      ),
    ),
    ("lm", lambda: args.no_lm or run_lm_section(args, clock, results)),
    (
      "step:clip_adamw",
      lambda: run_step_section(
        "step:clip_adamw", clip, args, clock, results, reserve_s=0.0
      ),
    ),
  )
  for name, section in sections:
    try:
      section()
    except Exception as exc:  # noqa: BLE001  (recorded; the next section runs)
      results.error(f"section {name}", exc)
  results.payload["elapsed_s"] = clock.elapsed()
  results.payload["complete"] = True
  results.save()
  log(f"done in {clock.elapsed():.0f} s (budget {args.budget_s:.0f} s)")
  try:
    for path in render([results.path], out):
      log(f"wrote {path}")
  except Exception as exc:  # noqa: BLE001  (the JSON stands; --render later)
    results.error("render", exc)
  return 0


def run_lm_section(args, clock: Clock, results: Results) -> None:
  t0 = time.perf_counter()
  for model_name in args.lm_models:
    log(f"lm {model_name} (k in {args.lm_ks}), {clock.left():.0f} s left")
    try:
      measure_lm(model_name, args, clock, results.payload["lm"], results.save)
    except Exception as exc:  # noqa: BLE001  (recorded; the next model runs)
      results.error(f"lm {model_name}", exc)
    finally:
      gc.collect()
    results.save()
  results.payload["sections"]["lm"] = {"seconds": time.perf_counter() - t0}


# --- Rendering: from the JSON alone. ---------------------------------------


def runs_lines(runs: list[dict[str, Any]] | None) -> list[str]:
  """Merged runs: each run's time; each run's machine where they differ."""
  if not runs:
    return []
  same = all(
    r[k] == runs[0][k]
    for r in runs
    for k in (*SAME_RUN_KEYS, "k", "micro_batch")
  )
  lines = [
    f"Merged from {len(runs)} runs (a later run's configurations replace an"
    " earlier one's)"
    + (
      "; machine, versions, k and batch agree:"
      if same
      else "; THEY DIFFER (the header names the last):"
    ),
    "",
  ]
  for i, r in enumerate(runs, 1):
    took = f"{r['elapsed_s']:.0f}" if r["elapsed_s"] is not None else "?"
    what = (
      ""
      if same
      else ", "
      + ", ".join(f"{k} {r[k]}" for k in (*SAME_RUN_KEYS, "k", "micro_batch"))
    )
    lines.append(
      f"- run {i}: {r['timestamp']}, {took} s of {r['budget_s']:.0f} s{what}"
    )
  return [*lines, ""]


def _cell(s: dict | None, digits: int = 2, suffix: str = "") -> str:
  """``1.02 (0.99-1.05)``: median (min-max over rounds)."""
  if not s or s.get("median") is None:
    return "-"
  text = f"{s['median']:.{digits}f}{suffix}"
  if s.get("n", 1) > 1:
    text += f" ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
  return text


def _mb(x: int | None) -> str:
  """MiB, three significant digits at least."""
  if x is None:
    return "-"
  return f"{x / MB:,.0f}" if x >= 100 * MB else f"{x / MB:.3g}"


def _params(r: dict[str, Any]) -> str:
  return f"{r['optimizer']}, {r['dtype']}, {_mb(r['param_bytes'])} MB"


def render_markdown(payload: dict[str, Any]) -> str:
  m = payload.get("machine", {})
  a = payload.get("args", {})
  est = payload.get("estimate", {})
  lines = [
    f"# {NAME}: the step timed on {m.get('device_kind', '?')}",
    "",
    f"Measured {m.get('timestamp', '?')} on {m.get('device_kind', '?')}"
    f" (backend {m.get('backend', '?')}), jax {m.get('jax', '?')}, jaxlib"
    f" {m.get('jaxlib', '?')}, optax {m.get('optax', '?')}, flax"
    f" {m.get('flax', '?')}, optax_accum {m.get('optax_accum', '?')}, python"
    f" {m.get('python', '?')}. k={a.get('k')}, {a.get('micro_batch')} rows"
    f" per micro-batch; medians over rounds (min-max); every ratio paired"
    f" by round in the same run. "
    + (
      f"Run took {payload.get('elapsed_s', 0):.0f} s of a"
      f" {a.get('budget_s', 0):.0f} s budget (estimated"
      f" {est.get('total_s', 0):.0f} s)."
      if payload.get("complete") and not payload.get("runs")
      else ""
      if payload.get("complete")
      else "INCOMPLETE: the run was cut short; what it finished is below."
    ),
    "",
    *runs_lines(payload.get("runs")),
    "## Micro-step and emitting step",
    "",
  ]
  steps = [r for r in payload.get("step", []) if "ratios" in r]
  header = [
    "inner, params",
    "floor micro ms",
    "ours micro ms",
    "ours / floor",
    "emit= / floor",
    "NNX / floor",
    "MultiSteps micro / ours",
    "MultiSteps per call / ours",
    "ours emit / plain",
    "peak ours / floor",
    "peak ours / MultiSteps",
  ]
  rows = []
  for r in steps:
    t, q, mr = r["times_ms"], r["ratios"], r["memory_ratios"]
    peak = mr["device_peak"]
    rows.append(
      [
        _params(r),
        _cell(t["floor"]["micro"], 3),
        _cell(t["ours"]["micro"], 3),
        _cell(q["micro_vs_floor"]["ours"]),
        _cell(q["micro_vs_floor"]["static"]),
        _cell(q["micro_vs_floor"]["nnx"]),
        _cell(q["multisteps_vs_ours_micro"], suffix="x"),
        _cell(q["multisteps_vs_ours_per_call"], suffix="x"),
        _cell(q["emit_vs_plain"]["ours"]),
        fmt(peak["vs_floor"]["ours"]),
        fmt(peak["ours_vs_multisteps"]),
      ]
    )
  lines += [
    markdown_table(header, rows).rstrip("\n") if rows else "No step results.",
    "",
  ]
  if steps:
    lines += [
      "Times (ms): micro-step (k-1 dispatched back to back, waited for"
      " once) / emitting step (dispatched and waited for alone).",
      "",
    ]
    header = ["inner, params", *(LABELS[n] for n in VARIANTS)]
    rows = [
      [
        _params(r),
        *(
          f"{fmt(r['times_ms'][n]['micro']['median'], 3)} /"
          f" {fmt(r['times_ms'][n]['emit']['median'], 3)}"
          for n in VARIANTS
        ),
      ]
      for r in steps
    ]
    lines += [markdown_table(header, rows).rstrip("\n"), ""]
    lines += [
      "Memory (MiB): device peak of one cycle, alone (arguments, state,"
      " batch, temporaries; '-' where not attributable) / compiled"
      " footprint (argument + temp + output - alias; NNX: compiled by"
      " nnx.jit, not read).",
      "",
    ]
    rows = [
      [
        _params(r),
        *(
          f"{_mb(r['memory'][n].get('device_peak'))} /"
          f" {_mb((r['memory'][n]['compiled'] or {}).get('footprint'))}"
          for n in VARIANTS
        ),
      ]
      for r in steps
    ]
    lines += [markdown_table(header, rows).rstrip("\n"), ""]
  lm = [e for e in payload.get("lm", []) if "ours_vs_multisteps" in e]
  lines += ["## LM demo: tokens/s", ""]
  if lm:
    header = [
      "model",
      "params MB",
      "k",
      "ours tok/s",
      "MultiSteps tok/s",
      "ours / MultiSteps",
    ]
    rows = [
      [
        f"{e['model']} (d={e['d_model']}, {e['num_layers']} layers,"
        f" {e['micro_batch']}x{e['max_len']})",
        _mb(e["param_bytes"]),
        e["k"],
        _cell(e["ours"]["tokens_per_s"], 0),
        _cell(e["MultiSteps"]["tokens_per_s"], 0),
        _cell(e["ours_vs_multisteps"], suffix="x"),
      ]
      for e in lm
    ]
    lines += [markdown_table(header, rows).rstrip("\n"), ""]
  else:
    lines += ["No LM results.", ""]
  problems = [
    f"- skipped {s['what']}: {s['why']}" for s in payload.get("skipped", [])
  ] + [
    f"- error in {e['where']}: {e['error'].splitlines()[-1][:300]}"
    for e in payload.get("errors", [])
  ]
  problems += [
    f"- skipped LM {e['model']} k={e['k']}: {e['skipped']}"
    for e in payload.get("lm", [])
    if "skipped" in e
  ]
  problems += [
    f"- step {r['optimizer']} {r['dtype']} {r['size_mb']:g} MB: did not finish"
    for r in payload.get("step", [])
    if not {"ratios", "error", "skipped"} & set(r)
  ]
  problems += [
    f"- LM {e['model']} k={e['k']}: did not finish"
    for e in payload.get("lm", [])
    if "ours_vs_multisteps" not in e and "skipped" not in e
  ]
  if problems:
    lines += ["## Skipped and failed", "", *problems, ""]
  return "\n".join(lines).rstrip("\n") + "\n"


def render_figure(payload: dict[str, Any]):
  from matplotlib.figure import Figure

  fig = Figure(figsize=(11, 4.2))
  ax_step, ax_lm = fig.subplots(1, 2)
  steps = [r for r in payload.get("step", []) if "ratios" in r]
  shown = ("ours", "static", "nnx", "MultiSteps")
  width = 0.8 / len(shown)
  for i, name in enumerate(shown):
    values = [
      (r["ratios"]["micro_vs_floor"][name] or {}).get("median") or 0.0
      for r in steps
    ]
    ax_step.bar(
      np.arange(len(steps)) + i * width, values, width, label=LABELS[name]
    )
  ax_step.axhline(1.0, color="k", lw=0.8)
  ax_step.set_xticks(
    np.arange(len(steps)) + 0.4 - width / 2,
    [_params(r).replace(", ", "\n") for r in steps],
    fontsize=7,
  )
  ax_step.set_ylabel("micro-step / floor")
  ax_step.legend(fontsize=7)
  lm = [e for e in payload.get("lm", []) if "ours_vs_multisteps" in e]
  for i, name in enumerate(("ours", "MultiSteps")):
    ax_lm.bar(
      np.arange(len(lm)) + i * 0.4,
      [e[name]["tokens_per_s"]["median"] for e in lm],
      0.4,
      label=name,
    )
  ax_lm.set_xticks(
    np.arange(len(lm)) + 0.2, [f"{e['model']}\nk={e['k']}" for e in lm]
  )
  ax_lm.set_ylabel("LM tokens/s")
  ax_lm.legend(fontsize=7)
  m = payload.get("machine", {})
  fig.suptitle(f"{NAME} on {m.get('device_kind', '?')}", fontsize=10)
  fig.tight_layout()
  return fig


# What must agree for merged runs to share one header.
SAME_RUN_KEYS = ("device_kind", "backend", "jax", "jaxlib", "optax", "flax")
SAME_RUN_KEYS += ("optax_accum", "python")


def step_key(r: dict[str, Any]) -> str:
  return f"step {r['optimizer']} {r['dtype']} {r['size_mb']:g} MB"


def merge(payloads: list[dict[str, Any]]) -> dict[str, Any]:
  """One payload from several runs: a later run's step configuration or LM
  (model, k) replaces an earlier one's in place, and its skips and errors
  replace the earlier ones about it."""
  if len(payloads) == 1:
    return payloads[0]
  steps, lms, problems = {}, {}, {"skipped": [], "errors": []}
  for p in payloads:
    new = {step_key(r): r for r in p.get("step", [])}
    new.update({f"LM {e['model']} k={e['k']}": e for e in p.get("lm", [])})
    new.update({s["what"]: None for s in p.get("skipped", [])})
    new.update({e["where"]: None for e in p.get("errors", [])})
    for kind, key in (("skipped", "what"), ("errors", "where")):
      problems[kind] = [e for e in problems[kind] if e[key] not in new]
      problems[kind] += p.get(kind, [])
    steps.update({step_key(r): r for r in p.get("step", [])})
    lms.update({(e["model"], e["k"]): e for e in p.get("lm", [])})
  run_keys = ("timestamp", *SAME_RUN_KEYS)
  return {
    **payloads[-1],
    **problems,
    "step": list(steps.values()),
    "lm": list(lms.values()),
    "complete": all(p.get("complete") for p in payloads),
    "runs": [
      {
        **{k: p.get("machine", {}).get(k) for k in run_keys},
        **{k: p["args"].get(k) for k in ("budget_s", "k", "micro_batch")},
        "elapsed_s": p.get("elapsed_s"),
      }
      for p in payloads
    ],
  }


def render(sources: list[pathlib.Path], out: pathlib.Path) -> list:
  """Writes bench_gpu.md and bench_gpu.png from the results files alone
  (several: `merge`d)."""
  payload = merge([json.loads(pathlib.Path(s).read_text()) for s in sources])
  out.mkdir(parents=True, exist_ok=True)
  md, png = out / f"{NAME}.md", out / f"{NAME}.png"
  md.write_text(render_markdown(payload))
  render_figure(payload).savefig(png, dpi=110, bbox_inches="tight")
  return [md, png]


if __name__ == "__main__":
  sys.exit(main())
