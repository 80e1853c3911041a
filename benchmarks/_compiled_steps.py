"""The steps ``bench_compiled.py`` compiles: the model, each variant and
engine as a jitted step with its abstract arguments (nothing is allocated),
and the compiler options of a case.

``Case`` names one step; :func:`build` gives ``(jitted step, arguments)``
and :func:`compile_case` the compiled program, for the CPU or (without the
device, through ``optax_accum.targets``) an accelerator target. Used by
``bench_compiled.py``, ``_comm_sharded.py`` and the accelerator tests.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import targets

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
    target: ``"cpu"`` or a name of ``optax_accum.targets.TARGETS``.
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
    inner: the inner optimizer, ``"adam"`` or ``"clip_adamw"``
      (``chain(clip_by_global_norm(1), adamw)``).
    accumulator: ``""`` (float32, the default) or ``"bf16"``:
      ``accumulate(accumulator_dtype=)``.
    rounding: ``accumulate(rounding=)``, ``"nearest"`` or ``"stochastic"``
      (with a bf16 accumulator).
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
  inner: str = "adam"
  accumulator: str = ""
  rounding: str = "nearest"
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
    parts += [self.inner] if self.inner != "adam" else []
    parts += [f"{self.accumulator}-accumulator"] if self.accumulator else []
    parts += ["stochastic"] if self.rounding == "stochastic" else []
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
  return targets.TARGETS[case.target].devices


def _mesh(case: Case, explicit: bool = False):
  n = _devices(case)
  if case.engine in SHARDED:  # always explicit: unreduced over an axis
    names = SHARDED[case.engine][0]
    shape = (2, n // 2) if len(names) == 2 else (n,)
    if case.target != "cpu":
      return targets.mesh(case.target, shape, names, explicit=True)
    devices = np.asarray(jax.devices()[:n]).reshape(shape)
    types = (jax.sharding.AxisType.Explicit,) * len(names)
    return jax.sharding.Mesh(devices, names, axis_types=types)
  if case.target == "cpu":
    devices = jax.devices()[:n]
    types = (jax.sharding.AxisType.Explicit,) if explicit else None
    return jax.sharding.Mesh(devices, (AXIS,), axis_types=types)
  return targets.mesh(case.target, (n,), (AXIS,), explicit=explicit)


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
  itemsize = jnp.dtype(DTYPES[case.accumulator or "f32"]).itemsize
  return case.layers * case.width**2 * itemsize


def _transformation(case: Case):
  inner = optax.adam(1e-3)
  if case.inner == "clip_adamw":
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
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
    accumulator_dtype=DTYPES[case.accumulator or "f32"],
    rounding=case.rounding,
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
    grad_fn = optax_accum.distributed.local_value_and_grad(
      loss_fn, axis_name=axis
    )
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


def build(case: Case):
  """``(jitted step, arguments)`` of `case`, ready to lower."""
  explicit = case.engine == "unreduced" and case.variant != "plain"
  mesh = _mesh(case, explicit=explicit)
  if case.variant == "floor":
    return _floor_step(case, mesh)
  params, batch = _params_and_batch(case, mesh)
  tx = _transformation(case)
  weight = _spec(mesh, (), jnp.float32)

  if case.engine in SHARDED:
    deferred = SHARDED[case.engine][2]
    return _sharded_step(case, mesh, tx, params, batch, weight, deferred)
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
    return _sharded_step(case, mesh, tx, params, batch, weight, AXIS)

  shapes = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params
  )
  specs = optax_accum.distributed.shard_map_specs(
    jax.eval_shape(tx.init, shapes), AXIS
  )
  init = jax.shard_map(
    lambda p: optax_accum.distributed.add_device_axis(tx.init(p)),
    mesh=mesh,
    in_specs=P(),
    out_specs=specs,
  )
  state = jax.eval_shape(init, params)

  def body(params, state, batch, weight):
    grads = jax.grad(loss_fn)(lax.pcast(params, AXIS, to="varying"), batch)
    state = optax_accum.distributed.drop_device_axis(state)
    params, state = _update_and_apply(case, tx, grads, state, params, weight)
    return params, optax_accum.distributed.add_device_axis(state)

  step = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P(), specs, P(AXIS), P()),
    out_specs=(P(), specs),
  )
  return jax.jit(step, donate_argnums=(0, 1)), (params, state, batch, weight)


def _explicit(case: Case) -> bool:
  return case.engine in ("unreduced", *SHARDED)


def _sharded_step(case: Case, mesh, tx, params, batch, weight, deferred):
  """Plain ``jit`` on an explicit mesh, the reduction deferred over the
  axis `deferred` (None: reduced every call): the unreduced engine
  (replicated params), or params sharded (:data:`SHARDED`): HSDP (the
  gradient reduce-scattered over "fsdp" on every call, over "replica"
  deferred to the emitting call), FSDP reducing every call, or 1-D FSDP
  deferred; ``plain``: FSDP over every device, reduced on every call."""
  with jax.set_mesh(mesh):
    shardings = optax_accum.distributed.state_shardings(tx, params)
  state = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
    jax.eval_shape(tx.init, params),
    shardings,
  )
  if case.variant == "plain" or deferred is None:
    grad_fn = jax.value_and_grad(loss_fn)
  else:
    grad_fn = optax_accum.distributed.local_value_and_grad(
      loss_fn, axis_name=deferred
    )

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
