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

A checkpoint holds the layout of the devices that wrote it: a leading axis of
N rows, one partial sum per device, on the device-local leaves (or on every
leaf of a ``pmap`` state). :func:`regroup_state` lays a restored state out for
the devices of the run that resumes it, with nothing lost, and
:func:`drop_device_axis` refuses a state that was not.
"""

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _checks, _control, _unreduced
from optax_accum._state import (
  DEVICE_LOCAL_FIELDS,
  AccumulateState,
  find_state,
  is_accumulate_state,
)
from optax_accum.distributed import _sharding


def _device_local_mask(state: AccumulateState) -> AccumulateState:
  """A prefix of `state`: True above each device-local field."""
  # A tree of bools in the state's own record (a prefix of it).
  return AccumulateState._make(
    field in DEVICE_LOCAL_FIELDS for field in state._fields
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

  Each device must see one row: the partial sums of one device. A state
  written on more devices than this ``shard_map`` spreads it over (a
  checkpoint of 8 devices resumed on 4) gives each device several rows,
  every one a partial sum that the cycle's update needs; rather than
  take one and lose the others, this raises, naming the device counts
  and :func:`regroup_state`, which lays such a state out for these
  devices. (Onto more devices than wrote it, 4 to 8, ``shard_map``
  itself refuses the state: 8 does not divide 4.)

  Args:
    opt_state: An optimizer state in the global layout, seen by one device.

  Returns:
    The same tree, each device-local leaf ``x`` replaced by ``x[0]``.

  Raises:
    ValueError: If a device-local leaf holds other than one row here.
  """
  _check_one_row(opt_state)
  return _map_device_local(opt_state, lambda x: x[0])


def _check_one_row(opt_state: Any) -> None:
  """Raises unless every device-local leaf of `opt_state` has one row."""

  def check(path: tuple, state: AccumulateState) -> None:
    local = [
      (path + (jax.tree_util.GetAttrKey(field), *p), x)
      for field in DEVICE_LOCAL_FIELDS
      for p, x in jax.tree_util.tree_flatten_with_path(
        getattr(state, "acc_buffer" if field == "acc_grads" else field)
      )[0]
    ]
    for where, x in local:
      rows = np.shape(x)[0] if np.ndim(x) else None
      if rows == 1:
        continue
      name = jax.tree_util.keystr(where) or "<root>"
      got = "no leading axis" if rows is None else f"{rows} rows"
      counts = _device_counts(state.acc_scalars, rows)
      raise ValueError(
        f"`opt_state` leaf {name} holds {got} on this device, where"
        " `add_device_axis` writes one (this device's partial sums):"
        f" {counts}. Taking one row would lose the other devices' partial"
        " sums of the open cycle. Lay the restored state out for these"
        " devices once, before the first step:"
        " `opt_state = optax_accum.distributed.regroup_state(restored,"
        " init(params))`, with `init` this run's (the state it gives on"
        " these devices is the layout wanted)."
      )

  for path, node in jax.tree_util.tree_flatten_with_path(
    opt_state, is_leaf=is_accumulate_state
  )[0]:
    if is_accumulate_state(node):
      check(tuple(path), node)


