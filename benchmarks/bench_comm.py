"""Cross-device communication per optimizer step: reduce every micro-batch, or once.

Data-parallel training of an MLP on ``--devices`` simulated host devices
(one mesh axis ``data``, params replicated, each device its own slice of
every micro-batch), ``k`` micro-batches per optimizer step, three recipes:

* ``gspmd``: ``jit`` with the batch sharded over ``data`` and
  ``optax_accum.accumulate(inner, k)``; XLA all-reduces every micro-batch
  gradient (the usual data-parallel step);
* ``psum_each``: ``shard_map``, ``lax.pmean`` of each micro-batch gradient,
  then ``accumulate(inner, k)``: the same traffic, written by hand;
* ``axis_name``: ``shard_map``, each device's local gradient into
  ``accumulate(inner, k, axis_name="data")``: one reduction per step, in the
  conditional branch that emits the update.

Bytes come from the compiled HLO of the micro-step (``.compile().as_text()``):
each ``all-reduce`` op's payload (the bytes of the buffers it reduces, per
device) counts once per micro-batch when it runs on every call, and once per
optimizer step when it sits inside a branch of a ``conditional`` (the
emitting branch runs once per cycle). A ring all-reduce moves about
``2 (n - 1) / n`` times the payload per device.

Time is one optimizer step (``k`` micro-step calls, params and state donated,
``block_until_ready`` at the end), after warm-up, medians over rounds in
which the recipes take turns (the first recipe rotates). All three recipes
compute the same update; the script checks that their params agree.

On simulated CPU devices an all-reduce is a memory copy inside one process,
so the time ratio understates what a network would show: the bytes column is
the portable result.

Usage::

  python benchmarks/bench_comm.py                 # ~1-2 minutes
  python benchmarks/bench_comm.py --width 2048 --ks 1,4,16,64
"""

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any


def _int_list(text: str) -> list[int]:
  values = [int(v) for v in text.split(",") if v.strip()]
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
  return values


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--devices",
    type=int,
    default=8,
    help="simulated host devices (sets XLA_FLAGS unless already set)",
  )
  parser.add_argument(
    "--ks",
    type=_int_list,
    default=[1, 4, 16],
    help="micro-batches per optimizer step, comma-separated (default 1,4,16)",
  )
  parser.add_argument(
    "--width",
    type=int,
    default=1024,
    help="MLP width: params = 2 * width^2 + 2 * width floats",
  )
  parser.add_argument(
    "--per-device-batch",
    type=int,
    default=8,
    help="examples per device per micro-batch",
  )
  parser.add_argument("--rounds", type=int, default=5, help="timed rounds")
  parser.add_argument("--warmup", type=int, default=1, help="warm-up rounds")
  parser.add_argument(
    "--out", default="bench_out", help="output folder (JSON, Markdown, PNG)"
  )
  return parser.parse_args(argv)


RECIPES = ("gspmd", "psum_each", "axis_name")
BASELINE = "psum_each"

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")
_CALLEE = re.compile(
  r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)"
  r"=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
# Counted (not sized) so that a change of lowering does not go unnoticed.
_OTHER_COLLECTIVES = (
  "all-gather",
  "reduce-scatter",
  "collective-permute",
  "all-to-all",
)
_ITEMSIZE = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}


def _shape_and_opcode(rest: str) -> tuple[str, str]:
  """Splits '(f32[2], s32[]) all-reduce(...)' into shape and opcode."""
  if rest.startswith("("):
    depth, end = 0, len(rest)
    for end, char in enumerate(rest, start=1):  # noqa: B007 (used after)
      depth += {"(": 1, ")": -1}.get(char, 0)
      if depth == 0:
        break
    shape, tail = rest[:end], rest[end:]
  else:
    shape, _, tail = rest.partition(" ")
  return shape, tail.strip().split("(", 1)[0]


