"""Replica groups of HLO collectives: which devices each op runs across.

XLA prints a collective's groups in one of three forms (``replica_groups=``
in the instruction's attributes):

* a list of lists, ``{{0,1,2,3},{4,5,6,7}}``; ``{}`` is one group of every
  device. ``shard_map``'s ``psum`` / ``psum_scatter`` / ``all_gather`` print
  this form up to jax 0.10 (the mesh form below from jax 0.12).
* an iota list, ``[2,4]<=[8]``: 2 groups of 4, read row by row from
  ``iota(8)``; ``[4,2]<=[2,4]T(1,0)`` reads them from
  ``iota(8).reshape(2, 4).transpose(1, 0)``. The SPMD partitioner printed
  this form before XLA's mesh form (and still does with
  ``xla_enable_rgv3_materialization=false``).
* a mesh and the axes each group runs along: ``mesh['axis_0'=2,'axis_1'=4]
  {'axis_1'}`` is 2 groups of 4 over a row-major ``iota(8)`` mesh;
  ``, device_ids=([2,4]T(1,0))`` (an iota array as above) or
  ``, device_ids=(3,1,0,2)`` gives the mesh's devices when they are not
  ``iota(n)``; an axis ``'a':(2)4`` is the sub-axis of size 4 after a major
  part of size 2 (Shardy's sub-axes). XLA's partitioner prints this form for
  the collectives it inserts under ``jit``, on CPU, GPU and TPU alike. With
  jax 0.10's XLA its mesh is its own (axes ``axis_0``, ``axis_1``, ...), not
  the user's; with jax 0.12's it is the user's mesh, in that mesh's device
  order (``mesh['replica'=2,'fsdp'=4] {'fsdp'}``), for ``shard_map``'s
  collectives too.

The ids in a group mean what the op's *group mode* says (XLA's
``CollectiveOpGroupMode``, from ``channel_id`` and
``use_global_device_ids``): replica ids, partition ids, or flattened ids
``replica * num_partitions + partition``. `device_groups` turns every mode
into flattened ids: positions in the executable's device assignment, which
for a ``jit`` over a mesh is the mesh's device order (``mesh.devices.flat``),
not ``device.id``.
"""

import math
import re

import numpy as np

from optax_accum.inspect._hlo import HloModule, Instruction, balanced_end

Groups = tuple[tuple[int, ...], ...]

_INTS = re.compile(r"-?\d+")
_ATTRIBUTE = re.compile(r"\breplica_groups=")
_IOTA = re.compile(r"\[([\d,\s]*)\]<=\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?")
_LIST = re.compile(r"\{\s*((?:\{[\d,\s]*\}\s*,?\s*)*)\}")
_MAXIMAL = re.compile(r"maximal_mesh\[device_id=(\d+)\]")
# A mesh axis name: quoted (current XLA: 'axis_0', any characters but a
# quote) or bare (older XLA and XLA's own tests).
_NAME = r"'[^']*'|[^\s=,:'\[\]{}()]+"
_AXIS_SIZE = re.compile(rf"\s*({_NAME})\s*=\s*(\d+)\s*")
_AXIS_REF = re.compile(rf"\s*({_NAME})(?::\((\d+)\)(\d+))?\s*")
_DEVICE_IDS = re.compile(r",\s*device_ids=\(")

# Opcodes whose instruction has a use_global_device_ids field (its absence
# means false); the others (all-to-all, collective-broadcast, ...) have none.
_GLOBAL_ID_OPCODES = ("all-reduce", "reduce-scatter", "all-gather")


