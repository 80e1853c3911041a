"""The project's mutants: small edits that change what a user gets.

``make mutants`` (never part of ``make test``) plants each mutant, one at a
time, in a temporary copy of the repository (tracked and untracked files,
not the ignored ones) and runs the tests that cover it there, with the copy
first on ``PYTHONPATH``. A mutant is *killed* when those tests fail, and
*survives* when they pass. The run prints one line per mutant, then the
kill rate and the survivors, and exits non-zero when a mutant survived or
no longer applies (its ``old`` text must occur exactly once in its file: a
mutant that no longer applies is reported, never silently skipped).

Each mutant is a behaviour change a user would see (the ``why``), not a
syntax error: a later change to the code it edits should either keep it
applying or replace it with the same behaviour's new spelling. Before the
mutants, each distinct test selection runs once unmutated (it must pass, or
a kill would mean nothing); ``--no-baseline`` skips that.

Usage::

  python tools/mutants.py                 # all, one at a time
  python tools/mutants.py -j 2            # two copies side by side
  python tools/mutants.py issue-1 flush   # names, or substrings of them
  python tools/mutants.py --list
  python tools/mutants.py --tests tests/test_differential.py issue-1
"""

import argparse
import concurrent.futures
import dataclasses
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  path: str  # relative to the repository root
  old: str  # must occur exactly once in `path`
  new: str
  tests: tuple[str, ...]  # pytest arguments: files, `-k` selections
  why: str  # what a user would see
  # The venv whose Python (and compilers, VENV/accel) runs the tests, for a
  # behaviour only an older jax shows; None: this Python.
  venv: str | None = None


def _m(name, path, old, new, tests, why, venv=None):
  return Mutant(name, f"optax_accum/{path}", old, new, tuple(tests), why, venv)


EDGES = "tests/test_edges.py"
DIFF = "tests/test_differential.py"
ACC = "tests/test_accumulate.py"
STATIC = "tests/test_static_cycle.py"
NOISE = "tests/test_noise_scale.py"
EVERY_K = "tests/test_every_k.py"
MULTI = ("tests/test_multisteps.py", "tests/test_multisteps_checkpoints.py")
FORMS = "tests/test_backend_forms.py"
FLAX = "tests/test_flax_dropins.py"

MUTANTS = [
  _m(
    "acc_grads reads the CPU leftovers",
    "_state.py",
    "  return _open_cycle(self, self.acc_buffer)\n",
    "  return self.acc_buffer\n",
    [FORMS],
    "opt_state.acc_grads after a cycle's end: the last updates on a laptop,"
    " zeros on a GPU",
  ),
  # -- apply_updates' contract tells when it is broken (issue 54). ---------
  _m(
    "apply_updates slow route silent",
    "_apply.py",
    "  _warn_slow_route(record)\n",
    "",
    ["tests/test_apply_updates.py"],
    "updates transformed after accumulate: the step copies on every"
    " micro-step and nothing says why",
  ),
  # -- The eleven of issue 37 (tests/test_edges.py holds each). ------------
  _m(
    "issue-1 fractional total weight left undivided",
    "_inner.py",
    "1.0 / jnp.where(total_weight <= 0, 1.0, total_weight)",
    "1.0 / jnp.where(total_weight <= 1, 1.0, total_weight)",
    [EDGES, "-k", "fractional"],
    "weights 0.25 + 0.25 of [2, 4]: updates [-1, -2] instead of [-2, -4]",
  ),
  _m(
    "issue-2 summed gradients multiplied by their weight",
    "_accumulate.py",
    'scale = weighted and config.gradients == "mean"',
    "scale = weighted",
    [EDGES, "-k", "summed_gradients"],
    'gradients="sum" with weight=: the gradient counted w times',
  ),
  _m(
    "issue-3 float schedule rounded up",
    "_every_k.py",
    "k = jnp.floor(k.astype(jnp.float32))",
    "k = jnp.ceil(k.astype(jnp.float32))",
    [EDGES, "-k", "rounded_down"],
    "every_k(step) = 2.5 gives cycles of 3, not 2",
  ),
  _m(
    "issue-4 integer schedule below 1 kept",
    "_every_k.py",
    "jnp.minimum(jnp.maximum(k, 1), INT32_MAX)",
    "jnp.minimum(jnp.maximum(k, 0), INT32_MAX)",
    [EDGES, "-k", "below_one"],
    "a schedule returning 0 or -1: current_every_k reads 0",
  ),
  _m(
    "issue-5 k=1 pass-through forgets weight_seen",
    "_accumulate.py",
    "weight_seen=_state_lib.add_weight_seen(\n      state.weight_seen,"
    " jnp.ones([], jnp.float32)\n    ),",
    "weight_seen=state.weight_seen,",
    [EDGES, "-k", "weight_seen_of_every_call"],
    "every_k=1: weight_seen stays 0 (a token schedule never advances)",
  ),
  _m(
    "issue-6 weightless cycle's inner state kept under selects",
    "_forms.py",
    "state = select(weighted, ran.inner_state, operands.state)",
    "state = ran.inner_state",
    [EDGES, "-k", "weightless"],
    "a weightless cycle ended with emit=True (or on GPU/TPU) steps Adam",
  ),
  _m(
    "issue-7 k=1 pass-through drops extra arguments",
    "_accumulate.py",
    "grads, state.inner_state, params, **extra_args\n  )",
    "grads, state.inner_state, params\n  )",
    [EDGES, "-k", "extra_arguments"],
    "every_k=1 with value=: the inner raises a TypeError",
  ),
  _m(
    "issue-8 summed noise sample times its weight",
    "_noise_scale.py",
    "sample = norm / jnp.where(weight > 0, weight, 1.0)",
    "sample = weight * norm",
    [EDGES, "-k", "noise_scale"],
    'gradients="sum": the noise scale -33.8 instead of 3.53',
  ),
  _m(
    "issue-9 bias correction one cycle late",
    "_noise_scale.py",
    "** cycles.astype(jnp.float32)",
    "** (cycles + 1).astype(jnp.float32)",
    [EDGES, "-k", "closed_form"],
    "noise_scale_components after 1 cycle: half the truth",
  ),
  _m(
    "issue-10 from_multisteps loses has_updated",
    "multisteps.py",
    "emitted=(n == 0) & (step > 0),",
    "emitted=fresh.emitted,",
    [EDGES, "-k", "keeps_has_updated"],
    "converted at a boundary: has_updated False where MultiSteps said True",
  ),
  _m(
    "issue-11 from_multisteps ignores every_k=",
    "multisteps.py",
    "    k = jnp.asarray(every_k, jnp.int32)\n",
    "    pass\n",
    [EDGES, "-k", "honours_every_k"],
    "the converted run updates after the target's k, not the one given",
  ),
  _m(
    "to_multisteps keeps leftovers",
    "multisteps.py",
    "acc = jax.tree.map(lambda a: jnp.where(empty, jnp.zeros([], a.dtype), a), acc)",
    "pass",
    [
      MULTI[1],
      FORMS,
      "-k",
      "continues_under_multisteps and end or to_multisteps",
    ],
    "converted at a CPU cycle's end: MultiSteps adds the last update again",
  ),
]


