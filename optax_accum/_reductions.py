"""How each output leaf of :func:`optax_accum.microbatch` is reduced over
the micro-batches: one :class:`Reduction` record per kind (weighted mean,
sum, any, last), chosen once per leaf from its dtype by :func:`leaves_of`, and
the checks of the output's structure.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _checks
from optax_accum._accumulate import add_term, compute_dtype
from optax_accum._records import zeros_like_type


class Total(NamedTuple):
  """What a weighted mean divides by, known after the scan."""

  # Named as tuple's method (see NoiseScaleState.count in _state.py).
  count: int  # type: ignore[assignment]  # num_microbatches: the divisor without `weight_fn`.
  weighted: bool  # Whether `weight_fn` was given.
  positive: jax.Array  # bool[]: the total weight is > 0.
  safe_weight: jax.Array  # f32[]: the total weight, 1 where not positive.


class Reduction(NamedTuple):
  """How one output leaf is reduced over the micro-batches.

  Attributes:
    init: ``init(shape, dtype)``, the scan carry before micro-batch 0 (None
      for a leaf that is not carried).
    update: ``update(acc, value, weight) -> (acc, scanned)``: the new carry
      and what this micro-batch adds to the scan's outputs (None: nothing).
    finalize: ``finalize(acc, scanned, shape, total)``, the result, where
      ``scanned`` is stacked over the micro-batches.
  """

  init: Callable[[jax.ShapeDtypeStruct, Any], Any]
  update: Callable[[Any, Any, jax.Array | None], tuple[Any, Any]]
  finalize: Callable[[Any, Any, jax.ShapeDtypeStruct, Total], Any]


def _not_carried(shape: jax.ShapeDtypeStruct, dtype: Any) -> None:
  # The last values are scan outputs (an extended dtype such as a PRNG key
  # has no zeros to start a carry from); float0 is always zeros.
  del shape, dtype


def _add_weighted(acc: jax.Array, value: Any, weight: Any) -> tuple:
  keep = None if weight is None else weight != 0
  added = add_term(acc, value, weight=weight, keep=keep)
  return added, None


def _weighted_mean(acc: jax.Array, scanned: Any, shape: Any, total: Total):
  del scanned
  compute = compute_dtype(acc.dtype)
  acc = acc.astype(compute)
  if total.weighted:
    mean = jnp.where(total.positive, acc / total.safe_weight.astype(compute), 0)
  else:
    mean = acc / total.count
  return mean.astype(shape.dtype)


def _the_carry(acc: Any, scanned: Any, shape: Any, total: Total) -> Any:
  del scanned, shape, total
  return acc


# Floating leaves (the loss, gradients, floating aux): the weighted mean.
_MEAN = Reduction(zeros_like_type, _add_weighted, _weighted_mean)
# Integer aux leaves (counts): the sum.
_SUM = Reduction(
  zeros_like_type, lambda acc, value, _: (acc + value, None), _the_carry
)
# Boolean aux leaves (flags): logical or.
_ANY = Reduction(
  zeros_like_type, lambda acc, value, _: (acc | value, None), _the_carry
)
# PRNG keys and other extended dtypes: the last micro-batch's value.
_LAST = Reduction(
  _not_carried,
  lambda acc, value, _: (None, value),
  lambda acc, scanned, shape, total: scanned[-1],
)
# `jax.grad(..., allow_int=True)`'s float0 zeros for integer arguments.
_FLOAT0 = Reduction(
  _not_carried,
  lambda acc, value, _: (None, None),
  lambda acc, scanned, shape, total: np.zeros(shape.shape, jax.dtypes.float0),
)


def _reduction(dtype: Any) -> Reduction:
  if dtype == jax.dtypes.float0:
    return _FLOAT0
  if jnp.issubdtype(dtype, jnp.inexact):
    return _MEAN
  if jnp.issubdtype(dtype, jnp.integer):
    return _SUM
  if jnp.issubdtype(dtype, jnp.bool_):
    return _ANY
  return _LAST


class Leaf(NamedTuple):
  """One output leaf: its reduction, carry dtype and output shape."""

  reduction: Reduction
  dtype: Any
  shape: jax.ShapeDtypeStruct


def leaves_of(out_shape: Any, accumulator_dtype: Any) -> list[Leaf]:
  """The `Leaf` of every leaf of `out_shape`, in `jax.tree.leaves` order.

  The value's leaves (loss, aux) come first, then the gradient's: floating
  value leaves are summed in at least float32, floating gradient leaves in
  `accumulator_dtype`, other leaves in their own dtype.
  """
  leaves = []
  for shape in jax.tree.leaves(out_shape[0]):
    reduction, dtype = _reduction(shape.dtype), shape.dtype
    if reduction is _MEAN:
      dtype = compute_dtype(dtype)
    leaves.append(Leaf(reduction, dtype, shape))
  for path, shape in jax.tree_util.tree_flatten_with_path(out_shape[1])[0]:
    reduction, dtype = _reduction(shape.dtype), shape.dtype
    if reduction is _MEAN:
      try:
        dtype = _checks.leaf_accumulator_dtype(accumulator_dtype, dtype)
      except ValueError as e:
        name = "grads" + jax.tree_util.keystr(path)
        raise ValueError(f"{e} The leaf: {name}.") from e
    leaves.append(Leaf(reduction, dtype, shape))
  return leaves


_USE_VALUE_AND_GRAD = (
  " A gradient function such as `jax.grad(loss_fn)` returns no value: pass"
  " `jax.value_and_grad(loss_fn)`."
)


def _shaped_like(tree: Any, structure: Any, shapes: list) -> bool:
  """Whether `tree` has the tree `structure` and leaf `shapes`."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef == structure and [np.shape(x) for x in leaves] == shapes


