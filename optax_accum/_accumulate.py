"""`accumulate`: gradient accumulation as an optax transformation.

Read top to bottom: the configuration and its checks, the steps of
``update`` as module-level functions, then :func:`accumulate` itself.

Why the step looks like this. A micro-step should cost what the gradient and
its add into the accumulator cost (the floor), on CPU, GPU and TPU alike, and
the step should need no memory beyond the accumulator. So:

1. the add happens before and outside control flow, straight into the
   state's accumulator, with every select (a weight of 0, a skipped
   micro-batch) on the gradient's side: compiled for GPU, XLA then fuses
   ``acc + grad`` into the GEMM that makes each weight gradient, which it
   does only for an accumulator that is a parameter of the step;
2. one conditional decides on the device whether the call ends the cycle
   (``_control.cond``: an integer switch whose branch 0 holds, so that no
   compiler turns it into selects or copies what it passes through). Its
   emitting branch runs the inner optimizer and writes the updates into the
   accumulator's buffer; the holding branch passes everything through;
3. the zero updates of a micro-step are a ``where`` outside the
   conditional, which fuses with ``optax.apply_updates``;
4. once the updates are read, a second conditional returns the accumulator
   to zeros at a cycle's end and, given the params, applies the updates
   (what :func:`optax_accum.apply_updates` returns); its holding branch
   passes both through, so a micro-step reads and writes neither. The
   engines whose updates cannot share the accumulator's buffer do this in
   the first conditional;
5. XLA:CPU's copy insertion would copy the buffer that point 4 reads, so
   compiled for CPU (``lax.platform_dependent``) the accumulator keeps the
   update until the next cycle starts, and that start ignores it;
6. with ``update(..., emit=True | False)`` the caller says at trace time
   whether the call ends the cycle: no conditional at all.

The structure tests (``tests/test_performance_structure.py`` for CPU,
``tests/test_accelerators.py`` compiled for an H100 and a TPU v5e) hold the
compiled programs to these points.

With ``axis_name``, :mod:`optax_accum._engine` picks per trace how the
accumulator is reduced: ``psum`` inside ``shard_map``, or, under plain
``jit``, one ``jax.reshard`` of an accumulator typed unreduced over the axis.
"""

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_accum import (
  _apply,
  _checks,
  _control,
  _engines,
  _every_k,
  _noise_scale,
  _tree,
  _unreduced,
)
from optax_accum._noise_scale import NoiseStats
from optax_accum._state import AccumulateState, NoiseScaleState

EveryK = int | Callable[..., Any] | _every_k.GrowEveryK

_REDUCTIONS = ("mean", "sum")
_GRADIENTS = ("mean", "sum")


class InnerForEveryK(NamedTuple):
  """An inner transformation built for each cycle's k; see
  :func:`inner_for_every_k`."""

  factory: Callable[[jax.Array], optax.GradientTransformation]


def inner_for_every_k(
  factory: Callable[[jax.Array], optax.GradientTransformation],
) -> InnerForEveryK:
  r"""Makes the inner optimizer a function of the cycle's number of micro-batches.

  When ``every_k`` grows during training (a schedule or
  :func:`grow_every_k`) the batch grows with it, and the learning rate
  usually should too: OLMo-core multiplies Adam's by
  :math:`\sqrt{k / k_0}`. Pass ``inner=inner_for_every_k(factory)`` to
  :func:`accumulate`: each emitting call runs ``factory(k)``, with ``k`` the
  cycle's ``every_k`` as an ``int32[]``, and ``init`` uses ``factory`` of
  the first cycle's k. The state's structure must not depend on k (true
  when k only enters hyperparameters such as the learning rate).

  Args:
    factory: ``factory(k) -> optax.GradientTransformation``.

  Returns:
    A value to pass as ``inner``.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(
    ...     optax_accum.inner_for_every_k(
    ...         lambda k: optax.sgd(0.1 * jnp.sqrt(k / 2))),
    ...     every_k=lambda step: 2 * (step + 1))  # k = 2, 4, 6, ...
    >>> params = jnp.zeros(1)
    >>> state = tx.init(params)
    >>> for k in (2, 4):
    ...   for _ in range(k):
    ...     updates, state = tx.update(jnp.ones(1), state, params)
    ...   print(k, updates)
    2 [-0.1]
    4 [-0.14142136]
  """
  if not callable(factory):
    raise TypeError(
      "`factory` must be callable as factory(k) -> GradientTransformation,"
      f" got {factory!r}."
    )
  return InnerForEveryK(factory)


@dataclasses.dataclass(frozen=True)
class _Config:
  """The validated arguments of :func:`accumulate`."""

  inner: Callable[[Any], optax.GradientTransformationExtraArgs]  # k -> inner
  every_k: _every_k.Spec
  reduction: str
  accumulator_dtype: Any
  skip_nonfinite: bool
  axis_name: Hashable | None
  track_noise_scale: bool
  noise_scale_decay: float
  gradients: str = "mean"
  reduce_dtype: Any = None


# ----------------------------------------------------------------------------
# Construction-time checks.
# ----------------------------------------------------------------------------


def _as_transformation(inner: Any) -> optax.GradientTransformationExtraArgs:
  """`inner` with extra-args support; raises naming `inner` otherwise."""
  init, update = (getattr(inner, name, None) for name in ("init", "update"))
  if not (callable(init) and callable(update)):
    hint = ""
    if isinstance(inner, optax.GradientTransformation):
      hint = " Its `init` and `update` must both be callable."
    elif callable(inner):
      name = getattr(inner, "__name__", "the factory")
      hint = f" Did you mean to call it, e.g. `{name}(1e-3)`?"
    raise TypeError(
      "`inner` must be an optax.GradientTransformation, e.g."
      f" `optax.adam(1e-3)`; got {inner!r} of type"
      f" {type(inner).__name__}.{hint}"
    )
  if not isinstance(inner, optax.GradientTransformation):
    inner = optax.GradientTransformation(init, update)
  return optax.with_extra_args_support(inner)


def _check_inner(inner: Any) -> Callable[[Any], Any]:
  """`k -> inner transformation`; checks a fixed inner at once."""
  if isinstance(inner, InnerForEveryK):
    return lambda k: _as_transformation(inner.factory(k))
  inner = _as_transformation(inner)
  return lambda k: inner


def _check_options(reduction: Any, axis_name: Any, gradients: Any) -> None:
  if reduction not in _REDUCTIONS:
    raise ValueError(
      f"`reduction` must be one of {_REDUCTIONS}, got {reduction!r}."
    )
  if gradients not in _GRADIENTS:
    raise ValueError(
      f"`gradients` must be one of {_GRADIENTS} (what each micro-batch"
      f" gradient is over its `weight`), got {gradients!r}."
    )
  if axis_name is not None and not isinstance(axis_name, Hashable):
    raise TypeError(
      "`axis_name` must be None or a hashable axis name (str or tuple),"
      f" got {axis_name!r}."
    )


def _check_reduce_dtype(reduce_dtype: Any, axis_name: Any) -> Any:
  """`reduce_dtype` as a floating dtype or None; raises naming it."""
  if reduce_dtype is None:
    return None
  if axis_name is None:
    raise ValueError(
      "`reduce_dtype` sets the dtype in which the accumulated gradient"
      " crosses devices, which needs `axis_name`; got reduce_dtype="
      f"{reduce_dtype!r} without an axis_name."
    )
  try:
    dtype = jnp.dtype(reduce_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      "`reduce_dtype` must be None or a floating dtype such as"
      f" `jnp.bfloat16`, got {reduce_dtype!r}."
    )
  return dtype


