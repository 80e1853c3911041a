"""`accumulate`: gradient accumulation as an optax transformation.

Read top to bottom: argument checks, then ``init``, then ``update``. The step
is laid out for speed on every backend (see "Why the step looks like this"
in ``update``): the accumulator add sits outside any control flow, and the
inner optimizer runs inside a ``lax.cond`` that only emitting calls enter.
"""

import numbers
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_accum import _checks, _noise_scale, _weighting
from optax_accum._state import AccumulateState

EveryK = int | Callable[[jax.Array], Any]

_REDUCTIONS = ("mean", "sum")


# ----------------------------------------------------------------------------
# Static configuration checks (construction time).
# ----------------------------------------------------------------------------


def _check_every_k(every_k: Any) -> EveryK:
  """Returns a Python int >= 1 or the schedule; raises naming `every_k`."""
  if callable(every_k) and not isinstance(every_k, jax.Array):
    return every_k
  return _checks.positive_int(
    every_k, "every_k", " or a schedule (callable(step) -> int)"
  )


def _check_options(
  reduction, accumulator_dtype, axis_name, noise_scale_decay
) -> Any:
  """Validates the keyword options; returns the accumulator dtype or None."""
  if reduction not in _REDUCTIONS:
    raise ValueError(
      f"`reduction` must be one of {_REDUCTIONS}, got {reduction!r}."
    )
  accumulator_dtype = _checks.accumulator_dtype(accumulator_dtype)
  if axis_name is not None and not isinstance(axis_name, Hashable):
    raise TypeError(
      "`axis_name` must be None or a hashable axis name (str or tuple),"
      f" got {axis_name!r}."
    )
  if isinstance(noise_scale_decay, bool) or not (
    isinstance(noise_scale_decay, numbers.Real) and 0 <= noise_scale_decay < 1
  ):
    raise ValueError(
      f"`noise_scale_decay` must be a float in [0, 1), got"
      f" {noise_scale_decay!r}."
    )
  return accumulator_dtype


# ----------------------------------------------------------------------------
# Trace-time checks.
# ----------------------------------------------------------------------------


def _check_grads_match(grads: Any, acc_grads: Any) -> None:
  """Raises a ValueError naming the first leaf where the trees differ."""
  grads_flat, grads_def = jax.tree_util.tree_flatten_with_path(grads)
  acc_flat, acc_def = jax.tree_util.tree_flatten_with_path(acc_grads)
  if grads_def != acc_def:
    grads_paths = [jax.tree_util.keystr(p) for p, _ in grads_flat]
    acc_paths = [jax.tree_util.keystr(p) for p, _ in acc_flat]
    missing = sorted(set(acc_paths) - set(grads_paths))
    extra = sorted(set(grads_paths) - set(acc_paths))
    raise ValueError(
      "`updates` must have the tree structure of the params given to"
      f" `init`; missing leaves: {missing or 'none'}, unexpected leaves:"
      f" {extra or 'none'}. Got structure {grads_def}, expected {acc_def}."
    )
  for (path, g), (_, a) in zip(grads_flat, acc_flat, strict=True):
    if np.shape(g) != np.shape(a):
      raise ValueError(
        f"`updates` leaf {jax.tree_util.keystr(path)} has shape"
        f" {np.shape(g)}, but the params given to `init` have shape"
        f" {np.shape(a)} there."
      )


def _scalar(value: Any, name: str, dtype: Any) -> jax.Array:
  """Converts a scalar argument, raising a ValueError naming it otherwise."""
  value = jnp.asarray(value)
  if value.ndim != 0:
    raise ValueError(
      f"`{name}` must be a scalar (one value per micro-batch), got shape"
      f" {value.shape}."
    )
  return value.astype(dtype)


def _sq_norm(tree: Any, scale: Any = 1.0) -> jax.Array:
  r""":math:`|\text{scale} \cdot x|^2` summed over the leaves, in float32.

  Complex leaves count their modulus, so no imaginary part is lost.
  """
  total = jnp.zeros([], jnp.float32)
  for x in jax.tree.leaves(tree):
    x = jnp.abs(x) if jnp.iscomplexobj(x) else jnp.asarray(x)
    total += jnp.sum(jnp.square(x.astype(jnp.float32) * scale))
  return total


