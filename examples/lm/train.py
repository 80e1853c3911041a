"""The training loop of the demo: one model, one data order, three optimizers.

* ``reference``: one big batch of ``every_k * micro_batch`` samples per step,
  loss = mean over all of its real tokens;
* ``weighted``: ``optax_accum.accumulate(inner, every_k)`` fed one micro-batch
  at a time, loss = mean over that micro-batch's real tokens, with
  ``weight=`` its real-token count. The same maths as the reference, so it
  matches it to float32 rounding;
* ``unweighted``: the same without ``weight=``. Every micro-batch then counts
  the same however many tokens it holds, which over-weights the tokens of
  short micro-batches: the classic accumulation bug.

`resume_check` saves mid-cycle with Orbax (`checkpointing`), restores into
fresh objects and checks that the resumed run is bitwise identical to the
uninterrupted one. `main.py` is the command line around these functions.
"""

import functools
import pathlib
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rich.progress import Progress

import optax_accum

from checkpointing import restore_checkpoint, save_checkpoint
from config import Config
from input_pipeline import Data, Samples, micro_batches, step_batch
from models import TransformerLM

MODES = ("reference", "weighted", "unweighted")
# Tolerances for "matches the reference": float32 rounding differs between a
# batch of 32 and four batches of 8 (different matmul blockings and sums),
# and Adam carries the difference along; a weighting bug is orders of
# magnitude larger (see the table).
LOSS_ATOL = 1e-4
PARAMS_ATOL = 1e-4


def inner_optimizer(cfg: Config) -> optax.GradientTransformation:
  """The optimizer every run steps once per cycle: clipping, then Adam on
  a warmup-cosine schedule. The schedule lives inside it, so that it
  advances once per optimizer step in every run."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    cfg.learning_rate,
    cfg.warmup_steps,
    decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
  )
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))


@functools.cache
def make_tx(cfg: Config, mode: str) -> optax.GradientTransformation:
  """The optimizer of `mode`, built once per configuration.

  Built once because nnx.Optimizer keeps `tx` as static graph data: a fresh
  but equal transformation is a new closure, and every jitted step taking it
  would be traced and compiled again.
  """
  if mode not in MODES:
    raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
  inner = inner_optimizer(cfg)
  if mode == "reference":
    return inner
  return optax_accum.accumulate(
    inner, cfg.every_k, track_noise_scale=mode == "weighted"
  )


def build(cfg: Config, mode: str) -> tuple[TransformerLM, nnx.Optimizer]:
  """A freshly initialized model (always the same) and its optimizer: the
  drop-in ``optax_accum.flax.Optimizer`` around ``accumulate`` (it applies
  with ``optax_accum.apply_updates``), ``nnx.Optimizer`` for the big batch."""
  model = TransformerLM(cfg, rngs=nnx.Rngs(cfg.seed))
  optimizer_class = nnx.Optimizer
  if mode != "reference":
    optimizer_class = optax_accum.flax.Optimizer
  optimizer = optimizer_class(model, make_tx(cfg, mode), wrt=nnx.Param)
  # Commit the state to a device up front, as the step's outputs will be:
  # otherwise the second step compiles again for committed inputs.
  pair = (model, optimizer)
  nnx.update(pair, jax.device_put(nnx.state(pair), jax.devices()[0]))
  return model, optimizer


# ---------------------------------------------------------------------------
# Loss and steps.
# ---------------------------------------------------------------------------


def token_loss_sum(
  model: TransformerLM, tokens: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Sum of next-byte cross-entropies over real tokens, and their count."""
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  positions = jnp.arange(inputs.shape[1], dtype=jnp.int32)
  mask = positions[None, :] < (lengths - 1)[:, None]
  losses = optax.softmax_cross_entropy_with_integer_labels(
    model(inputs), targets
  )
  return jnp.sum(jnp.where(mask, losses, 0.0)), jnp.sum(mask, dtype=jnp.float32)


def mean_token_loss(model, tokens, lengths):
  total, count = token_loss_sum(model, tokens, lengths)
  return total / count, count


def reference_step(model, optimizer, tokens, lengths):
  grad_fn = nnx.value_and_grad(mean_token_loss, has_aux=True)
  (loss, count), grads = grad_fn(model, tokens, lengths)
  optimizer.update(model, grads)
  return loss, count


