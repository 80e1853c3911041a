"""How a cycle starts and closes: the only platform-dependent code.

**One meaning of the state on every backend.** After a call that ends a
cycle, ``acc_grads`` is zeros and ``acc_weight`` is 0; while a cycle is
open they hold its sum and its total weight. A state saved on one backend
resumes on any other, bit for bit (``tests/test_backend_forms.py``).

What differs is only *how* the accumulator returns to zeros, because the
emitting branch writes the updates into the accumulator's buffer
(:class:`optax_accum._cycle.SharedBuffer`) and the two compilers treat a
buffer passed through a conditional differently:

* GPU/TPU (:func:`_close_in_conditional`): a second conditional, entered
  when the cycle ends, applies the updates to the params and zeroes the
  buffer in place; on a micro-step it passes both through untouched, so a
  micro-step neither reads nor writes them and the add into the
  accumulator fuses into each weight gradient's GEMM;
* CPU (:func:`_close_with_select`): XLA:CPU's copy insertion copies a buffer
  that a conditional passes through whenever that buffer is read after it
  (``tests/test_performance_structure.py`` fails on it: one accumulator
  copy per micro-step). So the params are applied in a conditional of
  their own and the accumulator returns to zeros with a select, fused into
  one elementwise pass.

And where a conditional branch ends weightless cycles too (the unreduced and
``shard_map`` engines, and updates that cannot share the accumulator's
buffer), how the inner optimizer's result is kept out of a cycle of no
weight (:func:`run_if_weighted`): selects on GPU/TPU, a conditional of its
own on CPU.

A state saved by optax_accum 0.1 on CPU right after an emitting call holds
that call's updates in ``acc_grads`` and its weight in ``acc_weight`` (0.1
left them there on CPU). :func:`cycle_start` recognises it (a fresh cycle
with a non-zero weight, which 0.2 never leaves) and starts that cycle at
weight −inf: the cycle emits zeros and leaves ``inner``'s state alone, then
training goes on. One cycle without an update; never a wrong one.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import _control, _tree


def _per_backend(*args: Any, cpu: Callable, accelerator: Callable) -> Any:
  """`cpu(*args)` in a program compiled for CPU, else `accelerator(*args)`.

  The tests pin this to one form to run the other on CPU.
  """
  return lax.platform_dependent(*args, cpu=cpu, default=accelerator)


def cycle_start(state: Any) -> tuple[Any, jax.Array]:
  """The accumulator and total weight that this call adds to: the state's
  own (zeros and 0 when a cycle starts), or, for a 0.1 CPU state left after
  an emission, a weight of −inf that makes the cycle emit nothing."""
  left_by_v01 = (state.micro_step == 0) & (state.acc_weight != 0)
  weight = jnp.where(left_by_v01, -jnp.inf, state.acc_weight)
  return state.acc_grads, weight


def applied(update_types: Any, params: Any, out: Any) -> Any:
  """`params` with the updates held in the buffer `out` applied."""
  updates = jax.tree.map(lambda b, t: b.astype(t.dtype), out, update_types)
  return optax.apply_updates(params, updates)


def close_shared(
  engine: Any,
  update_types: Any,
  params: Any,
  out: Any,
  cycle_end: jax.Array,
  emitted: jax.Array,
) -> tuple[Any, Any]:
  """``(new_params, acc)`` once the updates in `out` have been read:
  `params` with them applied (None without params) and the accumulator,
  zeros if the cycle ended."""
  return _per_backend(
    params,
    out,
    cpu=functools.partial(
      _close_with_select, engine, update_types, cycle_end, emitted
    ),
    accelerator=functools.partial(
      _close_in_conditional, engine, update_types, cycle_end, emitted
    ),
  )


def _close_in_conditional(
  engine, update_types, cycle_end, emitted, params, out
):
  def keep(params, out):
    return params, out

  def close(params, out):
    if params is not None:  # The select fuses into the update's kernel.
      params = _tree.select(emitted, applied(update_types, params, out), params)
    return params, _control.cleared(cycle_end, out, engine)

  return _control.cond(cycle_end, close, keep, params, out)


def _close_with_select(engine, update_types, cycle_end, emitted, params, out):
  if params is not None:
    params = _control.cond(
      emitted,
      functools.partial(applied, update_types),
      lambda params, out: params,
      params,
      out,
    )
  return params, engine.cleared(out, out, cycle_end)


def run_if_weighted(
  emitted: jax.Array,
  run: Callable,
  skip: Callable,
  run_then_select: Callable,
  *operands: Any,
) -> Any:
  """The inner optimizer, in a conditional branch that ends every cycle
  (weightless ones too): its result where `emitted` (the total weight is
  positive, or NaN), else `skip`'s (zero updates, the state as it was).
  Each callable takes ``(emitted, *operands)``.

  * GPU/TPU: `run_then_select`: the optimizer runs, and selects that fuse
    into its kernels keep its result out (a conditional of its own there
    costs the 8-H100 ``shard_map`` step a quarter of the accumulator more
    memory, ``tests/test_accelerators.py``);
  * CPU (:func:`_control.run_if_weighted`): a conditional of its own, where
    `skip` passes the state through. XLA:CPU does not update the state in
    place under the selects, and copies every inner-state leaf twice per
    micro-step.
  """
  return _per_backend(
    *operands,
    cpu=lambda *o: _control.run_if_weighted(emitted, run, skip, emitted, *o),
    accelerator=functools.partial(run_then_select, emitted),
  )


def weight_after(total_weight: jax.Array, cycle_end: jax.Array) -> jax.Array:
  """The state's ``acc_weight`` after the call: 0 once a cycle ends."""
  return jnp.where(cycle_end, 0.0, total_weight)
