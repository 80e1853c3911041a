"""One long-lived process that compiles for accelerators without the devices.

Started once per test process (``tests/_common.run_with_compilers``), with
``JAX_PLATFORMS=cpu`` and the accelerator compilers on ``PYTHONPATH``
(``_common.accel_env``), it runs the suite's compile workers
(``tests/_*accel_worker.py``, ``tests/_plan_worker.py``, the collectives
report, the docs' accelerator blocks) one after another as ``__main__``, as
``python SCRIPT ARGS...`` would, so that jax, flax and the H100 and TPU
compilers load once per run instead of once per module, and XLA compiles a
program that several workers ask for once (:func:`_compile_once`).

Protocol: one JSON request a line on stdin, ``{"argv": [script, *args]}``;
one JSON answer a line on the file descriptor given as ``argv[1]``:
``{"returncode": 0 or 1, "stdout": ..., "stderr": ...}`` (``stderr`` holds
the traceback when the script raised), plus ``"compile_requests"`` and
``"programs"``: the compiles this process was asked for so far, and the
distinct programs among them (those XLA compiled). What XLA itself
writes goes to this process's stderr.
"""

import contextlib
import hashlib
import io
import json
import os
import pathlib
import resource
import runpy
import sys
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]

import jax  # noqa: E402

# The recipes and compiled-step workers build 8 CPU devices before any
# backend starts; every script that asks for them again asks for 8.
jax.config.update("jax_num_cpu_devices", 8)

from jax._src import compiler  # noqa: E402

REQUESTS = 0  # programs the scripts asked XLA to compile
PROGRAMS: dict[tuple, object] = {}  # the distinct ones, compiled


def _compile_once(original):
  """XLA's compile, memoized on the program's text, devices and options:
  the workers build fresh functions (a new transformation, a new mesh) that
  lower to programs compiled before. A deviceless compile cannot go through
  jax's persistent cache (``_common.accel_env``); this in-memory one lasts
  the process's life. Programs with host callbacks compile every time."""

  def compile_(backend, module, executable_devices, options, host_callbacks):
    global REQUESTS
    REQUESTS += 1
    if host_callbacks:
      return original(
        backend, module, executable_devices, options, host_callbacks
      )
    text = module.operation.get_asm(enable_debug_info=False)
    key = (
      hashlib.sha256(text.encode()).hexdigest(),
      backend.platform,
      repr(executable_devices),
      options.SerializeAsString(),
    )
    if key not in PROGRAMS:
      PROGRAMS[key] = original(
        backend, module, executable_devices, options, host_callbacks
      )
    return PROGRAMS[key]

  return compile_


compiler.backend_compile_and_load = _compile_once(
  compiler.backend_compile_and_load
)


def _run(argv: list[str]) -> dict:
  script = pathlib.Path(argv[0]).resolve()
  modules, path, old_argv = set(sys.modules), list(sys.path), sys.argv
  environ = dict(os.environ)  # the docs' blocks set JAX_PLATFORMS
  sys.argv, sys.path[:0] = [str(script), *argv[1:]], [str(script.parent)]
  stdout, stderr = io.StringIO(), io.StringIO()
  returncode = 0
  try:
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
      try:
        runpy.run_path(str(script), run_name="__main__")
      except SystemExit as e:
        returncode = e.code if isinstance(e.code, int) else int(bool(e.code))
        if e.code and not isinstance(e.code, int):
          print(e.code, file=sys.stderr)
      except BaseException:  # noqa: BLE001  (the answer carries it)
        returncode = 1
        traceback.print_exc()
  finally:
    sys.argv, sys.path[:] = old_argv, path
    os.environ.clear()
    os.environ.update(environ)
    # The scripts' own helpers (tests/_common and benchmarks/_common share a
    # name) load afresh for the next script; jax, flax and the package stay.
    package = REPO / "optax_accum"
    for name in set(sys.modules) - modules:
      file = getattr(sys.modules[name], "__file__", None) or ""
      if file.startswith(str(REPO)) and not file.startswith(str(package)):
        del sys.modules[name]
  return {
    "returncode": returncode,
    "stdout": stdout.getvalue(),
    "stderr": stderr.getvalue(),
    "compile_requests": REQUESTS,
    "programs": len(PROGRAMS),
  }


def main(answer_fd: str) -> None:
  answers = os.fdopen(int(answer_fd), "w")
  # For measuring the suite: a JSON line per script run, appended there.
  stats = os.environ.get("OPTAX_ACCUM_ACCEL_STATS")
  for line in sys.stdin:
    argv = json.loads(line)["argv"]
    answer = _run(argv)
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
    if stats:
      usage = resource.getrusage(resource.RUSAGE_SELF)
      record = {k: answer[k] for k in ("compile_requests", "programs")}
      record.update(
        argv=argv, pid=os.getpid(), cpu_s=usage.ru_utime + usage.ru_stime
      )
      with open(stats, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
  main(sys.argv[1])
