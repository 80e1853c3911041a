"""Every benchmark table a user reads, from the results files alone.

One renderer for the pages (``PAGES``: the README, this folder's
``README.md``, the NNX guide) and the results pages next to the JSON
(``results/*.md``): a block between ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->`` is rewritten by ``SECTIONS[NAME]`` from its
results file (``SOURCES``). Every row a script measured is shown, losses and
ties included, with the reason for a loss where it is known (``REASONS``);
where the paired ratio and the ratio of medians disagree, both are shown.
``tests/test_benchmarks_smoke.py`` fails when a page and its results
disagree.

Usage::

  python benchmarks/render.py          # rewrite the pages
  python benchmarks/render.py --check  # exit 1 if one is stale
"""

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
from _paths import PAIRS, REFERENCES  # noqa: E402  (this folder's)

ROOT = HERE.parent
RESULTS = HERE / "results"
MB = 2**20

BLOCK = re.compile(
  r"(<!-- results:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)",
  re.S,
)


def _header(text: str) -> list[str]:
  """A table's header from ``"a | b | c"``."""
  return [x.strip() for x in text.split(" | ")]


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _spread(s: dict[str, Any] | None, digits: int = 2, suffix: str = "") -> str:
  """``median (min-max)`` of a spread record (``values`` or ``n``)."""
  if not s or s.get("median") is None:
    return "not measured"
  text = f"{s['median']:.{digits}f}{suffix}"
  if s.get("n", len(s.get("values", ()))) > 1:
    text += f" ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
  return text


# ----------------------------------------------------------------------------
# The whole loop (bench_loop.py, results/loop.json).
# ----------------------------------------------------------------------------

PAIRS_BY_PATH = {path: (ours, peer) for path, ours, peer in PAIRS}
# Why ours loses or ties on a path, as far as measured (the closing notes
# of issues 51 and 52 give the measurements).
REASONS = {
  "jax.jit (README)": (
    "where it ties, at k=1 on the tiny model: every call of both loops"
    " runs the optimizer, and a call is bound by the host, whose noise"
    " scatters the rounds across 1."
  ),
  "NNX, nnx.jit": (
    "`nnx.jit` walks the model and the optimizer in Python on every call"
    " (flax's graph traversal): at a small model that is the loop. The"
    " drop-in's state is one Variable since issue 61, where"
    " `nnx.Optimizer(MultiSteps)` keeps one per leaf."
  ),
  "jax.jit, emit=": (
    "at the tiny model, where a call is bound by the host. At k=1 every call"
    " of both loops runs the optimizer: three CPU runs measured 0.99x"
    " (2026-11-27), 0.99x (2026-11-29 01:15) and 0.93x (rounds 0.92-0.98,"
    " 02:40), a few per cent of host work a call more than MultiSteps', not"
    " isolated further. At k=2 rounds fall below 1 now and then: one of"
    " five at 0.95 (01:15); two of five at 0.63 and 0.67 in this table's"
    " run (09:47), whose other rounds were 1.30-1.49, where the same"
    " configuration rerun alone right after (7 rounds,"
    " `bench_loop.py --only 0.25:float32:adam:2`) gave 1.01-1.30, median"
    " 1.24: the shared 2-core box's noise, as far as measured."
  ),
}
# The same, on a GPU (``gpu.sh``; the closing note of issue 52).
_TINY_ON_A_GPU = (
  "at the tiny model only, where every loop is bound by the host: in"
  " `benchmarks/tiny_call_probe.py` on the same H200"
  " (`results/gpu/2026-11-27-tiny-probe/`, 7 rounds of 1,000 calls) each"
  " call is done on the device by the time the next is dispatched, and the"
  " dispatch takes 83-84 µs a call for our traced step (bare), 74-78 µs for"
  " `optax.MultiSteps`' and 75-78 µs for our `emit=` step (medians; the"
  " floor: 72 µs). Compiled for an H100 at the same size"
  " (`tools/tiny_step_kernels.py`), the traced step is 19 kernels, a copy"
  " and two conditionals (CUDA-graph conditional nodes), MultiSteps' 26"
  " kernels and 2 copies (XLA turns its conditional into selects), the"
  " `emit=` step has no conditional: the conditionals are the difference"
  " known, not isolated further. The rounds of one loop scatter up to 3x."
  " Since these runs (issue 61), a GPU program of a state below 1 MiB"
  " decides with selects, as MultiSteps' does (`SELECTS_BELOW_BYTES` in"
  " `optax_accum/_control.py`): compiled for an H100 the tiny traced step"
  " is 18 kernels, 3 small copies and no conditional. Not yet re-timed on"
  " a GPU: `benchmarks/tiny_variants.py` is the prepared experiment (the"
  " probe under each program form and command-buffer setting)."
)
# A key "path@size" (the table's model, as headed) before "path".
GPU_REASONS = {
  "jax.jit (README)@tiny": _TINY_ON_A_GPU,
  "jax.jit, emit=@tiny": _TINY_ON_A_GPU,
  "NNX, nnx.jit_partial@tiny": _TINY_ON_A_GPU,
  "linen TrainState@tiny": _TINY_ON_A_GPU,
  "equinox@tiny": _TINY_ON_A_GPU,
  "NNX, nnx.jit_partial": (
    "the fast form's own host cost, 0.13-0.18 ms a call at the tiny model"
    " for ours and MultiSteps' alike, is about the device's step at 64 MB"
    " (0.19-0.28 ms a call), so both loops wait on the host; at 512 MB it"
    " is 1.49x (bfloat16) and 2.42x (float32)."
  ),
  "NNX, nnx.jit": (
    "`nnx.jit` costs both loops 0.9-1.5 ms a call more than"
    " `nnx.jit_partial(..., graph=False)` at every size measured (tiny,"
    " 64 MB, 512 MB): flax's graph traversal in Python, on the host. Up to"
    " 512 MB of float32 params that is longer than the device's step, so"
    " both loops wait on the host: a tie. With bfloat16 params, or with the"
    " fast form, ours is 1.1-2.4x. These runs predate the drop-in's"
    " one-Variable state (issue 61), which halves the CPU walk."
  ),
}


