"""The gradient noise scale with the unreduced engine (plain `jax.jit`).

`local_value_and_grad(..., noise_stats=True)` measures each device's share of
a micro-batch where it is known, and `accumulate` folds those sums in. The
reference is the shard_map engine on the same shares: `accumulate` with the
same `axis_name` under a named `vmap` over the 8 devices, each passing its
own gradient and token count. Both engines see every device's share as one
sample, so they must agree on the estimate, on what a skipped micro-batch
leaves out, and on every k the `grow_every_k` controller picks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_jit_unreduced import _nan_on_device, _same_on_every_device
from test_unreduced import (
  _example_mean,
  _init_params,
  _make_batch,
  _mesh,
  _put,
  _token_mean,
)

import optax_accum

N_DEV = 8
RTOL = 2e-4  # float32 sums in another order, over a few cycles


def _shares(batch):
  """The batch as [device, rows of that device, ...]: the split of P("data")."""
  return jax.tree.map(lambda a: a.reshape(N_DEV, -1, *a.shape[1:]), batch)


def _unreduced_run(tx, batches, weighted):
  """Plain jit on the data-parallel mesh, gradients from the helper.

  Returns the params, the state and the k each call left for the next.
  """
  loss = _token_mean if weighted else _example_mean
  grad_fn = optax_accum.distributed.local_value_and_grad(
    loss, has_weight=weighted, noise_stats=True
  )

  @jax.jit
  def step(params, state, batch):
    value, grads, stats = grad_fn(params, batch)
    weight = value[1] if weighted else None
    updates, state = tx.update(
      grads, state, params, weight=weight, noise_stats=stats
    )
    return optax.apply_updates(params, updates), state

  mesh = _mesh("dp")
  with jax.set_mesh(mesh):
    params, _ = _put(mesh, "dp", _init_params(), batches[0])
    state = tx.init(params)
    ks = []
    for batch in batches:
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      params, state = step(params, state, batch)
      ks.append(int(state.every_k))
  return params, state, ks


def _shard_map_engine_run(tx, batches, weighted):
  """The same shares through the shard_map engine (a named vmap)."""

  def step(params, state, share):
    if weighted:
      grads, tokens = jax.grad(_token_mean, has_aux=True)(params, share)
      weight = tokens
    else:  # The helper's unit: one global micro-batch weighs 1.
      grads = jax.grad(_example_mean)(params, share)
      weight = jnp.asarray(1.0 / N_DEV)
    updates, state = tx.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.vmap(step, axis_name="data"))
  stack = lambda t: jax.tree.map(lambda a: jnp.stack([a] * N_DEV), t)  # noqa: E731
  params = stack(_init_params())
  state = jax.vmap(tx.init)(params)
  ks = []
  for batch in batches:
    params, state = step(params, state, _shares(batch))
    ks.append(int(state.every_k[0]))
  params, state = jax.tree.map(lambda a: a[0], (params, state))
  return params, state, ks


def _batches(n, nan_at=None):
  # Micro-batch 1 leaves device 0 without a token (its share's mean is 0/0).
  batches = [_make_batch(40 + i, empty_rows=2 * (i == 1)) for i in range(n)]
  if nan_at is not None:
    batches[nan_at] = _nan_on_device(batches[nan_at], 5)
  return batches


def _assert_same_estimate(actual, expected):
  noise, ref = actual.noise, expected.noise
  assert int(noise.cycles) == int(ref.cycles) > 0
  for got, want in zip(
    optax_accum.noise_scale_components(actual),
    optax_accum.noise_scale_components(expected),
    strict=True,
  ):
    np.testing.assert_allclose(float(got), float(want), rtol=RTOL)
  np.testing.assert_allclose(
    float(optax_accum.noise_scale(actual)),
    float(optax_accum.noise_scale(expected)),
    rtol=RTOL,
  )


CASES = {
  "tokens": dict(weighted=True, nan_at=None),
  "plain": dict(weighted=False, nan_at=None),
  "tokens-nan-skipped": dict(weighted=True, nan_at=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_equals_the_shard_map_engine(case):
  weighted, nan_at = CASES[case]["weighted"], CASES[case]["nan_at"]
  batches = _batches(12, nan_at)
  skip = nan_at is not None
  tx = optax_accum.accumulate(
    optax.adam(1e-2),
    3,
    axis_name="data",
    track_noise_scale=True,
    skip_nonfinite=skip,
  )
  params, state, _ = _unreduced_run(tx, batches, weighted)
  ref_params, ref_state, _ = _shard_map_engine_run(tx, batches, weighted)

  _assert_same_estimate(state, ref_state)
  assert int(state.num_skipped) == int(ref_state.num_skipped) == int(skip)
  assert int(state.step) == int(ref_state.step) == (12 - skip) // 3
  for key in ref_params:
    np.testing.assert_allclose(
      np.asarray(params[key]), np.asarray(ref_params[key]), atol=2e-6
    )
  _same_on_every_device(state.noise)


def test_the_controller_picks_the_same_ks_as_the_shard_map_engine():
  """`grow_every_k` reads the estimate and the cycle's weight, both global,
  so the two engines grow k on the same calls (and it does grow here)."""
  every_k = optax_accum.grow_every_k(8, min_cycles=2, scale=8.0)
  tx = optax_accum.accumulate(
    optax.adam(1e-2), every_k, axis_name="data", track_noise_scale=True
  )
  batches = _batches(24)
  _, state, ks = _unreduced_run(tx, batches, True)
  _, ref_state, ref_ks = _shard_map_engine_run(tx, batches, True)
  assert ks == ref_ks
  assert max(ks) > 2, ks
  _assert_same_estimate(state, ref_state)
  assert int(state.grow.changed_at) == int(ref_state.grow.changed_at)


# ----------------------------------------------------------------------------
# Errors.
# ----------------------------------------------------------------------------


def _one_unreduced_call(tx, noise_stats=True):
  mesh = _mesh("dp")
  grad_fn = optax_accum.distributed.local_value_and_grad(
    _token_mean, has_weight=True, noise_stats=noise_stats
  )

  @jax.jit
  def step(params, state, batch):
    (_, tokens), grads, *stats = grad_fn(params, batch)
    kwargs = {"noise_stats": stats[0]} if stats else {}
    return tx.update(grads, state, params, weight=tokens, **kwargs)

  with jax.set_mesh(mesh):
    params, batch = _put(mesh, "dp", _init_params(), _make_batch(0))
    return step(params, tx.init(params), batch)


def test_error_when_the_stats_are_missing():
  tx = optax_accum.accumulate(
    optax.sgd(0.1), 2, axis_name="data", track_noise_scale=True
  )
  with pytest.raises(ValueError, match="`noise_stats` must be given"):
    _one_unreduced_call(tx, noise_stats=False)


def test_error_when_the_stats_are_given_without_tracking():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="data")
  with pytest.raises(ValueError, match="track_noise_scale=False"):
    _one_unreduced_call(tx)


def test_error_when_the_stats_are_given_to_another_engine():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, track_noise_scale=True)
  stats = optax_accum.distributed.NoiseStats(
    jnp.ones([]), jnp.ones([]), jnp.ones([], jnp.int32)
  )
  params = jnp.zeros(3)
  with pytest.raises(ValueError, match="only for gradients unreduced"):
    tx.update(jnp.ones(3), tx.init(params), params, noise_stats=stats)


def test_error_when_the_stats_are_not_noise_stats():
  tx = optax_accum.accumulate(
    optax.sgd(0.1), 2, axis_name="data", track_noise_scale=True
  )
  mesh = _mesh("dp")
  grad_fn = optax_accum.distributed.local_value_and_grad(
    _token_mean, has_weight=True
  )
  with jax.set_mesh(mesh):
    params, batch = _put(mesh, "dp", _init_params(), _make_batch(0))
    (_, tokens), grads = jax.jit(grad_fn)(params, batch)
    with pytest.raises(TypeError, match="`noise_stats` must be the"):
      jax.jit(tx.update)(
        grads, tx.init(params), params, weight=tokens, noise_stats=(1.0, 2)
      )


@pytest.mark.parametrize("flag", ["has_weight", "has_aux", "noise_stats"])
def test_helper_flags_must_be_bools(flag):
  with pytest.raises(TypeError, match=f"`{flag}` must be True or False"):
    optax_accum.distributed.local_value_and_grad(_token_mean, **{flag: "yes"})
