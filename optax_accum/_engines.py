"""How an ``accumulate`` trace sums over devices: the engines of ``axis_name``.

Without ``axis_name`` a call never comes here: :class:`optax_accum._control.Local`
makes one device's sums with plain ``jnp``. With it, the engine is chosen
where ``init`` and ``update`` are traced (:func:`for_init`,
:func:`for_update`), once per trace; it overrides ``Local``'s methods and
adds those only a call with ``axis_name`` asks for (``reduce``,
``reduced_specs``, ``shares_buffer``):

* :class:`ShardMap`: ``axis_name`` is bound (inside ``jax.shard_map``,
  ``pmap`` or a named ``vmap``). Each device's accumulator is its own
  partial sum; devices agree on skips and flushes with ``pmin``/``pmax``,
  and the updating call sums with ``psum``.
* :class:`Unreduced`: ``axis_name`` is not bound but is an
  ``AxisType.Explicit`` axis of the mesh set with ``jax.set_mesh`` (plain
  ``jax.jit`` over a mesh). Gradients and accumulator are typed unreduced
  over the axis, its scalars are global already, and the updating call sums
  with one ``jax.reshard``. Unreduced arrays allow only linear operations,
  so its select, scale and finiteness test come from
  :mod:`optax_accum._unreduced`.
"""

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum import _control, _unreduced
from optax_accum._control import Local


@dataclasses.dataclass(frozen=True)
class ShardMap(Local):
  """``axis_name`` bound: ``psum`` once per cycle."""

  global_weight: ClassVar[bool] = False

  def device_index(self) -> jax.Array:
    return lax.axis_index(self.axis_name).astype(jnp.uint32)

  def agree(self, reduce: Callable, flag: jax.Array) -> jax.Array:
    """`flag` reduced with `reduce` (``lax.pmin``, ``lax.pmax``) over
    `axis_name` and every other manual axis it varies over (with
    ``check_vma=False``, where no value says, every manual axis of the
    mesh): replicas must agree on what is skipped and on when a cycle ends,
    and so must the devices that hold shards of one replica's gradient
    (HSDP)."""
    axes = set(_control.axis_tuple(self.axis_name))
    if _control.vma_checked():
      axes |= _control.varying_axes(jax.typeof(flag))
    else:  # no value says what it varies over: every manual axis
      axes |= _control.manual_axes()
    return reduce(flag.astype(jnp.int32), tuple(sorted(axes, key=str))) > 0

  def reduce(self, acc, scalars, *, per_leaf, specs):
    del specs
    leaves, treedef = jax.tree.flatten(acc)
    leaves, scalars = _control.psum_with_scalars(
      leaves, scalars, self.axis_name, per_leaf
    )
    return jax.tree.unflatten(treedef, leaves), scalars

  def reduced_specs(self, acc, params):
    del acc, params  # The sum's type has no layout in shard_map.
    return None

  def shares_buffer(self, acc):
    # Not with check_vma=True: the accumulator varies over the axis while
    # the updates, summed over it, do not, and one buffer cannot hold both
    # types.
    return not _control.varies_over(acc, self.axis_name)

  def cleared(self, cycle_ends, acc, total):
    # Zeros read from the reduced `total`, so that the sum can be reduced
    # in place of the accumulator (reading `acc` again keeps it alive, at
    # the cost of a copy of it); varying as the accumulator does.
    return jax.tree.map(
      lambda a, t: _control.vary_over(
        jnp.where(cycle_ends, jnp.zeros([], t.dtype), t),
        _control.varying_axes(jax.typeof(a)),
      ),
      acc,
      total,
    )

  def sample_axes(self):
    return self.axis_name


