"""One meaning of the state on every backend (``_per_backend`` in
``optax_accum/_accumulate.py``).

A program compiled for CPU and one compiled for GPU or TPU close a cycle in
different ways (a select, or a conditional that zeroes the accumulator in
place), and both leave the same state: zeros and weight 0 after a call that
ends a cycle. This machine runs only the CPU form, so these tests pin
``_accumulate._per_backend`` to each form in turn and run both on CPU: the same
updates, params and states, bit for bit, and a state saved by one form
resumes in the other as if nothing had changed. A state optax_accum 0.1
left on CPU after an emission costs one cycle without an update, never a
wrong one.
"""

import _common
import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum
from optax_accum import _accumulate

FORMS = {
  "cpu": lambda *args, cpu, accelerator: cpu(*args),
  "accelerator": lambda *args, cpu, accelerator: accelerator(*args),
}


def _pin(monkeypatch, form):
  """Every accumulate traced from now on takes `form`. JAX caches a trace
  per function: build a new transformation after pinning."""
  monkeypatch.setattr(_accumulate, "_per_backend", FORMS[form])
  _accumulate._jitted_update.cache_clear()


def _nan_grads(i):
  g = _common.grads(i)
  return jax.tree.map(lambda x: x.at[0].set(jnp.nan), g)


# name -> (accumulate kwargs, per-call update kwargs, gradient of call i)
SCENARIOS = {
  "adam": (dict(inner=optax.adam(0.1), every_k=3), lambda i: {}, None),
  "weighted": (
    dict(inner=optax.adam(0.1), every_k=3),
    lambda i: {"weight": float(i % 4)},  # a zero weight every fourth call
    None,
  ),
  "flush": (
    dict(inner=optax.sgd(1.0), every_k=4),
    lambda i: {"flush": i in (1, 6)},
    None,
  ),
  "skip_nonfinite": (
    dict(inner=optax.adam(0.1), every_k=3, skip_nonfinite=True),
    lambda i: {},
    lambda i: _nan_grads(i) if i % 5 == 2 else _common.grads(i),
  ),
  "noise_scale": (
    dict(inner=optax.sgd(0.1), every_k=3, track_noise_scale=True),
    lambda i: {"weight": 2.0},
    None,
  ),
  "schedule_sum": (
    dict(inner=optax.sgd(0.1), every_k=lambda s: s + 1, reduction="sum"),
    lambda i: {},
    None,
  ),
  "bf16_accumulator": (
    dict(inner=optax.adam(0.1), every_k=2, accumulator_dtype=jnp.bfloat16),
    lambda i: {},
    None,
  ),
  "static": (
    dict(inner=optax.adam(0.1), every_k=3),
    lambda i: {"emit": i % 3 == 2},
    None,
  ),
}


def _trajectory(monkeypatch, form, scenario, calls=12, jit=True):
  _pin(monkeypatch, form)
  kwargs, per_call, grads_of = SCENARIOS[scenario]
  grads_of = grads_of or _common.grads
  kwargs = dict(kwargs)
  tx = optax_accum.accumulate(
    kwargs.pop("inner"), kwargs.pop("every_k"), **kwargs
  )
  params = _common.params()
  state = tx.init(params)

  def step(params, state, grads, options):
    updates, state = tx.update(grads, state, params, **options)
    return optax_accum.apply_updates(params, updates, state), state, updates

  def with_emit(p, s, g, o, emit=None):
    return step(p, s, g, o if emit is None else o | {"emit": emit})

  # One jitted function per trajectory (the form is read at trace time):
  # `emit` static, the other options traced.
  jitted = jax.jit(with_emit, static_argnames="emit")
  out = []
  for i in range(calls):
    options = dict(per_call(i))
    emit = options.pop("emit", None)
    call = jitted if jit else with_emit
    params, state, updates = call(params, state, grads_of(i), options, emit)
    out.append((params, state, updates))
  return out


def _assert_fresh(state):
  chex.assert_trees_all_equal(
    state.acc_grads, jax.tree.map(jnp.zeros_like, state.acc_grads)
  )
  assert float(state.acc_weight) == 0.0


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_both_forms_give_the_same_run(monkeypatch, scenario, jit):
  cpu = _trajectory(monkeypatch, "cpu", scenario, jit=jit)
  accelerator = _trajectory(monkeypatch, "accelerator", scenario, jit=jit)
  for (p, s, u), (q, t, v) in zip(cpu, accelerator, strict=True):
    chex.assert_trees_all_equal(u, v, strict=True)
    chex.assert_trees_all_equal(p, q, strict=True)
    chex.assert_trees_all_equal(s, t, strict=True)  # the whole state
    if int(s.micro_step) == 0:  # a cycle boundary: a fresh accumulator
      _assert_fresh(s)
  assert any(bool(optax_accum.has_updated(s)) for _, s, _ in cpu)


