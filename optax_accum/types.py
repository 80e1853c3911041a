"""The state records of :func:`optax_accum.accumulate`, for annotations and
``isinstance`` checks.

:class:`AccumulateState` is the state (also at the top level); its ``noise``
field holds a :class:`NoiseScaleState` with ``track_noise_scale=True`` and
its ``grow`` field a :class:`GrowState` with ``every_k=grow_every_k(...)``,
each an ``optax.EmptyState()`` otherwise.
"""

from optax_accum._state import AccumulateState as AccumulateState
from optax_accum._state import GrowState as GrowState
from optax_accum._state import NoiseScaleState as NoiseScaleState

__all__ = ("AccumulateState", "GrowState", "NoiseScaleState")
