"""``optax_accum.flax.TrainState``: linen's ``TrainState`` applying with
:func:`optax_accum.apply_updates`."""

from typing import Any

from flax.training import train_state

from optax_accum import _apply


class TrainState(train_state.TrainState):
  """A drop-in for ``flax.training.train_state.TrainState``.

  ``create`` and the fields are the stock class's; ``apply_gradients`` also
  takes :func:`optax_accum.accumulate`'s ``weight=``, ``flush=`` and
  ``emit=``, and applies the updates with :func:`optax_accum.apply_updates`
  (a micro-step neither reads nor writes the params). Other keyword
  arguments replace fields, as in the stock class. Jit the step with the
  state donated (``jax.jit(step, donate_argnums=0)``).

  ``step`` counts ``apply_gradients`` calls (micro-batches);
  ``optax_accum.has_updated(state.opt_state)`` says whether the last call
  applied an update.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
    >>> state = optax_accum.flax.TrainState.create(
    ...   apply_fn=None, params={"w": jnp.zeros(2)}, tx=tx)
    >>> for w in (1.0, 3.0):
    ...   state = state.apply_gradients(grads={"w": jnp.ones(2)}, weight=w)
    >>> print(int(state.step), state.params["w"])
    2 [-1. -1.]
  """

  def apply_gradients(
    self,
    *,
    grads: Any,
    weight: Any = None,
    flush: Any = False,
    emit: bool | None = None,
    **kwargs: Any,
  ) -> "TrainState":
    options = {"flush": flush, "emit": emit}
    if weight is not None:
      options["weight"] = weight
    updates, opt_state = self.tx.update(
      grads, self.opt_state, self.params, **options
    )
    return self.replace(
      step=self.step + 1,
      params=_apply.apply_updates(self.params, updates, opt_state),
      opt_state=opt_state,
      **kwargs,
    )