# ----------------------------------------------------------------------------
# init.
# ----------------------------------------------------------------------------


def _gradient_params(params: optax.Params) -> optax.Params:
  """The params the gradients are taken with respect to.

  ``optax.lookahead`` keeps ``LookaheadParams(fast, slow)`` and expects
  gradients with respect to ``fast`` only.
  """
  if isinstance(params, optax.LookaheadParams):
    return params.fast
  return params


def _zeros_like_param(
  param: Any, accumulator_dtype: Any, engine: _engines.Engine
) -> jax.Array:
  """A zero accumulator leaf placed like `param`.

  A committed array's sharding is copied; an uncommitted one (created
  without a device) gives an uncommitted accumulator, as optax's own states.
  Under ``jit`` an explicit-axes mesh puts the sharding in the tracer's type
  and ``zeros_like`` keeps it; with auto axes pass
  ``out_shardings=optax_accum.distributed.state_shardings(tx, params)`` to ``jit``.
  """
  dtype = _checks.leaf_accumulator_dtype(
    accumulator_dtype, jnp.result_type(param)
  )
  if engine.unreduced:
    return _unreduced.unreduced_zeros_like(param, engine.axis_name, dtype)
  if isinstance(param, jax.Array) and not isinstance(param, jax.core.Tracer):
    device = param.sharding if param.committed else None
    return jnp.zeros(param.shape, dtype, device=device)
  return jnp.zeros_like(param, dtype=dtype)


# ----------------------------------------------------------------------------
# update, step by step.
# ----------------------------------------------------------------------------


def _check_state(state: Any, track_noise_scale: bool) -> None:
  if not isinstance(state, AccumulateState):
    raise TypeError(
      "`state` must be the AccumulateState returned by this"
      f" transformation's init, got {type(state).__name__}."
    )
  tracked = isinstance(state.noise, NoiseScaleState)
  if tracked != track_noise_scale:
    raise ValueError(
      "`state` was made by an accumulate with"
      f" track_noise_scale={tracked}, but this one has"
      f" track_noise_scale={track_noise_scale}."
    )


def _check_tree_matches(name: str, tree: Any, acc_grads: Any) -> list:
  """Raises naming `name` and the first leaf where the tree or a shape
  differs from the accumulator's (the params given to `init`).

  Returns:
    ``(key path, leaf, accumulator leaf)`` of every leaf.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  acc_flat, acc_def = jax.tree_util.tree_flatten_with_path(acc_grads)
  if treedef != acc_def:
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    acc_paths = [jax.tree_util.keystr(p) for p, _ in acc_flat]
    missing = sorted(set(acc_paths) - set(paths))
    extra = sorted(set(paths) - set(acc_paths))
    raise ValueError(
      f"`{name}` must have the tree structure of the params given to"
      f" `init`; missing leaves: {missing or 'none'}, unexpected leaves:"
      f" {extra or 'none'}. Got structure {treedef}, expected {acc_def}."
    )
  leaves = []
  for (path, x), (_, a) in zip(flat, acc_flat, strict=True):
    where = jax.tree_util.keystr(path)
    if np.shape(x) != np.shape(a):
      raise ValueError(
        f"`{name}` leaf {where} has shape {np.shape(x)}, but the params"
        f" given to `init` have shape {np.shape(a)} there."
      )
    leaves.append((where, x, a))
  return leaves


def _dtype_of(x: Any) -> Any:
  # `.dtype` first: jax.grad's float0 zeros are NumPy arrays JAX cannot read.
  return np.dtype(x.dtype) if hasattr(x, "dtype") else jnp.result_type(x)


def _check_grads_match(grads: Any, acc_grads: Any) -> None:
  """Raises naming the first leaf where the trees, shapes or kinds differ."""
  for where, g, a in _check_tree_matches("updates", grads, acc_grads):
    if jnp.iscomplexobj(g) and not jnp.iscomplexobj(a):
      raise TypeError(
        f"`updates` leaf {where} is complex ({jnp.result_type(g)}) but the"
        " params given to `init` are real there: the imaginary part would"
        " be lost. Take real gradients, or make those params complex."
      )
    # Python ints too: the mean would be emitted in their dtype, truncated.
    dtype = _dtype_of(g)
    if jnp.issubdtype(a.dtype, jnp.inexact) and not jnp.issubdtype(
      dtype, jnp.inexact
    ):
      raise TypeError(
        f"`updates` leaf {where} has dtype {dtype}, but its accumulator is"
        f" {a.dtype}: gradients must be floating (or complex). An integer"
        " or boolean gradient is usually something else passed by mistake"
        " (a mask, labels, a count); to accumulate such values on purpose,"
        " cast them first, e.g. `g.astype(jnp.float32)`."
      )


def _check_params_match(params: Any, acc_grads: Any) -> None:
  """Raises naming `params` where they are not the params given to `init`
  (the inner optimizer reads them, and apply_updates adds to them)."""
  if params is not None:
    _check_tree_matches("params", _gradient_params(params), acc_grads)


def _check_weight(weight: Any, skip_nonfinite: bool) -> jax.Array:
  """`weight` as a float32[]; raises naming it. A concrete negative weight
  raises, and so does a concrete NaN or Inf unless `skip_nonfinite` (which
  drops that micro-batch); a traced one is used as given."""
  w = _checks.real_scalar(
    weight, "`weight` must be", " (one value per micro-batch)"
  )
  if not isinstance(w, jax.core.Tracer):
    value = np.asarray(w)
    if value < 0:
      raise ValueError(f"`weight` must be >= 0, got {value}.")
    if not (np.isfinite(value) or skip_nonfinite):
      raise ValueError(
        f"`weight` must be finite, got {value}: the cycle's mean would be"
        " NaN. Build accumulate with `skip_nonfinite=True` to drop such"
        " micro-batches instead."
      )
  return w.astype(jnp.float32)


def _check_flush(flush: Any) -> jax.Array:
  """`flush` as a bool[]; raises naming it."""
  try:
    is_bool_scalar = not (flush is None or isinstance(flush, str | bytes)) and (
      jnp.result_type(flush) == jnp.bool_ and jnp.ndim(flush) == 0
    )
  except (TypeError, ValueError):  # a list, an arbitrary object
    is_bool_scalar = False
  if not is_bool_scalar:
    raise TypeError(
      "`flush` must be a boolean scalar (True ends the cycle at this call),"
      f" got {flush!r} of type {type(flush).__name__}."
    )
  return jnp.asarray(flush)


def _check_noise_stats(
  config: _Config, engine: _engines.Engine, noise_stats: Any
) -> NoiseStats | None:
  """`noise_stats` where the engine needs them; raises naming them."""
  if noise_stats is None:
    if engine.unreduced and config.track_noise_scale:
      raise ValueError(
        "`noise_stats` must be given with `track_noise_scale=True` and"
        f" gradients unreduced over {config.axis_name!r} under plain"
        " `jax.jit`: the unreduced gradient hides each device's own"
        " gradient and token count. Make the gradients with"
        " `optax_accum.distributed.local_value_and_grad(..., noise_stats=True)` and"
        " pass its stats as `update(..., noise_stats=stats)`."
      )
    return None
  if not config.track_noise_scale:
    raise ValueError(
      "`noise_stats` was given, but this accumulate was built with"
      " `track_noise_scale=False`: build it with `track_noise_scale=True`"
      " or leave the argument out."
    )
  if not engine.unreduced:
    raise ValueError(
      "`noise_stats` is only for gradients unreduced over `axis_name` under"
      " plain `jax.jit`; here accumulate measures each gradient itself:"
      " leave the argument out."
    )
  if not isinstance(noise_stats, NoiseStats):
    raise TypeError(
      "`noise_stats` must be the optax_accum.distributed.NoiseStats returned by"
      " `local_value_and_grad(..., noise_stats=True)`, got"
      f" {type(noise_stats).__name__}."
    )
  return noise_stats


def _check_emit(emit: Any, flush: Any) -> bool | None:
  """`emit` as None or a Python bool; raises naming it."""
  if emit is None:
    return None
  if not isinstance(emit, bool | np.bool_):
    raise TypeError(
      "`emit` must be None (the counter decides on the device) or a Python"
      " bool known when the step is traced, e.g. `jax.jit(step,"
      f" static_argnames='emit')`; got {emit!r} of type"
      f" {type(emit).__name__}."
    )
  if flush is not False:
    raise ValueError(
      "`flush` cannot be combined with `emit`: a call with `emit=True`"
      " already ends the cycle, whatever its length. Pass `emit=True`"
      f" instead of `flush`; got flush={flush!r} with emit={emit!r}."
    )
  return bool(emit)


class _MicroBatch(NamedTuple):
  """One call's gradient and what the caller said about it."""

  grads: Any
  weight: jax.Array  # float32[]; 1 when no weight was given
  weighted: bool  # static: a weight was given
  accepted: jax.Array  # bool[]: not dropped by skip_nonfinite
  flush: jax.Array  # bool[]


