"""Bad arguments give early, clear errors that name the argument.

Construction-time checks first, then what can only be checked when
``update`` is traced, then the state readers and ``state_shardings``. Each
runtime rule that cannot be checked under ``jit`` is tested for the
documented behaviour instead.
"""

import re
import warnings

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

# ---------------------------------------------------------------------------
# At construction.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "every_k, error",
  [
    (0, ValueError),
    (-1, ValueError),
    (2.0, TypeError),
    (True, TypeError),
    ("4", TypeError),
    (None, TypeError),
    (np.float32(2), TypeError),
    (jnp.zeros(2, jnp.int32), TypeError),
    (np.int64(0), ValueError),
  ],
  ids=repr,
)
def test_bad_every_k_is_rejected_at_construction(every_k, error):
  with pytest.raises(error, match="every_k") as info:
    optax_accum.accumulate(optax.sgd(0.1), every_k)
  assert repr(every_k).split("(")[0] in str(info.value) or str(every_k) in str(
    info.value
  )


@pytest.mark.parametrize(
  "every_k", [np.int32(3), np.int64(3), jnp.int32(3), jnp.asarray(3)]
)
def test_numpy_and_jax_integer_every_k_are_accepted(every_k):
  tx = optax_accum.accumulate(_common.identity(), every_k)
  params = _common.params()
  state = tx.init(params)
  for i in range(3):
    _, state = tx.update(_common.grads(i), state, params)
  assert optax_accum.has_updated(state)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"reduction": "max"}, "reduction"),
    ({"accumulator_dtype": jnp.int32}, "accumulator_dtype"),
    ({"accumulator_dtype": "nonsense"}, "accumulator_dtype"),
    ({"noise_scale_decay": 1.0}, "noise_scale_decay"),
    ({"axis_name": ["a"]}, "axis_name"),
  ],
)
def test_bad_options_name_the_argument(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    optax_accum.accumulate(optax.sgd(0.1), 2, **kwargs)


@pytest.mark.parametrize(
  "inner, hint",
  [
    (None, "optax.GradientTransformation"),
    ("adam", "optax.GradientTransformation"),
    (optax.adam, "Did you mean to call it"),
    (optax.GradientTransformation(None, None), "must both be callable"),
  ],
  ids=["None", "str", "uncalled_factory", "None_functions"],
)
def test_inner_that_is_not_a_transformation_is_rejected(inner, hint):
  with pytest.raises(TypeError, match=f"`inner`.*{hint}"):
    optax_accum.accumulate(inner, 2)


def test_inner_with_init_and_update_is_accepted():
  class Duck:  # not a GradientTransformation, but has its two functions
    init = staticmethod(optax.sgd(1.0).init)
    update = staticmethod(optax.sgd(1.0).update)

  tx = optax_accum.accumulate(Duck(), 1)
  out, _ = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
  np.testing.assert_array_equal(out, -jnp.ones(2))


@pytest.mark.parametrize("name", ["skip_nonfinite", "track_noise_scale"])
@pytest.mark.parametrize("value", ["False", None, 2, 0, 1.0])
def test_flags_must_be_bools(name, value):
  """`"False"` is truthy: it used to switch the option on silently."""
  with pytest.raises(TypeError, match=f"`{name}` must be True or False"):
    optax_accum.accumulate(optax.sgd(0.1), 2, **{name: value})


@pytest.mark.parametrize("name", ["skip_nonfinite", "track_noise_scale"])
def test_numpy_bools_are_accepted(name):
  optax_accum.accumulate(optax.sgd(0.1), 2, **{name: np.bool_(True)})


@pytest.mark.parametrize("every_k", [2**31, 2**40, np.int64(2**31)])
def test_every_k_beyond_int32_is_rejected_at_construction(every_k):
  with pytest.raises(ValueError, match=r"`every_k` must be at most 2\*\*31"):
    optax_accum.accumulate(optax.sgd(0.1), every_k)


def test_every_k_at_the_int32_limit_is_accepted():
  tx = optax_accum.accumulate(_common.identity(), 2**31 - 1)
  _, state = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
  assert int(state.micro_step) == 1


@pytest.mark.parametrize(
  "schedule, error, match",
  [
    (lambda step: jnp.ones(2), ValueError, "scalar"),
    (lambda step: "4", TypeError, "number"),
    (lambda step: None, TypeError, "number"),
    (lambda step: 1 + 2j, TypeError, "complex"),
    (lambda step: True, TypeError, "bool"),
    (lambda step: jnp.nan, ValueError, "NaN"),
  ],
  ids=["non_scalar", "str", "None", "complex", "bool", "nan"],
)
def test_bad_schedule_values_are_rejected_at_construction(
  schedule, error, match
):
  with pytest.raises(error, match=f"`every_k` schedule.*{match}"):
    optax_accum.accumulate(optax.sgd(0.1), schedule)


@pytest.mark.parametrize(
  "schedule, signature",
  [
    (lambda: 2, r"\(\)"),
    (lambda step, seen, extra: 2, r"\(step, seen, extra\)"),
    (lambda *, step: 2, r"\(\*, step\)"),
  ],
  ids=["no_argument", "three_arguments", "keyword_only"],
)
def test_schedule_that_cannot_take_the_step_is_rejected(schedule, signature):
  with pytest.raises(
    TypeError,
    match=r"`every_k` schedule must take the optimizer step.*"
    f"with signature {signature}",
  ):
    optax_accum.accumulate(optax.sgd(0.1), schedule)


@pytest.mark.parametrize(
  "schedule, k",
  [
    (lambda step, seen=None: 3, 3),  # takes (step, weight_seen)
    (lambda *args: 2 + len(args), 4),
    (lambda step, *, scale=1: 2 * scale, 2),
  ],
  ids=["default_second", "varargs", "keyword_option"],
)
def test_schedules_that_take_the_step_are_accepted(maybe_jit, schedule, k):
  tx = optax_accum.accumulate(_common.identity(), schedule)
  state, params = tx.init(jnp.zeros(2)), jnp.zeros(2)
  update = maybe_jit(tx.update)
  for _ in range(k):
    _, state = update(jnp.ones(2), state, params)
  assert int(state.every_k) == k and int(state.step) == 1


# ---------------------------------------------------------------------------
# When update is traced.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "flush", [None, "yes", 1, jnp.ones(2, bool), [True], {"now": True}, object()]
)
def test_flush_must_be_a_boolean_scalar(maybe_jit, flush):
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  params = _common.params()
  # A string never reaches our check under jit: jax.jit itself rejects it,
  # naming the argument's path.
  with pytest.raises(TypeError, match="`flush` must be a boolean|path flush"):
    maybe_jit(tx.update)(_common.grads(0), tx.init(params), params, flush=flush)


