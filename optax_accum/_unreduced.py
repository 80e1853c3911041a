"""Gradients left unreduced over a data axis under plain ``jax.jit``.

JAX's explicit sharding mode types an array as ``unreduced`` over a mesh axis
when each device holds a partial sum and the value is their sum, not yet
computed. Gradient accumulation wants exactly that: add each device's local
gradient into a local accumulator on every micro-step, and sum over devices
once per optimizer step. This module holds the pieces:

* :func:`unreduced_zeros_like`, :func:`where`, :func:`scale`,
  :func:`all_finite` and :func:`reduce` are the few operations an
  accumulator needs, written with the ops JAX allows on unreduced arrays
  (linear ones: add, multiply by a ``reduced`` scalar, select);
* :func:`is_unreduced`, :func:`check_supported`, :func:`check_explicit_axis`
  and :func:`check_unreduced` raise errors that say what to change.

:func:`optax_accum.distributed.local_value_and_grad` makes such gradients
for any loss.

Rules of the type system that shape the code (jax 0.10.2): an eager op on an
unreduced array other than ``+`` fails (``device_indices_map doesn't work
with unreduced``); a product needs its other operand ``reduced`` over the
axis; ``neg``, ``sub``, ``abs`` and ``is_finite`` have no unreduced rule;
``shard_map`` returns unreduced outputs only in full manual mode, and inside
it an unreduced input cannot be made varying again.
"""

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _versions
from optax_accum._checks import spec_of, unreduced_axes
from optax_accum._control import axis_tuple

AxisName = Hashable


# ----------------------------------------------------------------------------
# Capability and argument checks.
# ----------------------------------------------------------------------------


def is_supported() -> bool:
  """Whether the installed JAX has ``reduced``/``unreduced`` shardings with
  the rules an accumulator needs.

  jax 0.8.2 to 0.10.1 have the names (``jax.reshard``, ``lax.pcast``,
  ``PartitionSpec(unreduced=...)``) but not every rule: 0.10.1 has no
  unreduced rule for ``select_n`` (``jnp.where``, :func:`where`) and raises
  ``NotImplementedError``. So the release decides, and the names are
  checked too (a JAX that moved one fails here, not mid-trace).
  """
  return (
    _versions.jax_at_least(_versions.UNREDUCED_JAX)
    and hasattr(jax.sharding, "AxisType")
    and hasattr(jax, "reshard")
    and hasattr(jax, "shard_map")
    and hasattr(lax, "pcast")
  )


def check_supported() -> None:
  """Raises a RuntimeError if the installed JAX lacks unreduced shardings."""
  if not is_supported():
    raise RuntimeError(
      "Deferred reduction under plain `jax.jit` (`axis_name=` an explicit"
      " mesh axis outside `jax.shard_map`, gradients typed unreduced,"
      " `optax_accum.distributed.local_value_and_grad`) needs"
      f" jax>={_versions.UNREDUCED_JAX} (installed {jax.__version__}): it needs"
      " `reduced`/`unreduced` PartitionSpecs with their rules for"
      " `jnp.where`, `jax.reshard` and `lax.pcast`. Upgrade jax, or use"
      " `axis_name=` inside `jax.shard_map` instead."
    )


def check_explicit_axis(axis_name: AxisName = "data", mesh: Any = None) -> Any:
  """Returns the mesh, checking that `axis_name` is an explicit axis of it.

  Args:
    axis_name: A mesh axis name, or a tuple of them.
    mesh: A ``Mesh`` or ``AbstractMesh``; by default the one set with
      ``jax.set_mesh``.

  Returns:
    The mesh.

  Raises:
    RuntimeError: If JAX lacks the feature (see :func:`check_supported`).
    ValueError: If there is no mesh, or an axis is missing or not
      ``AxisType.Explicit``.
  """
  check_supported()
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    raise ValueError(
      f"`axis_name`={axis_name!r} needs a mesh: enter one with"
      " `jax.set_mesh(mesh)` (a context manager, or call it once) around"
      " the jitted step and the init, got no mesh."
    )
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  for axis in axis_tuple(axis_name):
    if axis not in types:
      raise ValueError(
        f"`axis_name`={axis_name!r} names an axis the mesh lacks; its axes"
        f" are {mesh.axis_names}."
      )
    if types[axis] != jax.sharding.AxisType.Explicit:
      raise ValueError(
        f"`axis_name`={axis_name!r}: mesh axis {axis!r} is of type"
        f" {types[axis]}, but an unreduced gradient needs"
        " `AxisType.Explicit`; build the mesh with e.g."
        f" `jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,"
        " ...))`."
      )
  return mesh


