"""Semantics of `optax_accum.microbatch`, with and without jit.

Each test names the point it proves. Micro-batching changes the order of the
float32 sums, so results are compared with the unsplit step at `TOL` (a few
float32 ulps of values of order 1); they are exact where the arithmetic is
the same on both sides (one micro-batch, power-of-two exact values).
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

# Float32 sums in another order: a few ulps of values of order 1.
TOL = {"rtol": 2e-5, "atol": 1e-6}


# ---------------------------------------------------------------------------
# A small token-level model: batch [B, T, D], per-token squared error.
# ---------------------------------------------------------------------------

BATCH, TOKENS, DIM, HIDDEN = 16, 4, 3, 5
# Real tokens per row. With 8 micro-batches (rows i and i + 8), micro-batch 3
# holds rows 3 and 11: all padding, so its per-token mean is 0/0 = NaN.
LENGTHS = [4, 1, 3, 0, 2, 4, 1, 3, 4, 2, 2, 0, 3, 4, 2, 1]


# Test data comes from numpy: eager `jax.random` costs seconds of compiles.


def _normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _params():
  rng = np.random.default_rng(0)
  return {"w1": _normal(rng, (DIM, HIDDEN)), "w2": _normal(rng, (HIDDEN,))}


def _batch(lengths=LENGTHS, seed=1):
  rng = np.random.default_rng(seed)
  mask = np.arange(TOKENS)[None, :] < np.asarray(lengths)[:, None]
  return {
    "x": _normal(rng, (len(lengths), TOKENS, DIM)),
    "y": _normal(rng, (len(lengths), TOKENS)),
    "mask": jnp.asarray(mask, jnp.float32),
  }


def _full_batch():
  return _batch(lengths=[TOKENS] * BATCH)


def _tokens(batch):
  return batch["mask"].sum()


def _loss_with_aux(params, batch):
  """Per-token mean over real tokens (no guard: 0/0 for an empty batch)."""
  pred = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
  err = pred - batch["y"]
  mask = batch["mask"]
  loss = jnp.sum(mask * err**2) / jnp.sum(mask)
  aux = {
    "mae": jnp.sum(mask * jnp.abs(err)) / jnp.sum(mask),  # float: mean
    "tokens": jnp.sum(mask).astype(jnp.int32),  # int: summed
    "large": jnp.any((mask > 0) & (jnp.abs(err) > 2.0)),  # bool: or-ed
  }
  return loss, aux


def _loss(params, batch):
  return _loss_with_aux(params, batch)[0]


def _value_and_grad(has_aux):
  if has_aux:
    return jax.value_and_grad(_loss_with_aux, has_aux=True)
  return jax.value_and_grad(_loss)


# Unsplit references, compiled once per input shape.
_REFERENCE = {aux: jax.jit(_value_and_grad(aux)) for aux in (False, True)}


def _assert_trees_close(actual, expected, **tol):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(
    jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True
  ):
    assert a.dtype == e.dtype and a.shape == e.shape
    if jnp.issubdtype(a.dtype, jnp.inexact):
      np.testing.assert_allclose(a, e, **tol)
    else:
      np.testing.assert_array_equal(a, e)


# ---------------------------------------------------------------------------
# 1. Equals the unsplit step: plain mean and token-weighted mean.
# ---------------------------------------------------------------------------

# (num_microbatches, has_aux, weighted): unweighted runs on full rows (equal
# token counts), weighted on ragged rows; with 8 micro-batches one of them is
# all padding (see LENGTHS).
EQUALITY_CASES = [
  (2, False, False),
  (4, True, False),
  (4, False, True),
  (8, True, True),
]


@pytest.mark.parametrize("n, has_aux, weighted", EQUALITY_CASES)
def test_equals_the_unsplit_gradient(maybe_jit, n, has_aux, weighted):
  params = _params()
  batch = _batch() if weighted else _full_batch()
  value_and_grad = _value_and_grad(has_aux)
  grad_fn = optax_accum.microbatch(
    value_and_grad, n, weight_fn=_tokens if weighted else None
  )
  out = maybe_jit(grad_fn)(params, batch)
  expected = _REFERENCE[has_aux](params, batch)
  _assert_trees_close(out, expected, **TOL)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))


def test_unweighted_mean_of_ragged_micro_batches_is_not_the_token_mean():
  """The reason for `weight_fn`: equal weights are wrong for ragged data."""
  params, batch = _params(), _batch(lengths=[1, 4] * (BATCH // 2))
  loss, _ = optax_accum.microbatch(jax.value_and_grad(_loss), 2)(params, batch)
  expected = _REFERENCE[False](params, batch)[0]
  assert not np.allclose(loss, expected, rtol=1e-2)


@pytest.mark.parametrize("has_aux, weighted", [(False, False), (True, True)])
def test_one_microbatch_is_the_plain_function_exactly(
  maybe_jit, has_aux, weighted
):
  params, batch = _params(), _batch()
  value_and_grad = _value_and_grad(has_aux)
  grad_fn = optax_accum.microbatch(
    value_and_grad, 1, weight_fn=_tokens if weighted else None
  )
  _assert_trees_close(
    maybe_jit(grad_fn)(params, batch),
    maybe_jit(value_and_grad)(params, batch),
    rtol=0,
    atol=0,
  )


def test_zero_total_weight_gives_zeros_without_nan(maybe_jit):
  params, batch = _params(), _batch(lengths=[0] * BATCH)
  grad_fn = optax_accum.microbatch(_value_and_grad(True), 4, weight_fn=_tokens)
  (loss, aux), grads = maybe_jit(grad_fn)(params, batch)
  for x in [loss, aux["mae"], *jax.tree.leaves(grads)]:
    np.testing.assert_array_equal(x, np.zeros_like(x))
  assert aux["tokens"] == 0 and not aux["large"]


def test_extra_args_and_kwargs_reach_every_call_unsplit(maybe_jit):
  def loss_fn(params, batch, scale, *, offset):
    return jnp.sum(scale) * _loss(params, batch) + offset

  params, batch = _params(), _batch()
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(loss_fn), 4, weight_fn=_tokens
  )
  # `scale` has a leading size 3: it must not be split like the batch.
  scale = jnp.array([0.5, 1.0, 0.25])
  out = maybe_jit(grad_fn)(params, batch, scale, offset=0.5)
  expected = jax.value_and_grad(loss_fn)(params, batch, scale, offset=0.5)
  _assert_trees_close(out, expected, **TOL)


# ---------------------------------------------------------------------------
# 2. Dtypes: bf16 gradients summed in float32, returned in bf16.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "accumulator_dtype, expected",
  [
    # 1 + 15 * 2**-8 = 1.0586 in float32, / 16, rounded once to bf16.
    (jnp.float32, 0.06640625),
    # In bf16 each 1 + 2**-8 rounds back to 1: the small terms vanish.
    (None, 0.0625),
  ],
)
def test_bf16_grads_accumulate_in_accumulator_dtype(
  maybe_jit, accumulator_dtype, expected
):
  def loss_fn(w, batch):
    return w * jnp.mean(batch)

  # 16 micro-batches of one row: micro-batch i's gradient is row i.
  batch = jnp.array([1.0] + [2.0**-8] * 15, jnp.bfloat16)
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(loss_fn), 16, accumulator_dtype=accumulator_dtype
  )
  loss, grad = maybe_jit(grad_fn)(jnp.bfloat16(1.0), batch)
  assert grad.dtype == jnp.bfloat16 and loss.dtype == jnp.bfloat16
  assert float(grad) == expected
  # The loss is always summed in float32.
  assert float(loss) == 0.06640625


# ---------------------------------------------------------------------------
# 3. Peak memory follows the micro-batch.
# ---------------------------------------------------------------------------


def test_sixteen_microbatches_cut_compiled_temp_memory():
  width, layers, batch_size = 256, 8, 2048

  def loss_fn(params, batch):
    h = batch["x"]
    for w in params:
      h = jnp.tanh(h @ w)
    return jnp.mean((h - batch["y"]) ** 2)

  params = [jax.ShapeDtypeStruct((width, width), jnp.float32)] * layers
  batch = dict.fromkeys(
    ("x", "y"), jax.ShapeDtypeStruct((batch_size, width), jnp.float32)
  )

  def temp_bytes(fn):
    compiled = jax.jit(fn).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  value_and_grad = jax.value_and_grad(loss_fn)
  unsplit = temp_bytes(value_and_grad)
  split = temp_bytes(optax_accum.microbatch(value_and_grad, 16))
  # Activations: 8 layers x 2048 x 256 float32 = 16 MiB unsplit.
  assert split <= 0.35 * unsplit, (split, unsplit, split / unsplit)


# ---------------------------------------------------------------------------
# 4. Sharded batches stay sharded per micro-batch.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_batch_stays_sharded_in_every_microbatch(maybe_jit, axis_type):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  seen = []

  def loss_fn(params, batch):
    jax.debug.inspect_array_sharding(batch["x"], callback=seen.append)
    return _loss(params, batch)

  params = _params()
  host_batch = _batch(lengths=LENGTHS * 4)  # 64 rows: 8 per device.
  batch = jax.device_put(host_batch, NamedSharding(mesh, P("data")))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  grad_fn = maybe_jit(
    optax_accum.microbatch(jax.value_and_grad(loss_fn), 4, weight_fn=_tokens)
  )
  with jax.set_mesh(mesh):
    out = grad_fn(params, batch)
    if maybe_jit is jax.jit:
      hlo = grad_fn.lower(params, batch).compile().as_text()
      # The batch is never gathered: each device keeps its own rows.
      assert "all-gather" not in hlo
  # 16 rows per micro-batch: 2 from each of the 8 devices.
  assert seen
  for sharding in seen:
    assert sharding.shard_shape((16, TOKENS, DIM)) == (2, TOKENS, DIM)
  expected = _REFERENCE[False](_params(), host_batch)
  _assert_trees_close(jax.device_get(out), expected, **TOL)


def test_sharded_params_under_an_explicit_mesh_keep_their_sharding(maybe_jit):
  """Gradients typed `f32[16@data, 8]` need a carry of that type."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  rng = np.random.default_rng(3)
  w = _normal(rng, (16, 8))
  x = _normal(rng, (32, 16))

  def loss_fn(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)

  grad_fn = maybe_jit(optax_accum.microbatch(jax.value_and_grad(loss_fn), 2))
  with jax.set_mesh(mesh):
    out = grad_fn(jax.device_put(w, P("data")), jax.device_put(x, P("data")))
    assert out[1].sharding.spec == P("data", None)
  expected = jax.jit(jax.value_and_grad(loss_fn))(w, x)
  _assert_trees_close(jax.device_get(out), expected, **TOL)


