r"""How many micro-batches each cycle of :func:`accumulate` wants.

``every_k`` is one of

* a positive int: every cycle has :math:`k` micro-batches;
* a schedule of the optimizer step, ``every_k(step) -> k``, or of the step
  and the weight seen so far, ``every_k(step, weight_seen) -> k`` (e.g.
  tokens: see :func:`piecewise_every_k`);
* :func:`grow_every_k`: a controller that grows :math:`k` toward
  :math:`c \, B_\text{simple} / w`, the gradient noise scale in micro-batches
  of typical weight :math:`w` (McCandlish et al., 2018).

Whatever the kind, the k of a cycle is decided when the previous cycle ends
(or at ``init``) and stored in the state, so it never changes mid-cycle and a
data loader can read it with :func:`optax_accum.current_every_k`.
"""

import dataclasses
import inspect
import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _checks, _noise_scale, _state
from optax_accum._checks import INT32_MAX
from optax_accum._state import GrowState, NoiseScaleState

# The largest float32 below 2**31: a float k at or above it holds the cycle.
_FLOAT32_BELOW_INT32_MAX = float(np.nextafter(np.float32(2**31), 0))


@dataclasses.dataclass(frozen=True)
class GrowEveryK:
  """The noise-scale controller's configuration: the arguments of
  :func:`~optax_accum.grow_every_k`, which makes it, to pass as ``every_k``."""

  k_max: int
  k_min: int
  factor: int
  scale: float
  min_cycles: int
  micro_batch_weight: float | None


# The public names (help(), the API reference); the classes live here.
GrowEveryK.__module__ = "optax_accum.types"


def grow_every_k(
  k_max: int,
  *,
  k_min: int = 2,
  factor: int = 2,
  scale: float = 1.0,
  min_cycles: int = 20,
  micro_batch_weight: float | None = None,
) -> GrowEveryK:
  r"""Grows ``every_k`` from the measured gradient noise scale.

  Pass the result as ``every_k`` of :func:`optax_accum.accumulate`, with
  ``track_noise_scale=True``. Training starts with :math:`k_\text{min}`
  micro-batches per cycle. When a cycle ends with an update, the controller
  reads the bias-corrected estimate :math:`B_\text{simple}` (in units of
  ``weight``) and the typical micro-batch weight :math:`w`, and sets

  .. math::

    k \leftarrow \min(\text{factor} \cdot k,\ k_\text{max})
    \quad\text{if}\quad
    c \, B_\text{simple} / w \;\geq\; \min(\text{factor} \cdot k,\
    k_\text{max}),

  so the big batch :math:`k w` approaches :math:`c \, B_\text{simple}`. It
  decides only after ``min_cycles`` cycles that fed the estimate since the
  start or since the last change; it only grows, one factor at a time; it
  never leaves :math:`[k_\text{min}, k_\text{max}]`; and it ignores a
  non-finite or negative estimate. Under ``axis_name`` every replica sees
  the same reduced estimate and decides the same.

  Caveats from the literature: :math:`B_\text{simple}` assumes a
  well-tuned learning rate, and it can mislead as a proxy for the critical
  batch size (Merrill et al., 2025); the controller never shrinks k.

  Args:
    k_max: The largest k, a positive int.
    k_min: The first cycles' k, an int in [2, ``k_max``]: a cycle of one
      micro-batch gives no noise-scale estimate, so the controller could
      never start from k = 1.
    factor: Growth factor, an int >= 2 (2: powers of two).
    scale: :math:`c`, a positive real; the target big batch in units of
      :math:`B_\text{simple}`.
    min_cycles: Cycles of evidence before each decision, a positive int.
    micro_batch_weight: :math:`w`, the weight of a typical micro-batch (e.g.
      its number of tokens). ``None`` measures it over the whole run: the
      weight of every cycle that ended with an update divided by their
      micro-batches (a single light or heavy cycle moves it little; the
      last cycle alone made the controller grow right after light ones).

  Returns:
    The controller's configuration, to pass as ``every_k``.

  Raises:
    TypeError, ValueError: For an argument of the wrong type or range,
      naming it.

  References:
    McCandlish et al., `An Empirical Model of Large-Batch Training
    <https://arxiv.org/abs/1812.06162>`_, 2018; Merrill et al., `Critical
    Batch Size Revisited <https://arxiv.org/abs/2505.23971>`_, 2025.
  """
  k_max = _checks.positive_int(k_max, "k_max")
  k_min = _checks.positive_int(k_min, "k_min")
  factor = _checks.positive_int(factor, "factor")
  min_cycles = _checks.positive_int(min_cycles, "min_cycles")
  if k_max > INT32_MAX:
    raise ValueError(f"`k_max` must be at most 2**31 - 1, got {k_max}.")
  if not 2 <= k_min <= k_max:
    raise ValueError(
      f"`k_min` must be in [2, `k_max`={k_max}] (a cycle of one micro-batch"
      f" gives no noise-scale estimate), got {k_min}."
    )
  if factor < 2:
    raise ValueError(f"`factor` must be >= 2, got {factor}.")
  scale = _positive_real(scale, "scale")
  if micro_batch_weight is not None:
    micro_batch_weight = _positive_real(
      micro_batch_weight, "micro_batch_weight"
    )
  return GrowEveryK(k_max, k_min, factor, scale, min_cycles, micro_batch_weight)


