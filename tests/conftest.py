"""Test set-up shared by the whole suite.

Eight simulated CPU devices for the sharding tests, and strict JAX: implicit
rank promotion raises. Both are JAX configuration set before any backend
starts; nothing here edits ``XLA_FLAGS``, so subprocesses the tests start
get the environment they choose (one CPU device unless they say otherwise).
"""

import jax
import pytest
from _common import MODES

NUM_CPU_DEVICES = 8

jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(params=list(MODES), ids=list(MODES))
def maybe_jit(request):
  """Every behaviour runs eagerly and under jit."""
  return MODES[request.param]
