"""The layouts of an :class:`AccumulateState` across devices.

With ``accumulate(..., axis_name=...)`` inside ``jax.shard_map``, some leaves
of the state hold each device's own, unreduced sums during a cycle (the
accumulator, its weight, the noise-scale sums) while every other leaf is the
same on every device. Between steps the state lives outside ``shard_map`` as
global arrays, so the device-local leaves get a leading device axis
(spec ``P(axis_name)``) and the rest is replicated (spec ``P()``). These
functions give the specs and convert between the two layouts, so that no
caller has to know which fields are which.

Under plain ``jit`` (the unreduced engine) the accumulator is typed unreduced
over the data axis, which JAX cannot copy to the host and Orbax cannot save;
:func:`reduce_state` gives the state a checkpoint can hold.
"""

from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _unreduced
from optax_accum._state import (
  DEVICE_LOCAL_FIELDS,
  AccumulateState,
  is_accumulate_state,
)
from optax_accum.distributed import _sharding


def _device_local_mask(state: AccumulateState) -> AccumulateState:
  """A prefix of `state`: True above each device-local field."""
  return AccumulateState(
    **{field: field in DEVICE_LOCAL_FIELDS for field in state._fields}
  )


def _map_accumulate_states(opt_state: Any, fn: Callable, other: Callable):
  """Maps every AccumulateState in `opt_state` with `fn`, other leaves with
  `other`."""

  def visit(node: Any) -> Any:
    return fn(node) if is_accumulate_state(node) else other(node)

  return jax.tree.map(visit, opt_state, is_leaf=is_accumulate_state)


def shard_map_specs(
  opt_state: Any, axis_name: Hashable, params: Any = None
) -> Any:
  """``PartitionSpec``\\s of an optimizer state in ``shard_map``'s global layout.

  Pass them as the state's ``in_specs`` and ``out_specs`` of the
  ``jax.shard_map`` whose body calls ``accumulate(..., axis_name=...)``.
  Inside the body, :func:`drop_device_axis` gives ``update`` the state it
  expects and :func:`add_device_axis` turns its result back.

  With params sharded over other axes of the mesh (FSDP or HSDP inside
  ``shard_map``: params ``P("fsdp")``, ``axis_name="replica"``), pass them
  as `params`: a state leaf that is a copy of a param (the accumulator,
  adam's ``mu`` and ``nu``; matched as :func:`state_shardings` does, by key
  path and shape) then gets the param's spec, after `axis_name` for the
  device-local accumulator: ``P("replica", "fsdp")``.

  Args:
    opt_state: The optimizer state (or its ``jax.eval_shape``): an
      :class:`~optax_accum.AccumulateState` or any tree holding them, e.g. an
      ``optax.chain`` state. Only its structure (and with `params`, its
      shapes: take it from the global params) is read.
    axis_name: The mesh axis the device-local leaves are spread over, the
      ``axis_name`` given to :func:`~optax_accum.accumulate`.
    params: Optional. The global params as arrays or
      ``jax.ShapeDtypeStruct``\\s with ``NamedSharding``\\s, those whose
      specs are the params' ``in_specs``. Default: params replicated.

  Returns:
    A prefix tree of the state with a ``PartitionSpec`` at each node:
    ``P(axis_name)`` above every device-local leaf, ``P()`` elsewhere; with
    `params`, a spec at every leaf, as above.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), 4, axis_name="data")
    >>> specs = optax_accum.distributed.shard_map_specs(
    ...     jax.eval_shape(tx.init, jnp.zeros(3)), "data")
    >>> print(specs.acc_grads, specs.acc_scalars, specs.counters, specs.inner_state)
    P('data',) P('data',) P() P()
  """
  local, replicated = P(axis_name), P()
  if params is not None:
    return _specs_following(opt_state, axis_name, params)

  def specs(state: AccumulateState) -> Any:
    return jax.tree.map(
      lambda is_local: local if is_local else replicated,
      _device_local_mask(state),
    )

  return _map_accumulate_states(opt_state, specs, lambda _: replicated)


