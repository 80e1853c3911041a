"""Which collectives a compiled step runs, and whether the reduction waits.

`collectives` lists the cross-device collectives of a compiled program with
their bytes, where they sit and the devices they run across;
`assert_reduction_deferred` is the one-call check for a user's own tests: no
gradient-sized reduction runs on a micro-step (over a given mesh axis, with
``axis_name``, e.g. the ``replica`` axis of HSDP).
"""

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from optax_accum.inspect import _groups, _hlo

# Reductions of a gradient: what accumulation should defer.
REDUCTION_OPCODES = ("all-reduce", "reduce-scatter")

# Below this many bytes a reduction is bookkeeping, not a gradient: a loss,
# token counts, non-finite flags and noise-scale sums are a few dozen bytes,
# even when XLA combines them into one op. Any parameter tensor worth
# accumulating is larger.
DEFAULT_MIN_BYTES = 1024


class Collective(NamedTuple):
  """One collective op of a compiled program, as it is reached.

  Attributes:
    opcode: ``all-reduce``, ``reduce-scatter``, ``all-gather``,
      ``collective-permute``, ``all-to-all``, ... (an async ``-start`` /
      ``-done`` pair is reported once, under the synchronous name). What the
      program runs: for a reduce-scatter that ``jit`` inserts, XLA's
      partitioner emits an all-reduce of the whole input and a
      ``dynamic-slice``; XLA:GPU turns them back into a ``reduce-scatter``,
      XLA:TPU into an ``all-reduce-scatter`` fusion (an all-reduce of the
      padded input and a slice, run as one reduce-scatter), reported as a
      ``reduce-scatter``; XLA:CPU (and XLA:TPU for small arrays) runs the
      all-reduce, reported as an ``all-reduce`` of the whole input.
      ``shard_map``'s ``psum_scatter`` is a ``reduce-scatter`` on all three.
    bytes: the larger of the op's input and output, in bytes on one device:
      an all-reduce's payload, an all-gather's gathered result, a
      reduce-scatter's input (before any padding a TPU fusion adds). (A ring
      all-reduce sends about ``2 (n - 1) / n`` times its payload per
      device.)
    operand_bytes: bytes of its inputs on one device.
    result_bytes: bytes of its output on one device.
    unconditional: True when it runs on every call of the program: no
      ``conditional`` lies between the entry and the op.
    emitting: True when it sits inside a conditional branch, and every
      conditional on the way to it was entered through its *emitting*
      branch: the branch that does the most work of its conditional's
      branches (counting the instructions that move data, in the branch and
      every computation it calls). In an ``accumulate`` step that is the
      branch running the inner optimizer, taken once per optimizer step.
    in_loop: True when a ``while`` loop lies on the way to it (it may run
      several times per call, e.g. inside ``optax_accum.microbatch``'s scan).
    name: the instruction's name in the HLO text.
    computation: the HLO computation holding it.
    shape: its result shape, as printed in the HLO text.
    replica_groups: the groups of devices it runs across, each a tuple of
      device ids, from every form XLA prints (``{{0,1},{2,3}}``,
      ``[2,2]<=[4]``, ``mesh[...] {...}``). An id is a position in the
      compiled program's device assignment: for a ``jit`` over a
      `jax.sharding.Mesh`, an index into ``mesh.devices.flat``, not a
      ``device.id``. Empty when the op has no groups (``collective-permute``
      has source-target pairs) or they are in a form this reader does not
      know.
  """

  opcode: str
  bytes: int
  operand_bytes: int
  result_bytes: int
  unconditional: bool
  emitting: bool
  in_loop: bool
  name: str
  computation: str
  shape: str
  replica_groups: tuple[tuple[int, ...], ...] = ()