@pytest.mark.parametrize(
  "weight, error, match",
  [
    ("3", TypeError, "real number"),
    (1 + 1j, TypeError, "real number"),
    (jnp.asarray(2 + 0j), TypeError, "real number"),
    (True, TypeError, "real number"),
    ({"tokens": 3.0}, TypeError, r"real number .*got \{'tokens'"),
    (object(), TypeError, "real number .*of type object"),
  ],
  ids=["str", "complex", "complex_array", "bool", "dict", "object"],
)
def test_weight_must_be_a_real_scalar(maybe_jit, weight, error, match):
  """A complex weight's imaginary part used to be dropped silently."""
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  params = _common.params()
  with pytest.raises(error, match=f"`weight` must be a {match}|path weight"):
    maybe_jit(tx.update)(
      _common.grads(0), tx.init(params), params, weight=weight
    )


def test_concrete_negative_weight_is_rejected():
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  params = _common.params()
  with pytest.raises(ValueError, match="`weight` must be >= 0, got -1.0"):
    tx.update(_common.grads(0), tx.init(params), params, weight=-1.0)


def test_traced_negative_weight_is_used_as_given():
  """Under jit a weight is not inspected: the documented signed sum."""
  tx = optax_accum.accumulate(_common.identity(), 2)
  params = jnp.zeros(2)
  update = jax.jit(tx.update)
  _, state = update(jnp.array([1.0, 2.0]), tx.init(params), params, weight=3.0)
  out, _ = update(jnp.array([4.0, 0.0]), state, params, weight=-1.0)
  np.testing.assert_allclose(out, jnp.array([-0.5, 3.0]))  # (3g0 - g1) / 2


@pytest.mark.parametrize(
  "weight", [np.inf, np.nan, jnp.float32(np.inf)], ids=["inf", "nan", "f32_inf"]
)
def test_concrete_nonfinite_weight_is_rejected(weight):
  """inf / inf: the cycle's mean would be NaN. Under jit the weight is not
  inspected: test_accumulate.py checks that the NaN reaches the inner."""
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  params = _common.params()
  with pytest.raises(
    ValueError, match="`weight` must be finite, got (inf|nan)"
  ):
    tx.update(_common.grads(0), tx.init(params), params, weight=weight)


