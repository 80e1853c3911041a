"""Accumulator and inner state sharded like the params.

On the 8 simulated CPU devices (see conftest.py), `init` (eager, or jitted
with the shardings of `optax_accum.distributed.state_shardings`) and every `update` keep
each accumulator and inner-state leaf sharded like its param, on a 4x2
("data", "model") mesh and an FSDP layout; uncommitted params give an
uncommitted state.
"""

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

N_DEV = 8
# ---------------------------------------------------------------------------
# 1. Sharding follows params.
# ---------------------------------------------------------------------------

# name -> (mesh shape, axis names, {param: (shape, spec)})
LAYOUTS = {
  "data_model": (
    (4, 2),
    ("data", "model"),
    {
      "w": ((8, 4), P("data", "model")),
      "b": ((4,), P("model")),
      "scale": ((), P()),
    },
  ),
  # FSDP: every big param split over all devices on one axis, small ones
  # replicated.
  "fsdp": (
    (8,),
    ("fsdp",),
    {
      "dense": {
        "kernel": ((16, 4), P("fsdp", None)),
        "bias": ((8,), P("fsdp")),
      },
      "norm": ((3,), P()),
    },
  ),
}

INNERS = {
  "adam": lambda: optax.adam(1e-2),
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "clip_adamw": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-2)
  ),
}


def _sharded_params(layout, axis_type=AxisType.Auto):
  mesh_shape, names, spec_tree = LAYOUTS[layout]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
  is_spec = lambda x: isinstance(x, tuple) and isinstance(x[1], P)  # noqa: E731
  params = jax.tree.map(
    lambda s: jax.device_put(
      jnp.arange(np.prod(s[0]), dtype=jnp.float32).reshape(s[0]) / 7.0,
      NamedSharding(mesh, s[1]),
    ),
    spec_tree,
    is_leaf=is_spec,
  )
  return mesh, params


def _grads_like(params, i):
  keys = jax.random.split(jax.random.PRNGKey(i), len(jax.tree.leaves(params)))
  leaves = [
    jax.device_put(jax.random.normal(k, p.shape), p.sharding)
    for k, p in zip(keys, jax.tree.leaves(params), strict=True)
  ]
  return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _expected_shardings(inner, params, mesh):
  """The oracle: optax's own map over the param-shaped parts of a state."""
  param_shardings = jax.tree.map(lambda p: p.sharding, params)
  replicated = NamedSharding(mesh, P())
  inner_state = jax.eval_shape(inner.init, params)
  return param_shardings, optax.tree_map_params(
    inner,
    lambda _, sharding: sharding,
    inner_state,
    param_shardings,
    transform_non_params=lambda _: replicated,
  )


def _assert_same_shardings(actual, expected, what):
  actual, expected = _common.flat(actual), _common.flat(expected)
  assert actual.keys() == expected.keys(), what
  for path, sharding in expected.items():
    got = actual[path]
    got = getattr(got, "sharding", got)
    assert (
      isinstance(got, NamedSharding)
      and got.mesh == sharding.mesh
      and _norm(got.spec) == _norm(sharding.spec)
    ), f"{what}{path}: got {got}, expected {sharding}"


def _norm(spec):
  """A PartitionSpec without trailing Nones (P('a', None) == P('a'))."""
  spec = list(spec)
  while spec and spec[-1] is None:
    spec.pop()
  return tuple(spec)


@pytest.mark.parametrize("inner_name", list(INNERS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_state_shardings_follow_params(layout, inner_name):
  """Accumulator like the params, inner state as optax maps it, scalars
  replicated; also for accumulate nested in a chain."""
  mesh, params = _sharded_params(layout)
  inner = INNERS[inner_name]()
  tx = optax_accum.accumulate(inner, 2)
  shardings = optax_accum.distributed.state_shardings(tx, params)
  param_shardings, inner_expected = _expected_shardings(inner, params, mesh)
  replicated = NamedSharding(mesh, P())

  assert jax.tree.structure(shardings) == jax.tree.structure(
    jax.eval_shape(tx.init, params)
  )
  _assert_same_shardings(shardings.acc_grads, param_shardings, "acc_grads")
  _assert_same_shardings(shardings.inner_state, inner_expected, "inner_state")
  # The scalars, packed in two arrays, are replicated.
  assert shardings.counters == shardings.acc_scalars == replicated

  # The same from an abstract tree (checkpoint restore) and inside a chain.
  abstract = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding),
    params,
  )
  chained = optax.chain(optax.clip(1.0), tx)
  chained_shardings = optax_accum.distributed.state_shardings(chained, abstract)
  _assert_same_shardings(chained_shardings[1], shardings, "chain[1]")


