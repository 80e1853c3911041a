"""`accumulate(..., axis_name="data")` under plain `jax.jit`: the unreduced
engine.

Every run is checked against one big batch on one device, for a model with
an embedding, a layer norm, a bias and per-example dropout keys, on three
layouts of 8 simulated devices: data parallel, data x tensor parallel and
FSDP. The compiled step is checked for where its collectives sit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import scaled_sgd
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_unreduced import (
  LAYOUTS,
  _example_mean,
  _init_params,
  _make_batch,
  _mesh,
  _put,
  _token_mean,
)

import optax_accum
from optax_accum import _unreduced
from optax_accum.inspect import _collectives, _hlo

K = 3
STEPS = 2
ATOL = 2e-6
PARAM_BYTES = sum(4 * p.size for p in jax.tree.leaves(_init_params()))


def _grad_fn(weighted):
  if weighted:
    return optax_accum.distributed.local_value_and_grad(
      _token_mean, has_weight=True
    )
  return optax_accum.distributed.local_value_and_grad(_example_mean)


def _micro_step(tx, grad_fn, weighted, params, state, batch, flush=False):
  value, grads = grad_fn(params, batch)
  weight = value[1] if weighted else None
  updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
  return optax.apply_updates(params, updates), state


def _big_batch(inner, batches, weighted, cycles):
  """Params after one inner step per cycle on the cycle's whole batch."""
  loss = (lambda p, b: _token_mean(p, b)[0]) if weighted else _example_mean
  params = _init_params()
  state = inner.init(params)
  for cycle in cycles:
    big = jax.tree.map(
      lambda *xs: jnp.concatenate(xs), *[batches[i] for i in cycle]
    )
    updates, state = inner.update(jax.grad(loss)(params, big), state, params)
    params = optax.apply_updates(params, updates)
  return params


def _close(actual, expected, atol=ATOL):
  for key in expected:
    np.testing.assert_allclose(
      np.asarray(actual[key]),
      np.asarray(expected[key]),
      atol=atol,
      err_msg=key,
    )


def _dims(spec):
  """A spec's per-dimension entries, trailing ``None``s dropped."""
  parts = list(spec)
  while parts and parts[-1] is None:
    parts.pop()
  return tuple(parts)


def _same_on_every_device(tree):
  """Every device holds the same copy of each replicated element."""
  for leaf in jax.tree.leaves(tree):
    shards = {}
    for shard in leaf.addressable_shards:
      key = str(shard.index)
      data = np.asarray(shard.data)
      if key in shards:
        np.testing.assert_array_equal(data, shards[key])
      shards[key] = data


def _train(layout, weighted, batches, tx, *, use_jit=True, flushes=None):
  mesh = _mesh(layout)
  grad_fn = jax.jit(_grad_fn(weighted))
  step = functools.partial(_micro_step, tx, grad_fn, weighted)
  if use_jit:
    step = jax.jit(step)
  flushes = flushes or [False] * len(batches)
  with jax.set_mesh(mesh):
    params, _ = _put(mesh, layout, _init_params(), batches[0])
    state = tx.init(params)
    for batch, flush in zip(batches, flushes, strict=True):
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      params, state = step(params, state, batch, flush)
  return params, state


# Eager only on the data-parallel layout: compiling is the slow part.
CASES = [(layout, True) for layout in LAYOUTS] + [("dp", False)]


@pytest.mark.parametrize(("layout", "use_jit"), CASES)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "tokens"])
def test_equals_the_big_batch(layout, weighted, use_jit):
  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, K, axis_name="data")
  batches = [_make_batch(i) for i in range(STEPS * K)]
  params, state = _train(layout, weighted, batches, tx, use_jit=use_jit)
  cycles = [range(s * K, (s + 1) * K) for s in range(STEPS)]
  _close(params, _big_batch(inner, batches, weighted, cycles))
  assert int(state.step) == STEPS
  assert _unreduced.is_unreduced(state.acc_grads["w"])
  # Params keep their layout (tensor parallel, FSDP) through the steps.
  specs = LAYOUTS[layout][2]
  for key, p in params.items():
    assert _dims(jax.typeof(p).sharding.spec) == _dims(specs.get(key, P())), key
  _same_on_every_device(params)


