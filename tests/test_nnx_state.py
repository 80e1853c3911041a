"""The NNX drop-in's optimizer state is one Variable (issue 61 item 1), and
nothing the stock ``nnx.Optimizer`` offers is lost: every field reads by
name, ``nnx.state`` / ``nnx.split`` / ``nnx.update`` round trips, Orbax and
flax msgpack checkpoints mid-cycle (bit for bit), the layouts of its leaves
on a mesh, and the checkpoints of the stock ``nnx.Optimizer`` around
``optax.MultiSteps`` and of optax_accum 0.3's drop-in (a Variable per leaf),
which come in with one call (:meth:`optax_accum.flax.Optimizer.load`) and
fail loudly restored naively."""

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

K, CALLS = 3, 8  # a checkpoint after 4 calls is mid-cycle

pytestmark = [
  pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning"),
]


class _Model(nnx.Module):
  def __init__(self, rngs, kernel_axes=None):
    init = nnx.initializers.lecun_normal()
    if kernel_axes is not None:  # on a mesh: the first layer's kernel sharded
      init = nnx.with_partitioning(init, kernel_axes)
    self.a = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
    self.b = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def _batch(i):
  x = jnp.sin(jnp.arange(16.0).reshape(4, 4) * (i + 1))
  return x, jnp.cos(x[:, :2])


def _tx():
  return optax_accum.accumulate(optax.adam(0.05), K)


@nnx.jit(donate_argnums=(0, 1))
def _step(model, optimizer, x, y):
  grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  optimizer.update(model, grads)


def _run(model, optimizer, calls):
  for i in calls:
    _step(model, optimizer, *_batch(i))
  return model, optimizer


def _variables(tree):
  return [
    v
    for v in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    if isinstance(v, nnx.Variable)
  ]