def partitions(spec: P) -> tuple:
  """The per-dimension entries of `spec` (``*spec`` is refused once it has
  unreduced or reduced axes)."""
  return tuple(getattr(spec, "partitions", spec))


def is_unreduced(x: Any, axis_name: AxisName = "data") -> bool:
  """Whether `x` is typed unreduced over every axis of `axis_name`.

  Works on arrays, tracers under ``jit`` and ``jax.ShapeDtypeStruct``.
  """
  return set(axis_tuple(axis_name)) <= set(unreduced_axes(x))


def check_unreduced(
  tree: Any, axis_name: AxisName = "data", name: str = "updates"
) -> None:
  """Raises a ValueError naming the first leaf not unreduced over the axis."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not is_unreduced(leaf, axis_name):
      where_ = jax.tree_util.keystr(path) or "<root>"
      raise ValueError(
        f"`{name}` must be typed unreduced over {axis_name!r} (each"
        " device's local gradient, not yet summed), but leaf"
        f" {where_} has type {jax.typeof(leaf)}. Make them with"
        " `optax_accum.distributed.local_value_and_grad`, or take `jax.grad` with"
        f" respect to params resharded to `P(..., reduced={{{axis_name!r}}})`."
      )


# ----------------------------------------------------------------------------
# Operations on unreduced values.
# ----------------------------------------------------------------------------


def without_axes(spec: P, axes: tuple) -> tuple:
  """The partitions of `spec` with every axis of `axes` removed."""

  def drop(entry):
    if entry is None:
      return None
    kept = tuple(a for a in axis_tuple(entry) if a not in axes)
    if not kept:
      return None
    return kept if isinstance(entry, tuple) else kept[0]

  return tuple(drop(e) for e in partitions(spec))


def unreduced_spec(x: Any, axis_name: AxisName = "data") -> P:
  """The spec of an accumulator for `x`: `x`'s own sharding over the other
  mesh axes, unreduced over `axis_name` (and not sharded over it: a param
  sharded over the data axis, FSDP-style, gets a full-size accumulator)."""
  spec = spec_of(x)
  axes = axis_tuple(axis_name)
  return P(
    *without_axes(spec, axes),
    unreduced=frozenset(spec.unreduced) | frozenset(axes),
    reduced=frozenset(spec.reduced) - frozenset(axes),
  )


def unreduced_zeros_like(
  x: Any, axis_name: AxisName = "data", dtype: Any = None
) -> jax.Array:
  """Zeros shaped like `x`, typed unreduced over `axis_name`.

  Works eagerly (on a committed array, with or without ``jax.set_mesh``) and
  under ``jit`` (with the mesh set by ``jax.set_mesh``). The zeros keep
  `x`'s sharding over the other mesh axes; see :func:`unreduced_spec`.
  """
  dtype = jnp.result_type(x) if dtype is None else dtype
  spec = unreduced_spec(x, axis_name)
  sharding = getattr(x, "sharding", None)
  if (
    isinstance(sharding, NamedSharding)
    and isinstance(sharding.mesh, jax.sharding.Mesh)
    and not isinstance(x, jax.core.Tracer)
    and jax.sharding.get_abstract_mesh().empty
  ):
    # Eager, no mesh context: unreduced zeros need one; use the array's.
    with jax.set_mesh(sharding.mesh):
      return jnp.zeros(jnp.shape(x), dtype, out_sharding=spec)
  return jnp.zeros(jnp.shape(x), dtype, out_sharding=spec)


def unreduced_like(x: Any, like: Any, axis_name: AxisName = "data") -> Any:
  """`x`, replicated over `axis_name`, typed as the unreduced `like`: no
  communication (one device holds `x`, the others zeros, so the sum is
  `x`). None where `x` is sharded over `axis_name` (FSDP), whose devices
  then hold other shapes than `like`'s."""
  axes = set(axis_tuple(axis_name))
  for entry in partitions(spec_of(x)):
    if entry is not None and axes & set(axis_tuple(entry)):
      return None
  return jax.reshard(x, spec_of(like))


