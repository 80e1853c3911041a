"""The public collective check and the HLO reader behind it.

On the suite's 8 simulated devices (conftest.py), three data-parallel steps
of one model, ``k = 4`` micro-batches per optimizer step:

* ``gspmd``: ``jit`` with the batch sharded over ``data``; XLA all-reduces
  the gradient on every call;
* ``psum_each``: ``shard_map``, ``lax.pmean`` of each micro-batch gradient,
  then ``accumulate``: the same traffic, written by hand;
* ``axis_name``: ``shard_map`` with ``accumulate(..., axis_name="data")``:
  one reduction, inside the branch that runs the inner optimizer.

Then the reader on small hand-written HLO modules, for the forms the
compiled steps above do not produce (``true_computation=``, async pairs,
loops).

Then replica groups: each form XLA prints, read from programs compiled on
the suite's CPU devices and, in a subprocess, for a TPU v5e 2x4 slice and
8 H100s without the hardware; and HSDP on the 8 devices as a (2, 4)
``("replica", "fsdp")`` mesh, where ``assert_reduction_deferred(...,
axis_name="replica")`` allows the per-step reduce-scatter over ``fsdp`` and
catches a per-step reduction over ``replica``.
"""

import functools
import json
import pathlib
import re
import sys

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.inspect import _groups, _hlo
from optax_accum.inspect._collectives import (
  DEFAULT_MIN_BYTES,
  assert_reduction_deferred,
  collectives,
)

REPO = pathlib.Path(__file__).resolve().parents[1]

K = 4
DIM, OUT, PER_DEVICE = 64, 32, 2
PARAM_BYTES = 4 * (DIM * OUT + OUT)  # 8320: w and b, float32
RECIPES = ("gspmd", "psum_each", "axis_name")


def _mesh():
  return jax.make_mesh((jax.device_count(),), ("data",))


def _params():
  key = jax.random.PRNGKey(0)
  return {"w": jax.random.normal(key, (DIM, OUT)), "b": jnp.zeros(OUT)}


def _loss(params, x, y):
  return jnp.mean(jnp.square(x @ params["w"] + params["b"][None] - y))


def _step(recipe):
  """(jitted micro-step, its arguments) for one recipe."""
  mesh = _mesh()
  n = jax.device_count()
  by_device = NamedSharding(mesh, P("data"))
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  x, y = jax.device_put(
    (jnp.ones((n * PER_DEVICE, DIM)), jnp.zeros((n * PER_DEVICE, OUT))),
    by_device,
  )
  inner = optax.adam(1e-2)
  if recipe == "gspmd":
    tx = optax_accum.accumulate(inner, K)

    def gspmd_step(params, state, x, y):
      updates, state = tx.update(jax.grad(_loss)(params, x, y), state, params)
      return optax.apply_updates(params, updates), state

    return jax.jit(gspmd_step), (params, tx.init(params), x, y)

  deferred = recipe == "axis_name"
  tx = optax_accum.accumulate(inner, K, axis_name="data" if deferred else None)

  def local(params, state, x, y):
    state = jax.tree.map(lambda a: a[0], state)
    grad = jax.grad(_loss)(lax.pcast(params, "data", to="varying"), x, y)
    if not deferred:
      grad = lax.pmean(grad, "data")
    updates, state = tx.update(grad, state, params)
    # One copy of everything per device: no state field list needed here.
    return jax.tree.map(lambda a: a[None], (updates, state))

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P(), P("data"), P("data"), P("data")),
      out_specs=P("data"),
    )
  )
  state = jax.tree.map(
    lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), tx.init(_params())
  )
  return step, (params, jax.device_put(state, by_device), x, y)


@functools.cache
def _forms(recipe):
  """The same step as a jitted function with arguments, a Lowered, a
  Compiled and HLO text: (step, args) pairs."""
  step, args = _step(recipe)
  lowered = step.lower(*args)
  compiled = lowered.compile()
  return {
    "jitted": (step, args),
    "lowered": (lowered, ()),
    "compiled": (compiled, ()),
    "text": (compiled.as_text(), ()),
  }


FORMS = ("jitted", "lowered", "compiled", "text")


def _reductions(records, **where):
  return [
    c
    for c in records
    if c.opcode == "all-reduce"
    and all(getattr(c, key) == value for key, value in where.items())
  ]


# ----------------------------------------------------------------------------
# assert_reduction_deferred on real steps.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("recipe", ["gspmd", "psum_each"])
def test_reducing_every_micro_step_fails(recipe, form):
  step, args = _forms(recipe)[form]
  with pytest.raises(AssertionError, match="every call") as error:
    assert_reduction_deferred(step, *args)
  # The table names the op and its bytes.
  assert "all-reduce" in str(error.value)
  assert str(PARAM_BYTES) in str(error.value)


