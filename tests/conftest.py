"""Test set-up shared by the whole suite.

Eight simulated CPU devices for the sharding tests, and strict JAX: implicit
rank promotion raises. Both are JAX configuration set before any backend
starts; nothing here edits ``XLA_FLAGS``, so subprocesses the tests start
get the environment they choose (one CPU device unless they say otherwise).

One persistent compilation cache for the run, in the running venv
(``.venv/jax-cache``; ``make clean`` removes it): the suite builds many
transformations whose steps compile to the same program (a fresh ``tx`` per
test, the same step in several processes), and XLA compiles each program
once. Through the environment, so that the CPU subprocesses the tests start
share it; ``JAX_COMPILATION_CACHE_DIR`` set (empty: no cache) wins. The
processes that compile for an accelerator without the device do not use it
(``_common.accel_env``).
"""

import os
import pathlib
import sys

_CACHE = os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(sys.prefix) / "jax-cache")
)
# Every program, however small or quick: most of the suite's are both.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after the cache's environment)
import pytest  # noqa: E402
from _common import MODES  # noqa: E402

# Also when a plugin imported jax before this file read the environment.
jax.config.update("jax_compilation_cache_dir", _CACHE or None)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

NUM_CPU_DEVICES = 8

# The scripts the tests run in processes of their own (the compile servers,
# the multi-process and accelerator workers) hold no test or doctest, and
# some change jax where they are imported: `_accel_server.py` keeps every
# program it compiles, for the life of its process. Imported by
# --doctest-modules into a pytest worker, it kept every CPU executable the
# worker compiled alive: on an empty compilation cache the suite's worker
# then crashed in XLA, three runs of three.
collect_ignore_glob = ["_*.py"]

jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
jax.config.update("jax_numpy_rank_promotion", "raise")


# For measuring the suite (issue 40): with OPTAX_ACCUM_COMPILE_STATS=FILE,
# each pytest process appends a JSON line there as it ends: its CPU seconds,
# the seconds jax spent compiling for the CPU (XLA, and the persistent
# cache's reads) and lowering, and the CPU seconds of the subprocesses it
# started (examples, benchmarks, the compile server: tests/_accel_server.py
# writes its own lines to OPTAX_ACCUM_ACCEL_STATS).
_STATS = os.environ.get("OPTAX_ACCUM_COMPILE_STATS")
_EVENTS: dict[str, dict] = {}  # event: {"seconds": ..., "count": ...}
_PROGRAMS: dict[str, float] = {}
if _STATS:

  def _on_event(event: str, seconds: float, fun_name=None, **kwargs) -> None:
    del kwargs
    total = _EVENTS.setdefault(event, {"seconds": 0.0, "count": 0})
    total["seconds"] += seconds
    total["count"] += 1
    if event.endswith("backend_compile_duration"):  # and by program name
      _PROGRAMS[fun_name] = _PROGRAMS.get(fun_name, 0.0) + seconds

  jax.monitoring.register_event_duration_secs_listener(_on_event)


def pytest_sessionfinish(session):
  if not _STATS:
    return
  import json
  import resource

  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  # pytest-xdist's controller: its children are the workers, which write
  # lines of their own.
  controller = not hasattr(session.config, "workerinput") and bool(
    session.config.getoption("numprocesses", None)
  )
  record = {
    "pid": os.getpid(),
    "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    "cpu_s": own.ru_utime + own.ru_stime,
    "children_cpu_s": 0.0
    if controller
    else children.ru_utime + children.ru_stime,
    "compile_s_by_name": _PROGRAMS,
    "events": _EVENTS,
  }
  with open(_STATS, "a") as f:
    f.write(json.dumps(record) + "\n")


@pytest.fixture(autouse=True)
def _apply_updates_warns_in_every_test(monkeypatch):
  """apply_updates warns once per misuse and process (its slow route,
  optax_accum/_apply.py); each test starts with none said, so that a test
  that takes the slow route without expecting it fails (warnings are
  errors here) whatever ran before it on its worker."""
  from optax_accum import _apply  # noqa: PLC0415

  monkeypatch.setattr(_apply, "_WARNED", set())


