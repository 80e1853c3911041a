"""Compiled steps for CPU, an H100 and a TPU v5e, read without the devices.

Each variant's micro-step and emitting call is compiled ahead of time for
the target (``optax_accum._targets``: the CUDA plugin and libtpu compile for
an H100 or a TPU slice on a machine that has neither) and read from the
compiled program (``optax_accum._program``): conditionals kept, whether an
optimizer op runs on every call, the kernels a micro-step and an emitting
call run and their bytes, parameter-sized copies, whether each
weight-gradient GEMM adds into the accumulator itself, compiled memory, the
collectives and, on an H100, whether the conditionals run inside CUDA
command buffers. Nothing is timed: every figure is a byte count or a
structure, the same on any machine.

The model: ``--layers`` dense ``--width``-square tanh layers, a batch of
``--batch`` rows per device, adam, ``every_k=8``. Variants: ``plain`` (the
inner optimizer alone; data parallel over the devices), ``floor`` (the
gradient added into a donated accumulator, nothing else), ``accumulate``
with ``optax.apply_updates`` and with ``optax_accum.apply_updates``, the
static cycle (``update(..., emit=False)`` / ``emit=True``),
``optax.MultiSteps`` and ``chain(adam, apply_every(k))``.

Needs the accelerator compilers on the path and ``JAX_PLATFORMS=cpu``::

  JAX_PLATFORMS=cpu PYTHONPATH=.venv/accel python benchmarks/bench_compiled.py

(``make bench`` does this). ``tests/test_accelerators.py`` compiles the
same steps through :func:`measure`.
"""

import argparse
import dataclasses
import math
import pathlib
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _collectives as _collectives_lib
from optax_accum import _hlo, _program, _targets

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

# The "cpu" target's distributed engines run on 8 simulated devices (set
# before the backend starts; the accelerator targets bring their own).
jax.config.update("jax_num_cpu_devices", 8)

