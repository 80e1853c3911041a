"""What a user passes and reads that no other test held (issue 63): NumPy
values for the call's keywords, an abstract state's readers, dtypes whose
wider mantissa has the narrower range, and a params tree of two float
widths under x64. Each test's docstring names the plant it catches
(``tools/mutants.py``)."""

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_emit_takes_a_numpy_bool(jit):
  """``emit=np.bool_(True)``, a comparison made on the host, is ``True``
  (plant: ``emit`` accepted only as a Python bool)."""
  tx = optax_accum.accumulate(optax.sgd(1.0), 3)
  params = jnp.zeros(2)
  update = jax.jit(tx.update, static_argnames="emit") if jit else tx.update
  out = {}
  for emit in (True, np.bool_(True), False, np.bool_(False)):
    state = tx.init(params)
    _, state = update(jnp.ones(2), state, params, emit=np.bool_(False))
    updates, state = update(jnp.full(2, 3.0), state, params, emit=emit)
    out[type(emit), bool(emit)] = (np.asarray(updates), int(state.step))
  np.testing.assert_array_equal(out[np.bool_, True][0], [-2.0, -2.0])
  assert out[np.bool_, True][1] == out[bool, True][1] == 1
  assert out[np.bool_, False][1] == out[bool, False][1] == 0


STATES = {
  "plain": dict(every_k=2),
  "noise": dict(every_k=2, track_noise_scale=True),
  "grow": dict(every_k=optax_accum.grow_every_k(8), track_noise_scale=True),
}
READERS = (*_common.STATE_READERS, "noise", "grow")


@pytest.mark.parametrize("kind", list(STATES))
def test_an_abstract_state_reads_the_types_of_the_concrete_one(kind):
  """``jax.eval_shape(tx.init, params)`` (what Orbax and sharding code
  read): every reader gives the shape and dtype the concrete state's gives
  (plant: ``weight_seen`` read as a scalar)."""
  tx = optax_accum.accumulate(optax.adam(0.1), **STATES[kind])
  params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
  abstract, concrete = jax.eval_shape(tx.init, params), tx.init(params)
  for name in READERS:
    got = jax.tree.map(
      lambda x: (x.shape, jnp.dtype(x.dtype)), getattr(abstract, name)
    )
    want = jax.tree.map(
      lambda x: (jnp.shape(x), jnp.result_type(x)), getattr(concrete, name)
    )
    assert got == want, name


@pytest.mark.parametrize("kind", list(STATES))
def test_the_public_readers_of_an_abstract_state_give_types(kind):
  """``has_updated``, ``current_every_k``, ``weight_seen`` and
  ``inner_state`` of ``jax.eval_shape(tx.init, params)`` (alone and in a
  chain): the type of what they give the concrete state, as
  ``jax.ShapeDtypeStruct``s (plant: ``has_updated`` reads the value)."""
  tx = optax.chain(
    optax.clip(1.0), optax_accum.accumulate(optax.adam(0.1), **STATES[kind])
  )
  params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
  abstract, concrete = jax.eval_shape(tx.init, params), tx.init(params)
  readers = (
    optax_accum.has_updated,
    optax_accum.current_every_k,
    optax_accum.weight_seen,
    optax_accum.inner_state,
  )
  for reader in readers:
    got = reader(abstract)
    assert all(
      isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(got)
    ), reader.__name__
    want = jax.eval_shape(reader, concrete)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == jax.tree.map(
      lambda x: (x.shape, x.dtype), want
    ), reader.__name__


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weight"])
def test_a_wider_mantissa_with_a_narrower_range_rounds_into_it(weighted):
  """A float16 accumulator (11 bits of mantissa, largest 65504) for
  bfloat16 gradients (8 bits, largest 3e38): 1e6 overflows it, with and
  without ``weight=`` (plant: ``_holds_exactly`` compares mantissas only,
  and ``every_k=1`` hands the gradient to ``inner`` whole)."""
  tx = optax_accum.accumulate(optax.sgd(1.0), 1, accumulator_dtype=jnp.float16)
  params = jnp.zeros(2, jnp.bfloat16)
  options = {"weight": 1.0} if weighted else {}
  updates, _ = tx.update(
    jnp.full(2, 1e6, jnp.bfloat16), tx.init(params), params, **options
  )
  assert np.all(np.isneginf(np.asarray(updates, np.float32)))


