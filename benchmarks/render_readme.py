"""Writes the figures of benchmarks/README.md (and the scaling guide's) from
the results files.

Every number in the README's performance guide sits between a pair of
markers, ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``, and is
rendered here from the JSON that ``make bench`` (the scripts with their
defaults) leaves in ``benchmarks/results/`` (``SOURCES``: the few kept
elsewhere, e.g. ``examples/lm/results/wire_dtype.json``, which
``examples/lm/wire_dtype.py`` writes for the scaling guide): nobody types a
figure by hand, and ``tests/test_benchmarks_smoke.py`` fails when a page
(``PAGES``) and the results disagree.

Usage::

  python benchmarks/render_readme.py          # rewrite the pages
  python benchmarks/render_readme.py --check  # exit 1 if one is stale
"""

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
RESULTS = HERE / "results"
LM_RESULTS = HERE.parent / "examples" / "lm" / "results"
# The pages with results blocks: this guide, the HSDP guide (the wire
# dtype's accuracy) and the landing page.
PAGES = (
  README,
  HERE.parent / "docs" / "guides" / "scaling_hsdp.md",
  HERE.parent / "README.md",
)
MB = 2**20

BLOCK = re.compile(
  r"(<!-- results:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)",
  re.S,
)


def _spread(s: dict[str, Any] | None, digits: int = 2, suffix: str = "") -> str:
  if not s or s.get("median") is None:
    return "-"
  text = f"{s['median']:.{digits}f}{suffix}"
  # bench_gpu's spreads carry their count, the others their values.
  if s.get("n", len(s.get("values", ()))) > 1:
    text += f" ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
  return text


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _machine(payload: dict[str, Any]) -> str:
  m, a = payload["machine"], payload["args"]
  return (
    f"Measured {m['timestamp'][:10]} on {m['cpu_count']} CPUs ({m['backend']}),"
    f" jax {m['jax']}, optax {m['optax']}; {a['repeats']} repeats of"
    f" {a['rounds']} rounds; median (min-max over repeats).\n"
  )


def bench_step(payload: dict[str, Any]) -> str:
  """The rows of the largest k at the largest size."""
  k = max(x["k"] for x in payload["results"])
  size = max(x["size_mb"] for x in payload["results"])
  rows = []
  for r in payload["results"]:
    if (r["k"], r["size_mb"]) != (k, size):
      continue
    ratio = r["spread"]["ratios"]
    rows.append(
      [
        f"{r['optimizer']}, {r['dtype']}, {r['param_bytes'] / MB:g} MB",
        _spread(ratio["micro_vs_floor"]),
        _spread(ratio.get("static_micro_vs_floor")),
        _spread(ratio.get("optax_micro_vs_floor")),
        _spread(ratio["emit_vs_plain"]),
        f"{r['ratios']['extra_memory']:.2f}",
        _spread(ratio["multisteps_speedup"], suffix="x"),
        f"{r['ratios']['memory_vs_multisteps']:.2f}",
      ]
    )
  targets = "".join(
    f"- {t['what']} {t['target']}\n" for t in payload["targets"].values()
  )
  misses = "".join(
    f"- {r['optimizer']}, {r['dtype']}, {r['size_mb']:g} MB, k={r['k']}:"
    f" {c['what']} = {c['value']:.2f} (target {c['target']})\n"
    for r in payload["results"]
    for c in r["checks"].values()
    if not c["pass"]
  )
  return (
    _machine(payload)
    + f"\nk={k}:\n\n"
    + _table(
      [
        "inner, params",
        "micro-step / floor",
        "static micro-step / floor",
        "with optax.apply_updates",
        "emit / plain",
        "extra memory / acc. bytes",
        "MultiSteps micro / ours",
        "footprint / MultiSteps",
      ],
      rows,
    )
    + "\nTargets (every size and k):\n\n"
    + targets
    + "\nMisses:\n\n"
    + (misses or "- none\n")
  )


