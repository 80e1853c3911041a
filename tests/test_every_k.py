"""How many micro-batches each cycle wants: schedules of the weight seen, the
noise-scale controller, and the inner optimizer as a function of k.

Every test runs with and without jit where both apply.
"""

import functools

import _common
import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

# ---------------------------------------------------------------------------
# k from the weight seen.
# ---------------------------------------------------------------------------


def test_token_schedule_emits_in_the_exact_pattern_with_one_trace():
  """10 tokens per micro-batch; k = 1 until 30 tokens, 2 until 70, then 4:
  updates on calls 1, 2, 3 (30 seen), 5, 7 (70 seen), 11 and 15."""
  tx = optax_accum.accumulate(
    _common.identity(), optax_accum.piecewise_every_k({30: 2, 70: 4})
  )
  params = jnp.zeros(2)
  state = tx.init(params)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def update(g, state):
    return tx.update(g, state, params, weight=10.0)

  emitted, wanted = [], []
  for i in range(1, 16):
    wanted.append(int(optax_accum.current_every_k(state)))
    _, state = update(jnp.full(2, float(i)), state)
    if optax_accum.has_updated(state):
      emitted.append(i)
  assert emitted == [1, 2, 3, 5, 7, 11, 15]
  assert wanted == [1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4]
  assert float(optax_accum.weight_seen(state)) == 150.0


def test_schedule_of_the_step_alone_still_works(maybe_jit):
  tx = optax_accum.accumulate(_common.identity(), lambda step: step + 1)
  params = jnp.zeros(1)
  state = tx.init(params)
  update = maybe_jit(tx.update)
  emitted = []
  for i in range(1, 11):
    _, state = update(jnp.ones(1), state, params)
    if optax_accum.has_updated(state):
      emitted.append(i)
  assert emitted == [1, 3, 6, 10]


# Three seeds under jit; eagerly (80 dispatched calls, ~6 s) one is enough.
@pytest.mark.parametrize(
  ("mode", "seed"), [("jit", 0), ("jit", 1), ("jit", 2), ("nojit", 0)]
)
def test_k_never_changes_mid_cycle(mode, seed):
  """Random token counts (zeros included), flushes and skipped NaN
  micro-batches: k changes only on calls that end a cycle."""
  maybe_jit = _common.MODES[mode]
  rng = np.random.default_rng(seed)
  tx = optax_accum.accumulate(
    _common.identity(),
    optax_accum.piecewise_every_k({40: 2, 90: 3, 200: 5}),
    skip_nonfinite=True,
  )
  params = jnp.zeros(2)
  state = tx.init(params)
  update = maybe_jit(tx.update)
  changes = 0
  for _ in range(80):
    weight = float(rng.choice([0, 3, 7, 12]))
    grad = jnp.full(2, np.nan if rng.random() < 0.1 else 1.0)
    flush = bool(rng.random() < 0.05)
    before = int(state.every_k)
    _, state = update(grad, state, params, weight=weight, flush=flush)
    if int(state.every_k) != before:
      changes += 1
      assert int(state.micro_step) == 0, "k changed in the middle of a cycle"
  assert changes >= 2  # the test saw k change, not a constant schedule


def test_weight_seen_is_a_compensated_sum():
  """Past 2**24 a float32 total no longer moves by 1; the sum still counts."""
  seen = jnp.asarray([2.0**24, 0.0], jnp.float32)
  add = jax.jit(optax_accum._state.add_weight_seen)
  plain = jnp.float32(2.0**24)
  for _ in range(100):
    seen = add(seen, jnp.float32(1.0))
    plain = plain + jnp.float32(1.0)
  assert float(plain) == 2.0**24  # what an uncompensated float32 gives
  assert float(optax_accum._state.total_of(seen)) == 2.0**24 + 100


# ---------------------------------------------------------------------------
# The controller, on a problem with a known noise scale.
# ---------------------------------------------------------------------------

D, SIGMA = 256, 4.0
G = jnp.ones(D)  # |G|^2 = D
B_SIMPLE = D * SIGMA**2 / D  # tr(Sigma) / |G|^2 = 16 examples
MICRO = 2.0  # examples per micro-batch: the target k is B_SIMPLE / MICRO = 8