@pytest.mark.parametrize("weight", [np.inf, np.nan], ids=["inf", "nan"])
def test_nonfinite_weight_with_skip_nonfinite_is_dropped(maybe_jit, weight):
  """Concrete or traced: dropped as documented, never an error."""
  tx = optax_accum.accumulate(_common.identity(), 2, skip_nonfinite=True)
  params = jnp.zeros(2)
  update = maybe_jit(tx.update)
  _, state = update(jnp.ones(2), tx.init(params), params, weight=1.0)
  _, state = update(jnp.full(2, 5.0), state, params, weight=weight)
  assert int(state.num_skipped) == 1 and int(state.micro_step) == 1
  out, state = update(jnp.full(2, 3.0), state, params, weight=3.0)
  np.testing.assert_allclose(out, jnp.full(2, 2.5))  # (1 + 3 * 3) / 4


@pytest.mark.parametrize("every_k", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_integer_or_boolean_gradients_are_rejected(maybe_jit, dtype, every_k):
  """Floating params get a floating accumulator; an integer gradient is
  something else passed by mistake (k = 1 used to pass it to `inner`)."""
  tx = optax_accum.accumulate(optax.sgd(0.1), every_k)
  params = _common.params()
  grads = dict(_common.grads(0), b=jnp.ones(3, dtype))
  with pytest.raises(
    TypeError,
    match=rf"`updates` leaf \['b'\] has dtype {jnp.dtype(dtype)}, but its"
    " accumulator is float32: gradients must be floating",
  ):
    maybe_jit(tx.update)(grads, tx.init(params), params)


def test_float0_gradients_of_integer_params_are_rejected():
  """jax.grad(..., allow_int=True) gives float0 zeros, which no optax
  optimizer takes; the error names the leaf (jit cannot take float0
  arguments at all)."""
  params = {"w": jnp.ones(3), "n": jnp.ones(2, jnp.int32)}
  grads = jax.grad(lambda p: jnp.sum(p["w"]), allow_int=True)(params)
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  with pytest.raises(TypeError, match=r"`updates` leaf \['n'\] has dtype"):
    tx.update(grads, tx.init(params), params)


def test_python_int_gradient_leaves_are_rejected(maybe_jit):
  """The mean would be emitted in the gradient's dtype: 1.5 truncated to 1.
  Python floats are accepted (test_accumulate.py)."""
  tx = optax_accum.accumulate(_common.identity(), 2)
  params = {"a": 0.0, "b": jnp.zeros(2)}
  with pytest.raises(TypeError, match=r"`updates` leaf \['a'\] has dtype int"):
    maybe_jit(tx.update)({"a": 1, "b": jnp.ones(2)}, tx.init(params), params)


@pytest.mark.parametrize("every_k", [1, 2])
def test_params_of_another_tree_or_shape_are_rejected(maybe_jit, every_k):
  """adamw reads the params: other params used to broadcast silently (k =
  1) or fail in a tree_map that named neither argument."""
  tx = optax_accum.accumulate(optax.adamw(1e-3), every_k)
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  grads = _common.grads(0)
  with pytest.raises(ValueError, match=r"`params` must have the tree.*\['c'\]"):
    update(grads, state, {"w": params["w"], "c": params["b"]})
  with pytest.raises(
    ValueError, match=r"`params` leaf \['b'\] has shape \(1,\), but the"
  ):
    update(grads, state, dict(params, b=jnp.ones(1)))
  # The params given to init are accepted, in another dtype too.
  update(grads, state, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))


def test_complex_gradients_for_real_params_are_rejected(maybe_jit):
  """The check itself raises: not a ComplexWarning that pytest's filters
  turn into an error (outside pytest the cast would drop the imaginary
  part silently, issue 55), so warnings are ignored here."""
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  params = _common.params()
  grads = dict(_common.grads(0), b=jnp.ones(3, jnp.complex64))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(TypeError, match=r"`updates` leaf \['b'\] is complex"):
      maybe_jit(tx.update)(grads, tx.init(params), params)


def test_noise_scale_decay_without_track_noise_scale_is_refused_naming_it():
  """Configuration that nothing would read raises (issue 55), like
  reduce_dtype without axis_name; the default is accepted either way."""
  with pytest.raises(
    ValueError, match=r"noise_scale_decay=0\.9 with track_noise_scale=False"
  ):
    optax_accum.accumulate(optax.sgd(0.1), 2, noise_scale_decay=0.9)
  optax_accum.accumulate(optax.sgd(0.1), 2, noise_scale_decay=0.99)
  optax_accum.accumulate(optax.sgd(0.1), 2, noise_scale_decay=np.float32(0.99))
  tx = optax_accum.accumulate(
    optax.sgd(0.1), 2, track_noise_scale=True, noise_scale_decay=0.9
  )
  assert tx is not None


