"""`accumulate`: gradient accumulation as an optax transformation.

Read top to bottom. The configuration and :func:`accumulate`; ``init``; then
``update``, which tells one call from its arguments to the next state, and
below it the steps it calls, in the order it calls them. The words used here
(micro-batch, cycle, end, emit, updated, ...) have one meaning each: see the
glossary in ``optax_accum/README.md``.

Why a call looks like this. A micro-step should cost what the gradient and
its add into the accumulator cost (the floor), on CPU, GPU and TPU alike,
and the step should need no memory beyond the accumulator. So:

* **the add** happens before and outside control flow, straight into the
  state's accumulator, with every select (a weight of 0, a skipped
  micro-batch) on the gradient's side (:func:`add_term`): compiled for GPU,
  XLA then fuses ``acc + grad`` into the GEMM that makes each weight
  gradient, which it does only for an accumulator that is a parameter of
  the step;
* **one conditional** decides on the device whether the call ends the cycle
  (:func:`_control.cond`: an integer switch whose branch 0 holds, so that no
  compiler turns it into selects or copies what it passes through). Its
  updating branch runs the inner optimizer on the cycle's mean gradient and,
  where the types allow, writes the updates into the accumulator's own
  buffer (:func:`_shares_buffer`); the holding branch passes everything
  through;
* **the zero updates** of a micro-step are a ``where`` outside the
  conditional, which fuses with ``optax.apply_updates``;
* **closing the cycle**: given the params, the updates are applied (what
  :func:`optax_accum.apply_updates` returns, see ``_apply.py``) in a way
  that leaves a micro-step reading and writing neither; on GPU/TPU the
  accumulator returns to zeros there, while on CPU it keeps the updates as
  *leftovers* (``micro_step`` 0 with the cycle's weight beside them, -inf
  for a weightless cycle), which the next call does not read: its add
  starts from zeros, a select fused into it (:func:`_close` and
  :func:`_cycle_start`: where CPU and GPU/TPU programs differ);
* with ``update(..., emit=True | False)`` the caller says at trace time
  whether the call ends the cycle: no conditional to decide it (a CPU
  ``emit=True`` step runs the inner optimizer in one, see
  :func:`_end_cycle_now`).

The structure tests (``tests/test_performance_structure.py`` for CPU,
``tests/test_accelerators.py`` compiled for an H100 and a TPU v5e) hold the
compiled programs to these points. The compiler workarounds the code calls
by name live in ``_control.py``, each with the behaviour it defeats.

**Devices.** Without ``axis_name`` everything below runs on one device with
plain ``jnp`` (:class:`_control.Local`). With it, an engine of ``_engines.py``
(chosen once per trace) says how the sums cross devices: ``ShardMap`` where
the axis is bound, ``Unreduced`` for gradients typed unreduced under plain
``jit``. The steps call the engine's methods; ``init`` and the start of
``update`` choose the engine, and three steps ask ``axis_name`` whether
the sums cross devices at all (the reduction, the reduced sum's layout,
whether the updates may share the accumulator's buffer), so that a call
without it calls only :class:`Local`'s methods.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding

from optax_accum import _apply, _checks, _control, _every_k, _noise_scale
from optax_accum import _state as _state_lib
from optax_accum._control import LOCAL, Local
from optax_accum._noise_scale import NoiseStats
from optax_accum._state import AccumulateState, NoiseScaleState

EveryK = int | Callable[..., Any] | _every_k.GrowEveryK
# What `reduction=` and `gradients=` take (checked at construction too).
MeanOrSum = Literal["mean", "sum"]
# What `rounding=` takes.
Rounding = Literal["nearest", "stochastic"]
# The noise-scale sums, or optax.EmptyState() when not tracked.
Noise = NoiseScaleState | optax.EmptyState
# A tree of types (jax.ShapeDtypeStruct leaves, from jax.eval_shape).
Types = Any

# ----------------------------------------------------------------------------
# The configuration and the transformation.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  """The validated arguments of :func:`accumulate`."""

  # The inner transformation for a cycle of k micro-batches (k is fixed but
  # for inner_for_every_k).
  inner: Callable[[jax.Array], optax.GradientTransformationExtraArgs]
  every_k: _every_k.Spec
  reduction: MeanOrSum
  accumulator_dtype: jnp.dtype | None
  skip_nonfinite: bool
  axis_name: Hashable | None
  track_noise_scale: bool
  noise_scale_decay: float
  gradients: MeanOrSum  # what each gradient is over its weight
  reduce_dtype: jnp.dtype | None
  rounding: Rounding  # of each add into a bfloat16 accumulator


@_checks.names_multisteps_arguments
def accumulate(
  inner: optax.GradientTransformation,
  every_k: EveryK,
  *,
  reduction: MeanOrSum = "mean",
  accumulator_dtype: jax.typing.DTypeLike | None = jnp.float32,
  skip_nonfinite: bool = False,
  axis_name: Hashable | None = None,
  track_noise_scale: bool = False,
  noise_scale_decay: float = _noise_scale.DEFAULT_DECAY,
  gradients: MeanOrSum = "mean",
  reduce_dtype: jax.typing.DTypeLike | None = None,
  rounding: Rounding = "nearest",
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
  leave ``inner``'s state untouched. ``inner`` runs only on the calls that end a cycle
  (under ``jit`` inside a conditional), so its cost, and any schedule inside
  it, is paid once per optimizer step: put everything that should run once
  per optimizer step (clipping, weight decay, schedules) *inside* ``inner``.
  With per-example or per-token mean gradients, pass each micro-batch's
  number of examples or tokens as ``weight``: the gradient ``inner`` gets is then
  the big-batch mean, however unevenly they are spread.

  After a call that ends a cycle the state's ``micro_step`` is 0 and it
  holds no cycle: its ``acc_grads`` is zeros (``acc_weight`` 0), or, left
  by a program compiled for CPU, the cycle's updates as leftovers, which the
  cycle's non-zero ``acc_weight`` marks and the next call does not read (on
  CPU that spares every micro-step a pass over the accumulator). A state
  saved anywhere resumes anywhere, with or without ``jit``: bit for bit,
  except that a program compiled for GPU/TPU throws a CPU program's
  leftovers away with its first cycle (one cycle without an update, never
  a wrong one).

  Rules for runtime values:

  * a micro-batch of weight 0 counts toward :math:`k` but contributes
    nothing, even with a NaN or Inf gradient (the 0/0 mean of an
    all-padding micro-batch; with ``gradients="sum"``, only under
    ``skip_nonfinite``: without it a summed gradient is added as is, so
    that XLA fuses the add into the GEMM); a cycle whose total weight is
    not positive returns zeros and leaves ``inner``'s state and ``step``
    unchanged. A concrete negative weight raises, and so does a concrete
    NaN or Inf one unless ``skip_nonfinite``; a traced weight is used as
    given (a NaN or Inf one makes the cycle's gradient NaN);
  * ``update(..., flush=True)`` ends the cycle at this call, normalised by
    what it holds (the partial last window of an epoch); ``emit=True`` or
    ``emit=False`` (a Python bool) says at trace time whether this call
    ends the cycle, and compiles without a conditional that decides it
    (``emit=False`` past :math:`k` keeps the cycle open; with a fixed
    ``every_k=1`` it raises: there a call without ``emit`` runs ``inner``
    alone and would not read a cycle held open);
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
      Complex gradients get the matching complex dtype. The mean gradients
      keep the gradient's dtype.
    skip_nonfinite: Drop micro-batches with a non-finite gradient or weight.
    axis_name: A mesh axis (or tuple of axes) over which the accumulated
      gradients are summed on the calls that end a cycle only: once per
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
      [0, 1); a value other than the default raises without
      ``track_noise_scale=True`` (nothing would read it).
    gradients: What each micro-batch gradient is over its ``weight``:
      ``"mean"`` (the default: multiplied by ``weight`` before it is added)
      or ``"sum"`` (a loss summed over the micro-batch: added as is, the
      weight only counting toward the total; no multiply in the add, so
      XLA:GPU fuses it into each weight-gradient GEMM with cuBLAS too).
    reduce_dtype: With ``axis_name``, the dtype in which the accumulated
      gradient crosses devices once per cycle (``None``: the
      accumulator's); ``jnp.bfloat16`` halves the bytes reduced.
    rounding: How each add into a ``jnp.bfloat16`` accumulator is rounded:
      ``"nearest"`` (the default, as any bfloat16 add), or
      ``"stochastic"`` (with ``accumulator_dtype=jnp.bfloat16`` only):
      the sum is taken in float32 and rounded up or down with probability
      proportional to the distance, so that the accumulator's expectation
      is the exact sum; the small gradients that round to nearest drops
      against a large running sum ("swamping") count on average. The
      random bits are a hash of the call's place in the run (``step``,
      ``micro_step``), each element's position and, with ``axis_name``,
      the device: nothing to pass, the same with and without ``jit``, and
      a checkpoint resumed mid-cycle goes on bit for bit. Not with
      gradients typed unreduced under plain ``jit`` (an error says so).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` is
    ``update(updates, state, params=None, *, weight=None, flush=False,
    emit=None, noise_stats=None, **extra_args)`` (``help(tx.update)``
    says what each does) and whose state is an
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
    >>> print(state.micro_step)  # no cycle open
    0
    >>> u, state = tx.update(jnp.array([2.0, 2.0]), state, params)
    >>> print(state.acc_grads, state.acc_weight)  # a new cycle, from zeros
    [2. 2.] 1.0
  """
  _checks.options(reduction, axis_name, gradients)
  track_noise_scale = _checks.boolean(track_noise_scale, "track_noise_scale")
  config = Config(
    inner=_inner_for(inner),
    every_k=_every_k.to_spec(every_k, track_noise_scale),
    reduction=reduction,
    accumulator_dtype=_checks.accumulator_dtype(accumulator_dtype),
    skip_nonfinite=_checks.boolean(skip_nonfinite, "skip_nonfinite"),
    axis_name=axis_name,
    track_noise_scale=track_noise_scale,
    noise_scale_decay=_noise_scale.check_decay(
      noise_scale_decay, track_noise_scale
    ),
    gradients=gradients,
    reduce_dtype=_checks.reduce_dtype(reduce_dtype, axis_name),
    rounding=_checks.rounding(
      rounding, _checks.accumulator_dtype(accumulator_dtype)
    ),
  )
  # `init` is `partial(_init, config)`: `config_of` reads the configuration
  # back from it (optax_accum.multisteps.restore_target builds the state of
  # the MultiSteps run a transformation replaces).

  def update(
    updates: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None = None,
    *,
    weight: jax.typing.ArrayLike | None = None,
    flush: bool | jax.Array = False,
    emit: bool | None = None,
    noise_stats: NoiseStats | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, AccumulateState]:
    """Adds one micro-batch's gradient; ends the cycle at its k-th.

    Args:
      updates: The micro-batch's gradient, a tree like the params.
      state: The :class:`AccumulateState` of the previous call (or
        ``init``).
      params: The params, as optax's ``update`` takes them. Give them:
        :func:`optax_accum.apply_updates` then applies the updates without
        reading or writing the params on a micro-step.
      weight: The micro-batch's weight :math:`w_i` (its number of examples
        or tokens), a non-negative scalar; default 1.
      flush: True ends the cycle at this call, normalised by what it holds
        (the partial last window of an epoch); a Python bool or a traced
        ``bool[]``.
      emit: ``True`` or ``False`` (a Python bool) says at trace time whether
        this call ends the cycle, and compiles without the conditional that
        decides it; ``None`` (default) lets the device decide.
      noise_stats: With unreduced gradients under plain ``jit`` and
        ``track_noise_scale``: what
        :func:`optax_accum.distributed.local_value_and_grad` measured.
      **extra_args: Passed to ``inner``'s ``update`` on the call that ends a
        cycle (e.g. ``value=`` for ``optax.contrib.reduce_on_plateau``).

    Returns:
      ``(updates, state)``: exact zeros on a micro-step, ``inner``'s updates
      of the cycle's mean on the call that ends it; the next state.
    """
    return _update(
      config,
      updates,
      state,
      params,
      weight=weight,
      flush=flush,
      emit=emit,
      noise_stats=noise_stats,
      **extra_args,
    )

  return optax.GradientTransformationExtraArgs(
    functools.partial(_init, config), update
  )


