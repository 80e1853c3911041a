"""A reader of optimized HLO text: computations, call edges, collectives.

``jax.jit(f).lower(*args).compile().as_text()`` prints the program XLA runs:
named computations, one ``ENTRY``, and instructions such as::

  %all-reduce.2 = (f32[8]{0}, f32[8,16]{1,0}) all-reduce(%a, %b), ...
  %conditional = (...) conditional(%p, %x, %y),
      branch_computations={%hold, %emit}, ...

A computation is entered either through a *call* edge (``calls=``,
``to_apply=``, a loop's ``body=`` / ``condition=``), which runs whenever its
caller runs, or through a *branch* edge of a ``conditional``
(``branch_computations=`` or ``true_computation=`` / ``false_computation=``),
which runs only when that branch is taken. Code reachable from the entry by
call edges alone runs on every call of the program: it is *unconditional*.

A collective's device groups are read by :mod:`optax_accum.inspect._groups`,
in the module's ids (``replica_count`` and ``num_partitions`` from its
header).

This module reads only what the structure tests, the benchmarks and
`optax_accum.inspect.collectives` need; it is not a full HLO parser.
"""

import dataclasses
import re
from collections.abc import Iterable

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALL_KEYS = re.compile(
  r"\b(to_apply|calls|body|condition)=(\{[^}]*\}|%?[\w.\-]+)"
)
_BRANCH_LIST = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"\b(true|false)_computation=%?([\w.\-]+)")
_NAME = re.compile(r"%?([\w.\-]+)")
_MODULE_COUNT = re.compile(r"\b(replica_count|num_partitions)=(\d+)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")

# Bytes per element of HLO element types; others are sized from their bits.
_ITEMSIZE = {"pred": 1, "token": 0, "s4": 1, "u4": 1, "f4e2m1fn": 1}

# Instructions that move no data: a branch made of these does no work.
FREE_OPCODES = frozenset(
  {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}
)

# Ops that pass their operand's data on unchanged, only re-described.
_SAME_DATA = frozenset({"bitcast", "copy", "reshape"})

# Collective opcodes; an async pair ("-start" / "-done") counts once, as its
# "-start" under the synchronous name.
COLLECTIVE_OPCODES = frozenset(
  {
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "collective-permute",
    "collective-broadcast",
    "all-to-all",
    "ragged-all-to-all",
  }
)