def _array_bytes(shape: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    size = 1
    for d in dims.split(","):
      if d:
        size *= int(d)
    total += size * _ITEMSIZE.get(dtype, 4)
  return total


def all_reduce_traffic(hlo_text: str) -> dict[str, int]:
  """All-reduce ops and payload bytes of a compiled module, split into code
  that runs on every call and code inside a branch of a conditional, and
  the number of other collective ops (none in these data-parallel steps)."""
  comps: dict[str, dict[str, list]] = {}
  entry = current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
      comps[current] = {"reduces": [], "calls": [], "others": 0}
      if line.startswith("ENTRY"):
        entry = current
      continue
    inst = _INSTRUCTION.match(line)
    if current is None or not inst:
      continue
    shape, opcode = _shape_and_opcode(inst.group(1))
    if opcode in ("all-reduce", "all-reduce-start"):
      comps[current]["reduces"].append(_array_bytes(shape))
    elif opcode.split("-start")[0] in _OTHER_COLLECTIVES:
      comps[current]["others"] += 1
    comps[current]["calls"] += [(c, False) for c in _CALLEE.findall(line)]
    branches = _BRANCHES.search(line)
    if branches:
      comps[current]["calls"] += [
        (c.strip().lstrip("%"), True) for c in branches.group(1).split(",")
      ]
  traffic = {
    "always_ops": 0,
    "always_bytes": 0,
    "branch_ops": 0,
    "branch_bytes": 0,
    "other_collective_ops": 0,
  }

  def visit(name: str, in_branch: bool, seen: frozenset) -> None:
    if name in seen or name not in comps:
      return
    where = "branch" if in_branch else "always"
    traffic["other_collective_ops"] += comps[name]["others"]
    for nbytes in comps[name]["reduces"]:
      traffic[f"{where}_ops"] += 1
      traffic[f"{where}_bytes"] += nbytes
    for callee, is_branch in comps[name]["calls"]:
      visit(callee, in_branch or is_branch, seen | {name})

  if entry is not None:
    visit(entry, False, frozenset())
  return traffic


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse_args(argv)
  # Before JAX starts its backend.
  if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()

  import jax
  import jax.numpy as jnp
  import matplotlib
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  from rich.progress import Progress

  import optax_accum

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from _common import (
    fmt,
    machine_info,
    machine_line,
    markdown_table,
    median,
    timed_call,
    write_outputs,
  )

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  n_dev = jax.device_count()
  mesh = jax.make_mesh((n_dev,), ("data",), axis_types=(AxisType.Auto,))
  replicated = NamedSharding(mesh, P())
  by_device = NamedSharding(mesh, P("data"))
  width, batch = args.width, args.per_device_batch * n_dev

  def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
      "w1": jax.random.normal(k1, (width, width)) / np.sqrt(width),
      "b1": jnp.zeros(width),
      "w2": jax.random.normal(k2, (width, width)) / np.sqrt(width),
      "b2": jnp.zeros(width),
    }

  def loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None])
    return jnp.mean((h @ params["w2"] + params["b2"][None] - y) ** 2)

  # SGD with momentum: linear in the gradient, so the recipes' params can be
  # compared tightly at the end (adam's normalisation would hide errors).
  inner = optax.sgd(1e-2, momentum=0.9)
  # The fields of the state holding this device's own sums in a cycle.
  local_fields = ("acc_grads", "acc_weight", "noise_sq_norm_sum", "noise_count")

  def build(recipe: str, k: int):
    """(jitted micro-step, params, state) for one recipe."""
    params = jax.device_put(init_params(), replicated)
    if recipe == "gspmd":
      tx = optax_accum.accumulate(inner, k)

      def gspmd_step(params, state, x, y):
        updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

      state = jax.jit(
        tx.init, out_shardings=optax_accum.state_shardings(tx, params)
      )(params)
      return jax.jit(gspmd_step, donate_argnums=(0, 1)), params, state

    deferred = recipe == "axis_name"
    tx = optax_accum.accumulate(
      inner, k, axis_name="data" if deferred else None
    )
    # With a gradient reduced every micro-batch the whole state is the same
    # on every device: replicated.
    fields = local_fields if deferred else ()
    specs = optax_accum.AccumulateState(
      **{
        f: P("data") if f in fields else P()
        for f in optax_accum.AccumulateState._fields
      }
    )

    def per_device(state, fn):
      return state._replace(
        **{f: jax.tree.map(fn, getattr(state, f)) for f in fields}
      )

    def local_step(params, state, x, y):
      state = per_device(state, lambda a: a[0])
      # Varying params: jax.grad returns the local gradient instead of
      # all-reducing it itself on every micro-batch.
      grad = jax.grad(loss)(lax.pcast(params, "data", to="varying"), x, y)
      if not deferred:
        grad = lax.pmean(grad, "data")
      updates, state = tx.update(grad, state, params)
      params = optax.apply_updates(params, updates)
      return params, per_device(state, lambda a: a[None])

    init = jax.jit(
      jax.shard_map(
        lambda p: per_device(tx.init(p), lambda a: a[None]),
        mesh=mesh,
        in_specs=P(),
        out_specs=specs,
      )
    )
    step = jax.jit(
      jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data")),
        out_specs=(P(), specs),
      ),
      donate_argnums=(0, 1),
    )
    return step, params, init(params)

  rng = np.random.default_rng(0)
  micro = [
    jax.device_put(
      (
        rng.normal(size=(batch, width)).astype(np.float32),
        rng.normal(size=(batch, width)).astype(np.float32),
      ),
      by_device,
    )
    for _ in range(max(args.ks))
  ]

  param_bytes = sum(
    int(p.size) * p.dtype.itemsize for p in jax.tree.leaves(init_params())
  )
  results: dict[tuple[str, int], dict[str, Any]] = {}
  runs: dict[tuple[str, int], list] = {}
  total = len(RECIPES) * len(args.ks) * (1 + args.warmup + args.rounds)
  with Progress(transient=False) as progress:
    task = progress.add_task("compile", total=total)
    for k in args.ks:
      for recipe in RECIPES:
        step, params, state = build(recipe, k)
        text = step.lower(params, state, *micro[0]).compile().as_text()
        traffic = all_reduce_traffic(text)
        results[recipe, k] = {
          "recipe": recipe,
          "k": k,
          **traffic,
          "ops_per_step": k * traffic["always_ops"] + traffic["branch_ops"],
          "bytes_per_step": (
            k * traffic["always_bytes"] + traffic["branch_bytes"]
          ),
          "times": [],
        }
        runs[recipe, k] = [step, params, state]
        progress.advance(task)

    def one_step(recipe, k):
      step, params, state = runs[recipe, k]
      seconds = 0.0
      for i in range(k):
        t, (params, state) = timed_call(step, params, state, *micro[i])
        seconds += t
      runs[recipe, k][1:] = [params, state]
      return seconds

    for r in range(args.warmup + args.rounds):
      progress.update(
        task,
        description="warm-up"
        if r < args.warmup
        else f"round {r - args.warmup + 1}/{args.rounds}",
      )
      for k in args.ks:
        order = RECIPES[r % len(RECIPES) :] + RECIPES[: r % len(RECIPES)]
        for recipe in order:
          seconds = one_step(recipe, k)
          if r >= args.warmup:
            results[recipe, k]["times"].append(seconds)
          progress.advance(task)

  # Same data, same maths: the three recipes must reach the same params.
  for k in args.ks:
    finals = [jax.device_get(runs[recipe, k][1]) for recipe in RECIPES]
    for other in finals[1:]:
      for a, b in zip(
        jax.tree.leaves(finals[0]), jax.tree.leaves(other), strict=True
      ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

  rows, table = [], []
  for k in args.ks:
    base = results[BASELINE, k]
    for recipe in RECIPES:
      res = results[recipe, k]
      res["time_median_s"] = median(res["times"])
      res["bytes_ratio_vs_baseline"] = (
        res["bytes_per_step"] / base["bytes_per_step"]
        if base["bytes_per_step"]
        else float("nan")
      )
      res["time_ratio_vs_baseline"] = res["time_median_s"] / median(
        base["times"]
      )
      rows.append(res)
      table.append(
        [
          recipe,
          k,
          res["ops_per_step"],
          fmt(res["bytes_per_step"] / 2**20, 2),
          fmt(res["bytes_ratio_vs_baseline"], 3),
          fmt(res["time_median_s"] * 1e3, 1),
          fmt(res["time_ratio_vs_baseline"], 2),
        ]
      )
  info = machine_info()
  markdown = (
    "# All-reduce traffic per optimizer step\n\n"
    f"{machine_line(info)}\n\n"
    f"{n_dev} devices, MLP width {width} "
    f"({param_bytes / 2**20:.2f} MiB of float32 params), "
    f"{args.per_device_batch} examples per device per micro-batch, "
    f"SGD with momentum; medians of {args.rounds} rounds. Payload = bytes of the "
    f"buffers all-reduced per device; ratios against `{BASELINE}`.\n\n"
    + markdown_table(
      [
        "recipe",
        "k",
        "all-reduces / step",
        "payload MiB / step",
        "payload ratio",
        "ms / step",
        "time ratio",
      ],
      table,
    )
  )
  others = sum(r["other_collective_ops"] for r in rows)
  if others:
    markdown += (
      f"\nNote: {others} collective ops other than all-reduce were found"
      " (see the JSON); their bytes are not counted above.\n"
    )
  fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
  for recipe in RECIPES:
    ks = list(args.ks)
    ax_bytes.plot(
      ks,
      [results[recipe, k]["bytes_per_step"] / 2**20 for k in ks],
      marker="o",
      label=recipe,
    )
    ax_time.plot(
      ks,
      [results[recipe, k]["time_median_s"] * 1e3 for k in ks],
      marker="o",
      label=recipe,
    )
  for ax, label in (
    (ax_bytes, "all-reduce payload per step (MiB)"),
    (ax_time, "time per optimizer step (ms)"),
  ):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (micro-batches per step)")
    ax.set_ylabel(label)
    ax.legend()
  fig.suptitle(f"{n_dev} host devices, {param_bytes / 2**20:.1f} MiB params")
  payload = {
    "benchmark": "bench_comm",
    "machine": info,
    "config": {**vars(args), "devices": n_dev, "param_bytes": param_bytes},
    "results": rows,
  }
  paths = write_outputs(args.out, "bench_comm", payload, markdown, fig)
  print(markdown)
  print("wrote", ", ".join(str(p) for p in paths))
  return 0


if __name__ == "__main__":
  sys.exit(main())
