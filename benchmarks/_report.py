"""What bench_step and bench_train print and draw, from their JSON payloads.

Each script measures and builds its payload (the JSON it writes); the
functions here turn a payload into the Markdown page, the figure and the
console lines, and read nothing else, so that a results file alone can be
shown again. ``render_readme.py`` renders the README's blocks from the same
files.
"""

import itertools
from typing import Any

import numpy as np
from _common import (
  MB,
  Target,
  console_table,
  figure_title,
  fmt,
  fmt_spread,
  markdown_page,
  markdown_table,
)
from matplotlib.figure import Figure

# --- bench_step. ------------------------------------------------------------

STEP_BASE = ["optimizer", "dtype", "params MB", "k"]
# The times table: (column, variant, time).
STEP_TIMES = (
  ("floor micro", "floor", "micro_ms"),
  ("plain", "plain", "call_ms"),
  ("accumulate micro", "accumulate", "micro_ms"),
  ("accumulate emit", "accumulate", "emit_ms"),
  ("acc+noise micro", "accumulate+noise", "micro_ms"),
  ("MultiSteps micro", "MultiSteps", "micro_ms"),
  ("MultiSteps emit", "MultiSteps", "emit_ms"),
  ("apply_every micro", "apply_every", "micro_ms"),
  ("apply_every emit", "apply_every", "emit_ms"),
)


def _step_base(r: dict[str, Any]) -> list[Any]:
  return [r["optimizer"], r["dtype"], f"{r['param_bytes'] / MB:g}", r["k"]]


def _check_cell(r: dict[str, Any], name: str) -> str:
  check = r["checks"].get(name)
  if check is None:
    return "-"
  value = fmt_spread(r["spread"]["ratios"][name])
  return f"{value} {'PASS' if check['pass'] else 'FAIL'}"


def _memory_cell(r: dict[str, Any], name: str) -> str:
  extra = r["ratios"]["extra_memory_vs_param_bytes"][name]
  return f"{r['variants'][name]['memory']['footprint'] / MB:.1f} ({extra:+.2f})"


def step_markdown(payload: dict[str, Any], targets: dict[str, Target]) -> str:
  """bench_step.md: the targets, the times, the compiled memory."""
  results, a = payload["results"], payload["args"]
  checks = [c for r in results for c in r["checks"].values()]
  variants = list(results[0]["variants"])
  return markdown_page(
    "bench_step: accumulation cost per call",
    payload["machine"],
    f"Model: square tanh layers, micro-batch {a['micro_batch']}."
    f" {a['repeats']} repeats, each {a['warmup']} warm-up round(s) then"
    f" {a['rounds']} interleaved rounds; each round runs whole cycles of"
    " k calls (>= 4 calls) per variant, the first call of each turn left"
    " out. Times in ms. A ratio is the median over rounds of that round's"
    " ratio of medians; tables show the median over repeats and, in"
    " brackets, their min-max."
    " Footprint = argument + temp + output - alias bytes of the compiled"
    " step.",
    f"**{sum(c['pass'] for c in checks)}/{len(checks)} targets pass.**",
    "## Targets",
    "\n".join(f"- {t.column}: {t.what} {t.text}" for t in targets.values()),
    markdown_table(
      STEP_BASE + [f"{t.column} ({t.text})" for t in targets.values()],
      [
        [*_step_base(r), *(_check_cell(r, n) for n in targets)] for r in results
      ],
    ),
    "## Times (ms, medians)",
    markdown_table(
      STEP_BASE + [column for column, _, _ in STEP_TIMES],
      [
        _step_base(r) + [fmt(r["variants"][n][w]) for _, n, w in STEP_TIMES]
        for r in results
      ],
    ),
    "## Compiled memory",
    markdown_table(
      STEP_BASE
      + [f"{name} footprint MB (extra / param bytes)" for name in variants],
      [
        [*_step_base(r), *(_memory_cell(r, n) for n in variants)]
        for r in results
      ],
    ),
  )


# Figure rows: (y label, ratios entry, target). Variants shown: (colour,
# marker, x offset); distinct markers and offsets keep equal values visible
# (accumulate and accumulate+noise often coincide).
STEP_FIGURE_ROWS = (
  ("micro-step / floor", "micro_vs_floor_by_variant", 1.3),
  ("emitting step / plain", "emit_vs_plain_by_variant", 1.3),
  ("extra memory / param bytes", "extra_memory_vs_param_bytes", None),
)
STEP_SHOWN = {
  "accumulate": ("C0", "o", 0.94),
  "accumulate+noise": ("C1", "s", 1.0),
  "MultiSteps": ("C3", "^", 1.06),
  "apply_every": ("C2", "x", 1.12),
}


