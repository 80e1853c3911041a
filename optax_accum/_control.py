"""Control flow that compilers keep, the one-device operations, and every
XLA workaround, in one place.

Four parts:

* **Per backend**: :func:`per_backend`, the one switch between what a
  program for CPU and one for a GPU or TPU compute (``_forms.py`` says why
  each form is what its backend compiles best).
* **Varying manual axes** (inside ``jax.shard_map`` with ``check_vma=True``,
  every value's type records the mesh axes it varies over; a ``psum``
  removes the axis, so the branches of a conditional that reduces in one
  branch only would disagree): :func:`varying_axes`, :func:`vary_over`,
  :func:`to_varying`, :func:`varies_over`, :func:`switch` and
  :func:`cond`. Outside ``shard_map`` (and under ``vmap``) they change
  nothing.
* **One device**: :class:`Local`, the operations a call without
  ``axis_name`` makes its sums with (plain ``jnp``), which the engines of
  ``_engines.py`` override where the sums cross devices. Here, below the
  core and the engines alike, so that imports point one way.
* **XLA workarounds.** Each function below the line says what XLA does
  without it (seen with jax/jaxlib 0.10.2), and which test fails when the
  plain form replaces it. At its call site each looks like a no-op or an
  odd detour, which is why each has a name: replacing one by the obvious
  code costs a parameter-sized copy or an optimizer run on every
  micro-step, and only a compiled-program test notices.
"""

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum import _versions

# A tree's structure (``jax.tree.structure``), as annotated where two are
# compared: jaxlib ships its PyTreeDef without a stub (jax 0.12.0.1:
# jaxlib/_jax.so, no .pyi), so a checker sees no `==` on it.
TreeDef = Any


def axis_tuple(axis_name: Hashable) -> tuple:
  """The axis names in `axis_name` (one name or a tuple of names)."""
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def varying_axes(aval: Any) -> frozenset:
  """Manual mesh axes a value of type `aval` varies over; empty outside."""
  # jax >= 0.9: `mat` on avals, `manual_axis_type` on ShapeDtypeStruct;
  # older jax: `vma`.
  mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def vary_over(x: Any, axes: frozenset) -> Any:
  """Marks `x` as varying over `axes` (a no-op on the values)."""
  missing = tuple(sorted(axes - varying_axes(jax.typeof(x)), key=str))
  if not missing:
    return x
  return to_varying(x, missing)


def to_varying(tree: Any, axis_name: Hashable) -> Any:
  """``lax.pcast(tree, axis_name, to="varying")``: marks every leaf as
  varying over the manual axes `axis_name` (a name or a tuple of names)."""
  if not hasattr(lax, "pcast"):
    # jax < 0.8.2 names it `lax.pvary` (removed in jax 0.10: the jax a
    # checker reads has none).
    return lax.pvary(tree, axis_name)  # type: ignore[attr-defined]
  return lax.pcast(tree, axis_name, to="varying")


def varies_over(tree: Any, axis_name: Hashable) -> bool:
  """Whether any leaf of `tree` varies over an axis of `axis_name`."""
  names = frozenset(axis_tuple(axis_name))
  return any(names & varying_axes(jax.typeof(x)) for x in jax.tree.leaves(tree))


def vma_checked() -> bool:
  """Whether the ``shard_map`` being traced checks varying manual axes
  (its ``check_vma=True``, the default). With ``check_vma=False`` every
  value's :func:`varying_axes` is empty whatever it varies over, so the
  callers take every manual axis of the mesh instead
  (:func:`manual_axes`). jax has no public reader: its own flag,
  ``jax._src.config._check_vma``, seen from jax 0.7.1 to 0.12.0.1 (where
  it is missing, True: the axes then come from the values' types)."""
  from jax._src import config  # noqa: PLC0415  (no public reader)

  flag = getattr(config, "_check_vma", None)
  return True if flag is None else bool(flag.value)


