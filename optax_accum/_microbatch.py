"""`microbatch`: exact, token-weighted micro-batching inside one step.

Read top to bottom: the batch split, the weight, the scan (each output
leaf reduced as :mod:`optax_accum._reductions` chooses), plain and NNX steps,
then :func:`microbatch` itself.
"""

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _checks, _reductions
from optax_accum._control import TreeDef

# ----------------------------------------------------------------------------
# The batch split (trace time).
# ----------------------------------------------------------------------------


def _batch_size(batch: Any, num_microbatches: int) -> int:
  """The shared leading size of `batch`'s leaves; raises naming the leaves."""
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise ValueError(
      "`batch` (argument 1) must hold at least one array with a leading"
      " batch axis, got a tree with no leaves."
    )
  sizes = {}
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path) or "batch"
    if np.ndim(leaf) == 0:
      raise ValueError(
        f"`batch` leaf {name} is a scalar; every leaf of `batch` (argument"
        " 1) needs a leading batch axis."
      )
    sizes[name] = np.shape(leaf)[0]
  if len(set(sizes.values())) > 1:
    raise ValueError(
      "Every leaf of `batch` (argument 1) must have the same leading batch"
      f" size, got sizes {sizes}."
    )
  size = next(iter(sizes.values()))
  if size % num_microbatches:
    raise ValueError(
      f"The batch size {size} of `batch` (argument 1) is not divisible by"
      f" `num_microbatches`={num_microbatches}; pad the batch (with zero"
      " weight) or choose a divisor of the batch size."
    )
  return size


def _split(batch: Any, num_microbatches: int) -> Any:
  """Reshapes each leaf [B, ...] to [B / n, n, ...]; micro-batch i is [:, i].

  Micro-batch ``i`` holds rows ``i, i + n, i + 2n, ...``. The reshape only
  splits the batch axis (no copy, no data movement), and the major part of
  the split keeps the leading axis' sharding: with the batch sharded over
  D devices, every micro-batch holds B / (n D) rows from each device.
  """

  def split_leaf(x):
    shape = np.shape(x)
    return jnp.reshape(
      x, (shape[0] // num_microbatches, num_microbatches) + shape[1:]
    )

  return jax.tree.map(split_leaf, batch)


def _micro_batch(split: Any, index: Any) -> Any:
  """Micro-batch `index` of a tree made by `_split`."""
  return jax.tree.map(
    lambda x: lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False),
    split,
  )


# ----------------------------------------------------------------------------
# The weight of a micro-batch. Dtypes throughout are chosen explicitly
# (`_accumulate.compute_dtype`, `_checks.leaf_accumulator_dtype`), never by
# `jnp.promote_types`, which raises under
# `jax_numpy_dtype_promotion="strict"` for bfloat16 with float32; every
# operation is between operands of one dtype (or a Python scalar).
# ----------------------------------------------------------------------------


def _weight_of(raw: Any) -> jax.Array:
  """One micro-batch's weight, `weight_fn`'s output, as a float32 scalar."""
  try:
    weight = jnp.asarray(raw)
  except (TypeError, ValueError) as e:
    raise TypeError(
      "`weight_fn` must return a real scalar (e.g. the micro-batch's number"
      f" of tokens), got {raw!r} of type {type(raw).__name__}."
    ) from e
  if weight.ndim != 0:
    raise ValueError(
      "`weight_fn` must return a scalar (one weight per micro-batch),"
      f" got shape {weight.shape}."
    )
  real = jnp.issubdtype(weight.dtype, jnp.integer) or jnp.issubdtype(
    weight.dtype, jnp.floating
  )
  if not (real or weight.dtype == jnp.bool_):
    raise TypeError(
      "`weight_fn` must return a real number (bool, integer or floating),"
      f" got {raw!r} of dtype {weight.dtype}."
    )
  return weight.astype(jnp.float32)


# ----------------------------------------------------------------------------
# The scan over micro-batches, for a pure step `step(micro, carried) ->
# (out, carried)`: `carried` is state threaded from one micro-batch to the
# next (None for plain JAX functions; NNX variables, see below).
# ----------------------------------------------------------------------------


