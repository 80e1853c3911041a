"""Small trees and transformations shared by the test modules."""

import atexit
import fcntl
import functools
import json
import os
import pathlib
import select
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# Every name an AccumulateState reads by, and `replace` writes by, but the
# noise scale's and the controller's records.
STATE_READERS = (
  "micro_step",
  "step",
  "every_k",
  "num_skipped",
  "emitted",
  "weight_seen",
  "acc_weight",
  "acc_grads",
  "acc_buffer",
)

# Every behaviour runs eagerly and under jit (the `maybe_jit` fixture).
MODES = {"nojit": lambda f: f, "jit": jax.jit}


def params():
  return {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}


def grads(i):
  """A deterministic, distinct gradient per micro-step."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(i))
  return {"w": jax.random.normal(k1, (2, 3)), "b": jax.random.normal(k2, (3,))}


def identity():
  """An inner that returns the gradient it receives: shows what reached it."""
  return optax.GradientTransformation(
    lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s)
  )


def scaled_sgd():
  """sgd(1) times the extra argument `value=`: shows that it arrived."""

  def update(updates, state, params=None, *, value=1.0, **extra):
    del params, extra
    return jax.tree.map(lambda u: -u * value, updates), state

  return optax.GradientTransformationExtraArgs(
    lambda params: optax.EmptyState(), update
  )


def flat(tree):
  """{key path: leaf}."""
  return {
    jax.tree_util.keystr(path): leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def accel_env() -> dict[str, str]:
  """The environment of a subprocess that compiles for an H100 or a TPU
  without the devices: the CUDA plugin and libtpu that `make test` installs
  (in ``OPTAX_ACCUM_ACCEL``, default ``.venv/accel``) on its path. Fails the
  test, never skips it, when they are missing."""
  accel = pathlib.Path(
    os.environ.get("OPTAX_ACCUM_ACCEL", REPO / ".venv" / "accel")
  )
  missing = [p for p in ("libtpu", "jax_plugins") if not (accel / p).is_dir()]
  if missing:
    pytest.fail(
      f"no {' or '.join(missing)} in {accel} (OPTAX_ACCUM_ACCEL): run `make"
      " test`, which installs the accelerator compilers there, or set"
      " OPTAX_ACCUM_ACCEL to a folder holding `pip install --no-deps"
      " --target DIR $(python -m optax_accum.targets)`."
    )
  env = dict(os.environ)
  # A program compiled for a deviceless target cannot be read back from the
  # persistent cache (jax 0.10.2: "PjRtCompiler must be constructed with a
  # Client to call DeserializeLoadedExecutable"): no cache there.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  # No GEMM autotuning: there is no device to time configurations on, and
  # at its default level XLA:GPU still compiles candidate configurations
  # (ptxas included) to find the first that compiles. At level 0 it takes
  # its default one: every fact the workers read (HLO, copies, kernel
  # bytes, memory_analysis) came out identical for the 105 programs of
  # tests/test_accelerators.py on jax 0.12.0.1, in 30% less CPU
  # (2026-11-29; issue 60).
  env["XLA_FLAGS"] = " ".join(
    filter(None, [env.get("XLA_FLAGS", ""), "--xla_gpu_autotune_level=0"])
  )
  env.update(
    JAX_PLATFORMS="cpu",  # compile only: no TPU or GPU is looked for
    PYTHONPATH=os.pathsep.join([str(accel), str(REPO)]),
    TPU_SKIP_MDS_QUERY="1",
    # libtpu locks a file while loaded; other tests compile for a TPU too.
    ALLOW_MULTIPLE_LIBTPU_LOAD="1",
  )
  return env


def footprint(compiled) -> int:
  """A compiled step's bytes per device, computed apart from the library's
  (``optax_accum._plan.footprint``, which must agree): arguments + outputs
  + temporaries - the outputs that reuse donated argument buffers."""
  memory = compiled.memory_analysis()
  return (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    + memory.temp_size_in_bytes
    - memory.alias_size_in_bytes
  )


def compiled_peak(step, args) -> int:
  """A compiled step's peak bytes per device, computed apart from
  ``optax_accum.plan_micro_batch`` (which must agree): the larger of the
  compiler's peak and :func:`footprint`."""
  compiled = step.lower(*args).compile()
  return max(
    compiled.memory_analysis().peak_memory_in_bytes, footprint(compiled)
  )


