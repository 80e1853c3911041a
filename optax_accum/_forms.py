"""What each backend compiles at a cycle's end, and why.

``update`` ends a call one of three ways (``_accumulate.py``): the device
decides whether the cycle ends (:func:`decide_on_device`, the default), or
the caller did at trace time (:func:`end_cycle_now` for ``emit=True``,
:func:`keep_cycle_open` for ``emit=False``). Each form here is a
workaround of a compiler's fusion and copy rules, said beside it:

* :func:`decide`: **one conditional** decides on the device whether the
  call ends the cycle (:func:`_control.cond`: an integer switch whose
  branch 0 holds, so that no compiler turns it into selects or copies what
  it passes through). Its updating branch runs the inner optimizer on the
  cycle's mean gradient (``_inner.py``) and, where the types allow, writes
  the updates into the accumulator's own buffer (:func:`shares_buffer`);
  the holding branch passes everything through. A small state on one GPU
  takes selects instead (:func:`decides_with_selects`), and narrow
  updates on GPU/TPU a switch that applies them inside
  (:func:`apply_inside`);
* **the zero updates** of a micro-step are a ``where`` outside the
  conditional, which fuses with ``optax.apply_updates``;
* **closing the cycle** (:func:`close`): given the params, the updates are
  applied (what :func:`optax_accum.apply_updates` returns, see
  ``_apply.py``) in a way that leaves a micro-step reading and writing
  neither; on GPU/TPU the accumulator returns to zeros there, while on CPU
  it keeps the updates as *leftovers* (``micro_step`` 0 with the cycle's
  weight beside them, -inf for a weightless cycle), which the next call
  does not read: its add starts from zeros, a select fused into it
  (:func:`cycle_start`).

Where CPU and GPU/TPU programs differ is :func:`_control.per_backend` and its
callers. One meaning of the state on every backend: while a cycle is open
(micro_step > 0), ``acc_grads`` and ``acc_weight`` hold its sum and total
weight. At micro_step 0 no cycle is open: ``acc_grads`` holds zeros
(weight 0), or leftovers of the last cycle (a non-zero weight), which the
next cycle does not read. The CPU form leaves leftovers, the GPU/TPU form
zeros; both take either, so a state saved on one backend resumes on any
other (``tests/test_backend_forms.py``): bit for bit, except that the
GPU/TPU form throws leftovers away with their cycle. What differs is how the
code gets there, because XLA:CPU and XLA:GPU/TPU fuse and copy around a
conditional differently.

The structure tests (``tests/test_performance_structure.py`` for CPU,
``tests/test_accelerators.py`` compiled for an H100 and a TPU v5e) hold the
compiled programs to these points.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum import _control, _inner
from optax_accum._control import Local
from optax_accum._inner import Inner, InnerOperands, Ran
from optax_accum._records import (
  Config,
  Cycle,
  Noise,
  Result,
  Types,
  zeros_like_type,
)


class Branch(NamedTuple):
  """What each branch of a closing conditional returns (the same fields in
  every branch, so that the conditional's outputs have names)."""

  # The updates; where they share the accumulator's buffer, that buffer.
  out: optax.Updates
  acc: optax.Updates | None  # the accumulator; None where `out` is it
  params: optax.Params | None  # updated where the branch applied them
  weight: jax.Array  # float32[]: the cycle's global total weight
  noise: Noise
  inner_state: optax.OptState
  updated: jax.Array  # bool[]: inner ran on a cycle of positive weight
  cycle_weight: jax.Array  # the ended cycle's global weight, else 0


class Closed(NamedTuple):
  """The params and the accumulator once a cycle's updates were read."""

  params: optax.Params | None  # the updates applied; None without params
  acc: optax.Updates
  acc_weight: jax.Array


# ----------------------------------------------------------------------------
# The default: the device decides.
# ----------------------------------------------------------------------------


def decide_on_device(
  config: Config, engine: Local, inner: Inner, cycle: Cycle
) -> Result:
  """The default (``emit=None``): a conditional decides on the device
  whether this call ends the cycle.

  Where the updates are narrower than the accumulator (bf16 params, a
  float32 accumulator) and the params are given, a program for GPU/TPU
  applies them in the updating branch (:func:`apply_inside`) instead of
  passing them through the accumulator's buffer, which costs the updating
  step a float32 write and read of every update there. Everything else is
  :func:`decide`, which CPU programs keep for narrow updates too, and so
  does every program on a jax whose XLA copies what a later branch passes
  through (:data:`_control.LATER_BRANCHES_COPY`, before jax 0.11.1): there
  the switch's weightless branch would copy the params and the inner state
  on every call.

  On a GPU, one device, an accumulator below
  :data:`_control.SELECTS_BELOW_BYTES`: :func:`decide` with selects in
  place of its conditionals (``selects=True``), as XLA:GPU compiles
  ``optax.MultiSteps``' conditional: the inner optimizer runs on every call,
  which over a small state costs the device less than a conditional costs
  the host's dispatch.
  """
  shares = shares_buffer(engine, inner, cycle.acc)
  # (`shares`: the same tree and shapes, so the leaves pair up.)
  narrow = shares and any(
    jnp.dtype(u.dtype).itemsize < jnp.dtype(a.dtype).itemsize
    for u, a in zip(
      jax.tree.leaves(inner.update_types),
      jax.tree.leaves(cycle.acc),
      strict=True,
    )
  )
  conditional = functools.partial(decide, config, engine, inner, shares=shares)
  accelerator = conditional
  if narrow and cycle.params is not None and not _control.LATER_BRANCHES_COPY:
    accelerator = functools.partial(apply_inside, config, engine, inner)
  small = decides_with_selects(engine.axis_name, cycle.acc)
  return _control.per_backend(
    cycle,
    cpu=conditional,
    accelerator=accelerator,
    gpu=functools.partial(conditional, selects=True) if small else None,
  )


def decides_with_selects(axis_name: Hashable | None, acc: Any) -> bool:
  """Whether a GPU program of this call ends a cycle with selects: one
  device (no `axis_name`) and an accumulator below
  :data:`_control.SELECTS_BELOW_BYTES`. With `axis_name` never: the selects would
  run the emitting branch's reduction on every micro-step (k times the
  communication the deferred reduction promises), whatever the size. Held
  by ``tests/test_accelerators.py`` (a small state compiled for 8 H100s
  keeps its conditional and its one reduction inside; plant
  ``selects_with_axis_name``)."""
  if axis_name is not None:
    return False
  size = sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(acc))
  return size < _control.SELECTS_BELOW_BYTES


