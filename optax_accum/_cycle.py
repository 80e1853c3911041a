"""The steps of one ``accumulate`` update, and the ways a call ends.

:func:`accept` decides whether a micro-batch counts, :func:`add` adds it
into the cycle's sums, :func:`plan` finds what the inner optimizer returns,
and one of three ends closes the call:

* :func:`traced_end` (the default): one conditional decides on the device
  whether the call ends the cycle. How its buffers are used is one of two
  strategies, chosen once per trace by :func:`plan`: :class:`SharedBuffer`
  writes the updates into the accumulator's own buffer (design point 2 of
  :mod:`optax_accum._accumulate`); :class:`OwnBuffer` gives them buffers of
  their own where the types cannot share one;
* :func:`static_end` (``emit=True``) and :func:`held_end` (``emit=False``):
  the caller decided at trace time; no conditional.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _backend, _checks, _control, _noise_scale, _tree
from optax_accum._noise_scale import NoiseStats
from optax_accum._state import AccumulateState, NoiseScaleState

# ----------------------------------------------------------------------------
# The records.
# ----------------------------------------------------------------------------


class MicroBatch(NamedTuple):
  """One call's gradient and what the caller said about it."""

  grads: Any
  weight: jax.Array  # float32[]; 1 when no weight was given
  weighted: bool  # static: a weight was given
  accepted: jax.Array  # bool[]: not dropped by skip_nonfinite
  flush: jax.Array  # bool[]: the caller ends the cycle here


class Cycle(NamedTuple):
  """The cycle after this call's add: what an end reads."""

  acc: Any  # the (device-local) sum
  weight: jax.Array  # float32[]: its (device-local) total weight
  micro_step: jax.Array  # int32[]: micro-batches accepted in it
  end: jax.Array  # bool[]: this call ends the cycle
  noise: Any  # NoiseScaleState, or optax.EmptyState() when not tracked
  inner_state: Any
  params: Any  # as given to update, or None


class Plan(NamedTuple):
  """Static facts about this trace, found with ``jax.eval_shape``."""

  grad_types: Any  # ShapeDtypeStructs of the gradient `inner` sees
  update_types: Any  # ... of inner's updates
  inner_state_types: Any  # ... of inner's new state
  shares_buffer: bool  # the updates fit the accumulator's buffer
  reduced_specs: Any  # the reduced sum's layout (unreduced engine), or None


@dataclasses.dataclass(frozen=True)
class Step:
  """What one traced call holds fixed: the configuration, the engine, the
  inner transformation (for this cycle's k), its extra arguments and the
  plan."""

  config: Any
  engine: Any
  inner: optax.GradientTransformationExtraArgs
  extra_args: dict
  plan: Plan


class Emission(NamedTuple):
  """A cycle's (reduced) mean gradient run through the inner optimizer."""

  updates: Any
  inner_state: Any
  emitted: jax.Array  # bool[]: the cycle's total weight was positive
  weight: jax.Array  # float32[]: its global total weight
  noise: Any  # the noise-scale state with the cycle folded in
  total: Any  # its reduced sum
  params: Any  # with the updates applied (asked for and given), else None


class End(NamedTuple):
  """How a call ends: what it returns and what it leaves for the next."""

  updates: Any
  emitted: jax.Array  # bool[]
  new_params: Any  # the params with `updates` applied, or None
  acc: Any
  acc_weight: jax.Array
  noise: Any
  inner_state: Any
  cycle_end: jax.Array  # bool[]
  cycle_weight: jax.Array  # the ended cycle's global weight, else 0


# ----------------------------------------------------------------------------
# accept, add, plan.
# ----------------------------------------------------------------------------


def accept(config, engine, grads, call: _checks.Call) -> MicroBatch:
  """Whether the micro-batch counts, and whether it ends the cycle, agreed
  over the devices."""
  weighted = call.weight is not None
  weight = call.weight if weighted else jnp.ones([], jnp.float32)
  accepted = jnp.asarray(True)
  flush = call.flush
  if config.skip_nonfinite:
    # A zero-weight micro-batch (e.g. the 0/0 mean of an all-padding
    # micro-batch) counts toward k and contributes nothing, NaN or not.
    finite = engine.all_finite(grads)
    accepted = jnp.isfinite(weight) & (finite | (weight == 0))
    accepted = engine.agree(jax.lax.pmin, accepted)
  if call.may_flush:
    flush = engine.agree(jax.lax.pmax, flush)
  return MicroBatch(grads, weight, weighted, accepted, flush)


