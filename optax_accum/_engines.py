"""Which reduction engine an ``accumulate(..., axis_name=...)`` trace uses.

One argument, two engines, chosen where ``init`` and ``update`` are traced:

* ``"shard_map"``: `axis_name` is bound (inside ``jax.shard_map``, ``pmap``
  or a named ``vmap``). Each device's accumulator is its own partial sum and
  the emitting branch sums over the axis with ``lax.psum``;
* ``"unreduced"``: `axis_name` is not bound, but is an
  ``AxisType.Explicit`` axis of the mesh set with ``jax.set_mesh`` (plain
  ``jax.jit`` over a mesh). The gradients and the accumulator are typed
  unreduced over the axis; the emitting branch sums once with
  ``jax.reshard``;
* ``"local"``: no `axis_name`.

An :class:`Engine` also carries the few operations whose form differs between
the engines: a select, a product with a scalar, a test of finiteness.
Unreduced arrays only allow linear operations, so there these come from
:mod:`optax_accum._unreduced`.
"""

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum import _unreduced

LOCAL, SHARD_MAP, UNREDUCED = "local", "shard_map", "unreduced"


class Engine(NamedTuple):
  """The engine of one trace (static)."""

  kind: str  # LOCAL, SHARD_MAP or UNREDUCED
  axis_name: Hashable | None

  @property
  def unreduced(self) -> bool:
    return self.kind == UNREDUCED

  def zero(self, x: Any) -> Any:
    """A zero to select against `x`: a scalar, or unreduced zeros."""
    if self.unreduced:
      return jnp.zeros_like(x)  # keeps the unreduced type under jit
    return jnp.zeros([], x.dtype)

  def select(self, pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``jnp.where`` with a replicated scalar `pred`."""
    if self.unreduced:
      return _unreduced.where(pred, on_true, on_false, self.axis_name)
    return jnp.where(pred, on_true, on_false)

  def scale(self, x: Any, factor: jax.Array) -> Any:
    """``x * factor`` for a replicated scalar `factor`."""
    if self.unreduced:
      return _unreduced.scale(x, factor, self.axis_name)
    return x * factor.astype(x.dtype)

  def all_finite(self, tree: Any) -> jax.Array:
    """Whether every gradient element is finite: on this device (local,
    shard_map) or on every device (unreduced, one scalar all-reduce)."""
    if self.unreduced:
      return _unreduced.all_finite(tree, self.axis_name)
    finite = jnp.asarray(True)
    for g in jax.tree.leaves(tree):
      finite &= jnp.all(jnp.isfinite(g))
    return finite


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
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  return all(types.get(a) == jax.sharding.AxisType.Explicit for a in axes)


def for_init(axis_name: Hashable | None, params: Any) -> Engine:
  """The engine of an ``init``, which sees the params but no gradient.

  Unreduced when the axis is not bound and is explicit on the mesh set with
  ``jax.set_mesh`` or, eagerly, on the mesh the params are placed on;
  otherwise zeros like the params (the shard_map engine's ``init`` outside
  ``shard_map`` included).
  """
  if axis_name is None:
    return Engine(LOCAL, None)
  if is_bound(axis_name) or not _unreduced.is_supported():
    return Engine(SHARD_MAP, axis_name)
  meshes = [jax.sharding.get_abstract_mesh()]
  for p in jax.tree.leaves(params):
    sharding = getattr(p, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      meshes.append(sharding.mesh)
      break
  if any(_explicit_on(m, axis_name) for m in meshes):
    return Engine(UNREDUCED, axis_name)
  return Engine(SHARD_MAP, axis_name)


def for_update(
  axis_name: Hashable | None, grads: Any, acc_grads: Any
) -> Engine:
  """The engine of an ``update``; raises if the unreduced engine cannot run.

  Raises:
    RuntimeError: If JAX lacks unreduced shardings.
    ValueError: If there is no mesh, the axis is not explicit on it, or
      `grads` or the state's accumulator are not unreduced over it; without
      `axis_name`, if `grads` are unreduced.
  """
  if axis_name is None:
    _refuse_unreduced(grads)
    return Engine(LOCAL, None)
  if is_bound(axis_name):
    return Engine(SHARD_MAP, axis_name)
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
      " accumulators; `optax_accum.distributed.state_shardings` gives their shardings."
    ) from None
  return Engine(UNREDUCED, axis_name)


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
        " `optax_accum.distributed.local_value_and_grad`), but this accumulate has no"
        f" `axis_name`: build it with `axis_name={name!r}` so that it sums"
        " them once per cycle."
      )
