"""The NNX drop-in takes what the stock ``nnx.Optimizer`` takes, and
``Optimizer.load`` converts every ``optax.MultiSteps`` checkpoint as it was
(issue 68).

One table: each row a ``MultiSteps`` option (or an inner optimizer built on
the model's tree) and the ``accumulate`` that replaces it. For each, the
stock ``nnx.Optimizer(model, optax.MultiSteps(...))`` runs, is saved
mid-cycle (or at a cycle's end) through Orbax without a target and through
flax msgpack, and goes on; the drop-in is built on the saved params, takes
the saved optimizer with ``load`` and goes on too: the params agree within
float32 rounding after every later call. Then the drop-in's own checkpoints
whatever the model's names, the layout of what ``load`` takes on a mesh,
and ``multisteps.from_multisteps`` with a schedule outside Flax.
"""

import dataclasses
from collections.abc import Callable

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import optax_accum
from optax_accum import multisteps

pytestmark = [
  pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning"),
]


_LECUN = nnx.initializers.lecun_normal()


class _Model(nnx.Module):
  def __init__(self, rngs, kernel_init=_LECUN):
    self.a = nnx.Linear(4, 8, kernel_init=kernel_init, rngs=rngs)
    self.b = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def _batch(i, nan_at=()):
  x = jnp.sin(jnp.arange(16.0).reshape(4, 4) * (i + 1))
  if i in nan_at:
    x = x.at[0, 0].set(jnp.nan)
  return x, jnp.cos(x[:, :2])


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def _step(model, optimizer, x, y):
  optimizer.update(model, nnx.grad(_loss)(model, x, y))


def _params(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


# The trees an inner optimizer may be built on, from the model.
def _mask_state(model):
  return jax.tree.map(
    lambda p: p.ndim > 1, nnx.as_pure(nnx.state(model, nnx.Param))
  )


def _mask_dict(model):
  return jax.tree.map(
    lambda p: p.ndim > 1, nnx.to_pure_dict(nnx.state(model, nnx.Param))
  )


def _labels(model):
  return jax.tree.map(
    lambda p: "kernel" if p.ndim > 1 else "bias",
    nnx.as_pure(nnx.state(model, nnx.Param)),
  )


def _masked(mask):
  return optax.chain(
    optax.masked(optax.add_decayed_weights(0.1), mask), optax.adam(0.05)
  )


def _by_label(labels):
  return optax.multi_transform(
    {"kernel": optax.adam(0.05), "bias": optax.sgd(0.1, momentum=0.9)}, labels
  )


def _schedule(step):
  return jnp.where(step < 2, 2, 4)


@dataclasses.dataclass(frozen=True)
class Row:
  """A MultiSteps run and the accumulate that replaces it.

  `inner(model)` (and `ours_inner(model)` where the drop-in's differs, same
  maths) is the inner optimizer; `ms` the MultiSteps keywords (but the
  inner) and `acc` accumulate's; `saved_at` calls before the checkpoint;
  `nan_at` the calls whose batch holds a NaN.
  """

  inner: Callable
  ms: dict = dataclasses.field(default_factory=dict)
  acc: dict = dataclasses.field(default_factory=dict)
  ours_inner: Callable | None = None
  saved_at: int = 5
  nan_at: tuple = ()
  k: object = 3
  atol: float = 2e-6  # float32 rounding: MultiSteps averages, we sum


ROWS = {
  "adam": Row(lambda m: optax.adam(0.05)),
  "stateless sgd": Row(lambda m: optax.sgd(0.1)),
  "use_grad_mean=False": Row(
    lambda m: optax.adam(0.05),
    ms={"use_grad_mean": False},
    acc={"reduction": "sum"},
  ),
  "every_k schedule mid-cycle": Row(lambda m: optax.sgd(0.1), k=_schedule),
  "every_k schedule at a boundary": Row(
    lambda m: optax.sgd(0.1), k=_schedule, saved_at=4
  ),
  "should_skip_update_fn": Row(
    lambda m: optax.adam(0.05),
    ms={"should_skip_update_fn": optax.skip_not_finite},
    acc={"skip_nonfinite": True},
    nan_at=(1, 4),
  ),
  # MultiSteps rounds a running mean to bfloat16 at each add, accumulate a
  # running sum: the two cycle means differ by bfloat16 rounding.
  "bfloat16 accumulator": Row(
    lambda m: optax.adam(0.05),
    ms={"accumulator_dtype": jnp.bfloat16},
    acc={"accumulator_dtype": jnp.bfloat16},
    atol=3e-4,
  ),
  "chain": Row(
    lambda m: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.05))
  ),
  "mask from nnx.state": Row(lambda m: _masked(_mask_state(m))),
  "mask as nested dicts": Row(
    lambda m: _masked(_mask_state(m)),
    ours_inner=lambda m: _masked(_mask_dict(m)),
  ),
  "labels from nnx.state": Row(lambda m: _by_label(_labels(m))),
  "adamw(mask=)": Row(
    lambda m: optax.adamw(0.05, weight_decay=0.1, mask=_mask_state(m))
  ),
}

