"""`accumulate`: gradient accumulation as an optax transformation.

Read top to bottom. The configuration and :func:`accumulate`; ``init``; then
``update``, which tells one call from its arguments to the next state, and
below it the steps it calls, in the order it calls them. The words used here
(micro-batch, cycle, end, emit, updated, ...) have one meaning each: see the
glossary in ``optax_accum/README.md``. Two rooms of their own hold what the
call hands on: ``_forms.py``, what each backend compiles at a cycle's end,
and ``_inner.py``, the inner optimizer's run on the cycle's mean; the
records that cross between them are ``_records.py``'s.

Why a call looks like this. A micro-step should cost what the gradient and
its add into the accumulator cost (the floor), on CPU, GPU and TPU alike,
and the step should need no memory beyond the accumulator. So:

* **the add** happens before and outside control flow, straight into the
  state's accumulator, with every select (a weight of 0, a skipped
  micro-batch) on the gradient's side (:func:`add_term`): compiled for GPU,
  XLA then fuses ``acc + grad`` into the GEMM that makes each weight
  gradient, which it does only for an accumulator that is a parameter of
  the step;
* **the end**: one conditional decides on the device whether the call ends
  the cycle, and closes it so that a micro-step reads and writes neither
  the updates nor the params (``_forms.decide_on_device``); with
  ``update(..., emit=True | False)`` the caller says at trace time whether
  the call ends the cycle, and no conditional decides it
  (``_forms.end_cycle_now``, ``_forms.keep_cycle_open``).

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

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import (
  _apply,
  _checks,
  _control,
  _every_k,
  _forms,
  _noise_scale,
)
from optax_accum import _state as _state_lib
from optax_accum._control import LOCAL, Local
from optax_accum._inner import Inner
from optax_accum._noise_scale import NoiseStats
from optax_accum._records import (
  Config,
  Cycle,
  MeanOrSum,
  Noise,
  Result,
  Rounding,
)
from optax_accum._state import AccumulateState, NoiseScaleState

EveryK = int | Callable[..., Any] | _every_k.GrowEveryK

# ----------------------------------------------------------------------------
# The configuration and the transformation.
# ----------------------------------------------------------------------------


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
  return optax.GradientTransformationExtraArgs(
    functools.partial(_init, config), _update_function(config)
  )


def _update_function(config: Config) -> Callable[..., Any]:
  """`tx.update`: a function of its own, with its signature and docstring
  (``help(tx.update)``), that runs :func:`_update` with `config`."""

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

  return update


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
  inner_tx = config.inner(values.every_k)
  # Two calls that are not this story: every call a cycle of its own
  # (`inner` alone, bit for bit), and an eager call on unreduced arrays (the
  # same story, jitted).
  if _is_inner_alone(config, call, updates, values.acc_buffer):
    return _inner_alone(inner_tx, updates, state, params, extra_args)
  if not (engine.runs_eagerly or _checks.is_traced(updates)):
    return _jitted_update(config)(
      updates, state, params, **call.as_given, **extra_args
    )

  # 2. Add the micro-batch into the cycle.
  cycle, accepted = _add(config, engine, values, updates, call, params=params)
  inner = _inner_types(engine, inner_tx, extra_args, updates, cycle)

  # 3. End the call: the device decides (traced), or the caller did (emit=).
  if call.emit is None:
    result = _forms.decide_on_device(config, engine, inner, cycle)
  elif call.emit:
    result = _forms.end_cycle_now(config, engine, inner, cycle)
  else:
    result = _forms.keep_cycle_open(inner, cycle)

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
    and _forms.fits(updates, acc)
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
  weight = jnp.ones([], jnp.float32) if call.weight is None else call.weight
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
    nonzero = jnp.not_equal(weight, 0)
    keep = nonzero if keep is None else keep & nonzero
  # gradients="sum" without skip_nonfinite: the gradient carries its weight
  # already; adding it as is, with no select, lets every GEMM backend fuse
  # the add (cuBLAS only with no scale).
  term = functools.partial(
    add_term, ops=engine, weight=weight if scale else None, keep=keep
  )
  if config.rounding == "stochastic":
    # Only bfloat16 leaves round: a complex gradient keeps a complex
    # accumulator (and an integer one its own), which rounds as it adds.
    acc = jax.tree.map(
      lambda a, g, key: term(
        a, g, key=key if a.dtype == jnp.bfloat16 else None
      ),
      start,
      grads,
      _rounding_keys(engine, state, start),
    )
  else:
    acc = jax.tree.map(lambda a, g: term(a, g), start, grads)
  noise = state.noise
  if config.track_noise_scale:
    noise = _add_noise(
      config, engine, state, grads, weight=weight, accepted=accepted, call=call
    )
  micro_step = state.micro_step + accepted.astype(jnp.int32)
  cycle = Cycle(
    acc=acc,
    weight=cycle_weight + jnp.where(accepted, weight, 0.0),
    micro_step=micro_step,
    ends=(micro_step >= state.every_k) | flush,
    noise=noise,
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

  return _control.per_backend(
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
  noise, fresh = state.noise, state.micro_step == 0
  if not isinstance(noise, NoiseScaleState):  # not tracked: nothing to add
    return noise
  if call.noise_stats is not None:
    return _noise_scale.add_stats(
      noise, call.noise_stats, weight, accepted, fresh
    )
  return _noise_scale.add_micro_batch(
    noise,
    grads,
    weight,
    accepted,
    fresh,
    summed=config.gradients == "sum",
    sample_axes=engine.sample_axes(),
  )


# -- 3. The end: _forms.py. 4. The next state. ------------------------------


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
  sum_dtypes = jax.tree.map(lambda a: compute_dtype(a.dtype), cycle.acc)
  inverse_dtype = max(
    (jnp.finfo(d).dtype for d in jax.tree.leaves(sum_dtypes)),
    key=lambda d: d.itemsize,
    default=jnp.dtype(jnp.float32),
  )
  return Inner(
    tx,
    extra_args,
    grad_types,
    update_types,
    state_types,
    specs,
    sum_dtypes,
    inverse_dtype,
  )


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