@pytest.mark.parametrize(
  "kwargs",
  [{"reduce_dtype": jnp.bfloat16}, {"reduce_dtype": "float16"}],
  ids=["bf16", "float16"],
)
def test_reduce_dtype_without_axis_name_is_refused_naming_it(kwargs):
  """reduce_dtype sets the dtype of the once-a-cycle reduction over
  `axis_name`; without an axis it would be accepted and do nothing, so it
  raises, naming it and its value (issue 55)."""
  with pytest.raises(ValueError, match=r"reduce_dtype=.*without an axis_name"):
    optax_accum.accumulate(optax.sgd(0.1), 2, **kwargs)
  tx = optax_accum.accumulate(optax.sgd(0.1), 2, axis_name="d", **kwargs)
  assert tx is not None


def test_complex_accumulator_for_real_params_is_rejected():
  tx = optax_accum.accumulate(
    optax.sgd(0.1), 2, accumulator_dtype=jnp.complex64
  )
  with pytest.raises(ValueError, match="`accumulator_dtype` is complex"):
    tx.init(_common.params())


def test_state_of_another_configuration_is_rejected(maybe_jit):
  plain = optax_accum.accumulate(optax.sgd(0.1), 2)
  tracked = optax_accum.accumulate(optax.sgd(0.1), 2, track_noise_scale=True)
  params = _common.params()
  with pytest.raises(ValueError, match="track_noise_scale=True"):
    maybe_jit(tracked.update)(_common.grads(0), plain.init(params), params)


# ---------------------------------------------------------------------------
# Readers and state_shardings.
# ---------------------------------------------------------------------------


def test_readers_reject_a_state_without_accumulate():
  state = optax.adam(1e-3).init(jnp.zeros(2))
  for reader in (
    optax_accum.has_updated,
    optax_accum.inner_state,
    optax_accum.noise_scale,
  ):
    with pytest.raises(TypeError, match="holds the AccumulateState"):
      reader(state)


def test_readers_reject_a_state_with_two_accumulates():
  acc = optax_accum.accumulate(optax.sgd(0.1), 2)
  state = optax.chain(acc, acc).init(jnp.zeros(2))
  with pytest.raises(ValueError, match="exactly one AccumulateState, got .* 2"):
    optax_accum.has_updated(state)
  # The part that holds the one meant is accepted.
  assert not bool(optax_accum.has_updated(state[0]))


@pytest.mark.parametrize("tx", [optax.sgd, optax_accum.accumulate, 3])
def test_state_shardings_rejects_what_is_not_a_transformation(tx):
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  params = {"w": jax.device_put(jnp.zeros(2), NamedSharding(mesh, P()))}
  with pytest.raises(TypeError, match="`tx` must be an optax"):
    optax_accum.distributed.state_shardings(tx, params)


def _make_tx():
  return optax_accum.accumulate(optax.sgd(0.1), 2)


@pytest.mark.parametrize(
  "tx, match",
  [
    (
      _make_tx,
      r"signature \(\); a factory\? Call it first, e.g. `tx=_make_tx\(\)`",
    ),
    (lambda params, lr: _make_tx(), r"signature \(params, lr\)\."),
  ],
  ids=["factory", "two_arguments"],
)
def test_state_shardings_rejects_a_callable_of_another_arity(tx, match):
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  params = {"w": jax.device_put(jnp.zeros(2), NamedSharding(mesh, P()))}
  with pytest.raises(TypeError, match="`tx` must be an optax.*" + match):
    optax_accum.distributed.state_shardings(tx, params)
  # Its init function is accepted.
  shardings = optax_accum.distributed.state_shardings(_make_tx().init, params)
  assert shardings.acc_grads["w"] == params["w"].sharding


def test_tree_mismatch_names_the_key_path(maybe_jit):
  tx = optax_accum.accumulate(optax.adam(1e-3), 2)
  params = _common.params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  bad_shape = {"w": jnp.ones((3, 2)), "b": jnp.ones(3)}
  with pytest.raises(ValueError, match=r"\['w'\].*\(3, 2\).*\(2, 3\)"):
    update(bad_shape, state, params)
  bad_tree = {"w": jnp.ones((2, 3)), "c": jnp.ones(3)}
  with pytest.raises(ValueError, match=r"missing leaves: \[\"\['b'\]\"\]"):
    update(bad_tree, state, params)