CALLS = 12


def _stock(row, model):
  tx = optax.MultiSteps(row.inner(model), row.k, **row.ms)
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _ours(row, model):
  inner = (row.ours_inner or row.inner)(model)
  tx = optax_accum.accumulate(inner, row.k, **row.acc)
  return optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)


def _through(via, tree, path):
  """`tree` saved and restored without a target, as `via` does it."""
  if via == "msgpack":
    return flax.serialization.msgpack_restore(flax.serialization.to_bytes(tree))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path)


def _saved_mid_run(row, via, path):
  """The stock run: its checkpoint at `row.saved_at` calls, and its params
  after each later call."""
  model = _Model(nnx.Rngs(0))
  optimizer = _stock(row, model)
  for i in range(row.saved_at):
    _step(model, optimizer, *_batch(i, row.nan_at))
  saved = _through(
    via,
    {
      "model": nnx.to_pure_dict(nnx.state(model)),
      "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
    },
    path,
  )
  later = []
  for i in range(row.saved_at, CALLS):
    _step(model, optimizer, *_batch(i, row.nan_at))
    later.append(_params(model))
  return saved, later


def _loaded(row, saved):
  model = _Model(nnx.Rngs(1))  # other values: all come from the checkpoint
  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, saved["model"])
  nnx.update(model, state)
  optimizer = _ours(row, model)
  optimizer.load(saved["optimizer"])
  return model, optimizer


@pytest.mark.parametrize("via", ["orbax", "msgpack"])
@pytest.mark.parametrize("row", list(ROWS))
def test_load_continues_each_multisteps_run_as_it_was(tmp_path, row, via):
  row = ROWS[row]
  saved, stock = _saved_mid_run(row, via, tmp_path / "ckpt")
  model, optimizer = _loaded(row, saved)
  assert int(optimizer.step[...]) == row.saved_at
  for n, i in enumerate(range(row.saved_at, CALLS)):
    _step(model, optimizer, *_batch(i, row.nan_at))
    chex.assert_trees_all_close(
      _params(model),
      stock[n],
      rtol=0,
      atol=row.atol,
      custom_message=f"call {i}",
    )
  # Not vacuously: the run went on through at least one update.
  assert not np.array_equal(stock[0]["a"]["kernel"], stock[-1]["a"]["kernel"])