def _takes_one_argument(weight_fn: Callable[[Any], Any]) -> None:
  """Raises unless `weight_fn` can be called with the micro-batch alone."""
  try:
    signature = inspect.signature(weight_fn)
  except (TypeError, ValueError):  # builtins without a signature: try it
    return
  try:
    signature.bind(None)
  except TypeError as e:
    raise TypeError(
      "`weight_fn` must take one argument, the micro-batch (`weight_fn("
      f"micro_batch) -> scalar`), got {weight_fn!r} with signature"
      f" {signature}: {e}."
    ) from None


def _call(step, weight_fn, split, index, carried):
  """Micro-batch `index`: `(out, weight or None, carried)`."""
  micro = _micro_batch(split, index)
  out, carried = step(micro, carried)
  weight = None if weight_fn is None else _weight_of(weight_fn(micro))
  return out, weight, carried


def _add_outputs(leaves, treedef, accs, out, weight):
  """Adds one micro-batch's output: new carries and scan outputs."""
  new_accs, scanned = [], []
  for leaf, acc, value in zip(
    leaves, accs, treedef.flatten_up_to(out), strict=True
  ):
    acc, value = leaf.reduction.update(acc, value, weight)
    new_accs.append(acc)
    scanned.append(value)
  return new_accs, scanned


def _scan(step, carried, split, n, weight_fn, accumulator_dtype, params=None):
  """The reduced output of `step` over the `n` micro-batches of `split`.

  `params`: argument 0 for plain JAX functions, to check the output's
  structure against (None: not checked)."""
  call = functools.partial(_call, step, weight_fn, split)
  # Closes over the arguments: they need not be valid JAX types.
  out_shape = jax.eval_shape(lambda: call(0, carried)[0])
  micro = None
  if params is not None:
    micro = jax.eval_shape(lambda: _micro_batch(split, 0))
  _reductions.check_output(out_shape, params, micro)
  treedef: TreeDef = jax.tree.structure(out_shape)
  leaves = _reductions.leaves_of(out_shape, accumulator_dtype)

  def body(carry, index):
    accs, total_weight, carried = carry
    out, weight, carried = call(index, carried)
    accs, scanned = _add_outputs(leaves, treedef, accs, out, weight)
    if weight is not None:
      total_weight = total_weight + weight
    return (accs, total_weight, carried), scanned

  accs = [leaf.reduction.init(leaf.shape, leaf.dtype) for leaf in leaves]
  carry = (accs, jnp.zeros([], jnp.float32), carried)
  (accs, total_weight, carried), scanned = lax.scan(
    body, carry, jnp.arange(n, dtype=jnp.int32)
  )
  positive = total_weight > 0
  total = _reductions.Total(
    n, weight_fn is not None, positive, jnp.where(positive, total_weight, 1.0)
  )
  results = [
    leaf.reduction.finalize(acc, ys, leaf.shape, total)
    for leaf, acc, ys in zip(leaves, accs, scanned, strict=True)
  ]
  if weight_fn is not None:
    results = _poisoned(results, total_weight)
  return treedef.unflatten(results), carried


def _poisoned(results: list, total_weight: jax.Array) -> list:
  """NaN outputs for a NaN or negative total weight, which has no mean (a
  total of 0, all padding, gives zeros); raised where it is concrete."""
  bad = ~(total_weight >= 0)
  if not isinstance(bad, jax.core.Tracer) and bool(bad):
    raise ValueError(
      "`weight_fn` gave the micro-batches a total weight of"
      f" {float(total_weight)}: weights must be non-negative and finite."
    )
  return [
    jnp.where(bad, jnp.nan, r) if jnp.issubdtype(r.dtype, jnp.inexact) else r
    for r in results
  ]


# ----------------------------------------------------------------------------
# The step: a plain function of arrays, or one taking Flax NNX objects.
# ----------------------------------------------------------------------------


def _plain_step(value_and_grad_fn, params, args, kwargs):
  """`(step, carried, write_back)` for arguments that are JAX values."""

  def step(micro, carried):
    return value_and_grad_fn(params, micro, *args, **kwargs), carried

  return step, None, lambda carried: None


