"""`local_value_and_grad`: each device's gradient, left unreduced.

Under plain ``jax.jit`` over a mesh whose data axis is ``AxisType.Explicit``,
the gradient a step hands to ``accumulate(..., axis_name=...)`` must be typed
unreduced over that axis: each device's partial sum, not yet added up. This
module makes such gradients for any loss, with the operations of
:mod:`optax_accum._unreduced`.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum import _checks, _noise_scale
from optax_accum._unreduced import (
  AxisName,
  axis_tuple,
  check_explicit_axis,
  partitions,
  spec_of,
  without_axes,
)


def from_per_device(stacked: Any, axis_name: AxisName = "data") -> Any:
  """Arrays ``(n, *shape)`` sharded over `axis_name` on their leading axis,
  one slot per device, to ``shape`` typed unreduced: no communication.

  ``shard_map`` returns unreduced outputs only in full manual mode; this
  contraction with ones works with params sharded over other mesh axes
  (tensor parallel), which then keep their sharding.
  """

  def one(s):
    parts = partitions(spec_of(s))[1:]
    parts += (None,) * (s.ndim - 1 - len(parts))
    out = P(*parts, unreduced=frozenset(axis_tuple(axis_name)))
    ones = jnp.ones(s.shape[:1], s.dtype, out_sharding=P(axis_name))
    return jnp.einsum(
      "d,d...->...",
      ones,
      s,
      out_sharding=out,
      precision=lax.Precision.HIGHEST,
      preferred_element_type=s.dtype,
    )

  return jax.tree.map(one, stacked)


def local_value_and_grad(
  fun: Callable[..., Any],
  *,
  axis_name: AxisName = "data",
  has_weight: bool = False,
  has_aux: bool = False,
  in_specs: Sequence[Any] | None = None,
  noise_stats: bool = False,
) -> Callable[..., Any]:
  r"""Like ``jax.value_and_grad(fun)``, but each device's gradient is left
  unreduced over `axis_name`: no communication of parameter size.

  Call the result under ``jax.jit`` with a mesh set by ``jax.set_mesh`` whose
  `axis_name` axis is ``AxisType.Explicit``, params replicated over that axis
  (or sharded over it, FSDP-style: they are all-gathered first) and the
  batch split over it on its leading axis. Inside, ``fun(params, *args)``
  runs once per device on that device's share of every argument after
  ``params`` (in global view over the other mesh axes, so a tensor-parallel
  model runs unchanged). What `fun` returns:

  * ``loss``: the mean of the loss over the device's examples. Devices
    count equally, so the result is the big-batch mean when every device
    gets the same number of examples;
  * with ``has_weight=True``, ``(loss, weight)``: the mean over the
    device's tokens and their number :math:`n_d` (e.g. ``mask.sum()``),
    which may differ between devices; a device with :math:`n_d = 0`
    contributes nothing, even if its mean is the NaN of 0/0;
  * with ``has_aux=True``, ``(that, aux)``.

  The gradient returned on device :math:`d` is
  :math:`\frac{n_d}{N} \nabla \ell_d` with :math:`N = \sum_d n_d` (and
  :math:`n_d = 1` without weights), so that summed over devices it is the
  gradient of the big-batch weighted mean :math:`\sum_d n_d \ell_d / N`:
  exactly the gradient ``jax.grad`` would give of the global mean loss. Hand
  it with ``weight=N`` (the returned weight) to an accumulator: with
  per-micro-batch weights :math:`N_i` the accumulated
  :math:`\sum_i N_i g_i / \sum_i N_i` is the per-token mean over all
  micro-batches and devices.

  Args:
    fun: ``fun(params, *args)``, see above.
    axis_name: The data axis of the mesh (a name or a tuple of names).
    has_weight: Whether `fun` returns ``(loss, weight)``.
    has_aux: Whether `fun` returns ``(value, aux)``.
    in_specs: PartitionSpecs (over `axis_name` only) of the arguments after
      ``params``, one prefix per argument; by default each is split over
      `axis_name` on its leading axis. Use ``P()`` for an argument every
      device gets whole (a step count, a shared key).
    noise_stats: Whether to also return the
      :class:`~optax_accum.distributed.NoiseStats` of the micro-batch, for
      ``accumulate(..., track_noise_scale=True)``: each device measures
      :math:`n_d |\nabla \ell_d|^2`, a pass over its gradient, and the
      sums join the loss's all-reduce.

  Returns:
    ``value_and_grad(params, *args) -> (value, grads)``, where `value` has
    the structure `fun` returns: the loss is the global (weighted) mean and
    the weight is :math:`N`, both replicated; `aux` gets a leading axis with
    one entry per device, split over `axis_name`. `grads` has the structure
    and, over the other mesh axes, the sharding of `params`, typed unreduced
    over `axis_name`. One scalar all-reduce (loss and weight) is done.
    With ``noise_stats=True``, ``(value, grads, stats)``: pass ``stats`` on
    as ``update(..., noise_stats=stats)``. Called outside ``jit`` it runs
    itself under ``jax.jit`` (compiled once per argument types).

  Raises:
    RuntimeError, ValueError: When called, if JAX lacks unreduced shardings
      or the axis is missing or not explicit (the error says which).
  """
  if not callable(fun):
    raise TypeError(f"`fun` must be callable, got {fun!r}.")
  has_weight = _checks.boolean(has_weight, "has_weight")
  has_aux = _checks.boolean(has_aux, "has_aux")
  noise_stats = _checks.boolean(noise_stats, "noise_stats")
  loss = _Loss(fun, axis_name, has_weight, has_aux, noise_stats)
  value_and_grad = functools.partial(loss.value_and_grad, in_specs)
  jitted = jax.jit(value_and_grad)

  def call(params: Any, *args: Any) -> Any:
    if _checks.is_traced(params):
      return value_and_grad(params, *args)
    # Eagerly, shard_map would dispatch op by op on every device: the same
    # computation, compiled once.
    return jitted(params, *args)

  return call


@dataclasses.dataclass(frozen=True)
class _Loss:
  """The loss of :func:`local_value_and_grad` and what it returns."""

  fun: Callable[..., Any]
  axis_name: AxisName
  has_weight: bool
  has_aux: bool
  noise_stats: bool

  def value_and_grad(self, in_specs, params: Any, *args: Any) -> Any:
    axis_name = self.axis_name
    axes = axis_tuple(axis_name)
    check_explicit_axis(axis_name)
    # FSDP: a param sharded over the data axis is gathered (the forward
    # needs it whole); its gradient is then a full-size partial sum.
    params = jax.tree.map(
      lambda p: jax.reshard(p, P(*without_axes(spec_of(p), axes))), params
    )
    specs = (
      tuple(in_specs) if in_specs is not None else (P(axis_name),) * len(args)
    )
    if len(specs) != len(args):
      raise ValueError(
        f"`in_specs` must have one entry per argument after `params`,"
        f" got {len(specs)} for {len(args)} arguments."
      )
    (value, aux, stats), stacked = jax.shard_map(
      self.per_device,
      in_specs=(P(),) + specs,
      out_specs=((P(), P(axis_name), P()), P(axis_name)),
      axis_names=frozenset(axes),
    )(params, *args)
    grads = from_per_device(stacked, axis_name)
    value = (value, aux) if self.has_aux else value
    if self.noise_stats:
      return value, grads, stats
    return value, grads

  def split(self, params: Any, *args: Any) -> Any:
    """`fun` as ``(loss, (weight, aux))``."""
    out = self.fun(params, *args)
    value, aux = out if self.has_aux else (out, None)
    loss, weight = value if self.has_weight else (value, 1.0)
    return loss, (weight, aux)

  def per_device(self, params: Any, *args: Any) -> Any:
    """One device's gradient, scaled by its share of the global weight."""
    axis_name = self.axis_name
    params = jax.tree.map(
      lambda p: lax.pcast(p, axis_name, to="varying"), params
    )
    (loss, (weight, aux)), grads = jax.value_and_grad(self.split, has_aux=True)(
      params, *args
    )
    weight = lax.stop_gradient(jnp.asarray(weight, jnp.float32))
    empty = weight == 0
    loss32 = jnp.where(empty, 0.0, jnp.asarray(loss, jnp.float32))
    sums: tuple[jax.Array, ...] = (weight * loss32, weight)
    if self.noise_stats:  # This device's share, measured before scaling.
      sq = jnp.where(empty, 0.0, weight * _noise_scale.sq_norm(grads))
      sums += (sq, jnp.where(empty, 0.0, 1.0))
    # Scalars only, in one all-reduce.
    loss_sum, total, *noise = lax.psum(sums, axis_name)
    share = jnp.where(total == 0, 0.0, weight / jnp.where(total == 0, 1, total))
    grads = jax.tree.map(
      lambda g: jnp.where(empty, jnp.zeros_like(g), g * share.astype(g.dtype))[
        None
      ],
      grads,
    )
    mean_loss = jnp.where(
      total == 0, 0.0, loss_sum / jnp.where(total == 0, 1, total)
    )
    mean_loss = mean_loss.astype(jnp.result_type(loss))
    value = (mean_loss, total) if self.has_weight else mean_loss
    aux = jax.tree.map(lambda a: jnp.asarray(a)[None], aux)
    stats = None
    if self.noise_stats:
      sq_sum, count = noise
      stats = _noise_scale.NoiseStats(sq_sum, total, count.astype(jnp.int32))
    return (value, aux, stats), grads
