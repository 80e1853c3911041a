"""``optax_accum.plan_micro_batch``: the largest micro-batch that fits.

On this machine's CPU with ``memory_limit=``: the chosen micro-batch's
compiled peak is within the budget and the next larger divisor's is not
(both compiled here, apart from the planner), ``micro_batch * every_k ==
global_batch`` and at most ``ceil(log2(global_batch)) + 2`` compiles; the
search itself against peak curves of every shape (``_search`` with a fake
compiler); variants; every bad input. The deviceless targets (an H100, 8
H100s, a TPU v5e) plan in a subprocess with their compilers
(``tests/_plan_worker.py``).
"""

import json
import math
import pathlib
import sys

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import _plan

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _plan_models  # noqa: E402

compiled_peak = _common.compiled_peak


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def limit_for(peak: int, headroom: float = 0.1) -> int:
  """The smallest limit whose budget, (1 - headroom) x limit, holds `peak`."""
  limit = math.ceil(peak / (1 - headroom))
  while int((1 - headroom) * limit) < peak:
    limit += 1
  return limit


def bound(global_batch: int) -> int:
  return math.ceil(math.log2(global_batch)) + 2


MODELS = {
  "mlp": lambda: _plan_models.mlp(global_batch=2048),
  "transformer": lambda: _plan_models.transformer(global_batch=96),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("answer", [4, 32])
def test_the_plan_is_the_largest_divisor_that_fits(model, answer):
  m = MODELS[model]()
  g = m.global_batch
  # A limit whose budget is the peak at `answer`.
  limit = limit_for(compiled_peak(m.step, m.args_for(answer)))
  plan = optax_accum.plan_micro_batch(m.step, m.args_for, g, memory_limit=limit)
  assert plan.micro_batch * plan.every_k == g
  assert plan.compiles <= bound(g)
  assert plan.budget_bytes == int(0.9 * limit)
  assert plan.peak_bytes <= plan.budget_bytes
  assert compiled_peak(m.step, m.args_for(plan.micro_batch)) == plan.peak_bytes
  larger = [d for d in divisors(g) if d > plan.micro_batch][0]
  assert compiled_peak(m.step, m.args_for(larger)) > plan.budget_bytes
  assert plan.micro_batch == answer


def test_the_whole_batch_fits_with_one_micro_step_and_two_compiles():
  m = _plan_models.mlp(global_batch=64)
  plan = optax_accum.plan_micro_batch(
    m.step, m.args_for, 64, memory_limit=2**34
  )
  assert (plan.micro_batch, plan.every_k, plan.compiles) == (64, 1, 2)


def loss(params, x):
  return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)


TX = optax_accum.accumulate(optax.adam(1e-3), every_k=2)
PARAMS = {"w": jax.ShapeDtypeStruct((128, 128), jnp.float32)}


def plain_step(params, state, x):
  grads = jax.grad(loss)(params, x)
  updates, state = TX.update(grads, state, params)
  return optax_accum.apply_updates(params, updates, state), state


def plain_args_for(n):
  return PARAMS, jax.eval_shape(TX.init, PARAMS), jnp.zeros((n, 128))


def test_a_plain_function_plans_as_its_jit():
  limit = limit_for(compiled_peak(jax.jit(plain_step), plain_args_for(64)))
  plans = [
    optax_accum.plan_micro_batch(step, plain_args_for, 1024, memory_limit=limit)
    for step in (plain_step, jax.jit(plain_step))
  ]
  assert plans[0].candidates[0].fits
  strip = lambda p: [(c.micro_batch, c.peak_bytes) for c in p.candidates]  # noqa: E731
  assert strip(plans[0]) == strip(plans[1])
  assert plans[0].micro_batch == plans[1].micro_batch == 64


def test_the_plan_prints_one_row_per_compile():
  plan = optax_accum.plan_micro_batch(
    plain_step, plain_args_for, 1024, memory_limit=4 * 2**20
  )
  lines = str(plan).splitlines()
  assert lines[0].startswith("plan for this machine")
  assert f"micro_batch={plan.micro_batch}, every_k={plan.every_k}" in lines[0]
  assert len(lines) == 2 + plan.compiles
  assert {int(line.split()[1]) for line in lines[2:]} == {
    c.micro_batch for c in plan.candidates
  }


def test_a_sharded_batch_plans_per_device_in_multiples_of_its_shards():
  mesh = jax.sharding.Mesh(jax.devices(), ("data",))
  sharding = jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec("data")
  )

  def args_for(n):
    params, state, _ = plain_args_for(n)
    return (
      params,
      state,
      jax.ShapeDtypeStruct((n, 128), jnp.float32, sharding=sharding),
    )

  step = jax.jit(plain_step, donate_argnums=(0, 1))
  limit = limit_for(compiled_peak(step, args_for(512)))
  plan = optax_accum.plan_micro_batch(step, args_for, 4096, memory_limit=limit)
  assert all(c.micro_batch % 8 == 0 for c in plan.candidates)
  assert plan.micro_batch == 512 and plan.every_k == 8
  # Per device: the program of 64 rows on one device, and the sum of the
  # gradient over the devices (at most one gradient-sized buffer); far
  # from the program of 512 rows on one device.
  one_device = jax.jit(plain_step, donate_argnums=(0, 1))
  rows_64 = compiled_peak(one_device, plain_args_for(64))
  grad_bytes = 128 * 128 * 4
  assert rows_64 <= plan.peak_bytes <= rows_64 + grad_bytes
  assert plan.peak_bytes < 0.6 * compiled_peak(one_device, plain_args_for(512))


