"""The NNX drop-in under Flax's own sharding and checkpoint recipes (issue
67): every leaf of its one-Variable state where the stock ``nnx.Optimizer``
puts the same leaf.

Each test holds the drop-in beside the stock class around the same
``accumulate`` (the same state, leaf for leaf: the stock class keeps a
Variable per leaf, the drop-in one for the whole state) on an 8-device CPU
mesh, with the kernel annotated for FSDP (``("fsdp", None)``), for a 2-D
mesh (``("data", "model")``) and with logical names under
``nnx.logical_axis_rules``. The recipes are Flax's, as users write them:
the sharded model made in ``nnx.jit`` (``get_partition_spec`` +
``with_sharding_constraint`` + ``nnx.update``), made eagerly under
``jax.set_mesh``, restored with Orbax into an abstract target sharded by
``nnx.get_named_sharding``, and stepped by ``jax.jit`` over ``nnx.split``'s
state with shardings from ``nnx.get_named_sharding``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import optax_accum

K = 4  # a checkpoint after 2 calls is mid-cycle

pytestmark = [
  pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning"),
]


# How the first kernel is annotated, on which mesh, under which rules.
LAYOUTS = {
  "fsdp": ((8,), ("fsdp",), ("fsdp", None), ()),
  "2d": ((2, 4), ("data", "model"), ("data", "model"), ()),
  "logical": (
    (8,),
    ("fsdp",),
    ("embed", "hidden"),
    (("embed", "fsdp"), ("hidden", None)),
  ),
}


class _Model(nnx.Module):
  def __init__(self, axes, rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)
    self.a = nnx.Linear(64, 32, kernel_init=init, rngs=rngs)
    self.b = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def _tx():
  return optax_accum.accumulate(optax.adam(0.05), K)


CLASSES = {"ours": optax_accum.flax.Optimizer, "stock": nnx.Optimizer}


class _Layout:
  def __init__(self, name):
    shape, names, self.axes, self.rules = LAYOUTS[name]
    self.mesh = jax.make_mesh(
      shape,
      names,
      axis_types=(jax.sharding.AxisType.Auto,) * len(names),
      devices=jax.devices()[: int(np.prod(shape))],
    )

  def __enter__(self):
    self._contexts = [
      jax.set_mesh(self.mesh),
      nnx.logical_axis_rules(self.rules),
    ]
    for c in self._contexts:
      c.__enter__()
    return self

  def __exit__(self, *exc):
    for c in reversed(self._contexts):
      c.__exit__(*exc)

  def new(self, cls):
    """A model and its optimizer, made as a user makes them."""
    model = _Model(self.axes, nnx.Rngs(0))
    return model, CLASSES[cls](model, _tx(), wrt=nnx.Param)


def _batch(i):
  x = jnp.sin(jnp.arange(4 * 64.0).reshape(4, 64) * (i + 1))
  return x, jnp.cos(x[:, :8])


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit(donate_argnums=(0, 1))
def _step(model, optimizer, x, y):
  optimizer.update(model, nnx.grad(_loss)(model, x, y))


# ----------------------------------------------------------------------------
# Reading a state leaf by leaf, whatever the layout.
# ----------------------------------------------------------------------------


def _name(key):
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  raise AssertionError(key)


def _by_path(tree, read):
  """{path: read(leaf)} over `tree`'s leaves, the Variables taken out and
  the path spelled the same for the one-Variable state and the stock's
  Variable per leaf (a field name, a dict key and an index alike)."""
  flat = jax.tree_util.tree_flatten_with_path(
    nnx.as_pure(tree), is_leaf=lambda x: isinstance(x, P)
  )[0]
  return {tuple(_name(k) for k in path): read(x) for path, x in flat}


def _placement(x):
  """What a leaf costs each device, and its layout."""
  shard = x.addressable_shards[0].data
  return (x.shape, str(x.dtype), x.sharding.spec, shard.nbytes)


def _the_same(ours, stock):
  assert ours.keys() == stock.keys()
  for path in ours:
    assert ours[path] == stock[path], path


def _sharded(placements):
  """The paths of the state leaves split over the devices."""
  return {
    p
    for p, (shape, _, _, nbytes) in placements.items()
    if nbytes * 8 <= int(np.prod(shape)) * 4 and len(shape) == 2
  }


# ----------------------------------------------------------------------------
# Item 1: each nnx function a sharded trainer calls, against the stock.
# ----------------------------------------------------------------------------


def _spec_of(x):
  return tuple(x)


def _get_partition_spec(layout, cls):
  _, optimizer = layout.new(cls)
  return _by_path(nnx.get_partition_spec(nnx.state(optimizer)), _spec_of)


def _get_named_sharding(layout, cls):
  _, optimizer = layout.new(cls)
  shardings = nnx.get_named_sharding(nnx.state(optimizer), layout.mesh)
  return _by_path(shardings, lambda s: (s.mesh.shape_tuple, tuple(s.spec)))


def _created_in_jit(layout, cls):
  @nnx.jit
  def create():
    model, optimizer = layout.new(cls)
    for obj in (model, optimizer):
      state = nnx.state(obj)
      specs = nnx.get_partition_spec(state)
      nnx.update(obj, jax.lax.with_sharding_constraint(state, specs))
    return model, optimizer

  return create()


def _with_sharding_constraint(layout, cls):
  """Flax's "create a sharded model" recipe, in nnx.jit."""
  _, optimizer = _created_in_jit(layout, cls)
  return _by_path(nnx.state(optimizer), _placement)


