"""``optax_accum.inspect.check_step``: it passes the documented recipes as
printed and flags each planted fault with its fix: no donation,
``optax.apply_updates`` in the traced step, a ``lax.cond`` turned into
selects, a transformation after ``accumulate``."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import optax
import pytest
import test_docs

import optax_accum
from optax_accum import _control
from optax_accum.inspect import assert_step, check_step

WIDTH = 128
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _problem():
  params = {"w1": jnp.zeros((WIDTH, WIDTH)), "w2": jnp.zeros((WIDTH, WIDTH))}
  x = jnp.ones((8, WIDTH))
  return params, x


def _loss(params, x):
  return jnp.sum(jnp.tanh(jnp.tanh(x @ params["w1"]) @ params["w2"]))


def _step(tx, apply="ours", donate=(0, 1)):
  def step(params, state, x):
    grads = jax.grad(_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    if apply == "ours":
      return optax_accum.apply_updates(params, updates, state), state
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=donate)


def _check(step, tx, **kwargs):
  params, x = _problem()
  return check_step(step, params, tx.init(params), x, **kwargs)


def test_the_hand_written_step_passes():
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)
  report = _check(_step(tx), tx)
  assert report.problems == (), str(report)
  assert report.conditionals >= 1 and report.undonated == ()
  assert "no problem found" in str(report)
  assert_step(_step(tx), *_problem()[:1], tx.init(_problem()[0]), _problem()[1])


def test_the_readme_quick_start_as_printed_passes():
  """The quick start's own `train_step`, run from the README's text."""
  block = next(
    b for b in test_docs.python_blocks(README) if "def train_step" in b.code
  )
  namespace = {}
  exec(block.code.split("opt_state = tx.init")[0], namespace)
  tx, params = namespace["tx"], namespace["params"]
  batch = namespace["micro_batches"][0]
  report = check_step(namespace["train_step"], params, tx.init(params), batch)
  assert report.problems == (), str(report)


def test_no_donation_is_flagged_with_the_fix():
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)
  report = _check(_step(tx, donate=()), tx)
  assert report.undonated == (0, 1)
  assert any("argument(s) 0, 1 " in p for p in report.problems)
  assert any("donate_argnums=(0, 1)" in p for p in report.problems)
  assert report.copies  # what the missing donation costs
  with pytest.raises(AssertionError, match="not donated"):
    params, x = _problem()
    assert_step(_step(tx, donate=()), params, tx.init(params), x)


def test_optax_apply_updates_is_flagged_with_the_fix():
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)
  report = _check(_step(tx, apply="optax"), tx)
  assert any("use optax_accum.apply_updates" in p for p in report.problems)


def test_a_transformation_after_accumulate_is_flagged():
  tx = optax.chain(
    optax_accum.accumulate(optax.adam(1e-3), 4), optax.scale(1.0)
  )
  # apply_updates says so too, as it applies by its slow route.
  with pytest.warns(UserWarning, match="transformed after it"):
    report = _check(_step(tx), tx)
  assert any("put accumulate last" in p for p in report.problems)


def _selects(pred, true_fun, false_fun, *operands):
  """A conditional turned into selects: both branches run every call."""
  true, false = true_fun(*operands), false_fun(*operands)
  return jax.tree.map(lambda t, f: jnp.where(pred, t, f), true, false)


def test_a_cond_turned_into_selects_is_flagged(monkeypatch):
  monkeypatch.setattr(_control, "cond", _selects)
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)
  report = _check(_step(tx), tx)
  assert report.conditionals == 0
  assert any("no conditional" in p for p in report.problems)


@pytest.mark.parametrize("emit", [False, True])
def test_a_static_step_passes_when_told(emit):
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, x):
    grads = jax.grad(_loss)(params, x)
    updates, state = tx.update(grads, state, params, emit=emit)
    return optax_accum.apply_updates(params, updates, state), state

  assert _check(step, tx, emit=emit).problems == ()
  assert any("pass emit= here" in p for p in _check(step, tx).problems)


def test_args_without_an_accumulate_state_name_the_argument():
  with pytest.raises(ValueError, match="`args` must hold exactly one"):
    check_step(jax.jit(lambda x: x), jnp.ones(2))


# ---------------------------------------------------------------------------
# nnx.jit steps, and the gradient reduced on every micro-step.
# ---------------------------------------------------------------------------


def _nnx_check(optimizer_class, donate=(0, 1)):
  from flax import nnx

  model = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)
  optimizer = optimizer_class(model, tx, wrt=nnx.Param)

  @functools.partial(nnx.jit, donate_argnums=donate)
  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(jnp.tanh(m(x)) ** 2))(model)
    optimizer.update(model, grads)

  x = jnp.ones((8, WIDTH))
  step(model, optimizer, x)  # a cached trace must not hide the update
  return check_step(step, model, optimizer, x)


def test_an_nnx_jit_step_with_the_drop_in_passes():
  report = _nnx_check(optax_accum.flax.Optimizer)
  assert report.problems == () and report.conditionals >= 1, str(report)


def test_an_nnx_jit_step_with_the_stock_optimizer_is_flagged():
  from flax import nnx

  report = _nnx_check(nnx.Optimizer)
  assert any("use optax_accum.apply_updates" in p for p in report.problems)


def test_an_undonated_nnx_jit_step_names_the_model_and_optimizer():
  report = _nnx_check(optax_accum.flax.Optimizer, donate=())
  assert report.undonated == (0, 1) and report.copies, str(report)
  assert any("nnx.jit" in p for p in report.problems)


def _nnx_partial_check(optimizer_class, donate=0, bound=2):
  """The NNX guide's fast form: ``nnx.jit_partial(..., graph=False)``,
  checked with its bound objects passed first (`bound` of them)."""
  from flax import nnx

  model = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)
  optimizer = optimizer_class(model, tx, wrt=nnx.Param)

  def train_step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(jnp.tanh(m(x)) ** 2))(model)
    optimizer.update(model, grads)

  step = nnx.jit_partial(
    train_step, model, optimizer, graph=False, donate_argnums=donate
  )
  x = jnp.ones((8, WIDTH))
  step(x)  # a cached trace must not hide the update
  return check_step(step, *(model, optimizer)[:bound], x)


def test_an_nnx_jit_partial_step_with_the_drop_in_passes():
  report = _nnx_partial_check(optax_accum.flax.Optimizer)
  assert report.problems == () and report.conditionals >= 1, str(report)


def test_an_nnx_jit_partial_step_is_flagged_as_nnx_jit_is():
  from flax import nnx

  stock = _nnx_partial_check(nnx.Optimizer)
  assert any("use optax_accum.apply_updates" in p for p in stock.problems)
  undonated = _nnx_partial_check(optax_accum.flax.Optimizer, donate=())
  assert undonated.undonated == (0, 1) and undonated.copies, str(undonated)
  assert any("donate_argnums=0" in p for p in undonated.problems)


def test_an_nnx_jit_partial_step_without_its_bound_objects_says_so():
  with pytest.raises(ValueError, match="pass the objects bound to it first"):
    _nnx_partial_check(optax_accum.flax.Optimizer, bound=1)


def _data_parallel_check(deferred: bool, emit=None, **kwargs):
  """Params replicated, the batch split over 8 CPU devices."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  axis = "data" if deferred else None
  tx = optax_accum.accumulate(optax.adam(1e-3), 4, axis_name=axis)
  if deferred:
    grad_fn = optax_accum.distributed.local_value_and_grad(_loss)
  else:
    grad_fn = jax.value_and_grad(_loss)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, x):
    _, grads = grad_fn(params, x)
    updates, state = tx.update(grads, state, params, emit=emit)
    return optax_accum.apply_updates(params, updates, state), state

  with jax.set_mesh(mesh):
    params = jax.device_put(_problem()[0], NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((16, WIDTH)), NamedSharding(mesh, P("data")))
    return check_step(step, params, tx.init(params), x, emit=emit, **kwargs)


