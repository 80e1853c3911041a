"""``plan_micro_batch``: the micro-batch that fits, found by compiling.

The step is compiled (never run) for candidate micro-batch sizes that divide
the global batch, here or for a deviceless target (:mod:`optax_accum.targets`),
and its compiled memory is compared with the device's limit. The search
compiles the smallest and the largest candidate, then fits the peak as a line
in the micro-batch size and confirms the prediction by compiling it and its
next larger neighbour; where the line is wrong it falls back to bisection, so
it never compiles more than ``ceil(log2(global_batch)) + 2`` candidates.
"""

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from optax_accum import _state

# Compiler errors that mean "does not fit" (XLA:TPU checks memory when it
# compiles; XLA:GPU and CPU do not).
_OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Ran out of memory", "out of memory")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One compiled micro-batch size.

  Attributes:
    variant: Which step (a key of ``variants``, or ``"step"``).
    micro_batch: Examples per micro-step.
    peak_bytes: Compiled peak memory per device (None where the compiler
      refused the program for want of memory without saying how much).
    fits: Whether ``peak_bytes`` is within the budget.
    compile_seconds: How long the compile took.
  """

  variant: str
  micro_batch: int
  peak_bytes: int | None
  fits: bool
  compile_seconds: float


# The public names (help(), the API reference); the classes live here.
Candidate.__module__ = "optax_accum.types"


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
  """What :func:`~optax_accum.plan_micro_batch` chose, and every candidate it compiled.

  Attributes:
    micro_batch: Examples per micro-step: the largest candidate that fits.
    every_k: Micro-steps per optimizer step (``micro_batch * every_k ==
      global_batch``): pass it to ``accumulate(..., every_k=...)``.
    peak_bytes: The chosen micro-batch's compiled peak memory per device.
    limit_bytes: The device's memory limit the plan used.
    budget_bytes: ``(1 - headroom) * limit_bytes``: what a plan may use.
    variant: The chosen step (a key of ``variants``, or ``"step"``).
    target: The device planned for, in words.
    compiles: How many compiles the plan took (all variants).
    candidates: Every compiled candidate, in the order compiled.
    estimated_step_seconds: Per variant, an *estimate* of the time of one
      optimizer step (``every_k`` micro-steps at the target's published
      peak flop/s and memory bandwidth, from ``cost_analysis()``); None
      where the target has no published rates (the local machine).
  """

  micro_batch: int
  every_k: int
  peak_bytes: int
  limit_bytes: int
  budget_bytes: int
  variant: str
  target: str
  compiles: int
  candidates: tuple[Candidate, ...]
  estimated_step_seconds: Mapping[str, float | None]

  def __str__(self) -> str:
    unit, scale = _unit(self.limit_bytes)
    lines = [
      f"plan for {self.target}: micro_batch={self.micro_batch},"
      f" every_k={self.every_k} (variant {self.variant!r}), peak"
      f" {self.peak_bytes / scale:.2f} {unit} of a"
      f" {self.budget_bytes / scale:.2f} {unit} budget (limit"
      f" {self.limit_bytes / scale:.2f} {unit}); {self.compiles} compiles",
      f"{'variant':<12} {'micro_batch':>11} {'peak ' + unit:>9} {'fits':>5}"
      f" {'compile s':>9}",
    ]
    for c in sorted(self.candidates, key=lambda c: (c.variant, c.micro_batch)):
      peak = "OOM" if c.peak_bytes is None else f"{c.peak_bytes / scale:.2f}"
      lines.append(
        f"{c.variant:<12} {c.micro_batch:>11} {peak:>9}"
        f" {'yes' if c.fits else 'no':>5} {c.compile_seconds:>9.2f}"
      )
    return "\n".join(lines)


MicroBatchPlan.__module__ = "optax_accum.types"


def _unit(n: int) -> tuple[str, float]:
  """GiB, MiB or KiB, whichever shows `n` as at least 1."""
  for unit, power in (("GiB", 30), ("MiB", 20)):
    if n >= 2**power:
      return unit, 2.0**power
  return "KiB", 1024.0


@dataclasses.dataclass(frozen=True)
class _Where:
  """Where the step is compiled: the local devices or a deviceless target."""

  name: str
  limit_bytes: int
  mesh: Any  # None: the arguments as given (the local devices).
  peak_flops: float | None
  memory_bandwidth: float | None


def plan_micro_batch(
  step: Callable[..., Any] | None,
  args_for: Callable[[int], Any],
  global_batch: int,
  *,
  memory_limit: int | None = None,
  target: str | None = None,
  headroom: float = 0.1,
  variants: Mapping[str, Callable[..., Any]] | None = None,
) -> MicroBatchPlan:
  r"""The largest micro-batch whose compiled step fits, and its ``every_k``.

  Compiles (never runs) `step` for micro-batch sizes :math:`n` that divide
  `global_batch` and reads the compiled peak memory per device,
  :math:`p(n)`: the larger of ``memory_analysis()``'s peak and arguments +
  outputs + temporaries - aliased (XLA:CPU's peak leaves out the
  temporaries). It returns the largest
  :math:`n` with :math:`p(n) \le (1 - h)\,L` (`headroom` :math:`h`, limit
  :math:`L`) and :math:`k = G / n`. Since :math:`p` grows about linearly in
  :math:`n`, it compiles the smallest and the largest candidate, predicts
  the answer from the line through them, and confirms it (the prediction
  fits, its next larger neighbour does not), bisecting where the line is
  wrong: at most :math:`\lceil\log_2 G\rceil + 2` compiles per variant.

  Args:
    step: The train step, ``(params, opt_state, batch, ...) -> ...``, with
      :func:`~optax_accum.accumulate` inside ``opt_state``; pass the
      ``jax.jit``-wrapped step you run (its donation changes the peak). A
      plain function is jitted without donation. None if `variants` holds
      the steps.
    args_for: ``args_for(n)`` gives the step's arguments for a micro-batch
      of ``n`` examples: arrays or ``jax.ShapeDtypeStruct``\ s (nothing is
      allocated), e.g. from ``jax.eval_shape``.
    global_batch: Examples per optimizer step (a positive int).
    memory_limit: Bytes a device may use; overrides the target's limit.
      Required where JAX reports none (the CPU).
    target: None for the step's own devices, or a deviceless target of
      :mod:`optax_accum.targets` (``"h100"``, ``"h100x8"``, ``"v5e_2x2"``,
      ``"v5e_2x4"``): compiled for it from this machine (needs its
      compilers and ``JAX_PLATFORMS=cpu``). On a several-device target the
      batch (argument 2) is split over all devices on its first axis and
      everything else is replicated, unless ``args_for`` gives
      ``ShapeDtypeStruct``\ s with shardings over
      ``optax_accum.targets.mesh(target, ...)``. Peaks are per device.
    headroom: Fraction of the limit left free, in ``[0, 1)``.
    variants: ``{"name": step}``: several ways to write the step (e.g.
      with and without ``jax.checkpoint``). The plan picks the one needing
      the fewest micro-steps; ties go to the lowest estimated time per
      optimizer step.

  Returns:
    A :class:`~optax_accum.types.MicroBatchPlan`; ``print`` it for the
    table of candidates.

  Raises:
    ValueError: Nothing fits even at the smallest micro-batch; a bad
      `global_batch`, `headroom`, `memory_limit` or `target`; `args_for`
      ignoring ``n``; arguments without an ``AccumulateState``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=1)
    >>> params = {"w": jnp.zeros((256, 256))}
    >>> def step(params, state, x):
    ...   grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(params)
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax_accum.apply_updates(params, updates, state), state
    >>> step = jax.jit(step, donate_argnums=(0, 1))
    >>> def args_for(n):
    ...   state = jax.eval_shape(tx.init, params)
    ...   return params, state, jax.ShapeDtypeStruct((n, 256), jnp.float32)
    >>> plan = optax_accum.plan_micro_batch(
    ...   step, args_for, 4096, memory_limit=4 * 2**20)
    >>> plan.micro_batch * plan.every_k, plan.peak_bytes <= plan.budget_bytes
    (4096, True)
  """
  steps = _steps(step, variants)
  _check_arguments(global_batch, headroom, memory_limit)
  where = where_to_compile(target, memory_limit)
  whole = _call_args_for(args_for, global_batch)
  sizes = _divisors(global_batch, _batch_multiple(whole, where))
  _check_args_for(args_for, sizes, whole)
  budget = int((1 - headroom) * where.limit_bytes)
  found = {}
  for name, fn in steps.items():
    compiler = _Compiler(name, fn, args_for, where, budget)
    found[name] = (_search(compiler, sizes, global_batch), compiler)
  return _choose(found, where, budget, global_batch)


def _steps(step: Any, variants: Any) -> dict[str, Callable[..., Any]]:
  """The steps to plan, by name."""
  if variants is None:
    if not callable(step):
      raise TypeError(
        f"`step` must be the train step (a function), got {step!r}; pass"
        " variants={'name': step, ...} to plan several."
      )
    return {"step": step}
  if not isinstance(variants, Mapping) or not variants:
    raise TypeError(
      "`variants` must be a non-empty dict {'name': step, ...}, got"
      f" {variants!r}."
    )
  steps = {} if step is None else {"step": step}
  for name, fn in variants.items():
    if not isinstance(name, str) or not callable(fn) or name in steps:
      raise TypeError(
        "`variants` maps names (str, other than 'step' when `step` is"
        f" given) to train steps; got {name!r}: {fn!r}."
      )
    steps[name] = fn
  return steps


def _check_arguments(global_batch: Any, headroom: Any, memory_limit: Any):
  if (
    not isinstance(global_batch, int)
    or isinstance(global_batch, bool)
    or global_batch < 1
  ):
    raise ValueError(
      "`global_batch` must be a positive int (examples per optimizer"
      f" step), got {global_batch!r}."
    )
  if not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
    raise ValueError(
      f"`headroom` must be a fraction of the limit in [0, 1), got {headroom!r}."
    )
  if memory_limit is not None and (
    not isinstance(memory_limit, int)
    or isinstance(memory_limit, bool)
    or memory_limit < 1
  ):
    raise ValueError(
      f"`memory_limit` must be a positive int of bytes, got {memory_limit!r}."
    )


def where_to_compile(target: Any, memory_limit: int | None) -> _Where:
  """The local devices (target None) or a deviceless target, with its limit."""
  if target is None:
    device = jax.devices()[0]
    limit = memory_limit or (device.memory_stats() or {}).get("bytes_limit")
    if limit is None:
      raise ValueError(
        "`memory_limit` is required: JAX reports no memory limit for the"
        f" {device.platform} device (memory_stats() gives no bytes_limit);"
        " pass the bytes a device may use, or a `target`."
      )
    name = f"this machine ({device.platform}: {device.device_kind})"
    return _Where(name, int(limit), None, None, None)
  from optax_accum import targets

  if target not in targets.TARGETS:
    raise ValueError(
      f"`target` {target!r} is not a known target; known:"
      f" {', '.join(targets.TARGETS)} (or None for this machine)."
    )
  spec = targets.TARGETS[target]
  targets.check_cpu_only()
  try:
    mesh = targets.mesh(target, (spec.devices,), ("data",))
  except Exception as e:
    raise RuntimeError(
      f"`target` {target!r}: this machine has no compiler for"
      f" {spec.description}. Install it, `pip install --no-deps"
      f" {' '.join(targets.requirements())}` (`python -m"
      " optax_accum.targets` prints them), and set JAX_PLATFORMS=cpu before"
      f" JAX starts. ({type(e).__name__}: {e})"
    ) from e
  limit = memory_limit or targets.memory_limit(target)
  return _Where(
    spec.description, limit, mesh, spec.peak_flops, spec.memory_bandwidth
  )


def placed(args: tuple, mesh: Any) -> tuple:
  """`args` as ``ShapeDtypeStruct``s on `mesh`: the batch (argument 2) split
  over all devices on its first axis, the rest replicated; shardings the
  caller gave are kept."""
  if mesh is None:
    return args
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  n = mesh.devices.size

  def place(position: int) -> Callable[[Any], Any]:
    def leaf(x: Any) -> Any:
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return x
      if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
        return x
      split = position == 2 and n > 1 and x.ndim and x.shape[0] % n == 0
      spec = P(mesh.axis_names) if split else P()
      sharding = NamedSharding(mesh, spec)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return leaf

  return tuple(jax.tree.map(place(i), a) for i, a in enumerate(args))


def _call_args_for(args_for: Callable[[int], Any], n: int) -> tuple:
  args = args_for(n)
  if not isinstance(args, (tuple, list)):
    raise TypeError(
      "`args_for(n)` must return the step's arguments as a tuple, got"
      f" {type(args).__name__} for n={n}."
    )
  return tuple(args)


def _batch_multiple(whole: tuple, where: _Where) -> int:
  """How many shards the batch's first axis is split into (1 unsharded),
  from the arguments of the whole global batch."""
  args = placed(whole, where.mesh)
  shards = 1
  for x in jax.tree.leaves(args[2:3]):
    sharding = getattr(x, "sharding", None)
    if getattr(x, "ndim", 0) and sharding is not None:
      shards = max(shards, x.shape[0] // sharding.shard_shape(x.shape)[0])
  return shards


def _divisors(global_batch: int, multiple: int) -> list[int]:
  """Divisors of `global_batch` that are multiples of `multiple`."""
  small = [
    d for d in range(1, math.isqrt(global_batch) + 1) if global_batch % d == 0
  ]
  every = sorted(set(small + [global_batch // d for d in small]))
  sizes = [d for d in every if d % multiple == 0]
  if not sizes:
    raise ValueError(
      f"`global_batch` {global_batch} has no divisor that splits over the"
      f" {multiple} devices the batch is sharded over: make it a multiple"
      f" of {multiple}."
    )
  return sizes


def _check_args_for(args_for, sizes: list[int], whole: tuple) -> None:
  """The arguments hold an AccumulateState and grow with n (`whole`: those
  of the largest size, the global batch)."""
  small = _call_args_for(args_for, sizes[0])
  leaves = jax.tree.leaves(small, is_leaf=_state.is_accumulate_state)
  if not any(_state.is_accumulate_state(x) for x in leaves):
    raise ValueError(
      "`step`'s arguments (from `args_for`) hold no AccumulateState:"
      " plan_micro_batch plans a step whose optimizer state wraps"
      " optax_accum.accumulate (the state from accumulate(tx, ...).init)."
    )
  if len(sizes) > 1:
    shapes = [
      jax.tree.map(lambda x: getattr(x, "shape", x), a) for a in (small, whole)
    ]
    if shapes[0] == shapes[1]:
      raise ValueError(
        f"`args_for` ignores n: args_for({sizes[0]}) and"
        f" args_for({sizes[-1]}) give arguments of the same shapes; it must"
        " give a batch of n examples."
      )


class _Compiler:
  """Compiles one step for micro-batch sizes; remembers every candidate."""

  def __init__(self, name, step, args_for, where: _Where, budget: int):
    self.name = name
    self.args_for = args_for
    self.where = where
    self.budget = budget
    self.step = step if hasattr(step, "lower") else jax.jit(step)
    self.trials: dict[int, Candidate] = {}
    self.costs: dict[int, tuple[float, float] | None] = {}

  def __call__(self, n: int) -> Candidate:
    args = placed(_call_args_for(self.args_for, n), self.where.mesh)
    start = time.perf_counter()
    try:
      lowered = self.step.lower(*args)
      compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 (only out-of-memory is a result)
      if not any(s in str(e) for s in _OUT_OF_MEMORY):
        e.add_note(
          f"plan_micro_batch: compiling {self.name!r} for a micro-batch of {n}"
        )
        raise
      peak, cost = _required_bytes(str(e)), None
    else:
      peak, cost = _peak(compiled.memory_analysis()), _cost(compiled)
    seconds = time.perf_counter() - start
    fits = peak is not None and peak <= self.budget
    self.trials[n] = Candidate(self.name, n, peak, fits, seconds)
    self.costs[n] = cost
    return self.trials[n]

  def cost(self, n: int) -> tuple[float, float] | None:
    """(flops, bytes accessed) per device of a micro-step of `n`: the
    compiler's figures, else (XLA:GPU without a device gives none) the
    program's before partitioning, from this machine's backend, split evenly
    over the devices."""
    if self.costs.get(n) is None:
      args = placed(_call_args_for(self.args_for, n), self.where.mesh)
      devices = 1 if self.where.mesh is None else self.where.mesh.devices.size
      here = jax.tree.map(
        lambda x: (
          jax.ShapeDtypeStruct(x.shape, x.dtype)
          if isinstance(x, jax.ShapeDtypeStruct)
          else x
        ),
        args,
      )
      analysis = _analysis(self.step.lower(*here).cost_analysis())
      self.costs[n] = (
        None
        if analysis is None
        else (
          analysis[0] / devices,
          analysis[1] / devices,
        )
      )
    return self.costs[n]


def footprint(memory: Any) -> int:
  """A compiled program's bytes per device from its ``memory_analysis()``:
  arguments + outputs + temporaries - the outputs that reuse (donated)
  argument buffers."""
  return int(
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    + memory.temp_size_in_bytes
    - memory.alias_size_in_bytes
  )


def _peak(memory: Any) -> int:
  """Peak bytes per device: the larger of the compiler's peak and the
  :func:`footprint` (XLA:CPU's reported peak leaves the temporaries out)."""
  peak = int(getattr(memory, "peak_memory_in_bytes", 0) or 0)
  return max(peak, footprint(memory))


def _required_bytes(message: str) -> int | None:
  """What a compiler's out-of-memory message says is required (XLA:TPU:
  "... required for HLO temporaries (17.00G) exceeds ...")."""
  found = re.search(r"required[^(]*\((\d+(?:\.\d+)?)([KMGT])\)", message)
  if found is None:
    return None
  scale = 2 ** (10 * "KMGT".index(found.group(2)) + 10)
  return int(float(found.group(1)) * scale)


def _cost(compiled: Any) -> tuple[float, float] | None:
  """(flops, bytes accessed) per device, where the compiler gives them."""
  return _analysis(compiled.cost_analysis())


def _analysis(analysis: Any) -> tuple[float, float] | None:
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  if not analysis:
    return None
  return float(analysis.get("flops", 0.0)), float(
    analysis.get("bytes accessed", 0.0)
  )


def _search(compiler: _Compiler, sizes: list[int], global_batch: int):
  """The largest fitting size's candidate (None if even the smallest does
  not fit), in at most ceil(log2(global_batch)) + 2 compiles."""
  bound = math.ceil(math.log2(global_batch)) + 2
  if not compiler(sizes[0]).fits:
    return None
  if len(sizes) == 1 or compiler(sizes[-1]).fits:
    return compiler.trials[sizes[-1] if len(sizes) > 1 else sizes[0]]
  lo, hi, used = 0, len(sizes) - 1, 2
  while hi - lo > 1:
    i = _next_index(compiler, sizes, lo, hi, bound - used)
    used += 1
    if compiler(sizes[i]).fits:
      lo = i
    else:
      hi = i
  return compiler.trials[sizes[lo]]


def _next_index(compiler, sizes, lo: int, hi: int, compiles_left: int) -> int:
  """The line's prediction between `lo` (fits) and `hi` (does not), or the
  middle where following the line could overrun the compile bound."""
  middle = (lo + hi) // 2
  low, high = compiler.trials[sizes[lo]], compiler.trials[sizes[hi]]
  if low.peak_bytes is None or high.peak_bytes is None:
    return middle
  slope = (high.peak_bytes - low.peak_bytes) / (
    high.micro_batch - low.micro_batch
  )
  if slope <= 0:
    return middle
  predicted = low.micro_batch + (compiler.budget - low.peak_bytes) / slope
  guess = max(i for i in range(lo, hi) if sizes[i] <= predicted or i == lo)
  guess = min(max(guess, lo + 1), hi - 1)
  worst = max(guess - lo - 1, hi - guess - 1)
  if 1 + math.ceil(math.log2(worst + 1)) <= compiles_left:
    return guess
  return middle


def _estimate(cost, every_k: int, where: _Where) -> float | None:
  """Seconds per optimizer step at the target's peak rates (an estimate)."""
  if cost is None or not where.peak_flops or not where.memory_bandwidth:
    return None
  flops, bytes_accessed = cost
  micro = max(flops / where.peak_flops, bytes_accessed / where.memory_bandwidth)
  return every_k * micro


def _choose(found: dict, where: _Where, budget: int, global_batch: int):
  """The variant with the fewest micro-steps; ties: the lowest estimate,
  else the fewest flops and bytes per optimizer step."""
  all_candidates = tuple(
    c for _, compiler in found.values() for c in compiler.trials.values()
  )
  fitting = {name: c for name, (c, _) in found.items() if c is not None}
  if not fitting:
    _nothing_fits(found, where, budget, global_batch)
  estimates: dict[str, float | None] = {}
  keys: dict[str, tuple[int, float, float, float]] = {}
  for name, (chosen, compiler) in found.items():
    if chosen is None:
      estimates[name] = None
      continue
    every_k = global_batch // chosen.micro_batch
    cost = compiler.cost(chosen.micro_batch)
    estimate = estimates[name] = _estimate(cost, every_k, where)
    work = (0.0, 0.0) if cost is None else cost
    keys[name] = (
      every_k,
      estimate if estimate is not None else 0.0,
      every_k * work[0],
      every_k * work[1],
    )
  name = min(keys, key=lambda n: keys[n])
  chosen = fitting[name]
  return MicroBatchPlan(
    micro_batch=chosen.micro_batch,
    every_k=global_batch // chosen.micro_batch,
    peak_bytes=chosen.peak_bytes,
    limit_bytes=where.limit_bytes,
    budget_bytes=budget,
    variant=name,
    target=where.name,
    compiles=len(all_candidates),
    candidates=all_candidates,
    estimated_step_seconds=estimates,
  )


def _nothing_fits(found: dict, where: _Where, budget: int, global_batch: int):
  unit, scale = _unit(where.limit_bytes)
  smallest = []
  for name, (_, compiler) in found.items():
    first = min(compiler.trials.values(), key=lambda c: c.micro_batch)
    peak = (
      "more than it has"
      if first.peak_bytes is None
      else f"{first.peak_bytes / scale:.2f} {unit}"
    )
    smallest.append(f"{name!r} at micro-batch {first.micro_batch}: {peak}")
  raise ValueError(
    f"Nothing fits on {where.name}: even the smallest micro-batch (a divisor"
    f" of `global_batch` {global_batch}) needs more than the budget of"
    f" {budget / scale:.2f} {unit} per device ((1 - headroom) x the limit,"
    f" {where.limit_bytes / scale:.2f} {unit}): {'; '.join(smallest)}. Try"
    " jax.checkpoint on the layers (as a `variants` entry), params or"
    " optimizer state in a lower precision, sharding the params over more"
    " devices (FSDP), a smaller model, or a larger `memory_limit`."
  )