def decide(
  config: Config,
  engine: Local,
  inner: Inner,
  cycle: Cycle,
  *,
  shares: bool,
  selects: bool = False,
) -> Result:
  """One conditional decides on the device whether this call ends the
  cycle.

  Where the updates share the accumulator's buffer (`shares`:
  :func:`shares_buffer`) the updating branch writes them there and
  :func:`close` closes the cycle once they are read. Otherwise (another
  tree, a buffer that varies over devices) they get buffers of their own
  and the updating branch zeroes the accumulator and applies them itself.
  With `selects` (a small state on a GPU, :func:`decide_on_device`) both
  branches run and selects keep the one the conditional would have taken:
  no conditional anywhere in the call.
  """
  # A weightless cycle skips the branch (a NaN total still enters, so that
  # the NaN reaches `inner`). Inside shard_map the global weight is known
  # only in the branch, which then checks it itself.
  checked = shares and engine.global_weight
  enter = cycle.ends & ~(cycle.weight <= 0) if checked else cycle.ends
  mean_sq = None
  if config.track_noise_scale and engine.axis_name is None:
    # Measured before the conditional (with axis_name it needs the reduced
    # sum, inside).
    mean_sq = (
      _inner.mean_sq_norm(cycle.acc, cycle.weight)
      if selects
      else _control.in_own_conditional(
        enter,
        _inner.mean_sq_norm,
        jnp.zeros([], jnp.float32),
        cycle.acc,
        cycle.weight,
      )
    )

  def update(cycle: Cycle, mean_sq: jax.Array | None) -> Branch:
    mean = _inner.cycle_mean(
      config, engine, inner, cycle, mean_sq, per_leaf=False
    )
    run = _inner.run_inner if checked else _inner_where_weighted
    ran = run(config, inner, mean.operands, apply=not shares)
    if shares:
      out = jax.tree.map(lambda u, a: u.astype(a.dtype), ran.updates, cycle.acc)
      acc = params = None
    else:
      out, params = ran.updates, ran.params
      acc = engine.cleared(cycle.ends, cycle.acc, mean.operands.total)
    # The global weight twice, as the ended cycle's too: under shard_map
    # the first joins the device-local accumulator's slot.
    return Branch(
      out=out,
      acc=acc,
      params=params,
      weight=mean.weight,
      noise=mean.noise,
      inner_state=ran.inner_state,
      updated=jnp.asarray(True) if checked else mean.operands.weighted,
      cycle_weight=mean.weight,
    )

  hold = functools.partial(_holding, inner, shares=shares)
  if selects:
    branch = select(enter, update(cycle, mean_sq), hold(cycle, mean_sq))
  else:
    branch = _control.cond(enter, update, hold, cycle, mean_sq)
  if shares:
    return close(engine, inner, cycle, branch, selects=selects)
  return _applied_in_branch(cycle, branch)