MUTANTS += [
  # -- Weights, sums and the mean. -----------------------------------------
  _m(
    "weight ignored in the add",
    "_accumulate.py",
    "weight=weight if scale else None, keep=keep",
    "weight=None, keep=keep",
    [DIFF, "-k", "k3 and not nojit"],
    "weight=n: every micro-batch counts once in the sum",
  ),
  _m(
    "total weight counts micro-batches",
    "_accumulate.py",
    "weight=cycle_weight + jnp.where(accepted, weight, 0.0),",
    "weight=cycle_weight + jnp.where(accepted, 1.0, 0.0),",
    [DIFF, "-k", "k3 and not nojit"],
    "weight=n: the sum divided by the number of micro-batches",
  ),
  _m(
    "extra arguments dropped on emitting calls",
    "_inner.py",
    "grad, operands.state, params, **inner.extra_args",
    "grad, operands.state, params",
    [EDGES, "-k", "extra_arguments"],
    "update(..., value=v): inner raises a TypeError",
  ),
  _m(
    "reduction='sum' divides anyway",
    "_inner.py",
    'if config.reduction == "mean":',
    "if True:",
    [DIFF, "-k", "sum_reduction and not nojit"],
    'reduction="sum" emits the mean',
  ),
  _m(
    "zero-weight NaN multiplies instead of selecting",
    "_accumulate.py",
    "term = ops.select(keep, term, ops.zero(term))",
    "term = term * keep.astype(term.dtype)",
    [ACC, "-k", "zero_weight_micro_batch"],
    "the 0/0 mean of an all-padding micro-batch poisons the cycle",
  ),
  _m(
    "emitted updates in the accumulator's dtype",
    "_forms.py",
    "lambda b, t: jnp.where(updated, b.astype(t.dtype), 0),",
    "lambda b, t: jnp.where(updated, b, 0),",
    [ACC, "-k", "dtypes_match"],
    "bf16 params: the updates come back float32",
  ),
  _m(
    "inner sees the accumulator's dtype",
    "_inner.py",
    "lambda a, g: a.astype(g.dtype), grad,",
    "lambda a, g: a, grad,",
    [ACC, "-k", "dtypes_match or inner_state_takes"],
    "bf16 gradients: inner gets float32 ones (other updates and state)",
  ),
  # -- Counters and the cycle's end. -------------------------------------------
  _m(
    "flush ignored",
    "_accumulate.py",
    "ends=(micro_step >= state.every_k) | flush,",
    "ends=(micro_step >= state.every_k),",
    [DIFF, "-k", "k3 and not nojit"],
    "flush=True does not end the partial window",
  ),
  _m(
    "cycle ends one micro-batch late",
    "_accumulate.py",
    "ends=(micro_step >= state.every_k) | flush,",
    "ends=(micro_step > state.every_k) | flush,",
    [DIFF, "-k", "(k1_weights or k3) and not nojit"],
    "every_k=k: an update every k + 1 calls",
  ),
  _m(
    "skipped micro-batch counts toward k",
    "_accumulate.py",
    "micro_step = state.micro_step + accepted.astype(jnp.int32)",
    "micro_step = state.micro_step + 1",
    [DIFF, "-k", "k3 and not nojit"],
    "skip_nonfinite: a dropped micro-batch shortens the cycle",
  ),
  _m(
    "step counts weightless cycles",
    "_accumulate.py",
    "step = jnp.where(updated, optax.safe_increment(state.step), state.step)",
    "step = jnp.where(ends, optax.safe_increment(state.step), state.step)",
    [DIFF, "-k", "k3 and not nojit"],
    "a cycle of weight 0 advances the optimizer step (and schedules)",
  ),
  _m(
    "micro_step kept after a weightless end",
    "_accumulate.py",
    "micro_step=jnp.where(ends, 0, cycle.micro_step),",
    "micro_step=jnp.where(updated, 0, cycle.micro_step),",
    [DIFF, "-k", "(k1_weights or k3) and not nojit"],
    "after a weightless cycle the counter runs on past k",
  ),
  _m(
    "num_skipped counts accepted micro-batches",
    "_accumulate.py",
    "accepted, state.num_skipped, optax.safe_increment(state.num_skipped)",
    "accepted, optax.safe_increment(state.num_skipped), state.num_skipped",
    [DIFF, "-k", "k3 and not nojit"],
    "num_skipped counts the good micro-batches",
  ),
  _m(
    "weight_seen counts micro-batches",
    "_accumulate.py",
    "_state_lib.add_weight_seen(state.weight_seen, result.cycle_weight),",
    "_state_lib.add_weight_seen(\n"
    "      state.weight_seen, cycle.micro_step.astype(jnp.float32)\n    ),",
    [DIFF, "-k", "k3 and not nojit"],
    "weight_seen (tokens trained on) counts micro-batches",
  ),
  _m(
    "weight_seen uncompensated",
    "_state.py",
    "lost = (new_total - total) - y",
    "lost = 0.0 * y",
    [EVERY_K, "-k", "compensated"],
    "past 2**24 tokens, weight_seen stops moving",
  ),
  # -- Options: skip_nonfinite, the pass-through, schedules. -------------------
  _m(
    "skip_nonfinite off",
    "_accumulate.py",
    "  if config.skip_nonfinite:\n    # A zero-weight",
    "  if False:\n    # A zero-weight",
    [DIFF, "-k", "k3 and not nojit"],
    "skip_nonfinite=True: a NaN micro-batch reaches inner",
  ),
  _m(
    "zero-weight NaN dropped by skip_nonfinite",
    "_accumulate.py",
    "accepted = jnp.isfinite(weight) & (finite | (weight == 0))",
    "accepted = jnp.isfinite(weight) & finite",
    [ACC, "-k", "zero_weight_micro_batch"],
    "an all-padding micro-batch is skipped: no longer counts toward k",
  ),
  _m(
    "k=1 pass-through ignores weights",
    "_accumulate.py",
    "    and call.weight is None\n",
    "",
    [DIFF, "-k", "k1_weighted and not nojit"],
    "every_k=1 with weight=0: the gradient is applied anyway",
  ),
  _m(
    "k=1 pass-through ignores skip_nonfinite",
    "_accumulate.py",
    "    and not config.skip_nonfinite\n",
    "",
    [DIFF, "-k", "k1_skip and not nojit"],
    "every_k=1 with skip_nonfinite: a NaN gradient reaches inner",
  ),
  _m(
    "schedule called with the step before the update",
    "_every_k.py",
    "return _scheduled(spec, step, _state.total_of(weight_seen)), grow_state",
    "return (\n    _scheduled(spec, step - 1, _state.total_of(weight_seen)),\n"
    "    grow_state,\n  )",
    [DIFF, "-k", "schedule and not nojit"],
    "every_k(step): each cycle gets the previous cycle's k",
  ),
  _m(
    "schedule of the weight seen reads it before the cycle",
    "_accumulate.py",
    "step=step,\n      weight_seen=weight_seen,\n      noise=result.noise,",
    "step=step,\n      weight_seen=state.weight_seen,\n      noise=result.noise,",
    [DIFF, "-k", "seen_schedule and not nojit"],
    "piecewise_every_k switches one cycle late",
  ),
  # -- The ends: traced, emit=, the backend forms. -----------------------------
  _m(
    "traced end runs inner on a weightless cycle",
    "_forms.py",
    "enter = cycle.ends & ~(cycle.weight <= 0)",
    "enter = cycle.ends",
    [EDGES, "-k", "weightless"],
    "a cycle of weight 0 steps Adam and reports an update",
  ),
  _m(
    "emit=True emits a weightless cycle",
    "_forms.py",
    "updated=mean.operands.weighted,",
    "updated=jnp.asarray(True),",
    [DIFF, "-k", "emit_k3 and not nojit"],
    "emit=True on a cycle of weight 0: has_updated, step += 1",
  ),
  _m(
    "CPU own-buffer end steps inner on a weightless cycle",
    "_forms.py",
    "return _control.run_if_weighted(operands.weighted, run, skip, operands)",
    "return run(operands)",
    [EDGES, "-k", "weightless"],
    "bf16 accumulator, weightless cycle: Adam's count moves",
  ),
  _m(
    "acc_weight kept after a cycle ends",
    "_forms.py",
    "acc_weight=jnp.where(cycle.ends, 0.0, branch.weight),",
    "acc_weight=branch.weight,",
    [FORMS, "-k", "same_run and bf16_accumulator"],
    "zeros marked as leftovers: GPU/TPU throw the next cycle away",
  ),
  _m(
    "emit=True keeps acc_weight",
    "_forms.py",
    "engine)\n    return ended(ran, acc, jnp.zeros_like(cycle.weight))",
    "engine)\n    return ended(ran, acc, cycle.weight)",
    [FORMS, "-k", "same_run and static"],
    "zeros marked as leftovers: after emit=True, GPU/TPU lose the next cycle",
  ),
  _m(
    "leftovers read on CPU",
    "_accumulate.py",
    "return _control.cleared(fresh, acc, engine), jnp.where(",
    "return acc, jnp.where(",
    [FORMS, "-k", "never_read and cpu"],
    "a CPU cycle's leftover update joins the next one",
  ),
  _m(
    "a weightless CPU cycle's end unmarked",
    "_forms.py",
    "params, out, jnp.where(ends & (weight == 0), -jnp.inf, weight)",
    "params, out, weight",
    [FORMS, "-k", "same_run and weightless_sum"],
    "a CPU state resumed on GPU/TPU adds a weightless cycle's sum",
  ),
  _m(
    "leftovers kept on GPU/TPU",
    "_accumulate.py",
    "return acc, jnp.where(leftovers, -jnp.inf, acc_weight)",
    "return acc, acc_weight",
    [FORMS, "-k", "v01_cpu_state_resumes and accelerator"],
    "a CPU checkpoint's leftover update joins the next one on GPU/TPU",
  ),
  _m(
    "apply_updates skips a static emitting call",
    "_apply.py",
    "return optax.apply_updates(params, updates) if record.emitted else params",
    "return params",
    [STATIC, "-k", "equals_the_traced_run or given_no_params"],
    "emit=True: the params never move",
  ),
  # -- The noise scale. ---------------------------------------------------------
  _m(
    "noise counts zero-weight samples",
    "_noise_scale.py",
    "counted = accepted & (weight > 0)\n  norm",
    "counted = accepted\n  norm",
    [DIFF, "-k", "k3 and not nojit"],
    "padding micro-batches bias the noise scale",
  ),
  _m(
    "noise trace divided by m",
    "_noise_scale.py",
    "safe_count = jnp.where(valid, count - 1, 1.0)",
    "safe_count = jnp.where(valid, count, 1.0)",
    [EDGES, "-k", "closed_form"],
    "tr(Sigma) biased low by (m - 1) / m",
  ),
  _m(
    "noise |G|^2 not debiased",
    "_noise_scale.py",
    "grad_sq = mean_sq_norm - trace / safe_weight",
    "grad_sq = mean_sq_norm",
    [EDGES, "-k", "closed_form"],
    "|G|^2 biased high by tr(Sigma) / W",
  ),
  _m(
    "noise folds one-sample cycles",
    "_noise_scale.py",
    "valid = (count >= 2) & (total_weight > 0)",
    "valid = (count >= 1) & (total_weight > 0)",
    [NOISE, "-k", "single_micro_batch or nan_until"],
    "a flushed cycle of one micro-batch gives an Inf/NaN estimate",
  ),
  # -- Migration and the Flax drop-ins. ------------------------------------------
  _m(
    "from_multisteps keeps the running mean as the sum",
    "multisteps.py",
    "scale = n.astype(jnp.float32) if mean else jnp.float32(1)",
    "scale = jnp.float32(1)",
    [MULTI[1], "-k", "continues_under_accumulate"],
    "a converted mid-cycle run loses (n - 1) / n of the partial sum",
  ),
  _m(
    "from_multisteps weight_seen counts updates",
    "multisteps.py",
    "jnp.stack([(step * k).astype(jnp.float32), jnp.float32(0)])",
    "jnp.stack([step.astype(jnp.float32), jnp.float32(0)])",
    [EDGES, "-k", "keeps_has_updated"],
    "token schedules restart after a conversion",
  ),
  _m(
    "to_multisteps hands the sum as the mean",
    "multisteps.py",
    "acc = jax.tree.map(lambda a: (a * inv).astype(a.dtype), state.acc_grads)",
    "acc = state.acc_grads",
    [MULTI[1], "-k", "continues_under_multisteps"],
    "going back mid-cycle: the partial sum counted n times",
  ),
  _m(
    "linen TrainState drops weight",
    "flax/_linen.py",
    '      "TrainState.apply_gradients",\n      weight=weight,',
    '      "TrainState.apply_gradients",\n      weight=None,',
    [DIFF, "-k", "linen and jit"],
    "TrainState.apply_gradients(weight=n) averages unweighted",
  ),
  _m(
    "nnx Optimizer drops keyword arguments",
    "flax/_nnx.py",
    "      grads, opt_state, params, **options, **kwargs",
    "      grads, opt_state, params, **kwargs",
    [DIFF, "-k", "nnx and jit"],
    "Optimizer.update(weight=, emit=) ignored",
  ),
  # -- Issue 52: the packed state, narrow updates on GPU/TPU, the CPU
  # static end, 0.2 checkpoints. ------------------------------------------
  _m(
    "a weightless bf16 cycle's sum kept on GPU/TPU",
    "_forms.py",
    "    acc = engine.cleared(cycle.ends, cycle.acc, cycle.acc)\n",
    "    acc = cycle.acc\n",
    [FORMS, "-k", "bf16_params"],
    "a weightless cycle's sum (bf16 params, GPU/TPU) joins the next cycle",
  ),
  _m(
    "bf16 cycle on GPU/TPU folds no noise",
    "_forms.py",
    "params=ran.params,\n      noise=mean.noise,",
    "params=ran.params,\n      noise=cycle.noise,",
    [FORMS, "-k", "bf16_params"],
    "noise_scale never moves with bf16 params on GPU/TPU",
  ),
  _m(
    "a weightless static CPU end unmarked",
    "_forms.py",
    "    weight = jnp.where(cycle.weight == 0, -jnp.inf, cycle.weight)",
    "    weight = cycle.weight",
    [FORMS, STATIC, EDGES, "-k", "static or weightless"],
    "after emit=True on a weightless cycle, its sum is read as a cycle",
  ),
  _m(
    "the counters packed out of order",
    "_state.py",
    "    micro_step=c[..., 0],\n    step=c[..., 1],",
    "    micro_step=c[..., 1],\n    step=c[..., 0],",
    [ACC, "-k", "jit and not nojit"],
    "micro_step and step swapped after one call",
  ),
  Mutant(
    "a 0.2 checkpoint loses its weight_seen",
    "optax_accum/upgrade.py",
    "    weight_seen=old.weight_seen,",
    "    weight_seen=jnp.zeros(2),",
    ("tests/test_upgrade.py",),
    "a resumed 0.2 run's weight schedule starts over",
  ),
  # -- Issue 55: blind spots, second set (the behaviours it lists, each
  # planted as it describes, and their families). -------------------------
  _m(
    "k=1 emit=False no longer refused",
    "_checks.py",
    "  if not emit and fixed_every_k == 1:",
    "  if False:",
    [STATIC, "-k", "every_k_1"],
    "emit=False at every_k=1 holds a cycle the next call never reads",
  ),
  _m(
    "a narrow accumulator rounds each term too",
    "_accumulate.py",
    "  total = acc.astype(compute) + term\n",
    "  term = term.astype(acc.dtype).astype(compute)\n"
    "  total = acc.astype(compute) + term\n",
    ["tests/test_dtypes.py", "-k", "narrow"],
    "bf16/f16 sums rounded twice per add: other sums than one rounding",
  ),
  _m(
    "float64 terms weighted and added in float32",
    "_accumulate.py",
    "  if dtype.itemsize >= 8 or jnp.issubdtype(dtype, jnp.complexfloating):",
    "  if dtype.itemsize > 8 or jnp.issubdtype(dtype, jnp.complexfloating):",
    ["tests/test_dtypes.py", "-k", "float64"],
    "under x64 a float64 accumulator sums at float32's precision",
  ),
  _m(
    "float64 mean taken with a float32 inverse",
    "_inner.py",
    "  total_weight = total_weight.astype(dtype)\n",
    "  total_weight = total_weight.astype(jnp.float32)\n",
    ["tests/test_dtypes.py", "-k", "float64"],
    "under x64 the mean of float64 gradients is off by ~1e-8",
  ),
  _m(
    "a zero-weight summed NaN reaches the cycle under skip_nonfinite",
    "_accumulate.py",
    "  if scale or (weighted and config.skip_nonfinite):",
    "  if scale:",
    [EDGES, "-k", "zero_weight_summed"],
    "gradients='sum', skip_nonfinite: a NaN at weight 0 poisons the cycle",
  ),
  _m(
    "restore_target ignores the accumulator_dtype of tx",
    "multisteps.py",
    "    accumulator_dtype = config.accumulator_dtype",
    "    accumulator_dtype = jnp.float32",
    ["tests/test_restores.py", "-k", "accumulator_dtype_of_tx"],
    "a bf16 (or None) accumulator's MultiSteps checkpoint restored as float32",
  ),
  _m(
    "to_multisteps drops its skip_state",
    "multisteps.py",
    "    skip_state=skip_state,\n  )",
    "    skip_state=(),\n  )",
    [*MULTI, "-k", "skip_state"],
    "MultiSteps(should_skip_update_fn=...) cannot run on the converted state",
  ),
  _m(
    "linen apply_gradients drops the field replacements",
    "flax/_linen.py",
    "      opt_state=opt_state,\n      **kwargs,",
    "      opt_state=opt_state,",
    [FLAX, "-k", "fields"],
    "a BatchNorm model's batch_stats never updated",
  ),
  _m(
    "linen apply_gradients ignores emit=",
    "flax/_linen.py",
    "      flush=flush,\n      emit=emit,\n    )",
    "      flush=flush,\n      emit=None,\n    )",
    [FLAX, "-k", "keyword"],
    "emit=True before k does not end the cycle: the counter decides",
  ),
  _m(
    "the Optimizer drop-in drops update's keywords",
    "flax/_nnx.py",
    "      grads, opt_state, params, **options, **kwargs",
    "      grads, opt_state, params, **kwargs",
    [FLAX, "-k", "keyword"],
    "weight=, flush=, emit= to nnx Optimizer.update do nothing",
  ),
  _m(
    "reduce_dtype accepted without axis_name",
    "_checks.py",
    '  if axis_name is None:\n    raise ValueError(\n      "`reduce_dtype`',
    '  if axis_name is None:\n    return None\n    raise ValueError(\n      "`reduce_dtype`',
    ["tests/test_arguments.py", "-k", "reduce_dtype"],
    "reduce_dtype=bf16 on one device accepted and silently ignored",
  ),
  _m(
    "complex gradients for real params cast silently",
    "_checks.py",
    "    if jnp.iscomplexobj(g) and not jnp.iscomplexobj(a):",
    "    if False:",
    ["tests/test_arguments.py", "-k", "complex"],
    "outside pytest the imaginary part is dropped, updates [-1+0j, -3+0j]",
  ),
  # Found by an audit of every keyword (issue 55, item 4: the families).
  _m(
    "an eager update of unreduced gradients passes flush=False on",
    "_checks.py",
    '  if flush is not False:\n    as_given["flush"] = flush\n',
    '  as_given["flush"] = flush\n',
    ["tests/test_jit_unreduced.py", "-k", "eager_update_takes"],
    "emit= raises there, naming a flush the caller never passed",
  ),
  _m(
    "an eager update of unreduced gradients drops inner's arguments",
    "_accumulate.py",
    "      updates, state, params, **call.as_given, **extra_args",
    "      updates, state, params, **call.as_given",
    ["tests/test_jit_unreduced.py", "-k", "eager_update_takes"],
    "value=10 reaches inner under jit, not in an eager call",
  ),
  _m(
    "k=1 runs inner alone past a narrow accumulator",
    "_accumulate.py",
    "    and _forms.fits(updates, acc)\n",
    "",
    ["tests/test_dtypes.py", "-k", "every_k_1"],
    "bf16 accumulator at k=1: rounded with weight=, not without",
  ),
  _m(
    "the drop-ins pass accumulate's options to any optimizer",
    "_checks.py",
    "  if given and find_state(opt_state, reader, missing_ok=True) is None:",
    "  if False:",
    [FLAX, "-k", "refused"],
    "TrainState(tx=optax.sgd).apply_gradients(weight=0) updates anyway",
  ),
  _m(
    "the drop-ins pass options not given",
    "_checks.py",
    "    if value is not defaults[name]\n",
    "    if True\n",
    [FLAX, "-k", "without_extra_arguments"],
    "linen TrainState with optax.scale: TypeError on `flush`",
  ),
  _m(
    "the Optimizer drop-in drops inner's own arguments",
    "flax/_nnx.py",
    "      grads, opt_state, params, **options, **kwargs",
    "      grads, opt_state, params, **options",
    [FLAX, "-k", "extra_arguments"],
    "Optimizer.update(model, grads, value=...) never reaches inner",
  ),
  _m(
    "noise_scale_decay accepted without track_noise_scale",
    "_noise_scale.py",
    "  if not track_noise_scale and np.float32(decay) != np.float32(DEFAULT_DECAY):",
    "  if False:",
    ["tests/test_arguments.py", "-k", "noise_scale_decay"],
    "noise_scale_decay=0.9 without tracking accepted and unused",
  ),
  _m(
    "flax local_value_and_grad ignores has_aux",
    "flax/_grad.py",
    "      has_aux=has_aux,",
    "      has_aux=False,",
    ["tests/test_flax_mesh.py", "-k", "keywords_reach"],
    "a loss returning (value, aux) is differentiated as one output",
  ),
  _m(
    "flax local_value_and_grad ignores wrt",
    "flax/_grad.py",
    "    graphdef, params, *others = nnx.split(model, wrt, ...)",
    "    graphdef, params, *others = nnx.split(model, nnx.Param, ...)",
    ["tests/test_flax_mesh.py", "-k", "keywords_reach"],
    "wrt=<a subset> gives gradients of every Param",
  ),
  _m(
    "a NaN schedule value under jit counts as k=1",
    "_every_k.py",
    "  k = jnp.where(jnp.isnan(k), jnp.inf, k)",
    "  k = jnp.where(jnp.isnan(k), 1.0, k)",
    [EVERY_K, "-k", "nan"],
    "a schedule gone NaN updates on every call instead of holding the cycle",
  ),
  _m(
    "microbatch's NaN total weight gives zeros",
    "_microbatch.py",
    "    jnp.where(bad, jnp.nan, r) if jnp.issubdtype(r.dtype, jnp.inexact) else r",
    "    r",
    ["tests/test_microbatch.py", "-k", "total_weight"],
    "a NaN total weight under jit gives a finite gradient, not NaN",
  ),
]

