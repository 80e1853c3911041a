"""End-to-end training of a tiny transformer language model with accumulation.

A decoder-only transformer (plain JAX, in `_models.py`) learns a synthetic
language: token sequences drawn from a fixed random sparse bigram table, so
nothing is downloaded and the loss visibly falls. For each number of
micro-batches per step ``k`` the same optimizer steps (``k`` micro-batches of
``--micro-batch`` sequences each) are trained with each of ``METHODS``.

Reported: tokens/s (medians of interleaved rounds, warm-up first) and its
ratio to the big batch, the compiled footprint (argument + temp + output -
alias bytes), the largest batch that fits the memory budget with each method
(from compiled footprints, never run), and max |params difference| between
``accumulate`` (and ``MultiSteps``) and the big batch after a few optimizer
steps on the same data.

Usage::

  python benchmarks/bench_train.py                   # defaults, ~2 minutes
  python benchmarks/bench_train.py --memory-budget-mb 64 --ks 1,4,16,64
"""

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
  MB,
  Carry,
  Run,
  abstract,
  add_run_arguments,
  benchmark_parser,
  compiled_memory,
  int_list,
  largest_fitting,
  median,
  positive_int,
  spread,
  train_step,
  tree_bytes,
)
from _models import (
  ModelConfig,
  batches_for_step,
  init_params,
  make_data,
  make_loss,
)
from _report import train_console, train_figure, train_markdown

import optax_accum


def make_optimizer(learning_rate: float) -> optax.GradientTransformation:
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(learning_rate, weight_decay=0.01),
  )


# --- The methods: each prepare(opt, k, loss) returns the transformation,
# the value-and-grad function and the jitted calls an optimizer step makes.


def prepare_accumulate(opt, k: int, loss: Callable) -> tuple:
  """``optax_accum.accumulate(opt, k)``, ``k`` jitted calls a step."""
  return optax_accum.accumulate(opt, k), jax.value_and_grad(loss), k


def prepare_multisteps(opt, k: int, loss: Callable) -> tuple:
  """``optax.MultiSteps(opt, k)``, ``k`` jitted calls a step."""
  tx = optax.MultiSteps(opt, k).gradient_transformation()
  return tx, jax.value_and_grad(loss), k


def prepare_big_batch(opt, k: int, loss: Callable) -> tuple:
  """The plain optimizer on one batch of ``k`` micro-batches; run only if
  its compiled footprint fits ``--memory-budget-mb``."""
  del k
  return opt, jax.value_and_grad(loss), 1


def prepare_microbatch(opt, k: int, loss: Callable) -> tuple:
  """``optax_accum.microbatch``: in-step micro-batching, a ``lax.scan``
  over the ``k`` micro-batches inside one jitted step."""
  return opt, optax_accum.microbatch(jax.value_and_grad(loss), k), 1


METHODS = {
  "accumulate": prepare_accumulate,
  "MultiSteps": prepare_multisteps,
  "big batch": prepare_big_batch,
}
if hasattr(optax_accum, "microbatch"):
  METHODS["microbatch"] = prepare_microbatch


class Method(NamedTuple):
  """One way to train, ready: its step compiled for its rows per call."""

  tx: optax.GradientTransformation
  compiled: Callable[..., Any]
  calls_per_step: int

  def __call__(self, params: Any, state: Any, tokens: np.ndarray) -> tuple:
    """One optimizer step: `calls_per_step` calls of the compiled step."""
    value = None
    for rows in np.split(tokens, self.calls_per_step):
      params, state, value = self.compiled(params, state, jnp.asarray(rows))
    return params, state, value