@pytest.mark.parametrize(
  "row", ["mask from nnx.state", "labels from nnx.state"]
)
def test_an_inner_optimizer_built_on_the_model_s_state_gives_the_stock_s_updates(
  row,
):
  """The drop-in builds where the stock class builds, and each call's
  updates are the stock class's around the same accumulate."""
  row = ROWS[row]
  models = {c: _Model(nnx.Rngs(0)) for c in ("ours", "stock")}
  tx = {c: optax_accum.accumulate(row.inner(models[c]), row.k) for c in models}
  ours = optax_accum.flax.Optimizer(models["ours"], tx["ours"], wrt=nnx.Param)
  stock = nnx.Optimizer(models["stock"], tx["stock"], wrt=nnx.Param)
  for i in range(7):
    x, y = _batch(i)
    got = ours.update(models["ours"], nnx.grad(_loss)(models["ours"], x, y))
    want = stock.update(models["stock"], nnx.grad(_loss)(models["stock"], x, y))
    assert isinstance(got, nnx.State)
    chex.assert_trees_all_close(
      nnx.to_pure_dict(got), nnx.to_pure_dict(want), rtol=0, atol=1e-7
    )
  chex.assert_trees_all_close(
    _params(models["ours"]), _params(models["stock"]), rtol=0, atol=1e-7
  )


def test_load_keeps_the_inner_state_in_its_own_dtype():
  """A bfloat16 accumulator: Adam's float32 moments come in unrounded."""
  row = ROWS["bfloat16 accumulator"]
  saved, _ = _saved_mid_run(row, "msgpack", None)
  _, optimizer = _loaded(row, saved)
  mu = optimizer.opt_state.inner_state[0].mu["a"]["kernel"]
  assert mu.dtype == jnp.float32
  np.testing.assert_array_equal(
    np.asarray(mu),
    np.asarray(
      saved["optimizer"]["opt_state"]["inner_opt_state"]["0"]["mu"]["a"][
        "kernel"
      ]
    ),
  )


# ----------------------------------------------------------------------------
# The drop-in's own checkpoints, whatever the model's names.
# ----------------------------------------------------------------------------


class _Body(nnx.Module):
  def __init__(self, rngs):
    self.value = nnx.Linear(4, 8, rngs=rngs)  # a module named value


class _Scale(nnx.Module):
  def __init__(self):
    self.value = nnx.Param(jnp.ones(2))  # a param named value


class _Named(nnx.Module):
  """Levels whose one key is ``value``, the name a checkpointer also writes
  for each Variable: a module's and a param's."""

  def __init__(self, rngs):
    self.body = _Body(rngs)
    self.head = nnx.Linear(8, 2, rngs=rngs)
    self.scale = _Scale()

  def __call__(self, x):
    return self.head(jnp.tanh(self.body.value(x))) * self.scale.value[None]


