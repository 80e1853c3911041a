"""Smoke tests of the LM demo (examples/lm/) at tiny sizes.

The demo runs once per module through its command line (a tiny model, a few
steps); the tests then check what it claims: the weighted run matches the big
batch, the unweighted one does not, the mid-cycle Orbax resume is bitwise,
and bad checkpoints fail with a clear error.
"""

import dataclasses
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = [
  "--no-plan",  # tested apart: test_the_demo_plans_its_model
  "--steps",
  "4",
  "--every-k",
  "3",
  "--micro-batch",
  "2",
  "--max-len",
  "64",
  "--d-model",
  "16",
  "--num-layers",
  "1",
  "--warmup-steps",
  "1",
]


LM = ROOT / "examples" / "lm"
# The demo's modules import each other by name, as `python main.py` does.
_LM_MODULES = (
  "config",
  "input_pipeline",
  "models",
  "checkpointing",
  "train",
  "report",
  "planning",
  "main",
  "accumulator_dtype",
)


def import_lm() -> types.SimpleNamespace:
  """The demo's modules, imported as `examples/lm/main.py` imports them.

  Their generic names (`train`, `main`, ...) leave `sys.modules` and
  `sys.path` again, so nothing else in the test session can pick them up.
  """
  sys.path.insert(0, str(LM))
  try:
    modules = {name: importlib.import_module(name) for name in _LM_MODULES}
  finally:
    sys.path.remove(str(LM))
    for name in _LM_MODULES:
      sys.modules.pop(name, None)
  return types.SimpleNamespace(
    pipeline=modules["input_pipeline"],
    ckpt=modules["checkpointing"],
    train=modules["train"],
    main=modules["main"],
    planning=modules["planning"],
    accumulator_dtype=modules["accumulator_dtype"],
  )


@pytest.fixture(scope="module")
def lm():
  return import_lm()


@pytest.fixture(scope="module")
def demo(lm, tmp_path_factory):
  out = tmp_path_factory.mktemp("demo_out")
  summary = lm.main.main([*TINY, "--out", str(out)])
  return out, summary


@pytest.fixture(scope="module")
def tiny_cfg(lm):
  cfg, _ = lm.main.parse_args(TINY)
  return cfg


def test_weighted_accumulation_matches_the_big_batch(demo, lm):
  _, summary = demo
  weighted = summary["runs"]["weighted"]
  assert summary["weighted_matches_reference"]
  # float32 rounding only: a batch of 6 versus three batches of 2.
  assert weighted["max_abs_dloss"] <= lm.train.LOSS_ATOL
  assert weighted["max_abs_dparams"] <= lm.train.PARAMS_ATOL


def test_unweighted_accumulation_differs_from_the_big_batch(demo):
  _, summary = demo
  weighted = summary["runs"]["weighted"]
  unweighted = summary["runs"]["unweighted"]
  assert summary["unweighted_overweight_max"] > 1  # micro-batches are uneven
  # Not rounding: orders of magnitude beyond the weighted run's difference.
  assert unweighted["max_abs_dparams"] > 1e-4
  assert unweighted["max_abs_dparams"] > 100 * weighted["max_abs_dparams"]
  assert unweighted["max_abs_dloss"] > 10 * weighted["max_abs_dloss"]


def test_resume_mid_cycle_is_bitwise_identical(demo):
  _, summary = demo
  resume = summary["resume_check"]
  assert resume["bitwise_identical"]
  assert resume["micro_step_at_save"] == 1  # saved mid-cycle (k = 3)


def test_demo_writes_plot_and_results(demo):
  out, summary = demo
  assert (out / "loss_curves.png").stat().st_size > 0
  assert json.loads((out / "results.json").read_text()) == summary
  for run in summary["runs"].values():
    assert np.isfinite(run["final_loss"]) and np.isfinite(run["heldout_loss"])


def test_weighted_run_reports_a_noise_scale(demo):
  _, summary = demo
  assert summary["noise_scale_tokens"] is not None


def test_no_resume_check_flag(lm):
  _, args = lm.main.parse_args([*TINY, "--no-resume-check"])
  assert args.resume_check is False
  _, args = lm.main.parse_args(TINY)
  assert args.resume_check is True


@pytest.mark.parametrize("flag", ["--steps", "--every-k", "--micro-batch"])
def test_nonpositive_sizes_are_rejected(lm, flag):
  with pytest.raises(SystemExit):
    lm.main.parse_args([flag, "0"])