def _run_controller(grow, cycles, seed=0, every=None, weight_of=None):
  """`weight_of(cycle)`: the examples per micro-batch in that cycle
  (default MICRO); each micro-batch's gradient is a mean over them."""
  tx = optax_accum.accumulate(
    optax.sgd(0.0),
    grow,
    track_noise_scale=True,
    noise_scale_decay=0.9,
  )
  params = jnp.zeros(D)

  @jax.jit
  def step(state, key, weight):
    z = jax.random.normal(key, (D,))
    g = G + SIGMA / jnp.sqrt(weight) * z
    return tx.update(g, state, params, weight=weight)[1]

  state = tx.init(params)
  key = jax.random.PRNGKey(seed)
  ks = []
  while len(ks) < cycles:
    key, sub = jax.random.split(key)
    weight = MICRO if weight_of is None else weight_of(len(ks))
    state = step(state, sub, jnp.float32(weight))
    if optax_accum.has_updated(state):
      ks.append(int(optax_accum.current_every_k(state)))
      if every is not None:
        every(state)
  return ks, state


def test_controller_grows_to_the_noise_scale_and_stays():
  grow = optax_accum.grow_every_k(k_max=64, min_cycles=20)
  ks, state = _run_controller(grow, cycles=300)
  assert ks[0] == 2
  assert all(a <= b for a, b in zip(ks, ks[1:], strict=False)), "shrank"
  assert set(ks) <= {2, 4, 8}  # powers of two up to the target, no further
  # Three changes, each after 20 cycles of evidence: at 8 within 120.
  assert ks.index(8) < 120, ks
  assert ks[-1] == 8
  estimate = float(optax_accum.noise_scale(state))
  assert 0.7 * B_SIMPLE < estimate < 1.3 * B_SIMPLE, estimate


def test_controller_waits_for_evidence_between_changes():
  grow = optax_accum.grow_every_k(k_max=64, min_cycles=20)
  ks, _ = _run_controller(grow, cycles=120)
  changes = [i for i in range(1, len(ks)) if ks[i] != ks[i - 1]]
  assert changes and changes[0] >= 19
  assert all(b - a >= 20 for a, b in zip(changes, changes[1:], strict=False))


@pytest.mark.parametrize(
  "kwargs, final",
  [
    ({"k_max": 4}, 4),  # clamped above although the target is 8
    ({"k_max": 64, "scale": 0.25}, 2),  # target 2: stays at k_min
    # target 12: 3 -> 9 in one factor of 3, never 27
    ({"k_max": 64, "k_min": 3, "factor": 3, "scale": 1.5}, 9),
    ({"k_max": 6}, 6),  # the clamp, not a power of two
  ],
  ids=["k_max", "scale", "factor", "k_max_not_a_power"],
)
def test_controller_respects_the_clamps_and_factor(kwargs, final):
  ks, _ = _run_controller(
    optax_accum.grow_every_k(min_cycles=10, **kwargs), 150
  )
  assert ks[-1] == final, ks
  assert max(ks) <= kwargs["k_max"]
  factor, k_min = kwargs.get("factor", 2), kwargs.get("k_min", 2)
  allowed = {min(k_min * factor**j, kwargs["k_max"]) for j in range(8)}
  assert set(ks) <= allowed, ks


def test_controller_with_a_given_micro_batch_weight():
  """Told that a micro-batch weighs 8 examples, the target is 16 / 8 = 2."""
  grow = optax_accum.grow_every_k(
    k_max=64, min_cycles=10, micro_batch_weight=8.0
  )
  ks, _ = _run_controller(grow, cycles=100)
  assert set(ks) == {2}


def test_a_light_cycle_does_not_make_the_controller_grow():
  """The micro-batch weight is the run-long mean: one cycle of light
  micro-batches (a quarter of the usual examples) right when the evidence
  is ready does not pass for the typical micro-batch. At scale 0.25 the
  target is 0.25 * 16 / 2 = 2 micro-batches: k stays at k_min; judged by
  that light cycle alone (weight 0.5) the target would be 8."""
  light = 5  # the cycle whose end first has min_cycles of evidence

  def weight_of(cycle):
    return MICRO / 4 if cycle == light else MICRO

  ks, state = _run_controller(
    optax_accum.grow_every_k(k_max=64, min_cycles=light + 1, scale=0.25),
    cycles=40,
    weight_of=weight_of,
  )
  assert set(ks) == {2}, ks
  # The mean the controller read: every emitted cycle's weight over its
  # micro-batches (here all cycles have k = 2).
  assert float(state.grow.micro_batches) == 2 * 40
  seen = float(optax_accum.weight_seen(state))
  assert seen == pytest.approx(2 * MICRO * 39 + 2 * MICRO / 4)
  # The same light cycle read as typical makes it grow: the test can fail.
  ks_light, _ = _run_controller(
    optax_accum.grow_every_k(
      k_max=64, min_cycles=light + 1, scale=0.25, micro_batch_weight=MICRO / 4
    ),
    cycles=40,
    weight_of=weight_of,
  )
  assert max(ks_light) > 2, ks_light