INPUTS = "tests/test_inputs_and_states.py"
MUTANTS += [
  # -- Issue 63: inputs, states and warnings no test held. -----------------
  _m(
    "emit takes only a Python bool",
    "_checks.py",
    "  if not isinstance(emit, bool | np.bool_):",
    "  if not isinstance(emit, bool):",
    [INPUTS, "-k", "numpy_bool"],
    "update(..., emit=np.bool_(True)) raises a TypeError",
  ),
  _m(
    "flush taken only as a Python bool or an array",
    "_checks.py",
    "      jnp.result_type(flush) == jnp.bool_ and jnp.ndim(flush) == 0",
    "      isinstance(flush, bool | jax.Array) and jnp.ndim(flush) == 0",
    [INPUTS, "-k", "every_form_of_a_keyword"],
    "update(..., flush=np.bool_(True)) raises a TypeError",
  ),
  _m(
    "an abstract state reads weight_seen as a scalar",
    "_state.py",
    "    width = () if isinstance(index, int) else (index.stop - index.start,)",
    "    width = ()",
    [INPUTS, "-k", "abstract"],
    "jax.eval_shape(tx.init, params).weight_seen has shape () not (2,)",
  ),
  _m(
    "has_updated reads an abstract state's value",
    "_state.py",
    "  if isinstance(emitted, jax.ShapeDtypeStruct):\n    return as_read(emitted)\n",
    "",
    [INPUTS, "-k", "abstract"],
    "optax_accum.has_updated(jax.eval_shape(tx.init, params)) raises a"
    " TypeError (len() of unsized object)",
  ),
  _m(
    "holds exactly compares mantissas only",
    "_forms.py",
    "  return w.nmant >= n.nmant and w.maxexp >= n.maxexp and w.minexp <= n.minexp",
    "  return w.nmant >= n.nmant",
    [INPUTS, "-k", "narrower_range"],
    "a float16 accumulator, bf16 gradient 1e6, k=1: -999424, not -inf",
  ),
  _m(
    "the inverse weight in the narrowest dtype",
    "_accumulate.py",
    "    key=lambda d: d.itemsize,",
    "    key=lambda d: -d.itemsize,",
    [INPUTS, "-k", "two_float_widths"],
    "x64, float32 and float64 leaves: the float64 mean 5.6e-9 off",
  ),
  _m(
    "replace writes the stored weight as it reads",
    "_state.py",
    '      current["acc_weight"] = _entry(self.acc_scalars, 0)\n',
    "",
    [FORMS, "-k", "replace_with and cpu"],
    "state.replace(step=state.step) after a CPU cycle's end: acc_grads reads"
    " the leftovers; resumed on a GPU, a wrong update",
  ),
  _m(
    "replace(acc_weight=) drops the mark beside leftovers",
    "_state.py",
    '      if "acc_weight" in named and "acc_grads" not in values:',
    "      if False:",
    [FORMS, "-k", "replace_with and cpu"],
    "state.replace(acc_weight=state.acc_weight) after a CPU cycle's end:"
    " acc_grads reads the last cycle's updates",
  ),
  _m(
    "a 0.2 TrainState looked for only at the top of opt_state",
    "flax/_linen.py",
    "  return _V0_2_KEYS <= state_dict.keys() or any(\n"
    "    _holds_v0_2(v) for v in state_dict.values()\n"
    "  )",
    "  return _V0_2_KEYS <= state_dict.keys()",
    ["tests/test_upgrade.py", "-k", "converts_a_chain"],
    "a 0.2 checkpoint of TrainState(tx=chain(clip, accumulate)): flax's"
    " 'field names do not match' instead of a conversion",
  ),
  _m(
    "apply_updates warns on every trace",
    "_apply.py",
    "  if why in _WARNED:\n    return\n",
    "",
    ["tests/test_apply_updates.py", "-k", "another_trace"],
    "the slow-route warning said on every trace, not once per misuse",
  ),
]

