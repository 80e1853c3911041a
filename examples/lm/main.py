"""A byte-level transformer on the Python standard library, trained three ways.

One initialization, one data order, three optimizers (Flax NNX): one big
batch per step (``reference``); ``optax_accum.accumulate`` over micro-batches
with ``weight=`` their real-token count (``weighted``, matches the reference
to float32 rounding); the same without ``weight=`` (``unweighted``, the
classic bug). Then (``--resume-check``, on by default) it saves model and
optimizer with Orbax in the middle of an accumulation cycle, restores into
fresh objects, continues, and checks that the result is bitwise identical.
README.md next to this file explains the output.

  python examples/lm/main.py            # about 2 minutes on a 2-core CPU
  python examples/lm/main.py --steps 20 --every-k 2 --micro-batch 4 --out /tmp/x

Files: config.py (Config), input_pipeline.py (data), models.py (the
transformer), checkpointing.py (Orbax), train.py (steps and training loop),
report.py (table and plot), main.py (this command line).
"""

import argparse
import dataclasses
import json
import pathlib
import time
from collections.abc import Sequence

import jax
import numpy as np
from rich.console import Console
from rich.progress import (
  BarColumn,
  MofNCompleteColumn,
  Progress,
  TextColumn,
  TimeElapsedColumn,
)

from config import Config
from input_pipeline import load_data
from planning import GLOBAL_BATCH, plan, plan_in_subprocess
from report import interpret_noise_scale, make_table, plot
from train import (
  LOSS_ATOL,
  MODES,
  PARAMS_ATOL,
  compare,
  resume_check,
  train,
  unweighted_overweight,
)


