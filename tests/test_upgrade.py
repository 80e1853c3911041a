"""Checkpoints that optax_accum 0.2 saved (``tests/data/v0_2``, written by
``tools/make_v0_2_fixtures.py`` with the 0.2 code, mid-cycle) come in with
one call and the run goes on bit for bit as 0.2 went on: restored into
``upgrade.v0_2_target`` (flax, Orbax, equinox) or as a state dict, then
``upgrade.from_v0_2``. Restored the old way, into a 0.3 target, they are
loud: the framework's error, or ``check_restored`` / the first eager
``update`` naming ``from_v0_2``; ``optax_accum.flax.TrainState`` converts
them as it restores."""

import pathlib

import chex
import equinox as eqx
import flax.serialization
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import optax_accum
from optax_accum import multisteps, upgrade
from tools import make_v0_2_fixtures as fixtures

DATA = pathlib.Path(__file__).parent / "data" / "v0_2"
CONFIGS = fixtures.configs()
FROM_V0_2 = r"upgrade\.from_v0_2"

pytestmark = [
  pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning"),
  pytest.mark.filterwarnings("ignore:.*transformations API:UserWarning"),
]


def _assert_continues_as_v0_2(name, state):
  """`AFTER` calls from `state` give what 0.2 gave after its checkpoint."""
  tx, weight = CONFIGS[name]
  want = np.load(DATA / f"{name}.after.npz")
  runs = fixtures.run(tx, weight, state, fixtures.CALLS, fixtures.AFTER)
  for j, (updates, s) in enumerate(runs):
    for key, leaf in updates.items():
      np.testing.assert_array_equal(leaf, want[f"{j}/updates/{key}"], key)
    for field in ("step", "micro_step", "every_k", "weight_seen"):
      np.testing.assert_array_equal(
        getattr(s, field), want[f"{j}/{field}"], f"call {j}: {field}"
      )


def _target(name):
  return upgrade.v0_2_target(CONFIGS[name][0], fixtures.params())


def _fresh(name):
  return CONFIGS[name][0].init(fixtures.params())


@pytest.mark.parametrize("name", CONFIGS)
def test_flax_bytes_continue_bit_for_bit(name):
  data = (DATA / f"{name}.msgpack").read_bytes()
  old = flax.serialization.from_bytes(_target(name), data)
  assert isinstance(old, upgrade.StateV0_2)
  _assert_continues_as_v0_2(name, upgrade.from_v0_2(old, _fresh(name)))
  # The state dict alone, without a target, converts the same.
  as_dict = flax.serialization.msgpack_restore(data)
  _assert_continues_as_v0_2(name, upgrade.from_v0_2(as_dict, _fresh(name)))
  # Into a 0.3 target: flax's own error (other field names).
  with pytest.raises(ValueError):
    flax.serialization.from_bytes(_fresh(name), data)


@pytest.mark.parametrize("name", CONFIGS)
def test_orbax_checkpoint_continues_bit_for_bit(name):
  checkpointer = ocp.StandardCheckpointer()
  old = checkpointer.restore(DATA / f"{name}.orbax", _target(name))
  _assert_continues_as_v0_2(name, upgrade.from_v0_2(old, _fresh(name)))
  with pytest.raises(ValueError):  # strict into a 0.3 target: Orbax's own
    checkpointer.restore(DATA / f"{name}.orbax", _fresh(name))


@pytest.mark.parametrize("name", CONFIGS)
def test_orbax_partial_restore_is_refused_naming_the_converter(name):
  """A partial restore fills the counters (and the cycle's weight) from the
  fresh target and keeps the saved accumulator: the check after a restore,
  and the first eager update, name from_v0_2."""
  restored = ocp.PyTreeCheckpointer().restore(
    DATA / f"{name}.orbax",
    args=ocp.args.PyTreeRestore(item=_fresh(name), partial_restore=True),
  )
  assert int(restored.step) == 0  # the fresh target's
  with pytest.raises(ValueError, match=FROM_V0_2):
    multisteps.check_restored(restored)
  with pytest.raises(ValueError, match=FROM_V0_2):
    multisteps.check_restored(restored, calls=fixtures.CALLS)
  tx, weight = CONFIGS[name]
  kwargs = {} if weight is None else {"weight": weight(0)}
  with pytest.raises(ValueError, match=FROM_V0_2):
    tx.update(fixtures.grads(0), restored, fixtures.params(), **kwargs)