# --- The search, against peak curves of every shape. --------------------


class FakeCompiler:
  """`_search`'s compiler over a given peak curve; counts compiles."""

  def __init__(self, peak, budget):
    self.peak, self.budget, self.trials = peak, budget, {}

  def __call__(self, n):
    peak = self.peak(n)
    self.trials[n] = _plan.Candidate("f", n, peak, peak <= self.budget, 0.0)
    return self.trials[n]


CURVES = {
  "linear": lambda n: 100 + 3 * n,
  "quadratic": lambda n: 100 + n * n,
  "square root": lambda n: 100 + int(40 * math.sqrt(n)),
  "step": lambda n: 100 if n < 50 else 10_000 + n,
  "flat then steep": lambda n: 100 + max(0, n - 200) * 50,
  "remat plateau": lambda n: 100 + min(n, 30) * 20 + n,
}


@pytest.mark.parametrize("curve", list(CURVES))
def test_the_search_finds_the_largest_fitting_divisor_within_the_bound(curve):
  peak = CURVES[curve]
  rng = np.random.default_rng(0)
  batches = [1, 2, 7, 12, 60, 64, 97, 360, 512, 720, 1000, 1024, 5040]
  for g in batches:
    sizes = _plan._divisors(g, 1)
    budgets = {peak(d) for d in sizes} | {peak(d) + 1 for d in sizes}
    budgets |= set(rng.integers(peak(1), peak(g) + 2, size=20).tolist())
    for budget in sorted(budgets):
      compiler = FakeCompiler(peak, budget)
      found = _plan._search(compiler, sizes, g)
      fitting = [d for d in sizes if peak(d) <= budget]
      assert (found is None) == (not fitting), (curve, g, budget)
      if fitting:
        assert found.micro_batch == max(fitting), (curve, g, budget)
      assert len(compiler.trials) <= bound(g), (curve, g, budget)


def test_a_linear_peak_takes_four_compiles():
  sizes = _plan._divisors(4096, 1)
  compiler = FakeCompiler(CURVES["linear"], CURVES["linear"](256) + 1)
  assert _plan._search(compiler, sizes, 4096).micro_batch == 256
  assert len(compiler.trials) == 4


# --- Variants. -------------------------------------------------------------


def deep_step(params, state, x):
  """`plain_step`'s params through 8 layers: 8 activations an example."""

  def deep_loss(params, x):
    for _ in range(8):
      x = jnp.tanh(x @ params["w"])
    return jnp.mean(x**2)

  grads = jax.grad(deep_loss)(params, x)
  updates, state = TX.update(grads, state, params)
  return optax_accum.apply_updates(params, updates, state), state


def test_the_variant_with_the_fewest_micro_steps_wins():
  # (On an H100, jax.checkpoint on the blocks against none: tests below.)
  limit = limit_for(compiled_peak(jax.jit(deep_step), plain_args_for(64)))
  plan = optax_accum.plan_micro_batch(
    None,
    plain_args_for,
    4096,
    memory_limit=limit,
    variants={"deep": deep_step, "plain": plain_step},
  )
  assert plan.variant == "plain"
  best = {}
  for c in plan.candidates:
    if c.fits:
      best[c.variant] = max(best.get(c.variant, 0), c.micro_batch)
  assert best["deep"] == 64 < best["plain"] == plan.micro_batch
  assert set(plan.estimated_step_seconds) == {"deep", "plain"}
  assert plan.compiles <= 2 * bound(4096)


def test_a_tie_goes_to_the_variant_with_less_work():
  def costly_step(params, state, x):
    # The same memory, 8 more matmuls per micro-step.
    extra = x
    for _ in range(8):
      extra = jnp.tanh(extra @ params["w"])
    params, state = plain_step(params, state, x)
    return params, state, jnp.sum(extra)

  plan = optax_accum.plan_micro_batch(
    None,
    plain_args_for,
    64,
    memory_limit=2**34,
    variants={"costly": costly_step, "plain": plain_step},
  )
  assert plan.every_k == 1 and plan.variant == "plain"


# --- Bad input. ------------------------------------------------------------


def plan(**kw):
  base = dict(
    step=plain_step,
    args_for=plain_args_for,
    global_batch=64,
    memory_limit=2**30,
  )
  base.update(kw)
  step = base.pop("step")
  args_for = base.pop("args_for")
  global_batch = base.pop("global_batch")
  return optax_accum.plan_micro_batch(step, args_for, global_batch, **base)


