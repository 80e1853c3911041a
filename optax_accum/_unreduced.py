"""Gradients left unreduced over a data axis under plain ``jax.jit``.

JAX's explicit sharding mode types an array as ``unreduced`` over a mesh axis
when each device holds a partial sum and the value is their sum, not yet
computed. Gradient accumulation wants exactly that: add each device's local
gradient into a local accumulator on every micro-step, and sum over devices
once per optimizer step. This module holds the pieces:

* :func:`local_value_and_grad` turns a loss into one returning each device's
  local gradient typed unreduced over the data axis, for any model;
* :func:`unreduced_zeros_like`, :func:`where`, :func:`scale`,
  :func:`all_finite` and :func:`reduce` are the few operations an
  accumulator needs, written with the ops JAX allows on unreduced arrays
  (linear ones: add, multiply by a ``reduced`` scalar, select);
* :func:`is_unreduced`, :func:`check_supported`, :func:`check_explicit_axis`
  and :func:`check_unreduced` raise errors that say what to change.

Rules of the type system that shape the code (jax 0.10.2): an eager op on an
unreduced array other than ``+`` fails (``device_indices_map doesn't work
with unreduced``); a product needs its other operand ``reduced`` over the
axis; ``neg``, ``sub``, ``abs`` and ``is_finite`` have no unreduced rule;
``shard_map`` returns unreduced outputs only in full manual mode, and inside
it an unreduced input cannot be made varying again.
"""

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _checks, _noise_scale

AxisName = Hashable


# ----------------------------------------------------------------------------
# Capability and argument checks.
# ----------------------------------------------------------------------------


def is_supported() -> bool:
  """Whether the installed JAX has ``reduced``/``unreduced`` shardings."""
  return (
    hasattr(jax.sharding, "AxisType")
    and hasattr(jax, "reshard")
    and hasattr(jax, "shard_map")
    and hasattr(lax, "pcast")
    and "unreduced" in inspect.signature(P).parameters
  )


def check_supported() -> None:
  """Raises a RuntimeError if the installed JAX lacks unreduced shardings."""
  if not is_supported():
    raise RuntimeError(
      "Deferred reduction under plain `jax.jit` needs JAX's explicit"
      " sharding with `reduced`/`unreduced` PartitionSpecs,"
      " `jax.reshard`, `jax.shard_map` and `lax.pcast`; the installed jax"
      f" {jax.__version__} lacks them (they are in jax 0.10.2). Upgrade"
      " jax, or use `axis_name=` inside `jax.shard_map` instead."
    )


def _axes(axis_name: AxisName) -> tuple:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


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
  for axis in _axes(axis_name):
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


def spec_of(x: Any) -> P:
  """The PartitionSpec in the type of an array, tracer or ShapeDtypeStruct."""
  sharding = getattr(x, "sharding", None)
  if isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "aval"):
    return getattr(sharding, "spec", P())
  return getattr(jax.typeof(x).sharding, "spec", P())


def _parts(spec: P) -> tuple:
  """The per-dimension entries of `spec` (``*spec`` is refused once it has
  unreduced or reduced axes)."""
  return tuple(getattr(spec, "partitions", spec))


def unreduced_axes(x: Any) -> tuple:
  """The mesh axes `x` is typed unreduced over, sorted; ``()`` if none.

  Works on arrays, tracers under ``jit`` and ``jax.ShapeDtypeStruct``.
  """
  return tuple(sorted(getattr(spec_of(x), "unreduced", ())))


def is_unreduced(x: Any, axis_name: AxisName = "data") -> bool:
  """Whether `x` is typed unreduced over every axis of `axis_name`.

  Works on arrays, tracers under ``jit`` and ``jax.ShapeDtypeStruct``.
  """
  return set(_axes(axis_name)) <= set(unreduced_axes(x))


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
        " `optax_accum.local_value_and_grad`, or take `jax.grad` with"
        f" respect to params resharded to `P(..., reduced={{{axis_name!r}}})`."
      )


# ----------------------------------------------------------------------------
# Operations on unreduced values.
# ----------------------------------------------------------------------------


def _without(spec: P, axes: tuple) -> tuple:
  """The partitions of `spec` with every axis of `axes` removed."""

  def drop(entry):
    if entry is None:
      return None
    kept = tuple(a for a in _axes(entry) if a not in axes)
    if not kept:
      return None
    return kept if isinstance(entry, tuple) else kept[0]

  return tuple(drop(e) for e in _parts(spec))


