"""optax_accum: gradient accumulation for JAX, as an optax transformation."""

# First: importing _versions checks that jax, jaxlib and optax are new
# enough, and raises an ImportError naming the installed and the minimum
# versions before an import below meets an API an older one lacks.
from optax_accum import _versions  # noqa: F401

# isort: split
from optax_accum._accumulate import accumulate as accumulate
from optax_accum._accumulate import inner_for_every_k as inner_for_every_k
from optax_accum._apply import apply_updates as apply_updates
from optax_accum._collectives import Collective as Collective
from optax_accum._collectives import (
  assert_reduction_deferred as assert_reduction_deferred,
)
from optax_accum._collectives import collectives as collectives
from optax_accum._collectives import format_collectives as format_collectives
from optax_accum._every_k import grow_every_k as grow_every_k
from optax_accum._every_k import piecewise_every_k as piecewise_every_k
from optax_accum._layout import add_device_axis as add_device_axis
from optax_accum._layout import drop_device_axis as drop_device_axis
from optax_accum._layout import reduce_state as reduce_state
from optax_accum._layout import shard_map_specs as shard_map_specs
from optax_accum._microbatch import microbatch as microbatch
from optax_accum._noise_scale import NoiseStats as NoiseStats
from optax_accum._noise_scale import noise_scale as noise_scale
from optax_accum._noise_scale import (
  noise_scale_components as noise_scale_components,
)
from optax_accum._sharding import state_shardings as state_shardings
from optax_accum._state import AccumulateState as AccumulateState
from optax_accum._state import GrowState as GrowState
from optax_accum._state import NoiseScaleState as NoiseScaleState
from optax_accum._state import current_every_k as current_every_k
from optax_accum._state import has_updated as has_updated
from optax_accum._state import inner_state as inner_state
from optax_accum._state import weight_seen as weight_seen
from optax_accum._unreduced import local_value_and_grad as local_value_and_grad

__version__ = "0.1.0"

__all__ = (
  "AccumulateState",
  "Collective",
  "GrowState",
  "NoiseScaleState",
  "NoiseStats",
  "accumulate",
  "add_device_axis",
  "apply_updates",
  "assert_reduction_deferred",
  "collectives",
  "current_every_k",
  "drop_device_axis",
  "format_collectives",
  "grow_every_k",
  "has_updated",
  "inner_for_every_k",
  "inner_state",
  "local_value_and_grad",
  "microbatch",
  "noise_scale",
  "noise_scale_components",
  "piecewise_every_k",
  "reduce_state",
  "shard_map_specs",
  "state_shardings",
  "weight_seen",
)