@pytest.mark.parametrize("via", ["orbax", "msgpack"])
def test_load_takes_its_own_checkpoint_whatever_the_names(tmp_path, via):
  tx = lambda: optax_accum.accumulate(optax.adam(0.05), 3)  # noqa: E731
  model = _Named(nnx.Rngs(0))
  optimizer = optax_accum.flax.Optimizer(model, tx(), wrt=nnx.Param)
  for i in range(4):
    _step(model, optimizer, *_batch(i))
  saved = _through(
    via,
    {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    if via == "orbax"
    else nnx.to_pure_dict(nnx.state({"model": model, "optimizer": optimizer})),
    tmp_path / "ckpt",
  )
  for i in range(4, 8):
    _step(model, optimizer, *_batch(i))
  uninterrupted = _params(model)

  model = _Named(nnx.Rngs(1))
  loaded = optax_accum.flax.Optimizer(model, tx(), wrt=nnx.Param)
  loaded.load(saved["optimizer"])
  state = nnx.state(model)
  nnx.replace_by_pure_dict(
    state, jax.tree.map(np.asarray, _unvalued(saved["model"], via))
  )
  nnx.update(model, state)
  assert int(loaded.opt_state.micro_step) == 1
  for i in range(4, 8):
    _step(model, loaded, *_batch(i))
  chex.assert_trees_all_equal(_params(model), uninterrupted)


def _unvalued(tree, via):
  """A model state restored by Orbax has a ``value`` level per Variable."""
  if via != "orbax":
    return tree
  if (
    isinstance(tree, dict)
    and "value" in tree
    and not isinstance(tree["value"], dict)
  ):
    return tree["value"]
  return {k: _unvalued(v, via) for k, v in tree.items()}


# ----------------------------------------------------------------------------
# On a mesh: every leaf lands with its param's sharding.
# ----------------------------------------------------------------------------


def _saved_by_ours(row, path):
  model = _Model(nnx.Rngs(0))
  optimizer = _ours(row, model)
  for i in range(row.saved_at):
    _step(model, optimizer, *_batch(i))
  return {"optimizer": _through("orbax", nnx.state(optimizer), path)}


SOURCES = {
  "MultiSteps adam": lambda path: _saved_mid_run(ROWS["adam"], "orbax", path)[
    0
  ],
  "MultiSteps masked": lambda path: _saved_mid_run(
    ROWS["mask from nnx.state"], "orbax", path
  )[0],
  "its own": lambda path: _saved_by_ours(ROWS["adam"], path),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_load_on_a_mesh_places_each_leaf_as_its_param(tmp_path, source):
  saved = SOURCES[source](tmp_path / "ckpt")
  row = ROWS["mask from nnx.state" if "masked" in source else "adam"]
  mesh = jax.make_mesh(
    (8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "fsdp"))
  with jax.set_mesh(mesh):
    model = _Model(nnx.Rngs(1), kernel_init=init)
    optimizer = _ours(row, model)
  before = jax.tree.map(lambda x: x.sharding, nnx.as_pure(optimizer.opt_state))
  optimizer.load(saved["optimizer"])
  after = jax.tree.map(lambda x: x.sharding, nnx.as_pure(optimizer.opt_state))
  chex.assert_trees_all_equal(after, before)
  kernel = optimizer.opt_state.acc_grads["a"]["kernel"]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
  assert int(optimizer.opt_state.micro_step) == 2


# ----------------------------------------------------------------------------
# from_multisteps with a schedule, outside Flax (the migration guide's route
# and the linen TrainState's).
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("saved_at", [4, 5], ids=["boundary", "mid-cycle"])
def test_from_multisteps_with_tx_keeps_the_schedule_s_cycle(saved_at):
  """where(step < 2, 2, 4): converted after 2 cycles, the next update comes
  at call 7 as in MultiSteps (it came at call 5 with schedule(0)'s k)."""
  params = jnp.zeros(2)
  grads = lambda i: jnp.array([1.0, -2.0]) * (i + 1)  # noqa: E731
  old = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=_schedule)
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=_schedule)
  ms = old.init(params)
  for i in range(saved_at):
    _, ms = old.update(grads(i), ms, params)
  state = multisteps.from_multisteps(ms, tx.init(params), tx=tx)
  for i in range(saved_at, 13):
    want, ms = old.update(grads(i), ms, params)
    got, state = tx.update(grads(i), state, params)
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"call {i}")
    assert bool(optax_accum.has_updated(state)) == bool(old.has_updated(ms))
  assert int(state.step) == int(ms.gradient_step) == 4


def test_linen_train_state_route_names_tx_and_keeps_the_schedule():
  """The TrainState's restore error prints the call to make; made as
  printed, the cycle is MultiSteps'."""
  from optax_accum.flax import _linen  # noqa: PLC0415

  assert "tx=state.tx" in _linen._FIX
  params = {"w": jnp.zeros(2)}
  old = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=_schedule)
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=_schedule)
  state = optax_accum.flax.TrainState.create(
    apply_fn=None, params=params, tx=tx
  )
  ms = old.init(params)
  for _ in range(4):
    _, ms = old.update({"w": jnp.ones(2)}, ms, params)
  restored = state.replace(opt_state=ms)
  restored = restored.replace(
    opt_state=multisteps.from_multisteps(
      restored.opt_state, state.opt_state, tx=state.tx
    )
  )
  assert int(optax_accum.current_every_k(restored.opt_state)) == 4