NNX_STATE = "tests/test_nnx_state.py"
NNX_SHARDING = "tests/test_nnx_sharding.py"
PARITY = "tests/test_dropin_parity.py"
MUTANTS += [
  # -- The NNX drop-in's state as one Variable (issue 61). ------------------
  # -- Flax's own sharding recipes see every leaf (issue 67). --------------
  _m(
    "nnx optimizer state specs all replicated",
    "flax/_nnx.py",
    '  if not annotations.get("out_sharding"):\n    return PartitionSpec()',
    "  if True:\n    return PartitionSpec()",
    [NNX_SHARDING, "-k", "jit-fsdp"],
    "nnx.get_partition_spec of the drop-in: the accumulator and the moments"
    " replicated where their param is sharded",
  ),
  _m(
    "nnx get_partition_spec sees one Variable",
    "flax/_nnx.py",
    "    if value is None or isinstance(value, PartitionSpec):",
    "    if False:",
    [NNX_SHARDING, "-k", "made_by_each_recipe and jit-fsdp"],
    "Flax's create-a-sharded-model recipe replicates the drop-in's state 8x"
    " in silence",
  ),
  _m(
    "nnx eval_shape leaves without shardings",
    "flax/_nnx.py",
    "    if not mesh.empty and any(unplaced):",
    "    if False:",
    [NNX_SHARDING, "-k", "eval_shape-fsdp"],
    "nnx.eval_shape of the drop-in: a restore target with no layout where"
    " the stock class's is sharded",
  ),
  _m(
    "nnx logical names taken as mesh axes",
    "flax/_nnx.py",
    "  spec = spmd.get_var_pspec(\n",
    '  spec = PartitionSpec(*annotations["out_sharding"]) or spmd.get_var_pspec(\n',
    [NNX_SHARDING, "-k", "get_partition_spec-logical"],
    "the drop-in's specs ignore nnx.logical_axis_rules: logical names where"
    " the stock class has mesh axes",
  ),
  # -- The drop-in takes what the stock class takes; load converts every
  # MultiSteps checkpoint as it was (issue 68). ----------------------------
  _m(
    "nnx drop-in gives tx nested dicts only",
    "flax/_nnx.py",
    "    for as_state in (True, False):",
    "    for as_state in (False,):",
    [PARITY, "-k", "built_on_the_model"],
    "a mask built on nnx.state(model): the drop-in refuses what the stock"
    " class takes",
  ),
  _m(
    "nnx load misses a stateless inner",
    "flax/_nnx.py",
    '{"mini_step", "gradient_step"} <= set(raw)',
    '{"mini_step", "inner_opt_state"} <= set(raw)',
    [PARITY, "-k", "stateless"],
    "load of nnx.Optimizer(MultiSteps(sgd)): 'no opt_state.counters'",
  ),
  _m(
    "from_multisteps ignores tx's reduction",
    "multisteps.py",
    '    mean = config.reduction == "mean"',
    "    mean = True",
    [PARITY, "-k", "use_grad_mean"],
    "a use_grad_mean=False checkpoint: the partial sum multiplied by mini_step",
  ),
  _m(
    "from_multisteps takes schedule(0)",
    "multisteps.py",
    "    k = _every_k.of_multisteps(config.every_k, step)",
    "    k = fresh.every_k",
    [PARITY, "-k", "schedule"],
    "an every_k schedule: the open cycle ends early, every later boundary"
    " moves",
  ),
  _m(
    "nnx load rounds the inner state",
    "flax/_nnx.py",
    '  restored = _filled(target, raw, "opt_state", cast=False)',
    '  restored = _filled(target, raw, "opt_state")',
    [PARITY, "-k", "own_dtype"],
    "a bfloat16 accumulator: Adam's float32 moments rounded on load",
  ),
  _m(
    "nnx load takes a param named value for a Variable",
    "flax/_nnx.py",
    '  if isinstance(node, dict) and set(node) == {"value"} and key != "value":',
    '  if isinstance(node, dict) and set(node) == {"value"}:',
    [PARITY, "-k", "whatever_the_names"],
    "load of its own checkpoint with a module named value: an error",
  ),
  _m(
    "nnx load leaves the state on one device",
    "flax/_nnx.py",
    "    self.opt_state.set_value(_dicts(_state.placed_like(state, current)))",
    "    self.opt_state.set_value(_dicts(state))",
    [PARITY, "-k", "mesh"],
    "after load, each leaf on one device, not with its param's sharding",
  ),
  _m(
    "nnx load keeps the fresh step",
    "flax/_nnx.py",
    "    self.step.set_value(_state.placed_like(step, self.step.get_value()))",
    "    pass",
    [NNX_STATE, "-k", "another_layout_comes_in"],
    "Optimizer.load: optimizer.step restarts at 0",
  ),
  _m(
    "nnx load reads integer keys only",
    "flax/_nnx.py",
    "  return (key.idx, str(key.idx))",
    "  return (key.idx,)",
    [NNX_STATE, "-k", "another_layout_comes_in"],
    "Optimizer.load of a msgpack checkpoint (string indices): an error",
  ),
]

