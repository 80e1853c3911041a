"""Compiles every documented recipe's step, as the docs print it, for one H100
(float32 and bfloat16 params) and the data-parallel ones for 8 H100s,
without the devices; prints each one's facts and its floor's as JSON.

Run by ``tests/test_recipes.py`` in one subprocess, with ``JAX_PLATFORMS=cpu``
and the accelerator compilers on ``PYTHONPATH`` (``tests/_common.accel_env``)::

  python tests/_recipes_accel_worker.py [--plants clean,no_donation,optax_apply]

The step is taken from the docs' own text (``tests/test_docs.python_blocks``:
README.md, the guides under docs/guides/) or an example's module
(``examples/scaling_shard_map.py``): the block runs up to its first
training call, and its step is lowered for params of
a size where the ratios mean something. The docs' models are tiny, so the
step gets the issue's (4 bias-free 2048-square tanh layers, 16 rows a
device) where it takes a model (the Flax steps), and one 4096-square matrix
(the same 64 MiB) where its loss fixes a linear model (``x @ w``). The
step's optimizer is the block's own ``tx``.

Per recipe: kernel bytes of a micro-step over the floor's (the same loss's
gradient added into a donated float32 accumulator: through the recipe's own
gradient function where it has one, ``local_value_and_grad`` or
``pcast`` + ``grad`` on a data-parallel mesh), the parameter-sized copies a
micro-step runs, the footprint over the plain inner step's (adam alone,
donated) in accumulator bytes, and ``optax_accum.inspect.check_step(...,
target=...)``'s problems.

Plants, each a whole second run of the recipes: ``no_donation`` strips
``donate_argnums`` from the printed code (text); ``optax_apply`` makes
``optax_accum.apply_updates`` (and so the Flax drop-ins) ``optax.apply_updates``.
"""

import argparse
import contextlib
import dataclasses
import json
import pathlib
import re
import sys
from typing import Any

import jax

# The data-parallel blocks build an 8-device CPU mesh before their step.
jax.config.update("jax_num_cpu_devices", 8)

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]

import _common  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import test_docs  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_accum  # noqa: E402
from optax_accum import _apply, targets  # noqa: E402
from optax_accum.inspect import _program, check_step  # noqa: E402

PLANTS = ("clean", "no_donation", "optax_apply")
WIDTH, LAYERS, ROWS = 2048, 4, 16  # the model, rows per device
LINEAR = 4096  # one matrix of the same bytes, for the linear losses
REPLICATED = P()
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass
class Recipe:
  """A recipe's step with its arguments, and what its floor needs."""

  step: Any
  args: tuple
  target: str
  engine: str  # "local", "unreduced" or "shard_map": the floor's
  mesh: Any
  params: Any  # the params, pure
  batch: tuple
  loss: Any  # loss(params, *batch) -> scalar
  grad: Any = None  # grad(params, *batch) -> grads (None: of `loss`)
  emit: bool | None = None


# ----------------------------------------------------------------------------
# The docs' code, planted or not.
# ----------------------------------------------------------------------------


def _block(path: str, marker: str) -> test_docs.Block:
  (block,) = [
    b for b in test_docs.python_blocks(REPO / path) if marker in b.code
  ]
  return block


def _plant_text(code: str, plant: str) -> str:
  if plant != "no_donation":
    return code
  stripped, n = re.subn(
    r",?\s*donate_argnums=\([^)]*\)|, donate_argnums=0", "", code
  )
  if not n:
    raise RuntimeError(f"no donate_argnums to strip in:\n{code[:300]}")
  return stripped


def _run(path: str, marker: str, cut: str, plant: str, namespace=None):
  """Runs the block of `path` holding `marker` (it makes its own data) up
  to `cut`, its first training call, in `namespace` (default: a new one)."""
  namespace = {} if namespace is None else namespace
  block = _block(path, marker)
  if cut not in block.code:
    raise RuntimeError(f"{block.id}: {cut!r} not found: the recipe changed")
  code = _plant_text(block.code.split(cut)[0], plant)
  exec(compile(code, block.id, "exec"), namespace)
  return namespace


def _optax_apply(params, updates, state=None):
  del state
  return optax.apply_updates(params, updates)