def _inner_for(
  inner: optax.GradientTransformation,
) -> Callable[[jax.Array], Any]:
  """`k -> inner transformation`; checks a fixed inner at once."""
  if isinstance(inner, _every_k.InnerForEveryK):
    return lambda k: _checks.transformation(inner.factory(k))
  transformation = _checks.transformation(inner)
  return lambda k: transformation


def config_of(tx: Any, reader: str) -> Config:
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


def _engine_for_init(axis_name: Hashable | None, params: optax.Params) -> Local:
  if axis_name is None:
    return LOCAL
  from optax_accum import _engines  # noqa: PLC0415  (axis_name only)

  return _engines.for_init(axis_name, params)


def _engine_for_update(
  axis_name: Hashable, grads: optax.Updates, acc: optax.Updates
) -> Local:
  from optax_accum import _engines  # noqa: PLC0415  (axis_name only)

  return _engines.for_update(axis_name, grads, acc)


def add_term(
  acc: jax.Array,
  value: Any,
  *,
  ops: Local = LOCAL,
  weight: jax.Array | None = None,
  keep: jax.Array | None = None,
  key: jax.Array | None = None,
) -> jax.Array:
  """``acc + keep * weight * value``, computed in :func:`compute_dtype`
  and rounded to `acc`'s dtype: to nearest, or, given a `key`,
  stochastically (a bfloat16 `acc`, :func:`_control.to_bfloat16_stochastically`
  with the bits of :func:`_control.random_bits`).

  Every select sits on the term's side, with a scalar predicate: compiled
  for GPU, XLA then fuses the add into the GEMM that makes `value` (it
  fuses ``acc + f(dot)`` where `acc` is a parameter of the step, not
  ``f(acc) + dot``). Where `keep` is false the term is exact zeros, even if
  `value` is NaN or Inf: the 0/0 per-token mean of an all-padding
  micro-batch counts for nothing rather than poisoning the sum.

  Args:
    acc: The sum so far; the result has its dtype.
    value: The term to add.
    ops: Where `scale`, `select` and `zero` come from (an engine: unreduced
      arrays need their own forms).
    weight: A scalar to multiply `value` by, or None.
    keep: A scalar bool: whether the term counts, or None (always).
    key: A uint32 scalar that picks the random bits of a stochastic
      rounding, or None (round to nearest).
  """
  compute = compute_dtype(acc.dtype)
  term = jnp.asarray(value).astype(compute)
  if weight is not None:
    term = ops.scale(term, weight)
  if keep is not None:
    term = ops.select(keep, term, ops.zero(term))
  total = acc.astype(compute) + term
  if key is None:
    return total.astype(acc.dtype)
  bits = _control.random_bits(total.shape, key)
  return _control.to_bfloat16_stochastically(total, bits)