def run_demo(
  cfg: Config,
  out: pathlib.Path,
  *,
  check_resume: bool = True,
  console: Console | None = None,
) -> dict:
  """Trains the three runs, writes the table, plot and JSON; returns them."""
  console = Console() if console is None else console
  # Exact fp32 matmuls on every backend (GPUs default to TF32 for float32).
  with jax.default_matmul_precision("highest"):
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    data = load_data(cfg)
    console.print(
      f"{len(data.train.lengths)} training samples from the standard"
      f" library ({time.perf_counter() - start:.1f} s to load), backend:"
      f" {jax.default_backend()}"
    )
    results = {}
    with Progress(
      TextColumn("{task.description:<10}"),
      BarColumn(),
      MofNCompleteColumn(),
      TextColumn("loss {task.fields[loss]:.3f}"),
      TextColumn("{task.fields[tok_s]:>8,.0f} tokens/s"),
      TimeElapsedColumn(),
      console=console,
    ) as progress:
      for mode in MODES:
        results[mode] = train(cfg, data, mode, progress)
    diffs = compare(results)
    console.print(make_table(cfg, results, diffs))

    weighted = results["weighted"]
    matches = (
      diffs["weighted"]["max_abs_dloss"] <= LOSS_ATOL
      and diffs["weighted"]["max_abs_dparams"] <= PARAMS_ATOL
    )
    overweight = unweighted_overweight(cfg, data.train)
    console.print(
      f"weighted accumulation matches the big batch (|Δ| <= {LOSS_ATOL:g}):"
      f" {'yes' if matches else 'NO'}. Without weights a token of a step's"
      f" shortest micro-batch counts {np.mean(overweight):.1f}x (up to"
      f" {np.max(overweight):.1f}x) its big-batch weight, and the run drifts"
      f" off the reference by up to {diffs['unweighted']['max_abs_dloss']:.1e}"
      " in loss."
    )
    console.print(
      f"critical batch size (gradient noise scale): ~{weighted.noise_scale:,.0f}"
      f" tokens; this run used ~{weighted.batch_tokens:,.0f} real tokens"
      " per step,"
      f" {interpret_noise_scale(weighted.noise_scale, weighted.batch_tokens)}"
    )
    resume = None
    if check_resume:
      resume = resume_check(cfg, data, out / "checkpoints")
      console.print(
        f"resume check: saved after {resume['saved_after_micro_batches']}"
        f" micro-batches (micro_step {resume['micro_step_at_save']} of"
        f" {cfg.every_k}), restored into fresh objects, ran to"
        f" {resume['micro_batches_total']}: bitwise identical ="
        f" {resume['bitwise_identical']}"
      )
    plot(cfg, results, out / "loss_curves.png")
    summary = {
      "config": dataclasses.asdict(cfg),
      "backend": jax.default_backend(),
      "runs": {
        mode: {
          "final_loss": float(r.losses[-1]),
          "heldout_loss": r.heldout,
          "seconds": r.seconds,
          "tokens_per_s": r.tokens_per_s,
          "batch_tokens": r.batch_tokens,
          **diffs[mode],
        }
        for mode, r in results.items()
      },
      "weighted_matches_reference": bool(matches),
      "unweighted_overweight_mean": float(np.mean(overweight)),
      "unweighted_overweight_max": float(np.max(overweight)),
      "noise_scale_tokens": weighted.noise_scale,
      "resume_check": resume,
      "total_seconds": time.perf_counter() - start,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    console.print(
      f"wrote {out / 'loss_curves.png'} and {out / 'results.json'}"
      f" ({summary['total_seconds']:.0f} s in all)"
    )
  return summary


def parse_args(
  argv: Sequence[str] | None = None,
) -> tuple[Config, argparse.Namespace]:
  defaults = Config()
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--steps", type=int, default=defaults.steps, help="optimizer steps per run"
  )
  parser.add_argument(
    "--every-k",
    type=int,
    default=defaults.every_k,
    help="micro-batches per optimizer step",
  )
  parser.add_argument(
    "--micro-batch",
    type=int,
    default=defaults.micro_batch,
    help="samples per micro-batch",
  )
  parser.add_argument(
    "--max-len",
    type=int,
    default=defaults.max_len,
    help="bytes per sample (longer blocks are cut)",
  )
  parser.add_argument(
    "--warmup-steps",
    type=int,
    default=defaults.warmup_steps,
    help="linear learning-rate warm-up, in optimizer steps",
  )
  parser.add_argument(
    "--d-model",
    type=int,
    default=defaults.d_model,
    help="model width (a multiple of the 4 heads)",
  )
  parser.add_argument(
    "--num-layers",
    type=int,
    default=defaults.num_layers,
    help="transformer blocks",
  )
  parser.add_argument(
    "--seed",
    type=int,
    default=defaults.seed,
    help="initialization and data order",
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("demo_out"),
    help="where the plot, JSON and checkpoints go",
  )
  parser.add_argument(
    "--plan",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="then plan a scaled-up run (planning.py) for this machine and one H100",
  )
  parser.add_argument(
    "--resume-check",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="check an Orbax resume mid-cycle",
  )
  args = parser.parse_args(argv)
  for name in (
    "steps",
    "every_k",
    "micro_batch",
    "max_len",
    "d_model",
    "num_layers",
  ):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  cfg = dataclasses.replace(
    defaults,
    steps=args.steps,
    every_k=args.every_k,
    micro_batch=args.micro_batch,
    max_len=args.max_len,
    warmup_steps=args.warmup_steps,
    d_model=args.d_model,
    num_layers=args.num_layers,
    seed=args.seed,
  )
  if cfg.warmup_steps < 0:
    parser.error("--warmup-steps must be >= 0")
  if cfg.d_model % cfg.num_heads:
    parser.error(f"--d-model must be a multiple of {cfg.num_heads} (heads)")
  return cfg, args


def print_plans(cfg: Config, console: Console) -> None:
  """The accumulation of this model at GLOBAL_BATCH sequences a step,
  planned by compiling (planning.py): for this machine, then for one H100."""
  console.print(
    f"\nPlanning a scaled-up run ({GLOBAL_BATCH} sequences per optimizer"
    " step) with optax_accum.plan_micro_batch: compiled, never run."
  )
  console.print(str(plan(cfg, None, GLOBAL_BATCH)), markup=False)
  h100 = plan_in_subprocess("h100", GLOBAL_BATCH, cfg)
  console.print(h100, markup=False)


def main(argv: Sequence[str] | None = None) -> dict:
  cfg, args = parse_args(argv)
  summary = run_demo(cfg, args.out, check_resume=args.resume_check)
  if args.plan:
    print_plans(cfg, Console())
  return summary


if __name__ == "__main__":
  main()
