"""``accumulate`` against a naive reference, compared after every call.

The reference (:class:`_Oracle`) is the big-batch definition written out in
plain Python and NumPy: float64 sums of ``w_i g_i`` (or ``g_i`` for
``gradients="sum"``), the total weight, the counters, and the inner
optimizer run with optax once per cycle on the cycle's mean (or sum). Each
call's draws are seeded NumPy: gradients on a grid of quarters and weights
in {0, 1/4, 1/2, 1, 2, 3, 5}, so that every sum is exact in float32 and the
counters, sums and readers are compared exactly; the updates, params and
inner states to float32 rounding of the inner optimizer.

Dimensions drawn (one row of ``CONFIGS`` each, several per row): integer,
fractional and zero weights; ``gradients`` mean/sum; ``reduction``
mean/sum; fixed k (1, 2, 3), an int schedule and a float schedule with
values below 1, a schedule of the weight seen; ``flush``;
``skip_nonfinite`` with NaN/Inf gradients and NaN weights; an inner that
takes ``value=``; the traced end, ``emit=True|False``; the noise-scale
sums; an own-buffer (bfloat16) accumulator; the Flax drop-ins; with and
without ``jit``. One compiled program per row (and ``emit`` value), built
once and reused across seeds.
"""

import dataclasses
import functools
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_accum
from optax_accum import _state

WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0)
BF16_WEIGHTS = (0.0, 0.5, 1.0, 2.0)  # sums exact in a bfloat16 accumulator
SHAPES = {"b": (3,), "w": (2, 3)}
DECAY = 0.75

INT_KS = (0, 2, -1, 3, 1)  # counts as 1, 2, 1, 3, 1
FLOAT_KS = (0.5, 2.5, 1.0, 3.75, 0.25)  # counts as 1, 2, 1, 3, 1
SEEN_BOUNDARIES = {3.0: 2, 8.0: 3}


def _int_schedule(step):
  return jnp.asarray(INT_KS, jnp.int32)[step % len(INT_KS)]


def _float_schedule(step):
  return jnp.asarray(FLOAT_KS, jnp.float32)[step % len(FLOAT_KS)]


def _oracle_k(every_k, step: int, seen: float) -> int:
  if every_k == "int":
    return max(INT_KS[step % len(INT_KS)], 1)
  if every_k == "float":
    return max(int(np.floor(FLOAT_KS[step % len(FLOAT_KS)])), 1)
  if every_k == "seen":
    k = 1
    for boundary, value in sorted(SEEN_BOUNDARIES.items()):
      k = value if seen >= boundary else k
    return k
  return every_k


def _library_every_k(every_k):
  return {
    "int": _int_schedule,
    "float": _float_schedule,
    "seen": optax_accum.piecewise_every_k(SEEN_BOUNDARIES),
  }.get(every_k, every_k)


def _needs_value():
  def update(updates, state, params=None, *, value):
    return jax.tree.map(lambda u: -u * value, updates), state

  return optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(), update
  )


INNERS = {
  "sgd": lambda: optax.sgd(0.5),
  "adam": lambda: optax.adam(0.1),
  # Extra arguments, and a state that changes: value= then a trace.
  "value": lambda: optax.chain(_needs_value(), optax.trace(decay=0.5)),
}


@dataclasses.dataclass(frozen=True)
class Config:
  every_k: Any  # an int, or "int" / "float" / "seen" (a schedule)
  inner: str
  weighted: bool = False
  flush: bool = False
  emit: bool = False  # draw emit= from None / True / False
  skip: bool = False
  gradients: str = "mean"
  reduction: str = "mean"
  noise: bool = False
  accumulator_dtype: Any = jnp.float32
  dropin: str | None = None  # "linen" or "nnx"

  def accumulate(self):
    return optax_accum.accumulate(
      INNERS[self.inner](),
      _library_every_k(self.every_k),
      reduction=self.reduction,
      accumulator_dtype=self.accumulator_dtype,
      skip_nonfinite=self.skip,
      track_noise_scale=self.noise,
      # Read only with the noise scale (without, another value raises).
      **({"noise_scale_decay": DECAY} if self.noise else {}),
      gradients=self.gradients,
    )


