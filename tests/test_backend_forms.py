"""One meaning of the state on every backend (``per_backend`` in
``optax_accum/_control.py``).

A program compiled for CPU and one compiled for GPU or TPU close a cycle in
different ways: the CPU form leaves the updates in the accumulator's buffer
(``acc_buffer``) as leftovers, marked by the cycle's stored weight at
micro_step 0, which the next call does not read (a select fused into its
add); the GPU/TPU form zeroes the accumulator in place (weight 0), and throws
a CPU program's leftovers away with their cycle. Both mean the same state,
and read the same: ``acc_grads`` and ``acc_weight`` are zeros and 0 after a
cycle's end in both forms (issue 54). This machine runs only the CPU form, so
these tests pin ``_control.per_backend`` to each form in turn and run
both on CPU: the same updates and params, bit for bit, states that mean the
same, and a state saved by one form resumes in the other as if nothing had
changed. Leftovers (the CPU form's, or those optax_accum 0.1 left on CPU)
are never read; the GPU/TPU form throws them away with their cycle: one
cycle without an update, never a wrong one.
"""

import functools

import _common
import chex
import flax.nnx as nnx
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import _accumulate, _control

FORMS = {
  "cpu": lambda *args, cpu, accelerator, gpu=None: cpu(*args),
  "accelerator": lambda *args, cpu, accelerator, gpu=None: accelerator(*args),
  # A GPU's program of a small state: selects, no conditional (the GPU/TPU
  # form where the code has no GPU form of its own).
  "gpu": lambda *args, cpu, accelerator, gpu=None: (gpu or accelerator)(*args),
}


def _pin(monkeypatch, form):
  """Every accumulate traced from now on takes `form`. JAX caches a trace
  per function: build a new transformation after pinning."""
  monkeypatch.setattr(_control, "per_backend", FORMS[form])
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
  # A weightless cycle whose sum is not zeros (summed gradients at weight
  # 0): what the CPU form leaves must be marked as leftovers too.
  "weightless_sum": (
    dict(inner=optax.adam(0.1), every_k=2, gradients="sum"),
    lambda i: {"weight": 0.0 if i < 2 else 1.0},
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
  # bfloat16 params and gradients, a float32 accumulator: the GPU/TPU form
  # applies the (narrower) updates in the emitting branch instead of
  # passing them through the accumulator's buffer (_apply_inside); a
  # weightless cycle (calls 3 and 4, summed gradients: a sum that is not
  # zeros) takes its third branch.
  "bf16_params": (
    dict(inner=optax.adam(0.1), every_k=2, gradients="sum"),
    lambda i: {"weight": 0.0 if i in (2, 3) else 1.0 + i % 3},
    lambda i: _bf16(_common.grads(i)),
  ),
  "bf16_params_noise_skip": (
    dict(
      inner=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1)),
      every_k=3,
      track_noise_scale=True,
      skip_nonfinite=True,
    ),
    lambda i: {"weight": 2.0, "flush": i == 7},
    lambda i: _bf16(_nan_grads(i) if i % 5 == 1 else _common.grads(i)),
  ),
  # Issue 70: what no scenario above had. A NaN weight makes the cycle's
  # total NaN, which every form hands to the inner optimizer (documented:
  # NaN in, NaN out); a cycle of total weight 0, and one of negative total
  # (mixed signs), hold without an update; a NaN gradient without
  # skip_nonfinite goes in as any other; a stochastically rounded bfloat16
  # accumulator rounds with the same bits in every form.
  "nan_weight": (
    dict(inner=optax.sgd(0.1), every_k=3),
    lambda i: {"weight": float("nan") if i == 4 else 1.0},
    None,
  ),
  "zero_total_weight": (
    dict(inner=optax.adam(0.1), every_k=2),
    lambda i: {"weight": 0.0 if i in (2, 3) else 1.0},
    None,
  ),
  "mixed_sign_weights": (
    dict(inner=optax.sgd(0.1), every_k=2),
    lambda i: {"weight": (2.0, -1.0, 1.0, -3.0)[i % 4]},
    None,
  ),
  "nan_grad_no_skip": (
    dict(inner=optax.sgd(0.1), every_k=3),
    lambda i: {},
    lambda i: _nan_grads(i) if i == 7 else _common.grads(i),
  ),
  "bf16_stochastic": (
    dict(
      inner=optax.adam(0.1),
      every_k=3,
      accumulator_dtype=jnp.bfloat16,
      rounding="stochastic",
    ),
    lambda i: {"weight": 1.0 + i % 2, "flush": i == 7},
    None,
  ),
}