def _accept(
  config: _Config,
  engine: _engines.Engine,
  grads: Any,
  weight: jax.Array | None,
  flush: jax.Array,
  may_flush: bool,
) -> _MicroBatch:
  """Decides whether the micro-batch counts.

  Args:
    weight, flush: As checked by :func:`_check_weight` (None: no weight
      given) and :func:`_check_flush`.
    may_flush: `flush` was not a Python False (which needs no collective).
  """
  weighted = weight is not None
  if not weighted:
    weight = jnp.ones([], jnp.float32)
  accepted = jnp.asarray(True)
  if config.skip_nonfinite:
    grads_finite = engine.all_finite(grads)
    # A zero-weight micro-batch (e.g. the 0/0 mean of an all-padding
    # micro-batch) counts toward k and contributes nothing, NaN or not.
    accepted = jnp.isfinite(weight) & (grads_finite | (weight == 0))
  if engine.kind == _engines.SHARD_MAP:
    # Replicas must agree on what is skipped and on when a cycle ends
    # (under plain jit, the unreduced engine's scalars are global already),
    # and so must the devices holding shards of one replica's gradient
    # (HSDP: the other manual axes the decision varies over).
    if config.skip_nonfinite:
      accepted = _agreed(lax.pmin, accepted, config.axis_name)
    if may_flush:
      flush = _agreed(lax.pmax, flush, config.axis_name)
  return _MicroBatch(grads, weight, weighted, accepted, flush)


def _agreed(reduce: Callable, flag: jax.Array, axis_name: Any) -> jax.Array:
  """`flag` reduced with `reduce` over `axis_name` and every other manual
  axis it varies over: the same on every device of the step."""
  axes = _control.axis_names(axis_name) | _control.varying_axes(
    jax.typeof(flag)
  )
  return reduce(flag.astype(jnp.int32), tuple(sorted(axes, key=str))) > 0


def _add_leaf(acc, g, *, keep, weight, engine):
  """Design point 1: ``acc + term``, with every select on the term's side.

  The weight and the skip decision are scalars: selecting the term with a
  scalar predicate keeps the add fusable into the GEMM that makes `g`
  (XLA:GPU fuses ``acc + f(dot)`` where `acc` is a parameter of the step,
  not ``f(acc) + dot``).
  """
  compute = _tree.compute_dtype(acc.dtype)
  term = jnp.asarray(g).astype(compute)
  if weight is not None:
    term = engine.scale(term, weight)
  if keep is not None:
    # Weight 0 adds exact zeros, even where `g` is NaN (see weighted_term).
    term = engine.select(keep, term, engine.zero(term))
  return (acc.astype(compute) + term).astype(acc.dtype)


def _per_backend(*args: Any, cpu: Callable, accelerator: Callable) -> Any:
  """`cpu(*args)` in a program compiled for CPU, `accelerator(*args)` for
  GPU and TPU (design point 5); chosen when the program is lowered, so only
  one of them is in it."""
  return lax.platform_dependent(*args, cpu=cpu, default=accelerator)


def _cycle_start(engine: _engines.Engine, state: AccumulateState):
  """The sums a call adds into, per backend (design point 5).

  Compiled for GPU or TPU, the accumulator is the state's own, untouched,
  so that the add fuses into the gradient's GEMM: it holds zeros at a
  cycle start, except on a state that a program compiled for CPU (or
  optax_accum 0.1) left at a cycle boundary, whose weight then starts at
  -inf so that the cycle ends without an update. Compiled for CPU, a cycle
  start ignores whatever the buffer holds (the cheaper form there).

  Returns:
    ``(accumulator, weight)``.
  """
  fresh = state.micro_step == 0

  def on_cpu(acc, weight, fresh):
    acc = jax.tree.map(lambda a: engine.select(fresh, engine.zero(a), a), acc)
    return acc, jnp.where(fresh, 0.0, weight)

  def on_accelerator(acc, weight, fresh):
    left_by_cpu = fresh & (weight != 0)
    start = jnp.where(left_by_cpu, -jnp.inf, 0.0)
    return acc, jnp.where(fresh, start, weight)

  return _per_backend(
    state.acc_grads,
    state.acc_weight,
    fresh,
    cpu=on_cpu,
    accelerator=on_accelerator,
  )


def _add(
  config: _Config,
  engine: _engines.Engine,
  state: AccumulateState,
  micro: _MicroBatch,
) -> tuple[Any, jax.Array]:
  """The new accumulator and total weight after adding `micro`."""
  acc, weight = _cycle_start(engine, state)
  keep = micro.accepted if config.skip_nonfinite else None
  scale = micro.weighted and config.gradients == "mean"
  if scale:
    nonzero = micro.weight != 0
    keep = nonzero if keep is None else keep & nonzero
  # gradients="sum": the gradient carries its weight already; adding it as
  # is lets every GEMM backend fuse the add (cuBLAS only with no scale).
  add_leaf = functools.partial(
    _add_leaf,
    keep=keep,
    weight=micro.weight if scale else None,
    engine=engine,
  )
  acc = jax.tree.map(add_leaf, acc, micro.grads)
  return acc, weight + jnp.where(micro.accepted, micro.weight, 0.0)


def _add_noise(
  noise: Any,
  micro: _MicroBatch,
  stats: NoiseStats | None,
  fresh: jax.Array,
  summed: bool,
  sample_axes: Any = None,
) -> Any:
  """The noise-scale sums after `micro`: measured here, or by the gradient
  helper (`stats`, unreduced engine); `summed`: gradients="sum";
  `sample_axes`: see :func:`_noise_scale.sq_norm`. An untracked `noise` (an
  empty record) passes through."""
  if not isinstance(noise, NoiseScaleState):
    return noise
  if stats is not None:
    return _noise_scale.add_stats(
      noise, stats, micro.weight, micro.accepted, fresh
    )
  return _noise_scale.add_micro_batch(
    noise, micro.grads, micro.weight, micro.accepted, fresh, summed, sample_axes
  )