# ---------------------------------------------------------------------------
# 5. Dropout: per-example keys travel with their rows.
# ---------------------------------------------------------------------------


def _dropout_loss(params, batch):
  # Each example's mask comes from its own key, whatever micro-batch it
  # lands in.
  keep = jax.vmap(lambda key: jax.random.bernoulli(key, 0.5, (TOKENS, HIDDEN)))(
    batch["rng"]
  )
  hidden = jnp.tanh(batch["x"] @ params["w1"]) * keep * 2.0
  err = hidden @ params["w2"] - batch["y"]
  # A model taking one key would use batch["rng"][0]; its aux reports it.
  return jnp.mean(err**2), {"key": batch["rng"][0]}


_DROPOUT_VALUE_AND_GRAD = jax.value_and_grad(_dropout_loss, has_aux=True)
_DROPOUT_REFERENCE = jax.jit(_DROPOUT_VALUE_AND_GRAD)


def test_per_example_dropout_keys_make_result_independent_of_split(maybe_jit):
  n = 4
  params, batch = _params(), _full_batch()
  # jax.random.split(key, BATCH) in a real step; numpy bits here (fast).
  key_bits = np.random.default_rng(42).integers(0, 2**32, (BATCH, 2))
  batch["rng"] = jax.random.wrap_key_data(key_bits.astype(np.uint32))
  grad_fn = optax_accum.microbatch(_DROPOUT_VALUE_AND_GRAD, n)
  (loss, aux), grads = maybe_jit(grad_fn)(params, batch)
  (expected_loss, _), expected_grads = _DROPOUT_REFERENCE(params, batch)
  _assert_trees_close((loss, grads), (expected_loss, expected_grads), **TOL)
  # Keys are an "other" aux leaf: the last micro-batch (rows 3, 7, ...)
  # reports its first key, row n - 1's.
  np.testing.assert_array_equal(
    jax.random.key_data(aux["key"]), jax.random.key_data(batch["rng"][n - 1])
  )


