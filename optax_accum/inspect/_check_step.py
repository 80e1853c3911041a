"""``check_step``: what a user's own jitted train step does on a micro-step.

The step (``jax.jit`` or ``nnx.jit``) is traced and compiled for its
arguments, with the installed backend or, with ``target=``, for a deviceless
accelerator (:mod:`optax_accum.targets`, as ``plan_micro_batch`` does); the
report reads the trace (which ``apply_updates`` ran) and the compiled program
(donation, conditionals, copies and reductions on the micro-step path, memory
beyond the accumulator).
"""

import contextlib
import dataclasses
import functools
from typing import Any

import jax

from optax_accum import _apply, _plan
from optax_accum._state import AccumulateState, is_accumulate_state
from optax_accum.inspect import _collectives, _hlo, _program

# Copies smaller than this are not reported (a tiny model's counters).
_MIN_COPY_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class StepReport:
  """What :func:`check_step` found.

  Attributes:
    problems: One line per fault, each naming its fix; empty at the floor.
    micro_step_bytes: Operand plus result bytes of the kernels a micro-step
      runs (a measure of structure, not a time).
    accumulator_bytes: Bytes of the accumulator (``acc_grads``).
    temp_bytes: The compiled step's temporary memory.
    conditionals: Conditionals the step runs on every call.
    copies: Copies of at least half the largest accumulator leaf (and 4
      KiB) that a micro-step runs.
    undonated: Arguments holding the ``AccumulateState`` or the params that
      are not donated (their positions).
    reductions: All-reduces and reduce-scatters of at least half the largest
      accumulator leaf that run on every call (outside the conditional):
      the gradient reduced on every micro-step. With ``axis_name=``, those
      across that mesh axis only.
    footprint_bytes: The compiled step's memory on one device: arguments,
      outputs and temporaries, less the outputs that reuse (donated)
      argument buffers.
  """

  problems: tuple[str, ...]
  micro_step_bytes: int
  accumulator_bytes: int
  temp_bytes: int
  conditionals: int
  copies: tuple[str, ...]
  undonated: tuple[int, ...]
  reductions: tuple[str, ...] = ()
  footprint_bytes: int = 0

  def __str__(self) -> str:
    lines = [
      f"micro-step kernel bytes: {self.micro_step_bytes}",
      f"accumulator bytes: {self.accumulator_bytes}",
      f"temporary memory: {self.temp_bytes} bytes",
      f"conditionals on every call: {self.conditionals}",
    ]
    if self.reductions:
      lines.append(f"reductions on every call: {len(self.reductions)}")
    if not self.problems:
      return "\n".join(["step check: no problem found", *lines])
    problems = [f"  - {p}" for p in self.problems]
    return "\n".join(["step check: problems found", *problems, *lines])


def _accumulate_states(args: tuple) -> list[tuple[int, AccumulateState]]:
  found = []
  for i, arg in enumerate(args):
    for x in jax.tree.leaves(arg, is_leaf=is_accumulate_state):
      if is_accumulate_state(x):
        found.append((i, x))
  return found


def _params_positions(args: tuple, acc_grads: Any) -> list[int]:
  """Arguments holding the params: a leaf of each accumulator leaf's shape
  (a params tree, an NNX model, a linen ``TrainState``), or of that shape
  without its first axis (``shard_map``'s per-device accumulator)."""
  shapes = [tuple(x.shape) for x in jax.tree.leaves(acc_grads)]
  candidates = [set(shapes)]
  if all(shapes) and len({s[0] for s in shapes}) == 1:
    candidates.append({s[1:] for s in shapes})

  def holds(arg: Any) -> bool:
    have = {tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(arg)}
    return any(wanted and wanted <= have for wanted in candidates)

  return [i for i, arg in enumerate(args) if holds(arg)]


def _undonated(lowered: Any, positions: list[int], bound: int = 0) -> list[int]:
  """Of the `positions` of the step's arguments, those not donated; the
  first `bound` are an ``nnx.jit_partial``'s, lowered as its argument 0."""
  args_info, _ = lowered.args_info

  def donated(i: int) -> bool:
    info = args_info[0 if i < bound else i - bound + bool(bound)]
    return all(leaf.donated for leaf in jax.tree.leaves(info))

  return [i for i in positions if not donated(i)]


