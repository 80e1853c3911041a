"""HSDP under plain jit: params sharded over ``"fsdp"``, deferred over
``"replica"`` (issue 21).

On 8 simulated CPU devices as an explicit ``("replica", "fsdp") = (2, 4)``
mesh, ``local_value_and_grad(loss, axis_name="replica")`` reduce-scatters
each micro-batch's gradient over ``"fsdp"`` (FSDP needs that anyway) and
leaves it unreduced over ``"replica"``; ``accumulate(inner, k,
axis_name="replica")`` then holds one shard per device and all-reduces it
across replicas once per optimizer step. Checked here: the run equals one
big batch (plain and token-weighted), the accumulator's bytes per device,
the compiled collectives (which axis each reduction spans, in which
branch), every option against the same run with replicated params, and a
checkpoint taken mid-cycle.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _control, _unreduced
from optax_accum.inspect import _groups

REPLICAS, FSDP = 2, 4
ROWS = 2  # examples per device and micro-batch
ATOL = 2e-6
SPECS = {"w1": P("fsdp", None), "w2": P(None, "fsdp"), "b": P()}
BATCH = P(("replica", "fsdp"))


def _mesh():
  return jax.make_mesh(
    (REPLICAS, FSDP), ("replica", "fsdp"), axis_types=(AxisType.Explicit,) * 2
  )


def _init_params(width=16, out=8):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {
    "w1": jax.random.normal(k1, (width, width)) / width**0.5,
    "w2": jax.random.normal(k2, (width, out)) / width**0.5,
    "b": 0.1 * jax.random.normal(k3, (width,)),
  }


def _make_batch(seed, width=16, out=8, rows=ROWS * REPLICAS * FSDP):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {
    "x": jax.random.normal(k1, (rows, width)),
    "y": jax.random.normal(k2, (rows, out)),
    "mask": (jax.random.uniform(k3, (rows,)) > 0.3).astype(jnp.float32),
  }


def _gathered(params):
  """FSDP's all-gather of the params before they are used (under a mesh)."""
  if jax.sharding.get_abstract_mesh().empty:
    return params
  return jax.tree.map(lambda w: jax.sharding.reshard(w, P()), params)


def _per_example(params, batch):
  params = _gathered(params)
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b"][None])
  return jnp.sum((h @ params["w2"] - batch["y"]) ** 2, axis=-1)


def _example_mean(params, batch):
  return jnp.mean(_per_example(params, batch))


def _token_mean(params, batch):
  """Mean over the rows the mask keeps, and their number."""
  tokens = batch["mask"].sum()
  loss = jnp.sum(_per_example(params, batch) * batch["mask"])
  return loss / jnp.maximum(tokens, 1.0), tokens


def _put_params(mesh, params, specs=SPECS):
  return {
    key: jax.device_put(value, NamedSharding(mesh, specs[key]))
    for key, value in params.items()
  }


def _train(
  tx,
  batches,
  *,
  weighted=False,
  specs=SPECS,
  use_jit=True,
  noise=False,
  flushes=None,
):
  """One micro-batch per call under the HSDP mesh (`specs` lay out the
  params); `noise`: the tx tracks the noise scale."""
  loss = _token_mean if weighted else _example_mean
  grad_fn = optax_accum.distributed.local_value_and_grad(
    loss, axis_name="replica", has_weight=weighted, noise_stats=noise
  )

  def step(params, state, batch, flush):
    value, grads, *stats = grad_fn(params, batch)
    extra = {"noise_stats": stats[0]} if stats else {}
    weight = value[1] if weighted else None
    updates, state = tx.update(
      grads, state, params, weight=weight, flush=flush, **extra
    )
    return optax.apply_updates(params, updates), state

  step = jax.jit(step) if use_jit else step
  flushes = flushes or [False] * len(batches)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    params = _put_params(mesh, _init_params(), specs)
    state = tx.init(params)
    for batch, flush in zip(batches, flushes, strict=True):
      batch = jax.device_put(batch, NamedSharding(mesh, BATCH))
      params, state = step(params, state, batch, flush)
  return params, state


def _big_batch(inner, batches, cycles, weighted=False):
  """Params after one inner step per cycle on the cycle's whole batch."""
  loss = (lambda p, b: _token_mean(p, b)[0]) if weighted else _example_mean
  params, state = _init_params(), None
  state = inner.init(params)
  for cycle in cycles:
    big = jax.tree.map(
      lambda *xs: jnp.concatenate(xs), *[batches[i] for i in cycle]
    )
    updates, state = inner.update(jax.grad(loss)(params, big), state, params)
    params = optax.apply_updates(params, updates)
  return params