def _positive_real(value: Any, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"`{name}` must be a positive real number, got {value!r}.")
  real = float(value)
  if not (np.isfinite(real) and real > 0):
    raise ValueError(f"`{name}` must be a positive real number, got {value!r}.")
  return real


def piecewise_every_k(
  boundaries: Mapping[float, int], initial: int = 1
) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """A schedule of the weight seen: ``initial``, then a new k past each boundary.

  The batch-size warm-up of OLMo-core and Megatron, in micro-batches: with
  ``weight=`` the number of tokens of each micro-batch,
  ``piecewise_every_k({2_000_000: 2, 8_000_000: 4})`` accumulates 1
  micro-batch per step until 2M tokens were seen, 2 until 8M, then 4.

  Args:
    boundaries: ``{weight_seen: k}``: from the first cycle that starts with
      at least that much weight seen, k is this value.
    initial: k before the first boundary.

  Returns:
    A schedule ``every_k(step, weight_seen) -> int32[]`` for
    :func:`optax_accum.accumulate`.

  Examples:
    >>> import optax_accum
    >>> schedule = optax_accum.piecewise_every_k({100: 2, 400: 4})
    >>> [int(schedule(0, seen)) for seen in (0, 99, 100, 399, 400, 10**6)]
    [1, 1, 2, 2, 4, 4]
  """
  initial = _checks.positive_int(initial, "initial")
  if not isinstance(boundaries, Mapping):
    raise TypeError(
      "`boundaries` must be a mapping {weight_seen: k}, got"
      f" {type(boundaries).__name__}."
    )
  points = sorted(
    (float(b), _checks.positive_int(k, f"boundaries[{b!r}]"))
    for b, k in boundaries.items()
  )
  thresholds = np.asarray([b for b, _ in points], np.float32)
  values = np.asarray([initial] + [k for _, k in points], np.int32)

  def schedule(step: jax.Array, weight_seen: jax.Array) -> jax.Array:
    del step
    passed = jnp.sum(jnp.asarray(weight_seen, jnp.float32) >= thresholds)
    return jnp.asarray(values)[passed]

  return schedule


class InnerForEveryK(NamedTuple):
  """An inner transformation built for each cycle's k: what
  :func:`~optax_accum.inner_for_every_k` makes, to pass as ``inner``."""

  factory: Callable[[jax.Array], optax.GradientTransformation]


InnerForEveryK.__module__ = "optax_accum.types"


