"""The Flax NNX drop-in on a data-parallel mesh, against optax.MultiSteps.

On meshes of each of ``--devices`` simulated CPU devices (one ``data``
mesh axis; params replicated, each micro-batch split over it; 1 and 2 by
default, in one process), three ``nnx.jit`` steps of a tanh MLP, model and
optimizer donated, and the step written by hand:

* ``MultiSteps``: ``nnx.Optimizer(model, optax.MultiSteps(adam, k))`` with
  ``nnx.value_and_grad``: the trainer before the switch;
* ``drop-in``: ``optax_accum.flax.Optimizer(model, accumulate(adam, k))``
  with ``nnx.value_and_grad``: the one-name swap (the gradient is still
  all-reduced on every micro-batch);
* ``drop-in+deferred``: ``accumulate(adam, k, axis_name="data")`` with
  ``optax_accum.flax.local_value_and_grad``: the NNX guide's data-parallel
  recipe (one all-reduce per cycle, in the call that ends it);
* ``hand-written``: the README's step on the model's params as a pytree
  (``nnx.split``): ``jax.jit`` donating params and state,
  ``optax_accum.apply_updates``, and on several devices
  ``optax_accum.distributed.local_value_and_grad`` with
  ``accumulate(..., axis_name="data")``: the floor the drop-ins aim at.

Each turn runs one cycle of k calls and times every call; the micro-step
time is the median of the calls that do not end the cycle. Reported:
``MultiSteps``' micro-step time over each variant's (median over repeats,
min-max), and, read from each compiled step, its temporary memory, its
parameter-sized copies and the bytes it all-reduces on every call::

  python benchmarks/bench_flax_mesh.py [--devices 1 2] [--width 1024]
"""

import functools
import sys
import time
from typing import Any

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.inspect import _program

VARIANTS = ("MultiSteps", "drop-in", "drop-in+deferred", "hand-written")
TARGETS = {
  "deferred_speedup": _common.Target(
    "MultiSteps micro / deferred",
    "MultiSteps' micro-step time over the deferred drop-in's",
    ">=",
    1.5,
  ),
}


def parse_args(argv: list[str] | None = None) -> Any:
  parser = _common.benchmark_parser(__doc__.splitlines()[0])
  parser.add_argument(
    "--devices",
    type=_common.positive_int,
    nargs="+",
    default=[1, 2],
    help="mesh sizes, each timed in this one process",
  )
  parser.add_argument(
    "--width", type=_common.positive_int, default=1024, help="layer width"
  )
  parser.add_argument(
    "--layers", type=_common.positive_int, default=2, help="square layers"
  )
  parser.add_argument(
    "--micro-batch",
    type=_common.positive_int,
    default=32,
    help="rows per micro-batch, over all devices",
  )
  parser.add_argument("--k", type=_common.positive_int, default=4)
  parser.add_argument(
    "--strict", action="store_true", help="exit 1 if the target fails"
  )
  _common.add_run_arguments(parser, rounds=10, warmup=1)
  return parser.parse_args(argv)


def _model(args: Any) -> nnx.Module:
  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List(
        [
          nnx.Linear(args.width, args.width, rngs=rngs)
          for _ in range(args.layers)
        ]
      )
      self.out = nnx.Linear(args.width, 8, rngs=rngs)

    def __call__(self, x):
      for layer in self.layers:
        x = jnp.tanh(layer(x))
      return self.out(x)

  return MLP(nnx.Rngs(0))


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _nnx_step(name: str, args: Any, model: nnx.Module):
  """The NNX variants: the optimizer and the donated ``nnx.jit`` step."""
  if name == "MultiSteps":
    tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=args.k)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  else:
    axis = "data" if name == "drop-in+deferred" else None
    tx = optax_accum.accumulate(optax.adam(1e-3), args.k, axis_name=axis)
    optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
  if name == "drop-in+deferred":
    grad_fn = optax_accum.flax.local_value_and_grad(loss_fn, axis_name="data")
  else:
    grad_fn = nnx.value_and_grad(loss_fn)

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def step(model, optimizer, x, y):
    loss, grads = grad_fn(model, x, y)
    optimizer.update(model, grads)
    return loss

  return step, (model, optimizer)


