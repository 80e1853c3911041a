"""Unreduced gradients under plain jit: `local_value_and_grad` and helpers.

Every gradient below is checked after its one reduction against the gradient
of the whole batch on one device, for a model with an embedding, a layer
norm, a bias and per-example dropout keys, on three layouts of 8 simulated
devices: data parallel, data x tensor parallel, and FSDP.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _unreduced, _versions, distributed
from optax_accum.distributed import _local_grad
from optax_accum.inspect import _collectives, _hlo

VOCAB, DIM, OUT = 16, 8, 4
BATCH, SEQ = 16, 5
ATOL = 1e-6  # float32 sums in a different order

LAYOUTS = {
  "dp": ((8,), ("data",), {}),
  "tp": (
    (4, 2),
    ("data", "model"),
    {"w": P(None, "model"), "b": P("model")},
  ),
  "fsdp": (
    (8,),
    ("data",),
    {"emb": P("data"), "w": P("data"), "ln_scale": P("data")},
  ),
}


def _mesh(layout, axis_type=AxisType.Explicit):
  shape, names, _ = LAYOUTS[layout]
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def _init_params():
  k = jax.random.split(jax.random.key(0), 4)
  return {
    "emb": jax.random.normal(k[0], (VOCAB, DIM)),
    "w": 0.3 * jax.random.normal(k[1], (DIM, OUT)),
    "b": 0.1 * jax.random.normal(k[2], (OUT,)),
    "ln_scale": 1.0 + 0.1 * jax.random.normal(k[3], (DIM,)),
    "ln_bias": jnp.zeros((DIM,)),
  }


def _make_batch(seed, empty_rows=0):
  k = jax.random.split(jax.random.key(seed), 4)
  mask = (jax.random.uniform(k[2], (BATCH, SEQ)) > 0.3).astype(jnp.float32)
  # The first `empty_rows` examples are all padding (a whole device's share
  # when empty_rows = BATCH / data devices).
  mask = mask.at[:empty_rows].set(0.0)
  return {
    "tok": jax.random.randint(k[0], (BATCH, SEQ), 0, VOCAB),
    "tgt": jax.random.normal(k[1], (BATCH, SEQ, OUT)),
    "mask": mask,
    "dropout": jax.random.split(k[3], BATCH),  # one key per example
  }


def _loss_sum(params, batch):
  """Sum of the per-token losses and the number of tokens."""
  x = params["emb"][batch["tok"]]
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  x = (x - mu) / jnp.sqrt(var + 1e-5) * params["ln_scale"][None, None]
  x = x + params["ln_bias"][None, None]
  keep = jax.vmap(lambda key: jax.random.bernoulli(key, 0.8, (SEQ, DIM)))(
    batch["dropout"]
  )
  x = jnp.where(keep, x / 0.8, 0.0)
  y = jnp.tanh(x @ params["w"] + params["b"][None, None])
  per_token = ((y - batch["tgt"]) ** 2).sum(-1)
  return (per_token * batch["mask"]).sum(), batch["mask"].sum()


def _token_mean(params, batch):
  total, count = _loss_sum(params, batch)
  return total / count, count


def _example_mean(params, batch):
  total, _ = _loss_sum(params, batch)
  return total / batch["tok"].shape[0]


def _put(mesh, layout, params, batch):
  specs = LAYOUTS[layout][2]
  params = {
    k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P())))
    for k, v in params.items()
  }
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  return params, batch


def _reduce_like(grads, params):
  """The one all-reduce, back to each param's layout (FSDP: scattered)."""
  return _unreduced.reduce(
    grads, out_specs=jax.tree.map(lambda p: jax.typeof(p).sharding.spec, params)
  )


def _close(actual, expected, atol=ATOL):
  for key in expected:
    np.testing.assert_allclose(
      np.asarray(actual[key]), expected[key], atol=atol, err_msg=key
    )


# Eager calls only on the data-parallel layout: compiling is the slow part.
CASES = [(layout, True) for layout in LAYOUTS] + [("dp", False)]


