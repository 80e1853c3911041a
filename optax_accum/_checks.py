"""Every argument check: the public factories' and ``update``'s.

Each raises a `TypeError` or `ValueError` whose message names the argument in
backticks and shows the value received. Construction-time values are checked
when the factory is called; an ``update``'s trees, shapes and dtypes when it
is traced, and its weights where they are concrete.
"""

import functools
import operator
from collections.abc import Callable, Hashable
from typing import Any, Literal, NamedTuple, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from optax_accum import _control
from optax_accum._noise_scale import NoiseStats
from optax_accum._state import (
  AccumulateState,
  NoiseScaleState,
  Values,
  find_state,
  unpack,
)

INT32_MAX = int(np.iinfo(np.int32).max)


def positive_int(value: Any, name: str, hint: str = "") -> int:
  """Returns `value` as a Python int >= 1 (NumPy/JAX integer scalars too).

  Args:
    value: What the user passed.
    name: The argument's name, for the message.
    hint: Appended to the type error, e.g. what else the argument accepts.
  """
  is_int_array = (
    isinstance(value, (np.ndarray, np.generic, jax.Array))
    and np.ndim(value) == 0
    and np.issubdtype(np.asarray(value).dtype, np.integer)
  )
  if isinstance(value, bool) or not (isinstance(value, int) or is_int_array):
    raise TypeError(
      f"`{name}` must be a positive integer{hint}, got {value!r} of type"
      f" {type(value).__name__}."
    )
  try:
    number = operator.index(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(
      f"`{name}` must be a concrete integer, got a traced value {value!r}."
    ) from e
  if number < 1:
    raise ValueError(f"`{name}` must be >= 1, got {number}.")
  return number


def accumulator_dtype(value: Any) -> Any:
  """Returns `value` as a floating (or complex) dtype, or None."""
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise TypeError(
      f"`accumulator_dtype` must be a floating dtype or None, got {value!r}."
    ) from e
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(
      f"`accumulator_dtype` must be a floating dtype or None, got {dtype}."
    )
  return dtype


def boolean(value: Any, name: str) -> bool:
  """Returns `value` as a Python bool; only bools (NumPy's too) pass."""
  if not isinstance(value, bool | np.bool_):
    raise TypeError(
      f"`{name}` must be True or False, got {value!r} of type"
      f" {type(value).__name__}."
    )
  return bool(value)


def _complex_of(dtype: Any) -> Any:
  """The complex dtype whose parts have at least `dtype`'s precision."""
  return jnp.dtype(
    jnp.complex128 if jnp.dtype(dtype).itemsize >= 8 else jnp.complex64
  )


def leaf_accumulator_dtype(accumulator_dtype: Any, leaf_dtype: Any) -> Any:
  """The accumulator dtype of one leaf: never drops an imaginary part.

  Raises:
    ValueError: For a complex `accumulator_dtype` and a real leaf (an
      accumulator that could only ever hold a zero imaginary part).
  """
  if accumulator_dtype is None:
    return jnp.dtype(leaf_dtype)
  leaf_is_complex = jnp.issubdtype(leaf_dtype, jnp.complexfloating)
  if jnp.issubdtype(accumulator_dtype, jnp.complexfloating):
    if not leaf_is_complex:
      raise ValueError(
        f"`accumulator_dtype` is complex ({jnp.dtype(accumulator_dtype)})"
        f" but a gradient leaf is real ({jnp.dtype(leaf_dtype)}); complex"
        " gradient leaves get a complex accumulator by themselves, so pass"
        " a real dtype."
      )
    return jnp.dtype(accumulator_dtype)
  if leaf_is_complex:
    return _complex_of(accumulator_dtype)
  return jnp.dtype(accumulator_dtype)


def real_scalar(value: Any, subject: str, what: str = "") -> jax.Array:
  """`value` as a 0-d integer or floating array; raises naming `subject`.

  Args:
    value: What the user passed (or a schedule returned).
    subject: The start of the message, e.g. "`weight` must be".
    what: What one value means, for the message.
  """
  if value is None or isinstance(value, str | bytes):
    raise TypeError(f"{subject} a real number{what}, got {value!r}.")
  try:
    x = jnp.asarray(value)
  except (TypeError, ValueError) as e:  # a dict, an arbitrary object
    raise TypeError(
      f"{subject} a real number{what}, got {value!r} of type"
      f" {type(value).__name__}."
    ) from e
  if x.ndim != 0:
    raise ValueError(f"{subject} a scalar{what}, got shape {x.shape}.")
  if not (
    jnp.issubdtype(x.dtype, jnp.integer)
    or jnp.issubdtype(x.dtype, jnp.floating)
  ):
    raise TypeError(f"{subject} a real number, got a value of dtype {x.dtype}.")
  return x


def is_traced(tree: Any) -> bool:
  """Whether any leaf of `tree` is a tracer (we are inside a transformation)."""
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------
# accumulate(): construction.
# ----------------------------------------------------------------------------

REDUCTIONS = ("mean", "sum")
GRADIENTS = ("mean", "sum")


def transformation(inner: Any) -> optax.GradientTransformationExtraArgs:
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


def options(reduction: Any, axis_name: Any, gradients: Any) -> None:
  """Checks the string and axis options of ``accumulate``."""
  if reduction not in REDUCTIONS:
    raise ValueError(
      f"`reduction` must be one of {REDUCTIONS}, got {reduction!r}."
    )
  if gradients not in GRADIENTS:
    raise ValueError(
      f"`gradients` must be one of {GRADIENTS} (what each micro-batch"
      f" gradient is over its `weight`), got {gradients!r}."
    )
  if axis_name is not None and not isinstance(axis_name, Hashable):
    raise TypeError(
      "`axis_name` must be None or a hashable axis name (str or tuple),"
      f" got {axis_name!r}."
    )


ROUNDINGS = ("nearest", "stochastic")


def rounding(
  value: Any, accumulator_dtype: Any
) -> Literal["nearest", "stochastic"]:
  """`rounding` as given, where it fits the accumulator; raises naming it."""
  if value == "nearest":
    return "nearest"
  if value != "stochastic":
    raise ValueError(f"`rounding` must be one of {ROUNDINGS}, got {value!r}.")
  if accumulator_dtype != jnp.bfloat16:
    raise ValueError(
      "`rounding='stochastic'` rounds each add into a bfloat16 accumulator:"
      " pass accumulator_dtype=jnp.bfloat16 with it (got accumulator_dtype="
      f"{accumulator_dtype}, whose adds it would not round)."
    )
  return "stochastic"


def reduce_dtype(value: Any, axis_name: Any) -> Any:
  """`reduce_dtype` as a floating dtype or None; raises naming it."""
  if value is None:
    return None
  if axis_name is None:
    raise ValueError(
      "`reduce_dtype` sets the dtype in which the accumulated gradient"
      " crosses devices, which needs `axis_name`; got reduce_dtype="
      f"{value!r} without an axis_name."
    )
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      "`reduce_dtype` must be None or a floating dtype such as"
      f" `jnp.bfloat16`, got {value!r}."
    )
  return dtype


