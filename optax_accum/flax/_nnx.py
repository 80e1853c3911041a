"""``optax_accum.flax.Optimizer``: ``nnx.Optimizer`` applying with
:func:`optax_accum.apply_updates`."""

from typing import Any

import flax
import jax.numpy as jnp
import optax
from flax import nnx

from optax_accum import _apply, _checks, _state


class Optimizer(nnx.Optimizer):
  """A drop-in for ``flax.nnx.Optimizer`` around ``optax_accum.accumulate``.

  The same constructor (``Optimizer(model, tx, wrt=nnx.Param)``), the same
  ``update(model, grads, **kwargs)`` and the same fields. ``update`` also
  takes :func:`optax_accum.accumulate`'s ``weight=``, ``flush=`` and
  ``emit=`` (a ``TypeError`` naming them with a `tx` that holds no
  ``accumulate``; the inner optimizer's own extra arguments pass through),
  and applies the updates with :func:`optax_accum.apply_updates`:
  on a micro-step the model's params are neither read nor written (the
  stock class adds zeros to them on every call). Jit the step with
  ``nnx.jit(..., donate_argnums=...)`` over the model and the optimizer (or
  ``jax.jit`` over their split state, donated) so that the accumulator and
  the params are updated in place.

  ``step`` counts ``update`` calls (micro-batches), as in ``nnx.Optimizer``;
  :attr:`optimizer_step` counts the optimizer steps (updates applied), and
  ``optax_accum.has_updated(optimizer.opt_state)`` says whether the last
  call applied one.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=2)
    >>> optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
    >>> loss = lambda m: jnp.mean(m(jnp.ones((4, 2))) ** 2)
    >>> for _ in range(4):
    ...   _ = optimizer.update(model, nnx.grad(loss)(model))
    >>> print(int(optimizer.step[...]), int(optimizer.optimizer_step))
    4 2
  """

  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> optax.Updates:
    """Accumulates `grads` and, when a cycle ends, updates `model`.

    Args:
      model: The model whose params `grads` are for.
      grads: The gradients, from ``nnx.grad`` with this ``wrt``.
      **kwargs: ``weight=``, ``flush=``, ``emit=`` and the inner
        optimizer's extra arguments, passed to ``tx.update``.

    Returns:
      The updates (exact zeros on a micro-step).
    """
    if not hasattr(nnx, "as_pure"):
      raise RuntimeError(
        "optax_accum.flax.Optimizer needs flax>=0.12.7 (installed"
        f" {flax.__version__}), for `nnx.as_pure`; flax 0.12.7 needs"
        " jax>=0.10. Upgrade flax, or apply with"
        " optax_accum.apply_updates in your own step."
      )
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    opt_state = nnx.as_pure(self.opt_state)
    kwargs = nnx.as_pure(kwargs)
    options = _checks.dropin_options(
      opt_state,
      "Optimizer.update",
      **{k: kwargs.pop(k) for k in ("weight", "flush", "emit") if k in kwargs},
    )
    updates, opt_state = self.tx.update(
      grads, opt_state, params, **options, **kwargs
    )
    nnx.update(model, _apply.apply_updates(params, updates, opt_state))
    nnx.update(self.opt_state, nnx.state(opt_state, graph=self.graph))
    self.step[...] += 1
    return updates

  @property
  def optimizer_step(self) -> jnp.ndarray:
    """The number of updates applied so far (the state's ``step``)."""
    state = _state.find_state(self.opt_state, "optimizer_step")
    return jnp.asarray(state.step)