MUTANTS += [
  # -- Selects for a small state on a GPU (issue 61 item 2). ---------------
  _m(
    "gpu selects keep a weightless end's update",
    "_forms.py",
    "    branch = select(enter, update(cycle, mean_sq), hold(cycle, mean_sq))",
    "    branch = select(cycle.ends, update(cycle, mean_sq), hold(cycle, mean_sq))",
    [FORMS, "-k", "same_run"],
    "a small model on a GPU: a cycle of weight 0 steps Adam",
  ),
  _m(
    "gpu selects never close the cycle",
    "_forms.py",
    "      params, out = close(params, out)",
    "      pass",
    [FORMS, "-k", "same_run"],
    "a small model on a GPU: the params never move, the sum never cleared",
  ),
  _m(
    "gpu selects at every size",
    "_control.py",
    "SELECTS_BELOW_BYTES = 1 << 20",
    "SELECTS_BELOW_BYTES = 1 << 40",
    ["tests/test_accelerators.py", "-k", "keeps_its_conditional"],
    "a 64 MB model on a GPU runs Adam on every micro-step",
  ),
  _m(
    "gpu conditionals at every size",
    "_control.py",
    "SELECTS_BELOW_BYTES = 1 << 20",
    "SELECTS_BELOW_BYTES = 1 << 10",
    ["tests/test_accelerators.py", "-k", "small_state_on_a_gpu"],
    "a tiny model on a GPU pays two conditionals' dispatch on every call",
  ),
]