CONFIGS = {
  "k1_inner_alone": Config(1, "adam"),
  "k1_inner_alone_extra_args": Config(1, "value"),
  # k = 1 with one option each: not the pass-through.
  "k1_weighted": Config(1, "sgd", weighted=True),
  "k1_skip": Config(1, "adam", skip=True),
  "k1_weights_flush_skip": Config(
    1, "sgd", weighted=True, flush=True, skip=True
  ),
  "k3_weights_flush_skip_noise": Config(
    3, "adam", weighted=True, flush=True, skip=True, noise=True
  ),
  "k2_summed_gradients_sum_reduction": Config(
    2, "sgd", weighted=True, flush=True, gradients="sum", reduction="sum"
  ),
  "int_schedule_extra_args": Config("int", "value", weighted=True, flush=True),
  "float_schedule_summed_skip_noise": Config(
    "float",
    "sgd",
    weighted=True,
    flush=True,
    skip=True,
    gradients="sum",
    noise=True,
  ),
  "seen_schedule_unweighted_skip": Config(
    "seen", "adam", flush=True, skip=True
  ),
  "emit_k3_skip_noise": Config(
    3, "adam", weighted=True, emit=True, skip=True, noise=True
  ),
  "emit_sum_reduction_extra_args": Config(
    2, "value", weighted=True, emit=True, reduction="sum"
  ),
  "own_buffer_bf16_accumulator": Config(
    2, "adam", weighted=True, flush=True, accumulator_dtype=jnp.bfloat16
  ),
  "linen_trainstate": Config(
    2, "sgd", weighted=True, flush=True, dropin="linen"
  ),
  "nnx_optimizer": Config(3, "adam", weighted=True, emit=True, dropin="nnx"),
}


# ----------------------------------------------------------------------------
# The draws.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Call:
  grads: dict  # float32 arrays
  weight: float | None
  flush: bool
  emit: bool | None
  value: float


def _draw(config: Config, rng: np.random.Generator) -> Call:
  grads = {
    name: (rng.integers(-8, 9, size=shape) / 4).astype(np.float32)
    for name, shape in SHAPES.items()
  }
  if config.accumulator_dtype == jnp.bfloat16:
    grads = {n: np.clip(g, -2, 2) for n, g in grads.items()}
  weight = None
  if config.weighted:
    choices = (
      BF16_WEIGHTS if config.accumulator_dtype != jnp.float32 else WEIGHTS
    )
    # Zero one time in four: weightless cycles (ended by k, flush or emit)
    # are drawn in every row.
    weight = 0.0 if rng.random() < 0.25 else float(rng.choice(choices[1:]))
    if weight == 0 and config.gradients == "mean" and rng.random() < 0.3:
      grads["w"][0, 0] = np.nan  # the 0/0 mean of an all-padding batch
  if config.skip and rng.random() < 0.2:
    kinds = ["nan", "inf"] + (["nan_weight"] if config.weighted else [])
    bad = kinds[rng.integers(len(kinds))]
    if bad == "nan_weight":
      weight = float("nan")
    else:
      grads["b"][1] = np.nan if bad == "nan" else -np.inf
  if weight == 0 and config.gradients == "sum":
    # A loss summed over no tokens: zeros, never NaN (test_edges' xfail).
    grads = {n: np.zeros_like(g) for n, g in grads.items()}
  emit = None
  if config.emit:
    emit = [None, False, True, True][rng.integers(4)]
  flush = bool(config.flush and emit is None and rng.random() < 0.2)
  value = float(rng.choice([0.5, 1.0, 2.0]))
  return Call(grads, weight, flush, emit, value)


# ----------------------------------------------------------------------------
# The reference.
# ----------------------------------------------------------------------------


def _sq_norm(tree) -> float:
  return float(
    sum(np.sum(np.square(x, dtype=np.float64)) for x in tree.values())
  )