AXIS = "data"
VARIANTS = ("plain", "floor", "accumulate", "MultiSteps", "apply_every")
APPLIES = ("optax", "accum")  # optax.apply_updates, optax_accum.apply_updates
EMITS = ("traced", "micro", "emit")  # emit=None / False / True
ENGINES = ("local", "shard_map", "unreduced", "hsdp", "fsdp", "fsdp1d")
# HSDP: params sharded over FSDP_AXIS within a replica, replicated over
# REPLICA_AXIS (two replicas); the reduction is deferred over REPLICA_AXIS.
REPLICA_AXIS, FSDP_AXIS = "replica", "fsdp"
# Engines under plain jit on an explicit mesh, params sharded: (mesh axes,
# the params' spec, the axis accumulate defers over or None).
SHARDED = {
  "hsdp": ((REPLICA_AXIS, FSDP_AXIS), P(FSDP_AXIS), REPLICA_AXIS),
  "fsdp": ((REPLICA_AXIS, FSDP_AXIS), P(FSDP_AXIS), None),
  "fsdp1d": ((AXIS,), P(AXIS), AXIS),
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
ADAM_OPS = ("sqrt", "rsqrt")

# Compiler options a case may ask for by name.
XLA_OPTIONS = {
  "": {},
  # TPU: asynchronous all-reduces that start as soon as their operand is
  # ready (without them XLA:TPU combines all reductions into one at the
  # end, even for plain data parallelism).
  "tpu_async": {
    "xla_enable_async_all_reduce": True,
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
    "xla_jf_crs_combiner_threshold_in_bytes": 1048576,
  },
  # GPU: collectives in CUDA command buffers too (off by default, which
  # keeps a conditional holding an all-reduce out of command buffers).
  "gpu_command_buffer_collectives": {
    "xla_gpu_enable_command_buffer": (
      "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,COLLECTIVES"
    ),
  },
}


@dataclasses.dataclass(frozen=True)
class Case:
  """One compiled step.

  Attributes:
    target: ``"cpu"`` or a name of ``optax_accum._targets.TARGETS``.
    variant: one of :data:`VARIANTS`.
    apply: how the updates are applied (accumulate only): ``"optax"`` or
      ``"accum"`` (``optax_accum.apply_updates``).
    emit: ``"traced"`` (the default decision on the device), or the static
      cycle's ``"micro"`` (``emit=False``) or ``"emit"`` (``emit=True``).
    engine: ``"local"``, or the data-parallel ``"shard_map"`` or
      ``"unreduced"`` (plain ``jit``) engine over all the target's devices,
      or, under plain ``jit`` with params sharded (:data:`SHARDED`):
      ``"hsdp"`` on a ``("replica", "fsdp")`` mesh of two replicas, params
      sharded over ``"fsdp"``, deferred over ``"replica"`` (its ``plain``
      variant is FSDP over every device, reducing every call); ``"fsdp"``,
      the same mesh and params reduced every call; ``"fsdp1d"``, params
      sharded over the one data axis and the reduction deferred over it.
    dtype: the params' dtype, ``"f32"`` or ``"bf16"``.
    weight: pass ``weight=`` (traced) to ``update``.
    skip: ``skip_nonfinite=True``.
    noise: ``track_noise_scale=True``.
    cublas: cuBLAS GEMMs instead of Triton's (H100).
    gradients: ``accumulate(gradients=...)``: ``"sum"`` for gradients of a
      loss summed over the micro-batch (added without a multiply).
    reduce_dtype: ``""``, or ``"bf16"``: ``accumulate(reduce_dtype=)``, the
      dtype the deferred reduction crosses devices in.
    xla: a name of :data:`XLA_OPTIONS`, compiler options to add.
  """

  target: str = "h100"
  variant: str = "accumulate"
  apply: str = "optax"
  emit: str = "traced"
  engine: str = "local"
  dtype: str = "f32"
  weight: bool = False
  skip: bool = False
  noise: bool = False
  cublas: bool = False
  gradients: str = "mean"
  reduce_dtype: str = ""
  xla: str = ""
  k: int = 8
  width: int = 2048
  layers: int = 4
  batch: int = 16

  @property
  def name(self) -> str:
    parts = [self.target, self.variant, self.engine, self.dtype]
    if self.variant == "accumulate":
      parts += [self.apply, self.emit]
    parts += [
      f for f in ("weight", "skip", "noise", "cublas") if getattr(self, f)
    ]
    parts += ["sum-gradients"] if self.gradients == "sum" else []
    parts += [f"{self.reduce_dtype}-wire"] if self.reduce_dtype else []
    parts += [self.xla] if self.xla else []
    return "-".join(parts)


# ----------------------------------------------------------------------------
# The model.
# ----------------------------------------------------------------------------


def loss_fn(params, batch):
  h, y = batch
  if not jax.sharding.get_abstract_mesh().empty:
    # Under an explicit mesh: FSDP's all-gather of the sharded params.
    params = jax.tree.map(lambda w: jax.sharding.reshard(w, P()), params)
  for name in sorted(params):
    h = jnp.tanh(h @ params[name])
  return jnp.mean(jnp.square((h - y).astype(jnp.float32)))


def _devices(case: Case) -> int:
  if case.target == "cpu":
    return jax.device_count() if case.engine != "local" else 1
  return _targets.TARGETS[case.target].devices


def _mesh(case: Case, explicit: bool = False):
  n = _devices(case)
  if case.engine in SHARDED:  # always explicit: unreduced over an axis
    names = SHARDED[case.engine][0]
    shape = (2, n // 2) if len(names) == 2 else (n,)
    if case.target != "cpu":
      return _targets.mesh(case.target, shape, names, explicit=True)
    devices = np.asarray(jax.devices()[:n]).reshape(shape)
    types = (jax.sharding.AxisType.Explicit,) * len(names)
    return jax.sharding.Mesh(devices, names, axis_types=types)
  if case.target == "cpu":
    devices = jax.devices()[:n]
    types = (jax.sharding.AxisType.Explicit,) if explicit else None
    return jax.sharding.Mesh(devices, (AXIS,), axis_types=types)
  return _targets.mesh(case.target, (n,), (AXIS,), explicit=explicit)


def _spec(mesh, shape, dtype, spec=None):
  spec = P() if spec is None else spec
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _params_and_batch(case: Case, mesh):
  dtype = DTYPES[case.dtype]
  rows = case.batch * _devices(case)
  param_spec = SHARDED[case.engine][1] if case.engine in SHARDED else P()
  params = {
    f"w{i}": _spec(mesh, (case.width, case.width), dtype, param_spec)
    for i in range(case.layers)
  }
  batch_spec = P(AXIS)  # the rows split over every device
  if case.engine == "local":
    batch_spec = P()
  elif case.engine in SHARDED:
    batch_spec = P(SHARDED[case.engine][0])
  batch = tuple(
    _spec(mesh, (rows, case.width), dtype, batch_spec) for _ in range(2)
  )
  return params, batch


def param_bytes(case: Case) -> int:
  return case.layers * case.width**2 * jnp.dtype(DTYPES[case.dtype]).itemsize


def accumulator_bytes(case: Case) -> int:
  return case.layers * case.width**2 * 4


def _transformation(case: Case):
  inner = optax.adam(1e-3)
  if case.variant == "plain":
    return inner
  if case.variant == "MultiSteps":
    return optax.MultiSteps(inner, case.k).gradient_transformation()
  if case.variant == "apply_every":
    return optax.chain(inner, optax.apply_every(case.k))
  axis = None if case.engine == "local" else AXIS
  if case.engine in SHARDED:
    axis = SHARDED[case.engine][2]
  return optax_accum.accumulate(
    inner,
    case.k,
    skip_nonfinite=case.skip,
    track_noise_scale=case.noise,
    axis_name=axis,
    gradients=case.gradients,
    reduce_dtype=DTYPES[case.reduce_dtype] if case.reduce_dtype else None,
  )


def _update_and_apply(case: Case, tx, grads, state, params, weight):
  """`tx.update`, then the case's way of applying the updates."""
  if case.variant != "accumulate":
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  options = {"weight": weight} if case.weight else {}
  if case.emit != "traced":
    options["emit"] = case.emit == "emit"
  updates, state = tx.update(grads, state, params, **options)
  if case.apply == "accum":
    return optax_accum.apply_updates(params, updates, state), state
  return optax.apply_updates(params, updates), state


def _floor_step(case: Case, mesh):
  """The gradient added into a donated accumulator, in a step that takes
  and returns the params (donated, untouched) as any train step does: what
  any accumulation pays at least."""
  params, batch = _params_and_batch(case, mesh)
  acc = jax.tree.map(lambda p: _spec(mesh, p.shape, jnp.float32), params)

  def add(acc, grads):
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)

  if case.engine == "local":

    def step(p, acc, b):
      return p, add(acc, jax.grad(loss_fn)(p, b))

    return jax.jit(step, donate_argnums=(0, 1)), (params, acc, batch)
  if case.engine in SHARDED and case.engine != "hsdp":
    raise ValueError(f"no floor for engine {case.engine!r}")
  if case.engine in ("unreduced", "hsdp"):
    axis = REPLICA_AXIS if case.engine == "hsdp" else AXIS
    grad_fn = optax_accum.local_value_and_grad(loss_fn, axis_name=axis)
    parts = (FSDP_AXIS,) if case.engine == "hsdp" else ()
    acc = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(
        a.shape,
        a.dtype,
        sharding=NamedSharding(mesh, P(*parts, unreduced={axis})),
      ),
      acc,
    )

    def step(p, acc, b):
      return p, add(acc, grad_fn(p, b)[1])

    jitted = jax.jit(step, donate_argnums=(0, 1))
    return _with_mesh(mesh, jitted), (params, acc, batch)
  local = P(AXIS)  # shard_map: each device's own sum, on a device axis.
  acc = jax.tree.map(
    lambda a: _spec(mesh, (_devices(case), *a.shape), a.dtype, local), acc
  )

  def body(p, acc, b):
    grads = jax.grad(loss_fn)(lax.pcast(p, AXIS, to="varying"), b)
    return p, jax.tree.map(lambda a, g: a + g[None].astype(a.dtype), acc, grads)

  step = jax.shard_map(
    body, mesh=mesh, in_specs=(P(), local, P(AXIS)), out_specs=(P(), local)
  )
  return jax.jit(step, donate_argnums=(0, 1)), (params, acc, batch)