def _nnx(arguments: Any) -> Any:
  """`flax.nnx` if `arguments` hold an NNX graph node (a Module, Rngs)."""
  nnx = sys.modules.get("flax.nnx")  # Imported by whoever made a Module.
  if nnx is None:
    return None
  is_node = nnx.graph.is_graph_node
  leaves = jax.tree.leaves(arguments, is_leaf=is_node)
  return nnx if any(is_node(leaf) for leaf in leaves) else None


def _nnx_step(nnx, value_and_grad_fn, params, args, kwargs):
  """`(step, carried, write_back)` for arguments holding NNX objects.

  NNX refuses a Variable created outside the scan's trace, so the arguments
  are split once outside it and merged inside every micro-batch from pure
  arrays: `nnx.Param` values are closed over (the same at every micro-batch,
  never copied), every other `nnx.Variable` (BatchNorm statistics, RNG
  counts) is carried from micro-batch to micro-batch, as in `n` calls one
  after the other, and `write_back` stores the last values in the caller's
  objects, as `nnx.value_and_grad` does.
  """
  graph = (params, args, kwargs)
  graphdef, fixed, variables, others = nnx.split(
    graph, nnx.Param, nnx.Variable, ...
  )
  fixed_def: TreeDef
  others_def: TreeDef
  carried_def: TreeDef
  fixed, fixed_def = jax.tree.flatten(fixed)
  others, others_def = jax.tree.flatten(others)
  carried, carried_def = jax.tree.flatten(variables)

  def step(micro, carried):
    merged = nnx.merge(
      graphdef,
      fixed_def.unflatten(fixed),
      carried_def.unflatten(carried),
      others_def.unflatten(others),
    )
    params, args, kwargs = merged
    out = value_and_grad_fn(params, micro, *args, **kwargs)
    variables = nnx.split(merged, nnx.Param, nnx.Variable, ...)[2]
    try:
      return out, carried_def.flatten_up_to(variables)
    except ValueError as e:
      raise ValueError(
        "`value_and_grad_fn` added or removed an `nnx.Variable` of its"
        " arguments; `microbatch` carries the NNX state from one"
        " micro-batch to the next and needs its structure fixed."
      ) from e

  def write_back(carried):
    nnx.update(graph, carried_def.unflatten(carried))

  return step, carried, write_back


# ----------------------------------------------------------------------------
# The transformation.
# ----------------------------------------------------------------------------