def test_a_gradient_reduced_every_micro_step_is_flagged_with_the_fix():
  report = _data_parallel_check(deferred=False)
  assert report.reductions, str(report)
  (problem,) = [p for p in report.problems if "reduction" in p]
  assert "axis_name=" in problem and "local_value_and_grad" in problem
  assert "optax_accum.flax.local_value_and_grad" in problem


def test_a_deferred_reduction_passes():
  report = _data_parallel_check(deferred=True)
  assert report.reductions == () and report.problems == (), str(report)


def test_the_emitting_static_step_may_reduce():
  """`emit=True` reduces by design: its call ends the cycle."""
  report = _data_parallel_check(deferred=True, emit=True)
  assert report.reductions == () and report.problems == (), str(report)


def test_an_unknown_target_names_the_argument():
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)
  params, x = _problem()
  with pytest.raises(ValueError, match="`target` 'h200' is not a known"):
    check_step(_step(tx), params, tx.init(params), x, target="h200")


# ---------------------------------------------------------------------------
# target=: the documented recipes checked for an H100 and 8 H100s without
# them (tests/_recipes_accel_worker.py, shared with tests/test_recipes.py).
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_targets(tmp_path_factory):
  import _common

  return _common.recipes_on_accelerators(_common.run_folder(tmp_path_factory))


