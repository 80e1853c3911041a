"""Each benchmark script runs end to end at tiny sizes and writes its outputs.

A smoke test, never a timed test: it proves the scripts still run against the
current library (arguments, JSON/Markdown/PNG outputs, the checks they
print, the traffic bench_comm reads from the compiled HLO), not how fast
anything is. And the figures of benchmarks/README.md are the ones rendered
from the committed results files.
"""

import importlib.util
import json
import os
import pathlib
import re
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
    "--check-k",
    "2",
    "--check-steps",
    "2",
    "--memory-budget-mb",
    "4",
  ],
  "bench_comm": [
    "--devices",
    "4",
    "--ks",
    "3",
    "--width",
    "16",
    "--per-device-batch",
    "2",
    "--sharded-targets",
    "cpu",
    "--sharded-width",
    "64",
  ],
  "bench_flax_mesh": ["--width", "64", "--layers", "1", "--k", "2"],
}
# Every script: the fewest rounds, two repeats (so spreads have a range).
RUN = ["--rounds", "1", "--warmup", "0", "--repeats", "2"]


def _run(script, *args):
  env = dict(os.environ)
  # The least LLVM optimisation: compiling is most of a tiny run's time.
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
  env["COLUMNS"] = "100"
  return subprocess.run(
    [sys.executable, str(BENCHMARKS / f"{script}.py"), *args],
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
      result = _run(script, *SCRIPTS[script], *RUN, "--out", str(out_dir))
      runs[script] = (result, out_dir)
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
  assert payload["args"]["repeats"] == 2
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
      "accumulate+apply",
      "accumulate+static",
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


def test_bench_step_records_the_spread_over_repeats(run_once):
  payload = json.loads((run_once("bench_step") / "bench_step.json").read_text())
  r = next(r for r in payload["results"] if r["k"] == 2)
  s = r["spread"]["ratios"]["micro_vs_floor"]
  assert len(s["values"]) == 2 and s["min"] <= s["median"] <= s["max"]
  assert s["median"] == pytest.approx(r["ratios"]["micro_vs_floor"])


def test_bench_comm_counts_deferred_traffic(run_once):
  """Payload per optimizer step grows with k when every micro-batch is
  reduced, and stays at one gradient with `axis_name` (under shard_map or
  plain jit)."""
  out = run_once("bench_comm")
  report = json.loads((out / "bench_comm.json").read_text())
  assert report["config"]["devices"] == 4
  rows = {(r["recipe"], r["k"]): r for r in report["results"]}
  assert all(r["other_collective_ops"] == 0 for r in rows.values())
  grad_bytes = report["config"]["param_bytes"]
  for recipe in ("gspmd", "psum_each"):
    # Every micro-batch: one gradient's worth, outside any conditional.
    assert rows[recipe, 3]["emitting_bytes"] == 0
    assert rows[recipe, 3]["bytes_per_step"] >= 3 * grad_bytes
  # Once per step, inside the emitting branch (+ a few scalars).
  deferred = rows["axis_name", 3]
  assert deferred["always_bytes"] < 64 and deferred["holding_bytes"] == 0
  assert grad_bytes <= deferred["bytes_per_step"] < grad_bytes + 64
  assert len(deferred["step_ms"]["values"]) == 2
  assert "| axis_name | 3 |" in (out / "bench_comm.md").read_text()
  # The same under plain jit with unreduced gradients; every call also
  # all-reduces the helper's 4-byte loss.
  unreduced = rows["jit_unreduced", 3]
  assert unreduced["holding_bytes"] == 0 and unreduced["always_bytes"] <= 8
  assert unreduced["emitting_bytes"] >= grad_bytes
  assert grad_bytes <= unreduced["bytes_per_step"] < grad_bytes + 64


def test_bench_flax_mesh_defers_the_reduction_of_the_recipe(run_once):
  """Read from the compiled steps: only the guide's recipe all-reduces
  nothing parameter-sized on every call; it copies nothing parameter-sized
  and needs no more temporary memory than MultiSteps."""
  out = run_once("bench_flax_mesh")
  by_devices = json.loads((out / "bench_flax_mesh.json").read_text())["results"]
  assert set(by_devices) == {"1", "2"}
  results = by_devices["2"]
  param_bytes = results["MultiSteps"]["param_bytes"]
  for name in ("MultiSteps", "drop-in"):
    assert results[name]["all_reduced_every_call"] >= param_bytes
  for name in ("drop-in+deferred", "hand-written"):
    recipe = results[name]
    assert recipe["all_reduced_every_call"] < 64, name  # the loss, its weight
    assert recipe["copies"] == 0, name
    assert recipe["temp_bytes"] <= results["MultiSteps"]["temp_bytes"], name
    assert len(recipe["speedup"]["values"]) == 2
  # One device: nothing parameter-sized reduced (a 1-device mesh keeps the
  # deferred recipe's scalar all-reduce), and the drop-in copies nothing.
  for name, row in by_devices["1"].items():
    assert row["all_reduced_every_call"] < 64, name
  assert by_devices["1"]["drop-in"]["copies"] == 0


def test_bench_comm_files_sharded_reductions_by_mesh_axis(run_once):
  """On a (2, 2) mesh: FSDP reduces across replicas every call; HSDP only
  within a replica every call and across replicas once, one shard per
  device; 1-D FSDP once, with a full-size accumulator."""
  report = json.loads((run_once("bench_comm") / "bench_comm.json").read_text())
  rows = {(r["layout"], r["wire"]): r for r in report["sharded"]}
  assert set(rows) == {
    ("fsdp", "f32"),
    ("fsdp1d", "f32"),
    ("fsdp1d", "bf16"),
    ("hsdp", "f32"),
    ("hsdp", "bf16"),
  }
  param_bytes = rows["hsdp", "f32"]["param_bytes"]
  fsdp, hsdp, fsdp1d = (
    rows["fsdp", "f32"],
    rows["hsdp", "f32"],
    rows["fsdp1d", "f32"],
  )
  assert "replica + fsdp" in fsdp["reduced_every_call"]
  assert not fsdp["reduced_once"]
  assert set(hsdp["reduced_every_call"]) == {"fsdp"}
  assert hsdp["reduced_once"] == {"replica": param_bytes // 2}
  assert hsdp["accumulator_bytes_per_device"] == param_bytes // 2
  assert fsdp1d["reduced_once"] == {"data": param_bytes}
  assert fsdp1d["accumulator_bytes_per_device"] == param_bytes
  # k = 3: the per-call reductions count three times, the deferred once.
  per_step = hsdp["reduced_per_step"]["3"]
  assert per_step["replica"] == param_bytes // 2
  assert per_step["fsdp"] == 3 * hsdp["reduced_every_call"]["fsdp"]
  assert (
    "## Sharded params"
    in (run_once("bench_comm") / "bench_comm.md").read_text()
  )


def test_bench_compiled_on_cpu_writes_its_facts(tmp_path):
  """bench_compiled.py for the CPU target alone (the accelerator targets
  are tests/test_accelerators.py's): every step's facts, the Markdown and
  the figure; on a micro-step, optax_accum.apply_updates is the floor."""
  result = _run(
    "bench_compiled",
    *("--targets", "cpu", "--width", "64", "--layers", "2"),
    *("--batch", "2", "--dtypes", "f32", "--out", str(tmp_path)),
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  payload = json.loads((tmp_path / "bench_compiled.json").read_text())
  rows = {r["name"]: r for r in payload["rows"]}
  floor = rows["cpu-floor-local-f32"]["bytes"]["micro-step"]
  ours = rows["cpu-accumulate-local-f32-accum-traced"]
  assert ours["conditionals"] >= 1 and not ours["adam_every_call"]
  # On CPU the add selects against leftovers of the last cycle
  # (`_cycle_start` in optax_accum/_accumulate.py), fused into it; bounded
  # as loosely as when it cost one more read and write of the accumulator.
  acc_bytes = 4 * 2 * 64 * 64  # two float32 64x64 layers
  assert ours["bytes"]["micro-step"] <= 1.05 * floor + 2 * acc_bytes
  assert rows["cpu-MultiSteps-local-f32"]["adam_every_call"]
  for suffix in ("md", "png"):
    assert (tmp_path / f"bench_compiled.{suffix}").stat().st_size > 0


def test_bench_plan_on_cpu_finds_the_true_largest(tmp_path):
  """bench_plan.py for the CPU alone (the H100's plans are
  tests/test_plan.py's): the planner's choice is the largest candidate
  that fits, found by compiling every one, within the compile bound."""
  result = _run(
    "bench_plan",
    *("--models", "mlp", "--targets", "cpu", "--repeats", "1"),
    *("--out", str(tmp_path)),
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  (row,) = json.loads((tmp_path / "bench_plan.json").read_text())["rows"]
  assert row["micro_batch"] == row["true_micro_batch"] > 0
  assert row["micro_batch"] * row["every_k"] == row["global_batch"]
  assert row["compiles"] <= row["bound"]
  assert row["compiles"] < row["all_compiles"]
  for suffix in ("md", "png"):
    assert (tmp_path / f"bench_plan.{suffix}").stat().st_size > 0


@pytest.mark.parametrize(
  "script", [*SCRIPTS, "bench_compiled", "bench_plan", "render_readme"]
)
def test_help(script):
  result = _run(script, "--help")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "usage:" in result.stdout


def _render_readme():
  spec = importlib.util.spec_from_file_location(
    "render_readme", BENCHMARKS / "render_readme.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_readme_figures_are_the_results_files():
  """Every figure in benchmarks/README.md is rendered from
  benchmarks/results/*.json: the blocks match a fresh rendering, and no
  decimal number appears outside them."""
  render = _render_readme()
  names = set()
  for page in render.PAGES:
    text = page.read_text()
    assert render.render(text) == text, (
      f"{page.name} differs from the results files: run"
      " `python benchmarks/render_readme.py`"
    )
    names |= {m.group("name") for m in render.BLOCK.finditer(text)}
  assert names == set(render.RENDERERS)
  text = render.README.read_text()
  outside = render.BLOCK.sub("", text)
  # Code blocks hold commands, not figures.
  outside = re.sub(r"```.*?```", "", outside, flags=re.S)
  typed = re.findall(r"\b\d+\.\d+x?\b|\b\d+(?:\.\d+)?x\b", outside)
  assert not typed, f"figures typed by hand outside results blocks: {typed}"


def test_readme_render_catches_a_changed_figure(tmp_path):
  """The check above is not vacuous: a figure edited by hand is found."""
  render = _render_readme()
  text = render.README.read_text()
  figures = (
    re.search(r"\| (\d+\.\d\d) ", m.group(0))
    for m in render.BLOCK.finditer(text)
  )
  match = next((m for m in figures if m), None)
  assert match, "no figure in any results block"
  edited = text.replace(match.group(0), "| 9" + match.group(1)[1:] + " ", 1)
  assert render.render(edited) != edited