# ----------------------------------------------------------------------------
# init.
# ----------------------------------------------------------------------------


def _init(config: Config, params: optax.Params) -> AccumulateState:
  engine = _engine_for_init(config.axis_name, params)

  def zeros(param):
    dtype = _checks.leaf_accumulator_dtype(
      config.accumulator_dtype, jnp.result_type(param)
    )
    return engine.zeros_like_param(param, dtype)

  every_k = _every_k.first(config.every_k)
  # Separate calls: every leaf is its own buffer, so the whole state can be
  # donated to jit.
  scalars = _state_lib.pack(
    micro_step=0,
    step=0,
    every_k=every_k,
    num_skipped=0,
    emitted=False,
    weight_seen=jnp.zeros([2], jnp.float32),
    acc_weight=jnp.zeros([], jnp.float32),
    noise=(
      _noise_scale.init() if config.track_noise_scale else optax.EmptyState()
    ),
    grow=_every_k.init_grow(config.every_k),
  )
  return AccumulateState(
    acc_grads=jax.tree.map(zeros, _checks.gradient_params(params)),
    inner_state=config.inner(every_k).init(params),
    **scalars,
  )


# ----------------------------------------------------------------------------
# update: one call, from its arguments to the next state.
# ----------------------------------------------------------------------------


class Cycle(NamedTuple):
  """The cycle after this call's micro-batch was added: what ends read."""

  acc: optax.Updates  # the (device-local) sum
  weight: jax.Array  # float32[]: its (device-local) total weight
  micro_step: jax.Array  # int32[]: micro-batches accepted in it
  ends: jax.Array  # bool[]: this call ends the cycle
  noise: Noise  # NoiseScaleState, or optax.EmptyState() when not tracked
  inner_state: optax.OptState
  params: optax.Params | None  # as given to update, or None


class Inner(NamedTuple):
  """What one traced call holds fixed about the inner optimizer: itself
  (for this cycle's k), its extra arguments, and the types it takes and
  returns (``jax.eval_shape``)."""

  tx: optax.GradientTransformationExtraArgs
  extra_args: dict
  grad_types: Types  # the mean gradient it is handed
  update_types: Types  # its updates
  state_types: Types  # its new state
  reduced_specs: Any  # the reduced sum's layout (Unreduced), or None


class Result(NamedTuple):
  """How a call ends: what it returns and what the next state holds."""

  updates: optax.Updates  # exact zeros unless `updated`
  updated: jax.Array  # bool[]: inner ran on a cycle of positive weight
  new_params: optax.Params | None  # the params with `updates` applied, or None
  acc: optax.Updates
  acc_weight: jax.Array
  noise: Noise
  inner_state: optax.OptState
  cycle_ends: jax.Array  # bool[]
  cycle_weight: jax.Array  # the ended cycle's global weight, else 0


def _update(
  config: Config,
  updates: optax.Updates,
  state: AccumulateState,
  params: optax.Params | None = None,
  *,
  weight: jax.typing.ArrayLike | None = None,
  flush: bool | jax.Array = False,
  emit: bool | None = None,
  noise_stats: NoiseStats | None = None,
  **extra_args: Any,
) -> tuple[optax.Updates, AccumulateState]:
  # 1. The arguments, checked; the engine for this trace.
  values = _checks.state(state, config.track_noise_scale)  # by name
  _checks.trees(updates, params, values.acc_buffer)
  if config.axis_name is None:
    _checks.not_unreduced(updates)
    engine = LOCAL
  else:
    engine = _engine_for_update(config.axis_name, updates, values.acc_buffer)
  call = _checks.update_call(
    weight=weight,
    flush=flush,
    emit=emit,
    noise_stats=noise_stats,
    fixed_every_k=config.every_k.fixed,
    skip_nonfinite=config.skip_nonfinite,
    track_noise_scale=config.track_noise_scale,
    axis_name=config.axis_name,
    measures_noise=engine.measures_noise,
  )
  inner = config.inner(values.every_k)
  # Two calls that are not this story: every call a cycle of its own
  # (`inner` alone, bit for bit), and an eager call on unreduced arrays (the
  # same story, jitted).
  if _is_inner_alone(config, call, updates, values.acc_buffer):
    return _inner_alone(inner, updates, state, params, extra_args)
  if not (engine.runs_eagerly or _checks.is_traced(updates)):
    return _jitted_update(config)(
      updates, state, params, **call.as_given, **extra_args
    )

  # 2. Add the micro-batch into the cycle.
  cycle, accepted = _add(config, engine, values, updates, call, params=params)
  inner = _inner_types(engine, inner, extra_args, updates, cycle)

  # 3. End the call: the device decides (traced), or the caller did (emit=).
  if call.emit is None:
    result = _decide_on_device(config, engine, inner, cycle)
  elif call.emit:
    result = _end_cycle_now(config, engine, inner, cycle)
  else:
    result = _keep_cycle_open(inner, cycle)

  # 4. Tell apply_updates what was applied; the next state.
  known = result.updated if call.emit is None else call.emit
  _apply.remember(result.updates, known, params, result.new_params)
  return result.updates, _next_state(config, values, accepted, cycle, result)


def _is_inner_alone(
  config: Config, call: _checks.Call, updates: optax.Updates, acc: optax.Updates
) -> bool:
  """Whether every call is a cycle of its own that `inner` alone computes
  bit for bit: k = 1 without weights, flush, skips, axis, `emit`, or an
  accumulator narrower than the gradients (whose rounding every other path
  applies)."""
  return (
    config.every_k.fixed == 1
    and call.emit is None
    and call.weight is None
    and not call.may_flush
    and not config.skip_nonfinite
    and config.axis_name is None
    and _fits(updates, acc)
  )


def _fits(values: optax.Updates, acc: optax.Updates) -> bool:
  """Whether each accumulator leaf holds the values of the leaf of `values`
  (arrays, scalars or their types) beside it exactly: a float32
  accumulator for bfloat16 or float32 gradients."""
  return all(
    _holds_exactly(a.dtype, jnp.result_type(v))
    for v, a in zip(jax.tree.leaves(values), jax.tree.leaves(acc), strict=True)
  )


def _inner_alone(inner, grads, state, params, extra_args):
  """Bit for bit `inner`, with the counters of an updating call (which
  :func:`optax_accum.apply_updates` applies as it is: every call emits)."""
  updates, inner_state = inner.update(
    grads, state.inner_state, params, **extra_args
  )
  _apply.remember(updates, True, params)
  return updates, state.replace(
    step=optax.safe_increment(state.step),
    weight_seen=_state_lib.add_weight_seen(
      state.weight_seen, jnp.ones([], jnp.float32)
    ),
    inner_state=inner_state,
    emitted=jnp.asarray(True),
  )


# Eager ops on unreduced arrays fail (jax 0.10.2): such an update runs
# jitted. Bounded, so that old configurations (and the inner optimizers they
# hold) are let go.
@functools.lru_cache(maxsize=16)
def _jitted_update(config: Config) -> Callable[..., Any]:
  return jax.jit(functools.partial(_update, config), static_argnames=("emit",))


# -- 2. The add. -------------------------------------------------------------


