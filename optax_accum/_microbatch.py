"""`microbatch`: exact, token-weighted micro-batching inside one step.

Read top to bottom: the batch split, how each output leaf
is reduced, then :func:`microbatch` itself.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding

from optax_accum import _checks, _weighting

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
# How each output leaf is reduced over the micro-batches.
# ----------------------------------------------------------------------------

# A leaf's kind decides its reduction: the (weighted) mean, the sum, logical
# or, the value from the last micro-batch, or the float0 zeros that
# `jax.grad(..., allow_int=True)` returns for integer arguments.
_MEAN, _SUM, _ANY, _LAST, _FLOAT0 = "mean", "sum", "any", "last", "float0"


def _kind(dtype: Any) -> str:
  if dtype == jax.dtypes.float0:
    return _FLOAT0
  if jnp.issubdtype(dtype, jnp.inexact):
    return _MEAN
  if jnp.issubdtype(dtype, jnp.integer):
    return _SUM
  if jnp.issubdtype(dtype, jnp.bool_):
    return _ANY
  return _LAST  # PRNG keys and other extended dtypes.


def _zeros(shape: jax.ShapeDtypeStruct, dtype: Any) -> jax.Array:
  """Zeros of `shape`'s shape; with its sharding where the mesh is explicit.

  Under an explicit mesh a sharding is part of the type, so a scan carry
  must start with the sharding the body gives it (e.g. FSDP gradients).
  """
  sharding = getattr(shape, "sharding", None)
  if isinstance(sharding, NamedSharding) and any(
    axis_type == AxisType.Explicit for axis_type in sharding.mesh.axis_types
  ):
    return jnp.zeros(shape.shape, dtype, out_sharding=sharding)
  return jnp.zeros(shape.shape, dtype)


def _check_output(out: Any) -> bool:
  """Returns `has_aux` from the shapes of one call; raises if not a pair."""
  if not (isinstance(out, tuple | list) and len(out) == 2):
    raise TypeError(
      "`value_and_grad_fn` must return `(value, grads)` like"
      " `jax.value_and_grad`, got an output of type"
      f" {type(out).__name__}."
    )
  value = out[0]
  has_aux = isinstance(value, tuple | list) and len(value) == 2
  loss = value[0] if has_aux else value
  if not (isinstance(loss, jax.ShapeDtypeStruct) and loss.shape == ()):
    raise TypeError(
      "`value_and_grad_fn` must return `(loss, grads)` or"
      " `((loss, aux), grads)` with a scalar loss, like"
      " `jax.value_and_grad(loss_fn, has_aux=...)`; got a value of"
      f" {jax.tree.map(lambda s: (s.shape, s.dtype), value)}."
    )
  return has_aux


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

  Rules for the runtime values (not checked under ``jit``): weights are
  meant to be :math:`\geq 0`; a micro-batch of weight 0 contributes nothing,
  even if its loss or gradient is NaN (the 0/0 of a per-token mean over an
  all-padding micro-batch); if the total weight is not positive, the loss,
  gradients and floating ``aux`` leaves are zeros, not NaN.

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
      :math:`w_i` of a micro-batch, e.g. its number of real tokens
      ``lambda b: b["mask"].sum()``. ``None`` weighs micro-batches equally.
    accumulator_dtype: The dtype in which gradients are summed (float32 by
      default, so bf16 gradients do not lose precision); ``None`` keeps each
      gradient leaf's dtype.

  Returns:
    ``grad_fn(params, batch, *args, **kwargs)``, returning what
    ``value_and_grad_fn`` returns: ``(loss, grads)`` or
    ``((loss, aux), grads)``. Compose it with :func:`optax_accum.accumulate`
    to also accumulate across steps, passing the step's total weight (e.g.
    its number of tokens) as ``weight=``.

  Raises:
    TypeError, ValueError: At construction, for a ``num_microbatches`` that
      is not an int (float, bool, str, None) or is below 1, a non-callable
      ``value_and_grad_fn`` or ``weight_fn``, or a bad
      ``accumulator_dtype``. At trace time, for a batch with no leaves,
      scalar leaves, leaves of different leading sizes or a size not
      divisible by ``num_microbatches``, a non-scalar weight, or an output
      that does not look like ``jax.value_and_grad``'s.

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
  num_microbatches = _checks.positive_int(num_microbatches, "num_microbatches")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(
      "`weight_fn` must be None or a callable `weight_fn(micro_batch) ->"
      f" scalar`, got {type(weight_fn).__name__}."
    )
  accumulator_dtype = _checks.accumulator_dtype(accumulator_dtype)
  n = num_microbatches

  def microbatched(params: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    _batch_size(batch, n)
    if n == 1:
      return value_and_grad_fn(params, batch, *args, **kwargs)
    split = _split(batch, n)

    def call(index):
      micro = _micro_batch(split, index)
      out = value_and_grad_fn(params, micro, *args, **kwargs)
      if weight_fn is None:
        return out, None
      weight = jnp.asarray(weight_fn(micro))
      if weight.ndim != 0:
        raise ValueError(
          "`weight_fn` must return a scalar (one weight per micro-batch),"
          f" got shape {weight.shape}."
        )
      return out, weight.astype(jnp.float32)

    # Closes over the arguments: they need not be valid JAX types.
    out_shape = jax.eval_shape(lambda: call(0)[0])
    _check_output(out_shape)
    leaf_shapes, treedef = jax.tree.flatten(out_shape)
    # The value's leaves (loss, aux) come first, then the gradient's.
    num_value_leaves = len(jax.tree.leaves(out_shape[0]))
    kinds = [_kind(s.dtype) for s in leaf_shapes]

    def acc_dtype(position, shape):
      if position >= num_value_leaves:  # A gradient leaf.
        if kinds[position] != _MEAN:
          return shape.dtype
        return _checks.leaf_accumulator_dtype(accumulator_dtype, shape.dtype)
      if kinds[position] == _MEAN:  # The loss or a floating aux leaf.
        return jnp.promote_types(shape.dtype, jnp.float32)
      return shape.dtype

    acc_dtypes = [acc_dtype(i, s) for i, s in enumerate(leaf_shapes)]

    def init(kind, dtype, shape):
      if kind in (_LAST, _FLOAT0):
        # Not carried: the last values are scan outputs (an extended dtype
        # has no zeros to start a carry from), float0 is always zeros.
        return None
      return _zeros(shape, dtype)

    accs0 = [
      init(kind, dtype, shape)
      for kind, dtype, shape in zip(kinds, acc_dtypes, leaf_shapes, strict=True)
    ]
    carry0 = (accs0, jnp.zeros([], jnp.float32))

    def body(carry, index):
      accs, total_weight = carry
      out, weight = call(index)
      leaves = treedef.flatten_up_to(out)
      new_accs, lasts = [], []
      for kind, acc, value in zip(kinds, accs, leaves, strict=True):
        if kind == _MEAN:
          compute = _weighting.compute_dtype(acc.dtype)
          term = _weighting.weighted_term(value, weight, compute)
          acc = (acc.astype(compute) + term).astype(acc.dtype)
        elif kind == _SUM:
          acc = acc + value
        elif kind == _ANY:
          acc = acc | value
        elif kind == _LAST:
          lasts.append(value)
        new_accs.append(acc)
      if weight is not None:
        total_weight = total_weight + weight
      return (new_accs, total_weight), lasts

    (accs, total_weight), lasts = lax.scan(
      body, carry0, jnp.arange(n, dtype=jnp.int32)
    )

    lasts = iter(lasts)
    positive = total_weight > 0
    safe_weight = jnp.where(positive, total_weight, 1.0)
    results = []
    for kind, acc, shape in zip(kinds, accs, leaf_shapes, strict=True):
      if kind == _MEAN:
        compute = _weighting.compute_dtype(acc.dtype)
        if weight_fn is None:
          mean = acc.astype(compute) / n
        else:
          mean = jnp.where(
            positive, acc.astype(compute) / safe_weight.astype(compute), 0
          )
        results.append(mean.astype(shape.dtype))
      elif kind == _LAST:
        results.append(next(lasts)[-1])
      elif kind == _FLOAT0:
        results.append(np.zeros(shape.shape, jax.dtypes.float0))
      else:
        results.append(acc)
    return treedef.unflatten(results)

  return microbatched
