"""The gradient-noise-scale estimate of `accumulate(track_noise_scale=True)`.

Validation with a known answer: per-example gradients G + z with
z ~ N(0, sigma^2 I) in d dimensions, so B_simple = d sigma^2 / |G|^2. A
micro-batch gradient is the mean of b examples: G + N(0, sigma^2 / b).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_accum

D = 64
SIGMA = 3.0
G = jnp.linspace(0.5, 1.5, D)  # |G|^2 = D * mean(G^2)
TRUE_B = D * SIGMA**2 / float(jnp.sum(G**2))


def _run(b_sizes, k, cycles, *, seed=0, axis_name=None, **kwargs):
  """Runs `cycles` cycles of k micro-batches whose sizes cycle over b_sizes."""
  tx = optax_accum.accumulate(
    optax.sgd(0.0), k, track_noise_scale=True, axis_name=axis_name, **kwargs
  )
  params = jnp.zeros(D)
  sizes = jnp.asarray(
    [b_sizes[i % len(b_sizes)] for i in range(k * cycles)], jnp.float32
  )
  noise = jax.random.normal(jax.random.PRNGKey(seed), (k * cycles, D))

  def body(state, inputs):
    size, z = inputs
    g = G + SIGMA / jnp.sqrt(size) * z
    _, state = tx.update(g, state, params, weight=size)
    return state, None

  state, _ = jax.jit(lambda s: lax.scan(body, s, (sizes, noise)))(
    tx.init(params)
  )
  return state


@pytest.mark.parametrize("b, k", [(4, 8), (16, 4)])
def test_estimate_within_15_percent_of_the_truth(b, k):
  state = _run([b], k, cycles=400)
  estimate = float(optax_accum.noise_scale(state))
  assert abs(estimate - TRUE_B) <= 0.15 * TRUE_B, (estimate, TRUE_B)
  grad_sq, trace = optax_accum.noise_scale_components(state)
  np.testing.assert_allclose(float(trace), D * SIGMA**2, rtol=0.15)
  np.testing.assert_allclose(float(grad_sq), float(jnp.sum(G**2)), rtol=0.15)


def test_unequal_micro_batch_weights_stay_unbiased():
  state = _run([2, 5, 9, 16], 4, cycles=400, seed=1)
  estimate = float(optax_accum.noise_scale(state))
  assert abs(estimate - TRUE_B) <= 0.15 * TRUE_B, (estimate, TRUE_B)


def test_nan_until_a_cycle_with_two_micro_batches():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, track_noise_scale=True)
  params = jnp.zeros(D)
  state = tx.init(params)
  assert np.isnan(float(optax_accum.noise_scale(state)))
  _, state = tx.update(G, state, params)
  assert np.isnan(float(optax_accum.noise_scale(state)))
  _, state = tx.update(G + 1.0, state, params)
  assert np.isfinite(float(optax_accum.noise_scale(state)))


def test_single_micro_batch_cycles_give_no_estimate():
  tx = optax_accum.accumulate(optax.sgd(0.1), 3, track_noise_scale=True)
  params = jnp.zeros(D)
  state = tx.init(params)
  for i in range(3):  # flushed after one micro-batch each time
    _, state = tx.update(G * i, state, params, flush=True)
  assert int(state.noise.cycles) == 0
  assert np.isnan(float(optax_accum.noise_scale(state)))


def test_skipped_micro_batches_are_left_out():
  clean = _run([8], 4, cycles=50, skip_nonfinite=True)
  tx = optax_accum.accumulate(
    optax.sgd(0.0), 4, track_noise_scale=True, skip_nonfinite=True
  )
  params = jnp.zeros(D)
  sizes = jnp.full((200,), 8.0)
  noise = jax.random.normal(jax.random.PRNGKey(0), (200, D))

  @jax.jit
  def step(state, size, z, poison):
    g = G + SIGMA / jnp.sqrt(size) * z
    g = jnp.where(poison, jnp.nan, g)
    return tx.update(g, state, params, weight=size)[1]

  state = tx.init(params)
  for i in range(200):
    state = step(state, sizes[i], noise[i], False)
    if i % 7 == 3:  # interleave NaN micro-batches that must leave no trace
      state = step(state, sizes[i], noise[i], True)
  assert int(state.num_skipped) > 0
  np.testing.assert_array_equal(
    optax_accum.noise_scale(state), optax_accum.noise_scale(clean)
  )


def test_off_by_default_holds_no_noise_state_and_readers_say_so():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  params = jnp.zeros(D)
  state = tx.init(params)
  for i in range(4):
    _, state = tx.update(G * i, state, params)
  assert state.noise == optax.EmptyState()
  assert not jax.tree.leaves(state.noise)
  for reader in (optax_accum.noise_scale, optax_accum.noise_scale_components):
    with pytest.raises(ValueError, match="track_noise_scale=True"):
      reader(state)


def test_before_two_micro_batch_cycle_the_tracked_estimate_is_nan():
  """ "Not yet known" (NaN) is told apart from "never tracked" (an error)."""
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, track_noise_scale=True)
  params = jnp.zeros(D)
  state = tx.init(params)
  _, state = tx.update(G, state, params)
  assert np.isnan(float(optax_accum.noise_scale(state)))


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5, float("nan"), "0.9", None])
def test_reader_decay_outside_unit_interval_is_rejected(decay):
  state = optax_accum.accumulate(
    optax.sgd(0.1), 2, track_noise_scale=True
  ).init(jnp.zeros(D))
  with pytest.raises(ValueError, match="noise_scale_decay"):
    optax_accum.noise_scale_components(state, noise_scale_decay=decay)


def test_readers_find_the_state_inside_chain_and_inject_hyperparams():
  acc = optax_accum.accumulate(optax.sgd(0.0), 2, track_noise_scale=True)
  tx = optax.chain(
    optax.identity(), optax.inject_hyperparams(optax.scale)(step_size=1.0), acc
  )
  params = jnp.zeros(D)
  state, alone = tx.init(params), acc.init(params)
  for i in range(6):
    g = G + SIGMA * jax.random.normal(jax.random.PRNGKey(i), (D,))
    _, state = tx.update(g, state, params)
    _, alone = acc.update(g, alone, params)
  np.testing.assert_array_equal(
    optax_accum.noise_scale(state), optax_accum.noise_scale(alone)
  )
  assert np.isfinite(float(optax_accum.noise_scale(state)))


def test_axis_name_matches_single_device():
  """4 replicas of 2 micro-batches each = one device with 8 micro-batches."""
  n_dev, k, cycles, b = 4, 2, 200, 4.0
  noise = jax.random.normal(jax.random.PRNGKey(3), (cycles, k, n_dev, D))
  params = jnp.zeros(D)

  dist_tx = optax_accum.accumulate(
    optax.sgd(0.0), k, track_noise_scale=True, axis_name="dev"
  )
  local_tx = optax_accum.accumulate(
    optax.sgd(0.0), k * n_dev, track_noise_scale=True
  )

  def dist_body(state, z):  # z: [k, n_dev, D]
    for i in range(k):
      g = G[None, :] + SIGMA / jnp.sqrt(b) * z[i]
      _, state = jax.vmap(
        functools.partial(dist_tx.update, weight=b),
        axis_name="dev",
        in_axes=(0, 0, None),
      )(g, state, params)
    return state, None

  def local_body(state, z):
    for i in range(k):
      for d in range(n_dev):
        g = G + SIGMA / jnp.sqrt(b) * z[i, d]
        _, state = local_tx.update(g, state, params, weight=b)
    return state, None

  dist_state0 = jax.vmap(dist_tx.init, axis_size=n_dev, in_axes=None)(params)
  dist, _ = jax.jit(lambda s: lax.scan(dist_body, s, noise))(dist_state0)
  local, _ = jax.jit(lambda s: lax.scan(local_body, s, noise))(
    local_tx.init(params)
  )
  per_device = jax.vmap(optax_accum.noise_scale)(dist)
  np.testing.assert_array_equal(per_device, per_device[0])  # all agree
  np.testing.assert_allclose(
    per_device[0], optax_accum.noise_scale(local), rtol=1e-4
  )