# ----------------------------------------------------------------------------
# update(): its arguments, at trace time.
# ----------------------------------------------------------------------------


class Call(NamedTuple):
  """The arguments of one ``update`` call, checked."""

  weight: jax.Array | None  # float32[]; None when no weight was given
  flush: jax.Array  # bool[]
  may_flush: bool  # `flush` was not a Python False (that needs no agreeing)
  emit: bool | None  # the caller's static decision, if any
  noise_stats: NoiseStats | None
  # The options as the caller gave them, to pass on (a jitted re-entry):
  # `flush` only if given, since a flush=False passed on would be traced,
  # and read as a flush beside `emit`.
  as_given: dict


def update_call(
  *,
  weight: Any,
  flush: Any,
  emit: Any,
  noise_stats: Any,
  fixed_every_k: int | None,
  skip_nonfinite: bool,
  track_noise_scale: bool,
  axis_name: Hashable | None,
  measures_noise: bool,
) -> Call:
  """Checks an ``update``'s options, one check per option (each raises
  naming its option), given ``accumulate``'s fixed ``every_k`` (None for a
  schedule), `skip_nonfinite`, `track_noise_scale` and `axis_name`, and
  whether the engine measures each gradient's norm itself
  (`measures_noise`). An option left at its default needs no check.

  Called before any ``jit`` of the update, so that concrete values are
  seen.
  """
  as_given = dict(weight=weight, emit=emit, noise_stats=noise_stats)
  if flush is not False:
    as_given["flush"] = flush
  checked = Call(
    weight=None if weight is None else update_weight(weight, skip_nonfinite),
    flush=jnp.asarray(False) if flush is False else update_flush(flush),
    may_flush=flush is not False,
    emit=None if emit is None else update_emit(emit, flush, fixed_every_k),
    noise_stats=noise_stats,
    as_given=as_given,
  )
  if noise_stats is not None or track_noise_scale:
    update_noise_stats(
      noise_stats, track_noise_scale, axis_name, measures_noise
    )
  return checked


