"""Values at the edges (issue 37): behaviours a user relies on that the
common-path tests did not hold. Each test names its behaviour; each failed
on a planted break of it (``tools/mutants.py`` keeps the plants: the
mutants named ``issue-1`` ... ``issue-11``). Values are exact where the
arithmetic is (dyadic weights and gradients), with and without ``jit``.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import _accumulate, _control
from optax_accum import multisteps as ms

ENDS = ["traced", "emit"]


def _identity():
  return optax.GradientTransformation(
    lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s)
  )


def _update(tx, maybe_jit):
  """`tx.update` eagerly or jitted, with `emit` static."""
  if maybe_jit is jax.jit:
    return jax.jit(tx.update, static_argnames="emit")
  return tx.update


def _cycle(update, state, params, grads, weights, end):
  """One cycle of `grads`; the last call ends it by the counter (traced)
  or by `emit=True` (the others then `emit=False`)."""
  for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
    kwargs = {} if end == "traced" else {"emit": i == len(grads) - 1}
    out, state = update(jnp.asarray(g), state, params, weight=w, **kwargs)
  return out, state


# ---------------------------------------------------------------------------
# 1. A total weight in (0, 1] is divided by like any other.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize(
  "weights, expected",
  [
    ((0.25, 0.25), [-4.0, -6.0]),  # (0.5 [2, 4] + 0.5 [6, 8]) / 1 ... / 0.5
    ((0.125, 0.375), [-5.0, -7.0]),
    ((0.5, 0.5), [-4.0, -6.0]),  # total exactly 1
  ],
)
def test_a_fractional_total_weight_divides_the_sum(
  maybe_jit, end, weights, expected
):
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = jnp.zeros(2)
  out, state = _cycle(
    _update(tx, maybe_jit),
    tx.init(params),
    params,
    [[2.0, 4.0], [6.0, 8.0]],
    weights,
    end,
  )
  np.testing.assert_array_equal(out, jnp.asarray(expected))
  assert float(optax_accum.weight_seen(state)) == sum(weights)


def test_a_fractional_total_weight_divides_the_sum_issue_example(maybe_jit):
  """The issue's numbers: 0.25 + 0.25 of [2, 4] is [-2, -4], not [-1, -2]."""
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = jnp.zeros(2)
  update = _update(tx, maybe_jit)
  state = tx.init(params)
  for _ in range(2):
    out, state = update(jnp.array([2.0, 4.0]), state, params, weight=0.25)
  np.testing.assert_array_equal(out, jnp.array([-2.0, -4.0]))
  # A flushed cycle of weight 0.5 too.
  _, state = update(jnp.array([2.0, 4.0]), state, params, weight=0.5)
  out, state = update(
    jnp.array([6.0, 8.0]), state, params, weight=0.0, flush=True
  )
  np.testing.assert_array_equal(out, jnp.array([-2.0, -4.0]))


# ---------------------------------------------------------------------------
# 2. gradients="sum": the gradient is added as is, never times its weight.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_summed_gradients_are_added_as_is(maybe_jit, end, reduction):
  """Losses summed over 3 and 1 tokens: gradients [3, 6] and [1, 2]; the
  big-batch mean is [1, 2], the sum [4, 8]."""
  tx = optax_accum.accumulate(
    _identity(), 2, gradients="sum", reduction=reduction
  )
  params = jnp.zeros(2)
  update = _update(tx, maybe_jit)
  state = tx.init(params)
  kwargs = {} if end == "traced" else {"emit": False}
  _, state = update(jnp.array([3.0, 6.0]), state, params, weight=3.0, **kwargs)
  np.testing.assert_array_equal(state.acc_grads, jnp.array([3.0, 6.0]))
  assert float(state.acc_weight) == 3.0
  kwargs = {} if end == "traced" else {"emit": True}
  out, state = update(
    jnp.array([1.0, 2.0]), state, params, weight=1.0, **kwargs
  )
  expected = [1.0, 2.0] if reduction == "mean" else [4.0, 8.0]
  np.testing.assert_array_equal(out, jnp.asarray(expected))
  assert float(optax_accum.weight_seen(state)) == 4.0


# ---------------------------------------------------------------------------
# 3. and 4. Schedule values: rounded down; 0 and below count as 1.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, k", [(2.5, 2), (3.75, 3), (1.99, 1)])
def test_a_float_schedule_value_is_rounded_down(maybe_jit, value, k):
  tx = optax_accum.accumulate(_identity(), lambda step: jnp.float32(value))
  params = jnp.zeros(1)
  state = tx.init(params)
  update = maybe_jit(tx.update)
  emitted, wanted = [], []
  for i in range(3 * k):
    wanted.append(int(optax_accum.current_every_k(state)))
    out, state = update(jnp.full(1, float(i)), state, params)
    emitted.append(bool(optax_accum.has_updated(state)))
    if emitted[-1]:  # the mean of the cycle's k calls i-k+1 .. i
      np.testing.assert_array_equal(out, jnp.full(1, i - (k - 1) / 2))
  assert wanted == [k] * (3 * k)
  assert emitted == [i % k == k - 1 for i in range(3 * k)]