def manual_axes() -> frozenset:
  """The manual axes of the mesh being traced (inside ``shard_map``)."""
  return frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def switch(index: Any, branches: Sequence[Callable], *operands: Any):
  """``lax.switch`` whose branches may differ in the axes their outputs vary
  over.

  Each output is marked as varying over the union of the branches' axes.
  When no operand varies (outside ``shard_map``, under ``vmap``) this is
  plain ``lax.switch`` and the branches are not traced twice.
  """
  return lax.switch(index, varying_alike(branches, *operands), *operands)


def varying_alike(branches: Sequence[Callable], *operands: Any) -> list:
  """`branches`, each marking its outputs as varying over the union of the
  axes the branches' outputs vary over, so that their output types agree
  (a conditional needs that, and so does ``lax.platform_dependent``); as
  they are where no operand varies (outside ``shard_map``, under ``vmap``),
  so that they are not traced twice."""
  if not any(varying_axes(jax.typeof(x)) for x in jax.tree.leaves(operands)):
    return list(branches)
  out_types = [jax.eval_shape(f, *operands) for f in branches]
  axes = jax.tree.map(
    lambda *types: frozenset().union(*map(varying_axes, types)), *out_types
  )

  def unify(fun: Callable) -> Callable:
    def unified(*args: Any) -> Any:
      return jax.tree.map(vary_over, fun(*args), axes)

    return unified

  return [unify(f) for f in branches]


def per_backend(
  *args: Any,
  cpu: Callable,
  accelerator: Callable,
  gpu: Callable | None = None,
) -> Any:
  """`cpu(*args)` in a program compiled for CPU, `gpu(*args)` (where given)
  in one for a GPU, else `accelerator(*args)`. Branches that are one
  function are traced once.

  Where CPU and GPU/TPU programs differ: its callers in ``_forms.py``
  (and the cycle's start in ``_accumulate.py``) say why each form is what
  that backend compiles best. The tests pin this to one form to run the
  others on CPU.
  """
  forms = [accelerator] + ([] if cpu is accelerator else [cpu])
  forms += [] if gpu is None else [gpu]
  if len(forms) > 1:  # Inside shard_map: the forms' outputs typed alike.
    forms = varying_alike(forms, *args)
  branches = {"default": forms[0]}
  if cpu is not accelerator:
    branches["cpu"] = forms[1]
  if gpu is not None:
    branches["cuda"] = branches["rocm"] = forms[-1]
  return lax.platform_dependent(*args, **branches)