SAVE, STOP = 6, 24


def test_controller_resumes_exactly_from_a_mid_cycle_checkpoint(maybe_jit):
  grow = optax_accum.grow_every_k(k_max=16, min_cycles=2)
  tx = optax_accum.accumulate(
    optax.adam(1e-2), grow, track_noise_scale=True, noise_scale_decay=0.9
  )
  params = jnp.zeros(D)
  update = maybe_jit(functools.partial(tx.update, weight=MICRO))

  def run(state, params, start, stop):
    for i in range(start, stop):
      g = G + SIGMA * jax.random.normal(jax.random.PRNGKey(i), (D,))
      updates, state = update(g, state, params)
      params = optax.apply_updates(params, updates)
    return state, params

  # Eager calls are slow: a short window, in which the controller acts
  # both before and after the save.
  straight, straight_params = run(tx.init(params), params, 0, STOP)
  state, mid_params = run(tx.init(params), params, 0, SAVE)
  assert 2 < int(state.every_k) < int(straight.every_k)
  assert int(state.micro_step) != 0  # saved in the middle of a cycle
  blob = flax.serialization.to_bytes((state, mid_params))
  restored, restored_params = flax.serialization.from_bytes(
    (tx.init(params), params), blob
  )
  resumed, resumed_params = run(restored, restored_params, SAVE, STOP)
  chex.assert_trees_all_equal(resumed, straight)
  chex.assert_trees_all_equal(resumed_params, straight_params)


def test_controller_replicas_agree_under_axis_name():
  """4 replicas, each with its own noise: every replica's k sequence is the
  same, and the controller does grow. Each device's share of a micro-step
  weighs 0.5, so a (global) micro-batch weighs 2 and the target is 8."""
  n_dev, share = 4, 0.5
  grow = optax_accum.grow_every_k(k_max=32, min_cycles=10)
  tx = optax_accum.accumulate(
    optax.sgd(0.0),
    grow,
    track_noise_scale=True,
    noise_scale_decay=0.9,
    axis_name="dev",
  )
  params = jnp.zeros(D)

  @jax.jit
  def step(state, key):
    keys = jax.random.split(key, n_dev)
    g = G[None] + SIGMA / jnp.sqrt(share) * jax.vmap(
      lambda k: jax.random.normal(k, (D,))
    )(keys)
    update = functools.partial(tx.update, weight=share)
    return jax.vmap(update, axis_name="dev", in_axes=(0, 0, None))(
      g, state, params
    )[1]

  state = jax.vmap(tx.init, axis_size=n_dev, in_axes=None)(params)
  key = jax.random.PRNGKey(0)
  history = []
  for _ in range(400):
    key, sub = jax.random.split(key)
    state = step(state, sub)
    history.append(np.asarray(state.every_k))
  history = np.stack(history)
  np.testing.assert_array_equal(history, history[:, :1].repeat(n_dev, 1))
  assert history[-1, 0] == 8


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"k_max": 0}, ValueError, "k_max"),
    ({"k_max": 8, "k_min": 1}, ValueError, "k_min"),
    ({"k_max": 8, "k_min": 16}, ValueError, "k_min"),
    ({"k_max": 8, "factor": 1}, ValueError, "factor"),
    ({"k_max": 8, "scale": -1.0}, ValueError, "scale"),
    ({"k_max": 8, "scale": "1"}, TypeError, "scale"),
    ({"k_max": 8, "min_cycles": 0}, ValueError, "min_cycles"),
    ({"k_max": 8, "micro_batch_weight": 0.0}, ValueError, "micro_batch"),
    ({"k_max": 2.0}, TypeError, "k_max"),
  ],
)
def test_controller_arguments_are_checked(kwargs, error, match):
  with pytest.raises(error, match=f"`{match}"):
    optax_accum.grow_every_k(**kwargs)