@contextlib.contextmanager
def _watching():
  """Collects, in the list it yields, what the traces it covers did: one
  ``"update"`` per traced ``accumulate`` update that recorded its updates
  for :func:`optax_accum.apply_updates` (``"static update"`` where it was
  given ``emit=``), and one entry per
  ``apply_updates`` call naming how it applied (``_apply._route``:
  ``"applied"``, ``"static"``, ``"eager"`` or ``"fallback"``).

  It wraps the two ends of the contract of ``optax_accum/_apply.py`` for
  the duration of the block (process-wide: ``check_step`` is a debugging
  aid, not for a step traced in another thread at the same time) and
  restores them after.
  """
  events: list[str] = []
  remember, route = _apply.remember, _apply._route

  def watched_remember(updates, emitted, *args, **kwargs):
    recorded = remember(updates, emitted, *args, **kwargs)
    if recorded:  # emit= given: the update knew at trace time
      events.append("static update" if isinstance(emitted, bool) else "update")
    return recorded

  def watched_route(*args, **kwargs):
    how = route(*args, **kwargs)
    events.append(how)
    return how

  _apply.remember, _apply._route = watched_remember, watched_route
  try:
    yield events
  finally:
    _apply.remember, _apply._route = remember, route


def _trace_problems(events: list[str]) -> list[str]:
  problems = []
  updates = events.count("update") + events.count("static update")
  applied = sum(events.count(e) for e in ("applied", "static"))
  if "fallback" in events:
    problems.append(
      "optax_accum.apply_updates got updates other than those accumulate"
      " returned (a transformation after accumulate in the chain?) and"
      " applies them in a conditional of its own: put accumulate last, or"
      " pass its own updates and params"
    )
  elif updates and not applied:
    problems.append(
      "the updates are applied without optax_accum.apply_updates (e.g."
      " optax.apply_updates, nnx.Optimizer.update): every micro-step reads"
      " and writes the params; use optax_accum.apply_updates(params,"
      " updates, opt_state) or optax_accum.flax.Optimizer / TrainState"
    )
  return problems


def check_step(
  step: Any,
  *args: Any,
  emit: bool | None = None,
  target: str | None = None,
  axis_name: str | tuple[str, ...] | None = None,
) -> StepReport:
  """Compiles `step` for `args` and reports what its micro-step does.

  `step` is the user's train step, ``jax.jit``-, ``nnx.jit``- or
  ``nnx.jit_partial``-wrapped as it runs (its donation included); one of
  `args` holds the optimizer state with an
  :class:`~optax_accum.AccumulateState`. For an ``nnx.jit_partial`` step,
  pass the objects bound to it first, as its function takes them
  (``check_step(step, model, optimizer, batch)``). Found problems name their
  fix:

  * an argument holding the state or the params that is not donated
    ("donate argument i"): the accumulator is then copied, not updated in
    place;
  * updates applied without :func:`optax_accum.apply_updates`;
  * no conditional in a step whose cycle is decided on the device (the
    inner optimizer then runs on every call: a ``lax.cond`` turned into
    selects); with ``emit=`` (a static cycle, no conditional by design),
    pass ``emit=`` here too;
  * copies of accumulator-sized buffers on the micro-step path;
  * a parameter-sized all-reduce or reduce-scatter on every call (the
    gradient reduced on every micro-step instead of once per cycle); with
    `axis_name`, only one across that mesh axis (HSDP reduce-scatters the
    gradient over ``"fsdp"`` on every call by design: check it with
    ``axis_name="replica"``);
  * temporary memory above the accumulator's size.

  Args:
    step: A ``jax.jit``, ``nnx.jit`` or ``nnx.jit_partial``-wrapped
      function (a plain function is jitted here, without donation, and
      reported so).
    *args: Its function's arguments (arrays, ``jax.ShapeDtypeStruct``, NNX
      modules), static ones included, as it takes them: for an
      ``nnx.jit_partial`` step, the bound objects too.
    emit: Whether the step is a static one (``emit=True/False`` inside):
      then no conditional is expected.
    target: None to compile for this machine, or a deviceless target of
      :mod:`optax_accum.targets` (``"h100"``, ``"h100x8"``, ...), as in
      :func:`optax_accum.plan_micro_batch`: arguments without a sharding
      are placed on its devices (argument 2, the batch, split over them).
      Needs the accelerator compilers and ``JAX_PLATFORMS=cpu``.
    axis_name: None (every per-call reduction counts), or the mesh axis
      (or axes) the gradient's reduction is deferred over, as given to
      ``accumulate``: only per-call reductions across it count, as in
      :func:`assert_reduction_deferred`. The mesh is the one set with
      ``jax.set_mesh``, else the arguments'.

  Returns:
    A :class:`StepReport`; ``print`` it, or use :func:`assert_step`.

  Raises:
    ValueError: If `args` hold no or several ``AccumulateState``\\s, `target`
      is unknown, or `axis_name` is not an axis of the mesh.
    TypeError: If `axis_name` is not a name or a tuple of names.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4)
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> @functools.partial(jax.jit, donate_argnums=(0, 1))
    ... def step(params, state, x):
    ...   grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(params)
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax_accum.apply_updates(params, updates, state), state
    >>> report = optax_accum.inspect.check_step(
    ...   step, params, tx.init(params), jnp.ones((8, 64)))
    >>> report.problems
    ()
  """
  if not hasattr(step, "lower"):
    step = jax.jit(step)
  bound = _bound_count(step, args)
  states = _accumulate_states(args)
  if len(states) != 1:
    raise ValueError(
      "`args` must hold exactly one AccumulateState (the optimizer state"
      f" of optax_accum.accumulate), found {len(states)}."
    )
  _collectives.axis_names(axis_name)  # its type, before compiling
  if target is not None:
    args = _plan.placed(args, _plan.where_to_compile(target, None).mesh)
  with _watching() as events:
    _fresh_trace(step, args, bound)
  lowered = step.lower(*args[bound:])
  lowered = getattr(lowered, "lowered", lowered)  # nnx.jit's stage wraps it
  report = _compiled_facts(lowered, args, *states[0], emit, axis_name, bound)
  problems = _donation_problems(report.undonated, bound)
  problems += _trace_problems(events)
  problems += _program_problems(report, events, emit)
  return dataclasses.replace(report, problems=tuple(problems))


