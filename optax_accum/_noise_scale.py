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
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from optax_accum._state import AccumulateState


class _NoiseFields(NamedTuple):
  """The noise-scale fields of :class:`AccumulateState`, updated together."""

  sq_norm_sum: jax.Array
  count: jax.Array
  grad_sq: jax.Array
  trace: jax.Array
  cycles: jax.Array


def _fold_cycle(
  fields: _NoiseFields,
  mean_sq_norm: jax.Array,
  total_weight: jax.Array,
  decay: float,
) -> _NoiseFields:
  """Folds one finished cycle into the moving averages, then resets it."""
  count = fields.count.astype(jnp.float32)
  valid = (count >= 2) & (total_weight > 0)
  safe_count = jnp.where(valid, count - 1, 1.0)
  safe_weight = jnp.where(valid, total_weight, 1.0)
  trace = (fields.sq_norm_sum - total_weight * mean_sq_norm) / safe_count
  grad_sq = mean_sq_norm - trace / safe_weight
  keep = jnp.asarray(decay, jnp.float32)
  return _NoiseFields(
    sq_norm_sum=jnp.zeros_like(fields.sq_norm_sum),
    count=jnp.zeros_like(fields.count),
    grad_sq=jnp.where(
      valid, keep * fields.grad_sq + (1 - keep) * grad_sq, fields.grad_sq
    ),
    trace=jnp.where(
      valid, keep * fields.trace + (1 - keep) * trace, fields.trace
    ),
    cycles=fields.cycles + valid.astype(fields.cycles.dtype),
  )


def noise_scale_components(
  state: AccumulateState, *, noise_scale_decay: float = 0.99
) -> tuple[jax.Array, jax.Array]:
  """The bias-corrected moving averages of :math:`|G|^2` and :math:`\\mathrm{tr}\\Sigma`.

  Args:
    state: The state of ``accumulate(..., track_noise_scale=True)``.
    noise_scale_decay: The decay the transformation was built with (the
      bias correction divides by :math:`1 - \\text{decay}^{n}` after
      :math:`n` cycles).

  Returns:
    ``(grad_sq, trace)``, both ``float32[]``; NaN before the first cycle with
    at least two micro-batches of positive weight. ``trace`` is in squared
    gradient units times the unit of ``weight``.
  """
  if not isinstance(state, AccumulateState):
    raise TypeError(
      f"`state` must be an AccumulateState, got {type(state).__name__}."
    )
  # jnp.asarray unwraps array-like leaves too, such as the OptArray leaves
  # of a flax.nnx.Optimizer's opt_state.
  cycles = jnp.asarray(state.noise_cycles)
  correction = 1 - jnp.asarray(noise_scale_decay, jnp.float32) ** cycles
  ready = cycles > 0
  correction = jnp.where(ready, correction, 1.0)
  grad_sq = jnp.where(
    ready, jnp.asarray(state.noise_grad_sq) / correction, jnp.nan
  )
  trace = jnp.where(ready, jnp.asarray(state.noise_trace) / correction, jnp.nan)
  return grad_sq, trace


def noise_scale(state: AccumulateState) -> jax.Array:
  """The simple gradient noise scale :math:`B_\\text{simple} = \\mathrm{tr}(\\Sigma)/|G|^2`.

  McCandlish et al. (2018) show that training up to a batch of about
  :math:`B_\\text{simple}` examples gains almost linearly from the larger
  batch, and that beyond it returns diminish: a rough critical batch size.

  The unit is the unit of ``weight``: pass each micro-batch's number of
  examples (or tokens) as ``weight`` to get examples (or tokens); with the
  default weight of 1 the unit is micro-batches.

  Args:
    state: The state of ``accumulate(..., track_noise_scale=True)``.

  Returns:
    A ``float32[]``; NaN until the first cycle with at least two micro-batches
    of positive weight. Noisy when :math:`|G|^2` is small: the smoothed
    estimate of :math:`|G|^2` can even be negative early on.

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
  grad_sq, trace = noise_scale_components(state)
  return trace / grad_sq