def test_data_is_deterministic_and_variable_length(lm, tiny_cfg):
  a, b = lm.pipeline.load_data(tiny_cfg), lm.pipeline.load_data(tiny_cfg)
  np.testing.assert_array_equal(a.train.tokens, b.train.tokens)
  uneven = False
  for step in range(tiny_cfg.steps):
    batch = lm.pipeline.step_batch(tiny_cfg, a.train, step)
    counts = [
      int(np.sum(m.lengths - 1))
      for m in lm.pipeline.micro_batches(tiny_cfg, batch)
    ]
    assert counts == sorted(counts)  # shortest micro-batch first
    uneven |= counts[0] < counts[-1]
  assert uneven


# ---------------------------------------------------------------------------
# Checkpoint errors.
# ---------------------------------------------------------------------------


@pytest.fixture
def saved(lm, tiny_cfg, tmp_path):
  model, optimizer = lm.train.build(tiny_cfg, "weighted")
  path = tmp_path / "ckpt"
  lm.ckpt.save_checkpoint(path, tiny_cfg, "weighted", model, optimizer)
  return path


def test_restore_round_trip(lm, tiny_cfg, saved):
  model, optimizer = lm.train.build(tiny_cfg, "weighted")
  lm.ckpt.restore_checkpoint(saved, tiny_cfg, "weighted", model, optimizer)


def test_missing_checkpoint_is_a_clear_error(lm, tiny_cfg, tmp_path):
  model, optimizer = lm.train.build(tiny_cfg, "weighted")
  with pytest.raises(lm.ckpt.CheckpointError, match="is missing or corrupt"):
    lm.ckpt.restore_checkpoint(
      tmp_path / "nothing", tiny_cfg, "weighted", model, optimizer
    )


@pytest.mark.parametrize(
  "change", [{"every_k": 4}, {"d_model": 32}, {"seed": 1}]
)
def test_other_configuration_names_the_fields(lm, tiny_cfg, saved, change):
  cfg = dataclasses.replace(tiny_cfg, **change)
  model, optimizer = lm.train.build(cfg, "weighted")
  (field,) = change
  with pytest.raises(lm.ckpt.CheckpointError, match=f"`{field}` saved"):
    lm.ckpt.restore_checkpoint(saved, cfg, "weighted", model, optimizer)


def test_other_mode_is_rejected(lm, tiny_cfg, saved):
  model, optimizer = lm.train.build(tiny_cfg, "unweighted")
  with pytest.raises(lm.ckpt.CheckpointError, match="`mode` saved 'weighted'"):
    lm.ckpt.restore_checkpoint(saved, tiny_cfg, "unweighted", model, optimizer)


def test_state_of_another_shape_is_a_clear_error(lm, tiny_cfg, saved):
  # A config that claims d_model=32 over state saved with 16: only the
  # arrays can tell.
  cfg = dataclasses.replace(tiny_cfg, d_model=32)
  config_file = saved / "config" / "metadata"
  meta = json.loads(config_file.read_text())
  config_file.write_text(json.dumps({**meta, "d_model": 32}))
  model, optimizer = lm.train.build(cfg, "weighted")
  message = (
    r"does not fit.*has shape \(16,\) float32 in the checkpoint,"
    r" this model expects shape \(32,\) float32"
  )
  with pytest.raises(lm.ckpt.CheckpointError, match=message):
    lm.ckpt.restore_checkpoint(saved, cfg, "weighted", model, optimizer)


_CORRUPT_ARRAYS = """
import pathlib, sys
root, tmp = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
sys.path.insert(0, str(root / "examples" / "lm"))
import checkpointing, main, train
cfg, _ = main.parse_args(sys.argv[3:])
model, optimizer = train.build(cfg, "weighted")
checkpointing.save_checkpoint(tmp / "ckpt", cfg, "weighted", model, optimizer)
data_files = [p for p in (tmp / "ckpt" / "state").rglob("*")
              if p.is_file() and p.parent.name == "d"]
assert data_files
for path in data_files:  # metadata intact, array data overwritten
  path.write_bytes(b"not a checkpoint")
try:
  checkpointing.restore_checkpoint(tmp / "ckpt", cfg, "weighted", model, optimizer)
except checkpointing.CheckpointError as e:
  print("CheckpointError:", e)
"""