# ----------------------------------------------------------------------------
# One device: the operations of the local path, in plain jnp.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Local:
  """How a cycle's sums are made and reduced on one device (no
  ``axis_name``): plain ``jnp``, nothing to agree on or reduce.

  The engines of ``_engines.py`` (``ShardMap``, ``Unreduced``) override
  these methods where sums cross devices, and add what only a call with
  ``axis_name`` asks for:

  * ``reduce(acc, scalars, *, per_leaf, specs) -> (acc, scalars)``: the
    cycle's sums over the devices (``_inner.reduce_cycle``);
  * ``reduced_specs(acc, params)``: where the reduced sum is laid out, or
    None where its type has no layout (``_accumulate._inner_types``);
  * ``shares_buffer(acc)``: whether the updates may be written into the
    accumulator's own buffer, as far as the devices go
    (``_forms.shares_buffer``).
  """

  axis_name: Hashable | None = None
  # Eager ops on this engine's arrays work (not on unreduced ones).
  runs_eagerly: ClassVar[bool] = True
  # The cycle's total weight is the same on every device before it is
  # reduced (not inside shard_map, where each device has its own).
  global_weight: ClassVar[bool] = True
  # `accumulate` measures each gradient's norm for the noise scale itself
  # (not unreduced gradients: `local_value_and_grad` measures them).
  measures_noise: ClassVar[bool] = True

  def zero(self, x: Any) -> Any:
    """A zero to select against `x`."""
    return jnp.zeros([], x.dtype)

  def select(self, pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``jnp.where`` with a replicated scalar `pred`."""
    return jnp.where(pred, on_true, on_false)

  def scale(self, x: Any, factor: jax.Array) -> Any:
    """``x * factor`` for a replicated scalar `factor`."""
    return x * factor.astype(x.dtype)

  def all_finite(self, tree: Any) -> jax.Array:
    """Whether every gradient element is finite (on every device whose
    decision this is)."""
    finite = jnp.asarray(True)
    for g in jax.tree.leaves(tree):
      finite &= jnp.all(jnp.isfinite(g))
    return finite

  def zeros_like_param(self, param: Any, dtype: Any) -> jax.Array:
    """A zero accumulator leaf placed like `param`.

    A committed array's sharding is copied; an uncommitted one (created
    without a device) gives an uncommitted accumulator, as optax's own
    states. Under ``jit`` an explicit-axes mesh puts the sharding in the
    tracer's type and ``zeros_like`` keeps it; with auto axes pass
    ``out_shardings=optax_accum.distributed.state_shardings(tx, params)``.
    """
    if isinstance(param, jax.Array) and not isinstance(param, jax.core.Tracer):
      device = param.sharding if param.committed else None
      return jnp.zeros(param.shape, dtype, device=device)
    return jnp.zeros_like(param, dtype=dtype)

  def device_index(self) -> jax.Array:
    """This device's index among those that sum over `axis_name` (uint32;
    here 0): what keeps each device's stochastic rounding its own."""
    return jnp.zeros([], jnp.uint32)

  def agree(self, reduce: Callable, flag: jax.Array) -> jax.Array:
    """`flag` the same on every device of the step (here: itself)."""
    del reduce
    return flag

  def cleared(self, cycle_ends: jax.Array, acc: Any, total: Any) -> Any:
    """Zeros in place of the accumulator `acc` where `cycle_ends`, once
    `total`, its sum over the devices, is known."""
    del total
    return cleared(cycle_ends, acc, self)

  def sample_axes(self) -> Hashable | None:
    """The axes each device's gradient is a noise-scale sample over."""
    return None

  # What only a call with `axis_name` asks for (``_engines.py`` has them):
  # declared here, so that each is one method whatever the engine.

  def reduce(
    self, acc: Any, scalars: tuple, *, per_leaf: bool, specs: Any
  ) -> tuple[Any, tuple]:
    """`acc` and the cycle's `scalars` summed over the devices."""
    raise NotImplementedError(_NEEDS_AXIS)

  def reduced_specs(self, acc: Any, params: Any) -> Any:
    """The reduced sum's layout (None where its type has none)."""
    raise NotImplementedError(_NEEDS_AXIS)

  def shares_buffer(self, acc: Any) -> bool:
    """Whether the accumulator can hold the updates (their type)."""
    raise NotImplementedError(_NEEDS_AXIS)


_NEEDS_AXIS = "only an accumulate with `axis_name` sums over devices"


LOCAL = Local()


# ----------------------------------------------------------------------------
# XLA workarounds.
# ----------------------------------------------------------------------------


def cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any):
  """``lax.cond`` that compilers keep, with `false_fun` (the branch that
  holds) as HLO branch 0; its outputs vary as :func:`switch`'s do.

  XLA:GPU, with ``lax.cond``: its index is ``convert(pred)``, which the
  algebraic simplifier folds back into a predicate; the conditional
  simplifier then inlines a predicate conditional whose branches are all
  elementwise into selects, so both branches run on every call (the inner
  optimizer on every micro-step). And, before jax/jaxlib 0.11.1, a
  pass-through branch that is not branch 0 is copied
  (:data:`LATER_BRANCHES_COPY`). An ``int32`` index (``lax.switch`` clamps
  it, so it stays an integer) with the holding branch first avoids both.
  Held by ``tests/test_accelerators.py`` (plants ``lax_cond`` and
  ``holding_branch_last``).
  """
  index = jnp.asarray(pred).astype(jnp.int32)
  branches = varying_alike((false_fun, true_fun), *operands)
  return lax.switch(index, branches, *operands)


