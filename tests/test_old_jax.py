"""On a jax older than the unreduced engine needs (``make test-oldest``).

The package imports and the core works on jax 0.7.1 (the rest of the core
suite); deferring the reduction under plain ``jax.jit`` needs jax 0.10.2
and, when used, raises a RuntimeError naming that feature, the jax it needs
and the installed one. Skipped where the feature works (the main suite,
whose tests/test_jit_unreduced.py runs it).
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _unreduced, _versions

pytestmark = pytest.mark.skipif(
  _unreduced.is_supported(),
  reason=f"jax {jax.__version__} has unreduced shardings: the feature works",
)

NEEDS = (
  r"^Deferred reduction under plain `jax.jit` .* needs"
  rf" jax>={_versions.UNREDUCED_JAX} \(installed {jax.__version__}\)"
)


def _explicit_mesh():
  return jax.make_mesh(
    (jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,)
  )


def _loss(params, batch):
  return jnp.mean((batch @ params["w"]) ** 2)


def _placed(mesh):
  params = {"w": jnp.ones((3, 2))}
  batch = jnp.ones((jax.device_count(), 3))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  return params, jax.device_put(batch, NamedSharding(mesh, P("data")))


def test_the_installed_jax_is_older_than_the_feature_needs():
  assert _versions.release(jax.__version__) < _versions.release(
    _versions.UNREDUCED_JAX
  )
  assert not _versions.jax_at_least(_versions.UNREDUCED_JAX)


def test_axis_name_under_plain_jit_on_an_explicit_mesh_names_the_version():
  mesh = _explicit_mesh()
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  with jax.set_mesh(mesh):
    params, batch = _placed(mesh)
    state = tx.init(params)  # zeros like the params: no unreduced type
    grads = jax.jit(jax.grad(_loss))(params, batch)
    with pytest.raises(RuntimeError, match=NEEDS):
      jax.jit(tx.update)(grads, state, params)


def test_local_value_and_grad_names_the_version():
  mesh = _explicit_mesh()
  value_and_grad = optax_accum.distributed.local_value_and_grad(_loss)
  with jax.set_mesh(mesh):
    params, batch = _placed(mesh)
    with pytest.raises(RuntimeError, match=NEEDS):
      value_and_grad(params, batch)


def test_axis_name_inside_shard_map_works():
  """The same accumulate, inside shard_map: the engine this jax has."""
  mesh = _explicit_mesh()
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  params, batch = _placed(mesh)
  specs = optax_accum.distributed.shard_map_specs(
    jax.eval_shape(tx.init, params), "data"
  )

  def step(params, state, batch):
    state = optax_accum.distributed.drop_device_axis(state)
    grads = jax.grad(_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    params = optax_accum.apply_updates(params, updates, state)
    return params, optax_accum.distributed.add_device_axis(state)

  init = jax.shard_map(
    lambda p: optax_accum.distributed.add_device_axis(tx.init(p)),
    mesh=mesh,
    in_specs=P(),
    out_specs=specs,
  )
  run = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), specs, P("data")),
      out_specs=(P(), specs),
    )
  )
  state = jax.jit(init)(params)
  start = params
  for _ in range(2):
    params, state = run(params, state, batch)
  assert int(state.step) == 1  # one optimizer step after k=2 micro-steps
  assert not jnp.allclose(params["w"], start["w"])