def test_corrupt_arrays_are_a_clear_error(tmp_path):
  # In a subprocess: when TensorStore reads fail, Orbax 0.12.8 leaves reads
  # pending on an event loop it has already closed; their callbacks raise
  # later, as "unraisable" exceptions that pytest pins on whatever test runs
  # next. The error the demo raises is all this checks.
  result = subprocess.run(
    [sys.executable, "-c", _CORRUPT_ARRAYS, str(ROOT), str(tmp_path), *TINY],
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "CheckpointError: The checkpoint at" in result.stdout
  assert "corrupt" in result.stdout


def test_corrupt_metadata_is_a_clear_error(lm, tiny_cfg, saved):
  for path in (saved / "state").rglob("*"):
    if path.is_file():
      path.write_bytes(b"not a checkpoint")
  model, optimizer = lm.train.build(tiny_cfg, "weighted")
  with pytest.raises(lm.ckpt.CheckpointError, match="is missing or corrupt"):
    lm.ckpt.restore_checkpoint(saved, tiny_cfg, "weighted", model, optimizer)


def test_truncated_checkpoint_is_a_clear_error(lm, tiny_cfg, saved):
  shutil.rmtree(saved / "state")
  model, optimizer = lm.train.build(tiny_cfg, "weighted")
  with pytest.raises(lm.ckpt.CheckpointError, match="is missing or corrupt"):
    lm.ckpt.restore_checkpoint(saved, tiny_cfg, "weighted", model, optimizer)


def test_wire_dtype_bfloat16_changes_the_run_a_little(tmp_path):
  """examples/lm/wire_dtype.py at a tiny size (4 devices): the bfloat16 wire gives
  other params than the float32 wire (so `reduce_dtype` reaches the
  reduction), close to them, and a nearby held-out loss."""
  result = subprocess.run(
    [
      sys.executable,
      str(LM / "wire_dtype.py"),
      *("--steps", "2", "--every-k", "2", "--micro-batch", "8"),
      *("--max-len", "64", "--d-model", "16", "--num-layers", "1"),
      *("--seeds", "0", "--devices", "4", "--out", str(tmp_path)),
    ],
    capture_output=True,
    text=True,
    cwd=LM,
    # The least LLVM optimisation: compiling is most of a tiny run's time
    # (as tests/test_benchmarks_smoke.py runs the benchmarks).
    env={**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0"},
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  payload = json.loads((tmp_path / "wire_dtype.json").read_text())
  (row,) = payload["seeds"]
  assert 0 < row["max_abs_params_diff"] < 1e-2
  assert abs(row["heldout"]["bfloat16"] - row["heldout"]["float32"]) < 1e-2
  assert "| 0 |" in (tmp_path / "wire_dtype.md").read_text()


def test_accumulator_dtype_runs_each_accumulator_from_one_start(lm, tmp_path):
  """examples/lm/accumulator_dtype.py at a tiny size: each accumulator's
  run from the same initialization on the same data, close to the float32
  run and not equal to it (the accumulator's dtype reaches the add), its
  table and its plot."""
  payload = lm.accumulator_dtype.main(
    [*("--steps", "2", "--ks", "2", "--seeds", "0", "--max-len", "32"),
     *("--d-model", "16", "--num-layers", "1", "--heldout-samples", "16"),
     *("--out", str(tmp_path))]
  )  # fmt: skip
  runs = payload["runs"]["2"]
  assert list(runs) == list(lm.accumulator_dtype.ACCUMULATORS)
  first = {name: r[0]["losses"][0] for name, r in runs.items()}
  assert len(set(first.values())) == 1  # the same start
  f32 = runs["float32"][0]["heldout"]
  for name in ("bfloat16, nearest", "bfloat16, stochastic"):
    assert 0 < abs(runs[name][0]["heldout"] - f32) < 1e-3, name
  names = sorted(p.name for p in tmp_path.iterdir())
  assert names == [f"accumulator_dtype.{x}" for x in ("json", "md", "png")]


def test_the_demo_plans_its_model(lm, tiny_cfg):
  """The plan `make demo` prints, here for this machine and a small batch
  (the H100's runs in the docs' accelerator block and tests/test_plan.py)."""
  plan = lm.planning.plan(tiny_cfg, None, 256)
  assert plan.micro_batch * plan.every_k == 256
  assert plan.limit_bytes == lm.planning.physical_memory()
  assert plan.peak_bytes <= plan.budget_bytes
  assert "plan for this machine" in str(plan)