def _static_step(tx, grad_fn, weighted, params, state, batch, emit):
  """One micro-batch of the static cycle (issue 20): the host says which
  call ends it."""
  value, grads = grad_fn(params, batch)
  weight = value[1] if weighted else None
  updates, state = tx.update(grads, state, params, weight=weight, emit=emit)
  return optax_accum.apply_updates(params, updates, state), state


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "tokens"])
def test_static_cycle_equals_the_big_batch(layout, weighted):
  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, K, axis_name="data")
  batches = [_make_batch(i) for i in range(STEPS * K)]
  mesh = _mesh(layout)
  step = jax.jit(
    functools.partial(_static_step, tx, jax.jit(_grad_fn(weighted)), weighted),
    static_argnames="emit",
  )
  with jax.set_mesh(mesh):
    params, _ = _put(mesh, layout, _init_params(), batches[0])
    state = tx.init(params)
    for i, batch in enumerate(batches):
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      params, state = step(params, state, batch, emit=i % K == K - 1)
  cycles = [range(s * K, (s + 1) * K) for s in range(STEPS)]
  _close(params, _big_batch(inner, batches, weighted, cycles))
  assert int(state.step) == STEPS and int(state.micro_step) == 0
  _same_on_every_device(params)


@pytest.mark.parametrize("emit", [None, True, False])
def test_an_eager_update_takes_emit_and_extra_arguments_as_jit_does(emit):
  """Called eagerly, an update of unreduced gradients runs jitted inside;
  `emit=` (without `flush`) and the inner optimizer's extra arguments
  reach it as they reach a jitted call (issue 55: emit= raised there,
  naming a flush never passed)."""
  tx = optax_accum.accumulate(scaled_sgd(), K, axis_name="data")
  mesh = _mesh("dp")
  loss = lambda p, x: jnp.mean(x @ p["w"])  # noqa: E731
  grad_fn = jax.jit(optax_accum.distributed.local_value_and_grad(loss))
  options = {"value": 10.0} | ({} if emit is None else {"emit": emit})

  def call(g, s, p):
    return tx.update(g, s, p, **options)

  with jax.set_mesh(mesh):
    params = jax.device_put({"w": jnp.ones(3)}, NamedSharding(mesh, P()))
    x = jax.device_put(
      jnp.arange(24.0).reshape(8, 3), NamedSharding(mesh, P("data"))
    )
    _, grads = grad_fn(params, x)
    eager, eager_state = call(grads, tx.init(params), params)
    jitted, jit_state = jax.jit(call)(grads, tx.init(params), params)
  np.testing.assert_array_equal(np.asarray(eager["w"]), jitted["w"])
  assert bool(optax_accum.has_updated(eager_state)) == bool(emit)
  assert bool(optax_accum.has_updated(jit_state)) == bool(emit)
  if emit:  # the cycle of one, scaled by value=10
    want = -10.0 * jnp.mean(jnp.arange(24.0).reshape(8, 3), axis=0)
    np.testing.assert_allclose(np.asarray(eager["w"]), want, rtol=1e-6)


def test_weight_computed_from_the_sharded_batch_is_global():
  """A token count taken under plain jit from the sharded batch is the
  micro-batch's global count: the same weight the helper returns."""
  inner = optax.sgd(0.5)
  tx = optax_accum.accumulate(inner, K, axis_name="data")
  grad_fn = optax_accum.distributed.local_value_and_grad(
    _token_mean, has_weight=True
  )

  def step(params, state, batch):
    _, grads = grad_fn(params, batch)
    weight = batch["mask"].sum()  # global, under plain jit
    updates, state = tx.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state

  batches = [_make_batch(10 + i) for i in range(K)]
  mesh = _mesh("dp")
  with jax.set_mesh(mesh):
    params, _ = _put(mesh, "dp", _init_params(), batches[0])
    state = tx.init(params)
    for batch in batches:
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      params, state = jax.jit(step)(params, state, batch)
  _close(params, _big_batch(inner, batches, True, [range(K)]))