# ---------------------------------------------------------------------------
# 6. Composes with `accumulate`: micro-batches in a step, steps in a cycle.
# ---------------------------------------------------------------------------


def test_composes_with_accumulate_to_the_big_batch_token_mean(maybe_jit):
  params = _params()
  batches = [_batch(seed=1), _batch(lengths=LENGTHS[::-1], seed=2)]
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(_loss), 4, weight_fn=_tokens
  )
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)

  def step(params, state, batch):
    _, grads = grad_fn(params, batch)
    return tx.update(grads, state, params, weight=_tokens(batch))

  step = maybe_jit(step)
  state = tx.init(params)
  updates, state = step(params, state, batches[0])
  assert all(np.all(u == 0) for u in jax.tree.leaves(updates))
  updates, state = step(params, state, batches[1])
  both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *batches)
  _, grads = _REFERENCE[False](params, both)
  expected = jax.tree.map(jnp.negative, grads)
  _assert_trees_close(updates, expected, **TOL)


# ---------------------------------------------------------------------------
# 7. Bad arguments name the argument and the value received.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "num_microbatches, error, match",
  [
    (0, ValueError, "`num_microbatches` must be >= 1, got 0"),
    (-2, ValueError, "`num_microbatches` must be >= 1, got -2"),
    (2.0, TypeError, "`num_microbatches` .* got 2.0 of type float"),
    ("2", TypeError, "`num_microbatches` .* got '2' of type str"),
    (None, TypeError, "`num_microbatches` .* got None"),
    (True, TypeError, "`num_microbatches` .* got True of type bool"),
  ],
)
def test_bad_num_microbatches_is_rejected_at_construction(
  num_microbatches, error, match
):
  with pytest.raises(error, match=match):
    optax_accum.microbatch(jax.value_and_grad(_loss), num_microbatches)


