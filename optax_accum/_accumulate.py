"""`accumulate`: gradient accumulation as an optax transformation.

Read top to bottom: the configuration, ``init``, ``update`` as a short
sequence of named steps (:mod:`optax_accum._cycle` holds them), then
:func:`accumulate` itself.

Why the step looks like this. A micro-step should cost what the gradient and
its add into the accumulator cost (the floor), on CPU, GPU and TPU alike, and
the step should need no memory beyond the accumulator. So:

1. the add happens before and outside control flow, straight into the
   state's accumulator, with every select (a weight of 0, a skipped
   micro-batch) on the gradient's side (:func:`_tree.add_term`): compiled
   for GPU, XLA then fuses ``acc + grad`` into the GEMM that makes each
   weight gradient, which it does only for an accumulator that is a
   parameter of the step;
2. one conditional decides on the device whether the call ends the cycle
   (:func:`_control.cond`: an integer switch whose branch 0 holds, so that
   no compiler turns it into selects or copies what it passes through). Its
   emitting branch runs the inner optimizer and writes the updates into the
   accumulator's buffer; the holding branch passes everything through;
3. the zero updates of a micro-step are a ``where`` outside the
   conditional, which fuses with ``optax.apply_updates``;
4. once the updates are read, the accumulator returns to zeros and, given
   the params, the updates are applied (what
   :func:`optax_accum.apply_updates` returns), in a way that leaves a
   micro-step reading and writing neither (:mod:`optax_accum._backend`);
5. with ``update(..., emit=True | False)`` the caller says at trace time
   whether the call ends the cycle: no conditional at all.

The structure tests (``tests/test_performance_structure.py`` for CPU,
``tests/test_accelerators.py`` compiled for an H100 and a TPU v5e) hold the
compiled programs to these points. With ``axis_name``, the engine of
:mod:`optax_accum._engines` decides how the sums cross devices.
"""

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_accum import (
  _apply,
  _checks,
  _cycle,
  _engines,
  _every_k,
  _noise_scale,
)
from optax_accum._noise_scale import NoiseStats
from optax_accum._state import AccumulateState

EveryK = int | Callable[..., Any] | _every_k.GrowEveryK


@dataclasses.dataclass(frozen=True)
class _Config:
  """The validated arguments of :func:`accumulate`."""

  inner: Callable[[Any], optax.GradientTransformationExtraArgs]  # k -> inner
  every_k: _every_k.Spec
  reduction: str
  accumulator_dtype: Any
  skip_nonfinite: bool
  axis_name: Hashable | None
  track_noise_scale: bool
  noise_scale_decay: float
  gradients: str
  reduce_dtype: Any


def _inner_for(inner: Any) -> Callable[[Any], Any]:
  """`k -> inner transformation`; checks a fixed inner at once."""
  if isinstance(inner, _every_k.InnerForEveryK):
    return lambda k: _checks.transformation(inner.factory(k))
  transformation = _checks.transformation(inner)
  return lambda k: transformation


# ----------------------------------------------------------------------------
# init.
# ----------------------------------------------------------------------------


def _init(config: _Config, params: optax.Params) -> AccumulateState:
  engine = _engines.for_init(config.axis_name, params)

  def zeros(param):
    dtype = _checks.leaf_accumulator_dtype(
      config.accumulator_dtype, jnp.result_type(param)
    )
    return engine.zeros_like_param(param, dtype)

  every_k = _every_k.first(config.every_k)
  # Separate calls: every leaf is its own buffer, so the whole state can be
  # donated to jit.
  return AccumulateState(
    micro_step=jnp.zeros([], jnp.int32),
    step=jnp.zeros([], jnp.int32),
    every_k=every_k,
    acc_grads=jax.tree.map(zeros, _checks.gradient_params(params)),
    acc_weight=jnp.zeros([], jnp.float32),
    weight_seen=jnp.zeros([2], jnp.float32),
    inner_state=config.inner(every_k).init(params),
    num_skipped=jnp.zeros([], jnp.int32),
    emitted=jnp.zeros([], jnp.bool_),
    noise=(
      _noise_scale.init() if config.track_noise_scale else optax.EmptyState()
    ),
    grow=_every_k.init_grow(config.every_k),
  )


# ----------------------------------------------------------------------------
# update.
# ----------------------------------------------------------------------------