def _enters_emitting_branch(
  cycle_end: jax.Array,
  total_weight: jax.Array,
  engine: _engines.Engine,
  plan: "_Plan",
) -> jax.Array:
  if engine.kind == _engines.LOCAL and plan.reuse_buffer:
    # A weightless cycle skips the branch (a NaN total still enters, so
    # that the NaN reaches `inner`); the closing conditional zeroes it.
    return cycle_end & ~(total_weight <= 0)
  # The branch closes the cycle, and under shard_map the global weight is
  # known inside it only: every cycle's end enters.
  return cycle_end


class _Plan(NamedTuple):
  """Static facts about this trace, found with ``jax.eval_shape``."""

  grad_types: Any  # ShapeDtypeStructs of the gradients.
  update_types: Any  # ... of inner's updates.
  inner_state_types: Any  # ... of inner's new state.
  reuse_buffer: bool  # Design point 2 applies.
  # Unreduced engine: PartitionSpecs of the reduced sum (the params' own
  # when given, so that `inner` sees gradients laid out like the params).
  reduced_specs: Any = None


def _holds_exactly(wide: Any, narrow: Any) -> bool:
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


def _reduced_specs(engine: _engines.Engine, acc: Any, params: Any) -> Any:
  """Where the unreduced engine's one reduction puts each leaf."""
  if not engine.unreduced:
    return None
  if params is not None:
    return jax.tree.map(_unreduced.spec_of, _gradient_params(params))
  return jax.tree.map(
    lambda a: _unreduced.reduced_spec(a, engine.axis_name), acc
  )


def _plan(
  config: _Config,
  engine: _engines.Engine,
  inner: optax.GradientTransformationExtraArgs,
  extra_args: dict,
  grads: Any,
  acc: Any,
  inner_state: Any,
  params: Any,
) -> _Plan:
  reduced_specs = _reduced_specs(engine, acc, params)
  if reduced_specs is None:
    grad_types = jax.tree.map(
      lambda g: jax.ShapeDtypeStruct(jnp.shape(g), jnp.result_type(g)), grads
    )
  else:  # The gradient `inner` sees is reduced, with a sharding in its type.
    grad_types = jax.tree.map(
      lambda g, spec: jax.ShapeDtypeStruct(
        jnp.shape(g), jnp.result_type(g), sharding=spec
      ),
      grads,
      reduced_specs,
    )
  update_types, inner_state_types = jax.eval_shape(
    lambda g, s, p: inner.update(g, s, p, **extra_args),
    grad_types,
    inner_state,
    params,
  )
  fits = jax.tree.structure(update_types) == jax.tree.structure(acc) and all(
    u.shape == a.shape and _holds_exactly(a.dtype, u.dtype)
    for u, a in zip(
      jax.tree.leaves(update_types), jax.tree.leaves(acc), strict=True
    )
  )
  # Not inside shard_map with check_vma=True: there the accumulator varies
  # over `axis_name` while the updates, summed over it, do not, and one
  # buffer cannot hold both types.
  # Nor with the unreduced engine: the accumulator is unreduced, the
  # updates are not.
  varies = engine.kind == _engines.SHARD_MAP and _control.varies_over(
    acc, config.axis_name
  )
  reuse = fits and not varies and not engine.unreduced
  return _Plan(
    grad_types, update_types, inner_state_types, reuse, reduced_specs
  )


def _zeros(types: Any, typed: bool = False) -> Any:
  """Zeros of `types`; `typed`: with the sharding in each type (explicit
  mesh axes, where both branches of a conditional must agree on it)."""

  def zeros(t):
    if typed:
      return jnp.zeros(t.shape, t.dtype, out_sharding=t.sharding.spec)
    return jnp.zeros(t.shape, t.dtype)

  return jax.tree.map(zeros, types)


def _settle(inner_state: Any, types: Any) -> Any:
  """`inner_state` in the dtypes `inner` itself gives its new state.

  So that a holding call leaves the state typed as an emitting one, and
  the inner state behaves as with `inner` alone (which may widen a state
  leaf, e.g. bf16 moments fed float32 gradients).
  """
  return jax.tree.map(
    lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype),
    inner_state,
    types,
  )


def _inverse_weight(total_weight: jax.Array) -> jax.Array:
  """1 / W, with 1 for a non-positive W (whose cycle emits nothing); a NaN W
  stays NaN so that it reaches ``inner``."""
  return 1.0 / jnp.where(total_weight <= 0, 1.0, total_weight)


def _mean_sq_norm(acc: Any, total_weight: jax.Array) -> jax.Array:
  return _noise_scale.sq_norm(acc, _inverse_weight(total_weight))


def _no_sq_norm(acc: Any, total_weight: jax.Array) -> jax.Array:
  del acc, total_weight
  return jnp.zeros([], jnp.float32)


def _local_mean_sq_norm(enter: jax.Array, acc: Any, total_weight: jax.Array):
  """|mean gradient|^2, in a small conditional of its own.

  Inside the emitting branch this reduction would read the accumulator with
  no data dependency on the inner's in-place writes into the same buffer
  (design point 2), so XLA would copy the whole accumulator in the holding
  branch on every call.
  """
  return _control.cond(enter, _mean_sq_norm, _no_sq_norm, acc, total_weight)


def _mean_gradient(acc: Any, inv_weight: jax.Array, plan: _Plan, reduction):
  """The gradient handed to `inner`, in the gradients' own dtypes."""

  def mean_leaf(a, g):
    compute = _tree.compute_dtype(a.dtype)
    if reduction == "mean":
      # A multiply, not a divide: XLA duplicates a cheap elementwise op into
      # every consumer fusion of the inner optimizer, but materialises a
      # divide into a parameter-sized buffer first.
      a = a.astype(compute) * inv_weight.astype(compute)
    return a.astype(g.dtype)

  # `grad_types` holds shapes only: closing over the gradient arrays would
  # make them operands of the conditional and materialise them.
  return jax.tree.map(mean_leaf, acc, plan.grad_types)


def _reduce(config, engine, plan, acc, weight, noise, per_leaf):
  """The cycle's sums over `axis_name`.

  Args:
    per_leaf: one reduction per accumulator leaf, so that each may start as
      soon as its own gradient is added (a static emission, where nothing
      else orders them), the scalars in one reduction of their own.
      Otherwise (inside the emitting branch, where everything waits for the
      branch anyway) one reduction of all the sums: XLA would otherwise
      join the scalars to a leaf's reduction by copying both into one
      buffer.
  """
  if config.reduce_dtype is not None:  # The dtype on the wire.
    kept = jax.tree.map(lambda a: a.dtype, acc)
    acc = jax.tree.map(lambda a: a.astype(config.reduce_dtype), acc)
    acc, weight, noise = _reduce(
      dataclasses.replace(config, reduce_dtype=None),
      engine,
      plan,
      acc,
      weight,
      noise,
      per_leaf,
    )
    return jax.tree.map(lambda a, d: a.astype(d), acc, kept), weight, noise
  if engine.kind == _engines.SHARD_MAP:
    scalars = (weight,)
    if config.track_noise_scale:  # The count as float32, to join the sum.
      scalars += (noise.sq_norm_sum, noise.count.astype(jnp.float32))
    if per_leaf:
      leaves, treedef = jax.tree.flatten(acc)
      # The scalars join one leaf's reduction as a tuple: on their own,
      # XLA would concatenate them onto a leaf, copying it.
      reduced = [lax.psum(a, config.axis_name) for a in leaves[:-1]]
      last, scalars = lax.psum((leaves[-1:], scalars), config.axis_name)
      acc = jax.tree.unflatten(treedef, reduced + last)
    else:
      acc, scalars = lax.psum((acc, scalars), config.axis_name)
    if config.track_noise_scale:
      noise = noise._replace(
        sq_norm_sum=scalars[1], count=scalars[2].astype(jnp.int32)
      )
    return acc, scalars[0], noise
  if engine.unreduced:  # The weight and the sums are global already.
    acc = _unreduced.reduce(acc, engine.axis_name, plan.reduced_specs)
  return acc, weight, noise


