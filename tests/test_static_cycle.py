"""The static cycle (issue 20): ``update(..., emit=True | False)``.

The loop knows on the host which call ends the cycle and says so with a
Python bool: ``emit=False`` adds and counts (no conditional, no inner
optimizer in the program), ``emit=True`` adds, reduces and runs the inner
optimizer. The state is the same ``AccumulateState`` as on the traced path,
so the two mix, and every option behaves as documented in ``accumulate``'s
docstring. Each behaviour runs with and without ``jit``.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _common import grads, params

import optax_accum
from tools import program

K = 3


def _step(tx, jit):
  """One call: `update` then `optax_accum.apply_updates`; `emit` static."""

  def step(p, state, g, emit=None, weight=None, **kw):
    updates, state = tx.update(g, state, p, weight=weight, emit=emit, **kw)
    return optax_accum.apply_updates(p, updates, state), state

  return jax.jit(step, static_argnames="emit") if jit else step


def _run(tx, jit, emits, weights=None, gradients=None):
  """Calls with `emits[i]` (None: traced); returns params, state, emitted."""
  step = _step(tx, jit)
  p, state = params(), tx.init(params())
  emitted = []
  for i, emit in enumerate(emits):
    g = gradients[i] if gradients is not None else grads(i)
    w = None if weights is None else jnp.asarray(weights[i], jnp.float32)
    p, state = step(p, state, g, emit=emit, weight=w)
    emitted.append(bool(state.emitted))
  return p, state, emitted


def _host_emits(n, k=K):
  """The host counter of the recommended loop: every k-th call emits."""
  return [i % k == k - 1 for i in range(n)]


_close = functools.partial(chex.assert_trees_all_close, rtol=1e-6, atol=1e-7)


def _big_batch(inner, cycles, weights=None):
  """Params after one inner step per cycle on its weighted mean gradient."""
  p, state = params(), inner.init(params())
  for cycle in cycles:
    w = [1.0 if weights is None else weights[i] for i in cycle]
    mean = jax.tree.map(
      lambda *gs, w=w: (
        sum(wi * g for wi, g in zip(w, gs, strict=True)) / sum(w)
      ),
      *[grads(i) for i in cycle],
    )
    updates, state = inner.update(mean, state, p)
    p = optax.apply_updates(p, updates)
  return p


# ----------------------------------------------------------------------------
# Values.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weights"])
def test_static_loop_equals_the_traced_run_and_the_big_batch(
  maybe_jit, weighted
):
  jit = maybe_jit is jax.jit
  weights = [1.0, 3.0, 0.5, 2.0, 1.0, 4.0] if weighted else None
  tx = optax_accum.accumulate(optax.adam(0.1), K)
  static, s_state, s_emitted = _run(tx, jit, _host_emits(6), weights)
  traced, t_state, t_emitted = _run(tx, jit, [None] * 6, weights)
  assert s_emitted == t_emitted == _host_emits(6)
  _close(static, traced)
  _close(static, _big_batch(optax.adam(0.1), [range(3), range(3, 6)], weights))
  for field in ("step", "micro_step", "every_k", "num_skipped"):
    assert int(getattr(s_state, field)) == int(getattr(t_state, field)), field
  # No cycle open: zeros, or (a program compiled for CPU) the cycle's
  # leftovers, marked by its weight, which no call reads
  # (tests/test_backend_forms.py).
  if float(s_state.acc_weight) == 0:
    chex.assert_trees_all_equal(
      s_state.acc_grads, jax.tree.map(jnp.zeros_like, s_state.acc_grads)
    )
  else:
    assert int(s_state.micro_step) == 0


def test_traced_and_static_calls_mix(maybe_jit):
  """The state is the same record: any call can be traced or static."""
  jit = maybe_jit is jax.jit
  tx = optax_accum.accumulate(optax.adam(0.1), K)
  mixed = [None, False, True, False, None, None, False, None, True]
  p, state, emitted = _run(tx, jit, mixed)
  ref, ref_state, ref_emitted = _run(tx, jit, [None] * 9)
  assert emitted == ref_emitted
  _close(p, ref)
  assert int(state.step) == int(ref_state.step) == 3


def test_emit_true_before_k_ends_the_cycle_like_flush(maybe_jit):
  jit = maybe_jit is jax.jit
  tx = optax_accum.accumulate(optax.sgd(0.1), 4)
  p, state, emitted = _run(tx, jit, [False, True, False, False])
  assert emitted == [False, True, False, False]
  assert int(state.step) == 1 and int(state.micro_step) == 2
  # The same as flush=True on the second call of the traced path.
  step = _step(tx, jit)
  ref, ref_state = params(), tx.init(params())
  for i in range(4):
    ref, ref_state = step(ref, ref_state, grads(i), flush=i == 1)
  _close(p, ref)
  _close(p, _big_batch(optax.sgd(0.1), [range(2)]))


def test_emit_false_past_k_keeps_accumulating(maybe_jit):
  """The counter goes past k and the cycle waits for the host's emit=True
  (a traced call would end it at once, see below)."""
  jit = maybe_jit is jax.jit
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  p, state, emitted = _run(tx, jit, [False, False, False])
  assert emitted == [False] * 3 and int(state.micro_step) == 3
  chex.assert_trees_all_equal(p, params())
  p, state, _ = _run(tx, jit, [False, False, False, True])
  assert int(state.step) == 1 and int(state.micro_step) == 0
  _close(p, _big_batch(optax.sgd(0.1), [range(4)]))
  # A traced call after k has passed ends the cycle there.
  p, state, emitted = _run(tx, jit, [False, False, None])
  assert emitted == [False, False, True]
  _close(p, _big_batch(optax.sgd(0.1), [range(3)]))


def test_apply_updates_after_an_update_given_no_params(maybe_jit):
  """optax's common call, `tx.update(grads, state)` without params: the
  update cannot apply them itself, so apply_updates does, from the static
  decision (its "static" route; issue 55's full mutant run found no test
  there)."""
  tx = optax_accum.accumulate(optax.sgd(0.1), K)

  def step(p, state, g, emit):
    updates, state = tx.update(g, state, emit=emit)
    return optax_accum.apply_updates(p, updates, state), state

  if maybe_jit is jax.jit:
    step = jax.jit(step, static_argnames="emit")
  p, state = params(), tx.init(params())
  for i, emit in enumerate(_host_emits(2 * K)):
    p, state = step(p, state, grads(i), emit=emit)
    if not emit:
      assert not optax_accum.has_updated(state)
  _close(p, _big_batch(optax.sgd(0.1), [range(K), range(K, 2 * K)]))


def test_emit_false_with_every_k_1_is_refused_naming_it(maybe_jit):
  """With a fixed every_k=1 a call without `emit` runs `inner` alone, so it
  would not read a cycle that emit=False held open (issue 55): the call
  raises, naming both; emit=True is every call's own cycle."""
  jit = maybe_jit is jax.jit
  tx = optax_accum.accumulate(optax.sgd(0.1), 1)
  with pytest.raises(ValueError, match=r"emit=False with every_k=1"):
    _run(tx, jit, [False])
  p, state, emitted = _run(tx, jit, [True, None])
  assert emitted == [True, True] and int(state.step) == 2
  _close(p, _big_batch(optax.sgd(0.1), [[0], [1]]))
  # A schedule whose k is 1 goes through the cycle's own path: held open,
  # the next call ends it with the mean of both.
  tx = optax_accum.accumulate(optax.sgd(0.1), lambda step: 1)
  p, state, emitted = _run(tx, jit, [False, None])
  assert emitted == [False, True] and int(state.step) == 1
  _close(p, _big_batch(optax.sgd(0.1), [range(2)]))