def test_update_without_params_reduces_to_the_accumulator_layout():
  tx = optax_accum.accumulate(optax.sgd(1.0), 2, axis_name="data")
  grad_fn = _grad_fn(False)
  batches = [_make_batch(i) for i in range(2)]
  mesh = _mesh("tp")
  with jax.set_mesh(mesh):
    params, _ = _put(mesh, "tp", _init_params(), batches[0])
    state = tx.init(params)

    @jax.jit
    def step(state, batch):
      _, grads = grad_fn(params, batch)
      return tx.update(grads, state)

    for batch in batches:
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      updates, state = step(state, batch)
  expected = _big_batch(optax.sgd(1.0), batches, False, [range(2)])
  applied = optax.apply_updates(_init_params(), updates)
  _close(applied, expected)
  assert jax.typeof(updates["w"]).sharding.spec == P(None, "model")


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_gives_unreduced_accumulators(layout, use_jit):
  tx = optax_accum.accumulate(optax.adam(1e-3), 4, axis_name="data")
  mesh = _mesh(layout)
  specs = LAYOUTS[layout][2]
  with jax.set_mesh(mesh):
    params, _ = _put(mesh, layout, _init_params(), _make_batch(0))
    init = jax.jit(tx.init) if use_jit else tx.init
    state = init(params)
    shardings = optax_accum.distributed.state_shardings(tx, params)
  for key, acc in state.acc_grads.items():
    spec = jax.typeof(acc).sharding.spec
    assert spec.unreduced == frozenset({"data"}), (key, spec)
    # Sharded like the param over "model"; never over "data" (FSDP holds
    # full-size partial sums).
    expected = _unreduced.unreduced_spec(params[key])
    assert spec == expected, (key, spec, expected)
    assert shardings.acc_grads[key].spec == spec, key
    # The inner state follows the params, as without accumulation.
    mu_spec = shardings.inner_state[0].mu[key].spec
    assert _dims(mu_spec) == _dims(specs.get(key, P())), key
  assert shardings.micro_step.spec == P()


def test_init_eagerly_on_placed_params_without_a_mesh_context():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  mesh = _mesh("dp")
  params = jax.device_put(_init_params(), NamedSharding(mesh, P()))
  state = tx.init(params)
  assert _unreduced.is_unreduced(state.acc_grads["emb"])


