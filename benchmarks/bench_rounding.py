"""The bias of a bfloat16 accumulator: rounded to nearest against rounded
stochastically (``accumulate(..., rounding="stochastic")``), with float32 as
the reference.

Each case adds k micro-batch gradients into one open cycle of
``optax_accum.accumulate(sgd, k + 1, reduction="sum")`` and compares the
accumulator with the exact float64 sum, element by element: every element is
one draw (its own random bits), ``--elements`` of them per case. Cases:

* ``swamping``: one large gradient (256), then k small ones (0.1): bfloat16's
  spacing at 256 is 2, so rounded to nearest every small gradient is lost;
* ``typical``: k gradients drawn from N(0.003, 0.01²), summed from zero.

Reported per case and accumulator: the mean error of the sum and its
standard error (the errors' standard deviation over sqrt(elements)). Writes
``bench_rounding.json`` and ``bench_rounding.png`` to ``--out`` (default
``benchmarks/results``); ``benchmarks/render.py`` renders the table of
``bench_rounding.md`` from the JSON, as every results page. Nothing is
timed::

  python benchmarks/bench_rounding.py            # a few seconds on a CPU
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import machine_info

import optax_accum

HERE = pathlib.Path(__file__).resolve().parent
ACCUMULATORS = {
  "float32": (jnp.float32, "nearest"),
  "bfloat16, nearest": (jnp.bfloat16, "nearest"),
  "bfloat16, stochastic": (jnp.bfloat16, "stochastic"),
}


def gradients(case: str, k: int, n: int) -> list:
  if case == "swamping":
    return [jnp.full(n, 256.0)] + [jnp.full(n, 0.1)] * k
  keys = jax.random.split(jax.random.PRNGKey(k), k)
  return [jax.random.normal(key, (n,)) * 0.01 + 0.003 for key in keys]


def errors(accumulator: str, grads: list) -> np.ndarray:
  dtype, rounding = ACCUMULATORS[accumulator]
  tx = optax_accum.accumulate(
    optax.sgd(1.0),
    len(grads) + 1,
    accumulator_dtype=dtype,
    rounding=rounding,
    reduction="sum",
  )
  params = jnp.zeros(grads[0].shape)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads:
    _, state = update(g, state, params)
  exact = np.sum([np.asarray(g, np.float64) for g in grads], axis=0)
  return np.asarray(state.acc_grads, np.float64) - exact


def measure(ks: list[int], n: int) -> list[dict]:
  rows = []
  for case in ("swamping", "typical"):
    for k in ks:
      grads = gradients(case, k, n)
      for name in ACCUMULATORS:
        e = errors(name, grads)
        rows.append(
          {
            "case": case,
            "k": k,
            "accumulator": name,
            "mean_error": float(e.mean()),
            "standard_error": float(e.std() / np.sqrt(n)),
            "rms_error": float(np.sqrt(np.mean(e**2))),
          }
        )
  return rows


def plot(payload: dict, path: pathlib.Path) -> None:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  by = {(r["case"], r["k"], r["accumulator"]): r for r in payload["rows"]}
  for ax, case in zip(axes, ("swamping", "typical"), strict=True):
    for i, name in enumerate(ACCUMULATORS):
      ks = payload["ks"]
      x = np.arange(len(ks)) + (i - 1) * 0.25
      mean = [by[case, k, name]["mean_error"] for k in ks]
      se = [4 * by[case, k, name]["standard_error"] for k in ks]
      ax.bar(x, mean, width=0.25, yerr=se, label=name, capsize=3)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xticks(np.arange(len(payload["ks"])), [f"k={k}" for k in ks])
    ax.set_title(f"{case}: mean error of the sum (bars: ±4 standard errors)")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128])
  p.add_argument("--elements", type=int, default=65536)
  p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
  args = p.parse_args()
  payload = {
    "machine": machine_info(),
    "ks": args.ks,
    "elements": args.elements,
    "rows": measure(args.ks, args.elements),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "bench_rounding.json").write_text(
    json.dumps(payload, indent=1) + "\n"
  )
  plot(payload, args.out / "bench_rounding.png")
  print(
    f"wrote {args.out / 'bench_rounding.json'}: benchmarks/render.py makes its page"
  )


if __name__ == "__main__":
  main()
