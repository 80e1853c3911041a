"""What each row of the whole-loop results compares: ``(path, ours, peer)``,
the names of two of ``_loops.VARIANTS``. Apart from ``_loops.py`` (which
needs jax) so that ``render.py`` reads them too."""

# (path, ours, peer): what each row of the results compares. `bare` and
# `floor` are references (the README loop over its bare step; the floor
# over the bare step).
PAIRS = (
  ("jax.jit (README)", "readme", "multisteps"),
  ("jax.jit, emit=", "static", "multisteps"),
  ("NNX, nnx.jit", "nnx_jit", "nnx_jit_multisteps"),
  ("NNX, nnx.jit_partial", "nnx_fast", "nnx_fast_multisteps"),
  ("linen TrainState", "linen", "linen_multisteps"),
  ("equinox", "equinox", "equinox_multisteps"),
)
REFERENCES = (
  ("README loop / its bare step", "readme", "bare"),
  (
    "README loop, bf16 stochastic accumulator / float32 accumulator",
    "readme_bf16_stochastic",
    "readme",
  ),
  ("bare step / floor", "bare", "floor"),
  ("bare step / one big batch", "bare", "big_batch"),
)