def step_figure(payload: dict[str, Any]) -> Figure:
  """Micro-step / floor, emitting step / plain, extra memory; vs size."""
  results = payload["results"]
  panels = sorted({(r["optimizer"], r["dtype"]) for r in results})
  rows = STEP_FIGURE_ROWS
  fig = Figure(figsize=(4.2 * len(panels), 3.2 * len(rows)))
  axes = fig.subplots(len(rows), len(panels), squeeze=False)
  ks = sorted({r["k"] for r in results})
  styles = dict(zip(ks, itertools.cycle(("--", "-", ":", "-."))))
  for col, (opt, dtype) in enumerate(panels):
    for row, (title, entry, target) in enumerate(rows):
      ax = axes[row][col]
      for name, k in itertools.product(STEP_SHOWN, ks):
        color, marker, offset = STEP_SHOWN[name]
        points = [
          (r["param_bytes"] / MB, r["ratios"][entry][name])
          for r in results
          if (r["optimizer"], r["dtype"], r["k"]) == (opt, dtype, k)
          and r["ratios"][entry][name] is not None
        ]
        if points:
          xs, ys = zip(*sorted(points), strict=True)
          ax.plot(
            [x * offset for x in xs],
            ys,
            styles[k],
            marker=marker,
            markerfacecolor="none",
            color=color,
            label=f"{name} k={k}",
          )
      if target is not None:
        ax.axhline(target, color="gray", lw=0.8, ls=":")
        ax.annotate(
          f"target {target}",
          (0.01, target),
          xycoords=("axes fraction", "data"),
          va="bottom",
          fontsize=7,
          color="gray",
        )
      ax.set_xscale("log", base=2)
      ax.set_xlabel("params (MB)")
      ax.set_ylabel(title)
      ax.set_title(f"{opt}, {dtype}", fontsize=9)
  # One legend, below the panels: it covers no data.
  handles, labels = axes[1][0].get_legend_handles_labels()
  fig.legend(
    handles,
    labels,
    loc="lower center",
    ncol=min(4, len(labels)),
    fontsize=7,
    bbox_to_anchor=(0.5, 0.0),
  )
  figure_title(fig, payload)
  fig.tight_layout(rect=(0, 0.06, 1, 1))
  return fig


def _console_cell(r: dict[str, Any], name: str) -> str:
  check = r["checks"].get(name)
  if check is None:
    return "-"
  color = "green" if check["pass"] else "red"
  return f"[{color}]{check['value']:.2f}[/{color}]"


def step_console(
  payload: dict[str, Any], targets: dict[str, Target]
) -> list[Any]:
  """Each configuration's ratios against the targets, green or red, then
  the targets that failed."""
  rows, failed = [], []
  for r in payload["results"]:
    dtype = {"float32": "f32", "bfloat16": "bf16"}[r["dtype"]]
    label = f"{r['optimizer']} {dtype} {r['param_bytes'] / MB:g}MB k={r['k']}"
    rows.append([label, *(_console_cell(r, name) for name in targets)])
    failed += [
      f"{r['optimizer']} {r['dtype']} {r['size_mb']:g}MB k={r['k']}: {name}"
      for name, check in r["checks"].items()
      if not check["pass"]
    ]
  table = console_table(
    "accumulate vs targets (medians over repeats)",
    ["config"] + [f"{t.column}\n{t.text}" for t in targets.values()],
    rows,
  )
  return [
    table,
    f"{len(failed)} target(s) failed" + (":" if failed else "."),
    *(f"  [red]{line}[/red]" for line in failed),
  ]


# --- bench_train. -----------------------------------------------------------


