"""Saving and restoring the demo's model and optimizer with Orbax, mid-cycle.

The `AccumulateState` inside the `nnx.Optimizer` is a pytree of arrays, so
``nnx.state(optimizer)`` saves and restores like any other state, also in the
middle of an accumulation cycle. A checkpoint is a composite: the arrays
(``state``) and the run's configuration as JSON (``config``).

`restore_checkpoint` checks the configuration and Orbax's metadata before it
reads any array, so a mismatch names what differs; a missing, truncated or
corrupt checkpoint raises `CheckpointError` with a one-line reason and the
Orbax error chained underneath.
"""

import dataclasses
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from config import Config


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
  model: nnx.Module,
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
  model: nnx.Module,
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