def _compiled_step(layout, every_k):
  tx = optax_accum.accumulate(optax.adam(1e-3), every_k, axis_name="data")
  grad_fn = _grad_fn(True)
  step = jax.jit(functools.partial(_micro_step, tx, grad_fn, True))
  mesh = _mesh(layout)
  with jax.set_mesh(mesh):
    params, batch = _put(mesh, layout, _init_params(), _make_batch(0))
    state = tx.init(params)
    return step.lower(params, state, batch).compile()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_parameter_sized_all_reduce_in_the_emitting_branch(layout):
  compiled = _compiled_step(layout, 4)
  ops = _collectives.collectives(compiled)
  # A gradient reduction runs across "data"; tensor parallelism's own
  # reductions run across "model" alone (told apart by their device groups,
  # as `assert_reduction_deferred(axis_name=)` does: by bytes they are not,
  # jax 0.12's 640 B activation all-reduce being as large as a leaf here).
  axes = _collectives.mesh_axes_of(
    ops, _hlo.HloModule(compiled.as_text()), compiled, "data"
  )
  reductions = [o for o in ops if o.opcode in ("all-reduce", "reduce-scatter")]
  over_data = [o for o in reductions if "data" in axes[o]]
  big = [o for o in over_data if o.bytes >= PARAM_BYTES // 4]
  # Tensor parallelism: the all-reduce covers each device's half of the
  # "model"-sharded leaves.
  expected = PARAM_BYTES // 2 if layout == "tp" else PARAM_BYTES
  assert [o.opcode for o in big] == ["all-reduce"], ops
  assert big[0].emitting and not big[0].unconditional, ops
  assert big[0].bytes >= 0.9 * expected, (big, expected)
  # Every call reduces only the helper's loss-and-weight scalars across
  # "data". (Tensor parallelism gathers activations over "model" and, from
  # jax 0.12, all-reduces them there; FSDP gathers the params for the
  # forward pass: gathers, not gradient reductions.)
  every_call = [o for o in over_data if o.unconditional]
  assert every_call and all(o.bytes <= 8 for o in every_call), ops
  others = [o for o in reductions if o not in over_data]
  assert all(axes[o] == ("model",) and layout == "tp" for o in others), ops
  assert (
    _collectives.assert_reduction_deferred(
      compiled, min_bytes=PARAM_BYTES // 4, axis_name="data"
    )
    == ops
  )


def test_deferral_check_fails_on_a_per_micro_step_reduction():
  """The same model, gradients reduced on each micro-step (what a step
  without `axis_name` does, silently)."""
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)
  grad_fn = _grad_fn(False)

  def step(params, state, batch):
    grads = _unreduced.reduce(grad_fn(params, batch)[1])
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  mesh = _mesh("dp")
  with jax.set_mesh(mesh):
    params, batch = _put(mesh, "dp", _init_params(), _make_batch(0))
    state = tx.init(params)
    compiled = jax.jit(step).lower(params, state, batch).compile()
  with pytest.raises(AssertionError, match="all-reduce"):
    _collectives.assert_reduction_deferred(compiled, min_bytes=PARAM_BYTES // 4)


def _nan_on_device(batch, device):
  """A NaN target in one token of one device's share of the batch."""
  rows = batch["tgt"].shape[0] // 8
  mask = batch["mask"].at[device * rows].set(1.0)
  tgt = batch["tgt"].at[device * rows, 0, 0].set(jnp.nan)
  return dict(batch, tgt=tgt, mask=mask.at[device * rows, 0].set(1.0))


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
def test_nan_on_one_device_is_skipped_everywhere(use_jit):
  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, K, axis_name="data", skip_nonfinite=True)
  clean = [_make_batch(20 + i) for i in range(K)]
  batches = clean[:1] + [_nan_on_device(_make_batch(99), 5)] + clean[1:]
  params, state = _train("dp", True, batches, tx, use_jit=use_jit)
  assert int(state.num_skipped) == 1
  assert int(state.step) == 1
  _close(params, _big_batch(inner, clean, True, [range(K)]))
  _same_on_every_device((params, state.inner_state, state.step))


def test_nan_on_one_device_reaches_inner_without_skipping():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  batches = [_make_batch(1), _nan_on_device(_make_batch(2), 3)]
  params, _ = _train("dp", True, batches, tx)
  assert all(np.isnan(np.asarray(p)).any() for p in jax.tree.leaves(params))


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
def test_flush_raised_by_one_device_ends_the_cycle(use_jit):
  """`flush` computed from a per-device flag (here device 6's) is one
  global scalar under plain jit: every device ends the cycle."""
  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, 4, axis_name="data")
  mesh = _mesh("dp")
  flags = np.zeros(8, bool)
  flags[6] = True
  with jax.set_mesh(mesh):
    # A reduction of the sharded flags, as a step would compute it.
    flush = jnp.any(jax.device_put(flags, NamedSharding(mesh, P("data"))))
  batches = [_make_batch(30 + i) for i in range(5)]
  flushes = [False, flush, False, False, False]  # a cycle of 2, then 3 held
  params, state = _train(
    "dp", True, batches, tx, use_jit=use_jit, flushes=flushes
  )
  expected = _big_batch(inner, batches, True, [range(2)])
  _close(params, expected)
  assert int(state.step) == 1 and int(state.micro_step) == 3
  _same_on_every_device((params, state.micro_step))


def test_a_cycle_without_tokens_emits_nothing():
  tx = optax_accum.accumulate(optax.adam(1e-2), 2, axis_name="data")
  empty = [_make_batch(i, empty_rows=16) for i in range(2)]
  params, state = _train("dp", True, empty, tx)
  assert int(state.step) == 0 and not bool(state.emitted)
  _close(params, _init_params(), atol=0)


# ----------------------------------------------------------------------------
# Errors.
# ----------------------------------------------------------------------------