@pytest.mark.parametrize("num_microbatches", [np.int64(4), jnp.int32(4)])
def test_numpy_and_jax_integers_are_accepted(num_microbatches):
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(lambda w, b: w * jnp.mean(b)), num_microbatches
  )
  loss, grad = grad_fn(jnp.float32(2.0), jnp.arange(8.0))
  assert (float(loss), float(grad)) == (7.0, 3.5)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"weight_fn": 3}, TypeError, "`weight_fn` .* got int"),
    (
      {"accumulator_dtype": jnp.int32},
      ValueError,
      "`accumulator_dtype` .* got int32",
    ),
    (
      {"accumulator_dtype": "nope"},
      TypeError,
      "`accumulator_dtype` .* got 'nope'",
    ),
  ],
)
def test_bad_options_name_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    optax_accum.microbatch(jax.value_and_grad(_loss), 2, **kwargs)


def test_non_callable_value_and_grad_fn_is_rejected():
  with pytest.raises(TypeError, match="`value_and_grad_fn` must be callable"):
    optax_accum.microbatch(3.0, 2)


BAD_BATCHES = {
  "not_divisible": (
    {"x": jnp.zeros((10, 3))},
    r"batch size 10 .* not divisible by `num_microbatches`=4",
  ),
  "different_sizes": (
    {"x": jnp.zeros((8, 3)), "y": jnp.zeros(6)},
    r"same leading batch size, got sizes .*\['x'\].*: 8, .*\['y'\].*: 6",
  ),
  "scalar_leaf": (
    {"x": jnp.zeros((8, 3)), "t": jnp.zeros(())},
    r"`batch` leaf \['t'\] is a scalar",
  ),
  "no_leaves": ({}, r"`batch` \(argument 1\) must hold at least one array"),
}


