"""End-to-end training of a tiny transformer language model with accumulation.

A decoder-only transformer (plain JAX, defined below) learns a synthetic
language: token sequences drawn from a fixed random sparse bigram table, so
nothing is downloaded and the loss visibly falls. For each number of
micro-batches per step ``k`` the same optimizer steps (``k`` micro-batches of
``--micro-batch`` sequences each) are trained with:

* ``accumulate``: ``optax_accum.accumulate(opt, k)``, ``k`` jitted calls;
* ``MultiSteps``: ``optax.MultiSteps(opt, k)``, ``k`` jitted calls;
* ``big batch``: the plain optimizer on one batch of ``k`` micro-batches, if
  its compiled footprint fits ``--memory-budget-mb``;
* ``microbatch``: ``optax_accum.microbatch`` (in-step micro-batching, a
  ``lax.scan`` over the ``k`` micro-batches inside one jitted step).

Reported: tokens/s (medians of interleaved rounds, warm-up first) and its
ratio to the big batch, the compiled footprint (argument + temp + output -
alias bytes of ``memory_analysis()``), the largest batch that fits the memory
budget with each method (estimated from compiled footprints, never run), and
an equivalence check: max |params difference| between ``accumulate`` (and
``MultiSteps``) and the big batch after a few optimizer steps on the same
data.

Usage::

  python benchmarks/bench_train.py                   # defaults, ~2 minutes
  python benchmarks/bench_train.py --memory-budget-mb 64 --ks 1,4,16,64
"""

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
  MB,
  add_run_arguments,
  compiled_memory,
  fmt,
  fmt_spread,
  interleaved,
  machine_info,
  machine_line,
  markdown_table,
  median,
  spread,
  timed_call,
  tree_bytes,
  write_outputs,
)
from matplotlib.figure import Figure
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import optax_accum

HAS_MICROBATCH = hasattr(optax_accum, "microbatch")
METHODS = ("accumulate", "MultiSteps", "big batch") + (
  ("microbatch",) if HAS_MICROBATCH else ()
)
# Multi-call methods run k jitted calls per optimizer step.
MULTI_CALL = ("accumulate", "MultiSteps")


# ----------------------------------------------------------------------------
# The model: a small decoder-only transformer in plain JAX.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab: int = 256
  seq_len: int = 64
  d_model: int = 128
  layers: int = 2
  heads: int = 4
  d_ff: int = 512


def init_params(key: jax.Array, cfg: ModelConfig) -> dict[str, Any]:
  keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))

  def dense(fan_in, fan_out):
    return jax.random.normal(next(keys), (fan_in, fan_out)) / math.sqrt(fan_in)

  d = cfg.d_model
  return {
    "embed": 0.02 * jax.random.normal(next(keys), (cfg.vocab, d)),
    "pos": 0.02 * jax.random.normal(next(keys), (cfg.seq_len, d)),
    "blocks": [
      {
        "ln1": jnp.ones(d),
        "qkv": dense(d, 3 * d),
        "proj": dense(d, d),
        "ln2": jnp.ones(d),
        "up": dense(d, cfg.d_ff),
        "down": dense(cfg.d_ff, d),
      }
      for _ in range(cfg.layers)
    ],
    "ln_f": jnp.ones(d),
  }


def _layer_norm(x, scale):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale[None, None, :]