@pytest.mark.parametrize("form", FORMS)
def test_axis_name_passes(form):
  step, args = _forms("axis_name")[form]
  records = assert_reduction_deferred(step, *args)
  # Not vacuous: the gradient is reduced, in the emitting branch.
  assert _reductions(records, emitting=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_bytes_are_the_param_bytes(recipe):
  """Gradient-sized all-reduces move the gradient's bytes once: every
  call without deferral, in the emitting branch with it."""
  step, args = _forms(recipe)["jitted"]
  records = collectives(step, *args)
  big = [c for c in _reductions(records) if c.bytes >= DEFAULT_MIN_BYTES]
  # With axis_name the cycle's weight (a float32 scalar) rides along in the
  # same all-reduce: a few scalars at most, never a second gradient.
  assert PARAM_BYTES <= sum(c.bytes for c in big) <= PARAM_BYTES + 64, records
  if recipe == "axis_name":
    assert all(c.emitting and not c.unconditional for c in big), records
  else:
    assert all(c.unconditional and not c.emitting for c in big), records
  assert all(c.operand_bytes == c.result_bytes == c.bytes for c in big)
  assert not any(c.in_loop for c in records)


def test_min_bytes_above_the_gradient_lets_every_step_pass():
  step, args = _step("gspmd")
  assert_reduction_deferred(step, *args, min_bytes=PARAM_BYTES + 1)
  with pytest.raises(AssertionError):
    assert_reduction_deferred(step, *args, min_bytes=PARAM_BYTES)


def test_a_plain_function_is_jitted():
  step, args = _step("gspmd")
  records = collectives(step.__wrapped__, *args)
  assert _reductions(records, unconditional=True)


@pytest.mark.parametrize("min_bytes", ["1024", 1.5, True])
def test_min_bytes_must_be_an_int(min_bytes):
  with pytest.raises(TypeError, match="`min_bytes`.*" + repr(min_bytes)):
    assert_reduction_deferred(
      "ENTRY %e () -> f32[] {\n}\n", min_bytes=min_bytes
    )


def test_lowered_step_takes_no_arguments():
  step, args = _step("gspmd")
  with pytest.raises(TypeError, match="already lowered"):
    collectives(step.lower(*args), *args)


def test_step_must_be_a_function_or_lowered():
  with pytest.raises(TypeError, match="`step` must be.*int: 3"):
    collectives(3)


def test_text_without_entry_is_a_clear_error():
  with pytest.raises(ValueError, match="no ENTRY computation"):
    collectives("HloModule m\n")


# ----------------------------------------------------------------------------
# The reader on hand-written HLO.
# ----------------------------------------------------------------------------

# A predicate conditional whose true branch works and reduces, inside a
# loop-free entry; an async all-gather pair; a while loop with a reduction.
_HANDWRITTEN = """\
HloModule m, entry_computation_layout={(f32[16]{0})->f32[16]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%hold (p: f32[16]) -> f32[16] {
  ROOT %p = f32[16]{0} parameter(0)
}

%emit (q: f32[16]) -> f32[16] {
  %q = f32[16]{0} parameter(0)
  %ar = f32[16]{0} all-reduce(%q), replica_groups={}, to_apply=%add
  %e = f32[16]{0} exponential(%ar)
  ROOT %m = f32[16]{0} multiply(%e, %ar)
}

%cond (c: (s32[], f32[16])) -> pred[] {
  %c = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (d: (s32[], f32[16])) -> (s32[], f32[16]) {
  %d = (s32[], f32[16]{0}) parameter(0)
  %j = s32[] get-tuple-element(%d), index=0
  %v = f32[16]{0} get-tuple-element(%d), index=1
  %r = f32[16]{0} all-reduce(%v), replica_groups={}, to_apply=%add
  ROOT %t = (s32[], f32[16]{0}) tuple(%j, %r)
}

ENTRY %main (x: f32[16]) -> f32[16] {
  %x = f32[16]{0} parameter(0)
  %pred = pred[] constant(true)
  %ags = ((f32[16]{0}), f32[64]{0}) all-gather-start(%x), dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %zero = s32[] constant(0)
  %init = (s32[], f32[16]{0}) tuple(%zero, %x)
  %loop = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body
  %y = f32[16]{0} get-tuple-element(%loop), index=1
  ROOT %out = f32[16]{0} conditional(%pred, %y, %y),\
 true_computation=%emit, false_computation=%hold
}
"""


def test_reader_call_and_branch_edges():
  hlo = _hlo.HloModule(_HANDWRITTEN)
  assert hlo.entry == "main"
  assert hlo.unconditional() == {"main", "cond", "body", "add"}
  # false first, as lax.cond orders a predicate's branches.
  assert hlo.conditionals() == [["hold", "emit"]]
  assert hlo.work("emit") > hlo.work("hold") == 0
  assert hlo.with_opcode(["exponential"]) == {"emit"}


def test_reader_collectives_placement_and_bytes():
  by_name = {c.name: c for c in collectives(_HANDWRITTEN)}
  assert set(by_name) == {"ar", "r", "ags"}
  gather = by_name["ags"]
  assert (gather.opcode, gather.operand_bytes, gather.result_bytes) == (
    "all-gather",
    64,
    256,
  )
  assert gather.bytes == 256 and gather.unconditional
  assert by_name["r"].in_loop and by_name["r"].unconditional
  assert by_name["ar"].emitting and not by_name["ar"].unconditional
  with pytest.raises(AssertionError, match=r"all-reduce\s+64\s+every call"):
    assert_reduction_deferred(_HANDWRITTEN, min_bytes=64)
  # Below the loop's 64 bytes, nothing counts.
  assert_reduction_deferred(_HANDWRITTEN, min_bytes=65)


@pytest.mark.parametrize(
  "shape, expected",
  [
    ("f32[8,16]{1,0}", 512),
    ("(f32[8]{0}, s32[], pred[])", 37),
    ("bf16[3]", 6),
    ("f8e4m3fn[10]", 10),
    ("c64[2]", 16),
    ("token[]", 0),
  ],
)
def test_shape_bytes(shape, expected):
  assert _hlo.shape_bytes(shape) == expected


def test_the_three_recipes_reach_the_same_params():
  """Same maths, so the check compares like with like."""
  finals = []
  for recipe in RECIPES:
    step, (params, state, x, y) = _step(recipe)
    for _ in range(K):
      out, state = step(params, state, x, y)
      if recipe == "gspmd":
        params = out
      else:  # per-device updates, the same on every device
        first = jax.tree.map(lambda u: np.asarray(u)[0], out)
        params = optax.apply_updates(params, first)
    finals.append(params)
  for other in finals[1:]:
    for a, b in zip(
      jax.tree.leaves(finals[0]), jax.tree.leaves(other), strict=True
    ):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# Replica groups, as XLA prints them.
# ----------------------------------------------------------------------------

FSDP_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))  # on a (2, 4) mesh, by position
REPLICA_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))


