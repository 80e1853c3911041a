"""A byte-level transformer on the Python standard library, trained three ways.

One initialization, one data order, three optimizers (Flax NNX):

* ``reference``: one big batch of ``every_k * micro_batch`` samples per step,
  loss = mean over all of its real tokens;
* ``weighted``: ``optax_accum.accumulate(inner, every_k)`` fed one micro-batch
  at a time, loss = mean over that micro-batch's real tokens, with
  ``weight=`` its real-token count. The same maths as the reference, so it
  matches it to float32 rounding;
* ``unweighted``: the same without ``weight=``. Every micro-batch then counts
  the same however many tokens it holds, which over-weights the tokens of
  short micro-batches: the classic accumulation bug.

Samples are blank-line separated blocks of standard-library source (a
function, a docstring, a group of imports), bytes padded to ``--max-len``.
Each big batch is sorted by length before it is cut into micro-batches, as a
padding-aware pipeline buckets by length, so micro-batches hold very
different numbers of real tokens.

Then (``--resume-check``, on by default) it saves model + optimizer with Orbax
in the middle of an accumulation cycle, restores into fresh objects,
continues, and checks that the result is bitwise identical to the
uninterrupted run.

  python examples/lm/train.py            # about 2 minutes on a 2-core CPU
  python examples/lm/train.py --steps 20 --every-k 2 --micro-batch 4 --out /tmp/x
"""

import argparse
import dataclasses
import functools
import json
import pathlib
import re
import sysconfig
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from rich.console import Console
from rich.progress import (
  BarColumn,
  MofNCompleteColumn,
  Progress,
  TextColumn,
  TimeElapsedColumn,
)
from rich.table import Table

import optax_accum

VOCAB = 256  # bytes
MODES = ("reference", "weighted", "unweighted")
# Tolerances for "matches the reference": float32 rounding differs between a
# batch of 32 and four batches of 8 (different matmul blockings and sums),
# and Adam carries the difference along; a weighting bug is orders of
# magnitude larger (see the table).
LOSS_ATOL = 1e-4
PARAMS_ATOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that determines a run.

  All fields but `steps` and `heldout_samples` must match to resume from a
  checkpoint (see `restore_checkpoint`).
  """

  steps: int = 200
  every_k: int = 4
  micro_batch: int = 8
  max_len: int = 128
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  learning_rate: float = 3e-3
  warmup_steps: int = 10
  heldout_samples: int = 512
  seed: int = 0

  @property
  def batch_size(self) -> int:
    return self.every_k * self.micro_batch


# ---------------------------------------------------------------------------
# Data: blocks of standard-library source, as padded bytes.
# ---------------------------------------------------------------------------


def stdlib_files() -> list[pathlib.Path]:
  """The standard library's own .py files, in a fixed order.

  Tests and lib2to3 are left out (fixtures with odd encodings and Python 2);
  so are site-packages, which can live under the stdlib directory.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "lib2to3",
  }
  return sorted(
    path
    for path in root.rglob("*.py")
    if not skip & set(path.relative_to(root).parts[:-1])
  )


def split_blocks(source: bytes, min_len: int = 16) -> list[bytes]:
  """Blank-line separated blocks of at least `min_len` bytes."""
  blocks = (block.strip(b"\n") for block in re.split(rb"\n[ \t]*\n", source))
  return [block for block in blocks if len(block) >= min_len]


class Samples(NamedTuple):
  """Padded byte sequences: ``tokens[i, :lengths[i]]`` is sample ``i``."""

  tokens: np.ndarray  # int32[n, max_len + 1], 0 after the end
  lengths: np.ndarray  # int32[n], in [2, max_len + 1]


class Data(NamedTuple):
  train: Samples  # steps * batch_size samples, in training order
  heldout: Samples


