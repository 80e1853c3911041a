"""``optax_accum.flax.local_value_and_grad``: an NNX model's gradient on a
data-parallel mesh, left unreduced until the cycle ends."""

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from optax_accum.distributed import _local_grad


def local_value_and_grad(
  fun: Callable[..., Any],
  *,
  axis_name: Hashable = "data",
  wrt: Any = nnx.Param,
  has_weight: bool = False,
  has_aux: bool = False,
  in_specs: Sequence[Any] | None = None,
) -> Callable[..., Any]:
  r"""Like ``nnx.value_and_grad(fun)``, but each device's gradient is left
  unreduced over `axis_name`: no parameter-sized communication.

  For data parallelism with ``optax_accum.accumulate(..., axis_name=...)``
  and :class:`Optimizer`: under ``nnx.jit`` (or ``jax.jit``) with a mesh set
  by ``jax.set_mesh`` whose `axis_name` axis is ``AxisType.Explicit`` (the
  default of ``jax.make_mesh``), the model's params replicated and the
  batch split over `axis_name`, ``nnx.value_and_grad`` returns the gradient
  summed over the devices, an all-reduce of the params' size on every
  micro-batch. This one returns each device's share of it, typed unreduced,
  and ``accumulate`` sums the accumulated gradient over the devices once, in
  the call that ends the cycle.

  ``fun(model, *args)`` runs once per device on that device's share of
  every argument after ``model``. It returns what
  :func:`optax_accum.distributed.local_value_and_grad` describes: the mean
  loss over the device's examples, or with ``has_weight=True``
  ``(loss, weight)`` (the mean over the device's tokens and their number),
  and with ``has_aux=True`` ``(that, aux)``. The gradients summed over the
  devices are those of the big-batch mean loss, as ``nnx.value_and_grad``
  would give.

  `fun` must leave the model's other state alone: state that the forward
  pass updates (``nnx.BatchStat`` in training mode, the counters of
  ``nnx.Rngs`` that dropout draws from) would differ between devices. Such
  a model raises a ``ValueError`` at trace time; compute its gradient with
  ``nnx.value_and_grad`` (reduced on every micro-batch) or pass the random
  keys in the batch.

  Args:
    fun: ``fun(model, *args)``, see above.
    axis_name: The data axis of the mesh (a name or a tuple of names).
    wrt: The filter of the variables to differentiate, as the optimizer's
      ``wrt``.
    has_weight: Whether `fun` returns ``(loss, weight)``.
    has_aux: Whether `fun` returns ``(value, aux)``.
    in_specs: PartitionSpecs over `axis_name` of the arguments after
      ``model``, one prefix per argument; by default each is split over
      `axis_name` on its leading axis (``P()`` for one every device gets
      whole).

  Returns:
    ``value_and_grad(model, *args) -> (value, grads)``: `value` as
    :func:`optax_accum.distributed.local_value_and_grad` returns it (the
    global mean loss, the global weight :math:`N`, `aux` with a leading
    device axis) and `grads` an ``nnx.State`` of the `wrt` variables, typed
    unreduced over `axis_name`. Hand them to ``optimizer.update(model,
    grads)`` (with ``weight=N`` for token means).

  Raises:
    ValueError: At trace time, if `fun` updates model state outside `wrt`,
      or the mesh axis is missing or not explicit.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> with jax.set_mesh(mesh):
    ...   model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    ...   tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
    ...   optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
    >>> grad_fn = optax_accum.flax.local_value_and_grad(
    ...   lambda m, x: jnp.mean(m(x) ** 2))
    >>> @nnx.jit(donate_argnums=(0, 1))
    ... def step(model, optimizer, x):
    ...   loss, grads = grad_fn(model, x)
    ...   optimizer.update(model, grads)
    ...   return loss
    >>> x = jnp.ones((2 * jax.device_count(), 4))
    >>> with jax.set_mesh(mesh):
    ...   x = jax.device_put(x, jax.P("data"))
    ...   for _ in range(2):
    ...     loss = step(model, optimizer, x)
    >>> print(int(optimizer.optimizer_step))
    1
  """
  if not callable(fun):
    raise TypeError(f"`fun` must be callable, got {fun!r}.")

  def value_and_grad(model: Any, *args: Any) -> Any:
    # (The other Variables: the third part of split's variadic tuple.)
    graphdef, params, *others = nnx.split(model, wrt, ...)
    rest = others[0]

    def loss(params: Any, rest: Any, *args: Any) -> Any:
      # Plain arrays: `merge` makes the other variables afresh in this
      # trace (the outer trace's variables refuse any write here, with an
      # error that does not say why).
      model = nnx.merge(graphdef, params, rest)
      out = fun(model, *args)
      _, _, *after = nnx.split(model, wrt, ...)
      _check_unchanged(rest, nnx.as_pure(after[0]))
      return out

    specs = (P(),) + (
      tuple(in_specs) if in_specs is not None else (P(axis_name),) * len(args)
    )
    return _local_grad.local_value_and_grad(
      loss,
      axis_name=axis_name,
      has_weight=has_weight,
      has_aux=has_aux,
      in_specs=specs,
    )(params, nnx.as_pure(rest), *args)

  return value_and_grad


def _check_unchanged(before: Any, after: Any) -> None:
  """Raises if the loss wrote model state outside `wrt`."""
  old = dict(jax.tree_util.tree_flatten_with_path(before)[0])
  for path, leaf in jax.tree_util.tree_flatten_with_path(after)[0]:
    if old.get(path) is not leaf:
      raise ValueError(
        f"The loss updates the model's state at"
        f" {jax.tree_util.keystr(path)}, outside `wrt` (batch statistics,"
        " the counters of `nnx.Rngs`): on a data-parallel mesh each device"
        " would update it differently. `local_value_and_grad` needs a loss"
        " that only reads such state: use `nnx.value_and_grad` for this"
        " model (its gradient is reduced on every micro-batch), or pass"
        " random keys in the batch."
      )