def _compile(
  step: Any, args: tuple, kwargs: dict
) -> tuple[str, jax.stages.Compiled | None]:
  """The compiled HLO text of `step` and, unless it is text, the compiled
  program (lowering and compiling as needed)."""
  lowered_types = (str, jax.stages.Lowered, jax.stages.Compiled)
  # flax.nnx's stages (``nnx.jit(f).lower(...)``, ``.compile()``) wrap
  # JAX's in a field of that name.
  for field in ("compiled", "lowered"):
    inner = getattr(step, field, None)
    if isinstance(inner, lowered_types[1:]):
      step = inner
  if isinstance(step, lowered_types) and (args or kwargs):
    raise TypeError(
      f"`step` is already lowered ({type(step).__name__}): pass no"
      f" arguments; got {len(args)} positional and keywords {sorted(kwargs)}"
    )
  if isinstance(step, str):
    return step, None
  compiled: jax.stages.Compiled
  if isinstance(step, jax.stages.Lowered):
    step = step.compile()
  if isinstance(step, jax.stages.Compiled):
    compiled = step
  elif callable(step):
    lower = getattr(step, "lower", None) or jax.jit(step).lower
    compiled = lower(*args, **kwargs).compile()
  else:
    raise TypeError(
      "`step` must be a jitted function (with its arguments), a"
      " `jax.stages.Lowered`, a `jax.stages.Compiled` or HLO text; got"
      f" {type(step).__name__}: {step!r:.80}"
    )
  text = compiled.as_text()
  if text is None:  # a backend that keeps no HLO text
    raise ValueError(
      f"`step` compiled to a program without HLO text: {step!r:.80}"
    )
  return text, compiled


def collectives(step: Any, *args: Any, **kwargs: Any) -> list[Collective]:
  """The collective ops of a compiled step, with their bytes and placement.

  Args:
    step: a jitted function (``jax.jit(f)``, ``nnx.jit(f)``; a plain
      function is jitted), called as ``step(*args, **kwargs)``; or a
      `jax.stages.Lowered` or `jax.stages.Compiled` (or ``nnx.jit``'s, then
      give no arguments); or the text of a compiled HLO module.
    *args: arguments to lower a function with (arrays or
      ``jax.ShapeDtypeStruct``\\s carrying their shardings).
    **kwargs: keyword arguments to lower a function with.

  Returns:
    A list of `Collective` records, one per op and per way the program
    reaches it, in program order.

  Examples:
    The mean over a batch sharded across devices all-reduces the partial
    sums on every call (1 KiB here; no collective at all on one device):

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from optax_accum.inspect import collectives
    >>> n = jax.device_count()  # 8 in the test suite
    >>> mesh = jax.make_mesh((n,), ("data",))
    >>> x = jax.device_put(jnp.ones((n, 256)), NamedSharding(mesh, P("data")))
    >>> ops = collectives(jax.jit(lambda x: x.mean(0)), x)
    >>> all(c.unconditional for c in ops)
    True
    >>> sum(c.bytes for c in ops if c.opcode == "all-reduce") == (
    ...   1024 if n > 1 else 0)
    True

    Its devices, by position in ``mesh.devices.flat``: one group of all:

    >>> [c.replica_groups for c in ops] == (
    ...   [(tuple(range(n)),)] if n > 1 else [])
    True
  """
  text, _ = _compile(step, args, kwargs)
  return _records(_hlo.HloModule(text))


def _records(hlo: _hlo.HloModule) -> list[Collective]:
  out = []
  for site in hlo.sites(_hlo.COLLECTIVE_OPCODES):
    inst = site.instruction
    operand, result = hlo.site_bytes(site)
    out.append(
      Collective(
        opcode=site.opcode,
        bytes=max(operand, result),
        operand_bytes=operand,
        result_bytes=result,
        unconditional=not site.path,
        emitting=bool(site.path) and all(s.heaviest for s in site.path),
        in_loop=site.in_loop,
        name=inst.name,
        computation=site.computation,
        shape=inst.shape,
        replica_groups=_groups.of_instruction(hlo, site.collective or inst),
      )
    )
  return out


def format_collectives(records: list[Collective]) -> str:
  """A plain-text table of `Collective` records, one per line.

  Args:
    records: as `collectives` returns them.

  Returns:
    The table: opcode, bytes, where it runs (every call, the emitting branch
    or another branch), whether in a loop, its groups (``2x4``: 2 groups of
    4 devices; empty for ops without groups) and its name.

  Examples:
    >>> from optax_accum.inspect import Collective
    >>> print(format_collectives([Collective("all-reduce", 4096, 4096, 4096,
    ...   True, False, False, "all-reduce.1", "main", "f32[1024]",
    ...   ((0, 1, 2, 3), (4, 5, 6, 7)))]))
    opcode      bytes  where       loop  groups  name
    all-reduce  4096   every call        2x4     all-reduce.1
  """
  return _table(records)