@pytest.mark.parametrize(
  "schedule",
  [
    lambda step: 0,
    lambda step: -1,
    lambda step: jnp.where(step < 2, 0, -7),  # int32, traced
    lambda step: jnp.float32(0.5),
    lambda step: jnp.float32(-2.5),
  ],
  ids=["zero", "minus_one", "traced_int", "half", "minus_float"],
)
def test_a_schedule_value_below_one_counts_as_one(maybe_jit, schedule):
  tx = optax_accum.accumulate(_identity(), schedule)
  params = jnp.zeros(1)
  state = tx.init(params)
  assert int(optax_accum.current_every_k(state)) == 1
  update = maybe_jit(tx.update)
  for i in range(4):
    out, state = update(jnp.full(1, float(i + 1)), state, params)
    assert bool(optax_accum.has_updated(state))
    assert int(optax_accum.current_every_k(state)) == 1
    assert int(state.step) == i + 1 and int(state.micro_step) == 0
    np.testing.assert_array_equal(out, jnp.full(1, float(i + 1)))


# ---------------------------------------------------------------------------
# 5. and 7. every_k=1, the pass-through to inner: weight_seen and extra
# arguments.
# ---------------------------------------------------------------------------


def test_every_k_1_counts_the_weight_seen_of_every_call(maybe_jit):
  tx = optax_accum.accumulate(optax.sgd(1.0), 1)
  params = jnp.zeros(2)
  state = tx.init(params)
  update = maybe_jit(tx.update)
  for i in range(5):
    _, state = update(jnp.ones(2), state, params)
    assert float(optax_accum.weight_seen(state)) == i + 1
    assert int(state.step) == i + 1
  # With weights (not the pass-through) the weights add up instead.
  for w in (0.5, 2.0):
    _, state = update(jnp.ones(2), state, params, weight=w)
  assert float(optax_accum.weight_seen(state)) == 7.5


def _needs_value():
  def update(updates, state, params=None, *, value):
    return jax.tree.map(lambda u: u * value, updates), state

  return optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(), update
  )


@pytest.mark.parametrize("where", ["alone", "chain", "weighted"])
def test_every_k_1_passes_extra_arguments_to_inner(maybe_jit, where):
  """`value=` for optax.contrib-style optimizers reaches inner at k=1."""
  acc = optax_accum.accumulate(_needs_value(), 1)
  tx = optax.chain(optax.scale(1.0), acc) if where == "chain" else acc
  params = jnp.zeros(2)
  state = tx.init(params)
  update = maybe_jit(functools.partial(tx.update))
  kwargs = {"weight": 2.0} if where == "weighted" else {}
  for value in (3.0, 0.5):
    out, state = update(
      jnp.array([1.0, 2.0]), state, params, value=value, **kwargs
    )
    np.testing.assert_array_equal(out, value * jnp.array([1.0, 2.0]))


# ---------------------------------------------------------------------------
# 6. A weightless cycle leaves inner's state alone, on every form.
# ---------------------------------------------------------------------------

FORMS = {
  "cpu": lambda *args, cpu, accelerator, gpu=None: cpu(*args),
  "accelerator": lambda *args, cpu, accelerator, gpu=None: accelerator(*args),
  # A GPU's program of a small state: selects, no conditional (the GPU/TPU
  # form where the code has no GPU form of its own).
  "gpu": lambda *args, cpu, accelerator, gpu=None: (gpu or accelerator)(*args),
}
# Shared: the updates are written into the accumulator's buffer; own: a
# bfloat16 accumulator cannot hold float32 updates, they get buffers of
# their own (and the inner runs in a branch that ends weightless cycles too).
BUFFERS = {"shared": jnp.float32, "own": jnp.bfloat16}


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("buffer", list(BUFFERS))
@pytest.mark.parametrize("form", list(FORMS))
def test_a_weightless_cycle_leaves_the_inner_state_alone(
  monkeypatch, maybe_jit, form, buffer, end
):
  monkeypatch.setattr(_control, "per_backend", FORMS[form])
  _accumulate._jitted_update.cache_clear()
  tx = optax_accum.accumulate(
    optax.adam(0.5), 2, accumulator_dtype=BUFFERS[buffer]
  )
  params = jnp.zeros(2)
  update = _update(tx, maybe_jit)
  state = tx.init(params)
  out, state = _cycle(
    update, state, params, [[1.0, 2.0], [3.0, 4.0]], [0.0, 0.0], end
  )
  np.testing.assert_array_equal(out, jnp.zeros(2))
  chex.assert_trees_all_equal(state.inner_state, tx.init(params).inner_state)
  assert int(state.inner_state[0].count) == 0
  assert not bool(optax_accum.has_updated(state))
  assert int(state.step) == 0 and int(state.micro_step) == 0
  assert float(optax_accum.weight_seen(state)) == 0.0
  # The next cycle, with weight, is adam's first step.
  g = jnp.array([1.0, -2.0])
  out, state = _cycle(update, state, params, [g, g], [1.0, 1.0], end)
  first, _ = optax.adam(0.5).update(g, optax.adam(0.5).init(params))
  np.testing.assert_allclose(out, first, rtol=1e-6)
  assert int(state.inner_state[0].count) == 1
  assert bool(optax_accum.has_updated(state)) and int(state.step) == 1