def _add(
  config: Config,
  engine: Local,
  state: _state_lib.Values,
  grads: optax.Updates,
  call: _checks.Call,
  *,
  params: optax.Params | None,
) -> tuple[Cycle, jax.Array]:
  """The cycle with this micro-batch added, and whether it was accepted
  (not dropped by `skip_nonfinite`), agreed over the devices."""
  weighted = call.weight is not None
  weight = call.weight if weighted else jnp.ones([], jnp.float32)
  accepted = jnp.asarray(True)
  if config.skip_nonfinite:
    # A zero-weight micro-batch (e.g. the 0/0 mean of an all-padding
    # micro-batch) counts toward k and contributes nothing, NaN or not.
    finite = engine.all_finite(grads)
    accepted = jnp.isfinite(weight) & (finite | (weight == 0))
    accepted = engine.agree(lax.pmin, accepted)
  flush = call.flush
  if call.may_flush:
    flush = engine.agree(lax.pmax, flush)

  start, cycle_weight = _cycle_start(
    engine, state.micro_step, state.acc_buffer, state.acc_weight
  )

  keep = accepted if config.skip_nonfinite else None
  scale = weighted and config.gradients == "mean"
  if scale or (weighted and config.skip_nonfinite):
    # A zero-weight term counts for nothing, even NaN: with skip_nonfinite
    # the add selects already, so gradients="sum" keeps that rule too.
    nonzero = weight != 0
    keep = nonzero if keep is None else keep & nonzero
  # gradients="sum" without skip_nonfinite: the gradient carries its weight
  # already; adding it as is, with no select, lets every GEMM backend fuse
  # the add (cuBLAS only with no scale).
  term = dict(ops=engine, weight=weight if scale else None, keep=keep)
  if config.rounding == "stochastic":
    # Only bfloat16 leaves round: a complex gradient keeps a complex
    # accumulator (and an integer one its own), which rounds as it adds.
    acc = jax.tree.map(
      lambda a, g, key: add_term(
        a, g, **term, key=key if a.dtype == jnp.bfloat16 else None
      ),
      start,
      grads,
      _rounding_keys(engine, state, start),
    )
  else:
    acc = jax.tree.map(lambda a, g: add_term(a, g, **term), start, grads)
  micro_step = state.micro_step + accepted.astype(jnp.int32)
  cycle = Cycle(
    acc=acc,
    weight=cycle_weight + jnp.where(accepted, weight, 0.0),
    micro_step=micro_step,
    ends=(micro_step >= state.every_k) | flush,
    noise=(
      _add_noise(
        config,
        engine,
        state,
        grads,
        weight=weight,
        accepted=accepted,
        call=call,
      )
      if config.track_noise_scale
      else state.noise
    ),
    inner_state=state.inner_state,
    params=params,
  )
  return cycle, accepted


def _rounding_keys(
  engine: Local, state: _state_lib.Values, acc: optax.Updates
) -> optax.Updates:
  """Each accumulator leaf's key for this call's stochastic rounding: the
  add's place in the run (the optimizer step, the micro-batch within its
  cycle), the leaf and the device, mixed (:func:`_control.random_bits`
  hashes each element's position with it). A call that does not change the
  accumulator (a dropped micro-batch) leaves its key to the next."""
  u32 = functools.partial(jnp.asarray, dtype=jnp.uint32)
  key = (
    state.step.astype(jnp.uint32) * u32(0x9E3779B9)
    ^ state.micro_step.astype(jnp.uint32) * u32(0x85EBCA6B)
    ^ engine.device_index() * u32(0xC2B2AE35)
  )
  leaves, treedef = jax.tree.flatten(acc)
  return jax.tree.unflatten(
    treedef, [key + u32(0x27D4EB2F) * u32(i + 1) for i in range(len(leaves))]
  )


def _cycle_start(
  engine: Local,
  micro_step: jax.Array,
  acc: optax.Updates,
  acc_weight: jax.Array,
) -> tuple[optax.Updates, jax.Array]:
  """The accumulator this call adds into and the cycle's weight so far:
  `acc` and `acc_weight`, with leftovers of the last cycle not read (at
  micro_step 0 a non-zero weight marks them: a state left by a CPU program,
  or by optax_accum 0.1 on CPU).

  * CPU: zeros and 0 wherever no cycle is open (``micro_step`` 0, marked
    or not), a select that XLA fuses into the add: one pass, in place;
  * GPU/TPU (whose programs leave no leftovers): the add stays ``acc +
    dot``, fused into each weight gradient's GEMM (a select on the
    accumulator's side of the add is not), so the leftovers are added and
    the cycle starts at weight -inf: it ends without an update and leaves
    zeros. One cycle without an update, never a wrong one. (A conditional
    that zeroes them, beside the closing one, compiled for an H100: four
    parameter-sized copies on the noise-scale step's micro-step, and a
    conditional inside the several-GPU step's command buffer;
    ``tests/test_accelerators.py``.)
  """

  def not_read(micro_step, acc, acc_weight):
    fresh = micro_step == 0
    return _control.cleared(fresh, acc, engine), jnp.where(
      fresh, 0.0, acc_weight
    )

  def thrown_away(micro_step, acc, acc_weight):
    leftovers = (micro_step == 0) & (acc_weight != 0)
    return acc, jnp.where(leftovers, -jnp.inf, acc_weight)

  return _per_backend(
    micro_step, acc, acc_weight, cpu=not_read, accelerator=thrown_away
  )


def _add_noise(
  config: Config,
  engine: Local,
  state: _state_lib.Values,
  grads: optax.Updates,
  *,
  weight: jax.Array,
  accepted: jax.Array,
  call: _checks.Call,
) -> Noise:
  """The noise-scale sums with this micro-batch: measured here, or by the
  gradient helper (`noise_stats`, Unreduced)."""
  fresh = state.micro_step == 0
  if call.noise_stats is not None:
    return _noise_scale.add_stats(
      state.noise, call.noise_stats, weight, accepted, fresh
    )
  return _noise_scale.add_micro_batch(
    state.noise,
    grads,
    weight,
    accepted,
    fresh,
    summed=config.gradients == "sum",
    sample_axes=engine.sample_axes(),
  )


def _inner_types(
  engine: Local,
  tx: optax.GradientTransformationExtraArgs,
  extra_args: dict,
  grads: optax.Updates,
  cycle: Cycle,
) -> Inner:
  """The inner optimizer of this trace, and the types it takes and
  returns."""
  params = cycle.params
  specs = None
  if engine.axis_name is not None:
    gradient_params = (
      None if params is None else _checks.gradient_params(params)
    )
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
  update_types, state_types = jax.eval_shape(
    lambda g, s, p: tx.update(g, s, p, **extra_args),
    grad_types,
    cycle.inner_state,
    params,
  )
  return Inner(tx, extra_args, grad_types, update_types, state_types, specs)


# -- 3. The ends. ------------------------------------------------------------


class Branch(NamedTuple):
  """What each branch of a closing conditional returns (the same fields in
  every branch, so that the conditional's outputs have names)."""

  # The updates; where they share the accumulator's buffer, that buffer.
  out: optax.Updates
  acc: optax.Updates | None  # the accumulator; None where `out` is it
  params: optax.Params | None  # updated where the branch applied them
  weight: jax.Array  # float32[]: the cycle's global total weight
  noise: Noise
  inner_state: optax.OptState
  updated: jax.Array  # bool[]: inner ran on a cycle of positive weight
  cycle_weight: jax.Array  # the ended cycle's global weight, else 0


