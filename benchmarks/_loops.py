"""The training loops ``bench_loop.py`` times: each path the docs print, and
the loop a user had before (its peer), on one model.

A loop is a small object: ``call(i)`` runs the loop's body for the run's
i-th micro-batch (dispatching its step, and whatever the loop does around
it: the README's log where a cycle ends, the static cycle's ``emit=``),
``block()`` waits for the device, ``memory`` is its compiled step's
footprint (the largest of its programs) and ``init`` the temporary bytes
of its optimizer's ``init`` (a one-off allocation, apart). Each path's code
is the guide's, on this benchmark's model (``_models.make_problem``: square
tanh layers, a loss that is a mean over the micro-batch's rows):

* ``jit``: the README quick start (``jax.jit``, params and state donated,
  ``static_argnames="flush"``, ``optax_accum.apply_updates``, the step
  read every ``LOG_EVERY`` optimizer steps, as its comment says to log),
  its step called bare (``bare``: what the loop adds), and the static
  ``emit=`` loop (``static``); peer:
  ``optax.MultiSteps`` jitted and donated with ``optax.apply_updates``;
* ``nnx``: ``optax_accum.flax.Optimizer`` under ``nnx.jit`` and in flax's
  fast form (``nnx.jit_partial(..., graph=False)``), both donated; peers:
  ``nnx.Optimizer(model, optax.MultiSteps(...))`` in the same forms;
* ``linen``: ``optax_accum.flax.TrainState``, jitted and donated; peer:
  flax's ``TrainState`` around ``optax.MultiSteps``;
* ``equinox``: ``eqx.filter_jit(donate="all")`` applying with
  ``optax_accum.apply_updates`` on the filtered arrays (the Equinox
  guide); peer: ``optax.MultiSteps`` with ``eqx.apply_updates``;
* references: ``floor`` (k gradients added into a donated accumulator, then
  the plain optimizer once on their mean: two programs picked on the host)
  and ``big_batch`` (the plain optimizer on the k micro-batches as one
  batch, one call per cycle).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from _paths import PAIRS as PAIRS
from _paths import REFERENCES as REFERENCES

import optax_accum

LEARNING_RATE = 1e-3
LOG_EVERY = 100  # optimizer steps between two reads of the README's loop
INNERS: dict[str, Callable[[], optax.GradientTransformation]] = {
  "adam": lambda: optax.adam(LEARNING_RATE),
  "clip_adamw": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(LEARNING_RATE)
  ),
}

VARIANTS = (
  "readme",
  "readme_bf16_stochastic",
  "bare",
  "static",
  "multisteps",
  "nnx_jit",
  "nnx_jit_multisteps",
  "nnx_fast",
  "nnx_fast_multisteps",
  "linen",
  "linen_multisteps",
  "equinox",
  "equinox_multisteps",
  "floor",
  "big_batch",
)
NEEDS = {  # variant -> the package it needs beyond jax and optax
  **{v: "flax" for v in VARIANTS if v.startswith(("nnx", "linen"))},
  **{v: "equinox" for v in VARIANTS if v.startswith("equinox")},
}


class Problem(NamedTuple):
  """One configuration: the model's params, a micro-batch, the loss."""

  params: dict[str, jax.Array]
  batch: tuple[jax.Array, jax.Array]
  loss: Callable[[Any, Any], jax.Array]
  inner: Callable[[], optax.GradientTransformation]
  k: int

  @property
  def rows(self) -> int:
    return int(self.batch[0].shape[0])


def memory_of(compiled: Any) -> int | None:
  """The compiled footprint: argument + temp + output - alias bytes."""
  compiled = getattr(compiled, "compiled", compiled)  # equinox's wrapper
  m = compiled.memory_analysis()
  if m is None:
    return None
  return int(
    m.argument_size_in_bytes
    + m.temp_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
  )


def init_temp(tx: optax.GradientTransformation, params: Any) -> int | None:
  """Temporary bytes of `tx.init`: what it allocates beyond its state."""
  m = jax.jit(tx.init).lower(params).compile().memory_analysis()
  return None if m is None else int(m.temp_size_in_bytes)