def test_a_tree_of_two_float_widths_keeps_each_leafs_precision():
  """x64, a float32 leaf and a float64 leaf, each accumulated in its own
  dtype: the float64 leaf's mean is its float64 sum times a float64 1/W,
  exactly, and the float32 leaf's is what it alone gives (plant: the
  inverse weight taken in the narrowest dtype)."""
  with jax.enable_x64(True):
    tx = optax_accum.accumulate(optax.sgd(1.0), 3, accumulator_dtype=None)
    params = {"a": jnp.zeros(2, jnp.float32), "b": jnp.zeros(2, jnp.float64)}
    alone = optax_accum.accumulate(optax.sgd(1.0), 3, accumulator_dtype=None)
    grads = [
      {"a": jnp.full(2, 0.1 * i, jnp.float32), "b": jnp.full(2, 0.1 * i)}
      for i in (1, 2, 4)
    ]
    state, single = tx.init(params), alone.init(params["a"])
    for g in grads:
      updates, state = tx.update(g, state, params)
      updates_a, single = alone.update(g["a"], single, params["a"])
    exact = np.sum([np.asarray(g["b"]) for g in grads], axis=0) * (1.0 / 3.0)
    np.testing.assert_array_equal(np.asarray(updates["b"]), -exact)
    assert updates["b"].dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(updates["a"]), updates_a)


# The call's keywords as a user may pass them: Python, NumPy, 0-d arrays.
KEYWORDS = {
  "weight": (2.0, [2, np.float32(2.0), np.float64(2.0), np.array(2.0)]),
  "flush": (True, [np.bool_(True), np.array(True), jnp.asarray(True)]),
}


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("keyword", list(KEYWORDS))
def test_every_form_of_a_keyword_gives_the_python_values_run(keyword, jit):
  """``weight=`` and ``flush=`` as Python, NumPy or 0-d array values: the
  same updates and state as the Python value (plant of this family:
  ``flush`` taken as a flag only when it is a Python bool)."""
  python, others = KEYWORDS[keyword]
  tx = optax_accum.accumulate(optax.adam(0.1), 3)
  params = jnp.zeros(2)
  update = jax.jit(tx.update) if jit else tx.update

  def run(value):
    state = tx.init(params)
    _, state = update(jnp.ones(2), state, params)
    out = update(jnp.full(2, 3.0), state, params, **{keyword: value})
    return jax.tree.map(np.asarray, out)

  want = run(python)
  for value in others:
    got = run(value)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, b, f"{keyword}={value!r}")


MIXED = {
  "f32": jnp.float32,
  "bf16": jnp.bfloat16,
  "f16": jnp.float16,
  "c64": jnp.complex64,
}


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("accumulator_dtype", [None, jnp.float32])
def test_a_mixed_dtype_tree_is_each_leaf_accumulated_alone(
  accumulator_dtype, x64
):
  """A params tree of float32, bfloat16, float16 and complex64 leaves, with
  weights and a cycle end: each leaf's updates and accumulator equal, bit
  for bit, that leaf accumulated alone in the same dtype (plant of this
  family: the mean's inverse taken in the narrowest dtype)."""
  with jax.enable_x64(x64):
    _mixed_leaf_by_leaf(accumulator_dtype, x64)


def _mixed_leaf_by_leaf(accumulator_dtype, x64):
  mixed = dict(MIXED, f64=jnp.float64, c128=jnp.complex128) if x64 else MIXED
  params = {n: jnp.zeros(3, d) for n, d in mixed.items()}
  grads = [
    {
      n: jnp.asarray(np.linspace(-1, 1, 3) * (i + 1) / 7, d)
      for n, d in mixed.items()
    }
    for i in range(5)
  ]
  weights = [1.0, 0.5, 2.0, 1.0, 3.0]

  def run(params, grads):
    tx = optax_accum.accumulate(
      optax.sgd(0.3), 3, accumulator_dtype=accumulator_dtype
    )
    state, out = tx.init(params), []
    update = jax.jit(tx.update)
    for g, w in zip(grads, weights, strict=True):
      updates, state = update(g, state, params, weight=w)
      out.append((updates, state.acc_grads))
    return out

  together = run(params, grads)
  for name in mixed:
    alone = run(params[name], [g[name] for g in grads])
    for (u, a), (v, b) in zip(together, alone, strict=True):
      np.testing.assert_array_equal(np.asarray(u[name]), np.asarray(v), name)
      np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b), name)