def _close(actual, expected, atol=ATOL, rtol=0.0):
  for key in expected:
    np.testing.assert_allclose(
      np.asarray(actual[key]),
      np.asarray(expected[key]),
      atol=atol,
      rtol=rtol,
      err_msg=key,
    )


def _dims(spec):
  """A spec's per-dimension entries, trailing ``None``s dropped."""
  parts = list(spec.partitions)
  while parts and parts[-1] is None:
    parts.pop()
  return tuple(parts)


# ----------------------------------------------------------------------------
# Values.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "nojit"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "tokens"])
def test_equals_the_big_batch(weighted, use_jit):
  # Eager is slow: one cycle, and a shorter one.
  k, cycles = (8, 2) if use_jit else (3, 1)
  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, k, axis_name="replica")
  batches = [_make_batch(i) for i in range(k * cycles)]
  params, state = _train(tx, batches, weighted=weighted, use_jit=use_jit)
  expected = _big_batch(
    inner, batches, [range(c * k, (c + 1) * k) for c in range(cycles)], weighted
  )
  _close(params, expected)
  assert int(state.step) == cycles
  for key, param in params.items():
    assert _dims(jax.typeof(param).sharding.spec) == _dims(SPECS[key]), key


def test_the_accumulator_holds_one_shard_per_device():
  """Sharded like the params over fsdp, unreduced over replica: per device,
  1/4 of the bytes of each fsdp-sharded param; `state_shardings` agrees."""
  tx = optax_accum.accumulate(optax.adam(1e-2), 8, axis_name="replica")
  mesh = _mesh()
  with jax.set_mesh(mesh):
    params = _put_params(mesh, _init_params())
    state = tx.init(params)
    shardings = optax_accum.distributed.state_shardings(tx, params)
  for key, param in params.items():
    acc = state.acc_grads[key]
    assert _unreduced.is_unreduced(acc, "replica"), key
    spec = jax.typeof(acc).sharding.spec
    assert _dims(spec) == _dims(SPECS[key]), (key, spec)
    assert spec.unreduced == {"replica"}, (key, spec)
    assert shardings.acc_grads[key].spec == spec, key
    split = FSDP if SPECS[key] != P() else 1
    for shard in acc.addressable_shards:
      assert shard.data.nbytes * split == param.nbytes, key


# Each option against the same run with the params replicated over the whole
# mesh (plain data parallel over "replica"): the sharding over fsdp changes
# where each number lives, never its value.
OPTIONS = {
  "flush": (dict(), dict(flushes=[False] * 4 + [True] + [False] * 4)),
  "skip_nonfinite": (dict(skip_nonfinite=True), dict(nan_at=5)),
  "noise": (dict(track_noise_scale=True), dict()),
  "grow_every_k": (
    dict(
      track_noise_scale=True,
      every_k=optax_accum.grow_every_k(4, min_cycles=1, scale=8.0),
    ),
    dict(),
  ),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_give_the_replicated_run(option):
  tx_kw, run_kw = (dict(kw) for kw in OPTIONS[option])  # changed below
  every_k = tx_kw.pop("every_k", 3)
  tx = optax_accum.accumulate(
    optax.adam(1e-2), every_k, axis_name="replica", **tx_kw
  )
  batches = [_make_batch(i) for i in range(9)]
  if "nan_at" in run_kw:  # one replica's rows of one micro-batch
    at = run_kw.pop("nan_at")
    batches[at]["x"] = batches[at]["x"].at[:ROWS].set(jnp.nan)
  replicated = {key: P() for key in SPECS}
  run_kw["noise"] = tx_kw.get("track_noise_scale", False)
  params, state = _train(tx, batches, weighted=True, **run_kw)
  ref_params, ref_state = _train(
    tx, batches, weighted=True, specs=replicated, **run_kw
  )
  _close(params, ref_params, atol=1e-6, rtol=1e-5)
  for field in ("step", "micro_step", "every_k", "num_skipped"):
    assert int(getattr(state, field)) == int(getattr(ref_state, field)), field
  if isinstance(state.noise, optax_accum.types.NoiseScaleState):
    np.testing.assert_allclose(
      np.asarray(optax_accum.noise_scale(state)),
      np.asarray(optax_accum.noise_scale(ref_state)),
      rtol=1e-4,
    )
  if option == "skip_nonfinite":
    assert int(state.num_skipped) == 1
    assert all(np.isfinite(np.asarray(p)).all() for p in params.values())
  if option == "flush":
    assert int(state.step) == 3  # 3 + flush after 2 + 3 + 1 left open


def test_a_checkpoint_mid_cycle_resumes_the_run():
  """`reduce_state` one micro-batch into a cycle, through the host (as a
  checkpoint goes), back with `state_shardings`: the run goes on."""
  k = 4
  tx = optax_accum.accumulate(optax.adam(1e-2), k, axis_name="replica")
  batches = [_make_batch(i) for i in range(2 * k)]
  grad_fn = optax_accum.distributed.local_value_and_grad(
    _example_mean, axis_name="replica"
  )

  @jax.jit
  def step(params, state, batch):
    _, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  expected, _ = _train(tx, batches)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    params = _put_params(mesh, _init_params())
    state = tx.init(params)
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, BATCH))
    for batch in batches[: k + 1]:
      params, state = step(params, state, put(batch))
    saved = jax.device_get(optax_accum.distributed.reduce_state(state))
    loaded = jax.tree.map(jnp.asarray, saved)  # as a checkpointer gives it
    restored = jax.device_put(
      loaded, optax_accum.distributed.state_shardings(tx, params)
    )
    assert _unreduced.is_unreduced(restored.acc_grads["w1"], "replica")
    assert int(restored.micro_step) == 1
    for batch in batches[k + 1 :]:
      params, restored = step(params, restored, put(batch))
  _close(params, expected, atol=1e-5)
  assert int(restored.step) == 2


