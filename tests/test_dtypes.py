"""Dtypes a user picks (issue 55): a narrow accumulator, and float64.

* A bfloat16 or float16 accumulator (``accumulator_dtype=``): each
  micro-batch's term, weighted, is added to the sum in float32 and the sum
  rounded once to the accumulator's dtype; rounding the term first as well
  (double rounding) gives other sums. The reference here is NumPy: float32
  arithmetic, one cast per add.
* ``jax_enable_x64`` with float64 params and a float64 (or ``None``)
  accumulator: terms weighted and added in float64, the mean taken in
  float64, the emitted updates float64. The weights are float32 (the state
  holds them so), so the references below use weights exact in float32.

Each runs with and without ``jit``, on the traced and the static (``emit=``)
ends.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import identity

import optax_accum

K = 3
WEIGHTS = (1.0, 3.0, 0.375)  # exact in float32
_NARROW = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _cycle(tx, update, grads, params, weights, emit):
  """The updates of one cycle of `grads`, ended by the counter (emit None)
  or by the caller on the last call."""
  state = tx.init(params)
  for i, g in enumerate(grads):
    last = i == len(grads) - 1
    kwargs = {} if weights is None else {"weight": weights[i]}
    if emit:
      kwargs["emit"] = last
    out, state = update(g, state, params, **kwargs)
  assert bool(optax_accum.has_updated(state))
  return out, state


def _updater(tx, maybe_jit):
  if maybe_jit is jax.jit:
    return jax.jit(tx.update, static_argnames="emit")
  return tx.update


# ----------------------------------------------------------------------------
# A narrow accumulator: one rounding per add.
# ----------------------------------------------------------------------------


def _narrow_reference(grads, weights, dtype):
  """sum_i w_i g_i with the sum held in `dtype`: each add in float32, then
  one cast; and the same with the term cast to `dtype` first."""
  single = double = np.zeros(grads[0].shape, dtype)
  for i, g in enumerate(grads):
    term = np.float32(1.0 if weights is None else weights[i]) * g
    single = (single.astype(np.float32) + term).astype(dtype)
    term_rounded = term.astype(dtype).astype(np.float32)
    double = (double.astype(np.float32) + term_rounded).astype(dtype)
  return single, double


@pytest.mark.parametrize("emit", [False, True], ids=["traced", "emit"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weights"])
@pytest.mark.parametrize("name", sorted(_NARROW))
def test_a_narrow_accumulator_rounds_each_sum_once(
  maybe_jit, name, weighted, emit
):
  dtype = _NARROW[name]
  rng = np.random.default_rng(0)
  grads = [rng.standard_normal(512).astype(np.float32) for _ in range(K)]
  weights = WEIGHTS if weighted else None
  single, double = _narrow_reference(grads, weights, dtype)
  # The test tells the two apart: double rounding changes some sums.
  assert np.any(single != double)

  tx = optax_accum.accumulate(
    identity(), K, reduction="sum", accumulator_dtype=dtype
  )
  params = jnp.zeros(512, jnp.float32)
  out, state = _cycle(
    tx,
    _updater(tx, maybe_jit),
    [jnp.asarray(g) for g in grads],
    params,
    weights,
    emit,
  )
  assert state.acc_grads.dtype == dtype
  assert out.dtype == jnp.float32  # the gradient's dtype
  np.testing.assert_array_equal(np.asarray(out), single.astype(np.float32))


# ----------------------------------------------------------------------------
# float64 under jax_enable_x64.
# ----------------------------------------------------------------------------


# (`x64`: the fixture of tests/conftest.py.)


@pytest.mark.parametrize("emit", [False, True], ids=["traced", "emit"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weights"])
@pytest.mark.parametrize("accumulator_dtype", [None, "float64"])
def test_float64_is_weighted_added_and_averaged_in_float64(
  x64, maybe_jit, accumulator_dtype, weighted, emit
):
  rng = np.random.default_rng(1)
  grads = [rng.standard_normal(64) for _ in range(K)]  # float64
  weights = WEIGHTS if weighted else (1.0,) * K
  want = sum(w * g for w, g in zip(weights, grads, strict=True)) / sum(weights)
  # float32 anywhere (a term, the sum, 1/W) is off by ~1e-8 here.
  as_float32 = sum(
    np.float32(w) * g.astype(np.float32)
    for w, g in zip(weights, grads, strict=True)
  ) * np.float32(1 / sum(weights))
  assert np.max(np.abs(as_float32 - want)) > 1e-9

  tx = optax_accum.accumulate(
    identity(), K, accumulator_dtype=accumulator_dtype
  )
  params = jnp.zeros(64, jnp.float64)
  out, state = _cycle(
    tx,
    _updater(tx, maybe_jit),
    [jnp.asarray(g) for g in grads],
    params,
    weights if weighted else None,
    emit,
  )
  assert state.acc_grads.dtype == jnp.float64 and out.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-14, atol=1e-15)
  # The counters keep their types under x64 (a checkpoint restores).
  fresh = tx.init(params)
  for got, was in zip(
    jax.tree.leaves(state), jax.tree.leaves(fresh), strict=True
  ):
    assert got.dtype == was.dtype


def test_float64_gradients_with_the_default_accumulator_are_float32_sums(x64):
  """The default accumulator stays float32 (as optax.MultiSteps'): float64
  gradients are summed in float32 unless the user passes float64 or None;
  the update keeps the gradient's dtype."""
  tx = optax_accum.accumulate(identity(), 2)
  params = jnp.zeros(2, jnp.float64)
  third = jnp.asarray([1 / 3, 2 / 3], jnp.float64)
  state = tx.init(params)
  _, state = tx.update(third, state, params)
  out, state = tx.update(third, state, params)
  assert state.acc_grads.dtype == jnp.float32 and out.dtype == jnp.float64
  np.testing.assert_array_equal(
    np.asarray(out), np.asarray(third, np.float32).astype(np.float64)
  )


@pytest.mark.parametrize("name", sorted(_NARROW))
def test_every_k_1_rounds_through_a_narrow_accumulator_on_every_path(
  maybe_jit, name
):
  """k = 1 runs `inner` alone where the accumulator holds the gradient
  exactly; through a narrower one, every call rounds as weight= and emit=
  do (issue 55: the plain call skipped the rounding)."""
  dtype = _NARROW[name]
  tx = optax_accum.accumulate(identity(), 1, accumulator_dtype=dtype)
  update = _updater(tx, maybe_jit)
  params = jnp.zeros(3, jnp.float32)
  g = jnp.asarray([1 + 2**-12, 3.0 + 2**-11, -(2**-20)], jnp.float32)
  rounded = np.asarray(g).astype(dtype).astype(np.float32)
  assert np.any(rounded != np.asarray(g))
  for options in ({}, {"weight": 1.0}, {"emit": True}):
    out, state = update(g, tx.init(params), params, **options)
    assert bool(optax_accum.has_updated(state))
    np.testing.assert_array_equal(np.asarray(out), rounded, err_msg=options)
  # A float32 accumulator holds float32 gradients: `inner` alone, exact.
  tx = optax_accum.accumulate(identity(), 1)
  out, _ = _updater(tx, maybe_jit)(g, tx.init(params), params)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(g))