def _unreduced_grads(mesh):
  with jax.set_mesh(mesh):
    params, batch = _put(mesh, "dp", _init_params(), _make_batch(0))
    return params, jax.jit(_grad_fn(False))(params, batch)[1]


def test_error_when_the_axis_is_not_explicit():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  mesh = _mesh("dp", AxisType.Auto)
  params = jax.device_put(_init_params(), NamedSharding(mesh, P()))
  state = tx.init(params)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="axis_name.*Explicit.*shard_map"):
      jax.jit(tx.update)(params, state, params)


def test_error_without_a_mesh():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  params = _init_params()
  state = tx.init(params)
  with pytest.raises(ValueError, match="needs a mesh.*shard_map"):
    jax.jit(tx.update)(params, state, params)


def test_error_when_gradients_are_not_unreduced():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  mesh = _mesh("dp")
  with jax.set_mesh(mesh):
    params, batch = _put(mesh, "dp", _init_params(), _make_batch(0))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)  # replicated, reduced
    with pytest.raises(ValueError, match="`updates` must be typed unreduced"):
      jax.jit(tx.update)(grads, state, params)


def test_error_when_the_state_was_made_off_the_mesh():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  mesh = _mesh("dp")
  state = tx.init(_init_params())  # host params, no mesh: plain zeros
  params, grads = _unreduced_grads(mesh)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="`state` holds an accumulator"):
      jax.jit(tx.update)(grads, state, params)


@pytest.mark.parametrize("every_k", [1, 3])
def test_error_when_unreduced_gradients_meet_no_axis_name(every_k):
  """The likely slip: the helper's gradients, `axis_name` forgotten (k = 1
  included, where `update` would otherwise hand them to `inner` as is)."""
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k)
  mesh = _mesh("dp")
  params, grads = _unreduced_grads(mesh)
  with jax.set_mesh(mesh):
    state = tx.init(params)
    with pytest.raises(ValueError, match="build it with `axis_name='data'`"):
      jax.jit(tx.update)(grads, state, params)