#: Whether this jax's XLA copies what a conditional's branch other than
#: branch 0 passes through. XLA:GPU before jax/jaxlib 0.11.1 does (copy
#: insertion; seen with 0.10.2 and 0.11.0, not with 0.11.1, 0.11.2 or
#: 0.12.0.1, compiled for an H100): a holding branch placed last costs twelve
#: 16 MiB copies on every call (:func:`cond` keeps it first), and a switch
#: with a second pass-through branch, such as ``apply_inside``'s for a
#: weightless cycle in ``_forms.py``, 40 parameter-sized copies and 3.37
#: accumulators of memory (bf16 params, adam, 4 x 2048^2). Where it is
#: true, ``decide_on_device`` keeps bf16 updates in the accumulator's
#: buffer instead (one conditional with a single pass-through branch, and
#: 0.2's memory). Held on the ``make test-py311`` leg (jax 0.10.2) by
#: ``tests/test_accelerators.py`` (``test_extra_memory_is_at_most_the_accumulator``
#: and the plant ``switch_on_every_xla``).
LATER_BRANCHES_COPY = not _versions.jax_at_least("0.11.1")


#: Below this many bytes of accumulator, a program compiled for a GPU (one
#: device) decides the end of a cycle with selects, not conditionals
#: (``decide(..., selects=True)`` in ``_forms.py``). XLA:GPU records a
#: conditional as a CUDA-graph conditional node, and on an H200 the host's
#: dispatch of the tiny model's traced step (two of them) took 6-9 µs longer
#: a call than its ``emit=`` step or ``optax.MultiSteps``' (no conditional:
#: XLA turns MultiSteps' into selects), 74-84 µs in all
#: (``benchmarks/results/gpu/2026-11-27-tiny-probe``). Running Adam on every
#: call instead moves about 7 bytes per accumulator byte (the params,
#: moments and mean read, three of them written): 7 MiB at this threshold,
#: about 2 µs at an H100's 3.35 TB/s, below what the conditionals cost; at
#: 64 MB the conditional wins 1.2-2.8x (``gpu.sh``). Held by
#: ``tests/test_accelerators.py`` (the tiny step compiled for an H100 has no
#: conditional, the 64 MiB one keeps it; plant ``selects_everywhere``).
SELECTS_BELOW_BYTES = 1 << 20


def random_bits(shape: Sequence[int], key: jax.Array) -> jax.Array:
  """uint32 bits for each element of an array of `shape`: a counter-based
  hash of the element's position and `key` (Wellons' lowbias32), computed
  where it is used (it fuses into the add), the same under ``jit`` and
  eagerly, on every backend."""
  size = math.prod(shape)
  position = lax.iota(jnp.uint32, size).reshape(shape)
  return _mix(position ^ _mix(key.astype(jnp.uint32)))


def _mix(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def to_bfloat16_stochastically(x: jax.Array, bits: jax.Array) -> jax.Array:
  """float32 `x` rounded to bfloat16 up or down (in magnitude) with
  probability proportional to the distance, so that its expectation is `x`:
  the 16 bits bfloat16 drops, plus 16 random ones, carry into the kept
  bits or not. NaN stays NaN (its bits could wrap around); a value that
  rounds up past bfloat16's largest becomes Inf, as rounding does."""
  kept = jnp.uint32(0xFFFF0000)
  u = lax.bitcast_convert_type(x, jnp.uint32)
  u = (u + (bits & jnp.uint32(0xFFFF))) & kept
  rounded = lax.bitcast_convert_type(u, jnp.float32).astype(jnp.bfloat16)
  return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), rounded)


def cleared(flag: jax.Array, tree: Any, ops: Any) -> Any:
  """Zeros in place of `tree` where the scalar `flag` is true (in a branch
  that ends a cycle, callers pass a flag that is true where it runs; the CPU
  cycle start passes whether no cycle is open).

  A select that reads `tree`, not constant zeros: XLA merges equal
  constants into one value, and outputs that share one value, or that are
  computed from nothing they could be written over, are copied into the
  step's output buffers, on micro-steps too. NaN-safe, unlike ``0 * x``.
  Held by ``tests/test_accelerators.py`` (no parameter-sized copy on a
  micro-step).
  """
  return jax.tree.map(lambda x: ops.select(flag, ops.zero(x), x), tree)


