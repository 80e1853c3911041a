"""A checkpoint written mid-cycle on N devices, resumed on M (issue 69).

Each engine that keeps per-device partial sums (``shard_map`` with
``axis_name``, ``pmap``, HSDP's replicas and plain ``jit`` with unreduced
gradients; several processes: tests/test_multiprocess.py) runs the same
nine micro-batches of token-weighted data, ``k = 4`` (one of them a NaN
that ``skip_nonfinite`` drops, inside the second cycle), on N devices; its
state is saved through the host, as a checkpoint is, in the middle of the
second cycle and at the boundary before it; resumed on M devices with
``optax_accum.distributed.regroup_state``, the run ends with the
uninterrupted run's params (float32 rounding: the partial sums are added in
another order), counters and weight, and with the noise scale's estimate
of the samples it took: N devices' shares before the checkpoint, M
devices' after (an oracle that measures each share on one device).
Resumed without it, the run raises, naming what to do, instead of losing a
device's sums.

Each engine's step is compiled once per device count and reused: the
uninterrupted runs, the resumed ones and the refusals share them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _unreduced
from optax_accum._control import to_varying

K = 4
EXAMPLES, SEQ, DIM, OUT = 8, 3, 4, 2  # a micro-batch: 8 examples of 3 tokens
CALLS = 9  # two cycles of K accepted micro-batches, and the skipped one
SKIPPED = 5  # a NaN in one example: every device skips the micro-batch
SAVED_AFTER = {"mid": 7, "boundary": 4}  # calls run before the checkpoint
CYCLE_2 = range(4, CALLS)
RTOL, ATOL = 1e-5, 1e-6

needs_unreduced = pytest.mark.skipif(
  not _unreduced.is_supported(), reason="unreduced shardings: jax>=0.10.2"
)


def _calls():
  rng = np.random.default_rng(0)
  calls = []
  for i in range(CALLS):
    x = rng.normal(size=(EXAMPLES, SEQ, DIM)).astype(np.float32)
    y = rng.normal(size=(EXAMPLES, SEQ, OUT)).astype(np.float32)
    lengths = rng.integers(1, SEQ + 1, size=(EXAMPLES, 1))
    mask = (np.arange(SEQ) < lengths).astype(np.float32)
    if i == SKIPPED:
      x[3, 0, 0] = np.nan
    calls.append((x, y, mask))
  return calls


CALL_DATA = _calls()
PARAMS0 = {
  "w": np.random.default_rng(1).normal(size=(DIM, OUT)).astype(np.float32),
  "b": np.zeros(OUT, np.float32),
}


def mean_loss(params, x, y, mask):
  """The mean over the real tokens, and their number (the weight)."""
  err = jnp.einsum("btd,do->bto", x, params["w"]) + params["b"][None, None]
  tokens = jnp.sum(mask)
  loss = jnp.sum(jnp.sum((err - y) ** 2, axis=-1) * mask)
  return loss / jnp.maximum(tokens, 1.0), tokens


def make_tx(axis_name="data"):
  # SGD with momentum: linear in the gradient, so that a lost partial sum
  # or weight shows in the params; decay 0: the noise scale reads the last
  # cycle's estimate as it is.
  return optax_accum.accumulate(
    optax.sgd(0.1, momentum=0.9),
    K,
    axis_name=axis_name,
    skip_nonfinite=True,
    track_noise_scale=True,
    noise_scale_decay=0.0,
  )


def _devices(n):
  return jax.devices()[:n]


# ----------------------------------------------------------------------------
# The engines, each on n devices (replicas for HSDP): a fresh state, one
# step, a checkpoint through the host. Compiled once per n.
# ----------------------------------------------------------------------------


class ShardMap:
  """The guide's recipe (docs/guides/scaling_shard_map.md)."""

  name = "shard_map"

  @staticmethod
  @functools.cache
  def _compiled(n):
    tx = make_tx()
    mesh = jax.make_mesh((n,), ("data",), (AxisType.Auto,), devices=_devices(n))
    specs = optax_accum.distributed.shard_map_specs(
      jax.eval_shape(tx.init, PARAMS0), "data"
    )

    def local_step(params, opt_state, x, y, mask):
      local = to_varying(params, "data")
      (_, tokens), grads = jax.value_and_grad(mean_loss, has_aux=True)(
        local, x, y, mask
      )
      opt_state = optax_accum.distributed.drop_device_axis(opt_state)
      updates, opt_state = tx.update(grads, opt_state, params, weight=tokens)
      opt_state = optax_accum.distributed.add_device_axis(opt_state)
      return optax_accum.apply_updates(params, updates, opt_state), opt_state

    init = jax.jit(
      jax.shard_map(
        lambda p: optax_accum.distributed.add_device_axis(tx.init(p)),
        mesh=mesh,
        in_specs=P(),
        out_specs=specs,
      )
    )
    step = jax.jit(
      jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data"), P("data")),
        out_specs=(P(), specs),
      )
    )
    return mesh, init, step

  def init(self, n, params):
    mesh, init, _ = self._compiled(n)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    return params, init(params)

  def step(self, n, params, state, call):
    return self._compiled(n)[2](params, state, *call)

  def save(self, n, params, state):
    del n
    return jax.device_get((params, state))


