"""Deferred reduction over `axis_name` under `shard_map` and `vmap`.

On the 8 simulated CPU devices (see conftest.py) each device passes its
local gradient; the emitted update equals the big-batch mean, replicas stay
identical through skips and flushes, the state layout comes from
`optax_accum.distributed.shard_map_specs`, and the compiled step reduces the gradient
only in the emitting branch, with shard_map's default `check_vma=True` and
with `check_vma=False`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum._control import to_varying
from optax_accum.inspect._hlo import HloModule, array_shapes

N_DEV = 8
# ---------------------------------------------------------------------------
# 2. Deferred reduction over `axis_name`.
# ---------------------------------------------------------------------------

SEQ, DIM, OUT = 4, 6, 5


def _replicated_leaves(state):
  """The leaves every device holds the same (not the cycle's local sums)."""
  specs = optax_accum.distributed.shard_map_specs(state, "data")
  return [
    sub
    for spec, sub in zip(
      jax.tree.leaves(specs),
      jax.tree.structure(specs).flatten_up_to(state),
      strict=True,
    )
    if spec == P()
  ]


def _data_mesh():
  return jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))


def _sum_loss(params, x, y, mask):
  err = jnp.einsum("btd,do->bto", x, params["w"]) + params["b"][None, None]
  return jnp.sum(jnp.sum((err - y) ** 2, axis=-1) * mask)


def _mean_loss(params, x, y, mask):
  """Token mean of a (micro-)batch, and its token count."""
  tokens = jnp.sum(mask)
  return _sum_loss(params, x, y, mask) / jnp.maximum(tokens, 1.0), tokens


def _params0():
  rng = np.random.default_rng(1)
  return {
    "w": jnp.asarray(rng.normal(size=(DIM, OUT)), jnp.float32),
    "b": jnp.zeros(OUT, jnp.float32),
  }


def _batches(n_micro, per_device=2, seed=0):
  """[micro, device, example, ...] data with 1 to SEQ tokens per example."""
  rng = np.random.default_rng(seed)
  shape = (n_micro, N_DEV, per_device, SEQ)
  x = rng.normal(size=(*shape, DIM)).astype(np.float32)
  y = rng.normal(size=(*shape, OUT)).astype(np.float32)
  lengths = rng.integers(1, SEQ + 1, size=shape[:-1])
  mask = (np.arange(SEQ) < lengths[..., None]).astype(np.float32)
  return x, y, mask


def _big_batch_step(params, inner_state, inner, x, y, mask):
  """The reference: one device, the token mean over every micro-batch."""
  flat = [a.reshape(-1, *a.shape[3:]) for a in (x, y, mask)]
  grad, _ = jax.grad(_mean_loss, has_aux=True)(params, *flat)
  updates, inner_state = inner.update(grad, inner_state, params)
  return optax.apply_updates(params, updates), inner_state


def _local_step(tx, weighted):
  """One micro-step of one device: params and state are this device's."""

  def step(params, state, x, y, mask, flush):
    grad, tokens = jax.grad(_mean_loss, has_aux=True)(params, x, y, mask)
    updates, state = tx.update(
      grad, state, params, weight=tokens if weighted else None, flush=flush
    )
    return optax.apply_updates(params, updates), state

  return step


def _per_device_runner(tx, runner, weighted=True, step=None):
  """Every device keeps its own copy of params and state (a leading device
  axis on every leaf), so the test can see that the replicas agree.

  `runner` is "shard_map" (jitted: eager shard_map dispatches every op of
  the step on 8 devices, tens of seconds per test; the default
  `check_vma=True`), "shard_map_no_vma" (the same with `check_vma=False`),
  "vmap" (jitted) or "vmap_nojit". `step` replaces the default micro-step.
  """
  step = step or _local_step(tx, weighted)
  if runner == "vmap":
    return jax.jit(jax.vmap(step, axis_name="data"))
  if runner == "vmap_nojit":
    return jax.vmap(step, axis_name="data")

  def per_device(params, state, x, y, mask, flush):
    squeeze = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
    out = step(*map(squeeze, (params, state, x, y, mask, flush)))
    return jax.tree.map(lambda a: a[None], out)

  mesh = _data_mesh()
  sharded = jax.jit(
    jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=P("data"),
      out_specs=P("data"),
      check_vma=runner != "shard_map_no_vma",
    )
  )

  def run(*args):
    # Host arrays in, each device's slice on that device.
    return sharded(*jax.device_put(args, NamedSharding(mesh, P("data"))))

  return run


def _replicate(tree):
  return jax.tree.map(lambda a: jnp.stack([a] * N_DEV), tree)


