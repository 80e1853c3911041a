"""How the inner optimizer runs on a cycle's mean.

A cycle that ends is summed over the devices (with ``axis_name``:
:func:`reduce_cycle`, in ``reduce_dtype`` on the wire), divided by its
total weight (:func:`inverse_weight`: in float32, or float64 under x64) and
folded into the noise scale (:func:`cycle_mean`); then the inner optimizer
runs on the mean (:func:`run_inner`), where a branch of ``_forms.py``
decides it should: that room says which way each backend runs it (in a
conditional of its own, or anyway with selects keeping a weightless cycle's
result out). The dtypes the mean is computed in are fixed with the rest of
:class:`Inner`, once per trace, with the types the inner optimizer takes
and returns (``_accumulate._inner_types``).

``_forms.py`` calls these from its branches; ``_accumulate.py`` builds
:class:`Inner` once per call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _control, _noise_scale
from optax_accum._control import Local
from optax_accum._records import Config, Cycle, Noise, Types
from optax_accum._state import NoiseScaleState


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
  # The dtypes the mean is computed in: each leaf's sum (at least float32),
  # and 1/W's (float32; float64 where a leaf is, under jax_enable_x64: a
  # float32 inverse would round a float64 mean to float32's precision).
  sum_dtypes: Any
  inverse_dtype: Any


class InnerOperands(NamedTuple):
  """What the inner optimizer's run on a cycle's mean reads (the operands of
  the conditional that runs it where it has one of its own)."""

  weighted: jax.Array  # bool[]: the total weight is positive, or NaN
  total: optax.Updates  # the cycle's (reduced) sum
  inv_weight: jax.Array  # 1 / its total weight (:func:`inverse_weight`)
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


def cycle_mean(
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
    cycle = reduce_cycle(config, engine, inner, cycle, per_leaf=per_leaf)
  inv_weight = inverse_weight(cycle.weight, inner.inverse_dtype)
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


def reduce_cycle(
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
  scalars: tuple[jax.Array, ...] = (cycle.weight,)
  if isinstance(noise, NoiseScaleState):  # The count as float32, to join.
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
  if isinstance(noise, NoiseScaleState):
    noise = noise._replace(
      sq_norm_sum=scalars[1], count=scalars[2].astype(jnp.int32)
    )
  return cycle._replace(acc=acc, weight=scalars[0], noise=noise)


def inverse_weight(
  total_weight: jax.Array, dtype: Any = jnp.float32
) -> jax.Array:
  """1 / W in `dtype` (:attr:`Inner.inverse_dtype`), with 1 for a
  non-positive W (whose cycle updates nothing); a NaN W stays NaN so that
  it reaches ``inner``."""
  total_weight = total_weight.astype(dtype)
  return 1.0 / jnp.where(total_weight <= 0, 1.0, total_weight)


def mean_sq_norm(acc: optax.Updates, total_weight: jax.Array) -> jax.Array:
  return _noise_scale.sq_norm(acc, inverse_weight(total_weight))


def run_inner(
  config: Config, inner: Inner, operands: InnerOperands, *, apply: bool
) -> Ran:
  """`inner` on the cycle's mean gradient, computed here so that it fuses
  into the inner's kernels; with `apply`, the params updated too."""

  # The sum in its compute dtype, times 1/W, in the gradient's own dtype.
  # (`grad_types` holds shapes only: closing over the gradient arrays would
  # make them operands of the conditional and materialise them.)
  grad = jax.tree.map(
    lambda a, t: a.astype(t), operands.total, inner.sum_dtypes
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