@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_bad_batch_names_the_argument_and_sizes(maybe_jit, name):
  batch, match = BAD_BATCHES[name]
  grad_fn = optax_accum.microbatch(jax.value_and_grad(lambda w, b: w * 1.0), 4)
  with pytest.raises(ValueError, match=match):
    maybe_jit(grad_fn)(jnp.float32(1.0), batch)


def test_non_scalar_weight_is_rejected(maybe_jit):
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(_loss), 4, weight_fn=lambda b: b["mask"].sum(1)
  )
  with pytest.raises(
    ValueError,
    match=r"`weight_fn` must return a scalar.*"
    r"got shape \(4,\)",
  ):
    maybe_jit(grad_fn)(_params(), _batch())


def test_output_that_is_not_value_and_grad_is_rejected(maybe_jit):
  grad_fn = optax_accum.microbatch(jax.grad(_loss), 4)
  with pytest.raises(
    TypeError,
    match="`value_and_grad_fn` must return.*pass `jax.value_and_grad",
  ):
    maybe_jit(grad_fn)(_params(), _batch())


def _scale_loss(w, batch):
  """A scalar parameter: its gradient passes for a loss."""
  return jnp.mean(w * batch["x"]), jnp.stack([w, w])


@pytest.mark.parametrize("has_aux", [False, True])
def test_gradient_function_of_params_and_batch_is_rejected(maybe_jit, has_aux):
  """jax.grad(f, argnums=(0, 1)) returns (g_params, g_batch): a pair, like
  value_and_grad's, that used to run and return the wrong structure."""
  loss = _scale_loss if has_aux else lambda w, b: _scale_loss(w, b)[0]
  grad_fn = optax_accum.microbatch(
    jax.grad(loss, argnums=(0, 1), has_aux=has_aux), 2
  )
  with pytest.raises(
    TypeError,
    match=r"shaped like gradients with respect to the params \(argument 0\)"
    r" and the micro-batch.*`jax.grad\(loss_fn, argnums=\(0, 1\)\)`",
  ):
    maybe_jit(grad_fn)(jnp.float32(2.0), {"x": jnp.arange(8.0)})


def test_scalar_params_with_batch_shaped_aux_are_accepted(maybe_jit):
  """value_and_grad's own output is never taken for a gradient function,
  even where the loss is shaped like the params and the aux like the
  micro-batch."""

  def loss(w, batch):
    per_example = w * batch["x"]
    return jnp.mean(per_example), {"x": per_example}

  vg = jax.value_and_grad(loss, has_aux=True)
  batch = {"x": jnp.arange(8.0)}
  (value, aux), grad = maybe_jit(optax_accum.microbatch(vg, 2))(
    jnp.float32(2.0), batch
  )
  (ref_value, _), ref_grad = vg(jnp.float32(2.0), batch)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-6)
  assert aux["x"].shape == (4,)


def test_complex_gradients_keep_their_imaginary_part():
  def loss(params, batch):
    return jnp.real(jnp.sum(jnp.conj(params)[None, :] * batch["x"]))

  params = jnp.array([1 + 2j, 3 - 1j], jnp.complex64)
  batch = {"x": jnp.arange(8, dtype=jnp.float32).reshape(4, 2) * (1 - 1j)}
  full = jax.value_and_grad(loss)(params, batch)
  split = optax_accum.microbatch(jax.value_and_grad(loss), 2)(params, batch)
  assert split[1].dtype == jnp.complex64
  # The split loss is a mean of micro-batch sums: half the full sum.
  np.testing.assert_allclose(split[1], full[1] / 2, rtol=1e-6)