@pytest.mark.parametrize(("layout", "use_jit"), CASES)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "tokens"])
def test_reduced_gradient_is_the_big_batch_gradient(layout, weighted, use_jit):
  params, batch = _init_params(), _make_batch(1)
  loss = _token_mean if weighted else _example_mean
  expected_value, expected = jax.value_and_grad(loss, has_aux=weighted)(
    params, batch
  )
  mesh = _mesh(layout)
  with jax.set_mesh(mesh):
    sharded_params, sharded_batch = _put(mesh, layout, params, batch)
    fn = distributed.local_value_and_grad(loss, has_weight=weighted)
    fn = jax.jit(fn) if use_jit else fn
    value, grads = fn(sharded_params, sharded_batch)
    for g, p in zip(
      jax.tree.leaves(grads), jax.tree.leaves(sharded_params), strict=True
    ):
      assert _unreduced.is_unreduced(g, "data"), jax.typeof(g)
      # Over the other mesh axes the gradient keeps its param's layout.
      if layout == "tp":
        pad = (None,) * p.ndim
        grad_parts = (jax.typeof(g).sharding.spec.partitions + pad)[: p.ndim]
        param_parts = (jax.typeof(p).sharding.spec.partitions + pad)[: p.ndim]
        assert grad_parts == param_parts, (jax.typeof(g), jax.typeof(p))
    reduced = jax.jit(_reduce_like)(grads, sharded_params)
  _close(reduced, expected)
  if weighted:
    loss_value, weight = value
    assert float(weight) == float(expected_value[1])
    np.testing.assert_allclose(float(loss_value), expected_value[0], rtol=1e-6)
  else:
    np.testing.assert_allclose(float(value), expected_value, rtol=1e-6)


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
def test_a_device_with_no_tokens_contributes_nothing(use_jit):
  # Device 0's two examples are all padding: its mean is 0/0 = NaN.
  params, batch = _init_params(), _make_batch(2, empty_rows=BATCH // 8)
  (_, count), expected = jax.value_and_grad(_token_mean, has_aux=True)(
    params, batch
  )
  mesh = _mesh("dp")
  with jax.set_mesh(mesh):
    sharded_params, sharded_batch = _put(mesh, "dp", params, batch)
    fn = distributed.local_value_and_grad(_token_mean, has_weight=True)
    fn = jax.jit(fn) if use_jit else fn
    (loss, weight), grads = fn(sharded_params, sharded_batch)
    reduced = jax.jit(_reduce_like)(grads, sharded_params)
  assert np.isfinite(float(loss)) and float(weight) == float(count)
  _close(reduced, expected)


def test_aux_comes_back_per_device():
  def loss(params, batch):
    mean = _example_mean(params, batch)
    return mean, {"local": mean}

  mesh = _mesh("dp")
  with jax.set_mesh(mesh):
    params, batch = _put(mesh, "dp", _init_params(), _make_batch(3))
    (value, aux), _ = jax.jit(
      distributed.local_value_and_grad(loss, has_aux=True)
    )(params, batch)
  assert aux["local"].shape == (8,)
  np.testing.assert_allclose(np.mean(aux["local"]), float(value), rtol=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_micro_step_compiles_without_parameter_sized_all_reduce(layout):
  mesh = _mesh(layout)
  with jax.set_mesh(mesh):
    params, batch = _put(mesh, layout, _init_params(), _make_batch(1))
    fn = jax.jit(distributed.local_value_and_grad(_token_mean, has_weight=True))
    compiled = fn.lower(params, batch).compile()
    micro = _collectives.collectives(compiled)
    axes = _collectives.mesh_axes_of(
      micro, _hlo.HloModule(compiled.as_text()), compiled, "data", mesh
    )
    grads = fn(params, batch)[1]
    reduce_ops = _collectives.collectives(jax.jit(_reduce_like), grads, params)
  param_bytes = sum(4 * p.size for p in jax.tree.leaves(_init_params()))
  # The loss and weight travel together: one all-reduce of two scalars
  # across "data", and no other reduction across it. Tensor parallelism adds
  # its own activation all-reduce, across "model" alone (80 B on jax 0.10.2,
  # 720 B on jax 0.12: told apart by its device groups, not its bytes).
  reductions = [c for c in micro if c.opcode in _collectives.REDUCTION_OPCODES]
  over_data = [c for c in reductions if "data" in axes[c]]
  assert [(c.opcode, c.bytes) for c in over_data] == [("all-reduce", 8)], micro
  others = [c for c in reductions if c not in over_data]
  assert all(axes[c] == ("model",) and layout == "tp" for c in others), micro
  assert not any(c.opcode == "reduce-scatter" for c in micro), micro
  # The reduction is the single parameter-sized collective (full size on
  # every device: the FSDP accumulator is not sharded over "data").
  assert len(reduce_ops) == 1, reduce_ops
  expected_bytes = param_bytes // (2 if layout == "tp" else 1)
  assert reduce_ops[0].bytes >= expected_bytes * 0.9, (reduce_ops, param_bytes)


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_unreduced_zeros_like(layout, use_jit):
  mesh = _mesh(layout)
  with jax.set_mesh(mesh):
    params, _ = _put(mesh, layout, _init_params(), _make_batch(1))
    make = (
      jax.jit(_unreduced.unreduced_zeros_like)
      if use_jit
      else (_unreduced.unreduced_zeros_like)
    )
    zeros = jax.tree.map(make, params)
    for z, p in zip(
      jax.tree.leaves(zeros), jax.tree.leaves(params), strict=True
    ):
      assert _unreduced.is_unreduced(z)
      assert z.shape == p.shape and z.dtype == p.dtype
    reduced = jax.jit(_reduce_like)(zeros, params)
  for r in jax.tree.leaves(reduced):
    np.testing.assert_array_equal(np.asarray(r), 0.0)


def test_unreduced_zeros_like_without_a_mesh_context():
  mesh = _mesh("tp")
  params, _ = _put(mesh, "tp", _init_params(), _make_batch(1))
  zeros = _unreduced.unreduced_zeros_like(params["w"])
  assert str(jax.typeof(zeros)) == "float32[8,4@model]{U:data}"


def _per_device(mesh, rows):
  """An array unreduced over "data" whose device d holds rows[d]."""
  stacked = jax.device_put(
    jnp.asarray(rows, jnp.float32), NamedSharding(mesh, P("data"))
  )
  return _local_grad.from_per_device(stacked)


def test_where_scale_and_all_finite():
  mesh = _mesh("dp")
  rows = np.arange(24.0).reshape(8, 3)
  nan, inf, huge = rows.copy(), rows.copy(), np.full((8, 3), 3e38)
  nan[3, 1], inf[5, 0] = np.nan, np.inf
  with jax.set_mesh(mesh):
    u = jax.jit(_per_device, static_argnums=0)(mesh, rows)
    reduce = jax.jit(_unreduced.reduce)

    @jax.jit
    def reset_then_add(acc, g, fresh, weight):
      kept = _unreduced.where(fresh, jnp.zeros_like(acc), acc)
      return kept + _unreduced.scale(g, weight)

    np.testing.assert_array_equal(
      reduce(reset_then_add(u, u, False, 2.0)), 3 * rows.sum(0)
    )
    poisoned = jax.jit(_per_device, static_argnums=0)(mesh, nan)
    # A select: the NaN of a reset accumulator does not survive.
    np.testing.assert_array_equal(
      reduce(reset_then_add(poisoned, u, True, 2.0)), 2 * rows.sum(0)
    )
    finite = jax.jit(_unreduced.all_finite)
    put = jax.jit(_per_device, static_argnums=0)
    assert bool(finite(u))
    assert not bool(finite(put(mesh, nan)))
    assert not bool(finite(put(mesh, inf)))
    # Finite partial sums whose total overflows are finite gradients.
    assert bool(finite(put(mesh, huge)))


def test_error_when_the_axis_is_not_explicit():
  mesh = _mesh("dp", AxisType.Auto)
  with jax.set_mesh(mesh):
    params, batch = _put(mesh, "dp", _init_params(), _make_batch(1))
    fn = jax.jit(distributed.local_value_and_grad(_example_mean))
    with pytest.raises(ValueError, match=r"`axis_name`='data'.*Explicit"):
      fn(params, batch)


def test_error_without_a_mesh_or_axis():
  with pytest.raises(ValueError, match=r"`axis_name`='data' needs a mesh"):
    _unreduced.check_explicit_axis("data")
  with jax.set_mesh(_mesh("dp")):
    with pytest.raises(ValueError, match=r"`axis_name`='batch'.*lacks"):
      _unreduced.check_explicit_axis("batch")


def test_error_when_gradients_are_not_unreduced():
  mesh = _mesh("dp")
  with jax.set_mesh(mesh):
    params, batch = _put(mesh, "dp", _init_params(), _make_batch(1))
    _, grads = jax.jit(distributed.local_value_and_grad(_example_mean))(
      params, batch
    )
    _unreduced.check_unreduced(grads)  # passes
    plain = jax.jit(_reduce_like)(grads, params)  # already summed
    with pytest.raises(ValueError, match=r"`updates` must be typed unreduced"):
      _unreduced.check_unreduced(plain)
    with pytest.raises(ValueError, match=r"leaf \['b'\] has type float32\[4\]"):
      jax.jit(_unreduced.check_unreduced)(plain)


def test_error_when_jax_lacks_the_feature(monkeypatch):
  assert _unreduced.is_supported()
  monkeypatch.delattr(jax, "reshard")
  assert not _unreduced.is_supported()
  with pytest.raises(RuntimeError, match=r"needs jax>=0\.10\.2 \(installed"):
    _unreduced.check_explicit_axis("data")


def test_error_names_the_version_on_an_older_jax(monkeypatch):
  # jax 0.8.2 to 0.10.1 have every name but not every rule (select_n).
  monkeypatch.setattr(jax, "__version__", "0.10.1")
  assert not _unreduced.is_supported()
  with pytest.raises(
    RuntimeError,
    match=r"^Deferred reduction under plain `jax.jit` .* needs"
    r" jax>=0\.10\.2 \(installed 0\.10\.1\)",
  ):
    _unreduced.check_explicit_axis("data")


def test_user_made_unreduced_gradients_are_accepted():
  # A matmul-only model: grad w.r.t. params cast to `reduced` is unreduced.
  mesh = _mesh("dp")
  w = jax.random.normal(jax.random.key(0), (DIM, OUT))
  x = jax.random.normal(jax.random.key(1), (BATCH, DIM))
  expected = jax.grad(lambda w: jnp.sum(x @ w))(w)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))

    @jax.jit
    def grad(w, x):
      w = jax.reshard(w, P(reduced={"data"}))
      return jax.grad(lambda w: jnp.sum(x @ w))(w)

    g = grad(w, xs)
    _unreduced.check_unreduced(g)
    np.testing.assert_allclose(
      np.asarray(jax.jit(_unreduced.reduce)(g)), expected, rtol=1e-5
    )