@contextlib.contextmanager
def _planted(plant: str):
  """`optax_apply`: optax_accum.apply_updates (and the Flax drop-ins, which
  call it) become optax.apply_updates while the recipes trace."""
  saved = optax_accum.apply_updates, _apply.apply_updates
  if plant == "optax_apply":
    optax_accum.apply_updates = _apply.apply_updates = _optax_apply
  try:
    yield
  finally:
    optax_accum.apply_updates, _apply.apply_updates = saved


@contextlib.contextmanager
def _target_make_mesh(target: str):
  """``jax.make_mesh`` gives the target's mesh: for a block whose step
  closes over its mesh (``shard_map``)."""
  make_mesh = jax.make_mesh

  def on_target(shape, names, *, axis_types=None, **kwargs):
    del kwargs
    explicit = axis_types is None or all(
      t == jax.sharding.AxisType.Explicit for t in axis_types
    )
    return targets.mesh(target, shape, names, explicit=explicit)

  jax.make_mesh = on_target
  try:
    yield
  finally:
    jax.make_mesh = make_mesh


# ----------------------------------------------------------------------------
# Abstract arguments.
# ----------------------------------------------------------------------------


def _sds(mesh, shape, dtype, spec=REPLICATED):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _placed(tree, mesh, spec=REPLICATED):
  return jax.tree.map(lambda x: _sds(mesh, x.shape, x.dtype, spec), tree)


def _masked_batch(mesh, dtype, width, rows, spec=REPLICATED):
  return {
    "x": _sds(mesh, (rows, width), dtype, spec),
    "y": _sds(mesh, (rows, width), dtype, spec),
    "mask": _sds(mesh, (rows,), jnp.float32, spec),
  }


def _masked_mean(pred, batch):
  """The guides' loss: the mean over the real rows of the micro-batch."""
  err = ((pred - batch["y"]) ** 2).sum(-1)
  return (err * batch["mask"]).sum() / batch["mask"].sum()


class NnxMLP(nnx.Module):
  def __init__(self, dtype, rngs):
    self.layers = nnx.List(
      [
        nnx.Linear(WIDTH, WIDTH, use_bias=False, param_dtype=dtype, rngs=rngs)
        for _ in range(LAYERS)
      ]
    )

  def __call__(self, h):
    for layer in self.layers:
      h = jnp.tanh(layer(h))
    return h


class LinenMLP(nn.Module):
  dtype: Any

  @nn.compact
  def __call__(self, h):
    for _ in range(LAYERS):
      h = jnp.tanh(nn.Dense(WIDTH, use_bias=False, param_dtype=self.dtype)(h))
    return h


def _nnx_loss(model):
  """The pure loss of an NNX model, for its floor and plain step."""
  graphdef, params = nnx.split(model)

  def loss(params, batch):
    return _masked_mean(nnx.merge(graphdef, params)(batch["x"]), batch)

  return params, loss


# ----------------------------------------------------------------------------
# The recipes.
# ----------------------------------------------------------------------------


def _one_h100(ns, carried, batch, mesh, params, loss, static=False) -> Recipe:
  """A recipe for one H100: the block's ``train_step(*carried, batch)``,
  or with `static` its ``static_step(*carried, batch, False)`` (emit=False,
  a micro-step)."""
  return Recipe(
    step=ns["static_step"] if static else ns["train_step"],
    args=(*carried, batch) + ((False,) if static else ()),
    target="h100",
    engine="local",
    mesh=mesh,
    params=params,
    batch=(batch,),
    loss=loss,
    emit=False if static else None,
  )


def readme(plant, dtype, static=False):
  mesh = targets.mesh("h100", (1,), ("data",))
  ns = _run(
    "README.md",
    "def train_step(params, opt_state",
    "opt_state = tx.init",
    plant,
  )
  if static:
    _run(
      "docs/guides/getting_started.md",
      "def static_step(",
      "opt_state = tx.init",
      plant,
      ns,
    )
  params = {"w": _sds(mesh, (LINEAR, LINEAR), dtype)}
  state = _placed(jax.eval_shape(ns["tx"].init, params), mesh)
  batch = _masked_batch(mesh, dtype, LINEAR, ROWS)
  carried = (params, state)
  return _one_h100(ns, carried, batch, mesh, params, ns["loss_fn"], static)


