"""benchmarks/gpu.sh, the one-run GPU measurement, runs on CPU and keeps its
promises: the outputs a GPU run will leave (flat names, few small files), the
fields and ratios of its JSON, a Markdown page rendered from the JSON alone,
errors and budget skips recorded rather than fatal, and the per-variant
device peak attributed correctly (against a fake allocator: CPUs have no
memory counters). Never a timed test: no assertion reads a time.
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MiB = 2**20


@pytest.fixture(scope="module")
def bench_gpu():
  """The script's module (benchmarks/ holds scripts, not a package).

  Its ``_common`` is benchmarks/_common.py, not the tests' own module of
  that name: the tests' is set aside while the script imports, then put
  back (the script keeps the names it imported).
  """
  tests_common = sys.modules.pop("_common", None)
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import bench_gpu
  finally:
    sys.path.remove(str(BENCHMARKS))
    sys.modules.pop("_common", None)
    if tests_common is not None:
      sys.modules["_common"] = tests_common
  return bench_gpu


# The smoke run's step configurations: both inners in both dtypes at the
# smallest size. `--smoke`'s second adam size (0.25 MB) runs the same code
# at another shape; the fakes below hold the selection and the budget on
# all six (a third of the run's compiles saved).
SMOKE_ONLY = "*:*:0.0625"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  """`JAX_PLATFORMS=cpu benchmarks/gpu.sh OUT --smoke --only SMOKE_ONLY`,
  once."""
  out = tmp_path_factory.mktemp("gpu")
  env = dict(os.environ)
  env.update(
    JAX_PLATFORMS="cpu",
    PYTHON=sys.executable,
    # The least LLVM optimisation: compiling is most of a tiny run's time.
    XLA_FLAGS="--xla_backend_optimization_level=0",
    GPU_SH_TIMEOUT="1500",  # the hard stop, against a hang only
  )
  result = subprocess.run(
    ["bash", str(BENCHMARKS / "gpu.sh"), str(out), "--smoke"]
    # No budget to skip by: on a busy machine the seconds run out, and what
    # is held here is that every section ran (the budget's own test is
    # test_a_tight_budget_skips_and_says_so).
    + ["--only", SMOKE_ONLY, "--budget-s", "1e9"],
    capture_output=True,
    text=True,
    env=env,
    timeout=1600,
    check=False,
  )
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
  return out, result.stdout


def test_outputs_are_few_small_flat_files(smoke):
  out, _ = smoke
  names = sorted(p.name for p in out.iterdir())
  assert names == [
    "bench_gpu.json",
    "bench_gpu.log",
    "bench_gpu.md",
    "bench_gpu.png",
  ]
  for path in out.iterdir():
    assert path.is_file() and 0 < path.stat().st_size < 16 * MiB
    assert re.fullmatch(r"[A-Za-z0-9._-]+", path.name)
  assert (out / "bench_gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_run_prints_progress_and_its_estimate(smoke):
  out, stdout = smoke
  log = (out / "bench_gpu.log").read_text()
  assert re.search(r"estimate ~\d+ s \(.*step programs x", log)
  assert "step adam float32 0.0625 MB" in log
  assert "LM tiny k=8" in log
  assert "# bench_gpu" in stdout  # the page, printed at the end


def test_json_records_the_machine_and_a_complete_run(smoke):
  payload = json.loads((smoke[0] / "bench_gpu.json").read_text())
  machine = payload["machine"]
  assert machine["backend"] == "cpu"
  for field in ("device_kind", "jax", "jaxlib", "optax", "flax", "python"):
    assert machine[field], field
  assert payload["complete"] is True
  assert payload["errors"] == [] and payload["skipped"] == []
  assert payload["estimate"]["compiles"] == 4 * 8
  assert payload["estimate"]["total_s"] > 0


def test_every_configuration_has_every_variant_and_ratio(smoke, bench_gpu):
  payload = json.loads((smoke[0] / "bench_gpu.json").read_text())
  configs = [
    (r["optimizer"], r["dtype"], r["size_mb"]) for r in payload["step"]
  ]
  assert configs == [
    ("adam", "float32", 0.0625),
    ("adam", "bfloat16", 0.0625),
    ("clip_adamw", "float32", 0.0625),
    ("clip_adamw", "bfloat16", 0.0625),
  ]
  for r in payload["step"]:
    # Each traced cycle, static cycle and NNX cycle ended with an update.
    assert r["emitted"] == {"ours": True, "static": True, "nnx": True}
    assert r["rounds"] >= 3
    assert set(r["times_ms"]) == set(bench_gpu.VARIANTS)
    for name in ("ours", "static", "nnx", "MultiSteps", "plain"):
      ratio = r["ratios"]["micro_vs_floor"][name]
      assert ratio["median"] > 0 and ratio["min"] <= ratio["max"], name
      assert ratio["q1"] <= ratio["median"] <= ratio["q3"], name
    for key in ("multisteps_vs_ours_micro", "multisteps_vs_ours_per_call"):
      assert r["ratios"][key]["median"] > 0
    for name in ("ours", "static", "nnx", "MultiSteps"):
      assert r["ratios"]["emit_vs_plain"][name]["median"] > 0
    compiled = r["memory_ratios"]["compiled"]
    # The accumulator is extra memory the floor has too, MultiSteps more.
    assert compiled["vs_floor"]["floor"] == 1.0
    assert compiled["ours_vs_multisteps"] > 0
    floor = r["memory"]["floor"]["compiled"]["footprint"]
    assert floor >= 2 * r["param_bytes"]  # params + accumulator at least
    # No memory counters on CPU: recorded as such, not guessed.
    assert r["memory"]["ours"]["device_peak"] is None
    assert r["memory_ratios"]["device_peak"]["ours_vs_multisteps"] is None


def test_lm_tokens_per_second_at_k_1_and_8(smoke):
  payload = json.loads((smoke[0] / "bench_gpu.json").read_text())
  lm = payload["lm"]
  assert [(e["model"], e["k"]) for e in lm] == [("tiny", 1), ("tiny", 8)]
  rounds = payload["args"]["lm_rounds"] * payload["args"]["lm_steps"]
  for e in lm:
    for name in ("ours", "MultiSteps"):
      assert e[name]["tokens_per_s"]["median"] > 0
    assert e["ours_vs_multisteps"]["median"] > 0
    # Two warm-up steps and the timed ones, each ending with an update.
    assert e["optimizer_steps_ours"] == 2 + rounds


def test_render_from_the_json_alone_gives_the_same_page(smoke, tmp_path):
  out, _ = smoke
  result = subprocess.run(
    [
      sys.executable,
      str(BENCHMARKS / "bench_gpu.py"),
      "--render",
      str(out / "bench_gpu.json"),
      "--out",
      str(tmp_path),
    ],
    capture_output=True,
    text=True,
    env={**os.environ, "PYTHONPATH": str(ROOT)},
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  page = (tmp_path / "bench_gpu.md").read_text()
  assert page == (out / "bench_gpu.md").read_text()
  assert "| adam, bfloat16, 0.0625 MB |" in page
  assert "## LM demo: tokens/s" in page
  assert (tmp_path / "bench_gpu.png").stat().st_size > 0


def test_help(bench_gpu, capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench_gpu.parse_args(["--help"])
  assert exit_info.value.code == 0
  assert "--budget-s" in capsys.readouterr().out


# --- Guards: a failing section is recorded, a tight budget skips. ----------


def test_a_failing_configuration_is_recorded_and_the_run_goes_on(
  bench_gpu, monkeypatch, tmp_path
):
  calls = []

  def measure_config(optimizer, dtype, size_mb, *args):
    calls.append((optimizer, dtype, size_mb))
    if size_mb == 0.0625:
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory (planted)")
    return {"planted": True}

  monkeypatch.setattr(bench_gpu, "measure_config", measure_config)
  monkeypatch.setattr(bench_gpu, "measure_lm", lambda *a: [])
  monkeypatch.setattr(bench_gpu, "render", lambda *a: [])
  assert bench_gpu.main(["--smoke", "--out", str(tmp_path)]) == 0
  payload = json.loads((tmp_path / "bench_gpu.json").read_text())
  assert len(calls) == 6  # every configuration was tried
  assert payload["complete"] is True
  errors = [e["where"] for e in payload["errors"]]
  assert errors == [
    "step adam float32 0.0625 MB",
    "step adam bfloat16 0.0625 MB",
    "step clip_adamw float32 0.0625 MB",
    "step clip_adamw bfloat16 0.0625 MB",
  ]
  assert "RESOURCE_EXHAUSTED" in payload["step"][0]["error"]
  assert payload["step"][2].pop("released")["arrays_deleted"] == 0
  assert payload["step"][2] == {
    "optimizer": "adam",
    "dtype": "float32",
    "size_mb": 0.25,
    "planted": True,
  }
  page = bench_gpu.render_markdown(payload)
  assert "error in step adam float32 0.0625 MB: RuntimeError" in page


def test_a_tight_budget_skips_and_says_so(bench_gpu, monkeypatch, tmp_path):
  monkeypatch.setattr(bench_gpu, "render", lambda *a: [])
  args = ["--smoke", "--budget-s", "1", "--out", str(tmp_path)]
  assert bench_gpu.main(args) == 0
  payload = json.loads((tmp_path / "bench_gpu.json").read_text())
  assert payload["step"] == [] and payload["errors"] == []
  assert len(payload["skipped"]) == 6
  assert all(s["why"].startswith("budget:") for s in payload["skipped"])
  assert [e["skipped"][:7] for e in payload["lm"]] == ["budget:"] * 2
  assert "skipped LM tiny k=8: budget" in bench_gpu.render_markdown(payload)


# --- The device peak, against a fake allocator. ----------------------------


class FakeDevice:
  """Bytes in use and their peak, as a GPU allocator counts them."""

  def __init__(self, in_use: int, peak: int, limit: int = 76 * 2**30):
    self.in_use, self.peak, self.limit = in_use, peak, limit

  def stats(self):
    return {
      "bytes_in_use": self.in_use,
      "peak_bytes_in_use": self.peak,
      "bytes_limit": self.limit,
    }

  def allocate(self, nbytes: int) -> "Held":
    self.in_use += nbytes
    self.peak = max(self.peak, self.in_use)
    return Held(self, nbytes)


class Held:
  def __init__(self, device, nbytes):
    self.device, self.nbytes = device, nbytes

  def __del__(self):
    self.device.in_use -= self.nbytes


class FakeStepper:
  """A variant holding `state` bytes whose calls need `temp` more."""

  def __init__(self, device, state, temp):
    self.device, self.temp = device, temp
    self.held = device.allocate(state)

  def call(self, emit):
    del emit
    scratch = self.device.allocate(self.temp)
    del scratch

  def block(self):
    pass

  def emitted(self):
    return True


class FakeVariants:
  k = 4

  def __init__(self, device, state, temp, footprint):
    self.device, self.state, self.temp = device, state, temp
    self.memory = {"ours": {"footprint": footprint}, "nnx": None}

  def build(self, name):
    return FakeStepper(self.device, self.state, self.temp)


GiB = 2**30
# (earlier peak, bytes in use, variant's state, its temporaries, compiled
# footprint, the peak to attribute: None where it sets no new high).
PROBES = [
  # Under an earlier, higher peak (the usual case): found by the ballast.
  (40 * GiB, 1 * GiB, 6 * GiB, 2 * GiB, 8 * GiB, 8 * GiB),
  # The compiled footprint overestimates a little: still found.
  (40 * GiB, 1 * GiB, 6 * GiB, 1 * GiB, 7 * GiB + 200 * MiB, 7 * GiB),
  # A fresh process (no earlier peak): no ballast needed.
  (1 * GiB, 1 * GiB, 3 * GiB, 1 * GiB, 4 * GiB, 4 * GiB),
  # Far below its compiled footprint: not attributable, so not reported.
  (40 * GiB, 1 * GiB, 1 * GiB, 0, 8 * GiB, None),
]


@pytest.mark.parametrize(
  "peak, in_use, state, temp, footprint, expected",
  PROBES,
  ids=["under-an-earlier-peak", "overestimated", "fresh", "far-below"],
)
@pytest.mark.parametrize("name", ["ours", "nnx"])  # nnx: ours' footprint
def test_probe_attributes_the_variants_own_peak(
  bench_gpu, monkeypatch, peak, in_use, state, temp, footprint, expected, name
):
  device = FakeDevice(in_use, peak)
  monkeypatch.setattr(bench_gpu, "device_memory", device.stats)
  monkeypatch.setattr(
    bench_gpu, "allocate_ballast", lambda n: [device.allocate(n)]
  )
  variants = FakeVariants(device, state, temp, footprint)
  out = bench_gpu.probe_memory(variants, name)
  assert out["device_peak"] == expected
  assert out["attributable"] is (expected is not None)
  assert out["resident"] == state  # the state outlives the cycle
  assert device.in_use == in_use  # ballast and variant freed
  # The ballast lifts the peak by no more than the margin (no runaway
  # peaks over many probes).
  margin = max(footprint // 16, 16 * MiB)
  assert device.peak <= max(peak, in_use + state + temp) + margin


def test_probe_records_a_ballast_that_does_not_fit(bench_gpu, monkeypatch):
  device = FakeDevice(1 * GiB, 40 * GiB)

  def allocate_ballast(nbytes):
    raise RuntimeError("RESOURCE_EXHAUSTED (planted)")

  monkeypatch.setattr(bench_gpu, "device_memory", device.stats)
  monkeypatch.setattr(bench_gpu, "allocate_ballast", allocate_ballast)
  variants = FakeVariants(device, 6 * GiB, 2 * GiB, 8 * GiB)
  out = bench_gpu.probe_memory(variants, "ours")
  assert "RESOURCE_EXHAUSTED" in out["ballast_error"]
  assert out["device_peak"] is None and out["attributable"] is False


def test_spread_has_the_quartiles(bench_gpu):
  s = bench_gpu.spread([4.0, 1.0, None, 3.0, 2.0])
  assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 4.0, 4)
  assert math.isclose(s["q1"], 1.75) and math.isclose(s["q3"], 3.25)
  assert bench_gpu.paired([2.0, 6.0], [1.0, 2.0])["median"] == 2.5


def test_a_run_cut_short_renders_what_it_finished(smoke, bench_gpu):
  """What a timeout leaves (the JSON as last saved) still renders."""
  payload = json.loads((smoke[0] / "bench_gpu.json").read_text())
  payload["complete"] = False
  del payload["elapsed_s"]
  payload["step"].append(
    {"optimizer": "adam", "dtype": "float32", "size_mb": 2048.0, "k": 8}
  )
  payload["lm"].append({"model": "gpu", "k": 8})
  page = bench_gpu.render_markdown(payload)
  assert "INCOMPLETE" in page
  assert "- step adam float32 2048 MB: did not finish" in page
  assert "- LM gpu k=8: did not finish" in page
  assert "| adam, float32, 0.0625 MB |" in page  # the finished ones stay
  bench_gpu.render_figure(payload)


def test_probe_never_fills_the_device(bench_gpu, monkeypatch):
  """A peak near the limit (the interleaved timing of a large
  configuration) would need a ballast that does not fit: none is taken, the
  reason is recorded, and the device stays under its limit less margin."""
  device = FakeDevice(1 * GiB, 74 * GiB, limit=76 * GiB)
  monkeypatch.setattr(bench_gpu, "device_memory", device.stats)
  monkeypatch.setattr(
    bench_gpu, "allocate_ballast", lambda n: [device.allocate(n)]
  )
  variants = FakeVariants(device, 2 * GiB, 1 * GiB, 3 * GiB)
  out = bench_gpu.probe_memory(variants, "ours")
  assert out["ballast"] == 0 and "MiB free" in out["no_ballast"]
  assert out["device_peak"] is None  # no new high: not attributed
  assert device.peak == 74 * GiB and device.in_use == 1 * GiB
  # Just under the cap, it is taken: the peak stays under limit - margin.
  device = FakeDevice(1 * GiB, 66 * GiB, limit=76 * GiB)
  monkeypatch.setattr(bench_gpu, "device_memory", device.stats)
  variants = FakeVariants(device, 2 * GiB, 1 * GiB, 3 * GiB)
  out = bench_gpu.probe_memory(variants, "ours")
  assert out["ballast"] > 60 * GiB and "no_ballast" not in out
  assert out["device_peak"] == 3 * GiB
  assert device.peak <= 76 * GiB - bench_gpu.safety_margin(76 * GiB)


def fake_config(calls, leak=None):
  def measure_config(optimizer, dtype, size_mb, *args):
    calls.append((optimizer, dtype, size_mb))
    if leak is not None:  # an array a failed configuration's frames hold
      leak.append(jnp.ones((1024,)))
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory (planted)")
    return {"planted": True}

  return measure_config


def test_only_and_no_lm_select_what_runs(bench_gpu, monkeypatch, tmp_path):
  calls = []
  monkeypatch.setattr(bench_gpu, "measure_config", fake_config(calls))
  monkeypatch.setattr(bench_gpu, "measure_lm", None)  # must not be called
  monkeypatch.setattr(bench_gpu, "render", lambda *a: [])
  only = "adam:bfloat16:0.25,clip_adamw:*:0.0625"
  argv = ["--smoke", "--only", only, "--no-lm", "--out", str(tmp_path)]
  assert bench_gpu.main(argv) == 0
  assert calls == [
    ("adam", "bfloat16", 0.25),
    ("clip_adamw", "float32", 0.0625),
    ("clip_adamw", "bfloat16", 0.0625),
  ]
  payload = json.loads((tmp_path / "bench_gpu.json").read_text())
  assert payload["errors"] == [] and payload["lm"] == []
  assert "lm" not in payload["sections"]
  assert payload["estimate"]["compiles"] == 3 * 8
  assert payload["estimate"]["lm_compiles"] == 0


def test_error_path_frees_what_the_configuration_left(
  bench_gpu, monkeypatch, tmp_path
):
  kept = jnp.ones((8,))  # alive before the run: left alone
  calls, leak = [], []
  monkeypatch.setattr(bench_gpu, "measure_config", fake_config(calls, leak))
  monkeypatch.setattr(bench_gpu, "render", lambda *a: [])
  argv = ["--smoke", "--only", "adam:*:0.0625", "--no-lm"]
  assert bench_gpu.main([*argv, "--out", str(tmp_path)]) == 0
  payload = json.loads((tmp_path / "bench_gpu.json").read_text())
  assert len(payload["errors"]) == 2 and len(leak) == 2
  assert all(a.is_deleted() for a in leak)
  assert not kept.is_deleted()
  for r in payload["step"]:
    assert r["released"]["arrays_deleted"] >= 1
    assert r["released"]["bytes_in_use"] is None  # CPU: no counters


def test_a_timing_that_does_not_fit_is_skipped_before_allocating(
  bench_gpu, monkeypatch, tmp_path
):
  """All six variants' arguments must fit the free bytes (limit less
  margin), checked after compiling, before any state is built for it."""
  limit = bench_gpu.safety_margin(0) + 4 * MiB  # room for ~4 MiB
  stats = {"bytes_in_use": 0, "peak_bytes_in_use": 0, "bytes_limit": limit}
  monkeypatch.setattr(bench_gpu, "device_memory", lambda: dict(stats))

  def time_cycle(*a):
    raise AssertionError("timed a configuration that does not fit")

  monkeypatch.setattr(bench_gpu, "time_cycle", time_cycle)
  monkeypatch.setattr(bench_gpu, "render", lambda *a: [])
  argv = ["--smoke", "--no-memory-probe", "--no-lm", "--out", str(tmp_path)]
  assert bench_gpu.main([*argv, "--only", "adam:float32:0.25"]) == 0
  payload = json.loads((tmp_path / "bench_gpu.json").read_text())
  assert payload["errors"] == []
  (large,) = payload["step"]
  need = bench_gpu.timing_bytes(
    {n: m["compiled"] for n, m in large["memory"].items()}
  )
  assert need > 4 * MiB and "times_ms" not in large
  assert large["skipped"].startswith("memory: six variants alive need")
  page = bench_gpu.render_markdown(payload)
  assert "- skipped step adam float32 0.25 MB: memory:" in page
  assert "did not finish" not in page


def test_render_merges_runs(smoke, bench_gpu, tmp_path):
  """A second, short run fills the first run's gaps: its configurations
  replace the failed ones in place, the rest stay, and each run is named."""
  first = json.loads((smoke[0] / "bench_gpu.json").read_text())
  fixed = first["step"][1]  # adam bfloat16 0.0625
  second = {
    **first,
    "step": [fixed],
    "lm": [],
    "skipped": [],
    "errors": [],
    "machine": {**first["machine"], "jax": "9.9.9"},
    "elapsed_s": 12.0,
  }
  first["step"][1] = {k: fixed[k] for k in ("optimizer", "dtype", "size_mb")}
  first["step"][1]["error"] = "RESOURCE_EXHAUSTED (planted)"
  where = "step adam bfloat16 0.0625 MB"
  first["errors"] = [{"where": where, "error": "RESOURCE_EXHAUSTED"}]
  paths = [tmp_path / "a.json", tmp_path / "b.json"]
  for path, payload in zip(paths, (first, second), strict=True):
    path.write_text(json.dumps(payload))
  argv = ["--render", *map(str, paths), "--out", str(tmp_path / "page")]
  assert bench_gpu.main(argv) == 0
  page = (tmp_path / "page" / "bench_gpu.md").read_text()
  rows = re.findall(r"^\| (adam|clip_adamw), (\w+), ([\d.]+) MB \|", page, re.M)
  assert rows[:4] == [
    ("adam", "float32", "0.0625"),
    ("adam", "bfloat16", "0.0625"),
    ("clip_adamw", "float32", "0.0625"),
    ("clip_adamw", "bfloat16", "0.0625"),
  ]
  assert "RESOURCE_EXHAUSTED" not in page and "## Skipped" not in page
  assert "| tiny (d=32" in page  # the first run's LM stays
  assert "Merged from 2 runs" in page and "THEY DIFFER" in page
  assert "jax 9.9.9" in page and f"jax {first['machine']['jax']}" in page
  assert "- run 2: " in page and "12 s of" in page
