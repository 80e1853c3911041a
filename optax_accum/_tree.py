"""The weighted add shared by `accumulate` and `microbatch`."""

from typing import Any

import jax
import jax.numpy as jnp


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


def weighted_term(value: Any, weight: jax.Array | None, compute: Any) -> Any:
  """`value` in dtype `compute`, times `weight` when one is given.

  A weight of 0 gives exact zeros even where `value` is NaN or Inf: that is
  the 0/0 per-token mean of an all-padding micro-batch, which must count for
  nothing rather than poison the sum.
  """
  term = jnp.asarray(value).astype(compute)
  if weight is None:
    return term
  return jnp.where(weight == 0, 0, term * weight.astype(compute))