def _params(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _uninterrupted():
  model = _Model(nnx.Rngs(0))
  optimizer = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  _run(model, optimizer, range(CALLS))
  return _params(model)


def test_the_optimizer_state_is_one_variable_with_every_field_by_name():
  model = _Model(nnx.Rngs(0))
  ours = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  stock = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
  # step and the whole optimizer state, where the stock class keeps one
  # Variable per leaf (the accumulator, Adam's moments, the counters).
  assert len(_variables(nnx.state(ours))) == 2
  assert len(_variables(nnx.state(stock))) == 1 + len(
    jax.tree.leaves(nnx.as_pure(stock.opt_state))
  )
  _run(model, ours, range(4))
  state = ours.opt_state
  assert isinstance(state, optax_accum.flax.OptStateTree)
  assert int(state.micro_step) == 1 and int(state.step) == 1
  assert int(ours.optimizer_step) == 1
  assert set(state.acc_grads) == {"a", "b"}
  assert float(state.acc_weight) == 1.0
  assert bool(optax_accum.has_updated(state)) is False


def test_split_and_merge_round_trip_and_jax_jit_takes_the_split_state():
  model = _Model(nnx.Rngs(0))
  optimizer = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  @jax.jit
  def step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  for i in range(CALLS):
    state = step(state, *_batch(i))
  model, optimizer = nnx.merge(graphdef, state)
  chex.assert_trees_all_equal(_params(model), _uninterrupted())
  assert int(optimizer.step[...]) == CALLS


def _orbax(path, tree, target=None):
  checkpointer = ocp.StandardCheckpointer()
  if target is None:
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    return None
  return checkpointer.restore(path, target)


def test_orbax_checkpoint_mid_cycle_resumes_bit_for_bit(tmp_path):
  model = _Model(nnx.Rngs(0))
  optimizer = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  _run(model, optimizer, range(4))
  _orbax(tmp_path / "ckpt", nnx.state((model, optimizer)))

  model = _Model(nnx.Rngs(1))  # other values: all come from the checkpoint
  optimizer = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  state = _orbax(tmp_path / "ckpt", None, nnx.state((model, optimizer)))
  nnx.update((model, optimizer), state)
  assert int(optimizer.opt_state.micro_step) == 1
  _run(model, optimizer, range(4, CALLS))
  chex.assert_trees_all_equal(_params(model), _uninterrupted())


def test_msgpack_checkpoint_mid_cycle_resumes_bit_for_bit():
  model = _Model(nnx.Rngs(0))
  optimizer = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  _run(model, optimizer, range(4))
  saved = flax.serialization.to_bytes(
    nnx.to_pure_dict(nnx.state((model, optimizer)))
  )

  model = _Model(nnx.Rngs(1))
  optimizer = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  state = nnx.state((model, optimizer))
  restored = flax.serialization.from_bytes(nnx.to_pure_dict(state), saved)
  nnx.replace_by_pure_dict(state, restored)
  nnx.update((model, optimizer), state)
  _run(model, optimizer, range(4, CALLS))
  chex.assert_trees_all_equal(_params(model), _uninterrupted())


# ----------------------------------------------------------------------------
# Checkpoints of other layouts: `load`, one call.
# ----------------------------------------------------------------------------


def _v0_3(model):
  """optax_accum 0.3's drop-in layout: the stock class's, a Variable per
  leaf, around the same accumulate (0.3's drop-in inherited its __init__)."""
  return nnx.Optimizer(model, _tx(), wrt=nnx.Param)


def _multisteps(model):
  return nnx.Optimizer(
    model, optax.MultiSteps(optax.adam(0.05), K), wrt=nnx.Param
  )


OLD = {"v0_3": _v0_3, "multisteps": _multisteps}


def _saved_by(old, tmp_path, via):
  """The model and optimizer after 4 calls of `old`, as a checkpoint
  restored without a target (nested dicts), and the model's params."""
  model = _Model(nnx.Rngs(0))
  optimizer = OLD[old](model)
  _run(model, optimizer, range(4))
  tree = {
    "model": nnx.to_pure_dict(nnx.state(model)),
    "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
  }
  if via == "msgpack":
    return flax.serialization.msgpack_restore(flax.serialization.to_bytes(tree))
  _orbax(tmp_path / "ckpt", tree)
  return ocp.StandardCheckpointer().restore(tmp_path / "ckpt")


@pytest.mark.parametrize("via", ["orbax", "msgpack"])
@pytest.mark.parametrize("old", list(OLD))
def test_a_checkpoint_of_another_layout_comes_in_with_load(tmp_path, old, via):
  """Bit for bit from 0.3's layout (the same values); within float rounding
  from MultiSteps' (its running mean becomes a sum)."""
  saved = _saved_by(old, tmp_path, via)
  model = _Model(nnx.Rngs(1))
  optimizer = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  model_state = nnx.state(model)
  nnx.replace_by_pure_dict(model_state, saved["model"])
  nnx.update(model, model_state)
  optimizer.load(saved["optimizer"])
  assert int(optimizer.step[...]) == 4
  assert int(optimizer.opt_state.micro_step) == 1
  _run(model, optimizer, range(4, CALLS))
  if old == "v0_3":
    chex.assert_trees_all_equal(_params(model), _uninterrupted())
  else:
    chex.assert_trees_all_close(
      _params(model), _uninterrupted(), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("old", list(OLD))
def test_a_checkpoint_of_another_layout_restored_naively_raises(tmp_path, old):
  _saved_by(old, tmp_path, "orbax")
  model = _Model(nnx.Rngs(1))
  optimizer = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  target = {
    "model": nnx.to_pure_dict(nnx.state(model)),
    "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
  }
  with pytest.raises(ValueError, match="do not match"):  # Orbax's
    ocp.StandardCheckpointer().restore(tmp_path / "ckpt", target)


def test_load_names_what_it_cannot_read(tmp_path):
  model = _Model(nnx.Rngs(1))
  optimizer = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
  with pytest.raises(ValueError, match="'step' and 'opt_state'"):
    optimizer.load({"params": 1})
  saved = _saved_by("v0_3", tmp_path, "msgpack")["optimizer"]
  del saved["opt_state"]["acc_grads"]["b"]
  with pytest.raises(ValueError, match=r"opt_state\.acc_grads.*'b'"):
    optimizer.load(saved)
  # A MultiSteps checkpoint converts into the accumulate that replaces it,
  # not into a chain around one.
  chained = optax_accum.flax.Optimizer(
    model, optax.chain(optax.identity(), _tx()), wrt=nnx.Param
  )
  saved = _saved_by("multisteps", tmp_path, "msgpack")["optimizer"]
  with pytest.raises(ValueError, match="not a chain around one"):
    chained.load(saved)


# ----------------------------------------------------------------------------
# Shardings: each leaf its param's layout, as the stock class gives it.
# ----------------------------------------------------------------------------


def _flat_specs(tree):
  return [
    tuple(s)
    for s in jax.tree.leaves(
      nnx.as_pure(tree), is_leaf=lambda x: isinstance(x, P)
    )
  ]


def test_shardings_on_a_mesh_are_the_stock_class_s():
  """On a mesh of jax's default axis types (Explicit on jax 0.12); the Auto
  meshes of Flax's recipes: tests/test_nnx_sharding.py."""
  mesh = jax.make_mesh((8,), ("model",), devices=jax.devices()[:8])
  with jax.set_mesh(mesh):
    model = _Model(nnx.Rngs(0), kernel_axes=(None, "model"))
    ours = optax_accum.flax.Optimizer(model, _tx(), wrt=nnx.Param)
    stock = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
  ours_specs = nnx.get_partition_spec(ours.opt_state)
  stock_specs = nnx.get_partition_spec(stock.opt_state)
  assert _flat_specs(ours_specs) == _flat_specs(stock_specs)
  assert ("model",) in [s[1:] for s in _flat_specs(ours_specs)]
  shardings = nnx.get_named_sharding(nnx.state(ours), mesh)
  state = nnx.as_pure(nnx.state(ours))
  placed = jax.device_put(state, nnx.as_pure(shardings))
  kernel = placed["opt_state"].acc_grads["a"]["kernel"]
  assert kernel.sharding == NamedSharding(mesh, P(None, "model"))
  # The arrays tx.init made follow the params' own layout, as the stock's.
  for a, b in zip(
    jax.tree.leaves(nnx.as_pure(ours.opt_state)),
    jax.tree.leaves(nnx.as_pure(stock.opt_state)),
    strict=True,
  ):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