def _hand_written_step(args: Any, model: nnx.Module, devices: int):
  """The README's step over the params pytree (donated), deferring the
  reduction on several devices."""
  graphdef, params = nnx.split(model, nnx.Param)

  def pure_loss(params, x, y):
    return loss_fn(nnx.merge(graphdef, params), x, y)

  axis = "data" if devices > 1 else None
  tx = optax_accum.accumulate(optax.adam(1e-3), args.k, axis_name=axis)
  if axis:
    grad_fn = optax_accum.distributed.local_value_and_grad(
      pure_loss, axis_name=axis
    )
  else:
    grad_fn = jax.value_and_grad(pure_loss)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, x, y):
    loss, grads = grad_fn(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax_accum.apply_updates(params, updates, state), state, loss

  return step, [params, tx.init(params)]


def prepare(name: str, args: Any, mesh: Any, batch: tuple) -> dict[str, Any]:
  """The variant's call (one step, its carried state updated) and its
  compiled facts."""
  devices = mesh.devices.size
  with jax.set_mesh(mesh):
    model = _model(args)
    if name == "hand-written":
      step, carried = _hand_written_step(args, model, devices)
    else:
      step, carried = _nnx_step(name, args, model)
    compiled = step.lower(*carried, *batch).compile()
  # nnx.jit's stage holds jax's Compiled; jax.jit's is it.
  compiled = getattr(compiled, "compiled", compiled)

  def call():
    with jax.set_mesh(mesh):
      out = step(*carried, *batch)
    if name == "hand-written":  # the donated state, carried
      carried[:] = out[:2]
    return out

  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  largest = max(p.nbytes for p in params)
  every_call = [
    c
    for c in optax_accum.inspect.collectives(compiled)
    if c.opcode == "all-reduce" and c.unconditional
  ]
  return {
    "call": call,
    "facts": {
      "param_bytes": sum(p.nbytes for p in params),
      "temp_bytes": _common.compiled_memory(compiled)["temp"],
      "copies": len(_program.Program(compiled).copies(min_bytes=largest // 2)),
      "all_reduced_every_call": sum(c.bytes for c in every_call),
    },
  }


def one_cycle(variant: dict[str, Any], k: int):
  """Times the k calls of one cycle: (micro-step ms, emitting step ms)."""
  times = []
  for _ in range(k):
    start = time.perf_counter()
    # The loss is an output of the same program: ready with the rest.
    jax.block_until_ready(variant["call"]())
    times.append(1e3 * (time.perf_counter() - start))
  micro = _common.median(times[:-1]) if k > 1 else None
  return micro, times[-1]


def _batch(mesh: Any, args: Any) -> tuple:
  rng = np.random.default_rng(0)
  return tuple(
    jax.device_put(
      rng.normal(size=(args.micro_batch, d)).astype(np.float32),
      NamedSharding(mesh, P("data")),
    )
    for d in (args.width, 8)
  )


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  _common.set_cpu_devices(max(args.devices))
  cases = [(n, name) for n in args.devices for name in VARIANTS]
  total = len(cases) + args.repeats * (args.warmup + args.rounds)
  with _common.Run("bench_flax_mesh", args, total) as run:
    run.stage("compiling")
    variants = {}
    for n, name in cases:
      mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
      variants[n, name] = prepare(name, args, mesh, _batch(mesh, args))
      one_cycle(variants[n, name], args.k)  # the call's compile
      run.advance()
    run.stage("timing")
    turns = {
      case: functools.partial(lambda v, _: one_cycle(v, args.k), variant)
      for case, variant in variants.items()
    }
    repeats = run.rounds(turns)
  results = {str(n): _results(n, variants, repeats) for n in args.devices}
  most = results[str(max(args.devices))]
  payload = run.payload(
    config={"param_bytes": most["MultiSteps"]["param_bytes"]},
    targets=_common.describe_targets(TARGETS),
    results=results,
    checks=_common.check_targets(
      TARGETS,
      {"deferred_speedup": most["drop-in+deferred"]["speedup"]["median"]},
    ),
  )
  run.finish(payload, markdown, figure, lines=[_console(payload)])
  if args.strict and not all(c["pass"] for c in payload["checks"].values()):
    sys.exit(1)
  return payload


def _results(devices, variants, repeats) -> dict[str, Any]:
  """Per variant on `devices` devices: its compiled facts, its times and
  MultiSteps' over them, each a spread over repeats."""
  out = {}
  for name in VARIANTS:
    times = [r[devices, name] for r in repeats]
    micro = [_common.median([t[0] for t in ts]) for ts in times]
    emit = [_common.median([t[1] for t in ts]) for ts in times]
    base = [
      _common.median([t[0] for t in r[devices, "MultiSteps"]]) for r in repeats
    ]
    out[name] = {
      **variants[devices, name]["facts"],
      "micro_ms": _common.spread(micro),
      "emit_ms": _common.spread(emit),
      "speedup": _common.spread(
        [b / m for b, m in zip(base, micro, strict=True)]
      ),
    }
  return out


HEADER = (
  "devices",
  "variant",
  "micro-step ms",
  "emitting step ms",
  "MultiSteps micro / this",
  "temp MB",
  "param-sized copies",
  "MB all-reduced every call",
)


def _rows(payload: dict[str, Any]) -> list[list[str]]:
  mb = _common.MB
  return [
    [
      devices,
      name,
      _common.fmt_spread(r["micro_ms"]),
      _common.fmt_spread(r["emit_ms"]),
      _common.fmt_spread(r["speedup"], suffix="x"),
      f"{r['temp_bytes'] / mb:.2f}",
      str(r["copies"]),
      f"{r['all_reduced_every_call'] / mb:.2f}",
    ]
    for devices, rows in payload["results"].items()
    for name, r in rows.items()
  ]


def _config(payload: dict[str, Any]) -> str:
  a = payload["args"]
  return (
    f"{'/'.join(map(str, a['devices']))} CPU devices, {a['layers']} tanh"
    f" layers of width"
    f" {a['width']} ({payload['config']['param_bytes'] / _common.MB:.1f} MB"
    f" of float32 params), micro-batch {a['micro_batch']}, k={a['k']},"
    f" adam; median (min-max) over {a['repeats']} repeats of"
    f" {a['rounds']} rounds."
  )


def markdown(payload: dict[str, Any]) -> str:
  checks = "".join(
    f"- {c['what']}: {c['value']:.2f} (target {c['target']}):"
    f" {'PASS' if c['pass'] else 'FAIL'}\n"
    for c in payload["checks"].values()
  )
  return _common.markdown_page(
    "bench_flax_mesh: the NNX drop-in on a data-parallel mesh",
    payload["machine"],
    _config(payload),
    _common.markdown_table(HEADER, _rows(payload)),
    checks,
  )


def _console(payload: dict[str, Any]) -> Any:
  return _common.console_table(_config(payload), HEADER, _rows(payload))


def figure(payload: dict[str, Any]) -> Any:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 3))
  cells = [
    (f"{n}: {name}", r["micro_ms"])
    for n, rows in payload["results"].items()
    for name, r in rows.items()
  ]
  medians = [s["median"] for _, s in cells]
  errors = [
    [s["median"] - s["min"] for _, s in cells],
    [s["max"] - s["median"] for _, s in cells],
  ]
  ax.bar([c for c, _ in cells], medians, yerr=errors, capsize=4)
  ax.tick_params(axis="x", labelrotation=45, labelsize=7)
  ax.set_ylabel("micro-step ms")
  _common.figure_title(fig, payload)
  return fig


if __name__ == "__main__":
  main()
