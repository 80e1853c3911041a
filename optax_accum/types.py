"""The records of :func:`optax_accum.accumulate` and its helpers, for
annotations and ``isinstance`` checks.

:class:`AccumulateState` is the state (also at the top level); its ``noise``
field holds a :class:`NoiseScaleState` with ``track_noise_scale=True`` and
its ``grow`` field a :class:`GrowState` with ``every_k=grow_every_k(...)``,
each an ``optax.EmptyState()`` otherwise. :class:`GrowEveryK` is what
:func:`optax_accum.grow_every_k` returns and :class:`InnerForEveryK` what
:func:`optax_accum.inner_for_every_k` returns, each passed on to
``accumulate``. :class:`MicroBatchPlan` (with its :class:`Candidate` rows)
is what :func:`optax_accum.plan_micro_batch` returns.
"""

from optax_accum._every_k import GrowEveryK as GrowEveryK
from optax_accum._every_k import InnerForEveryK as InnerForEveryK
from optax_accum._plan import Candidate as Candidate
from optax_accum._plan import MicroBatchPlan as MicroBatchPlan
from optax_accum._state import AccumulateState as AccumulateState
from optax_accum._state import GrowState as GrowState
from optax_accum._state import NoiseScaleState as NoiseScaleState

__all__ = (
  "AccumulateState",
  "Candidate",
  "GrowEveryK",
  "GrowState",
  "InnerForEveryK",
  "MicroBatchPlan",
  "NoiseScaleState",
)