def _check_not_a_gradient_function(out: Any, params: Any, micro: Any) -> None:
  """Raises if `out` looks like ``jax.grad(f, argnums=(0, 1))(params,
  micro)``: gradients w.r.t. the params and the micro-batch, whose first
  one passes for a loss when the params are a scalar.

  The output of ``jax.value_and_grad(f)`` never does: its second output is
  shaped like the params and a micro-batch leaf is never a scalar.
  """
  leaves, params_def = jax.tree.flatten(params)
  params_shapes = [np.shape(x) for x in leaves]
  micro_def = jax.tree.structure(micro)
  micro_shapes = [x.shape for x in jax.tree.leaves(micro)]
  value = out[0]
  has_aux = isinstance(value, tuple | list) and len(value) == 2
  # jax.grad(f, argnums=(0, 1), has_aux=True) gives ((g_params, g_micro), aux).
  pair = value if has_aux else out
  if (
    _shaped_like(pair[0], params_def, params_shapes)
    and _shaped_like(pair[1], micro_def, micro_shapes)
    and not _shaped_like(out[1], params_def, params_shapes)
  ):
    raise TypeError(
      "`value_and_grad_fn` must return `(value, grads)` like"
      " `jax.value_and_grad`, but its output is shaped like gradients with"
      " respect to the params (argument 0) and the micro-batch (argument"
      " 1), as from `jax.grad(loss_fn, argnums=(0, 1))`; microbatch"
      " reduces gradients with respect to the params, never the batch."
      + _USE_VALUE_AND_GRAD
    )


def check_output(out: Any, params: Any = None, micro: Any = None) -> None:
  """Raises unless `out` (shapes) looks like `jax.value_and_grad`'s output.

  Args:
    params, micro: The shapes of argument 0 and of one micro-batch, to tell
      a gradient function's output apart (None: not checked).
  """
  if not (isinstance(out, tuple | list) and len(out) == 2):
    raise TypeError(
      "`value_and_grad_fn` must return `(value, grads)` like"
      " `jax.value_and_grad`, got an output of type"
      f" {type(out).__name__}." + _USE_VALUE_AND_GRAD
    )
  value = out[0]
  has_aux = isinstance(value, tuple | list) and len(value) == 2
  loss = value[0] if has_aux else value
  if not (isinstance(loss, jax.ShapeDtypeStruct) and loss.shape == ()):
    raise TypeError(
      "`value_and_grad_fn` must return `(loss, grads)` or"
      " `((loss, aux), grads)` with a scalar loss, like"
      " `jax.value_and_grad(loss_fn, has_aux=...)`; got a value of"
      f" {jax.tree.map(lambda s: (s.shape, s.dtype), value)}."
      + _USE_VALUE_AND_GRAD
    )
  if micro is not None:
    _check_not_a_gradient_function(out, params, micro)