def micro_step(model, optimizer, tokens, lengths, weighted: bool):
  """One micro-batch; `optimizer` moves the params only every k-th call."""
  grad_fn = nnx.value_and_grad(mean_token_loss, has_aux=True)
  (loss, count), grads = grad_fn(model, tokens, lengths)
  if weighted:
    # This micro-batch's loss is a mean over `count` tokens: weigh it so.
    optimizer.update(model, grads, weight=count)
  else:
    optimizer.update(model, grads)  # the bug: every micro-batch counts 1
  return loss, count


def fast(step, model, optimizer):
  """`step` bound to `model` and `optimizer` in flax's fast call form: both
  flattened once, here, instead of walked in Python on every call as
  ``nnx.jit`` does; donated, so the params and the accumulator are updated
  in place. Call it with the rest: ``fast(micro_step, m, o)(tokens,
  lengths, weighted=True)``."""
  return nnx.jit_partial(
    step,
    model,
    optimizer,
    graph=False,
    static_argnames="weighted" if step is micro_step else None,
    donate_argnums=0,
  )


@nnx.jit
def eval_sums(model, tokens, lengths):
  return token_loss_sum(model, tokens, lengths)


def heldout_loss(model: TransformerLM, samples: Samples, size: int) -> float:
  """Mean next-byte loss over every real token of `samples`, evaluated
  `size` samples at a time (the demo and adaptive.py share this loop)."""
  total, count = 0.0, 0.0
  for start in range(0, len(samples.lengths), size):
    tokens = samples.tokens[start : start + size]
    lengths = samples.lengths[start : start + size]
    if len(lengths) < size:  # keep one compiled shape: pad with empty rows
      missing = size - len(lengths)
      tokens = np.pad(tokens, [(0, missing), (0, 0)])
      lengths = np.pad(lengths, [(0, missing)])
    s, c = eval_sums(model, tokens, lengths)
    total, count = total + float(s), count + float(c)
  return total / count


def accumulate_state(optimizer: nnx.Optimizer) -> optax_accum.AccumulateState:
  """The AccumulateState inside an nnx.Optimizer, as plain arrays."""
  opt_state = nnx.as_pure(optimizer.opt_state)
  found = [
    s
    for s in jax.tree.leaves(
      opt_state,
      is_leaf=lambda x: isinstance(x, optax_accum.AccumulateState),
    )
    if isinstance(s, optax_accum.AccumulateState)
  ]
  if len(found) != 1:
    raise ValueError(
      f"expected one AccumulateState in the optimizer, found {len(found)}."
    )
  return found[0]


def params_of(model: TransformerLM) -> dict:
  return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def run_steps(cfg: Config, step: Any, mode: str, batch: Samples):
  """One optimizer step of `mode` with `step` (:func:`fast`'s); returns
  (big-batch mean loss, tokens)."""
  if mode == "reference":
    loss, count = step(*batch)
    return float(loss), float(count)
  losses, counts = [], []
  for micro in micro_batches(cfg, batch):
    loss, count = step(*micro, weighted=mode == "weighted")
    losses.append(loss)
    counts.append(count)
  losses, counts = np.asarray(losses, np.float64), np.asarray(counts)
  # Before the step all micro-batches saw the same params, so this is the
  # big-batch loss of the reference, whatever the run weighs its gradients.
  return float(np.sum(losses * counts) / np.sum(counts)), float(np.sum(counts))


class RunResult(NamedTuple):
  mode: str
  losses: np.ndarray  # float64[steps]: big-batch mean loss before each step
  params: dict
  heldout: float
  seconds: float
  tokens_per_s: float  # after the first (compiling) step
  batch_tokens: float  # mean real tokens per optimizer step
  noise_scale: float | None  # critical batch size in tokens (weighted only)