def _cleared_after_reduction(engine, acc, total, cycle_end):
  """Zeros in place of the device-local `acc` once `total`, its sum over the
  devices, is known: read from `total`, so that the sum can be reduced in
  place of the accumulator (reading `acc` again would keep it alive, at the
  cost of a copy of it). See :func:`_cleared` for the select."""

  def leaf(a, t):
    zeros = jnp.where(cycle_end, jnp.zeros([], t.dtype), t)
    if engine.kind == _engines.SHARD_MAP:
      return _control.vary_over(zeros, _control.varying_axes(jax.typeof(a)))
    if engine.unreduced:
      typed = _unreduced.unreduced_like(zeros, a, engine.axis_name)
      if typed is not None:
        return typed.astype(a.dtype)
    return engine.select(cycle_end, engine.zero(a), a)  # shapes differ

  if engine.kind == _engines.LOCAL:
    return _cleared(engine, acc, cycle_end)
  return jax.tree.map(leaf, acc, total)


def _fold_noise(config, noise, acc, inv_weight, weight, mean_sq):
  """The ended cycle folded into the noise-scale averages."""
  if not config.track_noise_scale:
    return noise
  if mean_sq is None:  # The global mean, known only after the all-reduce.
    mean_sq = _noise_scale.sq_norm(acc, inv_weight, config.axis_name)
  return _noise_scale.fold_cycle(
    noise, mean_sq, weight, config.noise_scale_decay
  )


def _run_inner(inner, extra_args, grad, inner_state, params):
  updates, inner_state = inner.update(grad, inner_state, params, **extra_args)
  return updates, inner_state, jnp.asarray(True)


class _Cycle(NamedTuple):
  """What the conditional that may end a cycle reads: its one operand."""

  acc: Any  # The cycle's (device-local) sum, after this call's add.
  weight: jax.Array  # float32[]: its (device-local) total weight.
  micro_step: jax.Array  # int32[]: micro-batches accepted in it.
  end: jax.Array  # bool[]: this call ends the cycle.
  noise: Any  # NoiseScaleState, or optax.EmptyState() when not tracked.
  mean_sq: Any  # |mean gradient|^2 measured outside, or None.
  inner_state: Any
  params: Any


class _Branch(NamedTuple):
  """What the conditional that may end a cycle returns."""

  out: Any  # The updates after an emission (design point 2).
  weight: jax.Array  # The cycle's total weight (global after emission).
  noise: Any
  inner_state: Any
  emitted: jax.Array  # bool[]
  cycle_weight: jax.Array  # The ended cycle's global weight, else 0.
  # Without buffer reuse the branch also closes the cycle (design point 4):
  acc: Any = None  # the accumulator, zeros after a cycle's end;
  params: Any = None  # the params, with the updates applied if emitted.


def _if_emitted(emitted: jax.Array, new: Any, old: Any) -> Any:
  """`new` where the call emitted, else `old` (cast to `new`'s dtypes)."""
  return jax.tree.map(
    lambda n, o: jnp.where(emitted, n, o.astype(n.dtype)), new, old
  )


def _emission(config, engine, tx, plan, extra_args, cycle: _Cycle, static):
  """The cycle's (reduced) mean gradient through `tx`, the inner
  transformation.

  Args:
    static: the caller said this call ends the cycle (no conditional).

  Unless the total weight is known to be positive (or NaN) here, the inner
  runs anyway and its result is kept only for a positive total weight:
  selects that fuse into the inner's own kernels, where a conditional would
  materialise the mean gradient.

  Returns:
    ``(updates, inner_state, emitted, weight, noise, total)``, with the
    cycle's global weight and noise-scale sums, and its reduced sum.
  """
  checked = not static and engine.kind == _engines.LOCAL and plan.reuse_buffer
  acc, weight, noise = _reduce(
    config, engine, plan, cycle.acc, cycle.weight, cycle.noise, static
  )
  inv_weight = _inverse_weight(weight)
  grad = _mean_gradient(acc, inv_weight, plan, config.reduction)
  noise = _fold_noise(config, noise, acc, inv_weight, weight, cycle.mean_sq)
  updates, inner_state, emitted = _run_inner(
    tx, extra_args, grad, cycle.inner_state, cycle.params
  )
  if not checked:
    emitted = ~(weight <= 0)  # NaN: let it reach `inner`
    updates = jax.tree.map(
      lambda u: jnp.where(emitted, u, jnp.zeros([], u.dtype)), updates
    )
    inner_state = _if_emitted(emitted, inner_state, cycle.inner_state)
  return updates, inner_state, emitted, weight, noise, acc


def _emit(config, engine, tx, plan, extra_args, cycle: _Cycle) -> _Branch:
  """The emitting branch (see :func:`_enters_emitting_branch`)."""
  updates, inner, emitted, weight, noise, total = _emission(
    config, engine, tx, plan, extra_args, cycle, static=False
  )
  if plan.reuse_buffer:
    updates = jax.tree.map(lambda u, a: u.astype(a.dtype), updates, cycle.acc)
    # The weight again, as the ended cycle's global weight: under
    # shard_map the first copy joins the device-local accumulator's slot.
    return _Branch(updates, weight, noise, inner, emitted, weight)
  params = cycle.params
  if params is not None:
    params = _if_emitted(emitted, optax.apply_updates(params, updates), params)
  return _Branch(
    updates,
    weight,
    noise,
    inner,
    emitted,
    weight,
    _cleared_after_reduction(engine, cycle.acc, total, cycle.end),
    params,
  )


def _hold(plan, cycle: _Cycle) -> _Branch:
  """The holding branch: passes the accumulator through (design point 2)."""
  if plan.reuse_buffer:
    held, acc, params = cycle.acc, None, None
  else:  # Unused, and dropped by XLA, when the updates are applied with
    # optax_accum.apply_updates. One zero per leaf, not one merged value
    # that each output would copy (see _cleared): `cycle.end` is false here.
    leaves, treedef = jax.tree.flatten(plan.update_types)
    typed = plan.reduced_specs is not None
    held = jax.tree.unflatten(
      treedef,
      [
        _zeros(t, typed) * jnp.where(cycle.end, i + 1.0, 0.0).astype(t.dtype)
        for i, t in enumerate(leaves)
      ],
    )
    acc, params = cycle.acc, cycle.params
  return _Branch(
    held,
    cycle.weight,
    cycle.noise,
    _settle(cycle.inner_state, plan.inner_state_types),
    jnp.asarray(False),
    jnp.zeros([], cycle.weight.dtype),
    acc,
    params,
  )


