"""`apply_updates`: a micro-step that leaves the params alone.

``optax.apply_updates(params, updates)`` reads and writes every parameter on
every call, also on the micro-steps of :func:`optax_accum.accumulate`, whose
updates are zeros: on an accelerator that is as many bytes again as the
gradient's add into the accumulator. :func:`apply_updates` applies them only
when they were emitted.

**The contract between ``update`` and ``apply_updates``** (owned here, and
only here). A traced ``accumulate`` update given `params` computes, in the
conditional that closes a cycle, the params with the updates applied (and
passes them through untouched on a micro-step): applying them there, where
the updates sit in the accumulator's buffer, is what keeps a micro-step free
of copies. So:

* the writer: ``update`` calls :func:`remember` with the update tracers it
  returns, its ``bool[]`` (or, with ``emit=``, Python bool) decision, the
  params it was given and the params it computed;
* the table: :data:`_RECORDS`, keyed by ``id()`` of the first update leaf;
  each record holds weak references to the update and param leaves, so it
  keeps no tracer alive;
* the reader: :func:`apply_updates` looks up its `updates` (:func:`_recall`)
  and uses the record only if every update leaf, and every param leaf, is
  the very object the update returned and was given; then it returns the
  params computed in the conditional, and XLA drops whichever of the two
  results goes unused. Given anything else (updates transformed after
  ``accumulate``, as an ``optax.chain`` member after it does, or other
  params) it applies what it is given inside a conditional of its own: the
  same values, in a program that may copy the accumulator on micro-steps
  (``optax_accum.inspect.check_step`` reports it). It says so: a
  ``UserWarning`` that names the misuse and its fix, once per misuse and
  process (:func:`_warn_slow_route`);
* lifetime: an entry lives as long as its first update tracer, i.e. for the
  trace that made it (``weakref.finalize`` removes it); eager calls record
  nothing (nothing runs there that could be skipped);
* threads: JAX traces on the calling thread; entries of traces running at
  once in several threads cannot collide (``id()`` is unique among live
  objects, and a match needs the same objects), and each dict operation is
  atomic under the GIL. A record is only ever read back by the thread whose
  trace holds its tracers.
"""

import warnings
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _control
from optax_accum._state import find_state


class _Record(NamedTuple):
  """What an ``accumulate`` call returned, for :func:`apply_updates`."""

  updates: tuple  # weak references to the update leaves it returned
  emitted: Any  # bool[] of that call; a Python bool for a static call
  params: tuple  # weak references to the params it was given
  new_params: Any  # those params with the updates applied, or None


# id(first update leaf) -> _Record, while that leaf (a tracer) lives.
_RECORDS: dict[int, _Record] = {}


def _same(refs: tuple, tree: Any) -> bool:
  leaves = jax.tree.leaves(tree)
  return len(refs) == len(leaves) and all(
    ref() is x for ref, x in zip(refs, leaves, strict=True)
  )


def remember(
  updates: Any, emitted: Any, params: Any = None, new_params: Any = None
) -> bool:
  """Records that `updates` came from an ``accumulate`` call; returns
  whether it did (only traced calls are recorded).

  Args:
    updates: the update tree the call returns.
    emitted: the call's emission flag: a ``bool[]`` for a decision on the
      device, a Python bool when the call knew it at trace time (``emit=``).
    params: the params the call was given, if any.
    new_params: `params` with `updates` applied, as the call computed them.
  """
  leaves = jax.tree.leaves(updates)
  if not leaves or not all(isinstance(x, jax.core.Tracer) for x in leaves):
    return False  # Eager: nothing runs that could be skipped.
  key = id(leaves[0])
  refs = tuple(map(weakref.ref, leaves))
  param_refs = tuple(map(weakref.ref, jax.tree.leaves(params)))
  _RECORDS[key] = _Record(refs, emitted, param_refs, new_params)
  weakref.finalize(leaves[0], _RECORDS.pop, key, None)
  return True


def _recall(updates: Any) -> _Record | None:
  """The record of `updates` if they are exactly what an ``accumulate`` call
  returned in this trace."""
  leaves = jax.tree.leaves(updates)
  record = _RECORDS.get(id(leaves[0])) if leaves else None
  if record is None or not _same(record.updates, updates):
    return None
  return record


def _keep(params: Any, updates: Any) -> Any:
  del updates
  return params