# ---------------------------------------------------------------------------
# 8. Strict dtype promotion: every dtype is chosen explicitly, every
#    operation is between operands of one dtype.
# ---------------------------------------------------------------------------


def _strict_loss(w, batch):
  """Runs under strict promotion for real and complex `w` alike."""
  err = batch["x"] @ w - batch["y"]
  sq = jnp.real(err * jnp.conj(err))
  mask = batch["mask"].astype(sq.dtype)
  loss = jnp.sum(mask * sq) / jnp.sum(mask)
  aux = {
    "tokens": jnp.sum(batch["mask"] > 0),  # int: summed
    "large": jnp.any(sq > 2),  # bool: or-ed
  }
  return loss, aux


def _strict_inputs(dtype):
  rng = np.random.default_rng(5)
  batch = _batch()
  w = rng.standard_normal((DIM,))
  x = np.asarray(batch["x"])
  if jnp.issubdtype(dtype, jnp.complexfloating):
    w = w + 1j * rng.standard_normal((DIM,))
    x = x * (1 - 0.5j)
  batch = dict(batch, x=jnp.asarray(x, dtype), y=batch["y"].astype(dtype))
  return jnp.asarray(w, dtype), batch


# (dtype, accumulator_dtype, tolerance of the comparison with the unsplit
# step, which computes everything in `dtype`).
STRICT_CASES = [
  (jnp.bfloat16, jnp.float32, {"rtol": 2e-2, "atol": 2e-2}),
  (jnp.bfloat16, None, {"rtol": 2e-2, "atol": 2e-2}),
  (jnp.float32, jnp.float32, TOL),
  (jnp.complex64, jnp.float32, TOL),
  (jnp.complex64, None, TOL),
]


@pytest.mark.parametrize("dtype, accumulator_dtype, tol", STRICT_CASES)
def test_runs_under_strict_dtype_promotion(
  maybe_jit, dtype, accumulator_dtype, tol
):
  w, batch = _strict_inputs(dtype)
  value_and_grad = jax.value_and_grad(_strict_loss, has_aux=True)
  grad_fn = optax_accum.microbatch(
    value_and_grad, 4, weight_fn=_tokens, accumulator_dtype=accumulator_dtype
  )
  with jax.numpy_dtype_promotion("strict"):
    out = maybe_jit(grad_fn)(w, batch)
    expected = value_and_grad(w, batch)
  _assert_trees_close(out, expected, **tol)
  assert out[1].dtype == dtype


@pytest.mark.parametrize(
  "accumulator_dtype, expected",
  [(jnp.float32, 0.06640625), (None, 0.0625)],
)
def test_bf16_accumulation_is_the_same_under_strict_promotion(
  maybe_jit, accumulator_dtype, expected
):
  def loss_fn(w, batch):
    return w * jnp.mean(batch)

  batch = jnp.array([1.0] + [2.0**-8] * 15, jnp.bfloat16)
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(loss_fn), 16, accumulator_dtype=accumulator_dtype
  )
  with jax.numpy_dtype_promotion("strict"):
    loss, grad = maybe_jit(grad_fn)(jnp.bfloat16(1.0), batch)
  assert grad.dtype == jnp.bfloat16 and float(grad) == expected
  assert loss.dtype == jnp.bfloat16 and float(loss) == 0.06640625


def test_complex_accumulator_for_complex_gradients_is_accepted(maybe_jit):
  w, batch = _strict_inputs(jnp.complex64)
  value_and_grad = jax.value_and_grad(_strict_loss, has_aux=True)
  grad_fn = optax_accum.microbatch(
    value_and_grad, 4, weight_fn=_tokens, accumulator_dtype=jnp.complex64
  )
  _assert_trees_close(
    maybe_jit(grad_fn)(w, batch), value_and_grad(w, batch), **TOL
  )


# ---------------------------------------------------------------------------
# 9. Bad input at the edges: each error names the argument and the value.
# ---------------------------------------------------------------------------


