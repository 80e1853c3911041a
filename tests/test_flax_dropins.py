"""``optax_accum.flax``: drop-ins for ``nnx.Optimizer`` and linen's
``TrainState`` give the stock classes' results bit for bit (with and without
``accumulate``, under ``nnx.jit`` and ``jax.jit``, with and without
``emit=``), and their micro-step leaves the params alone."""

import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from _common import scaled_sgd
from flax import nnx
from flax.training import train_state

import optax_accum
from tools import program

K, CALLS = 3, 7


def _batch(i):
  x = jnp.sin(jnp.arange(12.0).reshape(4, 3) * (i + 1))
  return x, jnp.cos(x[:, :2])


class _Model(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(3, 8, rngs=rngs)
    self.b = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _nnx_run(cls, tx, jit, emit):
  model = _Model(nnx.Rngs(0))
  optimizer = cls(model, tx, wrt=nnx.Param)

  def step(model, optimizer, x, y, emit):
    grads = nnx.grad(_loss)(model, x, y)
    if emit is None:  # the stock signature
      optimizer.update(model, grads)
    else:
      optimizer.update(model, grads, emit=emit)

  if jit == "nnx":
    step = nnx.jit(step, static_argnames="emit", donate_argnums=(0, 1))
  for i in range(CALLS):
    step(model, optimizer, *_batch(i), (i % K == K - 1) if emit else None)
  return nnx.state(model, nnx.Param), optimizer


@pytest.mark.parametrize("emit", [False, True], ids=["traced", "emit"])
@pytest.mark.parametrize("jit", ["eager", "nnx"])
def test_nnx_optimizer_is_the_stock_one(jit, emit):
  tx = optax_accum.accumulate(optax.adam(0.05), K)
  ours, optimizer = _nnx_run(optax_accum.flax.Optimizer, tx, jit, emit)
  stock, _ = _nnx_run(nnx.Optimizer, tx, jit, False)
  ours, stock = jax.tree.map(jnp.asarray, (ours, stock))
  if emit:  # another program (no conditional): float rounding apart
    chex.assert_trees_all_close(ours, stock, rtol=1e-6, atol=1e-7)
  else:
    chex.assert_trees_all_equal(ours, stock)
  assert int(optimizer.step[...]) == CALLS
  assert int(optimizer.optimizer_step) == CALLS // K


def test_nnx_optimizer_without_accumulate_is_the_stock_one():
  tx = optax.adam(0.05)
  ours, _ = _nnx_run(optax_accum.flax.Optimizer, tx, "nnx", False)
  stock, _ = _nnx_run(nnx.Optimizer, tx, "nnx", False)
  chex.assert_trees_all_equal(
    jax.tree.map(jnp.asarray, ours), jax.tree.map(jnp.asarray, stock)
  )


def test_nnx_optimizer_micro_step_leaves_the_params_alone():
  model = _Model(nnx.Rngs(0))
  tx = optax_accum.accumulate(optax.adam(0.05), K)
  optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  grads = nnx.grad(_loss)(model, *_batch(0))
  updates = optimizer.update(model, grads)
  chex.assert_trees_all_equal(nnx.state(model, nnx.Param), before)
  assert not any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))


class _Linen(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(jnp.tanh(nn.Dense(8)(x)))


def _linen_run(cls, tx, weighted):
  model = _Linen()
  params = model.init(jax.random.PRNGKey(0), _batch(0)[0])
  state = cls.create(apply_fn=model.apply, params=params, tx=tx)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, x, y, weight):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2))(
      state.params
    )
    if not weighted:  # the stock call
      return state.apply_gradients(grads=grads)
    return state.apply_gradients(grads=grads, weight=weight)

  for i in range(CALLS):
    state = step(state, *_batch(i), 1.0 + weighted * i)
  return state


@pytest.mark.parametrize(
  "accumulated", [True, False], ids=["accumulate", "plain"]
)
def test_linen_train_state_is_the_stock_one(accumulated):
  tx = optax.adam(0.05)
  if accumulated:
    tx = optax_accum.accumulate(tx, K)
  ours = _linen_run(optax_accum.flax.TrainState, tx, weighted=False)
  stock = _linen_run(train_state.TrainState, tx, weighted=False)
  chex.assert_trees_all_equal(ours.params, stock.params)
  assert int(ours.step) == CALLS