def nnx_guide(plant, dtype, static=False):
  """The NNX guide's step: its ``nnx.jit_partial`` call form over this
  recipe's model (the guide's own line, run again with it), or the static
  block's ``nnx.jit`` step."""
  mesh = targets.mesh("h100", (1,), ("data",))
  path = "docs/guides/flax.md"
  marker = "def train_step(model, optimizer, batch)"
  # Up to the call form (no donation there: the line below is planted).
  prefix_plant = "clean" if plant == "no_donation" else plant
  ns = _run(path, marker, "step = nnx.jit_partial(", prefix_plant)
  if static:
    _run(path, "def static_step(model, optimizer", "for i, batch in", plant, ns)
  tx = ns["optimizer"].tx

  def make():
    model = NnxMLP(dtype, nnx.Rngs(0))
    return model, optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)

  model, optimizer = _placed(nnx.eval_shape(make), mesh)
  batch = _masked_batch(mesh, dtype, WIDTH, ROWS)
  params, loss = _nnx_loss(model)
  if not static:  # the guide's fast form, bound to this model
    ns.update(model=model, optimizer=optimizer)
    line = _block(path, marker).code.split("step = nnx.jit_partial(")[1]
    line = "step = nnx.jit_partial(" + line.split("\nfor batch in")[0]
    exec(_plant_text(line, plant), ns)
    ns["train_step"] = ns["step"]
    return _one_h100(ns, (model, optimizer), batch, mesh, params, loss)
  return _one_h100(ns, (model, optimizer), batch, mesh, params, loss, static)


def linen_guide(plant, dtype):
  mesh = targets.mesh("h100", (1,), ("data",))
  ns = _run(
    "docs/guides/flax.md",
    "def linen_step(state, batch)",
    "for batch in",
    plant,
  )
  ns["train_step"] = ns["linen_step"]
  model = LinenMLP(dtype)
  batch = _masked_batch(mesh, dtype, WIDTH, ROWS)
  params = _placed(
    jax.eval_shape(model.init, jax.random.key(0), batch["x"]), mesh
  )
  state = jax.eval_shape(
    lambda p: optax_accum.flax.TrainState.create(
      apply_fn=model.apply, params=p, tx=ns["state"].tx
    ),
    params,
  )
  state = _placed(state, mesh)

  def loss(params, batch):
    return _masked_mean(model.apply(params, batch["x"]), batch)

  return _one_h100(ns, (state,), batch, mesh, params, loss)


def nnx_data_parallel(plant, dtype):
  mesh = targets.mesh("h100x8", (8,), ("data",), explicit=True)
  ns = _run(
    "docs/guides/flax.md",
    "def dp_step(",
    "with jax.set_mesh(mesh):\n  sharded",
    plant,
  )

  def make():
    model = NnxMLP(dtype, nnx.Rngs(0))
    return model, optax_accum.flax.Optimizer(model, ns["tx"], wrt=nnx.Param)

  with jax.set_mesh(mesh):
    model, optimizer = nnx.eval_shape(make)
  batch = _masked_batch(mesh, dtype, WIDTH, 8 * ROWS, P("data"))
  graphdef, params = nnx.split(model)
  params = _placed(params, mesh)

  def loss(params, batch):
    return ns["loss_fn"](nnx.merge(graphdef, params), batch)

  grad = optax_accum.distributed.local_value_and_grad(
    loss, axis_name="data", has_weight=True
  )
  return Recipe(
    ns["dp_step"],
    (model, optimizer, batch),
    "h100x8",
    "unreduced",
    mesh,
    params,
    (batch,),
    lambda p, b: loss(p, b)[0],
    grad=lambda p, b: grad(p, b)[1],
  )


def _linear_dp(mesh, dtype):
  """The shard_map set-up's token loss at a size: x @ w + b, one token."""
  params = {
    "w": _sds(mesh, (LINEAR, LINEAR), dtype),
    "b": _sds(mesh, (LINEAR,), dtype),
  }
  rows = P("data")
  batch = (
    _sds(mesh, (8 * ROWS, 1, LINEAR), dtype, rows),
    _sds(mesh, (8 * ROWS, 1, LINEAR), dtype, rows),
    _sds(mesh, (8 * ROWS, 1), jnp.float32, rows),
  )
  return params, batch