def _ratio(config: dict, ours: str, peer: str) -> dict[str, Any] | None:
  """Ours' throughput over the peer's: paired by round, and of medians."""
  v = config["variants"]
  if ours not in v or peer not in v:
    return None
  a, b = v[ours]["segment_s"], v[peer]["segment_s"]
  paired = [tb / ta for ta, tb in zip(a, b, strict=True)]
  return {
    "median": statistics.median(paired),
    "min": min(paired),
    "max": max(paired),
    "values": paired,
    "of_medians": statistics.median(b) / statistics.median(a),
  }


def verdict(r: dict[str, Any]) -> str:
  """``"win"``, ``"tie"`` (the rounds' ratios straddle 1) or ``"loss"``."""
  if r["min"] <= 1.0 <= r["max"]:
    return "tie"
  return "win" if r["median"] > 1 else "loss"


def _cell(r: dict[str, Any] | None, marked: bool = True) -> str:
  """A ratio with its spread; `marked`: a tie or a loss in bold."""
  if r is None:
    return "not run"
  text = _spread(r, suffix="x")
  # The ratio of the medians, where it disagrees with the paired one:
  # outside the rounds' range, or on the other side of 1.
  of = r["of_medians"]
  if not r["min"] <= of <= r["max"] or (of - 1) * (r["median"] - 1) < 0:
    text += f"; of medians {of:.2f}x"
  mark = verdict(r)
  return text if mark == "win" or not marked else f"**{text}, {mark}**"


def _loop_machine(payload: dict[str, Any]) -> str:
  m, a = payload["machine"], payload["args"]
  device = (
    m["device_kind"] if m["backend"] != "cpu" else f"{m['cpu_count']} CPUs"
  )
  return (
    f"Timed on {device} ({m['backend']}), jax {m['jax']}, flax {m['flax']},"
    f" optax {m['optax']}, equinox {m['equinox']}, optax_accum"
    f" {m['optax_accum']}, {m['timestamp'][:10]}; {a['rows']} rows per"
    f" micro-batch, {a['rounds']} interleaved rounds; median (min-max) of"
    " the ratios paired by round."
  )


def _size(config: dict) -> str:
  return f"{config['size_mb']:g} MB" if config["size_mb"] >= 1 else "tiny"


def _groups(payload: dict) -> dict[tuple, list[dict]]:
  out: dict[tuple, list[dict]] = {}
  for c in payload["configs"]:
    key = (c["size_mb"], c["dtype"], c["inner"])
    out.setdefault(key, []).append(c)
  return out