def parse(attributes: str) -> Groups | None:
  """The replica groups of an instruction, as printed (ids in the op's mode).

  Args:
    attributes: the instruction's text after its operands (or the whole
      line).

  Returns:
    The groups, each a tuple of ids; ``()`` for ``replica_groups={}`` (one
    group of every device, see `device_groups`); None when the text has no
    ``replica_groups=`` or it is in a form this reader does not know.

  Examples:
    >>> parse("replica_groups={{0,1},{2,3}}, to_apply=%add")
    ((0, 1), (2, 3))
    >>> parse("replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true")
    ((0, 4), (1, 5), (2, 6), (3, 7))
    >>> parse("replica_groups=mesh['x'=2,'y'=4] {'x'}")
    ((0, 4), (1, 5), (2, 6), (3, 7))
  """
  found = _ATTRIBUTE.search(attributes)
  if found is None:
    return None
  start = found.end()
  text = attributes[start:]
  if text.startswith("{"):
    listed = _LIST.match(text)
    if listed is None:
      return None
    return tuple(
      tuple(int(i) for i in _INTS.findall(group))
      for group in re.findall(r"\{([\d,\s]*)\}", listed.group(1))
    )
  if text.startswith("["):
    iota = _IOTA.match(text)
    if iota is None:
      return None
    shape, reshape, perm = (_ints(g) for g in iota.groups())
    ids = _iota_array(reshape, perm)
    if math.prod(shape) != ids.size or len(shape) != 2:
      return None
    return _rows(ids.reshape(shape))
  if text.startswith("maximal_mesh["):
    maximal = _MAXIMAL.match(text)
    return ((int(maximal.group(1)),),) if maximal else None
  if text.startswith("mesh["):
    return _mesh_groups(text)
  return None


def group_mode(opcode: str, attributes: str) -> str:
  """How an op's group ids read (XLA's ``GetCollectiveOpGroupMode``).

  Args:
    opcode: the instruction's opcode (``all-reduce``, ``all-to-all``, ...).
    attributes: its text after the operands (or the whole line).

  Returns:
    ``"cross_replica"`` (no ``channel_id``: replica ids),
    ``"cross_partition"`` (``channel_id`` on an op without
    ``use_global_device_ids``: partition ids), ``"cross_replica_and_partition"``
    (``channel_id``, ``use_global_device_ids=false``: replica ids, every
    partition of each) or ``"flattened_id"`` (both: flattened ids).

  Examples:
    >>> group_mode("all-reduce", "channel_id=1, replica_groups={{0,1}},"
    ...            " use_global_device_ids=true")
    'flattened_id'
    >>> group_mode("all-to-all", "channel_id=2, replica_groups={{0,1}}")
    'cross_partition'
  """
  if not re.search(r"\bchannel_id=", attributes):
    return "cross_replica"
  base = opcode.removesuffix("-start")
  if base not in _GLOBAL_ID_OPCODES:
    return "cross_partition"
  if re.search(r"\buse_global_device_ids=true\b", attributes):
    return "flattened_id"
  return "cross_replica_and_partition"


def device_groups(
  groups: Groups, *, mode: str, replicas: int, partitions: int
) -> Groups:
  """Groups of flattened device ids (``replica * partitions + partition``).

  Args:
    groups: as `parse` returns them; ``()`` means one group of every id.
    mode: as `group_mode` returns it.
    replicas: the module's ``replica_count``.
    partitions: the module's ``num_partitions``.

  Examples:
    Under ``jit`` (one replica) a cross-replica-and-partition group of
    replica 0 holds every partition:

    >>> device_groups(((0,),), mode="cross_replica_and_partition",
    ...               replicas=1, partitions=4)
    ((0, 1, 2, 3),)
  """
  if mode == "flattened_id":
    return groups or (tuple(range(replicas * partitions)),)
  if mode == "cross_partition":
    groups = groups or (tuple(range(partitions)),)
    return tuple(
      tuple(r * partitions + p for p in group)
      for r in range(replicas)
      for group in groups
    )
  groups = groups or (tuple(range(replicas)),)
  if mode == "cross_replica":
    return tuple(
      tuple(r * partitions + p for r in group)
      for p in range(partitions)
      for group in groups
    )
  return tuple(
    tuple(r * partitions + p for r in group for p in range(partitions))
    for group in groups
  )


def spanned_axes(groups: Groups, coordinates) -> set[int]:
  """The mesh axes some group spans: it holds two devices whose coordinates
  differ along that axis.

  Args:
    groups: groups of flattened device ids.
    coordinates: flattened id -> that device's mesh coordinates (a tuple).

  Examples:
    >>> coords = [(r, f) for r in range(2) for f in range(4)]
    >>> sorted(spanned_axes(((0, 1, 2, 3), (4, 5, 6, 7)), coords))
    [1]
    >>> sorted(spanned_axes(((0, 4), (1, 5), (2, 6), (3, 7)), coords))
    [0]
  """
  spanned = set()
  for group in groups:
    points = [coordinates[i] for i in group]
    for axis in range(len(points[0]) if points else 0):
      if len({p[axis] for p in points}) > 1:
        spanned.add(axis)
  return spanned