def test_skipped_micro_batch_with_a_host_counter(maybe_jit):
  """With skip_nonfinite, a host counter counts calls, the state counts the
  micro-batches it accepted: the cycle the host ends with emit=True is the
  mean over the accepted ones (one fewer), as a flush would be."""
  jit = maybe_jit is jax.jit
  tx = optax_accum.accumulate(optax.sgd(0.1), K, skip_nonfinite=True)
  gradients = [grads(i) for i in range(6)]
  gradients[1] = jax.tree.map(lambda g: g.at[0].set(jnp.nan), gradients[1])
  p, state, emitted = _run(tx, jit, _host_emits(6), gradients=gradients)
  assert emitted == _host_emits(6)
  assert int(state.num_skipped) == 1 and int(state.step) == 2
  _close(p, _big_batch(optax.sgd(0.1), [[0, 2], range(3, 6)]))


def test_a_cycle_of_skipped_micro_batches_emits_nothing(maybe_jit):
  jit = maybe_jit is jax.jit
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, skip_nonfinite=True)
  nan = [jax.tree.map(lambda g: g * jnp.nan, grads(i)) for i in range(2)]
  p, state, emitted = _run(tx, jit, [False, True], gradients=nan)
  assert emitted == [False, False] and int(state.step) == 0
  chex.assert_trees_all_equal(p, params())


def test_noise_scale_is_the_traced_runs(maybe_jit):
  jit = maybe_jit is jax.jit
  tx = optax_accum.accumulate(optax.adam(0.1), K, track_noise_scale=True)
  weights = [1.0, 2.0, 3.0] * 3
  _, s_state, _ = _run(tx, jit, _host_emits(9), weights)
  _, t_state, _ = _run(tx, jit, [None] * 9, weights)
  np.testing.assert_allclose(
    np.asarray(optax_accum.noise_scale(s_state)),
    np.asarray(optax_accum.noise_scale(t_state)),
    # The noise scale is a ratio of differences of squared norms; the two
    # programs sum in different fusions (1.6e-5 apart measured, jax 0.10.2).
    rtol=1e-4,
  )
  assert int(s_state.noise.cycles) == int(t_state.noise.cycles) == 3


