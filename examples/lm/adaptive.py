"""Adaptive batch size on the LM demo: fixed k, a token schedule, a controller.

The demo's byte-level transformer (models.py) and data (input_pipeline.py),
one stream of micro-batches of real-token-weighted gradients, the same token
budget, initialization and data order for every run. Only the number of
micro-batches per optimizer step (k) differs:

* ``fixed-small``: k = --k-small throughout;
* ``fixed-large``: k = --k-large throughout;
* ``schedule``: ``optax_accum.piecewise_every_k`` of the tokens seen
  (--schedule: fractions of the budget at which k changes);
* ``controller``: ``optax_accum.grow_every_k``, which grows k from the
  measured gradient noise scale (``track_noise_scale=True``).

The learning rate follows k in every run by OLMo-core's square-root rule,
``lr = --lr * sqrt(k / --k-small)``, through ``optax_accum.inner_for_every_k``
(constant within a run for the fixed runs). Two more controller runs (in the
default --runs) isolate its inputs: ``controller-known-w`` is told the mean
micro-batch weight (``micro_batch_weight=``) instead of measuring it over
the run (the cycles that ended with an update), ``controller-uncoupled``
keeps the learning rate constant.
Each run draws ``current_every_k`` micro-batches per cycle, as a data loader
would, and flushes the last partial cycle so that every run trains on
exactly the same tokens. Held-out loss is measured (train.heldout_loss, the
demo's evaluation loop) at the first cycle end after each 1/--evals of the
budget. Settings (config.py) holds every option; adaptive_report.py writes
the table, the notes and the plot.

Writes results.json, results.md (the table) and adaptive.png to --out.
README.md next to this file ("Adaptive batch size") discusses the results.

  python examples/lm/adaptive.py                 # the committed results
  python examples/lm/adaptive.py --budget 16 --micro-batch 2 --out /tmp/a
"""

import argparse
import dataclasses
import json
import math
import os
import pathlib
import platform
import time
from collections.abc import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_accum

from adaptive_report import k_path, plot, report, summarize
from config import BASELINE, EXTRA_RUNS, RUNS, Settings
from input_pipeline import Samples, load_data
from models import TransformerLM
from train import accumulate_state, heldout_loss, mean_token_loss

# The held-out set is evaluated this many samples at a time.
EVAL_BATCH = 64


def make_every_k(s: Settings, run: str, budget_tokens: float):
  """`every_k` of `run`: an int, a token schedule or the controller."""
  if run == "fixed-small":
    return s.k_small
  if run == "fixed-large":
    return s.k_large
  if run == "schedule":
    return optax_accum.piecewise_every_k(
      {fraction * budget_tokens: k for fraction, k in s.schedule},
      initial=s.k_small,
    )
  # The controller needs k >= 2 from the start: one micro-batch per cycle
  # gives no estimate of the gradient noise.
  known_w = budget_tokens / s.budget if run == "controller-known-w" else None
  return optax_accum.grow_every_k(
    s.k_max,
    k_min=s.k_small,
    scale=s.scale,
    min_cycles=s.min_cycles,
    micro_batch_weight=known_w,
  )


def make_tx(s: Settings, run: str, budget_tokens: float):
  """accumulate(inner_for_every_k(clip + Adam at lr(k)), every_k of `run`)."""
  coupled = run != "controller-uncoupled"

  def inner(k):
    lr = s.lr * jnp.sqrt(k / s.k_small) if coupled else s.lr
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))

  every_k = make_every_k(s, run, budget_tokens)
  # The noise scale is tracked in every run (a squared norm per micro-batch):
  # the fixed-small run gives the estimate with the most cycles.
  return optax_accum.accumulate(
    optax_accum.inner_for_every_k(inner), every_k, track_noise_scale=True
  )


@nnx.jit
def micro_step(model, optimizer, tokens, lengths, flush):
  """One micro-batch; the params move only when a cycle ends."""
  grad_fn = nnx.value_and_grad(mean_token_loss, has_aux=True)
  (loss, count), grads = grad_fn(model, tokens, lengths)
  # The loss is a mean over `count` real tokens: weigh it so.
  optimizer.update(model, grads, weight=count, flush=flush)
  return loss, count


def micro_batch(s: Settings, train: Samples, i: int) -> Samples:
  rows = slice(i * s.micro_batch, (i + 1) * s.micro_batch)
  return Samples(train.tokens[rows], train.lengths[rows])


