"""The state of :func:`optax_accum.accumulate` and functions that read it."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class AccumulateState(NamedTuple):
  """State of :func:`optax_accum.accumulate`.

  Every field is an array (or a tree of arrays), so the state can be saved
  and restored mid-cycle with any pytree serializer, carried through
  ``lax.scan``, donated to ``jit`` and sharded like the parameters.

  Attributes:
    micro_step: ``int32[]``. Micro-batches accepted in the current cycle
      (skipped ones excluded); ``0`` right after an update was emitted.
    step: ``int32[]``. Updates emitted so far: the optimizer step. A schedule
      passed as ``every_k`` is called with this value.
    acc_grads: The accumulator, a tree like the params with leaves in
      ``accumulator_dtype``: :math:`\\sum_i w_i g_i` over the micro-batches
      of the current cycle. When ``micro_step == 0`` it holds no gradient:
      the emitting call reuses this buffer as scratch for the update it
      returns (so a step needs no second parameter-sized buffer) and the
      next call overwrites it without reading it.
    acc_weight: ``float32[]``. :math:`\\sum_i w_i`, the total weight
      accumulated in the current cycle (with the default weight of 1, the
      number of micro-batches). Reset lazily like ``acc_grads``: when
      ``micro_step == 0`` it still holds the last cycle's total.
    inner_state: The wrapped transformation's state; changes only on
      emitting calls.
    num_skipped: ``int32[]``. Micro-batches dropped by ``skip_nonfinite``
      over the whole run.
    emitted: ``bool[]``. Whether the most recent ``update`` emitted a real
      update (read it with :func:`has_updated`).
    noise_sq_norm_sum: ``float32[]``. :math:`\\sum_i w_i |g_i|^2` over the
      current cycle (only with ``track_noise_scale=True``, else 0).
    noise_count: ``int32[]``. Micro-batches with positive weight in the
      current cycle (only with ``track_noise_scale=True``, else 0).
    noise_grad_sq: ``float32[]``. Exponential moving average of the unbiased
      per-cycle estimate of :math:`|G|^2` (not bias-corrected; read it with
      :func:`noise_scale_components`).
    noise_trace: ``float32[]``. Exponential moving average of the unbiased
      per-cycle estimate of :math:`\\mathrm{tr}(\\Sigma)`.
    noise_cycles: ``int32[]``. Cycles folded into the two averages above.
  """

  micro_step: jax.Array  # int32[]
  step: jax.Array  # int32[]
  acc_grads: optax.Updates
  acc_weight: jax.Array  # float32[]
  inner_state: optax.OptState
  num_skipped: jax.Array  # int32[]
  emitted: jax.Array  # bool[]
  noise_sq_norm_sum: jax.Array  # float32[]
  noise_count: jax.Array  # int32[]
  noise_grad_sq: jax.Array  # float32[]
  noise_trace: jax.Array  # float32[]
  noise_cycles: jax.Array  # int32[]


def has_updated(state: AccumulateState) -> jax.Array:
  """Whether the most recent ``update`` call emitted a real update.

  ``False`` on the accumulating calls of a cycle, on calls dropped by
  ``skip_nonfinite`` and on a cycle whose total weight was zero; ``True``
  when the inner transformation ran.

  Args:
    state: An :class:`AccumulateState` (also found inside an ``optax.chain``
      state by the caller).

  Returns:
    A ``bool[]`` array (batched under ``vmap``).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=2)
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   _, state = tx.update(jnp.ones(3), state, params)
    ...   print(bool(optax_accum.has_updated(state)))
    False
    True
  """
  if not isinstance(state, AccumulateState):
    raise TypeError(
      "`state` must be an AccumulateState (the state of"
      f" optax_accum.accumulate), got {type(state).__name__}."
    )
  # jnp.asarray unwraps array-like leaves too, such as the OptArray leaves
  # of a flax.nnx.Optimizer's opt_state.
  return jnp.asarray(state.emitted)