# ----------------------------------------------------------------------------
# The compiled step (XLA:CPU; tests/test_accelerators.py: 8 H100s, TPU 2x4).
# ----------------------------------------------------------------------------

MIB = 2**20
WIDE = 1024  # 4 MiB leaves: 1 MiB shards


def _compiled_hsdp_step(per_step_fsdp=False):
  """`accumulate(adam, 8, axis_name="replica")` on two 1024-square layers
  sharded over fsdp; `per_step_fsdp`: plain FSDP gradients instead, reduced
  over every device on every call."""
  mesh = _mesh()
  axis = None if per_step_fsdp else "replica"
  tx = optax_accum.accumulate(optax.adam(1e-3), 8, axis_name=axis)

  def spec(shape, s):
    return jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, s)
    )

  params = {
    "w1": spec((WIDE, WIDE), P("fsdp", None)),
    "w2": spec((WIDE, WIDE), P("fsdp", None)),
    "b": spec((WIDE,), P()),
  }
  rows = ROWS * REPLICAS * FSDP
  batch = {
    "x": spec((rows, WIDE), BATCH),
    "y": spec((rows, WIDE), BATCH),
    "mask": spec((rows,), BATCH),
  }
  if per_step_fsdp:
    grad_fn = jax.value_and_grad(_example_mean)
  else:
    grad_fn = optax_accum.distributed.local_value_and_grad(
      _example_mean, axis_name="replica"
    )

  def step(params, state, batch):
    _, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax_accum.apply_updates(params, updates, state), state

  with jax.set_mesh(mesh):
    shardings = optax_accum.distributed.state_shardings(tx, params)
    state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      jax.eval_shape(tx.init, params),
      shardings,
    )
    compiled = (
      jax.jit(step, donate_argnums=(0, 1)).lower(params, state, batch).compile()
    )
  return mesh, compiled


