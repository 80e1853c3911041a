"""Varying manual axes inside ``shard_map``, across JAX versions.

Inside ``jax.shard_map`` with ``check_vma=True`` (the default) every value's
type records the mesh axes it varies over. A ``psum`` removes the axis from
the type, so the two branches of a conditional that reduces in one branch
only would disagree on types. These helpers read and widen that set; outside
``shard_map`` (and under ``vmap``) every value varies over no axis and they
change nothing.
"""

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def axis_names(axis_name: Hashable) -> frozenset:
  """The axis names in `axis_name` (one name or a tuple of names)."""
  return frozenset(axis_name if isinstance(axis_name, tuple) else (axis_name,))


def varying_axes(aval: Any) -> frozenset:
  """Manual mesh axes a value of type `aval` varies over; empty outside."""
  # jax >= 0.9: `mat` on avals, `manual_axis_type` on ShapeDtypeStruct;
  # older jax: `vma`.
  mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def vary_over(x: Any, axes: frozenset) -> Any:
  """Marks `x` as varying over `axes` (a no-op on the values)."""
  missing = tuple(sorted(axes - varying_axes(jax.typeof(x)), key=str))
  if not missing:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, missing, to="varying")
  return lax.pvary(x, missing)  # older jax


def switch(index: Any, branches: Sequence[Callable], *operands: Any):
  """``lax.switch`` whose branches may differ in the axes their outputs vary
  over.

  Each output is marked as varying over the union of the branches' axes.
  When no operand varies (outside ``shard_map``, under ``vmap``) this is
  plain ``lax.switch`` and the branches are not traced twice.
  """
  if not any(varying_axes(jax.typeof(x)) for x in jax.tree.leaves(operands)):
    return lax.switch(index, branches, *operands)
  out_types = [jax.eval_shape(f, *operands) for f in branches]
  axes = jax.tree.map(
    lambda *types: frozenset().union(*map(varying_axes, types)), *out_types
  )

  def unify(fun: Callable) -> Callable:
    def unified(*args: Any) -> Any:
      return jax.tree.map(vary_over, fun(*args), axes)

    return unified

  return lax.switch(index, [unify(f) for f in branches], *operands)


def cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any):
  """``lax.cond`` that compilers keep, and that may vary its outputs as
  :func:`switch` does.

  Lowered as ``lax.switch`` on an ``int32`` index with `false_fun` as HLO
  branch 0, for two reasons seen in XLA:GPU. A ``lax.cond`` index is
  ``convert(pred)``, which the algebraic simplifier folds back into a
  predicate; the conditional simplifier then inlines a predicate
  conditional whose branches are all elementwise into selects, so both
  branches run on every call (an optimizer on every micro-step). And a
  pass-through branch that is not branch 0 makes copy insertion copy the
  operands it passes through. The clamp ``lax.switch`` puts on its index
  keeps it an integer, and the holding branch stays branch 0.
  """
  index = jnp.asarray(pred).astype(jnp.int32)
  return switch(index, (false_fun, true_fun), *operands)


def varies_over(tree: Any, axis_name: Hashable) -> bool:
  """Whether any leaf of `tree` varies over an axis of `axis_name`."""
  names = axis_names(axis_name)
  return any(names & varying_axes(jax.typeof(x)) for x in jax.tree.leaves(tree))
