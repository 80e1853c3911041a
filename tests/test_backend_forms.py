"""The two forms accumulate compiles to agree (design point 5 of
``optax_accum/_accumulate.py``).

A program compiled for CPU starts a cycle by ignoring what the accumulator's
buffer holds and leaves the last update there; one compiled for GPU or TPU
adds into the accumulator as it is, so that the add fuses into the gradient's
GEMM, and returns it to zeros when a cycle ends. This machine runs only the
CPU form, so these tests pin ``_accumulate._per_backend`` to each form in turn
and run both on CPU: the same updates, params, counters and inner states,
bit for bit, and the same accumulator while a cycle is open. A state the CPU
form leaves at a cycle boundary, resumed by the other form, gives one cycle
without an update and nothing wrong.
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


def _comparable(state):
  """The state without the accumulator's contents at a cycle boundary, where
  the forms differ by design (zeros, or the last update)."""
  open_cycle = int(state.micro_step) > 0
  return state._replace(
    acc_grads=state.acc_grads if open_cycle else None,
    acc_weight=state.acc_weight if open_cycle else None,
  )


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_both_forms_give_the_same_run(monkeypatch, scenario, jit):
  cpu = _trajectory(monkeypatch, "cpu", scenario, jit=jit)
  accelerator = _trajectory(monkeypatch, "accelerator", scenario, jit=jit)
  for (p, s, u), (q, t, v) in zip(cpu, accelerator, strict=True):
    chex.assert_trees_all_equal(u, v, strict=True)
    chex.assert_trees_all_equal(p, q, strict=True)
    chex.assert_trees_all_equal(_comparable(s), _comparable(t), strict=True)
  assert any(bool(optax_accum.has_updated(s)) for _, s, _ in cpu)


def test_accelerator_form_leaves_zeros_and_cpu_form_the_update(monkeypatch):
  params = _common.params()
  ends = {}
  for form in FORMS:
    _pin(monkeypatch, form)
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    state = tx.init(params)
    for i in range(2):
      updates, state = jax.jit(tx.update)(_common.grads(i), state, params)
    ends[form] = (state, updates)
  state, _ = ends["accelerator"]
  chex.assert_trees_all_equal(
    state.acc_grads, jax.tree.map(jnp.zeros_like, state.acc_grads)
  )
  assert float(state.acc_weight) == 0.0
  state, updates = ends["cpu"]  # sgd(1): the buffer holds the update.
  chex.assert_trees_all_close(state.acc_grads, updates)
  assert float(state.acc_weight) == 2.0


def _cycle(tx, state, params, start, static):
  """Two calls, the second ending the cycle (by k=2, or by emit=True)."""
  update = jax.jit(tx.update, static_argnames="emit")
  for i in range(2):
    options = {"emit": i == 1} if static else {}
    updates, state = update(_common.grads(start + i), state, params, **options)
  return updates, state


@pytest.mark.parametrize("static", [False, True], ids=["traced", "static"])
def test_a_cpu_boundary_state_costs_the_accelerator_one_cycle(
  monkeypatch, static
):
  """A traced emission compiled for CPU leaves its update in the buffer.
  Resumed by the accelerator form (traced or static), the cycle that starts
  on that scratch ends without an update (its weight starts at -inf) and
  leaves zeros; the next cycle is exactly what a clean start gives."""
  params = _common.params()
  _pin(monkeypatch, "cpu")
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  _, state = _cycle(tx, tx.init(params), params, 0, static=False)
  assert float(state.acc_weight) != 0  # The CPU form's scratch.
  _pin(monkeypatch, "accelerator")
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  updates, state = _cycle(tx, state, params, 10, static)
  assert not optax_accum.has_updated(state) and int(state.step) == 1
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
  chex.assert_trees_all_equal(
    state.acc_grads, jax.tree.map(jnp.zeros_like, state.acc_grads)
  )
  assert float(state.acc_weight) == 0.0
  resumed, state = _cycle(tx, state, params, 20, static)
  clean, _ = _cycle(tx, tx.init(params), params, 20, static)
  chex.assert_trees_all_equal(resumed, clean)
  assert int(state.step) == 2


def test_without_the_flag_the_accelerator_form_would_add_scratch(monkeypatch):
  """Control for the test above: hide the CPU form's flag (acc_weight) and
  the accelerator form adds the scratch into its next update."""
  params = _common.params()
  _pin(monkeypatch, "cpu")
  tx = optax_accum.accumulate(optax.sgd(1.0), 1, skip_nonfinite=True)
  _, state = tx.update(_common.grads(0), tx.init(params), params)
  _pin(monkeypatch, "accelerator")
  tx = optax_accum.accumulate(optax.sgd(1.0), 1, skip_nonfinite=True)
  hidden = state._replace(acc_weight=jnp.zeros([], jnp.float32))
  updates, _ = tx.update(_common.grads(1), hidden, params)
  clean, _ = tx.update(_common.grads(1), tx.init(params), params)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(updates, clean)