def _cleared(engine: _engines.Engine, acc: Any, cycle_end: jax.Array) -> Any:
  """Zeros in place of `acc` (`cycle_end` is true where this runs).

  A select that reads `acc`, not constant zeros: XLA merges equal constants
  into one value, and outputs sharing one value, or computed from nothing
  they could be written over, are copied, on micro-steps too. NaN-safe,
  unlike ``0 * acc``."""
  return jax.tree.map(
    lambda a: engine.select(cycle_end, engine.zero(a), a), acc
  )


def _applied(plan: _Plan, params: Any, out: Any) -> Any:
  """`params` with the updates held in the conditional's buffer applied."""
  updates = jax.tree.map(lambda b, t: b.astype(t.dtype), out, plan.update_types)
  return optax.apply_updates(params, updates)


def _close_cycle(
  engine: _engines.Engine,
  plan: _Plan,
  params: Any,
  out: Any,
  cycle_end: jax.Array,
  emitted: jax.Array,
) -> tuple[Any, Any]:
  """Design point 4, with buffer reuse: once the updates are read, the
  accumulator the state keeps and, given `params`, the params with the
  updates applied if they were emitted (what
  :func:`optax_accum.apply_updates` returns).

  Compiled for GPU or TPU, one conditional on `cycle_end` returns the
  accumulator (the buffer `out`) to zeros and applies the updates; its
  holding branch passes both through, so that a micro-step neither reads
  nor writes them. It has two branches: XLA copies the pass-through operands
  of a conditional with more. Compiled for CPU, whose copy insertion would
  copy the buffer this conditional reads, the buffer stays as it is (a
  cycle start there ignores it) and a conditional of its own applies the
  updates.

  Returns:
    ``(new_params, accumulator)``; `new_params` is None without `params`.
  """

  def keep(params, out):
    return params, out

  def close(params, out):
    if params is not None:  # The select fuses into the update's kernel.
      params = _if_emitted(emitted, _applied(plan, params, out), params)
    return params, _cleared(engine, out, cycle_end)

  def on_accelerator(params, out):
    return _control.cond(cycle_end, close, keep, params, out)

  def on_cpu(params, out):
    if params is not None:
      params = _control.cond(
        emitted,
        functools.partial(_applied, plan),
        lambda params, out: params,
        params,
        out,
      )
    return params, out

  return _per_backend(params, out, cpu=on_cpu, accelerator=on_accelerator)


def _emitted_updates(out: Any, emitted: jax.Array, plan: _Plan) -> Any:
  """Design point 3: the updates, exact zeros unless emitted; outside the
  conditional, so that the select fuses with ``optax.apply_updates``."""
  return jax.tree.map(
    lambda b, t: jnp.where(emitted, b.astype(t.dtype), 0),
    out,
    plan.update_types,
  )


def _weight_kept(total_weight: jax.Array, cycle_end: jax.Array) -> jax.Array:
  """``acc_weight`` after a call: the cycle's total; at a cycle's end, 0
  where the accumulator was returned to zeros (GPU, TPU) and the ended
  cycle's total where it holds scratch (CPU, see :func:`_cycle_start`)."""
  return _per_backend(
    total_weight,
    cycle_end,
    cpu=lambda total, end: total,
    accelerator=lambda total, end: jnp.where(end, 0.0, total),
  )


class _End(NamedTuple):
  """How a call ends: what it returns and what it leaves for the next."""

  updates: Any
  emitted: Any  # bool[]
  new_params: Any  # the params with `updates` applied, or None
  acc: Any
  acc_weight: jax.Array
  noise: Any
  inner_state: Any
  cycle_end: jax.Array  # bool[]
  cycle_weight: jax.Array  # the ended cycle's global weight


def _traced_end(config, engine, inner, plan, extra_args, cycle) -> _End:
  """The device decides whether this call ends the cycle (the default)."""
  enter = _enters_emitting_branch(cycle.end, cycle.weight, engine, plan)
  if config.track_noise_scale and config.axis_name is None:
    cycle = cycle._replace(
      mean_sq=_local_mean_sq_norm(enter, cycle.acc, cycle.weight)
    )
  # _control.cond is lax.switch, with lax.cond's arguments, that varies its
  # outputs over the shard_map axes its operands vary over.
  branch = _control.cond(
    enter,
    functools.partial(_emit, config, engine, inner, plan, extra_args),
    functools.partial(_hold, plan),
    cycle,
  )
  if plan.reuse_buffer:
    new_params, acc = _close_cycle(
      engine, plan, cycle.params, branch.out, cycle.end, branch.emitted
    )
    acc_weight = _weight_kept(branch.weight, cycle.end)
  else:
    new_params, acc = branch.params, branch.acc
    acc_weight = jnp.where(cycle.end, 0.0, branch.weight)
  return _End(
    updates=_emitted_updates(branch.out, branch.emitted, plan),
    emitted=branch.emitted,
    new_params=new_params,
    acc=acc,
    acc_weight=acc_weight,
    noise=branch.noise,
    inner_state=branch.inner_state,
    cycle_end=cycle.end,
    cycle_weight=branch.cycle_weight,
  )


def _static_end(config, engine, inner, plan, extra_args, cycle) -> _End:
  """``emit=True``: the caller says this call ends the cycle. No
  conditional (see :func:`_emission`); the accumulator is left at zeros."""
  if config.track_noise_scale and config.axis_name is None:
    cycle = cycle._replace(mean_sq=_mean_sq_norm(cycle.acc, cycle.weight))
  updates, inner_state, emitted, weight, noise, total = _emission(
    config, engine, inner, plan, extra_args, cycle, static=True
  )
  return _End(
    updates=updates,
    emitted=emitted,
    new_params=None,
    # Always true, but traced: see _cleared.
    acc=_cleared_after_reduction(
      engine, cycle.acc, total, cycle.micro_step >= 0
    ),
    acc_weight=jnp.zeros_like(cycle.weight),
    noise=noise,
    inner_state=inner_state,
    cycle_end=jnp.asarray(True),
    cycle_weight=weight,
  )


def _held(plan, cycle):
  """``emit=False``: the caller says the cycle goes on. The add and the
  counters only: no conditional, no inner optimizer."""
  return _End(
    updates=_zeros(plan.update_types, plan.reduced_specs is not None),
    emitted=jnp.asarray(False),
    new_params=None,
    acc=cycle.acc,
    acc_weight=cycle.weight,
    noise=cycle.noise,
    inner_state=_settle(cycle.inner_state, plan.inner_state_types),
    cycle_end=jnp.asarray(False),
    # Not zeros_like: under shard_map the weight varies over the devices.
    cycle_weight=jnp.zeros([], jnp.float32),
  )


def _inner_alone(inner, grads, state, params, extra_args):
  """k = 1 without weights, flush, skips or axis: bit for bit `inner`."""
  updates, inner_state = inner.update(
    grads, state.inner_state, params, **extra_args
  )
  return updates, state._replace(
    step=optax.safe_increment(state.step),
    weight_seen=_every_k.add_weight_seen(
      state.weight_seen, jnp.ones([], jnp.float32)
    ),
    inner_state=inner_state,
    emitted=jnp.asarray(True),
  )


def _passes_through(
  config: _Config, weight: Any, flush: Any, emit: bool | None
) -> bool:
  return (
    config.every_k.fixed == 1
    and emit is None
    and weight is None
    and flush is False
    and not config.skip_nonfinite
    and config.axis_name is None
  )