def update_weight(weight: Any, skip_nonfinite: bool) -> jax.Array:
  """``update(..., weight=)`` as a float32[]. A concrete negative weight
  raises, and so does a concrete NaN or Inf unless `skip_nonfinite` (which
  drops that micro-batch); a traced one is used as given."""
  weight = real_scalar(
    weight, "`weight` must be", " (one value per micro-batch)"
  )
  if not isinstance(weight, jax.core.Tracer):
    value = np.asarray(weight)
    if value < 0:
      raise ValueError(f"`weight` must be >= 0, got {value}.")
    if not (np.isfinite(value) or skip_nonfinite):
      raise ValueError(
        f"`weight` must be finite, got {value}: the cycle's mean would be"
        " NaN. Build accumulate with `skip_nonfinite=True` to drop such"
        " micro-batches instead."
      )
  return weight.astype(jnp.float32)


def update_flush(flush: Any) -> jax.Array:
  """``update(..., flush=)`` as a bool[]: a boolean scalar, or it raises."""
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


def update_emit(emit: Any, flush: Any, fixed_every_k: int | None) -> bool:
  """``update(..., emit=)``: a Python bool, without `flush`, and not
  ``False`` where every call ends its cycle (a fixed k of 1)."""
  if not isinstance(emit, bool | np.bool_):
    raise TypeError(
      "`emit` must be None (the counter decides on the device) or a"
      " Python bool known when the step is traced, e.g. `jax.jit(step,"
      f" static_argnames='emit')`; got {emit!r} of type"
      f" {type(emit).__name__}."
    )
  if flush is not False:
    raise ValueError(
      "`flush` cannot be combined with `emit`: a call with `emit=True`"
      " already ends the cycle, whatever its length. Pass `emit=True`"
      f" instead of `flush`; got flush={flush!r} with emit={emit!r}."
    )
  if not emit and fixed_every_k == 1:
    raise ValueError(
      "`emit=False` holds the cycle open, but with every_k=1 every call"
      " ends its cycle: a later call without `emit=` runs the inner"
      " optimizer alone and would not read the gradients held. For"
      " cycles the host decides, build accumulate with the longest"
      " cycle as `every_k` and pass `emit=True` where each ends; got"
      " emit=False with every_k=1."
    )
  return bool(emit)


def update_noise_stats(
  noise_stats: Any,
  track_noise_scale: bool,
  axis_name: Hashable | None,
  measures_noise: bool,
) -> None:
  """``update(..., noise_stats=)``: given where the engine needs them (the
  noise scale tracked over gradients it cannot measure), and only there."""
  if noise_stats is None:
    if track_noise_scale and not measures_noise:
      raise ValueError(
        "`noise_stats` must be given with `track_noise_scale=True` and"
        f" gradients unreduced over {axis_name!r} under plain"
        " `jax.jit`: the unreduced gradient hides each device's own"
        " gradient and token count. Make the gradients with"
        " `optax_accum.distributed.local_value_and_grad(...,"
        " noise_stats=True)` and pass its stats as `update(...,"
        " noise_stats=stats)`."
      )
  elif not track_noise_scale:
    raise ValueError(
      "`noise_stats` was given, but this accumulate was built with"
      " `track_noise_scale=False`: build it with `track_noise_scale=True`"
      " or leave the argument out."
    )
  elif measures_noise:
    raise ValueError(
      "`noise_stats` is only for gradients unreduced over `axis_name` under"
      " plain `jax.jit`; here accumulate measures each gradient itself:"
      " leave the argument out."
    )
  elif not isinstance(noise_stats, NoiseStats):
    raise TypeError(
      "`noise_stats` must be the optax_accum.distributed.NoiseStats"
      " returned by `local_value_and_grad(..., noise_stats=True)`, got"
      f" {type(noise_stats).__name__}."
    )