def test_target_passes_every_recipe(on_targets):
  clean = {k: f for k, f in on_targets.items() if k.startswith("clean/")}
  assert {f["target"] for f in clean.values()} == {"h100", "h100x8"}
  assert {k: f["problems"] for k, f in clean.items() if f["problems"]} == {}


@pytest.mark.parametrize(
  ("plant", "flag"),
  [
    ("no_donation", "not donated"),
    ("optax_apply", "use optax_accum.apply_updates"),
  ],
)
def test_target_flags_each_planted_recipe(on_targets, plant, flag):
  planted = {k: f for k, f in on_targets.items() if k.startswith(plant)}
  assert len(planted) >= 9
  unflagged = [
    k for k, f in planted.items() if not any(flag in p for p in f["problems"])
  ]
  assert unflagged == []


def _hsdp_check(**kwargs):
  """HSDP: params sharded over "fsdp" (reduce-scattered on every call, by
  design), the reduction deferred over "replica"."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (2, 4), ("replica", "fsdp"), axis_types=(AxisType.Explicit,) * 2
  )
  tx = optax_accum.accumulate(optax.adam(1e-3), 4, axis_name="replica")

  def fsdp_loss(params, x):
    gathered = jax.tree.map(lambda p: jax.sharding.reshard(p, P()), params)
    return _loss(gathered, x)

  grad_fn = optax_accum.distributed.local_value_and_grad(
    fsdp_loss, axis_name="replica"
  )

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, x):
    _, grads = grad_fn(params, x)
    updates, state = tx.update(grads, state, params)
    return optax_accum.apply_updates(params, updates, state), state

  with jax.set_mesh(mesh):
    params = jax.device_put(_problem()[0], NamedSharding(mesh, P("fsdp")))
    x = jax.device_put(
      jnp.ones((16, WIDTH)), NamedSharding(mesh, P(("replica", "fsdp")))
    )
    return check_step(step, params, tx.init(params), x, **kwargs)


def test_hsdp_fsdp_reduction_counts_unless_the_deferred_axis_is_named():
  """Without `axis_name` the per-call reduce-scatter within a replica is
  flagged, and the message says to name the deferred axis; with
  ``axis_name="replica"`` the step passes (its reduction across replicas
  runs once per cycle)."""
  flagged = _hsdp_check()
  assert flagged.reductions, str(flagged)
  (problem,) = [p for p in flagged.problems if "reduction" in p]
  assert "check_step(..., axis_name=...)" in problem
  named = _hsdp_check(axis_name="replica")
  assert named.reductions == () and named.problems == (), str(named)


def test_axis_name_still_flags_a_reduction_across_it():
  """Naming the axis filters by axis, not away: the undeferred
  data-parallel step still reduces across "data" on every call."""
  with pytest.raises(AssertionError, match="reduction"):
    _data_parallel_assert(axis_name="data")


def _data_parallel_assert(**kwargs):
  report = _data_parallel_check(deferred=False, **kwargs)
  if report.problems:
    raise AssertionError(str(report))


@pytest.mark.parametrize(
  "axis_name, error, match",
  [
    (3, TypeError, "`axis_name` must be"),
    ("model", ValueError, "`axis_name` 'model' is not an axis"),
  ],
)
def test_a_bad_axis_name_names_the_argument(axis_name, error, match):
  with pytest.raises(error, match=match):
    _data_parallel_check(deferred=False, axis_name=axis_name)
