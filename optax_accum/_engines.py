"""How an ``accumulate`` trace sums over devices: one record per engine.

``axis_name`` is one argument with three engines, chosen where ``init`` and
``update`` are traced (:func:`for_init`, :func:`for_update`), once per
trace:

* :class:`Local`: no ``axis_name``. One device's sums; nothing to agree on
  or reduce.
* :class:`ShardMap`: ``axis_name`` is bound (inside ``jax.shard_map``,
  ``pmap`` or a named ``vmap``). Each device's accumulator is its own
  partial sum; devices agree on skips and flushes with ``pmin``/``pmax``,
  and the emitting call sums with ``psum``.
* :class:`Unreduced`: ``axis_name`` is not bound but is an
  ``AxisType.Explicit`` axis of the mesh set with ``jax.set_mesh`` (plain
  ``jax.jit`` over a mesh). Gradients and accumulator are typed unreduced
  over the axis, its scalars are global already, and the emitting call sums
  with one ``jax.reshard``. Unreduced arrays allow only linear operations,
  so its select, scale and finiteness test come from
  :mod:`optax_accum._unreduced`.

The rest of the step calls the engine's methods and never asks which one it
has.
"""

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum import _control, _unreduced


@dataclasses.dataclass(frozen=True)
class Local:
  """No ``axis_name``: one device's sums."""

  axis_name: Hashable | None = None
  # Eager ops on this engine's arrays work (not on unreduced ones).
  runs_eagerly: ClassVar[bool] = True
  # The cycle's total weight is the same on every device before it is
  # reduced (not inside shard_map, where each device has its own).
  global_weight: ClassVar[bool] = True
  # `accumulate` measures each gradient's norm for the noise scale itself
  # (not unreduced gradients: `local_value_and_grad` measures them).
  measures_noise: ClassVar[bool] = True

  # -- Elementwise forms (see _tree.add_term). -------------------------------

  def zero(self, x: Any) -> Any:
    """A zero to select against `x`."""
    return jnp.zeros([], x.dtype)

  def select(self, pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``jnp.where`` with a replicated scalar `pred`."""
    return jnp.where(pred, on_true, on_false)

  def scale(self, x: Any, factor: jax.Array) -> Any:
    """``x * factor`` for a replicated scalar `factor`."""
    return x * factor.astype(x.dtype)

  def all_finite(self, tree: Any) -> jax.Array:
    """Whether every gradient element is finite (on every device whose
    decision this is)."""
    finite = jnp.asarray(True)
    for g in jax.tree.leaves(tree):
      finite &= jnp.all(jnp.isfinite(g))
    return finite

  # -- The cycle. ------------------------------------------------------------

  def zeros_like_param(self, param: Any, dtype: Any) -> jax.Array:
    """A zero accumulator leaf placed like `param`.

    A committed array's sharding is copied; an uncommitted one (created
    without a device) gives an uncommitted accumulator, as optax's own
    states. Under ``jit`` an explicit-axes mesh puts the sharding in the
    tracer's type and ``zeros_like`` keeps it; with auto axes pass
    ``out_shardings=optax_accum.distributed.state_shardings(tx, params)``.
    """
    if isinstance(param, jax.Array) and not isinstance(param, jax.core.Tracer):
      device = param.sharding if param.committed else None
      return jnp.zeros(param.shape, dtype, device=device)
    return jnp.zeros_like(param, dtype=dtype)

  def agree(self, reduce: Callable, flag: jax.Array) -> jax.Array:
    """`flag` the same on every device of the step (here: itself)."""
    del reduce
    return flag

  def reduce(
    self, acc: Any, scalars: tuple, *, per_leaf: bool, specs: Any
  ) -> tuple[Any, tuple]:
    """The cycle's sums over the devices: `acc` and a few float32
    `scalars` (its weight, the noise-scale sums). Here: as they are."""
    del per_leaf, specs
    return acc, scalars

  def reduced_specs(self, acc: Any, params: Any) -> Any:
    """Where the reduced sum is laid out (None: no layout in the type)."""
    del acc, params
    return None

  def shares_buffer(self, acc: Any) -> bool:
    """Whether the emitted updates may be written into the accumulator's
    own buffer (design point 2 of :mod:`optax_accum._accumulate`)."""
    del acc
    return True

  def cleared(self, acc: Any, total: Any, cycle_end: jax.Array) -> Any:
    """Zeros in place of the accumulator `acc` at a cycle's end, once
    `total`, its sum over the devices, is known."""
    del total
    return _control.cleared(cycle_end, acc, self)

  def sample_axes(self) -> Hashable | None:
    """The axes each device's gradient is a noise-scale sample over."""
    return None


