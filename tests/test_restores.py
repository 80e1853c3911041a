"""An ``optax.MultiSteps`` checkpoint restored into the switched code, route
by route: it comes in with one call (``multisteps.restore_target(tx,
params)``, then ``from_multisteps``) and the run resumes within 1e-6 of the
unswitched one; restored the codebase's old way, it is loud (an error
naming ``from_multisteps`` where our code runs at restore time, the
framework's own error or :func:`multisteps.check_restored` elsewhere),
never silently trained on.

Routes: equinox ``tree_deserialise_leaves``; Orbax ``StandardCheckpointer``
(strict and ``partial_restore=True``); ``flax.training.checkpoints`` and
``flax.serialization`` into ``optax_accum.flax.TrainState`` and a user's
subclass of it (jitted and ``pmap``ped steps); an NNX optimizer restored
into ``nnx.State`` then ``nnx.update``. Each checkpoint is saved mid-cycle
and at a cycle boundary (zeros in ``acc_grads``: only the counters tell)."""

from typing import Any

import equinox as eqx
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import jax_utils, nnx
from flax.training import checkpoints, train_state

import optax_accum
from optax_accum import multisteps

K, CALLS = 3, 14
# Where the checkpoint is saved: mid-cycle (8 = 2 * 3 + 2), at a boundary.
SWITCHES = {"mid_cycle": 8, "boundary": 6}
FROM_MULTISTEPS = r"multisteps\.from_multisteps"

pytestmark = [
  # Orbax on CPU arrays without a sharding; flax's Orbax route.
  pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning"),
  pytest.mark.filterwarnings("ignore:.*transformations API:UserWarning"),
]


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.ones(3)}


def _grads(i):
  return jax.tree.map(lambda p: jnp.sin(p * (i + 1)) + 0.1 * i, _params())


def _inner():
  return optax.adam(optax.linear_schedule(0.05, 0.01, 4))


def _old():
  return optax.MultiSteps(_inner(), every_k_schedule=K)


def _new():
  return optax_accum.accumulate(_inner(), every_k=K)


def _close(a, b):
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=1e-6), a, b
  )


