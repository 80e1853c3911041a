"""optax_accum: gradient accumulation for JAX, as an optax transformation.

The top level holds what a train step uses; the rest sits in namespaces:

* :mod:`optax_accum.distributed`: gradients, state layouts and shardings
  for ``accumulate(..., axis_name=...)`` across devices;
* :mod:`optax_accum.inspect`: what a compiled step runs (collectives, the
  reduction deferred), imported only when used;
* :mod:`optax_accum.flax`: drop-ins for ``nnx.Optimizer`` and linen's
  ``TrainState`` (imports flax when used);
* :mod:`optax_accum.multisteps`: coming from ``optax.MultiSteps``;
* :mod:`optax_accum.upgrade`: checkpoints of earlier versions;
* :mod:`optax_accum.types`: the state records, and what
  ``grow_every_k``, ``inner_for_every_k`` and ``plan_micro_batch`` return;
* :mod:`optax_accum.targets`: accelerators to compile for without one.
"""

import importlib
import warnings

# First: importing _versions checks that jax, jaxlib and optax are new
# enough, and raises an ImportError naming the installed and the minimum
# versions before an import below meets an API an older one lacks.
from optax_accum import _versions  # noqa: F401

# isort: split
from optax_accum._accumulate import accumulate as accumulate
from optax_accum._apply import apply_updates as apply_updates
from optax_accum._every_k import grow_every_k as grow_every_k
from optax_accum._every_k import inner_for_every_k as inner_for_every_k
from optax_accum._every_k import piecewise_every_k as piecewise_every_k
from optax_accum._microbatch import microbatch as microbatch
from optax_accum._noise_scale import noise_scale as noise_scale
from optax_accum._noise_scale import (
  noise_scale_components as noise_scale_components,
)
from optax_accum._plan import plan_micro_batch as plan_micro_batch
from optax_accum._state import AccumulateState as AccumulateState
from optax_accum._state import current_every_k as current_every_k
from optax_accum._state import has_updated as has_updated
from optax_accum._state import inner_state as inner_state
from optax_accum._state import weight_seen as weight_seen

__version__ = "0.3.0"

__all__ = (
  "AccumulateState",
  "accumulate",
  "apply_updates",
  "current_every_k",
  "grow_every_k",
  "has_updated",
  "inner_for_every_k",
  "inner_state",
  "microbatch",
  "noise_scale",
  "noise_scale_components",
  "piecewise_every_k",
  "plan_micro_batch",
  "weight_seen",
)

# Names that were top-level in 0.1 and now live in a namespace: they keep
# working, with a DeprecationWarning, until 0.4 (0.3 changed the state
# layout; one breaking change a release).
_MOVED = {
  "Collective": "optax_accum.inspect",
  "assert_reduction_deferred": "optax_accum.inspect",
  "collectives": "optax_accum.inspect",
  "format_collectives": "optax_accum.inspect",
  "NoiseStats": "optax_accum.distributed",
  "add_device_axis": "optax_accum.distributed",
  "drop_device_axis": "optax_accum.distributed",
  "local_value_and_grad": "optax_accum.distributed",
  "reduce_state": "optax_accum.distributed",
  "shard_map_specs": "optax_accum.distributed",
  "state_shardings": "optax_accum.distributed",
  "GrowState": "optax_accum.types",
  "NoiseScaleState": "optax_accum.types",
}


# Namespaces imported on first use, so that `import optax_accum` stays light
# (no HLO reader, no flax) while `optax_accum.inspect.collectives` works.
_NAMESPACES = (
  "distributed",
  "flax",
  "inspect",
  "multisteps",
  "targets",
  "types",
  "upgrade",
)


def __getattr__(name: str):
  if name in _NAMESPACES:
    return importlib.import_module(f"optax_accum.{name}")
  module = _MOVED.get(name)
  if module is None:
    raise AttributeError(f"module 'optax_accum' has no attribute '{name}'")
  warnings.warn(
    f"`optax_accum.{name}` moved to `{module}.{name}` in 0.2; the old name"
    " will be removed in 0.4.",
    DeprecationWarning,
    stacklevel=2,
  )
  return getattr(importlib.import_module(module), name)