def _copy(tree: Any) -> Any:
  return jax.tree.map(jnp.copy, tree)


def _multisteps(problem: Problem) -> optax.GradientTransformation:
  return optax.MultiSteps(
    problem.inner(), every_k_schedule=problem.k
  ).gradient_transformation()


def _ours(
  problem: Problem, **options: Any
) -> optax.GradientTransformationExtraArgs:
  return optax_accum.accumulate(problem.inner(), every_k=problem.k, **options)


# The README's loop with a bfloat16 accumulator rounded stochastically.
BF16_STOCHASTIC = dict(accumulator_dtype=jnp.bfloat16, rounding="stochastic")


# ----------------------------------------------------------------------------
# jax.jit: the README's loop, its bare step, the static loop, MultiSteps.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class JitLoop:
  """A jitted step over ``(params, state)``, donated; `emit_of(i)` picks a
  static program (None: one program); every `log_every` cycles (0: never)
  the loop reads the optimizer step, as the README says to log."""

  step: Any
  values: tuple
  batch: Any
  k: int
  emit_of: Callable[[int], dict] = lambda i: {}
  log_every: int = 0
  memory: int | None = None
  init: int | None = None

  def call(self, i: int) -> None:
    self.values = self.step(*self.values, self.batch, **self.emit_of(i))
    if self.log_every and (i + 1) % (self.k * self.log_every) == 0:
      int(self.values[1].step)  # the README's log

  def block(self) -> None:
    jax.block_until_ready(self.values)


def readme_step(loss, tx, rows):
  """The README's train_step, on this model (its weight: the rows)."""

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames="flush")
  def train_step(params, opt_state, batch, flush=False):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, weight=jnp.float32(rows), flush=flush
    )
    return optax_accum.apply_updates(params, updates, opt_state), opt_state

  return train_step


def static_step(loss, tx, rows):
  """Getting started's static_step (``emit=`` from the loop)."""

  @functools.partial(jax.jit, static_argnames="emit", donate_argnums=(0, 1))
  def step(params, opt_state, batch, emit):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, weight=jnp.float32(rows), emit=emit
    )
    return optax_accum.apply_updates(params, updates, opt_state), opt_state

  return step


