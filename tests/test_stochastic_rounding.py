"""A bfloat16 accumulator rounded stochastically (issue 62):
``accumulate(..., accumulator_dtype=jnp.bfloat16, rounding="stochastic")``.

Each add is taken in float32 and rounded to bfloat16 up or down with
probability proportional to the distance, so that the accumulator's
expectation is the exact sum: over many elements (each with its own random
bits) the mean error is within a few standard errors of 0 where rounding to
nearest loses every small gradient against a large sum. The bits come from
the state and the element's position: the same with and without ``jit``, and
a checkpoint resumed mid-cycle goes on bit for bit, on one device and on an
8-device mesh (each device its own bits)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import optax_accum

N = 4096  # elements: independent draws of one add's rounding


def _tx(rounding, k, **kwargs):
  return optax_accum.accumulate(
    optax.sgd(1.0),
    k,
    accumulator_dtype=jnp.bfloat16,
    rounding=rounding,
    reduction="sum",
    **kwargs,
  )


def _sums(rounding, grads, update=None):
  """The accumulator after adding `grads` (a list of arrays) into one
  cycle that stays open, as float64."""
  tx = _tx(rounding, len(grads) + 1)
  params = jnp.zeros(grads[0].shape)
  update = update or jax.jit(tx.update)
  state = tx.init(params)
  for g in grads:
    _, state = update(g, state, params)
  assert state.acc_grads.dtype == jnp.bfloat16
  return np.asarray(state.acc_grads, np.float64)


def _swamping(k):
  """One large gradient, then k small ones (bfloat16's spacing at 256 is 2:
  to nearest, 256 + 0.1 is 256)."""
  return [jnp.full(N, 256.0)] + [jnp.full(N, 0.1)] * k


def _typical(k):
  keys = jax.random.split(jax.random.PRNGKey(0), k)
  return [jax.random.normal(key, (N,)) * 0.01 + 0.003 for key in keys]


CASES = {
  "swamping-k8": _swamping(8),
  "swamping-k32": _swamping(32),
  "swamping-k128": _swamping(128),
  "typical-k32": _typical(32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stochastic_rounding_is_unbiased_where_nearest_is_not(case):
  grads = CASES[case]
  exact = np.sum([np.asarray(g, np.float64) for g in grads], axis=0)
  error = _sums("stochastic", grads) - exact
  # Within 4 standard errors of 0 (a mean of N draws).
  assert abs(error.mean()) < 4 * error.std() / np.sqrt(N) + 1e-6
  nearest = _sums("nearest", grads) - exact
  if case.startswith("swamping"):  # every small gradient lost
    k = len(grads) - 1
    np.testing.assert_allclose(nearest, -0.1 * k, rtol=1e-3)
    assert abs(nearest.mean()) > 20 * error.std() / np.sqrt(N)


def test_each_add_rounds_to_one_of_its_two_neighbours():
  grads = [jnp.full(N, 1.0), jnp.full(N, 0.0025)]  # 1.0025: 1.0 or 1.0078125
  sums = _sums("stochastic", grads)
  assert set(np.unique(sums)) == {1.0, 1.0078125}
  # Up with probability 0.0025 / 0.0078125 = 0.32.
  assert abs((sums > 1).mean() - 0.32) < 4 * np.sqrt(0.32 * 0.68 / N)


def test_the_same_with_and_without_jit():
  grads = _swamping(8)
  tx = _tx("stochastic", 10)
  chex.assert_trees_all_equal(
    _sums("stochastic", grads), _sums("stochastic", grads, tx.update)
  )


def test_nan_and_inf_survive_the_rounding():
  grads = [jnp.array([jnp.nan, jnp.inf, -jnp.inf, 3.0e38])] * 2
  sums = _sums("stochastic", grads)
  assert np.isnan(sums[0]) and sums[1] == np.inf and sums[2] == -np.inf
  assert sums[3] == np.inf  # 6e38 is past bfloat16's largest


def test_the_inner_optimizer_gets_the_float32_mean_of_the_bfloat16_sum():
  tx = optax_accum.accumulate(
    optax.sgd(1.0), 3, accumulator_dtype=jnp.bfloat16, rounding="stochastic"
  )
  params = jnp.zeros(N)
  state = tx.init(params)
  grads = _swamping(2)
  update = jax.jit(tx.update, static_argnames="emit")
  for g in grads[:2]:
    _, state = update(g, state, params)
  # The last add held open (emit=False), rounded as the ending call rounds
  # it: the same step and micro-step.
  _, held = update(grads[2], state, params, emit=False)
  updates, _ = update(grads[2], state, params)
  assert updates.dtype == jnp.float32
  mean = np.asarray(held.acc_grads, np.float32) * np.float32(1 / 3)
  np.testing.assert_array_equal(np.asarray(updates), -mean)


def _resumed(update, tx, grads, at):
  """The accumulator after all `grads`, with the state taken out (as a
  checkpoint) after `at` calls and put back into a fresh run."""
  params = jnp.zeros(grads[0].shape)
  state = tx.init(params)
  for g in grads[:at]:
    _, state = update(g, state, params)
  saved = jax.tree.map(np.asarray, state)
  state = jax.tree.map(jnp.asarray, saved)
  for g in grads[at:]:
    _, state = update(g, state, params)
  return state


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_a_checkpoint_mid_cycle_resumes_bit_for_bit(jit):
  tx = _tx("stochastic", 4)  # the cycle ends at call 4, 8; saved at 6
  update = jax.jit(tx.update) if jit else tx.update
  grads = [jnp.full(N, 1.0 + 0.01 * i) for i in range(11)]
  whole = _resumed(update, tx, grads, len(grads))
  chex.assert_trees_all_equal(_resumed(update, tx, grads, 6), whole)
  assert int(whole.micro_step) == 3 and int(whole.step) == 2


def _on_a_mesh(tx, mesh, params):
  """The documented shard_map step (docs/guides/scaling_shard_map.md): each
  device's gradient its own, the state with a device axis."""
  specs = optax_accum.distributed.shard_map_specs(
    jax.eval_shape(tx.init, params), "data"
  )
  init = jax.jit(
    jax.shard_map(
      lambda p: optax_accum.distributed.add_device_axis(tx.init(p)),
      mesh=mesh,
      in_specs=P(),
      out_specs=specs,
    )
  )

  def local_step(params, state, grads):
    state = optax_accum.distributed.drop_device_axis(state)
    _, state = tx.update(grads[0], state, params)
    return optax_accum.distributed.add_device_axis(state)

  step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(P(), specs, P("data")),
      out_specs=specs,
    )
  )
  return init(params), step


