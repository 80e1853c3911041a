"""Each benchmark script runs end to end at tiny sizes and writes its outputs.

A smoke test, never a timed test: it proves the scripts still run against the
current library (arguments, JSON/Markdown/PNG outputs, the checks they
print), not how fast anything is.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

# Tiny configurations: each run takes seconds.
SCRIPTS = {
  "bench_step": [
    "--sizes-mb",
    "0.0625",
    "--ks",
    "1,2",
    "--optimizers",
    "adam",
    "--dtypes",
    "float32",
    "--rounds",
    "2",
    "--warmup",
    "1",
  ],
  "bench_train": [
    "--ks",
    "2",
    "--micro-batch",
    "2",
    "--seq-len",
    "8",
    "--vocab",
    "32",
    "--d-model",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--d-ff",
    "32",
    "--rounds",
    "1",
    "--warmup",
    "1",
    "--check-k",
    "2",
    "--check-steps",
    "2",
    "--memory-budget-mb",
    "4",
  ],
}


def _run(script, out_dir):
  env = dict(os.environ)
  # Not the suite's 8 simulated devices (conftest.py); and the least LLVM
  # optimisation, since compiling is most of a tiny run's time.
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
  env["COLUMNS"] = "200"
  return subprocess.run(
    [
      sys.executable,
      str(BENCHMARKS / f"{script}.py"),
      *SCRIPTS[script],
      "--out",
      str(out_dir),
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    check=False,
  )


@pytest.fixture(scope="module")
def run_once(tmp_path_factory):
  """Runs each script at most once for the whole module."""
  runs = {}

  def run(script):
    if script not in runs:
      out_dir = tmp_path_factory.mktemp(script)
      runs[script] = (_run(script, out_dir), out_dir)
    result, out_dir = runs[script]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out_dir

  return run


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_script_runs_and_writes_json_markdown_png(script, run_once):
  tmp_path = run_once(script)
  for suffix in ("json", "md", "png"):
    path = tmp_path / f"{script}.{suffix}"
    assert path.is_file() and path.stat().st_size > 0, f"missing {path.name}"
  payload = json.loads((tmp_path / f"{script}.json").read_text())
  for field in (
    "platform",
    "cpu_count",
    "jax",
    "jaxlib",
    "optax",
    "backend",
    "device_kind",
  ):
    assert payload["machine"][field] not in (None, ""), field
  assert (tmp_path / f"{script}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_step_reports_every_variant_and_target(run_once):
  tmp_path = run_once("bench_step")
  payload = json.loads((tmp_path / "bench_step.json").read_text())
  by_k = {r["k"]: r for r in payload["results"]}
  assert set(by_k) == {1, 2}
  for r in by_k.values():
    assert set(r["variants"]) == {
      "floor",
      "plain",
      "accumulate",
      "accumulate+noise",
      "MultiSteps",
      "apply_every",
    }
    for v in r["variants"].values():
      assert v["memory"]["footprint"] > 0 and v["emit_ms"] > 0
  # Micro-step targets exist only when a cycle has micro-steps.
  assert "micro_vs_floor" not in by_k[1]["checks"]
  assert set(by_k[2]["checks"]) == set(payload["targets"])
  assert all(isinstance(c["pass"], bool) for c in by_k[2]["checks"].values())
  markdown = (tmp_path / "bench_step.md").read_text()
  assert "PASS" in markdown or "FAIL" in markdown


def test_bench_train_checks_equivalence_with_the_big_batch(run_once):
  tmp_path = run_once("bench_train")
  payload = json.loads((tmp_path / "bench_train.json").read_text())
  eq = payload["equivalence"]
  # Same data, same maths: accumulated training matches the big batch.
  assert eq["accumulate"]["pass"], eq
  assert [r["k"] for r in payload["throughput"]] == [2]
  assert (
    payload["memory_budget"]["accumulate"]["effective_batch"]
    >= (payload["memory_budget"]["big batch"]["effective_batch"])
  )