def inner_for_every_k(
  factory: Callable[[jax.Array], optax.GradientTransformation],
) -> InnerForEveryK:
  r"""Makes the inner optimizer a function of the cycle's number of micro-batches.

  When ``every_k`` grows during training (a schedule or
  :func:`grow_every_k`) the batch grows with it, and the learning rate
  usually should too: OLMo-core multiplies Adam's by
  :math:`\sqrt{k / k_0}`. Pass ``inner=inner_for_every_k(factory)`` to
  :func:`accumulate`: each emitting call runs ``factory(k)``, with ``k`` the
  cycle's ``every_k`` as an ``int32[]``, and ``init`` uses ``factory`` of
  the first cycle's k. The state's structure must not depend on k (true
  when k only enters hyperparameters such as the learning rate).

  Args:
    factory: ``factory(k) -> optax.GradientTransformation``.

  Returns:
    A value to pass as ``inner``.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(
    ...     optax_accum.inner_for_every_k(
    ...         lambda k: optax.sgd(0.1 * jnp.sqrt(k / 2))),
    ...     every_k=lambda step: 2 * (step + 1))  # k = 2, 4, 6, ...
    >>> params = jnp.zeros(1)
    >>> state = tx.init(params)
    >>> for k in (2, 4):
    ...   for _ in range(k):
    ...     updates, state = tx.update(jnp.ones(1), state, params)
    ...   print(k, updates)
    2 [-0.1]
    4 [-0.14142136]
  """
  if not callable(factory):
    raise TypeError(
      "`factory` must be callable as factory(k) -> GradientTransformation,"
      f" got {factory!r}."
    )
  return InnerForEveryK(factory)


# ----------------------------------------------------------------------------
# Used by accumulate.
# ----------------------------------------------------------------------------


class Spec(NamedTuple):
  """A validated ``every_k``: exactly one of `fixed`, `schedule`, `grow`."""

  fixed: int | None = None  # A plain k.
  schedule: Callable | None = None  # every_k(step) or (step, weight_seen).
  takes_weight: bool = False  # The schedule's second argument is the weight.
  grow: GrowEveryK | None = None  # The controller.


def _takes_weight_seen(schedule: Callable) -> bool:
  """Whether `schedule` is ``every_k(step, weight_seen)`` rather than
  ``every_k(step)``; raises naming `every_k` if it is neither."""
  try:
    signature = inspect.signature(schedule)
  except (TypeError, ValueError):  # no signature (some builtins): the step
    return False
  for arguments, takes_weight in (((0, 0), True), ((0,), False)):
    try:
      signature.bind(*arguments)
    except TypeError:
      continue
    return takes_weight
  raise TypeError(
    "`every_k` schedule must take the optimizer step, `every_k(step)`, or"
    " the step and the weight seen, `every_k(step, weight_seen)`; got"
    f" {schedule!r} with signature {signature}."
  )


def to_spec(every_k: Any, track_noise_scale: bool) -> Spec:
  """Validates ``every_k`` at construction; raises naming it."""
  if isinstance(every_k, GrowEveryK):
    if not track_noise_scale:
      raise ValueError(
        "`every_k=grow_every_k(...)` needs `track_noise_scale=True`: it"
        " grows k from the gradient noise scale."
      )
    return Spec(grow=every_k)
  if callable(every_k) and not isinstance(every_k, jax.Array):
    spec = Spec(schedule=every_k, takes_weight=_takes_weight_seen(every_k))
    first(spec)  # a bad schedule fails here, not at the first update
    return spec
  k = _checks.positive_int(
    every_k,
    "every_k",
    " or a schedule (callable(step) -> int), or grow_every_k(...)",
  )
  if k > INT32_MAX:
    raise ValueError(
      f"`every_k` must be at most 2**31 - 1 (it is counted in int32), got {k}."
    )
  return Spec(fixed=k)


def schedule_value(value: Any) -> jax.Array:
  """A schedule's value as an int32[] cycle length >= 1; raises naming it.

  Values are rounded down and values below 1 count as 1. A NaN or a value
  too large for int32 holds the cycle open (no update until ``flush``) when
  it is only known at run time; a concrete NaN raises.
  """
  k = _checks.real_scalar(
    value, "`every_k` schedule must return", " (the cycle length)"
  )
  if jnp.issubdtype(k.dtype, jnp.integer):
    return jnp.minimum(jnp.maximum(k, 1), INT32_MAX).astype(jnp.int32)
  if not isinstance(k, jax.core.Tracer) and np.isnan(np.asarray(k)):
    raise ValueError("`every_k` schedule returned NaN.")
  k = jnp.floor(k.astype(jnp.float32))
  k = jnp.where(jnp.isnan(k), jnp.inf, k)
  return jnp.clip(k, 1, _FLOAT32_BELOW_INT32_MAX).astype(jnp.int32)


