"""The scaling examples run end to end in a subprocess and pass their checks.

Each example compares its params with one big batch on one device and exits
non-zero when they differ, so a zero exit status is the assertion.
"""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

RUNS = {
  "shard_map": ("scaling_shard_map.py", ["--steps", "2", "--every-k", "2"]),
  "fsdp": ("scaling_fsdp.py", ["--steps", "2", "--every-k", "2"]),
  "jit_unreduced": (
    "scaling_jit_unreduced.py",
    ["--steps", "2", "--every-k", "3"],
  ),
  "hsdp": ("scaling_hsdp.py", ["--steps", "1", "--every-k", "2"]),
  "multihost_one_process": ("scaling_multihost.py", ["--steps", "1"]),
  "multihost_two_processes": (
    "scaling_multihost.py",
    ["--spawn", "2", "--steps", "1", "--timeout", "120"],
  ),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_example_runs(name):
  script, args = RUNS[name]
  env = dict(os.environ)
  # The examples choose their own device count (8, or 2 per spawned process).
  env.pop("XLA_FLAGS", None)
  result = subprocess.run(
    [sys.executable, str(EXAMPLES / script), *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=240,
    check=False,
  )
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-4000:]
  assert "max |params - big-batch reference|" in output
  if name == "hsdp":  # the cross-replica all-reduce waits for the cycle
    assert "emitting    replica" in output
  if name == "multihost_two_processes":
    assert "[process 1] process 1: max |params" in output