def _decide_on_device(
  config: Config, engine: Local, inner: Inner, cycle: Cycle
) -> Result:
  """The default (``emit=None``): a conditional decides on the device
  whether this call ends the cycle.

  Where the updates are narrower than the accumulator (bf16 params, a
  float32 accumulator) and the params are given, a program for GPU/TPU
  applies them in the updating branch (:func:`_apply_inside`) instead of
  passing them through the accumulator's buffer, which costs the updating
  step a float32 write and read of every update there. Everything else is
  :func:`_decide`, which CPU programs keep for narrow updates too, and so
  does every program on a jax whose XLA copies what a later branch passes
  through (:data:`_control.LATER_BRANCHES_COPY`, before jax 0.11.1): there
  the switch's weightless branch would copy the params and the inner state
  on every call.

  On a GPU, one device, an accumulator below
  :data:`_control.SELECTS_BELOW_BYTES`: :func:`_decide` with selects in
  place of its conditionals (``selects=True``), as XLA:GPU compiles
  ``optax.MultiSteps``' conditional: the inner optimizer runs on every call,
  which over a small state costs the device less than a conditional costs
  the host's dispatch.
  """
  shares = _shares_buffer(engine, inner, cycle.acc)
  # (`shares`: the same tree and shapes, so the leaves pair up.)
  narrow = shares and any(
    jnp.dtype(u.dtype).itemsize < jnp.dtype(a.dtype).itemsize
    for u, a in zip(
      jax.tree.leaves(inner.update_types),
      jax.tree.leaves(cycle.acc),
      strict=True,
    )
  )
  decide = functools.partial(_decide, config, engine, inner, shares=shares)
  accelerator = decide
  if narrow and cycle.params is not None and not _control.LATER_BRANCHES_COPY:
    accelerator = functools.partial(_apply_inside, config, engine, inner)
  small = _control.decides_with_selects(engine.axis_name, cycle.acc)
  return _per_backend(
    cycle,
    cpu=decide,
    accelerator=accelerator,
    gpu=functools.partial(decide, selects=True) if small else None,
  )


def _decide(
  config: Config,
  engine: Local,
  inner: Inner,
  cycle: Cycle,
  *,
  shares: bool,
  selects: bool = False,
) -> Result:
  """One conditional decides on the device whether this call ends the
  cycle.

  Where the updates share the accumulator's buffer (`shares`:
  :func:`_shares_buffer`) the updating branch writes them there and
  :func:`_close` closes the cycle once they are read. Otherwise (another
  tree, a buffer that varies over devices) they get buffers of their own
  and the updating branch zeroes the accumulator and applies them itself.
  With `selects` (a small state on a GPU, :func:`_decide_on_device`) both
  branches run and selects keep the one the conditional would have taken:
  no conditional anywhere in the call.
  """
  # A weightless cycle skips the branch (a NaN total still enters, so that
  # the NaN reaches `inner`). Inside shard_map the global weight is known
  # only in the branch, which then checks it itself.
  checked = shares and engine.global_weight
  enter = cycle.ends & ~(cycle.weight <= 0) if checked else cycle.ends
  mean_sq = None
  if config.track_noise_scale and engine.axis_name is None:
    # Measured before the conditional (with axis_name it needs the reduced
    # sum, inside).
    mean_sq = (
      _mean_sq_norm(cycle.acc, cycle.weight)
      if selects
      else _control.in_own_conditional(
        enter,
        _mean_sq_norm,
        jnp.zeros([], jnp.float32),
        cycle.acc,
        cycle.weight,
      )
    )

  def update(cycle: Cycle, mean_sq: jax.Array | None) -> Branch:
    mean = _cycle_mean(config, engine, inner, cycle, mean_sq, per_leaf=False)
    run = _run_inner if checked else _inner_where_weighted
    ran = run(config, inner, mean.operands, apply=not shares)
    if shares:
      out = jax.tree.map(lambda u, a: u.astype(a.dtype), ran.updates, cycle.acc)
      acc = params = None
    else:
      out, params = ran.updates, ran.params
      acc = engine.cleared(cycle.ends, cycle.acc, mean.operands.total)
    # The global weight twice, as the ended cycle's too: under shard_map
    # the first joins the device-local accumulator's slot.
    return Branch(
      out=out,
      acc=acc,
      params=params,
      weight=mean.weight,
      noise=mean.noise,
      inner_state=ran.inner_state,
      updated=jnp.asarray(True) if checked else mean.operands.weighted,
      cycle_weight=mean.weight,
    )

  hold = functools.partial(_holding, inner, shares=shares)
  if selects:
    branch = select(enter, update(cycle, mean_sq), hold(cycle, mean_sq))
  else:
    branch = _control.cond(enter, update, hold, cycle, mean_sq)
  if shares:
    return _close(engine, inner, cycle, branch, selects=selects)
  return _applied_in_branch(cycle, branch)


def _applied_in_branch(cycle: Cycle, branch: Branch) -> Result:
  """The call's result where the updating branch applied the updates and
  zeroed the accumulator itself (the updates in buffers of their own)."""
  return Result(
    updates=branch.out,
    updated=branch.updated,
    new_params=branch.params,
    acc=branch.acc,
    acc_weight=jnp.where(cycle.ends, 0.0, branch.weight),
    noise=branch.noise,
    inner_state=branch.inner_state,
    cycle_ends=cycle.ends,
    cycle_weight=branch.cycle_weight,
  )


def _holding(
  inner: Inner, cycle: Cycle, mean_sq: jax.Array | None = None, *, shares: bool
) -> Branch:
  """The branch that holds: everything passed through, no updates (the
  accumulator's own buffer where they share it, else traced zeros).
  (`mean_sq`: the operand :func:`_decide`'s branches share, unread.)"""
  del mean_sq
  return Branch(
    out=cycle.acc if shares else _no_updates(inner, cycle.ends),
    acc=None if shares else cycle.acc,
    params=None if shares else cycle.params,
    weight=cycle.weight,
    noise=cycle.noise,
    inner_state=_settle(cycle.inner_state, inner.state_types),
    updated=jnp.asarray(False),
    cycle_weight=jnp.zeros([], cycle.weight.dtype),
  )


def _no_updates(inner: Inner, flag: jax.Array) -> optax.Updates:
  """Zero updates, a traced value per leaf from a `flag` that is false where
  this runs (:func:`_control.distinct_zeros`)."""
  leaves, treedef = jax.tree.flatten(inner.update_types)
  zeros = _control.distinct_zeros(leaves, flag, zeros_like_type)
  return jax.tree.unflatten(treedef, zeros)