def add(
  config: Any,
  engine: Any,
  state: AccumulateState,
  micro: MicroBatch,
  noise_stats: NoiseStats | None,
  params: Any,
) -> Cycle:
  """The cycle after adding `micro`: sums, counters, noise-scale sums."""
  acc, weight = _backend.cycle_start(state)
  keep = micro.accepted if config.skip_nonfinite else None
  scale = micro.weighted and config.gradients == "mean"
  if scale:
    nonzero = micro.weight != 0
    keep = nonzero if keep is None else keep & nonzero
  # gradients="sum": the gradient carries its weight already; adding it as
  # is lets every GEMM backend fuse the add (cuBLAS only with no scale).
  acc = jax.tree.map(
    lambda a, g: _tree.add_term(
      a, g, ops=engine, weight=micro.weight if scale else None, keep=keep
    ),
    acc,
    micro.grads,
  )
  micro_step = state.micro_step + micro.accepted.astype(jnp.int32)
  return Cycle(
    acc=acc,
    weight=weight + jnp.where(micro.accepted, micro.weight, 0.0),
    micro_step=micro_step,
    end=(micro_step >= state.every_k) | micro.flush,
    noise=_add_noise(config, engine, state, micro, noise_stats),
    inner_state=state.inner_state,
    params=params,
  )


def _add_noise(config, engine, state, micro, stats) -> Any:
  """The noise-scale sums after `micro`: measured here, or by the gradient
  helper (`stats`, unreduced engine). Untracked (an empty record): as is."""
  if not isinstance(state.noise, NoiseScaleState):
    return state.noise
  fresh = state.micro_step == 0
  if stats is not None:
    return _noise_scale.add_stats(
      state.noise, stats, micro.weight, micro.accepted, fresh
    )
  return _noise_scale.add_micro_batch(
    state.noise,
    micro.grads,
    micro.weight,
    micro.accepted,
    fresh,
    summed=config.gradients == "sum",
    sample_axes=engine.sample_axes(),
  )


def _holds_exactly(wide: Any, narrow: Any) -> bool:
  """Whether every value of dtype `narrow` survives a trip through `wide`."""
  wide, narrow = jnp.dtype(wide), jnp.dtype(narrow)
  if wide == narrow:
    return True
  if not (
    jnp.issubdtype(wide, jnp.inexact) and jnp.issubdtype(narrow, jnp.inexact)
  ):
    return False
  if jnp.issubdtype(narrow, jnp.complexfloating) and not jnp.issubdtype(
    wide, jnp.complexfloating
  ):
    return False
  w, n = jnp.finfo(wide), jnp.finfo(narrow)
  return w.nmant >= n.nmant and w.maxexp >= n.maxexp and w.minexp <= n.minexp


def plan(config, engine, inner, extra_args, grads, cycle: Cycle) -> Plan:
  """What `inner` returns for this trace, and whether its updates can be
  written into the accumulator's buffer."""
  del config
  params = cycle.params
  gradient_params = None if params is None else _checks.gradient_params(params)
  specs = engine.reduced_specs(cycle.acc, gradient_params)
  if specs is None:
    grad_types = jax.tree.map(
      lambda g: jax.ShapeDtypeStruct(jnp.shape(g), jnp.result_type(g)), grads
    )
  else:  # The gradient `inner` sees is reduced, with a sharding in its type.
    grad_types = jax.tree.map(
      lambda g, spec: jax.ShapeDtypeStruct(
        jnp.shape(g), jnp.result_type(g), sharding=spec
      ),
      grads,
      specs,
    )
  update_types, inner_state_types = jax.eval_shape(
    lambda g, s, p: inner.update(g, s, p, **extra_args),
    grad_types,
    cycle.inner_state,
    params,
  )
  acc = cycle.acc
  fits = jax.tree.structure(update_types) == jax.tree.structure(acc) and all(
    u.shape == a.shape and _holds_exactly(a.dtype, u.dtype)
    for u, a in zip(
      jax.tree.leaves(update_types), jax.tree.leaves(acc), strict=True
    )
  )
  return Plan(
    grad_types=grad_types,
    update_types=update_types,
    inner_state_types=inner_state_types,
    shares_buffer=fits and engine.shares_buffer(acc),
    reduced_specs=specs,
  )


# ----------------------------------------------------------------------------
# The emission: the cycle's mean through the inner optimizer.
# ----------------------------------------------------------------------------