def train(
  cfg: Config, data: Data, mode: str, progress: Progress | None = None
) -> RunResult:
  """Trains `mode` from the shared initialization on the shared data."""
  model, optimizer = build(cfg, mode)
  step_fn = reference_step if mode == "reference" else micro_step
  step = fast(step_fn, model, optimizer)
  task = None
  if progress is not None:
    task = progress.add_task(
      mode, total=cfg.steps, loss=float("nan"), tok_s=0.0
    )
  losses, tokens = [], []
  start = time.perf_counter()
  warm = start
  for i in range(cfg.steps):
    loss, count = run_steps(cfg, step, mode, step_batch(cfg, data.train, i))
    losses.append(loss)
    tokens.append(count)
    now = time.perf_counter()
    if i == 0:
      warm = now
    tok_s = sum(tokens[1:]) / (now - warm) if i else 0.0
    if task is not None:
      progress.update(task, advance=1, loss=loss, tok_s=tok_s)
  seconds = time.perf_counter() - start
  noise = None
  if mode == "weighted":
    noise = float(optax_accum.noise_scale(accumulate_state(optimizer)))
  return RunResult(
    mode=mode,
    losses=np.asarray(losses),
    params=params_of(model),
    heldout=heldout_loss(model, data.heldout, cfg.batch_size),
    seconds=seconds,
    tokens_per_s=tok_s,
    batch_tokens=float(np.mean(tokens)),
    noise_scale=noise,
  )


def unweighted_overweight(cfg: Config, samples: Samples) -> np.ndarray:
  """Per step: how much more a token of the shortest micro-batch counts.

  Without weights every micro-batch gets 1/k of the step, so a token of a
  micro-batch with n of the step's N real tokens gets 1/(k n) instead of
  1/N: N / (k n) times its big-batch weight.
  """
  ratios = []
  for step in range(cfg.steps):
    counts = np.asarray(
      [
        np.sum(np.maximum(m.lengths - 1, 0))
        for m in micro_batches(cfg, step_batch(cfg, samples, step))
      ],
      np.float64,
    )
    ratios.append(counts.sum() / (cfg.every_k * counts.min()))
  return np.asarray(ratios)


def max_abs_diff(a: Any, b: Any) -> float:
  return max(
    float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y))))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def resume_check(cfg: Config, data: Data, ckpt_dir: pathlib.Path) -> dict:
  """Stops mid-cycle, saves, restores into fresh objects, compares bitwise.

  Runs the weighted configuration for two and a half cycles (with
  ``every_k=1`` there is no mid-cycle: it stops after two steps), saves, goes
  on to the end of the third cycle, then restores the checkpoint into a
  freshly built model and optimizer and runs the same micro-batches again.
  """
  mode = "weighted"
  # Three steps' worth of data (the first ones again if the run is shorter).
  micros = [
    m
    for step in range(3)
    for m in micro_batches(cfg, step_batch(cfg, data.train, step % cfg.steps))
  ]
  stop = 2 * cfg.every_k + cfg.every_k // 2
  model, optimizer = build(cfg, mode)
  step = fast(micro_step, model, optimizer)
  for micro in micros[:stop]:
    step(*micro, weighted=True)
  micro_at_save = int(accumulate_state(optimizer).micro_step)
  path = pathlib.Path(ckpt_dir) / f"mid_cycle_{stop}"
  save_checkpoint(path, cfg, mode, model, optimizer)
  for micro in micros[stop:]:
    step(*micro, weighted=True)
  uninterrupted = jax.device_get((nnx.state(model), nnx.state(optimizer)))

  fresh_model, fresh_optimizer = build(cfg, mode)
  restore_checkpoint(path, cfg, mode, fresh_model, fresh_optimizer)
  resumed_step = fast(micro_step, fresh_model, fresh_optimizer)
  for micro in micros[stop:]:
    resumed_step(*micro, weighted=True)
  resumed = jax.device_get((nnx.state(fresh_model), nnx.state(fresh_optimizer)))

  same_tree = jax.tree.structure(uninterrupted) == jax.tree.structure(resumed)
  identical = same_tree and all(
    np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed), strict=True
    )
  )
  return {
    "saved_after_micro_batches": stop,
    "micro_step_at_save": micro_at_save,
    "micro_batches_total": len(micros),
    "bitwise_identical": bool(identical),
  }


# ---------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------


def compare(results: dict[str, RunResult]) -> dict[str, dict]:
  ref = results["reference"]
  return {
    mode: {
      "max_abs_dloss": float(np.max(np.abs(r.losses - ref.losses))),
      "max_abs_dparams": max_abs_diff(r.params, ref.params),
    }
    for mode, r in results.items()
  }