def _applied_in_branch(cycle: Cycle, branch: Branch) -> Result:
  """The call's result where the updating branch applied the updates and
  zeroed the accumulator itself (the updates in buffers of their own)."""
  return Result(
    updates=branch.out,
    updated=branch.updated,
    new_params=branch.params,
    acc=branch.acc,
    acc_weight=jnp.where(cycle.ends, 0.0, branch.weight),
    noise=branch.noise,
    inner_state=branch.inner_state,
    cycle_ends=cycle.ends,
    cycle_weight=branch.cycle_weight,
  )


def _holding(
  inner: Inner, cycle: Cycle, mean_sq: jax.Array | None = None, *, shares: bool
) -> Branch:
  """The branch that holds: everything passed through, no updates (the
  accumulator's own buffer where they share it, else traced zeros).
  (`mean_sq`: the operand :func:`decide`'s branches share, unread.)"""
  del mean_sq
  return Branch(
    out=cycle.acc if shares else _no_updates(inner, cycle.ends),
    acc=None if shares else cycle.acc,
    params=None if shares else cycle.params,
    weight=cycle.weight,
    noise=cycle.noise,
    inner_state=_settle(cycle.inner_state, inner.state_types),
    updated=jnp.asarray(False),
    cycle_weight=jnp.zeros([], cycle.weight.dtype),
  )


def _no_updates(inner: Inner, flag: jax.Array) -> optax.Updates:
  """Zero updates, a traced value per leaf from a `flag` that is false where
  this runs (:func:`_control.distinct_zeros`)."""
  leaves, treedef = jax.tree.flatten(inner.update_types)
  zeros = _control.distinct_zeros(leaves, flag, zeros_like_type)
  return jax.tree.unflatten(treedef, zeros)


def apply_inside(
  config: Config, engine: Local, inner: Inner, cycle: Cycle
) -> Result:
  """GPU/TPU, narrow updates, params given: one switch. Branch 0 holds
  (passes everything through); branch 1 ends a weighted cycle: the inner
  optimizer on the mean, the params updated and the accumulator zeroed in
  its kernels, as the ``emit=True`` step does; branch 2 ends a
  weightless one (the accumulator zeroed, nothing applied). The updates
  get buffers of their own, which XLA drops when the caller applies them
  with :func:`optax_accum.apply_updates` (with ``optax.apply_updates`` a
  micro-step writes narrow zeros there, as many bytes as reading the
  shared buffer costs it, ``tests/test_accelerators.py``).

  One device (a local ``global_weight``): the weight that decides the
  branch is the cycle's whole weight.
  """
  weighted = ~(cycle.weight <= 0)  # a NaN total enters, to reach `inner`
  index = jnp.where(cycle.ends, jnp.where(weighted, 1, 2), 0)

  def update(cycle: Cycle) -> Branch:
    mean = _inner.cycle_mean(config, engine, inner, cycle, None, per_leaf=False)
    ran = _inner.run_inner(config, inner, mean.operands, apply=True)
    acc = engine.cleared(cycle.ends, cycle.acc, mean.operands.total)
    return _holding(inner, cycle, shares=False)._replace(
      out=ran.updates,
      acc=acc,
      params=ran.params,
      noise=mean.noise,
      inner_state=ran.inner_state,
      updated=jnp.asarray(True),
      cycle_weight=cycle.weight,
    )

  def weightless(cycle: Cycle) -> Branch:
    acc = engine.cleared(cycle.ends, cycle.acc, cycle.acc)
    return _holding(inner, cycle, shares=False)._replace(
      out=_no_updates(inner, ~cycle.ends), acc=acc
    )

  hold = functools.partial(_holding, inner, shares=False)
  branch = _control.switch(index, (hold, update, weightless), cycle)
  return _applied_in_branch(cycle, branch)


