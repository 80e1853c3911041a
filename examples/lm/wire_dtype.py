"""The dtype of the deferred reduction on the wire: float32 or bfloat16.

The demo's transformer (``config.Config``), data parallel over 8 simulated
devices: ``jax.vmap`` with ``axis_name="data"`` over a leading device axis,
the engine that runs inside ``shard_map``, in one XLA:CPU program (8 device
threads of XLA:CPU's in-process all-reduce deadlocked on this 2-core
machine under load). Each device's gradient of its share of every
micro-batch, token-weighted, goes to
``optax_accum.accumulate(inner, k, axis_name="data", reduce_dtype=...)``,
which sums the accumulated gradients over the devices once per optimizer
step (the static cycle: ``emit=`` from the loop). With
``reduce_dtype=jnp.bfloat16`` each device's sum is rounded to bfloat16 and
summed in bfloat16, as it would cross devices (half the bytes of float32;
the accumulator itself stays float32). Two runs per seed, from the same
initialization on the same data, one per wire dtype, and the float32 run on
one device (float32's own rounding: its sums run in another order);
reported per seed after ``--steps`` optimizer steps: the held-out losses,
the max |params(bf16) - params(f32)| and the max |params(f32, one device) -
params(f32)|::

  python examples/lm/wire_dtype.py                   # about 3 minutes
  python examples/lm/wire_dtype.py --steps 4 --out /tmp/wire

Writes ``wire_dtype.json`` and ``wire_dtype.md`` to ``--out`` (default
``examples/lm/results``).
"""

import argparse
import json
import pathlib
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_accum

from config import Config
from input_pipeline import load_data, micro_batches, step_batch
from models import TransformerLM
from train import heldout_loss, make_tx, max_abs_diff, mean_token_loss

HERE = pathlib.Path(__file__).resolve().parent
AXIS = "data"
WIRES = {"float32": None, "bfloat16": jnp.bfloat16}


def make_step(graphdef, tx, emit: bool):
  """One micro-batch on every simulated device (``jax.vmap`` over a leading
  device axis, named `AXIS`): each device's gradient of its share into
  `tx`; `emit`: this call ends the cycle (the static cycle)."""

  def local_step(params, state, tokens, lengths):
    def loss_fn(p):
      return mean_token_loss(nnx.merge(graphdef, p), tokens, lengths)

    (_, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, state = tx.update(grads, state, params, weight=count, emit=emit)
    return optax_accum.apply_updates(params, updates, state), state

  return jax.jit(jax.vmap(local_step, axis_name=AXIS), donate_argnums=(0, 1))


def per_device(tree, devices: int):
  """Every leaf stacked `devices` times: each device's own copy."""
  return jax.tree.map(lambda a: jnp.stack([jnp.asarray(a)] * devices), tree)


def run(cfg: Config, data, wire: str, devices: int) -> dict:
  """Trains `cfg.steps` optimizer steps with `wire` on the wire."""
  inner = make_tx(cfg, "reference")  # the demo's clip + adam + schedule
  tx = optax_accum.accumulate(
    inner, cfg.every_k, axis_name=AXIS, reduce_dtype=WIRES[wire]
  )
  model = TransformerLM(cfg, rngs=nnx.Rngs(cfg.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  state = per_device(tx.init(params), devices)
  params = per_device(params, devices)
  steps = [make_step(graphdef, tx, emit) for emit in (False, True)]
  start = time.perf_counter()
  for s in range(cfg.steps):
    batch = step_batch(cfg, data.train, s)
    for i, micro in enumerate(micro_batches(cfg, batch)):
      shares = [a.reshape(devices, -1, *a.shape[1:]) for a in micro]
      params, state = steps[i == cfg.every_k - 1](params, state, *shares)
  params = jax.tree.map(lambda a: np.asarray(a[0]), params)  # device 0's
  seconds = time.perf_counter() - start
  nnx.update(model, params)
  return {
    "params": params,
    "heldout": heldout_loss(model, data.heldout, cfg.batch_size),
    "seconds": seconds,
  }


def markdown(payload: dict) -> str:
  a = payload["args"]
  lines = [
    f"{a['steps']} optimizer steps of k={a['every_k']} micro-batches of"
    f" {a['micro_batch']} samples, {payload['devices']} simulated devices,"
    f" jax {payload['jax']}:",
    "",
    "| seed | held-out loss, float32 wire | held-out loss, bfloat16 wire"
    " | max abs params diff, bf16 vs f32 | f32, one device vs 8 |",
    "|---|---|---|---|---|",
  ]
  for r in payload["seeds"]:
    lines.append(
      f"| {r['seed']} | {r['heldout']['float32']:.4f} |"
      f" {r['heldout']['bfloat16']:.4f} | {r['max_abs_params_diff']:.1e} |"
      f" {r['float32_one_device_params_diff']:.1e} |"
    )
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument("--micro-batch", type=int, default=16)
  parser.add_argument("--seeds", default="0,1", help="comma-separated")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--max-len", type=int, default=Config.max_len)
  parser.add_argument("--d-model", type=int, default=Config.d_model)
  parser.add_argument("--num-layers", type=int, default=Config.num_layers)
  parser.add_argument("--out", default=str(HERE / "results"))
  args = parser.parse_args(argv)
  if args.micro_batch % args.devices:
    parser.error(
      f"--micro-batch must be a multiple of --devices ({args.devices});"
      f" got {args.micro_batch}"
    )
  seeds = []
  for seed in (int(s) for s in args.seeds.split(",")):
    cfg = Config.of_args(args, seed=seed)
    data = load_data(cfg)
    runs = {wire: run(cfg, data, wire, args.devices) for wire in WIRES}
    one_device = run(cfg, data, "float32", 1)
    seeds.append(
      {
        "seed": seed,
        "heldout": {w: r["heldout"] for w, r in runs.items()},
        "max_abs_params_diff": max_abs_diff(
          runs["float32"]["params"], runs["bfloat16"]["params"]
        ),
        "float32_one_device_params_diff": max_abs_diff(
          runs["float32"]["params"], one_device["params"]
        ),
        "seconds": {w: r["seconds"] for w, r in runs.items()},
      }
    )
    print(
      f"seed {seed}: held-out {runs['float32']['heldout']:.4f} (float32 wire)"
      f" vs {runs['bfloat16']['heldout']:.4f} (bfloat16 wire);"
      f" max |Δparams| {seeds[-1]['max_abs_params_diff']:.1e}",
      flush=True,
    )
  payload = {
    "args": vars(args),
    "devices": args.devices,
    "jax": jax.__version__,
    "optax": optax.__version__,
    "seeds": seeds,
  }
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "wire_dtype.json").write_text(json.dumps(payload, indent=1) + "\n")
  (out / "wire_dtype.md").write_text(markdown(payload))
  return payload


if __name__ == "__main__":
  main()
