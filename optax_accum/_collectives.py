"""Which collectives a compiled step runs, and whether the reduction waits.

`collectives` lists the cross-device collectives of a compiled program with
their bytes and where they sit; `assert_reduction_deferred` is the one-call
check for a user's own tests: no gradient-sized reduction runs on a
micro-step.
"""

from typing import Any, NamedTuple

import jax

from optax_accum import _hlo

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
      ``-done`` pair is reported once, under the synchronous name).
    bytes: the larger of the op's input and output, in bytes on one device:
      an all-reduce's payload, an all-gather's gathered result, a
      reduce-scatter's input. (A ring all-reduce sends about
      ``2 (n - 1) / n`` times its payload per device.)
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


def _hlo_text(step: Any, args: tuple, kwargs: dict) -> str:
  """The compiled HLO text of `step`, lowering and compiling as needed."""
  lowered_types = (str, jax.stages.Lowered, jax.stages.Compiled)
  if isinstance(step, lowered_types) and (args or kwargs):
    raise TypeError(
      f"`step` is already lowered ({type(step).__name__}): pass no"
      f" arguments; got {len(args)} positional and keywords {sorted(kwargs)}"
    )
  if isinstance(step, str):
    return step
  if isinstance(step, jax.stages.Compiled):
    return step.as_text()
  if isinstance(step, jax.stages.Lowered):
    return step.compile().as_text()
  if callable(step):
    lower = getattr(step, "lower", None) or jax.jit(step).lower
    return lower(*args, **kwargs).compile().as_text()
  raise TypeError(
    "`step` must be a jitted function (with its arguments), a"
    " `jax.stages.Lowered`, a `jax.stages.Compiled` or HLO text; got"
    f" {type(step).__name__}: {step!r:.80}"
  )


def collectives(step: Any, *args: Any, **kwargs: Any) -> list[Collective]:
  """The collective ops of a compiled step, with their bytes and placement.

  Args:
    step: a jitted function (``jax.jit(f)``; a plain function is jitted),
      called as ``step(*args, **kwargs)``; or a `jax.stages.Lowered` or
      `jax.stages.Compiled` (then give no arguments); or the text of a
      compiled HLO module.
    *args: arguments to lower a function with (arrays or
      ``jax.ShapeDtypeStruct``s carrying their shardings).
    **kwargs: keyword arguments to lower a function with.

  Returns:
    A list of `Collective` records, one per op and per way the program
    reaches it, in program order.

  Examples:
    The mean over a batch sharded across devices all-reduces the partial
    sums on every call (1 KiB here; no collective at all on one device):

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from optax_accum import collectives
    >>> n = jax.device_count()  # 8 in the test suite
    >>> mesh = jax.make_mesh((n,), ("data",))
    >>> x = jax.device_put(jnp.ones((n, 256)), NamedSharding(mesh, P("data")))
    >>> ops = collectives(jax.jit(lambda x: x.mean(0)), x)
    >>> all(c.unconditional for c in ops)
    True
    >>> sum(c.bytes for c in ops if c.opcode == "all-reduce") == (
    ...   1024 if n > 1 else 0)
    True
  """
  hlo = _hlo.HloModule(_hlo_text(step, args, kwargs))
  out = []
  for site in hlo.sites(_hlo.COLLECTIVE_OPCODES):
    inst = site.instruction
    operand = hlo.operand_bytes(site.computation, inst)
    result = hlo.result_bytes(site.computation, inst)
    out.append(
      Collective(
        opcode=inst.opcode.removesuffix("-start"),
        bytes=max(operand, result),
        operand_bytes=operand,
        result_bytes=result,
        unconditional=not site.path,
        emitting=bool(site.path) and all(s.heaviest for s in site.path),
        in_loop=site.in_loop,
        name=inst.name,
        computation=site.computation,
        shape=inst.shape,
      )
    )
  return out


def format_collectives(records: list[Collective]) -> str:
  """A plain-text table of `Collective` records, one per line."""
  header = ("opcode", "bytes", "where", "loop", "name")
  rows = [
    (
      c.opcode,
      str(c.bytes),
      "every call"
      if c.unconditional
      else ("emitting branch" if c.emitting else "other branch"),
      "yes" if c.in_loop else "",
      c.name,
    )
    for c in records
  ]
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
  **kwargs: Any,
) -> list[Collective]:
  """Asserts that a step reduces its gradient only in the emitting branch.

  Fails when a reduction (``all-reduce`` or ``reduce-scatter``) of at least
  `min_bytes` bytes runs outside the emitting branch (see `Collective`):
  on every call, or in a branch that holds. With
  ``accumulate(inner, k, axis_name=...)`` the gradient is reduced once per
  optimizer step, inside the branch that runs ``inner``; a step that reduces
  every micro-batch (the usual ``jit`` data-parallel step) fails.

  The check reads the program's structure, not how often it runs: a step
  whose whole body sits in a user's own ``lax.cond`` would look deferred.

  Args:
    step: as for `collectives`.
    *args: as for `collectives`.
    min_bytes: the smallest reduction, in bytes on one device, that counts
      as a gradient reduction; default `DEFAULT_MIN_BYTES` (1024). Give the
      bytes of your smallest parameter to check every one of them.
    **kwargs: as for `collectives`.

  Returns:
    The step's collectives (`collectives`), when the check passes.

  Raises:
    AssertionError: listing the offending collectives in a table.

  Examples:
    A step that reduces its gradient on every call fails (on more than one
    device; the error lists the offending ops):

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from optax_accum import assert_reduction_deferred
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
  """
  if min_bytes is None:
    min_bytes = DEFAULT_MIN_BYTES
  if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
    raise TypeError(
      f"`min_bytes` must be an int or None; got {type(min_bytes).__name__}:"
      f" {min_bytes!r}"
    )
  records = collectives(step, *args, **kwargs)
  offending = [
    c
    for c in records
    if c.opcode in REDUCTION_OPCODES and c.bytes >= min_bytes and not c.emitting
  ]
  if offending:
    raise AssertionError(
      f"{len(offending)} reduction(s) of >= {min_bytes} bytes run outside"
      " the emitting branch, so they are not deferred to the end of the"
      " cycle:\n"
      + format_collectives(offending)
      + "\n\nAll collectives of the step:\n"
      + format_collectives(records)
    )
  return records
