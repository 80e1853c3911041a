"""Gradient noise scale (McCandlish et al., 2018) from accumulated gradients.

Within one cycle every micro-batch gradient :math:`g_i` (a mean over
:math:`w_i` examples or tokens) and the cycle's weighted mean
:math:`g = \\sum_i w_i g_i / W`, :math:`W = \\sum_i w_i`, are taken at the
same parameters. With :math:`G` the true gradient and :math:`\\Sigma` the
per-example gradient covariance,

.. math::

  \\mathbb{E}|g_i|^2 = |G|^2 + \\mathrm{tr}(\\Sigma) / w_i, \\qquad
  \\mathbb{E}|g|^2 = |G|^2 + \\mathrm{tr}(\\Sigma) / W,

so with :math:`S = \\sum_i w_i |g_i|^2` over the :math:`m` micro-batches of
positive weight, :math:`\\mathbb{E}[S - W|g|^2] = (m - 1)\\,\\mathrm{tr}(\\Sigma)`
and the unbiased per-cycle estimates are

.. math::

  \\widehat{\\mathrm{tr}\\Sigma} = \\frac{S - W |g|^2}{m - 1}, \\qquad
  \\widehat{|G|^2} = |g|^2 - \\widehat{\\mathrm{tr}\\Sigma} / W .

Each is smoothed by its own exponential moving average and only the smoothed
values are divided: :math:`B_\\text{simple} = \\mathrm{tr}(\\Sigma) / |G|^2`.

With ``axis_name`` every device's share of a micro-batch is one of the
:math:`m` samples. Inside ``shard_map`` each device measures its own
:math:`w_d |g_d|^2`. Under plain ``jit`` the accumulator only sees each
device's :math:`(n_d / N)\\, g_d` inside a gradient typed unreduced, never
:math:`n_d`, so :func:`optax_accum.distributed.local_value_and_grad` measures the
shares where they are known and hands their sums over as
:class:`NoiseStats`. A micro-batch given weight :math:`w` whose shares carry
:math:`n_d` (:math:`\\sum_d n_d = N`) has its shares weighted
:math:`w\\, n_d / N`, so that the sample weights add up to the
accumulator's :math:`W` whatever unit ``weight`` is in.
"""

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _control
from optax_accum._state import NoiseScaleState, find_state


class NoiseStats(NamedTuple):
  """One micro-batch's noise-scale sums over the devices' shares of it.

  Made by ``optax_accum.distributed.local_value_and_grad(..., noise_stats=True)`` and
  passed on as ``update(..., noise_stats=stats)`` to
  ``accumulate(..., axis_name=..., track_noise_scale=True)`` under plain
  ``jit``, where the accumulator sees neither a device's own gradient nor
  its weight. Every field is the same on every device.

  Attributes:
    sq_norm_sum: ``float32[]``. :math:`\\sum_d n_d |g_d|^2` over the devices,
      with :math:`g_d` the gradient of device :math:`d`'s own mean loss and
      :math:`n_d` its weight (its token count, or 1 without weights).
    weight: ``float32[]``. :math:`N = \\sum_d n_d`.
    count: ``int32[]``. Devices with :math:`n_d > 0`.
  """

  sq_norm_sum: jax.Array  # float32[]
  weight: jax.Array  # float32[]
  # Named as tuple's method (see NoiseScaleState.count in _state.py).
  count: jax.Array  # type: ignore[assignment]  # int32[]


# Its public name (help(), the API reference, pickles); it lives here.
NoiseStats.__module__ = "optax_accum.distributed"


DEFAULT_DECAY = 0.99  # accumulate's noise_scale_decay


def check_decay(decay: Any, track_noise_scale: bool = True) -> float:
  """Returns `decay` if it is a real number in [0, 1), and the default
  unless the noise scale is tracked (no other value would be read); raises
  naming it."""
  if isinstance(decay, bool) or not (
    isinstance(decay, numbers.Real) and 0 <= float(decay) < 1
  ):
    raise ValueError(
      f"`noise_scale_decay` must be a float in [0, 1), got {decay!r}."
    )
  # float32 too: np.float32(0.99) is the default, whatever its float.
  if not track_noise_scale and np.float32(decay) != np.float32(DEFAULT_DECAY):
    raise ValueError(
      "`noise_scale_decay` sets the decay of the noise scale's moving"
      " averages, which are kept only with `track_noise_scale=True`; got"
      f" noise_scale_decay={decay!r} with track_noise_scale=False."
    )
  return float(decay)


def init() -> NoiseScaleState:
  """The sums of a run that has seen nothing."""
  return NoiseScaleState(
    sq_norm_sum=jnp.zeros([], jnp.float32),
    count=jnp.zeros([], jnp.int32),
    grad_sq=jnp.zeros([], jnp.float32),
    trace=jnp.zeros([], jnp.float32),
    cycles=jnp.zeros([], jnp.int32),
  )


