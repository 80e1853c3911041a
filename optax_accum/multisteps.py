"""Coming from ``optax.MultiSteps``: the names, the meanings, the checkpoints.

``optax_accum.accumulate(inner, every_k)`` takes the place of
``optax.MultiSteps(inner, every_k).gradient_transformation()``: the same
``init`` and ``update``, exact zeros on the calls that only accumulate, the
inner optimizer's update when a cycle ends. The errors that a ``MultiSteps``
name raises point here (``help(optax_accum.multisteps)``).

Arguments and methods::

  optax.MultiSteps                  optax_accum
  --------------------------------  ---------------------------------------
  MultiSteps(opt, ...)              accumulate(inner, ...): inner runs only
                                    on the call that ends a cycle
  every_k_schedule=k | schedule     every_k=k | every_k(step) |
                                    every_k(step, weight_seen) |
                                    grow_every_k(...)
  use_grad_mean=True / False        reduction="mean" / "sum" (the mean is
                                    weighted by update(..., weight=))
  should_skip_update_fn=            skip_nonfinite=True (no other
    optax.skip_not_finite           predicate)
  accumulator_dtype=                accumulator_dtype= (None: the
                                    gradient's dtype)
  .gradient_transformation()        the transformation itself (on an
                                    accumulate it raises AttributeError:
                                    'GradientTransformationExtraArgs' object
                                    has no attribute 'gradient_transformation':
                                    drop the call)
  .has_updated(state)               optax_accum.has_updated(state): False
                                    on a dropped micro-batch and on a cycle
                                    of total weight 0 (tx.has_updated raises
                                    the same bare AttributeError)
  optax.MultiStepsState (type       optax_accum.AccumulateState
    annotations)

State fields (reading a ``MultiStepsState`` name from an
``AccumulateState`` raises an ``AttributeError`` naming the equivalent)::

  mini_step                         micro_step
  gradient_step                     step
  inner_opt_state                   inner_state (optax_accum.inner_state
                                    finds it inside chains too)
  acc_grads (the running MEAN)      acc_grads (the running SUM of w_i g_i;
                                    the mean so far is acc_grads /
                                    acc_weight; at mini_step 0, zeros or
                                    leftovers the next call does not read)
  skip_state                        num_skipped (a count over the run)

Checkpoints. A ``MultiSteps`` checkpoint does not fit an ``accumulate``
target (other field names; ``acc_grads`` a mean, not a sum). Restore it
into :func:`restore_target`, built from the ``accumulate`` transformation
itself (no copy of the old optimizer's construction), then convert; the
run goes on where it stopped, mid-cycle too::

  tx = optax_accum.accumulate(inner, every_k=k)
  ms_state = checkpointer.restore(path, restore_target(tx, params))
  state = from_multisteps(ms_state, tx.init(params), tx=tx)

:func:`to_multisteps` goes back. Restored the old way, into an
``accumulate`` target, each route does this (``tests/test_restores.py``):

* Orbax ``StandardCheckpointer().restore(path, target)``: Orbax raises its
  own error ("User-provided restore item and on-disk value metadata tree
  structures do not match"; one trainer reported "The truth value of an
  array with more than one element is ambiguous" from its diff formatter).
* Orbax ``partial_restore=True``: silent. The fields the file lacks come
  from the fresh target: a reset inner state, ``MultiSteps``' mean taken as
  a sum. No code of this package runs there.
* ``flax.training.checkpoints.restore_checkpoint(dir, target=state)`` and
  ``flax.serialization.from_state_dict`` / ``from_bytes`` with ``state`` an
  ``optax_accum.flax.TrainState`` or a subclass: a ``ValueError`` naming
  :func:`restore_target` and :func:`from_multisteps`, raised by the restore
  (the ``TrainState`` checks what it restored, once; the training step pays
  nothing). With flax's own ``TrainState``, ``restore_checkpoint`` is
  silent (it fills the missing fields from the target, as
  ``partial_restore``) and ``flax.serialization`` raises flax's "The field
  names of the state dict and the named tuple do not match".
* equinox ``tree_deserialise_leaves(path, like)``: equinox's
  ``TreePathError`` (a leaf path through ``inner_state``) or ``EOFError: No
  data left in file``.
* NNX, Orbax into ``nnx.state(optimizer)`` then ``nnx.update``: strict,
  Orbax's error; with ``partial_restore=True``, silent (no code of this
  package runs in ``nnx.update``). Restore instead without a target (the
  checkpoint's own layout) and hand the optimizer's part to
  ``optax_accum.flax.Optimizer.load``, which converts it in one call.

So during a switch, call :func:`check_restored` once after every restore
that no code of this package runs in, with the trainer's own count of calls
(``check_restored(opt_state, calls=state.step)``): it raises naming
:func:`from_multisteps` on a state filled from a fresh target. The first
eager ``update`` refuses a mid-cycle one too, but a step jitted or
``pmap``-ped from its first call is not checked (that would cost a pass
over the accumulator on every micro-step).

Places that change in a trainer: the optimizer's construction; the step's
type annotations (``optax.MultiStepsState`` -> ``AccumulateState``); every
restore of an old checkpoint (into :func:`restore_target` once, convert,
then save and restore ``accumulate`` states from then on);
``.has_updated`` -> ``optax_accum.has_updated``; reads of ``mini_step``,
``gradient_step`` and ``inner_opt_state``; the apply step
(``optax_accum.apply_updates``).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _accumulate, _checks, _control, _every_k
from optax_accum._state import find_state, placed_like, swap_state

__all__ = (
  "check_restored",
  "equivalent",
  "from_multisteps",
  "restore_target",
  "to_multisteps",
)


class _FromTx:
  """The default ``accumulator_dtype`` of :func:`restore_target` and
  :func:`equivalent`: the one the ``accumulate`` transformation holds."""

  def __repr__(self) -> str:
    return "<the accumulator_dtype of tx>"


_FROM_TX = _FromTx()


def restore_target(
  tx: optax.GradientTransformation,
  params: optax.Params,
  *,
  accumulator_dtype: Any = _FROM_TX,
) -> optax.MultiStepsState:
  """The target to restore a checkpoint of the ``MultiSteps`` run into.

  The ``optax.MultiStepsState`` that ``optax.MultiSteps(inner, k).init``
  gives for the ``inner`` optimizer `tx` wraps, with ``skip_state`` the
  one of ``should_skip_update_fn=optax.skip_not_finite`` when `tx` has
  ``skip_nonfinite=True``: the tree, shapes and dtypes a ``MultiSteps``
  checkpoint was saved with, without a copy of the old optimizer's
  construction. Restore into it, then convert with
  :func:`from_multisteps`.

  Args:
    tx: The transformation :func:`optax_accum.accumulate` returned (not a
      chain around it; pass the accumulate part, or build the target with
      the old optimizer).
    params: The params (the tree ``tx.init`` takes).
    accumulator_dtype: The ``MultiSteps`` argument of the same name
      (``None``: the params' dtype). By default the one `tx` was built
      with, which a run that kept its ``accumulator_dtype`` when it moved
      to ``accumulate`` saved its ``MultiSteps`` checkpoint with.

  Returns:
    An ``optax.MultiStepsState`` of zeros and the inner optimizer's
    initial state.

  Raises:
    TypeError: If `tx` is not a transformation ``accumulate`` returned.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> from optax_accum import multisteps
    >>> params = jnp.zeros(2)
    >>> old = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    >>> _, saved = old.update(jnp.array([2.0, 4.0]), old.init(params), params)
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> target = multisteps.restore_target(tx, params)
    >>> restored = jax.tree.unflatten(  # your checkpointer's restore
    ...   jax.tree.structure(target), jax.tree.leaves(saved))
    >>> state = multisteps.from_multisteps(restored, tx.init(params), tx=tx)
    >>> print(state.micro_step, state.acc_grads)
    1 [2. 4.]
  """
  return _equivalent(tx, "restore_target", accumulator_dtype).init(params)


def equivalent(
  tx: optax.GradientTransformation, *, accumulator_dtype: Any = _FROM_TX
) -> optax.MultiSteps:
  """The ``optax.MultiSteps`` that `tx` takes the place of.

  Built from the ``accumulate`` transformation's own arguments, following
  the table above: its ``inner`` optimizer, ``every_k`` (a schedule
  ``every_k(step)`` as is; the first k of a schedule of ``(step,
  weight_seen)`` or of a controller), ``use_grad_mean`` from
  ``reduction`` and ``should_skip_update_fn=optax.skip_not_finite`` from
  ``skip_nonfinite=True``. Its ``init(params)`` is :func:`restore_target`;
  wrap it where a trainer holds the optimizer, e.g. ``nnx.Optimizer(model,
  equivalent(tx), wrt=nnx.Param)``, to get the layout a ``MultiSteps``
  checkpoint of that trainer was saved with.

  Args:
    tx: The transformation :func:`optax_accum.accumulate` returned.
    accumulator_dtype: The ``MultiSteps`` argument of the same name; by
      default the one `tx` was built with.

  Raises:
    TypeError: If `tx` is not a transformation ``accumulate`` returned.
  """
  return _equivalent(tx, "equivalent", accumulator_dtype)


def _equivalent(tx: Any, reader: str, accumulator_dtype: Any):
  config = _accumulate.config_of(tx, reader)
  spec = config.every_k
  k = _every_k.first(spec)
  every_k_schedule: int | Callable[..., Any]
  if _every_k.is_step_schedule(spec) and spec.schedule is not None:
    every_k_schedule = spec.schedule  # both call it with the optimizer step
  else:
    every_k_schedule = int(k)
  if accumulator_dtype is _FROM_TX:
    accumulator_dtype = config.accumulator_dtype
  return optax.MultiSteps(
    config.inner(k),
    every_k_schedule=every_k_schedule,
    use_grad_mean=config.reduction == "mean",
    accumulator_dtype=accumulator_dtype,
    should_skip_update_fn=optax.skip_not_finite
    if config.skip_nonfinite
    else None,
  )


def _check_multisteps_state(ms_state: Any) -> None:
  if not isinstance(ms_state, optax.MultiStepsState):
    raise TypeError(
      "`ms_state` must be an optax.MultiStepsState (restore the checkpoint"
      " with the MultiSteps optimizer's init as the target), got"
      f" {type(ms_state).__name__}."
    )


def from_multisteps(
  ms_state: optax.MultiStepsState,
  target: Any,
  *,
  tx: optax.GradientTransformation | None = None,
  use_grad_mean: bool | None = None,
  every_k: int | None = None,
) -> Any:
  r"""The ``accumulate`` state that continues a ``MultiSteps`` run.

  The cycle goes on where it was: ``micro_step`` and ``step`` are
  ``mini_step`` and ``gradient_step``, ``inner_state`` is
  ``inner_opt_state``, and the accumulator holds the running sum
  :math:`n \bar g` (with ``use_grad_mean``, ``MultiSteps`` keeps the running
  mean :math:`\bar g` of the :math:`n` = ``mini_step`` micro-batches), of
  weight :math:`n`. The open cycle's k is the one ``MultiSteps`` gave it,
  ``every_k_schedule(gradient_step)``. Continued with the same gradients,
  the run matches the unswitched one to float32 rounding.

  Pass `tx`, the ``accumulate`` transformation that takes over: from it
  come what ``acc_grads`` holds (its ``reduction``) and the open cycle's k
  (its ``every_k`` schedule at ``gradient_step``). Without it, `target`
  says nothing of either, and a schedule's cycle would take the k of step 0.

  Args:
    ms_state: The ``optax.MultiStepsState``, restored with the
      ``MultiSteps`` optimizer's ``init`` as the target.
    target: A fresh state of the ``accumulate`` transformation that takes
      over (``tx.init(params)``), or an optimizer state holding one (an
      ``optax.chain`` state): its layout, dtypes and records are kept.
    tx: That ``accumulate`` transformation (not a chain around it).
    use_grad_mean: The ``MultiSteps`` argument of the same name (what its
      ``acc_grads`` holds); default: ``reduction == "mean"`` of `tx`, or
      True without `tx`.
    every_k: The current cycle's number of micro-batches; default: with
      `tx`, its ``every_k`` schedule at ``gradient_step`` (a fixed k, that
      k); without, the target's.

  Returns:
    `target` with its :class:`~optax_accum.AccumulateState` replaced.

  Raises:
    TypeError: If `ms_state` is not a ``MultiStepsState``, `target` holds
      no ``AccumulateState`` or `tx` is not an ``accumulate``.
    ValueError: If the inner state's or the accumulator's tree differs.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> params = jnp.zeros(2)
    >>> old = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    >>> _, ms = old.update(jnp.array([2.0, 4.0]), old.init(params), params)
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> state = optax_accum.multisteps.from_multisteps(
    ...   ms, tx.init(params), tx=tx)
    >>> u, state = tx.update(jnp.array([4.0, 8.0]), state, params)
    >>> print(u)  # -(2 + 4) / 2, -(4 + 8) / 2
    [-3. -6.]
  """
  _check_multisteps_state(ms_state)
  fresh = find_state(target, "from_multisteps")
  # Read once: only its tree, dtypes and places are used (each read of
  # acc_grads asks the device whether a cycle is open).
  buffer = fresh.acc_grads
  _same_tree("inner_opt_state", ms_state.inner_opt_state, fresh.inner_state)
  _same_tree("acc_grads", ms_state.acc_grads, buffer)
  # The restored values on the target's devices (a mesh's, for a state made
  # under jax.set_mesh): the state packs them beside the target's own.
  ms_state = ms_state._replace(
    mini_step=placed_like(
      jnp.asarray(ms_state.mini_step, jnp.int32), fresh.micro_step
    ),
    gradient_step=placed_like(
      jnp.asarray(ms_state.gradient_step, jnp.int32), fresh.step
    ),
    acc_grads=placed_like(ms_state.acc_grads, buffer),
    inner_opt_state=placed_like(ms_state.inner_opt_state, fresh.inner_state),
  )
  step = ms_state.gradient_step
  k = fresh.every_k
  mean = True
  if tx is not None:
    config = _accumulate.config_of(tx, "from_multisteps")
    mean = config.reduction == "mean"
    k = _every_k.of_multisteps(config.every_k, step)
  if use_grad_mean is not None:
    mean = use_grad_mean
  if every_k is not None:
    k = jnp.asarray(every_k, jnp.int32)
  n = ms_state.mini_step
  scale = n.astype(jnp.float32) if mean else jnp.float32(1)
  acc = jax.tree.map(
    lambda m, a: (m.astype(jnp.float32) * scale).astype(a.dtype),
    ms_state.acc_grads,
    buffer,
  )
  state = fresh.replace(
    micro_step=n,
    step=step,
    every_k=k,
    acc_grads=acc,
    acc_weight=n.astype(jnp.float32),
    # MultiSteps counts no micro-batches: k per optimizer step so far.
    weight_seen=jnp.stack([(step * k).astype(jnp.float32), jnp.float32(0)]),
    inner_state=jax.tree.map(
      lambda x, t: jnp.asarray(x, jnp.result_type(t)),
      ms_state.inner_opt_state,
      fresh.inner_state,
    ),
    emitted=(n == 0) & (step > 0),
  )
  return swap_state(target, fresh, state)


def to_multisteps(
  opt_state: Any, *, use_grad_mean: bool = True, skip_state: Any = ()
) -> optax.MultiStepsState:
  """The ``optax.MultiStepsState`` that continues an ``accumulate`` run.

  The inverse of :func:`from_multisteps`, for a run that goes back (or a
  tool that reads ``MultiSteps`` states). Defined for unweighted cycles:
  with ``update(..., weight=)`` the running mean is the weighted one.

  Args:
    opt_state: An optimizer state holding one ``AccumulateState``.
    use_grad_mean: The ``MultiSteps`` that takes over averages (True) or
      sums (False).
    skip_state: The ``skip_state`` its ``should_skip_update_fn`` starts
      from (``()`` without one).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = jnp.zeros(2)
    >>> _, state = tx.update(jnp.array([2.0, 4.0]), tx.init(params), params)
    >>> ms = optax_accum.multisteps.to_multisteps(state)
    >>> print(ms.mini_step, ms.acc_grads)
    1 [2. 4.]
  """
  state = find_state(opt_state, "to_multisteps")
  n = state.micro_step
  # At micro_step 0 no cycle is open, whatever acc_grads holds (leftovers
  # of the last one, on CPU): MultiSteps' zeros. So for a cycle that holds
  # leftovers it throws away (weight -inf, GPU/TPU).
  empty = (n == 0) | jnp.isneginf(state.acc_weight)
  if use_grad_mean:
    inv = jnp.where(state.acc_weight > 0, 1 / state.acc_weight, 0.0)
    acc = jax.tree.map(lambda a: (a * inv).astype(a.dtype), state.acc_grads)
  else:
    acc = state.acc_grads
  acc = jax.tree.map(lambda a: jnp.where(empty, jnp.zeros([], a.dtype), a), acc)
  return optax.MultiStepsState(
    mini_step=n,
    gradient_step=state.step,
    inner_opt_state=state.inner_state,
    acc_grads=acc,
    skip_state=skip_state,
  )


# ----------------------------------------------------------------------------
# Restore checks (check_restored; optax_accum.flax.TrainState's restore).
# ----------------------------------------------------------------------------


# The fields of an optax.MultiStepsState that an AccumulateState lacks.
_MULTISTEPS_KEYS = frozenset(
  ("mini_step", "gradient_step", "inner_opt_state", "acc_grads")
)

# What to do with a MultiSteps checkpoint, for a bare optimizer state.
_RESTORE_FIX = (
  "Restore it into the MultiSteps-shaped target and convert:"
  " `optax_accum.multisteps.restore_target(tx, params)` is that target for"
  " the opt_state, and"
  " `optax_accum.multisteps.from_multisteps(restored_opt_state,"
  " tx.init(params), tx=tx)` continues the run (mid-cycle too); into an"
  " optax_accum.flax.Optimizer, `optimizer.load(restored_optimizer)` does"
  " both in one call. See help(optax_accum.multisteps)."
)


def _holds_multisteps(state_dict: Any) -> bool:
  """Whether a state dict (``flax.serialization.to_state_dict``) holds an
  ``optax.MultiStepsState`` anywhere."""
  if not isinstance(state_dict, dict):
    return False
  return _MULTISTEPS_KEYS <= state_dict.keys() or any(
    _holds_multisteps(v) for v in state_dict.values()
  )


def _values(tree: Any) -> list | None:
  """`tree`'s leaves as NumPy arrays, or None where one is not concrete
  here (traced, abstract, or on another host)."""
  out = []
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      if not x.is_fully_addressable:
        return None
    elif not isinstance(x, (np.ndarray, np.generic, int, float, bool)):
      return None
    try:
      out.append(np.asarray(x))
    except Exception:  # noqa: BLE001  (an unreduced array reads only in jit)
      return None
  return out


def _not_restored_from_elsewhere(
  opt_state: Any, calls: Any, where: str, fix: str = _RESTORE_FIX
) -> None:
  """Raises if a just-restored optimizer state holds an ``accumulate``
  state whose counters are a fresh target's though the run had made `calls`
  calls (or whose ``acc_grads`` no call leaves): what a restorer that fills
  the fields a checkpoint lacks from the target gives for a ``MultiSteps``
  checkpoint (or one saved without ``accumulate``).

  Reads the counters, and ``acc_grads`` once, where the values are
  concrete; a traced or abstract state passes.

  Args:
    opt_state: The restored optimizer state.
    calls: The trainer's restored count of calls (``TrainState.step``,
      ``nnx.Optimizer.step``), or None.
    where: What was restored, for the message.
    fix: What to do instead, for the message.
  """
  try:
    state = find_state(opt_state, where, missing_ok=True)
  except ValueError:  # several accumulate states: not ours to judge
    return
  if state is None:
    return
  # As stored (`acc_scalars`, `acc_buffer`), not as read: what a restorer
  # filled in is there, whatever the counters say.
  counters = _values(
    (state.micro_step, state.step, state.acc_scalars, state.weight_seen)
    + (state.num_skipped,)
  )
  if counters is None or any(c.any() for c in counters):
    return
  made = 0
  if calls is not None:
    restored_calls = _values(calls)
    if restored_calls is None:
      return
    made = int(max((c.max() for c in restored_calls), default=0))
  acc = _values(state.acc_buffer)
  nonzero = acc is not None and any(a.any() for a in acc)
  if made <= 0 and not nonzero:
    return
  why = (
    (f"the run had made {made} calls" if made > 0 else "")
    + (" and " if made > 0 and nonzero else "")
    + ("acc_grads is not zero" if nonzero else "")
  )
  raise ValueError(
    f"The {where} restored holds an accumulate state with a fresh target's"
    f" counters, though {why}: the checkpoint holds no AccumulateState of"
    " this version. It looks like an optax.MultiSteps checkpoint (or one"
    " saved without accumulate) whose missing fields the restorer filled"
    " from the target"
    " (flax.training.checkpoints and Orbax's partial_restore=True do);"
    " trained on, its optimizer state would be reset and MultiSteps'"
    f" running mean taken as a sum. {fix} A checkpoint of optax_accum 0.2"
    " (whose counters were fields of their own) restores the same way into"
    " optax_accum.upgrade.v0_2_target(tx, params), converted with"
    " optax_accum.upgrade.from_v0_2(saved, tx.init(params))."
  )


def _same_tree(name: str, got: Any, want: Any) -> None:
  tree: _control.TreeDef = jax.tree.structure(got)
  if tree != jax.tree.structure(want):
    raise ValueError(
      f"`ms_state.{name}` has the tree {jax.tree.structure(got)}, but the"
      f" target's is {jax.tree.structure(want)}: build the target with the"
      " same inner optimizer and params as the MultiSteps run."
    )


def check_restored(opt_state: Any, *, calls: Any = None) -> None:
  """Raises if `opt_state` looks like a checkpoint with no ``accumulate``
  state (an ``optax.MultiSteps`` one) restored into a fresh ``accumulate``
  target, naming :func:`from_multisteps`; a state that ``update`` left
  passes. Call it once after every restore while a run switches, wherever
  no code of this package runs at restore time (a bare state restored by
  hand, Orbax, ``nnx.update``): a step jitted from its first call cannot
  check without a cost on every micro-step.

  Without `calls`, it catches a checkpoint saved mid-cycle (a non-zero
  ``acc_grads`` with fresh counters, which no call leaves); with the
  trainer's own count of calls restored beside it (``TrainState.step``,
  ``nnx.Optimizer.step``), also one saved at a cycle boundary (fresh
  counters though the run had made calls).

  Args:
    opt_state: The restored optimizer state (holding one
      ``AccumulateState``).
    calls: The number of ``update`` calls the checkpointed run had made, as
      restored with it; None if the trainer keeps none.

  Raises:
    ValueError: Naming :func:`from_multisteps`, see above.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> optax_accum.multisteps.check_restored(tx.init(jnp.zeros(2)))
    >>> try:
    ...   optax_accum.multisteps.check_restored(tx.init(jnp.zeros(2)), calls=6)
    ... except ValueError as e:
    ...   print(str(e)[:60])
    The opt_state restored holds an accumulate state with a fres
  """
  _checks.not_a_foreign_restore(find_state(opt_state, "check_restored"))
  _not_restored_from_elsewhere(opt_state, calls, "opt_state")