def _losses(
  rows: list[tuple[str, dict | None]],
  reasons: dict[str, str] = REASONS,
  size: str = "",
) -> str:
  """One line per reason for the paths that lose or tie somewhere (a
  reason for ``path@size`` before one for ``path``)."""
  seen = {}
  for path, r in rows:
    if r is not None and verdict(r) != "win":
      seen.setdefault(path, set()).add(verdict(r))
  by_reason: dict[str, list[str]] = {}  # paths that share a reason: one line
  for path, v in seen.items():
    reason = reasons.get(f"{path}@{size}") or reasons.get(
      path, "not explained yet: see the JSON's rounds."
    )
    by_reason.setdefault(reason, []).append(
      f"{path} ({' and '.join(sorted(v))})"
    )
  lines = [
    f"- {'; '.join(paths)}: {reason}" for reason, paths in by_reason.items()
  ]
  return ("\n" + "\n".join(lines) + "\n") if lines else ""


def loop(payload: dict[str, Any]) -> str:
  """Every path at every measured k, per model: ours / peer throughput."""
  parts = [_loop_machine(payload) + "\n"]
  gpu = payload["machine"]["backend"] == "gpu"
  reasons = GPU_REASONS if gpu else REASONS
  for (_, dtype, inner), configs in _groups(payload).items():
    configs = sorted(configs, key=lambda c: c["k"])
    first = configs[0]
    parts.append(
      f"\n{_size(first)}, {first['param_bytes'] / MB:.2f} MiB of {dtype}"
      f" params, {inner}; examples/s, ours / the loop it replaces (the last"
      " rows: references, unmarked):\n\n"
    )
    rows, seen = [], []
    for path, ours, peer in PAIRS + REFERENCES:
      cells = [_ratio(c, ours, peer) for c in configs]
      if all(x is None for x in cells):
        continue
      pair = path in PAIRS_BY_PATH  # references are not marked
      rows.append([path, *(_cell(x, pair) for x in cells)])
      seen += [(path, x) for x in cells]
    parts.append(_table(["path", *[f"k={c['k']}" for c in configs]], rows))
    losses = [s for s in seen if s[0] in PAIRS_BY_PATH]
    parts.append(_losses(losses, reasons, _size(first)))
  for failed in payload.get("failed", []):
    parts.append(f"\n{failed['config']}: failed (see the JSON).\n")
  if payload.get("not_run"):
    parts.append(f"\nNot run (budget): {', '.join(payload['not_run'])}.\n")
  return "".join(parts)


def _each_run(render_one: Callable[[dict[str, Any]], str]):
  """A block of every ``gpu.sh`` run in ``results/gpu/*/loop.json``, each
  rendered by `render_one`, one after the other (a run's rounds are
  seconds apart; runs are minutes apart)."""

  def block(runs: dict[str, dict[str, Any]]) -> str:
    return "\n".join(
      f"Run {i} of {len(runs)} (`results/gpu/{folder}/loop.json`, started"
      f" {payload['machine']['timestamp'][11:16]} UTC):\n\n"
      + render_one(payload)
      for i, (folder, payload) in enumerate(sorted(runs.items()), 1)
    )

  return block


def _mib(nbytes: int | None, digits: int) -> str:
  return "not measured" if nbytes is None else f"{nbytes / MB:.{digits}f}"


def loop_steps(payload: dict[str, Any]) -> str:
  """Each loop's micro-step, emitting step and memory, per configuration."""
  rows = []
  for c in payload["configs"]:
    for name, v in sorted(c["variants"].items()):
      micro = [x for x in v["micro_s"] if x is not None]
      micro = (
        "one call a cycle"
        if name == "big_batch"
        else f"{statistics.median(micro) * 1e3:.3f}"
        if micro
        else "k=1: none"
      )
      rows.append(
        [
          f"{_size(c)}, {c['dtype']}, {c['inner']}, k={c['k']}",
          f"`{name}`",
          micro,
          f"{statistics.median(v['emit_s']) * 1e3:.3f}",
          _mib(v["footprint"], 1),
          _mib(v["init_temp"], 2),
        ]
      )
  return _table(
    _header(
      "configuration | loop | micro-step ms | emitting step ms"
      " | footprint MiB | init temp MiB"
    ),
    rows,
  )