def test_non_scalar_weight_is_rejected(maybe_jit):
  tx = optax_accum.accumulate(optax.adam(1e-3), 2)
  params = _common.params()
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"`weight` must be a scalar.*\(2,\)"):
    maybe_jit(tx.update)(_common.grads(0), state, params, weight=jnp.ones(2))


def test_noise_scale_decay_accepts_numpy_reals():
  tx = optax_accum.accumulate(
    optax.sgd(0.1), 2, track_noise_scale=True, noise_scale_decay=np.float32(0.9)
  )
  assert isinstance(tx, optax.GradientTransformationExtraArgs)


# ---------------------------------------------------------------------------
# Names from optax.MultiSteps (the migration table: docs/guides/multisteps.md).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, equivalent",
  [
    ({"every_k_schedule": 4}, "pass `every_k`"),
    ({"use_grad_mean": False}, 'use_grad_mean=False is reduction="sum"'),
    ({"should_skip_update_fn": optax.skip_not_finite}, "`skip_nonfinite=True`"),
  ],
  ids=lambda x: next(iter(x)) if isinstance(x, dict) else None,
)
def test_multisteps_arguments_name_the_equivalent(kwargs, equivalent):
  ((name, value),) = kwargs.items()
  with pytest.raises(
    TypeError,
    match=rf"`{name}` is an argument of optax.MultiSteps.*"
    rf"got {name}={re.escape(repr(value))}\): .*{re.escape(equivalent)}",
  ):
    optax_accum.accumulate(optax.sgd(0.1), 2, **kwargs)


def test_multisteps_opt_keyword_names_inner():
  with pytest.raises(TypeError, match="`opt` is .*as `inner`"):
    optax_accum.accumulate(opt=optax.sgd(0.1), every_k=2)


def test_other_unknown_keywords_keep_pythons_message():
  with pytest.raises(TypeError, match="unexpected keyword argument 'k'"):
    optax_accum.accumulate(optax.sgd(0.1), 2, k=2)


@pytest.mark.parametrize(
  "name, equivalent",
  [
    ("mini_step", "read `micro_step`"),
    ("gradient_step", "read `step`"),
    ("inner_opt_state", "read `inner_state`"),
    ("skip_state", "no equivalent; `num_skipped`"),
  ],
)
def test_multisteps_state_fields_name_the_equivalent(
  maybe_jit, name, equivalent
):
  """Also under jit, where the state is a tree of tracers."""
  tx = optax_accum.accumulate(optax.sgd(0.1), 2)
  state = tx.init(jnp.zeros(2))
  with pytest.raises(
    AttributeError,
    match=rf"AccumulateState has no `{name}` .*MultiStepsState\): .*"
    + re.escape(equivalent),
  ):
    maybe_jit(lambda s: getattr(s, name))(state)
  # The state inside a chain says the same.
  chained = optax.chain(optax.clip(1.0), tx).init(jnp.zeros(2))
  with pytest.raises(AttributeError, match=f"has no `{name}`"):
    getattr(chained[1], name)


def test_other_missing_state_attributes_keep_the_usual_message():
  state = optax_accum.accumulate(optax.sgd(0.1), 2).init(jnp.zeros(2))
  with pytest.raises(
    AttributeError, match="^'AccumulateState' object has no attribute 'foo'$"
  ):
    state.foo  # noqa: B018
  assert not hasattr(state, "mini_step")
  assert hasattr(state, "micro_step") and hasattr(state, "_replace")


# ----------------------------------------------------------------------------
# The last bad inputs (issue 28).
# ----------------------------------------------------------------------------


def _squares_value_and_grad():
  return jax.value_and_grad(lambda p, b: jnp.mean((b["x"] * p) ** 2))


def test_microbatch_weight_fn_of_the_wrong_arity_names_it():
  with pytest.raises(TypeError, match=r"`weight_fn` must take one argument"):
    optax_accum.microbatch(
      _squares_value_and_grad(), 2, weight_fn=lambda micro, extra: 1.0
    )
  # One required argument and optional ones: accepted.
  optax_accum.microbatch(
    _squares_value_and_grad(), 2, weight_fn=lambda micro, scale=1.0: scale
  )


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_a_state_for_other_params_names_the_state(use_jit):
  tx = optax_accum.accumulate(optax.sgd(1.0), 2)
  state = tx.init({"a": jnp.ones(3)})
  params = {"w": jnp.ones(2)}
  update = jax.jit(tx.update) if use_jit else tx.update
  with pytest.raises(ValueError, match=r"`state` was made by init for params"):
    update(params, state, params)