# ---------------------------------------------------------------------------
# 8. and 9. The noise scale: the summed form, and the bias correction, held
# to a closed form.
# ---------------------------------------------------------------------------

NOISE_G = jnp.array([1.0, 2.0, -1.0, 0.5])  # |G|^2 = 6.25
NOISE_W = (1.0, 2.0, 4.0)


def _noise_gradients():
  """Micro-batch mean gradients G + e_i with sum_i w_i e_i = 0: the cycle's
  mean is G, and S - W |G|^2 = sum_i w_i |e_i|^2, exactly."""
  e0 = jnp.array([1.0, 0.0, 0.5, -0.5])
  e1 = jnp.array([-1.0, 1.0, 0.25, 0.5])
  e2 = -(NOISE_W[0] * e0 + NOISE_W[1] * e1) / NOISE_W[2]
  es = [e0, e1, e2]
  trace = (
    sum(w * float(jnp.sum(e**2)) for w, e in zip(NOISE_W, es, strict=True)) / 2
  )
  grad_sq = float(jnp.sum(NOISE_G**2)) - trace / sum(NOISE_W)
  return [NOISE_G + e for e in es], grad_sq, trace


@pytest.mark.parametrize("cycles", [1, 3])
@pytest.mark.parametrize("gradients", ["mean", "sum"])
@pytest.mark.parametrize("end", ENDS)
def test_noise_scale_matches_its_closed_form(maybe_jit, gradients, end, cycles):
  """The same cycle `cycles` times: each cycle's unbiased estimates are the
  closed form's, the moving averages hold (1 - decay^n) of them, and the
  bias-corrected reads are the closed form exactly; with
  gradients="sum" (each gradient w_i g_i) the same."""
  decay = 0.9
  tx = optax_accum.accumulate(
    optax.sgd(0.0),
    len(NOISE_W),
    track_noise_scale=True,
    noise_scale_decay=decay,
    gradients=gradients,
  )
  params = jnp.zeros(4)
  grads, grad_sq, trace = _noise_gradients()
  if gradients == "sum":
    grads = [w * g for w, g in zip(NOISE_W, grads, strict=True)]
  update = _update(tx, maybe_jit)
  state = tx.init(params)
  for _ in range(cycles):
    _, state = _cycle(update, state, params, grads, NOISE_W, end)
  assert int(state.noise.cycles) == cycles
  kept = 1 - decay**cycles
  np.testing.assert_allclose(state.noise.grad_sq, kept * grad_sq, rtol=1e-5)
  np.testing.assert_allclose(state.noise.trace, kept * trace, rtol=1e-5)
  read = optax_accum.noise_scale_components(state, noise_scale_decay=decay)
  np.testing.assert_allclose(read, (grad_sq, trace), rtol=1e-5)
  # The ratio hides the correction (both divided by it): held above.
  np.testing.assert_allclose(
    optax_accum.noise_scale(state), trace / grad_sq, rtol=1e-5
  )


def test_noise_scale_of_summed_gradients_equals_the_mean_form(maybe_jit):
  """Random data, uneven weights: the summed form's estimate is the mean
  form's (a sample is |g_sum|^2 / w, not w |g_sum|^2)."""
  rng = np.random.default_rng(0)
  weights = rng.integers(1, 9, size=12).astype(np.float32)
  means = rng.normal(1.0, 2.0, size=(12, 8)).astype(np.float32)
  reads = {}
  for gradients in ("mean", "sum"):
    tx = optax_accum.accumulate(
      optax.sgd(0.0), 4, track_noise_scale=True, gradients=gradients
    )
    params = jnp.zeros(8)
    state = tx.init(params)
    update = maybe_jit(tx.update)
    for g, w in zip(means, weights, strict=True):
      g = g * w if gradients == "sum" else g
      _, state = update(jnp.asarray(g), state, params, weight=w)
    reads[gradients] = optax_accum.noise_scale_components(state)
  assert np.all(np.isfinite(reads["mean"]))
  np.testing.assert_allclose(reads["sum"], reads["mean"], rtol=1e-4)