BF16_PARAMS = ("bf16_params", "bf16_params_noise_skip")
# Under jit only: weights an eager call refuses (a ValueError naming
# `weight`; under jit they are runtime values, and run as documented), and
# issue 70's other scenarios, whose eager runs (the same forms, op by op)
# would cost the suite 12 s of CPU more.
JIT_ONLY = (
  "nan_weight",
  "mixed_sign_weights",
  "zero_total_weight",
  "nan_grad_no_skip",
  "bf16_stochastic",
)


def _bf16(tree):
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)


def _trajectory(monkeypatch, form, scenario, calls=12, jit=True):
  _pin(monkeypatch, form)
  kwargs, per_call, grads_of = SCENARIOS[scenario]
  grads_of = grads_of or _common.grads
  kwargs = dict(kwargs)
  tx = optax_accum.accumulate(
    kwargs.pop("inner"), kwargs.pop("every_k"), **kwargs
  )
  params = _common.params()
  if scenario in BF16_PARAMS:
    params = _bf16(params)
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


def _stored_weight(state):
  """The weight as stored beside the buffer (a mark beside leftovers), not
  as ``acc_weight`` reads it."""
  return float(state.acc_scalars[0])


def _meaning(state):
  """`state` as stored, with leftovers (micro_step 0, a non-zero stored
  weight) replaced by the zeros and weight 0 they stand for."""
  if int(state.micro_step) != 0 or _stored_weight(state) == 0:
    return state
  return state.replace(
    acc_buffer=jax.tree.map(jnp.zeros_like, state.acc_buffer),
    acc_weight=jnp.zeros([], jnp.float32),
  )


def _assert_fresh(state, stored=True):
  """No cycle open: read as zeros and 0, and (`stored`) stored so too."""
  read = [(state.acc_grads, float(state.acc_weight))]
  if stored:
    read.append((state.acc_buffer, _stored_weight(state)))
  for tree, weight in read:
    chex.assert_trees_all_equal(tree, jax.tree.map(jnp.zeros_like, tree))
    assert weight == 0.0


