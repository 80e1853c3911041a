"""Data for the demo: blocks of standard-library source, as padded bytes.

Nothing is downloaded: the samples are the blank-line separated blocks (a
function, a docstring, a group of imports) of the Python standard library
this interpreter ships with. Files are read in sorted order and the blocks
shuffled with a fixed seed, so every run sees the same data.

Each step's big batch is sorted by length before it is cut into
micro-batches, as a padding-aware pipeline buckets by length: the
micro-batches of a step hold very different numbers of real tokens, which is
what makes the token weighting matter.
"""

import pathlib
import re
import sysconfig
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from config import Config

VOCAB = 256  # bytes


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
  """`batch` cut into `cfg.every_k` consecutive micro-batches."""
  return [
    Samples(
      *(a[i * cfg.micro_batch : (i + 1) * cfg.micro_batch] for a in batch)
    )
    for i in range(cfg.every_k)
  ]