def _update(
  config: _Config,
  updates: optax.Updates,
  state: AccumulateState,
  params: optax.Params | None = None,
  *,
  weight: Any = None,
  flush: Any = False,
  emit: bool | None = None,
  noise_stats: NoiseStats | None = None,
  **extra_args: Any,
) -> tuple[optax.Updates, AccumulateState]:
  _checks.state(state, config.track_noise_scale)
  _checks.state_fits(updates, params, state.acc_grads)
  _checks.grads_match(updates, state.acc_grads)
  _checks.params_match(params, state.acc_grads)
  engine = _engines.for_update(config.axis_name, updates, state.acc_grads)
  call = _checks.update_call(
    config,
    engine,
    weight=weight,
    flush=flush,
    emit=emit,
    noise_stats=noise_stats,
  )
  inner = config.inner(state.every_k)
  if _passes_through(config, call):
    return _inner_alone(inner, updates, state, params, extra_args)
  if not (engine.runs_eagerly or _checks.is_traced(updates)):
    options = dict(
      weight=weight, flush=flush, emit=emit, noise_stats=noise_stats
    )
    return _jitted_update(config)(
      updates, state, params, **options, **extra_args
    )

  micro = _cycle.accept(config, engine, updates, call)
  cycle = _cycle.add(config, engine, state, micro, call.noise_stats, params)
  plan = _cycle.plan(config, engine, inner, extra_args, updates, cycle)
  step = _cycle.Step(config, engine, inner, extra_args, plan)
  if call.emit is None:
    end = _cycle.traced_end(step, cycle)
  elif call.emit:
    end = _cycle.static_end(step, cycle)
  else:
    end = _cycle.held_end(step, cycle)
  known = end.emitted if call.emit is None else call.emit
  _apply.remember(end.updates, known, params, end.new_params)
  return end.updates, _next_state(config, state, micro, cycle, end)


def _passes_through(config: _Config, call: _checks.Call) -> bool:
  """k = 1 without weights, flush, skips, axis or `emit`: `inner` alone."""
  return (
    config.every_k.fixed == 1
    and call.emit is None
    and call.weight is None
    and not call.may_flush
    and not config.skip_nonfinite
    and config.axis_name is None
  )


def _inner_alone(inner, grads, state, params, extra_args):
  """Bit for bit `inner`, with the counters of an emitting call."""
  updates, inner_state = inner.update(
    grads, state.inner_state, params, **extra_args
  )
  return updates, state._replace(
    step=optax.safe_increment(state.step),
    weight_seen=_every_k.add_weight_seen(
      state.weight_seen, jnp.ones([], jnp.float32)
    ),
    inner_state=inner_state,
    emitted=jnp.asarray(True),
  )


# Eager ops on unreduced arrays fail (jax 0.10.2): such an update runs
# jitted. Bounded, so that old configurations (and the inner optimizers they
# hold) are let go.
@functools.lru_cache(maxsize=16)
def _jitted_update(config: _Config) -> Callable[..., Any]:
  return jax.jit(functools.partial(_update, config), static_argnames=("emit",))


def _next_state(config, state, micro, cycle, end: _cycle.End):
  """The state after a call: counters, and the weight seen, k and the
  controller's state, which change only when the call ended a cycle."""
  step = jnp.where(end.emitted, optax.safe_increment(state.step), state.step)
  weight_seen = jnp.where(
    end.emitted,
    _every_k.add_weight_seen(state.weight_seen, end.cycle_weight),
    state.weight_seen,
  )
  k, grow = _every_k.next_k(
    config.every_k,
    state.every_k,
    state.grow,
    step=step,
    weight_seen=weight_seen,
    noise=end.noise,
    cycle_micro_batches=cycle.micro_step,
    emitted=end.emitted,
    decay=config.noise_scale_decay,
  )
  return AccumulateState(
    micro_step=jnp.where(end.cycle_end, 0, cycle.micro_step),
    step=step,
    every_k=jnp.where(end.cycle_end, k, state.every_k),
    acc_grads=end.acc,
    acc_weight=end.acc_weight,
    weight_seen=weight_seen,
    inner_state=end.inner_state,
    num_skipped=jnp.where(
      micro.accepted,
      state.num_skipped,
      optax.safe_increment(state.num_skipped),
    ),
    emitted=end.emitted,
    noise=end.noise,
    grow=jax.tree.map(
      lambda n, o: jnp.where(end.cycle_end, n, o), grow, state.grow
    ),
  )


