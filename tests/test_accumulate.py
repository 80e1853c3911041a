"""Semantics of `optax_accum.accumulate` (the core issue), with and without jit.

Each test names the semantic point it proves. Equality is exact where the
arithmetic is the same on both sides (power-of-two cycle lengths, identical
summation order); tolerances are stated where it is not.
"""

import functools

import _common
import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_accum

# ---------------------------------------------------------------------------
# 1. Zeros until k, then the inner's updates; accumulator resets; k=1.
# ---------------------------------------------------------------------------


INNERS = {
  # sgd is one multiply: the same bits however XLA fuses it.
  "sgd": (optax.sgd(0.5), 0.0),
  # adam inside the conditional is fused differently from adam alone;
  # float32 rounding of sqrt/divide differs by an ulp or so.
  "adam": (optax.adam(1e-2), 1e-6),
}


@pytest.mark.parametrize("inner_name", list(INNERS))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_zeros_until_k_then_inner_update_of_the_mean(maybe_jit, k, inner_name):
  inner, rtol = INNERS[inner_name]
  tx = optax_accum.accumulate(inner, k)
  params = _common.params()
  state = tx.init(params)
  ref_state = inner.init(params)
  update = maybe_jit(tx.update)
  for cycle in range(3):
    grads = [_common.grads(10 * cycle + i) for i in range(k)]
    for i, g in enumerate(grads):
      before = state.inner_state
      updates, state = update(g, state, params)
      if i < k - 1:
        # Exact zeros of the gradient's dtypes, and an untouched inner state.
        chex.assert_trees_all_equal(
          updates, jax.tree.map(jnp.zeros_like, g), strict=True
        )
        chex.assert_trees_all_equal(state.inner_state, before, strict=True)
        assert not optax_accum.has_updated(state)
    total = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), grads)
    mean = jax.tree.map(lambda t: t * (1.0 / k), total)
    expected, ref_state = inner.update(mean, ref_state, params)
    assert optax_accum.has_updated(state)
    assert int(state.step) == cycle + 1
    assert int(state.micro_step) == 0
    # The mean is exact on both sides (k is a power of two).
    chex.assert_trees_all_close(updates, expected, rtol=rtol, atol=0)
    chex.assert_trees_all_close(state.inner_state, ref_state, rtol=rtol, atol=0)
    ref_state = state.inner_state  # compare the next cycle from equal states


def test_every_k_1_behaves_like_inner_alone(maybe_jit):
  inner = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
  tx = optax_accum.accumulate(inner, 1)
  params = _common.params()
  state, ref_state = tx.init(params), inner.init(params)
  update, ref_update = maybe_jit(tx.update), maybe_jit(inner.update)
  for i in range(5):
    updates, state = update(_common.grads(i), state, params)
    expected, ref_state = ref_update(_common.grads(i), ref_state, params)
    chex.assert_trees_all_equal(updates, expected)
    params = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(state.inner_state, ref_state)


# ---------------------------------------------------------------------------
# 2. The inner runs only on emitting calls; a partial sum never reaches it.
# ---------------------------------------------------------------------------


def _counting_inner(counter):
  def update(updates, state, params=None):
    jax.debug.callback(lambda: counter.append(1))
    return updates, state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_inner_runs_exactly_once_per_cycle_under_jit():
  counter = []
  tx = optax_accum.accumulate(_counting_inner(counter), 4)
  params = _common.params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(8):
    _, state = update(_common.grads(i), state, params)
  jax.effects_barrier()
  assert len(counter) == 2


def test_partial_sum_never_reaches_inner(maybe_jit):
  """An inner computing 1/g would turn a zero partial sum into Inf/NaN."""

  def update(updates, state, params=None):
    inv = jax.tree.map(lambda g: 1.0 / g, updates)
    return inv, jax.tree.map(lambda s, i: s + i, state, inv)

  inner = optax.GradientTransformation(
    lambda p: jax.tree.map(jnp.zeros_like, p), update
  )
  tx = optax_accum.accumulate(inner, 4)
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  step = maybe_jit(tx.update)
  zero, one = {"w": jnp.zeros(3)}, {"w": jnp.ones(3)}
  for g in (zero, zero, zero, one):  # partial sums 0, 0, 0; full sum 1
    updates, state = step(g, state, params)
    assert all(
      bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((updates, state))
    )
  np.testing.assert_array_equal(updates["w"], 4.0 * jnp.ones(3))