class _Oracle:
  """What `accumulate` promises, one call at a time."""

  def __init__(self, config: Config, params: dict):
    self.config = config
    self.inner = INNERS[config.inner]()
    self.inner_update = jax.jit(self.inner.update)
    self.params = {n: np.asarray(p) for n, p in params.items()}
    self.inner_state = self.inner.init(params)
    self.micro_step = self.step = self.num_skipped = 0
    self.seen = 0.0
    self.k = _oracle_k(config.every_k, 0, 0.0)
    self.acc = {n: np.zeros(s) for n, s in SHAPES.items()}
    self.weight = 0.0
    self.emitted = False
    self.updates = None
    # Noise scale: this cycle's sums, the moving averages, the cycles.
    self.sq_sum, self.count = 0.0, 0
    self.grad_sq = self.trace = 0.0
    self.cycles = 0

  def call(self, c: Call):
    cfg = self.config
    w = 1.0 if c.weight is None else c.weight
    finite = all(np.all(np.isfinite(g)) for g in c.grads.values())
    accepted = not cfg.skip or (np.isfinite(w) and (finite or w == 0))
    if self.micro_step == 0:
      self.sq_sum, self.count = 0.0, 0
    if accepted:
      scaled = c.weight is not None and cfg.gradients == "mean"
      if not (scaled and w == 0):
        for n, g in c.grads.items():
          self.acc[n] = self.acc[n] + (
            w * g.astype(np.float64) if scaled else g
          )
      self.weight += w
      self.micro_step += 1
      if w > 0:
        norm = _sq_norm(c.grads)
        self.sq_sum += norm / w if cfg.gradients == "sum" else w * norm
        self.count += 1
    else:
      self.num_skipped += 1
    end = (self.micro_step >= self.k or c.flush) if c.emit is None else c.emit
    zeros = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    self.updates, self.emitted = zeros, False
    if end:
      self._end(c)
    return self.updates

  def _end(self, c: Call):
    cfg = self.config
    total = self.weight
    if total > 0:
      inv = np.float32(1.0) / np.float32(total)
      acc = {n: a.astype(np.float32) for n, a in self.acc.items()}
      grad = acc
      if cfg.reduction == "mean":
        grad = {n: a * inv for n, a in acc.items()}
      extra = {"value": c.value} if cfg.inner == "value" else {}
      updates, self.inner_state = self.inner_update(
        grad, self.inner_state, self.params, **extra
      )
      self.updates = {n: np.asarray(u) for n, u in updates.items()}
      self.params = {n: self.params[n] + self.updates[n] for n in SHAPES}
      self.emitted = True
      self.step += 1
      self.seen += total
      mean_sq = _sq_norm({n: a / total for n, a in self.acc.items()})
      if self.count >= 2:
        trace = (self.sq_sum - total * mean_sq) / (self.count - 1)
        grad_sq = mean_sq - trace / total
        self.grad_sq = DECAY * self.grad_sq + (1 - DECAY) * grad_sq
        self.trace = DECAY * self.trace + (1 - DECAY) * trace
        self.cycles += 1
    self.sq_sum, self.count = 0.0, 0
    self.micro_step, self.weight = 0, 0.0
    self.acc = {n: np.zeros(s) for n, s in SHAPES.items()}
    self.k = _oracle_k(cfg.every_k, self.step, self.seen)


# ----------------------------------------------------------------------------
# The library, one compiled program per row.
# ----------------------------------------------------------------------------


def _params():
  return {
    "b": jnp.asarray([0.5, -1.0, 2.0], jnp.float32),
    "w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) / 4,
  }


def _kwargs(config: Config, weight, flush, value, emit):
  kwargs = {}
  if config.weighted:
    kwargs["weight"] = weight
  if config.flush and emit is None:
    kwargs["flush"] = flush
  if config.inner == "value":
    kwargs["value"] = value
  if emit is not None:
    kwargs["emit"] = emit
  return kwargs


class _Core:
  """``tx.update`` then ``optax_accum.apply_updates``."""

  def __init__(self, config: Config, jit: bool):
    self.config, self.tx = config, config.accumulate()

    def step(params, state, grads, weight, flush, value, emit=None):
      kwargs = _kwargs(config, weight, flush, value, emit)
      updates, state = self.tx.update(grads, state, params, **kwargs)
      return optax_accum.apply_updates(params, updates, state), state, updates

    self.step = jax.jit(step, static_argnames="emit") if jit else step

  def start(self):
    params = _params()
    return params, self.tx.init(params)

  def call(self, run, c: Call):
    params, state = run
    grads = {n: jnp.asarray(g) for n, g in c.grads.items()}
    params, state, updates = self.step(
      params, state, grads, c.weight, c.flush, c.value, emit=c.emit
    )
    return (params, state), updates, params, state


class _Linen:
  """``optax_accum.flax.TrainState.apply_gradients``."""

  def __init__(self, config: Config, jit: bool):
    self.config, self.tx = config, config.accumulate()

    def step(ts, grads, weight, flush, emit=None):
      kwargs = _kwargs(config, weight, flush, None, emit)
      return ts.apply_gradients(grads=grads, **kwargs)

    self.step = jax.jit(step, static_argnames="emit") if jit else step

  def start(self):
    return optax_accum.flax.TrainState.create(
      apply_fn=None, params=_params(), tx=self.tx
    )

  def call(self, ts, c: Call):
    grads = {n: jnp.asarray(g) for n, g in c.grads.items()}
    ts = self.step(ts, grads, c.weight, c.flush, emit=c.emit)
    return ts, None, ts.params, ts.opt_state


class _Model(nnx.Module):
  def __init__(self):
    params = _params()
    self.b = nnx.Param(params["b"])
    self.w = nnx.Param(params["w"])