def _hsdp_mesh(order="plain"):
  """The 8 devices as ("replica", "fsdp") = (2, 4); "transposed" lays them
  out column-major, so that a device's id is not its position."""
  devices = np.array(jax.devices())
  if order == "transposed":
    devices = devices.reshape(4, 2).T
  return jax.sharding.Mesh(devices.reshape(2, 4), ("replica", "fsdp"))


# The forms XLA prints depend on its version; the tests accept each, and hold
# that every form reads as the same groups. jax 0.10.2's XLA prints
# shard_map's groups as a list (``{{0,4},{1,5},...}``) and those its
# partitioner inserts under jit over a mesh of its own (``mesh['axis_0'=2,
# 'axis_1'=4,'axis_2'=1,'axis_3'=1] {'axis_1'}``, with ``device_ids=`` when
# its device order is not iota). jax 0.12's prints both over the user's mesh,
# in the mesh's device order: ``mesh['replica'=2,'fsdp'=4] {'fsdp'}``.
SHARD_MAP_FORMS = ("list", "mesh")
JIT_FORMS = ("mesh, device_ids", "mesh")


def _form(line):
  """Which printed form an instruction's replica groups take ("mesh" for
  XLA's own mesh and the user's alike)."""
  value = line.split("replica_groups=", 1)[1]
  if value.startswith("{"):
    return "list"
  if value.startswith("["):
    return "iota"
  if value.startswith("mesh["):
    has_ids = re.match(r"mesh\[[^\]]*\], device_ids=", value)
    return "mesh, device_ids" if has_ids else "mesh"
  return value[:20]


def _forms_of(text):
  """{record name: form}, for the collectives that have groups."""
  hlo = _hlo.HloModule(text)
  return {
    site.instruction.name: _form((site.collective or site.instruction).line)
    for site in hlo.sites(_hlo.COLLECTIVE_OPCODES)
    if "replica_groups=" in (site.collective or site.instruction).line
  }


def _sum_over(axis):
  """A jitted sum over one axis of the (2, 4) mesh, and its argument: XLA
  inserts the all-reduce, so the partitioner prints its groups."""
  mesh = _hsdp_mesh()
  x = jax.ShapeDtypeStruct(
    (8 * 8, 64),
    jnp.float32,
    sharding=NamedSharding(mesh, P(("replica", "fsdp"))),
  )
  dim = {"replica": 0, "fsdp": 1}[axis]
  return jax.jit(lambda x: x.reshape(2, 4, 8, 64).sum(dim)), x


# XLA's partitioner prints the mesh form by default and the iota form with
# replica-group v3 materialisation off (what XLA printed before the mesh
# form existed). The mesh is XLA's own (jax 0.10.2) or the user's, its
# groups along the summed axis (jax 0.12; AXIS below).
_IOTA_OPTIONS = {"xla_enable_rgv3_materialization": False}
_XLA_MESH = r"mesh\['axis_0'=2,'axis_1'=4,'axis_2'=1,'axis_3'=1\] "
_USER_MESH = r"mesh\['replica'=2,'fsdp'=4\] \{'AXIS'\}"