def bench_train(payload: dict[str, Any]) -> str:
  rows = [
    [
      str(r["k"]),
      name,
      "over budget"
      if m["skipped"]
      else _spread(m.get("vs_big_batch_spread"), suffix="x"),
      f"{m['memory']['footprint'] / MB:.0f}",
    ]
    for r in payload["throughput"]
    for name, m in r["methods"].items()
  ]
  eq = payload["equivalence"]
  return (
    _machine(payload)
    + "\n"
    + _table(["k", "method", "tokens/s vs big batch", "footprint MB"], rows)
    + f"\nAfter {eq['steps']} steps of k={eq['k']}, max |params - big batch"
    f" params|: accumulate {eq['accumulate']['max_abs_diff']:.1e}.\n"
  )


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
    _machine(payload)
    + f"{c['devices']} simulated devices, {c['param_bytes'] / MB:.2f} MiB of"
    " params:\n\n"
    + _table(
      [
        "recipe",
        "k",
        "all-reduces / step",
        "MiB / step",
        "ms / step",
        "time vs psum_each",
      ],
      rows,
    )
  )


def bench_comm_sharded(payload: dict[str, Any]) -> str:
  """The sharded-params table of bench_comm.json, at the largest k."""
  rows, skipped = payload.get("sharded", []), payload.get("sharded_skipped", {})
  if not rows:
    return "(no sharded rows in `bench_comm.json`: run `make bench`)\n"
  ks = list(rows[0]["reduced_per_step"])

  def by_axes(d):
    return ", ".join(f"{a} {b / MB:.0f}" for a, b in sorted(d.items())) or "-"

  body = [
    [
      r["target"],
      r["layout"],
      r["wire"],
      by_axes(r["reduced_every_call"]),
      by_axes(r["reduced_once"]),
      ", ".join(r["deferred_opcodes"]) or "-",
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
  """Per (target, engine, dtype): each step's micro-step kernel bytes over
  the floor's, and what optax_accum's traced step compiles to."""
  groups: dict[tuple, dict[str, Any]] = {}
  for row in payload["rows"]:
    c = row["case"]
    key = (c["target"], c["engine"], c["dtype"])
    groups.setdefault(key, {})[_compiled_step(c)] = row

  def micro(steps, name):
    if name not in steps or "floor" not in steps:
      return "-"
    floor = steps["floor"]["bytes"]["micro-step"]
    return f"{steps[name]['bytes']['micro-step'] / floor:.2f}"

  body = []
  for (target, engine, dtype), steps in groups.items():
    ours, plain = steps.get("accum/traced"), steps.get("plain")
    if ours is None:
      continue
    extra = "-"
    if plain is not None:
      extra = (
        ours["memory"]["footprint"] - plain["memory"]["footprint"]
      ) / ours["accumulator_bytes"]
      extra = f"{extra:.2f}"
    gemms = ours["wgrad_gemms"]
    fused = f"{sum(g['fused'] for g in gemms)}/{len(gemms)}" if gemms else "-"
    emit = steps.get("accum/emit", {}).get("overlap")
    overlap = (
      f"{emit['started_before_last_gemm']}/{emit['reductions']}"
      if emit and emit.get("reductions")
      else "-"
    )
    body.append(
      [
        target,
        engine,
        dtype,
        micro(steps, "optax/traced"),
        micro(steps, "accum/traced"),
        micro(steps, "accum/micro"),
        micro(steps, "MultiSteps"),
        str(ours["conditionals"]),
        "yes" if ours["adam_every_call"] else "no",
        str(len(ours["copies"]["micro-step"])),
        extra,
        fused,
        overlap,
      ]
    )
  m = payload["machine"]
  return (
    f"Compiled {m['timestamp'][:10]} without the devices (nothing timed),"
    f" jax {m['jax']}, optax {m['optax']}: {payload['args']['layers']}"
    f" {payload['args']['width']}-square layers, adam, k=8.\n\n"
    + _table(
      [
        "target",
        "engine",
        "params",
        "micro-step / floor: optax.apply_updates",
        "optax_accum.apply_updates",
        "static, emit=False",
        "MultiSteps",
        "conditionals kept",
        "adam every call",
        "param-sized copies / micro-step",
        "extra memory / accumulator",
        "weight-gradient GEMMs add in place",
        "static emit=True: reductions started in the backward",
      ],
      body,
    )
  )


def bench_compiled_recipes(payload: dict[str, Any]) -> str:
  """The documented recipes, compiled as printed (``bench_compiled.py``):
  micro-step bytes over the floor of the recipe's own loss, parameter-sized
  copies, extra memory over its inner optimizer's plain step."""
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
  m = payload["machine"]
  return (
    f"Compiled {m['timestamp'][:10]} without the devices, jax {m['jax']}.\n\n"
    + _table(
      [
        "recipe (as the docs print it)",
        "target",
        "params",
        "micro-step bytes / floor",
        "param-sized copies",
        "extra memory / accumulator",
        "check_step problems",
      ],
      body,
    )
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
      [
        "seed",
        "held-out loss, float32 wire",
        "bfloat16 wire",
        "difference",
        "max abs params difference",
        "float32 on one device vs 8: max abs params difference",
      ],
      rows,
    )
  )


def bench_flax_mesh(payload: dict[str, Any]) -> str:
  """The three NNX steps on the data-parallel mesh, and the target."""
  a, config = payload["args"], payload["config"]
  rows = [
    [
      devices,
      name,
      _spread(r["micro_ms"]),
      _spread(r["speedup"], suffix="x"),
      f"{r['temp_bytes'] / MB:.2f}",
      str(r["copies"]),
      f"{r['all_reduced_every_call'] / MB:.2f}",
    ]
    for devices, by_name in payload["results"].items()
    for name, r in by_name.items()
  ]
  checks = "".join(
    f"- {c['what']}: {c['value']:.2f} (target {c['target']}):"
    f" {'PASS' if c['pass'] else 'FAIL'}\n"
    for c in payload["checks"].values()
  )
  return (
    _machine(payload)
    + f"\n{'/'.join(map(str, a['devices']))} CPU devices, {a['layers']} tanh"
    f" layers of width"
    f" {a['width']} ({config['param_bytes'] / MB:.1f} MiB of float32"
    f" params), micro-batch {a['micro_batch']}, k={a['k']}, adam:\n\n"
    + _table(
      [
        "devices",
        "step",
        "micro-step ms",
        "MultiSteps micro / this",
        "temp MiB",
        "param-sized copies",
        "MiB all-reduced every call",
      ],
      rows,
    )
    + "\n"
    + checks
  )


def _pick(rows, **match):
  return next(
    (r for r in rows if all(r["case"][k] == v for k, v in match.items())),
    None,
  )


def performance(payloads: dict[str, dict[str, Any]]) -> str:
  """The README's headline figures, from three results files."""
  step, comm, compiled = (
    payloads[n] for n in ("bench_step", "bench_comm", "bench_compiled")
  )
  k = max(r["k"] for r in step["results"])
  size = max(r["size_mb"] for r in step["results"])
  (r,) = [
    x
    for x in step["results"]
    if (x["k"], x["size_mb"], x["optimizer"], x["dtype"])
    == (k, size, "adam", "float32")
  ]
  ratio = r["spread"]["ratios"]
  kmax = max(x["k"] for x in comm["results"])
  traffic = {x["recipe"]: x for x in comm["results"] if x["k"] == kmax}
  rows_c = compiled["rows"]

  def kernel(target, **match):
    ours = _pick(rows_c, target=target, **match)
    floor = _pick(
      rows_c,
      target=target,
      variant="floor",
      engine=match["engine"],
      dtype="f32",
    )
    return ours["bytes"]["micro-step"] / floor["bytes"]["micro-step"]

  h100 = dict(engine="local", dtype="f32")
  emit = _pick(
    rows_c,
    target="h100x8",
    engine="unreduced",
    dtype="f32",
    variant="accumulate",
    apply="accum",
    emit="emit",
  )
  overlap = emit["overlap"]
  sharded = {
    (x["target"], x["layout"], x["wire"]): x for x in comm.get("sharded", [])
  }
  rows = [
    [
      f"CPU, adam, float32, {size:g} MB of params, k={k}: micro-step / floor"
      " (gradient + add, nothing else)",
      _spread(ratio["micro_vs_floor"]),
      "bench_step",
    ],
    [
      "the same, static cycle (`emit=False`)",
      _spread(ratio["static_micro_vs_floor"]),
      "bench_step",
    ],
    [
      "`optax.MultiSteps` micro-step / ours",
      _spread(ratio["multisteps_speedup"], suffix="x"),
      "bench_step",
    ],
    [
      "extra memory / accumulator bytes",
      f"{r['ratios']['extra_memory']:.2f}",
      "bench_step",
    ],
    [
      f"8 devices, k={kmax}: MiB all-reduced per optimizer step, deferred"
      " (plain `jit`) vs every micro-batch",
      f"{traffic['jit_unreduced']['bytes_per_step'] / MB:.2f} vs"
      f" {traffic['gspmd']['bytes_per_step'] / MB:.2f}",
      "bench_comm",
    ],
    [
      "one H100, compiled: micro-step kernel bytes / floor, ours vs"
      " `optax.MultiSteps`",
      f"{kernel('h100', variant='accumulate', apply='accum', emit='traced', **h100):.2f}"
      f" vs {kernel('h100', variant='MultiSteps', **h100):.2f}",
      "bench_compiled",
    ],
    [
      "8 H100s, compiled, `emit=True`: leaf all-reduces started during the"
      " backward pass",
      f"{overlap['started_before_last_gemm']} of {overlap['reductions']}",
      "bench_compiled",
    ],
  ]
  hsdp, fsdp = (
    sharded.get(("v5e_2x4", "hsdp", "f32")),
    sharded.get(("v5e_2x4", "fsdp", "f32")),
  )
  if hsdp and fsdp:
    last = list(hsdp["reduced_per_step"])[-1]
    across = lambda x: sum(  # noqa: E731
      b for a, b in x["reduced_per_step"][last].items() if "replica" in a
    )
    rows.append(
      [
        f"TPU v5e 2x4, compiled, k={last}: MiB reduced across replicas per"
        " optimizer step, HSDP vs FSDP",
        f"{across(hsdp) / MB:.0f} vs {across(fsdp) / MB:.0f}",
        "bench_comm",
      ]
    )
  m = step["machine"]
  return (
    f"Timed on {m['cpu_count']} CPUs ({m['backend']}, jax {m['jax']},"
    f" {m['timestamp'][:10]}): median (min-max) over"
    f" {step['args']['repeats']} repeats; accelerators compiled without"
    " the devices, nothing timed.\n\n" + _table(["", "", "script"], rows)
  )


def gpu(payloads: dict[str, dict[str, Any]]) -> str:
  """The step timed on a GPU (bench_gpu.py), its runs merged: what a
  micro-step costs over the floor and against ``optax.MultiSteps``."""
  # A later run's configuration replaces an earlier one's (as
  # bench_gpu.merge, which the full page uses; not imported: it needs jax).
  steps = {}
  for run in payloads.values():
    steps.update(
      {(r["optimizer"], r["dtype"], r["size_mb"]): r for r in run["step"]}
    )
  payload = {**list(payloads.values())[-1], "step": list(steps.values())}
  rows = [
    [
      f"{r['optimizer']}, {r['dtype']}, {r['size_mb']:,g} MB",
      _spread(r["ratios"]["micro_vs_floor"]["ours"]),
      f"{r['ratios']['ours_minus_floor_micro_ms']['median'] * 1e3:.0f}",
      _spread(r["ratios"]["micro_vs_floor"]["static"]),
      _spread(r["ratios"]["multisteps_vs_ours_micro"], suffix="x"),
      _spread(r["ratios"]["multisteps_vs_ours_per_call"], suffix="x"),
    ]
    for r in sorted(
      payload["step"],
      key=lambda r: (r["optimizer"], r["dtype"], r["size_mb"]),
    )
    if r.get("ratios")
  ]
  m = payload["machine"]
  return (
    f"Timed on one {m['device_kind']} ({m['backend']}, jax {m['jax']},"
    f" {m['timestamp'][:10]}, `benchmarks/gpu.sh`): median (min-max) over"
    f" interleaved rounds, k={payload['args']['k']}.\n\n"
    + _table(
      [
        "inner, params",
        "micro-step / floor",
        "µs over floor",
        "`emit=False` / floor",
        "`MultiSteps` micro-step / ours",
        "`MultiSteps` per call / ours",
      ],
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
  m = payload["machine"]
  return (
    f"Compiled on {m['cpu_count']} CPUs (jax {m['jax']},"
    f" {m['timestamp'][:10]}); planner seconds: median (min-max) over"
    f" {payload['args']['repeats']} cold runs.\n\n"
    + _table(
      [
        "model",
        "target",
        "global batch",
        "limit",
        "plan: micro-batch x every_k",
        "true largest",
        "planner compiles",
        "planner s",
        "every candidate: compiles / s",
      ],
      rows,
    )
  )


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
  "bench_step": bench_step,
  "bench_train": bench_train,
  "bench_comm": bench_comm,
  "bench_comm-sharded": bench_comm_sharded,
  "bench_compiled": bench_compiled,
  "bench_compiled-recipes": bench_compiled_recipes,
  "bench_plan": bench_plan,
  "bench_flax_mesh": bench_flax_mesh,
  "wire_dtype": wire_dtype,
  "performance": performance,
  "gpu": gpu,
}
# Where each block's JSON is, when not RESULTS / f"{name}.json".
SOURCES = {
  "bench_comm-sharded": RESULTS / "bench_comm.json",
  "bench_compiled-recipes": RESULTS / "bench_compiled.json",
  "wire_dtype": LM_RESULTS / "wire_dtype.json",
  # Several files: the renderer gets {name: payload}.
  "performance": tuple(
    RESULTS / f"{n}.json"
    for n in ("bench_step", "bench_comm", "bench_compiled")
  ),
  # Both GPU runs, merged (the second filled the first's gaps).
  "gpu": (
    RESULTS / "gpu" / "bench_gpu.json",
    RESULTS / "gpu" / "run2" / "bench_gpu.json",
  ),
}


def render(text: str, results: Path = RESULTS) -> str:
  """`text` with every results block rendered from its JSON file."""

  def block(match: re.Match) -> str:
    name = match.group("name")
    path = SOURCES.get(name, results / f"{name}.json")
    paths = path if isinstance(path, tuple) else (path,)
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
      body = f"(no `{missing[0]}` yet: run `make bench`)\n"
    elif isinstance(path, tuple):
      # Keyed by file name, or by path where names repeat (runs of one
      # script), in the order SOURCES gives.
      keys = [p.stem for p in paths]
      if len(set(keys)) < len(keys):
        keys = [str(p.relative_to(RESULTS)) for p in paths]
      body = RENDERERS[name](
        {k: json.loads(p.read_text()) for k, p in zip(keys, paths, strict=True)}
      )
    else:
      body = RENDERERS[name](json.loads(path.read_text()))
    return f"{match.group(1)}{body}{match.group(4)}"

  return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--check",
    action="store_true",
    help="exit with status 1 if the README differs from the results",
  )
  args = parser.parse_args(argv)
  stale = []
  for page in PAGES:
    text = page.read_text()
    rendered = render(text)
    if rendered != text:
      stale.append(page)
      if not args.check:
        page.write_text(rendered)
  if args.check and stale:
    names = ", ".join(str(p.relative_to(HERE.parent)) for p in stale)
    print(f"{names}: stale, run benchmarks/render_readme.py")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