def performance(payloads: dict[str, dict[str, Any]]) -> str:
  """The README's headline: whole-loop throughput per path, ours / peer,
  at k = 2, 4 and 8 (the tiny model and 64 MB), then compiled facts."""
  payload = payloads["loop"]
  configs = {
    (c["size_mb"], c["k"]): c
    for c in payload["configs"]
    if c["dtype"] == "float32" and c["inner"] == "adam"
  }
  sizes = sorted({s for s, _ in configs})
  ks = [k for k in (2, 4, 8) if any((s, k) in configs for s in sizes)]
  header = ["path"] + [
    f"{_size(configs[(s, k)])}, k={k}"
    for s in sizes
    for k in ks
    if (s, k) in configs
  ]
  rows, seen = [], []
  for path, ours, peer in PAIRS:
    cells = [
      _ratio(configs[(s, k)], ours, peer)
      for s in sizes
      for k in ks
      if (s, k) in configs
    ]
    rows.append([path, *map(_cell, cells)])
    seen += [(path, x) for x in cells]
  text = (
    _loop_machine(payload)
    + " Examples per second of the training loop each guide prints, ours"
    " over the same loop with `optax.MultiSteps` (adam, float32; above 1:"
    " ours is faster; **bold**: a tie or a loss):\n\n"
    + _table(header, rows)
    + _losses(seen)
  )
  compiled = payloads.get("bench_compiled")
  if compiled:
    text += "\n" + _compiled_headline(compiled, payloads.get("bench_comm"))
  return text


def nnx_forms(payload: dict[str, Any]) -> str:
  """The NNX guide's table: each call form, ours / MultiSteps, per call."""
  rows = []
  for c in sorted(payload["configs"], key=lambda c: (c["size_mb"], c["k"])):
    if c["dtype"] != "float32" or c["inner"] != "adam" or c["k"] not in (4, 8):
      continue
    for form, ours, peer in PAIRS[2:4]:
      r = _ratio(c, ours, peer)
      if r is None:
        continue
      calls = c["cycles_per_segment"] * c["k"]
      per_call = statistics.median(c["variants"][ours]["segment_s"]) / calls
      rows.append(
        [f"{_size(c)}, k={c['k']}", form, f"{per_call * 1e6:,.0f}", _cell(r)]
      )
  return (
    _loop_machine(payload)
    + "\n\n"
    + _table(
      ["model", "form", "ours: µs per call", "examples/s, ours / MultiSteps"],
      rows,
    )
  )


# ----------------------------------------------------------------------------
# The old GPU runs (bench_gpu.py, removed): the step, not the loop.
# ----------------------------------------------------------------------------


def gpu_history(payloads: dict[str, dict[str, Any]]) -> str:
  """Each run from its own file: every configuration it measured, and the
  LM demo's tokens/s (the NNX drop-in under ``nnx.jit`` against
  ``nnx.Optimizer(MultiSteps)``)."""
  parts = []
  for name, run in payloads.items():
    m = run["machine"]
    parts.append(
      f"\n`{name}`: {m['device_kind']}, jax {m['jax']},"
      f" {m['timestamp'][:10]}, k={run['args']['k']}; the step of the quick"
      " start (traced), of `emit=`, and of the NNX drop-in under `nnx.jit`:\n\n"
    )
    rows = []
    for r in sorted(
      run["step"], key=lambda r: (r["optimizer"], r["dtype"], r["size_mb"])
    ):
      label = f"{r['optimizer']}, {r['dtype']}, {r['size_mb']:,g} MB"
      ratios, times = r.get("ratios"), r.get("times_ms") or {}
      if not ratios:
        why = r.get("skipped") or r.get("error") or "memory"
        rows.append([label, f"not timed: {str(why)[:70]}", *["not timed"] * 5])
        continue
      nnx = ratios["micro_vs_floor"].get("nnx")
      emit = [
        times.get(v, {}).get("emit", {}).get("median")
        for v in ("ours", "MultiSteps")
      ]
      rows.append(
        [
          label,
          _spread(ratios["micro_vs_floor"]["ours"]),
          _spread(ratios["micro_vs_floor"]["static"]),
          _spread(nnx) if nnx else "not measured",
          _spread(ratios["multisteps_vs_ours_micro"], suffix="x"),
          f"{emit[0] / emit[1]:.2f}" if all(emit) else "not measured",
          _spread(ratios["multisteps_vs_ours_per_call"], suffix="x"),
        ]
      )
    parts.append(
      _table(
        _header(
          "inner, params | micro-step / floor | `emit=False` / floor"
          " | NNX drop-in / floor | MultiSteps micro-step / ours"
          " | emitting step, ours / MultiSteps (medians)"
          " | MultiSteps per call / ours"
        ),
        rows,
      )
    )
    lm = [
      [
        f"{x['model']} ({x['param_bytes'] / MB:.1f} MiB)",
        str(x["k"]),
        _spread(x["ours_vs_multisteps"], suffix="x"),
      ]
      for x in run.get("lm") or []
      if x.get("ours_vs_multisteps")
    ]
    if lm:
      parts.append(
        "\nThe LM demo, tokens/s of the NNX drop-in / `nnx.Optimizer(MultiSteps)`,"
        " both under `nnx.jit` (3 optimizer steps a round: too few to rank):\n\n"
        + _table(["model", "k", "ours / MultiSteps"], lm)
      )
  return "".join(parts)


