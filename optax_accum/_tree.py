"""Tree helpers shared by `accumulate` and `microbatch`: one weighted add,
one select, zeros of a type."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

INT32_MAX = int(np.iinfo(np.int32).max)


def compute_dtype(acc_dtype: Any) -> Any:
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
  ops: Any,
  weight: jax.Array | None = None,
  keep: jax.Array | None = None,
) -> jax.Array:
  """``acc + keep * weight * value``, computed in :func:`compute_dtype`.

  Every select sits on the term's side, with a scalar predicate: compiled
  for GPU, XLA then fuses the add into the GEMM that makes `value` (it
  fuses ``acc + f(dot)`` where `acc` is a parameter of the step, not
  ``f(acc) + dot``). Where `keep` is false the term is exact zeros, even if
  `value` is NaN or Inf: the 0/0 per-token mean of an all-padding
  micro-batch counts for nothing rather than poisoning the sum.

  Args:
    acc: The sum so far; the result has its dtype.
    value: The term to add.
    ops: Where `scale`, `select` and `zero` come from (an engine of
      :mod:`optax_accum._engines`: unreduced arrays need their own forms).
    weight: A scalar to multiply `value` by, or None.
    keep: A scalar bool: whether the term counts, or None (always).
  """
  compute = compute_dtype(acc.dtype)
  term = jnp.asarray(value).astype(compute)
  if weight is not None:
    term = ops.scale(term, weight)
  if keep is not None:
    term = ops.select(keep, term, ops.zero(term))
  return (acc.astype(compute) + term).astype(acc.dtype)


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