def apply_updates(
  params: optax.Params, updates: optax.Updates, opt_state: optax.OptState
) -> optax.Params:
  """``optax.apply_updates`` that reads and writes nothing on a micro-step.

  A drop-in for ``optax.apply_updates`` in a train step that uses
  :func:`optax_accum.accumulate`: on an emitting call it returns exactly
  ``optax.apply_updates(params, updates)``; on any other call it returns
  `params`, unread and unwritten (donated, they pass through in place).
  Under ``jit`` the decision is a conditional on
  :func:`optax_accum.has_updated`; with ``update(..., emit=...)`` it is
  known at trace time and there is no conditional at all.

  Args:
    params: The params, as for ``optax.apply_updates``.
    updates: The updates returned with `opt_state`.
    opt_state: The optimizer state returned with `updates`: one that holds
      an :class:`AccumulateState` (itself, or inside an ``optax.chain``,
      ``inject_hyperparams`` or a ``flax.nnx.Optimizer``'s ``opt_state``),
      or one that holds none (a trainer with accumulation switched off),
      for which this is ``optax.apply_updates(params, updates)``.

  Returns:
    The new params, with the dtypes of `params`.

  Raises:
    ValueError: If `opt_state` holds several :class:`AccumulateState`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> @jax.jit
    ... def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax_accum.apply_updates(params, updates, state), state
    >>> for g in (1.0, 3.0):
    ...   params, state = step(params, state, jnp.full(2, g))
    ...   print(params)
    [0. 0.]
    [-2. -2.]
  """
  state = find_state(opt_state, "apply_updates", missing_ok=True)
  if state is None:  # No accumulation: every call is an optimizer step.
    return optax.apply_updates(params, updates)
  record = _recall(updates)
  # jnp.asarray unwraps array-like leaves too, such as the OptArray leaves
  # of a flax.nnx.Optimizer's opt_state.
  emitted = jnp.asarray(state.emitted if record is None else record.emitted)
  how = _route(record, params, emitted)
  if how == "static" and record is not None:  # (static and applied: a record)
    return optax.apply_updates(params, updates) if record.emitted else params
  if how == "applied" and record is not None:
    return record.new_params
  if how == "eager":
    return optax.apply_updates(params, updates) if bool(emitted) else params
  _warn_slow_route(record)
  return _control.cond(emitted, optax.apply_updates, _keep, params, updates)


def _route(record: _Record | None, params: Any, emitted: jax.Array) -> str:
  """How :func:`apply_updates` applies: ``"static"`` (the update knew at
  trace time, ``emit=``), ``"applied"`` (the params the update computed,
  per the contract), ``"eager"`` (a concrete decision), or ``"fallback"``
  (updates or params other than the update's, applied in a conditional of
  their own)."""
  if (
    record is not None
    and record.new_params is not None
    and _same(record.params, params)
  ):
    return "applied"
  if record is not None and isinstance(record.emitted, bool):
    return "static"
  if not isinstance(emitted, jax.core.Tracer):
    return "eager"
  return "fallback"


# Why a traced apply_updates took its own conditional, and the fix; each
# said once per process (`_WARNED`), since a jitted step traces once.
_SLOW_ROUTES = {
  "foreign_updates": (
    "the updates are not the ones an accumulate update returned in this"
    " trace: transformed after it (an optax.chain member after accumulate,"
    " a scale by hand), or returned by an update traced in another jitted"
    " function. Put every per-step transformation inside accumulate's"
    " `inner` (it runs once per cycle there), and call apply_updates in the"
    " same jitted step as tx.update, on the updates it returned."
  ),
  "no_params": (
    "the update that returned these updates was given no params. Pass them:"
    " tx.update(grads, opt_state, params)."
  ),
  "other_params": (
    "the params are not the ones given to the update that returned these"
    " updates. Pass apply_updates the same params as tx.update."
  ),
}
_WARNED: set[str] = set()


def _warn_slow_route(record: _Record | None) -> None:
  """Warns, once per misuse, that :func:`apply_updates` applies in a
  conditional of its own: the right params, in a program that may read and
  write them (and copy the accumulator) on every micro-step."""
  if record is None:
    why = "foreign_updates"
  elif record.new_params is None:
    why = "no_params"
  else:
    why = "other_params"
  if why in _WARNED:
    return
  _WARNED.add(why)
  warnings.warn(
    "optax_accum.apply_updates returns the right params, but not by its"
    " fast route (the params the update computed, untouched on a"
    " micro-step): " + _SLOW_ROUTES[why],
    UserWarning,
    stacklevel=3,
  )
