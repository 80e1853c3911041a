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
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _hlo
from optax_accum._collectives import (
  DEFAULT_MIN_BYTES,
  assert_reduction_deferred,
  collectives,
)

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