class Setup:
  """What every measurement shares: the arguments, the loss, the initial
  params, the data, and each method's step, compiled once per (k, rows per
  call).

  Compiling dominates this script's run time on a small CPU, so the
  throughput runs, the memory-budget search and the equivalence check share
  executables. A big-batch step does not depend on k, only on its rows.
  """

  def __init__(self, args: argparse.Namespace, cfg: ModelConfig):
    self.args = args
    self.loss = make_loss(cfg)
    self.init = init_params(jax.random.PRNGKey(args.seed), cfg)
    rows_needed = max(args.ks + [args.check_k]) * args.micro_batch
    self.data = make_data(cfg, max(4 * rows_needed, 512), args.seed)
    self._compiled = {}

  def batch(self, step: int, k: int) -> np.ndarray:
    """The sequences of optimizer step `step` at `k` micro-batches a step."""
    return batches_for_step(self.data, step, k, self.args.micro_batch)

  def prepare(self, name: str, k: int) -> tuple:
    """The method's (transformation, jitted step, calls per step)."""
    opt = make_optimizer(self.args.learning_rate)
    tx, grad_fn, calls = METHODS[name](opt, k, self.loss)
    return tx, train_step(grad_fn, tx, has_value=True), calls

  def compiled(self, name: str, k: int, rows: int) -> Any:
    key = (name, None if name == "big batch" else k, rows)
    if key not in self._compiled:
      tx, step, _ = self.prepare(name, k)
      state = jax.eval_shape(tx.init, self.init)
      tokens = jax.ShapeDtypeStruct((rows, self.args.seq_len + 1), jnp.int32)
      self._compiled[key] = step.lower(
        abstract(self.init), state, tokens
      ).compile()
    return self._compiled[key]

  def ready(self, name: str, k: int) -> Method:
    """The method with its step compiled for its own rows per call."""
    tx, _, calls = self.prepare(name, k)
    rows = k * self.args.micro_batch // calls
    return Method(tx, self.compiled(name, k, rows), calls)

  def largest_fitting_rows(self, name: str, k: int, **search) -> tuple:
    """The most rows per call (and their footprint) within the budget."""
    return largest_fitting(
      lambda rows: compiled_memory(self.compiled(name, k, rows))["footprint"],
      int(self.args.memory_budget_mb * MB),
      **search,
    )


# --- Measurements. ----------------------------------------------------------


def measure_k(k: int, setup: Setup, run: Run) -> dict[str, Any]:
  """Throughput and memory of every method at `k` micro-batches a step."""
  args = setup.args
  budget = int(args.memory_budget_mb * MB)
  methods, memory, skipped = {}, {}, {}
  for name in METHODS:
    method = setup.ready(name, k)
    memory[name] = compiled_memory(method.compiled)
    run.advance()
    if memory[name]["footprint"] > budget:
      skipped[name] = "exceeds the memory budget"
    else:
      methods[name] = method

  def turn(name):
    """A method's turn: mean seconds per optimizer step over --steps."""
    params = jax.tree.map(jnp.copy, setup.init)
    carry = Carry(methods[name], params, methods[name].tx.init(params))

    def one_turn(r):
      steps = range(r * args.steps, (r + 1) * args.steps)
      seconds = [carry(setup.batch(step, k)) for step in steps]
      return sum(seconds) / args.steps

    return one_turn

  # Each repeat: the median step time of its rounds, per method.
  turns = {name: turn(name) for name in methods}
  repeats = [
    {name: median(seconds) for name, seconds in rounds.items()}
    for rounds in run.rounds(turns)
  ]
  tokens_per_step = k * args.micro_batch * args.seq_len
  results = {}
  for name in METHODS:
    entry = {"memory": memory[name], "skipped": skipped.get(name)}
    ratio = None
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
        # Throughput ratio = inverse step-time ratio, paired within a repeat.
        ratio = spread([r["big batch"] / r[name] for r in repeats])
    entry["vs_big_batch"] = ratio["median"] if ratio else None
    entry["vs_big_batch_spread"] = ratio
    results[name] = entry
  return {"k": k, "tokens_per_step": tokens_per_step, "methods": results}


def equivalence(setup: Setup) -> dict[str, Any]:
  """Max |params difference| to the big batch after `--check-steps` steps."""
  args, init, loss = setup.args, setup.init, setup.loss
  k = args.check_k
  first = setup.batch(0, k)
  finals, losses = {}, {}
  for name in ("big batch", "accumulate", "MultiSteps"):
    method = setup.ready(name, k)
    params = jax.tree.map(jnp.copy, init)
    state = method.tx.init(params)
    for step in range(args.check_steps):
      params, state, _ = method(params, state, setup.batch(step, k))
    finals[name] = params
    losses[name] = float(jax.jit(loss)(params, first))

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
    "initial_loss": float(jax.jit(loss)(init, first)),
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