# ----------------------------------------------------------------------------
# The transformation.
# ----------------------------------------------------------------------------


@_checks.names_multisteps_arguments
def accumulate(
  inner: optax.GradientTransformation,
  every_k: EveryK,
  *,
  reduction: str = "mean",
  accumulator_dtype: Any = jnp.float32,
  skip_nonfinite: bool = False,
  axis_name: Hashable | None = None,
  track_noise_scale: bool = False,
  noise_scale_decay: float = 0.99,
  gradients: str = "mean",
  reduce_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates gradients over ``every_k`` micro-batches, then runs ``inner``.

  Each call adds one micro-batch gradient :math:`g_i` with weight
  :math:`w_i` (``weight=``, default 1) to an accumulator. The call that
  completes a cycle of :math:`k` micro-batches hands ``inner`` the gradient

  .. math::

    \bar g = \frac{\sum_{i=1}^{k} w_i g_i}{\sum_{i=1}^{k} w_i}
    \quad (\text{reduction="mean"}), \qquad
    \bar g = \sum_{i=1}^{k} w_i g_i \quad (\text{reduction="sum"}),

  and returns ``inner``'s updates; the other calls return exact zeros and
  leave ``inner``'s state untouched. ``inner`` runs only on emitting calls
  (under ``jit`` inside a conditional), so its cost, and any schedule inside
  it, is paid once per optimizer step: put everything that should run once
  per optimizer step (clipping, weight decay, schedules) *inside* ``inner``.
  With per-example or per-token mean gradients, pass each micro-batch's
  number of examples or tokens as ``weight``: the emitted gradient is then
  the big-batch mean, however unevenly they are spread.

  After an emitting call the state's ``acc_grads`` is zeros and its
  ``acc_weight`` 0, on every backend, with or without ``jit``: a state
  saved anywhere resumes anywhere.

  Rules for runtime values:

  * a micro-batch of weight 0 counts toward :math:`k` but contributes
    nothing, even with a NaN or Inf gradient (the 0/0 mean of an
    all-padding micro-batch); a cycle whose total weight is not positive
    emits zeros and leaves ``inner``'s state and ``step`` unchanged. A
    concrete negative weight raises, and so does a concrete NaN or Inf one
    unless ``skip_nonfinite``; a traced weight is used as given (a NaN or
    Inf one makes the cycle's gradient NaN);
  * ``update(..., flush=True)`` ends the cycle at this call, normalised by
    what it holds (the partial last window of an epoch); ``emit=True`` or
    ``emit=False`` (a Python bool) says at trace time whether this call
    ends the cycle, and compiles without a conditional;
  * a schedule ``every_k(step)`` is called with the optimizer step; its
    value is rounded down and values below 1 count as 1; under ``jit`` a
    NaN or a value beyond int32 holds the cycle open until ``flush``;
  * with ``skip_nonfinite=True`` a micro-batch whose weight, or whose
    gradient at nonzero weight, holds a NaN or Inf is dropped as if the call
    never happened, and ``num_skipped`` grows; without it the NaN reaches
    ``inner`` at the end of the cycle.

  Args:
    inner: The optimizer to run once per cycle, any
      ``optax.GradientTransformation`` (or :func:`inner_for_every_k`); it
      receives ``update``'s extra keyword arguments (e.g. ``value=``). With
      ``optax.lookahead``, ``init`` takes the ``LookaheadParams`` and the
      gradients are those with respect to ``params.fast``.
    every_k: Micro-batches per cycle: a positive int below :math:`2^{31}`,
      a schedule ``every_k(step)`` or ``every_k(step, weight_seen)``
      (:func:`piecewise_every_k`), or :func:`grow_every_k`.
    reduction: ``"mean"`` (weighted mean, the default) or ``"sum"``.
    accumulator_dtype: The accumulator's dtype (float32 by default, so bf16
      gradients lose no precision); ``None`` keeps each gradient's dtype.
      Complex gradients get the matching complex dtype. Emitted gradients
      keep the gradient's dtype.
    skip_nonfinite: Drop micro-batches with a non-finite gradient or weight.
    axis_name: A mesh axis (or tuple of axes) over which the accumulated
      gradients are summed on emitting calls only: communication once per
      cycle instead of once per micro-batch. Where the axis is bound
      (``shard_map``, ``pmap``, a named ``vmap``) pass each device's local
      gradient and weight (the state's layout:
      :func:`optax_accum.distributed.shard_map_specs`). Under plain
      ``jax.jit`` with a ``jax.set_mesh`` mesh whose axis is
      ``AxisType.Explicit``, pass gradients typed unreduced over it
      (:func:`optax_accum.distributed.local_value_and_grad`) and the
      micro-batch's global weight.
    track_noise_scale: Also estimate the gradient noise scale (a few
      scalars); read it with :func:`noise_scale`. With unreduced gradients
      under plain ``jit``, also pass ``update(..., noise_stats=...)``.
    noise_scale_decay: Decay of the noise scale's moving averages, in
      [0, 1).
    gradients: What each micro-batch gradient is over its ``weight``:
      ``"mean"`` (the default: multiplied by ``weight`` before it is added)
      or ``"sum"`` (a loss summed over the micro-batch: added as is, the
      weight only counting toward the total; no multiply in the add, so
      XLA:GPU fuses it into each weight-gradient GEMM with cuBLAS too).
    reduce_dtype: With ``axis_name``, the dtype in which the accumulated
      gradient crosses devices once per cycle (``None``: the
      accumulator's); ``jnp.bfloat16`` halves the bytes reduced.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` is
    ``update(updates, state, params=None, *, weight=None, flush=False,
    emit=None, noise_stats=None, **extra_args)`` and whose state is an
    :class:`AccumulateState`. Apply its updates with
    :func:`optax_accum.apply_updates`: a micro-step then neither reads nor
    writes the params.

  Raises:
    TypeError, ValueError: At construction, for a bad argument (the message
      names it and the value; a keyword of ``optax.MultiSteps`` names our
      equivalent). At trace time, for gradients or params whose tree,
      shapes or kind differ from the params given to ``init``, a bad
      ``weight``, ``flush``, ``emit`` or ``noise_stats``, or an
      ``axis_name`` that names no usable mesh axis.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> u, state = tx.update(jnp.array([1.0, 2.0]), state, params, weight=1)
    >>> print(u)
    [0. 0.]
    >>> u, state = tx.update(jnp.array([4.0, 8.0]), state, params, weight=3)
    >>> print(u)  # -(1 * [1, 2] + 3 * [4, 8]) / 4
    [-3.25 -6.5 ]
    >>> print(state.acc_grads, state.acc_weight)  # a fresh cycle
    [0. 0.] 0.0
  """
  _checks.options(reduction, axis_name, gradients)
  track_noise_scale = _checks.boolean(track_noise_scale, "track_noise_scale")
  config = _Config(
    inner=_inner_for(inner),
    every_k=_every_k.check(every_k, track_noise_scale),
    reduction=reduction,
    accumulator_dtype=_checks.accumulator_dtype(accumulator_dtype),
    skip_nonfinite=_checks.boolean(skip_nonfinite, "skip_nonfinite"),
    axis_name=axis_name,
    track_noise_scale=track_noise_scale,
    noise_scale_decay=_noise_scale.check_decay(noise_scale_decay),
    gradients=gradients,
    reduce_dtype=_checks.reduce_dtype(reduce_dtype, axis_name),
  )
  # `init` is `partial(_init, config)`: `config_of` reads the configuration
  # back from it (optax_accum.multisteps.restore_target builds the state of
  # the MultiSteps run a transformation replaces).
  return optax.GradientTransformationExtraArgs(
    functools.partial(_init, config), functools.partial(_update, config)
  )


def config_of(tx: Any, reader: str) -> _Config:
  """The validated arguments of the :func:`accumulate` that returned `tx`.

  Raises:
    TypeError: If `tx` is not a transformation :func:`accumulate` returned
      (an ``optax.chain`` around one included: its parts are not reachable).
  """
  init = getattr(tx, "init", None)
  if isinstance(init, functools.partial) and init.func is _init:
    return init.args[0]
  raise TypeError(
    f"`{reader}` needs the transformation optax_accum.accumulate returned"
    f" (`tx`), got {type(tx).__name__}: pass that transformation itself,"
    " not a chain or wrapper around it."
  )