def _state_specs(tx, params, mesh):
  shapes = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params
  )
  return optax_accum.shard_map_specs(jax.eval_shape(tx.init, shapes), AXIS)


def build(case: Case):
  """``(jitted step, arguments)`` of `case`, ready to lower."""
  explicit = case.engine == "unreduced" and case.variant != "plain"
  mesh = _mesh(case, explicit=explicit)
  if case.variant == "floor":
    return _floor_step(case, _mesh(case, explicit=_explicit(case)))
  params, batch = _params_and_batch(case, mesh)
  tx = _transformation(case)
  weight = _spec(mesh, (), jnp.float32)

  if case.engine in SHARDED:
    return _sharded_step(case, mesh, tx, params, batch, weight)
  if case.engine == "local" or case.variant == "plain":
    # Plain data parallel for the distributed engines' baseline: the batch
    # is sharded, jit all-reduces the gradient on every call.
    state = jax.tree.map(
      lambda s: _spec(mesh, s.shape, s.dtype), jax.eval_shape(tx.init, params)
    )

    def step(params, state, batch, weight):
      grads = jax.grad(loss_fn)(params, batch)
      return _update_and_apply(case, tx, grads, state, params, weight)

    return jax.jit(step, donate_argnums=(0, 1)), (params, state, batch, weight)

  if case.engine == "unreduced":
    with jax.set_mesh(mesh):
      shardings = optax_accum.state_shardings(tx, params)
      state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(tx.init, params),
        shardings,
      )
    grad_fn = optax_accum.local_value_and_grad(loss_fn, axis_name=AXIS)

    def step(params, state, batch, weight):
      _, grads = grad_fn(params, batch)
      return _update_and_apply(case, tx, grads, state, params, weight)

    return _with_mesh(mesh, jax.jit(step, donate_argnums=(0, 1))), (
      params,
      state,
      batch,
      weight,
    )

  specs = _state_specs(tx, params, mesh)
  init = jax.shard_map(
    lambda p: optax_accum.add_device_axis(tx.init(p)),
    mesh=mesh,
    in_specs=P(),
    out_specs=specs,
  )
  state = jax.eval_shape(init, params)

  def body(params, state, batch, weight):
    grads = jax.grad(loss_fn)(lax.pcast(params, AXIS, to="varying"), batch)
    state = optax_accum.drop_device_axis(state)
    params, state = _update_and_apply(case, tx, grads, state, params, weight)
    return params, optax_accum.add_device_axis(state)

  step = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P(), specs, P(AXIS), P()),
    out_specs=(P(), specs),
  )
  return jax.jit(step, donate_argnums=(0, 1)), (params, state, batch, weight)


