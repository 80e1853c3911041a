"""What adaptive.py writes: the summary, the tables, the notes, the plot.

Every function works from the runs' results alone (as results.json holds
them), so that tests/test_adaptive_eval.py can check the table and figures
that README.md quotes against the committed results.
"""

import pathlib
from collections.abc import Sequence

from config import BASELINE, EXTRA_RUNS, RUNS


def reach(curve: list[dict], target: float) -> dict | None:
  """The first evaluation at or below `target`, or None."""
  return next((p for p in curve if p["heldout"] <= target), None)


def summarize(runs: dict[int, dict[str, dict]]) -> None:
  """Adds, per seed, what each run needed to reach the baseline's loss."""
  for by_run in runs.values():
    target = by_run[BASELINE]["final_heldout"]
    for result in by_run.values():
      point = reach(result["curve"], target)
      result["target_heldout"] = target
      result["reached"] = point is not None
      result["tokens_to_target"] = None if point is None else point["tokens"]
      result["steps_to_target"] = None if point is None else point["steps"]


def k_path(result: dict) -> str:
  ks = [c["k"] for c in result["cycles"]]
  path = [k for i, k in enumerate(ks) if i == 0 or k != ks[i - 1]]
  return "→".join(str(k) for k in path)


def _per_seed(values: Sequence[str]) -> str:
  return " / ".join(values)


def _tokens(t: float | None) -> str:
  return "not reached" if t is None else f"{t / 1000:.0f}k"


def markdown_table(results: dict) -> str:
  """The table of results.md (and of the README), from the results JSON."""
  runs = {int(seed): by_run for seed, by_run in results["runs"].items()}
  seeds = sorted(runs)
  names = list(runs[seeds[0]])
  lines = [
    "| run | k | held-out loss | optimizer steps | tokens to reach"
    f" {BASELINE}'s loss | steps to reach it | train wall s |",
    "|---|---|---|---|---|---|---|",
  ]
  for name in names:
    per = [runs[seed][name] for seed in seeds]
    lines.append(
      "| "
      + " | ".join(
        [
          name,
          _per_seed([k_path(r) for r in per]),
          _per_seed([f"{r['final_heldout']:.4f}" for r in per]),
          _per_seed([str(r["steps"]) for r in per]),
          _per_seed([_tokens(r["tokens_to_target"]) for r in per]),
          _per_seed(
            [
              "not reached"
              if r["steps_to_target"] is None
              else str(r["steps_to_target"])
              for r in per
            ]
          ),
          _per_seed([f"{r['train_seconds']:.0f}" for r in per]),
        ]
      )
      + " |"
    )
  return "\n".join(lines)


