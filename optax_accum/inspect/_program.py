"""What a compiled step does on one call: kernels, bytes, copies, GEMMs.

Reads a compiled program (``jax.jit(f).lower(...).compile()``, for any
backend, compiled with or without the device) and answers the structural
questions the accelerator tests and ``benchmarks/bench_compiled.py`` ask of
an accumulation step:

* which kernels run on a micro-step and on the emitting call, and how many
  bytes they read and write (:meth:`Program.kernels`,
  :meth:`Program.kernel_bytes`): a micro-step takes branch 0 of every
  conditional (the holding branch, see ``_control.cond``), the emitting call
  the branch of each conditional that does the most work;
* whether parameter-sized buffers are copied on the way
  (:meth:`Program.copies`), whether an optimizer op runs outside every
  conditional (:meth:`Program.runs_every_call`);
* whether each weight-gradient GEMM adds into the accumulator itself
  (:meth:`Program.gemms`: a GEMM kernel that reads a buffer of its own
  result's shape writes the sum, as cuBLAS with beta = 1 or a Triton GEMM
  with an add epilogue do);
* whether XLA:GPU runs the conditionals inside CUDA command buffers, from
  the thunk sequence it dumps (:func:`conditionals_in_command_buffers`);
* when each reduction starts relative to the gradient GEMMs in the
  schedule (:meth:`Program.overlap`).

Kernel bytes are the bytes of a kernel's operands plus its results that live
in the device's main memory (HBM): an upper bound on the memory traffic it
causes (a fusion may read less of an operand than its whole shape). A TPU
compiler prefetches operands into on-chip memory (shapes annotated
``S(1)``): the prefetch counts its read from main memory, and the kernel
that then reads on-chip memory adds nothing. They are a measure of a
program's structure, not a time.
"""

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

from optax_accum.inspect import _hlo

# Control flow and ops that move no data: not kernels.
_NOT_KERNELS = _hlo.FREE_OPCODES | {
  "conditional",
  "call",
  "while",
  "after-all",
  "opt-barrier",
  "partition-id",
  "replica-id",
}
_GEMM_OPCODES = frozenset({"dot", "convolution"})
_GEMM_TARGETS = re.compile(
  r'custom_call_target="(__cublas\$\w+|__cublas\$lt\$\w+|__onednn\$matmul)"'
)
_ASYNC_DONE = re.compile(r"-done$")
# A result in another memory space than HBM (TPU memory-space assignment
# prefetching into on-chip memory): ``f32[8]{0:T(8)S(1)}``.
_ALTERNATE_MEMORY = re.compile(r"S\([1-9]\d*\)")