@pytest.mark.parametrize("name", CONFIGS)
def test_equinox_leaves_continue_bit_for_bit(name):
  path = DATA / f"{name}.eqx"
  old = eqx.tree_deserialise_leaves(path, _target(name))
  _assert_continues_as_v0_2(name, upgrade.from_v0_2(old, _fresh(name)))
  with pytest.raises(Exception):  # noqa: B017  (equinox's own error)
    eqx.tree_deserialise_leaves(path, _fresh(name))


@pytest.mark.parametrize("name", CONFIGS)
def test_linen_train_state_converts_as_it_restores(name):
  """optax_accum.flax.TrainState's restore converts a 0.2 opt_state."""
  tx, _ = CONFIGS[name]
  state = optax_accum.flax.TrainState.create(
    apply_fn=None, params=fixtures.params(), tx=tx
  )
  saved = flax.serialization.msgpack_restore(
    (DATA / f"{name}.msgpack").read_bytes()
  )
  as_dict = flax.serialization.to_state_dict(state)
  as_dict["opt_state"] = saved
  as_dict["step"] = np.int32(fixtures.CALLS)
  restored = flax.serialization.from_state_dict(state, as_dict)
  chex.assert_trees_all_equal(
    restored.opt_state, upgrade.from_v0_2(saved, _fresh(name))
  )
  _assert_continues_as_v0_2(name, restored.opt_state)


def test_linen_train_state_converts_a_chain_as_it_restores():
  """A 0.2 checkpoint of a TrainState whose tx is chain(clip, accumulate),
  mid-cycle: the restore finds the 0.2 state inside the chain and converts
  it, the clip's state as saved (plant: the 0.2 state looked for only at
  the top of opt_state)."""
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), optax_accum.accumulate(optax.adam(0.1), 3)
  )
  params = jnp.zeros(2)
  state = optax_accum.flax.TrainState.create(
    apply_fn=None, params=params, tx=tx
  )
  for g in (1.0, 2.0, 4.0, 8.0):  # a cycle, and one call into the next
    state = state.apply_gradients(grads=jnp.full(2, g))
  saved = flax.serialization.to_state_dict(state)
  saved["opt_state"] = flax.serialization.to_state_dict(
    upgrade.to_v0_2(state.opt_state)
  )
  fresh = optax_accum.flax.TrainState.create(
    apply_fn=None, params=params, tx=tx
  )
  restored = flax.serialization.from_bytes(
    fresh, flax.serialization.msgpack_serialize(saved)
  )
  chex.assert_trees_all_equal(restored.opt_state, state.opt_state)
  assert int(restored.opt_state[1].micro_step) == 1
  chex.assert_trees_all_equal(
    restored.apply_gradients(grads=jnp.ones(2)).params,
    state.apply_gradients(grads=jnp.ones(2)).params,
  )


def test_a_chain_keeps_its_other_parts_as_saved():
  tx = optax.chain(
    optax.add_noise(0.1, 0.5, 0),
    optax_accum.accumulate(optax.sgd(1.0), 2),
  )
  params = jnp.zeros(2)
  _, state = tx.update(jnp.ones(2), tx.init(params), params)
  _, state = tx.update(jnp.ones(2), state, params)
  saved = upgrade.to_v0_2(state)
  assert isinstance(saved[1], upgrade.StateV0_2)
  back = upgrade.from_v0_2(saved, tx.init(params))
  chex.assert_trees_all_equal(back, state)  # the noise's count too


def test_to_v0_2_round_trips_every_value():
  tx, weight = CONFIGS["grow"]
  runs = fixtures.run(tx, weight, tx.init(fixtures.params()), 0, 9)
  state = runs[-1][1]
  assert int(state.step) > 0 and isinstance(
    state.grow, optax_accum.types.GrowState
  )
  old = upgrade.to_v0_2(state)
  assert old.emitted.dtype == jnp.bool_ and old.weight_seen.shape == (2,)
  chex.assert_trees_all_equal(
    upgrade.from_v0_2(old, tx.init(fixtures.params())), state
  )


def test_bad_input_names_what_to_pass():
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = jnp.zeros(2)
  with pytest.raises(TypeError, match=r"v0_2_target\(tx, params\)"):
    upgrade.from_v0_2(tx.init(params), tx.init(params))
  other = optax_accum.accumulate(optax.adam(1.0), 2)
  with pytest.raises(ValueError, match="`inner_state` has the tree"):
    upgrade.from_v0_2(upgrade.v0_2_target(tx, params), other.init(params))
  with pytest.raises(ValueError, match="has no `step`"):
    upgrade.from_v0_2({"micro_step": 0}, tx.init(params))
