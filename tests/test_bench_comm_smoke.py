"""benchmarks/bench_comm.py runs end to end at tiny sizes.

A smoke test, not a timed test: it checks that the script runs against the
current library, writes JSON, Markdown and PNG, and that the traffic it
reads from the compiled HLO has the shape the benchmark is about (payload
per optimizer step grows with k when every micro-batch is reduced, and
stays at one gradient with `axis_name`). Times are not looked at.
"""

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = (
  pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_comm.py"
)


def test_bench_comm_runs_and_counts_deferred_traffic(tmp_path):
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  env["COLUMNS"] = "200"
  result = subprocess.run(
    [
      sys.executable,
      str(SCRIPT),
      "--devices",
      "4",
      "--ks",
      "3",
      "--width",
      "16",
      "--per-device-batch",
      "2",
      "--rounds",
      "1",
      "--warmup",
      "0",
      "--out",
      str(tmp_path),
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  for suffix in ("json", "md", "png"):
    assert (tmp_path / f"bench_comm.{suffix}").stat().st_size > 0
  report = json.loads((tmp_path / "bench_comm.json").read_text())
  assert report["machine"]["jax"] and report["config"]["devices"] == 4
  rows = {(r["recipe"], r["k"]): r for r in report["results"]}
  assert all(r["other_collective_ops"] == 0 for r in rows.values())
  grad_bytes = report["config"]["param_bytes"]
  for recipe in ("gspmd", "psum_each"):
    # Every micro-batch: one gradient's worth, outside any conditional.
    assert rows[recipe, 3]["branch_bytes"] == 0
    assert rows[recipe, 3]["bytes_per_step"] >= 3 * grad_bytes
  # Once per step, inside the emitting branch (+ a few scalars).
  deferred = rows["axis_name", 3]
  assert deferred["always_bytes"] < 64
  assert grad_bytes <= deferred["bytes_per_step"] < grad_bytes + 64
  assert "| axis_name | 3 |" in (tmp_path / "bench_comm.md").read_text()