# ---------------------------------------------------------------------------
# 3. Weights: exact token-weighted mean, sum, zero weights.
# ---------------------------------------------------------------------------


def _token_problem():
  """Linear model, per-token squared error, micro-batches of 2, 2, 60 tokens."""
  key = jax.random.PRNGKey(0)
  kx, ky, kw = jax.random.split(key, 3)
  sizes = (2, 2, 60)
  xs = jax.random.normal(kx, (sum(sizes), 4))
  ys = jax.random.normal(ky, (sum(sizes),)) + 3.0 * xs[:, 0]
  params = {"w": jax.random.normal(kw, (4,))}

  def loss(p, x, y):  # per-token mean over the tokens it is given
    return jnp.mean((x @ p["w"] - y) ** 2)

  bounds = np.cumsum((0,) + sizes)
  micro = [
    (xs[a:b], ys[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=False)
  ]
  return params, loss, micro, (xs, ys), sizes


def test_token_weighted_mean_equals_big_batch_gradient(maybe_jit):
  params, loss, micro, (xs, ys), sizes = _token_problem()
  big = jax.grad(loss)(params, xs, ys)
  outs = {}
  for weighted in (True, False):
    tx = optax_accum.accumulate(_common.identity(), len(micro))
    state = tx.init(params)
    update = maybe_jit(tx.update)
    for (x, y), n in zip(micro, sizes, strict=False):
      g = jax.grad(loss)(params, x, y)
      out, state = update(g, state, params, weight=n if weighted else None)
    outs[weighted] = out
  # float32 sums in a different order: rtol 1e-5.
  np.testing.assert_allclose(outs[True]["w"], big["w"], rtol=1e-5, atol=1e-6)
  # The unweighted mean of per-micro-batch means is the classic bug.
  assert float(jnp.max(jnp.abs(outs[False]["w"] - big["w"]))) > 1e-2


def test_sum_reduction_emits_weighted_sum(maybe_jit):
  tx = optax_accum.accumulate(_common.identity(), 3, reduction="sum")
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  weights = (0.5, 2.0, 4.0)
  for i, w in enumerate(weights):
    out, state = update(_common.grads(i), state, params, weight=w)
  expected = jax.tree.map(
    lambda a, b, c: ((0.0 + 0.5 * a) + 2.0 * b) + 4.0 * c,
    *[_common.grads(i) for i in range(3)],
  )
  chex.assert_trees_all_close(out, expected, rtol=1e-6)


def test_zero_weight_counts_toward_k_but_contributes_nothing(maybe_jit):
  tx = optax_accum.accumulate(_common.identity(), 3)
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  out, state = update(_common.grads(0), state, params, weight=2.0)
  out, state = update(_common.grads(1), state, params, weight=0.0)
  assert int(state.micro_step) == 2
  out, state = update(_common.grads(2), state, params, weight=2.0)
  expected = jax.tree.map(
    lambda a, c: (2.0 * a + 2.0 * c) * (1.0 / 4.0),
    _common.grads(0),
    _common.grads(2),
  )
  chex.assert_trees_all_close(out, expected, rtol=1e-6)


def test_zero_total_weight_cycle_emits_zeros_without_nan(maybe_jit):
  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, 2)
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  before = state.inner_state
  for i in range(2):
    out, state = update(_common.grads(i), state, params, weight=0.0)
  chex.assert_trees_all_equal(out, jax.tree.map(jnp.zeros_like, params))
  chex.assert_trees_all_equal(state.inner_state, before)
  assert not optax_accum.has_updated(state)
  assert int(state.step) == 0 and int(state.micro_step) == 0
  # The next cycle is unaffected.
  for i in range(2):
    out, state = update(_common.grads(5 + i), state, params, weight=1.0)
  assert optax_accum.has_updated(state)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))