def _span_replicas(record):
  # jit's device ids are positions in mesh.devices.flat: (replica, fsdp).
  coordinates = [(i // FSDP, i % FSDP) for i in range(REPLICAS * FSDP)]
  return 0 in _groups.spanned_axes(record.replica_groups, coordinates)


def test_compiled_step_reduces_across_replicas_once_per_cycle():
  mesh, compiled = _compiled_hsdp_step()
  records = optax_accum.inspect.assert_reduction_deferred(
    compiled, axis_name="replica", mesh=mesh, min_bytes=MIB
  )
  reductions = [
    r for r in records if r.opcode in ("all-reduce", "reduce-scatter")
  ]
  across = [r for r in reductions if _span_replicas(r) and r.bytes >= MIB]
  # One all-reduce of each device's shards (1/4 of the 1024-square layers)
  # and the replicated bias, in the emitting branch.
  shard_bytes = 2 * WIDE * WIDE * 4 // FSDP + WIDE * 4
  assert [(r.opcode, r.bytes, r.emitting) for r in across] == [
    ("all-reduce", shard_bytes, True)
  ]
  # Within a replica, FSDP reduces every call (XLA:CPU: an all-reduce of the
  # gradient, then each device keeps its slice), which the check allows
  # with axis_name and flags without it.
  within = [r for r in reductions if r.unconditional and r.bytes >= MIB]
  assert within and not any(_span_replicas(r) for r in within)
  with pytest.raises(AssertionError, match="not deferred"):
    optax_accum.inspect.assert_reduction_deferred(compiled, min_bytes=MIB)


def test_fsdp_reducing_every_call_fails_the_check():
  mesh, compiled = _compiled_hsdp_step(per_step_fsdp=True)
  with pytest.raises(AssertionError, match="across mesh axis 'replica'"):
    optax_accum.inspect.assert_reduction_deferred(
      compiled, axis_name="replica", mesh=mesh, min_bytes=MIB
    )


# ----------------------------------------------------------------------------
# Inside shard_map: "fsdp" manual too, the layout from shard_map_specs.
# ----------------------------------------------------------------------------


def _shard_map_train(tx, batches, *, sharded=True, check_vma=True):
  """HSDP written by hand inside shard_map: all-gather the params over
  fsdp, the local gradient reduce-scattered over fsdp, deferred over
  replica by `tx`; token-weighted. `sharded=False`: params replicated. A
  batch's "bad" rows put an Inf in the shard of w1's gradient of the
  devices that hold them (after the reduce-scatter: those devices only)."""
  mesh = jax.make_mesh((REPLICAS, FSDP), ("replica", "fsdp"))
  specs = SPECS if sharded else {key: P() for key in SPECS}
  params = jax.device_put(
    _init_params(), {k: NamedSharding(mesh, s) for k, s in specs.items()}
  )
  state_specs = optax_accum.distributed.shard_map_specs(
    jax.eval_shape(tx.init, params), "replica", params=params
  )

  def body(params, state, batch):
    def gather(p, spec):
      for dim, axis in enumerate(spec):
        if axis == "fsdp":
          p = jax.lax.all_gather(p, "fsdp", axis=dim, tiled=True)
      return p

    def vary(x):  # this device's own copy: jax.grad leaves it unreduced
      missing = tuple(
        a
        for a in ("replica", "fsdp")
        if a not in _control.varying_axes(jax.typeof(x))
      )
      return jax.lax.pcast(x, missing, to="varying") if missing else x

    full = {k: vary(gather(p, specs[k])) for k, p in params.items()}

    def reduce_over_fsdp(x, spec):
      """FSDP's reduce-scatter to the param's shard (psum when whole)."""
      dims = [d for d, axis in enumerate(spec) if axis == "fsdp"]
      if not dims:
        return jax.lax.psum(x, "fsdp")
      return jax.lax.psum_scatter(
        x, "fsdp", scatter_dimension=dims[0], tiled=True
      )

    def loss(p):
      return _token_mean(p, batch)

    (_, tokens), g = jax.value_and_grad(loss, has_aux=True)(full)
    # This replica's token-weighted sum over its fsdp devices, then each
    # device keeps its shard (the replicated bias: the whole sum).
    g = jax.tree.map(lambda x: x * tokens, g)
    tokens = jax.lax.psum(tokens, "fsdp")
    g = {k: reduce_over_fsdp(x, specs[k]) for k, x in g.items()}
    g = jax.tree.map(lambda x: x / jnp.maximum(tokens, 1.0), g)
    if "bad" in batch:
      bad = jnp.any(batch["bad"] > 0)
      if not sharded:  # w1 whole on each device of the replica: on each
        bad = jax.lax.pmax(bad, "fsdp")
      g["w1"] = g["w1"].at[0, 0].add(jnp.where(bad, jnp.inf, 0.0))
    # The noise scale (noise=True) is measured by `tx` from the shards.
    u, state = tx.update(
      g, optax_accum.distributed.drop_device_axis(state), params, weight=tokens
    )
    params = optax_accum.apply_updates(params, u, state)
    return params, optax_accum.distributed.add_device_axis(state)

  rows = P(("replica", "fsdp"))
  step = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(specs, state_specs, rows),
      out_specs=(specs, state_specs),
      check_vma=check_vma,
    )
  )
  init = jax.jit(
    jax.shard_map(
      lambda p: optax_accum.distributed.add_device_axis(tx.init(p)),
      mesh=mesh,
      in_specs=(specs,),
      out_specs=state_specs,
      check_vma=check_vma,
    )
  )
  state = init(params)
  for batch in batches:
    batch = jax.device_put(batch, NamedSharding(mesh, rows))
    params, state = step(params, state, batch)
  return params, state, state_specs, step.lower(params, state, batch)


