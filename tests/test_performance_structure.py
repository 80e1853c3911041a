"""Structural guards for the speed and memory of `accumulate` (issue 3).

Never wall-clock time: each test reads the compiled training step
(``jit(grad -> tx.update -> optax.apply_updates)``, params and state donated)
and checks a property that makes it fast or small:

* the inner optimizer runs only inside a conditional branch (its ``sqrt``
  appears in no computation reachable from the entry without entering a
  branch), and the branch that holds copies nothing parameter-sized;
* the step's compiled footprint (argument + temp + output - alias bytes) is
  the plain inner step's plus the accumulator and nothing else;
* it is no larger than ``optax.MultiSteps``' footprint.

``benchmarks/bench_loop.py`` times the loops around such steps, and
records their footprints.
"""

import functools
import json
import math
import os
import subprocess
import sys

import _common
import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum
from optax_accum import _versions
from optax_accum.inspect._hlo import FREE_OPCODES, HloModule

WIDTH, LAYERS, MICRO_BATCH = 512, 4, 8  # 4 MB of float32 params.

# The accumulator may cost 5% more than its own bytes before a test fails:
# the measured extra is 0.75x (k > 1: the emitting step writes the updates
# into the accumulator's buffer, and the micro-step adds into it in place)
# to 1.00x (k=1, the accumulator is carried but never touched). The margin
# absorbs scalar fields and XLA's buffer packing, not a parameter-sized
# buffer (that would add >= 25%: each layer is a quarter of the params).
EXTRA_MEMORY_MARGIN = 1.05

OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-3),
  "clip_adamw": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
  ),
}

# (param dtype, accumulator_dtype): the default float32 accumulator, and for
# bf16 params also an accumulator in the params' own dtype.
DTYPES = {
  "f32": (jnp.float32, jnp.float32),
  "bf16": (jnp.bfloat16, jnp.float32),
  "bf16_acc_bf16": (jnp.bfloat16, None),
}

# XLA:CPU's default scheduler favours concurrency over memory. In the emitting
# branch of clip_by_global_norm on bf16 params it upcasts every gradient leaf
# to float32 before reducing any of them (the plain step, one computation,
# interleaves them), which costs 1x the bf16 param bytes more. The same step
# under the memory-minimising scheduler meets the target: see
# test_extra_memory_with_xla_memory_scheduler below.
_CONCURRENCY_SCHEDULER = pytest.mark.xfail(
  strict=False,
  reason="XLA:CPU's concurrency-optimised scheduler keeps every float32"
  " upcast of the bf16 mean gradient alive at once in the emitting branch",
)
SCHEDULER_BOUND = {
  ("clip_adamw", "bf16", 4),
  ("clip_adamw", "bf16_acc_bf16", 4),
}

MEMORY_CASES = [
  pytest.param(opt, dtype, k, id=f"{opt}-{dtype}-k{k}")
  for opt in OPTIMIZERS
  for dtype in DTYPES
  for k in (1, 4)
]


# ----------------------------------------------------------------------------
# The compiled step.
# ----------------------------------------------------------------------------


def _problem(dtype):
  key = jax.random.PRNGKey(0)
  params = {
    f"w{i}": (
      jax.random.normal(jax.random.fold_in(key, i), (WIDTH, WIDTH))
      / math.sqrt(WIDTH)
    ).astype(dtype)
    for i in range(LAYERS)
  }
  batch = (
    jnp.ones((MICRO_BATCH, WIDTH), dtype),
    jnp.zeros((MICRO_BATCH, WIDTH), dtype),
  )
  return params, batch


def _loss(params, batch):
  h, y = batch
  for name in sorted(params):
    h = jnp.tanh(h @ params[name])
  return jnp.mean(jnp.square((h - y).astype(jnp.float32)))


def _transformation(variant, opt, dtype, k):
  param_dtype, acc_dtype = DTYPES[dtype]
  inner = OPTIMIZERS[opt]()
  if variant == "plain":
    return inner
  if variant == "MultiSteps":
    return optax.MultiSteps(inner, k).gradient_transformation()
  if variant == "accumulate+noise":
    return optax_accum.accumulate(
      inner, k, accumulator_dtype=acc_dtype, track_noise_scale=True
    )
  return optax_accum.accumulate(inner, k, accumulator_dtype=acc_dtype)