def sq_norm(tree: Any, scale: Any = 1.0, sample_axes: Any = None) -> jax.Array:
  r""":math:`|\text{scale} \cdot x|^2` summed over the leaves, in float32.

  Complex leaves count their modulus, so no imaginary part is lost.

  `sample_axes` (inside ``shard_map``): the manual axes each device's value
  is its own sample over (``accumulate``'s ``axis_name``). A leaf that also
  varies over other manual axes is a shard of a larger array (FSDP or
  HSDP: params sharded over ``"fsdp"``): its sum of squares is added over
  those axes with a scalar ``psum``, so that the norm is the whole
  array's. A leaf the same on those axes (a replicated bias) counts once.
  With ``check_vma=False`` no value says what it varies over:
  :func:`_over_unknown_shards` tells the shards by their sums.
  """
  sums = []
  for x in jax.tree.leaves(tree):
    x = jnp.abs(x) if jnp.iscomplexobj(x) else jnp.asarray(x)
    sums.append(jnp.sum(jnp.square(x.astype(jnp.float32) * scale)))
  own = frozenset(_control.axis_tuple(sample_axes or ()))
  if sample_axes is not None and not _control.vma_checked():
    others = _control.manual_axes() - own
    if others and sums:
      return _over_unknown_shards(jnp.stack(sums), others)
  total = jnp.zeros([], jnp.float32)
  for leaf in sums:
    if sample_axes is not None:
      shards = _control.varying_axes(jax.typeof(leaf)) - own
      if shards:
        leaf = lax.psum(leaf, tuple(sorted(shards)))
    total += leaf
  return total


def _over_unknown_shards(sums: jax.Array, axes: frozenset) -> jax.Array:
  """The leaves' sums of squares (`sums`, one each) added over the manual
  `axes` where a leaf is sharded over them, under ``check_vma=False``: a
  sum the same on every device of an axis is a replicated leaf's, counted
  once; one that differs is a shard's, added over the axis (three scalar
  collectives per axis, one vector of the leaves each). An array split into
  shards of bitwise-equal sums would be taken for a replicated one; a
  gradient's shards are not (zeros excepted, which add nothing either
  way)."""
  for axis in sorted(axes, key=str):
    same = lax.pmax(sums, axis) == lax.pmin(sums, axis)
    sums = jnp.where(same, sums, lax.psum(sums, axis))
  return jnp.sum(sums)


def add_micro_batch(
  noise: NoiseScaleState,
  grads: Any,
  weight: jax.Array,
  accepted: jax.Array,
  fresh: jax.Array,
  summed: bool = False,
  sample_axes: Any = None,
) -> NoiseScaleState:
  """Adds one micro-batch to the cycle's sums (a fresh cycle starts at 0).

  `summed`: `grads` is a sum over the micro-batch's `weight` (its mean is
  ``grads / weight``), so its sample is :math:`|g|^2 / w`. `sample_axes`:
  see :func:`sq_norm`.
  """
  counted = accepted & (weight > 0)
  norm = sq_norm(grads, sample_axes=sample_axes)
  if summed:
    sample = norm / jnp.where(weight > 0, weight, 1.0)
  else:
    sample = weight * norm
  return _add_samples(noise, fresh, counted, sample, 1)


def add_stats(
  noise: NoiseScaleState,
  stats: NoiseStats,
  weight: jax.Array,
  accepted: jax.Array,
  fresh: jax.Array,
) -> NoiseScaleState:
  """Adds one micro-batch measured per device (see :class:`NoiseStats`),
  its shares reweighted to add up to `weight`."""
  counted = accepted & (weight > 0) & (stats.weight > 0)
  share = weight / jnp.where(stats.weight > 0, stats.weight, 1.0)
  return _add_samples(
    noise, fresh, counted, share * stats.sq_norm_sum, stats.count
  )


def _add_samples(
  noise: NoiseScaleState,
  fresh: jax.Array,
  counted: jax.Array,
  sq_norm_sum: jax.Array,
  count: Any,
) -> NoiseScaleState:
  """The cycle's sums plus `count` samples whose weighted squared norms add
  up to `sq_norm_sum`, if `counted` (a fresh cycle starts at 0)."""
  return noise._replace(
    sq_norm_sum=jnp.where(fresh, 0.0, noise.sq_norm_sum)
    + jnp.where(counted, sq_norm_sum, 0.0),
    count=jnp.where(fresh, 0, noise.count)
    + jnp.where(counted, count, 0).astype(noise.count.dtype),
  )