SR = "tests/test_stochastic_rounding.py"
MUTANTS += [
  # -- A bfloat16 accumulator rounded stochastically (issue 62). -----------
  _m(
    "stochastic rounding rounds to nearest",
    "_accumulate.py",
    "  if key is None:\n    return total.astype(acc.dtype)",
    "  if True:\n    return total.astype(acc.dtype)",
    [SR, "-k", "unbiased"],
    "rounding='stochastic': small gradients lost against a large sum",
  ),
  _m(
    "stochastic rounding bits the same on every device",
    "_accumulate.py",
    "    ^ engine.device_index() * u32(0xC2B2AE35)\n",
    "",
    [SR, "-k", "mesh"],
    "rounding='stochastic' under shard_map: every device rounds alike",
  ),
]

MUTANTS += [
  # -- The program form chosen by the XLA installed (issue 60). -------------
  _m(
    "bf16 switch on an XLA that copies it",
    "_control.py",
    'LATER_BRANCHES_COPY = not _versions.jax_at_least("0.11.1")',
    "LATER_BRANCHES_COPY = False",
    [
      "tests/test_accelerators.py",
      "-k",
      "extra_memory and bf16 or copies_nothing and bf16",
    ],
    "bf16 params on a GPU with jax 0.10.2: 40 parameter-sized copies and"
    " 3.4x the accumulator's memory",
    venv=".venv-py311",
  ),
]