def _explicit(case: Case) -> bool:
  return case.engine in ("unreduced", *SHARDED)


def _sharded_step(case: Case, mesh, tx, params, batch, weight):
  """Params sharded, plain ``jit``: HSDP (the gradient reduce-scattered
  over "fsdp" on every call, over "replica" deferred to the emitting
  call), FSDP reducing every call, or 1-D FSDP deferred; ``plain``: FSDP
  over every device, reduced on every call."""
  with jax.set_mesh(mesh):
    shardings = optax_accum.state_shardings(tx, params)
  state = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
    jax.eval_shape(tx.init, params),
    shardings,
  )
  deferred = SHARDED[case.engine][2]
  if case.variant == "plain" or deferred is None:
    grad_fn = jax.value_and_grad(loss_fn)
  else:
    grad_fn = optax_accum.local_value_and_grad(loss_fn, axis_name=deferred)

  def step(params, state, batch, weight):
    _, grads = grad_fn(params, batch)
    return _update_and_apply(case, tx, grads, state, params, weight)

  jitted = jax.jit(step, donate_argnums=(0, 1))
  return _with_mesh(mesh, jitted), (params, state, batch, weight)


class _with_mesh:
  """A jitted function lowered under ``jax.set_mesh(mesh)``."""

  def __init__(self, mesh, fn):
    self.mesh, self.fn = mesh, fn

  def lower(self, *args):
    with jax.set_mesh(self.mesh):
      return self.fn.lower(*args)


def compiler_options(case: Case, dump_dir: str | None = None) -> dict:
  options = dict(XLA_OPTIONS[case.xla])
  if case.cublas:
    options["xla_gpu_enable_triton_gemm"] = False
  if dump_dir is not None:
    options["xla_dump_to"] = dump_dir
  return options


def compile_case(case: Case, dump_dir: str | None = None):
  """The compiled step of `case` (`dump_dir`: XLA's dump, for the thunks)."""
  step, args = build(case)
  return step.lower(*args).compile(
    compiler_options=compiler_options(case, dump_dir) or None
  )


# ----------------------------------------------------------------------------
# What the compiled program says.
# ----------------------------------------------------------------------------