def _pad(blocks: Sequence[bytes], max_len: int) -> Samples:
  tokens = np.zeros((len(blocks), max_len + 1), np.int32)
  lengths = np.zeros((len(blocks),), np.int32)
  for i, block in enumerate(blocks):
    block = block[: max_len + 1]
    tokens[i, : len(block)] = np.frombuffer(block, np.uint8)
    lengths[i] = len(block)
  return Samples(tokens, lengths)


def load_data(cfg: Config, files: Sequence[pathlib.Path] | None = None) -> Data:
  """Held-out and training samples, shuffled with `cfg.seed`."""
  files = stdlib_files() if files is None else files
  blocks = [b for path in files for b in split_blocks(path.read_bytes())]
  order = np.random.default_rng(cfg.seed).permutation(len(blocks))
  if len(order) <= cfg.heldout_samples:
    raise ValueError(
      f"only {len(order)} blocks found, not enough for"
      f" {cfg.heldout_samples} held-out samples and training."
    )
  held, rest = order[: cfg.heldout_samples], order[cfg.heldout_samples :]
  # A long run cycles through the training blocks again, never the held-out.
  picked = [
    blocks[rest[i % len(rest)]] for i in range(cfg.steps * cfg.batch_size)
  ]
  heldout = _pad([blocks[i] for i in held], cfg.max_len)
  train = _pad(picked, cfg.max_len)
  return Data(train, heldout)


def step_batch(cfg: Config, samples: Samples, step: int) -> Samples:
  """The big batch of optimizer step `step`, shortest samples first.

  Sorting makes micro-batch ``i`` the ``i``-th length bucket of the batch:
  its real-token count differs a lot from the others'.
  """
  rows = slice(step * cfg.batch_size, (step + 1) * cfg.batch_size)
  tokens, lengths = samples.tokens[rows], samples.lengths[rows]
  order = np.argsort(lengths, kind="stable")
  return Samples(tokens[order], lengths[order])


def micro_batches(cfg: Config, batch: Samples) -> list[Samples]:
  return [
    Samples(
      *(a[i * cfg.micro_batch : (i + 1) * cfg.micro_batch] for a in batch)
    )
    for i in range(cfg.every_k)
  ]


# ---------------------------------------------------------------------------
# Model: a pre-norm decoder-only transformer.
# ---------------------------------------------------------------------------