def _inverse_weight(total_weight: jax.Array) -> jax.Array:
  """1 / W, with 1 for a non-positive W (whose cycle emits nothing); a NaN W
  stays NaN so that it reaches ``inner``."""
  return 1.0 / jnp.where(total_weight <= 0, 1.0, total_weight)


def _holds_exactly(wide: Any, narrow: Any) -> bool:
  """Whether every value of dtype `narrow` survives a trip through `wide`."""
  return jnp.dtype(wide) == jnp.dtype(narrow) or (
    jnp.promote_types(wide, narrow) == jnp.dtype(wide)
    and jnp.issubdtype(narrow, jnp.inexact)
  )


def _axis_names(axis_name: Hashable) -> frozenset:
  return frozenset(axis_name if isinstance(axis_name, tuple) else (axis_name,))


def _varying_axes(aval: Any) -> frozenset:
  """Manual mesh axes a value varies over inside ``shard_map``, else empty."""
  # jax >= 0.9: `mat` on avals, `manual_axis_type` on ShapeDtypeStruct;
  # older jax: `vma`.
  mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def _vary_over(x: Any, axes: frozenset) -> Any:
  """Marks `x` as varying over `axes` (a no-op on the values)."""
  missing = tuple(sorted(axes - _varying_axes(jax.typeof(x)), key=str))
  if not missing:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, missing, to="varying")
  return lax.pvary(x, missing)  # older jax


def _cond(pred, true_fun, false_fun, *operands):
  """``lax.cond`` whose branches may differ in the axes their outputs vary over.

  Inside ``shard_map`` with ``check_vma=True`` (the default), a value summed
  by ``psum`` in one branch no longer varies over the axis while the other
  branch passes the unreduced value through, and ``lax.cond`` demands equal
  types: each output is marked as varying over the union of both branches'
  axes. When no operand varies (outside ``shard_map``, under ``vmap``) this
  is plain ``lax.cond`` and the branches are not traced twice.
  """
  if not any(_varying_axes(jax.typeof(x)) for x in jax.tree.leaves(operands)):
    return lax.cond(pred, true_fun, false_fun, *operands)
  out_types = [jax.eval_shape(f, *operands) for f in (true_fun, false_fun)]
  axes = jax.tree.map(
    lambda a, b: _varying_axes(a) | _varying_axes(b), *out_types
  )

  def unify(fun):
    def unified(*args):
      return jax.tree.map(_vary_over, fun(*args), axes)

    return unified

  return lax.cond(pred, unify(true_fun), unify(false_fun), *operands)


# ----------------------------------------------------------------------------
# The transformation.
# ----------------------------------------------------------------------------


