"""Flax drop-ins that apply with :func:`optax_accum.apply_updates`.

Swap one name and keep the rest of the trainer:

* :class:`Optimizer` for ``flax.nnx.Optimizer``: same constructor, same
  ``update(model, grads, **kwargs)``, same ``step`` and ``opt_state``
  fields, the state one Variable (:class:`OptStateTree`) whose every leaf
  Flax's sharding functions (``nnx.get_partition_spec``,
  ``nnx.get_named_sharding``) place as the stock class's;
* :class:`TrainState` for ``flax.training.train_state.TrainState``:
  ``apply_gradients(grads=..., weight=..., flush=..., emit=...)``;
* :func:`local_value_and_grad` for ``nnx.value_and_grad`` on a
  data-parallel mesh: each device's gradient, left unreduced until
  ``accumulate(..., axis_name=...)`` sums it once per cycle.

The stock classes apply with ``optax.apply_updates``, which reads and writes
the params on every call, micro-steps included; these apply with
:func:`optax_accum.apply_updates`, so that a micro-step neither reads nor
writes them. They behave exactly like the stock classes when the optimizer
holds no :func:`optax_accum.accumulate` (accumulation switched off).

Imported only when used: ``import optax_accum`` does not import flax.
"""

from optax_accum.flax._grad import (
  local_value_and_grad as local_value_and_grad,
)
from optax_accum.flax._linen import TrainState as TrainState
from optax_accum.flax._nnx import Optimizer as Optimizer
from optax_accum.flax._nnx import OptStateTree as OptStateTree

__all__ = (
  "OptStateTree",
  "Optimizer",
  "TrainState",
  "local_value_and_grad",
)