class Block(nnx.Module):
  """Causal self-attention and an MLP, each behind a LayerNorm."""

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.norm1 = nnx.LayerNorm(d_model, rngs=rngs)
    # No bias: softmax ignores a key bias, so its gradient is zero up to
    # rounding, which Adam would blow up into learning-rate-sized steps that
    # differ between any two summation orders.
    self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, rngs=rngs)
    self.norm2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
    self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:  # float32[b, t, d]
    b, t, d = x.shape
    heads = self.qkv(self.norm1(x)).reshape(b, t, 3 * self.num_heads, -1)
    q, k, v = jnp.split(heads, 3, axis=2)
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / np.sqrt(q.shape[-1])
    # With right padding a causal mask is all we need: no real token ever
    # attends to a pad (pads attend to real tokens, but their loss is masked).
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(x.dtype).min)
    mixed = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, axis=-1), v)
    x = x + self.out(mixed.reshape(b, t, d))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TransformerLM(nnx.Module):
  """Bytes in, next-byte logits out; input and output embeddings are tied."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
    self.pos = nnx.Param(
      0.02 * jax.random.normal(rngs.params(), (cfg.max_len, cfg.d_model))
    )
    self.blocks = nnx.List(
      [
        Block(cfg.d_model, cfg.num_heads, rngs=rngs)
        for _ in range(cfg.num_layers)
      ]
    )
    self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:  # int32[b, t]
    table = self.embed.embedding[...]
    # A one-hot matmul rather than a gather: its gradient is a matmul, which
    # is deterministic on GPU too (a gather's is a scatter-add with atomics),
    # and the bitwise resume check needs that. Cheap with 256 symbols.
    one_hot = jax.nn.one_hot(tokens, VOCAB, dtype=table.dtype)
    x = jnp.einsum("btv,vd->btd", one_hot, table)
    x = x + self.pos[...][None, : tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))


@functools.cache
def make_tx(cfg: Config, mode: str) -> optax.GradientTransformation:
  """The optimizer of `mode`, built once per configuration.

  Built once because nnx.Optimizer keeps `tx` as static graph data: a fresh
  but equal transformation is a new closure, and every jitted step taking it
  would be traced and compiled again.
  """
  if mode not in MODES:
    raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
  # The schedule lives inside the inner optimizer, so it advances once per
  # optimizer step in all three runs.
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    cfg.learning_rate,
    cfg.warmup_steps,
    decay_steps=max(cfg.steps, cfg.warmup_steps + 1),
  )
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
  if mode == "reference":
    return inner
  return optax_accum.accumulate(
    inner, cfg.every_k, track_noise_scale=mode == "weighted"
  )


def build(cfg: Config, mode: str) -> tuple[TransformerLM, nnx.Optimizer]:
  """A freshly initialized model (always the same) and its optimizer."""
  model = TransformerLM(cfg, rngs=nnx.Rngs(cfg.seed))
  optimizer = nnx.Optimizer(model, make_tx(cfg, mode), wrt=nnx.Param)
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


@nnx.jit
def reference_step(model, optimizer, tokens, lengths):
  grad_fn = nnx.value_and_grad(mean_token_loss, has_aux=True)
  (loss, count), grads = grad_fn(model, tokens, lengths)
  optimizer.update(model, grads)
  return loss, count


@functools.partial(nnx.jit, static_argnames="weighted")
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


@nnx.jit
def eval_sums(model, tokens, lengths):
  return token_loss_sum(model, tokens, lengths)


def heldout_loss(cfg: Config, model: TransformerLM, samples: Samples) -> float:
  """Mean next-byte loss over every real token of `samples`."""
  total, count = 0.0, 0.0
  size = cfg.batch_size
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


def run_steps(
  cfg: Config,
  model: TransformerLM,
  optimizer: nnx.Optimizer,
  mode: str,
  batch: Samples,
) -> tuple[float, float]:
  """One optimizer step of `mode`; returns (big-batch mean loss, tokens)."""
  if mode == "reference":
    loss, count = reference_step(model, optimizer, *batch)
    return float(loss), float(count)
  losses, counts = [], []
  for micro in micro_batches(cfg, batch):
    loss, count = micro_step(
      model, optimizer, *micro, weighted=mode == "weighted"
    )
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
  task = None
  if progress is not None:
    task = progress.add_task(
      mode, total=cfg.steps, loss=float("nan"), tok_s=0.0
    )
  losses, tokens = [], []
  start = time.perf_counter()
  warm = start
  for step in range(cfg.steps):
    loss, count = run_steps(
      cfg, model, optimizer, mode, step_batch(cfg, data.train, step)
    )
    losses.append(loss)
    tokens.append(count)
    now = time.perf_counter()
    if step == 0:
      warm = now
    tok_s = sum(tokens[1:]) / (now - warm) if step else 0.0
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
    heldout=heldout_loss(cfg, model, data.heldout),
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


# ---------------------------------------------------------------------------
# Checkpointing mid-cycle with Orbax.
# ---------------------------------------------------------------------------


class CheckpointError(RuntimeError):
  """A checkpoint that is missing, corrupt, or from another configuration."""


def _config_dict(cfg: Config, mode: str) -> dict:
  return {"mode": mode, **dataclasses.asdict(cfg)}


# Fields that may differ between the saving and the restoring run: the length
# of the run, not the shape of its state or the meaning of a cycle.
_RESUMABLE_FIELDS = {"steps", "heldout_samples"}


def _checkpointer() -> ocp.Checkpointer:
  return ocp.Checkpointer(
    ocp.CompositeCheckpointHandler(
      state=ocp.StandardCheckpointHandler(),
      config=ocp.JsonCheckpointHandler(),
    )
  )


def save_checkpoint(
  path: pathlib.Path,
  cfg: Config,
  mode: str,
  model: TransformerLM,
  optimizer: nnx.Optimizer,
) -> None:
  """Saves model and optimizer state (with the accumulator) and the config."""
  state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
  with _checkpointer() as checkpointer:
    checkpointer.save(
      pathlib.Path(path).absolute(),
      force=True,  # a rerun of the demo overwrites its old checkpoint
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        config=ocp.args.JsonSave(_config_dict(cfg, mode)),
      ),
    )


def _brief(error: Exception, limit: int = 300) -> str:
  """The start of an Orbax/TensorStore error (the full one is chained)."""
  text = f"{type(error).__name__}: {error}"
  return text if len(text) <= limit else text[:limit] + " ..."


def _leaf_table(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """`{"model.blocks.0.qkv.kernel.value": (shape, dtype)}` for array leaves."""

  def name(path) -> str:
    return ".".join(
      str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
      for k in path
    )

  return {
    name(path): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def restore_checkpoint(
  path: pathlib.Path,
  cfg: Config,
  mode: str,
  model: TransformerLM,
  optimizer: nnx.Optimizer,
) -> None:
  """Restores `save_checkpoint`'s state into `model` and `optimizer` in place.

  Everything is checked before any array is read, so a mismatch names what
  differs instead of surfacing as an error deep inside Orbax.

  Raises:
    CheckpointError: if `path` holds no readable checkpoint; or one saved
      with another configuration (the differing fields are named: another
      `every_k`, say, would restore without complaint but silently change
      the cycle); or state of another tree, shape or dtype (the first
      differing leaf is named); or arrays that cannot be read (corrupt).
  """
  path = pathlib.Path(path).absolute()
  target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  try:
    with _checkpointer() as checkpointer:
      saved_cfg = checkpointer.restore(
        path, args=ocp.args.Composite(config=ocp.args.JsonRestore())
      ).config
      saved_state = checkpointer.metadata(path).item_metadata["state"]
    saved_leaves = _leaf_table(saved_state)
  except Exception as e:  # Orbax raises many types for unreadable files.
    raise CheckpointError(
      f"The checkpoint at {path} is missing or corrupt: its config or"
      f" metadata could not be read ({_brief(e)})."
    ) from e

  expected = _config_dict(cfg, mode)
  differing = [
    f"`{key}` saved {saved_cfg.get(key)!r}, now {value!r}"
    for key, value in expected.items()
    if key not in _RESUMABLE_FIELDS and saved_cfg.get(key) != value
  ]
  if differing:
    raise CheckpointError(
      f"The checkpoint at {path} was saved by another configuration:"
      f" {', '.join(differing)}. Restore it with the configuration it was"
      " saved with."
    )

  wanted_leaves = _leaf_table(abstract)

  def describe(leaf):
    return f"shape {leaf[0]} {leaf[1]}"

  problems = [
    f"{n} is not in the checkpoint"
    for n in wanted_leaves
    if n not in saved_leaves
  ]
  problems += [
    f"{n} is in the checkpoint but not in this model"
    for n in saved_leaves
    if n not in wanted_leaves
  ]
  problems += [
    f"{n} has {describe(saved_leaves[n])} in the checkpoint, this model"
    f" expects {describe(want)}"
    for n, want in wanted_leaves.items()
    if n in saved_leaves and saved_leaves[n] != want
  ]
  if problems:
    raise CheckpointError(
      f"The checkpoint at {path} does not fit this model and optimizer:"
      f" {len(problems)} leaves differ, the first: {problems[0]}."
    )

  try:
    with _checkpointer() as checkpointer:
      restored = checkpointer.restore(
        path, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
      ).state
  except Exception as e:
    raise CheckpointError(
      f"The checkpoint at {path} is corrupt: its arrays could not be read"
      f" ({_brief(e)})."
    ) from e
  nnx.update(model, restored["model"])
  nnx.update(optimizer, restored["optimizer"])


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
  for micro in micros[:stop]:
    micro_step(model, optimizer, *micro, weighted=True)
  micro_at_save = int(accumulate_state(optimizer).micro_step)
  path = pathlib.Path(ckpt_dir) / f"mid_cycle_{stop}"
  save_checkpoint(path, cfg, mode, model, optimizer)
  for micro in micros[stop:]:
    micro_step(model, optimizer, *micro, weighted=True)
  uninterrupted = jax.device_get((nnx.state(model), nnx.state(optimizer)))

  fresh_model, fresh_optimizer = build(cfg, mode)
  restore_checkpoint(path, cfg, mode, fresh_model, fresh_optimizer)
  for micro in micros[stop:]:
    micro_step(fresh_model, fresh_optimizer, *micro, weighted=True)
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


def make_table(cfg: Config, results: dict[str, RunResult], diffs) -> Table:
  table = Table(
    title=f"{cfg.steps} steps of {cfg.batch_size} samples"
    f" (every_k={cfg.every_k} x micro_batch={cfg.micro_batch})",
    caption="loss in nats/byte; Δ: max |run - big batch| over all steps",
  )
  for column in ("run", "loss", "held-out", "Δloss", "Δparams", "tokens/s"):
    table.add_column(column, justify="left" if column == "run" else "right")
  labels = {
    "reference": "big batch",
    "weighted": "accum, weighted",
    "unweighted": "accum, unweighted",
  }
  for mode, r in results.items():
    table.add_row(
      labels[mode],
      f"{r.losses[-1]:.4f}",
      f"{r.heldout:.4f}",
      "-" if mode == "reference" else f"{diffs[mode]['max_abs_dloss']:.1e}",
      "-" if mode == "reference" else f"{diffs[mode]['max_abs_dparams']:.1e}",
      f"{r.tokens_per_s:,.0f}",
    )
  return table


def plot(results: dict[str, RunResult], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ref = results["reference"].losses
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
  styles = {
    "reference": ("-", "C0"),
    "weighted": ("--", "C1"),
    "unweighted": (":", "C3"),
  }
  for mode, r in results.items():
    steps = np.arange(1, len(r.losses) + 1)
    line, color = styles[mode]
    top.plot(steps, r.losses, line, color=color, label=mode)
    if mode != "reference":
      bottom.semilogy(
        steps,
        np.maximum(np.abs(r.losses - ref), 1e-9),
        line,
        color=color,
        label=mode,
      )
  top.set_ylabel("big-batch mean loss (nats/byte)")
  top.legend()
  bottom.set_ylabel("|loss - reference loss|")
  bottom.set_xlabel("optimizer step")
  bottom.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def interpret_noise_scale(b_crit: float, batch_tokens: float) -> str:
  """One line on what the batch size means next to the critical batch size."""
  if not np.isfinite(b_crit) or b_crit <= 0:
    return (
      "no usable estimate yet (it needs cycles of >= 2 micro-batches"
      " and a clear gradient signal)."
    )
  ratio = batch_tokens / b_crit
  if ratio < 0.5:
    return (
      "well below it, so a larger batch (a larger every_k) would cut"
      " the number of steps almost in proportion."
    )
  if ratio > 2:
    return (
      "well above it, so a larger batch would barely cut the number of"
      " steps, and a smaller one would reach the same loss with less"
      " compute (the estimate grows as the loss falls)."
    )
  return "close to it: the usual balance between steps and compute."


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
    plot(results, out / "loss_curves.png")
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


def main(argv: Sequence[str] | None = None) -> dict:
  cfg, args = parse_args(argv)
  return run_demo(cfg, args.out, check_resume=args.resume_check)


if __name__ == "__main__":
  main()