def test_shard_map_hsdp_equals_the_big_batch():
  k = 4
  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, k, axis_name="replica")
  batches = [_make_batch(i) for i in range(2 * k)]
  params, state, specs, lowered = _shard_map_train(tx, batches)
  expected = _big_batch(inner, batches, [range(k), range(k, 2 * k)], True)
  _close(params, expected)
  assert int(state.step) == 2
  # The layout: the accumulator's shards on a leading replica axis.
  assert specs.acc_grads["w1"] == P("replica", "fsdp", None)
  assert specs.acc_grads["b"] == P("replica")
  assert specs.inner_state[0].mu["w1"] == P("fsdp", None)
  assert specs.acc_weight == P("replica") and specs.step == P()
  shard = state.acc_grads["w1"].addressable_shards[0].data
  assert shard.shape == (1, 16 // FSDP, 16)
  optax_accum.inspect.assert_reduction_deferred(
    lowered, axis_name="replica", min_bytes=64
  )


@pytest.mark.parametrize("option", ["skip_nonfinite", "noise"])
def test_shard_map_hsdp_options_give_the_replicated_run(option):
  noise = option == "noise"
  tx = optax_accum.accumulate(
    optax.adam(1e-2),
    3,
    axis_name="replica",
    skip_nonfinite=not noise,
    track_noise_scale=noise,
  )
  batches = [_make_batch(i) for i in range(6)]
  if not noise:  # one replica's rows of one micro-batch
    batches[4]["x"] = batches[4]["x"].at[:ROWS].set(jnp.nan)
  params, state, _, _ = _shard_map_train(tx, batches)
  ref, ref_state, _, _ = _shard_map_train(tx, batches, sharded=False)
  _close(params, ref, atol=1e-6, rtol=1e-5)
  assert int(state.num_skipped) == int(ref_state.num_skipped) == (not noise)
  if noise:
    np.testing.assert_allclose(
      np.asarray(optax_accum.noise_scale(state)),
      np.asarray(optax_accum.noise_scale(ref_state)),
      rtol=1e-4,
    )


@pytest.mark.parametrize("option", ["skip", "noise"])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_shard_map_hsdp_agrees_on_every_device_whatever_check_vma(
  check_vma, option
):
  """With check_vma=True and with check_vma=False (where no value's type
  says which axes it varies over): an Inf in one element of one device's
  shard of the gradient is skipped by every device, and the replicated
  counters stay equal on every device (the devices agree over every manual
  axis); the noise scale is the replicated-params run's (a shard told from
  a replicated leaf by its sum). Apart: a device that skips alone would
  leave the others' emitting branch waiting on its collectives."""
  skip = option == "skip"
  tx = optax_accum.accumulate(
    optax.adam(1e-2),
    3,
    axis_name="replica",
    skip_nonfinite=skip,
    track_noise_scale=not skip,
  )
  batches = [_make_batch(i) for i in range(8)]
  for i, batch in enumerate(batches):
    batch["bad"] = (
      jnp.zeros(ROWS * REPLICAS * FSDP).at[:ROWS].set(skip and i == 4)
    )
  params, state, _, _ = _shard_map_train(tx, batches, check_vma=check_vma)
  ref, ref_state, _, _ = _shard_map_train(tx, batches, sharded=False)
  shards = [np.asarray(s.data) for s in state.counters.addressable_shards]
  assert all(np.array_equal(x, shards[0]) for x in shards), shards
  assert int(state.num_skipped) == int(ref_state.num_skipped) == skip
  assert int(state.micro_step) == int(ref_state.micro_step) == 2 - skip
  _close(params, ref, atol=1e-6, rtol=1e-5)
  if not skip:
    np.testing.assert_allclose(
      np.asarray(optax_accum.noise_scale(state)),
      np.asarray(optax_accum.noise_scale(ref_state)),
      rtol=1e-4,
    )
