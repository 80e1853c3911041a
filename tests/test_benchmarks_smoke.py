"""Each benchmark script runs end to end at tiny sizes and writes its results
file; every page's tables are the renderer's, from the committed results.

A smoke test, never a timed test: it proves the scripts still run against the
current library (arguments, the JSON they write, the checks they make, the
traffic bench_comm reads from the compiled HLO), not how fast anything is.
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
  "bench_loop": ["--preset", "smoke"],
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
    *("--rounds", "1", "--warmup", "1", "--repeats", "2"),
  ],
}


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
  """Runs each script at most once for the whole module; its JSON."""
  runs = {}

  def run(script):
    if script not in runs:
      out_dir = tmp_path_factory.mktemp(script)
      if script == "bench_loop":  # as benchmarks/gpu.sh runs it, on CPU
        result = _gpu_sh(out_dir)
      else:
        result = _run(script, *SCRIPTS[script], "--out", str(out_dir))
      runs[script] = (result, out_dir)
    result, out_dir = runs[script]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if script == "bench_loop":
      assert sorted(p.name for p in out_dir.iterdir()) == [
        "gpu.log",
        "loop.json",
      ]
      return json.loads((out_dir / "loop.json").read_text())
    assert sorted(p.name for p in out_dir.iterdir()) == [f"{script}.json"]
    return json.loads((out_dir / f"{script}.json").read_text())

  run.folder = lambda script: runs[script][1]  # where the run wrote
  return run


def _gpu_sh(out_dir):
  """benchmarks/gpu.sh's CPU smoke run (bench_loop.py --preset smoke)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable)
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
  return subprocess.run(
    ["bash", str(BENCHMARKS / "gpu.sh"), str(out_dir), "--smoke"],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    check=False,
  )


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_script_records_the_machine(script, run_once):
  payload = run_once(script)
  for field in ("platform", "cpu_count", "jax", "jaxlib", "optax", "backend"):
    assert payload["machine"][field] not in (None, ""), field