def _eval_shape(layout, cls):
  _, optimizer = nnx.eval_shape(lambda: layout.new(cls))
  return _by_path(
    nnx.state(optimizer), lambda a: (a.shape, str(a.dtype), a.sharding)
  )


def _as_abstract(layout, cls):
  _, optimizer = nnx.eval_shape(lambda: layout.new(cls))
  return _by_path(
    nnx.as_abstract(nnx.state(optimizer)),
    lambda a: (a.shape, str(a.dtype), getattr(a.sharding, "spec", None)),
  )


def _get_abstract_model(layout, cls):
  _, state = nnx.get_abstract_model(lambda: layout.new(cls), layout.mesh)
  return _by_path(state, lambda a: (a.shape, a.sharding.spec))


def _split_merge_update(layout, cls):
  model, optimizer = layout.new(cls)
  graphdef, state = nnx.split(optimizer)
  again = nnx.merge(graphdef, state)
  nnx.update(optimizer, nnx.state(again))
  return _by_path(nnx.state(optimizer), _placement)


def _state_opt_state(layout, cls):
  _, optimizer = layout.new(cls)
  return _by_path(nnx.state(optimizer, nnx.OptState), _placement)


def _device_put_named_sharding(layout, cls):
  _, optimizer = layout.new(cls)
  state = nnx.state(optimizer)
  shardings = nnx.get_named_sharding(state, layout.mesh)
  return _by_path(jax.device_put(state, shardings), _placement)


# Every nnx function of issue 67's item 1 (nnx.with_sharding_constraint is
# not in flax 0.12: jax.lax's is the recipe's), and those built on them.
NNX_FUNCTIONS = {
  "get_partition_spec": _get_partition_spec,
  "get_named_sharding": _get_named_sharding,
  "jax.lax.with_sharding_constraint": _with_sharding_constraint,
  "eval_shape": _eval_shape,
  "as_abstract": _as_abstract,
  "get_abstract_model": _get_abstract_model,
  "split_merge_update": _split_merge_update,
  "state(optimizer, nnx.OptState)": _state_opt_state,
  "device_put(get_named_sharding)": _device_put_named_sharding,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("function", list(NNX_FUNCTIONS))
def test_each_nnx_function_gives_every_leaf_the_stock_layout(function, layout):
  with _Layout(layout) as mesh:
    ours = NNX_FUNCTIONS[function](mesh, "ours")
    stock = NNX_FUNCTIONS[function](mesh, "stock")
  _the_same(ours, stock)
  # Not trivially: the accumulator and both Adam moments of the annotated
  # kernel are split over the devices, as the stock class splits them.
  if function in ("get_partition_spec", "get_named_sharding"):
    specs = [
      v if function == "get_partition_spec" else v[1] for v in ours.values()
    ]
    assert sum(any(axis is not None for axis in s) for s in specs) >= 3
  elif function in ("jax.lax.with_sharding_constraint", "split_merge_update"):
    assert len(_sharded(ours)) >= 3


# ----------------------------------------------------------------------------
# Item 2: the recipes as users write them, a train step under each.
# ----------------------------------------------------------------------------


def _created_eagerly(layout, cls):
  return layout.new(cls)


CREATIONS = {"nnx.jit": _created_in_jit, "eager set_mesh": _created_eagerly}


def _params(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("creation", list(CREATIONS))
def test_made_by_each_recipe_each_leaf_sits_where_the_stock_s_does_and_trains(
  creation, layout
):
  placements, after, params = {}, {}, {}
  with _Layout(layout) as mesh:
    for cls in CLASSES:
      model, optimizer = CREATIONS[creation](mesh, cls)
      placements[cls] = _by_path(nnx.state(optimizer), _placement)
      for i in range(K + 1):
        _step(model, optimizer, *_batch(i))
      after[cls] = _by_path(nnx.state(optimizer), _placement)
      params[cls] = _params(model)
  _the_same(placements["ours"], placements["stock"])
  _the_same(after["ours"], after["stock"])
  assert len(_sharded(placements["ours"])) >= 3
  chex.assert_trees_all_close(
    params["ours"], params["stock"], rtol=0, atol=1e-7
  )


def _abstract_target(layout, cls):
  """Flax's restore target: eval_shape, then each leaf's NamedSharding."""
  abstract = nnx.eval_shape(lambda: layout.new(cls))
  graphdef, state = nnx.split(abstract)
  shardings = nnx.get_named_sharding(state, layout.mesh)
  target = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    state,
    shardings,
  )
  return graphdef, target


@pytest.mark.parametrize("layout", ["fsdp", "logical"])
def test_orbax_restore_into_a_target_sharded_by_get_named_sharding(
  tmp_path, layout
):
  """Mid-cycle, bit for bit: the restored leaves, their layout (the stock
  class's), and the run continued from them."""
  with _Layout(layout) as mesh:
    model, optimizer = mesh.new("ours")
    for i in range(2):
      _step(model, optimizer, *_batch(i))
    saved = _by_path(nnx.state((model, optimizer)), np.asarray)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "ckpt", nnx.state((model, optimizer)))
    for i in range(2, 2 * K):
      _step(model, optimizer, *_batch(i))
    uninterrupted = _params(model)

    graphdef, target = _abstract_target(mesh, "ours")
    stock_layout = _by_path(
      _abstract_target(mesh, "stock")[1], lambda a: a.sharding.spec
    )
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(tmp_path / "ckpt", target)
    model, optimizer = nnx.merge(graphdef, restored)
    layout_read = _by_path(
      nnx.state((model, optimizer)), lambda a: a.sharding.spec
    )
    _the_same(layout_read, stock_layout)
    assert int(optimizer.opt_state.micro_step) == 2
    chex.assert_trees_all_equal(
      _by_path(nnx.state((model, optimizer)), np.asarray), saved
    )
    for i in range(2, 2 * K):
      _step(model, optimizer, *_batch(i))
    chex.assert_trees_all_equal(_params(model), uninterrupted)