def fold_cycle(
  noise: NoiseScaleState,
  mean_sq_norm: jax.Array,
  total_weight: jax.Array,
  decay: float,
) -> NoiseScaleState:
  """Folds one finished cycle into the moving averages, then resets it."""
  count = noise.count.astype(jnp.float32)
  valid = (count >= 2) & (total_weight > 0)
  safe_count = jnp.where(valid, count - 1, 1.0)
  safe_weight = jnp.where(valid, total_weight, 1.0)
  trace = (noise.sq_norm_sum - total_weight * mean_sq_norm) / safe_count
  grad_sq = mean_sq_norm - trace / safe_weight
  keep = jnp.asarray(decay, jnp.float32)
  return NoiseScaleState(
    sq_norm_sum=jnp.zeros_like(noise.sq_norm_sum),
    count=jnp.zeros_like(noise.count),
    grad_sq=jnp.where(
      valid, keep * noise.grad_sq + (1 - keep) * grad_sq, noise.grad_sq
    ),
    trace=jnp.where(
      valid, keep * noise.trace + (1 - keep) * trace, noise.trace
    ),
    cycles=noise.cycles + valid.astype(noise.cycles.dtype),
  )


def _tracked(opt_state: Any, reader: str) -> NoiseScaleState:
  noise = find_state(opt_state, reader).noise
  if not isinstance(noise, NoiseScaleState):
    raise ValueError(
      f"`{reader}` needs the state of"
      " `accumulate(..., track_noise_scale=True)`; this state was built"
      " without it, so there is no noise-scale estimate to read."
    )
  return noise


def noise_scale_components(
  opt_state: Any, *, noise_scale_decay: float = 0.99
) -> tuple[jax.Array, jax.Array]:
  """The bias-corrected moving averages of :math:`|G|^2` and :math:`\\mathrm{tr}\\Sigma`.

  Args:
    opt_state: The state of ``accumulate(..., track_noise_scale=True)``, or
      any optimizer state holding exactly one such state (see
      :func:`optax_accum.has_updated`).
    noise_scale_decay: The decay the transformation was built with (the
      bias correction divides by :math:`1 - \\text{decay}^{n}` after
      :math:`n` cycles), in [0, 1).

  Returns:
    ``(grad_sq, trace)``, both ``float32[]``; NaN before the first cycle with
    at least two micro-batches of positive weight. ``trace`` is in squared
    gradient units times the unit of ``weight``.

  Raises:
    TypeError: If `opt_state` holds no AccumulateState.
    ValueError: If it holds several, if it was built without
      ``track_noise_scale=True``, or for a decay outside [0, 1).
  """
  decay = check_decay(noise_scale_decay)
  return bias_corrected(_tracked(opt_state, "noise_scale_components"), decay)


def bias_corrected(
  noise: NoiseScaleState, decay: float
) -> tuple[jax.Array, jax.Array]:
  """``(grad_sq, trace)`` divided by :math:`1 - \\text{decay}^n`; NaN at n=0."""
  # jnp.asarray unwraps array-like leaves too, such as the OptArray leaves
  # of a flax.nnx.Optimizer's opt_state.
  cycles = jnp.asarray(noise.cycles)
  correction = 1 - jnp.asarray(decay, jnp.float32) ** cycles.astype(jnp.float32)
  ready = cycles > 0
  correction = jnp.where(ready, correction, 1.0)
  grad_sq = jnp.where(ready, jnp.asarray(noise.grad_sq) / correction, jnp.nan)
  trace = jnp.where(ready, jnp.asarray(noise.trace) / correction, jnp.nan)
  return grad_sq, trace


def noise_scale(opt_state: Any) -> jax.Array:
  """The simple gradient noise scale :math:`B_\\text{simple} = \\mathrm{tr}(\\Sigma)/|G|^2`.

  McCandlish et al. (2018) show that training up to a batch of about
  :math:`B_\\text{simple}` examples gains almost linearly from the larger
  batch, and that beyond it returns diminish: a rough critical batch size.

  The unit is the unit of ``weight``: pass each micro-batch's number of
  examples (or tokens) as ``weight`` to get examples (or tokens); with the
  default weight of 1 the unit is micro-batches.

  Args:
    opt_state: The state of ``accumulate(..., track_noise_scale=True)``, or
      any optimizer state holding exactly one such state.

  Returns:
    A ``float32[]``; NaN until the first cycle with at least two micro-batches
    of positive weight. Noisy when :math:`|G|^2` is small: the smoothed
    estimate of :math:`|G|^2` can even be negative early on.

  Raises:
    TypeError, ValueError: As :func:`noise_scale_components`; in particular
      a ``ValueError`` for a state built without ``track_noise_scale=True``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.0), every_k=8,
    ...                             track_noise_scale=True)
    >>> params = jnp.zeros(100)
    >>> state = tx.init(params)
    >>> update = jax.jit(tx.update)
    >>> noise = jax.random.normal(jax.random.PRNGKey(0), (800, 100))
    >>> for z in noise:  # true gradient 1, per-example noise N(0, 4)
    ...   _, state = update(1.0 + 2.0 * z, state, params)
    >>> b = float(optax_accum.noise_scale(state))  # truth: 100 * 4 / 100 = 4
    >>> 3.4 < b < 4.6
    True

  References:
    McCandlish et al., `An Empirical Model of Large-Batch Training
    <https://arxiv.org/abs/1812.06162>`_, 2018.
  """
  grad_sq, trace = noise_scale_components(opt_state)
  return trace / grad_sq