def _inverse_weight(total_weight: jax.Array) -> jax.Array:
  """1 / W, with 1 for a non-positive W (whose cycle emits nothing); a NaN W
  stays NaN so that it reaches ``inner``."""
  return 1.0 / jnp.where(total_weight <= 0, 1.0, total_weight)


def _mean_sq_norm(acc: Any, total_weight: jax.Array) -> jax.Array:
  return _noise_scale.sq_norm(acc, _inverse_weight(total_weight))


def _reduce(step: Step, acc: Any, weight: Any, noise: Any, per_leaf: bool):
  """The cycle's sums over the devices, in `reduce_dtype` on the wire."""
  tracked = isinstance(noise, NoiseScaleState)
  scalars = (weight,)
  if tracked:  # The count as float32, to join the sum.
    scalars += (noise.sq_norm_sum, noise.count.astype(jnp.float32))
  wire = step.config.reduce_dtype
  kept = jax.tree.map(lambda a: a.dtype, acc)
  if wire is not None:
    acc = jax.tree.map(lambda a: a.astype(wire), acc)
  acc, scalars = step.engine.reduce(
    acc, scalars, per_leaf=per_leaf, specs=step.plan.reduced_specs
  )
  if wire is not None:
    acc = jax.tree.map(lambda a, d: a.astype(d), acc, kept)
  if tracked:
    noise = noise._replace(
      sq_norm_sum=scalars[1], count=scalars[2].astype(jnp.int32)
    )
  return acc, scalars[0], noise


def _mean_gradient(step: Step, acc: Any, inv_weight: jax.Array) -> Any:
  """The gradient handed to `inner`, in the gradients' own dtypes."""

  def mean_leaf(a, g):
    compute = _tree.compute_dtype(a.dtype)
    a = a.astype(compute)
    if step.config.reduction == "mean":
      a = _control.times_inverse(a, inv_weight)
    return a.astype(g.dtype)

  # `grad_types` holds shapes only: closing over the gradient arrays would
  # make them operands of the conditional and materialise them.
  return jax.tree.map(mean_leaf, acc, step.plan.grad_types)


def emission(
  step: Step,
  cycle: Cycle,
  mean_sq: Any,
  *,
  static: bool,
  weight_checked: bool,
  apply: bool = False,
) -> Emission:
  """The cycle's (reduced) mean gradient through the inner optimizer.

  Args:
    mean_sq: ``|mean gradient|^2`` measured before, or None to measure the
      reduced sum here (with the noise scale tracked).
    static: the caller knew at trace time that the call emits (no
      conditional): the leaves are reduced one by one, so that each may
      start as soon as its gradient is added; selects keep a weightless
      cycle's result out.
    weight_checked: the caller runs this only for a positive (or NaN) total
      weight; otherwise see :func:`_backend.run_if_weighted`.
    apply: also apply the updates to the params (when given), next to
      `inner` (not with `static`).
  """
  total, weight, noise = _reduce(
    step, cycle.acc, cycle.weight, cycle.noise, per_leaf=static
  )
  inv_weight = _inverse_weight(weight)
  if isinstance(noise, NoiseScaleState):
    if mean_sq is None:  # The global mean, known only after the reduction.
      mean_sq = _noise_scale.sq_norm(total, inv_weight, step.config.axis_name)
    noise = _noise_scale.fold_cycle(
      noise, mean_sq, weight, step.config.noise_scale_decay
    )
  apply = apply and cycle.params is not None
  operands = (total, inv_weight, cycle.inner_state, cycle.params)
  # A NaN weight runs `inner`, so that the NaN reaches it.
  emitted = jnp.asarray(True) if weight_checked else ~(weight <= 0)
  run = functools.partial(_run_inner, step, apply)
  select = functools.partial(_run_then_select, step, apply)
  if weight_checked:
    updates, inner_state, params = run(emitted, *operands)
  elif static:
    updates, inner_state, params = select(emitted, *operands)
  else:
    skip = functools.partial(_skip_inner, step)
    updates, inner_state, params = _backend.run_if_weighted(
      emitted, run, skip, select, *operands
    )
  params = params if apply else None
  return Emission(updates, inner_state, emitted, weight, noise, total, params)


def _run_inner(step, apply, emitted, total, inv_weight, state, params):
  """`inner` on the cycle's mean gradient, computed here so that it fuses
  into the inner's kernels; with `apply`, the params updated too."""
  del emitted
  grad = _mean_gradient(step, total, inv_weight)
  updates, state = step.inner.update(grad, state, params, **step.extra_args)
  if apply:
    params = optax.apply_updates(params, updates)
  return updates, state, params