def _table(records: list[Collective], axes: Sequence[str] = ()) -> str:
  """`format_collectives`, with a column of mesh axes when `axes` holds one
  entry per record."""
  header: tuple[str, ...] = (
    "opcode",
    "bytes",
    "where",
    "loop",
    "groups",
    "name",
  )
  rows: list[tuple[str, ...]] = [
    (
      c.opcode,
      str(c.bytes),
      "every call"
      if c.unconditional
      else ("emitting branch" if c.emitting else "other branch"),
      "yes" if c.in_loop else "",
      _groups.describe(c.replica_groups) if c.replica_groups else "",
      c.name,
    )
    for c in records
  ]
  if axes:
    header = (*header[:5], "mesh axes", header[5])
    rows = [(*r[:5], a, r[5]) for r, a in zip(rows, axes, strict=True)]
  widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
  return "\n".join(
    "  ".join(
      cell.ljust(w) for cell, w in zip(row, widths, strict=True)
    ).rstrip()
    for row in (header, *rows)
  )


def assert_reduction_deferred(
  step: Any,
  *args: Any,
  min_bytes: int | None = None,
  axis_name: str | Sequence[str] | None = None,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  **kwargs: Any,
) -> list[Collective]:
  """Asserts that a step reduces its gradient only in the emitting branch.

  Fails when a reduction (``all-reduce`` or ``reduce-scatter``) of at least
  `min_bytes` bytes runs outside the emitting branch (see `Collective`):
  on every call, or in a branch that holds. With
  ``accumulate(inner, k, axis_name=...)`` the gradient is reduced once per
  optimizer step, inside the branch that runs ``inner``; a step that reduces
  every micro-batch (the usual ``jit`` data-parallel step) fails.

  With `axis_name`, only reductions across that mesh axis count: those with
  a device group holding two devices whose mesh coordinates differ along
  it. Under HSDP (params sharded over ``fsdp`` inside a slice, replicated
  over ``replica`` across slices) the gradient is reduce-scattered over
  ``fsdp`` on every micro-step and all-reduced over ``replica`` once per
  optimizer step: check it with ``axis_name="replica"``. A reduction whose
  groups cannot be read counts.

  The check reads the program's structure, not how often it runs: a step
  whose whole body sits in a user's own ``lax.cond`` would look deferred.

  Args:
    step: as for `collectives`.
    *args: as for `collectives`.
    min_bytes: the smallest reduction, in bytes on one device, that counts
      as a gradient reduction; default `DEFAULT_MIN_BYTES` (1024). Give the
      bytes of your smallest parameter to check every one of them.
    axis_name: a mesh axis name, or several (a reduction across any of them
      counts); None (default) counts every reduction.
    mesh: the mesh `axis_name` names an axis of. Default: the mesh set with
      ``jax.set_mesh``, else the mesh of the arguments' ``NamedSharding``s
      (also those a `jax.stages.Lowered` or `jax.stages.Compiled` was
      compiled with). Only read with `axis_name`. A step given as HLO text
      has no arguments: its device ids are taken as indices into
      ``mesh.devices.flat``, the device order of a ``jit`` over `mesh`.
    **kwargs: as for `collectives`.

  Returns:
    The step's collectives (`collectives`), when the check passes.

  Raises:
    AssertionError: listing the offending collectives in a table.
    ValueError: when `axis_name` is given and no mesh is found, or the mesh
      has no such axis, or it does not hold the step's devices.

  Examples:
    A step that reduces its gradient on every call fails (on more than one
    device; the error lists the offending ops):

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from optax_accum.inspect import assert_reduction_deferred
    >>> n = jax.device_count()  # 8 in the test suite
    >>> mesh = jax.make_mesh((n,), ("data",))
    >>> x = jax.device_put(jnp.ones((n, 256)), NamedSharding(mesh, P("data")))
    >>> try:
    ...   _ = assert_reduction_deferred(jax.jit(lambda x: x.mean(0)), x)
    ...   failed = False
    ... except AssertionError as e:
    ...   failed = "every call" in str(e)
    >>> failed == (n > 1)
    True

    Reductions over the other axes of a mesh pass with `axis_name`: here
    the sum runs over ``fsdp`` only, not across ``replica``:

    >>> if n == 8:
    ...   hsdp = jax.make_mesh((2, 4), ("replica", "fsdp"))
    ...   y = jax.device_put(
    ...     jnp.ones((8, 256)), NamedSharding(hsdp, P(("replica", "fsdp"))))
    ...   sum_fsdp = jax.jit(lambda y: y.reshape(2, 4, 256).sum(1))
    ...   _ = assert_reduction_deferred(sum_fsdp, y, axis_name="replica")
  """
  if min_bytes is None:
    min_bytes = DEFAULT_MIN_BYTES
  if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
    raise TypeError(
      f"`min_bytes` must be an int or None; got {type(min_bytes).__name__}:"
      f" {min_bytes!r}"
    )
  names = axis_names(axis_name)
  if mesh is not None and not isinstance(
    mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)
  ):
    raise TypeError(
      "`mesh` must be a jax.sharding.Mesh or AbstractMesh; got"
      f" {type(mesh).__name__}: {mesh!r:.80}"
    )
  if mesh is not None and not names:
    raise ValueError(
      "`mesh` is only read with `axis_name`: pass the mesh axis to check as"
      f" `axis_name`; got axis_name=None and mesh={mesh!r:.80}"
    )
  text, compiled = _compile(step, args, kwargs)
  hlo = _hlo.HloModule(text)
  records = _records(hlo)
  reductions = [
    c
    for c in records
    if c.opcode in REDUCTION_OPCODES and c.bytes >= min_bytes and not c.emitting
  ]
  axes = None
  if names:
    axes = mesh_axes_of(records, hlo, compiled, axis_name, mesh)
    reductions = [c for c in reductions if set(names) & set(axes[c])]
  if reductions:
    over = f" across mesh axis {' or '.join(map(repr, names))}" if names else ""
    columns = [", ".join(axes[c]) for c in records] if axes else ()
    offending = [", ".join(axes[c]) for c in reductions] if axes else ()
    raise AssertionError(
      f"{len(reductions)} reduction(s) of >= {min_bytes} bytes{over} run"
      " outside the emitting branch, so they are not deferred to the end of"
      " the cycle:\n"
      + _table(reductions, offending)
      + "\n\nAll collectives of the step:\n"
      + _table(records, columns)
    )
  return records