def _far(a, b):
  return max(
    float(jnp.max(jnp.abs(x - y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def test_restore_target_is_the_multisteps_init():
  params = {"w": jnp.zeros((2, 3), jnp.bfloat16), "b": jnp.zeros(3)}
  for skip in (False, True):
    tx = optax_accum.accumulate(_inner(), K, skip_nonfinite=skip)
    old = optax.MultiSteps(
      _inner(), K, should_skip_update_fn=optax.skip_not_finite if skip else None
    )
    target = multisteps.restore_target(tx, params)
    assert isinstance(target, optax.MultiStepsState)
    want = old.init(params)
    assert jax.tree.structure(target) == jax.tree.structure(want)
    for got, ref in zip(
      jax.tree.leaves(target), jax.tree.leaves(want), strict=True
    ):
      assert got.dtype == ref.dtype and got.shape == ref.shape
  with pytest.raises(TypeError, match="`restore_target` needs the trans"):
    multisteps.restore_target(optax.chain(optax.clip(1.0), _new()), params)


ACCUMULATOR_DTYPES = {
  "float32": jnp.float32,
  "None": None,
  "bf16": jnp.bfloat16,
}


@pytest.mark.parametrize(
  "accumulator_dtype", ACCUMULATOR_DTYPES.values(), ids=ACCUMULATOR_DTYPES
)
def test_restore_target_takes_the_accumulator_dtype_of_tx(
  tmp_path, accumulator_dtype
):
  """A run that kept its accumulator_dtype when it moved saved its
  MultiSteps checkpoint with that dtype: the target has it (bf16 params
  tell None from float32), the restore keeps it, and the run goes on; an
  explicit accumulator_dtype= still wins (issue 55)."""
  params = {"w": jnp.zeros((2, 3), jnp.bfloat16), "b": jnp.zeros(3)}
  tx = optax_accum.accumulate(
    optax.sgd(0.1), K, accumulator_dtype=accumulator_dtype
  )
  old = optax.MultiSteps(optax.sgd(0.1), K, accumulator_dtype=accumulator_dtype)
  grads = jax.tree.map(lambda p: jnp.ones(p.shape, p.dtype), params)
  # One micro-batch in (MultiSteps' own update fails for None with bf16
  # params, optax 0.2.8: its branches' accumulator dtypes differ).
  fresh = old.init(params)
  saved = fresh._replace(
    mini_step=jnp.ones([], jnp.int32),
    acc_grads=jax.tree.map(
      lambda a, g: g.astype(a.dtype), fresh.acc_grads, grads
    ),
  )
  for target in (
    multisteps.restore_target(tx, params),
    multisteps.equivalent(tx).init(params),
  ):
    for got, want in zip(
      jax.tree.leaves(target), jax.tree.leaves(saved), strict=True
    ):
      assert got.dtype == want.dtype, (accumulator_dtype, got, want)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", saved)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(
    tmp_path / "ckpt", multisteps.restore_target(tx, params)
  )
  state = multisteps.from_multisteps(restored, tx.init(params))
  assert int(state.micro_step) == 1
  jax.tree.map(
    lambda a, b: np.testing.assert_array_equal(
      np.asarray(a, np.float32), np.asarray(b, np.float32)
    ),
    state.acc_grads,
    grads,
  )
  wide = multisteps.restore_target(tx, params, accumulator_dtype=jnp.float32)
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(wide.acc_grads))


EVERY_K = {"fixed": K, "schedule": lambda step: 2 + step % 2}


@pytest.mark.parametrize("every_k", EVERY_K.values(), ids=EVERY_K)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_equivalent_is_the_multisteps_tx_replaces(every_k, reduction):
  """The same updates, call by call, as the accumulate it is built from
  (sgd: adam would hide a mean taken for a sum)."""
  tx = optax_accum.accumulate(optax.sgd(0.1), every_k, reduction=reduction)
  old = multisteps.equivalent(tx)
  params = _params()
  state, ms_state = tx.init(params), old.init(params)
  for i in range(10):
    updates, state = tx.update(_grads(i), state, params)
    ms_updates, ms_state = old.update(_grads(i), ms_state, params)
    _close(updates, ms_updates)
  assert int(state.step) == int(ms_state.gradient_step) >= 3


# ----------------------------------------------------------------------------
# Equinox: tree_serialise_leaves of (model, opt_state).
# ----------------------------------------------------------------------------


def _eqx_model():
  return eqx.nn.MLP(3, 2, width_size=4, depth=1, key=jax.random.key(0))


def _eqx_batch(i):
  x = jnp.sin(jnp.arange(12.0).reshape(4, 3) * (i + 1))
  return x, jnp.cos(x[:, :2])


def _eqx_run(tx, model, state, calls):
  @eqx.filter_jit(donate="all")
  def step(model, state, x, y):
    def loss(m):
      return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    grads = eqx.filter_grad(loss)(model)
    updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state

  for i in calls:
    model, state = step(model, state, *_eqx_batch(i))
  return model, state


def _eqx_init(tx, model):
  return tx.init(eqx.filter(model, eqx.is_array))


@pytest.mark.parametrize("switch", SWITCHES.values(), ids=SWITCHES)
def test_equinox_checkpoint_comes_in_with_one_call(tmp_path, switch):
  old, tx = _old(), _new()
  model = _eqx_model()
  unswitched, _ = _eqx_run(old, model, _eqx_init(old, model), range(CALLS))
  model = _eqx_model()
  saved = _eqx_run(old, model, _eqx_init(old, model), range(switch))
  eqx.tree_serialise_leaves(tmp_path / "ckpt.eqx", saved)

  model = _eqx_model()  # the switched code starts here
  params = eqx.filter(model, eqx.is_array)
  # The codebase's way, into the accumulate state: equinox's own error
  # (EOFError at a boundary, TreePathError mid-cycle, neither ours).
  with pytest.raises((EOFError, RuntimeError)):
    eqx.tree_deserialise_leaves(tmp_path / "ckpt.eqx", (model, tx.init(params)))
  # The documented call.
  model, ms_state = eqx.tree_deserialise_leaves(
    tmp_path / "ckpt.eqx", (model, multisteps.restore_target(tx, params))
  )
  state = multisteps.from_multisteps(ms_state, tx.init(params))
  switched, _ = _eqx_run(tx, model, state, range(switch, CALLS))
  _close(
    eqx.filter(switched, eqx.is_array), eqx.filter(unswitched, eqx.is_array)
  )
  assert (
    _far(
      eqx.filter(switched, eqx.is_array), eqx.filter(_eqx_model(), eqx.is_array)
    )
    > 1e-2
  )


# ----------------------------------------------------------------------------
# Orbax StandardCheckpointer: a bare optimizer state.
# ----------------------------------------------------------------------------


def _run(tx, params, state, calls):
  update = jax.jit(tx.update)
  for i in calls:
    updates, state = update(_grads(i), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _orbax_save(path, tree):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tree)
  checkpointer.wait_until_finished()
  return checkpointer


@pytest.mark.parametrize("switch", SWITCHES.values(), ids=SWITCHES)
def test_orbax_checkpoint_comes_in_with_one_call(tmp_path, switch):
  old, tx = _old(), _new()
  unswitched, _ = _run(old, _params(), old.init(_params()), range(CALLS))
  params, ms_state = _run(old, _params(), old.init(_params()), range(switch))
  checkpointer = _orbax_save(
    tmp_path / "ckpt", {"params": params, "opt": ms_state}
  )

  target = {"params": _params(), "opt": tx.init(_params())}
  with pytest.raises(ValueError):  # strict: Orbax's own error
    checkpointer.restore(tmp_path / "ckpt", target)
  restored = checkpointer.restore(
    tmp_path / "ckpt",
    {"params": _params(), "opt": multisteps.restore_target(tx, _params())},
  )
  params = restored["params"]
  state = multisteps.from_multisteps(restored["opt"], tx.init(params))
  switched, _ = _run(tx, params, state, range(switch, CALLS))
  _close(switched, unswitched)


@pytest.mark.parametrize("switch", SWITCHES.values(), ids=SWITCHES)
def test_orbax_partial_restore_is_caught_by_check_restored(tmp_path, switch):
  """No code of ours runs in a partial restore: it fills the fields the
  file lacks from the target, silently; `check_restored` with the run's
  call count says so, mid-cycle and at a boundary."""
  old, tx = _old(), _new()
  params, ms_state = _run(old, _params(), old.init(_params()), range(switch))
  _orbax_save(tmp_path / "ckpt", {"calls": jnp.int32(switch), "opt": ms_state})
  restored = ocp.PyTreeCheckpointer().restore(
    tmp_path / "ckpt",
    args=ocp.args.PyTreeRestore(
      item={"calls": jnp.int32(0), "opt": tx.init(params)},
      partial_restore=True,
    ),
  )
  assert int(restored["opt"].micro_step) == 0  # the fresh target's
  with pytest.raises(ValueError, match=FROM_MULTISTEPS):
    multisteps.check_restored(restored["opt"], calls=restored["calls"])
  if switch % K:  # mid-cycle: acc_grads alone tells
    with pytest.raises(ValueError, match=FROM_MULTISTEPS):
      multisteps.check_restored(restored["opt"])
  # A run's own checkpoint passes, fresh or not.
  _, own = _run(tx, params, tx.init(params), range(switch))
  multisteps.check_restored(own, calls=switch)
  multisteps.check_restored(tx.init(params), calls=0)


# ----------------------------------------------------------------------------
# flax linen: flax.training.checkpoints and flax.serialization into the
# TrainState drop-in and a user's subclass of it.
# ----------------------------------------------------------------------------


class _UserState(optax_accum.flax.TrainState):
  """A trainer's own TrainState, with a field of its own."""

  calls_seen: Any = 0


class _OldUserState(train_state.TrainState):
  calls_seen: Any = 0


STATES = {
  "drop_in": (train_state.TrainState, optax_accum.flax.TrainState),
  "subclass": (_OldUserState, _UserState),
}


def _apply(params, x):
  return jnp.tanh(x @ params["w"]) + params["b"][None]


def _linen_batch(i):
  return jnp.sin(jnp.arange(8.0).reshape(4, 2) * (i + 1)), jnp.cos(
    jnp.arange(12.0).reshape(4, 3) * (i + 1)
  )


def _loss(params, x, y):
  return jnp.mean((_apply(params, x) - y) ** 2)


@jax.jit
def _jit_step(state, x, y):
  return state.apply_gradients(grads=jax.grad(_loss)(state.params, x, y))


def _pmap_step(pmean):
  def step(state, x, y):
    grads = jax.grad(_loss)(state.params, x, y)
    if pmean:  # MultiSteps (or accumulation off): reduce on every call
      grads = jax.lax.pmean(grads, "batch")
    return state.apply_gradients(grads=grads)

  return jax.pmap(step, axis_name="batch")


def _linen_run(state, calls, pmapped):
  if not pmapped:
    for i in calls:
      state = _jit_step(state, *_linen_batch(i))
    return state
  n = jax.local_device_count()
  # MultiSteps reduces on every call; accumulate(axis_name=) once a cycle.
  step = _pmap_step(pmean=isinstance(state.opt_state, optax.MultiStepsState))
  state = jax_utils.replicate(state)
  for i in calls:  # every device the same rows: the mean is the batch's
    x, y = (jnp.stack([b] * n) for b in _linen_batch(i))
    state = step(state, x, y)
  return jax_utils.unreplicate(state)


def _old_state(cls, switch):
  state = cls.create(
    apply_fn=_apply, params=_params(), tx=_old().gradient_transformation()
  )
  return _linen_run(state, range(switch), pmapped=False)


def _new_state(cls, pmapped):
  tx = optax_accum.accumulate(
    _inner(), K, axis_name="batch" if pmapped else None
  )
  return cls.create(apply_fn=_apply, params=_params(), tx=tx)


@pytest.mark.parametrize("pmapped", [False, True], ids=["jit", "pmap"])
@pytest.mark.parametrize("kind", STATES)
@pytest.mark.parametrize("switch", SWITCHES.values(), ids=SWITCHES)
def test_linen_checkpoint_is_refused_then_comes_in_with_one_call(
  tmp_path, switch, kind, pmapped
):
  old_cls, new_cls = STATES[kind]
  unswitched = _old_state(old_cls, CALLS)
  checkpoints.save_checkpoint(tmp_path, _old_state(old_cls, switch), switch)

  state = _new_state(new_cls, pmapped)  # the switched trainer starts here
  # The trainer's own restore: refused before the first step.
  with pytest.raises(ValueError, match=FROM_MULTISTEPS):
    checkpoints.restore_checkpoint(tmp_path, target=state)
  # The documented call.
  restored = checkpoints.restore_checkpoint(
    tmp_path,
    target=state.replace(
      opt_state=multisteps.restore_target(state.tx, state.params)
    ),
  )
  state = restored.replace(
    opt_state=multisteps.from_multisteps(restored.opt_state, state.opt_state)
  )
  assert int(state.step) == switch
  switched = _linen_run(state, range(switch, CALLS), pmapped)
  _close(switched.params, unswitched.params)
  assert _far(switched.params, _params()) > 1e-2


@pytest.mark.parametrize("switch", SWITCHES.values(), ids=SWITCHES)
def test_flax_own_train_state_restores_silently_check_restored_tells(
  tmp_path, switch
):
  """No code of ours runs when the target is flax's own TrainState: the
  restore fills the missing fields from the target, silently (as the guide
  says); `check_restored` with the restored step catches it."""
  checkpoints.save_checkpoint(
    tmp_path, _old_state(train_state.TrainState, switch), switch
  )
  state = _new_state(train_state.TrainState, pmapped=False)
  restored = checkpoints.restore_checkpoint(tmp_path, target=state)
  assert int(restored.step) == switch
  assert int(restored.opt_state.micro_step) == 0  # the fresh target's
  with pytest.raises(ValueError, match=FROM_MULTISTEPS):
    multisteps.check_restored(restored.opt_state, calls=restored.step)


@pytest.mark.parametrize("kind", STATES)
@pytest.mark.parametrize("switch", SWITCHES.values(), ids=SWITCHES)
def test_flax_serialization_into_a_train_state_names_the_converter(
  switch, kind
):
  old_cls, new_cls = STATES[kind]
  saved = _old_state(old_cls, switch)
  state = _new_state(new_cls, pmapped=False)
  with pytest.raises(ValueError, match=FROM_MULTISTEPS):
    flax.serialization.from_state_dict(
      state, flax.serialization.to_state_dict(saved)
    )
  with pytest.raises(ValueError, match=FROM_MULTISTEPS):
    flax.serialization.from_bytes(state, flax.serialization.to_bytes(saved))
  # A hand-merged state dict (what a lenient restorer gives) too.
  merged = flax.serialization.to_state_dict(saved)
  merged["opt_state"] = flax.serialization.to_state_dict(state.opt_state) | {
    k: v for k, v in merged["opt_state"].items() if k == "acc_grads"
  }
  with pytest.raises(ValueError, match=FROM_MULTISTEPS):
    flax.serialization.from_state_dict(state, merged)


@pytest.mark.parametrize("kind", STATES)
def test_a_train_state_restores_its_own_checkpoints(tmp_path, kind):
  """The check passes what the switched trainer saves: fresh, mid-cycle, at
  a boundary; and a TrainState without accumulate (accumulation off)."""
  _, new_cls = STATES[kind]
  for calls in (0, 2, 3, 5):
    state = _linen_run(_new_state(new_cls, False), range(calls), False)
    back = flax.serialization.from_bytes(
      _new_state(new_cls, False), flax.serialization.to_bytes(state)
    )
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
      np.testing.assert_array_equal(a, b)
  off = new_cls.create(apply_fn=_apply, params=_params(), tx=_inner())
  off = _linen_run(off, range(2), False)
  fresh = new_cls.create(apply_fn=_apply, params=_params(), tx=_inner())
  flax.serialization.from_bytes(fresh, flax.serialization.to_bytes(off))
  checkpoints.save_checkpoint(tmp_path, state, 5)
  checkpoints.restore_checkpoint(tmp_path, target=_new_state(new_cls, False))


# ----------------------------------------------------------------------------
# NNX: Orbax into nnx.State, then nnx.update.
# ----------------------------------------------------------------------------


def _nnx_model():
  return nnx.Linear(2, 3, rngs=nnx.Rngs(0))


def _nnx_run(model, optimizer, calls):
  @nnx.jit
  def step(model, optimizer, x, y):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)

  for i in calls:
    step(model, optimizer, *_linen_batch(i))
  return model, optimizer


@pytest.mark.parametrize("switch", SWITCHES.values(), ids=SWITCHES)
def test_nnx_partial_restore_then_update_is_caught_by_check_restored(
  tmp_path, switch
):
  model = _nnx_model()
  optimizer = nnx.Optimizer(model, _old(), wrt=nnx.Param)
  _nnx_run(model, optimizer, range(switch))
  _orbax_save(
    tmp_path / "ckpt", nnx.to_pure_dict(nnx.state((model, optimizer)))
  )
  model = _nnx_model()
  optimizer = optax_accum.flax.Optimizer(model, _new(), wrt=nnx.Param)
  target = nnx.to_pure_dict(nnx.state((model, optimizer)))
  with pytest.raises(ValueError):  # strict: Orbax's own error
    ocp.StandardCheckpointer().restore(tmp_path / "ckpt", target)
  restored = ocp.PyTreeCheckpointer().restore(
    tmp_path / "ckpt",
    args=ocp.args.PyTreeRestore(item=target, partial_restore=True),
  )
  state = nnx.state((model, optimizer))
  nnx.replace_by_pure_dict(state, restored)
  nnx.update((model, optimizer), state)
  with pytest.raises(ValueError, match=r"optimizer\.load\(restored_optimizer"):
    multisteps.check_restored(optimizer.opt_state, calls=optimizer.step)


@pytest.mark.parametrize("switch", SWITCHES.values(), ids=SWITCHES)
def test_nnx_checkpoint_comes_in_with_one_call(tmp_path, switch):
  """The NNX route of the guide: the stock nnx.Optimizer(MultiSteps)
  checkpoint restored without a target, then `optimizer.load`; the run
  resumes within 1e-6 of the unswitched one. Restored into the drop-in's
  own target, it raises (Orbax's strict structure check)."""
  model = _nnx_model()
  unswitched = nnx.Optimizer(model, _old(), wrt=nnx.Param)
  _nnx_run(model, unswitched, range(CALLS))
  unswitched = nnx.state(model, nnx.Param)
  model = _nnx_model()
  optimizer = nnx.Optimizer(model, _old(), wrt=nnx.Param)
  _nnx_run(model, optimizer, range(switch))
  _orbax_save(
    tmp_path / "ckpt",
    {
      "model": nnx.to_pure_dict(nnx.state(model)),
      "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
    },
  )

  model = _nnx_model()  # the switched code starts here
  optimizer = optax_accum.flax.Optimizer(model, _new(), wrt=nnx.Param)
  with pytest.raises(ValueError):  # strict: Orbax's own error
    ocp.StandardCheckpointer().restore(
      tmp_path / "ckpt",
      {
        "model": nnx.to_pure_dict(nnx.state(model)),
        "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
      },
    )
  saved = ocp.StandardCheckpointer().restore(tmp_path / "ckpt")
  model_state = nnx.state(model)
  nnx.replace_by_pure_dict(model_state, saved["model"])
  nnx.update(model, model_state)
  optimizer.load(saved["optimizer"])
  multisteps.check_restored(optimizer.opt_state, calls=optimizer.step)
  assert int(optimizer.step[...]) == switch
  assert int(optimizer.opt_state.micro_step) == switch % K
  _nnx_run(model, optimizer, range(switch, CALLS))
  _close(
    nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    nnx.to_pure_dict(unswitched),
  )
  assert int(optimizer.step[...]) == CALLS
