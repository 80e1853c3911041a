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
micro-batch weight (``micro_batch_weight=``) instead of measuring it from
the last cycle, ``controller-uncoupled`` keeps the learning rate constant. Each run draws ``current_every_k`` micro-batches per cycle, as a
data loader would, and flushes the last partial cycle so that every run
trains on exactly the same tokens. Held-out loss is measured at the first
cycle end after each 1/--evals of the budget.

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

from config import Config
from input_pipeline import Samples, load_data
from models import TransformerLM
from train import accumulate_state, mean_token_loss, token_loss_sum

RUNS = ("fixed-small", "fixed-large", "schedule", "controller")
EXTRA_RUNS = ("controller-known-w", "controller-uncoupled")
BASELINE = "fixed-large"  # the others race to its final held-out loss


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that determines the evaluation (one seed per entry)."""

  budget: int = 1600  # micro-batches per run
  micro_batch: int = 4  # samples per micro-batch
  max_len: int = 128
  d_model: int = 64
  num_layers: int = 2
  lr: float = 2e-3  # Adam's learning rate at k = k_small
  k_small: int = 2
  k_large: int = 8
  k_max: int = 16
  schedule: tuple[tuple[float, int], ...] = ((0.25, 4), (0.5, 8))
  min_cycles: int = 20
  scale: float = 1.0
  evals: int = 16
  heldout_samples: int = 256
  seeds: tuple[int, ...] = (0, 1)
  runs: tuple[str, ...] = RUNS + EXTRA_RUNS

  def model_config(self, seed: int) -> Config:
    # One "step" of the demo's Config = one micro-batch of this stream.
    return Config(
      steps=self.budget,
      every_k=1,
      micro_batch=self.micro_batch,
      max_len=self.max_len,
      d_model=self.d_model,
      num_layers=self.num_layers,
      heldout_samples=self.heldout_samples,
      seed=seed,
    )


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


@nnx.jit
def eval_sums(model, tokens, lengths):
  return token_loss_sum(model, tokens, lengths)


def heldout_loss(model, samples: Samples, chunk: int = 64) -> float:
  total, count = 0.0, 0.0
  for start in range(0, len(samples.lengths), chunk):
    tokens = samples.tokens[start : start + chunk]
    lengths = samples.lengths[start : start + chunk]
    missing = chunk - len(lengths)  # one compiled shape: pad empty rows
    tokens = np.pad(tokens, [(0, missing), (0, 0)])
    lengths = np.pad(lengths, [(0, missing)])
    s, c = eval_sums(model, tokens, lengths)
    total, count = total + float(s), count + float(c)
  return total / count


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
  curve = [
    {"tokens": 0.0, "steps": 0, "heldout": heldout_loss(model, data.heldout)}
  ]
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
      curve.append(
        {
          "tokens": seen,
          "steps": step,
          "heldout": heldout_loss(model, data.heldout),
        }
      )
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


# ---------------------------------------------------------------------------
# Summary, table, plot.
# ---------------------------------------------------------------------------


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
  s = Settings(
    budget=args.budget,
    micro_batch=args.micro_batch,
    max_len=args.max_len,
    d_model=args.d_model,
    num_layers=args.num_layers,
    lr=args.lr,
    k_small=args.k_small,
    k_large=args.k_large,
    k_max=args.k_max,
    schedule=schedule,
    min_cycles=args.min_cycles,
    scale=args.scale,
    evals=args.evals,
    heldout_samples=args.heldout_samples,
    seeds=seeds,
    runs=tuple(args.runs.split(",")),
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