def _cycle(tx, state, params, start, static):
  """Two calls, the second ending the cycle (by k=2, or by emit=True)."""
  update = jax.jit(tx.update, static_argnames="emit")
  for i in range(2):
    options = {"emit": i == 1} if static else {}
    updates, state = update(_common.grads(start + i), state, params, **options)
  return updates, state


@pytest.mark.parametrize("static", [False, True], ids=["traced", "static"])
@pytest.mark.parametrize("first", list(FORMS))
def test_a_state_resumes_in_the_other_form(monkeypatch, first, static):
  """Saved by one form at a cycle boundary and mid-cycle, resumed by the
  other: the run goes on bit for bit as in the first form."""
  other = "cpu" if first == "accelerator" else "accelerator"
  params = _common.params()

  def run(forms):
    state, out = None, []
    for i, form in enumerate(forms):
      _pin(monkeypatch, form)
      tx = optax_accum.accumulate(optax.sgd(1.0), 2)
      state = tx.init(params) if state is None else state
      updates, state = _cycle(tx, state, params, 2 * i, static)
      out.append((updates, state))
    return out

  for (u, s), (v, t) in zip(
    run([first, first, first]), run([first, other, other]), strict=True
  ):
    chex.assert_trees_all_equal(u, v, strict=True)
    chex.assert_trees_all_equal(s, t, strict=True)
    _assert_fresh(t)
  # Mid-cycle: one call in the first form, the rest in the other.
  _pin(monkeypatch, first)
  tx = optax_accum.accumulate(optax.sgd(1.0), 3)
  _, half = jax.jit(tx.update)(_common.grads(0), tx.init(params), params)
  assert int(half.micro_step) == 1 and float(half.acc_weight) == 1.0
  ends = {}
  for form in (first, other):
    _pin(monkeypatch, form)
    tx = optax_accum.accumulate(optax.sgd(1.0), 3)
    state = half
    for i in (1, 2):
      updates, state = jax.jit(tx.update)(_common.grads(i), state, params)
    ends[form] = (updates, state)
  chex.assert_trees_all_equal(ends[first], ends[other], strict=True)


def _v01_cpu_state(params):
  """What optax_accum 0.1 compiled for CPU left after an emitting call
  (sgd(1), k=2): that call's updates in acc_grads, its weight in
  acc_weight, micro_step 0."""
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  updates, state = _cycle(tx, tx.init(params), params, 0, static=False)
  return state._replace(acc_grads=updates, acc_weight=jnp.float32(2.0))


@pytest.mark.parametrize("static", [False, True], ids=["traced", "static"])
@pytest.mark.parametrize("form", list(FORMS))
def test_a_v01_cpu_state_costs_one_cycle(monkeypatch, form, static):
  """Resumed in either form (traced or static): the cycle that starts on
  0.1's leftovers ends without an update and leaves zeros; the next cycle is
  exactly what a clean start gives."""
  params = _common.params()
  _pin(monkeypatch, form)
  state = _v01_cpu_state(params)
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  updates, state = _cycle(tx, state, params, 10, static)
  assert not optax_accum.has_updated(state) and int(state.step) == 1
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
  _assert_fresh(state)
  resumed, state = _cycle(tx, state, params, 20, static)
  clean, _ = _cycle(tx, tx.init(params), params, 20, static)
  chex.assert_trees_all_equal(resumed, clean)
  assert int(state.step) == 2


def test_without_the_flag_a_v01_state_would_add_its_leftovers(monkeypatch):
  """Control for the test above: hide 0.1's flag (acc_weight) and its
  leftover update joins the next update."""
  params = _common.params()
  hidden = _v01_cpu_state(params)._replace(
    acc_weight=jnp.zeros([], jnp.float32)
  )
  tx = optax_accum.accumulate(optax.sgd(1.0), 1, skip_nonfinite=True)
  # Under jit: outside it, update refuses such a state (test_multisteps_
  # checkpoints.py: a sum with no cycle under way).
  updates, _ = jax.jit(tx.update)(_common.grads(1), hidden, params)
  clean, _ = jax.jit(tx.update)(_common.grads(1), tx.init(params), params)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(updates, clean)