@functools.cache
def _compiled(variant, opt, dtype, k, apply=optax.apply_updates):
  """The compiled step; cached, shared by the tests of this module.

  `apply(params, updates, state)`: ``optax.apply_updates`` (the state
  ignored) or :func:`optax_accum.apply_updates`.
  """
  tx = _transformation(variant, opt, dtype, k)
  params, batch = _problem(DTYPES[dtype][0])

  def step(params, state, batch):
    grads = jax.grad(_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    if apply is optax.apply_updates:
      return optax.apply_updates(params, updates), state
    return apply(params, updates, state), state

  state = jax.eval_shape(tx.init, params)
  args = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, state, batch)
  )
  return jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()


def _param_bytes(dtype):
  return LAYERS * WIDTH * WIDTH * jnp.dtype(DTYPES[dtype][0]).itemsize


def _accumulator_bytes(dtype):
  param_dtype, acc_dtype = DTYPES[dtype]
  return LAYERS * WIDTH * WIDTH * jnp.dtype(acc_dtype or param_dtype).itemsize


ADAM_SQRT = ("sqrt", "rsqrt")


# ----------------------------------------------------------------------------
# (a) The inner optimizer runs only inside the conditional.
# ----------------------------------------------------------------------------


def test_hlo_reader_sees_sqrt_of_plain_adam_on_every_call():
  """Control for the next test: without accumulation the sqrt is unconditional."""
  hlo = HloModule(_compiled("plain", "adam", "f32", 4).as_text())
  assert hlo.with_opcode(ADAM_SQRT) & hlo.unconditional()


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("variant", ["accumulate", "accumulate+noise"])
def test_inner_optimizer_runs_only_inside_the_conditional(variant, opt):
  hlo = HloModule(_compiled(variant, opt, "f32", 4).as_text())
  with_sqrt = hlo.with_opcode(ADAM_SQRT)
  assert with_sqrt, "Adam's sqrt vanished from the HLO: the test is stale"
  outside = with_sqrt & hlo.unconditional()
  assert not outside, f"inner optimizer ops run on every call: {outside}"
  in_branches = hlo.reachable(hlo.conditional_branches(), through_branches=True)
  assert with_sqrt <= in_branches


def _holding_branch_work(variant, opt):
  """Instructions of the non-emitting branch that produce big arrays."""
  hlo = HloModule(_compiled(variant, opt, "f32", 4).as_text())
  with_sqrt = hlo.with_opcode(ADAM_SQRT)

  def runs_inner(branch):
    return bool(hlo.reachable([branch], through_branches=True) & with_sqrt)

  # The other branches of the conditional whose emitting branch runs Adam.
  holding = [
    b
    for branches in hlo.conditionals()
    if any(map(runs_inner, branches))
    for b in branches
    if not runs_inner(b)
  ]
  assert holding, "no conditional branch without the inner optimizer"
  big = f"[{WIDTH},{WIDTH}]"
  return [
    i.line.strip()[:120]
    for b in holding
    for i in hlo.computations[b]
    if big in i.shape and i.opcode not in FREE_OPCODES
  ]


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_holding_branch_passes_the_accumulator_through(opt):
  """A micro-step's conditional copies or computes nothing parameter-sized."""
  assert _holding_branch_work("accumulate", opt) == []


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_holding_branch_passes_the_accumulator_through_with_noise_scale(opt):
  assert _holding_branch_work("accumulate+noise", opt) == []


# ----------------------------------------------------------------------------
# (b) Extra memory = the accumulator; (c) no more than MultiSteps.
# ----------------------------------------------------------------------------


def _extra_memory_ratio(
  opt, dtype, k, variant="accumulate", apply=optax.apply_updates
):
  """(footprint - plain footprint) / accumulator bytes, and / param bytes."""
  extra = _common.footprint(
    _compiled(variant, opt, dtype, k, apply)
  ) - _common.footprint(_compiled("plain", opt, dtype, 1))
  return extra / _accumulator_bytes(dtype), extra / _param_bytes(dtype)


@pytest.mark.parametrize(
  "opt, dtype, k",
  [
    pytest.param(*case.values, id=case.id, marks=_CONCURRENCY_SCHEDULER)
    if tuple(case.values) in SCHEDULER_BOUND
    else case
    for case in MEMORY_CASES
  ],
)
def test_extra_memory_is_the_accumulator_and_nothing_else(opt, dtype, k):
  ratio, of_params = _extra_memory_ratio(opt, dtype, k)
  assert ratio <= EXTRA_MEMORY_MARGIN, (
    f"accumulate needs {ratio:.3f}x the accumulator's bytes over the plain"
    f" step ({of_params:.3f}x the param bytes)"
  )


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_extra_memory_with_apply_updates(dtype):
  """The step as the guides write it (``optax_accum.apply_updates``) needs
  no more than with ``optax.apply_updates``: the updates the params'
  conditional reads stay in the accumulator's buffer as leftovers (a
  select returning it to zeros after that conditional wrote out of place:
  1.25x-1.49x the accumulator). With leftovers the XLAs of jax 0.10.2 and
  0.12 both give 1.0002x or less.
  """
  ours, _ = _extra_memory_ratio(
    "adam", dtype, 4, apply=optax_accum.apply_updates
  )
  theirs, _ = _extra_memory_ratio("adam", dtype, 4)
  assert ours <= EXTRA_MEMORY_MARGIN, ours
  assert ours <= theirs + 0.01, (ours, theirs)