def jit_unreduced(plant, dtype):
  mesh = targets.mesh("h100x8", (8,), ("data",), explicit=True)
  ns = _run(
    "docs/guides/scaling_jit.md",
    "grads: each device's share, typed",
    "with jax.set_mesh(mesh):",
    plant,
  )
  params, batch = _linear_dp(mesh, dtype)
  with jax.set_mesh(mesh):
    shardings = optax_accum.distributed.state_shardings(ns["tx"], params)
  state = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
    jax.eval_shape(ns["tx"].init, params),
    shardings,
  )
  grad_fn = ns["grad_fn"]
  return Recipe(
    ns["train_step"],
    (params, state, *batch),
    "h100x8",
    "unreduced",
    mesh,
    params,
    batch,
    lambda p, *b: ns["loss_fn"](p, *b)[0],
    grad=lambda p, *b: grad_fn(p, *b)[1],
  )


def shard_map(plant, dtype):
  with _target_make_mesh("h100x8"):
    ns = _run(
      "docs/guides/scaling_shard_map.md",
      "def local_step(params, opt_state",
      "opt_state = init(params)",
      plant,
    )
  mesh = ns["mesh"]
  params, batch = _linear_dp(mesh, dtype)
  state = _with_specs(jax.eval_shape(ns["init"], params), ns["specs"], mesh)
  return Recipe(
    ns["train_step"],
    (params, state, *batch),
    "h100x8",
    "shard_map",
    mesh,
    params,
    batch,
    lambda p, *b: ns["loss_fn"](p, *b)[0],
  )


def _with_specs(state, specs, mesh):
  """The state between ``shard_map`` steps, placed by its specs (a prefix
  tree of ``PartitionSpec``s): a device axis where each device holds its
  own sums."""
  return jax.tree.map(
    lambda spec, sub: _placed(sub, mesh, spec),
    specs,
    state,
    is_leaf=lambda x: isinstance(x, P),
  )


def scaling_shard_map(plant, dtype):
  """``examples/scaling_shard_map.py``'s ``make_train_step``."""
  source = (REPO / "examples" / "scaling_shard_map.py").read_text()
  # The worker set the device count before JAX started.
  source = source.replace('jax.config.update("jax_num_cpu_devices", 8)', "")
  ns = {"__name__": "scaling_shard_map"}
  exec(compile(_plant_text(source, plant), "scaling_shard_map.py", "exec"), ns)
  mesh = targets.mesh("h100x8", (8,), ("data",))
  params, batch = _linear_dp(mesh, dtype)
  tx = optax_accum.accumulate(optax.adam(1e-3), 8, axis_name="data")
  state = jax.eval_shape(ns["make_init"](tx, mesh, params), params)
  state = _with_specs(state, ns["state_specs"](tx, params), mesh)
  return Recipe(
    ns["make_train_step"](tx, mesh, params),
    (params, state, *batch),
    "h100x8",
    "shard_map",
    mesh,
    params,
    batch,
    lambda p, *b: ns["loss_fn"](p, *b)[0],
  )


RECIPES = {
  "readme_quick_start": (readme, ("f32", "bf16")),
  "readme_static": (lambda p, d: readme(p, d, static=True), ("f32", "bf16")),
  "nnx_guide": (nnx_guide, ("f32", "bf16")),
  "nnx_static": (lambda p, d: nnx_guide(p, d, static=True), ("f32", "bf16")),
  "linen_guide": (linen_guide, ("f32", "bf16")),
  "nnx_data_parallel": (nnx_data_parallel, ("f32",)),
  "jit_unreduced": (jit_unreduced, ("f32",)),
  "shard_map": (shard_map, ("f32",)),
  "scaling_shard_map_py": (scaling_shard_map, ("f32",)),
}


# ----------------------------------------------------------------------------
# The floor, the plain step, the facts.
# ----------------------------------------------------------------------------