# ----------------------------------------------------------------------------
# Compiled without the devices: bench_comm, bench_compiled, bench_plan, and
# the demo's wire dtype.
# ----------------------------------------------------------------------------


def _machine(payload: dict[str, Any], what: str) -> str:
  m = payload["machine"]
  return f"{what} {m['timestamp'][:10]} (jax {m['jax']}, optax {m['optax']})"


def bench_comm(payload: dict[str, Any]) -> str:
  rows = [
    [
      r["recipe"],
      str(r["k"]),
      r["ops_label"],
      f"{r['bytes_per_step'] / MB:.2f}",
      _spread(r["step_ms"], 1),
      _spread(r["time_ratio_vs_baseline"]),
    ]
    for r in payload["results"]
  ]
  c = payload["config"]
  return (
    _machine(payload, "Timed")
    + f" on {c['devices']} simulated devices, {c['param_bytes'] / MB:.2f} MiB"
    " of params; times say little about a real interconnect:\n\n"
    + _table(
      _header(
        "recipe | k | all-reduces / step | MiB / step | ms / step"
        " | time vs psum_each"
      ),
      rows,
    )
  )


def bench_comm_sharded(payload: dict[str, Any]) -> str:
  """The sharded-params table of bench_comm.json."""
  rows, skipped = payload.get("sharded", []), payload.get("sharded_skipped", {})
  if not rows:
    return "(no sharded rows in `bench_comm.json`: run `make bench`)\n"
  ks = list(rows[0]["reduced_per_step"])

  def by_axes(d):
    return (
      ", ".join(f"{a} {b / MB:.0f}" for a, b in sorted(d.items())) or "none"
    )

  body = [
    [
      r["target"],
      r["layout"],
      r["wire"],
      by_axes(r["reduced_every_call"]),
      by_axes(r["reduced_once"]),
      ", ".join(r["deferred_opcodes"]) or "none",
      *[by_axes(r["reduced_per_step"][k]) for k in ks],
      f"{r['accumulator_bytes_per_device'] / MB:.0f}",
    ]
    for r in rows
  ]
  text = (
    f"{rows[0]['param_bytes'] / MB:.0f} MiB of float32 params in 4 layers, 8"
    " devices, compiled (nothing timed); MiB per device, filed under the"
    " mesh axes each reduction spans:\n\n"
    + _table(
      [
        "target",
        "layout",
        "wire",
        "reduced every call",
        "reduced once a step",
        "as",
        *[f"per step, k={k}" for k in ks],
        "accumulator / device",
      ],
      body,
    )
  )
  for target, reason in skipped.items():
    text += f"\n{target}: not compiled ({reason}).\n"
  return text


def _compiled_step(case: dict[str, Any]) -> str:
  if case["variant"] != "accumulate":
    return case["variant"]
  return f"{case['apply']}/{case['emit']}"


