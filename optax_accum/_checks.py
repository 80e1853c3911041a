"""Construction-time argument checks shared by the public factories.

Each raises a `TypeError` or `ValueError` whose message names the argument in
backticks and shows the value received.
"""

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def positive_int(value: Any, name: str, hint: str = "") -> int:
  """Returns `value` as a Python int >= 1 (NumPy/JAX integer scalars too).

  Args:
    value: What the user passed.
    name: The argument's name, for the message.
    hint: Appended to the type error, e.g. what else the argument accepts.
  """
  is_int_array = (
    isinstance(value, (np.ndarray, np.generic, jax.Array))
    and np.ndim(value) == 0
    and np.issubdtype(np.asarray(value).dtype, np.integer)
  )
  if isinstance(value, bool) or not (isinstance(value, int) or is_int_array):
    raise TypeError(
      f"`{name}` must be a positive integer{hint}, got {value!r} of type"
      f" {type(value).__name__}."
    )
  try:
    number = operator.index(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(
      f"`{name}` must be a concrete integer, got a traced value {value!r}."
    ) from e
  if number < 1:
    raise ValueError(f"`{name}` must be >= 1, got {number}.")
  return number


def accumulator_dtype(value: Any) -> Any:
  """Returns `value` as a floating (or complex) dtype, or None."""
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise TypeError(
      f"`accumulator_dtype` must be a floating dtype or None, got {value!r}."
    ) from e
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(
      f"`accumulator_dtype` must be a floating dtype or None, got {dtype}."
    )
  return dtype


def boolean(value: Any, name: str) -> bool:
  """Returns `value` as a Python bool; only bools (NumPy's too) pass."""
  if not isinstance(value, bool | np.bool_):
    raise TypeError(
      f"`{name}` must be True or False, got {value!r} of type"
      f" {type(value).__name__}."
    )
  return bool(value)


def _complex_of(dtype: Any) -> Any:
  """The complex dtype whose parts have at least `dtype`'s precision."""
  return jnp.dtype(
    jnp.complex128 if jnp.dtype(dtype).itemsize >= 8 else jnp.complex64
  )


def leaf_accumulator_dtype(accumulator_dtype: Any, leaf_dtype: Any) -> Any:
  """The accumulator dtype of one leaf: never drops an imaginary part.

  Raises:
    ValueError: For a complex `accumulator_dtype` and a real leaf (an
      accumulator that could only ever hold a zero imaginary part).
  """
  if accumulator_dtype is None:
    return jnp.dtype(leaf_dtype)
  leaf_is_complex = jnp.issubdtype(leaf_dtype, jnp.complexfloating)
  if jnp.issubdtype(accumulator_dtype, jnp.complexfloating):
    if not leaf_is_complex:
      raise ValueError(
        f"`accumulator_dtype` is complex ({jnp.dtype(accumulator_dtype)})"
        f" but a gradient leaf is real ({jnp.dtype(leaf_dtype)}); complex"
        " gradient leaves get a complex accumulator by themselves, so pass"
        " a real dtype."
      )
    return jnp.dtype(accumulator_dtype)
  if leaf_is_complex:
    return _complex_of(accumulator_dtype)
  return jnp.dtype(accumulator_dtype)


def real_scalar(value: Any, subject: str, what: str = "") -> jax.Array:
  """`value` as a 0-d integer or floating array; raises naming `subject`.

  Args:
    value: What the user passed (or a schedule returned).
    subject: The start of the message, e.g. "`weight` must be".
    what: What one value means, for the message.
  """
  if value is None or isinstance(value, str | bytes):
    raise TypeError(f"{subject} a real number{what}, got {value!r}.")
  try:
    x = jnp.asarray(value)
  except (TypeError, ValueError) as e:  # a dict, an arbitrary object
    raise TypeError(
      f"{subject} a real number{what}, got {value!r} of type"
      f" {type(value).__name__}."
    ) from e
  if x.ndim != 0:
    raise ValueError(f"{subject} a scalar{what}, got shape {x.shape}.")
  if not (
    jnp.issubdtype(x.dtype, jnp.integer)
    or jnp.issubdtype(x.dtype, jnp.floating)
  ):
    raise TypeError(f"{subject} a real number, got a value of dtype {x.dtype}.")
  return x


def is_traced(tree: Any) -> bool:
  """Whether any leaf of `tree` is a tracer (we are inside a transformation)."""
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))
