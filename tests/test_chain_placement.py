"""The chain trap: what runs once per optimizer step goes inside `accumulate`.

`optax.chain` calls every member on every call, that is on every micro-batch.
A transformation placed next to `accumulate` instead of inside it therefore
runs per micro-batch: weight decay moves the params while `has_updated` is
False, and clipping clips each micro-batch instead of their mean. Placed
inside, it runs once per cycle on the mean, exactly as in big-batch training.
The README's quick start shows the same two placements side by side.
"""

import chex
import jax
import jax.numpy as jnp
import optax

import optax_accum

K = 4


def _run(tx, params, grads, maybe_jit):
  """Feeds `grads` one per call; returns each call's updates and has_updated."""
  state = tx.init(params)
  update = maybe_jit(tx.update)
  outputs = []
  for g in grads:
    updates, state = update(g, state, params)
    # has_updated finds the AccumulateState inside a chain's state too.
    outputs.append((updates, bool(optax_accum.has_updated(state))))
  return outputs


def _big_batch(inner, params, grads):
  """`inner`'s update on the mean of `grads`, summed in the same order."""
  total = grads[0]
  for g in grads[1:]:
    total = jax.tree.map(jnp.add, total, g)
  mean = jax.tree.map(lambda t: t / len(grads), total)
  updates, _ = inner.update(mean, inner.init(params), params)
  return updates


# --- weight decay -----------------------------------------------------------

PARAMS = {"w": jnp.ones(3)}
GRADS = [{"w": jnp.array([1.0, -2.0, 0.5]) * (i + 1)} for i in range(K)]


def test_decay_next_to_accumulate_moves_params_on_every_micro_batch(
  maybe_jit,
):
  wrong = optax.chain(
    optax_accum.accumulate(optax.adam(1e-3), K),
    optax.add_decayed_weights(1e-2),
  )
  outputs = _run(wrong, PARAMS, GRADS, maybe_jit)
  for updates, stepped in outputs[: K - 1]:
    assert not stepped
    # The decay alone, 1e-2 * params, although no optimizer step happened.
    chex.assert_trees_all_close(updates, {"w": jnp.full(3, 1e-2)})
  assert outputs[K - 1][1]


def test_decay_inside_accumulate_runs_once_on_the_mean(maybe_jit):
  inner = optax.chain(optax.add_decayed_weights(1e-2), optax.adam(1e-3))
  right = optax_accum.accumulate(inner, K)
  outputs = _run(right, PARAMS, GRADS, maybe_jit)
  for updates, stepped in outputs[: K - 1]:
    assert not stepped
    chex.assert_trees_all_equal(updates, {"w": jnp.zeros(3)})
  updates, stepped = outputs[K - 1]
  assert stepped
  chex.assert_trees_all_equal(updates, _big_batch(inner, PARAMS, GRADS))


# --- clipping ---------------------------------------------------------------

CLIP_PARAMS = {"w": jnp.zeros(2)}
# Each micro-batch gradient has norm 3; their mean [0, 1.5] has norm 1.5.
CLIP_GRADS = [
  {"w": jnp.array(g)} for g in ([3.0, 0.0], [0.0, 3.0], [-3.0, 0.0], [0, 3.0])
]


def test_clip_before_accumulate_clips_each_micro_batch(maybe_jit):
  wrong = optax.chain(
    optax.clip_by_global_norm(1.0), optax_accum.accumulate(optax.sgd(1.0), K)
  )
  outputs = _run(wrong, CLIP_PARAMS, CLIP_GRADS, maybe_jit)
  for updates, stepped in outputs[: K - 1]:
    assert not stepped
    chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2)})
  updates, stepped = outputs[K - 1]
  assert stepped
  # Mean of the unit vectors [1,0], [0,1], [-1,0], [0,1]: [0, 0.5].
  chex.assert_trees_all_close(updates, {"w": jnp.array([0.0, -0.5])})


def test_clip_inside_accumulate_clips_the_mean(maybe_jit):
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  right = optax_accum.accumulate(inner, K)
  outputs = _run(right, CLIP_PARAMS, CLIP_GRADS, maybe_jit)
  for updates, stepped in outputs[: K - 1]:
    assert not stepped
    chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2)})
  updates, stepped = outputs[K - 1]
  assert stepped
  # The mean [0, 1.5] clipped to norm 1: [0, 1], as one big batch gets.
  chex.assert_trees_all_close(updates, {"w": jnp.array([0.0, -1.0])})
  chex.assert_trees_all_equal(
    updates, _big_batch(inner, CLIP_PARAMS, CLIP_GRADS)
  )