@pytest.mark.parametrize("every_k", ["grow", "schedule"])
def test_k_read_once_per_cycle_follows_the_traced_run(maybe_jit, every_k):
  """A loop with a changing k reads `current_every_k` at each cycle's start
  and emits on its last call: the traced run's cycles, exactly."""
  jit = maybe_jit is jax.jit
  if every_k == "grow":
    spec = optax_accum.grow_every_k(8, min_cycles=1, scale=64.0)
  else:
    spec = optax_accum.piecewise_every_k({3: 2, 9: 4}, initial=1)
  tx = optax_accum.accumulate(
    optax.sgd(0.1), spec, track_noise_scale=every_k == "grow"
  )
  n = 24
  step = _step(tx, jit)
  p, state = params(), tx.init(params())
  static_emitted, ks, left = [], [], 0
  for i in range(n):
    if left == 0:  # a cycle starts: how long is it?
      left = int(optax_accum.current_every_k(state))
      ks.append(left)
    left -= 1
    p, state = step(p, state, grads(i), emit=left == 0)
    static_emitted.append(bool(state.emitted))
  ref, ref_state, traced_emitted = _run(tx, jit, [None] * n)
  assert static_emitted == traced_emitted
  assert len(set(ks)) > 1, ks  # k did change
  _close(p, ref)
  assert int(state.every_k) == int(ref_state.every_k)


def test_mid_cycle_checkpoint_resumes_bit_for_bit(tmp_path):
  """Orbax, saved one call into a cycle of the static loop, restored into a
  fresh state: the rest of the run is the uninterrupted one, bit for bit."""
  tx = optax_accum.accumulate(optax.adam(0.1), K)
  step = _step(tx, jit=True)
  emits = _host_emits(6)
  p, state = params(), tx.init(params())
  for i in range(4):
    p, state = step(p, state, grads(i), emit=emits[i])
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", {"params": p, "opt_state": state})
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(
      tmp_path / "ckpt",
      {"params": params(), "opt_state": tx.init(params())},
    )
  assert int(restored["opt_state"].micro_step) == 1
  rp, rstate = restored["params"], restored["opt_state"]
  for i in range(4, 6):
    p, state = step(p, state, grads(i), emit=emits[i])
    rp, rstate = step(rp, rstate, grads(i), emit=emits[i])
  chex.assert_trees_all_equal(rp, p)
  chex.assert_trees_all_equal(rstate.inner_state, state.inner_state)


# ----------------------------------------------------------------------------
# The programs (XLA:CPU; the accelerators: tests/test_accelerators.py).
# ----------------------------------------------------------------------------


def _program_of(emit):
  tx = optax_accum.accumulate(optax.adam(0.1), K)
  step = jax.jit(_step(tx, jit=False), static_argnames="emit")
  p = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}
  g = jax.tree.map(jnp.ones_like, p)
  compiled = step.lower(p, tx.init(p), g, emit=emit).compile()
  return program.Program(compiled)


ADAM_OPS = ("sqrt", "rsqrt")


def test_a_static_micro_step_has_no_conditional_and_no_optimizer():
  micro = _program_of(False)
  assert micro.conditionals() == 0
  assert not micro.runs_every_call(ADAM_OPS)
  # The emitting step compiled for CPU runs the optimizer in the one
  # conditional that keeps a weightless cycle's result out, where XLA:CPU
  # updates the state and the params in place (a GPU/TPU program selects
  # instead, with no conditional: tests/test_accelerators.py).
  emitting = _program_of(True)
  assert emitting.conditionals() == 1
  assert not emitting.runs_every_call(ADAM_OPS)
  traced = _program_of(None)
  assert traced.conditionals() >= 1  # the check would see one


# ----------------------------------------------------------------------------
# Errors name `emit`, with and without jit.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("emit", [1, "yes", jnp.asarray(True)])
def test_emit_must_be_a_python_bool(maybe_jit, emit):
  tx = optax_accum.accumulate(optax.sgd(0.1), K)
  p = params()
  update = functools.partial(tx.update, emit=emit)
  with pytest.raises(TypeError, match="`emit` must be None"):
    maybe_jit(update)(grads(0), tx.init(p), p)


def test_a_traced_emit_is_named():
  tx = optax_accum.accumulate(optax.sgd(0.1), K)
  p = params()
  with pytest.raises(TypeError, match="static_argnames='emit'"):
    jax.jit(lambda g, s, e: tx.update(g, s, p, emit=e))(
      grads(0), tx.init(p), True
    )


def test_flush_and_emit_together_are_refused(maybe_jit):
  tx = optax_accum.accumulate(optax.sgd(0.1), K)
  p = params()
  update = functools.partial(tx.update, flush=True, emit=False)
  with pytest.raises(ValueError, match="`flush` cannot be combined"):
    maybe_jit(update)(grads(0), tx.init(p), p)