@pytest.mark.parametrize(
  "scenario, jit",
  [
    pytest.param(scenario, jit, id=f"{scenario}-{'jit' if jit else 'nojit'}")
    for jit in (False, True)
    for scenario in SCENARIOS
    if jit or scenario not in JIT_ONLY
  ],
)
def test_both_forms_give_the_same_run(monkeypatch, scenario, jit):
  cpu = _trajectory(monkeypatch, "cpu", scenario, jit=jit)
  accelerator = _trajectory(monkeypatch, "accelerator", scenario, jit=jit)
  gpu = _trajectory(monkeypatch, "gpu", scenario, jit=jit)
  # The GPU's selects (a small state) give the GPU/TPU form's run, to the
  # float rounding of an inner optimizer that XLA:CPU fuses otherwise (a
  # ulp of adam's moments).
  for (p, s, u), (q, t, v) in zip(accelerator, gpu, strict=True):
    chex.assert_trees_all_close(
      (p, _meaning(s), u), (q, _meaning(t), v), rtol=1e-5, atol=1e-7
    )
  # Bit for bit, but where a static emitting step runs the inner optimizer:
  # in a conditional in the CPU form, under selects in the GPU/TPU one,
  # which XLA:CPU fuses apart (adam's moments 1 ulp apart).
  same = chex.assert_trees_all_equal
  if scenario == "static":
    same = functools.partial(chex.assert_trees_all_close, rtol=1e-6, atol=0)
  for (p, s, u), (q, t, v) in zip(cpu, accelerator, strict=True):
    same(u, v, strict=True)
    same(p, q, strict=True)
    # The whole state as stored, leftovers read as what they mean.
    same(_meaning(s), _meaning(t), strict=True)
    # As a user reads it (the pin of issue 54): the same after every call.
    same((s.acc_grads, s.acc_weight), (t.acc_grads, t.acc_weight))
    if int(t.micro_step) == 0:  # a cycle boundary: zeros on GPU/TPU
      _assert_fresh(t)
      _assert_fresh(s, stored=False)  # and read so on CPU
    shares = scenario not in (
      "bf16_accumulator",
      "bf16_stochastic",
      *BF16_PARAMS,
    )
    if int(s.micro_step) == 0 and shares and s.emitted:
      # The CPU form leaves the updates where they fit the accumulator's
      # buffer (float32 updates fit no bfloat16 one), marked by the weight.
      assert _stored_weight(s) != 0.0
  assert any(bool(optax_accum.has_updated(s)) for _, s, _ in cpu)
  # What every form must do, not only what they agree on (issue 70).
  updated = [bool(optax_accum.has_updated(s)) for _, s, _ in cpu]
  if scenario == "nan_weight":  # the cycle of calls 3-5 hands NaN to inner
    assert updated[5] and np.isnan(np.asarray(cpu[5][0]["w"])).all()
  if scenario in ("zero_total_weight", "mixed_sign_weights"):
    # Weight 0 (calls 2-3), and -2 (calls 2-3 of each four): no update.
    assert updated[1] and not updated[3]


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
  other: the run goes on bit for bit as in the first form; except that the
  GPU/TPU form throws the CPU form's leftovers (a cycle's end, traced or
  static) away with their cycle, and then goes on as from a clean start."""
  other = "accelerator" if first == "cpu" else "cpu"
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

  unswitched, switched = run([first] * 3), run([first, other, other])
  if first == "cpu":
    (updates, state), (after, _) = switched[1:]
    assert not optax_accum.has_updated(state) and int(state.step) == 1
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
    _assert_fresh(state)
    tx = optax_accum.accumulate(optax.sgd(1.0), 2)
    clean, _ = _cycle(tx, tx.init(params), params, 4, static)
    chex.assert_trees_all_equal(after, clean, strict=True)
    unswitched, switched = unswitched[:1], switched[:1]
  for (u, s), (v, t) in zip(unswitched, switched, strict=True):
    chex.assert_trees_all_equal(u, v, strict=True)
    chex.assert_trees_all_equal(_meaning(s), _meaning(t), strict=True)
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
  (u, s), (v, t) = ends[first], ends[other]
  chex.assert_trees_all_equal(u, v, strict=True)
  chex.assert_trees_all_equal(_meaning(s), _meaning(t), strict=True)


def _v01_cpu_state(params):
  """What optax_accum 0.1 compiled for CPU left after an emitting call
  (sgd(1), k=2): that call's updates in acc_grads, its weight in
  acc_weight, micro_step 0."""
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  updates, state = _cycle(tx, tx.init(params), params, 0, static=False)
  return state.replace(acc_grads=updates, acc_weight=jnp.float32(2.0))


@pytest.mark.parametrize("static", [False, True], ids=["traced", "static"])
@pytest.mark.parametrize("form", list(FORMS))
def test_a_v01_cpu_state_resumes(monkeypatch, form, static):
  """0.1's leftovers are the CPU form's: never read. Resumed in the CPU
  form, the next cycle is exactly what a clean start gives; in the GPU/TPU
  form the cycle that starts on them ends without an update and leaves
  zeros, and the cycle after it is a clean start's."""
  params = _common.params()
  _pin(monkeypatch, form)
  state = _v01_cpu_state(params)
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  clean, _ = _cycle(tx, tx.init(params), params, 10, static)
  updates, state = _cycle(tx, state, params, 10, static)
  if form != "cpu":
    assert not optax_accum.has_updated(state) and int(state.step) == 1
    zeros = jax.tree.map(jnp.zeros_like, updates)
    chex.assert_trees_all_equal(updates, zeros)
    _assert_fresh(state)
    updates, state = _cycle(tx, state, params, 20, static)
    clean, _ = _cycle(tx, tx.init(params), params, 20, static)
  chex.assert_trees_all_equal(updates, clean)
  assert bool(optax_accum.has_updated(state))


