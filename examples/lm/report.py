"""What the demo prints and draws: the table, the plot, a noise-scale note."""

import pathlib
import textwrap

import numpy as np
from rich.table import Table

from config import Config
from train import RunResult

LABELS = {
  "reference": "big batch",
  "weighted": "accum, weighted",
  "unweighted": "accum, unweighted",
}

# Why the accumulating runs can show more tokens/s than the big batch, and
# why a given run may not: benchmarks/bench_loop.py measures the same
# comparison with medians over interleaved rounds.
TOKENS_PER_S_NOTE = (
  "tokens/s: the accumulating runs push {micro} samples at a time through"
  " the model, the big batch {batch}. On a CPU the big batch pays for {k}x"
  " the activation memory (out of cache), so on a quiet machine a"
  " micro-batch often runs faster per token; the optimizer runs once per"
  " step in both. Timings under other load can flip that order (see"
  " benchmarks/bench_loop.py for medians); every other number here is"
  " deterministic."
)


def make_table(cfg: Config, results: dict[str, RunResult], diffs) -> Table:
  """The summary table: final and held-out loss, distance to the big batch."""
  table = Table(
    title=f"{cfg.steps} steps of {cfg.batch_size} samples"
    f" (every_k={cfg.every_k} x micro_batch={cfg.micro_batch})",
    caption="loss in nats/byte; Δ: max |run - big batch| over all steps",
  )
  for column in ("run", "loss", "held-out", "Δloss", "Δparams", "tokens/s"):
    table.add_column(column, justify="left" if column == "run" else "right")
  for mode, r in results.items():
    table.add_row(
      LABELS[mode],
      f"{r.losses[-1]:.4f}",
      f"{r.heldout:.4f}",
      "-" if mode == "reference" else f"{diffs[mode]['max_abs_dloss']:.1e}",
      "-" if mode == "reference" else f"{diffs[mode]['max_abs_dparams']:.1e}",
      f"{r.tokens_per_s:,.0f}",
    )
  return table


def plot(
  cfg: Config, results: dict[str, RunResult], path: pathlib.Path
) -> None:
  """Loss curves, distance to the big batch (log scale), a tokens/s note."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ref = results["reference"].losses
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8.5), sharex=True)
  fig.suptitle(
    "Byte-level LM on the stdlib: one big batch of"
    f" {cfg.batch_size} vs accumulate({cfg.every_k} x {cfg.micro_batch})"
  )
  # The weighted curve lies on the big-batch one: markers keep it visible.
  every = max(1, len(ref) // 10)
  styles = {
    "reference": dict(linestyle="-", color="C0", linewidth=3, alpha=0.5),
    "weighted": dict(linestyle="--", color="C1", marker="o", markevery=every),
    "unweighted": dict(
      linestyle=":", color="C3", marker="s", markevery=(every // 2, every)
    ),
  }
  for mode, r in results.items():
    steps = np.arange(1, len(r.losses) + 1)
    label = f"{LABELS[mode]} ({r.tokens_per_s:,.0f} tokens/s)"
    top.plot(steps, r.losses, label=label, **styles[mode])
    if mode != "reference":
      bottom.semilogy(
        steps,
        np.maximum(np.abs(r.losses - ref), 1e-9),
        label=LABELS[mode],
        **styles[mode],
      )
  top.set_ylabel("big-batch mean loss (nats/byte)")
  top.legend(loc="upper right")
  bottom.set_ylabel("|loss - big-batch loss|")
  bottom.set_xlabel("optimizer step")
  bottom.legend(loc="center right")
  note = TOKENS_PER_S_NOTE.format(
    micro=cfg.micro_batch, batch=cfg.batch_size, k=cfg.every_k
  )
  fig.text(0.02, 0.01, textwrap.fill(note, 110), fontsize=8, va="bottom")
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(path, dpi=100)
  plt.close(fig)


def interpret_noise_scale(b_crit: float, batch_tokens: float) -> str:
  """One line on what the batch size means next to the critical batch size."""
  if not np.isfinite(b_crit) or b_crit <= 0:
    return (
      "no usable estimate yet (it needs cycles of >= 2 micro-batches"
      " and a clear gradient signal)."
    )
  ratio = batch_tokens / b_crit
  if ratio < 0.5:
    return (
      "well below it, so a larger batch (a larger every_k) would cut"
      " the number of steps almost in proportion."
    )
  if ratio > 2:
    return (
      "well above it, so a larger batch would barely cut the number of"
      " steps, and a smaller one would reach the same loss with less"
      " compute (the estimate grows as the loss falls)."
    )
  return "close to it: the usual balance between steps and compute."