def test_extra_memory_with_xla_memory_scheduler():
  """The cases left to XLA's scheduler above meet the target without it.

  XLA flags are read once per process, so this compiles in a subprocess.
  """
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
  result = subprocess.run(
    [
      sys.executable,
      __file__,
      *(",".join(map(str, c)) for c in sorted(SCHEDULER_BOUND)),
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  ratios = json.loads(result.stdout.strip().splitlines()[-1])
  margins = {
    f"{o}-{d}-k{k}": EXTRA_MEMORY_MARGIN for o, d, k in SCHEDULER_BOUND
  }
  # While the CPU form returned the accumulator to zeros with a select at
  # every call, this scheduler placed the select before a read of the
  # updates it overwrote: up to 1.374x for bf16 clip_adamw (jax 0.12). It
  # now leaves them as leftovers: 0.999x (jax 0.12.0.1), 1.0001x (0.10.2).
  assert ratios.keys() == margins.keys(), ratios
  assert all(ratios[c] <= margins[c] for c in ratios), ratios


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_noise_scale_adds_no_parameter_sized_memory(opt):
  """Two float32 scalars a micro-step; no buffer (< 1% of the params)."""
  ours = _common.footprint(_compiled("accumulate+noise", opt, "f32", 4))
  base = _common.footprint(_compiled("accumulate", opt, "f32", 4))
  assert ours - base <= 0.01 * _param_bytes("f32"), (
    f"track_noise_scale costs {(ours - base) / _param_bytes('f32'):.3f}x"
    " the param bytes"
  )


# XLA:CPU of jax 0.12 (seen on 0.12.0.1; 0.11 untested) compiles MultiSteps'
# clip_adamw step on bf16 params 2.0 MiB tighter than jax 0.10.2's (15.02
# against 17.03 MiB: its temporaries 5.24 against 7.36 MB), and
# accumulate's to the same 16,794,673 bytes as before: what its emitting
# branch holds is `_CONCURRENCY_SCHEDULER`'s, the float32 upcasts of the
# bf16 mean gradient for clip_by_global_norm's norm (wrapped_convert.9 and
# .10 in the buffer assignment) live beside adamw's float32 temporaries
# (convert_multiply_fusion, .1): 1.0 MiB over MultiSteps, one float32 layer.
# Case -> the most bytes over MultiSteps allowed.
MULTISTEPS_MISSES = {}
if _versions.jax_at_least("0.12"):
  MULTISTEPS_MISSES[("clip_adamw", "bf16", 4)] = 1.05 * WIDTH * WIDTH * 4


@pytest.mark.parametrize("opt, dtype, k", MEMORY_CASES)
def test_footprint_is_at_most_multisteps(opt, dtype, k):
  ours = _common.footprint(_compiled("accumulate", opt, dtype, k))
  theirs = _common.footprint(_compiled("MultiSteps", opt, dtype, k))
  message = (
    f"accumulate {ours / 2**20:.2f} MB > MultiSteps {theirs / 2**20:.2f} MB"
  )
  if (opt, dtype, k) in MULTISTEPS_MISSES:
    # Strict: the known miss and no more (fixed, it fails here).
    assert theirs < ours <= theirs + MULTISTEPS_MISSES[opt, dtype, k], message
    pytest.xfail(f"known, XLA:CPU's scheduler: {message}")
  assert ours <= theirs, message


if __name__ == "__main__":
  # `python test_performance_structure.py opt,dtype,k ...` prints the extra
  # memory ratios as JSON (used by test_extra_memory_with_xla_memory_scheduler).
  cases = [arg.split(",") for arg in sys.argv[1:]]
  print(
    json.dumps(
      {
        f"{opt}-{dtype}-k{k}": _extra_memory_ratio(opt, dtype, int(k))[0]
        for opt, dtype, k in cases
      }
    )
  )