def _apply_inside(
  config: Config, engine: Local, inner: Inner, cycle: Cycle
) -> Result:
  """GPU/TPU, narrow updates, params given: one switch. Branch 0 holds
  (passes everything through); branch 1 ends a weighted cycle: the inner
  optimizer on the mean, the params updated and the accumulator zeroed in
  its kernels, as the ``emit=True`` step does; branch 2 ends a
  weightless one (the accumulator zeroed, nothing applied). The updates
  get buffers of their own, which XLA drops when the caller applies them
  with :func:`optax_accum.apply_updates` (with ``optax.apply_updates`` a
  micro-step writes narrow zeros there, as many bytes as reading the
  shared buffer costs it, ``tests/test_accelerators.py``).

  One device (a local ``global_weight``): the weight that decides the
  branch is the cycle's whole weight.
  """
  weighted = ~(cycle.weight <= 0)  # a NaN total enters, to reach `inner`
  index = jnp.where(cycle.ends, jnp.where(weighted, 1, 2), 0)

  def update(cycle: Cycle) -> Branch:
    mean = _cycle_mean(config, engine, inner, cycle, None, per_leaf=False)
    ran = _run_inner(config, inner, mean.operands, apply=True)
    acc = engine.cleared(cycle.ends, cycle.acc, mean.operands.total)
    return _holding(inner, cycle, shares=False)._replace(
      out=ran.updates,
      acc=acc,
      params=ran.params,
      noise=mean.noise,
      inner_state=ran.inner_state,
      updated=jnp.asarray(True),
      cycle_weight=cycle.weight,
    )

  def weightless(cycle: Cycle) -> Branch:
    acc = engine.cleared(cycle.ends, cycle.acc, cycle.acc)
    return _holding(inner, cycle, shares=False)._replace(
      out=_no_updates(inner, ~cycle.ends), acc=acc
    )

  hold = functools.partial(_holding, inner, shares=False)
  branch = _control.switch(index, (hold, update, weightless), cycle)
  return _applied_in_branch(cycle, branch)


def _end_cycle_now(
  config: Config, engine: Local, inner: Inner, cycle: Cycle
) -> Result:
  """``emit=True``: the caller says this call ends the cycle. With
  ``axis_name``, no conditional (the leaves reduced one by one, so that
  each may start as soon as its gradient is added; selects keep a
  weightless cycle's result out) and the accumulator left at zeros (the
  reduced sum's: see ``_engines.py``).

  On one device with the params given, the params are updated here too
  (what :func:`optax_accum.apply_updates` returns), and a program compiled
  for CPU runs the inner optimizer in a conditional of its own that applies
  them in place (:func:`_run_if_weighted`) and leaves the accumulator
  as leftovers: the cycle's sum beside its weight (-inf for a weightless
  cycle's), which the next call does not read (:func:`_cycle_start`).
  XLA:CPU fuses neither the zeroing pass nor the applying pass into the
  optimizer's kernels at the top level of a program: the ``emit=True`` step was
  1.7x the traced one's at 64 MB (``benchmarks/bench_loop.py``).
  """
  mean_sq = None
  if config.track_noise_scale and engine.axis_name is None:
    mean_sq = _mean_sq_norm(cycle.acc, cycle.weight)
  mean = _cycle_mean(config, engine, inner, cycle, mean_sq, per_leaf=True)
  always = _control.traced_true(cycle.micro_step)

  def ended(ran: Ran, acc: optax.Updates, acc_weight: jax.Array) -> Result:
    return Result(
      updates=ran.updates,
      updated=mean.operands.weighted,
      new_params=ran.params,
      acc=acc,
      acc_weight=acc_weight,
      noise=mean.noise,
      inner_state=ran.inner_state,
      cycle_ends=jnp.asarray(True),
      cycle_weight=mean.weight,
    )

  if engine.axis_name is not None or cycle.params is None:
    run = (
      _run_then_select
      if engine.axis_name is not None
      else _inner_where_weighted
    )
    ran = run(config, inner, mean.operands, apply=False)
    acc = engine.cleared(always, cycle.acc, mean.operands.total)
    return ended(ran, acc, jnp.zeros_like(cycle.weight))

  def leftovers(cycle: Cycle) -> Result:
    ran = _run_if_weighted(config, inner, mean.operands, apply=True)
    weight = jnp.where(cycle.weight == 0, -jnp.inf, cycle.weight)
    return ended(ran, cycle.acc, weight)

  def zeros(cycle: Cycle) -> Result:
    ran = _run_then_select(config, inner, mean.operands, apply=False)
    ran = ran._replace(params=optax.apply_updates(cycle.params, ran.updates))
    acc = _control.cleared(always, cycle.acc, engine)
    return ended(ran, acc, jnp.zeros_like(cycle.weight))

  return _per_backend(cycle, cpu=leftovers, accelerator=zeros)


def _keep_cycle_open(inner: Inner, cycle: Cycle) -> Result:
  """``emit=False``: the caller says the cycle goes on. The add and the
  counters only: no conditional, no inner optimizer."""
  return Result(
    updates=jax.tree.map(zeros_like_type, inner.update_types),
    updated=jnp.asarray(False),
    new_params=None,
    acc=cycle.acc,
    acc_weight=cycle.weight,
    noise=cycle.noise,
    inner_state=_settle(cycle.inner_state, inner.state_types),
    cycle_ends=jnp.asarray(False),
    # Not zeros_like: under shard_map the weight varies over the devices.
    cycle_weight=jnp.zeros([], jnp.float32),
  )


def _shares_buffer(engine: Local, inner: Inner, acc: optax.Updates) -> bool:
  """Whether the updates can be written into the accumulator's buffer:
  the same tree and shapes, dtypes the accumulator holds exactly, and (with
  ``axis_name``) an engine whose accumulator has the updates' type."""
  update_types = inner.update_types
  fits = (
    jax.tree.structure(update_types) == jax.tree.structure(acc)
    and all(
      u.shape == a.shape
      for u, a in zip(
        jax.tree.leaves(update_types), jax.tree.leaves(acc), strict=True
      )
    )
    and _fits(update_types, acc)
  )
  return fits and (engine.axis_name is None or engine.shares_buffer(acc))


def _holds_exactly(
  wide: jax.typing.DTypeLike, narrow: jax.typing.DTypeLike
) -> bool:
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


# -- The inner optimizer on the cycle's mean. --------------------------------


class InnerOperands(NamedTuple):
  """What the inner optimizer's run on a cycle's mean reads (the operands of
  the conditional that runs it where it has one of its own)."""

  weighted: jax.Array  # bool[]: the total weight is positive, or NaN
  total: optax.Updates  # the cycle's (reduced) sum
  inv_weight: jax.Array  # 1 / its total weight (:func:`_inverse_weight`)
  state: optax.OptState  # the inner optimizer's state
  params: optax.Params | None  # as given to update, or None


class Mean(NamedTuple):
  """A cycle summed over the devices, ready for the inner optimizer."""

  operands: InnerOperands
  weight: jax.Array  # float32[]: the cycle's global total weight
  noise: Noise  # the noise-scale state with the cycle folded in


class Ran(NamedTuple):
  """The inner optimizer's result on a cycle's mean."""

  updates: optax.Updates
  inner_state: optax.OptState
  # The params with the updates applied where asked (`apply`), else None.
  params: optax.Params | None


def _cycle_mean(
  config: Config,
  engine: Local,
  inner: Inner,
  cycle: Cycle,
  mean_sq: jax.Array | None,
  *,
  per_leaf: bool,
) -> Mean:
  """The cycle's sums over the devices (with ``axis_name``; `per_leaf`: a
  reduction per leaf, see :func:`_control.psum_with_scalars`), the inverse
  of its total weight, and the noise scale with the cycle folded in
  (`mean_sq`: ``|mean gradient|^2`` measured before, or None to measure the
  reduced sum here)."""
  if engine.axis_name is not None:
    cycle = _reduce(config, engine, inner, cycle, per_leaf=per_leaf)
  inv_weight = _inverse_weight(cycle.weight, cycle.acc)
  noise = cycle.noise
  if isinstance(noise, NoiseScaleState):
    if mean_sq is None:  # The global mean, known only after the reduction.
      mean_sq = _noise_scale.sq_norm(cycle.acc, inv_weight, config.axis_name)
    noise = _noise_scale.fold_cycle(
      noise, mean_sq, cycle.weight, config.noise_scale_decay
    )
  operands = InnerOperands(
    # A NaN weight runs `inner`, so that the NaN reaches it.
    weighted=~(cycle.weight <= 0),
    total=cycle.acc,
    inv_weight=inv_weight,
    state=cycle.inner_state,
    params=cycle.params,
  )
  return Mean(operands, cycle.weight, noise)


