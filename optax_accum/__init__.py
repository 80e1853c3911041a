"""optax_accum: gradient accumulation for JAX, as an optax transformation."""

from optax_accum._accumulate import accumulate as accumulate
from optax_accum._microbatch import microbatch as microbatch
from optax_accum._noise_scale import noise_scale as noise_scale
from optax_accum._noise_scale import (
  noise_scale_components as noise_scale_components,
)
from optax_accum._sharding import state_shardings as state_shardings
from optax_accum._state import AccumulateState as AccumulateState
from optax_accum._state import has_updated as has_updated

__version__ = "0.1.0"

__all__ = (
  "AccumulateState",
  "accumulate",
  "has_updated",
  "microbatch",
  "noise_scale",
  "noise_scale_components",
  "state_shardings",
)