def accumulate(
  inner: optax.GradientTransformation,
  every_k: EveryK,
  *,
  reduction: str = "mean",
  accumulator_dtype: Any = jnp.float32,
  skip_nonfinite: bool = False,
  axis_name: Hashable | None = None,
  track_noise_scale: bool = False,
  noise_scale_decay: float = 0.99,
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates gradients over ``every_k`` micro-batches, then runs ``inner``.

  Each call adds one micro-batch gradient :math:`g_i` with weight
  :math:`w_i` (``weight=``, default 1) to an accumulator. The call that
  completes a cycle of :math:`k` micro-batches hands ``inner`` the gradient

  .. math::

    \bar g = \frac{\sum_{i=1}^{k} w_i g_i}{\sum_{i=1}^{k} w_i}
    \quad (\text{reduction="mean"}), \qquad
    \bar g = \sum_{i=1}^{k} w_i g_i \quad (\text{reduction="sum"}),

  and returns ``inner``'s updates; the other calls return exact zeros and
  leave ``inner``'s state untouched. ``inner`` is only executed on emitting
  calls (under ``jit`` it sits inside a ``lax.cond``), so its cost, and any
  schedule inside it, is paid once per optimizer step.

  If each micro-batch gradient is a mean over its own examples or tokens,
  pass their number as ``weight``: the emitted gradient is then exactly the
  big-batch mean over all examples or tokens, however unevenly they are
  spread over the micro-batches.

  Rules for the runtime values (not checked under ``jit``):

  * a micro-batch of weight 0 counts toward :math:`k` but contributes
    nothing, even if its gradient is NaN or Inf (the 0/0 per-token mean of
    an all-padding micro-batch); a cycle whose total weight is not positive
    emits zeros, leaves ``inner``'s state and ``step`` unchanged and
    produces no NaN; weights are meant to be :math:`\geq 0`;
  * ``flush=True`` ends the cycle at this call, however many micro-batches
    it holds, normalised by what was actually accumulated (the partial last
    window of an epoch); on an empty cycle it emits nothing;
  * a schedule ``every_k(step)`` is called with ``state.step``; its value is
    rounded down and values below 1 are treated as 1;
  * with ``skip_nonfinite=True`` a micro-batch whose weight, or whose
    gradient at nonzero weight, holds a NaN or Inf is dropped as if the call
    never happened (it does not count toward :math:`k`) and ``num_skipped``
    grows; without it the NaN reaches ``inner`` at the end of the cycle.

  Args:
    inner: The optimizer to run once per cycle, any
      ``optax.GradientTransformation``; it receives the extra keyword
      arguments of ``update`` (e.g. ``value=``) on emitting calls.
    every_k: Micro-batches per cycle, a positive int, or a schedule
      ``callable(step: int32[]) -> int`` for batch-size warm-up.
    reduction: ``"mean"`` (weighted mean, the default) or ``"sum"``.
    accumulator_dtype: The dtype of the accumulator (float32 by default, so
      bf16 gradients do not lose precision); ``None`` keeps each gradient
      leaf's dtype. Complex gradient leaves get the matching complex dtype;
      for float64 gradients pass ``jnp.float64`` or ``None``. Emitted
      gradients keep the gradient's dtype.
    skip_nonfinite: Drop micro-batches with a non-finite gradient or weight.
    axis_name: A named axis (``shard_map``, ``pmap``, ``vmap``) over which
      the accumulated gradients and weights are summed on emitting calls
      only. Pass each device's local, unreduced gradient: communication
      then happens once per cycle instead of once per micro-batch.
    track_noise_scale: Also estimate the gradient noise scale (a few scalars
      in the state); read it with :func:`optax_accum.noise_scale`.
    noise_scale_decay: Decay of the noise scale's moving averages.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` is
    ``update(updates, state, params=None, *, weight=None, flush=False,
    **extra_args)`` and whose state is an :class:`AccumulateState`.

  Raises:
    TypeError, ValueError: For a bad ``every_k`` (0, negative, float, bool,
      str, None), ``reduction``, ``accumulator_dtype``, ``axis_name`` or
      ``noise_scale_decay``, at construction; for gradients whose tree or
      shapes differ from the params, or a non-scalar ``weight``, at trace
      time.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> u, state = tx.update(jnp.array([1.0, 2.0]), state, params, weight=1)
    >>> print(u)
    [0. 0.]
    >>> u, state = tx.update(jnp.array([4.0, 8.0]), state, params, weight=3)
    >>> print(u)  # -(1 * [1, 2] + 3 * [4, 8]) / 4
    [-3.25 -6.5 ]
  """
  every_k = _check_every_k(every_k)
  accumulator_dtype = _check_options(
    reduction, accumulator_dtype, axis_name, noise_scale_decay
  )
  inner = optax.with_extra_args_support(inner)

  def acc_dtype(leaf: Any) -> Any:
    return _checks.leaf_accumulator_dtype(accumulator_dtype, leaf.dtype)

  def init_fn(params: optax.Params) -> AccumulateState:
    def zeros_like_param(p):
      # Keep the param's sharding. Outside jit a committed param's sharding
      # is copied explicitly. Under jit, zeros_like keeps the sharding that
      # an explicit-axes mesh puts in the tracer's type; with auto axes the
      # zeros do not depend on the param and nothing is propagated: pass
      # `out_shardings=optax_accum.state_shardings(tx, params)` to jit.
      sharding = getattr(p, "sharding", None)
      if isinstance(p, jax.Array) and not isinstance(p, jax.core.Tracer):
        return jnp.zeros(p.shape, acc_dtype(p), device=sharding)
      return jnp.zeros_like(p, dtype=acc_dtype(jnp.asarray(p)))

    # Separate calls: every leaf is its own buffer, so the whole state can
    # be donated to jit.
    return AccumulateState(
      micro_step=jnp.zeros([], jnp.int32),
      step=jnp.zeros([], jnp.int32),
      acc_grads=jax.tree.map(zeros_like_param, params),
      acc_weight=jnp.zeros([], jnp.float32),
      inner_state=inner.init(params),
      num_skipped=jnp.zeros([], jnp.int32),
      emitted=jnp.zeros([], jnp.bool_),
      noise_sq_norm_sum=jnp.zeros([], jnp.float32),
      noise_count=jnp.zeros([], jnp.int32),
      noise_grad_sq=jnp.zeros([], jnp.float32),
      noise_trace=jnp.zeros([], jnp.float32),
      noise_cycles=jnp.zeros([], jnp.int32),
    )

  def update_fn(
    updates: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None = None,
    *,
    weight: Any = None,
    flush: Any = False,
    **extra_args: Any,
  ) -> tuple[optax.Updates, AccumulateState]:
    # Why the step looks like this. A micro-step should cost a gradient add.
    # On XLA:CPU, the operands and results of a conditional are materialised
    # buffers, which blocks fusing the gradient into the accumulator add and
    # costs a parameter-sized buffer for the updates the conditional returns.
    # So: (1) the add happens before and outside the conditional; (2) the
    # reset is lazy (a new cycle ignores the old contents instead of zeroing
    # them); (3) the conditional's only big operand and result is the
    # accumulator itself: the emitting branch writes the inner updates into
    # the accumulator's buffer (scratch after emission, thanks to (2)) and
    # the holding branch passes it through untouched; (4) the zero updates
    # of a micro-step are a `where` outside the conditional, which fuses with
    # `optax.apply_updates`. The inner optimizer still runs only in the
    # emitting branch.
    if not isinstance(state, AccumulateState):
      raise TypeError(
        "`state` must be the AccumulateState returned by this"
        f" transformation's init, got {type(state).__name__}."
      )
    _check_grads_match(updates, state.acc_grads)
    grads = updates
    has_weight = weight is not None
    weight = _scalar(1.0 if weight is None else weight, "weight", jnp.float32)

    if (
      every_k == 1
      and not has_weight
      and flush is False
      and not (skip_nonfinite or axis_name is not None)
    ):
      # Every call emits and the mean of one unweighted gradient is the
      # gradient itself: call the inner directly, bit for bit like `inner`
      # alone, with no conditional and no accumulator traffic (the state's
      # accumulator is left as it is).
      new_updates, inner_state = inner.update(
        grads, state.inner_state, params, **extra_args
      )
      return new_updates, state._replace(
        step=optax.safe_increment(state.step),
        inner_state=inner_state,
        emitted=jnp.asarray(True),
      )

    may_flush = flush is not False  # a Python False needs no collective
    flush = _scalar(flush, "flush", jnp.bool_)
    grad_leaves = jax.tree.leaves(grads)
    grad_types = jax.tree.map(
      lambda g: jax.ShapeDtypeStruct(jnp.shape(g), jnp.result_type(g)), grads
    )
    if skip_nonfinite:
      grads_finite = jnp.asarray(True)
      for g in grad_leaves:
        grads_finite &= jnp.all(jnp.isfinite(g))
      # A zero-weight micro-batch (e.g. the 0/0 mean of an all-padding
      # micro-batch) counts toward k and contributes nothing, NaN or not.
      finite = jnp.isfinite(weight) & (grads_finite | (weight == 0))
    else:
      finite = jnp.asarray(True)
    if axis_name is not None:
      # Replicas must agree on what is skipped and on when a cycle ends.
      if skip_nonfinite:
        finite = lax.pmin(finite.astype(jnp.int32), axis_name) > 0
      if may_flush:
        flush = lax.pmax(flush.astype(jnp.int32), axis_name) > 0

    # (1) + (2): the add, outside control flow; a new cycle starts from 0.
    fresh = state.micro_step == 0

    def add(acc, g):
      compute = _weighting.compute_dtype(acc.dtype)
      base = jnp.where(fresh, jnp.zeros([], compute), acc.astype(compute))
      term = _weighting.weighted_term(
        g, weight if has_weight else None, compute
      )
      summed = base + term
      if skip_nonfinite:
        summed = jnp.where(finite, summed, base)
      return summed.astype(acc.dtype)

    acc = jax.tree.map(add, state.acc_grads, grads)
    accepted = finite.astype(jnp.int32)
    micro_step = state.micro_step + accepted
    total_weight = jnp.where(fresh, 0.0, state.acc_weight) + jnp.where(
      finite, weight, 0.0
    )

    noise = _noise_scale._NoiseFields(
      sq_norm_sum=state.noise_sq_norm_sum,
      count=state.noise_count,
      grad_sq=state.noise_grad_sq,
      trace=state.noise_trace,
      cycles=state.noise_cycles,
    )
    if track_noise_scale:
      sq_norm = _sq_norm(grad_leaves)
      counted = finite & (weight > 0)
      noise = noise._replace(
        sq_norm_sum=jnp.where(fresh, 0.0, noise.sq_norm_sum)
        + jnp.where(counted, weight * sq_norm, 0.0),
        count=jnp.where(fresh, 0, noise.count) + counted.astype(jnp.int32),
      )

    if callable(every_k):
      k = jnp.asarray(every_k(state.step))
      if not jnp.issubdtype(k.dtype, jnp.integer):
        k = jnp.floor(k)
      k = jnp.maximum(k.astype(jnp.int32), 1)
    else:
      k = every_k
    cycle_end = (micro_step >= k) | flush
    if axis_name is None:
      # Locally known: skip the branch entirely for a weightless cycle.
      enter = cycle_end & ~(total_weight <= 0)  # a NaN total reaches inner
    else:
      # The global weight is only known after the reduction in the branch.
      enter = cycle_end & (micro_step > 0)

    inner_shapes = jax.eval_shape(
      lambda g, s, p: inner.update(g, s, p, **extra_args),
      grad_types,
      state.inner_state,
      params,
    )
    inner_updates_shape = inner_shapes[0]
    # (3) applies when each update leaf fits its accumulator leaf exactly.
    reuse_buffer = jax.tree.structure(
      inner_updates_shape
    ) == jax.tree.structure(acc) and all(
      u.shape == a.shape and _holds_exactly(a.dtype, u.dtype)
      for u, a in zip(
        jax.tree.leaves(inner_updates_shape), jax.tree.leaves(acc), strict=True
      )
    )
    # Not inside shard_map with check_vma=True: there the accumulator varies
    # over `axis_name` while the updates, summed over it, do not, and one
    # buffer cannot hold both types.
    reuse_buffer = reuse_buffer and not (
      axis_name is not None
      and any(
        _axis_names(axis_name) & _varying_axes(jax.typeof(a))
        for a in jax.tree.leaves(acc)
      )
    )

    def zero_updates():
      return jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), inner_updates_shape
      )

    def run_inner(acc, total_weight, noise, inner_state, params):
      if axis_name is not None:
        # One all-reduce per cycle: the gradient sum and its weight, plus the
        # noise-scale sums (the count as float32 so it joins the same op).
        if track_noise_scale:
          acc, total_weight, sq_sum, count = lax.psum(
            (
              acc,
              total_weight,
              noise.sq_norm_sum,
              noise.count.astype(jnp.float32),
            ),
            axis_name,
          )
          noise = noise._replace(
            sq_norm_sum=sq_sum, count=count.astype(noise.count.dtype)
          )
        else:
          acc, total_weight = lax.psum((acc, total_weight), axis_name)
      positive = ~(total_weight <= 0)  # NaN: let it reach `inner`
      # A multiply, not a divide: XLA duplicates a cheap elementwise op into
      # every consumer fusion of the inner optimizer, but materialises a
      # divide into a parameter-sized buffer first.
      inv_weight = _inverse_weight(total_weight)

      def mean_grad(a, g):
        compute = _weighting.compute_dtype(a.dtype)
        if reduction == "mean":
          a = a.astype(compute) * inv_weight.astype(compute)
        return a.astype(g.dtype)

      # `grad_types` holds shapes only: closing over the gradient arrays
      # would make them operands of the conditional and materialise them.
      grad = jax.tree.map(mean_grad, acc, grad_types)
      if track_noise_scale:
        if axis_name is None:
          mean_sq = local_mean_sq
        else:  # The global mean is only known after the psum above.
          mean_sq = _sq_norm(acc, inv_weight)
        noise = _noise_scale._fold_cycle(
          noise, mean_sq, total_weight, noise_scale_decay
        )

      def apply(grad, inner_state, params):
        new_updates, new_state = inner.update(
          grad, inner_state, params, **extra_args
        )
        # Branches must agree on types: keep every state leaf's dtype.
        new_state = jax.tree.map(
          lambda new, old: (
            new if new.dtype == old.dtype else new.astype(old.dtype)
          ),
          new_state,
          inner_state,
        )
        return new_updates, new_state, jnp.asarray(True)

      def hold(grad, inner_state, params):
        del params
        return zero_updates(), inner_state, jnp.asarray(False)

      if axis_name is None:
        new_updates, inner_state, emitted = apply(grad, inner_state, params)
      else:
        new_updates, inner_state, emitted = _cond(
          positive, apply, hold, grad, inner_state, params
        )
      if reuse_buffer:
        new_updates = jax.tree.map(
          lambda u, a: u.astype(a.dtype), new_updates, acc
        )
      return new_updates, total_weight, noise, inner_state, emitted

    def keep(acc, total_weight, noise, inner_state, params):
      del params
      held = acc if reuse_buffer else zero_updates()
      return held, total_weight, noise, inner_state, jnp.asarray(False)

    if track_noise_scale and axis_name is None:
      # |mean gradient|^2 in a small conditional of its own, before the main
      # one. Inside the emitting branch this reduction reads the accumulator
      # with no data dependency on the inner's in-place writes into the same
      # buffer (3), so XLA copies the whole accumulator in the holding branch
      # on every call: a parameter-sized buffer more, and its traffic.
      local_mean_sq = lax.cond(
        enter,
        lambda a, w: _sq_norm(a, _inverse_weight(w)),
        lambda a, w: jnp.zeros([], jnp.float32),
        acc,
        total_weight,
      )

    cond = lax.cond if axis_name is None else _cond
    out, total_weight, noise, inner_state, emitted = cond(
      enter,
      run_inner,
      keep,
      acc,
      total_weight,
      noise,
      state.inner_state,
      params,
    )
    if reuse_buffer:
      # (4) the buffer holds the updates after emission, the sum otherwise.
      new_updates = jax.tree.map(
        lambda b, s: jnp.where(emitted, b.astype(s.dtype), 0),
        out,
        inner_updates_shape,
      )
      acc = out
    else:
      new_updates = out

    new_state = AccumulateState(
      micro_step=jnp.where(cycle_end, 0, micro_step),
      step=jnp.where(emitted, optax.safe_increment(state.step), state.step),
      acc_grads=acc,
      acc_weight=total_weight,
      inner_state=inner_state,
      num_skipped=jnp.where(
        finite, state.num_skipped, optax.safe_increment(state.num_skipped)
      ),
      emitted=emitted,
      noise_sq_norm_sum=noise.sq_norm_sum,
      noise_count=noise.count,
      noise_grad_sq=noise.grad_sq,
      noise_trace=noise.trace,
      noise_cycles=noise.cycles,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