class Pmap:
  """docs/guides/scaling_pmap.md: every leaf stacked, one row a device."""

  name = "pmap"

  @staticmethod
  @functools.cache
  def _step(n):
    tx = make_tx()

    def step(params, state, x, y, mask):
      (_, tokens), grads = jax.value_and_grad(mean_loss, has_aux=True)(
        params, x, y, mask
      )
      updates, state = tx.update(grads, state, params, weight=tokens)
      return optax_accum.apply_updates(params, updates, state), state

    return jax.pmap(step, axis_name="data", devices=_devices(n))

  def init(self, n, params):
    stack = lambda tree: jax.tree.map(lambda a: np.stack([a] * n), tree)  # noqa: E731
    return stack(params), stack(make_tx().init(params))

  def step(self, n, params, state, call):
    split = [a.reshape(n, -1, *a.shape[1:]) for a in call]
    return self._step(n)(params, state, *split)

  def save(self, n, params, state):
    del n
    first = jax.tree.map(lambda a: np.asarray(a[0]), params)
    return first, jax.device_get(state)


class Unreduced:
  """docs/guides/scaling_jit.md: plain jit, gradients typed unreduced; the
  checkpoint holds `reduce_state`'s sums (no device axis)."""

  name = "jit"
  axis = "data"

  def mesh(self, n):
    return jax.make_mesh(
      (n,), ("data",), (AxisType.Explicit,), devices=_devices(n)
    )

  def param_specs(self):
    return {"w": P(), "b": P()}

  def batch_spec(self):
    return P("data")

  def loss(self):
    return mean_loss

  @functools.cache  # noqa: B019  (one instance per class, for the module)
  def _step(self, n):
    tx = make_tx(self.axis)
    grad_fn = optax_accum.distributed.local_value_and_grad(
      self.loss(), axis_name=self.axis, has_weight=True, noise_stats=True
    )

    @jax.jit
    def step(params, state, x, y, mask):
      (_, tokens), grads, stats = grad_fn(params, x, y, mask)
      updates, state = tx.update(
        grads, state, params, weight=tokens, noise_stats=stats
      )
      return optax_accum.apply_updates(params, updates, state), state

    return step

  def init(self, n, params):
    mesh = self.mesh(n)
    params = {
      k: jax.device_put(v, NamedSharding(mesh, self.param_specs()[k]))
      for k, v in params.items()
    }
    with jax.set_mesh(mesh):
      return params, make_tx(self.axis).init(params)

  def step(self, n, params, state, call):
    mesh = self.mesh(n)
    with jax.set_mesh(mesh):
      call = jax.device_put(call, NamedSharding(mesh, self.batch_spec()))
      return self._step(n)(params, state, *call)

  def save(self, n, params, state):
    with jax.set_mesh(self.mesh(n)):
      state = optax_accum.distributed.reduce_state(state)
    return jax.device_get((params, state))


class Hsdp(Unreduced):
  """docs/guides/scaling_hsdp.md: n replicas of 2 devices; the params
  sharded over "fsdp", the sums deferred over "replica"."""

  name = "hsdp"
  axis = "replica"

  def mesh(self, n):
    return jax.make_mesh(
      (n, 2),
      ("replica", "fsdp"),
      (AxisType.Explicit,) * 2,
      devices=_devices(2 * n),
    )

  def param_specs(self):
    return {"w": P("fsdp", None), "b": P()}

  def batch_spec(self):
    return P(("replica", "fsdp"))

  def loss(self):
    def fsdp_loss(params, x, y, mask):
      gathered = jax.tree.map(lambda p: jax.sharding.reshard(p, P()), params)
      return mean_loss(gathered, x, y, mask)

    return fsdp_loss