def microbatch(
  value_and_grad_fn: Callable[..., Any],
  num_microbatches: int,
  *,
  weight_fn: Callable[[Any], Any] | None = None,
  accumulator_dtype: Any = jnp.float32,
) -> Callable[..., Any]:
  r"""Evaluates ``value_and_grad_fn`` over micro-batches in one step, exactly.

  The returned function has the signature of ``value_and_grad_fn``,
  ``grad_fn(params, batch, *args, **kwargs)``. It splits ``batch`` (argument
  1, a tree whose leaves share a leading batch axis of size :math:`B`) into
  :math:`n` micro-batches :math:`b_1, \dots, b_n` of :math:`B / n` rows,
  evaluates ``value_and_grad_fn`` on them one after the other (a
  ``lax.scan``: only one micro-batch's activations are alive at a time) and
  returns the weighted means

  .. math::

    L = \frac{\sum_{i=1}^{n} w_i L_i}{\sum_{i=1}^{n} w_i}, \qquad
    g = \frac{\sum_{i=1}^{n} w_i g_i}{\sum_{i=1}^{n} w_i}, \qquad
    w_i = \texttt{weight\_fn}(b_i) \text{ (1 without weight\_fn)}.

  If :math:`L_i` is the mean of per-token losses :math:`\ell_t` over the
  :math:`w_i` real tokens of :math:`b_i`, then
  :math:`L = \sum_t \ell_t / \sum_i w_i`: the per-token mean of the whole
  batch, and by linearity :math:`g` is its gradient, however unevenly the
  tokens are spread. Averaging per-micro-batch means with equal weights (as
  ``optax.microbatching.microbatch`` does) is only exact when every
  micro-batch holds the same number of tokens.

  The split and the output:

  * micro-batch :math:`i` holds rows ``i, i + n, i + 2n, ...`` of the batch,
    a reshape of the batch axis to ``[B / n, n]``: a batch sharded over its
    leading axis stays sharded, each micro-batch taking :math:`B / (n D)`
    rows from each of the :math:`D` devices (keep :math:`B / n` a multiple
    of :math:`D`). Other arguments are passed unchanged to every call;
    gradients must be taken with respect to them (usually ``params``), not
    the batch;
  * whether ``value_and_grad_fn`` was built with ``has_aux`` is detected
    from its output (traced once with ``jax.eval_shape``): a value that is a
    pair is ``(loss, aux)``, otherwise it is the loss and must be a scalar.
    The output has the same structure as ``value_and_grad_fn``'s;
  * gradients are summed in ``accumulator_dtype`` and returned in their own
    dtype; the loss and floating ``aux`` leaves are summed in at least
    float32 and reduced like the gradients (weighted mean);
  * other ``aux`` leaves: integer leaves are summed (counts such as the
    number of tokens or of correct predictions add up to the whole batch's),
    boolean leaves are or-ed (a flag raised by any micro-batch stays
    raised), and any other dtype (typed PRNG keys from ``jax.random.key``;
    raw ``uint32`` keys are integers and would be summed) holds the last
    micro-batch's value. Leaves are reduced, never concatenated: return
    per-example outputs from a separate function (or
    ``optax.microbatching.micro_vmap``);
  * ``num_microbatches=1`` calls ``value_and_grad_fn`` once on the whole
    batch and returns its output unchanged (``weight_fn`` is not called).

  Rules for the runtime values: weights are meant to be :math:`\geq 0`; a
  micro-batch of weight 0 contributes nothing, even if its loss or gradient
  is NaN (the 0/0 of a per-token mean over an all-padding micro-batch); if
  the total weight is 0, the loss, gradients and floating ``aux`` leaves are
  zeros, not NaN. A NaN or negative total weight has no mean: called
  outside ``jit`` it raises a ``ValueError``; under ``jit`` those leaves are
  NaN (so ``skip_nonfinite`` or a NaN check catches it).

  Flax NNX: ``value_and_grad_fn`` may be ``nnx.value_and_grad(loss_fn)``
  with the model as argument 0 (other arguments may hold NNX objects too,
  e.g. an ``nnx.Rngs``); gradients come back as the ``nnx.State`` it
  returns. The arguments are split once outside the scan and merged inside
  it: ``nnx.Param`` values are the same at every micro-batch (changes to
  them during the call are dropped), every other ``nnx.Variable`` (BatchNorm
  statistics, RNG counts) is carried from one micro-batch to the next and
  written back to the caller's objects, leaving them as :math:`n` calls one
  after the other would. So a BatchNorm in training mode normalises with
  each micro-batch's statistics and updates its running averages
  :math:`n` times, and dropout masks drawn from the model's ``nnx.Rngs``
  differ between micro-batches: neither equals the unsplit step.

  Dropout and other randomness: put the keys in the batch, one per example,
  e.g. ``batch["rng"] = jax.random.split(key, B)``, so that every
  micro-batch receives the keys of its own rows. Drawing each example's mask
  from its own key (``jax.vmap`` over the keys) makes the result
  independent of ``num_microbatches``; a model that takes a single key can
  use ``batch["rng"][0]``, which differs between micro-batches. Use a new
  ``key`` every step.

  Args:
    value_and_grad_fn: ``jax.value_and_grad(loss_fn, has_aux=...)`` (or any
      function with its output structure) whose argument 1 is the batch.
    num_microbatches: :math:`n`, a positive int that divides the batch size.
      Peak activation memory scales with :math:`B / n`.
    weight_fn: ``weight_fn(micro_batch) -> scalar``, the weight
      :math:`w_i` of a micro-batch (a real number: bool, integer or
      floating, used as float32), e.g. its number of real tokens
      ``lambda b: b["mask"].sum()``. ``None`` weighs micro-batches equally.
    accumulator_dtype: The dtype in which gradients are summed (float32 by
      default, so bf16 gradients do not lose precision); ``None`` keeps each
      gradient leaf's dtype. Complex gradient leaves are summed in the
      complex dtype of its precision (complex64 for float32); a complex
      ``accumulator_dtype`` is for complex gradients only.

  Returns:
    ``grad_fn(params, batch, *args, **kwargs)``, returning what
    ``value_and_grad_fn`` returns: ``(loss, grads)`` or
    ``((loss, aux), grads)``. Compose it with :func:`optax_accum.accumulate`
    to also accumulate across steps, passing the step's total weight (e.g.
    its number of tokens) as ``weight=``.

  Raises:
    TypeError, ValueError: At construction, for a ``num_microbatches`` that
      is not an int (float, bool, str, None), is below 1 or above the int32
      range, a non-callable ``value_and_grad_fn`` or ``weight_fn``, or a
      bad ``accumulator_dtype``. At trace time, for a batch with no leaves,
      scalar leaves, leaves of different leading sizes or a size not
      divisible by ``num_microbatches``, a weight that is not a real scalar
      (``None``, a string, complex, an array), a complex
      ``accumulator_dtype`` for a real gradient leaf, an output that does
      not look like ``jax.value_and_grad``'s, or NNX arguments whose
      variables ``value_and_grad_fn`` adds or removes.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_accum
    >>> def loss_fn(w, batch):  # per-token mean of a squared error
    ...   err = batch["mask"] * (w * batch["x"] - batch["y"]) ** 2
    ...   return err.sum() / batch["mask"].sum()
    >>> batch = {"x": jnp.array([1.0, 2.0, 3.0, 4.0]), "y": jnp.zeros(4),
    ...          "mask": jnp.array([1.0, 1.0, 1.0, 0.0])}
    >>> w = jnp.array(1.0)
    >>> loss, grad = jax.value_and_grad(loss_fn)(w, batch)
    >>> print(f"{loss:.4f} {grad:.4f}")  # (1 + 4 + 9) / 3, (2 + 8 + 18) / 3
    4.6667 9.3333
    >>> grad_fn = optax_accum.microbatch(
    ...     jax.value_and_grad(loss_fn), 2, weight_fn=lambda b: b["mask"].sum())
    >>> loss, grad = jax.jit(grad_fn)(w, batch)
    >>> print(f"{loss:.4f} {grad:.4f}")  # rows {0, 2}: 2 tokens; {1, 3}: 1
    4.6667 9.3333
    >>> unweighted = optax_accum.microbatch(jax.value_and_grad(loss_fn), 2)
    >>> loss, grad = unweighted(w, batch)
    >>> print(f"{loss:.4f} {grad:.4f}")  # (10 / 2 + 4) / 2: not the mean
    4.5000 9.0000
  """
  if not callable(value_and_grad_fn):
    raise TypeError(
      "`value_and_grad_fn` must be callable, e.g."
      " `jax.value_and_grad(loss_fn)`, got"
      f" {type(value_and_grad_fn).__name__}."
    )
  n = _checks.positive_int(num_microbatches, "num_microbatches")
  if n > _checks.INT32_MAX:  # The scan's micro-batch index is an int32.
    raise ValueError(
      f"`num_microbatches` must be at most {_checks.INT32_MAX}, got {n}."
    )
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(
      "`weight_fn` must be None or a callable `weight_fn(micro_batch) ->"
      f" scalar`, got {type(weight_fn).__name__}."
    )
  if weight_fn is not None:
    _takes_one_argument(weight_fn)
  accumulator_dtype = _checks.accumulator_dtype(accumulator_dtype)

  def microbatched(params: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    _batch_size(batch, n)
    if n == 1:
      return value_and_grad_fn(params, batch, *args, **kwargs)
    nnx = _nnx((params, args, kwargs))
    if nnx is None:
      make_step, reference = _plain_step, params
    else:
      make_step, reference = functools.partial(_nnx_step, nnx), None
    step, carried, write_back = make_step(
      value_and_grad_fn, params, args, kwargs
    )
    out, carried = _scan(
      step,
      carried,
      _split(batch, n),
      n,
      weight_fn,
      accumulator_dtype,
      reference,
    )
    write_back(carried)
    return out

  return microbatched