def _next_state(config, state, micro, micro_step, end: _End):
  """The state after a call: counters, and the weight seen, k and the
  controller's state, which change only when the call ended a cycle."""
  step = jnp.where(end.emitted, optax.safe_increment(state.step), state.step)
  weight_seen = jnp.where(
    end.emitted,
    _every_k.add_weight_seen(state.weight_seen, end.cycle_weight),
    state.weight_seen,
  )
  k, grow = _every_k.next_k(
    config.every_k,
    state.every_k,
    state.grow,
    step=step,
    weight_seen=weight_seen,
    noise=end.noise,
    cycle_micro_batches=micro_step,
    emitted=end.emitted,
    decay=config.noise_scale_decay,
  )
  return AccumulateState(
    micro_step=jnp.where(end.cycle_end, 0, micro_step),
    step=step,
    every_k=jnp.where(end.cycle_end, k, state.every_k),
    acc_grads=end.acc,
    acc_weight=end.acc_weight,
    weight_seen=weight_seen,
    inner_state=end.inner_state,
    num_skipped=jnp.where(
      micro.accepted,
      state.num_skipped,
      optax.safe_increment(state.num_skipped),
    ),
    emitted=end.emitted,
    noise=end.noise,
    grow=jax.tree.map(
      lambda n, o: jnp.where(end.cycle_end, n, o), grow, state.grow
    ),
  )


@functools.cache
def _jitted_update(config: _Config) -> Callable[..., Any]:
  return jax.jit(functools.partial(_update, config), static_argnames=("emit",))


def _update(
  config: _Config,
  updates: optax.Updates,
  state: AccumulateState,
  params: optax.Params | None = None,
  *,
  weight: Any = None,
  flush: Any = False,
  emit: bool | None = None,
  noise_stats: NoiseStats | None = None,
  **extra_args: Any,
) -> tuple[optax.Updates, AccumulateState]:
  _check_state(state, config.track_noise_scale)
  _check_grads_match(updates, state.acc_grads)
  _check_params_match(params, state.acc_grads)
  emit = _check_emit(emit, flush)
  # Checked before any jit below, so that concrete values are seen.
  checked_weight = (
    None if weight is None else _check_weight(weight, config.skip_nonfinite)
  )
  checked_flush = _check_flush(flush)
  engine = _engines.for_update(config.axis_name, updates, state.acc_grads)
  noise_stats = _check_noise_stats(config, engine, noise_stats)
  inner = config.inner(state.every_k)
  if _passes_through(config, weight, flush, emit):
    return _inner_alone(inner, updates, state, params, extra_args)
  if engine.unreduced and not _checks.is_traced(updates):
    # Eager ops on unreduced arrays fail (jax 0.10.2): run the step jitted.
    options = dict(weight=weight, flush=flush, emit=emit)
    return _jitted_update(config)(
      updates, state, params, noise_stats=noise_stats, **options, **extra_args
    )

  micro = _accept(
    config,
    engine,
    updates,
    checked_weight,
    checked_flush,
    may_flush=flush is not False,
  )
  acc, total_weight = _add(config, engine, state, micro)
  micro_step = state.micro_step + micro.accepted.astype(jnp.int32)
  noise = _add_noise(
    state.noise,
    micro,
    noise_stats,
    state.micro_step == 0,
    config.gradients == "sum",
    config.axis_name if engine.kind == _engines.SHARD_MAP else None,
  )
  plan = _plan(
    config, engine, inner, extra_args, updates, acc, state.inner_state, params
  )
  cycle_end = (micro_step >= state.every_k) | micro.flush
  cycle = _Cycle(
    acc,
    total_weight,
    micro_step,
    cycle_end,
    noise,
    None,
    state.inner_state,
    params,
  )
  if emit is None:
    end = _traced_end(config, engine, inner, plan, extra_args, cycle)
  elif emit:
    end = _static_end(config, engine, inner, plan, extra_args, cycle)
  else:
    end = _held(plan, cycle)
  known = end.emitted if emit is None else emit  # a Python bool when static
  _apply.remember(end.updates, known, params, end.new_params)
  return end.updates, _next_state(config, state, micro, micro_step, end)


def _init(config: _Config, params: optax.Params) -> AccumulateState:
  engine = _engines.for_init(config.axis_name, params)
  zeros = functools.partial(
    _zeros_like_param,
    accumulator_dtype=config.accumulator_dtype,
    engine=engine,
  )
  every_k = _every_k.first(config.every_k)
  # Separate calls: every leaf is its own buffer, so the whole state can be
  # donated to jit.
  return AccumulateState(
    micro_step=jnp.zeros([], jnp.int32),
    step=jnp.zeros([], jnp.int32),
    every_k=every_k,
    acc_grads=jax.tree.map(zeros, _gradient_params(params)),
    acc_weight=jnp.zeros([], jnp.float32),
    weight_seen=jnp.zeros([2], jnp.float32),
    inner_state=config.inner(every_k).init(params),
    num_skipped=jnp.zeros([], jnp.int32),
    emitted=jnp.zeros([], jnp.bool_),
    noise=(
      _noise_scale.init() if config.track_noise_scale else optax.EmptyState()
    ),
    grow=_every_k.init_grow(config.every_k),
  )


# ----------------------------------------------------------------------------
# The transformation.
# ----------------------------------------------------------------------------

# The keyword arguments of optax.MultiSteps, and what to pass instead.
_MULTISTEPS_ARGUMENTS = {
  "opt": "pass the optimizer as `inner` (the first argument)",
  "every_k_schedule": (
    "pass `every_k` (the second argument): an int, or a schedule"
    " `every_k(step)` of the optimizer step as every_k_schedule is"
  ),
  "use_grad_mean": (
    'pass `reduction`: use_grad_mean=True is reduction="mean" (the'
    ' default), use_grad_mean=False is reduction="sum"'
  ),
  "should_skip_update_fn": (
    "pass `skip_nonfinite=True` for optax.skip_not_finite; other"
    " predicates (e.g. optax.skip_large_updates) have no equivalent: give"
    " such a micro-batch `weight=0` (it still counts toward k) or leave"
    " out its call"
  ),
}

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _names_multisteps_arguments(factory: Callable[_P, _R]) -> Callable[_P, _R]:
  """`factory`, whose callers get a TypeError that names the equivalent for
  a keyword argument of optax.MultiSteps (Python's own message would only
  say that the keyword is unexpected)."""

  @functools.wraps(factory)
  def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
    for name, value in kwargs.items():
      if name in _MULTISTEPS_ARGUMENTS:
        raise TypeError(
          f"`{name}` is an argument of optax.MultiSteps, not of"
          f" accumulate (got {name}={value!r}): {_MULTISTEPS_ARGUMENTS[name]}."
          " See 'Coming from optax.MultiSteps' in examples/README.md."
        )
    return factory(*args, **kwargs)

  return checked