def _assert_replicas_identical(tree):
  for leaf in jax.tree.leaves(tree):
    leaf = np.asarray(leaf)
    for d in range(1, N_DEV):
      np.testing.assert_array_equal(leaf[d], leaf[0])


RUNNERS = ["shard_map", "vmap"]


@pytest.mark.parametrize(
  "runner, weighting",
  [
    ("shard_map", "tokens"),
    ("shard_map", "uniform"),
    ("shard_map_no_vma", "tokens"),
    ("vmap", "tokens"),
    ("vmap_nojit", "tokens"),
  ],
)
def test_axis_name_equals_global_big_batch_mean(runner, weighting):
  """8 devices x 2 micro-batches of different token counts, 2 optimizer
  steps: each device only ever sees its own gradients, yet every replica
  lands on the big-batch params (float32 sums reordered: rtol 1e-5)."""
  # Eager vmap dispatches every op: one optimizer step is enough there.
  k, steps = 2, (1 if runner == "vmap_nojit" else 2)
  inner = optax.sgd(0.1, momentum=0.9)  # linear: shows any weighting error
  tx = optax_accum.accumulate(inner, k, axis_name="data")
  weighted = weighting == "tokens"
  step = _per_device_runner(tx, runner, weighted)
  x, y, mask = _batches(k * steps)
  if not weighted:  # every micro-batch the same number of tokens
    mask = np.ones_like(mask)
  params = _replicate(_params0())
  state = _replicate(tx.init(_params0()))
  no_flush = jnp.zeros(N_DEV, bool)
  ref, ref_state = _params0(), inner.init(_params0())
  for s in range(steps):
    for i in range(k):
      j = s * k + i
      params, state = step(params, state, x[j], y[j], mask[j], no_flush)
      assert bool(np.all(state.emitted == (i == k - 1)))
    ref, ref_state = _big_batch_step(
      ref, ref_state, inner, *(a[s * k : (s + 1) * k] for a in (x, y, mask))
    )
  _assert_replicas_identical(params)
  _assert_replicas_identical(_replicated_leaves(state))
  np.testing.assert_array_equal(state.step, steps)
  for name in ("w", "b"):
    np.testing.assert_allclose(params[name][0], ref[name], rtol=1e-5, atol=1e-6)


def _static_step(tx, emit):
  """A micro-step of the static cycle (issue 20): the host says whether the
  call ends the cycle; optax_accum.apply_updates applies the result."""

  def step(params, state, x, y, mask, flush):
    del flush  # the runner's signature; emit= ends the cycle instead
    grad, tokens = jax.grad(_mean_loss, has_aux=True)(params, x, y, mask)
    updates, state = tx.update(grad, state, params, weight=tokens, emit=emit)
    return optax_accum.apply_updates(params, updates, state), state

  return step


@pytest.mark.parametrize("runner", RUNNERS)
def test_static_cycle_equals_global_big_batch_mean(runner):
  k, steps = 3, 2
  inner = optax.sgd(0.1, momentum=0.9)
  tx = optax_accum.accumulate(inner, k, axis_name="data")
  run = {
    emit: _per_device_runner(tx, runner, step=_static_step(tx, emit))
    for emit in (False, True)
  }
  x, y, mask = _batches(k * steps)
  params = _replicate(_params0())
  state = _replicate(tx.init(_params0()))
  no_flush = jnp.zeros(N_DEV, bool)
  ref, ref_state = _params0(), inner.init(_params0())
  for s in range(steps):
    for i in range(k):
      j = s * k + i
      params, state = run[i == k - 1](
        params, state, x[j], y[j], mask[j], no_flush
      )
    ref, ref_state = _big_batch_step(
      ref, ref_state, inner, *(a[s * k : (s + 1) * k] for a in (x, y, mask))
    )
  _assert_replicas_identical(params)
  _assert_replicas_identical(_replicated_leaves(state))
  np.testing.assert_array_equal(state.step, steps)
  for name in ("w", "b"):
    np.testing.assert_allclose(params[name][0], ref[name], rtol=1e-5, atol=1e-6)


# The devices' agreement under shard_map's check_vma=False too (issue 70).
AGREEING = [*RUNNERS, "shard_map_no_vma"]