def _apply_cost(mesh, model):
  """The temporary bytes per device that applying with
  optax_accum.apply_updates costs beyond optax.apply_updates, in the same
  step without Flax (the params placed as the model's): the one way the
  drop-in's step may differ from the stock class's, which applies with
  optax's. On XLA:CPU a few hundred bytes, whatever the model's size."""
  graphdef, state = nnx.split(model)
  params = jax.device_put(
    nnx.as_pure(state), nnx.as_pure(nnx.get_named_sharding(state, mesh))
  )
  tx = _tx()
  temp = {}
  for name, apply in (
    ("ours", optax_accum.apply_updates),
    ("optax", lambda p, u, s: optax.apply_updates(p, u)),
  ):

    def step(p, s, x, y, apply=apply):
      g = jax.grad(lambda p: _loss(nnx.merge(graphdef, p), x, y))(p)
      u, s = tx.update(g, s, p)
      return apply(p, u, s), s

    args = (params, tx.init(params))
    shardings = jax.tree.map(lambda x: x.sharding, args)
    compiled = jax.jit(
      step,
      in_shardings=(*shardings, None, None),
      out_shardings=shardings,
      donate_argnums=(0, 1),
    ).lower(*args, *_batch(0))
    temp[name] = compiled.compile().memory_analysis().temp_size_in_bytes
  return temp["ours"] - temp["optax"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_jax_jit_over_the_split_state_with_get_named_sharding_costs_what_stock_does(
  layout,
):
  """The step compiled with in and out shardings from
  nnx.get_named_sharding: the same bytes per device for the state as the
  stock class's, no more temporary memory than applying with
  optax_accum.apply_updates costs anyway, and every leaf back in place."""
  compiled, placements, params = {}, {}, {}
  with _Layout(layout) as mesh:
    for cls in CLASSES:
      model, optimizer = mesh.new(cls)
      graphdef, state = nnx.split((model, optimizer))
      shardings = nnx.get_named_sharding(state, mesh.mesh)

      def step(state, x, y, graphdef=graphdef):
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, nnx.grad(_loss)(model, x, y))
        return nnx.state((model, optimizer))

      jitted = jax.jit(
        step,
        in_shardings=(shardings, None, None),
        out_shardings=shardings,
        donate_argnums=0,
      )
      state = jax.device_put(state, shardings)
      compiled[cls] = (
        jitted.lower(state, *_batch(0)).compile().memory_analysis()
      )
      for i in range(K + 1):
        state = jitted(state, *_batch(i))
      placements[cls] = _by_path(state, _placement)
      params[cls] = _params(nnx.merge(graphdef, state)[0])
    apply_cost = _apply_cost(mesh.mesh, _Model(mesh.axes, nnx.Rngs(0)))
  _the_same(placements["ours"], placements["stock"])
  assert len(_sharded(placements["ours"])) >= 4  # the kernel too
  ours, stock = compiled["ours"], compiled["stock"]
  assert ours.argument_size_in_bytes == stock.argument_size_in_bytes
  assert ours.output_size_in_bytes == stock.output_size_in_bytes
  # One replicated state leaf of the kernel would add 7/8 of 8 KiB.
  assert ours.temp_size_in_bytes <= stock.temp_size_in_bytes + apply_cost
  assert apply_cost < 1024
  chex.assert_trees_all_close(
    params["ours"], params["stock"], rtol=0, atol=1e-7
  )
