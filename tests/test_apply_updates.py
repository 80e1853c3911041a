"""`optax_accum.apply_updates`: ``optax.apply_updates`` on emitting calls,
the params untouched otherwise, with and without jit.

What it compiles to (no parameter work on a micro-step) is held by
``tests/test_accelerators.py`` and ``tests/test_performance_structure.py``;
here, that it returns the right params in every way it can be called.
"""

import contextlib
import warnings

import _common
import chex
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import _apply
from tools import program

# What each misuse's warning says (optax_accum/_apply.py, issue 54).
FOREIGN = "transformed after it"
NO_PARAMS = "was given no params"
OTHER_PARAMS = "not the ones given to the update"

# (tests/conftest.py clears the once-per-process warnings before each test.)


def _run(tx, apply, calls=7, jit=True, pass_params=True, **options):
  """`calls` steps of ``grads -> tx.update -> apply``; the params after each
  and the updates of each."""
  params = _common.params()
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(
      grads, state, params if pass_params else None, **options
    )
    return apply(params, updates, state), state, updates

  step = jax.jit(step) if jit else step
  history = []
  for i in range(calls):
    params, state, updates = step(params, state, _common.grads(i))
    history.append((params, updates, state))
  return history


def _optax_apply(params, updates, state):
  del state
  return optax.apply_updates(params, updates)


TRANSFORMATIONS = {
  "adam": lambda: optax_accum.accumulate(optax.adam(0.1), 3),
  "in_chain": lambda: optax.chain(
    optax.clip(1.0), optax_accum.accumulate(optax.adam(0.1), 3)
  ),
  # The updates are transformed after accumulate: applied as given.
  "scaled_after": lambda: optax.chain(
    optax_accum.accumulate(optax.adam(0.1), 3), optax.scale(-2.0)
  ),
  # Updates of another dtype than the accumulator's (design point 2 off).
  "bf16_accumulator": lambda: optax_accum.accumulate(
    optax.adam(0.1), 3, accumulator_dtype=jnp.bfloat16
  ),
}


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("name", list(TRANSFORMATIONS))
@pytest.mark.parametrize("pass_params", [True, False])
def test_equals_optax_apply_updates(name, jit, pass_params):
  """The same params in every way it is called; where the updates or the
  params are not the update's own, under jit, a warning names the fix."""
  misuse = None
  if jit and name == "scaled_after":
    misuse = FOREIGN
  elif jit and not pass_params:
    misuse = NO_PARAMS
  warns = contextlib.nullcontext()
  if misuse is not None:
    warns = pytest.warns(UserWarning, match=misuse)
  with warns:
    ours = _run(
      TRANSFORMATIONS[name](),
      optax_accum.apply_updates,
      jit=jit,
      pass_params=pass_params,
    )
  theirs = _run(
    TRANSFORMATIONS[name](), _optax_apply, jit=jit, pass_params=pass_params
  )
  emitted = 0
  for (p, _, s), (q, _, _) in zip(ours, theirs, strict=True):
    chex.assert_trees_all_equal(p, q, strict=True)
    emitted += bool(optax_accum.has_updated(s))
  assert emitted == 2  # calls 3 and 6 of 7


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_params_are_returned_untouched_on_a_micro_step(jit):
  """Bit for bit, -0.0 included (``p + 0`` would turn it into +0.0)."""
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = {"w": jnp.array([-0.0, 1.0])}
  state = tx.init(params)

  def step(params, state):
    updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    return optax_accum.apply_updates(params, updates, state), state

  step = jax.jit(step) if jit else step
  params, state = step(params, state)
  assert np.signbit(params["w"][0]) and not optax_accum.has_updated(state)
  params, state = step(params, state)
  np.testing.assert_array_equal(params["w"], [-1.0, 0.0])


def test_other_params_than_those_updated_with_are_applied_as_given():
  tx = optax_accum.accumulate(optax.sgd(1.0), 1, skip_nonfinite=True)
  params = {"w": jnp.zeros(2)}
  other = {"w": jnp.full(2, 10.0)}
  state = tx.init(params)

  @jax.jit
  def step(params, other, state):
    updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    return optax_accum.apply_updates(other, updates, state)

  with pytest.warns(UserWarning, match=OTHER_PARAMS):
    new = step(params, other, state)
  np.testing.assert_array_equal(new["w"], [9.0, 9.0])


def test_updates_of_another_trace_are_applied_and_named():
  """update and apply_updates in two jitted functions: the right params,
  and a warning that names the fix; once per misuse and process."""
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(lambda g, s, p: tx.update(g, s, p))
  with pytest.warns(UserWarning, match=FOREIGN) as record:
    for g in (1.0, 3.0):
      updates, state = update({"w": jnp.full(2, g)}, state, params)
      # A fresh function each time: traced anew, the misuse met again.
      apply = jax.jit(lambda p, u, s: optax_accum.apply_updates(p, u, s))
      params = apply(params, updates, state)
  assert len(record) == 1, [str(w.message) for w in record]
  np.testing.assert_array_equal(params["w"], [-2.0, -2.0])