RESUME = "tests/test_resume_devices.py"
MUTANTS += [
  # -- Resuming on another number of devices (issue 69). --------------------
  _m(
    "drop_device_axis takes row 0 of a state of more devices",
    "distributed/_layout.py",
    "  _check_one_row(opt_state)\n",
    "",
    [RESUME, "-k", "refused"],
    "a mid-cycle checkpoint of 8 devices resumed on 4 without regroup_state:"
    " no error, one device's partial sums of each pair lost (the guide's"
    " sgd step 42% off in norm)",
  ),
  _m(
    "regroup_state drops the regrouped weights",
    "distributed/_layout.py",
    '    acc_scalars=over(local, "acc_scalars", state.acc_scalars,'
    " like.acc_scalars),\n",
    "    acc_scalars=like.acc_scalars,\n",
    [RESUME, "-k", "another_device_count and mid"],
    "a checkpoint resumed on other devices mid-cycle: the weight of the"
    " micro-batches before it lost, the cycle's mean gradient too large",
  ),
]

ROUNDING = "tests/test_stochastic_rounding.py"
HSDP = "tests/test_hsdp.py"
MUTANTS += [
  # -- Blind spots, fourth set (issue 70): the five survivors and the two
  # behaviours a review found, each planted alone. -------------------------
  _m(
    "stochastic rounding: every cycle the same bits",
    "_accumulate.py",
    "    state.step.astype(jnp.uint32) * u32(0x9E3779B9)\n    ^ ",
    "    ",
    [ROUNDING, "-k", "independent or unbiased_per_element"],
    "a bfloat16 accumulator fed the same micro-batches every cycle errs by"
    " the same rounding every cycle: a bias where it should average out",
  ),
  _m(
    "stochastic rounding: every leaf the same bits",
    "_accumulate.py",
    "    treedef, [key + u32(0x27D4EB2F) * u32(i + 1) for i in range(len(leaves))]",
    "    treedef, [key for i in range(len(leaves))]",
    [ROUNDING, "-k", "independent"],
    "two leaves of the same shape err in lockstep",
  ),
  _m(
    "stochastic rounding: every micro-step the same bits",
    "_accumulate.py",
    "    ^ state.micro_step.astype(jnp.uint32) * u32(0x85EBCA6B)\n",
    "",
    [ROUNDING, "-k", "independent"],
    "the adds of one cycle round with the same bits, element by element",
  ),
  _m(
    "stochastic rounding: bfloat16 gradients to nearest",
    "_accumulate.py",
    "        a, g, key=key if a.dtype == jnp.bfloat16 else None\n",
    "        a, g,"
    " key=None if g.dtype == jnp.bfloat16 or a.dtype != jnp.bfloat16"
    " else key\n",
    [ROUNDING, "-k", "every_gradient_dtype"],
    "bf16 params: small gradients swamped by a large sum again (2.0 where"
    " the mean is 2.0099)",
  ),
  _m(
    "stochastic rounding: a complex leaf rounded",
    "_accumulate.py",
    "        a, g, key=key if a.dtype == jnp.bfloat16 else None\n",
    "        a, g, key=key\n",
    [ROUNDING, "-k", "complex"],
    "a complex leaf beside a stochastically rounded accumulator: TypeError"
    " on the first update",
  ),
  _m(
    "GPU selects form holds a NaN-weight cycle",
    "_forms.py",
    "    branch = select(enter, update(cycle, mean_sq), hold(cycle, mean_sq))",
    "    branch = select(\n      enter & (cycle.weight > 0), update(cycle,"
    " mean_sq), hold(cycle, mean_sq)\n    )",
    [FORMS, "-k", "nan_weight"],
    "a small model on a GPU: a NaN total weight holds the cycle where the"
    " other forms hand the NaN to the inner optimizer",
  ),
  _m(
    "GPU selects form under axis_name",
    "_forms.py",
    "  if axis_name is not None:\n    return False\n",
    "",
    ["tests/test_accelerators.py", "-k", "small_state_on_several"],
    "a small model's deferred reduction on 8 GPUs all-reduces on every"
    " micro-step (k times the communication)",
  ),
  # -- Issue 70's families: a plant of our own in each. ---------------------
  _m(
    "stochastic rounding: every device the same bits",
    "_accumulate.py",
    "    ^ engine.device_index() * u32(0xC2B2AE35)\n",
    "",
    [ROUNDING, "-k", "each_device_rounds_independently"],
    "under shard_map every device's bfloat16 sum errs in lockstep",
  ),
  _m(
    "each gradient rounded to the accumulator's dtype before the add",
    "_accumulate.py",
    "  term = jnp.asarray(value).astype(compute)\n",
    "  term = jnp.asarray(value).astype(acc.dtype).astype(compute)\n",
    [ROUNDING, "-k", "every_gradient_dtype and typical"],
    "float32 gradients into a bfloat16 accumulator rounded twice per add",
  ),
  _m(
    "every form holds a NaN-weight cycle",
    "_forms.py",
    "  enter = cycle.ends & ~(cycle.weight <= 0) if checked else cycle.ends",
    "  enter = cycle.ends & (cycle.weight > 0) if checked else cycle.ends",
    [FORMS, "-k", "nan_weight"],
    "a NaN total weight: no update, where the docs say the NaN reaches the"
    " inner optimizer",
  ),
  _m(
    "check_vma=False: every leaf taken for a shard",
    "_noise_scale.py",
    "    same = lax.pmax(sums, axis) == lax.pmin(sums, axis)",
    "    same = jnp.zeros_like(sums, bool)",
    [HSDP, "-k", "whatever_check_vma and noise"],
    "HSDP in shard_map, check_vma=False: a replicated bias counted once per"
    " fsdp device in the noise scale",
  ),
  _m(
    "GPU selects above the threshold",
    "_forms.py",
    "  return size < _control.SELECTS_BELOW_BYTES",
    "  return size >= _control.SELECTS_BELOW_BYTES",
    ["tests/test_accelerators.py", "-k", "small_state_on_a_gpu"],
    "a tiny model on one GPU dispatches conditionals; a large one runs adam"
    " on every micro-step",
  ),
  _m(
    "HSDP with check_vma=False agrees over axis_name only",
    "_engines.py",
    "    if _control.vma_checked():",
    "    if True:",
    [HSDP, "-k", "whatever_check_vma and skip"],
    "check_vma=False: an Inf on one fsdp device skips there only, the"
    " replicated counters differ between devices",
  ),
  _m(
    "HSDP with check_vma=False: the noise scale from the values' axes",
    "_noise_scale.py",
    "  if sample_axes is not None and not _control.vma_checked():",
    "  if False:",
    [HSDP, "-k", "whatever_check_vma and noise"],
    "check_vma=False: the noise scale counts each device's shard as the"
    " whole gradient",
  ),
]