def test_num_microbatches_beyond_int32_is_rejected_at_construction():
  with pytest.raises(
    ValueError,
    match=r"`num_microbatches` must be at most 2147483647, got 2147483648",
  ):
    optax_accum.microbatch(jax.value_and_grad(_loss), 2**31)


@pytest.mark.parametrize(
  "weight, error, match",
  [
    (None, TypeError, r"`weight_fn` must return a real scalar.*got None"),
    ("3", TypeError, r"`weight_fn` must return a real scalar.*got '3'"),
    (1 + 2j, TypeError, r"`weight_fn` must return a real number.*complex64"),
    (
      jnp.ones(2),
      ValueError,
      r"`weight_fn` must return a scalar.*got shape \(2,\)",
    ),
  ],
  ids=["None", "str", "complex", "vector"],
)
def test_bad_weight_fn_output_names_weight_fn(maybe_jit, weight, error, match):
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(_loss), 4, weight_fn=lambda micro: weight
  )
  with pytest.raises(error, match=match):
    maybe_jit(grad_fn)(_params(), _batch())


@pytest.mark.parametrize("weight", [True, 3, np.float64(2.5)])
def test_bool_int_and_float_weights_are_accepted(maybe_jit, weight):
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(_loss), 4, weight_fn=lambda micro: weight
  )
  # Equal weights: the unweighted mean of the micro-batches.
  expected = optax_accum.microbatch(jax.value_and_grad(_loss), 4)
  params, batch = _params(), _full_batch()
  _assert_trees_close(
    maybe_jit(grad_fn)(params, batch), expected(params, batch), **TOL
  )


def test_complex_accumulator_for_real_gradients_is_rejected(maybe_jit):
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(_loss), 4, accumulator_dtype=jnp.complex64
  )
  with pytest.raises(
    ValueError,
    match=r"`accumulator_dtype` is complex \(complex64\) but a gradient"
    r" leaf is real \(float32\).* The leaf: grads\['w1'\]",
  ):
    maybe_jit(grad_fn)(_params(), _batch())


# ---------------------------------------------------------------------------
# 10. Flax NNX: the model as argument 0, as `nnx.value_and_grad` takes it.
# ---------------------------------------------------------------------------

NNX_MODES = {"nojit": lambda f: f, "nnx.jit": nnx.jit}


@pytest.fixture(params=list(NNX_MODES), ids=list(NNX_MODES))
def maybe_nnx_jit(request):
  return NNX_MODES[request.param]


class _Net(nnx.Module):
  """Linear -> BatchNorm -> Dropout -> Linear: state that changes per call."""

  def __init__(self, rngs, *, stateful):
    self.hidden = nnx.Linear(DIM, HIDDEN, rngs=rngs)
    self.norm = nnx.BatchNorm(HIDDEN, rngs=rngs) if stateful else None
    self.drop = nnx.Dropout(0.5, rngs=rngs) if stateful else None
    self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.hidden(x))
    if self.norm is not None:
      h = self.drop(self.norm(h))
    return self.out(h)[..., 0]


def _nnx_loss(model, batch):
  err = model(batch["x"]) - batch["y"]
  return jnp.sum(batch["mask"] * err**2) / jnp.sum(batch["mask"])


def _nnx_noisy_loss(model, batch, rngs):
  """Also draws from `rngs`, an extra argument: its count must advance."""
  noise = jax.random.normal(rngs.noise(), batch["y"].shape)
  return _nnx_loss(model, dict(batch, y=batch["y"] + noise))


def test_nnx_model_gives_the_unsplit_gradient_as_an_nnx_state(maybe_nnx_jit):
  model, batch = _Net(nnx.Rngs(0), stateful=False), _batch()
  value_and_grad = nnx.value_and_grad(_nnx_loss)
  grad_fn = optax_accum.microbatch(value_and_grad, 8, weight_fn=_tokens)
  loss, grads = maybe_nnx_jit(grad_fn)(model, batch)
  expected_loss, expected_grads = value_and_grad(model, batch)
  assert type(grads) is type(expected_grads)  # nnx.State
  _assert_trees_close((loss, grads), (expected_loss, expected_grads), **TOL)


