"""The way in from `optax.MultiSteps`: the migration table's claims.

The table in docs/guides/multisteps.md ("Coming from optax.MultiSteps") maps every
name of MultiSteps; these tests hold it to optax's own list of names, and run
both transformations side by side, field by field, with and without jit.
The errors for MultiSteps names are in tests/test_arguments.py.
"""

import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

GUIDE = (
  pathlib.Path(__file__).resolve().parent.parent
  / "docs"
  / "guides"
  / "multisteps.md"
)


def _table_first_column() -> list[str]:
  text = GUIDE.read_text()
  # The page is the section (with its checkpoint subsection) it was in
  # examples/README.md.
  section = text[text.index("# Coming from `optax.MultiSteps`") :]
  rows = [line for line in section.splitlines() if line.startswith("| ")]
  return [row.split("|")[1] for row in rows[1:]]  # below the header


def test_the_table_maps_every_multisteps_name():
  """Every argument, public attribute and state field of MultiSteps."""
  cells = " ".join(_table_first_column())
  arguments = list(inspect.signature(optax.MultiSteps).parameters)
  attributes = [
    name for name in dir(optax.MultiSteps) if not name.startswith("_")
  ]
  fields = list(optax.MultiStepsState._fields)
  assert {"opt", "every_k_schedule", "use_grad_mean"} <= set(arguments)
  assert {"has_updated", "gradient_transformation"} <= set(attributes)
  missing = [a for a in arguments if not re.search(rf"\b{a}\b", cells)]
  missing += [a for a in attributes if f"`.{a}" not in cells]
  missing += [f for f in fields if f"`state.{f}`" not in cells]
  assert not missing, f"names of optax.MultiSteps not in the table: {missing}"


def test_the_installed_guide_maps_every_state_field_and_argument():
  """``help(optax_accum.multisteps)``, where the errors point: the wheel
  ships no docs/guides/multisteps.md."""
  from optax_accum import multisteps

  doc = multisteps.__doc__
  names = list(optax.MultiStepsState._fields)
  names += ["every_k_schedule", "use_grad_mean", "should_skip_update_fn"]
  names += ["accumulator_dtype", "has_updated", "gradient_transformation"]
  assert not [n for n in names if n not in doc]


def test_accumulate_returns_optax_own_type():
  """Why the table documents `tx.has_updated` instead of providing it."""
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  assert type(tx) is optax.GradientTransformationExtraArgs
  assert not hasattr(tx, "has_updated")


def _grads(i):
  g = jnp.array([1.0, -2.0, 0.5]) * (i + 1) + jnp.array([0.0, 0.25, i * 0.1])
  return {"w": g, "b": jnp.full(2, 0.5 * i)}


# (MultiSteps arguments, accumulate arguments, a non-finite micro-batch).
CONFIGS = {
  "k3": ({"every_k_schedule": 3}, {"every_k": 3}, None),
  "schedule": (
    {"every_k_schedule": lambda step: 2 + step},
    {"every_k": lambda step: 2 + step},
    None,
  ),
  "sum": (
    {"every_k_schedule": 2, "use_grad_mean": False},
    {"every_k": 2, "reduction": "sum"},
    None,
  ),
  "skip": (
    {"every_k_schedule": 2, "should_skip_update_fn": optax.skip_not_finite},
    {"every_k": 2, "skip_nonfinite": True},
    2,  # right after an update
  ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_same_run_field_by_field(maybe_jit, config):
  old_args, new_args, bad = CONFIGS[config]
  inner = optax.adam(0.1)
  old = optax.MultiSteps(inner, **old_args)
  new = optax_accum.accumulate(inner, **new_args)
  params = {"w": jnp.zeros(3), "b": jnp.ones(2)}
  old_state, new_state = old.init(params), new.init(params)
  old_update, new_update = maybe_jit(old.update), maybe_jit(new.update)
  emitted = 0
  for i in range(9):
    grads = _grads(i)
    if i == bad:
      grads = dict(grads, w=grads["w"].at[0].set(jnp.nan))
    old_out, old_state = old_update(grads, old_state, params)
    new_out, new_state = new_update(grads, new_state, params)
    # adam inside a conditional vs masked: an ulp or so apart.
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
      new_out,
      old_out,
    )
    assert int(new_state.micro_step) == int(old_state.mini_step)
    assert int(new_state.step) == int(old_state.gradient_step)
    updated = bool(optax_accum.has_updated(new_state))
    if i == bad:  # The table's difference: this call moved nothing.
      assert not updated and bool(old.has_updated(old_state))
    else:
      assert updated == bool(old.has_updated(old_state))
    emitted += updated
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
      new_state.inner_state,
      old_state.inner_opt_state,
    )
    if int(new_state.micro_step) > 0:
      # Ours holds the sum; MultiSteps the mean (use_grad_mean) or the sum.
      scale = 1.0 if config == "sum" else 1.0 / float(new_state.acc_weight)
      for a, b in zip(
        jax.tree.leaves(new_state.acc_grads),
        jax.tree.leaves(old_state.acc_grads),
        strict=True,
      ):
        np.testing.assert_allclose(a * scale, b, rtol=1e-6)
  assert emitted >= 2
  assert int(new_state.num_skipped) == (0 if bad is None else 1)


def test_learning_rate_of_the_next_update_is_schedule_of_step(maybe_jit):
  """A schedule inside `inner` sees optimizer steps: the update of a cycle
  uses schedule(state.step) read before it."""
  schedule = optax.linear_schedule(1.0, 0.1, transition_steps=5)
  tx = optax_accum.accumulate(
    optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), 3
  )
  params = jnp.zeros(2)
  state = tx.init(params)
  update = maybe_jit(tx.update)
  for i in range(12):
    to_log = float(schedule(state.step))
    _, state = update(jnp.ones(2) * i, state, params)
    if optax_accum.has_updated(state):
      used = optax_accum.inner_state(state).hyperparams["learning_rate"]
      np.testing.assert_allclose(used, to_log, rtol=1e-6)
  assert int(state.step) == 4
