"""Smoke test of examples/lm/adaptive.py, and the README table it feeds.

The script runs once per module at a tiny size (a 1-layer model of width 16,
13 micro-batches, so that last cycles are partial and must be flushed); the
tests check that it writes what it claims and that every run trained on the
same tokens. The last test checks that the table in examples/lm/README.md is
the one the committed results give.
"""

import importlib
import json
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LM = ROOT / "examples" / "lm"
RESULTS = LM / "results"
# The script imports the demo's modules by name, as `python adaptive.py` does.
_MODULES = (
  "config",
  "input_pipeline",
  "models",
  "checkpointing",
  "train",
  "adaptive_report",
)
TINY = [
  "--budget", "13", "--micro-batch", "2", "--max-len", "32",
  "--d-model", "16", "--num-layers", "1", "--evals", "3",
  "--heldout-samples", "16", "--min-cycles", "2", "--seeds", "0",
  "--k-small", "2", "--k-large", "4", "--k-max", "8",
  "--schedule", "0.3:4",
  # A target far above any estimate: the controller must grow.
  "--scale", "1000",
]  # fmt: skip


def _import(module: str):
  sys.path.insert(0, str(LM))
  try:
    return importlib.import_module(module)
  finally:
    sys.path.remove(str(LM))
    for name in (*_MODULES, "adaptive"):
      sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def adaptive():
  return _import("adaptive")


@pytest.fixture(scope="module")
def adaptive_report():
  """The tables, notes and plot that adaptive.py writes."""
  return _import("adaptive_report")


@pytest.fixture(scope="module")
def evaluation(adaptive, tmp_path_factory):
  out = tmp_path_factory.mktemp("adaptive")
  adaptive.main([*TINY, "--out", str(out)])
  return out, json.loads((out / "results.json").read_text())


def test_writes_results_table_and_plot(evaluation, adaptive):
  out, results = evaluation
  assert set(results) >= {"settings", "machine", "runs", "total_seconds"}
  assert set(results["machine"]) >= {"jax", "optax", "flax", "processor"}
  (by_run,) = results["runs"].values()
  assert list(by_run) == [*adaptive.RUNS, *adaptive.EXTRA_RUNS]
  for r in by_run.values():
    assert set(r) >= {
      "curve",
      "cycles",
      "final_heldout",
      "steps",
      "tokens",
      "tokens_to_target",
      "steps_to_target",
      "train_seconds",
    }
    assert len(r["curve"]) == 1 + 3  # at init, then --evals
    assert all(math.isfinite(p["heldout"]) for p in r["curve"])
  assert (out / "results.md").read_text() == adaptive.report(results) + "\n"
  assert (out / "adaptive.png").stat().st_size > 0


def test_every_run_trains_on_the_same_tokens(evaluation):
  _, results = evaluation
  (by_run,) = results["runs"].values()
  budgets = {r["budget_tokens"] for r in by_run.values()}
  assert len(budgets) == 1
  for r in by_run.values():
    assert r["cycles"][-1]["micro_batches"] == 13
    assert r["tokens"] == r["budget_tokens"]  # the last cycle was flushed


def test_k_follows_each_policy(evaluation):
  _, results = evaluation
  (by_run,) = results["runs"].values()
  ks = {name: [c["k"] for c in r["cycles"]] for name, r in by_run.items()}
  assert set(ks["fixed-small"]) == {2}
  assert set(ks["fixed-large"]) == {4}
  assert by_run["fixed-small"]["steps"] == 7  # the last of 1
  assert by_run["fixed-large"]["steps"] == 4  # the last of 1
  controllers = ["controller", "controller-known-w", "controller-uncoupled"]
  for name in ["schedule", *controllers]:
    assert ks[name] == sorted(ks[name]), name  # never shrinks
    assert ks[name][0] == 2 and ks[name][-1] > 2, name
  for name in controllers:
    assert max(ks[name]) <= 8, name  # --k-max


def test_reaching_the_baseline_is_read_off_the_curve(evaluation):
  _, results = evaluation
  (by_run,) = results["runs"].values()
  target = by_run["fixed-large"]["final_heldout"]
  for r in by_run.values():
    reached = [p for p in r["curve"] if p["heldout"] <= target]
    if reached:
      assert r["tokens_to_target"] == reached[0]["tokens"]
      assert r["steps_to_target"] == reached[0]["steps"]
    else:
      assert r["tokens_to_target"] is None


def test_readme_table_is_the_committed_results(adaptive_report):
  results = json.loads((RESULTS / "results.json").read_text())
  table = adaptive_report.markdown_table(results)
  readme = (LM / "README.md").read_text()
  assert table in readme
  written = (RESULTS / "results.md").read_text()
  assert written == adaptive_report.report(results) + "\n"
  # The other figures the README quotes: the noise scale, every decision of
  # the controllers, the machine, versions, budget and seeds.
  assert adaptive_report.noise_note(results) in readme
  assert adaptive_report.decisions_table(results) in readme
  assert adaptive_report.provenance(results) in readme
