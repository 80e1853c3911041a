"""Accumulation across devices: gradients, state layouts and shardings.

``accumulate(..., axis_name=...)`` defers the cross-device reduction to the
end of each cycle. These helpers go with it:

* :func:`local_value_and_grad`: each device's gradient typed unreduced over
  the data axis, under plain ``jax.jit`` (and :class:`NoiseStats`, its
  noise-scale sums);
* :func:`state_shardings`: shardings of an optimizer state that follow the
  params', for ``jit``'s ``out_shardings``;
* :func:`shard_map_specs`, :func:`add_device_axis`,
  :func:`drop_device_axis`: the state's layout in and out of
  ``jax.shard_map``;
* :func:`reduce_state`: a state under plain ``jit`` that a checkpoint can
  hold;
* :func:`regroup_state`: a restored state laid out for the devices that
  resume it, however many wrote it.
"""

from optax_accum._noise_scale import NoiseStats as NoiseStats
from optax_accum.distributed._layout import add_device_axis as add_device_axis
from optax_accum.distributed._layout import (
  drop_device_axis as drop_device_axis,
)
from optax_accum.distributed._layout import reduce_state as reduce_state
from optax_accum.distributed._layout import regroup_state as regroup_state
from optax_accum.distributed._layout import shard_map_specs as shard_map_specs
from optax_accum.distributed._local_grad import (
  local_value_and_grad as local_value_and_grad,
)
from optax_accum.distributed._sharding import (
  state_shardings as state_shardings,
)

__all__ = (
  "NoiseStats",
  "add_device_axis",
  "drop_device_axis",
  "local_value_and_grad",
  "reduce_state",
  "regroup_state",
  "shard_map_specs",
  "state_shardings",
)