def bench_compiled(payload: dict[str, Any]) -> str:
  """Per (target, engine, dtype): each step's kernel bytes over the
  floor's, and what the traced step compiles to."""
  groups: dict[tuple, dict[str, Any]] = {}
  for row in payload["rows"]:
    c = row["case"]
    key = (c["target"], c["engine"], c["dtype"])
    groups.setdefault(key, {})[_compiled_step(c)] = row

  def over_floor(steps, name, path="micro-step"):
    if name not in steps or "floor" not in steps:
      return "not compiled"
    floor = steps["floor"]["bytes"]["micro-step"]
    return f"{steps[name]['bytes'][path] / floor:.2f}"

  body = []
  for (target, engine, dtype), steps in groups.items():
    ours, plain = steps.get("accum/traced"), steps.get("plain")
    if ours is None:
      continue
    extra = "no plain step"
    if plain is not None:
      extra = (
        ours["memory"]["footprint"] - plain["memory"]["footprint"]
      ) / ours["accumulator_bytes"]
      extra = f"{extra:.2f}"
    gemms = ours["wgrad_gemms"]
    fused = (
      f"{sum(g['fused'] for g in gemms)}/{len(gemms)}" if gemms else "none"
    )
    body.append(
      [
        target,
        engine,
        dtype,
        over_floor(steps, "optax/traced"),
        over_floor(steps, "accum/traced"),
        over_floor(steps, "accum/micro"),
        over_floor(steps, "MultiSteps"),
        over_floor(steps, "accum/traced", "emitting"),
        over_floor(steps, "accum/emit", "emitting"),
        str(ours["conditionals"]),
        str(len(ours["copies"]["micro-step"])),
        extra,
        fused,
      ]
    )
  return (
    _machine(payload, "Compiled without the devices (nothing timed)")
    + f": {payload['args']['layers']} {payload['args']['width']}-square"
    " layers, adam, k=8; kernel bytes over the floor's micro-step.\n\n"
    + _table(
      _header(
        "target | engine | params | micro-step: optax.apply_updates"
        " | optax_accum.apply_updates | static, emit=False | MultiSteps"
        " | emitting step, traced | emitting step, static | conditionals"
        " | param-sized copies / micro-step | extra memory / accumulator"
        " | weight-gradient GEMMs add in place"
      ),
      body,
    )
  )


def bench_compiled_recipes(payload: dict[str, Any]) -> str:
  """The documented recipes, compiled as printed."""
  if not payload.get("recipes"):
    return "(no recipes in `bench_compiled.json` yet: run `make bench`)\n"
  body = []
  for key, f in payload["recipes"].items():
    name, dtype = key.split("/")
    extra = (f["footprint"] - f["plain_footprint"]) / f["accumulator_bytes"]
    body.append(
      [
        f"`{name}`",
        f["target"],
        dtype,
        f"{f['micro_step_bytes'] / f['floor_bytes']:.2f}",
        str(len(f["copies"])),
        f"{extra:.2f}",
        str(len(f["problems"])),
      ]
    )
  return (
    _machine(payload, "Compiled without the devices")
    + ".\n\n"
    + _table(
      _header(
        "recipe (as the docs print it) | target | params"
        " | micro-step bytes / floor | param-sized copies"
        " | extra memory / accumulator | check_step problems"
      ),
      body,
    )
  )


def _pick(rows, **match):
  return next(
    (r for r in rows if all(r["case"].get(k) == v for k, v in match.items())),
    None,
  )


def _compiled_headline(compiled: dict, comm: dict | None) -> str:
  """The compiled facts under the README's loop table."""
  rows_c = compiled["rows"]

  def over_floor(target, engine, path="micro-step", dtype="f32", **match):
    ours = _pick(rows_c, target=target, engine=engine, dtype=dtype, **match)
    floor = _pick(
      rows_c, target=target, variant="floor", engine=engine, dtype=dtype
    )
    if ours is None or floor is None:
      return None
    return ours["bytes"][path] / floor["bytes"]["micro-step"]

  traced = dict(variant="accumulate", apply="accum", emit="traced")
  rows = []
  micro = over_floor("h100", "local", **traced)
  ms = over_floor("h100", "local", variant="MultiSteps")
  if micro is not None and ms is not None:
    rows.append(
      [
        "one H100: micro-step kernel bytes / floor, ours vs `optax.MultiSteps`",
        f"{micro:.2f} vs {ms:.2f}",
      ]
    )
  for dtype in ("f32", "bf16"):
    t = over_floor("h100", "local", "emitting", dtype, **traced)
    s = over_floor(
      "h100",
      "local",
      "emitting",
      dtype,
      variant="accumulate",
      apply="accum",
      emit="emit",
    )
    if t is not None and s is not None:
      rows.append(
        [
          f"one H100, {dtype} params: emitting step bytes, traced / static",
          f"{t / s:.2f}",
        ]
      )
  if comm:
    kmax = max(x["k"] for x in comm["results"])
    traffic = {x["recipe"]: x for x in comm["results"] if x["k"] == kmax}
    if {"jit_unreduced", "gspmd"} <= traffic.keys():
      rows.append(
        [
          f"8 devices, k={kmax}: MiB all-reduced per optimizer step,"
          " deferred (plain `jit`) vs every micro-batch",
          f"{traffic['jit_unreduced']['bytes_per_step'] / MB:.2f} vs"
          f" {traffic['gspmd']['bytes_per_step'] / MB:.2f}",
        ]
      )
  return (
    "Compiled without the devices (bytes and structure, nothing timed;"
    " `bench_compiled.py`, `bench_comm.py`):\n\n" + _table(["", ""], rows)
  )