def _reduce(
  config: Config,
  engine: Local,
  inner: Inner,
  cycle: Cycle,
  *,
  per_leaf: bool,
) -> Cycle:
  """The cycle with its sums over the devices, in `reduce_dtype` on the
  wire."""
  noise = cycle.noise
  tracked = isinstance(noise, NoiseScaleState)
  scalars = (cycle.weight,)
  if tracked:  # The count as float32, to join the sum.
    scalars += (noise.sq_norm_sum, noise.count.astype(jnp.float32))
  wire = config.reduce_dtype
  acc = cycle.acc
  kept = jax.tree.map(lambda a: a.dtype, acc)
  if wire is not None:
    acc = jax.tree.map(lambda a: a.astype(wire), acc)
  acc, scalars = engine.reduce(
    acc, scalars, per_leaf=per_leaf, specs=inner.reduced_specs
  )
  if wire is not None:
    acc = jax.tree.map(lambda a, d: a.astype(d), acc, kept)
  if tracked:
    noise = noise._replace(
      sq_norm_sum=scalars[1], count=scalars[2].astype(jnp.int32)
    )
  return cycle._replace(acc=acc, weight=scalars[0], noise=noise)


def _inverse_weight(
  total_weight: jax.Array, acc: optax.Updates = ()
) -> jax.Array:
  """1 / W, with 1 for a non-positive W (whose cycle updates nothing); a
  NaN W stays NaN so that it reaches ``inner``. In float32, or in float64
  where `acc` holds a float64 (or complex128) leaf (``jax_enable_x64``): a
  float32 inverse would round a float64 mean to float32's precision."""
  dtype = max(
    (jnp.finfo(compute_dtype(a.dtype)).dtype for a in jax.tree.leaves(acc)),
    key=lambda d: d.itemsize,
    default=jnp.dtype(jnp.float32),
  )
  total_weight = total_weight.astype(dtype)
  return 1.0 / jnp.where(total_weight <= 0, 1.0, total_weight)


def _mean_sq_norm(acc: optax.Updates, total_weight: jax.Array) -> jax.Array:
  return _noise_scale.sq_norm(acc, _inverse_weight(total_weight))


# Three ways to run the inner optimizer on the mean, one a decision: the
# caller checked the weight (`_run_inner`), selects keep a weightless
# cycle's result out (`_run_then_select`), or the backend chooses between
# the two (`_inner_where_weighted`). Each takes `apply`: also apply the
# updates to the params, next to `inner`.


def _run_inner(
  config: Config, inner: Inner, operands: InnerOperands, *, apply: bool
) -> Ran:
  """`inner` on the cycle's mean gradient, computed here so that it fuses
  into the inner's kernels; with `apply`, the params updated too."""

  # The sum in its compute dtype, times 1/W, in the gradient's own dtype.
  # (`grad_types` holds shapes only: closing over the gradient arrays would
  # make them operands of the conditional and materialise them.)
  grad = jax.tree.map(
    lambda a: a.astype(compute_dtype(a.dtype)), operands.total
  )
  if config.reduction == "mean":
    grad = _control.times_inverse(grad, operands.inv_weight)
  grad = jax.tree.map(lambda a, g: a.astype(g.dtype), grad, inner.grad_types)
  params = operands.params
  updates, state = inner.tx.update(
    grad, operands.state, params, **inner.extra_args
  )
  if not apply or params is None:
    return Ran(updates, state, None)
  return Ran(updates, state, optax.apply_updates(params, updates))


def _run_then_select(
  config: Config, inner: Inner, operands: InnerOperands, *, apply: bool
) -> Ran:
  """`inner` run anyway, its result kept for a positive weight by selects
  that fuse into the inner's own kernels."""
  ran = _run_inner(config, inner, operands, apply=False)
  weighted, params = operands.weighted, operands.params
  updates = jax.tree.map(
    lambda u: jnp.where(weighted, u, jnp.zeros([], u.dtype)), ran.updates
  )
  state = select(weighted, ran.inner_state, operands.state)
  if not apply or params is None:
    return Ran(updates, state, None)
  applied = optax.apply_updates(params, updates)
  return Ran(updates, state, select(weighted, applied, params))


def _run_if_weighted(
  config: Config, inner: Inner, operands: InnerOperands, *, apply: bool
) -> Ran:
  """The CPU form of :func:`_inner_where_weighted`: `inner` in a
  conditional of its own (:func:`_control.run_if_weighted`), whose holding
  branch passes the state through (zero updates, the state and params as
  they were). XLA:CPU does not update the state in place under selects,
  and copies every inner-state leaf twice per micro-step."""

  def run(operands: InnerOperands) -> Ran:
    return _run_inner(config, inner, operands, apply=apply)

  def skip(operands: InnerOperands) -> Ran:  # `weighted` is false here
    updates = _no_updates(inner, operands.weighted)
    state = _settle(operands.state, inner.state_types)
    return Ran(updates, state, operands.params if apply else None)

  return _control.run_if_weighted(operands.weighted, run, skip, operands)


def _inner_where_weighted(
  config: Config, inner: Inner, operands: InnerOperands, *, apply: bool
) -> Ran:
  """The inner optimizer, in a conditional branch that ends every cycle
  (weightless ones too): its result where the total weight is positive (or
  NaN), else zero updates and the state and params as they were. On CPU
  :func:`_run_if_weighted`; on GPU/TPU :func:`_run_then_select` (a
  conditional of its own there costs the 8-H100 ``shard_map`` step a
  quarter of the accumulator more memory, ``tests/test_accelerators.py``).
  A caller already in one backend's form calls that form itself."""
  return _per_backend(
    operands,
    cpu=functools.partial(_run_if_weighted, config, inner, apply=apply),
    accelerator=functools.partial(_run_then_select, config, inner, apply=apply),
  )


def _settle(inner_state: optax.OptState, types: Types) -> optax.OptState:
  """`inner_state` in the dtypes `inner` itself gives its new state.

  So that a holding call leaves the state typed as an updating one, and the
  inner state behaves as with `inner` alone (which may widen a state leaf,
  e.g. bf16 moments fed float32 gradients).
  """
  return jax.tree.map(
    lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype),
    inner_state,
    types,
  )


# -- Where CPU and GPU/TPU programs differ. ----------------------------------
#
# One meaning of the state on every backend: while a cycle is open
# (micro_step > 0), ``acc_grads`` and ``acc_weight`` hold its sum and total
# weight. At micro_step 0 no cycle is open: ``acc_grads`` holds zeros (weight
# 0), or leftovers of the last cycle (a non-zero weight), which the next
# cycle does not read. The CPU form leaves leftovers, the GPU/TPU form zeros;
# both take either, so a state saved on one backend resumes on any other
# (tests/test_backend_forms.py): bit for bit, except that the GPU/TPU form
# throws leftovers away with their cycle (:func:`_cycle_start`).
# What differs is how the code gets there, because XLA:CPU and XLA:GPU/TPU
# fuse and copy around a conditional differently.