# States whose param-like parts optax.tree_map_params cannot map (masked
# subtrees) or that hold leaves of other shapes (factored moments).
ODD_INNERS = {
  "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
  "masked": lambda: optax.masked(
    optax.adam(1e-2), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  ),
  "multi_transform": lambda: optax.multi_transform(
    {"big": optax.adam(1e-2), "small": optax.sgd(1e-2)},
    lambda p: jax.tree.map(lambda x: "big" if x.ndim > 1 else "small", p),
  ),
}


@pytest.mark.parametrize("inner_name", list(ODD_INNERS))
def test_state_shardings_fit_any_inner_state(inner_name):
  """Every leaf gets a sharding valid for its shape: the param's where the
  shapes agree, replicated elsewhere, so jit(init) and a cycle of jitted
  updates run with them."""
  mesh, params = _sharded_params("fsdp")
  tx = optax_accum.accumulate(ODD_INNERS[inner_name](), 2)
  shardings = optax_accum.distributed.state_shardings(tx, params)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  shapes = _common.flat(jax.eval_shape(tx.init, params))
  by_path = {
    jax.tree_util.keystr(path): p
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  for path, sharding in _common.flat(shardings).items():
    matched = [
      p
      for suffix, p in by_path.items()
      if path.endswith(suffix) and p.shape == shapes[path].shape
    ]
    expected = matched[0].sharding if matched else NamedSharding(mesh, P())
    assert sharding == expected, path
  _, state = jax.jit(tx.update)(_grads_like(params, 0), state, params)
  _, state = jax.jit(tx.update)(_grads_like(params, 1), state, params)
  assert bool(optax_accum.has_updated(state))
  _assert_same_shardings(
    state.acc_grads, jax.tree.map(lambda p: p.sharding, params), "acc"
  )


# (layout, how init runs, whether update is jitted, mesh axis type). Eager
# updates on 8 devices dispatch op by op (seconds per call): one case covers
# them.
SHARDING_CASES = [
  ("data_model", "eager", "jit", AxisType.Auto),
  ("data_model", "jit_out_shardings", "jit", AxisType.Auto),
  ("fsdp", "eager", "jit", AxisType.Auto),
  ("fsdp", "jit_out_shardings", "jit", AxisType.Auto),
  ("data_model", "eager", "nojit", AxisType.Auto),
  # jax.make_mesh's default axes: shardings are part of the types.
  ("data_model", "jit_out_shardings", "jit", AxisType.Explicit),
]


@pytest.mark.parametrize(
  "layout, init_mode, update_mode, axis_type", SHARDING_CASES
)
def test_init_and_update_keep_param_shardings(
  layout, init_mode, update_mode, axis_type
):
  """Through a whole cycle and into the next, every param-shaped state leaf
  and the updates stay sharded like their param, and the values are those
  of an unsharded run (rtol 1e-6: adam inside a different fusion)."""
  mesh, params = _sharded_params(layout, axis_type)
  with jax.set_mesh(mesh):
    _check_sharded_training(mesh, params, init_mode, update_mode)


def _check_sharded_training(mesh, params, init_mode, update_mode):
  inner = optax.adam(1e-2)
  tx = optax_accum.accumulate(inner, 2)
  shardings = optax_accum.distributed.state_shardings(tx, params)
  if init_mode == "eager":
    state = tx.init(params)
  else:
    state = jax.jit(tx.init, out_shardings=shardings)(params)
  update = _common.MODES[update_mode](tx.update)
  host_params = jax.device_get(params)
  host_state = tx.init(host_params)
  host_update = jax.jit(tx.update)
  param_shardings, inner_expected = _expected_shardings(inner, params, mesh)
  inner_param_leaves = {
    path: s for path, s in _common.flat(inner_expected).items() if s.spec != P()
  }
  assert inner_param_leaves  # adam's mu and nu
  for i in range(3):
    grads = _grads_like(params, i)
    updates, state = update(grads, state, params)
    host_updates, host_state = host_update(
      jax.device_get(grads), host_state, host_params
    )
    _assert_same_shardings(state.acc_grads, param_shardings, f"step {i}: acc")
    _assert_same_shardings(updates, param_shardings, f"step {i}: updates")
    _assert_same_shardings(
      {p: _common.flat(state.inner_state)[p] for p in inner_param_leaves},
      inner_param_leaves,
      f"step {i}: inner",
    )
    for a, b in zip(
      jax.tree.leaves((updates, state)),
      jax.tree.leaves((host_updates, host_state)),
      strict=True,
    ):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  assert int(state.step) == 1


def test_jitted_update_keeps_state_shardings_exactly():
  """Under jit the whole state, scalars included, comes back with exactly
  the shardings `state_shardings` gave it (no resharding between steps)."""
  _, params = _sharded_params("data_model")
  tx = optax_accum.accumulate(optax.adam(1e-2), 2)
  shardings = optax_accum.distributed.state_shardings(tx, params)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  update = jax.jit(tx.update)
  for i in range(2):
    _, state = update(_grads_like(params, i), state, params)
    _assert_same_shardings(state, shardings, f"step {i}: ")


def test_state_shardings_restore_a_checkpoint_mid_cycle(tmp_path):
  """Saved mid-cycle, restored into `state_shardings`: same layout, and
  training goes on exactly as without the interruption."""
  _, params = _sharded_params("fsdp")
  tx = optax_accum.accumulate(optax.adam(1e-2), 3)
  shardings = optax_accum.distributed.state_shardings(tx, params)
  update = jax.jit(tx.update)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  for i in range(4):  # one cycle and a third
    _, state = update(_grads_like(params, i), state, params)

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  target = jax.tree.map(
    lambda s, sharding: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=sharding
    ),
    jax.eval_shape(tx.init, params),
    shardings,
  )
  restored = checkpointer.restore(tmp_path / "state", target)
  _assert_same_shardings(restored, shardings, "restored")

  for i in range(4, 6):  # finish the cycle from both
    live_updates, state = update(_grads_like(params, i), state, params)
    restored_updates, restored = update(
      _grads_like(params, i), restored, params
    )
  assert bool(optax_accum.has_updated(restored))
  for a, b in zip(
    jax.tree.leaves((live_updates, state)),
    jax.tree.leaves((restored_updates, restored)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_state_shardings_errors_name_the_argument():
  with pytest.raises(TypeError, match="`params`.*NamedSharding.*\\['w'\\]"):
    optax_accum.distributed.state_shardings(
      optax_accum.accumulate(optax.sgd(1.0), 2), {"w": np.zeros(3)}
    )
  with pytest.raises(TypeError, match="`tx`"):
    _, params = _sharded_params("fsdp")
    optax_accum.distributed.state_shardings(3, params)


def test_jit_init_follows_params_on_an_explicit_mesh():
  mesh, params = _sharded_params("data_model", AxisType.Explicit)
  tx = optax_accum.accumulate(optax.adam(1e-2), 2)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(params)
  param_shardings, _ = _expected_shardings(optax.adam(1e-2), params, mesh)
  _assert_same_shardings(state.acc_grads, param_shardings, "acc_grads")


def test_uncommitted_params_give_an_uncommitted_state():
  """As optax's own states: a state stacked for several devices then runs
  over any of them (a committed accumulator on device 0 made a 4-device
  shard_map fail with "incompatible devices")."""
  params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
  assert not params["w"].committed
  tx = optax_accum.accumulate(optax.adam(1e-3), 2)
  state = tx.init(params)
  for leaf in jax.tree.leaves(state):
    assert not leaf.committed, leaf
  mesh = jax.make_mesh(
    (4,), ("d",), axis_types=(AxisType.Auto,), devices=jax.devices()[4:]
  )
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 4), (params, state))
  grads = jax.tree.map(jnp.ones_like, jax.tree.map(lambda x: x[None], params))
  grads = jax.tree.map(lambda g: jnp.concatenate([g] * 4), grads)

  def step(params, state, grads):
    squeeze = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
    updates, state = tx.update(squeeze(grads), squeeze(state), squeeze(params))
    return jax.tree.map(lambda a: a[None], (updates, state))

  run = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  )
  _, new_state = run(*stacked, grads)
  np.testing.assert_array_equal(new_state.micro_step, np.ones(4))


def test_committed_params_give_a_state_on_their_devices():
  device = jax.devices()[3]
  params = jax.device_put(jnp.zeros(3), device)
  state = optax_accum.accumulate(optax.sgd(0.1), 2).init(params)
  assert state.acc_grads.committed
  assert state.acc_grads.devices() == {device}