@pytest.mark.parametrize("runner", AGREEING)
def test_skip_nonfinite_with_nan_on_one_device_keeps_replicas_identical(
  runner,
):
  """A NaN gradient on device 5 only: every device drops that micro-step,
  the cycle waits for one more, and the result is the big-batch mean of the
  kept micro-steps."""
  k = 2
  inner = optax.sgd(0.1, momentum=0.9)
  tx = optax_accum.accumulate(inner, k, axis_name="data", skip_nonfinite=True)
  step = _per_device_runner(tx, runner)
  x, y, mask = _batches(3)
  x_nan = x.copy()
  x_nan[1, 5, 0, 0, 0] = np.nan
  params = _replicate(_params0())
  state = _replicate(tx.init(_params0()))
  no_flush = jnp.zeros(N_DEV, bool)
  emitted = []
  for j in range(3):
    params, state = step(params, state, x_nan[j], y[j], mask[j], no_flush)
    emitted.append(np.asarray(state.emitted))
    _assert_replicas_identical(params)
  np.testing.assert_array_equal(
    np.stack(emitted), [[False] * N_DEV, [False] * N_DEV, [True] * N_DEV]
  )
  np.testing.assert_array_equal(state.num_skipped, 1)
  assert np.all(np.isfinite(params["w"]))
  kept = [0, 2]
  ref, _ = _big_batch_step(
    _params0(),
    inner.init(_params0()),
    inner,
    *(a[kept] for a in (x, y, mask)),
  )
  for name in ("w", "b"):
    np.testing.assert_allclose(params[name][0], ref[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("runner", AGREEING)
def test_flush_on_one_device_flushes_every_device(runner):
  """`flush=True` on device 2 alone ends the cycle on all devices, with the
  mean over what was accumulated (2 of 4 micro-steps)."""
  k = 4
  inner = optax.sgd(0.1)
  tx = optax_accum.accumulate(inner, k, axis_name="data")
  step = _per_device_runner(tx, runner)
  x, y, mask = _batches(2)
  params = _replicate(_params0())
  state = _replicate(tx.init(_params0()))
  params, state = step(
    params, state, x[0], y[0], mask[0], jnp.zeros(N_DEV, bool)
  )
  assert not np.any(state.emitted)
  flush = jnp.arange(N_DEV) == 2
  params, state = step(params, state, x[1], y[1], mask[1], flush)
  np.testing.assert_array_equal(state.emitted, True)
  np.testing.assert_array_equal(state.micro_step, 0)
  np.testing.assert_array_equal(state.step, 1)
  _assert_replicas_identical(params)
  ref, _ = _big_batch_step(
    _params0(), inner.init(_params0()), inner, x, y, mask
  )
  for name in ("w", "b"):
    np.testing.assert_allclose(params[name][0], ref[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_replicated_params_recipe(check_vma):
  """The README recipe: replicated params and inner state, only the cycle's
  local sums per device, with shard_map's default `check_vma=True` and with
  `check_vma=False`."""
  k = 2
  inner = optax.sgd(0.1, momentum=0.9)
  tx = optax_accum.accumulate(inner, k, axis_name="data")
  mesh = _data_mesh()
  specs = optax_accum.distributed.shard_map_specs(
    jax.eval_shape(tx.init, _params0()), "data"
  )

  def sharded_step(params, state, x, y, mask):
    state = optax_accum.distributed.drop_device_axis(state)
    # Under check_vma=True, jax.grad sums the gradient of replicated params
    # over the devices itself (every micro-step); for params marked as
    # varying it stays local and unreduced. A no-op with check_vma=False.
    # `lax.pcast(params, "data", to="varying")` (`lax.pvary` before jax
    # 0.8.2).
    local_params = to_varying(params, "data")
    grad, tokens = jax.grad(_mean_loss, has_aux=True)(local_params, x, y, mask)
    updates, state = tx.update(grad, state, params, weight=tokens)
    params = optax.apply_updates(params, updates)
    return params, optax_accum.distributed.add_device_axis(state)

  init = jax.jit(
    jax.shard_map(
      lambda p: optax_accum.distributed.add_device_axis(tx.init(p)),
      mesh=mesh,
      in_specs=P(),
      out_specs=specs,
      check_vma=check_vma,
    )
  )
  run = jax.jit(
    jax.shard_map(
      sharded_step,
      mesh=mesh,
      in_specs=(P(), specs, P("data"), P("data"), P("data")),
      out_specs=(P(), specs),
      check_vma=check_vma,
    )
  )
  x, y, mask = (a.reshape(a.shape[0], -1, *a.shape[3:]) for a in _batches(k))
  params = _params0()
  state = init(params)
  for i in range(k):
    params, state = run(params, state, x[i], y[i], mask[i])
  ref, _ = _big_batch_step(
    _params0(), inner.init(_params0()), inner, *_batches(k)
  )
  np.testing.assert_array_equal(state.step, 1)
  for name in ("w", "b"):
    np.testing.assert_allclose(params[name], ref[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# 2b. Where the reduction sits in the compiled step.
# ---------------------------------------------------------------------------


def _all_reduce_sites(text):
  """Each all-reduced array with the conditional branches on the way to it:
  a tuple of branch indices, () for code that runs on every call."""
  return [
    (array, tuple(step.index for step in site.path))
    for site in HloModule(text).sites(["all-reduce", "all-reduce-start"])
    for array in array_shapes(site.instruction.shape)
  ]


# "axis_name" and "psum_every_micro_step" run under shard_map's default
# check_vma=True, "axis_name_no_vma" under check_vma=False.
RECIPES = [
  "axis_name",
  "axis_name_no_vma",
  "psum_every_micro_step",
  "gspmd_jit",
]


def _compiled_micro_step(recipe, k):
  mesh = _data_mesh()
  inner = optax.adam(1e-2)
  params = _params0()
  x, y, mask = (a[0].reshape(-1, *a.shape[3:]) for a in _batches(1))
  if recipe == "gspmd_jit":
    tx = optax_accum.accumulate(inner, k)
    batch = NamedSharding(mesh, P("data"))
    x, y, mask = (jax.device_put(a, batch) for a in (x, y, mask))
    params = jax.device_put(params, NamedSharding(mesh, P()))

    def gspmd_step(params, state, x, y, mask):
      grad, tokens = jax.grad(_mean_loss, has_aux=True)(params, x, y, mask)
      return tx.update(grad, state, params, weight=tokens)

    fn = jax.jit(gspmd_step)
    state = tx.init(params)
  else:
    deferred = recipe.startswith("axis_name")
    check_vma = recipe != "axis_name_no_vma"
    tx = optax_accum.accumulate(
      inner, k, axis_name="data" if deferred else None
    )

    def local(params, state, x, y, mask):
      state = jax.tree.map(lambda a: a[0], state)
      # The local gradient (jax.grad would all-reduce it under check_vma).
      local_params = to_varying(params, "data")
      grad, tokens = jax.grad(_mean_loss, has_aux=True)(
        local_params, x, y, mask
      )
      if not deferred:  # the usual data-parallel step: reduce right away
        grad = jax.tree.map(lambda g: lax.psum(g * tokens, "data"), grad)
        tokens = lax.psum(tokens, "data")
        grad = jax.tree.map(lambda g: g / tokens, grad)
      updates, state = tx.update(grad, state, params, weight=tokens)
      # Per device, like the state (whose copy of the inner state, and so
      # the updates, check_vma counts as varying).
      return jax.tree.map(lambda a: a[None], (updates, state))

    fn = jax.jit(
      jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P("data"), P("data"), P("data"), P("data")),
        out_specs=P("data"),
        check_vma=check_vma,
      )
    )
    state = _replicate(tx.init(params))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state, x, y, mask = jax.device_put(
      (state, x, y, mask), NamedSharding(mesh, P("data"))
    )
  return fn, (params, state, x, y, mask)


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_gradient_all_reduce_sits_where_expected(recipe):
  """Parse the compiled HLO of one micro-step. With `axis_name` every
  gradient array is all-reduced exactly once, and only inside a branch of
  the conditional (so on the cycle's emitting call only); the two usual
  data-parallel steps reduce it outside any conditional, on every call."""
  fn, args = _compiled_micro_step(recipe, k=4)
  text = fn.lower(*args).compile().as_text()
  # By element count: XLA may reduce the kernel gradient transposed.
  grad_sizes = [DIM * OUT, OUT]
  sites = [
    (int(np.prod(shape)), branches)
    for (_, shape), branches in _all_reduce_sites(text)
    if int(np.prod(shape)) in grad_sizes
  ]
  assert sorted(size for size, _ in sites) == sorted(grad_sizes), sites
  if recipe.startswith("axis_name"):
    assert all(len(branches) >= 1 for _, branches in sites), sites
    # lax.cond(pred, emit, hold) lowers to branches {hold, emit}: index 1.
    assert all(branches[0] == 1 for _, branches in sites), sites
  else:
    assert all(branches == () for _, branches in sites), sites


def test_axis_name_emits_once_per_cycle():
  """The branch holding the reduction is entered once per cycle: over 3
  cycles of k=4 the update is emitted on calls 4, 8 and 12 only."""
  fn, (params, state, x, y, mask) = _compiled_micro_step("axis_name", k=4)
  emitted = []
  for _ in range(12):
    _, state = fn(params, state, x, y, mask)
    emitted.append(bool(state.emitted[0]))
  assert emitted == [i % 4 == 3 for i in range(12)]