@pytest.mark.parametrize(
  "axis, expected", [("fsdp", FSDP_GROUPS), ("replica", REPLICA_GROUPS)]
)
@pytest.mark.parametrize(
  "options, form, printed",
  [
    (None, "mesh", f"({_XLA_MESH}|{_USER_MESH})"),
    (_IOTA_OPTIONS, "iota", r"\[\d,\d\]<=\[[\d,]+\]"),
  ],
  ids=["mesh", "iota"],
)
def test_partitioner_groups_forms(axis, expected, options, form, printed):
  step, x = _sum_over(axis)
  text = step.lower(x).compile(compiler_options=options).as_text()
  (record,) = collectives(text)
  assert _forms_of(text) == {record.name: form}
  printed = printed.replace("AXIS", axis)
  assert re.search(r"replica_groups=" + printed, _line_of(text, record))
  assert (record.opcode, record.replica_groups) == ("all-reduce", expected)


def _line_of(text, record):
  return next(
    line for line in text.splitlines() if f"%{record.name} = " in line
  )


def test_mesh_form_with_device_ids():
  """jit's FSDP gradient: jax 0.10.2's XLA builds its own mesh, with a
  transposed device order (``device_ids=([2,4]T(1,0))``), for the
  all-gather over fsdp and the all-reduce over replica (jax 0.12's prints
  the user's mesh, no device_ids); XLA:CPU runs the reduce-scatter over fsdp
  as an all-reduce of the whole gradient and a slice (reported as that
  all-reduce, of the whole gradient's bytes)."""
  mesh = _hsdp_mesh()
  w = jax.ShapeDtypeStruct(
    (1024, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp"))
  )
  x = jax.ShapeDtypeStruct(
    (8, 1024), jnp.float32, sharding=NamedSharding(mesh, P(("replica", "fsdp")))
  )
  grad = jax.jit(
    jax.grad(lambda w, x: jnp.sum((x @ w) ** 2)),
    out_shardings=NamedSharding(mesh, P("fsdp")),
  )
  text = grad.lower(w, x).compile().as_text()
  records = collectives(text)
  assert len(set(_forms_of(text).values())) == 1
  assert set(_forms_of(text).values()) <= set(JIT_FORMS)
  got = [(c.opcode, c.bytes, c.replica_groups) for c in records]
  assert got == [
    ("all-gather", 1024 * 256 * 4, FSDP_GROUPS),
    ("all-reduce", 1024 * 256 * 4, FSDP_GROUPS),
    ("all-reduce", 256 * 256 * 4, REPLICA_GROUPS),
  ], _table_of(records)


def _table_of(records):
  return "\n" + optax_accum.inspect.format_collectives(records)


def test_list_form_from_shard_map():
  step, args = _hsdp_step(_hsdp_mesh(), deferred=True)
  text = step.lower(*args).compile().as_text()
  by_opcode = {c.opcode: c for c in collectives(text)}
  forms = _forms_of(text)
  for opcode, expected in [
    ("all-gather", FSDP_GROUPS),
    ("reduce-scatter", FSDP_GROUPS),
    ("all-reduce", REPLICA_GROUPS),
  ]:
    assert forms[by_opcode[opcode].name] in SHARD_MAP_FORMS
    assert by_opcode[opcode].replica_groups == expected
  # XLA:CPU runs shard_map's psum_scatter as a reduce-scatter: input in,
  # a quarter out.
  scatter = by_opcode["reduce-scatter"]
  assert scatter.operand_bytes == 4 * scatter.result_bytes == 4 * DIM * OUT


@pytest.mark.parametrize(
  "attributes, expected",
  [
    ("replica_groups={}", ()),
    ("replica_groups={{0,1},{2,3}}, to_apply=%add", ((0, 1), (2, 3))),
    # XLA's own test vectors: iota with a transpose, sub-axes (pre-size in
    # brackets), a non-iota device order, several sub-axes of one axis.
    (
      "replica_groups=[2,10]<=[4,5]T(1,0)",
      (
        (0, 5, 10, 15, 1, 6, 11, 16, 2, 7),
        (12, 17, 3, 8, 13, 18, 4, 9, 14, 19),
      ),
    ),
    (
      "replica_groups=mesh[x=2,y=2], device_ids=(3,1,0,2) {x}",
      ((3, 0), (1, 2)),
    ),
    (
      "replica_groups=mesh[x=2,y=2], device_ids=(3,1,0,2) {y}",
      ((3, 1), (0, 2)),
    ),
    (
      "replica_groups=mesh['a'=6,'b'=6] {'a':(3)2, 'b':(3)2}",
      tuple(
        (a + b, a + b + 1, a + b + 6, a + b + 7)
        for a in (0, 12, 24)
        for b in (0, 2, 4)
      ),
    ),
    (
      "replica_groups=mesh['a.b'=2,'<axis> def'=4] {'<axis> def'}",
      FSDP_GROUPS,
    ),
    ("replica_groups=maximal_mesh[device_id=5] {}", ((5,),)),
    ("replica_groups=something_new", None),
    ("channel_id=1", None),
  ],
)
def test_parse_printed_groups(attributes, expected):
  assert _groups.parse(attributes) == expected


@pytest.mark.parametrize(
  "mesh_axes, iota",
  [
    ("{a:(1)2}", "[4,2]<=[2,4]T(1,0)"),
    ("{a:(1)4}", "[2,4]<=[4,2]T(1,0)"),
    ("{a:(2)2}", "[4,2]<=[2,2,2]T(0,2,1)"),
    ("{a:(2)4}", "[2,4]<=[8]"),
    ("{a:(4)2}", "[4,2]<=[8]"),
    ("{a:(1)2,a:(4)2}", "[2,4]<=[2,2,2]T(1,0,2)"),
    ("{a:(4)2,a:(1)2}", "[2,4]<=[2,2,2]T(1,2,0)"),
    ("{a}", "[1,8]<=[8]"),
  ],
)
def test_sub_axes_read_as_their_iota_equivalent(mesh_axes, iota):
  """Pairs from XLA's tests of one group list in both forms."""
  mesh_form = _groups.parse(f"replica_groups=mesh[a=8] {mesh_axes}")
  assert mesh_form == _groups.parse(f"replica_groups={iota}")


# Two replicas of two partitions: each group mode names other devices.
_MODES = """\
HloModule modes, replica_count=2, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8]) -> (f32[8], f32[8], f32[8], f32[8], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %replicas = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %both = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0},{1}},\
 to_apply=%add
  %flat = f32[8]{0} all-reduce(%x), channel_id=2, replica_groups={{0,3},{1,2}},\
 use_global_device_ids=true, to_apply=%add
  %all = f32[8]{0} all-reduce(%x), channel_id=3, replica_groups={},\
 use_global_device_ids=true, to_apply=%add
  %parts = f32[8]{0} all-to-all(%x), channel_id=4, replica_groups={{0,1}},\
 dimensions={0}
  ROOT %t = (f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0})\
 tuple(%replicas, %both, %flat, %all, %parts)
}
"""


def test_group_modes_become_device_ids():
  """Device id = replica * num_partitions + partition, whatever the mode."""
  groups = {c.name: c.replica_groups for c in collectives(_MODES)}
  assert groups == {
    "replicas": ((0, 2), (1, 3)),  # no channel_id: replica ids
    "both": ((0, 1), (2, 3)),  # channel_id alone: replicas' partitions
    "flat": ((0, 3), (1, 2)),  # use_global_device_ids: as printed
    "all": ((0, 1, 2, 3),),
    "parts": ((0, 1), (2, 3)),  # all-to-all with channel_id: partition ids
  }


# XLA:TPU's reduce-scatter of a (1000, 250) gradient over 4 devices, as a
# compile for a v5e 2x4 slice prints it (trimmed): a fusion that pads the
# input to 1024 rows, all-reduces it and slices out the device's 256 rows.
_TPU_REDUCE_SCATTER = """\
HloModule jit_loss, num_partitions=8

%add.clone (x.3: f32[], y.1: f32[]) -> f32[] {
  %x.3 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%x.3, %y.1)
}

%all-reduce-scatter (input: f32[1000,250]) -> f32[256,250] {
  %input = f32[1000,250]{1,0:T(8,128)S(1)} parameter(0)
  %constant.17 = f32[]{:T(128)} constant(0)
  %pad = f32[1024,250]{1,0:T(8,128)} pad(%input, %constant.17),\
 padding=0_24x0_0
  %all-reduce.3 = f32[1024,250]{1,0:T(8,128)} all-reduce(%pad), channel_id=4,\
 replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true,\
 to_apply=%add.clone
  %partition-id.2 = u32[] partition-id()
  %constant.19 = u32[] constant(0)
  ROOT %dynamic-slice.5 = f32[256,250]{1,0:T(8,128)S(1)}\
 dynamic-slice(%all-reduce.3, %partition-id.2, %constant.19),\
 dynamic_slice_sizes={256,250}
}

ENTRY %main.2_spmd (param: f32[1000,250]) -> f32[256,250] {
  %param = f32[1000,250]{1,0:T(8,128)} parameter(0)
  ROOT %fusion = f32[256,250]{1,0:T(8,128)S(1)} fusion(%param), kind=kCustom,\
 calls=%all-reduce-scatter
}
"""


def test_tpu_reduce_scatter_fusion_is_one_reduce_scatter():
  (record,) = collectives(_TPU_REDUCE_SCATTER)
  assert record.opcode == "reduce-scatter" and record.name == "fusion"
  # The gradient's bytes in, the device's shard out; not the padded input.
  assert (record.operand_bytes, record.result_bytes) == (1_000_000, 256_000)
  assert record.bytes == 1_000_000
  assert record.replica_groups == FSDP_GROUPS and record.unconditional
  # Nor does the all-reduce inside count by itself.
  assert not _hlo.HloModule(_TPU_REDUCE_SCATTER).sites(["all-reduce"])


# ----------------------------------------------------------------------------
# HSDP: reduce-scatter over fsdp every micro-step, all-reduce over replica
# once per optimizer step.
# ----------------------------------------------------------------------------

HSDP_GRAD_BYTES = 4 * DIM * OUT // 4  # a device's quarter of w's gradient


def _hsdp_step(mesh, deferred):
  """(jitted micro-step, its arguments): w sharded over fsdp and replicated
  over replica, the batch over both axes. The gradient is reduce-scattered
  over fsdp on every call; `deferred` leaves the replica sum to
  ``accumulate(..., axis_name="replica")``, else each call takes it."""
  tx = optax_accum.accumulate(
    optax.adam(1e-2), K, axis_name="replica" if deferred else None
  )
  both = P("replica", "fsdp")

  def local(w, state, x, y):
    state = jax.tree.map(lambda a: a[0, 0], state)
    full = lax.all_gather(w, "fsdp", tiled=True)
    # Varying over replica before grad: else its transpose psums over it.
    full = lax.pcast(full, "replica", to="varying")
    grad = jax.grad(lambda w: jnp.mean(jnp.square(x @ w - y)))(full)
    grad = lax.psum_scatter(grad, "fsdp", tiled=True)
    if not deferred:
      grad = lax.pmean(grad, "replica")
    updates, state = tx.update({"w": grad}, state, {"w": w})
    return jax.tree.map(lambda a: a[None, None], (updates, state))

  batch = P(("replica", "fsdp"))
  step = jax.jit(
    jax.shard_map(
      local, mesh=mesh, in_specs=(P("fsdp"), both, batch, batch), out_specs=both
    )
  )
  w = jax.device_put(_params()["w"], NamedSharding(mesh, P("fsdp")))
  state = tx.init({"w": jnp.zeros((DIM // 4, OUT))})
  state = jax.tree.map(
    lambda a: jnp.broadcast_to(a, (2, 4, *jnp.shape(a))), state
  )
  key = jax.random.PRNGKey(1)
  x, y = jax.device_put(
    (
      jax.random.normal(key, (8 * PER_DEVICE, DIM)),
      jnp.zeros((8 * PER_DEVICE, OUT)),
    ),
    NamedSharding(mesh, batch),
  )
  return step, (w, jax.device_put(state, NamedSharding(mesh, both)), x, y)


@functools.cache
def _hsdp_compiled(order, deferred):
  step, args = _hsdp_step(_hsdp_mesh(order), deferred)
  return step.lower(*args).compile()


@pytest.mark.parametrize("order", ["plain", "transposed"])
def test_hsdp_replica_reduction_every_step_fails(order):
  compiled = _hsdp_compiled(order, deferred=False)
  with pytest.raises(AssertionError, match="across mesh axis 'replica'") as e:
    assert_reduction_deferred(compiled, axis_name="replica")
  offending = str(e.value).split("All collectives")[0]
  assert re.search(
    rf"all-reduce\s+{HSDP_GRAD_BYTES}\s+every call\s+4x2\s+replica", offending
  ), e.value
  # The reduce-scatter over fsdp is allowed: not among the offending ops.
  assert "reduce-scatter" not in offending


@pytest.mark.parametrize("order", ["plain", "transposed"])
def test_hsdp_deferred_replica_reduction_passes(order):
  compiled = _hsdp_compiled(order, deferred=True)
  records = assert_reduction_deferred(compiled, axis_name="replica")
  (deferred,) = [c for c in records if c.emitting]
  assert deferred.opcode == "all-reduce"
  assert deferred.replica_groups == REPLICA_GROUPS
  assert deferred.bytes >= HSDP_GRAD_BYTES
  # Every axis, or fsdp alone: the per-step reduce-scatter counts.
  for axis_name in (None, "fsdp", ("replica", "fsdp")):
    with pytest.raises(AssertionError, match=r"reduce-scatter\s+8192"):
      assert_reduction_deferred(compiled, axis_name=axis_name)


def test_hsdp_deferred_matches_reducing_every_step():
  """Not vacuous: both steps emit the same update at the cycle's end."""
  emitted = []
  for deferred in (False, True):
    step, (w, state, x, y) = _hsdp_step(_hsdp_mesh(), deferred)
    for _ in range(K):
      updates, state = step(w, state, x, y)
    emitted.append(np.asarray(updates["w"]))
  np.testing.assert_allclose(emitted[0], emitted[1], rtol=1e-5, atol=1e-7)
  assert np.abs(emitted[0]).max() > 0


def test_hlo_ids_are_positions_in_the_mesh_not_device_ids():
  """Run a psum over fsdp on the transposed mesh: devices sum with the
  devices at HLO ids {0,1,2,3} *of mesh.devices.flat*, not with devices
  0-3. The HLO text is the same as on the plain mesh."""
  mesh = _hsdp_mesh("transposed")
  ids = np.vectorize(lambda d: d.id)(mesh.devices).astype(np.float32)
  spec = P("replica", "fsdp")
  step = jax.jit(
    jax.shard_map(
      lambda v: lax.psum(v, "fsdp"), mesh=mesh, in_specs=spec, out_specs=spec
    )
  )
  x = jax.device_put(jnp.asarray(ids), NamedSharding(mesh, spec))
  (record,) = collectives(step, x)
  assert record.replica_groups == FSDP_GROUPS
  flat = [d.id for d in mesh.devices.flat]
  sums = [sum(flat[i] for i in group) for group in record.replica_groups]
  assert sums == [0 + 2 + 4 + 6, 1 + 3 + 5 + 7]
  np.testing.assert_array_equal(np.asarray(step(x)), [[12.0] * 4, [16.0] * 4])


def test_mesh_from_argument_set_mesh_or_shardings():
  compiled = _hsdp_compiled("plain", deferred=True)
  text = compiled.as_text()
  mesh = _hsdp_mesh()
  # The arguments' mesh (above), an explicit mesh, the mesh set with
  # jax.set_mesh (for text, ids are positions in its device order).
  assert_reduction_deferred(text, axis_name="replica", mesh=mesh)
  with jax.set_mesh(mesh):
    assert_reduction_deferred(text, axis_name="replica")
  abstract = jax.sharding.AbstractMesh((2, 4), ("replica", "fsdp"))
  assert_reduction_deferred(text, axis_name="replica", mesh=abstract)
  # An explicit mesh wins over the set one.
  with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    assert_reduction_deferred(text, axis_name="replica", mesh=mesh)
  # Through the devices: the same layout with the axes in the other order
  # names the same devices' replica coordinates, though its device order
  # differs from the arguments'.
  swapped = jax.sharding.Mesh(mesh.devices.T, ("fsdp", "replica"))
  assert_reduction_deferred(compiled, axis_name="replica", mesh=swapped)
  # Taken as positions in *its* order instead, the fsdp groups would span
  # replica: what a text step given that mesh gets.
  with pytest.raises(AssertionError, match="reduce-scatter"):
    assert_reduction_deferred(text, axis_name="replica", mesh=swapped)


def test_axis_name_errors():
  text = _hsdp_compiled("plain", deferred=True).as_text()
  with pytest.raises(
    ValueError, match=r"`axis_name`='replica' needs a mesh.*`mesh=`"
  ):
    assert_reduction_deferred(text, axis_name="replica")
  with pytest.raises(
    ValueError, match=r"`axis_name` 'slice' is not an axis.*'replica', 'fsdp'"
  ):
    assert_reduction_deferred(text, axis_name="slice", mesh=_hsdp_mesh())
  with pytest.raises(ValueError, match="`mesh` is only read with `axis_name`"):
    assert_reduction_deferred(text, mesh=_hsdp_mesh())
  with pytest.raises(TypeError, match="`axis_name` must be.*int: 3"):
    assert_reduction_deferred(text, axis_name=3)
  with pytest.raises(TypeError, match="`axis_name` must be.*tuple: \\(\\)"):
    assert_reduction_deferred(text, axis_name=())
  with pytest.raises(TypeError, match="`mesh` must be.*str: 'replica'"):
    assert_reduction_deferred(text, axis_name="replica", mesh="replica")
  small = jax.make_mesh((2,), ("replica",))
  with pytest.raises(ValueError, match="8 devices but the mesh has 2"):
    assert_reduction_deferred(text, axis_name="replica", mesh=small)


# ----------------------------------------------------------------------------
# A TPU v5e 2x4 slice and 8 H100s, compiled without the hardware in a
# subprocess.
# ----------------------------------------------------------------------------


def _accelerator_report():
  """What the reader finds in programs compiled for a v5e 2x4 slice (and
  one for 8 H100s); run by `_accelerator_run` with JAX_PLATFORMS=cpu and
  the compilers importable."""
  from optax_accum import targets
  from optax_accum.inspect import _collectives

  mesh = targets.mesh("v5e_2x4", (2, 4), ("replica", "fsdp"))

  def arg(shape, spec):
    return jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, spec)
    )

  batch = P(("replica", "fsdp"))
  local = {
    "psum_replica": lambda v: lax.psum(v, "replica"),
    "psum_scatter_fsdp": lambda v: lax.psum_scatter(v, "fsdp", tiled=True),
  }
  programs = {
    name: (
      jax.jit(jax.shard_map(f, mesh=mesh, in_specs=batch, out_specs=batch)),
      (arg((8 * 32, 1024), batch),),
      None,
    )
    for name, f in local.items()
  }
  # jit's gradient of a (1000, 250) weight sharded over fsdp: 250 rows a
  # device, which the TPU pads to 256.
  grad = jax.jit(
    jax.grad(lambda w, x: jnp.sum((x @ w) ** 2)),
    out_shardings=NamedSharding(mesh, P("fsdp")),
  )
  grad_args = (arg((1000, 250), P("fsdp")), arg((8, 1000), batch))
  programs["grad"] = (grad, grad_args, None)
  programs["grad_iota"] = (grad, grad_args, _IOTA_OPTIONS)
  # The same gradient for 8 H100s (XLA:GPU), on a mesh of its own.
  gpu = targets.mesh("h100x8", (2, 4), ("replica", "fsdp"))
  gpu_args = tuple(
    jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(gpu, spec))
    for a, spec in zip(grad_args, (P("fsdp"), batch), strict=True)
  )
  gpu_grad = jax.jit(
    jax.grad(lambda w, x: jnp.sum((x @ w) ** 2)),
    out_shardings=NamedSharding(gpu, P("fsdp")),
  )
  programs["gpu_grad"] = (gpu_grad, gpu_args, None)
  report = {"mesh_device_ids": [d.id for d in mesh.devices.flat]}
  for name, (step, args, options) in programs.items():
    on = gpu if name.startswith("gpu") else mesh
    compiled = step.lower(*args).compile(compiler_options=options)
    hlo = _hlo.HloModule(compiled.as_text())
    coordinates = _collectives._coordinates(on, compiled, hlo)
    forms = _forms_of(compiled.as_text())
    report[name] = {
      "records": [
        {
          "opcode": c.opcode,
          "operand_bytes": c.operand_bytes,
          "result_bytes": c.result_bytes,
          "groups": c.replica_groups,
          "form": forms.get(c.name),
          "axes": _collectives._axes_of(c, on, coordinates),
        }
        for c in collectives(compiled)
      ]
    }
    for axis_name in ("replica", "fsdp"):
      try:
        assert_reduction_deferred(compiled, axis_name=axis_name)
        report[name][axis_name] = "passes"
      except AssertionError:
        report[name][axis_name] = "fails"
  return report


@functools.cache
def _accelerator_run():
  stdout = _common.run_with_compilers([__file__, "accelerators"], timeout=600)
  return _common.last_json_line(stdout)


def _records_of(report, name):
  return [
    (r["opcode"], r["form"], tuple(map(tuple, r["groups"])), tuple(r["axes"]))
    for r in report[name]["records"]
  ]


def _groups_in(forms, records):
  """`records` without their forms, after checking that each is one of
  `forms`."""
  assert all(form in forms for _, form, *_ in records), records
  return [(opcode, *rest) for opcode, _, *rest in records]


def test_tpu_v5e_groups():
  report = _accelerator_run()
  # The slice's mesh is in ring order: an HLO id is not a device id.
  assert report["mesh_device_ids"] == [0, 1, 2, 3, 7, 6, 5, 4]
  assert _groups_in(SHARD_MAP_FORMS, _records_of(report, "psum_replica")) == [
    ("all-reduce", REPLICA_GROUPS, ("replica",))
  ]
  scatter = _records_of(report, "psum_scatter_fsdp")
  assert _groups_in(SHARD_MAP_FORMS, scatter) == [
    ("reduce-scatter", FSDP_GROUPS, ("fsdp",))
  ]
  assert report["psum_replica"]["replica"] == "fails"
  assert report["psum_replica"]["fsdp"] == "passes"
  assert report["psum_scatter_fsdp"]["replica"] == "passes"
  mesh_forms = _records_of(report, "grad")
  iota_forms = _records_of(report, "grad_iota")
  # A list for the fusion's reduce-scatter; jit's other ops over XLA's own
  # mesh, with device_ids (jax 0.10.2), or the user's (jax 0.12).
  forms = {form for _, form, *_ in mesh_forms if form}
  assert "list" in forms and len(forms - {"list"}) == 1, forms
  assert forms - {"list"} <= set(JIT_FORMS), forms
  assert {form for _, form, *_ in iota_forms} >= {"iota"}
  # Same groups whichever form: gather and reduce-scatter over fsdp, the
  # shard's all-reduce over replica (and a collective-permute, no groups,
  # that moves the padded rows back into place).
  for records in (mesh_forms, iota_forms):
    grouped = [(op, g, a) for op, _, g, a in records if g]
    assert sorted(grouped) == [
      ("all-gather", FSDP_GROUPS, ("fsdp",)),
      ("all-reduce", REPLICA_GROUPS, ("replica",)),
      ("reduce-scatter", FSDP_GROUPS, ("fsdp",)),
    ]
  for name in ("grad", "grad_iota"):
    assert report[name]["replica"] == report[name]["fsdp"] == "fails"


def test_tpu_v5e_reduce_scatter_bytes():
  """The TPU's reduce-scatter fusion: the (1000, 250) gradient in, a
  device's 256 padded rows out; no all-reduce of the padded 1024 rows."""
  report = _accelerator_run()
  for name in ("grad", "grad_iota"):
    by_opcode = {r["opcode"]: r for r in report[name]["records"]}
    scatter = by_opcode["reduce-scatter"]
    assert (scatter["operand_bytes"], scatter["result_bytes"]) == (
      1000 * 250 * 4,
      256 * 250 * 4,
    )
    assert by_opcode["all-reduce"]["operand_bytes"] == 250 * 250 * 4


def test_h100_groups():
  """XLA:GPU: jit's reduce-scatter is a reduce-scatter (async pair), its
  groups in the mesh form, as are the all-gather's and the all-reduce's."""
  report = _accelerator_run()
  records = report["gpu_grad"]["records"]
  assert _groups_in(JIT_FORMS, _records_of(report, "gpu_grad")) == [
    ("all-gather", FSDP_GROUPS, ("fsdp",)),
    ("reduce-scatter", FSDP_GROUPS, ("fsdp",)),
    ("all-reduce", REPLICA_GROUPS, ("replica",)),
  ]
  scatter = records[1]
  assert (scatter["operand_bytes"], scatter["result_bytes"]) == (
    1000 * 250 * 4,
    250 * 250 * 4,
  )


if __name__ == "__main__":
  # `python test_collectives.py accelerators` prints `_accelerator_report()`
  # as JSON.
  if sys.argv[1:] == ["accelerators"]:
    print(json.dumps(_accelerator_report()))