def element_bytes(dtype: str) -> int:
  """Bytes of one element of an HLO element type (``f32`` -> 4)."""
  if dtype in _ITEMSIZE:
    return _ITEMSIZE[dtype]
  bits = re.search(r"\d+", dtype)
  return -(-int(bits.group()) // 8) if bits else 0


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The arrays of an HLO shape: ``(f32[8]{0}, s32[])`` ->
  ``[("f32", (8,)), ("s32", ())]``."""
  return [
    (dtype, tuple(int(d) for d in dims.split(",") if d))
    for dtype, dims in _ARRAY.findall(shape)
  ]


def shape_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape (``(f32[8]{0}, s32[])`` -> 36)."""
  total = 0
  for dtype, dims in array_shapes(shape):
    size = 1
    for d in dims:
      size *= d
    total += size * element_bytes(dtype)
  return total


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction.

  Attributes:
    name: the instruction's name, without ``%``.
    shape: its result shape, as printed (``f32[8,16]{1,0}``, or a tuple).
    opcode: ``add``, ``all-reduce``, ``conditional``, ...
    operands: names of its operands.
    calls: computations it calls unconditionally (fusions, reducers, loops).
    branches: branch computations, in branch-index order (for a predicate
      conditional: false, then true, as ``lax.cond`` orders them).
    line: the instruction's text.
    attributes: the text after its operands (``channel_id=1,
      replica_groups=...``).
  """

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  calls: tuple[str, ...]
  branches: tuple[str, ...]
  line: str
  attributes: str = ""

  @property
  def is_root(self) -> bool:
    """Whether it is its computation's ``ROOT``."""
    return self.line.lstrip().startswith("ROOT ")


def parse_instruction(line: str) -> Instruction | None:
  """An `Instruction` from one line of HLO text; None for other lines."""
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, rest = match.groups()
  if rest.startswith("("):
    end = balanced_end(rest, 0)
    shape, tail = rest[:end], rest[end:].lstrip()
  else:
    shape, _, tail = rest.partition(" ")
  opcode, paren, _ = tail.partition("(")
  if not paren or not re.fullmatch(r"[a-z][a-z0-9\-]*", opcode):
    return None
  open_at = len(opcode)
  close_at = balanced_end(tail, open_at)
  inside = tail[open_at + 1 : close_at - 1]
  operands = tuple(_operand_name(op) for op in _split_top_level(inside) if op)
  attributes = tail[close_at:]
  calls = tuple(
    callee
    for _, value in _CALL_KEYS.findall(attributes)
    for callee in _NAME.findall(value)
  )
  branch_list = _BRANCH_LIST.search(attributes)
  if branch_list:
    branches = tuple(_NAME.findall(branch_list.group(1)))
  else:
    by_value = dict(_TRUE_FALSE.findall(attributes))
    branches = tuple(by_value[v] for v in ("false", "true") if v in by_value)
  return Instruction(
    name, shape, opcode, operands, calls, branches, line, attributes
  )


def _operand_name(text: str) -> str:
  """``%x`` or ``f32[8]{0} %x`` -> ``x``."""
  named = re.findall(r"%([\w.\-]+)", text)
  return named[-1] if named else text.strip()


def _split_top_level(text: str) -> list[str]:
  parts, depth, start = [], 0, 0
  for i, char in enumerate(text):
    depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(char, 0)
    if char == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return parts


@dataclasses.dataclass(frozen=True)
class BranchStep:
  """One conditional entered on the way from the entry to some code.

  Attributes:
    conditional: the ``conditional`` instruction's name.
    index: the branch taken (0-based, in ``branch_computations`` order).
    branches: all branch computations of that conditional.
    heaviest: whether the branch taken does the most work of its
      conditional's branches (`HloModule.work`); ties count for every tied
      branch.
  """

  conditional: str
  index: int
  branches: tuple[str, ...]
  heaviest: bool


@dataclasses.dataclass(frozen=True)
class Site:
  """Where an instruction runs: its computation and how it is reached.

  Attributes:
    instruction: the instruction.
    computation: the computation holding it.
    path: the conditionals entered from the entry to it, outermost first;
      empty when the instruction runs on every call.
    in_loop: whether a ``while`` body or condition is on the way to it.
    collective: for a fusion that is one collective (XLA:TPU's
      reduce-scatter, see `HloModule.fused_reduce_scatters`), the collective
      instruction inside it, which holds the op's replica groups; None
      otherwise.
  """

  instruction: Instruction
  computation: str
  path: tuple[BranchStep, ...]
  in_loop: bool
  collective: Instruction | None = None

  @property
  def opcode(self) -> str:
    """The collective the site runs: its synchronous opcode
    (``all-reduce-start`` -> ``all-reduce``), ``reduce-scatter`` for a
    reduce-scatter fusion."""
    if self.collective is not None:
      return "reduce-scatter"
    return self.instruction.opcode.removesuffix("-start")


class HloModule:
  """The computations of an optimized HLO module and the edges between them.

  Attributes:
    entry: the name of the ``ENTRY`` computation.
    computations: computation name -> its instructions, in text order.
    replica_count: the module's replicas (``replica_count=``, default 1).
    num_partitions: its partitions (``num_partitions=``, default 1); a
      ``jit`` over n devices has 1 replica and n partitions.
    fused_reduce_scatters: computation called by a ``fusion`` -> the
      all-reduce in it, for computations that all-reduce their input and
      return a ``dynamic-slice`` of the result (XLA:TPU's
      ``all-reduce-scatter`` fusions, which run as one reduce-scatter).
  """

  def __init__(self, text: str):
    self.computations: dict[str, list[Instruction]] = {}
    self._work: dict[str, int] = {}
    entry: str | None = None
    self.replica_count = self.num_partitions = 1
    current = None
    for line in text.splitlines():
      if line.startswith("HloModule "):
        counts = dict(_MODULE_COUNT.findall(line))
        self.replica_count = int(counts.get("replica_count", 1))
        self.num_partitions = int(counts.get("num_partitions", 1))
      elif current is None:
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
          current = header.group(2)
          self.computations[current] = []
          if header.group(1):
            entry = current
      elif line.strip() == "}":
        current = None
      else:
        instruction = parse_instruction(line)
        if instruction is not None:
          self.computations[current].append(instruction)
    if entry is None:
      raise ValueError(
        "no ENTRY computation in the HLO text: pass the text of a compiled"
        " module (`jax.jit(f).lower(*args).compile().as_text()`)."
      )
    self.entry: str = entry
    self.fused_reduce_scatters = {
      callee: reduction
      for instructions in self.computations.values()
      for i in instructions
      if i.opcode == "fusion"
      for callee in i.calls
      if (reduction := self._sliced_all_reduce(callee)) is not None
    }

  def _sliced_all_reduce(self, name: str) -> Instruction | None:
    """The all-reduce whose result computation `name` returns a slice of.

    XLA:TPU prints a reduce-scatter it runs as one op (its
    ``SingleInputAllReduceScatterFusion`` emitter) as a fusion of an
    all-reduce of the (padded) input and a ``dynamic-slice`` of the result:
    read alone, the all-reduce would count the whole padded input as
    reduced on every device.
    """
    if not self._known(name):
      return None
    body = {i.name: i for i in self.computations[name]}
    root = next((i for i in body.values() if i.is_root), None)
    if root is None or root.opcode != "dynamic-slice" or not root.operands:
      return None
    source = body.get(root.operands[0])
    while (
      source is not None and source.opcode in _SAME_DATA and source.operands
    ):
      source = body.get(source.operands[0])
    if source is not None and source.opcode == "all-reduce":
      return source
    return None

  # --- The call graph. ------------------------------------------------------

  def calls(self, name: str) -> set[str]:
    """Computations `name` calls outside conditional branches."""
    return {
      c for i in self.computations[name] for c in i.calls if self._known(c)
    }

  def branches(self, name: str) -> set[str]:
    """Branch computations of the conditionals in `name`."""
    return {
      b for i in self.computations[name] for b in i.branches if self._known(b)
    }

  def _known(self, name: str) -> bool:
    return name in self.computations

  def reachable(
    self, roots: Iterable[str], *, through_branches: bool
  ) -> set[str]:
    """Computations reachable from `roots` (included) by call edges, and
    by branch edges too when `through_branches`."""
    seen, todo = set(), list(roots)
    while todo:
      name = todo.pop()
      if name in seen or not self._known(name):
        continue
      seen.add(name)
      todo += self.calls(name)
      if through_branches:
        todo += self.branches(name)
    return seen

  def unconditional(self) -> set[str]:
    """Computations that run on every call: reachable without a branch."""
    return self.reachable([self.entry], through_branches=False)

  def conditionals(self) -> list[list[str]]:
    """The branch lists of the conditionals that run on every call."""
    return [
      list(i.branches)
      for name in sorted(self.unconditional())
      for i in self.computations[name]
      if i.branches
    ]

  def conditional_branches(self) -> list[str]:
    """Branch computations of the conditionals that run on every call."""
    return [b for branches in self.conditionals() for b in branches]

  # --- What the computations hold. ------------------------------------------

  def opcodes(self, name: str) -> list[str]:
    """The opcodes of `name`'s instructions."""
    return [i.opcode for i in self.computations[name]]

  def with_opcode(self, opcodes: Iterable[str]) -> set[str]:
    """Computations holding an instruction with one of `opcodes`."""
    wanted = set(opcodes)
    return {n for n in self.computations if wanted & set(self.opcodes(n))}

  def work(self, name: str) -> int:
    """Instructions that move data (not in `FREE_OPCODES`) that running
    `name` may execute: its own, and those of every computation it reaches
    through calls and branches."""
    if name not in self._work:
      self._work[name] = sum(
        i.opcode not in FREE_OPCODES
        for c in self.reachable([name], through_branches=True)
        for i in self.computations[c]
      )
    return self._work[name]

  def sites(self, opcodes: Iterable[str]) -> list[Site]:
    """Every way the entry reaches an instruction with one of `opcodes`.

    A computation reached along several paths (say, a reducer shared by two
    conditionals) yields one `Site` per path. A ``-start`` opcode of an async
    pair matches its synchronous name (``all-reduce-start`` for
    ``all-reduce``).
    """
    wanted = set(opcodes)
    out = []

    def visit(name, path, in_loop, seen):
      if name in seen or not self._known(name):
        return
      seen = seen | {name}
      fused = self.fused_reduce_scatters.get(name)
      for inst in self.computations[name]:
        # A reduce-scatter fusion is reported at the fusion, once.
        if inst.opcode.removesuffix("-start") in wanted and inst is not fused:
          out.append(Site(inst, name, path, in_loop))
        for callee in inst.calls if inst.opcode == "fusion" else ():
          inner = self.fused_reduce_scatters.get(callee)
          if inner is not None and "reduce-scatter" in wanted:
            out.append(Site(inst, name, path, in_loop, collective=inner))
        loop = inst.opcode == "while"
        for callee in inst.calls:
          visit(callee, path, in_loop or loop, seen)
        weights = [self.work(b) if self._known(b) else 0 for b in inst.branches]
        for index, branch in enumerate(inst.branches):
          step = BranchStep(
            inst.name, index, inst.branches, weights[index] == max(weights)
          )
          visit(branch, (*path, step), in_loop, seen)

    visit(self.entry, (), False, frozenset())
    return out

  def site_bytes(self, site: Site) -> tuple[int, int]:
    """(operand bytes, result bytes) of the collective at `site`.

    For a reduce-scatter fusion: the bytes of the fusion's operands that
    reach its all-reduce (before the padding the fusion adds) and of the
    fusion's result, the scattered shard.
    """
    inst, computation = site.instruction, site.computation
    if site.collective is None:
      return (
        self.operand_bytes(computation, inst),
        self.result_bytes(computation, inst),
      )
    callee = next(c for c in inst.calls if c in self.fused_reduce_scatters)
    body = {i.name: i for i in self.computations[callee]}
    shapes = {i.name: i.shape for i in self.computations[computation]}
    operand = 0
    for name in site.collective.operands:
      source = body.get(name)
      while source is not None and source.opcode in _SAME_DATA | {"pad"}:
        source = body.get(source.operands[0]) if source.operands else None
      if source is not None and source.opcode == "parameter":
        index = int(source.operands[0])
        operand += shape_bytes(shapes.get(inst.operands[index], ""))
      else:
        operand += shape_bytes(body[name].shape if name in body else "")
    return operand, shape_bytes(inst.shape)

  def operand_bytes(self, computation: str, instruction: Instruction) -> int:
    """Bytes of an instruction's operands (their result shapes)."""
    shapes = {i.name: i.shape for i in self.computations[computation]}
    return sum(shape_bytes(shapes.get(op, "")) for op in instruction.operands)

  def done_shape(self, computation: str, instruction: Instruction) -> str:
    """An instruction's result shape; for an async ``-start`` (whose own
    result also holds its operands), the matching ``-done``'s."""
    if instruction.opcode.endswith("-start"):
      done = instruction.opcode.removesuffix("-start") + "-done"
      for other in self.computations[computation]:
        if other.opcode == done and instruction.name in other.operands:
          return other.shape
    return instruction.shape

  def result_bytes(self, computation: str, instruction: Instruction) -> int:
    """Bytes of an instruction's result; for an async ``-start``, of the
    matching ``-done``'s result."""
    return shape_bytes(self.done_shape(computation, instruction))


def balanced_end(text: str, start: int) -> int:
  """Index just past the bracket group opening at ``text[start]`` (the
  end of `text` if it does not close)."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)