# ----------------------------------------------------------------------------
# emit=True and emit=False: the caller decided.
# ----------------------------------------------------------------------------


def end_cycle_now(
  config: Config, engine: Local, inner: Inner, cycle: Cycle
) -> Result:
  """``emit=True``: the caller says this call ends the cycle. With
  ``axis_name``, no conditional (the leaves reduced one by one, so that
  each may start as soon as its gradient is added; selects keep a
  weightless cycle's result out) and the accumulator left at zeros (the
  reduced sum's: see ``_engines.py``).

  On one device with the params given, the params are updated here too
  (what :func:`optax_accum.apply_updates` returns), and a program compiled
  for CPU runs the inner optimizer in a conditional of its own that applies
  them in place (:func:`_run_if_weighted`) and leaves the accumulator
  as leftovers: the cycle's sum beside its weight (-inf for a weightless
  cycle's), which the next call does not read (:func:`cycle_start`).
  XLA:CPU fuses neither the zeroing pass nor the applying pass into the
  optimizer's kernels at the top level of a program: the ``emit=True`` step was
  1.7x the traced one's at 64 MB (``benchmarks/bench_loop.py``).
  """
  mean_sq = None
  if config.track_noise_scale and engine.axis_name is None:
    mean_sq = _inner.mean_sq_norm(cycle.acc, cycle.weight)
  mean = _inner.cycle_mean(config, engine, inner, cycle, mean_sq, per_leaf=True)
  always = _control.traced_true(cycle.micro_step)

  def ended(ran: Ran, acc: optax.Updates, acc_weight: jax.Array) -> Result:
    return Result(
      updates=ran.updates,
      updated=mean.operands.weighted,
      new_params=ran.params,
      acc=acc,
      acc_weight=acc_weight,
      noise=mean.noise,
      inner_state=ran.inner_state,
      cycle_ends=jnp.asarray(True),
      cycle_weight=mean.weight,
    )

  if engine.axis_name is not None or cycle.params is None:
    run = (
      run_then_select if engine.axis_name is not None else _inner_where_weighted
    )
    ran = run(config, inner, mean.operands, apply=False)
    acc = engine.cleared(always, cycle.acc, mean.operands.total)
    return ended(ran, acc, jnp.zeros_like(cycle.weight))

  def leftovers(cycle: Cycle) -> Result:
    ran = _run_if_weighted(config, inner, mean.operands, apply=True)
    weight = jnp.where(cycle.weight == 0, -jnp.inf, cycle.weight)
    return ended(ran, cycle.acc, weight)

  def zeros(cycle: Cycle) -> Result:
    ran = run_then_select(config, inner, mean.operands, apply=False)
    ran = ran._replace(params=optax.apply_updates(cycle.params, ran.updates))
    acc = _control.cleared(always, cycle.acc, engine)
    return ended(ran, acc, jnp.zeros_like(cycle.weight))

  return _control.per_backend(cycle, cpu=leftovers, accelerator=zeros)


def keep_cycle_open(inner: Inner, cycle: Cycle) -> Result:
  """``emit=False``: the caller says the cycle goes on. The add and the
  counters only: no conditional, no inner optimizer."""
  return Result(
    updates=jax.tree.map(zeros_like_type, inner.update_types),
    updated=jnp.asarray(False),
    new_params=None,
    acc=cycle.acc,
    acc_weight=cycle.weight,
    noise=cycle.noise,
    inner_state=_settle(cycle.inner_state, inner.state_types),
    cycle_ends=jnp.asarray(False),
    # Not zeros_like: under shard_map the weight varies over the devices.
    cycle_weight=jnp.zeros([], jnp.float32),
  )