def test_controller_needs_the_noise_scale():
  with pytest.raises(ValueError, match="track_noise_scale=True"):
    optax_accum.accumulate(optax.sgd(0.1), optax_accum.grow_every_k(8))


@pytest.mark.parametrize(
  "boundaries, initial, match",
  [
    ([(10, 2)], 1, "boundaries"),
    ({10: 0}, 1, "boundaries"),
    ({10: 2}, 0, "initial"),
  ],
)
def test_piecewise_arguments_are_checked(boundaries, initial, match):
  with pytest.raises((TypeError, ValueError), match=f"`{match}"):
    optax_accum.piecewise_every_k(boundaries, initial)


# ---------------------------------------------------------------------------
# The inner optimizer as a function of k.
# ---------------------------------------------------------------------------


def test_learning_rate_follows_the_cycle_k(maybe_jit):
  """sqrt-rule learning rate: each update is sgd at 0.1 sqrt(k / 2) on the
  cycle's mean gradient, k = 2, 4, 8 from a token schedule."""
  lr = lambda k: 0.1 * jnp.sqrt(k / 2)  # noqa: E731
  tx = optax_accum.accumulate(
    optax_accum.inner_for_every_k(lambda k: optax.sgd(lr(k), momentum=0.9)),
    optax_accum.piecewise_every_k({4: 4, 12: 8}, initial=2),
  )
  params = jnp.zeros(3)
  state = tx.init(params)
  ref_params, trace = params, jnp.zeros(3)
  update = maybe_jit(tx.update)
  for k in (2, 2, 4, 4, 8):
    grads = [jnp.arange(3.0) + i for i in range(k)]
    for g in grads:
      updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
    trace = sum(grads) / k + 0.9 * trace
    ref_params = ref_params - lr(k) * trace
  np.testing.assert_allclose(params, ref_params, rtol=1e-6)


def test_inner_for_every_k_rejects_what_is_not_callable():
  with pytest.raises(TypeError, match="`factory`"):
    optax_accum.inner_for_every_k(optax.sgd(0.1))


# ----------------------------------------------------------------------------
# A schedule's value that is no k: NaN, beyond int32.
# ----------------------------------------------------------------------------


def _nan_after_first_step(step):
  return jnp.where(step >= 1, jnp.nan, 2.0)


def test_schedule_nan_raises_when_concrete():
  """The next cycle's k is decided when a cycle ends: the call ending the
  first cycle (k = 2 at step 0) finds NaN at step 1 and raises."""
  tx = optax_accum.accumulate(_common.identity(), _nan_after_first_step)
  state, params = tx.init(jnp.zeros(2)), jnp.zeros(2)
  _, state = tx.update(jnp.ones(2), state, params)
  with pytest.raises(ValueError, match="`every_k` schedule returned NaN"):
    tx.update(jnp.ones(2), state, params)


def test_schedule_nan_under_jit_holds_the_cycle_until_flush():
  """Never silently k = 1: no update until `flush=True` ends the cycle."""
  tx = optax_accum.accumulate(_common.identity(), _nan_after_first_step)
  state, params = tx.init(jnp.zeros(2)), jnp.zeros(2)
  update = jax.jit(tx.update)
  emitted = []
  for i in range(8):
    _, state = update(jnp.ones(2) * i, state, params)
    emitted.append(bool(optax_accum.has_updated(state)))
  assert emitted == [False, True] + [False] * 6
  out, state = update(jnp.ones(2) * 8, state, params, flush=True)
  assert bool(optax_accum.has_updated(state))
  np.testing.assert_allclose(out, jnp.full(2, 5.0))  # mean of 2..8


def test_schedule_beyond_int32_holds_the_cycle(maybe_jit):
  tx = optax_accum.accumulate(_common.identity(), lambda step: 1e12)
  state, params = tx.init(jnp.zeros(2)), jnp.zeros(2)
  update = maybe_jit(tx.update)
  for _ in range(4):
    _, state = update(jnp.ones(2), state, params)
  assert int(state.micro_step) == 4 and int(state.step) == 0