def traced_true(count: jax.Array) -> jax.Array:
  """``True``, from a non-negative counter XLA cannot see is non-negative.

  For :func:`cleared` where the caller knows at trace time that the flag is
  true (``emit=True``): a constant ``True`` makes the select constant zeros
  again, with the copies :func:`cleared` avoids.
  """
  return count >= 0


def distinct_zeros(types: Sequence[Any], flag: jax.Array, zeros: Callable):
  """Zeros of each of `types`, as a traced value per leaf.

  For the updates a holding branch returns when the emitting branch writes
  them into buffers of their own. Constant zeros would be one merged value,
  which each output of the conditional then copies (see :func:`cleared`);
  ``zeros(t) * where(flag, i + 1, 0)`` with a `flag` that is false in that
  branch gives XLA a different value per leaf that it cannot fold. When the
  caller applies the updates with :func:`optax_accum.apply_updates` they
  are unused and XLA drops them.
  """
  return [
    zeros(t) * jnp.where(flag, i + 1.0, 0.0).astype(t.dtype)
    for i, t in enumerate(types)
  ]


def times_inverse(tree: Any, inverse: jax.Array) -> Any:
  """``x * inverse`` for each leaf ``x`` of `tree`, for a mean ``x /
  total``: a multiply, not a divide.

  XLA duplicates a cheap elementwise op into every consumer fusion of the
  inner optimizer, but materialises a divide into a parameter-sized buffer
  first.
  """
  return jax.tree.map(lambda x: x * inverse.astype(x.dtype), tree)


def psum_with_scalars(
  leaves: list, scalars: tuple, axis_name: Hashable, per_leaf: bool
) -> tuple[list, tuple]:
  """``psum`` of accumulator `leaves` and a few `scalars` over `axis_name`.

  ``per_leaf``: one reduction per leaf, so that each may start as soon as
  its own gradient is added (a static emission, where nothing else orders
  them), the scalars joined to the last leaf's reduction as a tuple; on
  their own, or joined to a leaf as values, XLA concatenates them onto a
  leaf, copying it. Otherwise (inside a conditional, where everything waits
  for the branch anyway) one reduction of everything, for the same reason.
  Held by ``tests/test_accelerators.py`` (plant ``one_reduction``; no copy
  in the emitting branch).
  """
  if not per_leaf:
    return lax.psum((leaves, scalars), axis_name)
  reduced = [lax.psum(a, axis_name) for a in leaves[:-1]]
  last, scalars = lax.psum((leaves[-1:], scalars), axis_name)
  return reduced + last, scalars


def run_if_weighted(
  weighted: jax.Array, run: Callable, skip: Callable, *operands: Any
) -> Any:
  """`run(*operands)` where the cycle's total weight is positive (or NaN),
  else `skip(*operands)`: the inner optimizer in a conditional of its own,
  inside a branch that ends every cycle, weightless ones included.

  XLA:CPU, with selects instead (``where(weighted, new, old)`` over the
  inner state and the params once the inner optimizer ran): the select
  reads the old value after the new one is computed, so neither is updated
  in place, and copy insertion copies every inner-state leaf twice on every
  micro-step (in the holding branch of the conditional around this one,
  and after it). Seen for the unreduced and ``shard_map`` engines with
  jax/jaxlib 0.10.2 (8 parameter-sized copies per micro-step with Adam, 2
  layers). `skip` is branch 0 and passes its operands through (see
  :func:`cond`). Used on CPU only (``_inner_where_weighted`` in ``_forms.py``). Held
  by ``tests/test_flax_mesh.py`` (no parameter-sized copy on a micro-step).
  """
  return cond(weighted, run, skip, *operands)


def in_own_conditional(
  enter: jax.Array, fun: Callable, default: Any, *operands: Any
) -> Any:
  """``fun(*operands)`` where `enter`, else `default`, in a conditional of
  its own.

  For a reduction over the accumulator that the emitting branch needs: in
  that branch it would read the accumulator with no data dependency on the
  inner optimizer's in-place writes into the same buffer, so XLA would copy
  the whole accumulator in the holding branch on every call.
  """
  return cond(enter, fun, lambda *_: default, *operands)