# ----------------------------------------------------------------------------
# Running them.
# ----------------------------------------------------------------------------


def _files() -> list[str]:
  out = subprocess.run(
    ["git", "ls-files", "-co", "--exclude-standard", "-z"],
    cwd=REPO,
    capture_output=True,
    check=True,
  ).stdout.decode()
  return [f for f in out.split("\0") if f and (REPO / f).is_file()]


def _copy(dest: pathlib.Path) -> pathlib.Path:
  for name in _files():
    target = dest / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / name, target)
  return dest


def _pytest(
  copy: pathlib.Path, tests: tuple, timeout: float, venv: str | None = None
):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(copy), env.get("PYTHONPATH", "")])
  python = sys.executable
  if venv is None:
    env.setdefault("OPTAX_ACCUM_ACCEL", str(REPO / ".venv" / "accel"))
  else:
    python = str(REPO / venv / "bin" / "python")
    env["OPTAX_ACCUM_ACCEL"] = str(REPO / venv / "accel")
  argv = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
  try:
    result = subprocess.run(
      [*argv, *tests],
      cwd=copy,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return "timeout", ""
  return result.returncode, result.stdout + result.stderr


def _first_failure(output: str) -> str:
  match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
  return match.group(1) if match else output.strip().splitlines()[-1:][0]


def apply(mutant: Mutant, root: pathlib.Path) -> str | None:
  """Plants `mutant` in `root`; returns the original text, or None when its
  `old` text does not occur exactly once."""
  path = root / mutant.path
  text = path.read_text()
  if text.count(mutant.old) != 1:
    return None
  path.write_text(text.replace(mutant.old, mutant.new))
  return text


def _run_one(mutant: Mutant, root: pathlib.Path, timeout: float) -> dict:
  start = time.monotonic()
  original = apply(mutant, root)
  if original is None:
    return dict(mutant=mutant, status="NOT APPLIED", detail="", seconds=0.0)
  try:
    code, output = _pytest(root, mutant.tests, timeout, mutant.venv)
  finally:
    (root / mutant.path).write_text(original)
  if code == "timeout":
    status, detail = "KILLED", f"timeout after {timeout:.0f} s"
  elif code == 1:
    status, detail = "KILLED", _first_failure(output)
  elif code == 0:
    status, detail = "SURVIVED", ""
  else:  # collection errors, no tests selected, usage errors
    status, detail = "ERROR", f"pytest exit {code}: {_first_failure(output)}"
  seconds = time.monotonic() - start
  return dict(mutant=mutant, status=status, detail=detail, seconds=seconds)


def _select(names: list[str]) -> list[Mutant]:
  if not names:
    return MUTANTS
  ids = {m.name.split()[0] for m in MUTANTS}

  def chosen_by(n: str, m: Mutant) -> bool:  # an id ("issue-1"), or a substring
    return m.name.split()[0] == n if n in ids else n in m.name

  chosen = [m for m in MUTANTS if any(chosen_by(n, m) for n in names)]
  if not chosen:
    raise SystemExit(f"no mutant matches {names}")
  return chosen


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "names", nargs="*", help="mutants: ids (issue-1) or name substrings"
  )
  parser.add_argument("-j", "--jobs", type=int, default=1)
  parser.add_argument("--timeout", type=float, default=600.0)
  parser.add_argument("--list", action="store_true")
  parser.add_argument("--no-baseline", action="store_true")
  parser.add_argument(
    "--tests",
    help="run every chosen mutant against these pytest arguments instead"
    " of its own (e.g. 'tests/test_differential.py -k \"not nojit\"')",
  )
  args = parser.parse_args(argv)
  mutants = _select(args.names)
  if args.tests:
    tests = tuple(shlex.split(args.tests))
    mutants = [dataclasses.replace(m, tests=tests) for m in mutants]
  if args.list:
    for m in mutants:
      on = f" (on {m.venv})" if m.venv else ""
      print(f"{m.name}\n  {m.path}: {m.why}\n  tests{on}: {' '.join(m.tests)}")
    return 0
  jobs = max(1, args.jobs)
  with tempfile.TemporaryDirectory(prefix="optax_accum_mutants_") as tmp:
    roots = [_copy(pathlib.Path(tmp) / f"copy{i}") for i in range(jobs)]
    # Mutants that no longer apply are known before anything runs.
    stale = [
      m for m in mutants if (REPO / m.path).read_text().count(m.old) != 1
    ]
    if not args.no_baseline:
      selections = sorted(
        {(m.tests, m.venv) for m in mutants if m not in stale},
        key=lambda s: (s[0], s[1] or ""),
      )
      for tests, venv in selections:
        code, output = _pytest(roots[0], tests, args.timeout, venv)
        if code != 0:
          print(
            f"baseline FAILS for {' '.join(tests)}: {_first_failure(output)}"
          )
          return 2
      print(f"baseline: {len(selections)} test selections pass unmutated")
    free = list(roots)
    results = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
      futures = {}
      for m in mutants:
        if len(futures) >= jobs:
          done, _ = concurrent.futures.wait(
            futures, return_when=concurrent.futures.FIRST_COMPLETED
          )
          for f in done:
            free.append(futures.pop(f))
            results.append(f.result())
            _print(results[-1])
        root = free.pop()
        futures[pool.submit(_run_one, m, root, args.timeout)] = root
      for f in concurrent.futures.as_completed(futures):
        results.append(f.result())
        _print(results[-1])
  return _summary(results)


def _print(result: dict) -> None:
  m = result["mutant"]
  detail = f"  ({result['detail']})" if result["detail"] else ""
  print(
    f"{result['status']:<11} {result['seconds']:6.1f} s  {m.name}{detail}",
    flush=True,
  )


def _summary(results: list[dict]) -> int:
  by = {}
  for r in results:
    by.setdefault(r["status"], []).append(r["mutant"])
  killed = len(by.get("KILLED", []))
  judged = killed + len(by.get("SURVIVED", []))
  rate = 100.0 * killed / judged if judged else 0.0
  print(f"\nkilled {killed} of {judged} mutants: {rate:.1f}%")
  for status in ("SURVIVED", "NOT APPLIED", "ERROR"):
    for m in by.get(status, []):
      print(f"  {status}: {m.name} ({m.path}): {m.why}")
  return 0 if killed == judged == len(results) else 1


if __name__ == "__main__":
  sys.exit(main())