def _attention(x, block, heads):
  b, t, d = x.shape
  q, k, v = jnp.split(x @ block["qkv"], 3, axis=-1)
  q, k, v = (y.reshape(b, t, heads, d // heads) for y in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None, :, :]
  scores = jnp.where(causal, scores, -1e9)
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
  return out.reshape(b, t, d) @ block["proj"]


def make_loss(cfg: ModelConfig) -> Callable[[Any, jax.Array], jax.Array]:
  """Mean next-token cross-entropy over a batch of ``[B, seq_len + 1]``."""

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + params["pos"][None, :, :]
    for block in params["blocks"]:
      x = x + _attention(_layer_norm(x, block["ln1"]), block, cfg.heads)
      h = jax.nn.gelu(_layer_norm(x, block["ln2"]) @ block["up"])
      x = x + h @ block["down"]
    logits = _layer_norm(x, params["ln_f"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
    ).mean()

  return loss


def make_data(cfg: ModelConfig, num_sequences: int, seed: int) -> np.ndarray:
  """Sequences from a random sparse bigram language (4 successors a token)."""
  rng = np.random.default_rng(seed)
  successors = rng.integers(0, cfg.vocab, size=(cfg.vocab, 4))
  probs = np.array([0.55, 0.25, 0.15, 0.05])
  tokens = np.empty((num_sequences, cfg.seq_len + 1), np.int32)
  tokens[:, 0] = rng.integers(0, cfg.vocab, size=num_sequences)
  for t in range(1, cfg.seq_len + 1):
    choice = rng.choice(4, size=num_sequences, p=probs)
    tokens[:, t] = successors[tokens[:, t - 1], choice]
  return tokens


def make_optimizer(learning_rate: float) -> optax.GradientTransformation:
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(learning_rate, weight_decay=0.01),
  )


# ----------------------------------------------------------------------------
# The training steps of each method.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Method:
  """One way to train: its jitted step and how many calls make a step."""

  name: str
  tx: optax.GradientTransformation
  step: Callable[..., Any]
  calls_per_step: int
  rows_per_call: int
  # The compiled step for `rows_per_call` rows, once compiled.
  compiled: Callable[..., Any] | None = None


def make_method(
  name: str, k: int, micro_batch: int, loss: Callable, learning_rate: float
) -> Method:
  opt = make_optimizer(learning_rate)
  if name == "accumulate":
    tx = optax_accum.accumulate(opt, k)
  elif name == "MultiSteps":
    tx = optax.MultiSteps(opt, k).gradient_transformation()
  else:
    tx = opt
  if name == "microbatch":
    grad_fn = optax_accum.microbatch(jax.value_and_grad(loss), k)
  else:
    grad_fn = jax.value_and_grad(loss)

  def step(params, state, tokens):
    value, grads = grad_fn(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  multi = name in MULTI_CALL
  return Method(
    name=name,
    tx=tx,
    step=jax.jit(step, donate_argnums=(0, 1)),
    calls_per_step=k if multi else 1,
    rows_per_call=micro_batch if multi else k * micro_batch,
  )


def abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class StepCompiler:
  """Builds and compiles each method's step once per (k, rows per call).

  Compiling dominates this script's run time on a small CPU, so the
  throughput runs, the memory-budget search and the equivalence check share
  executables. A big-batch step does not depend on k, only on its rows.
  """

  def __init__(self, args: argparse.Namespace, params: Any, loss: Callable):
    self.args, self.params, self.loss = args, params, loss
    self._compiled = {}

  def method(self, name: str, k: int) -> Method:
    return make_method(
      name, k, self.args.micro_batch, self.loss, self.args.learning_rate
    )

  def compiled(self, name: str, k: int, rows: int) -> Any:
    key = (name, None if name == "big batch" else k, rows)
    if key not in self._compiled:
      method = self.method(name, k)
      state = jax.eval_shape(method.tx.init, self.params)
      tokens = jax.ShapeDtypeStruct((rows, self.args.seq_len + 1), jnp.int32)
      self._compiled[key] = method.step.lower(
        abstract(self.params), state, tokens
      ).compile()
    return self._compiled[key]

  def ready(self, name: str, k: int) -> Method:
    """The method with its step compiled for its own rows per call."""
    method = self.method(name, k)
    method.compiled = self.compiled(name, k, method.rows_per_call)
    return method

  def footprint(self, name: str, k: int, rows: int) -> int:
    return compiled_memory(self.compiled(name, k, rows))["footprint"]

  def largest_fitting_rows(
    self,
    name: str,
    k: int,
    budget: int,
    *,
    base: int,
    multiple: int,
    limit: int = 1 << 16,
  ) -> tuple[int, int]:
    """The most rows per call whose compiled footprint fits `budget`.

    Footprints grow about linearly with the rows: compiles at `base` and
    `2 * base` rows estimate the line, then candidates at the estimate
    (rounded down to `multiple`) are compiled and stepped down until one
    fits. Returns (rows, footprint); (0, footprint at `multiple` rows) when
    not even `multiple` rows fit.
    """
    small = self.footprint(name, k, base)
    if small > budget:
      if base == multiple:
        return 0, small
      return self.largest_fitting_rows(
        name, k, budget, base=multiple, multiple=multiple, limit=limit
      )
    large = self.footprint(name, k, 2 * base)
    per_row = max((large - small) / base, 1.0)
    rows = int(base + (budget - small) / per_row)
    rows = max(base, min(limit, rows - rows % multiple))
    for _ in range(8):
      used = self.footprint(name, k, rows)
      if used <= budget or rows == base:
        return rows, used
      rows = max(base, int(rows * budget / used) // multiple * multiple)
    return rows, used


# ----------------------------------------------------------------------------
# Measurements.
# ----------------------------------------------------------------------------


def batches_for_step(
  data: np.ndarray, step: int, k: int, micro_batch: int
) -> np.ndarray:
  """The `k * micro_batch` sequences of optimizer step `step` (cycling)."""
  rows = k * micro_batch
  start = (step * rows) % (len(data) - rows + 1)
  return data[start : start + rows]


def run_step(
  method: Method, params: Any, state: Any, tokens: np.ndarray
) -> tuple[Any, Any, jax.Array]:
  """One optimizer step: `calls_per_step` calls of the jitted step."""
  step = method.compiled or method.step
  value = None
  for rows in np.split(tokens, method.calls_per_step):
    params, state, value = step(params, state, jnp.asarray(rows))
  return params, state, value


def measure_k(
  k: int,
  args: argparse.Namespace,
  cfg: ModelConfig,
  data: np.ndarray,
  init: Any,
  steps: StepCompiler,
  advance: Callable[[], None],
) -> dict[str, Any]:
  """Throughput and memory of every method at `k` micro-batches a step."""
  budget = int(args.memory_budget_mb * MB)
  methods, memory, skipped = {}, {}, {}
  for name in METHODS:
    method = steps.ready(name, k)
    memory[name] = compiled_memory(method.compiled)
    advance()
    if memory[name]["footprint"] > budget:
      skipped[name] = "exceeds the memory budget"
      continue
    methods[name] = method

  runners = {}
  for name, method in methods.items():
    params = jax.tree.map(jnp.copy, init)
    runners[name] = [params, method.tx.init(params)]
  tokens_per_step = k * args.micro_batch * cfg.seq_len
  steps_done = {"count": 0}

  def turn(name):
    def run(r):
      params, state = runners[name]
      elapsed = 0.0
      for s in range(args.steps):
        start = steps_done["count"] + r * args.steps + s
        tokens = batches_for_step(data, start, k, args.micro_batch)
        t, (params, state, _) = timed_call(
          run_step, methods[name], params, state, tokens
        )
        elapsed += t
      runners[name] = [params, state]
      return elapsed / args.steps

    return run

  # Each repeat: the median step time of its rounds, per method.
  repeats = []
  for _ in range(args.repeats):
    seconds = interleaved(
      {name: turn(name) for name in methods},
      rounds=args.rounds,
      warmup=args.warmup,
      advance=advance,
    )
    steps_done["count"] += (args.rounds + args.warmup) * args.steps
    repeats.append({name: median(seconds[name]) for name in methods})

  results = {}
  for name in METHODS:
    entry = {"memory": memory[name], "skipped": skipped.get(name)}
    if name in methods:
      step_s = median([r[name] for r in repeats])
      entry.update(
        step_ms=1e3 * step_s,
        tokens_per_s=tokens_per_step / step_s,
        tokens_per_s_spread=spread(
          [tokens_per_step / r[name] for r in repeats]
        ),
      )
      if "big batch" in methods:
        entry["vs_big_batch_spread"] = spread(
          [r[name] / r["big batch"] for r in repeats]
        )
    results[name] = entry
  for entry in results.values():
    # Throughput ratio = inverse step-time ratio, paired within a repeat.
    s = entry.pop("vs_big_batch_spread", None)
    if s is not None:
      s = spread([1 / v for v in s["values"]])
    entry["vs_big_batch"] = s["median"] if s else None
    entry["vs_big_batch_spread"] = s
  return {"k": k, "tokens_per_step": tokens_per_step, "methods": results}


def equivalence(
  args: argparse.Namespace,
  data: np.ndarray,
  init: Any,
  loss: Callable,
  steps: StepCompiler,
) -> dict[str, Any]:
  """Max |params difference| to the big batch after `--check-steps` steps."""
  k = args.check_k
  finals, losses = {}, {}
  for name in ("big batch", "accumulate", "MultiSteps"):
    method = steps.ready(name, k)
    params = jax.tree.map(jnp.copy, init)
    state = method.tx.init(params)
    for s in range(args.check_steps):
      tokens = batches_for_step(data, s, k, args.micro_batch)
      params, state, _ = run_step(method, params, state, tokens)
    finals[name] = params
    losses[name] = float(
      jax.jit(loss)(params, batches_for_step(data, 0, k, args.micro_batch))
    )

  def max_abs_diff(a, b):
    return max(
      float(jnp.max(jnp.abs(x - y)))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )

  moved = max_abs_diff(finals["big batch"], init)
  out = {
    "k": k,
    "steps": args.check_steps,
    "max_param_change_big_batch": moved,
    "loss_after": losses,
    "initial_loss": float(
      jax.jit(loss)(init, batches_for_step(data, 0, k, args.micro_batch))
    ),
  }
  for name in ("accumulate", "MultiSteps"):
    diff = max_abs_diff(finals[name], finals["big batch"])
    out[name] = {
      "max_abs_diff": diff,
      "relative_to_change": diff / moved if moved else None,
      "pass": diff <= args.check_tolerance,
    }
  out["tolerance"] = args.check_tolerance
  return out


def memory_budget_table(
  args: argparse.Namespace,
  steps: StepCompiler,
  advance: Callable[[], None],
) -> dict[str, Any]:
  """Largest effective batch (sequences per optimizer step) under budget.

  accumulate is searched over its micro-batch (the step it runs k times),
  the big batch over its batch, microbatch over the whole batch split into
  k_max micro-batches; every search starts from a size already compiled by
  the throughput runs.
  """
  budget = int(args.memory_budget_mb * MB)
  k_max = max(args.ks)
  mb = args.micro_batch
  out = {}
  for name in METHODS:
    if name == "MultiSteps":
      continue
    if name == "microbatch":
      rows, used = steps.largest_fitting_rows(
        name, k_max, budget, base=k_max * mb, multiple=k_max
      )
      note = f"batch {rows} in {k_max} micro-batches of {rows // k_max}"
      effective = rows
    elif name == "accumulate":
      rows, used = steps.largest_fitting_rows(
        name, k_max, budget, base=mb, multiple=1
      )
      note = f"micro-batch {rows} x any k (x{k_max} here)"
      effective = rows * k_max
    else:
      rows, used = steps.largest_fitting_rows(
        name, 1, budget, base=mb, multiple=1
      )
      note = f"batch {rows}"
      effective = rows
    out[name] = {
      "rows_per_call": rows,
      "footprint": used,
      "effective_batch": effective,
      "note": note,
    }
    advance()
  return out


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------


def markdown_report(payload: dict[str, Any]) -> str:
  a, eq = payload["args"], payload["equivalence"]
  rows = []
  for r in payload["throughput"]:
    for name, m in r["methods"].items():
      rows.append(
        [
          r["k"],
          name,
          r["k"] * a["micro_batch"],
          fmt_spread(m["tokens_per_s_spread"], 0)
          if not m["skipped"]
          else m["skipped"],
          fmt_spread(m["vs_big_batch_spread"])
          if m.get("vs_big_batch_spread")
          else "-",
          fmt(m["memory"]["footprint"] / MB, 1),
        ]
      )
  budget_rows = [
    [name, b["effective_batch"], b["note"], fmt(b["footprint"] / MB, 1)]
    for name, b in payload["memory_budget"].items()
  ]
  eq_rows = [
    [
      name,
      f"{eq[name]['max_abs_diff']:.2e}",
      f"{eq[name]['relative_to_change']:.2e}"
      if eq[name]["relative_to_change"] is not None
      else "-",
      "PASS" if eq[name]["pass"] else "FAIL",
    ]
    for name in ("accumulate", "MultiSteps")
  ]
  m = payload["model"]
  return "\n".join(
    [
      "# bench_train: tiny transformer LM, end to end",
      "",
      f"Machine: {machine_line(payload['machine'])}.",
      "",
      f"Model: {m['layers']} layers, d_model {m['d_model']}, {m['heads']}"
      f" heads, d_ff {m['d_ff']}, vocab {m['vocab']}, sequence"
      f" {m['seq_len']}; {m['param_bytes'] / MB:.2f} MB of float32 params."
      f" Optimizer: clip_by_global_norm(1) + adamw({a['learning_rate']})."
      f" Micro-batch: {a['micro_batch']} sequences. {a['repeats']} repeats"
      f" of {a['warmup']} warm-up then {a['rounds']} interleaved rounds of"
      f" {a['steps']} optimizer step(s); median over repeats (min-max) of"
      " each repeat's median; ratios paired within a repeat. Memory budget:"
      f" {a['memory_budget_mb']:g} MB (compiled footprint = argument + temp"
      " + output - alias bytes).",
      "",
      "## Throughput",
      "",
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
      "",
      markdown_table(
        ["method", "effective batch (sequences)", "how", "footprint MB"],
        budget_rows,
      ),
      "## Equivalence with the big batch",
      "",
      f"After {eq['steps']} optimizer steps of k={eq['k']} micro-batches"
      f" (loss {eq['initial_loss']:.3f} -> big batch"
      f" {eq['loss_after']['big batch']:.3f}, accumulate"
      f" {eq['loss_after']['accumulate']:.3f}), largest parameter change of"
      f" the big batch {eq['max_param_change_big_batch']:.2e}; tolerance"
      f" {eq['tolerance']:g}.",
      "",
      markdown_table(
        ["method", "max abs param diff", "relative to the change", "check"],
        eq_rows,
      ),
    ]
  )


def figure(payload: dict[str, Any]) -> Any:
  fig = Figure(figsize=(11, 3.6))
  axes = fig.subplots(1, 3)
  ks = [r["k"] for r in payload["throughput"]]
  width = 0.8 / len(METHODS)
  x = np.arange(len(ks))
  for i, name in enumerate(METHODS):
    tps = [
      r["methods"][name].get("tokens_per_s") or 0.0
      for r in payload["throughput"]
    ]
    mem = [
      r["methods"][name]["memory"]["footprint"] / MB
      for r in payload["throughput"]
    ]
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
  fig.suptitle(
    f"bench_train on {payload['machine']['backend']}"
    f" ({payload['machine']['cpu_count']} CPUs)",
    fontsize=10,
  )
  fig.tight_layout()
  return fig


def console_table(payload: dict[str, Any]) -> Table:
  table = Table(title="tokens/s (ratio to the big batch), footprint MB")
  table.add_column("k")
  for name in METHODS:
    table.add_column(name, justify="right")
  for r in payload["throughput"]:
    cells = []
    for name in METHODS:
      m = r["methods"][name]
      mem = m["memory"]["footprint"] / MB
      if m["skipped"]:
        cells.append(f"over budget ({mem:.0f} MB)")
      else:
        ratio = m["vs_big_batch"]
        ratio_text = f" ({ratio:.2f}x)" if ratio is not None else ""
        cells.append(f"{m['tokens_per_s']:.0f}{ratio_text}, {mem:.0f} MB")
    table.add_row(str(r["k"]), *cells)
  return table


# ----------------------------------------------------------------------------
# Entry point.
# ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=(
      "Tokens/s and compiled memory of training a tiny transformer LM"
      " with optax_accum.accumulate, optax.MultiSteps, one big batch and"
      " in-step micro-batching; the largest batch within a memory"
      " budget; and max |params difference| to big-batch training."
    ),
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--ks",
    type=lambda s: [int(x) for x in s.split(",") if x],
    default=[1, 4, 16],
    help="comma-separated micro-batches per step",
  )
  parser.add_argument(
    "--micro-batch", type=int, default=8, help="sequences per micro-batch"
  )
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--d-ff", type=int, default=512)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument(
    "--steps",
    type=int,
    default=1,
    help="optimizer steps per method per timed round",
  )
  add_run_arguments(parser, rounds=3, warmup=1, repeats=3)
  parser.add_argument(
    "--memory-budget-mb",
    type=float,
    default=512.0,
    help="memory a step may use (compiled footprint); a big batch over it"
    " is not run",
  )
  parser.add_argument(
    "--check-k",
    type=int,
    default=4,
    help="micro-batches per step of the equivalence check",
  )
  parser.add_argument(
    "--check-steps",
    type=int,
    default=3,
    help="optimizer steps of the equivalence check",
  )
  parser.add_argument(
    "--check-tolerance",
    type=float,
    default=1e-4,
    help="largest acceptable max |params difference| to the big batch",
  )
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if min(args.ks) < 1 or args.rounds < 1 or args.steps < 1:
    parser.error("--ks, --rounds and --steps must be >= 1")
  if args.d_model % args.heads:
    parser.error("--d-model must be a multiple of --heads")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  console = Console()
  if not console.is_terminal:  # a log file: 100 columns
    console = Console(width=100)
  cfg = ModelConfig(
    vocab=args.vocab,
    seq_len=args.seq_len,
    d_model=args.d_model,
    layers=args.layers,
    heads=args.heads,
    d_ff=args.d_ff,
  )
  loss = make_loss(cfg)
  init = init_params(jax.random.PRNGKey(args.seed), cfg)
  steps = StepCompiler(args, init, loss)
  rows_needed = max(args.ks + [args.check_k]) * args.micro_batch
  data = make_data(cfg, max(4 * rows_needed, 512), args.seed)

  total = (
    sum(
      len(METHODS) + args.repeats * (args.warmup + args.rounds) for _ in args.ks
    )
    + len(METHODS)
    - 1  # the budget search, MultiSteps excluded
  )
  with Progress(console=console) as progress:
    task = progress.add_task("bench_train", total=total)

    def advance():
      progress.advance(task)

    throughput = []
    for k in args.ks:
      progress.update(task, description=f"throughput k={k}")
      throughput.append(measure_k(k, args, cfg, data, init, steps, advance))
    progress.update(task, description="memory budget")
    budget = memory_budget_table(args, steps, advance)
    progress.update(task, description="equivalence")
    eq = equivalence(args, data, init, loss, steps)

  payload = {
    "benchmark": "bench_train",
    "machine": machine_info(),
    "args": vars(args),
    "model": {**dataclasses.asdict(cfg), "param_bytes": tree_bytes(init)},
    "methods": list(METHODS),
    "throughput": throughput,
    "memory_budget": budget,
    "equivalence": eq,
  }
  console.print(console_table(payload))
  for name in ("accumulate", "MultiSteps"):
    console.print(
      f"max |params - big batch params| after {eq['steps']} steps,"
      f" {name}: {eq[name]['max_abs_diff']:.2e}"
      f" ({'PASS' if eq[name]['pass'] else 'FAIL'})"
    )
  for name, b in budget.items():
    console.print(
      f"within {args.memory_budget_mb:g} MB, {name}: effective batch"
      f" {b['effective_batch']} ({b['note']})"
    )
  paths = write_outputs(
    args.out,
    "bench_train",
    payload,
    markdown_report(payload),
    figure(payload),
  )
  console.print("Wrote " + ", ".join(str(p) for p in paths))
  return 0


if __name__ == "__main__":
  sys.exit(main())