def test_on_a_mesh_each_device_rounds_with_its_own_bits_and_resumes():
  mesh = jax.make_mesh(
    (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  tx = _tx("stochastic", 4, axis_name="data")
  params = jnp.zeros(N)
  state, step = _on_a_mesh(tx, mesh, params)
  same = jnp.broadcast_to(jnp.full(N, 0.1), (8, N))
  big = jnp.broadcast_to(jnp.full(N, 256.0), (8, N))
  states = []
  for grads in (big, same, same):
    state = step(params, state, grads)
    states.append(state)
  # The devices added the same gradients, each rounding with its own bits.
  per_device = np.asarray(states[-1].acc_grads, np.float64).reshape(8, N)
  assert len({row.tobytes() for row in per_device}) == 8
  error = per_device - 256.2
  assert abs(error.mean()) < 4 * error.std() / np.sqrt(8 * N)
  # Resumed from the state after the first call: bit for bit.
  state = jax.tree.map(jnp.asarray, jax.tree.map(np.asarray, states[0]))
  for grads in (same, same):
    state = step(params, state, grads)
  chex.assert_trees_all_equal(
    jax.tree.map(np.asarray, state), jax.tree.map(np.asarray, states[-1])
  )


def test_the_nnx_drop_in_rounds_as_accumulate_does():
  model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
  tx = _tx("stochastic", 3)
  optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  state = tx.init(params)
  for i in range(2):
    c = 0.3 + i  # the loss's gradient: c everywhere
    grads = nnx.grad(
      lambda m, c=c: c * (jnp.sum(m.kernel[...]) + jnp.sum(m.bias[...]))
    )(model)
    optimizer.update(model, grads)
    same = jax.tree.map(lambda p, c=c: jnp.full_like(p, c), params)
    _, state = tx.update(same, state, params)
  chex.assert_trees_all_equal(optimizer.opt_state.acc_grads, state.acc_grads)


def test_arguments_are_checked_at_construction():
  with pytest.raises(ValueError, match="`rounding` must be one of"):
    optax_accum.accumulate(optax.sgd(1.0), 2, rounding="up")
  with pytest.raises(ValueError, match="accumulator_dtype=jnp.bfloat16"):
    optax_accum.accumulate(optax.sgd(1.0), 2, rounding="stochastic")
  with pytest.raises(ValueError, match="got accumulator_dtype=float16"):
    optax_accum.accumulate(
      optax.sgd(1.0), 2, accumulator_dtype=jnp.float16, rounding="stochastic"
    )


def test_unreduced_gradients_under_plain_jit_are_refused_by_name():
  """Rounding is not linear, and an unreduced array takes linear ops only:
  the engine of gradients typed unreduced says so where it would round."""
  from optax_accum import _engines  # noqa: PLC0415

  with pytest.raises(NotImplementedError, match="rounding='stochastic'"):
    _engines.Unreduced(axis_name="data").device_index()


def test_the_planner_counts_the_smaller_accumulator():
  """plan_micro_batch compiles the step: with bfloat16 params and a
  bfloat16 accumulator (stochastic rounding), its peak is half a float32
  accumulator's bytes below the float32 one's, and under a limit between
  the two the same global batch fits a larger micro-batch. (With float32
  params the float32 updates cannot share a bfloat16 accumulator's buffer
  and take one of their own: less is saved.)"""
  params = {"w": jnp.zeros((512, 512), jnp.bfloat16)}

  def plan(accumulator_dtype, rounding, limit):
    tx = optax_accum.accumulate(
      optax.sgd(1e-3), 4, accumulator_dtype=accumulator_dtype, rounding=rounding
    )

    def step(params, state, x):
      grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(params)
      updates, state = tx.update(grads, state, params)
      return optax_accum.apply_updates(params, updates, state), state

    def args_for(n):
      state = jax.eval_shape(tx.init, params)
      return params, state, jax.ShapeDtypeStruct((n, 512), jnp.bfloat16)

    step = jax.jit(step, donate_argnums=(0, 1))
    return optax_accum.plan_micro_batch(step, args_for, 64, memory_limit=limit)

  f32 = plan(jnp.float32, "nearest", 1 << 30)
  bf16 = plan(jnp.bfloat16, "stochastic", 1 << 30)
  assert f32.micro_batch == bf16.micro_batch == 64
  half = 512 * 512 * 2  # bytes a bfloat16 accumulator saves over float32
  assert abs(f32.peak_bytes - bf16.peak_bytes - half) <= 64 * 1024
  # A limit the float32 step's peak at 64 does not fit but bfloat16's does.
  limit = int((bf16.peak_bytes + half // 2) / 0.9)
  assert plan(jnp.bfloat16, "stochastic", limit).micro_batch == 64
  assert plan(jnp.float32, "nearest", limit).micro_batch < 64