@dataclasses.dataclass(frozen=True)
class ShardMap(Local):
  """``axis_name`` bound: ``psum`` once per cycle."""

  global_weight: ClassVar[bool] = False

  def agree(self, reduce: Callable, flag: jax.Array) -> jax.Array:
    """`flag` reduced with `reduce` (``lax.pmin``, ``lax.pmax``) over
    `axis_name` and every other manual axis it varies over: replicas must
    agree on what is skipped and on when a cycle ends, and so must the
    devices that hold shards of one replica's gradient (HSDP)."""
    axes = set(_control.axis_tuple(self.axis_name))
    axes |= _control.varying_axes(jax.typeof(flag))
    return reduce(flag.astype(jnp.int32), tuple(sorted(axes, key=str))) > 0

  def reduce(self, acc, scalars, *, per_leaf, specs):
    del specs
    leaves, treedef = jax.tree.flatten(acc)
    leaves, scalars = _control.psum_with_scalars(
      leaves, scalars, self.axis_name, per_leaf
    )
    return jax.tree.unflatten(treedef, leaves), scalars

  def shares_buffer(self, acc):
    # Not with check_vma=True: the accumulator varies over the axis while
    # the updates, summed over it, do not, and one buffer cannot hold both
    # types.
    return not _control.varies_over(acc, self.axis_name)

  def cleared(self, acc, total, cycle_end):
    # Zeros read from the reduced `total`, so that the sum can be reduced
    # in place of the accumulator (reading `acc` again keeps it alive, at
    # the cost of a copy of it); varying as the accumulator does.
    return jax.tree.map(
      lambda a, t: _control.vary_over(
        jnp.where(cycle_end, jnp.zeros([], t.dtype), t),
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

  def cleared(self, acc, total, cycle_end):
    def leaf(a, t):
      zeros = jnp.where(cycle_end, jnp.zeros([], t.dtype), t)
      typed = _unreduced.unreduced_like(zeros, a, self.axis_name)
      if typed is None:  # FSDP: the shapes per device differ.
        return self.select(cycle_end, self.zero(a), a)
      return typed.astype(a.dtype)

    return jax.tree.map(leaf, acc, total)


LOCAL = Local()


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


def for_init(axis_name: Hashable | None, params: Any) -> Local:
  """The engine of an ``init``, which sees the params but no gradient.

  Unreduced when the axis is not bound and is explicit on the mesh set with
  ``jax.set_mesh`` or, eagerly, on the mesh the params are placed on;
  otherwise zeros like the params (the shard_map engine's ``init`` outside
  ``shard_map`` included).
  """
  if axis_name is None:
    return LOCAL
  if is_bound(axis_name) or not _unreduced.is_supported():
    return ShardMap(axis_name)
  meshes = [jax.sharding.get_abstract_mesh()]
  for p in jax.tree.leaves(params):
    sharding = getattr(p, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      meshes.append(sharding.mesh)
      break
  if any(_explicit_on(m, axis_name) for m in meshes):
    return Unreduced(axis_name)
  return ShardMap(axis_name)


def for_update(axis_name: Hashable | None, grads: Any, acc_grads: Any) -> Local:
  """The engine of an ``update``; raises if the unreduced engine cannot run.

  Raises:
    RuntimeError: If JAX lacks unreduced shardings.
    ValueError: If there is no mesh, the axis is not explicit on it, or
      `grads` or the state's accumulator are not unreduced over it; without
      `axis_name`, if `grads` are unreduced.
  """
  if axis_name is None:
    _refuse_unreduced(grads)
    return LOCAL
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
      " their shardings."
    ) from None
  return Unreduced(axis_name)


def _refuse_unreduced(grads: Any) -> None:
  """Raises if a gradient is unreduced while no `axis_name` says over what
  to sum it (JAX's own error names neither the cause nor the fix)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    axes = _unreduced.unreduced_axes(leaf)
    if axes:
      name = axes[0] if len(axes) == 1 else axes
      raise ValueError(
        f"`updates` leaf {jax.tree_util.keystr(path) or '<root>'} is typed"
        f" unreduced over {name!r} (each device's partial sum, e.g. from"
        " `optax_accum.distributed.local_value_and_grad`), but this"
        f" accumulate has no `axis_name`: build it with `axis_name={name!r}`"
        " so that it sums them once per cycle."
      )