@dataclasses.dataclass(frozen=True)
class Unreduced(Local):
  """``axis_name`` an explicit mesh axis under plain ``jit``: one
  ``jax.reshard`` once per cycle."""

  runs_eagerly: ClassVar[bool] = False  # jax 0.10.2
  measures_noise: ClassVar[bool] = False

  def zero(self, x):
    return jnp.zeros_like(x)  # keeps the unreduced type under jit

  def select(self, pred, on_true, on_false):
    return _unreduced.where(pred, on_true, on_false, self.axis_name)

  def scale(self, x, factor):
    return _unreduced.scale(x, factor, self.axis_name)

  def all_finite(self, tree):
    # On every device: one scalar all-reduce.
    return _unreduced.all_finite(tree, self.axis_name)

  def zeros_like_param(self, param, dtype):
    return _unreduced.unreduced_zeros_like(param, self.axis_name, dtype)

  def device_index(self):
    # Rounding is not linear, and an unreduced array takes linear ops only.
    raise NotImplementedError(
      "`rounding='stochastic'` with gradients typed unreduced under plain"
      " jit (axis_name an explicit mesh axis) is not supported: each"
      " device's bfloat16 sum would be rounded, which an unreduced array"
      " cannot be. Accumulate inside shard_map (axis_name bound), or in"
      " float32."
    )

  def reduce(self, acc, scalars, *, per_leaf, specs):
    del per_leaf  # The weight and the noise sums are global already.
    return _unreduced.reduce(acc, self.axis_name, specs), scalars

  def reduced_specs(self, acc, params):
    # The params' own specs when given, so that `inner` sees gradients laid
    # out like the params.
    if params is not None:
      return jax.tree.map(_unreduced.spec_of, params)
    return jax.tree.map(
      lambda a: _unreduced.reduced_spec(a, self.axis_name), acc
    )

  def shares_buffer(self, acc):
    del acc  # The accumulator is unreduced, the updates are not.
    return False

  def cleared(self, cycle_ends, acc, total):
    def leaf(a, t):
      zeros = jnp.where(cycle_ends, jnp.zeros([], t.dtype), t)
      typed = _unreduced.unreduced_like(zeros, a, self.axis_name)
      if typed is None:  # FSDP: the shapes per device differ.
        return self.select(cycle_ends, self.zero(a), a)
      return typed.astype(a.dtype)

    return jax.tree.map(leaf, acc, total)


def is_bound(axis_name: Hashable) -> bool:
  """Whether `axis_name` is a bound axis here (shard_map, pmap, vmap)."""
  try:
    jax.eval_shape(lambda: lax.axis_index(axis_name))
  except NameError:
    return False
  return True


def _explicit_on(mesh: Any, axis_name: Hashable) -> bool:
  if mesh is None or mesh.empty:
    return False
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  return all(
    types.get(a) == jax.sharding.AxisType.Explicit
    for a in _control.axis_tuple(axis_name)
  )


def for_init(axis_name: Hashable, params: Any) -> Local:
  """The engine of an ``init``, which sees the params but no gradient.

  Unreduced when the axis is not bound and is explicit on the mesh set with
  ``jax.set_mesh`` or, eagerly, on the mesh the params are placed on;
  otherwise zeros like the params (the shard_map engine's ``init`` outside
  ``shard_map`` included).
  """
  if is_bound(axis_name) or not _unreduced.is_supported():
    return ShardMap(axis_name)
  meshes: list[jax.sharding.Mesh | jax.sharding.AbstractMesh] = [
    jax.sharding.get_abstract_mesh()
  ]
  for p in jax.tree.leaves(params):
    sharding = getattr(p, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      meshes.append(sharding.mesh)
      break
  if any(_explicit_on(m, axis_name) for m in meshes):
    return Unreduced(axis_name)
  return ShardMap(axis_name)


def for_update(axis_name: Hashable, grads: Any, acc_grads: Any) -> Local:
  """The engine of an ``update``; raises if the unreduced engine cannot run.

  Raises:
    RuntimeError: If JAX lacks unreduced shardings.
    ValueError: If there is no mesh, the axis is not explicit on it, or
      `grads` or the state's accumulator are not unreduced over it; without
      `axis_name`, if `grads` are unreduced.
  """
  if is_bound(axis_name):
    return ShardMap(axis_name)
  # Not inside shard_map: plain jit (or eager) over an explicit mesh.
  try:
    _unreduced.check_explicit_axis(axis_name)
  except ValueError as error:
    raise ValueError(
      f"{error} Outside `jax.shard_map` (where `axis_name` is bound),"
      " `accumulate(..., axis_name=...)` sums gradients left unreduced over"
      " an explicit mesh axis under plain `jax.jit`."
    ) from None
  _unreduced.check_unreduced(grads, axis_name, "updates")
  try:
    _unreduced.check_unreduced(acc_grads, axis_name, "state.acc_grads")
  except ValueError:
    raise ValueError(
      f"`state` holds an accumulator that is not unreduced over"
      f" {axis_name!r}, but the gradients are: make the state with"
      " `tx.init(params)` while the mesh is set (`with jax.set_mesh(mesh):`)"
      " or with params placed on it, so that `init` builds unreduced"
      " accumulators; `optax_accum.distributed.state_shardings` gives"
      " their shardings. A restored state (host arrays, or a checkpoint"
      " of another number of devices): lay it out with"
      " `optax_accum.distributed.regroup_state(restored, tx.init(params))`"
      " under the mesh."
    ) from None
  return Unreduced(axis_name)