def wire_dtype(payload: dict[str, Any]) -> str:
  """examples/lm/wire_dtype.py: float32 vs bfloat16 on the wire."""
  a = payload["args"]
  rows = [
    [
      str(r["seed"]),
      f"{r['heldout']['float32']:.4f}",
      f"{r['heldout']['bfloat16']:.4f}",
      f"{r['heldout']['bfloat16'] - r['heldout']['float32']:+.1e}",
      f"{r['max_abs_params_diff']:.1e}",
      f"{r['float32_one_device_params_diff']:.1e}",
    ]
    for r in payload["seeds"]
  ]
  return (
    f"{a['steps']} optimizer steps of k={a['every_k']} micro-batches of"
    f" {a['micro_batch']} samples on {payload['devices']} simulated"
    f" devices (jax {payload['jax']}); deterministic, one row per seed:\n\n"
    + _table(
      _header(
        "seed | held-out loss, float32 wire | bfloat16 wire | difference"
        " | max abs params difference"
        " | float32 on one device vs 8: max abs params difference"
      ),
      rows,
    )
  )


def bench_plan(payload: dict[str, Any]) -> str:
  """The planner's choice against every candidate compiled."""
  rows = [
    [
      r["model"],
      r["target"],
      str(r["global_batch"]),
      f"{r['limit_bytes'] / 2**30:.0f} GiB",
      f"{r['micro_batch']} x {r['every_k']}",
      str(r["true_micro_batch"]),
      f"{r['compiles']} (bound {r['bound']})",
      _spread(r["seconds"], 1),
      f"{r['all_compiles']} / {r['all_seconds']:.0f} s",
    ]
    for r in payload["rows"]
  ]
  return (
    _machine(payload, "Compiled")
    + f"; planner seconds: median (min-max) over {payload['args']['repeats']}"
    " cold runs.\n\n"
    + _table(
      _header(
        "model | target | global batch | limit | plan: micro-batch x every_k"
        " | true largest | planner compiles | planner s"
        " | every candidate: compiles / s"
      ),
      rows,
    )
  )


# The accumulators bench_rounding.py compares, in its order.
ROUNDING_ACCUMULATORS = ("float32", "bfloat16, nearest", "bfloat16, stochastic")