class _Server:
  """``tests/_accel_server.py``, started on first use: one process per
  test process that runs every compile worker with the compilers loaded
  once (see there)."""

  def __init__(self):
    self.process = None
    self.answers = None

  def start(self):
    read, write = os.pipe()
    self.log = tempfile.TemporaryFile()  # what XLA writes: failures show it
    self.process = subprocess.Popen(
      [sys.executable, REPO / "tests" / "_accel_server.py", str(write)],
      stdin=subprocess.PIPE,
      stdout=subprocess.DEVNULL,
      stderr=self.log,
      env=accel_env(),
      pass_fds=(write,),
      text=True,
    )
    os.close(write)
    self.answers = os.fdopen(read)

  def stop(self):
    if self.process is not None:
      self.process.stdin.close()  # it ends at the end of its input
      try:
        self.process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
      self.answers.close()
      self.process = None

  def log_tail(self) -> str:
    self.log.seek(0)
    return self.log.read()[-4000:].decode(errors="replace")

  def run(self, argv: list, timeout: int) -> dict:
    if self.process is None or self.process.poll() is not None:
      self.start()
    self.process.stdin.write(json.dumps({"argv": list(map(str, argv))}) + "\n")
    self.process.stdin.flush()
    ready, _, _ = select.select([self.answers], [], [], timeout)
    line = ready and self.answers.readline()
    if not line:  # timed out or died: the next run starts afresh
      tail = self.log_tail()
      self.stop()
      return {"returncode": -1, "stdout": "", "stderr": tail}
    return json.loads(line)


_SERVER = _Server()
atexit.register(_SERVER.stop)


def run_with_compilers(
  argv: list, *, timeout: int = 900, what: str = ""
) -> str:
  """Runs ``python *argv`` with the accelerator compilers
  (:func:`accel_env`), in this test process's compile server
  (``tests/_accel_server.py``), asserting that it succeeds; its stdout.
  `what` prefixes the failure message."""
  accel_env()  # fails the test at once when the compilers are missing
  result = _SERVER.run(argv, timeout)
  assert result["returncode"] == 0, f"{what}{result['stderr'][-4000:]}"
  return result["stdout"]


def last_json_line(stdout: str):
  """What a worker printed last, as JSON."""
  return json.loads(stdout.strip().splitlines()[-1])


def run_folder(tmp_path_factory) -> pathlib.Path:
  """A temporary folder for the whole test run: under pytest-xdist, the one
  its workers share (their base folders' parent, fresh for each run)."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# The accelerator targets a run compiles for: all of them, or, with
# OPTAX_ACCUM_ACCEL_SCOPE=one_h100 (make test-py311: the older jax's leg),
# one H100 only; tests/conftest.py then deselects the tests of several
# devices, and the compile workers skip their programs.
ONE_H100 = os.environ.get("OPTAX_ACCUM_ACCEL_SCOPE") == "one_h100"
# What names a program of several devices: targets, engines, recipes.
MULTI_DEVICE = (
  "h100x8",
  "v5e_2x2",
  "v5e_2x4",
  "hsdp",
  "shard_map",
  "unreduced",
  "nnx_data_parallel",
  "jit_unreduced",
  "scaling_shard_map_py",
)


def of_several_devices(name: str) -> bool:
  """Whether a request key, target, engine or recipe name is a program
  for several devices."""
  return any(part in MULTI_DEVICE for part in name.split("/")[:2])


@functools.cache
def recipes_on_accelerators(shared: pathlib.Path, recipes=None) -> dict:
  """Every documented recipe compiled for one H100 and 8 H100s, clean and
  planted (``tests/_recipes_accel_worker.py``), once per test run:
  ``{"plant/recipe/dtype": facts}``. tests/test_recipes.py and
  tests/test_check_step.py both read it; under pytest-xdist they may sit
  on two workers, which share `shared` (:func:`run_folder`): the first
  computes it, the other waits for it there. `recipes`: their names, where
  not all (:data:`ONE_H100`)."""
  path = shared / "recipes_on_accelerators.json"
  with open(path.with_suffix(".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists():
      argv = [REPO / "tests" / "_recipes_accel_worker.py"]
      if recipes is not None:
        argv += ["--recipes", ",".join(recipes)]
      path.write_text(run_with_compilers(argv).strip().splitlines()[-1])
  return json.loads(path.read_text())
