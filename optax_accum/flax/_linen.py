"""``optax_accum.flax.TrainState``: linen's ``TrainState`` applying with
:func:`optax_accum.apply_updates`."""

import dataclasses
from typing import Any

import jax
from flax import serialization
from flax.training import train_state

from optax_accum import _apply, _checks, _state, multisteps, upgrade


class TrainState(train_state.TrainState):
  """A drop-in for ``flax.training.train_state.TrainState``.

  ``create`` and the fields are the stock class's; ``apply_gradients`` also
  takes :func:`optax_accum.accumulate`'s ``weight=``, ``flush=`` and
  ``emit=``, and applies the updates with :func:`optax_accum.apply_updates`
  (a micro-step neither reads nor writes the params); given with a `tx`
  that holds no ``accumulate``, they raise a ``TypeError`` naming them
  (not given, any optax transformation works as in the stock class). Other
  keyword arguments replace fields, as in the stock class. Jit the step
  with the state donated (``jax.jit(step, donate_argnums=0)``).

  ``step`` counts ``apply_gradients`` calls (micro-batches);
  ``optax_accum.has_updated(state.opt_state)`` says whether the last call
  applied an update.

  Restores check what they restore, once, where the values are concrete:
  ``flax.serialization.from_state_dict`` (and so ``from_bytes`` and
  ``flax.training.checkpoints.restore_checkpoint`` with this class, or a
  subclass of it, as the target) raises a ``ValueError`` naming
  :func:`optax_accum.multisteps.from_multisteps` when the checkpoint's
  ``opt_state`` is an ``optax.MultiSteps`` state, or when the restored
  accumulate state has a fresh target's counters though ``step`` says the
  run had made calls (a restorer that filled the missing fields from the
  target, as ``restore_checkpoint`` does through Orbax). Restore such a
  checkpoint into ``state.replace(opt_state=restore_target(state.tx,
  state.params))`` and convert (``help(optax_accum.multisteps)``). A
  checkpoint of optax_accum 0.2 (``help(optax_accum.upgrade)``) is
  converted as it is restored. The training step pays nothing for it.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> state = optax_accum.flax.TrainState.create(
    ...   apply_fn=None, params={"w": jnp.zeros(2)}, tx=tx)
    >>> for w in (1.0, 3.0):
    ...   state = state.apply_gradients(grads={"w": jnp.ones(2)}, weight=w)
    >>> print(int(state.step), state.params["w"])
    2 [-1. -1.]
  """

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)  # makes `cls` a flax dataclass
    _register_checked_restore(cls)

  def apply_gradients(
    self,
    *,
    grads: Any,
    weight: Any = None,
    flush: Any = False,
    emit: bool | None = None,
    **kwargs: Any,
  ) -> "TrainState":
    options = _checks.dropin_options(
      self.opt_state,
      "TrainState.apply_gradients",
      weight=weight,
      flush=flush,
      emit=emit,
    )
    updates, opt_state = self.tx.update(
      grads, self.opt_state, self.params, **options
    )
    return self.replace(
      step=self.step + 1,
      params=_apply.apply_updates(self.params, updates, opt_state),
      opt_state=opt_state,
      **kwargs,
    )


_FIX = (
  "Restore it into"
  " `state.replace(opt_state=optax_accum.multisteps.restore_target("
  "state.tx, state.params))`, then continue with"
  " `restored.replace(opt_state=optax_accum.multisteps.from_multisteps("
  "restored.opt_state, state.opt_state, tx=state.tx))`. See"
  " help(optax_accum.multisteps)."
)


# The fields of optax_accum 0.2's AccumulateState that 0.3's lacks.
_V0_2_KEYS = frozenset(upgrade.StateV0_2._fields) - set(
  _state.AccumulateState._fields
)


def _holds_v0_2(state_dict: Any) -> bool:
  """Whether a state dict holds an optax_accum 0.2 state anywhere."""
  if not isinstance(state_dict, dict):
    return False
  return _V0_2_KEYS <= state_dict.keys() or any(
    _holds_v0_2(v) for v in state_dict.values()
  )


def _stored(opt_state: Any) -> Any:
  """`opt_state` with each AccumulateState as a mapping of its fields as
  stored: flax reads a named tuple's fields by name, and ``acc_grads`` read
  by name is the open cycle's sum, not the buffer (``_state.py``). The same
  state dict as flax's own, bit for bit what the step left."""
  return jax.tree.map(
    lambda x: (
      dict(zip(x._fields, x, strict=True))
      if _state.is_accumulate_state(x)
      else x
    ),
    opt_state,
    is_leaf=_state.is_accumulate_state,
  )


def _register_checked_restore(cls: type) -> None:
  """Registers `cls`'s flax serialization: the stock dataclass one, with the
  restored optimizer state checked (:func:`optax_accum.multisteps.check_restored`).

  flax registers every dataclass with a generic ``from_state_dict`` that
  keeps no hook, so this one restores the fields as it does, then checks.
  """
  fields = [
    f.name
    for f in dataclasses.fields(cls)
    if f.metadata.get("pytree_node", True)
  ]

  def to_state_dict(x: Any) -> dict[str, Any]:
    return {
      name: serialization.to_state_dict(
        _stored(x.opt_state) if name == "opt_state" else getattr(x, name)
      )
      for name in fields
    }

  def from_state_dict(x: Any, state: dict[str, Any]) -> Any:
    ours = jax.tree.leaves(x.opt_state, is_leaf=_state.is_accumulate_state)
    if any(
      map(_state.is_accumulate_state, ours)
    ) and multisteps._holds_multisteps(state.get("opt_state")):
      raise ValueError(
        f"The checkpoint restored into {cls.__name__} holds an"
        " optax.MultiSteps state in `opt_state` (mini_step, gradient_step,"
        " inner_opt_state, acc_grads), but this TrainState's optimizer is"
        f" optax_accum.accumulate. {_FIX}"
      )
    state = dict(state)
    if any(map(_state.is_accumulate_state, ours)) and _holds_v0_2(
      state.get("opt_state")
    ):  # Saved by optax_accum 0.2: converted here, bit for bit.
      old = serialization.from_state_dict(
        upgrade.to_v0_2(x.opt_state), state["opt_state"], name="opt_state"
      )
      state["opt_state"] = serialization.to_state_dict(
        upgrade.from_v0_2(old, x.opt_state)
      )
    updates = {}
    for name in fields:
      if name not in state:
        raise ValueError(
          f"Missing field {name} in state dict while restoring an instance"
          f" of {cls.__name__}, at path {serialization.current_path()}"
        )
      updates[name] = serialization.from_state_dict(
        getattr(x, name), state.pop(name), name=name
      )
    if state:
      raise ValueError(
        f'Unknown field(s) "{",".join(state)}" in state dict while restoring'
        f" an instance of {cls.__name__} at path"
        f" {serialization.current_path()}"
      )
    restored = x.replace(**updates)
    multisteps._not_restored_from_elsewhere(
      restored.opt_state, restored.step, f"{cls.__name__}'s opt_state", _FIX
    )
    return restored

  serialization.register_serialization_state(
    cls, to_state_dict, from_state_dict, override=True
  )


_register_checked_restore(TrainState)