def _acc(recipe: Recipe):
  mesh, n = recipe.mesh, recipe.mesh.devices.size
  if recipe.engine == "shard_map":  # each device's own sum, on a device axis
    return jax.tree.map(
      lambda p: _sds(mesh, (n, *p.shape), jnp.float32, P("data")), recipe.params
    )
  spec = P(unreduced={"data"}) if recipe.engine == "unreduced" else P()
  return jax.tree.map(
    lambda p: _sds(mesh, p.shape, jnp.float32, spec), recipe.params
  )


def _add(acc, grads, lead=False):
  return jax.tree.map(
    lambda a, g: a + (g[None] if lead else g).astype(a.dtype), acc, grads
  )


def _floor(recipe: Recipe):
  """The gradient added into a donated float32 accumulator."""
  grad = recipe.grad or jax.grad(recipe.loss)
  if recipe.engine != "shard_map":
    step = jax.jit(
      lambda p, acc, *b: (p, _add(acc, grad(p, *b))), donate_argnums=(0, 1)
    )
    return _lower(
      step, (recipe.params, _acc(recipe), *recipe.batch), recipe.mesh
    )

  def body(p, acc, *b):
    grads = jax.grad(recipe.loss)(lax.pcast(p, "data", to="varying"), *b)
    return p, _add(acc, grads, lead=True)

  batch_specs = (P("data"),) * len(recipe.batch)
  step = jax.shard_map(
    body,
    mesh=recipe.mesh,
    in_specs=(P(), P("data"), *batch_specs),
    out_specs=(P(), P("data")),
  )
  step = jax.jit(step, donate_argnums=(0, 1))
  return _lower(step, (recipe.params, _acc(recipe), *recipe.batch), recipe.mesh)


def _plain(recipe: Recipe):
  """The inner optimizer alone (adam, donated; data parallel under jit)."""
  inner = optax.adam(1e-3)

  def step(params, state, *batch):
    grads = jax.grad(recipe.loss)(params, *batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = _placed(jax.eval_shape(inner.init, recipe.params), recipe.mesh)
  step = jax.jit(step, donate_argnums=(0, 1))
  return _lower(step, (recipe.params, state, *recipe.batch), recipe.mesh)


def _lower(step, args, mesh):
  with jax.set_mesh(mesh):
    lowered = step.lower(*args)
  return getattr(lowered, "lowered", lowered).compile()


def measure(recipe: Recipe, full: bool) -> dict:
  """The recipe's facts, from ``check_step(..., target=...)``'s report
  (`full`: with its floor and plain step)."""
  with jax.set_mesh(recipe.mesh):
    report = check_step(
      recipe.step, *recipe.args, emit=recipe.emit, target=recipe.target
    )
  leaves = jax.tree.leaves(recipe.params)
  facts = {
    "target": recipe.target,
    "micro_step_bytes": report.micro_step_bytes,
    # Copies of half the largest float32 accumulator leaf or more: a
    # bfloat16 param leaf is that size.
    "copies": list(report.copies),
    "footprint": report.footprint_bytes,
    # Per device: every recipe here holds a full-size accumulator on each
    # (check_step counts shard_map's device axis whole).
    "accumulator_bytes": sum(x.size * 4 for x in leaves),
    "param_bytes": sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves),
    "problems": list(report.problems),
  }
  if full:
    facts["floor_bytes"] = _program.Program(_floor(recipe)).kernel_bytes()
    facts["plain_footprint"] = _common.footprint(_plain(recipe))
  return facts


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--plants", default=",".join(PLANTS))
  parser.add_argument("--recipes", default=",".join(RECIPES))
  parser.add_argument("--dtypes", default="f32,bf16")
  args = parser.parse_args(argv)
  out = {}
  for plant in args.plants.split(","):
    for name in args.recipes.split(","):
      build, dtypes = RECIPES[name]
      for dtype in dtypes:
        # Planted runs: float32 only (the fault is the same in bf16).
        if dtype not in args.dtypes.split(",") or (
          plant != "clean" and dtype != "f32"
        ):
          continue
        with _planted(plant):
          recipe = build(plant, DTYPES[dtype])
          facts = measure(recipe, full=plant == "clean")
        out[f"{plant}/{name}/{dtype}"] = facts
        print(f"{plant}/{name}/{dtype}", file=sys.stderr, flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
