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


# ----------------------------------------------------------------------------
# Issue 70: the randomness, family by family.
# ----------------------------------------------------------------------------

# An add whose exact result sits between two bfloat16 neighbours: 1.0025
# rounds to 1.0 or 1.0078125, up with probability 0.32. Each element's
# direction is one draw of the bits; two draws of the same bits agree.
BASE, SMALL, UP = 1.0, 0.0025, 1.0


def _ups(acc):
  return np.asarray(acc, np.float64) > UP


def _correlation(a, b):
  return float(np.corrcoef(a.astype(float), b.astype(float))[0, 1])


def _open_cycle(adds, tree_of, k):
  """The accumulator after `adds` (values, each added to every element of
  every leaf of `tree_of(value)`) in a cycle of `k`, from a fresh state."""
  tx = _tx("stochastic", k)
  params = tree_of(0.0)
  update = jax.jit(tx.update)
  state = tx.init(params)
  for value in adds:
    _, state = update(tree_of(value), state, params)
  return state.acc_grads


def _one_leaf(value):
  return jnp.full(N, value, jnp.float32)


def _two_leaves(value):
  return {"a": _one_leaf(value), "b": _one_leaf(value)}


def _micro_steps():
  """The same add at micro-step 1 and at micro-step 2 of a cycle of the
  same step (the add of 0.0 before it exact)."""
  first = _open_cycle([BASE, SMALL], _one_leaf, 4)
  second = _open_cycle([0.0, BASE, SMALL], _one_leaf, 4)
  return _ups(first), _ups(second)


def _cycles():
  """The same cycle twice (sgd(1) on the sum: the update is minus it)."""
  tx = _tx("stochastic", 2)
  params = _one_leaf(0.0)
  update = jax.jit(tx.update)
  state, out = tx.init(params), []
  for _ in range(2):
    for value in (BASE, SMALL):
      updates, state = update(_one_leaf(value), state, params)
    out.append(_ups(-updates))
  return tuple(out)


def _leaves():
  acc = _open_cycle([BASE, SMALL], _two_leaves, 4)
  return _ups(acc["a"]), _ups(acc["b"])


INDEPENDENT = {
  "micro_steps": _micro_steps,
  "cycles": _cycles,
  "leaves": _leaves,
}


@pytest.mark.parametrize("between", list(INDEPENDENT))
def test_the_bits_are_independent_between(between):
  """The same add rounded at two places of a run (another micro-step,
  cycle or leaf; the devices: the mesh test above) goes up or down
  independently: the directions' correlation is that of independent
  draws (|r| < 0.1 over 4096 elements, sd 0.016), each up about 32% of the
  time."""
  first, second = INDEPENDENT[between]()
  for ups in (first, second):
    assert abs(ups.mean() - 0.32) < 4 * np.sqrt(0.32 * 0.68 / N)
  assert abs(_correlation(first, second)) < 0.1


CYCLES, ELEMENTS, K = 512, 64, 8


@pytest.fixture(scope="module")
def many_cycles():
  """Two identical 64-element leaves fed the same 8 micro-batches (one
  large, seven small: swamped to nearest) for 512 cycles, in one jitted
  scan: each cycle's emitted sum minus the exact one, per element, and
  per leaf."""
  tx = _tx("stochastic", K)
  key = jax.random.split(jax.random.PRNGKey(1), 2)
  big = 256.0 + jax.random.uniform(key[0], (ELEMENTS,)) * 8
  small = jax.random.uniform(key[1], (K - 1, ELEMENTS)) * 0.05
  grads = jnp.concatenate([big[None], small]).astype(jnp.float32)
  exact = np.sum(np.asarray(grads, np.float64), axis=0)
  params = {"a": jnp.zeros(ELEMENTS), "b": jnp.zeros(ELEMENTS)}

  @jax.jit
  def run(state):
    def call(state, i):
      g = grads[i % K]
      updates, state = tx.update({"a": g, "b": g}, state, params)
      return state, updates

    _, updates = jax.lax.scan(call, state, jnp.arange(CYCLES * K))
    return jax.tree.map(lambda u: -u[K - 1 :: K], updates)  # the sums

  sums = run(tx.init(params))
  return {name: np.asarray(s, np.float64) - exact for name, s in sums.items()}


def test_per_element_the_mean_over_cycles_is_unbiased_per_element(many_cycles):
  """Each element's error averages out over the cycles: its mean within a
  few of its own standard errors of 0 (an element that rounded with the
  same bits every cycle would err by the same amount every time: no spread,
  a bias of many standard errors)."""
  errors = many_cycles["a"]
  spread = errors.std(axis=0)
  assert (spread > 0).all()
  z = np.abs(errors.mean(axis=0)) / (spread / np.sqrt(CYCLES))
  assert np.median(z) < 1.5 and z.max() < 4.5, (np.median(z), z.max())


def test_two_identical_leaves_err_independently(many_cycles):
  """The same gradients into two leaves of the same shape: their rounding
  errors are uncorrelated (|r| < 0.1 over 32,768 pairs)."""
  a, b = many_cycles["a"].ravel(), many_cycles["b"].ravel()
  assert abs(_correlation(a, b)) < 0.1