ENGINES = {e.name: e for e in (ShardMap(), Pmap(), Unreduced(), Hsdp())}


@functools.cache
def uninterrupted(engine, n):
  """The run on n devices: the checkpoints (host params and state after
  each of `SAVED_AFTER`) and the end."""
  eng = ENGINES[engine]
  params, state = eng.init(n, PARAMS0)
  saved = {}
  for i, call in enumerate(CALL_DATA):
    for point, after in SAVED_AFTER.items():
      if i == after:
        saved[point] = eng.save(n, params, state)
    params, state = eng.step(n, params, state, call)
  return saved, eng.save(n, params, state)


def resumed(engine, n, m, point, resumed_with=None):
  """The checkpoint of `point` on n devices, regrouped and run to the end
  on m (with the engine `resumed_with`, default the same)."""
  eng = ENGINES[resumed_with or engine]
  params, restored = uninterrupted(engine, n)[0][point]
  params, target = eng.init(m, params)
  state = optax_accum.distributed.regroup_state(restored, target)
  _, regrouped = eng.save(m, params, state)
  for call in CALL_DATA[SAVED_AFTER[point] :]:
    params, state = eng.step(m, params, state, call)
  return regrouped, eng.save(m, params, state)


# ----------------------------------------------------------------------------
# The noise scale's oracle: every sample measured on its own.
# ----------------------------------------------------------------------------


@jax.jit
def _share_grad(params, x, y, mask):
  return jax.grad(lambda p: mean_loss(p, x, y, mask)[0])(params)


def cycle_estimate(params, splits):
  """``(grad_sq, trace)`` of the second cycle from its samples: each call's
  micro-batch split over ``splits[i]`` devices, each share one sample
  weighted by its tokens (the docstring of `_noise_scale`)."""
  sq_sum = weight = count = 0.0
  total = None
  for i in CYCLE_2:
    if i == SKIPPED:
      continue
    x, y, mask = CALL_DATA[i]
    rows = EXAMPLES // splits[i]
    for d in range(splits[i]):
      part = slice(d * rows, (d + 1) * rows)
      w = float(mask[part].sum())
      if w == 0:
        continue
      g = _share_grad(params, x[part], y[part], mask[part])
      g = np.concatenate(
        [np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(g)]
      )
      sq_sum += w * float(g @ g)
      weight += w
      count += 1
      total = w * g if total is None else total + w * g
  mean = total / weight
  trace = (sq_sum - weight * float(mean @ mean)) / (count - 1)
  return float(mean @ mean) - trace / weight, trace


def _noise(state):
  grad_sq, trace = optax_accum.noise_scale_components(
    state, noise_scale_decay=0.0
  )
  # A pmap state's replicas agree: the first.
  return float(np.ravel(grad_sq)[0]), float(np.ravel(trace)[0])


def _assert_ends_as(state, params, expected_state, expected_params):
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
    params,
    expected_params,
  )
  for reader in ("step", "micro_step", "num_skipped"):
    assert int(np.max(getattr(state, reader))) == int(
      np.max(getattr(expected_state, reader))
    ), reader
  np.testing.assert_array_equal(
    np.ravel(optax_accum.weight_seen(state))[0],
    np.ravel(optax_accum.weight_seen(expected_state))[0],
  )


def _resume(engine, n, m, *marks):
  return pytest.param(engine, n, m, marks=marks, id=f"{engine}-{n}to{m}")


RESUMES = [
  _resume("shard_map", 8, 4),
  _resume("shard_map", 8, 2),
  _resume("shard_map", 8, 1),
  _resume("shard_map", 4, 8),
  _resume("shard_map", 2, 8),
  _resume("pmap", 4, 2),
  _resume("pmap", 2, 4),
  _resume("hsdp", 4, 2, needs_unreduced),  # replicas of 2 devices
  _resume("jit", 8, 4, needs_unreduced),
]