def test_error_when_jax_lacks_the_feature(monkeypatch):
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  mesh = _mesh("dp")
  params, grads = _unreduced_grads(mesh)
  with jax.set_mesh(mesh):
    state = tx.init(params)
    monkeypatch.setattr(_unreduced, "is_supported", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs jax>=0\.10\.2"):
      jax.jit(tx.update)(grads, state, params)


def test_fsdp_deferral_holds_a_full_size_accumulator_per_device():
  """The memory cost of deferring under FSDP, from the compiled steps: each
  device holds whole partial sums of the params sharded over "data",
  instead of its 1/8 slice when every micro-batch is reduce-scattered."""
  sharded = list(LAYOUTS["fsdp"][2])
  sharded_bytes = sum(4 * _init_params()[k].size for k in sharded)

  def argument_bytes(axis_type, axis_name):
    tx = optax_accum.accumulate(optax.sgd(0.1), 4, axis_name=axis_name)
    if axis_name:
      grad_fn = _grad_fn(True)
    else:  # jax.grad reduces (reduce-scatters) every micro-batch itself.
      grad_fn = jax.value_and_grad(_token_mean, has_aux=True)
    step = jax.jit(functools.partial(_micro_step, tx, grad_fn, True))
    mesh = _mesh("fsdp", axis_type)
    with jax.set_mesh(mesh):
      params, batch = _put(mesh, "fsdp", _init_params(), _make_batch(0))
      state = jax.jit(
        tx.init,
        out_shardings=optax_accum.distributed.state_shardings(tx, params),
      )(params)
      compiled = step.lower(params, state, batch).compile()
    return compiled.memory_analysis().argument_size_in_bytes

  deferred = argument_bytes(AxisType.Explicit, "data")
  per_micro_batch = argument_bytes(AxisType.Auto, None)
  print(f"argument bytes per device: {deferred} vs {per_micro_batch}")
  assert deferred - per_micro_batch == pytest.approx(
    sharded_bytes * 7 / 8, rel=0.05
  )


def test_gradients_made_unreduced_by_the_user_are_accepted():
  """A matmul-only model: `jax.grad` with respect to params resharded to
  `reduced` over "data" gives unreduced gradients, no helper needed."""
  inner = optax.sgd(0.1, momentum=0.9)
  tx = optax_accum.accumulate(inner, 2, axis_name="data")
  w0 = jax.random.normal(jax.random.key(0), (8, 3))
  xs = [jax.random.normal(jax.random.key(i), (16, 8)) for i in (1, 2)]

  def loss(w, x):
    return jnp.mean((x @ w) ** 2)

  @jax.jit
  def step(w, state, x):
    grads = jax.grad(loss)(jax.reshard(w, P(reduced={"data"})), x)
    updates, state = tx.update(grads, state, w)
    return optax.apply_updates(w, updates), state

  mesh = _mesh("dp")
  with jax.set_mesh(mesh):
    w = jax.device_put(w0, NamedSharding(mesh, P()))
    state = tx.init(w)
    for x in xs:
      w, state = step(
        w, state, jax.device_put(x, NamedSharding(mesh, P("data")))
      )
  big = jnp.concatenate(xs)
  updates, _ = inner.update(jax.grad(loss)(w0, big), inner.init(w0), w0)
  np.testing.assert_allclose(
    np.asarray(w), np.asarray(w0 + updates), rtol=1e-5, atol=1e-6
  )


# ----------------------------------------------------------------------------
# Checkpoints.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_a_checkpoint_mid_cycle_resumes_the_run(layout, tmp_path):
  """Saved with `reduce_state` one micro-batch into the second cycle,
  restored with `jax.device_put` to `state_shardings`: the run goes on as
  if never stopped, up to float rounding."""
  import orbax.checkpoint as ocp

  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, K, axis_name="data")
  grad_fn = jax.jit(_grad_fn(True))
  step = jax.jit(functools.partial(_micro_step, tx, grad_fn, True))
  batches = [_make_batch(60 + i) for i in range(2 * K)]
  mesh = _mesh(layout)
  data = NamedSharding(mesh, P("data"))
  with jax.set_mesh(mesh):
    params, _ = _put(mesh, layout, _init_params(), batches[0])
    state = tx.init(params)
    for batch in batches[: K + 1]:
      params, state = step(params, state, jax.device_put(batch, data))
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(
        tmp_path / "state", optax_accum.distributed.reduce_state(state)
      )
      checkpointer.wait_until_finished()
      restored = checkpointer.restore(
        tmp_path / "state",
        optax_accum.distributed.reduce_state(tx.init(params)),
      )
    restored = jax.device_put(
      restored, optax_accum.distributed.state_shardings(tx, params)
    )
    assert _unreduced.is_unreduced(restored.acc_grads["w"])
    assert int(restored.micro_step) == 1
    resumed = params
    for batch in batches[K + 1 :]:
      batch = jax.device_put(batch, data)
      params, state = step(params, state, batch)
      resumed, restored = step(resumed, restored, batch)
  _close(resumed, params)
  _close(resumed, _big_batch(inner, batches, True, [range(K), range(K, 2 * K)]))
  assert int(restored.step) == 2


def test_reduce_state_under_jit_on_shapes_and_elsewhere():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  mesh = _mesh("tp")
  with jax.set_mesh(mesh):
    params, _ = _put(mesh, "tp", _init_params(), _make_batch(0))
    state = tx.init(params)
    traced = jax.jit(optax_accum.distributed.reduce_state)(state)
    shapes = optax_accum.distributed.reduce_state(
      jax.eval_shape(tx.init, params)
    )
  for reduced in (traced.acc_grads, shapes.acc_grads):
    for key, leaf in reduced.items():
      assert not _unreduced.is_unreduced(leaf), key
      assert _dims(leaf.sharding.spec) == _dims(
        jax.typeof(params[key]).sharding.spec
      )
  local = optax_accum.accumulate(optax.sgd(0.1), 2).init(_init_params())
  for a, b in zip(
    jax.tree.leaves(optax_accum.distributed.reduce_state(local)),
    jax.tree.leaves(local),
    strict=True,
  ):
    assert a is b