@_names_multisteps_arguments
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
  gradients: str = "mean",
  reduce_dtype: Any = None,
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
  calls (under ``jit`` it sits inside a conditional), so its cost, and any
  schedule inside it, is paid once per optimizer step. Put everything that
  should run once per optimizer step (clipping, weight decay, schedules)
  inside ``inner``: a transformation chained *around* ``accumulate`` runs on
  every micro-batch.

  If each micro-batch gradient is a mean over its own examples or tokens,
  pass their number as ``weight``: the emitted gradient is then exactly the
  big-batch mean over all examples or tokens, however unevenly they are
  spread over the micro-batches.

  Rules for the runtime values:

  * a micro-batch of weight 0 counts toward :math:`k` but contributes
    nothing, even if its gradient is NaN or Inf (the 0/0 per-token mean of
    an all-padding micro-batch); a cycle whose total weight is not positive
    emits zeros, leaves ``inner``'s state and ``step`` unchanged and
    produces no NaN. Weights must be finite and :math:`\geq 0`: a concrete
    negative weight raises, and so does a concrete NaN or Inf unless
    ``skip_nonfinite`` drops it (below). A traced weight (under ``jit``) is
    used as given: a NaN or Inf weight makes the cycle's gradient NaN (with
    ``gradients="sum"``, an Inf weight makes it zero) and that reaches
    ``inner``, unless ``skip_nonfinite``;
  * ``flush=True`` ends the cycle at this call, however many micro-batches
    it holds, normalised by what was actually accumulated (the partial last
    window of an epoch); on an empty cycle it emits nothing;
  * a schedule ``every_k(step)`` is called with ``state.step``; its value is
    rounded down and values below 1 are treated as 1. A NaN raises when the
    value is concrete; under ``jit``, a NaN or a value beyond the int32
    range holds the cycle open (no update until ``flush=True``);
  * with ``skip_nonfinite=True`` a micro-batch whose weight, or whose
    gradient at nonzero weight, holds a NaN or Inf is dropped as if the call
    never happened (it does not count toward :math:`k`) and ``num_skipped``
    grows; without it the NaN reaches ``inner`` at the end of the cycle;
  * ``inner``'s state leaves take the dtypes ``inner`` itself gives them
    (e.g. bf16 moments fed float32 gradients become float32, as with
    ``inner`` alone).

  Args:
    inner: The optimizer to run once per cycle, any
      ``optax.GradientTransformation``; it receives the extra keyword
      arguments of ``update`` (e.g. ``value=``) on emitting calls. With
      ``optax.lookahead``, ``init`` takes the ``LookaheadParams`` and the
      gradients are those with respect to ``params.fast``.
    every_k: Micro-batches per cycle, a positive int below :math:`2^{31}`,
      or a schedule ``callable(step: int32[]) -> int`` for batch-size
      warm-up (called once at construction with step 0 to check it).
    reduction: ``"mean"`` (weighted mean, the default) or ``"sum"``.
    accumulator_dtype: The dtype of the accumulator (float32 by default, so
      bf16 gradients do not lose precision); ``None`` keeps each gradient
      leaf's dtype. Complex gradient leaves get the matching complex dtype;
      a complex dtype for real params raises. For float64 gradients pass
      ``jnp.float64`` or ``None``. Emitted gradients keep the gradient's
      dtype.
    skip_nonfinite: Drop micro-batches with a non-finite gradient or weight.
    axis_name: A mesh axis (or tuple of axes) over which the accumulated
      gradients are summed on emitting calls only: communication happens
      once per cycle instead of once per micro-batch. Two engines, chosen
      where ``init`` and ``update`` are traced. Where the axis is bound
      (``shard_map``, ``pmap``, a named ``vmap``), pass each device's local
      gradient and its own ``weight``; gradients, weights and skips are
      summed with ``psum`` (see :func:`optax_accum.distributed.shard_map_specs` for the
      state's layout). Under plain ``jax.jit`` (or eagerly) with a mesh set
      by ``jax.set_mesh`` whose axis is ``AxisType.Explicit``, pass
      gradients typed unreduced over it (from
      :func:`optax_accum.distributed.local_value_and_grad`) and the micro-batch's global
      ``weight``; ``init`` under that mesh gives unreduced accumulators and
      the emitting call reduces them once, to the params' sharding.
    track_noise_scale: Also estimate the gradient noise scale (a few scalars
      in the state); read it with :func:`optax_accum.noise_scale`. With
      gradients unreduced under plain ``jit``, each ``update`` also needs
      the ``noise_stats=`` that ``local_value_and_grad(...,
      noise_stats=True)`` returns with them.
    noise_scale_decay: Decay of the noise scale's moving averages, in
      [0, 1).
    gradients: What each micro-batch gradient is over its ``weight``:
      ``"mean"`` (the default: the gradient of a loss averaged over the
      micro-batch's examples or tokens, multiplied by ``weight`` before it
      is added) or ``"sum"`` (the gradient of a loss summed over them,
      added as is, ``weight`` only counting toward the cycle's total). Both
      emit the same mean gradient; ``"sum"`` needs no multiply in the add,
      so XLA:GPU fuses the add into each weight-gradient GEMM with cuBLAS
      too (Triton fuses both). With ``"sum"`` a micro-batch of weight 0
      is added as is (a sum over nothing is 0; a NaN there is only dropped
      by ``skip_nonfinite``).
    reduce_dtype: With ``axis_name``, the dtype in which the accumulated
      gradient crosses devices once per cycle (``None``: the accumulator's
      own); ``jnp.bfloat16`` halves the bytes of the reduction, rounding
      each device's partial sum to bfloat16 before they are added (XLA:CPU
      adds them in float32).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` is
    ``update(updates, state, params=None, *, weight=None, flush=False,
    noise_stats=None, **extra_args)`` and whose state is an
    :class:`AccumulateState`.

  Raises:
    TypeError, ValueError: At construction, for an ``inner`` that is not a
      transformation (or whose ``init`` or ``update`` is not callable), a
      bad ``every_k`` (0, negative, float, bool, str, None, beyond int32, a
      schedule that takes neither ``(step)`` nor ``(step, weight_seen)`` or
      whose value at step 0 is not a real scalar), ``reduction``,
      ``accumulator_dtype``, ``axis_name``, non-bool ``skip_nonfinite`` or
      ``track_noise_scale``, ``noise_scale_decay``, or a keyword argument
      of ``optax.MultiSteps`` (the message names the equivalent). At trace
      time, for gradients whose tree, shapes or (complex vs real) kind
      differ from the params, integer or boolean gradients for a floating
      accumulator, ``params`` whose tree or shapes differ from those given
      to ``init``, a ``weight`` or ``flush`` that is not a real or boolean
      scalar, a concrete negative ``weight`` or (without
      ``skip_nonfinite``) a concrete NaN or Inf one; with
      ``axis_name`` outside ``shard_map``: no mesh, an axis that is not
      explicit, gradients or an accumulator that are not unreduced over
      it (ValueError), a JAX without unreduced shardings (RuntimeError);
      ``noise_stats`` missing where it is needed, given where it is not, or
      not a :class:`NoiseStats`.

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
  _check_options(reduction, axis_name, gradients)
  track_noise_scale = _checks.boolean(track_noise_scale, "track_noise_scale")
  config = _Config(
    inner=_check_inner(inner),
    every_k=_every_k.check(every_k, track_noise_scale),
    reduction=reduction,
    accumulator_dtype=_checks.accumulator_dtype(accumulator_dtype),
    skip_nonfinite=_checks.boolean(skip_nonfinite, "skip_nonfinite"),
    axis_name=axis_name,
    track_noise_scale=track_noise_scale,
    noise_scale_decay=_noise_scale.check_decay(noise_scale_decay),
    gradients=gradients,
    reduce_dtype=_check_reduce_dtype(reduce_dtype, axis_name),
  )
  return optax.GradientTransformationExtraArgs(
    functools.partial(_init, config), functools.partial(_update, config)
  )