@pytest.fixture(autouse=True, scope="module")
def _executables_released_after_each_module():
  """jax's caches keep every executable a worker compiled, and each holds
  memory maps of its code: over the whole suite a worker on an empty
  compilation cache reached 47,000 of the kernel's 65,530
  (vm.max_map_count), past which XLA crashes. Let go after each module
  (a program a later module needs again comes back from the persistent
  compilation cache)."""
  yield
  jax.clear_caches()


@pytest.fixture(params=list(MODES), ids=list(MODES))
def maybe_jit(request):
  """Every behaviour runs eagerly and under jit."""
  return MODES[request.param]


@pytest.fixture
def x64():
  """jax_enable_x64 for one test, then as it was."""
  was = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", was)


# On a jax without unreduced shardings (before 0.10.2: the `make
# test-oldest` stack), these modules skip, naming what they need; the core
# (Makefile, CORE_TESTS) runs there.
_UNREDUCED = "deferring the reduction under plain jit needs jax>=0.10.2"
_XLA = "holds the programs XLA compiles with jax/jaxlib>=0.10.2 (make test)"
NEEDS_NEWEST_JAX = {
  "test_unreduced.py": _UNREDUCED,
  "test_jit_unreduced.py": _UNREDUCED,
  "test_jit_unreduced_noise.py": _UNREDUCED,
  "test_hsdp.py": "HSDP: " + _UNREDUCED,
  "test_multiprocess.py": "the multi-process workers: " + _UNREDUCED,
  "test_collectives.py": _XLA,
  "test_performance_structure.py": _XLA,
  "test_accelerators.py": _XLA,
  "test_flax_dropins.py": "optax_accum.flax.Optimizer needs flax>=0.12.7",
  "test_flax_mesh.py": _UNREDUCED,
  "test_docs.py": "the docs' code: " + _UNREDUCED,
}
# The examples and benchmarks, run as scripts of the installed package, and
# the doctests (which print jax 0.10.2's reprs) are held on the newest
# stack only; the examples use newer flax too (`nnx.List`).
_NEWEST_ONLY = "run on the newest stack only (make test)"
for _name in (
  "test_adaptive_eval.py",
  "test_benchmarks_smoke.py",
  "test_lm_demo.py",
  "test_scaling_examples.py",
):
  NEEDS_NEWEST_JAX[_name] = "the examples and benchmarks " + _NEWEST_ONLY


# The longest modules first (a run's `--durations`, summed per module):
# `make test`'s workers take modules in collection order (`--dist
# loadscope --no-loadscope-reorder`: xdist's default hands out the modules
# with the most tests first, which put every accelerator module at the
# end), and one started last would run alone at the end while the other
# core idles.
LONGEST_FIRST = (
  "test_accelerators.py",
  "test_plan.py",
  "test_recipes.py",
  "test_benchmarks_smoke.py",
  "test_adaptive_eval.py",
  "test_lm_demo.py",
  "test_docs.py",
)


def _of_several_devices(item) -> bool:
  """A test of a program for several devices: marked so, or a parameter
  naming such a target, engine, recipe or request (``_common``)."""
  import _common  # noqa: PLC0415

  if item.get_closest_marker("multi_device"):
    return True
  params = getattr(getattr(item, "callspec", None), "params", {})
  return any(
    isinstance(v, str) and _common.of_several_devices(v)
    for v in params.values()
  )


def pytest_collection_modifyitems(config, items):
  import _common  # noqa: PLC0415

  if _common.ONE_H100:  # make test-py311: one H100's programs only
    accel = ("test_accelerators.py", "test_recipes.py")
    drop = [i for i in items if i.path.name in accel and _of_several_devices(i)]
    if drop:
      config.hook.pytest_deselected(items=drop)
      dropped = set(drop)
      items[:] = [i for i in items if i not in dropped]
  # A stable sort: each module's tests keep their order.
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
  from optax_accum import _unreduced

  if _unreduced.is_supported():
    return
  for item in items:
    reason = NEEDS_NEWEST_JAX.get(item.path.name)
    if isinstance(item, pytest.DoctestItem):
      reason = "the doctests " + _NEWEST_ONLY
    if reason:
      item.add_marker(
        pytest.mark.skip(reason=f"{reason} (installed {jax.__version__})")
      )