def train_run(s: Settings, run: str, seed: int, data) -> dict:
  """One run over the budget; the curve, the k trajectory, the timings."""
  cfg = s.model_config(seed)
  budget_tokens = float(np.sum(np.maximum(data.train.lengths - 1, 0)))
  model = TransformerLM(cfg, rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(
    model, make_tx(s, run, budget_tokens), wrt=nnx.Param
  )
  marks = [math.ceil(s.budget * (i + 1) / s.evals) for i in range(s.evals)]

  def evaluation(tokens: float, steps: int) -> dict:
    heldout = heldout_loss(model, data.heldout, EVAL_BATCH)
    return {"tokens": tokens, "steps": steps, "heldout": heldout}

  curve = [evaluation(0.0, 0)]
  cycles = []  # one entry per cycle end
  train_seconds = eval_seconds = 0.0
  drawn = 0
  while drawn < s.budget:
    opt_state = optimizer.opt_state
    # What a data loader asks at the start of a cycle.
    k = int(optax_accum.current_every_k(opt_state))
    start = time.perf_counter()
    for i in range(drawn, min(drawn + k, s.budget)):
      flush = jnp.asarray(i == s.budget - 1)
      micro_step(model, optimizer, *micro_batch(s, data.train, i), flush)
    drawn = min(drawn + k, s.budget)
    opt_state = optimizer.opt_state
    seen = float(optax_accum.weight_seen(opt_state))
    train_seconds += time.perf_counter() - start
    step = int(accumulate_state(optimizer).step)
    cycles.append(
      {
        "micro_batches": drawn,
        "tokens": seen,
        "steps": step,
        "k": k,
        "noise_scale_tokens": float(optax_accum.noise_scale(opt_state)),
      }
    )
    if marks and drawn >= marks[0]:
      while marks and drawn >= marks[0]:
        marks.pop(0)
      start = time.perf_counter()
      curve.append(evaluation(seen, step))
      eval_seconds += time.perf_counter() - start
  return {
    "curve": curve,
    "cycles": cycles,
    "final_heldout": curve[-1]["heldout"],
    "steps": cycles[-1]["steps"],
    "tokens": cycles[-1]["tokens"],
    "budget_tokens": budget_tokens,
    "final_k": cycles[-1]["k"],
    "train_seconds": train_seconds,
    "eval_seconds": eval_seconds,
  }


def _cpu_name() -> str:
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine() -> dict:
  return {
    "platform": platform.platform(),
    "processor": _cpu_name(),
    "cpu_count": os.cpu_count(),
    "load_average_at_start": os.getloadavg(),
    "backend": jax.default_backend(),
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jax.lib.__version__,
    "optax": optax.__version__,
    "flax": flax.__version__,
    "numpy": np.__version__,
    "optax_accum": optax_accum.__version__,
  }


def evaluate(s: Settings, out: pathlib.Path) -> dict:
  """All runs for all seeds; writes results.json, results.md, adaptive.png."""
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  names = s.runs
  results = {"settings": dataclasses.asdict(s), "machine": machine()}
  runs = {}
  start = time.perf_counter()
  with jax.default_matmul_precision("highest"):
    for seed in s.seeds:
      data = load_data(s.model_config(seed))
      runs[seed] = {}
      for name in names:
        r = train_run(s, name, seed, data)
        runs[seed][name] = r
        print(
          f"seed {seed} {name:<21} held-out {r['final_heldout']:.4f}"
          f" steps {r['steps']:>5} k {k_path(r):<12}"
          f" {r['train_seconds']:.0f} s",
          flush=True,
        )
  summarize(runs)
  results["runs"] = {str(seed): by_run for seed, by_run in runs.items()}
  results["total_seconds"] = time.perf_counter() - start
  text = report(results)
  (out / "results.json").write_text(json.dumps(results, indent=1))
  (out / "results.md").write_text(text + "\n")
  plot(results, out / "adaptive.png")
  print(text, f"wrote {out}", sep="\n")
  return results


def parse_args(
  argv: Sequence[str] | None = None,
) -> tuple[Settings, pathlib.Path]:
  d = Settings()
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  add = parser.add_argument
  add("--budget", type=int, default=d.budget, help="micro-batches per run")
  add("--micro-batch", type=int, default=d.micro_batch, help="samples each")
  add("--max-len", type=int, default=d.max_len, help="bytes per sample")
  add("--d-model", type=int, default=d.d_model, help="model width")
  add("--num-layers", type=int, default=d.num_layers, help="blocks")
  add("--lr", type=float, default=d.lr, help="Adam's lr at k = --k-small")
  add("--k-small", type=int, default=d.k_small, help="fixed-small's k")
  add("--k-large", type=int, default=d.k_large, help="fixed-large's k")
  add("--k-max", type=int, default=d.k_max, help="the controller's k_max")
  add(
    "--schedule",
    default=",".join(f"{f:g}:{k}" for f, k in d.schedule),
    help="FRACTION:K,...: k from that fraction of the token budget on",
  )
  add("--min-cycles", type=int, default=d.min_cycles, help="controller")
  add("--scale", type=float, default=d.scale, help="controller's target c")
  add("--evals", type=int, default=d.evals, help="held-out evaluations")
  add("--heldout-samples", type=int, default=d.heldout_samples)
  add("--seeds", default=",".join(map(str, d.seeds)), help="comma-separated")
  add(
    "--runs",
    default=",".join(d.runs),
    help=f"comma-separated, from {','.join(RUNS + EXTRA_RUNS)}",
  )
  add(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("examples/lm/results"),
    help="where results.json, results.md and adaptive.png go",
  )
  args = parser.parse_args(argv)
  try:
    schedule = tuple(
      (float(f), int(k))
      for f, k in (item.split(":") for item in args.schedule.split(","))
    )
    seeds = tuple(int(x) for x in args.seeds.split(","))
  except ValueError as e:
    parser.error(f"--schedule or --seeds: {e}")
  # Every other option is the Settings field of the same name.
  fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)}
  runs = tuple(args.runs.split(","))
  s = Settings(
    **(fields | {"schedule": schedule, "seeds": seeds, "runs": runs})
  )
  if min(s.budget, s.micro_batch, s.evals, s.min_cycles) < 1:
    parser.error("--budget, --micro-batch, --evals, --min-cycles must be >= 1")
  unknown = set(s.runs) - set(RUNS + EXTRA_RUNS)
  if unknown or not {BASELINE, "fixed-small"} <= set(s.runs):
    parser.error(
      f"--runs: unknown {sorted(unknown)}, or {BASELINE} or fixed-small"
      f" missing (both needed), in {args.runs!r}"
    )
  if not 2 <= s.k_small <= s.k_large <= s.k_max:
    parser.error("need 2 <= --k-small <= --k-large <= --k-max")
  return s, args.out


def main(argv: Sequence[str] | None = None) -> dict:
  settings, out = parse_args(argv)
  return evaluate(settings, out)


if __name__ == "__main__":
  main()