def test_bench_loop_times_every_loop_and_checks_its_steps(run_once):
  """Every loop of _loops.VARIANTS ran every round; each of ours and each
  MultiSteps loop made one optimizer step per k calls (bench_loop checks,
  and records what it counted)."""
  payload = run_once("bench_loop")
  assert payload["schema"] == "optax_accum.bench_loop/1"
  assert not payload["failed"], payload["failed"]
  (config,) = payload["configs"]
  rounds, k = payload["args"]["rounds"], config["k"]
  sys.path.insert(0, str(BENCHMARKS))
  try:
    from _loops import VARIANTS  # noqa: PLC0415
  finally:
    sys.path.remove(str(BENCHMARKS))
  assert set(config["variants"]) == set(VARIANTS)
  for name, v in config["variants"].items():
    assert len(v["segment_s"]) == len(v["emit_s"]) == rounds, name
    assert all(t > 0 for t in v["segment_s"]), name
    assert v["footprint"] and v["footprint"] > 0, name
  steps = config["optimizer_steps"]
  assert set(steps) == set(VARIANTS) - {"floor", "big_batch"}
  calls = 2 * k + rounds * (config["cycles_per_segment"] + 1) * k
  assert set(steps.values()) == {calls // k}


def test_gpu_sh_smoke_on_cpu(run_once):
  """benchmarks/gpu.sh's CPU smoke run (the one the tests above read): the
  loop results and its log."""
  payload = run_once("bench_loop")
  assert payload["args"]["preset"] == "smoke" and payload["configs"]
  log = run_once.folder("bench_loop") / "gpu.log"
  assert "gpu.sh: exit 0" in log.read_text()


def test_tiny_call_probe_splits_dispatch_from_the_whole():
  """benchmarks/tiny_call_probe.py (the GPU page's tiny-model reason): each
  loop's seconds per call, dispatched and whole, every round; here in
  another program form (--form, for tiny_variants.py)."""
  result = _run(
    "tiny_call_probe", "--rounds", "2", "--calls", "2", "--k", "2",
    "--form", "one_switch",
  )  # fmt: skip
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  payload = json.loads(result.stdout.strip().splitlines()[-1])
  assert payload["form"] == "one_switch"
  loops = payload["results"]["2"]
  assert sorted(loops) == sorted(
    ["readme", "bare", "static", "multisteps", "floor"]
  )
  for r in loops.values():
    assert len(r["dispatch_s"]) == len(r["total_s"]) == 2
    pairs = zip(r["dispatch_s"], r["total_s"], strict=True)
    assert all(0 < d <= t for d, t in pairs)


def test_tiny_variants_runs_the_probe_under_xla_flags(tmp_path):
  """benchmarks/tiny_variants.py (issue 61's GPU experiment): each variant
  a probe run of its own, with its XLA flags, its output kept."""
  variant = "conditionals, not in command buffers"
  result = _run(
    "tiny_variants", str(tmp_path), "--variants", variant,
    "--rounds", "1", "--calls", "2", "--k", "2",
  )  # fmt: skip
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  saved = json.loads((tmp_path / "tiny_variants.json").read_text())
  assert saved[variant]["form"] == "conditionals"
  assert set(saved[variant]["results"]["2"]) >= {"bare", "multisteps"}
  assert f"{variant}" in result.stdout and "us per call" in result.stdout


def test_bench_rounding_shows_the_bias_of_rounding_to_nearest(tmp_path):
  """benchmarks/bench_rounding.py at a tiny size: swamping loses every small
  gradient rounded to nearest, and about none stochastically."""
  result = _run(
    "bench_rounding", "--ks", "8", "--elements", "4096", "--out", str(tmp_path)
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  payload = json.loads((tmp_path / "bench_rounding.json").read_text())
  by = {(r["case"], r["accumulator"]): r for r in payload["rows"]}
  assert abs(by["swamping", "bfloat16, nearest"]["mean_error"] + 0.8) < 1e-3
  stochastic = by["swamping", "bfloat16, stochastic"]
  assert abs(stochastic["mean_error"]) < 4 * stochastic["standard_error"]
  names = sorted(p.name for p in tmp_path.iterdir())
  assert names == [f"bench_rounding.{x}" for x in ("json", "png")]
  # Its page, from the one renderer.
  table = _render().bench_rounding(payload)
  assert "| swamping | 8 |" in table and "bfloat16, stochastic" in table


def test_bench_comm_counts_deferred_traffic(run_once):
  """Payload per optimizer step grows with k when every micro-batch is
  reduced, and stays at one gradient with `axis_name` (under shard_map or
  plain jit)."""
  report = run_once("bench_comm")
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
  # The same under plain jit with unreduced gradients; every call also
  # all-reduces the helper's 4-byte loss.
  unreduced = rows["jit_unreduced", 3]
  assert unreduced["holding_bytes"] == 0 and unreduced["always_bytes"] <= 8
  assert unreduced["emitting_bytes"] >= grad_bytes
  assert grad_bytes <= unreduced["bytes_per_step"] < grad_bytes + 64


def test_bench_comm_files_sharded_reductions_by_mesh_axis(run_once):
  """On a (2, 2) mesh: FSDP reduces across replicas every call; HSDP only
  within a replica every call and across replicas once, one shard per
  device; 1-D FSDP once, with a full-size accumulator."""
  report = run_once("bench_comm")
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


def test_bench_compiled_on_cpu_writes_its_facts(tmp_path):
  """bench_compiled.py for the CPU target alone (the accelerator targets
  are tests/test_accelerators.py's): every step's facts, and only its
  JSON; on a micro-step, optax_accum.apply_updates is the floor."""
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
  assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_compiled.json"]


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
  assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_plan.json"]


@pytest.mark.parametrize(
  "script", [*SCRIPTS, "bench_compiled", "bench_plan", "render"]
)
def test_help(script):
  result = _run(script, "--help")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "usage:" in result.stdout


def _render():
  spec = importlib.util.spec_from_file_location(
    "render", BENCHMARKS / "render.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_page_is_its_results_files():
  """Every results block of every page (the README, the benchmark page, the
  NNX guide, the HSDP guide, the results pages) matches a fresh rendering;
  every renderer has a block; no figure of the benchmark page or the README
  is typed outside a block."""
  render = _render()
  names = set()
  pages = {p: p.read_text() for p in render.PAGES}
  for path, spec in render.RESULT_PAGES.items():
    assert path.read_text() == render.result_page(*spec), (
      f"{path.name}: stale, run `python benchmarks/render.py`"
    )
    names |= set(spec[1])
  for page, text in pages.items():
    assert render.render(text) == text, (
      f"{page.name} differs from the results files: run"
      " `python benchmarks/render.py`"
    )
    names |= {m.group("name") for m in render.BLOCK.finditer(text)}
  assert names == set(render.SECTIONS)
  for page in (render.PAGES[0], render.PAGES[1]):
    outside = render.BLOCK.sub("", page.read_text())
    outside = re.sub(r"```.*?```", "", outside, flags=re.S)
    typed = re.findall(r"\b\d+\.\d+x\b|\b\d+(?:\.\d+)?x\b", outside)
    assert not typed, f"{page.name}: ratios typed outside blocks: {typed}"


def test_a_changed_figure_is_caught():
  """The check above is not vacuous: a figure edited by hand is found."""
  render = _render()
  text = render.PAGES[1].read_text()
  figures = (
    re.search(r"\| (\d+\.\d\d)", m.group(0))
    for m in render.BLOCK.finditer(text)
  )
  match = next((m for m in figures if m), None)
  assert match, "no figure in any results block"
  edited = text.replace(match.group(0), "| 9" + match.group(1)[1:], 1)
  assert render.render(edited) != edited


def test_losses_and_ties_are_marked_and_explained():
  """A loop that loses or ties is bold in its cell and named in a line
  under its table; a win is plain; both ratios show where they disagree."""
  render = _render()
  config = {
    "size_mb": 64,
    "dtype": "float32",
    "inner": "adam",
    "k": 4,
    "param_bytes": 64 * 2**20,
    "cycles_per_segment": 1,
    "variants": {
      name: {
        "segment_s": seconds,
        "micro_s": [None],
        "emit_s": [1.0],
        "footprint": 1,
        "init_temp": 0,
      }
      for name, seconds in {
        "readme": [1.0, 1.0, 1.0],
        "multisteps": [2.0, 2.1, 1.9],  # a win: 2x
        "nnx_jit": [1.0, 1.0, 1.0],
        "nnx_jit_multisteps": [0.9, 1.1, 1.0],  # a tie
        "linen": [1.0, 1.0, 1.0],
        "linen_multisteps": [0.5, 0.6, 0.4],  # a loss
        # Paired median 1.2x, medians' ratio 0.3x: both shown.
        "equinox": [1.0, 1.0, 4.0, 4.0, 4.0],
        "equinox_multisteps": [1.2, 1.2, 1.0, 9.0, 9.0],
      }.items()
    },
  }
  payload = {
    "machine": {
      "device_kind": "cpu",
      "backend": "cpu",
      "cpu_count": 2,
      "jax": "x",
      "flax": "x",
      "optax": "x",
      "equinox": "x",
      "optax_accum": "x",
      "timestamp": "2026-11-27",
    },
    "args": {"rows": 8, "rounds": 3},
    "configs": [config],
  }
  text = render.loop(payload)
  rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()}
  assert "**" not in rows["jax.jit (README)"]
  assert (
    "tie**" in rows["NNX, nnx.jit"] and "loss**" in rows["linen TrainState"]
  )
  assert "- NNX, nnx.jit (tie): " in text
  # Paths with one reason share its line.
  assert "- linen TrainState (loss); equinox (tie): not explained yet" in text
  assert "1.20x (0.25-2.25); of medians 0.30x, tie" in rows["equinox"]
  assert "of medians" not in rows["NNX, nnx.jit"]
  # A GPU run's reasons are the GPU's, a size's before the path's.
  payload["machine"]["backend"] = "gpu"
  config["size_mb"] = 0.25
  gpu = render.loop(payload)
  assert render.GPU_REASONS["NNX, nnx.jit"] in gpu
  assert render.REASONS["NNX, nnx.jit"] not in gpu
  assert (
    f"linen TrainState (loss); equinox (tie): {render._TINY_ON_A_GPU}" in gpu
  )
