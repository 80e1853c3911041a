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

This module reads only what the structure tests, the benchmarks and
`optax_accum.collectives` need; it is not a full HLO parser.
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
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")

# Bytes per element of HLO element types; others are sized from their bits.
_ITEMSIZE = {"pred": 1, "token": 0, "s4": 1, "u4": 1, "f4e2m1fn": 1}

# Instructions that move no data: a branch made of these does no work.
FREE_OPCODES = frozenset(
  {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}
)

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


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


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
  """

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  calls: tuple[str, ...]
  branches: tuple[str, ...]
  line: str


def parse_instruction(line: str) -> Instruction | None:
  """An `Instruction` from one line of HLO text; None for other lines."""
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, rest = match.groups()
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, tail = rest[:end], rest[end:].lstrip()
  else:
    shape, _, tail = rest.partition(" ")
  opcode, paren, _ = tail.partition("(")
  if not paren or not re.fullmatch(r"[a-z][a-z0-9\-]*", opcode):
    return None
  open_at = len(opcode)
  close_at = _balanced(tail, open_at)
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
  return Instruction(name, shape, opcode, operands, calls, branches, line)


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
  """

  instruction: Instruction
  computation: str
  path: tuple[BranchStep, ...]
  in_loop: bool


class HloModule:
  """The computations of an optimized HLO module and the edges between them.

  Attributes:
    entry: the name of the ``ENTRY`` computation.
    computations: computation name -> its instructions, in text order.
  """

  def __init__(self, text: str):
    self.computations: dict[str, list[Instruction]] = {}
    self._work: dict[str, int] = {}
    self.entry: str | None = None
    current = None
    for line in text.splitlines():
      if current is None:
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
          current = header.group(2)
          self.computations[current] = []
          if header.group(1):
            self.entry = current
      elif line.strip() == "}":
        current = None
      else:
        instruction = parse_instruction(line)
        if instruction is not None:
          self.computations[current].append(instruction)
    if self.entry is None:
      raise ValueError(
        "no ENTRY computation in the HLO text: pass the text of a compiled"
        " module (`jax.jit(f).lower(*args).compile().as_text()`)."
      )

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
      for inst in self.computations[name]:
        if inst.opcode.removesuffix("-start") in wanted:
          out.append(Site(inst, name, path, in_loop))
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

  def operand_bytes(self, computation: str, instruction: Instruction) -> int:
    """Bytes of an instruction's operands (their result shapes)."""
    shapes = {i.name: i.shape for i in self.computations[computation]}
    return sum(shape_bytes(shapes.get(op, "")) for op in instruction.operands)

  def result_bytes(self, computation: str, instruction: Instruction) -> int:
    """Bytes of an instruction's result; for an async ``-start``, of the
    matching ``-done``'s result."""
    if instruction.opcode.endswith("-start"):
      done = instruction.opcode.removesuffix("-start") + "-done"
      for other in self.computations[computation]:
        if other.opcode == done and instruction.name in other.operands:
          return shape_bytes(other.shape)
    return shape_bytes(instruction.shape)
