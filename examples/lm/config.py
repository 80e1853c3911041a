"""What determines a run: of the demo (`Config`), of adaptive.py (`Settings`)."""

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

  @classmethod
  def of_args(cls, args, **fields) -> "Config":
    """The Config of a script's command line: each of argparse's `args`
    that names a field (``--d-model`` is `d_model`), then `fields`."""
    names = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in vars(args).items() if k in names}
    return cls(**{**given, **fields})


# The runs of adaptive.py: each chooses k (micro-batches per optimizer step)
# its own way; see adaptive.make_every_k.
RUNS = ("fixed-small", "fixed-large", "schedule", "controller")
EXTRA_RUNS = ("controller-known-w", "controller-uncoupled")
BASELINE = "fixed-large"  # the others race to its final held-out loss


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything that determines the evaluation (one seed per entry)."""

  budget: int = 1600  # micro-batches per run
  micro_batch: int = 4  # samples per micro-batch
  max_len: int = 128
  d_model: int = 64
  num_layers: int = 2
  lr: float = 2e-3  # Adam's learning rate at k = k_small
  k_small: int = 2
  k_large: int = 8
  k_max: int = 16
  schedule: tuple[tuple[float, int], ...] = ((0.25, 4), (0.5, 8))
  min_cycles: int = 20
  scale: float = 1.0
  evals: int = 16
  heldout_samples: int = 256
  seeds: tuple[int, ...] = (0, 1)
  runs: tuple[str, ...] = RUNS + EXTRA_RUNS

  def model_config(self, seed: int) -> Config:
    # One "step" of the demo's Config = one micro-batch of this stream.
    return Config(
      steps=self.budget,
      every_k=1,
      micro_batch=self.micro_batch,
      max_len=self.max_len,
      d_model=self.d_model,
      num_layers=self.num_layers,
      heldout_samples=self.heldout_samples,
      seed=seed,
    )