def memory_budget_table(setup: Setup, advance: Callable) -> dict[str, Any]:
  """Largest effective batch (sequences per optimizer step) under budget.

  accumulate is searched over its micro-batch (the step it runs k times),
  the big batch over its batch, microbatch over the whole batch split into
  k_max micro-batches; every search starts from a size already compiled by
  the throughput runs.
  """
  k_max, mb = max(setup.args.ks), setup.args.micro_batch
  out = {}
  for name in METHODS:
    if name == "MultiSteps":
      continue
    if name == "microbatch":
      rows, used = setup.largest_fitting_rows(
        name, k_max, base=k_max * mb, multiple=k_max
      )
      note = f"batch {rows} in {k_max} micro-batches of {rows // k_max}"
      effective = rows
    elif name == "accumulate":
      rows, used = setup.largest_fitting_rows(name, k_max, base=mb, multiple=1)
      note = f"micro-batch {rows} x any k (x{k_max} here)"
      effective = rows * k_max
    else:
      rows, used = setup.largest_fitting_rows(name, 1, base=mb, multiple=1)
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


# --- Entry point. -----------------------------------------------------------

MODEL_ARGUMENTS = ("seq_len", "vocab", "d_model", "layers", "heads", "d_ff")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = benchmark_parser(
    "Tokens/s and compiled memory of training a tiny transformer LM"
    " with optax_accum.accumulate, optax.MultiSteps, one big batch and"
    " in-step micro-batching; the largest batch within a memory"
    " budget; and max |params difference| to big-batch training."
  )
  add = parser.add_argument
  add(
    "--ks",
    type=int_list,
    default=[1, 4, 16],
    help="comma-separated micro-batches per step",
  )
  add("--micro-batch", type=int, default=8, help="sequences per micro-batch")
  for name in MODEL_ARGUMENTS:  # the fields of ModelConfig
    flag = "--" + name.replace("_", "-")
    add(flag, type=int, default=getattr(ModelConfig, name))
  add("--learning-rate", type=float, default=1e-3)
  add(
    "--steps",
    type=positive_int,
    default=1,
    help="optimizer steps per method per timed round",
  )
  add_run_arguments(parser, rounds=3, warmup=1, repeats=3)
  add(
    "--memory-budget-mb",
    type=float,
    default=512.0,
    help="memory a step may use (compiled footprint); a big batch over it"
    " is not run",
  )
  add(
    "--check-k",
    type=int,
    default=4,
    help="micro-batches per step of the equivalence check",
  )
  add(
    "--check-steps",
    type=int,
    default=3,
    help="optimizer steps of the equivalence check",
  )
  add(
    "--check-tolerance",
    type=float,
    default=1e-4,
    help="largest acceptable max |params difference| to the big batch",
  )
  add("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.d_model % args.heads:
    parser.error("--d-model must be a multiple of --heads")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  cfg = ModelConfig(**{name: getattr(args, name) for name in MODEL_ARGUMENTS})
  setup = Setup(args, cfg)
  per_k = len(METHODS) + args.repeats * (args.warmup + args.rounds)
  total = len(args.ks) * per_k + len(METHODS) - 1  # budget: no MultiSteps
  with Run("bench_train", args, total=total) as run:
    throughput = []
    for k in args.ks:
      run.stage(f"throughput k={k}")
      throughput.append(measure_k(k, setup, run))
    run.stage("memory budget")
    budget = memory_budget_table(setup, run.advance)
    run.stage("equivalence")
    eq = equivalence(setup)
  payload = run.payload(
    model={**dataclasses.asdict(cfg), "param_bytes": tree_bytes(setup.init)},
    methods=list(METHODS),
    throughput=throughput,
    memory_budget=budget,
    equivalence=eq,
  )
  run.finish(payload, train_markdown, train_figure, train_console(payload))
  return 0


if __name__ == "__main__":
  sys.exit(main())