def test_each_device_rounds_independently_of_the_others():
  """8 devices add the same gradients: every pair's directions are
  independent draws."""
  mesh = jax.make_mesh(
    (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  tx = _tx("stochastic", 4, axis_name="data")
  params = jnp.zeros(N)
  state, step = _on_a_mesh(tx, mesh, params)
  for value in (BASE, SMALL):
    state = step(params, state, jnp.broadcast_to(_one_leaf(value), (8, N)))
  ups = _ups(np.asarray(state.acc_grads).reshape(8, N))
  worst = max(
    abs(_correlation(ups[i], ups[j])) for i in range(8) for j in range(i)
  )
  assert worst < 0.1, worst


# ----------------------------------------------------------------------------
# Issue 70: every gradient dtype into every accumulator and rounding.
# ----------------------------------------------------------------------------

GRAD_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
ACCUMULATORS = {
  "f32": (jnp.float32, "nearest"),
  "bf16-nearest": (jnp.bfloat16, "nearest"),
  "bf16-stochastic": (jnp.bfloat16, "stochastic"),
}
SWAMP_K = 128  # 256, then 127 x 0.01: the mean 2.0099 in float64


def _swamping_grads(dtype):
  return [jnp.full(N, 256.0, dtype)] + [jnp.full(N, 0.01, dtype)] * (
    SWAMP_K - 1
  )


def _typical_grads(dtype):
  """Gradients of one scale (nothing swamped), each element its own."""
  return [g.astype(dtype) for g in _typical(32)]


DTYPE_CASES = {"swamping": _swamping_grads, "typical": _typical_grads}


def _accumulated(grads, accumulator, params_dtype):
  """The accumulator's sum after `grads`, the cycle open, as float64."""
  dtype, rounding = ACCUMULATORS[accumulator]
  tx = optax_accum.accumulate(
    optax.sgd(1.0),
    len(grads) + 1,
    accumulator_dtype=dtype,
    rounding=rounding,
    reduction="sum",
  )
  params = jnp.zeros(N, params_dtype)
  stacked = jnp.stack(grads)

  @jax.jit
  def run(state):
    def call(state, g):
      return tx.update(g, state, params)[1], None

    return jax.lax.scan(call, state, stacked)[0]

  acc = run(tx.init(params)).acc_grads
  assert acc.dtype == dtype
  return np.asarray(acc, np.float64)


def _oracle(grads, accumulator):
  """Each add in float32 (the gradient widened), then rounded to the
  accumulator's dtype to nearest: NumPy's (ml_dtypes') casts."""
  dtype = np.dtype(ACCUMULATORS[accumulator][0])
  acc = np.zeros(N, dtype)
  for g in grads:
    acc = (acc.astype(np.float32) + np.asarray(g, np.float32)).astype(dtype)
  return acc.astype(np.float64)


@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("params_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("accumulator", list(ACCUMULATORS))
@pytest.mark.parametrize("grads_dtype", list(GRAD_DTYPES))
def test_every_gradient_dtype_into_every_accumulator(
  grads_dtype, accumulator, params_dtype, case
):
  """The swamping case (issue 70: bf16 gradients into a stochastically
  rounded bf16 accumulator gave 2.0 where the mean is 2.0099): where the
  accumulator rounds to nearest, equal to the oracle of each add; where it
  rounds stochastically, unbiased (the mean error within 4 standard errors
  of 0 over 4096 elements, where to nearest loses every small gradient)."""
  grads = DTYPE_CASES[case](GRAD_DTYPES[grads_dtype])
  sums = _accumulated(grads, accumulator, GRAD_DTYPES[params_dtype])
  if accumulator.endswith("stochastic"):
    exact = np.sum([np.asarray(g, np.float64) for g in grads], axis=0)
    error = sums - exact
    assert abs(error.mean()) < 4 * error.std() / np.sqrt(N) + 1e-6
    if case == "swamping":  # the mean 2.0099, not nearest's 2.0
      assert abs(sums.mean() / SWAMP_K - exact.mean() / SWAMP_K) < 2e-3
  else:
    np.testing.assert_array_equal(sums, _oracle(grads, accumulator))


@pytest.mark.parametrize("accumulator", list(ACCUMULATORS))
def test_float64_gradients_under_x64(x64, accumulator):
  """float64 gradients (jax_enable_x64) into each accumulator: added in
  float32 and rounded as above (a float64 accumulator: test_dtypes.py)."""
  del x64
  grads = _swamping_grads(jnp.float64)
  sums = _accumulated(grads, accumulator, jnp.float64)
  if accumulator.endswith("stochastic"):
    error = sums - np.sum([np.asarray(g) for g in grads], axis=0)
    assert abs(error.mean()) < 4 * error.std() / np.sqrt(N) + 1e-6
  else:
    np.testing.assert_array_equal(sums, _oracle(grads, accumulator))


def test_a_complex_leaf_beside_a_stochastic_accumulator():
  """A complex leaf keeps a complex accumulator, added exactly; only the
  bfloat16 leaves round (it raised a TypeError on the first update)."""
  tx = optax_accum.accumulate(
    optax.sgd(1.0), 2, accumulator_dtype=jnp.bfloat16, rounding="stochastic"
  )
  params = {"c": jnp.zeros(4, jnp.complex64), "r": jnp.zeros(4)}
  grads = {"c": jnp.full(4, 1 + 2j, jnp.complex64), "r": jnp.full(4, 1.0)}
  for update in (tx.update, jax.jit(tx.update)):
    state = tx.init(params)
    _, state = update(grads, state, params)
    updates, state = update(grads, state, params)
    np.testing.assert_array_equal(updates["c"], jnp.full(4, -(1 + 2j)))
    np.testing.assert_array_equal(updates["r"], jnp.full(4, -1.0))
    assert state.acc_buffer["c"].dtype == jnp.complex64