def multisteps_step(loss, tx):
  """optax.MultiSteps as its docs use it: jitted, donated."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def jit_loops(problem: Problem, names: set[str]) -> dict[str, JitLoop]:
  loss, k, rows = problem.loss, problem.k, problem.rows
  out = {}
  for name in names:
    params = _copy(problem.params)
    if name == "multisteps":
      tx = _multisteps(problem)
    elif name == "readme_bf16_stochastic":
      tx = _ours(problem, **BF16_STOCHASTIC)
    else:
      tx = _ours(problem)
    state = (params, tx.init(params))
    if name in ("readme", "bare", "readme_bf16_stochastic"):
      step = readme_step(loss, tx, rows)
      out[name] = JitLoop(
        step, state, problem.batch, k, log_every=LOG_EVERY * (name == "readme")
      )
    elif name == "static":
      out[name] = JitLoop(
        static_step(loss, tx, rows),
        state,
        problem.batch,
        k,
        emit_of=lambda i: {"emit": i % k == k - 1},
      )
    else:
      out[name] = JitLoop(multisteps_step(loss, tx), state, problem.batch, k)
  return out


def floor_loop(problem: Problem) -> JitLoop:
  """k gradients added into a donated float32 accumulator, then the plain
  optimizer once on their mean (two programs, picked on the host)."""
  inner, loss, k = problem.inner(), problem.loss, problem.k

  @functools.partial(jax.jit, static_argnames="emit", donate_argnums=(0, 1))
  def floor_step(params, state, batch, emit):
    acc, inner_state = state
    acc = jax.tree.map(
      lambda a, g: a + g.astype(a.dtype), acc, jax.grad(loss)(params, batch)
    )
    if not emit:
      return params, (acc, inner_state)
    mean = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    updates, inner_state = inner.update(mean, inner_state, params)
    zeros = jax.tree.map(jnp.zeros_like, acc)
    return optax.apply_updates(params, updates), (zeros, inner_state)

  params = _copy(problem.params)
  acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  return JitLoop(
    floor_step,
    (params, (acc, inner.init(params))),
    problem.batch,
    k,
    emit_of=lambda i: {"emit": i % k == k - 1},
  )


def big_batch_loop(problem: Problem) -> JitLoop:
  """The plain optimizer on the k micro-batches as one batch: one call per
  cycle (its `call(i)` steps on every k-th micro-batch)."""
  inner, loss, k = problem.inner(), problem.loss, problem.k
  big = jax.tree.map(lambda x: jnp.concatenate([x] * k), problem.batch)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def big_step(params, state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = _copy(problem.params)
  loop = JitLoop(big_step, (params, inner.init(params)), big, k)
  plain_call = loop.call

  def call(i: int) -> None:
    if i % k == k - 1:
      plain_call(i)

  loop.call = call
  return loop


# ----------------------------------------------------------------------------
# Flax NNX: nnx.jit and nnx.jit_partial(..., graph=False).
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class NnxLoop:
  call_step: Callable[[], Any]
  model: Any
  optimizer: Any
  memory: int | None = None
  init: int | None = None

  def call(self, i: int) -> None:
    del i
    self.call_step()

  def block(self) -> None:
    from flax import nnx

    jax.block_until_ready(nnx.state((self.model, self.optimizer)))


def nnx_loops(problem: Problem, names: set[str]) -> dict[str, NnxLoop]:
  from flax import nnx

  import optax_accum.flax  # noqa: F401  (the drop-in)

  loss, rows = problem.loss, problem.rows

  class Stack(nnx.Module):
    def __init__(self, params):
      self.layers = nnx.List([nnx.Param(params[n]) for n in sorted(params)])

  def nnx_loss(model, batch):
    layers = {f"w{i:02d}": w[...] for i, w in enumerate(model.layers)}
    return loss(layers, batch)

  def train_step(model, optimizer, batch):  # the NNX guide's step
    loss_value, grads = nnx.value_and_grad(nnx_loss)(model, batch)
    if isinstance(optimizer, optax_accum.flax.Optimizer):
      optimizer.update(model, grads, weight=jnp.float32(rows))
    else:
      optimizer.update(model, grads)
    return loss_value

  out = {}
  for name in names:
    model = Stack(_copy(problem.params))
    ours = "multisteps" not in name
    if ours:
      optimizer = optax_accum.flax.Optimizer(
        model, _ours(problem), wrt=nnx.Param
      )
    else:
      optimizer = nnx.Optimizer(model, _multisteps(problem), wrt=nnx.Param)
    # Commit the arrays to the device, as the step's outputs will be: else
    # nnx.jit compiles its second call again.
    pair = (model, optimizer)
    nnx.update(pair, jax.device_put(nnx.state(pair), jax.devices()[0]))
    batch = problem.batch
    if name.startswith("nnx_fast"):
      step = nnx.jit_partial(
        train_step, model, optimizer, graph=False, donate_argnums=0
      )
      call = functools.partial(step, batch)
      lowered = step.lower(batch)
    else:
      step = nnx.jit(train_step, donate_argnums=(0, 1))
      call = functools.partial(step, model, optimizer, batch)
      lowered = step.lower(model, optimizer, batch)
    lowered = getattr(lowered, "lowered", lowered)
    out[name] = NnxLoop(call, model, optimizer, memory_of(lowered.compile()))
  return out


# ----------------------------------------------------------------------------
# Flax linen TrainState, and equinox.
# ----------------------------------------------------------------------------


def linen_loops(problem: Problem, names: set[str]) -> dict[str, JitLoop]:
  from flax.training import train_state

  import optax_accum.flax  # noqa: F401

  loss, rows = problem.loss, problem.rows

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state, batch):  # the linen guide's step
    grads = jax.grad(loss)(state.params, batch)
    if isinstance(state, optax_accum.flax.TrainState):
      return state.apply_gradients(grads=grads, weight=jnp.float32(rows))
    return state.apply_gradients(grads=grads)

  out = {}
  for name in names:
    cls, tx = optax_accum.flax.TrainState, _ours(problem)
    if name == "linen_multisteps":
      cls, tx = train_state.TrainState, _multisteps(problem)
    state = cls.create(apply_fn=None, params=_copy(problem.params), tx=tx)
    loop = JitLoop(
      lambda s, b: (train_step(s, b),), (state,), problem.batch, problem.k
    )
    loop.memory = memory_of(train_step.lower(state, problem.batch).compile())
    out[name] = loop
  return out


def equinox_loops(problem: Problem, names: set[str]) -> dict[str, JitLoop]:
  import equinox as eqx

  loss, rows = problem.loss, problem.rows

  class Stack(eqx.Module):
    layers: list

  def eqx_loss(model, batch):
    return loss({f"w{i:02d}": w for i, w in enumerate(model.layers)}, batch)

  out = {}
  for name in names:
    ours = name == "equinox"
    tx = _ours(problem) if ours else _multisteps(problem)

    @eqx.filter_jit(donate="all")
    def step(model, state, batch, tx=tx, ours=ours):  # the Equinox guide's
      grads = eqx.filter_grad(eqx_loss)(model, batch)
      params, static = eqx.partition(model, eqx.is_array)
      if not ours:
        updates, state = tx.update(grads, state, params)
        return eqx.apply_updates(model, updates), state
      updates, state = tx.update(grads, state, params, weight=jnp.float32(rows))
      params = optax_accum.apply_updates(params, updates, state)
      return eqx.combine(params, static), state

    model = Stack(layers=[problem.params[n] for n in sorted(problem.params)])
    model = _copy(model)
    state = tx.init(eqx.filter(model, eqx.is_array))
    loop = JitLoop(step, (model, state), problem.batch, problem.k)
    loop.memory = memory_of(step.lower(model, state, problem.batch).compile())
    out[name] = loop
  return out


def build(problem: Problem, names: set[str]) -> dict[str, Any]:
  """The loops of `names` for `problem`, each with its memory figures."""
  loops: dict[str, Any] = {}
  loops.update(
    jit_loops(
      problem,
      names
      & {"readme", "bare", "static", "multisteps", "readme_bf16_stochastic"},
    )
  )
  if "floor" in names:
    loops["floor"] = floor_loop(problem)
  if "big_batch" in names:
    loops["big_batch"] = big_batch_loop(problem)
  nnx_names = {n for n in names if n.startswith("nnx")}
  if nnx_names:
    loops.update(nnx_loops(problem, nnx_names))
  linen_names = {n for n in names if n.startswith("linen")}
  if linen_names:
    loops.update(linen_loops(problem, linen_names))
  eqx_names = {n for n in names if n.startswith("equinox")}
  if eqx_names:
    loops.update(equinox_loops(problem, eqx_names))
  for name, loop in loops.items():
    if loop.memory is None and isinstance(loop, JitLoop):
      loop.memory = _jit_memory(loop)
    if "multisteps" in name:
      loop.init = init_temp(_multisteps(problem), problem.params)
    elif name in ("floor", "big_batch"):  # the plain optimizer's
      loop.init = init_temp(problem.inner(), problem.params)
    else:
      loop.init = init_temp(_ours(problem), problem.params)
  return loops


def _jit_memory(loop: JitLoop) -> int | None:
  """The largest footprint of the loop's programs (one per `emit`)."""
  emits = {tuple(sorted(loop.emit_of(i).items())) for i in range(loop.k)}
  sizes = [
    memory_of(loop.step.lower(*loop.values, loop.batch, **dict(e)).compile())
    for e in emits
  ]
  sizes = [s for s in sizes if s is not None]
  return max(sizes) if sizes else None
