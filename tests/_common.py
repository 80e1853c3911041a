"""Small trees and transformations shared by the test modules."""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

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


def run_with_compilers(
  argv: list, *, timeout: int = 900, what: str = ""
) -> str:
  """Runs ``python *argv`` with the accelerator compilers
  (:func:`accel_env`), asserting that it succeeds; its stdout. `what`
  prefixes the failure message."""
  result = subprocess.run(
    [sys.executable, *map(str, argv)],
    capture_output=True,
    text=True,
    env=accel_env(),
    timeout=timeout,
    check=False,
  )
  assert result.returncode == 0, f"{what}{result.stderr[-4000:]}"
  return result.stdout


def last_json_line(stdout: str):
  """What a worker printed last, as JSON."""
  return json.loads(stdout.strip().splitlines()[-1])


@functools.cache
def recipes_on_accelerators() -> dict:
  """Every documented recipe compiled for one H100 and 8 H100s, clean and
  planted (``tests/_recipes_accel_worker.py``), in one subprocess per test
  run: ``{"plant/recipe/dtype": facts}``."""
  worker = REPO / "tests" / "_recipes_accel_worker.py"
  return last_json_line(run_with_compilers([worker]))
