"""What a user passes and reads that no other test held (issue 63): NumPy
values for the call's keywords, an abstract state's readers, dtypes whose
wider mantissa has the narrower range, and a params tree of two float
widths under x64. Each test's docstring names the plant it catches
(``tools/mutants.py``)."""

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
READERS = (
  "micro_step",
  "step",
  "every_k",
  "num_skipped",
  "emitted",
  "weight_seen",
  "acc_weight",
  "acc_grads",
  "acc_buffer",
  "noise",
  "grow",
)


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