def axis_names(axis_name: Any) -> tuple[str, ...]:
  """`axis_name` as a tuple of names (empty for None)."""
  if axis_name is None:
    return ()
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  if (
    not isinstance(names, (tuple, list))
    or not names
    or not all(isinstance(n, str) for n in names)
  ):
    raise TypeError(
      "`axis_name` must be a mesh axis name, a non-empty tuple of them, or"
      f" None; got {type(axis_name).__name__}: {axis_name!r}"
    )
  return tuple(names)


def _find_mesh(
  mesh: Any, axis_name: Any, compiled: jax.stages.Compiled | None
) -> Any:
  """The mesh `axis_name` names axes of: `mesh`, else the one set with
  ``jax.set_mesh``, else the arguments' (see `assert_reduction_deferred`)."""
  names = axis_names(axis_name)
  source = "`mesh`"
  if mesh is None:
    source = "jax.set_mesh"
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
      mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    source = "the arguments' NamedShardings"
    found = []
    for sharding in _shardings(compiled):
      if isinstance(sharding, jax.sharding.NamedSharding):
        if sharding.mesh not in found:
          found.append(sharding.mesh)
    if len(found) > 1:
      raise ValueError(
        f"`axis_name`={axis_name!r} is ambiguous: the step's arguments are on"
        f" {len(found)} meshes ({', '.join(map(repr, found))}); pass the one"
        " to check as `mesh=`."
      )
    if not found:
      raise ValueError(
        f"`axis_name`={axis_name!r} needs a mesh to read the step's device groups"
        " against, and none was found: pass `mesh=`, call inside"
        " `with jax.set_mesh(mesh):`, or give arguments with NamedShardings"
        f" (got mesh=None and {type(compiled).__name__ if compiled else 'HLO text'}"
        " without them)."
      )
    mesh = found[0]
  missing = [n for n in names if n not in mesh.axis_names]
  if missing:
    raise ValueError(
      f"`axis_name` {missing[0]!r} is not an axis of the mesh (from"
      f" {source}), whose axes are {tuple(mesh.axis_names)}; got"
      f" axis_name={axis_name!r} and mesh={mesh!r:.120}"
    )
  return mesh


