"""``optax_accum.flax`` on a data-parallel mesh (issue 27, item 3).

The NNX drop-in, with its gradient from ``optax_accum.flax.local_value_and_grad``
and ``accumulate(..., axis_name="data")``, params replicated and the batch
split over ``data`` (2 and 8 simulated CPU devices, donated ``nnx.jit``):

* gives the params of one big batch on one device;
* compiles to a micro-step that reduces nothing parameter-sized (the one
  reduction sits in the emitting branch), copies nothing parameter-sized,
  and needs no more temporary memory than one reduced gradient, nor more
  than ``optax.MultiSteps`` through ``nnx.Optimizer`` on the same mesh;
* compiled for 8 H100s without the devices (``_flax_mesh_accel_worker.py``),
  costs at most 1.05x the floor's micro-step kernel bytes, with no
  parameter-sized copy.

Structure only (``memory_analysis()``, the compiled HLO), never a time.
"""

import functools
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import REPO, accel_env, last_json_line
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.inspect import _program

DEVICES = (2, 8)
WIDTH, K, CYCLES = 128, 3, 2
KERNEL_BYTES = WIDTH * WIDTH * 4  # the largest param leaf, float32


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(8, WIDTH, rngs=rngs)
    self.b = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.c = nnx.Linear(WIDTH, 2, rngs=rngs)

  def __call__(self, x):
    return self.c(jnp.tanh(self.b(jnp.tanh(self.a(x)))))


def _token_loss(model, x, y, mask):
  """Mean over the real rows, and their number."""
  err = jnp.sum((model(x) - y) ** 2, axis=-1)
  return jnp.sum(err * mask) / jnp.sum(mask), jnp.sum(mask)


