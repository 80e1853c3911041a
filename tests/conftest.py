"""Test set-up shared by the whole suite.

Eight simulated CPU devices for the sharding tests (must be set before JAX is
imported), and strict JAX: implicit rank promotion raises.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