def test_in_specs_for_shared_arguments():
  # A per-step scale every device gets whole, next to the split batch.
  def loss(params, batch, factor):
    return factor * _example_mean(params, batch)

  params, batch = _init_params(), _make_batch(4)
  expected = jax.grad(loss)(params, batch, 3.0)
  mesh = _mesh("dp")
  with jax.set_mesh(mesh):
    sp, sb = _put(mesh, "dp", params, batch)
    fn = distributed.local_value_and_grad(loss, in_specs=(P("data"), P()))
    _, grads = jax.jit(fn)(sp, sb, jnp.float32(3.0))
    reduced = jax.jit(_reduce_like)(grads, sp)
  _close(reduced, expected, atol=3 * ATOL)
  with pytest.raises(ValueError, match=r"`in_specs` must have one entry"):
    with jax.set_mesh(mesh):
      distributed.local_value_and_grad(loss, in_specs=(P("data"),))(sp, sb, 3.0)


# jax 0.12 lifted the restriction below (seen on 0.12.0.1; 0.11 untested).
PARTIAL_MANUAL_UNREDUCED = _versions.jax_at_least("0.12")


def test_pcast_is_what_full_manual_shard_map_allows():
  # Documents the JAX behaviour that shaped `from_per_device`: up to jax
  # 0.10, unreduced out_specs need full manual mode, so a mesh with a
  # "model" axis cannot use `lax.pcast(..., to="unreduced")` in a data-only
  # shard_map. jax 0.12 allows it (`from_per_device`, a contraction with
  # ones, works on both and stays).
  mesh = _mesh("tp")
  rows = jnp.arange(12.0).reshape(4, 3)
  with jax.set_mesh(mesh):
    x = jax.device_put(rows, NamedSharding(mesh, P("data")))
    fn = jax.shard_map(
      lambda b: lax.pcast(b[0], "data", to="unreduced"),
      in_specs=P("data"),
      out_specs=P(unreduced={"data"}),
      axis_names={"data"},
    )
    if not PARTIAL_MANUAL_UNREDUCED:
      with pytest.raises(NotImplementedError, match="full manual mode"):
        jax.jit(fn)(x)
      return
    unreduced = jax.jit(fn)(x)
    assert _unreduced.is_unreduced(unreduced, "data"), jax.typeof(unreduced)
    total = jax.jit(_unreduced.reduce)(unreduced)
  np.testing.assert_array_equal(np.asarray(total), rows.sum(0))