def dropin_options(opt_state: Any, reader: str, **options: Any) -> dict:
  """The options of ``accumulate``'s ``update`` that a Flax drop-in was
  given (`options` not left at their defaults: ``weight=None``,
  ``flush=False``, ``emit=None``), to pass on as given; raises naming them
  when `opt_state` holds no ``AccumulateState``, whose ``update`` alone
  reads them (an optax transformation that takes extra arguments would drop
  them silently)."""
  defaults = {"weight": None, "flush": False, "emit": None}
  given = {
    name: value
    for name, value in options.items()
    if value is not defaults[name]
  }
  if given and find_state(opt_state, reader, missing_ok=True) is None:
    names = ", ".join(f"`{name}=`" for name in given)
    raise TypeError(
      f"{names} of `{reader}` are optax_accum.accumulate's, but this"
      " optimizer holds no accumulate: wrap it,"
      " `optax_accum.accumulate(tx, every_k)`, or leave"
      f" {'it' if len(given) == 1 else 'them'} out; got"
      f" {', '.join(f'{n}={v!r}' for n, v in given.items())}."
    )
  return given


def state(value: Any, track_noise_scale: bool) -> Values:
  """`value`'s values by name (:func:`unpack`); raises unless `value` is an
  ``AccumulateState`` of this configuration."""
  if not isinstance(value, AccumulateState):
    raise TypeError(
      "`state` must be the AccumulateState returned by this"
      f" transformation's init, got {type(value).__name__}."
    )
  values = unpack(value)
  not_a_foreign_restore(values)
  tracked = isinstance(values.noise, NoiseScaleState)
  if tracked != track_noise_scale:
    raise ValueError(
      "`state` was made by an accumulate with"
      f" track_noise_scale={tracked}, but this one has"
      f" track_noise_scale={track_noise_scale}."
    )
  return values


def not_a_foreign_restore(value: Any) -> None:
  """Raises if a concrete state holds a sum with no cycle under way, before
  the run's first update (``step`` 0).

  No call leaves that: a cycle's end leaves zeros and weight 0, or
  leftovers beside a non-zero weight (CPU; optax_accum 0.1 on CPU too). It
  is what a restore that fills a checkpoint's missing fields from a fresh
  target gives: ``MultiSteps``' running mean beside a fresh counter and
  inner state, or a 0.2 state's sum beside fresh counters.
  """
  counters = (value.step, value.micro_step, value.acc_weight)
  if is_traced(counters):
    return
  # Only a state with a fresh target's counters can be such a restore, so
  # the accumulator is read at most until the run's first update.
  if int(value.step) != 0 or int(value.micro_step) != 0:
    return
  if float(value.acc_weight) != 0:
    return
  leaves = jax.tree.leaves(value.acc_buffer)
  if is_traced(leaves) or not all(
    getattr(x, "is_fully_addressable", True) for x in leaves
  ):
    return
  try:
    nonzero = any(bool(jnp.any(x != 0)) for x in leaves)
  except Exception:  # noqa: BLE001  (an unreduced array reads only in jit)
    return
  if not nonzero:
    return
  raise ValueError(
    "`state` holds a non-zero acc_grads with micro_step 0 and acc_weight 0,"
    " which no accumulate call leaves: it looks like a checkpoint of"
    " another layout restored into an accumulate target that filled the"
    " missing fields from the target. An optax.MultiSteps checkpoint:"
    " restore it into optax_accum.multisteps.restore_target(tx, params),"
    " then convert with optax_accum.multisteps.from_multisteps(ms_state,"
    " tx.init(params), tx=tx); into an optax_accum.flax.Optimizer,"
    " `optimizer.load(restored_optimizer)` does both in one call. An"
    " optax_accum 0.2 checkpoint: restore it into"
    " optax_accum.upgrade.v0_2_target(tx, params), then convert with"
    " optax_accum.upgrade.from_v0_2(saved, tx.init(params))."
  )


def paths_differ(tree: Any, want: Any) -> tuple[list[str], list[str]]:
  """The key paths of `want`'s leaves that `tree` lacks, and of `tree`'s
  that `want` lacks, each sorted."""
  have = {
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_leaves_with_path(tree)
  }
  wanted = {
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_leaves_with_path(want)
  }
  return sorted(wanted - have), sorted(have - wanted)


def tree_matches(name: str, tree: Any, acc_grads: Any) -> list:
  """Raises naming `name` and the first leaf where the tree or a shape
  differs from the accumulator's (the params given to `init`).

  Returns:
    ``(key path, leaf, accumulator leaf)`` of every leaf.
  """
  treedef: _control.TreeDef
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  acc_flat, acc_def = jax.tree_util.tree_flatten_with_path(acc_grads)
  if treedef != acc_def:
    missing, extra = paths_differ(tree, acc_grads)
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


