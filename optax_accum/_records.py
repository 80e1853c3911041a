"""What the rooms of ``update`` share: the configuration, and the records one
call passes from room to room.

``_accumulate.py`` builds a :class:`Cycle` (the micro-batch added) and reads
a :class:`Result` (how the call ended); ``_forms.py`` turns the one into the
other, calling on ``_inner.py`` for the inner optimizer's run. Every value
that crosses between them is one of these records, so that no room reaches
into another's locals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, Literal, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding

from optax_accum import _every_k
from optax_accum._state import NoiseScaleState

# What `reduction=` and `gradients=` take (checked at construction too).
MeanOrSum: TypeAlias = Literal["mean", "sum"]
# What `rounding=` takes.
Rounding: TypeAlias = Literal["nearest", "stochastic"]
# The noise-scale sums, or optax.EmptyState() when not tracked.
Noise: TypeAlias = NoiseScaleState | optax.EmptyState
# A tree of types (jax.ShapeDtypeStruct leaves, from jax.eval_shape).
Types: TypeAlias = Any


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


class Cycle(NamedTuple):
  """The cycle after this call's micro-batch was added: what ends read."""

  acc: optax.Updates  # the (device-local) sum
  weight: jax.Array  # float32[]: its (device-local) total weight
  micro_step: jax.Array  # int32[]: micro-batches accepted in it
  ends: jax.Array  # bool[]: this call ends the cycle
  noise: Noise  # NoiseScaleState, or optax.EmptyState() when not tracked
  inner_state: optax.OptState
  params: optax.Params | None  # as given to update, or None


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
