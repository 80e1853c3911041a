"""Checkpoints saved by earlier versions of optax_accum.

optax_accum 0.3 keeps the state's scalars in two arrays
(:class:`~optax_accum.AccumulateState`'s ``counters`` and ``acc_scalars``,
read by name through its properties); 0.2 had a field for each of them and
records ``noise`` and ``grow``. A 0.2 checkpoint therefore does not fit a 0.3
target: restore it into :func:`v0_2_target`, built from the transformation
itself, then convert with :func:`from_v0_2`; the run goes on where it
stopped, mid-cycle too, bit for bit::

  tx = optax_accum.accumulate(inner, every_k=k)
  old = checkpointer.restore(path, optax_accum.upgrade.v0_2_target(tx, params))
  opt_state = optax_accum.upgrade.from_v0_2(old, tx.init(params))

Restored the old way, into a 0.3 target, each route does this
(``tests/test_upgrade.py``):

* Orbax ``StandardCheckpointer().restore(path, target)`` and
  ``flax.serialization.from_state_dict`` / ``from_bytes``: their own error
  (the trees' structures or field names differ). With
  ``optax_accum.flax.TrainState`` (or a subclass) as the target, flax's
  routes (``from_state_dict``, ``from_bytes``,
  ``flax.training.checkpoints.restore_checkpoint``) convert a 0.2
  ``opt_state`` themselves.
* Orbax ``partial_restore=True`` and ``flax.training.checkpoints`` with any
  other target fill the counters from the fresh target:
  :func:`optax_accum.multisteps.check_restored` (and the first eager
  ``update``) then raise, naming :func:`from_v0_2`, wherever the
  accumulator or its weight holds a cycle that the fresh counters deny.
* equinox ``tree_deserialise_leaves(path, like)``: equinox's error (the
  leaves are read by position; 0.2 had more). Deserialise into
  ``v0_2_target(tx, params)`` instead.

:func:`to_v0_2` goes back, for a tool that reads 0.2 states.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _control
from optax_accum._state import (
  AccumulateState,
  GrowState,
  NoiseScaleState,
  find_state,
  is_accumulate_state,
  swap_state,
)

__all__ = ("StateV0_2", "from_v0_2", "to_v0_2", "v0_2_target")


class StateV0_2(NamedTuple):
  """The layout of optax_accum 0.2's ``AccumulateState``: the tree, names
  and dtypes a 0.2 checkpoint was saved with (fields as documented in 0.2:
  ``weight_seen`` a compensated ``float32[2]`` sum, ``emitted`` a
  ``bool[]``, ``noise`` and ``grow`` a record or ``optax.EmptyState()``)."""

  micro_step: Any
  step: Any
  every_k: Any
  acc_grads: Any
  acc_weight: Any
  weight_seen: Any
  inner_state: Any
  num_skipped: Any
  emitted: Any
  noise: Any
  grow: Any


def _as_v0_2(state: AccumulateState) -> StateV0_2:
  return StateV0_2(
    micro_step=state.micro_step,
    step=state.step,
    every_k=state.every_k,
    # As stored: 0.2 read the buffer and its weight as they are.
    acc_grads=state.acc_buffer,
    acc_weight=state.acc_scalars[..., 0],
    weight_seen=state.weight_seen,
    inner_state=state.inner_state,
    num_skipped=state.num_skipped,
    emitted=state.emitted,
    noise=state.noise,
    grow=state.grow,
  )


def to_v0_2(opt_state: Any) -> Any:
  """`opt_state` with every :class:`~optax_accum.AccumulateState` in it
  laid out as optax_accum 0.2 saved it (a :class:`StateV0_2`).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> old = optax_accum.upgrade.to_v0_2(tx.init(jnp.zeros(2)))
    >>> print(old.micro_step, old.every_k, old.weight_seen)
    0 2 [0. 0.]
  """
  return jax.tree.map(
    lambda x: _as_v0_2(x) if is_accumulate_state(x) else x,
    opt_state,
    is_leaf=is_accumulate_state,
  )


def v0_2_target(tx: optax.GradientTransformation, params: Any) -> Any:
  """The target to restore a checkpoint of optax_accum 0.2 into.

  ``tx.init(params)`` with its accumulate state laid out as 0.2 saved it
  (:func:`to_v0_2`): the tree, field names, shapes and dtypes of the
  checkpoint. `tx` is the optimizer as the run builds it now (an
  ``optax.chain`` around ``accumulate`` included).
  """
  return to_v0_2(tx.init(params))


def from_v0_2(saved: Any, target: Any) -> Any:
  """The optimizer state that continues a run checkpointed by optax_accum 0.2.

  Every value is carried over as saved (the counters, the accumulator and
  its weight, the inner state, the noise scale and the controller), so the
  run goes on bit for bit, mid-cycle too.

  Args:
    saved: The restored state: restored into :func:`v0_2_target` (a tree
      holding one :class:`StateV0_2`), or the accumulate state alone as a
      mapping of 0.2's field names (a state dict, e.g. from
      ``flax.serialization.to_state_dict`` or a restore without a target).
    target: A fresh state of the optimizer that takes over,
      ``tx.init(params)``: its accumulate state gives the layout, and the
      dtypes the values are cast to.

  Returns:
    `saved` with its 0.2 state converted (the other parts of a chain as
    saved); for a mapping, `target` with its accumulate state replaced.

  Raises:
    TypeError: If `saved` holds no 0.2 state or `target` no
      ``AccumulateState``.
    ValueError: If `saved` holds several, or if its accumulator or inner
      state does not have the target's tree.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> from optax_accum import upgrade
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = jnp.zeros(2)
    >>> _, state = tx.update(jnp.array([2.0, 4.0]), tx.init(params), params)
    >>> saved = upgrade.to_v0_2(state)  # as 0.2 wrote it
    >>> restored = upgrade.from_v0_2(saved, tx.init(params))
    >>> u, _ = tx.update(jnp.array([4.0, 8.0]), restored, params)
    >>> print(u)
    [-3. -6.]
  """
  fresh = find_state(target, "from_v0_2")
  if isinstance(saved, Mapping) and not isinstance(saved, StateV0_2):
    old = _from_mapping(saved, _as_v0_2(fresh))
    return swap_state(target, fresh, _converted(old, fresh))
  found = [
    x
    for x in jax.tree.leaves(saved, is_leaf=_is_v0_2)
    if isinstance(x, StateV0_2)
  ]
  if len(found) != 1:
    if found:
      raise ValueError(
        f"`saved` holds {len(found)} optax_accum 0.2 states; convert the"
        " part of the optimizer state that holds the one you mean."
      )
    raise TypeError(
      "`saved` must be restored into optax_accum.upgrade.v0_2_target(tx,"
      " params) (a tree holding one StateV0_2), or be the 0.2 state's"
      f" mapping of field names; got a {type(saved).__name__} with none"
      " inside."
    )
  return swap_state(saved, found[0], _converted(found[0], fresh))


def _is_v0_2(x: Any) -> bool:
  return isinstance(x, StateV0_2)


def _converted(old: StateV0_2, fresh: AccumulateState) -> AccumulateState:
  for name in ("acc_grads", "inner_state"):
    got, want = getattr(old, name), getattr(fresh, name)
    tree: _control.TreeDef = jax.tree.structure(got)
    if tree != jax.tree.structure(want):
      raise ValueError(
        f"The saved state's `{name}` has the tree {jax.tree.structure(got)},"
        f" but the target's is {jax.tree.structure(want)}: build the target"
        " with the optimizer and params of the saved run."
      )

  def cast(value: Any, like: Any) -> Any:
    return jax.tree.map(
      lambda x, t: jnp.asarray(x, jnp.result_type(t)), value, like
    )

  noise = old.noise if isinstance(fresh.noise, NoiseScaleState) else None
  grow = old.grow if isinstance(fresh.grow, GrowState) else None
  return fresh.replace(
    micro_step=old.micro_step,
    step=old.step,
    every_k=old.every_k,
    num_skipped=old.num_skipped,
    emitted=old.emitted,
    weight_seen=old.weight_seen,
    acc_weight=old.acc_weight,
    acc_grads=cast(old.acc_grads, fresh.acc_grads),
    inner_state=cast(old.inner_state, fresh.inner_state),
    noise=fresh.noise if noise is None else NoiseScaleState(*noise),
    grow=fresh.grow if grow is None else GrowState(*grow),
  )


def _from_mapping(saved: Mapping, like: Any) -> Any:
  """`saved` (nested mappings and sequences, as a state dict or a restore
  without a target gives them) rebuilt with the tree of `like`."""
  if isinstance(like, tuple) and hasattr(like, "_fields"):
    return type(like)(
      *(_from_mapping(_item(saved, f), getattr(like, f)) for f in like._fields)
    )
  if isinstance(like, tuple | list):
    return type(like)(
      _from_mapping(_item(saved, i), x) for i, x in enumerate(like)
    )
  if isinstance(like, dict):
    return {k: _from_mapping(_item(saved, k), v) for k, v in like.items()}
  return saved


def _item(saved: Any, key: Any) -> Any:
  if isinstance(saved, Mapping):
    if key in saved:
      return saved[key]
    if str(key) in saved:  # flax's state dicts key sequences by position
      return saved[str(key)]
    raise ValueError(
      f"The saved optax_accum 0.2 state has no `{key}` (it has"
      f" {sorted(map(str, saved))}): restore it into"
      " optax_accum.upgrade.v0_2_target(tx, params) instead."
    )
  return saved[key]