MICRO_STEP, EMITTING = "micro-step", "emitting"


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of a compiled program, as a call reaches it.

  Attributes:
    computation: the HLO computation holding it.
    name: the instruction's name.
    opcode: its opcode (``fusion``, ``custom-call``, ``copy``, ...).
    shape: its result shape, as printed.
    operand_bytes: main-memory bytes of its operands.
    result_bytes: main-memory bytes of its results (for an async
      ``-start``, of the matching ``-done``).
    gemm: whether it is a matrix multiplication (a dot, a convolution, a
      cuBLAS call, or a fusion around one).
    copy: whether it only copies (a ``copy`` op, or a fusion of copies).
    prefetch: an asynchronous copy or slice into another memory space than
      the device's main memory (a TPU compiler's prefetch into on-chip
      memory): its bytes are the main-memory read.
    held: it runs inside a conditional's holding branch (branch 0).
  """

  computation: str
  name: str
  opcode: str
  shape: str
  operand_bytes: int
  result_bytes: int
  gemm: bool
  copy: bool
  prefetch: bool = False
  held: bool = False

  @property
  def bytes(self) -> int:
    """Operand plus result bytes: what the kernel may move."""
    return self.operand_bytes + self.result_bytes

  def operand_shapes(self, program: "Program") -> list[str]:
    shapes = program.shapes(self.computation)
    inst = program.instruction(self.computation, self.name)
    return [shapes.get(op, "") for op in inst.operands]


_ARRAY_WITH_LAYOUT = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")


def main_memory_bytes(shape: str) -> int:
  """Bytes of the arrays of an HLO shape that live in main memory (no
  ``S(n)`` memory-space annotation in their layout, n > 0)."""
  return sum(
    _hlo.shape_bytes(array.group())
    for array in _ARRAY_WITH_LAYOUT.finditer(shape)
    if not (array.group(3) and _ALTERNATE_MEMORY.search(array.group(3)))
  )


class Program:
  """A compiled program's kernels along the paths a call takes.

  Args:
    compiled: a ``jax.stages.Compiled``, or the text of a compiled HLO
      module.
  """

  def __init__(self, compiled: Any):
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    self.hlo = _hlo.HloModule(text)
    self._index = {
      name: {i.name: i for i in insts}
      for name, insts in self.hlo.computations.items()
    }

  # --- Lookups. -------------------------------------------------------------

  def instruction(self, computation: str, name: str) -> _hlo.Instruction:
    return self._index[computation][name]

  def shapes(self, computation: str) -> dict[str, str]:
    return {n: i.shape for n, i in self._index[computation].items()}

  def _called(self, inst: _hlo.Instruction) -> set[str]:
    """Computations an instruction calls (fusion bodies), transitively."""
    return self.hlo.reachable(inst.calls, through_branches=True)

  def _is_gemm(self, inst: _hlo.Instruction) -> bool:
    if inst.opcode in _GEMM_OPCODES or _GEMM_TARGETS.search(inst.line):
      return True
    if inst.opcode != "fusion":
      return False
    return any(
      set(self.hlo.opcodes(c)) & _GEMM_OPCODES for c in self._called(inst)
    )

  def _is_copy(self, inst: _hlo.Instruction) -> bool:
    if inst.opcode in ("copy", "copy-start"):
      return True
    if inst.opcode != "fusion":
      return False
    ops = {
      op
      for c in self._called(inst)
      for op in self.hlo.opcodes(c)
      if op not in _hlo.FREE_OPCODES
    }
    return bool(ops) and ops <= {"copy"}

  def _result_bytes(self, computation: str, inst: _hlo.Instruction) -> int:
    """Main-memory bytes of a result (an async op's: its ``-done``'s)."""
    return main_memory_bytes(self.hlo.done_shape(computation, inst))

  def _kernel(
    self, computation: str, inst: _hlo.Instruction, held: bool = False
  ) -> Kernel:
    prefetch = inst.opcode in ("copy-start", "slice-start") and bool(
      _ALTERNATE_MEMORY.search(inst.shape)
    )
    shapes = self.shapes(computation)
    if prefetch:  # It reads what it puts on chip (a slice: part of it).
      operand_bytes = _hlo.shape_bytes(self.hlo.done_shape(computation, inst))
    else:
      operand_bytes = sum(
        main_memory_bytes(shapes.get(op, "")) for op in inst.operands
      )
    return Kernel(
      computation=computation,
      name=inst.name,
      opcode=inst.opcode,
      shape=inst.shape,
      operand_bytes=operand_bytes,
      result_bytes=self._result_bytes(computation, inst),
      gemm=self._is_gemm(inst),
      copy=self._is_copy(inst) and not prefetch,
      prefetch=prefetch,
      held=held,
    )

  # --- Paths. ---------------------------------------------------------------

  def _pick(self, path: str) -> Callable[[_hlo.Instruction], str]:
    if path == MICRO_STEP:
      return lambda inst: inst.branches[0]
    if path == EMITTING:
      return lambda inst: max(inst.branches, key=self.hlo.work)
    raise ValueError(
      f"`path` must be {MICRO_STEP!r} or {EMITTING!r}, got {path!r}."
    )

  def kernels(self, path: str = MICRO_STEP) -> list[Kernel]:
    """The kernels a call runs, in schedule order.

    Args:
      path: ``"micro-step"``: branch 0 of every conditional (the holding
        branch); ``"emitting"``: the branch of each conditional that does
        the most work. A loop body counts once.
    """
    pick, out = self._pick(path), []

    def visit(computation: str, held: bool) -> None:
      for inst in self.hlo.computations[computation]:
        if inst.opcode == "conditional" and inst.branches:
          branch = pick(inst)
          visit(branch, held or branch == inst.branches[0])
        elif inst.opcode in ("call", "while"):
          for callee in inst.calls:
            visit(callee, held)
        elif inst.opcode not in _NOT_KERNELS and not _ASYNC_DONE.search(
          inst.opcode
        ):
          out.append(self._kernel(computation, inst, held))

    visit(self.hlo.entry, False)
    return out

  def kernel_bytes(self, path: str = MICRO_STEP) -> int:
    """Main-memory operand plus result bytes of the kernels a call runs."""
    return sum(k.bytes for k in self.kernels(path))

  def held(self, min_bytes: int = 1) -> list[Kernel]:
    """Kernels of at least `min_bytes` (result bytes) that a micro-step runs
    inside holding branches: work a conditional does when nothing ends."""
    return [
      k
      for k in self.kernels(MICRO_STEP)
      if k.held and not k.prefetch and k.result_bytes >= min_bytes
    ]

  def copies(self, path: str = MICRO_STEP, min_bytes: int = 1) -> list[Kernel]:
    """Copies of at least `min_bytes` (result bytes) a call runs."""
    return [
      k for k in self.kernels(path) if k.copy and k.result_bytes >= min_bytes
    ]

  def conditionals(self) -> int:
    """Conditionals that run on every call (not nested in a branch)."""
    return len(self.hlo.conditionals())

  def runs_every_call(self, opcodes: Iterable[str]) -> set[str]:
    """Computations holding one of `opcodes` that run on every call."""
    return self.hlo.with_opcode(opcodes) & self.hlo.unconditional()

  def gemms(self, result_shape: str | None = None, path: str = MICRO_STEP):
    """GEMM kernels of a call, and whether each adds into a buffer.

    Args:
      result_shape: keep the GEMMs whose (first) result has this HLO shape,
        without layout (``"f32[2048,2048]"``): the weight gradients of a
        parameter of that shape.
      path: as for :meth:`kernels`.

    Returns:
      ``[(kernel, fused)]``: `fused` when the kernel reads a buffer of its
      result's shape, i.e. writes ``acc + dot`` in one pass.
    """
    out = []
    for k in self.kernels(path):
      if not k.gemm:
        continue
      result = _first_array(k.shape)
      if result_shape is not None and result != result_shape:
        continue
      reads = [_first_array(s) for s in k.operand_shapes(self)]
      out.append((k, result in reads))
    return out

  def makes(self, inst: _hlo.Instruction, result_shape: str) -> bool:
    """Whether `inst` is, or is a kernel around, a dot or convolution whose
    result has `result_shape` (``f32[2048,2048]``, no layout)."""
    if inst.opcode in _GEMM_OPCODES:
      return _first_array(inst.shape) == result_shape
    if _GEMM_TARGETS.search(inst.line):
      return _first_array(inst.shape) == result_shape
    return any(
      i.opcode in _GEMM_OPCODES and _first_array(i.shape) == result_shape
      for c in self._called(inst)
      for i in self.hlo.computations[c]
    )

  def overlap(self, result_shape: str, min_bytes: int) -> dict[str, int]:
    """How the reductions of a step without conditionals sit among the GEMMs
    that make the gradients of shape `result_shape`, in schedule order.

    A reduction starts at an ``all-reduce``/``reduce-scatter`` (or its
    async ``-start``) of at least `min_bytes`, or at a TPU compiler's
    ``async-collective-start``, which spreads one over the kernels that
    follow it.

    Returns:
      ``{"gemms": n, "reductions": m, "started_before_last_gemm": j}``.
    """
    gemms, starts = [], []
    for position, inst in enumerate(self.hlo.computations[self.hlo.entry]):
      base = inst.opcode.removesuffix("-start")
      if inst.name.startswith("async-collective-start"):
        starts.append(position)
      elif base in ("all-reduce", "reduce-scatter"):
        if self._result_bytes(self.hlo.entry, inst) >= min_bytes:
          starts.append(position)
      elif self.makes(inst, result_shape):
        gemms.append(position)
    last = max(gemms, default=-1)
    return {
      "gemms": len(gemms),
      "reductions": len(starts),
      "started_before_last_gemm": sum(p < last for p in starts),
    }


def _first_array(shape: str) -> str:
  """``(f32[8,2]{1,0}, s8[4]{0})`` -> ``f32[8,2]``."""
  match = re.search(r"[a-z][a-z0-9]*\[[\d,]*\]", shape)
  return match.group() if match else ""