def trees(grads: Any, params: Any, acc_grads: Any) -> None:
  """Raises naming the argument whose tree, shapes or dtypes do not fit the
  state's accumulator (made by ``init`` from the params): `state` when the
  gradients and the params agree with each other but not with it, else
  `updates` or `params`, at the first leaf that differs."""
  tree: _control.TreeDef = jax.tree.structure(grads)
  grad_params = None if params is None else gradient_params(params)
  if (
    grad_params is not None
    and tree != jax.tree.structure(acc_grads)
    and tree == jax.tree.structure(grad_params)
  ):
    raise ValueError(
      "`state` was made by init for params of another tree: its accumulator"
      f" has the structure {jax.tree.structure(acc_grads)}, but `updates`"
      f" and `params` both have {tree}. Pass the state that this model's"
      " params were given to `init` (a restored checkpoint of another"
      " model?)."
    )
  for where, g, a in tree_matches("updates", grads, acc_grads):
    if jnp.iscomplexobj(g) and not jnp.iscomplexobj(a):
      raise TypeError(
        f"`updates` leaf {where} is complex ({jnp.result_type(g)}) but the"
        " params given to `init` are real there: the imaginary part would"
        " be lost. Take real gradients, or make those params complex."
      )
    # Python ints too: the mean would be emitted in their dtype, truncated.
    # `.dtype` first: jax.grad's float0 zeros are NumPy arrays JAX cannot
    # read.
    dtype = np.dtype(g.dtype) if hasattr(g, "dtype") else jnp.result_type(g)
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
  # The inner optimizer reads the params, and apply_updates adds to them.
  if grad_params is not None:
    tree_matches("params", grad_params, acc_grads)


def gradient_params(params: Any) -> Any:
  """The params the gradients are taken with respect to.

  ``optax.lookahead`` keeps ``LookaheadParams(fast, slow)`` and expects
  gradients with respect to ``fast`` only.
  """
  if isinstance(params, optax.LookaheadParams):
    return params.fast
  return params


def not_unreduced(grads: Any) -> None:
  """Raises if a gradient is typed unreduced while no `axis_name` says over
  what to sum it (JAX's own error names neither the cause nor the fix)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
    axes = unreduced_axes(leaf)
    if axes:
      name = axes[0] if len(axes) == 1 else axes
      raise ValueError(
        f"`updates` leaf {jax.tree_util.keystr(path) or '<root>'} is typed"
        f" unreduced over {name!r} (each device's partial sum, e.g. from"
        " `optax_accum.distributed.local_value_and_grad`), but this"
        f" accumulate has no `axis_name`: build it with `axis_name={name!r}`"
        " so that it sums them once per cycle."
      )


def spec_of(x: Any) -> P:
  """The PartitionSpec in the type of an array, tracer or ShapeDtypeStruct."""
  sharding = getattr(x, "sharding", None)
  if isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "aval"):
    return getattr(sharding, "spec", P())
  return getattr(jax.typeof(x).sharding, "spec", P())


def unreduced_axes(x: Any) -> tuple:
  """The mesh axes `x` is typed unreduced over, sorted; ``()`` if none.

  Works on arrays, tracers under ``jit`` and ``jax.ShapeDtypeStruct``.
  """
  return tuple(sorted(getattr(spec_of(x), "unreduced", ())))


# ----------------------------------------------------------------------------
# Arguments of optax.MultiSteps, and what to pass instead.
# ----------------------------------------------------------------------------

MULTISTEPS_ARGUMENTS = {
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


def names_multisteps_arguments(factory: Callable[_P, _R]) -> Callable[_P, _R]:
  """`factory`, whose callers get a TypeError that names the equivalent for
  a keyword argument of optax.MultiSteps (Python's own message would only
  say that the keyword is unexpected)."""

  @functools.wraps(factory)
  def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
    for name, value in kwargs.items():
      if name in MULTISTEPS_ARGUMENTS:
        raise TypeError(
          f"`{name}` is an argument of optax.MultiSteps, not of"
          f" accumulate (got {name}={value!r}): {MULTISTEPS_ARGUMENTS[name]}."
          " See help(optax_accum.multisteps)."
        )
    return factory(*args, **kwargs)

  return checked