@pytest.mark.parametrize("value", [0, -8, 2.5, True, "64", None])
def test_global_batch_must_be_a_positive_int(value):
  with pytest.raises(
    ValueError, match=f"`global_batch` must be .* got {value!r}"
  ):
    plan(global_batch=value)


@pytest.mark.parametrize("value", [1.0, -0.1, 2, "0.1"])
def test_headroom_must_be_a_fraction(value):
  with pytest.raises(ValueError, match="`headroom`"):
    plan(headroom=value)


@pytest.mark.parametrize("value", [0, -1, 1.5e9, True])
def test_memory_limit_must_be_positive_bytes(value):
  with pytest.raises(ValueError, match="`memory_limit`"):
    plan(memory_limit=value)


def test_the_cpu_needs_a_memory_limit():
  with pytest.raises(ValueError, match="`memory_limit` is required.*cpu"):
    plan(memory_limit=None)


def test_an_unknown_target_lists_the_known_ones():
  with pytest.raises(
    ValueError, match="`target` 'a100' .*h100, h100x8, v5e_2x2"
  ):
    plan(target="a100")


def test_a_target_without_its_compiler_says_how_to_get_it():
  # This process runs JAX on its CPU without JAX_PLATFORMS=cpu.
  with pytest.raises(RuntimeError, match="JAX_PLATFORMS=cpu"):
    plan(target="h100")


def test_nothing_fits_names_the_smallest_peak_and_the_budget():
  with pytest.raises(ValueError) as error:
    plan(memory_limit=100_000)
  message = str(error.value)
  assert "Nothing fits" in message and "micro-batch 1:" in message
  assert "`global_batch` 64" in message and "`memory_limit`" in message
  assert "jax.checkpoint" in message


def test_args_for_that_ignores_n():
  fixed = plain_args_for(8)
  with pytest.raises(ValueError, match="`args_for` ignores n"):
    plan(args_for=lambda n: fixed)


def test_args_for_must_give_a_tuple():
  with pytest.raises(TypeError, match=r"`args_for\(n\)` must return"):
    plan(args_for=lambda n: {"x": jnp.zeros((n, 2))})


def test_a_step_without_an_accumulate_state():
  def args_for(n):
    params, _, x = plain_args_for(n)
    return params, optax.adam(1e-3).init(params), x

  with pytest.raises(ValueError, match="`step`.*no AccumulateState"):
    plan(args_for=args_for)


@pytest.mark.parametrize(
  "variants", [{}, [plain_step], {"a": 3}, {"step": plain_step}]
)
def test_variants_must_name_steps(variants):
  with pytest.raises(TypeError, match="`variants`"):
    plan(variants=variants)


def test_step_must_be_a_function():
  with pytest.raises(TypeError, match="`step`"):
    plan(step=None)


# --- Deviceless targets, in a subprocess with their compilers. ---------------


@pytest.fixture(scope="module")
def target_facts(tmp_path_factory):
  out = tmp_path_factory.mktemp("plan") / "facts.json"
  _common.run_with_compilers([REPO / "tests" / "_plan_worker.py", out])
  return json.loads(out.read_text())


def test_an_h100_plans_a_model_whose_batch_does_not_fit_in_80_gb(target_facts):
  f = target_facts["h100"]
  assert f["whole_batch_peak"] > 80 * 2**30
  assert f["micro_batch"] * f["every_k"] == f["global_batch"]
  assert f["limit_bytes"] == int(0.75 * 80 * 2**30)
  assert f["peak_bytes"] <= 0.9 * f["limit_bytes"] < f["next_larger_peak"]
  assert f["next_larger_peak_here"] == f["next_larger_peak"]
  assert f["compiles"] <= bound(f["global_batch"])
  assert f["estimated_step_seconds"] > 0


def test_eight_h100s_split_the_batch(target_facts):
  f = target_facts["h100x8"]
  assert f["micro_batch"] % 8 == 0 and f["micro_batch"] > 8
  assert f["micro_batch"] * f["every_k"] == f["global_batch"]
  assert f["peak_bytes"] <= 0.9 * f["limit_bytes"] < f["next_larger_peak"]
  assert not f["whole_batch_fits"]
  assert f["compiles"] <= bound(f["global_batch"])


def test_a_tpu_v5e_plans_and_refuses_what_does_not_fit(target_facts):
  f = target_facts["v5e_2x2"]
  assert f["limit_bytes"] == int(15.75 * 2**30)
  assert f["micro_batch"] * f["every_k"] == f["global_batch"]
  assert f["peak_bytes"] <= 0.9 * f["limit_bytes"]
  assert f["compiles"] <= bound(f["global_batch"])
  assert not f["whole_batch_fits"]


def test_an_h100_plan_picks_checkpointed_blocks_when_they_fit_more(
  target_facts,
):
  f = target_facts["variants"]
  assert f["variant"] == "remat" and f["micro_batch"] == f["best"]["remat"]
  assert f["best"]["remat"] > f["best"].get("plain", 0)
  assert f["limit_bytes"] == 40 * 2**30
  assert f["compiles"] <= 2 * bound(2**22)
  assert all(e > 0 for e in f["estimates"].values())