@pytest.mark.parametrize("point", list(SAVED_AFTER))
@pytest.mark.parametrize(("engine", "n", "m"), RESUMES)
def test_a_checkpoint_resumes_on_another_device_count(engine, n, m, point):
  """Regrouped onto m devices, the run ends as the uninterrupted one on n:
  params to float32 rounding, the same steps, skips and weight; the noise
  scale's estimate of the cycle is that of its own samples."""
  saved, (expected_params, expected) = uninterrupted(engine, n)
  regrouped, (params, state) = resumed(engine, n, m, point)
  _assert_ends_as(state, params, expected, expected_params)
  if point == "boundary":  # no cycle open: nothing device-local to carry
    assert not any(
      np.any(leaf) for leaf in jax.tree.leaves(regrouped.acc_buffer)
    )
    assert not np.any(regrouped.acc_scalars)
  # The cycle's samples: n devices' shares before the checkpoint, m's after
  # (HSDP: a replica's share is a sample).
  cycle_params = saved["boundary"][0]
  splits = {i: n if i < SAVED_AFTER[point] else m for i in CYCLE_2}
  np.testing.assert_allclose(
    _noise(state), cycle_estimate(cycle_params, splits), rtol=1e-4
  )
  # The oracle is the uninterrupted run's estimate, with n's shares.
  np.testing.assert_allclose(
    _noise(expected),
    cycle_estimate(cycle_params, dict.fromkeys(CYCLE_2, n)),
    rtol=1e-4,
  )


@pytest.mark.parametrize(
  ("engine", "n", "other", "m"),
  [
    ("pmap", 4, "shard_map", 2),
    pytest.param("shard_map", 8, "jit", 4, marks=needs_unreduced),
    pytest.param("jit", 8, "shard_map", 2, marks=needs_unreduced),
  ],
  ids=lambda x: str(x),
)
def test_a_checkpoint_moves_to_another_engine(engine, n, other, m):
  """Every layout is read and written: a pmap state (every leaf stacked) or
  the unreduced engine's (no device axis) resumes under shard_map, and a
  shard_map state under plain jit, mid-cycle."""
  saved, (expected_params, expected) = uninterrupted(engine, n)
  _, (params, state) = resumed(engine, n, m, "mid", resumed_with=other)
  _assert_ends_as(state, params, expected, expected_params)
  splits = {i: n if i < SAVED_AFTER["mid"] else m for i in CYCLE_2}
  np.testing.assert_allclose(
    _noise(state), cycle_estimate(saved["boundary"][0], splits), rtol=1e-4
  )


@needs_unreduced
def test_a_live_unreduced_state_moves_to_fewer_devices():
  """No checkpoint: the unreduced state of 8 devices itself, typed
  unreduced (which jax cannot copy to the host), is summed and placed on 4,
  outside any mesh context."""
  eng = ENGINES["jit"]
  params, state = eng.init(8, PARAMS0)
  for call in CALL_DATA[: SAVED_AFTER["mid"]]:
    params, state = eng.step(8, params, state, call)
  params, target = eng.init(4, jax.device_get(params))
  state = optax_accum.distributed.regroup_state(state, target)
  for call in CALL_DATA[SAVED_AFTER["mid"] :]:
    params, state = eng.step(4, params, state, call)
  _, (expected_params, expected) = uninterrupted("jit", 8)
  params, state = eng.save(4, params, state)
  _assert_ends_as(state, params, expected, expected_params)


# What a user sees without `regroup_state`: an error that says what to do, or
# (where shard_map or pmap refuses the state first) jax's own, never a run
# that goes on without some devices' sums.
REFUSED_BY = {
  "shard_map": r"written on {n} devices .* runs on {m}\b.*regroup_state",
  "jit": r"not unreduced.*regroup_state",
  "hsdp": r"not unreduced.*regroup_state",
  # Refused by jax before the step runs: onto more devices, shard_map's "8
  # does not evenly divide 4"; pmap's (jax 0.12: a shape error of its own
  # squeeze; earlier: "pmap got inconsistent sizes").
  "shard_map_more": None,
  "pmap": None,
}