@pytest.mark.parametrize("skip_nonfinite", [False, True])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_zero_weight_micro_batch_with_nonfinite_gradient_contributes_nothing(
  maybe_jit, skip_nonfinite, bad
):
  """The per-token mean of an all-padding micro-batch is 0/0 = NaN."""
  tx = optax_accum.accumulate(
    _common.identity(), 3, skip_nonfinite=skip_nonfinite
  )
  params = jnp.zeros(2)
  state = tx.init(params)
  update = maybe_jit(tx.update)
  _, state = update(jnp.array([1.0, 2.0]), state, params, weight=2.0)
  _, state = update(jnp.full(2, bad), state, params, weight=0.0)
  assert int(state.micro_step) == 2 and int(state.num_skipped) == 0
  out, state = update(jnp.array([3.0, 4.0]), state, params, weight=2.0)
  assert optax_accum.has_updated(state)
  np.testing.assert_array_equal(out, jnp.array([2.0, 3.0]))


# ---------------------------------------------------------------------------
# 4. flush=True ends a partial cycle.
# ---------------------------------------------------------------------------


def test_flush_emits_partial_window_normalised_by_what_was_accumulated(
  maybe_jit,
):
  tx = optax_accum.accumulate(_common.identity(), 4)
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  _, state = update(_common.grads(0), state, params, weight=1.0)
  out, state = update(_common.grads(1), state, params, weight=3.0, flush=True)
  assert optax_accum.has_updated(state)
  expected = jax.tree.map(
    lambda a, b: (a + 3.0 * b) * (1.0 / 4.0), _common.grads(0), _common.grads(1)
  )
  chex.assert_trees_all_close(out, expected, rtol=1e-6)
  assert int(state.micro_step) == 0 and int(state.step) == 1
  # Flushing an empty cycle does nothing (nothing to average).
  out, state = update(_common.grads(2), state, params, weight=0.0, flush=True)
  assert not optax_accum.has_updated(state)
  assert int(state.step) == 1


# ---------------------------------------------------------------------------
# 5. every_k as a schedule.
# ---------------------------------------------------------------------------


def test_schedule_every_k_pattern_with_one_trace():
  tx = optax_accum.accumulate(
    _common.identity(), lambda s: jnp.minimum(1 + s, 4)
  )
  params = _common.params()
  state = tx.init(params)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def update(g, state):
    return tx.update(g, state, params)

  emitted = []
  for call in range(1, 13):
    _, state = update(_common.grads(call), state)
    if optax_accum.has_updated(state):
      emitted.append(call)
  assert emitted == [1, 3, 6, 10]


@pytest.mark.parametrize("value", [0, -3, 0.5])
def test_schedule_values_below_one_are_treated_as_one(maybe_jit, value):
  tx = optax_accum.accumulate(_common.identity(), lambda s: value)
  params = _common.params()
  state = tx.init(params)
  _, state = maybe_jit(tx.update)(_common.grads(0), state, params)
  assert optax_accum.has_updated(state)


# ---------------------------------------------------------------------------
# 6. Extra arguments; schedules inside the inner.
# ---------------------------------------------------------------------------


def _needs_value():
  def update(updates, state, params=None, *, value):
    return jax.tree.map(lambda u: u * value, updates), state

  return optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(), update
  )


def test_extra_args_reach_inner_also_inside_chain(maybe_jit):
  tx = optax.chain(optax.scale(1.0), optax_accum.accumulate(_needs_value(), 2))
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(functools.partial(tx.update))
  _, state = update(_common.grads(0), state, params, value=3.0, weight=1.0)
  out, state = update(_common.grads(1), state, params, value=3.0, weight=3.0)
  expected = jax.tree.map(
    lambda a, b: (a + 3.0 * b) * (1.0 / 4.0) * 3.0,
    _common.grads(0),
    _common.grads(1),
  )
  chex.assert_trees_all_close(out, expected, rtol=1e-6)