def describe(groups: Groups) -> str:
  """``2x4`` for 2 groups of 4 devices; ``{0,1},{2,3,4}`` when sizes
  differ; ``?`` for groups that could not be read."""
  if not groups:
    return "?"
  sizes = {len(g) for g in groups}
  if len(sizes) == 1:
    return f"{len(groups)}x{sizes.pop()}"
  return ",".join("{" + ",".join(map(str, g)) + "}" for g in groups)


def _ints(text: str | None) -> list[int]:
  return [int(i) for i in _INTS.findall(text or "")]


def _rows(array: np.ndarray) -> Groups:
  return tuple(tuple(int(i) for i in row) for row in array)


def _iota_array(reshape: list[int], perm: list[int]) -> np.ndarray:
  """``iota(prod(reshape)).reshape(reshape).transpose(perm)``, flat."""
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  return ids.transpose(perm or range(len(reshape))).ravel()


def _mesh_groups(text: str) -> Groups | None:
  """Groups of ``mesh[...](, device_ids=(...))? {axes}`` (XLA's
  ``MeshAxesReplicaGroupList``)."""
  names, sizes = [], []
  pos = len("mesh[")
  while pos < len(text) and text[pos] != "]":
    axis = _AXIS_SIZE.match(text, pos)
    if axis is None:
      return None
    names.append(axis.group(1).strip("'"))
    sizes.append(int(axis.group(2)))
    pos = axis.end() + (text[axis.end() : axis.end() + 1] == ",")
  pos += 1
  devices = np.arange(math.prod(sizes))
  listed = _DEVICE_IDS.match(text, pos)
  if listed is not None:
    end = balanced_end(text, listed.end() - 1)
    inside = text[listed.end() : end - 1]
    if inside.startswith("["):
      dims, _, perm = inside.partition("T")
      devices = _iota_array(_ints(dims), _ints(perm))
    else:
      devices = np.array(_ints(inside))
    pos = end
  if devices.size != math.prod(sizes):
    return None
  opening = re.compile(r"\s*\{").match(text, pos)
  if opening is None:
    return None
  pos = opening.end()
  refs = []  # (mesh axis index, pre-size or None, size)
  while pos < len(text) and text[pos] != "}":
    ref = _AXIS_REF.match(text, pos)
    if ref is None or ref.group(1).strip("'") not in names:
      return None
    index = names.index(ref.group(1).strip("'"))
    if ref.group(2) is None:
      refs.append((index, 1, sizes[index]))
    else:
      refs.append((index, int(ref.group(2)), int(ref.group(3))))
    pos = ref.end() + (text[ref.end() : ref.end() + 1] == ",")
  return _along(devices.reshape(sizes), refs)


def _along(devices: np.ndarray, refs: list[tuple[int, int, int]]) -> Groups:
  """Groups of a mesh's devices along (sub-)axes, in `refs` order.

  Each mesh axis is split into its referenced sub-axes (``pre`` = the size
  of its major part before the sub-axis) and the parts between them; the
  device array is reshaped to those factors, the factors not grouped are
  moved to the front, and each group is one row of what is left.
  """
  factors, grouped = [], {}
  for axis, size in enumerate(devices.shape):
    prefix = 1
    for ref_index, (_, pre, sub) in sorted(
      ((i, r) for i, r in enumerate(refs) if r[0] == axis),
      key=lambda item: item[1][1],
    ):
      if pre != prefix:
        factors.append(pre // prefix)
        prefix = pre
      grouped[ref_index] = len(factors)
      factors.append(sub)
      prefix *= sub
    if prefix != size:
      factors.append(size // prefix)
  kept = [f for f in range(len(factors)) if f not in grouped.values()]
  order = kept + [grouped[i] for i in range(len(refs))]
  per_group = math.prod(factors[grouped[i]] for i in range(len(refs)))
  regrouped = devices.reshape(factors).transpose(order)
  return _rows(regrouped.reshape(-1, per_group))


def of_instruction(hlo: HloModule, instruction: Instruction) -> Groups:
  """An instruction's device groups, as flattened device ids
  (``replica * num_partitions + partition``: positions in the executable's
  device assignment); ``()`` when it has none or they cannot be read."""
  groups = parse(instruction.attributes)
  if groups is None:
    return ()
  return device_groups(
    groups,
    mode=group_mode(instruction.opcode, instruction.attributes),
    replicas=hlo.replica_count,
    partitions=hlo.num_partitions,
  )