def _bound_count(step: Any, args: tuple) -> int:
  """How many of `args` an ``nnx.jit_partial`` `step` holds already (its
  bound objects, flattened to their Variables when it was made); 0 for
  another step."""
  bound = getattr(step, "partial_args", None)
  if bound is None or not hasattr(step, "jitted_fn"):
    return 0
  from flax import nnx  # noqa: PLC0415  (an NNX step: flax is there)

  def is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)

  for n in range(len(args) + 1):
    flat = jax.tree.leaves(args[:n], is_leaf=is_variable)
    if len(flat) == len(bound) and all(
      a is b for a, b in zip(flat, bound, strict=True)
    ):
      return n
  raise ValueError(
    "`step` is an nnx.jit_partial: pass the objects bound to it first, as"
    " its function takes them, e.g. check_step(step, model, optimizer,"
    " batch)."
  )


def _fresh_trace(step: Any, args: tuple, bound: int = 0) -> None:
  """Traces the step's function in a new wrapper (with the same static
  arguments): a trace of `step` itself may be cached and run no Python,
  and then no ``update`` or ``apply_updates`` call would be seen."""
  if bound:  # nnx.jit_partial: its function, over all the objects
    from flax import nnx  # noqa: PLC0415

    function = step.fun.__wrapped__
    nnx.jit(lambda *a: function(*a), graph=False).trace(*args)
    return
  jitted = getattr(step, "jitted_fn", step)  # nnx.jit holds a jax.jit
  info = getattr(jitted, "_jit_info", None)
  function = getattr(step, "fun", None) or getattr(step, "__wrapped__", step)

  @functools.wraps(function)
  def fresh(*a: Any, **k: Any) -> Any:
    return function(*a, **k)

  if info is None:  # another wrapper: trace its function, all args traced
    jax.make_jaxpr(fresh)(*args)
    return
  statics = dict(
    static_argnums=info.static_argnums, static_argnames=info.static_argnames
  )
  if jitted is not step:
    from flax import nnx

    nnx.jit(fresh, **statics).trace(*args)
  else:
    jax.jit(fresh, **statics).trace(*args)