def _run_then_select(step, apply, emitted, total, inv_weight, state, params):
  """`inner` run anyway, its result kept for a positive weight by selects
  that fuse into the inner's own kernels."""
  run = _run_inner(step, False, emitted, total, inv_weight, state, params)
  updates, new_state, _ = run
  updates = jax.tree.map(
    lambda u: jnp.where(emitted, u, jnp.zeros([], u.dtype)), updates
  )
  new_state = _tree.select(emitted, new_state, state)
  if apply:
    params = _tree.select(emitted, optax.apply_updates(params, updates), params)
  return updates, new_state, params


def _skip_inner(step, emitted, total, inv_weight, state, params):
  """No weight: zero updates (traced, one per leaf: `emitted` is false
  here); the params and `inner`'s state as they were."""
  del total, inv_weight
  leaves, treedef = jax.tree.flatten(step.plan.update_types)
  zeros = _control.distinct_zeros(leaves, emitted, _tree.zeros_like_type)
  state = _settle(state, step.plan.inner_state_types)
  return jax.tree.unflatten(treedef, zeros), state, params


def _settle(inner_state: Any, types: Any) -> Any:
  """`inner_state` in the dtypes `inner` itself gives its new state.

  So that a holding call leaves the state typed as an emitting one, and
  the inner state behaves as with `inner` alone (which may widen a state
  leaf, e.g. bf16 moments fed float32 gradients).
  """
  return jax.tree.map(
    lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype),
    inner_state,
    types,
  )


# ----------------------------------------------------------------------------
# Ending the call: decided on the device, with one of two buffer strategies.
# ----------------------------------------------------------------------------


class Decision(NamedTuple):
  """What the conditional that may end a cycle decides, beside buffers."""

  weight: jax.Array  # the cycle's total weight (global after an emission)
  noise: Any
  inner_state: Any
  emitted: jax.Array  # bool[]
  cycle_weight: jax.Array  # the ended cycle's global weight, else 0


class SharedBuffer:
  """Design point 2: the emitting branch writes the updates into the
  accumulator's buffer; the holding branch passes the accumulator through.
  Once the updates are read, :func:`_backend.close_shared` returns the
  buffer to zeros and applies the updates to the params."""

  @staticmethod
  def enters(step: Step, cycle: Cycle) -> jax.Array:
    if not step.engine.global_weight:
      # The global weight is known inside the branch only.
      return cycle.end
    # A weightless cycle skips the branch (a NaN total still enters, so
    # that the NaN reaches `inner`); the closing step zeroes it.
    return cycle.end & ~(cycle.weight <= 0)

  @staticmethod
  def emit(step: Step, cycle: Cycle, mean_sq: Any) -> tuple[Any, Decision]:
    done = emission(
      step,
      cycle,
      mean_sq,
      static=False,
      weight_checked=step.engine.global_weight,
    )
    out = jax.tree.map(lambda u, a: u.astype(a.dtype), done.updates, cycle.acc)
    # The weight twice, as the ended cycle's global weight too: under
    # shard_map the first copy joins the device-local accumulator's slot.
    return out, Decision(
      done.weight, done.noise, done.inner_state, done.emitted, done.weight
    )

  @staticmethod
  def hold(step: Step, cycle: Cycle, mean_sq: Any) -> tuple[Any, Decision]:
    del mean_sq
    return cycle.acc, _held_decision(step, cycle)

  @staticmethod
  def close(step: Step, cycle: Cycle, out: Any, decision: Decision):
    """``(updates, new_params, acc, acc_weight)`` after the conditional."""
    new_params, acc = _backend.close_shared(
      step.engine,
      step.plan.update_types,
      cycle.params,
      out,
      cycle.end,
      decision.emitted,
    )
    updates = _emitted_updates(out, decision.emitted, step.plan)
    acc_weight = _backend.weight_after(decision.weight, cycle.end)
    return updates, new_params, acc, acc_weight