def measure(case: Case) -> dict[str, Any]:
  """The facts of `case`'s compiled step, as JSON-able values."""
  on_gpu = (
    case.target != "cpu" and _targets.TARGETS[case.target].platform == "cuda"
  )
  with tempfile.TemporaryDirectory() as dump:
    compiled = compile_case(case, dump if on_gpu else None)
    thunks = _program.thunk_sequence(dump) if on_gpu else ""
  program = _program.Program(compiled)
  leaf = case.width**2 * jnp.dtype(DTYPES[case.dtype]).itemsize
  wgrad = (
    f"{'f32' if case.dtype == 'f32' else 'bf16'}[{case.width},{case.width}]"
  )
  facts = {
    "case": dataclasses.asdict(case),
    "name": case.name,
    "conditionals": program.conditionals(),
    "adam_every_call": bool(program.runs_every_call(ADAM_OPS)),
    "bytes": {
      path: program.kernel_bytes(path)
      for path in (_program.MICRO_STEP, _program.EMITTING)
    },
    "copies": {
      path: [
        [k.name, k.result_bytes]
        for k in program.copies(path, min_bytes=leaf // 2)
      ]
      for path in (_program.MICRO_STEP, _program.EMITTING)
    },
    "held": [
      [k.name, k.result_bytes] for k in program.held(min_bytes=leaf // 2)
    ],
    "memory": _common.compiled_memory(compiled),
    "param_bytes": param_bytes(case),
    "accumulator_bytes": accumulator_bytes(case),
    "wgrad_gemms": [
      {"name": k.name, "fused": fused, "bytes": k.bytes}
      for shape in {wgrad, f"f32[{case.width},{case.width}]"}
      for k, fused in program.gemms(shape)
    ],
    "collectives": _collectives(case, compiled),
  }
  if not facts["conditionals"]:  # Where the reductions start.
    facts["overlap"] = program.overlap(wgrad, min_bytes=leaf // 2)
  if on_gpu:
    total, inside = _program.conditionals_in_command_buffers(thunks)
    facts["command_buffer"] = {"conditionals": total, "inside": inside}
  return facts


def _collectives(case: Case, compiled) -> list[dict[str, Any]]:
  """Each collective: opcode, bytes on one device, where it runs (every
  call, the emitting branch, another branch) and the mesh axes its device
  groups span."""
  text = compiled.as_text()
  records = optax_accum.collectives(text)
  mesh = _mesh(case, explicit=_explicit(case))
  coordinates = _collectives_lib._coordinates(
    mesh, compiled, _hlo.HloModule(text)
  )
  return [
    {
      "opcode": c.opcode,
      "bytes": c.bytes,
      "where": "every call"
      if c.unconditional
      else ("emitting" if c.emitting else "other"),
      "axes": list(_collectives_lib._axes_of(c, mesh, coordinates)),
    }
    for c in records
  ]


def ratio(facts: dict, floor: dict, path: str = _program.MICRO_STEP) -> float:
  """Kernel bytes of a call of `facts` over the floor's."""
  return facts["bytes"][path] / floor["bytes"][_program.MICRO_STEP]


def extra_memory(facts: dict, plain: dict) -> float:
  """Footprint over the plain inner step's, in accumulator bytes."""
  extra = facts["memory"]["footprint"] - plain["memory"]["footprint"]
  return extra / facts["accumulator_bytes"]


# ----------------------------------------------------------------------------
# The benchmark.
# ----------------------------------------------------------------------------


def cases_for(target: str, args: argparse.Namespace) -> list[Case]:
  """The benchmark's rows for one target."""
  base = dict(
    target=target, width=args.width, layers=args.layers, batch=args.batch
  )
  out = []
  engines = (
    ("local",) if target in ("cpu", "h100") else ("shard_map", "unreduced")
  )
  for dtype in args.dtypes:
    for engine in engines:
      common = dict(base, dtype=dtype, engine=engine)
      out.append(Case(variant="plain", **common))
      out.append(Case(variant="floor", **common))
      for apply in APPLIES:
        out.append(Case(apply=apply, **common))
      out.append(Case(apply="accum", emit="micro", **common))
      # On TPU the reductions start during the backward only with the
      # asynchronous collective options (XLA_OPTIONS["tpu_async"]).
      tpu = target.startswith("v5e")
      out.append(
        Case(
          apply="accum", emit="emit", xla="tpu_async" if tpu else "", **common
        )
      )
      if engine == "local":
        out.append(Case(variant="MultiSteps", **common))
        out.append(Case(variant="apply_every", **common))
  return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--targets",
    default="cpu,h100,h100x8,v5e_2x2",
    type=lambda s: [t for t in s.split(",") if t],
    help="cpu and/or names of optax_accum._targets.TARGETS",
  )
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=16, help="rows per device")
  parser.add_argument(
    "--dtypes", default="f32,bf16", type=lambda s: s.split(",")
  )
  parser.add_argument("--out", default=str(_common.RESULTS_DIR))
  args = parser.parse_args(argv)
  rows = []
  for target in args.targets:
    for case in cases_for(target, args):
      facts = measure(case)
      rows.append(facts)
      print(_summary(facts), flush=True)
  payload = {
    "machine": _common.machine_info(),
    "args": vars(args),
    "rows": rows,
  }
  markdown = render(payload)
  _common.write_outputs(
    args.out, "bench_compiled", payload, markdown, _figure(payload)
  )
  return payload


def _summary(facts: dict) -> str:
  mib = 2**20
  return (
    f"{facts['name']:55s} conds={facts['conditionals']}"
    f" adam_every_call={facts['adam_every_call']}"
    f" micro={facts['bytes']['micro-step'] / mib:.1f}MiB"
    f" emit={facts['bytes']['emitting'] / mib:.1f}MiB"
    f" copies={len(facts['copies']['micro-step'])}"
    f" held={len(facts['held'])}"
    f" temp={facts['memory']['temp'] / mib:.1f}MiB"
  )


def _find(rows, **match):
  for row in rows:
    if all(row["case"][k] == v for k, v in match.items()):
      return row
  return None


def render(payload: dict) -> str:
  """The Markdown tables: one row per step, ratios to the same target's
  floor (kernel bytes) and plain step (memory)."""
  rows = payload["rows"]
  header = [
    "target",
    "engine",
    "dtype",
    "step",
    "conditionals",
    "adam every call",
    "micro-step bytes / floor",
    "emitting bytes / floor",
    "param-sized copies (micro-step)",
    "weight-gradient GEMMs with the add fused",
    "extra memory / accumulator",
  ]
  table = []
  for row in rows:
    c = row["case"]
    key = dict(target=c["target"], engine=c["engine"], dtype=c["dtype"])
    floor = _find(rows, variant="floor", **key)
    plain = _find(rows, variant="plain", **key)
    gemms = row["wgrad_gemms"]
    fused = f"{sum(g['fused'] for g in gemms)}/{len(gemms)}" if gemms else "-"
    step = c["variant"]
    if step == "accumulate":
      step += (
        " + "
        + {
          "optax": "optax.apply_updates",
          "accum": "optax_accum.apply_updates",
        }[c["apply"]]
      )
      if c["emit"] != "traced":
        step += f" (emit={c['emit'] == 'emit'})"
    table.append(
      [
        c["target"],
        c["engine"],
        c["dtype"],
        step,
        row["conditionals"],
        "yes" if row["adam_every_call"] else "no",
        _common.fmt(ratio(row, floor)) if floor else "-",
        _common.fmt(ratio(row, floor, "emitting")) if floor else "-",
        len(row["copies"]["micro-step"]),
        fused,
        _common.fmt(extra_memory(row, plain)) if plain else "-",
      ]
    )
  return (
    "Compiled without a device (not timed): "
    + _common.machine_line(payload["machine"])
    + "\n\n"
    + _common.markdown_table(header, table)
  )


def _figure(payload: dict):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in payload["rows"] if r["case"]["variant"] != "floor"]
  fig, ax = plt.subplots(figsize=(10, 0.3 * len(rows) + 1))
  labels, values = [], []
  for r in rows:
    c = r["case"]
    floor = _find(
      payload["rows"],
      variant="floor",
      target=c["target"],
      engine=c["engine"],
      dtype=c["dtype"],
    )
    labels.append(r["name"])
    values.append(ratio(r, floor) if floor else math.nan)
  ax.barh(labels, values)
  ax.axvline(1.0, color="k", lw=0.8)
  ax.set_xlabel("micro-step kernel bytes / floor (compiled, not timed)")
  ax.invert_yaxis()
  return fig


if __name__ == "__main__":
  main()