# ----------------------------------------------------------------------------
# Running the inner optimizer where a branch decides on the weight: with
# selects that keep a weightless cycle's result out (`run_then_select`), or
# in a conditional of its own (`_run_if_weighted`, CPU); the backend
# chooses between the two (`_inner_where_weighted`). Each takes `apply`:
# also apply the updates to the params, next to `inner`.
# ----------------------------------------------------------------------------


def run_then_select(
  config: Config, inner: Inner, operands: InnerOperands, *, apply: bool
) -> Ran:
  """`inner` run anyway, its result kept for a positive weight by selects
  that fuse into the inner's own kernels."""
  ran = _inner.run_inner(config, inner, operands, apply=False)
  weighted, params = operands.weighted, operands.params
  updates = jax.tree.map(
    lambda u: jnp.where(weighted, u, jnp.zeros([], u.dtype)), ran.updates
  )
  state = select(weighted, ran.inner_state, operands.state)
  if not apply or params is None:
    return Ran(updates, state, None)
  applied = optax.apply_updates(params, updates)
  return Ran(updates, state, select(weighted, applied, params))


def _run_if_weighted(
  config: Config, inner: Inner, operands: InnerOperands, *, apply: bool
) -> Ran:
  """The CPU form of :func:`_inner_where_weighted`: `inner` in a
  conditional of its own (:func:`_control.run_if_weighted`), whose holding
  branch passes the state through (zero updates, the state and params as
  they were). XLA:CPU does not update the state in place under selects,
  and copies every inner-state leaf twice per micro-step."""

  def run(operands: InnerOperands) -> Ran:
    return _inner.run_inner(config, inner, operands, apply=apply)

  def skip(operands: InnerOperands) -> Ran:  # `weighted` is false here
    updates = _no_updates(inner, operands.weighted)
    state = _settle(operands.state, inner.state_types)
    return Ran(updates, state, operands.params if apply else None)

  return _control.run_if_weighted(operands.weighted, run, skip, operands)


def _inner_where_weighted(
  config: Config, inner: Inner, operands: InnerOperands, *, apply: bool
) -> Ran:
  """The inner optimizer, in a conditional branch that ends every cycle
  (weightless ones too): its result where the total weight is positive (or
  NaN), else zero updates and the state and params as they were. On CPU
  :func:`_run_if_weighted`; on GPU/TPU :func:`run_then_select` (a
  conditional of its own there costs the 8-H100 ``shard_map`` step a
  quarter of the accumulator more memory, ``tests/test_accelerators.py``).
  A caller already in one backend's form calls that form itself."""
  return _control.per_backend(
    operands,
    cpu=functools.partial(_run_if_weighted, config, inner, apply=apply),
    accelerator=functools.partial(run_then_select, config, inner, apply=apply),
  )


def _settle(inner_state: optax.OptState, types: Types) -> optax.OptState:
  """`inner_state` in the dtypes `inner` itself gives its new state.

  So that a holding call leaves the state typed as an updating one, and the
  inner state behaves as with `inner` alone (which may widen a state leaf,
  e.g. bf16 moments fed float32 gradients).
  """
  return jax.tree.map(
    lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype),
    inner_state,
    types,
  )


# ----------------------------------------------------------------------------
# Closing a cycle whose updates share the accumulator's buffer.
# ----------------------------------------------------------------------------


