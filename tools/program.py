"""Readers of XLA:GPU dumps, for the tests and benchmarks (not shipped).

The compiled-program reader itself is ``optax_accum.inspect._program``
(shipped: ``optax_accum.inspect.check_step`` uses it); it is re-exported
here for the tests and benchmarks.
"""

import glob
import os
import re

from optax_accum.inspect._program import (  # noqa: F401
  EMITTING as EMITTING,
)
from optax_accum.inspect._program import (
  MICRO_STEP as MICRO_STEP,
)
from optax_accum.inspect._program import (
  Kernel as Kernel,
)
from optax_accum.inspect._program import (
  Program as Program,
)
from optax_accum.inspect._program import (
  main_memory_bytes as main_memory_bytes,
)

# ----------------------------------------------------------------------------
# XLA:GPU thunks.
# ----------------------------------------------------------------------------
_THUNK = re.compile(r"^(\s*)\d+: (k\w+)")


def thunk_sequence(dump_dir: str) -> str:
  """The final thunk sequence XLA:GPU dumped (``--xla_dump_to``), or ''.

  Compile with ``compiler_options={"xla_dump_to": dump_dir}`` into an empty
  folder, one program per folder.
  """
  for pattern in (
    "*thunk_sequence_after_thunk_passes.txt",
    "*thunk_sequence.txt",
  ):
    found = sorted(glob.glob(os.path.join(dump_dir, pattern)))
    if found:
      with open(found[-1]) as f:
        return f.read()
  return ""


def conditionals_in_command_buffers(thunks: str) -> tuple[int, int]:
  """``(conditionals, of which inside a CUDA command buffer)``.

  A conditional thunk inside a command buffer is a CUDA graph conditional
  node: the device picks the branch. Outside, the host reads the predicate
  first, a round trip per call.
  """
  stack: list[tuple[int, str]] = []
  total = inside = 0
  for line in thunks.splitlines():
    match = _THUNK.match(line)
    if not match:
      continue
    indent, kind = len(match.group(1)), match.group(2)
    while stack and stack[-1][0] >= indent:
      stack.pop()
    if kind == "kConditional":
      total += 1
      inside += any(k == "kCommandBuffer" for _, k in stack)
    stack.append((indent, kind))
  return total, inside