def _param_bytes(model):
  return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _mesh(n):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _micro_batches(n):
  """K * CYCLES micro-batches of 2 rows per device, each device with its
  own count of real rows (1 or 2)."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(K * CYCLES):
    x = rng.normal(size=(2 * n, 8)).astype(np.float32)
    y = np.sin(x[:, :2]).astype(np.float32)
    mask = np.ones(2 * n, np.float32)
    mask[1::2] = rng.integers(0, 2, size=n)  # at least 1 real row each
    out.append((x, y, mask))
  return out


def _build(kind, n):
  """The model, optimizer and donated step of `kind`, built on the mesh."""
  with jax.set_mesh(_mesh(n)):
    model = _MLP(nnx.Rngs(0))
    if kind == "multisteps":
      tx = optax.MultiSteps(optax.adam(0.05), every_k_schedule=K)
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    else:
      axis_name = "data" if kind == "deferred" else None
      tx = optax_accum.accumulate(optax.adam(0.05), K, axis_name=axis_name)
      optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  if kind == "deferred":
    grad_fn = optax_accum.flax.local_value_and_grad(
      _token_loss, axis_name="data", has_weight=True
    )
  else:
    grad_fn = nnx.value_and_grad(_token_loss, has_aux=True)

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def step(model, optimizer, x, y, mask):
    (loss, tokens), grads = grad_fn(model, x, y, mask)
    if kind == "multisteps":
      optimizer.update(model, grads)
    else:
      optimizer.update(model, grads, weight=tokens)
    return loss

  return model, optimizer, step


def _sharded(n, batch):
  return jax.device_put(batch, NamedSharding(_mesh(n), P("data")))


def _big_batch_params(batches):
  """One device, one batch of every micro-batch of a cycle, per cycle."""
  model = _MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
  for c in range(CYCLES):
    cycle = batches[c * K : (c + 1) * K]
    big = [np.concatenate(a) for a in zip(*cycle, strict=True)]
    grads = nnx.grad(lambda m, big: _token_loss(m, *big)[0])(model, big)
    optimizer.update(model, grads)
  return nnx.state(model, nnx.Param)


@pytest.mark.parametrize("n", DEVICES)
def test_drop_in_on_a_data_parallel_mesh_is_the_big_batch(n):
  batches = _micro_batches(n)
  model, optimizer, step = _build("deferred", n)
  with jax.set_mesh(_mesh(n)):
    for batch in batches:
      step(model, optimizer, *_sharded(n, batch))
    ours = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  assert int(optimizer.step[...]) == K * CYCLES
  assert int(optimizer.optimizer_step) == CYCLES
  reference = jax.tree.map(np.asarray, _big_batch_params(batches))
  # Float32 sums in another order (per device, then over devices), which
  # Adam's division by sqrt(nu) magnifies where a gradient element is near
  # zero: the examples' bound (scaling_jit_unreduced.py), 1e-5.
  chex.assert_trees_all_close(ours, reference, rtol=1e-5, atol=1e-5)


@functools.cache
def _compiled(kind, n):
  """The compiled micro-step; once per module (two tests read the same)."""
  model, optimizer, step = _build(kind, n)
  with jax.set_mesh(_mesh(n)):
    lowered = step.lower(model, optimizer, *_sharded(n, _micro_batches(n)[0]))
  return lowered.compile().compiled, _param_bytes(model)


@pytest.mark.parametrize("n", DEVICES)
def test_micro_step_reduces_nothing_parameter_sized(n):
  compiled, param_bytes = _compiled("deferred", n)
  # Raises if a reduction of >= 1 KiB runs outside the emitting branch.
  optax_accum.inspect.assert_reduction_deferred(compiled)
  emitting = [
    c
    for c in optax_accum.inspect.collectives(compiled)
    if c.opcode == "all-reduce" and c.emitting
  ]
  # The one sum of the gradient, once per cycle.
  assert sum(c.bytes for c in emitting) >= param_bytes


@pytest.mark.parametrize("n", DEVICES)
def test_micro_step_copies_nothing_and_needs_one_gradient_of_memory(n):
  compiled, param_bytes = _compiled("deferred", n)
  copies = _program.Program(compiled).copies(min_bytes=KERNEL_BYTES // 2)
  assert not copies, [c.name for c in copies]
  temp = compiled.memory_analysis().temp_size_in_bytes
  # The reduced gradient of the emitting step; a parameter-sized buffer
  # more would add >= 40% (the largest leaf is 2/3 of the params).
  assert temp <= 1.05 * param_bytes, temp / param_bytes
  multisteps, _ = _compiled("multisteps", n)
  assert temp <= multisteps.memory_analysis().temp_size_in_bytes


def test_without_deferral_the_micro_step_reduces():
  """The control: `nnx.value_and_grad` on the same mesh all-reduces the
  gradient on every micro-step, and the check says so."""
  compiled, _ = _compiled("reduced", 2)
  with pytest.raises(AssertionError):
    optax_accum.inspect.assert_reduction_deferred(compiled)


class _Normed(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(8, 2, rngs=rngs)
    self.bn = nnx.BatchNorm(2, rngs=rngs)

  def __call__(self, x):
    return self.bn(self.a(x))


def test_a_loss_that_updates_model_state_is_refused():
  mesh = _mesh(2)
  with jax.set_mesh(mesh):
    model = _Normed(nnx.Rngs(0))
  grad_fn = optax_accum.flax.local_value_and_grad(
    lambda m, x: jnp.mean(m(x) ** 2)
  )
  x = _sharded(2, np.ones((4, 8), np.float32))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="batch_stats|bn"):
    nnx.jit(grad_fn)(model, x)
  model.eval()  # Running averages only read: allowed.
  with jax.set_mesh(mesh):
    loss, grads = nnx.jit(grad_fn)(model, x)
  assert "bn" in grads and np.isfinite(float(loss))


@pytest.fixture(scope="module")
def h100x8():
  """The guide's step and its reduced control, compiled for 8 H100s in a
  subprocess with the compilers: a process of its own, not the shared
  compile server (after other workers ran there, flax 0.12.12's
  `nnx.state` failed sorting a pytree's keys, "'<' not supported between
  instances of 'str' and 'int'": a fresh-clone run, jax 0.12.0.1)."""
  worker = REPO / "tests" / "_flax_mesh_accel_worker.py"
  out = subprocess.run(
    [sys.executable, str(worker)],
    env=accel_env(),
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  return last_json_line(out.stdout)


def test_h100x8_micro_step_is_the_floor(h100x8):
  facts = h100x8["deferred"]
  ratio = facts["micro_step_bytes"] / facts["floor_bytes"]
  assert ratio <= 1.05, ratio
  assert not facts["copies"], facts["copies"]
  assert facts["reduced_every_call"] < 1024  # the loss and its weight


def test_h100x8_without_deferral_reduces_every_call(h100x8):
  """The control: the one-name swap all-reduces the gradient on every
  micro-step, beyond the floor."""
  facts = h100x8["reduced"]
  assert facts["reduced_every_call"] >= facts["param_bytes"]
  assert facts["micro_step_bytes"] > 1.05 * facts["floor_bytes"]


def test_local_value_and_grad_keywords_reach_what_they_name():
  """`axis_name`, `wrt`, `has_aux` and `in_specs`, each off its default
  (issue 55): an axis named "batch", the gradient of the last layer only,
  an aux per device and a replicated first argument; the cycle of one
  update is the full batch's gradient of that layer."""
  n = 2
  mesh = jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n])
  last = nnx.All(nnx.Param, nnx.PathContains("c"))

  def loss(model, scale, x):
    out = scale * jnp.mean(model(x) ** 2)
    return out, {"rows": jnp.full([1], x.shape[0])}

  x = np.random.default_rng(0).normal(size=(4 * n, 8)).astype(np.float32)
  scale = jnp.float32(3.0)
  with jax.set_mesh(mesh):
    model = _MLP(nnx.Rngs(0))
    tx = optax_accum.accumulate(optax.sgd(1.0), 1, axis_name="batch")
    optimizer = optax_accum.flax.Optimizer(model, tx, wrt=last)
  grad_fn = optax_accum.flax.local_value_and_grad(
    loss, axis_name="batch", wrt=last, has_aux=True, in_specs=(P(), P("batch"))
  )

  @nnx.jit
  def step(model, optimizer, scale, x):
    (value, aux), grads = grad_fn(model, scale, x)
    optimizer.update(model, grads)
    return value, aux

  want_model = _MLP(nnx.Rngs(0))
  want_value = loss(want_model, scale, x)[0]
  want = nnx.grad(
    lambda m: loss(m, scale, x)[0], argnums=nnx.DiffState(0, last)
  )(want_model)
  before = nnx.state(model, nnx.Param)
  before = jax.tree.map(np.asarray, before)
  with jax.set_mesh(mesh):
    value, aux = step(
      model,
      optimizer,
      scale,
      jax.device_put(x, NamedSharding(mesh, P("batch"))),
    )
  np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(aux["rows"]), np.full((n, 1), 4))
  after = nnx.state(model, nnx.Param)
  for path, got in jax.tree_util.tree_flatten_with_path(after)[0]:
    old = dict(jax.tree_util.tree_flatten_with_path(before)[0])[path]
    if "c" in jax.tree_util.keystr(path):
      grad = dict(jax.tree_util.tree_flatten_with_path(want)[0])[path]
      np.testing.assert_allclose(np.asarray(got), old - grad, atol=1e-6)
    else:  # outside `wrt`: untouched
      np.testing.assert_array_equal(np.asarray(got), old)