def test_nnx_state_is_carried_as_in_calls_one_after_the_other(maybe_nnx_jit):
  """BatchNorm statistics, Dropout's and an argument's RNG counts."""
  n, batch = 4, _full_batch()
  models = [_Net(nnx.Rngs(0), stateful=True) for _ in range(2)]
  rngs = [nnx.Rngs(noise=7) for _ in range(2)]
  value_and_grad = nnx.value_and_grad(_nnx_noisy_loss)
  grad_fn = maybe_nnx_jit(optax_accum.microbatch(value_and_grad, n))
  loss, grads = grad_fn(models[0], batch, rngs[0])
  # Micro-batch i holds rows i, i + n, ...; equal weights.
  micro_batches = [
    jax.tree.map(lambda x, i=i: x[i::n], batch) for i in range(n)
  ]
  outs = [value_and_grad(models[1], micro, rngs[1]) for micro in micro_batches]
  expected = jax.tree.map(lambda *xs: sum(xs) / n, *outs)
  _assert_trees_close((loss, grads), expected, **TOL)
  for kind in (nnx.BatchStat, nnx.RngCount):
    states = [nnx.state(model, kind) for model in models]
    assert jax.tree.leaves(states[0])
    _assert_trees_close(*states, **TOL)
  assert int(rngs[0].noise.count[...]) == int(rngs[1].noise.count[...]) == n


def test_nnx_variable_added_during_the_call_is_rejected(maybe_nnx_jit):
  def loss_fn(model, batch):
    if not hasattr(model, "calls"):
      model.calls = nnx.BatchStat(jnp.zeros(()))
    return _nnx_loss(model, batch)

  grad_fn = optax_accum.microbatch(nnx.value_and_grad(loss_fn), 4)
  with pytest.raises(ValueError, match="`value_and_grad_fn` added or removed"):
    maybe_nnx_jit(grad_fn)(_Net(nnx.Rngs(0), stateful=False), _batch())


def _load_example(name):
  path = pathlib.Path(__file__).resolve().parent.parent / "examples"
  spec = importlib.util.spec_from_file_location(name, path / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_nnx_example_checks_itself_and_fails_without_weights(capsys):
  example = _load_example("nnx_microbatch")
  assert example.main(["--steps", "2"]) == 0
  assert "(ok," in capsys.readouterr().out
  # Equal weights on ragged rows are not the token mean: its check fails.
  assert example.main(["--steps", "1", "--no-weight-fn"]) == 1
  assert "MISMATCH" in capsys.readouterr().out
  with pytest.raises(SystemExit) as exit_info:
    example.main(["--help"])
  assert exit_info.value.code == 0
  assert "--num-microbatches" in capsys.readouterr().out


# ----------------------------------------------------------------------------
# A total weight with no mean (moved from tests/test_arguments.py, issue 55).
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("total", [-1.0, float("nan")], ids=["negative", "nan"])
def test_microbatch_nan_or_negative_total_weight_is_loud(total):
  grad_fn = optax_accum.microbatch(
    jax.value_and_grad(lambda p, b: jnp.mean((b["x"] * p) ** 2)),
    2,
    weight_fn=lambda micro: total / 2,
  )
  batch = {"x": jnp.arange(4.0)}
  with pytest.raises(ValueError, match=r"`weight_fn` gave .* total weight"):
    grad_fn(1.0, batch)
  value, grad = jax.jit(grad_fn)(1.0, batch)  # NaN, never silent zeros
  assert np.isnan(value) and np.isnan(grad)
  zero = optax_accum.microbatch(
    jax.value_and_grad(lambda p, b: jnp.mean((b["x"] * p) ** 2)),
    2,
    weight_fn=lambda micro: 0.0,
  )
  assert float(zero(1.0, batch)[1]) == 0.0  # all padding: zeros, documented