# ---------------------------------------------------------------------------
# 10. and 11. from_multisteps: has_updated at a boundary, and every_k=.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("calls", [0, 1, 2, 3, 4])
def test_from_multisteps_keeps_has_updated(maybe_jit, calls):
  old = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = jnp.zeros(2)
  ms_state = old.init(params)
  update = maybe_jit(old.update)
  for i in range(calls):
    _, ms_state = update(jnp.full(2, float(i)), ms_state, params)
  state = ms.from_multisteps(ms_state, tx.init(params))
  assert bool(optax_accum.has_updated(state)) == bool(old.has_updated(ms_state))
  assert bool(optax_accum.has_updated(state)) == (calls in (2, 4))
  # MultiSteps counts no weight: k per update so far.
  assert float(optax_accum.weight_seen(state)) == 2 * (calls // 2)


@pytest.mark.parametrize("calls", [2, 3])  # at a boundary; mid-cycle
@pytest.mark.parametrize("target_k", ["schedule", "fixed"])
def test_from_multisteps_honours_every_k(maybe_jit, calls, target_k):
  """MultiSteps with k = 2 + step: after one update the cycle wants 3. The
  converted state says so and updates when MultiSteps would, whatever k the
  fresh target held (2 from the schedule at step 0, or a fixed 2)."""
  schedule = lambda step: 2 + step  # noqa: E731
  old = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=schedule)
  tx = optax_accum.accumulate(
    optax.sgd(1.0), schedule if target_k == "schedule" else 2
  )
  params = jnp.zeros(2)
  ms_state = old.init(params)
  old_update = maybe_jit(old.update)
  for i in range(calls):
    _, ms_state = old_update(jnp.full(2, float(i)), ms_state, params)
  assert int(ms_state.gradient_step) == 1
  state = ms.from_multisteps(ms_state, tx.init(params), every_k=3)
  assert int(optax_accum.current_every_k(state)) == 3
  assert int(tx.init(params).every_k) == 2
  update = maybe_jit(tx.update)
  ours, theirs = [], []
  for i in range(calls, 5):
    g = jnp.full(2, float(i))
    out, state = update(g, state, params)
    old_out, ms_state = old_update(g, ms_state, params)
    ours.append(bool(optax_accum.has_updated(state)))
    theirs.append(bool(old.has_updated(ms_state)))
    np.testing.assert_allclose(out, old_out, rtol=1e-6)
  assert ours == theirs == [i == 4 for i in range(calls, 5)]


# ---------------------------------------------------------------------------
# Found while writing these: a zero-weight micro-batch under gradients="sum".
# ---------------------------------------------------------------------------


def test_a_zero_weight_summed_gradient_contributes_nothing(maybe_jit):
  # With skip_nonfinite=True the add selects already: a NaN in a weight-0
  # micro-batch counts for nothing under gradients="sum" too (issue 55).
  tx = optax_accum.accumulate(
    _identity(), 2, gradients="sum", skip_nonfinite=True
  )
  params = jnp.zeros(2)
  update = maybe_jit(tx.update)
  state = tx.init(params)
  _, state = update(jnp.array([2.0, 4.0]), state, params, weight=2.0)
  out, state = update(jnp.array([jnp.nan, 1.0]), state, params, weight=0.0)
  np.testing.assert_array_equal(out, jnp.array([1.0, 2.0]))
  assert int(state.num_skipped) == 0  # counted toward k, not dropped


def test_a_zero_weight_summed_nan_reaches_the_cycle_without_skip_nonfinite(
  maybe_jit,
):
  # The documented exception: without skip_nonfinite a summed gradient is
  # added as is, with no select (the form XLA fuses into the GEMM), so a
  # NaN there reaches `inner` as any unskipped NaN does.
  tx = optax_accum.accumulate(_identity(), 2, gradients="sum")
  params = jnp.zeros(2)
  update = maybe_jit(tx.update)
  state = tx.init(params)
  _, state = update(jnp.array([2.0, 4.0]), state, params, weight=2.0)
  out, _ = update(jnp.array([jnp.nan, 1.0]), state, params, weight=0.0)
  np.testing.assert_array_equal(out, jnp.array([jnp.nan, 2.5]))