def test_without_the_flag_a_v01_state_would_add_its_leftovers(monkeypatch):
  """Control for the test above: hide 0.1's flag (acc_weight) and its
  leftover update joins the next update."""
  params = _common.params()
  hidden = _v01_cpu_state(params).replace(acc_weight=jnp.zeros([], jnp.float32))
  tx = optax_accum.accumulate(optax.sgd(1.0), 1, skip_nonfinite=True)
  # Under jit: outside it, update refuses such a state (test_multisteps_
  # checkpoints.py: a sum with no cycle under way).
  updates, _ = jax.jit(tx.update)(_common.grads(1), hidden, params)
  clean, _ = jax.jit(tx.update)(_common.grads(1), tx.init(params), params)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(updates, clean)


# name -> (accumulate kwargs, per-call update kwargs, gradient of call i)
FIRST_CALLS = {
  "plain": ({}, lambda i: {}, _common.grads),
  "zero_weight_first": ({}, lambda i: {"weight": float(i > 0)}, _common.grads),
  "summed_zero_weight_first": (
    {"gradients": "sum"},
    lambda i: {"weight": float(i > 0)},
    lambda i: jax.tree.map(lambda g: g * float(i > 0), _common.grads(i)),
  ),
  "skipped_first": (
    {"skip_nonfinite": True},
    lambda i: {},
    lambda i: _nan_grads(i) if i == 0 else _common.grads(i),
  ),
}


@pytest.mark.parametrize("static", [False, True], ids=["traced", "static"])
@pytest.mark.parametrize("first", list(FIRST_CALLS))
@pytest.mark.parametrize("form", list(FORMS))
def test_what_a_cycle_end_leaves_is_never_read(
  monkeypatch, form, first, static
):
  """Leftovers are never read: whatever acc_grads holds beside the marking
  weight at micro_step 0 (here NaN, which any read would spread), the next
  cycle is bit for bit the one that starts from zeros, whatever its first
  call (a zero weight, a skipped micro-batch); in the GPU/TPU form it ends
  without an update (NaN-free zeros)."""
  _pin(monkeypatch, form)
  kwargs, per_call, grads_of = FIRST_CALLS[first]
  tx = optax_accum.accumulate(optax.adam(0.1), 2, **kwargs)
  params = _common.params()
  update = jax.jit(tx.update, static_argnames="emit")
  _, ended = _cycle(tx, tx.init(params), params, 0, static)
  assert int(ended.micro_step) == 0 and int(ended.step) == 1
  nan = ended.replace(
    acc_buffer=jax.tree.map(
      lambda a: jnp.full_like(a, jnp.nan), ended.acc_buffer
    ),
    acc_weight=jnp.float32(2.0),
  )
  zeros = ended.replace(
    acc_weight=jnp.float32(0.0),
    acc_buffer=jax.tree.map(jnp.zeros_like, ended.acc_buffer),
  )
  calls = 3 if first == "skipped_first" else 2  # a skipped call counts not
  runs = []
  for state in (nan, zeros):
    out = []
    for i in range(calls):
      options = per_call(i) | ({"emit": i == calls - 1} if static else {})
      updates, state = update(grads_of(i), state, params, **options)
      out.append((updates, state.acc_grads))
    runs.append((out, state))
  if form != "cpu":
    (out, state), _ = runs
    assert not bool(optax_accum.has_updated(state))
    _assert_fresh(state)
    for updates, _ in out:
      chex.assert_trees_all_equal(
        updates, jax.tree.map(jnp.zeros_like, updates)
      )
    return
  chex.assert_trees_all_equal(runs[0], runs[1], strict=True)
  assert bool(optax_accum.has_updated(runs[1][1]))
  leaves = jax.tree.leaves(runs[1][0][-1][0])
  assert all(
    bool(jnp.all(jnp.isfinite(u))) and bool(jnp.any(u != 0)) for u in leaves
  )