@pytest.mark.parametrize(("engine", "n", "m"), RESUMES)
def test_a_state_of_other_devices_is_refused_never_cut(engine, n, m):
  eng = ENGINES[engine]
  params, restored = uninterrupted(engine, n)[0]["mid"]
  params, _ = eng.init(m, params)
  which = "shard_map_more" if engine == "shard_map" and m > n else engine
  expected = REFUSED_BY[which]
  match = expected and expected.format(n=n, m=m)
  with pytest.raises(ValueError, match=match):
    eng.step(m, params, restored, CALL_DATA[SAVED_AFTER["mid"]])


# ----------------------------------------------------------------------------
# What regroup_state refuses (host states: nothing compiled).
# ----------------------------------------------------------------------------


def _state_of(n=None, stacked=None, params=PARAMS0, tx=None):
  """A host state mid-cycle: with a device axis of `n` rows on the
  device-local leaves (shard_map's layout), or `stacked` rows on every leaf
  (pmap's); each row's partial sums its index + 1."""
  tx = tx or optax_accum.accumulate(optax.sgd(0.1), K, axis_name="data")
  state = jax.device_get(tx.init(params)).replace(micro_step=1)
  rows = n or stacked
  if rows is None:
    return state

  def numbered(a):  # row i: i + 1
    lead = np.arange(1.0, rows + 1).reshape(-1, *[1] * np.ndim(a))
    return (lead * np.ones_like(a)).astype(a.dtype)

  local = state._replace(
    acc_grads=jax.tree.map(numbered, state.acc_buffer),
    acc_scalars=numbered(state.acc_scalars),
  )
  if stacked is None:
    return local
  stack = lambda a: np.stack([a] * rows)  # noqa: E731
  return local._replace(
    counters=stack(local.counters),
    inner_state=jax.tree.map(stack, local.inner_state),
  )


def test_regroup_state_sums_rows_onto_fewer_and_spreads_them_onto_more():
  eight = _state_of(n=8)
  four = optax_accum.distributed.regroup_state(eight, _state_of(n=4))
  np.testing.assert_array_equal(four.acc_scalars[:, 0], [3, 7, 11, 15])
  three = optax_accum.distributed.regroup_state(eight, _state_of(n=3))
  np.testing.assert_array_equal(three.acc_scalars[:, 0], [6, 15, 15])
  back = optax_accum.distributed.regroup_state(four, _state_of(n=8))
  np.testing.assert_array_equal(
    back.acc_scalars[:, 0], [3, 0, 7, 0, 11, 0, 15, 0]
  )
  one = optax_accum.distributed.regroup_state(eight, _state_of())
  np.testing.assert_array_equal(one.acc_buffer["w"], np.full((DIM, OUT), 36.0))
  assert int(one.micro_step) == 1
  # An abstract target gives the layout only: host arrays.
  shapes = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state_of(n=2)
  )
  two = optax_accum.distributed.regroup_state(eight, shapes)
  np.testing.assert_array_equal(two.acc_scalars[:, 0], [10, 26])
  assert isinstance(two.acc_scalars, np.ndarray)


def test_regroup_state_raises_naming_what_differs():
  regroup = optax_accum.distributed.regroup_state
  with pytest.raises(
    ValueError,
    match=r"acc_grads\['w'\] is float32\[8, 5, 2\] \(8 rows.*\[4, 4, 2\]",
  ):
    regroup(
      _state_of(n=8, params={"w": np.zeros((5, OUT)), "b": np.zeros(OUT)}),
      _state_of(n=4),
    )
  with pytest.raises(
    ValueError,
    match=r"`opt_state` has \[\"[^\"]*\['b'\]\"\] that `target` lacks",
  ):
    regroup(_state_of(n=8), _state_of(n=4, params={"w": PARAMS0["w"]}))
  with pytest.raises(TypeError, match="regroup_state.*none inside"):
    regroup({"w": np.zeros(2)}, {"w": np.zeros(2)})
  momentum = optax_accum.accumulate(
    optax.sgd(0.1, momentum=0.9), K, axis_name="data"
  )
  ensemble = _state_of(stacked=2, tx=momentum)
  trace = ensemble.inner_state[0].trace
  trace["b"][1] += 1.0  # two members of a stacked ensemble, not replicas
  with pytest.raises(
    ValueError, match=r"inner_state.*differs between its 2 rows"
  ):
    regroup(ensemble, _state_of(stacked=4, tx=momentum))