def close(
  engine: Local,
  inner: Inner,
  cycle: Cycle,
  branch: Branch,
  *,
  selects: bool = False,
) -> Result:
  """The call's result once the updates the updating branch wrote into the
  accumulator's buffer (`branch.out`) have been read: the updates (exact
  zeros unless updated: a select outside the conditional, which fuses with
  ``optax.apply_updates``), the params with them applied (None without
  params), and the state's accumulator and weight.

  * GPU/TPU: a second conditional, entered when the cycle ends, applies the
    updates and zeroes the buffer in place (weight 0); on a micro-step it
    passes both through untouched, so a micro-step neither reads nor writes
    them and the add into the accumulator fuses into each weight gradient's
    GEMM;
  * CPU: the params are applied in a conditional of their own, and the
    buffer keeps the updates (or a weightless cycle's sum): leftovers, which
    the cycle's weight left beside them at micro_step 0 marks (-inf for a
    weightless cycle: its sum need not be zeros, e.g. mixed-sign weights),
    and which the next call does not read (:func:`cycle_start`);
  * with `selects` (a small state on a GPU): the GPU/TPU form's closing
    branch run on every call, its selects doing what the conditional did.

  On CPU, returning the buffer to zeros here costs every micro-step a pass
  over it (a select after the conditional), or, wherever the caller reads the
    updates after the step
    (``optax.apply_updates``), a copy of it (a conditional that zeroes it:
    XLA:CPU copies a buffer that a conditional passes through when it is
    read after; ``tools/cpu_cond_probe.py``).
  """
  update_types, updated, ends = inner.update_types, branch.updated, cycle.ends

  def applied(params, out):
    updates = jax.tree.map(lambda b, t: b.astype(t.dtype), out, update_types)
    return optax.apply_updates(params, updates)

  def close(params, out):
    if params is not None:  # The select fuses into the update's kernel.
      params = select(updated, applied(params, out), params)
    return params, _control.cleared(ends, out, engine)

  def in_conditional(params, out, weight) -> Closed:
    if selects:
      params, out = close(params, out)
    else:
      params, out = _control.cond(ends, close, lambda p, o: (p, o), params, out)
    return Closed(params, out, jnp.where(ends, 0.0, weight))

  def leftovers(params, out, weight) -> Closed:
    if params is not None:
      params = _control.cond(updated, applied, lambda p, o: p, params, out)
    return Closed(
      params, out, jnp.where(ends & (weight == 0), -jnp.inf, weight)
    )

  closed = _control.per_backend(
    cycle.params,
    branch.out,
    branch.weight,
    cpu=leftovers,
    accelerator=in_conditional,
  )
  return Result(
    updates=jax.tree.map(
      lambda b, t: jnp.where(updated, b.astype(t.dtype), 0),
      branch.out,
      update_types,
    ),
    updated=updated,
    new_params=closed.params,
    acc=closed.acc,
    acc_weight=closed.acc_weight,
    noise=branch.noise,
    inner_state=branch.inner_state,
    cycle_ends=ends,
    cycle_weight=branch.cycle_weight,
  )


def shares_buffer(engine: Local, inner: Inner, acc: optax.Updates) -> bool:
  """Whether the updates can be written into the accumulator's buffer:
  the same tree and shapes, dtypes the accumulator holds exactly, and (with
  ``axis_name``) an engine whose accumulator has the updates' type."""
  update_types = inner.update_types
  update_tree: _control.TreeDef = jax.tree.structure(update_types)
  same = (
    update_tree == jax.tree.structure(acc)
    and all(
      u.shape == a.shape
      for u, a in zip(
        jax.tree.leaves(update_types), jax.tree.leaves(acc), strict=True
      )
    )
    and fits(update_types, acc)
  )
  return same and (engine.axis_name is None or engine.shares_buffer(acc))


def fits(values: optax.Updates, acc: optax.Updates) -> bool:
  """Whether each accumulator leaf holds the values of the leaf of `values`
  (arrays, scalars or their types) beside it exactly: a float32
  accumulator for bfloat16 or float32 gradients."""
  return all(
    _holds_exactly(a.dtype, jnp.result_type(v))
    for v, a in zip(jax.tree.leaves(values), jax.tree.leaves(acc), strict=True)
  )


def _holds_exactly(
  wide: jax.typing.DTypeLike, narrow: jax.typing.DTypeLike
) -> bool:
  """Whether every value of dtype `narrow` survives a trip through `wide`."""
  wide, narrow = jnp.dtype(wide), jnp.dtype(narrow)
  if wide == narrow:
    return True
  if not (
    jnp.issubdtype(wide, jnp.inexact) and jnp.issubdtype(narrow, jnp.inexact)
  ):
    return False
  if jnp.issubdtype(narrow, jnp.complexfloating) and not jnp.issubdtype(
    wide, jnp.complexfloating
  ):
    return False
  w, n = jnp.finfo(wide), jnp.finfo(narrow)
  return w.nmant >= n.nmant and w.maxexp >= n.maxexp and w.minexp <= n.minexp


def select(flag: jax.Array, new: Any, old: Any) -> Any:
  """`new` where the scalar `flag` is true, else `old` cast to `new`'s
  dtypes, leaf by leaf."""
  return jax.tree.map(
    lambda n, o: jnp.where(flag, n, o.astype(n.dtype)), new, old
  )