def test_the_fast_route_says_nothing():
  """The documented step (update given the params, apply_updates on its
  updates in the same trace) warns of nothing: the suite turns warnings
  into errors, and this checks it here too."""
  tx = optax_accum.accumulate(optax.adam(0.1), 2)
  params = _common.params()
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax_accum.apply_updates(params, updates, state), state

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for i in range(3):
      params, state = step(params, state, _common.grads(i))
  assert not _apply._WARNED


@pytest.mark.parametrize("emit", [False, True])
def test_static_calls_apply_at_trace_time(emit):
  """With emit= there is nothing to decide on the device: the micro-step
  returns the very params it was given."""
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)

  def step(params, state):
    updates, state = tx.update({"w": jnp.ones(2)}, state, params, emit=emit)
    return optax_accum.apply_updates(params, updates, state), state

  compiled = jax.jit(step).lower(params, state).compile()
  # None from apply_updates; the emitting step compiled for CPU runs the
  # optimizer, and applies, in the conditional that keeps a weightless
  # cycle out (tests/test_static_cycle.py).
  assert program.Program(compiled).conditionals() == int(emit)
  new, _ = jax.jit(step)(params, state)
  np.testing.assert_array_equal(new["w"], [0.0, 0.0] if emit else [1.0, 1.0])


def test_reads_the_state_inside_an_nnx_optimizer():
  """A flax.nnx.Optimizer's opt_state holds OptArray leaves: the flag of
  the call that emitted is read through them (every_k=1: every call
  emits, so the updates are applied, not ignored)."""
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  tx = optax_accum.accumulate(optax.sgd(1.0), 1)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  optimizer.update(model, grads)  # its opt_state: after an emitting call
  out = optax_accum.apply_updates(params, updates, optimizer.opt_state)
  expected = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(out, expected)
  with pytest.raises(AssertionError):  # the updates are not zeros
    chex.assert_trees_all_equal(expected, params)


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_without_an_accumulate_state_is_optax_apply_updates(use_jit):
  """Accumulation switched off (a trainer's plain optimizer): the same
  call applies the updates, as ``optax.apply_updates`` does."""
  tx = optax.adam(0.1)
  params = {"w": jnp.arange(3.0), "b": jnp.ones(2)}
  updates, state = tx.update(
    jax.tree.map(jnp.ones_like, params), tx.init(params)
  )
  apply = (
    jax.jit(optax_accum.apply_updates) if use_jit else optax_accum.apply_updates
  )
  out = apply(params, updates, state)
  chex.assert_trees_all_equal(out, optax.apply_updates(params, updates))
  with pytest.raises(AssertionError):  # the updates are not zeros
    chex.assert_trees_all_equal(out, params)


def test_several_accumulate_states_name_the_function():
  tx = optax.chain(
    optax_accum.accumulate(optax.sgd(1.0), 2),
    optax_accum.accumulate(optax.sgd(1.0), 2),
  )
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match="`apply_updates`"):
    optax_accum.apply_updates(params, params, tx.init(params))


def _misused(misuse):
  """A fresh jitted step (traced anew each time) that applies updates by
  `misuse`: foreign updates (scaled after accumulate), no params given to
  the update, or other params than those it was given."""
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  params = {"w": jnp.zeros(2)}

  def step(params, state):
    given = None if misuse == "no_params" else params
    updates, state = tx.update({"w": jnp.ones(2)}, state, given)
    if misuse == "foreign":
      updates = jax.tree.map(lambda u: 0.5 * u, updates)
    target = {"w": params["w"] + 1.0} if misuse == "other" else params
    return optax_accum.apply_updates(target, updates, state)

  return lambda: jax.jit(step)(params, tx.init(params))


MISUSES = {"foreign": FOREIGN, "no_params": NO_PARAMS, "other": OTHER_PARAMS}


def test_each_misuse_is_said_once_per_process_with_its_fix():
  """The slow-route warning as documented: each misuse's own text the
  first time it is met, nothing the second time (a fresh trace of the same
  misuse), and another misuse still said (plant: a warning on every
  trace)."""
  said = []
  for misuse in (*MISUSES, *MISUSES):  # every misuse twice
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      _misused(misuse)()
    said += [(misuse, str(w.message)) for w in caught]
  assert [m for m, _ in said] == list(MISUSES)
  for misuse, message in said:
    assert MISUSES[misuse] in message, (misuse, message)
    assert message.startswith("optax_accum.apply_updates returns the right")