def test_a_weightless_static_end_on_cpu_is_marked_for_the_other_form(
  monkeypatch,
):
  """A static emit=True that ends a weightless cycle (summed gradients at
  weight 0: a sum that is not zeros) leaves the sum as leftovers on CPU,
  marked -inf: resumed by the GPU/TPU form, the next cycle is thrown away
  (no update, never a wrong one) and the one after it is a clean start's
  first; unmarked, the sum would join the next cycle's update."""
  params = _common.params()

  def tx():
    return optax_accum.accumulate(optax.sgd(1.0), 2, gradients="sum")

  def cycle(state, start):
    update = jax.jit(tx().update, static_argnames="emit")
    for i in range(start, start + 2):
      updates, state = update(
        _common.grads(i),
        state,
        params,
        weight=float(start > 0),
        emit=i % 2 == 1,
      )
    return updates, state

  _pin(monkeypatch, "cpu")
  _, state = cycle(tx().init(params), 0)
  assert int(state.micro_step) == 0 and _stored_weight(state) == -jnp.inf
  _assert_fresh(state, stored=False)  # read as no cycle open
  _pin(monkeypatch, "accelerator")
  thrown, state = cycle(state, 2)
  assert not optax_accum.has_updated(state)
  chex.assert_trees_all_equal(thrown, jax.tree.map(jnp.zeros_like, thrown))
  after, _ = cycle(state, 4)
  clean, _ = cycle(tx().init(params), 4)
  chex.assert_trees_all_equal(after, clean)


def test_acc_grads_reads_the_cycle_wherever_it_is_read(monkeypatch):
  """The CPU form's leftovers stay out of what a user reads (issue 54):
  eager, under jit, inside a flax.nnx.Optimizer; flax's state dicts, which
  read named tuples by name, resume the same run; the TrainState drop-in's
  keeps the buffer as stored."""
  _pin(monkeypatch, "cpu")
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = _common.params()
  update = jax.jit(tx.update)
  _, state = update(_common.grads(0), tx.init(params), params)
  _, state = update(_common.grads(1), state, params)
  assert _stored_weight(state) == 2.0  # leftovers, as stored
  assert any(bool(jnp.any(a != 0)) for a in jax.tree.leaves(state.acc_buffer))
  _assert_fresh(state, stored=False)
  read = jax.jit(lambda s: (s.acc_grads, s.acc_weight))(state)
  chex.assert_trees_all_equal(read, (state.acc_grads, state.acc_weight))
  # Mid-cycle it is the sum itself.
  _, mid = update(_common.grads(2), state, params)
  chex.assert_trees_all_equal(mid.acc_grads, mid.acc_buffer)
  assert float(mid.acc_weight) == 1.0
  # flax.serialization: the meaning saved, the same run resumed.
  restored = flax.serialization.from_bytes(
    tx.init(params), flax.serialization.to_bytes(state)
  )
  runs = []
  for start in (state, restored):
    s, out = start, []
    for i in range(2, 6):
      updates, s = update(_common.grads(i), s, params)
      out.append(updates)
    runs.append(out)
  chex.assert_trees_all_equal(runs[0], runs[1])
  # Inside an nnx.Optimizer (its leaves are Variables).
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  grads = nnx.grad(lambda m: (m(jnp.ones((1, 2))) ** 2).sum())(model)
  for _ in range(2):
    optimizer.update(model, grads)
  assert float(jnp.asarray(optimizer.opt_state.acc_scalars)[0]) == 2.0
  _assert_fresh(optimizer.opt_state, stored=False)