def train_markdown(payload: dict[str, Any]) -> str:
  """bench_train.md: throughput, the memory budget, the equivalence."""
  a, eq, model = payload["args"], payload["equivalence"], payload["model"]
  rows = [
    [
      r["k"],
      name,
      r["k"] * a["micro_batch"],
      m["skipped"] or fmt_spread(m["tokens_per_s_spread"], 0),
      fmt_spread(m["vs_big_batch_spread"])
      if m.get("vs_big_batch_spread")
      else "-",
      fmt(m["memory"]["footprint"] / MB, 1),
    ]
    for r in payload["throughput"]
    for name, m in r["methods"].items()
  ]
  budget_rows = [
    [name, b["effective_batch"], b["note"], fmt(b["footprint"] / MB, 1)]
    for name, b in payload["memory_budget"].items()
  ]
  eq_rows = [
    [
      name,
      f"{eq[name]['max_abs_diff']:.2e}",
      "-"
      if eq[name]["relative_to_change"] is None
      else f"{eq[name]['relative_to_change']:.2e}",
      "PASS" if eq[name]["pass"] else "FAIL",
    ]
    for name in ("accumulate", "MultiSteps")
  ]
  return markdown_page(
    "bench_train: tiny transformer LM, end to end",
    payload["machine"],
    f"Model: {model['layers']} layers, d_model {model['d_model']},"
    f" {model['heads']} heads, d_ff {model['d_ff']}, vocab {model['vocab']},"
    f" sequence {model['seq_len']}; {model['param_bytes'] / MB:.2f} MB of"
    " float32 params."
    f" Optimizer: clip_by_global_norm(1) + adamw({a['learning_rate']})."
    f" Micro-batch: {a['micro_batch']} sequences. {a['repeats']} repeats"
    f" of {a['warmup']} warm-up then {a['rounds']} interleaved rounds of"
    f" {a['steps']} optimizer step(s); median over repeats (min-max) of"
    " each repeat's median; ratios paired within a repeat. Memory budget:"
    f" {a['memory_budget_mb']:g} MB (compiled footprint = argument + temp"
    " + output - alias bytes).",
    "## Throughput",
    markdown_table(
      [
        "k",
        "method",
        "sequences / step",
        "tokens/s",
        "vs big batch",
        "footprint MB",
      ],
      rows,
    ),
    "## Largest effective batch within the memory budget",
    markdown_table(
      ["method", "effective batch (sequences)", "how", "footprint MB"],
      budget_rows,
    ),
    "## Equivalence with the big batch",
    f"After {eq['steps']} optimizer steps of k={eq['k']} micro-batches"
    f" (loss {eq['initial_loss']:.3f} -> big batch"
    f" {eq['loss_after']['big batch']:.3f}, accumulate"
    f" {eq['loss_after']['accumulate']:.3f}), largest parameter change of"
    f" the big batch {eq['max_param_change_big_batch']:.2e}; tolerance"
    f" {eq['tolerance']:g}.",
    markdown_table(
      ["method", "max abs param diff", "relative to the change", "check"],
      eq_rows,
    ),
  )


def train_figure(payload: dict[str, Any]) -> Figure:
  """Tokens/s and footprints per k; the largest batch within the budget."""
  fig = Figure(figsize=(11, 3.6))
  axes = fig.subplots(1, 3)
  methods, throughput = payload["methods"], payload["throughput"]
  ks = [r["k"] for r in throughput]
  width = 0.8 / len(methods)
  x = np.arange(len(ks))
  for i, name in enumerate(methods):
    m = [r["methods"][name] for r in throughput]
    tps = [v.get("tokens_per_s") or 0.0 for v in m]
    mem = [v["memory"]["footprint"] / MB for v in m]
    axes[0].bar(x + i * width, tps, width, label=name)
    axes[1].bar(x + i * width, mem, width, label=name)
  budget = payload["args"]["memory_budget_mb"]
  axes[1].axhline(budget, color="gray", ls=":", lw=1, label="budget")
  for ax, title in zip(
    axes[:2], ("tokens/s", "compiled footprint (MB)"), strict=True
  ):
    ax.set_xticks(x + 0.4 - width / 2, [f"k={k}" for k in ks])
    ax.set_title(title, fontsize=9)
  axes[0].legend(fontsize=7)
  names = list(payload["memory_budget"])
  axes[2].bar(
    names, [payload["memory_budget"][n]["effective_batch"] for n in names]
  )
  axes[2].set_title(f"largest batch within {budget:g} MB", fontsize=9)
  axes[2].tick_params(axis="x", labelsize=7)
  figure_title(fig, payload)
  fig.tight_layout()
  return fig


def train_console(payload: dict[str, Any]) -> list[Any]:
  """The throughput table, the equivalence and the memory budget."""
  rows = []
  for r in payload["throughput"]:
    cells = []
    for m in r["methods"].values():
      mem = m["memory"]["footprint"] / MB
      if m["skipped"]:
        cells.append(f"over budget ({mem:.0f} MB)")
      else:
        ratio = m["vs_big_batch"]
        ratio_text = f" ({ratio:.2f}x)" if ratio is not None else ""
        cells.append(f"{m['tokens_per_s']:.0f}{ratio_text}, {mem:.0f} MB")
    rows.append([r["k"], *cells])
  eq, budget_mb = payload["equivalence"], payload["args"]["memory_budget_mb"]
  return [
    console_table(
      "tokens/s (ratio to the big batch), footprint MB",
      ["k", *payload["methods"]],
      rows,
    ),
    *(
      f"max |params - big batch params| after {eq['steps']} steps,"
      f" {name}: {eq[name]['max_abs_diff']:.2e}"
      f" ({'PASS' if eq[name]['pass'] else 'FAIL'})"
      for name in ("accumulate", "MultiSteps")
    ),
    *(
      f"within {budget_mb:g} MB, {name}: effective batch"
      f" {b['effective_batch']} ({b['note']})"
      for name, b in payload["memory_budget"].items()
    ),
  ]
