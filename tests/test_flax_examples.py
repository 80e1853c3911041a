"""Flax integration: the NNX and linen examples, schedules, BatchNorm.

Each example is imported from its file and run with its own assertions; the
tests around them pin down the Flax and optax behaviour the examples and the
README rely on, so a Flax release that changes it fails here first.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import optax_accum

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
  spec = importlib.util.spec_from_file_location(
    f"example_{name}", EXAMPLES / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def nnx_quickstart():
  return _load("nnx_quickstart")


@pytest.fixture(scope="module")
def linen_trainstate():
  return _load("linen_trainstate")


@pytest.fixture(scope="module")
def lr_schedules():
  return _load("lr_schedules")


# ---------------------------------------------------------------------------
# Smoke tests: every example runs and its own checks pass.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "name", ["nnx_quickstart", "linen_trainstate", "lr_schedules"]
)
def test_example_main_runs_and_passes_its_checks(name, capsys):
  _load(name).main()
  assert capsys.readouterr().out  # it reports what it checked


def test_nnx_quickstart_matches_big_batch_with_uneven_micro_batches(
  nnx_quickstart,
):
  big, accumulated = nnx_quickstart.train_both(
    steps=2, every_k=3, micro_batch=4
  )
  # float32 rounding of two summation orders (Adam, 2 steps).
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
    nnx.to_pure_dict(big),
    nnx.to_pure_dict(accumulated),
  )


@pytest.mark.parametrize("counts", ["calls", "optimizer_steps"])
def test_linen_trainstate_matches_big_batch_with_either_step_count(
  linen_trainstate, counts
):
  """Two full windows of 3 and a last one of 1 that `flush=True` ends:
  `step` counts the 7 calls or the 3 optimizer steps, as asked."""
  big, states = linen_trainstate.train_both(steps=2, every_k=3, micro_batch=4)
  state = states[counts]
  assert int(state.step) == {"calls": 7, "optimizer_steps": 3}[counts]
  assert int(state.opt_state.step) == int(big.step) == 3
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
    big.params,
    state.params,
  )


def test_linen_trainstate_passes_flush_on(linen_trainstate, maybe_jit):
  """Without `flush` reaching the optimizer, a short window emits nothing."""
  state = linen_trainstate.AccumTrainState.create(
    apply_fn=None,
    params={"w": jnp.zeros(2)},
    tx=optax_accum.accumulate(optax.sgd(1.0), 4),
  )
  grads = {"w": jnp.ones(2)}
  apply = maybe_jit(
    lambda s, flush: s.apply_gradients(grads=grads, flush=flush)
  )
  state = apply(state, False)
  assert int(state.opt_state.step) == 0
  state = apply(state, True)
  assert int(state.opt_state.step) == 1 and int(state.step) == 2
  np.testing.assert_array_equal(state.params["w"], -jnp.ones(2))


# ---------------------------------------------------------------------------
# What Flax does with `weight=` (the reason for each example's pattern).
# ---------------------------------------------------------------------------


def test_nnx_optimizer_update_forwards_weight_to_tx():
  # sgd(1) on a linear model whose gradient we know: w' = w - weighted mean.
  model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
  w0 = np.asarray(model.kernel[...])
  optimizer = nnx.Optimizer(
    model, optax_accum.accumulate(optax.sgd(1.0), 2), wrt=nnx.Param
  )
  grads = [
    nnx.State({"kernel": nnx.Param(jnp.full((1, 1), g, jnp.float32))})
    for g in (1.0, 5.0)
  ]
  optimizer.update(model, grads[0], weight=1.0)
  np.testing.assert_array_equal(model.kernel[...], w0)  # mid-cycle: no move
  optimizer.update(model, grads[1], weight=3.0)
  # (1 * 1 + 3 * 5) / 4 = 4; without the weights it would be 3.
  np.testing.assert_allclose(model.kernel[...], w0 - 4.0, rtol=1e-6)
  assert int(optimizer.step[...]) == 2  # nnx counts calls ...
  assert int(optimizer.opt_state.step[...]) == 1  # ... accumulate steps


def test_linen_trainstate_apply_gradients_does_not_forward_weight():
  # Why examples/linen_trainstate.py subclasses TrainState.
  params = {"w": jnp.ones(2)}
  state = train_state.TrainState.create(
    apply_fn=None, params=params, tx=optax_accum.accumulate(optax.sgd(1.0), 2)
  )
  with pytest.raises(TypeError, match="weight"):
    state.apply_gradients(grads=params, weight=2.0)


# ---------------------------------------------------------------------------
# Learning-rate schedules.
# ---------------------------------------------------------------------------


def test_schedule_inside_advances_once_per_optimizer_step(lr_schedules):
  got = lr_schedules.learning_rates(
    lr_schedules.inside(every_k=3), steps=4, every_k=3
  )
  want = [lr_schedules.SCHEDULE(t) for t in range(4)]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_inject_hyperparams_around_accumulate_counts_micro_batches(
  lr_schedules,
):
  k = 3
  got = lr_schedules.learning_rates(
    lr_schedules.around(every_k=k), steps=4, every_k=k
  )
  want = [lr_schedules.SCHEDULE(t * k + k - 1) for t in range(4)]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  fixed = lr_schedules.learning_rates(
    lr_schedules.around_rescaled(every_k=k), steps=4, every_k=k
  )
  np.testing.assert_allclose(
    fixed, [lr_schedules.SCHEDULE(t) for t in range(4)], rtol=1e-6
  )


def test_adam_schedule_count_is_the_optimizer_step():
  schedule = optax.linear_schedule(1e-2, 0.0, transition_steps=10)
  tx = optax_accum.accumulate(optax.adam(schedule), every_k=4)
  params = jnp.zeros(3)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(3 * 4 + 2):  # three cycles and half of a fourth
    _, state = update(jnp.ones(3), state, params)
  # ScaleByAdamState.count and ScaleByScheduleState.count: both 3.
  counts = [s.count for s in state.inner_state if hasattr(s, "count")]
  assert [int(c) for c in counts] == [3, 3]
  assert int(state.step) == 3


# ---------------------------------------------------------------------------
# BatchNorm: running statistics update per micro-batch (README note).
# ---------------------------------------------------------------------------


class _BNModel(nnx.Module):
  def __init__(self, momentum: float, rngs: nnx.Rngs):
    self.bn = nnx.BatchNorm(1, momentum=momentum, rngs=rngs)
    self.linear = nnx.Linear(1, 1, rngs=rngs)

  def __call__(self, x):
    return self.linear(self.bn(x))


def _bn_after_one_optimizer_step(momentum: float, every_k: int):
  model = _BNModel(momentum, nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, optax_accum.accumulate(optax.sgd(0.1), every_k), wrt=nnx.Param
  )

  @nnx.jit
  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(jnp.square(m(x) - 1.0)))(model)
    optimizer.update(model, grads)

  kernel_before = np.asarray(model.linear.kernel[...])
  # Every micro-batch has mean 2, so after n EMA updates from 0 the running
  # mean is 2 (1 - momentum**n).
  x = jnp.asarray([[1.0], [3.0]], jnp.float32)
  for _ in range(every_k):
    step(model, optimizer, x)
  moved = not np.array_equal(kernel_before, model.linear.kernel[...])
  return float(model.bn.mean[...][0]), moved


def test_batchnorm_running_stats_update_per_micro_batch():
  mean, moved = _bn_after_one_optimizer_step(momentum=0.9, every_k=4)
  assert moved  # one optimizer step happened ...
  np.testing.assert_allclose(mean, 2 * (1 - 0.9**4), rtol=1e-5)  # ... 4 EMA


def test_batchnorm_momentum_root_keeps_the_big_batch_horizon():
  # The recommended pattern: momentum ** (1 / every_k) per micro-batch.
  k = 4
  mean, _ = _bn_after_one_optimizer_step(momentum=0.9 ** (1 / k), every_k=k)
  np.testing.assert_allclose(mean, 2 * (1 - 0.9), rtol=1e-5)


def test_state_readers_accept_an_nnx_optimizer_opt_state():
  """has_updated / noise_scale unwrap nnx's OptArray leaves themselves."""
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, track_noise_scale=True)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(model)
  seen = []
  for _ in range(4):
    optimizer.update(model, grads)
    seen.append(bool(optax_accum.has_updated(optimizer.opt_state)))
  assert seen == [False, True, False, True]
  # Identical micro-batch gradients: no noise, a finite zero estimate.
  assert float(optax_accum.noise_scale(optimizer.opt_state)) == 0.0
