"""``pmap`` data parallelism: the recipe of docs/guides/scaling_pmap.md ("Data
parallel with pmap"). The state is initialised outside and replicated; each
device passes its own gradient and ``axis_name`` defers the reduction to
the cycle's end. The run equals the big batch, and ``has_updated`` answers
once for the replicated state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

K, STEPS = 2, 3


def _loss(params, batch):
  pred = jnp.tanh(batch["x"] @ params["w"]) + params["b"][None, :]
  return jnp.mean((pred - batch["y"]) ** 2)


def _data(n_devices):
  key = jax.random.PRNGKey(0)
  kx, ky, kw = jax.random.split(key, 3)
  rows = n_devices * K * STEPS * 2  # 2 rows per device per micro-batch
  x = jax.random.normal(kx, (rows, 3))
  y = jax.random.normal(ky, (rows, 2))
  params = {"w": jax.random.normal(kw, (3, 2)) * 0.5, "b": jnp.zeros(2)}
  return params, x, y


@pytest.mark.parametrize("n_devices", [2, 8])
def test_pmap_recipe_is_the_big_batch(n_devices):
  params, x, y = _data(n_devices)
  inner = optax.adam(0.1)
  tx = optax_accum.accumulate(inner, K, axis_name="batch")

  def step(params, state, batch):
    grads = jax.grad(_loss)(params, batch)  # this device's own gradient
    updates, state = tx.update(grads, state, params)
    return optax_accum.apply_updates(params, updates, state), state

  p_step = jax.pmap(
    step,
    axis_name="batch",
    donate_argnums=(0, 1),
    devices=jax.devices()[:n_devices],
  )
  # Initialised outside pmap, one copy per device.
  p_params, p_state = jax.tree.map(
    lambda a: jnp.stack([a] * n_devices), (params, tx.init(params))
  )
  # Big-batch reference: each optimizer step sees K micro-batches from
  # every device at once.
  ref_params, ref_state = params, inner.init(params)
  per_step = x.shape[0] // STEPS
  emitted = []
  for s in range(STEPS):
    xs = x[s * per_step : (s + 1) * per_step]
    ys = y[s * per_step : (s + 1) * per_step]
    g = jax.grad(_loss)(ref_params, {"x": xs, "y": ys})
    u, ref_state = inner.update(g, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, u)
    # The same rows as K micro-batches, each split over the devices.
    for m in range(K):
      rows = xs.shape[0] // K
      batch = {
        "x": xs[m * rows : (m + 1) * rows].reshape(n_devices, -1, 3),
        "y": ys[m * rows : (m + 1) * rows].reshape(n_devices, -1, 2),
      }
      p_params, p_state = p_step(p_params, p_state, batch)
      flag = optax_accum.has_updated(p_state)
      assert flag.shape == ()  # one answer for the replicated state
      emitted.append(bool(flag))
  assert emitted == [False, True] * STEPS
  for leaf in jax.tree.leaves(p_params):  # the replicas agree
    np.testing.assert_array_equal(leaf[0], leaf[-1])
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a[0], b, rtol=1e-5, atol=1e-6),
    p_params,
    ref_params,
  )


def test_has_updated_of_a_stacked_state_whose_flags_differ_gives_them_all():
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  state = tx.init(jnp.zeros(2))
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), state)
  stacked = stacked.replace(emitted=jnp.array([True, False]))
  np.testing.assert_array_equal(optax_accum.has_updated(stacked), [True, False])
