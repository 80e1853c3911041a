"""Compiles the NNX guide's data-parallel step for 8 H100s without the
devices; prints its facts and the floor's as JSON.

Run by ``tests/test_flax_mesh.py`` in a subprocess, with ``JAX_PLATFORMS=cpu``
and the accelerator compilers on ``PYTHONPATH`` (``tests/_common.accel_env``)::

  python tests/_flax_mesh_accel_worker.py

The step is the guide's (``docs/guides/flax.md``, "On a data-parallel mesh"):
``optax_accum.flax.Optimizer`` around ``accumulate(adam, 8,
axis_name="data")``, the gradient from ``optax_accum.flax.local_value_and_grad``
(and, as the control, ``reduced``: from ``nnx.value_and_grad``), under
``nnx.jit`` with the model and the optimizer donated; the model is
``bench_compiled``'s (4 bias-free 2048-square tanh layers, 16 rows per
device), built abstractly (``nnx.eval_shape``) on the target's mesh. The
floor is ``bench_compiled``'s for the unreduced engine: the local gradient
added into a donated accumulator.
"""

import functools
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _compiled_steps  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_accum  # noqa: E402
from optax_accum import targets  # noqa: E402
from optax_accum.inspect import _program  # noqa: E402

CASE = _compiled_steps.Case(
  target="h100x8", variant="floor", engine="unreduced"
)


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List(
      [
        nnx.Linear(CASE.width, CASE.width, use_bias=False, rngs=rngs)
        for _ in range(CASE.layers)
      ]
    )

  def __call__(self, h):
    for layer in self.layers:
      h = jnp.tanh(layer(h))
    return h


def loss_fn(model, x, y):
  return jnp.mean(jnp.square(model(x) - y))


def compile_step(deferred: bool):
  devices = targets.TARGETS[CASE.target].devices
  mesh = targets.mesh(CASE.target, (devices,), ("data",), explicit=True)
  axis_name = "data" if deferred else None
  with jax.set_mesh(mesh):

    def make():
      model = MLP(nnx.Rngs(0))
      tx = optax_accum.accumulate(optax.adam(1e-3), CASE.k, axis_name=axis_name)
      return model, optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(make)
  if deferred:
    grad_fn = optax_accum.flax.local_value_and_grad(loss_fn)
  else:
    grad_fn = nnx.value_and_grad(loss_fn)

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def dp_step(model, optimizer, x, y):
    loss, grads = grad_fn(model, x, y)
    optimizer.update(model, grads)
    return loss

  rows = CASE.batch * devices
  x = jax.ShapeDtypeStruct(
    (rows, CASE.width), jnp.float32, sharding=NamedSharding(mesh, P("data"))
  )
  with jax.set_mesh(mesh):
    return dp_step.lower(model, optimizer, x, x).compile().compiled


def facts(compiled, floor_bytes: int) -> dict:
  largest = CASE.width**2 * 4
  every_call = [
    c.bytes
    for c in optax_accum.inspect.collectives(compiled)
    if c.opcode in ("all-reduce", "reduce-scatter") and c.unconditional
  ]
  return {
    "micro_step_bytes": _program.Program(compiled).kernel_bytes(),
    "floor_bytes": floor_bytes,
    "copies": [
      c.name for c in _program.Program(compiled).copies(min_bytes=largest // 2)
    ],
    "reduced_every_call": sum(every_call),
    "param_bytes": CASE.layers * largest,
  }


def main() -> None:
  floor = _program.Program(_compiled_steps.compile_case(CASE)).kernel_bytes()
  out = {
    mode: facts(compile_step(deferred=mode == "deferred"), floor)
    for mode in ("deferred", "reduced")
  }
  print(json.dumps(out))


if __name__ == "__main__":
  main()