def test_inner_schedule_advances_once_per_emitted_update(maybe_jit):
  schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
  tx = optax_accum.accumulate(inner, 4)
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  for i in range(12):
    _, state = update(_common.grads(i), state, params)
  assert int(state.inner_state.count) == 3
  np.testing.assert_allclose(
    state.inner_state.hyperparams["learning_rate"], schedule(2), rtol=1e-6
  )


def test_lookahead_takes_its_params_and_matches_the_big_batch(maybe_jit):
  """`optax.lookahead` keeps LookaheadParams(fast, slow) and takes gradients
  with respect to `fast`: `init` accepts the natural LookaheadParams."""
  inner = optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5)
  params = optax.LookaheadParams.init_synced(_common.params())
  tx = optax_accum.accumulate(inner, 2)
  state, ref_state, ref_params = tx.init(params), inner.init(params), params
  update = maybe_jit(tx.update)
  for step in range(3):
    g0, g1 = _common.grads(2 * step), _common.grads(2 * step + 1)
    _, state = update(g0, state, params)
    updates, state = update(g1, state, params)
    params = optax.apply_updates(params, updates)
    mean = jax.tree.map(lambda a, b: (a + b) * 0.5, g0, g1)
    ref_updates, ref_state = inner.update(mean, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, ref_updates)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------
# 7. skip_nonfinite.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["nan_grad", "inf_grad", "nan_weight"])
def test_skip_nonfinite_drops_the_bad_micro_batch_only(maybe_jit, bad):
  tx = optax_accum.accumulate(_common.identity(), 3, skip_nonfinite=True)
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  good = [_common.grads(i) for i in range(3)]
  poisoned = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _common.grads(9))
  weight = 1.0
  if bad == "inf_grad":
    poisoned = jax.tree.map(lambda g: g.at[0].set(jnp.inf), _common.grads(9))
  elif bad == "nan_weight":
    poisoned, weight = _common.grads(9), jnp.nan
  _, state = update(good[0], state, params, weight=1.0)
  out, state = update(poisoned, state, params, weight=weight)
  assert not optax_accum.has_updated(state)
  assert int(state.micro_step) == 1 and int(state.num_skipped) == 1
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
  _, state = update(good[1], state, params, weight=1.0)
  out, state = update(good[2], state, params, weight=1.0)
  assert optax_accum.has_updated(state)
  expected = jax.tree.map(lambda a, b, c: ((a + b) + c) * (1.0 / 3.0), *good)
  chex.assert_trees_all_close(out, expected, rtol=1e-6)
  assert all(
    bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.acc_grads)
  )


def test_without_skip_nonfinite_a_nan_reaches_the_update():
  tx = optax_accum.accumulate(_common.identity(), 2)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
  out, state = tx.update({"w": jnp.ones(2)}, state, params)
  assert bool(jnp.isnan(out["w"][0]))


@pytest.mark.parametrize("weight", [jnp.nan, jnp.inf], ids=["nan", "inf"])
def test_traced_nonfinite_weight_without_skip_nonfinite_reaches_the_inner(
  weight,
):
  """Under jit a weight is not inspected: the cycle's mean is NaN (inf/inf)
  and the inner receives it. A concrete one raises (test_arguments.py)."""
  tx = optax_accum.accumulate(_common.identity(), 2)
  params = jnp.zeros(2)
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update(jnp.ones(2), state, params, weight=weight)
  out, state = update(jnp.ones(2), state, params, weight=1.0)
  assert optax_accum.has_updated(state)
  assert bool(jnp.all(jnp.isnan(out)))


# ---------------------------------------------------------------------------
# 8. Dtypes.
# ---------------------------------------------------------------------------