def _compiled_facts(
  lowered, args, state_position, state, emit, axis_name, bound=0
) -> StepReport:
  """The report's figures, without the problems (`bound`: the first
  `bound` of `args` are an ``nnx.jit_partial``'s, its argument 0)."""
  compiled = lowered.compile()
  program = _program.Program(compiled)
  acc_bytes = [
    x.size * x.dtype.itemsize for x in jax.tree.leaves(state.acc_buffer)
  ]
  largest = max(acc_bytes, default=0)
  positions = [state_position, *_params_positions(args, state.acc_buffer)]
  copies: tuple[str, ...] = ()
  reductions: tuple[str, ...] = ()
  if emit is not True:  # A static emitting step has no micro-step.
    least = max(_MIN_COPY_BYTES, largest // 2)
    copies = tuple(
      f"{k.name}: {k.shape}" for k in program.copies(min_bytes=least)
    )
    reductions = _reductions(compiled, least, axis_name)
  memory = compiled.memory_analysis()
  footprint = _plan.footprint(memory) if memory is not None else 0
  return StepReport(
    problems=(),
    micro_step_bytes=program.kernel_bytes(),
    accumulator_bytes=sum(acc_bytes),
    temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0)) if memory else 0,
    conditionals=program.conditionals(),
    copies=copies,
    undonated=tuple(_undonated(lowered, sorted(set(positions)), bound)),
    reductions=reductions,
    footprint_bytes=footprint,
  )


def _reductions(
  compiled: Any, min_bytes: int, axis_name: Any
) -> tuple[str, ...]:
  """Reductions of at least `min_bytes` that run on every call (across
  `axis_name` only, unless None)."""
  records = _collectives.collectives(compiled)
  found = [
    c
    for c in records
    if c.opcode in _collectives.REDUCTION_OPCODES
    and c.unconditional
    and c.bytes >= min_bytes
  ]
  if found and axis_name is not None:
    hlo = _hlo.HloModule(compiled.as_text())
    axes = _collectives.mesh_axes_of(records, hlo, compiled, axis_name)
    names = set(_collectives.axis_names(axis_name))
    found = [c for c in found if names & set(axes[c])]
  return tuple(f"{c.opcode} {c.name}: {c.bytes} bytes" for c in found)


def _donation_problems(undonated: tuple[int, ...], bound: int = 0) -> list[str]:
  if not undonated:
    return []
  which = ", ".join(map(str, undonated))
  how = f"jax.jit(..., donate_argnums={tuple(undonated)}) (or nnx.jit's)"
  if bound:
    how = "nnx.jit_partial(..., donate_argnums=0) (its bound objects)"
  return [
    f"argument(s) {which} (the optimizer state / params) not donated:"
    f" donate them, {how}, so that the accumulator and the params are"
    " updated in place, not copied"
  ]


def _program_problems(report: StepReport, events, emit) -> list[str]:
  problems = []
  if emit is None and "static update" in events:
    problems.append(
      "no conditional is expected: the step passes emit= to update (a"
      " static cycle); pass emit= here too"
    )
  elif emit is None and events.count("update") and not report.conditionals:
    problems.append(
      "no conditional: the inner optimizer runs on every call (a lax.cond"
      " turned into selects); if the step passes emit=, pass emit= here"
    )
  if report.copies:
    problems.append(
      f"{len(report.copies)} accumulator-sized copies on a micro-step:"
      f" {report.copies}"
    )
  if report.reductions:
    problems.append(
      f"{len(report.reductions)} parameter-sized reduction(s) on every call"
      f" {report.reductions}: the gradient is reduced on every micro-step;"
      " defer it to the cycle's end with accumulate(..., axis_name=...) and"
      " an unreduced gradient: optax_accum.distributed.local_value_and_grad"
      " under jit (optax_accum.flax.local_value_and_grad for NNX), or the"
      " params pcast to varying inside shard_map. If the params are"
      " sharded (FSDP, HSDP), their per-call reduce-scatter is by design:"
      " pass the axis the reduction is deferred over as"
      " check_step(..., axis_name=...) so that only it counts"
    )
  acc, temp = report.accumulator_bytes, report.temp_bytes
  if temp > 1.05 * acc and temp > 1 << 20:
    problems.append(
      f"temporary memory is {temp / max(acc, 1):.2f}x the accumulator's"
      " bytes (expected at most about 1x)"
    )
  return problems


def assert_step(
  step: Any,
  *args: Any,
  emit: bool | None = None,
  target: str | None = None,
  axis_name: str | tuple[str, ...] | None = None,
) -> None:
  """:func:`check_step`, raising an ``AssertionError`` with the report if
  it found a problem."""
  report = check_step(
    step, *args, emit=emit, target=target, axis_name=axis_name
  )
  if report.problems:
    raise AssertionError(str(report))