def _linear_loss(model, gb, gw):
  """A loss whose gradient is exactly (gb, gw)."""
  return jnp.sum(model.b[...] * gb) + jnp.sum(model.w[...] * gw)


class _Nnx:
  """``optax_accum.flax.Optimizer.update``."""

  def __init__(self, config: Config, jit: bool):
    self.config, self.tx = config, config.accumulate()

    def step(model, optimizer, gb, gw, weight, flush, emit=None):
      grads = nnx.grad(_linear_loss)(model, gb, gw)
      kwargs = _kwargs(config, weight, flush, None, emit)
      optimizer.update(model, grads, **kwargs)

    self.step = nnx.jit(step, static_argnames="emit") if jit else step

  def start(self):
    model = _Model()
    return model, optax_accum.flax.Optimizer(model, self.tx, wrt=nnx.Param)

  def call(self, run, c: Call):
    model, optimizer = run
    gb, gw = jnp.asarray(c.grads["b"]), jnp.asarray(c.grads["w"])
    self.step(model, optimizer, gb, gw, c.weight, c.flush, emit=c.emit)
    params = {"b": model.b[...], "w": model.w[...]}
    opt_state = jax.tree.map(jnp.asarray, nnx.as_pure(optimizer.opt_state))
    return run, None, params, opt_state


@functools.cache
def _library(name: str, jit: bool):
  config = CONFIGS[name]
  kind = {None: _Core, "linen": _Linen, "nnx": _Nnx}[config.dropin]
  return kind(config, jit)


# ----------------------------------------------------------------------------
# The comparison.
# ----------------------------------------------------------------------------

ROUNDING = dict(rtol=2e-6, atol=1e-6)  # the inner optimizer's float32 ops


def _compare(oracle: _Oracle, updates, params, opt_state, where: str):
  state = _state.find_state(opt_state, "test")
  # Leftovers (micro_step 0 beside a non-zero weight: what a cycle's end
  # leaves on CPU) mean zeros and weight 0, which the reference holds.
  leftovers = int(state.micro_step) == 0 and float(state.acc_weight) != 0
  if leftovers:
    assert oracle.micro_step == 0, where
    state = state.replace(
      acc_grads=jax.tree.map(jnp.zeros_like, state.acc_grads),
      acc_weight=jnp.zeros_like(state.acc_weight),
    )
  counters = {
    "has_updated": (bool(optax_accum.has_updated(opt_state)), oracle.emitted),
    "current_every_k": (
      int(optax_accum.current_every_k(opt_state)),
      oracle.k,
    ),
    "weight_seen": (float(optax_accum.weight_seen(opt_state)), oracle.seen),
    "step": (int(state.step), oracle.step),
    "micro_step": (int(state.micro_step), oracle.micro_step),
    "num_skipped": (int(state.num_skipped), oracle.num_skipped),
    "acc_weight": (float(state.acc_weight), oracle.weight),
  }
  wrong = {k: v for k, v in counters.items() if v[0] != v[1]}
  assert not wrong, f"{where}: (library, reference) {wrong}"
  for name in SHAPES:
    if oracle.config.dropin is None:
      got = np.asarray(updates[name])
      assert got.dtype == np.float32, f"{where}: updates[{name}] {got.dtype}"
      if oracle.emitted:
        np.testing.assert_allclose(
          got, oracle.updates[name], **ROUNDING, err_msg=f"{where} {name}"
        )
      else:  # exact zeros
        np.testing.assert_array_equal(got, 0.0, err_msg=f"{where} {name}")
    np.testing.assert_allclose(
      np.asarray(params[name]),
      oracle.params[name],
      **ROUNDING,
      err_msg=f"{where}: params[{name}]",
    )
    acc = np.asarray(state.acc_grads[name], np.float64)
    np.testing.assert_array_equal(
      acc, oracle.acc[name], err_msg=f"{where}: acc_grads[{name}]"
    )
    assert state.acc_grads[name].dtype == oracle.config.accumulator_dtype
  inner = jax.tree.map(np.asarray, state.inner_state)
  want = jax.tree.map(np.asarray, oracle.inner_state)
  if oracle.config.dropin != "nnx":  # nnx holds nnx.State for dicts
    assert jax.tree.structure(inner) == jax.tree.structure(want), where
  for got, ref in zip(
    jax.tree.leaves(inner), jax.tree.leaves(want), strict=True
  ):
    np.testing.assert_allclose(got, ref, **ROUNDING, err_msg=f"{where}: inner")
  if oracle.config.noise:
    _compare_noise(oracle, opt_state, state.noise, where)