def test_bf16_micro_batches_accumulate_in_float32():
  k = 256
  rng = np.random.default_rng(0)
  values = rng.normal(size=(k, 64)).astype(np.float32) + 0.01
  grads = jnp.asarray(values, jnp.bfloat16)
  exact = np.asarray(grads, np.float64).mean(axis=0)
  params = jnp.zeros(64, jnp.bfloat16)
  results = {}
  for name, acc_dtype in (("f32", jnp.float32), ("bf16", None)):
    tx = optax_accum.accumulate(
      _common.identity(), k, accumulator_dtype=acc_dtype
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(k):
      out, state = update(grads[i], state, params)
    assert out.dtype == jnp.bfloat16
    results[name] = np.asarray(out, np.float64)
  # Within bf16 rounding of the float64 mean: half an ulp (2^-8 relative)
  # plus the float32 sum's rounding.
  ulp = np.abs(exact) * 2.0**-8 + 1e-6
  assert np.all(np.abs(results["f32"] - exact) <= ulp)
  # Accumulating in bf16 itself is far worse: the reason for the default.
  assert np.max(np.abs(results["bf16"] - exact) / ulp) > 4


@pytest.mark.parametrize(
  "inner",
  [
    optax.adam(1e-3),
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
  ],
  ids=["adam", "clip_adamw"],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dtypes_match_inner_alone_and_state_types_never_change(inner, dtype):
  params = jax.tree.map(lambda p: p.astype(dtype), _common.params())
  tx = optax_accum.accumulate(inner, 2)
  state = tx.init(params)
  grads = jax.tree.map(lambda g: g.astype(dtype), _common.grads(0))
  ref_updates, _ = inner.update(grads, inner.init(params), params)

  def types(tree):
    return jax.tree.map(
      lambda x: (jnp.shape(x), jnp.result_type(x), x.weak_type), tree
    )

  initial = types(state)
  update = jax.jit(tx.update)
  for _i in range(4):
    out, state = update(grads, state, params)
    chex.assert_trees_all_equal_dtypes(out, ref_updates)
    assert types(state) == initial
  for leaf in jax.tree.leaves(state.acc_grads):
    assert leaf.dtype == jnp.float32

  # lax.scan over several cycles type-checks only if no leaf changes type.
  def body(state, g):
    out, state = tx.update(g, state, params)
    return state, out

  stacked = jax.tree.map(lambda g: jnp.stack([g] * 6), grads)
  final, outs = lax.scan(body, tx.init(params), stacked)
  assert int(final.step) == 3


def test_complex_gradients_keep_their_imaginary_part(maybe_jit):
  params = jnp.zeros(2, jnp.complex64)
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  state = tx.init(params)
  assert state.acc_grads.dtype == jnp.complex64
  update = maybe_jit(tx.update)
  g = jnp.array([1 + 1j, 2 + 2j], jnp.complex64)
  _, state = update(g, state, params)
  out, state = update(g, state, params)
  expected, _ = optax.sgd(1.0).update(g, optax.sgd(1.0).init(params))
  np.testing.assert_array_equal(out, expected)


def test_inner_state_takes_the_dtypes_inner_gives_it(maybe_jit):
  """bf16 params, float32 gradients: adam alone widens its moments to
  float32, and so does the wrapped one; updates match `inner` alone."""
  inner = optax.adam(1e-2)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _common.params())
  tx = optax_accum.accumulate(inner, 2)
  state, ref_state = tx.init(params), inner.init(params)
  update = maybe_jit(tx.update)
  for step in range(3):
    g0, g1 = _common.grads(2 * step), _common.grads(2 * step + 1)  # float32
    _, state = update(g0, state, params)
    out, state = update(g1, state, params)
    mean = jax.tree.map(lambda a, b: (a + b) * 0.5, g0, g1)
    expected, ref_state = inner.update(mean, ref_state, params)
    chex.assert_trees_all_equal_dtypes(state.inner_state, ref_state)
    chex.assert_trees_all_close(out, expected, rtol=1e-6, atol=0)
    chex.assert_trees_all_close(state.inner_state, ref_state, rtol=1e-6)
    ref_state = state.inner_state


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_core_semantics_under_strict_dtype_promotion(maybe_jit, dtype):
  """No implicit promotion anywhere in init or update (bf16 params failed
  `init` when promote_types chose the accumulator's dtype)."""
  params = jax.tree.map(lambda p: p.astype(dtype), _common.params())
  grads = [
    jax.tree.map(lambda g: g.astype(dtype), _common.grads(i)) for i in range(3)
  ]
  with jax.numpy_dtype_promotion("strict"):
    tx = optax_accum.accumulate(
      optax.sgd(0.5), 2, skip_nonfinite=True, track_noise_scale=True
    )
    update = maybe_jit(tx.update)
    _, state = update(grads[0], tx.init(params), params, weight=2.0)
    out, state = update(grads[1], state, params, weight=6.0)
    flushed, state = update(grads[2], state, params, flush=True)
  mean = jax.tree.map(
    lambda a, b: (2 * a.astype(jnp.float32) + 6 * b.astype(jnp.float32)) / 8,
    grads[0],
    grads[1],
  )
  expected = jax.tree.map(lambda m: (-0.5 * m).astype(dtype), mean)
  chex.assert_trees_all_equal_dtypes(out, grads[0])
  chex.assert_trees_all_close(
    out, expected, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6
  )
  chex.assert_trees_all_close(
    flushed, jax.tree.map(lambda g: -0.5 * g, grads[2]), rtol=1e-6
  )
  assert int(state.step) == 2


# ---------------------------------------------------------------------------
# 9. Trees, masked, multi_transform, vmap, donation, retracing.
# ---------------------------------------------------------------------------


def test_none_leaves_pass_through(maybe_jit):
  params = {"w": jnp.ones(3), "frozen": None}
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  state = tx.init(params)
  assert state.acc_grads["frozen"] is None
  update = maybe_jit(tx.update)
  grads = {"w": jnp.ones(3), "frozen": None}
  out, state = update(grads, state, params)
  out, state = update(grads, state, params)
  assert out["frozen"] is None
  np.testing.assert_array_equal(out["w"], -jnp.ones(3))


def test_empty_tree(maybe_jit):
  tx = optax_accum.accumulate(optax.adam(1e-3), 2)
  state = tx.init({})
  update = maybe_jit(tx.update)
  out, state = update({}, state, {})
  out, state = update({}, state, {})
  assert out == {} and int(state.step) == 1


def test_inside_and_around_masked_and_multi_transform(maybe_jit):
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  mask = {"a": True, "b": False}
  grads = [
    {"a": jnp.full(3, float(i)), "b": jnp.full(2, 2.0 * i)} for i in range(1, 3)
  ]
  mean = {"a": jnp.full(3, 1.5), "b": jnp.full(2, 3.0)}
  variants = {
    "inside_masked": optax_accum.accumulate(
      optax.masked(optax.sgd(1.0), mask), 2
    ),
    "around_masked": optax.masked(
      optax_accum.accumulate(optax.sgd(1.0), 2), mask
    ),
    "inside_multi": optax_accum.accumulate(
      optax.multi_transform(
        {"x": optax.sgd(1.0), "y": optax.sgd(2.0)}, {"a": "x", "b": "y"}
      ),
      2,
    ),
    "around_multi": optax.multi_transform(
      {"x": optax_accum.accumulate(optax.sgd(1.0), 2), "y": optax.sgd(2.0)},
      {"a": "x", "b": "y"},
    ),
  }
  expected = {
    "inside_masked": {"a": -mean["a"], "b": mean["b"]},
    "around_masked": {"a": -mean["a"], "b": grads[1]["b"]},
    "inside_multi": {"a": -mean["a"], "b": -2.0 * mean["b"]},
    "around_multi": {"a": -mean["a"], "b": -2.0 * grads[1]["b"]},
  }
  for name, tx in variants.items():
    state = tx.init(params)
    update = maybe_jit(tx.update)
    for g in grads:
      out, state = update(g, state, params)
    chex.assert_trees_all_close(out, expected[name], rtol=1e-6)


def test_under_vmap():
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = jnp.zeros((5, 3))
  state = jax.vmap(tx.init)(params)
  update = jax.jit(jax.vmap(tx.update))
  g1, g2 = jnp.ones((5, 3)), 3.0 * jnp.ones((5, 3))
  out, state = update(g1, state, params)
  np.testing.assert_array_equal(out, jnp.zeros((5, 3)))
  out, state = update(g2, state, params)
  np.testing.assert_array_equal(out, -2.0 * jnp.ones((5, 3)))
  assert state.step.shape == (5,)


def test_fresh_state_can_be_donated_and_never_retraces():
  tx = optax_accum.accumulate(optax.adam(1e-3), 3, skip_nonfinite=True)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  @chex.assert_max_traces(n=1)
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  params = _common.params()
  state = tx.init(params)
  leaves = jax.tree.leaves((params, state))
  assert len({id(x) for x in leaves}) == len(leaves)
  for i in range(7):
    params, state = step(params, state, _common.grads(i))
  assert int(state.step) == 2


def test_eager_init_keeps_each_params_sharding():
  # Sharding under jit and in updates: tests/test_distributed.py.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
  params = {"w": jax.device_put(jnp.ones((4, 3)), sharding)}
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  state = tx.init(params)
  assert state.acc_grads["w"].sharding.is_equivalent_to(sharding, 2)


def test_python_scalar_gradient_leaves_are_accepted(maybe_jit):
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = {"a": 0.0, "b": jnp.zeros(2)}
  state = tx.init(params)
  update = maybe_jit(tx.update)
  _, state = update({"a": 1.0, "b": jnp.ones(2)}, state, params)
  out, state = update({"a": 3.0, "b": jnp.ones(2)}, state, params)
  np.testing.assert_allclose(out["a"], -2.0)


# ---------------------------------------------------------------------------
# 10. Save mid-cycle, restore, continue: bitwise identical.
# ---------------------------------------------------------------------------


def test_state_roundtrips_mid_cycle_bitwise(maybe_jit):
  tx = optax_accum.accumulate(optax.adam(1e-2), 4, track_noise_scale=True)
  params = _common.params()

  def run(state, params, start, stop):
    update = maybe_jit(tx.update)
    for i in range(start, stop):
      updates, state = update(_common.grads(i), state, params, weight=1.0 + i)
      params = optax.apply_updates(params, updates)
    return state, params

  straight_state, straight_params = run(tx.init(params), params, 0, 10)
  state, mid_params = run(tx.init(params), params, 0, 6)  # mid-cycle
  blob = flax.serialization.to_bytes((state, mid_params))
  restored, restored_params = flax.serialization.from_bytes(
    (tx.init(params), params), blob
  )
  assert int(restored.micro_step) == 2
  resumed_state, resumed_params = run(restored, restored_params, 6, 10)
  chex.assert_trees_all_equal(resumed_params, straight_params)
  chex.assert_trees_all_equal(resumed_state, straight_state)


# Configurations whose `noise` and `grow` records are used or not.
RECORDS = {
  "plain": lambda: optax_accum.accumulate(optax.sgd(0.1), 2),
  "noise": lambda: optax_accum.accumulate(
    optax.sgd(0.1), 2, track_noise_scale=True
  ),
  "grow": lambda: optax_accum.accumulate(
    optax.sgd(0.1),
    optax_accum.grow_every_k(k_max=8, min_cycles=1),
    track_noise_scale=True,
  ),
}


def _map_state_dict(fn, node):
  """`fn` over a state dict as a checkpointer walks one: into every dict,
  `fn` on every other value (a None there used to reach `fn`)."""
  if isinstance(node, dict):
    return {key: _map_state_dict(fn, value) for key, value in node.items()}
  return fn(node)


@pytest.mark.parametrize("config", list(RECORDS))
def test_state_has_no_none_for_tree_walkers(maybe_jit, config):
  """Unused records are empty (optax.EmptyState), never None: a function
  mapped over the state dict or the leaves only ever sees arrays."""
  tx = RECORDS[config]()
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  for i in range(3):  # mid-cycle
    _, state = update(_common.grads(i), state, params)
  as_dict = flax.serialization.to_state_dict(state)
  seen = []

  def to_numpy(x):
    seen.append(type(x))
    return np.asarray(x) + 0  # raises on None

  mapped = _map_state_dict(to_numpy, as_dict)
  assert set(seen) <= {jax.Array, type(jnp.zeros(1))}, seen
  assert len(seen) == len(jax.tree.leaves(state))
  leaves_or_none = jax.tree.leaves(state, is_leaf=lambda x: x is None)
  assert all(x is not None for x in leaves_or_none)
  restored = flax.serialization.from_state_dict(tx.init(params), mapped)
  chex.assert_trees_all_equal(restored, state)
  tracks_noise = config != "plain"
  assert (
    isinstance(state.noise, optax_accum.types.NoiseScaleState) == tracks_noise
  )
  assert isinstance(state.grow, optax_accum.types.GrowState) == (
    config == "grow"
  )


@pytest.mark.parametrize("config", list(RECORDS))
def test_layouts_keep_the_records(maybe_jit, config):
  """shard_map's layout of a state: the device-local sums (acc_grads and
  acc_scalars, which holds the cycle's weight and noise sums) get the
  device axis, the counters (the noise scale's averages and the
  controller's state among them) are replicated."""
  tx = RECORDS[config]()
  state = tx.init(_common.params())
  specs = optax_accum.distributed.shard_map_specs(state, "data")
  local, replicated = jax.P("data"), jax.P()
  assert specs.acc_scalars == local and specs.counters == replicated
  # A spec has no entries: the properties give the spec of their array.
  assert specs.acc_weight == local and specs.step == replicated
  width = {"plain": 7, "noise": 10, "grow": 12}[config]
  assert state.counters.shape == (width,)
  assert state.acc_scalars.shape == ((1,) if config == "plain" else (3,))
  with_axis = maybe_jit(optax_accum.distributed.add_device_axis)(state)
  assert jax.tree.structure(with_axis) == jax.tree.structure(state)
  assert with_axis.acc_weight.shape == (1,) and with_axis.step.shape == ()
  if config != "plain":
    assert with_axis.noise.sq_norm_sum.shape == (1,)
    assert with_axis.noise.cycles.shape == ()
  back = maybe_jit(optax_accum.distributed.drop_device_axis)(with_axis)
  chex.assert_trees_all_equal(back, state)


def test_sgd_state_has_at_most_7_leaves():
  """The leaf budget of a plain state (one-leaf params, sgd): two scalar
  arrays, as optax.MultiStepsState has two scalars, and no empty records
  (each a node that flax walks on every nnx.jit call)."""
  tx = optax_accum.accumulate(optax.sgd(0.1), 4)
  state = tx.init(jnp.zeros(3))
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  names = [jax.tree_util.keystr(path) for path, _ in leaves]
  assert len(leaves) <= 7, names
  scalars = [x for x in jax.tree.leaves(state) if x.shape != (3,)]
  assert len(scalars) == 2, names
  assert state.noise == state.grow == optax.EmptyState()

  # Nodes: the state and sgd's two records, nothing for noise or grow.
  def records(tree):
    treedef = jax.tree.structure(tree)
    return treedef.num_nodes - treedef.num_leaves

  assert records(state) == records(state.inner_state) + 1


# ---------------------------------------------------------------------------
# 11. Reading the state inside any optax state.
# ---------------------------------------------------------------------------


def _accumulate_sgd(learning_rate):
  return optax_accum.accumulate(optax.sgd(learning_rate), 2)


WRAPPERS = {
  "itself": lambda: _accumulate_sgd(0.1),
  "chain": lambda: optax.chain(optax.clip(1.0), _accumulate_sgd(0.1)),
  "inject_hyperparams": lambda: optax.inject_hyperparams(_accumulate_sgd)(
    learning_rate=0.1
  ),
  "masked": lambda: optax.masked(_accumulate_sgd(0.1), {"w": True, "b": False}),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_readers_find_the_one_accumulate_state(maybe_jit, wrapper):
  tx = WRAPPERS[wrapper]()
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  seen = []
  for i in range(4):
    _, state = update(_common.grads(i), state, params)
    seen.append(bool(optax_accum.has_updated(state)))
  assert seen == [False, True, False, True]
  inner = optax_accum.inner_state(state)
  chex.assert_trees_all_equal_structs(inner, optax.sgd(0.1).init(params))