class OwnBuffer:
  """The updates in buffers of their own (types that cannot share the
  accumulator's): the emitting branch also returns the accumulator to zeros
  and applies the updates to the params."""

  @staticmethod
  def enters(step: Step, cycle: Cycle) -> jax.Array:
    del step  # The branch closes the cycle: every cycle's end enters.
    return cycle.end

  @staticmethod
  def emit(step: Step, cycle: Cycle, mean_sq: Any) -> tuple[Any, Decision]:
    done = emission(
      step, cycle, mean_sq, static=False, weight_checked=False, apply=True
    )
    acc = step.engine.cleared(cycle.acc, done.total, cycle.end)
    decision = Decision(
      done.weight, done.noise, done.inner_state, done.emitted, done.weight
    )
    return (done.updates, acc, done.params), decision

  @staticmethod
  def hold(step: Step, cycle: Cycle, mean_sq: Any) -> tuple[Any, Decision]:
    del mean_sq
    # `cycle.end` is false here: traced zeros, one per leaf.
    leaves, treedef = jax.tree.flatten(step.plan.update_types)
    zeros = _control.distinct_zeros(leaves, cycle.end, _tree.zeros_like_type)
    updates = jax.tree.unflatten(treedef, zeros)
    return (updates, cycle.acc, cycle.params), _held_decision(step, cycle)

  @staticmethod
  def close(step: Step, cycle: Cycle, out: Any, decision: Decision):
    del step
    updates, acc, new_params = out
    acc_weight = jnp.where(cycle.end, 0.0, decision.weight)
    return updates, new_params, acc, acc_weight


def _held_decision(step: Step, cycle: Cycle) -> Decision:
  return Decision(
    weight=cycle.weight,
    noise=cycle.noise,
    inner_state=_settle(cycle.inner_state, step.plan.inner_state_types),
    emitted=jnp.asarray(False),
    cycle_weight=jnp.zeros([], cycle.weight.dtype),
  )


def _emitted_updates(out: Any, emitted: jax.Array, plan: Plan) -> Any:
  """Design point 3: the updates, exact zeros unless emitted; outside the
  conditional, so that the select fuses with ``optax.apply_updates``."""
  return jax.tree.map(
    lambda b, t: jnp.where(emitted, b.astype(t.dtype), 0),
    out,
    plan.update_types,
  )


def traced_end(step: Step, cycle: Cycle) -> End:
  """The device decides whether this call ends the cycle (the default)."""
  buffer = SharedBuffer if step.plan.shares_buffer else OwnBuffer
  enter = buffer.enters(step, cycle)
  mean_sq = None
  if _measures_mean_here(step):
    mean_sq = _control.in_own_conditional(
      enter,
      _mean_sq_norm,
      jnp.zeros([], jnp.float32),
      cycle.acc,
      cycle.weight,
    )
  out, decision = _control.cond(
    enter,
    functools.partial(buffer.emit, step),
    functools.partial(buffer.hold, step),
    cycle,
    mean_sq,
  )
  updates, new_params, acc, acc_weight = buffer.close(
    step, cycle, out, decision
  )
  return End(
    updates=updates,
    emitted=decision.emitted,
    new_params=new_params,
    acc=acc,
    acc_weight=acc_weight,
    noise=decision.noise,
    inner_state=decision.inner_state,
    cycle_end=cycle.end,
    cycle_weight=decision.cycle_weight,
  )


def _measures_mean_here(step: Step) -> bool:
  """The noise scale's |mean|^2 is measured before the conditional: on one
  device (with `axis_name` it needs the reduced sum, inside)."""
  return step.config.track_noise_scale and step.engine.axis_name is None


def static_end(step: Step, cycle: Cycle) -> End:
  """``emit=True``: the caller says this call ends the cycle. No
  conditional (see :func:`emission`); the accumulator is left at zeros."""
  mean_sq = None
  if _measures_mean_here(step):
    mean_sq = _mean_sq_norm(cycle.acc, cycle.weight)
  done = emission(step, cycle, mean_sq, static=True, weight_checked=False)
  cleared = step.engine.cleared(
    cycle.acc, done.total, _control.traced_true(cycle.micro_step)
  )
  return End(
    updates=done.updates,
    emitted=done.emitted,
    new_params=None,
    acc=cleared,
    acc_weight=jnp.zeros_like(cycle.weight),
    noise=done.noise,
    inner_state=done.inner_state,
    cycle_end=jnp.asarray(True),
    cycle_weight=done.weight,
  )


def held_end(step: Step, cycle: Cycle) -> End:
  """``emit=False``: the caller says the cycle goes on. The add and the
  counters only: no conditional, no inner optimizer."""
  return End(
    updates=jax.tree.map(_tree.zeros_like_type, step.plan.update_types),
    emitted=jnp.asarray(False),
    new_params=None,
    acc=cycle.acc,
    acc_weight=cycle.weight,
    noise=cycle.noise,
    inner_state=_settle(cycle.inner_state, step.plan.inner_state_types),
    cycle_end=jnp.asarray(False),
    # Not zeros_like: under shard_map the weight varies over the devices.
    cycle_weight=jnp.zeros([], jnp.float32),
  )