def _shardings(compiled: jax.stages.Compiled | None) -> list[Any]:
  """The shardings of a compiled step's inputs, then its outputs."""
  if compiled is None:
    return []
  return jax.tree.leaves(
    (compiled.input_shardings, compiled.output_shardings),
    is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
  )


def _coordinates(
  mesh: Any, compiled: jax.stages.Compiled | None, hlo: _hlo.HloModule
) -> list[tuple[int, ...]]:
  """Mesh coordinates of each device id of the step's HLO.

  An HLO device id is a position in the executable's device assignment,
  which ``jit`` takes from its shardings (all on one device order; for a
  `jax.sharding.Mesh`, ``mesh.devices.flat``). Through those devices the ids
  map onto `mesh` even when its device order is not the arguments'. Without
  shardings (HLO text, an `AbstractMesh`), the ids are taken as indices
  into the mesh's device order.
  """
  count = hlo.replica_count * hlo.num_partitions
  shape = tuple(mesh.axis_sizes)
  order = None
  for sharding in _shardings(compiled):
    # Sharding._device_assignment: the device order the executable uses (no
    # public property gives it, device_set is unordered).
    order = getattr(sharding, "_device_assignment", None)
    if order is not None:
      break
  if order is not None and isinstance(mesh, jax.sharding.Mesh):
    where = {d: tuple(map(int, i)) for i, d in np.ndenumerate(mesh.devices)}
    missing = [d for d in order if d not in where]
    if missing:
      raise ValueError(
        f"the step runs on devices {missing[:4]} that the mesh does not hold:"
        " pass the mesh the step is compiled on as `mesh=`; got"
        f" mesh={mesh!r:.120}"
      )
    return [where[d] for d in order]
  if count > math.prod(shape):
    raise ValueError(
      f"the step runs on {count} devices but the mesh has {math.prod(shape)}:"
      f" pass the mesh the step is compiled on as `mesh=`; got"
      f" mesh={mesh!r:.120}"
    )
  return [tuple(map(int, np.unravel_index(i, shape))) for i in range(count)]


def mesh_axes_of(
  records: list[Collective],
  hlo: _hlo.HloModule,
  compiled: jax.stages.Compiled | None,
  axis_name: Any,
  mesh: Any = None,
) -> dict[Collective, tuple[str, ...]]:
  """The mesh axes each of `records` spans (every axis for a reduction whose
  groups cannot be read), on `mesh` or the one `_find_mesh` finds for
  `axis_name`."""
  mesh = _find_mesh(mesh, axis_name, compiled)
  coordinates = _coordinates(mesh, compiled, hlo)
  return {c: _axes_of(c, mesh, coordinates) for c in records}


def _axes_of(
  record: Collective, mesh: Any, coordinates: list[tuple[int, ...]]
) -> tuple[str, ...]:
  """The mesh axes a collective's groups span; every axis when its groups
  are unknown, so that an unreadable reduction counts."""
  if not record.replica_groups:
    return tuple(mesh.axis_names) if record.opcode in REDUCTION_OPCODES else ()
  try:
    spanned = _groups.spanned_axes(record.replica_groups, coordinates)
  except IndexError as e:
    raise ValueError(
      f"{record.name}'s groups {record.replica_groups} name a device the mesh"
      f" does not have ({len(coordinates)} devices): pass the mesh the step"
      " is compiled on as `mesh=`"
    ) from e
  return tuple(n for i, n in enumerate(mesh.axis_names) if i in spanned)