def _per_backend(
  *args: Any,
  cpu: Callable,
  accelerator: Callable,
  gpu: Callable | None = None,
) -> Any:
  """`cpu(*args)` in a program compiled for CPU, `gpu(*args)` (where given)
  in one for a GPU, else `accelerator(*args)`. Branches that are one
  function are traced once.

  The tests pin this to one form to run the others on CPU.
  """
  forms = [accelerator] + ([] if cpu is accelerator else [cpu])
  forms += [] if gpu is None else [gpu]
  if len(forms) > 1:  # Inside shard_map: the forms' outputs typed alike.
    forms = _control.varying_alike(forms, *args)
  branches = {"default": forms[0]}
  if cpu is not accelerator:
    branches["cpu"] = forms[1]
  if gpu is not None:
    branches["cuda"] = branches["rocm"] = forms[-1]
  return lax.platform_dependent(*args, **branches)


class Closed(NamedTuple):
  """The params and the accumulator once a cycle's updates were read."""

  params: optax.Params | None  # the updates applied; None without params
  acc: optax.Updates
  acc_weight: jax.Array


def _close(
  engine: Local,
  inner: Inner,
  cycle: Cycle,
  branch: Branch,
  *,
  selects: bool = False,
) -> Result:
  """The call's result once the updates the updating branch wrote into the
  accumulator's buffer (`branch.out`) have been read: the updates (exact
  zeros unless updated: a select outside the conditional, which fuses with
  ``optax.apply_updates``), the params with them applied (None without
  params), and the state's accumulator and weight.

  * GPU/TPU: a second conditional, entered when the cycle ends, applies the
    updates and zeroes the buffer in place (weight 0); on a micro-step it
    passes both through untouched, so a micro-step neither reads nor writes
    them and the add into the accumulator fuses into each weight gradient's
    GEMM;
  * CPU: the params are applied in a conditional of their own, and the
    buffer keeps the updates (or a weightless cycle's sum): leftovers, which
    the cycle's weight left beside them at micro_step 0 marks (-inf for a
    weightless cycle: its sum need not be zeros, e.g. mixed-sign weights),
    and which the next call does not read (:func:`_cycle_start`);
  * with `selects` (a small state on a GPU): the GPU/TPU form's closing
    branch run on every call, its selects doing what the conditional did.

  On CPU, returning the buffer to zeros here costs every micro-step a pass
  over it (a select after the conditional), or, wherever the caller reads the
    updates after the step
    (``optax.apply_updates``), a copy of it (a conditional that zeroes it:
    XLA:CPU copies a buffer that a conditional passes through when it is
    read after; ``tools/cpu_cond_probe.py``).
  """
  update_types, updated, ends = inner.update_types, branch.updated, cycle.ends

  def applied(params, out):
    updates = jax.tree.map(lambda b, t: b.astype(t.dtype), out, update_types)
    return optax.apply_updates(params, updates)

  def close(params, out):
    if params is not None:  # The select fuses into the update's kernel.
      params = select(updated, applied(params, out), params)
    return params, _control.cleared(ends, out, engine)

  def in_conditional(params, out, weight) -> Closed:
    if selects:
      params, out = close(params, out)
    else:
      params, out = _control.cond(ends, close, lambda p, o: (p, o), params, out)
    return Closed(params, out, jnp.where(ends, 0.0, weight))

  def leftovers(params, out, weight) -> Closed:
    if params is not None:
      params = _control.cond(updated, applied, lambda p, o: p, params, out)
    return Closed(
      params, out, jnp.where(ends & (weight == 0), -jnp.inf, weight)
    )

  closed = _per_backend(
    cycle.params,
    branch.out,
    branch.weight,
    cpu=leftovers,
    accelerator=in_conditional,
  )
  return Result(
    updates=jax.tree.map(
      lambda b, t: jnp.where(updated, b.astype(t.dtype), 0),
      branch.out,
      update_types,
    ),
    updated=updated,
    new_params=closed.params,
    acc=closed.acc,
    acc_weight=closed.acc_weight,
    noise=branch.noise,
    inner_state=branch.inner_state,
    cycle_ends=ends,
    cycle_weight=branch.cycle_weight,
  )


# -- 4. The next state. ------------------------------------------------------


def _next_state(
  config: Config,
  state: _state_lib.Values,
  accepted: jax.Array,
  cycle: Cycle,
  result: Result,
) -> AccumulateState:
  """The state after a call: counters, and the weight seen, k and the
  controller's state, which change only when the call ended a cycle."""
  updated, ends = result.updated, result.cycle_ends
  step = jnp.where(updated, optax.safe_increment(state.step), state.step)
  weight_seen = jnp.where(
    updated,
    _state_lib.add_weight_seen(state.weight_seen, result.cycle_weight),
    state.weight_seen,
  )
  k, grow = state.every_k, state.grow
  if config.every_k.fixed is None:  # a schedule or the controller
    next_k, next_grow = _every_k.next_k(
      config.every_k,
      state.every_k,
      state.grow,
      step=step,
      weight_seen=weight_seen,
      noise=result.noise,
      cycle_micro_batches=cycle.micro_step,
      emitted=updated,
      decay=config.noise_scale_decay,
    )
    k = jnp.where(ends, next_k, state.every_k)
    grow = jax.tree.map(
      lambda n, o: jnp.where(ends, n, o), next_grow, state.grow
    )
  scalars = _state_lib.pack(
    micro_step=jnp.where(ends, 0, cycle.micro_step),
    step=step,
    every_k=k,
    num_skipped=jnp.where(
      accepted, state.num_skipped, optax.safe_increment(state.num_skipped)
    ),
    emitted=updated,
    weight_seen=weight_seen,
    acc_weight=result.acc_weight,
    noise=result.noise,
    grow=grow,
  )
  return AccumulateState(
    acc_grads=result.acc, inner_state=result.inner_state, **scalars
  )


# ----------------------------------------------------------------------------
# Tree helpers (microbatch's reductions use them too).
# ----------------------------------------------------------------------------


def compute_dtype(acc_dtype: jax.typing.DTypeLike) -> jnp.dtype:
  """The dtype in which a gradient is weighted and added: at least float32.

  Chosen explicitly rather than by type promotion, so that it also works
  under ``jax_numpy_dtype_promotion="strict"``: 16-bit floats compute in
  float32, wider and complex dtypes in themselves.
  """
  dtype = jnp.dtype(acc_dtype)
  if dtype.itemsize >= 8 or jnp.issubdtype(dtype, jnp.complexfloating):
    return dtype
  return jnp.dtype(jnp.float32)


def select(flag: jax.Array, new: Any, old: Any) -> Any:
  """`new` where the scalar `flag` is true, else `old` cast to `new`'s
  dtypes, leaf by leaf."""
  return jax.tree.map(
    lambda n, o: jnp.where(flag, n, o.astype(n.dtype)), new, old
  )


def zeros_like_type(t: Any, dtype: Any = None) -> jax.Array:
  """Zeros of the shape of `t` (an array or ``ShapeDtypeStruct``), in
  `dtype` (default `t`'s), with `t`'s sharding where a mesh axis is
  explicit: there the sharding is part of the type, and a scan carry or the
  branches of a conditional must agree on it."""
  dtype = t.dtype if dtype is None else dtype
  sharding = getattr(t, "sharding", None)
  if isinstance(sharding, NamedSharding) and any(
    axis_type == AxisType.Explicit for axis_type in sharding.mesh.axis_types
  ):
    return jnp.zeros(t.shape, dtype, out_sharding=sharding)
  return jnp.zeros(t.shape, dtype)
