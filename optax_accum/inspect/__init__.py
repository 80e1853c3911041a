"""Inspection of compiled train steps: which collectives run, and where.

Imported only when used (``import optax_accum`` does not load the HLO
reader). Everything here reads the program XLA compiled for a step
(``jax.jit(step).lower(*args).compile()``), never runs it.

* :func:`check_step` reports what a user's own jitted train step does on a
  micro-step (donation, the conditional, copies, reductions, memory beyond
  the accumulator) as a :class:`StepReport`; :func:`assert_step` raises
  when that report lists a problem;
* :func:`collectives` lists the cross-device collectives of a compiled step
  (:class:`Collective`: bytes, the branch they sit in, the devices they
  span); :func:`format_collectives` prints them as a table;
* :func:`assert_reduction_deferred` fails when a gradient-sized reduction
  runs on a micro-step.
"""

from optax_accum.inspect._check_step import StepReport as StepReport
from optax_accum.inspect._check_step import assert_step as assert_step
from optax_accum.inspect._check_step import check_step as check_step
from optax_accum.inspect._collectives import Collective as Collective
from optax_accum.inspect._collectives import (
  assert_reduction_deferred as assert_reduction_deferred,
)
from optax_accum.inspect._collectives import collectives as collectives
from optax_accum.inspect._collectives import (
  format_collectives as format_collectives,
)

__all__ = (
  "Collective",
  "StepReport",
  "assert_step",
  "check_step",
  "assert_reduction_deferred",
  "collectives",
  "format_collectives",
)