def decisions_table(results: dict) -> str:
  """Every change of k by a controller: when, and what it had just read."""
  lines = [
    "| seed | run | k | after tokens | after steps | tokens per"
    " micro-batch, last cycle | B_simple, tokens | B_simple / mean"
    " micro-batch |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for seed, by_run in results["runs"].items():
    for name, r in by_run.items():
      if not name.startswith("controller"):
        continue
      mean_w = r["budget_tokens"] / results["settings"]["budget"]
      c = r["cycles"]
      for i in range(1, len(c)):
        if c[i]["k"] == c[i - 1]["k"]:
          continue
        # The decision was taken at the end of cycle i - 1.
        end, before = c[i - 1], c[i - 2] if i >= 2 else None
        drawn = end["micro_batches"] - (
          before["micro_batches"] if before else 0
        )
        weight = end["tokens"] - (before["tokens"] if before else 0.0)
        b = end["noise_scale_tokens"]
        lines.append(
          f"| {seed} | {name} | {c[i - 1]['k']}→{c[i]['k']} |"
          f" {_tokens(end['tokens'])} | {end['steps']} |"
          f" {weight / drawn:.0f} | {b:,.0f} | {b / mean_w:.2f} |"
        )
  return "\n".join(lines)


def provenance(results: dict) -> str:
  m, s = results["machine"], results["settings"]
  tokens = " / ".join(
    _tokens(by_run[BASELINE]["budget_tokens"])
    for by_run in results["runs"].values()
  )
  return (
    f"{results['total_seconds']:.0f} s in all on {m['processor']}"
    f" ({m['cpu_count']} cores, shared), {m['backend']} backend, Python"
    f" {m['python']}, jax {m['jax']}, optax {m['optax']}, flax {m['flax']},"
    f" numpy {m['numpy']}; {s['budget']:,} micro-batches of"
    f" {s['micro_batch']} samples per run ({tokens} tokens), seeds"
    f" {' / '.join(results['runs'])}"
  )


def report(results: dict) -> str:
  """results.md: the table, the noise scale, the controllers' decisions."""
  return "\n\n".join(
    [
      markdown_table(results),
      noise_note(results),
      decisions_table(results),
      provenance(results) + ".",
    ]
  )


def noise_note(results: dict) -> str:
  """B_simple at the end of each seed's runs, in tokens and micro-batches."""
  notes = []
  for seed, by_run in results["runs"].items():
    small = by_run["fixed-small"]
    w = small["budget_tokens"] / results["settings"]["budget"]
    b = small["cycles"][-1]["noise_scale_tokens"]
    notes.append(
      f"seed {seed}: B_simple ≈ {b:,.0f} tokens at the end of fixed-small"
      f" ≈ {b / w:.1f} micro-batches of {w:.0f} tokens"
    )
  return "; ".join(notes) + "."


def plot(results: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
  colors = dict(zip(RUNS + EXTRA_RUNS, plt.cm.tab10.colors, strict=False))
  styles = ["-", "--", ":", "-."]
  for n, (seed, by_run) in enumerate(results["runs"].items()):
    style = styles[n % len(styles)]
    for name, r in by_run.items():
      label = f"{name} (seed {seed})"
      for ax, x in zip(axes[:2], ("tokens", "steps"), strict=True):
        ax.plot(
          [p[x] for p in r["curve"][1:]],
          [p["heldout"] for p in r["curve"][1:]],
          style,
          marker="o",
          markersize=3,
          color=colors[name],
          label=label,
        )
      tokens = [c["tokens"] for c in r["cycles"]]
      if name.startswith("controller"):
        axes[2].plot(
          tokens,
          [c["k"] for c in r["cycles"]],
          style,
          color=colors[name],
          label=f"{name} k (seed {seed})",
        )
      if name == "fixed-small":  # the estimate with the most cycles
        w = r["budget_tokens"] / results["settings"]["budget"]
        axes[2].plot(
          tokens,
          [c["noise_scale_tokens"] / w for c in r["cycles"]],
          style,
          color="0.5",
          label=f"B_simple / mean micro-batch, fixed-small (seed {seed})",
        )
  axes[0].set(xlabel="tokens trained on", ylabel="held-out loss (nats/byte)")
  axes[0].set_title("held-out loss vs tokens")
  axes[1].set(xlabel="optimizer steps")
  axes[1].set_title("held-out loss vs optimizer steps")
  axes[2].set(xlabel="tokens trained on", ylabel="micro-batches", yscale="log")
  axes[2].set_title("controllers' k and the noise scale")
  # Zoom on the race to the end; the first evaluations sit far above.
  finals = [
    r["final_heldout"]
    for by_run in results["runs"].values()
    for r in by_run.values()
  ]
  for ax in axes[:2]:
    ax.set_ylim(min(finals) - 0.02, max(finals) + 0.35)
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  axes[2].legend(fontsize=7)
  s = results["settings"]
  fig.suptitle(
    f"Adaptive batch size: {s['budget']} micro-batches of {s['micro_batch']}"
    f" samples per run, lr ∝ √k; {results['machine']['processor']}"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