def bench_rounding(payload: dict[str, Any]) -> str:
  lines = [
    f"Mean error of the accumulated sum against the exact (float64) one,"
    f" ± its standard error, over {payload['elements']} draws (elements);"
    f" jax {payload['machine']['jax']}:",
    "",
    "| case | k | " + " | ".join(ROUNDING_ACCUMULATORS) + " |",
    "|---|---|" + "---|" * len(ROUNDING_ACCUMULATORS),
  ]
  by = {(r["case"], r["k"], r["accumulator"]): r for r in payload["rows"]}
  for case in ("swamping", "typical"):
    for k in payload["ks"]:
      cells = [
        f"{by[case, k, a]['mean_error']:+.2e} ±"
        f" {by[case, k, a]['standard_error']:.1e}"
        for a in ROUNDING_ACCUMULATORS
      ]
      lines.append(f"| {case} | {k} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------
# Pages.
# ----------------------------------------------------------------------------

SECTIONS: dict[str, Callable[[Any], str]] = {
  "performance": performance,
  "loop": loop,
  "gpu_loop": _each_run(loop),
  "gpu_nnx_forms": _each_run(nnx_forms),
  "loop_steps": loop_steps,
  "nnx_forms": nnx_forms,
  "gpu_history": gpu_history,
  "bench_comm": bench_comm,
  "bench_comm-sharded": bench_comm_sharded,
  "bench_compiled": bench_compiled,
  "bench_compiled-recipes": bench_compiled_recipes,
  "bench_plan": bench_plan,
  "bench_rounding": bench_rounding,
  "wire_dtype": wire_dtype,
}
GPU_RUNS = RESULTS / "gpu"
GPU_LOOPS = tuple(sorted(GPU_RUNS.glob("*/loop.json")))  # gpu.sh's runs
# Where each block's JSON is, when not RESULTS / f"{name}.json"; a tuple:
# several files, handed over as {stem or path: payload}.
SOURCES: dict[str, Any] = {
  "loop": RESULTS / "loop.json",
  "gpu_loop": GPU_LOOPS,
  "gpu_nnx_forms": GPU_LOOPS,
  "loop_steps": RESULTS / "loop.json",
  "nnx_forms": RESULTS / "loop.json",
  "performance": tuple(
    RESULTS / f"{n}.json" for n in ("loop", "bench_compiled", "bench_comm")
  ),
  "gpu_history": tuple(sorted(GPU_RUNS.glob("*/bench_gpu.json"))),
  "bench_comm-sharded": RESULTS / "bench_comm.json",
  "bench_compiled-recipes": RESULTS / "bench_compiled.json",
  "wire_dtype": ROOT / "examples" / "lm" / "results" / "wire_dtype.json",
}
PAGES = (
  ROOT / "README.md",
  HERE / "README.md",
  ROOT / "docs" / "guides" / "flax.md",
  ROOT / "docs" / "guides" / "scaling_hsdp.md",
)
# The results pages next to their JSON: title, then its sections.
RESULT_PAGES = {
  RESULTS / "loop.md": (
    "The whole loop (`bench_loop.py`)",
    ("loop", "loop_steps"),
  ),
  RESULTS / "bench_comm.md": (
    "Reductions (`bench_comm.py`)",
    ("bench_comm", "bench_comm-sharded"),
  ),
  RESULTS / "bench_compiled.md": (
    "Compiled programs (`bench_compiled.py`)",
    ("bench_compiled", "bench_compiled-recipes"),
  ),
  RESULTS / "bench_plan.md": ("The planner (`bench_plan.py`)", ("bench_plan",)),
  RESULTS / "bench_rounding.md": (
    "A bfloat16 accumulator's rounding (`bench_rounding.py`)",
    ("bench_rounding",),
  ),
  GPU_RUNS / "README.md": (
    "Earlier GPU runs: the step (`bench_gpu.py`, before the whole loop)",
    ("gpu_history",),
  ),
}


def section(name: str) -> str:
  """The body of block `name`, from its results file(s)."""
  path = SOURCES.get(name, RESULTS / f"{name}.json")
  paths = path if isinstance(path, tuple) else (path,)
  missing = [p.name for p in paths if not p.is_file()]
  if missing or not paths:
    where = (
      "`benchmarks/gpu.sh` on a GPU" if name == "gpu_loop" else "`make bench`"
    )
    return f"(no `{missing[0] if missing else name}` yet: run {where})\n"
  if not isinstance(path, tuple):
    return SECTIONS[name](json.loads(path.read_text()))
  keys = [p.stem for p in paths]
  if any(p.parent != RESULTS for p in paths):  # runs, a folder each
    keys = [p.parent.name for p in paths]
  return SECTIONS[name](
    {k: json.loads(p.read_text()) for k, p in zip(keys, paths, strict=True)}
  )


def render(text: str) -> str:
  """`text` with every results block rendered from its JSON file."""

  def block(match: re.Match) -> str:
    return f"{match.group(1)}{section(match.group('name'))}{match.group(4)}"

  return BLOCK.sub(block, text)


def result_page(title: str, names: tuple[str, ...]) -> str:
  """A results page: its title, then each block, markers included (so that
  the page checks like the others)."""
  blocks = [
    f"<!-- results:{n} -->\n{section(n)}<!-- /results:{n} -->\n" for n in names
  ]
  return f"# {title}\n\n" + "\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--check", action="store_true", help="exit 1 if a page is stale"
  )
  args = parser.parse_args(argv)
  pages = {p: render(p.read_text()) for p in PAGES}
  pages.update({p: result_page(*spec) for p, spec in RESULT_PAGES.items()})
  stale = [
    p for p, text in pages.items() if not p.is_file() or p.read_text() != text
  ]
  if args.check:
    for p in stale:
      print(f"{p.relative_to(ROOT)}: stale, run benchmarks/render.py")
    return 1 if stale else 0
  for p in stale:
    p.write_text(pages[p])
  return 0


if __name__ == "__main__":
  sys.exit(main())
