"""The demo's configuration: everything that determines a run."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that determines a run.

  All fields but `steps` and `heldout_samples` must match to resume from a
  checkpoint (see `checkpointing.restore_checkpoint`).
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