def _device_counts(scalars: Any, rows: int | None) -> str:
  """The device counts a state of `rows` rows per device says, in words:
  named where the mesh axis it is spread over is known (the one manual axis
  `scalars` varies over, or the mesh's one manual axis)."""
  if rows is None:
    return "it was not laid out with `shard_map_specs` and `add_device_axis`"
  mesh = jax.sharding.get_abstract_mesh()
  axes = _control.varying_axes(jax.typeof(scalars)) or _control.manual_axes()
  if len(axes) == 1 and not mesh.empty:
    (axis,) = axes
    here = dict(mesh.shape)[axis]
    return (
      f"the state was written on {rows * here} devices (or replicas) of"
      f" {axis!r} and this shard_map runs on {here}"
    )
  return (
    f"the state was written on {rows} times as many devices (or replicas)"
    " as this shard_map spreads it over"
  )


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
  if not isinstance(x.sharding, NamedSharding):  # unreduced: a named one
    return x
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
  like the params: a state of no device count, which resumes on any. To go
  on from it, :func:`regroup_state` ``(restored, tx.init(params))`` under
  the mesh places the whole sum on the first device of the data axis and
  zeros on the others (no communication), from host arrays too, which
  ``jax.device_put(restored, state_shardings(tx, params))`` refuses
  (``device_indices_map doesn't work with unreduced``).

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


# ----------------------------------------------------------------------------
# Resuming on another number of devices.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rows:
  """How a state lays out its devices: `stacked` rows on every leaf (a
  ``pmap`` state), `local` rows on the device-local leaves (``shard_map``'s
  global layout, or `stacked`); None for no such axis (one device's state,
  or the unreduced engine's, whose sums are one value)."""

  stacked: int | None
  local: int | None


def _rows_of(state: AccumulateState, name: str) -> _Rows:
  counters, scalars = np.shape(state.counters), np.shape(state.acc_scalars)
  if len(counters) == 2 and scalars[:1] == counters[:1]:
    return _Rows(counters[0], counters[0])
  if len(counters) == 1 and len(scalars) in (1, 2):
    return _Rows(None, scalars[0] if len(scalars) == 2 else None)
  raise ValueError(
    f"`{name}` holds an AccumulateState whose `counters` have shape"
    f" {counters} and `acc_scalars` {scalars}: not a layout of one device,"
    " of `shard_map_specs` (a leading device axis on `acc_grads` and"
    " `acc_scalars`) or of `pmap` (a leading device axis on every leaf)."
  )


def _on_host(x: Any) -> np.ndarray:
  """`x`'s value as a NumPy array, gathered from every process when it
  spans several."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def _regrouped(x: Any, rows: int | None, wanted: int | None) -> np.ndarray:
  """Partial sums on `rows` rows (None: one value, no device axis) regrouped
  onto `wanted` rows, nothing lost: row ``i`` is added into row
  ``i * wanted // rows`` (the contiguous blocks ``shard_map`` would give
  each device where `wanted` divides `rows`), in float32 at least."""
  x = _on_host(x)
  if rows is None:
    x, rows = x[None], 1
  out_rows = 1 if wanted is None else wanted
  wide = np.promote_types(x.dtype, np.float32)
  out = np.zeros((out_rows, *x.shape[1:]), wide)
  for i in range(rows):
    out[i * out_rows // rows] += x[i]
  out = out.astype(x.dtype)
  return out[0] if wanted is None else out


def _replicated(x: Any, rows: int | None, wanted: int | None, name: str) -> Any:
  """A leaf every device holds the same, from `rows` stacked copies (None:
  one) to `wanted`; raises if the copies differ (not replicas of one run:
  a stacked ensemble)."""
  if rows is None and wanted is None:
    return x
  if rows is not None:
    copies = _on_host(x)
    same = copies == copies[:1]
    if jnp.issubdtype(copies.dtype, jnp.inexact):
      same |= np.isnan(copies) & np.isnan(copies[:1])
    if not same.all():
      raise ValueError(
        f"`opt_state` leaf {name} differs between its {rows} rows, which"
        " a `pmap` state's replicas never do: this is not the state of one"
        " run replicated over devices (a stacked ensemble?), and regrouping"
        " it onto another number of devices would mix runs."
      )
    x = copies[0]
  if wanted is None:
    return x
  x = np.asarray(x)
  return np.broadcast_to(x, (wanted, *x.shape)).copy()


def _concrete_sharding(like: Any) -> jax.sharding.Sharding | None:
  """The sharding to place a leaf like `like` on: a committed array's, or
  a ``jax.ShapeDtypeStruct``'s where it names devices; None otherwise (an
  uncommitted array, such as the copies ``jnp.stack`` makes for ``pmap``,
  leaves the placing to the step)."""
  if isinstance(like, jax.Array) and not like.committed:
    return None
  sharding = getattr(like, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding):
    return None
  if isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
    return None
  return sharding


def _check_leaf(
  x: Any, like: Any, name: str, rows: int | None, wanted: int | None
) -> None:
  """Raises unless `x` (with `rows` rows, or None) and `like` (`wanted`)
  are the same leaf but for their device axes."""
  have, want = tuple(np.shape(x)), tuple(np.shape(like))
  same_dtype = np.dtype(x.dtype) == np.dtype(like.dtype)
  if same_dtype and have[rows is not None :] == want[wanted is not None :]:
    return

  def typed(leaf: Any, rows: int | None) -> str:
    kind = "" if rows is None else f" ({rows} rows of devices)"
    return f"{np.dtype(leaf.dtype).name}{list(np.shape(leaf))}{kind}"

  raise ValueError(
    f"`opt_state` leaf {name} is {typed(x, rows)} where `target`'s is"
    f" {typed(like, wanted)}: restore the checkpoint of this"
    " transformation (the same `accumulate` options and inner optimizer)"
    " and these params."
  )


def _placed(value: Any, like: Any) -> Any:
  """`value` (a NumPy array, or an array of the restored state) placed as
  `like` is, where `like` has a sharding on devices."""
  sharding = _concrete_sharding(like)
  if sharding is None:
    return value
  if isinstance(value, jax.Array) and value.sharding == sharding:
    return value
  spec = getattr(sharding, "spec", None)
  unreduced = tuple(getattr(spec, "unreduced", ()))
  if unreduced and isinstance(sharding, NamedSharding):
    # jax cannot place host values on an unreduced sharding
    # (`device_indices_map doesn't work with unreduced`, jax 0.10.2 to
    # 0.12): placed replicated over those axes first, the device_put to the
    # unreduced sharding keeps the whole sum on one device of each group
    # and zeros on the others (no communication).
    reduced = NamedSharding(
      sharding.mesh, _unreduced.reduced_spec(like, unreduced)
    )
    return jax.device_put(_put(value, reduced), sharding)
  return _put(value, sharding)


def _put(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  if isinstance(value, jax.Array) or sharding.is_fully_addressable:
    return jax.device_put(value, sharding)
  host = np.asarray(value)  # every process holds it: each puts its shards
  return jax.make_array_from_callback(
    host.shape, sharding, lambda index: host[index]
  )


def _regroup_accumulate(
  path: tuple, state: AccumulateState, like: AccumulateState
) -> AccumulateState:
  have, want = _rows_of(state, "opt_state"), _rows_of(like, "target")
  field = jax.tree_util.GetAttrKey
  # The cycle is open where a micro-batch was accepted since the last end;
  # where none is, the device-local leaves hold nothing the run reads (at
  # most what the last cycle left, `_state.py`): zeros.
  is_open = bool((_on_host(state.counters)[..., 0] > 0).any())

  def local(x: Any, t: Any, where: str) -> Any:
    _check_leaf(x, t, where, have.local, want.local)
    if is_open and have.local == want.local:  # as many rows: as they are
      return _placed(x, t)
    if is_open:
      return _placed(_regrouped(x, have.local, want.local), t)
    return _placed(np.zeros(np.shape(t), t.dtype), t)

  def over(fn: Callable, key: str, x: Any, t: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
      lambda p, t_leaf, x_leaf: fn(
        x_leaf, t_leaf, jax.tree_util.keystr((*path, field(key), *p))
      ),
      t,
      x,
    )

  def replicated(x: Any, t: Any, where: str) -> Any:
    return _replicated_leaf(x, t, where, have.stacked, want.stacked)

  return AccumulateState(
    counters=over(replicated, "counters", state.counters, like.counters),
    acc_grads=over(local, "acc_grads", state.acc_buffer, like.acc_buffer),
    acc_scalars=over(local, "acc_scalars", state.acc_scalars, like.acc_scalars),
    inner_state=over(
      replicated, "inner_state", state.inner_state, like.inner_state
    ),
  )


def _replicated_leaf(
  x: Any, like: Any, where: str, rows: int | None, wanted: int | None
) -> Any:
  """A leaf every device holds the same, checked, copied and placed."""
  _check_leaf(x, like, where, rows, wanted)
  return _placed(_replicated(x, rows, wanted, where), like)


def _check_structure(opt_state: Any, target: Any) -> None:
  tree: _control.TreeDef = jax.tree.structure(opt_state)
  if tree == jax.tree.structure(target):
    return
  missing, extra = _checks.paths_differ(opt_state, target)
  raise ValueError(
    "`opt_state` and `target` must be states of one transformation (the"
    f" same tree), got trees that differ: `target` has {missing[:3]} that"
    f" `opt_state` lacks, `opt_state` has {extra[:3]} that `target` lacks"
    f" (first three; structures {jax.tree.structure(opt_state)} and"
    f" {jax.tree.structure(target)})."
  )


def regroup_state(opt_state: Any, target: Any) -> Any:
  r"""A restored state, laid out for the devices of the run that resumes it.

  The state of ``accumulate(..., axis_name=...)`` keeps one partial sum per
  device during a cycle, and a checkpoint keeps them as the devices that
  wrote it held them: a leading axis of N rows on the device-local leaves
  (``shard_map``'s layout, :func:`shard_map_specs`), on every leaf
  (``pmap``), or none (the unreduced engine's :func:`reduce_state`, whose
  sums are one value). Resumed on M devices, those N partial sums are
  regrouped onto M rows, nothing lost: row ``i`` is added into row
  ``i * M // N`` (in float32 at least, then back to the accumulator's
  dtype), so that the cycle goes on from the same sums. The counters say
  the cycle ends after the micro-batches it would have; its update is the
  uninterrupted run's up to float rounding (the partial sums are added in
  another order). The weights and the noise scale's sums of the open cycle
  are sums over devices too, and are regrouped alike: the noise scale's
  estimate of that cycle keeps every sample taken before the checkpoint
  (its samples after it are the new devices' shares). Between cycles
  (``micro_step == 0``) there is nothing to regroup: the device-local
  leaves are zeros.

  Call it once, right after the restore, whatever the device counts (with
  as many devices as before it changes nothing but the placement); the
  layout wanted is that of `target`, a state of this run on these devices,
  and the one read is that of `opt_state`, so no count is passed:

  * ``shard_map``: ``target = init(params)``, the jitted ``shard_map`` of
    ``add_device_axis(tx.init(p))`` with :func:`shard_map_specs`;
  * ``pmap``: the copies ``pmap`` is given (``jnp.stack([x] * n)`` of
    ``tx.init(params)``'s leaves);
  * plain ``jit`` with unreduced gradients: ``tx.init(params)`` under the
    mesh (``jax.set_mesh``). `opt_state` may then hold host arrays, which
    ``jax.device_put(restored, state_shardings(tx, params))`` refuses
    (``device_indices_map doesn't work with unreduced``): this places each
    sum on the first device of the data axis and zeros on the others.

  Each leaf is placed as `target`'s is (its sharding, where it is a
  committed array or a ``jax.ShapeDtypeStruct`` with a sharding on
  devices), else returned as it is or, where regrouped, as a NumPy array.
  A regrouped leaf passes through the host, gathered from every process
  where it spans several; a device-local leaf of as many rows as wanted,
  and a replicated one, does not.

  Args:
    opt_state: The restored optimizer state (host or device arrays): an
      :class:`~optax_accum.AccumulateState` or any tree holding them, as
      saved on any number of devices, replicas or processes, in any of the
      layouts above. A state whose accumulator is still typed unreduced is
      summed first (:func:`reduce_state`).
    target: A state of the same transformation on the devices of this run
      (arrays, or ``jax.ShapeDtypeStruct``\s): its layout and placement are
      those wanted.

  Returns:
    `opt_state`'s values with `target`'s structure, shapes, dtypes and
    shardings.

  Raises:
    ValueError: If the trees differ, a leaf's shape or dtype does not match
      `target`'s once regrouped (another transformation or other params),
      or the copies of a ``pmap`` state differ (a stacked ensemble, not
      replicas).
    TypeError: If `target` holds no :class:`~optax_accum.AccumulateState`.

  Examples:
    Four micro-batch gradients of a ``pmap`` state of 8 devices, resumed on
    4: each new device holds two old devices' sums and weights.

    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), 4, axis_name="data")
    >>> params = jnp.zeros(2)
    >>> def replicas(n):  # one copy of the state per device
    ...   return jax.tree.map(lambda a: jnp.stack([a] * n), tx.init(params))
    >>> grads = jnp.outer(jnp.arange(1.0, 9.0), jnp.ones(2))  # device d: d+1
    >>> update = jax.vmap(tx.update, (0, 0, None), axis_name="data")
    >>> _, saved = update(grads, replicas(8), params)
    >>> state = optax_accum.distributed.regroup_state(saved, replicas(4))
    >>> print(state.acc_grads, state.acc_weight, state.micro_step)
    [[ 3.  3.]
     [ 7.  7.]
     [11. 11.]
     [15. 15.]] [2. 2. 2. 2.] [1 1 1 1]
  """
  _check_structure(opt_state, target)
  find_state(target, "regroup_state")  # raises naming what is missing
  found = [
    (t, x)
    for t, x in zip(
      jax.tree.leaves(target, is_leaf=is_accumulate_state),
      jax.tree.leaves(opt_state, is_leaf=is_accumulate_state),
      strict=True,
    )
    if is_accumulate_state(t)
  ]
  stacks = {
    (_rows_of(x, "opt_state").stacked, _rows_of(t, "target").stacked)
    for t, x in found
  }
  if len(stacks) != 1:
    raise ValueError(
      "`opt_state` holds AccumulateStates of different layouts (some"
      " stacked by `pmap`, some not): regroup each state on its own."
    )
  (stack,) = stacks
  opt_state = reduce_state(opt_state)

  def visit(path: tuple, like: Any, x: Any) -> Any:
    if is_accumulate_state(like):
      return _regroup_accumulate(tuple(path), x, like)
    where = jax.tree_util.keystr(tuple(path))
    return _replicated_leaf(x, like, where, *stack)

  return jax.tree_util.tree_map_with_path(
    visit, target, opt_state, is_leaf=is_accumulate_state
  )