def _specs_following(opt_state: Any, axis_name: Hashable, params: Any) -> Any:
  """:func:`shard_map_specs` with `params`: a spec at every leaf."""
  found = _sharding.param_shardings(params)

  def spec(path: tuple, leaf: Any, is_local: bool = False) -> P:
    copied = _sharding.param_copied(found, path, getattr(leaf, "shape", ()))
    parts = () if copied is None else tuple(copied.spec)
    return P(axis_name, *parts) if is_local else P(*parts)

  def accumulate_specs(state: AccumulateState) -> Any:
    def subtree(path, is_local, sub):
      return jax.tree_util.tree_map_with_path(
        lambda p, leaf: spec(path + p, leaf, is_local), sub
      )

    mask = _device_local_mask(state)
    return jax.tree_util.tree_map_with_path(subtree, mask, state)

  def visit(path: tuple, node: Any) -> Any:
    if is_accumulate_state(node):
      return accumulate_specs(node)
    return spec(path, node)

  return jax.tree_util.tree_map_with_path(
    visit, opt_state, is_leaf=is_accumulate_state
  )


def _map_device_local(opt_state: Any, fn: Callable) -> Any:
  def convert(state: AccumulateState) -> AccumulateState:
    return jax.tree.map(
      lambda is_local, sub: jax.tree.map(fn, sub) if is_local else sub,
      _device_local_mask(state),
      state,
    )

  return _map_accumulate_states(opt_state, convert, lambda leaf: leaf)


def add_device_axis(opt_state: Any) -> Any:
  """Inside ``shard_map``: gives the device-local leaves a leading axis of 1.

  The state ``accumulate(..., axis_name=...).update`` returns, made ready to
  leave ``shard_map`` with the specs of :func:`shard_map_specs`.

  Args:
    opt_state: An optimizer state in the per-device layout.

  Returns:
    The same tree, each device-local leaf ``x`` replaced by ``x[None]``.
  """
  return _map_device_local(opt_state, lambda x: x[None])


def drop_device_axis(opt_state: Any) -> Any:
  """Inside ``shard_map``: drops the device-local leaves' leading axis.

  The inverse of :func:`add_device_axis`: turns the state received through
  the specs of :func:`shard_map_specs` into what ``update`` expects.

  Args:
    opt_state: An optimizer state in the global layout, seen by one device.

  Returns:
    The same tree, each device-local leaf ``x`` replaced by ``x[0]``.
  """
  return _map_device_local(opt_state, lambda x: x[0])


def _reduced_leaf(x: Any) -> Any:
  """`x` summed over the axes it is unreduced over; other leaves as given."""
  if not isinstance(x, jax.Array | jax.ShapeDtypeStruct):
    return x
  axes = _unreduced.unreduced_axes(x)
  if not axes:
    return x
  spec = _unreduced.reduced_spec(x, axes)
  if isinstance(x, jax.core.Tracer):
    return jax.reshard(x, spec)
  sharding = NamedSharding(x.sharding.mesh, spec)
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.reshard(x, sharding)


def reduce_state(opt_state: Any) -> Any:
  r"""Sums every leaf typed unreduced, so the state can be saved.

  With ``accumulate(..., axis_name=...)`` under plain ``jit`` the
  accumulator holds each device's partial sum, typed unreduced over the
  data axis; on jax 0.10.2 such an array cannot be copied to the host and
  Orbax refuses to save it. This returns the same state with each such leaf
  replaced by its sum over the devices (one all-reduce per leaf), laid out
  like the params. To go on from it, put it back with the state's own
  shardings: ``jax.device_put(restored, optax_accum.distributed.state_shardings(tx,
  params))`` places the whole sum on the first device of the data axis and
  zeros on the others (no communication).

  The resumed run gives the uninterrupted run's updates up to float
  rounding: the saved sum is added to the later micro-batches in another
  order. Any other state passes through unchanged.

  Args:
    opt_state: An optimizer state (arrays, under ``jit`` or not) or its
      ``jax.ShapeDtypeStruct``\s, whose shardings are then changed alike.

  Returns:
    The same tree, every leaf typed unreduced replaced by its sum.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",),
    ...                      axis_types=(AxisType.Explicit,))
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), 4, axis_name="data")
    >>> params = jax.device_put(jnp.zeros(3), NamedSharding(mesh, P()))
    >>> state = tx.init(params)
    >>> print(jax.typeof(state.acc_grads))
    float32[3]{U:data}
    >>> print(jax.typeof(optax_accum.distributed.reduce_state(state).acc_grads))
    float32[3]
  """
  return jax.tree.map(_reduced_leaf, opt_state)