def test_to_multisteps_of_a_cycle_thrown_away_holds_no_sum(monkeypatch):
  """A CPU state resumed by the GPU/TPU form: its first cycle adds the
  leftovers and is marked (stored weight -inf) to end without an update.
  Converted mid-way to optax.MultiSteps, it holds no sum: the leftovers
  are not passed off as gradients."""
  params = _common.params()

  def tx():  # a transformation per form: each traces anew
    return optax_accum.accumulate(optax.sgd(1.0), 3)

  _pin(monkeypatch, "cpu")
  update = jax.jit(tx().update)
  state = tx().init(params)
  for i in range(3):
    _, state = update(_common.grads(i), state, params)
  assert _stored_weight(state) == 3.0  # leftovers beside micro_step 0
  _pin(monkeypatch, "accelerator")
  _, state = jax.jit(tx().update)(_common.grads(3), state, params)
  assert int(state.micro_step) == 1 and _stored_weight(state) == -jnp.inf
  for mean in (True, False):  # MultiSteps' mean, or its sum
    ms = optax_accum.multisteps.to_multisteps(state, use_grad_mean=mean)
    chex.assert_trees_all_equal(
      ms.acc_grads, jax.tree.map(jnp.zeros_like, ms.acc_grads)
    )


# Every name `replace` takes that a reader reads back (issue 63).
NAMES = _common.STATE_READERS


def _read(state):
  return {name: getattr(state, name) for name in NAMES}


@pytest.mark.parametrize("form", list(FORMS))
def test_replace_with_what_a_name_reads_changes_nothing(monkeypatch, form):
  """A state written back with what each name reads, after every call of a
  run in every backend form (cycle ends among them, where a CPU program
  leaves marked leftovers), reads the same by every name and gives the
  same next call, resumed in the other forms too (plant: `replace`
  writes the stored weight as it reads, dropping the mark)."""
  params = _common.params()
  rng = np.random.default_rng(0)
  calls = [
    dict(weight=float(rng.integers(0, 3)), emit=e)
    for e in (None, None, True, None, None, None, False, True, None)
  ]
  # Each form's next call, traced (called) once with that form pinned: the
  # later calls, of the same types, reuse that trace.
  steps = {}
  for later in FORMS:
    _pin(monkeypatch, later)
    tx = optax_accum.accumulate(optax.adam(0.1), 3)
    steps[later] = jax.jit(tx.update)
    steps[later](_common.grads(0), tx.init(params), params, weight=1.0)
  _pin(monkeypatch, form)  # the run's own calls, traced in its form
  tx = optax_accum.accumulate(optax.adam(0.1), 3)
  run = jax.jit(tx.update, static_argnames="emit")
  state = tx.init(params)
  for i, call in enumerate(calls):
    options = {k: v for k, v in call.items() if v is not None}
    _, state = run(_common.grads(i), state, params, **options)
    for name in NAMES:
      written = state.replace(**{name: getattr(state, name)})
      read, before = _read(written), _read(state)
      if name == "acc_grads":  # the buffer as stored holds what was written
        del read["acc_buffer"], before["acc_buffer"]
      chex.assert_trees_all_equal(read, before)
      for later, step in steps.items():  # the next call, in every form
        a = step(_common.grads(99), state, params, weight=1.0)
        b = step(_common.grads(99), written, params, weight=1.0)
        chex.assert_trees_all_equal(a[0], b[0])
        read, before = _read(b[1]), _read(a[1])
        if name == "acc_grads" and later != "cpu":
          # A CPU program's leftovers, overwritten by what acc_grads reads
          # (zeros), differ in a cycle the GPU/TPU form throws away (its
          # sum is never read): the counters and updates do not.
          for buffer in ("acc_grads", "acc_buffer"):
            del read[buffer], before[buffer]
        chex.assert_trees_all_equal(read, before)
