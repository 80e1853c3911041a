"""The accumulator's dtype: float32, bfloat16 rounded to nearest, bfloat16
rounded stochastically (``rounding="stochastic"``).

The demo's transformer (``config.Config``) on one device, trained with
``optax_accum.flax.Optimizer`` around
``optax_accum.accumulate(inner, k, accumulator_dtype=..., rounding=...)``,
token-weighted micro-batches, from the same initialization on the same data
for the three accumulators; per k and seed, the big-batch training loss
before every optimizer step and the held-out loss at the end. A bfloat16
accumulator holds half the float32 one's bytes; rounded to nearest, every
add drops what falls below half its last place, which the sum of many small
gradients feels most (large k); rounded stochastically, it keeps them on
average::

  python examples/lm/accumulator_dtype.py                 # about 10 minutes
  python examples/lm/accumulator_dtype.py --steps 2 --ks 2 --seeds 0 --out /tmp/acc

Writes ``accumulator_dtype.json``, ``accumulator_dtype.md`` and
``accumulator_dtype.png`` (the loss curves) to ``--out`` (default
``examples/lm/results``).
"""

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

from config import Config
from input_pipeline import load_data, step_batch
from models import TransformerLM
from train import fast, heldout_loss, inner_optimizer, micro_step, run_steps

HERE = pathlib.Path(__file__).resolve().parent
ACCUMULATORS = {
  "float32": (jnp.float32, "nearest"),
  "bfloat16, nearest": (jnp.bfloat16, "nearest"),
  "bfloat16, stochastic": (jnp.bfloat16, "stochastic"),
}


def run(cfg: Config, data, accumulator: str) -> dict:
  from flax import nnx  # noqa: PLC0415

  dtype, rounding = ACCUMULATORS[accumulator]
  tx = optax_accum.accumulate(
    inner_optimizer(cfg),
    cfg.every_k,
    accumulator_dtype=dtype,
    rounding=rounding,
  )
  model = TransformerLM(cfg, rngs=nnx.Rngs(cfg.seed))
  optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  step = fast(micro_step, model, optimizer)
  start = time.perf_counter()
  losses = [
    run_steps(cfg, step, "weighted", step_batch(cfg, data.train, i))[0]
    for i in range(cfg.steps)
  ]
  return {
    "losses": losses,
    "heldout": heldout_loss(model, data.heldout, cfg.batch_size),
    "seconds": time.perf_counter() - start,
  }


def markdown(payload: dict) -> str:
  a = payload["args"]
  lines = [
    f"{a['steps']} optimizer steps of k micro-batches of {a['micro_batch']}"
    f" samples, seeds {a['seeds']}, one CPU device, jax {payload['jax']}:"
    " held-out loss after the last step, median (min-max) over the seeds;"
    " the float32 runs' seed-to-seed spread is the yardstick.",
    "",
    "| k | " + " | ".join(ACCUMULATORS) + " |",
    "|---|" + "---|" * len(ACCUMULATORS),
  ]
  for k, runs in payload["runs"].items():
    cells = []
    for name in ACCUMULATORS:
      h = [r["heldout"] for r in runs[name]]
      cells.append(f"{statistics.median(h):.5f} ({min(h):.5f}-{max(h):.5f})")
    lines.append(f"| {k} | " + " | ".join(cells) + " |")
  lines += ["", "Per seed, bfloat16 minus float32 (held-out loss):", ""]
  lines += ["| k | seed | nearest | stochastic |", "|---|---|---|---|"]
  for k, runs in payload["runs"].items():
    for i, seed in enumerate(payload["seeds"]):
      base = runs["float32"][i]["heldout"]
      near = runs["bfloat16, nearest"][i]["heldout"] - base
      sto = runs["bfloat16, stochastic"][i]["heldout"] - base
      lines.append(f"| {k} | {seed} | {near:+.1e} | {sto:+.1e} |")
  return "\n".join(lines) + "\n"


def plot(payload: dict, path: pathlib.Path) -> None:
  """Per k: the loss curves (top), and each bfloat16 run's loss minus its
  seed's float32 run's (bottom: the curves above overlap)."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  ks = list(payload["runs"])
  fig, axes = plt.subplots(
    2, len(ks), figsize=(6 * len(ks), 7), squeeze=False, sharex=True
  )
  colors = dict(zip(ACCUMULATORS, ("C0", "C3", "C2"), strict=True))
  for col, k in enumerate(ks):
    runs = payload["runs"][k]
    top, bottom = axes[0][col], axes[1][col]
    for name in ACCUMULATORS:
      for i, r in enumerate(runs[name]):
        label = name if i == 0 else None
        top.plot(r["losses"], color=colors[name], alpha=0.7, lw=1, label=label)
        if name != "float32":
          diff = np.subtract(r["losses"], runs["float32"][i]["losses"])
          bottom.plot(diff, color=colors[name], alpha=0.7, lw=1, label=label)
    top.set_title(f"k = {k}")
    top.set_ylabel("training loss (big batch)")
    bottom.set_ylabel("minus the float32 run's")
    bottom.set_xlabel("optimizer step")
    top.legend()
    bottom.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--ks", default="8,32", help="comma-separated")
  parser.add_argument("--micro-batch", type=int, default=4)
  parser.add_argument("--seeds", default="0,1,2", help="comma-separated")
  parser.add_argument("--max-len", type=int, default=Config.max_len)
  parser.add_argument("--d-model", type=int, default=Config.d_model)
  parser.add_argument("--num-layers", type=int, default=Config.num_layers)
  parser.add_argument(
    "--heldout-samples", type=int, default=Config.heldout_samples
  )
  parser.add_argument("--out", default=str(HERE / "results"))
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  payload = {
    "args": vars(args),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "seeds": seeds,
    "runs": {},
  }
  for k in (int(x) for x in args.ks.split(",")):
    runs = {name: [] for name in ACCUMULATORS}
    for seed in seeds:
      cfg = Config.of_args(args, every_k=k, seed=seed)
      data = load_data(cfg)
      for name in ACCUMULATORS:
        runs[name].append(run(cfg, data, name))
        print(
          f"k={k} seed {seed} {name}: held-out {runs[name][-1]['heldout']:.4f}",
          flush=True,
        )
    payload["runs"][str(k)] = runs
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "accumulator_dtype.json").write_text(
    json.dumps(payload, indent=1) + "\n"
  )
  (out / "accumulator_dtype.md").write_text(markdown(payload))
  plot(payload, out / "accumulator_dtype.png")
  return payload


if __name__ == "__main__":
  np.seterr(all="ignore")
  main()