def reduced_spec(x: Any, axis_name: AxisName = "data") -> P:
  """The spec of `x` summed over `axis_name`: unreduced no more, same
  sharding over the other mesh axes, replicated over `axis_name`."""
  spec = spec_of(x)
  return P(
    *partitions(spec),
    unreduced=frozenset(spec.unreduced) - frozenset(axis_tuple(axis_name)),
    reduced=spec.reduced,
  )


def to_reduced(x: Any, axis_name: AxisName = "data") -> jax.Array:
  """A replicated value, typed ``reduced`` over `axis_name` (no
  communication), so that it may multiply or select unreduced arrays."""
  x = jnp.asarray(x)
  spec = spec_of(x)
  return jax.reshard(
    x,
    P(
      *partitions(spec),
      unreduced=spec.unreduced,
      reduced=frozenset(spec.reduced) | frozenset(axis_tuple(axis_name)),
    ),
  )


def scale(x: jax.Array, factor: Any, axis_name: AxisName = "data") -> Any:
  """``x * factor`` for an unreduced `x` and a replicated scalar `factor`."""
  return x * to_reduced(jnp.asarray(factor, x.dtype), axis_name)


def where(
  pred: Any, on_true: Any, on_false: Any, axis_name: AxisName = "data"
) -> Any:
  """``jnp.where`` with a replicated scalar `pred` between unreduced arrays.

  Use ``unreduced_zeros_like`` or ``jnp.zeros_like(u)`` (which stays
  unreduced under ``jit``) for a zero branch: a plain ``0`` is not unreduced
  and is refused. A select, so a NaN in the branch not taken is dropped.
  """
  return jnp.where(to_reduced(pred, axis_name), on_true, on_false)


def all_finite(tree: Any, axis_name: AxisName = "data") -> jax.Array:
  """Whether every element of every device's partial sum is finite.

  One scalar all-reduce: :math:`\\sum_d \\sum_i 0 \\cdot x_{d,i}` is 0 when
  all are finite and NaN otherwise (``is_finite`` has no unreduced rule).
  Unlike a test on the reduced sum, finite partial sums whose total would
  overflow count as finite. Returns a replicated ``bool[]``.
  """
  total = jnp.zeros([], jnp.float32)
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  terms = [
    jnp.sum(scale(x.astype(jnp.float32), 0.0, axis_name)) for x in leaves
  ]
  total = terms[0]
  for t in terms[1:]:
    total = total + t
  return jnp.isfinite(jax.reshard(total, P()))


def reduce(
  tree: Any, axis_name: AxisName = "data", out_specs: Any = None
) -> Any:
  """Sums unreduced values over `axis_name`: the one all-reduce.

  Args:
    tree: Arrays typed unreduced over `axis_name`.
    axis_name: The data axis.
    out_specs: ``PartitionSpec``\\s (a tree prefix of `tree`) for the
      results, e.g. the params' specs so that an FSDP accumulator is
      reduce-scattered back to its param's layout. By default each leaf keeps
      its sharding over the other axes and is replicated over `axis_name`.

  Returns:
    `tree`, summed over the devices of `axis_name`.
  """
  if out_specs is None:
    out_specs = jax.tree.map(lambda x: reduced_spec(x, axis_name), tree)
  return jax.reshard(tree, out_specs)