def test_linen_train_state_passes_the_weight():
  tx = optax_accum.accumulate(optax.sgd(1.0), K)
  weighted = _linen_run(optax_accum.flax.TrainState, tx, weighted=True)
  plain = _linen_run(optax_accum.flax.TrainState, tx, weighted=False)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(weighted.params, plain.params)


def test_import_optax_accum_does_not_import_flax():
  import subprocess
  import sys

  out = subprocess.run(
    [
      sys.executable,
      "-c",
      "import sys, optax_accum; print('flax' in sys.modules)",
    ],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  assert out.strip() == "False"


class _Wide(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(256, 256, rngs=rngs)
    self.b = nnx.Linear(256, 256, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def _micro_step_program(cls):
  """The compiled step of the recipe (split state, donated) on CPU."""
  model = _Wide(nnx.Rngs(0))
  tx = optax_accum.accumulate(optax.adam(1e-3), 4)
  graphdef, state = nnx.split((model, cls(model, tx, wrt=nnx.Param)))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, x):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  x = jax.ShapeDtypeStruct((8, 256), jnp.float32)
  return program.Program(step.lower(state, x).compile())


def test_nnx_micro_step_neither_reads_nor_writes_the_params():
  """Against the stock class on the same step: the stock one applies zeros
  to every param on a micro-step, ours does not touch them."""
  ours = _micro_step_program(optax_accum.flax.Optimizer)
  stock = _micro_step_program(nnx.Optimizer)
  param_bytes = 2 * (256 * 256 + 256) * 4
  # The stock micro-step reads the params and the zero updates and writes
  # the params: at least 2x the param bytes more.
  assert ours.kernel_bytes() + 2 * param_bytes <= stock.kernel_bytes()
  assert not ours.copies(min_bytes=256 * 256 * 4)


# ----------------------------------------------------------------------------
# Every keyword reaches what it names (issue 55): update's options, against
# the counter alone, and linen's field replacements.
# ----------------------------------------------------------------------------

_G = (jnp.array([1.0, 2.0]), jnp.array([4.0, -2.0]), jnp.array([-1.0, 8.0]))

# Three calls of sgd(1.0), k=3, from w = 0: each keyword per call, and w
# after them. The counter alone ends one cycle: w = -mean(_G), unlike each.
_KEYWORDS = {
  "weight": (
    [{"weight": 1.0}, {"weight": 3.0}, {"weight": 0.5}],
    -(_G[0] + 3 * _G[1] + 0.5 * _G[2]) / 4.5,
  ),
  "flush": ([{}, {"flush": True}, {}], -(_G[0] + _G[1]) / 2),
  "emit_early": (
    [{"emit": False}, {"emit": True}, {"emit": False}],
    -(_G[0] + _G[1]) / 2,
  ),
  "emit_false_at_k": ([{"emit": False}] * 3, jnp.zeros(2)),
}
_COUNTER = -(_G[0] + _G[1] + _G[2]) / 3


class _Weights(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.zeros(2))


def _nnx_keywords(calls, jit):
  model = _Weights()
  optimizer = optax_accum.flax.Optimizer(
    model, optax_accum.accumulate(optax.sgd(1.0), K), wrt=nnx.Param
  )

  def step(model, optimizer, x, kwargs):
    grads = nnx.grad(lambda m: jnp.sum(m.w[...] * x))(model)
    optimizer.update(model, grads, **kwargs)

  for x, kwargs in zip(_G, calls, strict=True):
    if jit:
      emit = kwargs.get("emit")
      rest = {k: v for k, v in kwargs.items() if k != "emit"}
      jitted = nnx.jit(
        lambda m, o, x, rest, emit: step(
          m, o, x, {**rest, **({} if emit is None else {"emit": emit})}
        ),
        static_argnames="emit",
      )
      jitted(model, optimizer, x, rest, emit=emit)
    else:
      step(model, optimizer, x, kwargs)
  return model.w[...]


def _linen_keywords(calls, jit):
  state = optax_accum.flax.TrainState.create(
    apply_fn=None,
    params={"w": jnp.zeros(2)},
    tx=optax_accum.accumulate(optax.sgd(1.0), K),
  )

  def step(state, x, rest, emit=None):
    options = rest if emit is None else {**rest, "emit": emit}
    return state.apply_gradients(grads={"w": x}, **options)

  if jit:
    step = jax.jit(step, static_argnames="emit")
  for x, kwargs in zip(_G, calls, strict=True):
    rest = {k: v for k, v in kwargs.items() if k != "emit"}
    state = step(state, x, rest, emit=kwargs.get("emit"))
  return state.params["w"]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("keyword", _KEYWORDS)
@pytest.mark.parametrize("dropin", ["nnx", "linen"])
def test_each_update_keyword_of_the_dropins_reaches_update(
  dropin, keyword, jit
):
  calls, want = _KEYWORDS[keyword]
  run = _nnx_keywords if dropin == "nnx" else _linen_keywords
  got = run(calls, jit)
  chex.assert_trees_all_close(got, want, rtol=1e-6)
  assert bool(jnp.any(jnp.abs(got - _COUNTER) > 1e-3))  # not the counter's
  chex.assert_trees_all_close(run([{}] * 3, jit), _COUNTER, rtol=1e-6)


class _BatchNormState(optax_accum.flax.TrainState):
  """As in flax's BatchNorm guide: a field beside the stock ones."""

  batch_stats: Any = None


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_linen_apply_gradients_replaces_the_fields_it_is_given(jit):
  """``apply_gradients(grads=g, batch_stats=bs)`` sets batch_stats on every
  call, micro-step or not, as the stock TrainState does."""
  state = _BatchNormState.create(
    apply_fn=None,
    params={"w": jnp.zeros(2)},
    tx=optax_accum.accumulate(optax.sgd(1.0), K),
    batch_stats={"mean": jnp.zeros(2)},
  )

  def step(state, x, i):
    return state.apply_gradients(
      grads={"w": x}, batch_stats={"mean": jnp.full(2, i)}
    )

  if jit:
    step = jax.jit(step, donate_argnums=0)
  for i, x in enumerate(_G):
    state = step(state, x, jnp.float32(i + 1))
    chex.assert_trees_all_equal(state.batch_stats["mean"], jnp.full(2, i + 1.0))
    assert int(state.step) == i + 1
  chex.assert_trees_all_close(state.params["w"], _COUNTER, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
def test_nnx_optimizer_passes_the_inner_optimizers_extra_arguments(jit):
  model = _Weights()
  optimizer = optax_accum.flax.Optimizer(
    model, optax_accum.accumulate(scaled_sgd(), 2), wrt=nnx.Param
  )

  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.sum(m.w[...] * x))(model)
    optimizer.update(model, grads, value=10.0, weight=1.0)

  if jit:
    step = nnx.jit(step)
  for x in _G[:2]:
    step(model, optimizer, x)
  chex.assert_trees_all_close(model.w[...], -10.0 * (_G[0] + _G[1]) / 2)


def test_linen_train_state_takes_a_transformation_without_extra_arguments():
  """optax.scale is a plain GradientTransformation (its update takes no
  keyword): the stock class runs it, so does ours."""
  tx = optax.scale(-1.0)
  states = [
    cls.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=tx)
    for cls in (optax_accum.flax.TrainState, train_state.TrainState)
  ]
  for x in _G:
    states = [s.apply_gradients(grads={"w": x}) for s in states]
  chex.assert_trees_all_equal(states[0].params, states[1].params)
  chex.assert_trees_all_close(states[0].params["w"], -(_G[0] + _G[1] + _G[2]))


@pytest.mark.parametrize(
  "keyword", [{"weight": 0.0}, {"flush": True}, {"emit": False}], ids=str
)
@pytest.mark.parametrize("dropin", ["nnx", "linen"])
def test_accumulates_keywords_without_accumulate_are_refused(dropin, keyword):
  """optax.sgd swallows extra keywords: weight=0 or emit=False would update
  anyway. Without an accumulate in tx the drop-ins refuse them, naming the
  keyword."""
  (name,) = keyword
  with pytest.raises(TypeError, match=rf"`{name}=` of `.*` are optax_accum"):
    if dropin == "nnx":
      model = _Weights()
      optimizer = optax_accum.flax.Optimizer(
        model, optax.sgd(1.0), wrt=nnx.Param
      )
      grads = nnx.grad(lambda m: jnp.sum(m.w[...]))(model)
      optimizer.update(model, grads, **keyword)
    else:
      state = optax_accum.flax.TrainState.create(
        apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(1.0)
      )
      state.apply_gradients(grads={"w": jnp.ones(2)}, **keyword)