def unreduced_spec(x: Any, axis_name: AxisName = "data") -> P:
  """The spec of an accumulator for `x`: `x`'s own sharding over the other
  mesh axes, unreduced over `axis_name` (and not sharded over it: a param
  sharded over the data axis, FSDP-style, gets a full-size accumulator)."""
  spec = spec_of(x)
  axes = _axes(axis_name)
  return P(
    *_without(spec, axes),
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
  axes = set(_axes(axis_name))
  for entry in _parts(spec_of(x)):
    if entry is not None and axes & set(_axes(entry)):
      return None
  return jax.reshard(x, spec_of(like))


def reduced_spec(x: Any, axis_name: AxisName = "data") -> P:
  """The spec of `x` summed over `axis_name`: unreduced no more, same
  sharding over the other mesh axes, replicated over `axis_name`."""
  spec = spec_of(x)
  return P(
    *_parts(spec),
    unreduced=frozenset(spec.unreduced) - frozenset(_axes(axis_name)),
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
      *_parts(spec),
      unreduced=spec.unreduced,
      reduced=frozenset(spec.reduced) | frozenset(_axes(axis_name)),
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


def from_per_device(stacked: Any, axis_name: AxisName = "data") -> Any:
  """Arrays ``(n, *shape)`` sharded over `axis_name` on their leading axis,
  one slot per device, to ``shape`` typed unreduced: no communication.

  ``shard_map`` returns unreduced outputs only in full manual mode; this
  contraction with ones works with params sharded over other mesh axes
  (tensor parallel), which then keep their sharding.
  """

  def one(s):
    parts = _parts(spec_of(s))[1:]
    parts += (None,) * (s.ndim - 1 - len(parts))
    out = P(*parts, unreduced=frozenset(_axes(axis_name)))
    ones = jnp.ones(s.shape[:1], s.dtype, out_sharding=P(axis_name))
    return jnp.einsum(
      "d,d...->...",
      ones,
      s,
      out_sharding=out,
      precision=lax.Precision.HIGHEST,
      preferred_element_type=s.dtype,
    )

  return jax.tree.map(one, stacked)


# ----------------------------------------------------------------------------
# The gradient helper.
# ----------------------------------------------------------------------------


def local_value_and_grad(
  fun: Callable[..., Any],
  *,
  axis_name: AxisName = "data",
  has_weight: bool = False,
  has_aux: bool = False,
  in_specs: Sequence[Any] | None = None,
  noise_stats: bool = False,
) -> Callable[..., Any]:
  r"""Like ``jax.value_and_grad(fun)``, but each device's gradient is left
  unreduced over `axis_name`: no communication of parameter size.

  Call the result under ``jax.jit`` with a mesh set by ``jax.set_mesh`` whose
  `axis_name` axis is ``AxisType.Explicit``, params replicated over that axis
  (or sharded over it, FSDP-style: they are all-gathered first) and the
  batch split over it on its leading axis. Inside, ``fun(params, *args)``
  runs once per device on that device's share of every argument after
  ``params`` (in global view over the other mesh axes, so a tensor-parallel
  model runs unchanged). What `fun` returns:

  * ``loss``: the mean of the loss over the device's examples. Devices
    count equally, so the result is the big-batch mean when every device
    gets the same number of examples;
  * with ``has_weight=True``, ``(loss, weight)``: the mean over the
    device's tokens and their number :math:`n_d` (e.g. ``mask.sum()``),
    which may differ between devices; a device with :math:`n_d = 0`
    contributes nothing, even if its mean is the NaN of 0/0;
  * with ``has_aux=True``, ``(that, aux)``.

  The gradient returned on device :math:`d` is
  :math:`\frac{n_d}{N} \nabla \ell_d` with :math:`N = \sum_d n_d` (and
  :math:`n_d = 1` without weights), so that summed over devices it is the
  gradient of the big-batch weighted mean :math:`\sum_d n_d \ell_d / N`:
  exactly the gradient ``jax.grad`` would give of the global mean loss. Hand
  it with ``weight=N`` (the returned weight) to an accumulator: with
  per-micro-batch weights :math:`N_i` the accumulated
  :math:`\sum_i N_i g_i / \sum_i N_i` is the per-token mean over all
  micro-batches and devices.

  Args:
    fun: ``fun(params, *args)``, see above.
    axis_name: The data axis of the mesh (a name or a tuple of names).
    has_weight: Whether `fun` returns ``(loss, weight)``.
    has_aux: Whether `fun` returns ``(value, aux)``.
    in_specs: PartitionSpecs (over `axis_name` only) of the arguments after
      ``params``, one prefix per argument; by default each is split over
      `axis_name` on its leading axis. Use ``P()`` for an argument every
      device gets whole (a step count, a shared key).
    noise_stats: Whether to also return the
      :class:`~optax_accum.NoiseStats` of the micro-batch, for
      ``accumulate(..., track_noise_scale=True)``: each device measures
      :math:`n_d |\nabla \ell_d|^2`, a pass over its gradient, and the
      sums join the loss's all-reduce.

  Returns:
    ``value_and_grad(params, *args) -> (value, grads)``, where `value` has
    the structure `fun` returns: the loss is the global (weighted) mean and
    the weight is :math:`N`, both replicated; `aux` gets a leading axis with
    one entry per device, split over `axis_name`. `grads` has the structure
    and, over the other mesh axes, the sharding of `params`, typed unreduced
    over `axis_name`. One scalar all-reduce (loss and weight) is done.
    With ``noise_stats=True``, ``(value, grads, stats)``: pass ``stats`` on
    as ``update(..., noise_stats=stats)``. Called outside ``jit`` it runs
    itself under ``jax.jit`` (compiled once per argument types).

  Raises:
    RuntimeError, ValueError: When called, if JAX lacks unreduced shardings
      or the axis is missing or not explicit (see
      :func:`check_explicit_axis`).
  """
  if not callable(fun):
    raise TypeError(f"`fun` must be callable, got {fun!r}.")
  has_weight = _checks.boolean(has_weight, "has_weight")
  has_aux = _checks.boolean(has_aux, "has_aux")
  noise_stats = _checks.boolean(noise_stats, "noise_stats")
  axes = _axes(axis_name)

  def value_and_grad(params: Any, *args: Any) -> Any:
    check_explicit_axis(axis_name)
    # FSDP: a param sharded over the data axis is gathered (the forward
    # needs it whole); its gradient is then a full-size partial sum.
    params = jax.tree.map(
      lambda p: jax.reshard(p, P(*_without(spec_of(p), axes))), params
    )
    specs = (
      tuple(in_specs) if in_specs is not None else (P(axis_name),) * len(args)
    )
    if len(specs) != len(args):
      raise ValueError(
        f"`in_specs` must have one entry per argument after `params`,"
        f" got {len(specs)} for {len(args)} arguments."
      )

    def per_device(params, *args):
      params = jax.tree.map(
        lambda p: lax.pcast(p, axis_name, to="varying"), params
      )

      def split(params, *args):
        out = fun(params, *args)
        value, aux = out if has_aux else (out, None)
        loss, weight = value if has_weight else (value, 1.0)
        return loss, (weight, aux)

      (loss, (weight, aux)), grads = jax.value_and_grad(split, has_aux=True)(
        params, *args
      )
      weight = lax.stop_gradient(jnp.asarray(weight, jnp.float32))
      empty = weight == 0
      loss32 = jnp.where(empty, 0.0, jnp.asarray(loss, jnp.float32))
      sums = (weight * loss32, weight)
      if noise_stats:  # This device's share, measured before scaling.
        sq = jnp.where(empty, 0.0, weight * _noise_scale.sq_norm(grads))
        sums += (sq, jnp.where(empty, 0.0, 1.0))
      # Scalars only, in one all-reduce.
      loss_sum, total, *noise = lax.psum(sums, axis_name)
      share = jnp.where(
        total == 0, 0.0, weight / jnp.where(total == 0, 1, total)
      )
      grads = jax.tree.map(
        lambda g: jnp.where(
          empty, jnp.zeros_like(g), g * share.astype(g.dtype)
        )[None],
        grads,
      )
      mean_loss = jnp.where(
        total == 0, 0.0, loss_sum / jnp.where(total == 0, 1, total)
      )
      mean_loss = mean_loss.astype(jnp.result_type(loss))
      value = (mean_loss, total) if has_weight else mean_loss
      aux = jax.tree.map(lambda a: jnp.asarray(a)[None], aux)
      stats = None
      if noise_stats:
        sq_sum, count = noise
        stats = _noise_scale.NoiseStats(sq_sum, total, count.astype(jnp.int32))
      return (value, aux, stats), grads

    (value, aux, stats), stacked = jax.shard_map(
      per_device,
      in_specs=(P(),) + specs,
      out_specs=((P(), P(axis_name), P()), P(axis_name)),
      axis_names=frozenset(axes),
    )(params, *args)
    grads = from_per_device(stacked, axis_name)
    value = (value, aux) if has_aux else value
    if noise_stats:
      return value, grads, stats
    return value, grads

  jitted = jax.jit(value_and_grad)

  def call(params: Any, *args: Any) -> Any:
    if _checks.is_traced(params):
      return value_and_grad(params, *args)
    # Eagerly, shard_map would dispatch op by op on every device: the same
    # computation, compiled once.
    return jitted(params, *args)

  return call