def _compare_noise(oracle: _Oracle, opt_state, noise, where: str):
  assert int(noise.count) == oracle.count, where
  assert int(noise.cycles) == oracle.cycles, where
  scale = 1e-5 * (1.0 + abs(oracle.sq_sum) + abs(oracle.trace))
  for got, want in (
    (noise.sq_norm_sum, oracle.sq_sum),
    (noise.grad_sq, oracle.grad_sq),
    (noise.trace, oracle.trace),
  ):
    np.testing.assert_allclose(
      float(got), want, rtol=1e-4, atol=scale, err_msg=f"{where}: noise"
    )
  read = optax_accum.noise_scale_components(opt_state, noise_scale_decay=DECAY)
  correction = 1 - DECAY**oracle.cycles
  if oracle.cycles == 0:
    assert np.all(np.isnan(np.asarray(read))), where
  else:
    want = (oracle.grad_sq / correction, oracle.trace / correction)
    np.testing.assert_allclose(
      np.asarray(read), want, rtol=1e-4, atol=scale / correction
    )


# Four seeds jitted per row. Eagerly, each call of an update with a
# conditional traces and compiles its branches again (about 0.3 s of CPU):
# the rows whose eager path differs most, with fewer calls. Both modes run
# the same draws for a given seed.
CASES = [(name, "jit", seed) for name in CONFIGS for seed in range(4)]
EAGER = (
  "k1_inner_alone",  # the pass-through to inner
  "k3_weights_flush_skip_noise",  # concrete NaN weights, checked eagerly
  "float_schedule_summed_skip_noise",
  "emit_sum_reduction_extra_args",
)
CASES += [(name, "nojit", 0) for name in EAGER]
CALLS = {"jit": 14, "nojit": 8}


@pytest.mark.parametrize(("name", "mode", "seed"), CASES)
def test_matches_the_reference_after_every_call(name, mode, seed):
  config = CONFIGS[name]
  library = _library(name, mode == "jit")
  rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
  run = library.start()
  oracle = _Oracle(config, _params())
  history = []
  for i in range(CALLS[mode]):
    call = _draw(config, rng)
    history.append(
      f"w={call.weight} flush={call.flush} emit={call.emit} v={call.value}"
      f" finite={all(np.all(np.isfinite(g)) for g in call.grads.values())}"
    )
    oracle.call(call)
    run, updates, params, opt_state = library.call(run, call)
    where = f"{name} {mode} seed {seed}, call {i}: " + "; ".join(history)
    _compare(oracle, updates, params, opt_state, where)
  # The draws reached what they are meant to: updates, and cycle ends.
  assert oracle.step >= 2, f"{name}: only {oracle.step} updates in the run"


# ----------------------------------------------------------------------------
# The noise scale on gradients of known variance.
# ----------------------------------------------------------------------------

NOISE_D, NOISE_SIGMA = 32, 2.0
NOISE_G = jnp.linspace(0.5, 1.5, NOISE_D)


@pytest.mark.parametrize("gradients", ["mean", "sum"])
def test_noise_scale_of_known_variance(gradients):
  """Per-example gradients G + N(0, sigma^2 I); micro-batches of 1 to 8
  examples, as means (or sums, gradients="sum"): the estimate of
  tr(Sigma) = d sigma^2, |G|^2 and their ratio within 10 % of the truth."""
  k, cycles = 4, 500
  tx = optax_accum.accumulate(
    optax.sgd(0.0), k, track_noise_scale=True, gradients=gradients
  )
  params = jnp.zeros(NOISE_D)
  sizes = jnp.asarray(
    np.random.default_rng(0).integers(1, 9, k * cycles), jnp.float32
  )
  noise = jax.random.normal(jax.random.PRNGKey(1), (k * cycles, NOISE_D))

  def body(state, inputs):
    size, z = inputs
    g = NOISE_G + NOISE_SIGMA / jnp.sqrt(size) * z  # a mean over `size`
    g = g * size if gradients == "sum" else g
    return tx.update(g, state, params, weight=size)[1], None

  state, _ = jax.jit(lambda s: jax.lax.scan(body, s, (sizes, noise)))(
    tx.init(params)
  )
  grad_sq, trace = optax_accum.noise_scale_components(state)
  true_grad_sq = float(jnp.sum(NOISE_G**2))
  true_trace = NOISE_D * NOISE_SIGMA**2
  np.testing.assert_allclose(float(trace), true_trace, rtol=0.1)
  np.testing.assert_allclose(float(grad_sq), true_grad_sq, rtol=0.1)
  np.testing.assert_allclose(
    float(optax_accum.noise_scale(state)), true_trace / true_grad_sq, rtol=0.1
  )