def _scheduled(
  spec: Spec, step: jax.Array, weight_seen: jax.Array
) -> jax.Array:
  """The k `spec`'s schedule gives at `step` (a spec that has one)."""
  schedule = spec.schedule
  if schedule is None:  # a fixed k or the controller: no schedule to call
    raise TypeError(f"`every_k` {spec} has no schedule.")
  if spec.takes_weight:
    return schedule_value(schedule(step, weight_seen))
  return schedule_value(schedule(step))


def first(spec: Spec) -> jax.Array:
  """The k of the first cycle, an int32[]."""
  if spec.fixed is not None:
    return jnp.asarray(spec.fixed, jnp.int32)
  if spec.grow is not None:
    return jnp.asarray(spec.grow.k_min, jnp.int32)
  zero = jnp.zeros([], jnp.int32)
  return _scheduled(spec, zero, jnp.zeros([], jnp.float32))


def is_step_schedule(spec: Spec) -> bool:
  """Whether `spec` is a schedule of the optimizer step alone, the one kind
  ``optax.MultiSteps`` shares (its ``every_k_schedule``)."""
  return spec.schedule is not None and not spec.takes_weight


def of_multisteps(spec: Spec, step: jax.Array) -> jax.Array:
  """The k of the cycle at optimizer step `step` in the ``optax.MultiSteps``
  run that `spec` takes over from (``multisteps.equivalent``): a schedule
  of the step at `step`, any other kind its first k."""
  if is_step_schedule(spec):
    return _scheduled(spec, jnp.asarray(step, jnp.int32), jnp.float32(0))
  return first(spec)


def init_grow(spec: Spec) -> GrowState | optax.EmptyState:
  """The controller's state; an empty record without a controller."""
  if spec.grow is None:
    return optax.EmptyState()
  return GrowState(
    changed_at=jnp.zeros([], jnp.int32),
    micro_batches=jnp.zeros([], jnp.float32),
  )


def _grown(
  grow: GrowEveryK,
  k: jax.Array,
  state: GrowState,
  noise: NoiseScaleState,
  weight_seen: jax.Array,
  cycle_micro_batches: jax.Array,
  decay: float,
) -> tuple[jax.Array, GrowState]:
  """`weight_seen` and the micro-batches include the cycle that just ended
  (with an update)."""
  grad_sq, trace = _noise_scale.bias_corrected(noise, decay)
  micro_batches = state.micro_batches + cycle_micro_batches.astype(jnp.float32)
  if grow.micro_batch_weight is None:  # the run-long mean
    typical = _state.total_of(weight_seen) / jnp.maximum(micro_batches, 1.0)
  else:
    typical = jnp.asarray(grow.micro_batch_weight, jnp.float32)
  target = grow.scale * (trace / grad_sq) / typical
  bigger = jnp.minimum(k * grow.factor, grow.k_max)
  evidence = noise.cycles - state.changed_at >= grow.min_cycles
  decide = (
    evidence
    & (grad_sq > 0)
    & (trace >= 0)
    & (typical > 0)
    & jnp.isfinite(target)
    & (k < grow.k_max)
    & (target >= bigger)
  )
  return (
    jnp.where(decide, bigger, k).astype(jnp.int32),
    GrowState(
      changed_at=jnp.where(decide, noise.cycles, state.changed_at),
      micro_batches=micro_batches,
    ),
  )


def next_k(
  spec: Spec,
  k: jax.Array,
  grow_state: GrowState | optax.EmptyState,
  *,
  step: jax.Array,
  weight_seen: jax.Array,
  noise: NoiseScaleState | optax.EmptyState,
  cycle_micro_batches: jax.Array,
  emitted: jax.Array,
  decay: float,
) -> tuple[jax.Array, GrowState | optax.EmptyState]:
  """The k of the next cycle (called when a cycle ends), and the new
  controller state. `step` and `weight_seen` are after this cycle."""
  if spec.fixed is not None:
    return k, grow_state
  if spec.grow is None:  # a schedule
    return _scheduled(spec, step, _state.total_of(weight_seen)), grow_state
  grown, new_state = _grown(
    spec.grow, k, grow_state, noise, weight_seen, cycle_micro_batches, decay
  )
  # Only a cycle that ended with an update brought new evidence.
  k = jnp.where(emitted, grown, k)
  grow_state = jax.tree.map(
    lambda new, old: jnp.where(emitted, new, old), new_state, grow_state
  )
  return k, grow_state
