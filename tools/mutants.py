"""The project's mutants: small edits that change what a user gets.

``make mutants`` (never part of ``make test``) plants each mutant, one at a
time, in a temporary copy of the repository (tracked and untracked files,
not the ignored ones) and runs the tests that cover it there, with the copy
first on ``PYTHONPATH``. A mutant is *killed* when those tests fail, and
*survives* when they pass. The run prints one line per mutant, then the
kill rate and the survivors, and exits non-zero when a mutant survived or
no longer applies (its ``old`` text must occur exactly once in its file: a
mutant that no longer applies is reported, never silently skipped).

Each mutant is a behaviour change a user would see (the ``why``), not a
syntax error: a later change to the code it edits should either keep it
applying or replace it with the same behaviour's new spelling. Before the
mutants, each distinct test selection runs once unmutated (it must pass, or
a kill would mean nothing); ``--no-baseline`` skips that.

Usage::

  python tools/mutants.py                 # all, one at a time
  python tools/mutants.py -j 2            # two copies side by side
  python tools/mutants.py issue-1 flush   # names, or substrings of them
  python tools/mutants.py --list
"""

import argparse
import concurrent.futures
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  path: str  # relative to the repository root
  old: str  # must occur exactly once in `path`
  new: str
  tests: tuple[str, ...]  # pytest arguments: files, `-k` selections
  why: str  # what a user would see


def _m(name, path, old, new, tests, why):
  return Mutant(name, f"optax_accum/{path}", old, new, tuple(tests), why)


EDGES = "tests/test_edges.py"
DIFF = "tests/test_differential.py"
ACC = "tests/test_accumulate.py"
STATIC = "tests/test_static_cycle.py"
NOISE = "tests/test_noise_scale.py"
EVERY_K = "tests/test_every_k.py"
MULTI = ("tests/test_multisteps.py", "tests/test_multisteps_checkpoints.py")
FORMS = "tests/test_backend_forms.py"
FLAX = "tests/test_flax_dropins.py"

MUTANTS = [
  # -- The eleven of issue 37 (tests/test_edges.py holds each). ------------
  _m(
    "issue-1 fractional total weight left undivided",
    "_cycle.py",
    "1.0 / jnp.where(total_weight <= 0, 1.0, total_weight)",
    "1.0 / jnp.where(total_weight <= 1, 1.0, total_weight)",
    [EDGES, "-k", "fractional"],
    "weights 0.25 + 0.25 of [2, 4]: updates [-1, -2] instead of [-2, -4]",
  ),
  _m(
    "issue-2 summed gradients multiplied by their weight",
    "_cycle.py",
    'scale = micro.weighted and config.gradients == "mean"',
    "scale = micro.weighted",
    [EDGES, "-k", "summed_gradients"],
    'gradients="sum" with weight=: the gradient counted w times',
  ),
  _m(
    "issue-3 float schedule rounded up",
    "_every_k.py",
    "k = jnp.floor(k.astype(jnp.float32))",
    "k = jnp.ceil(k.astype(jnp.float32))",
    [EDGES, "-k", "rounded_down"],
    "every_k(step) = 2.5 gives cycles of 3, not 2",
  ),
  _m(
    "issue-4 integer schedule below 1 kept",
    "_every_k.py",
    "jnp.minimum(jnp.maximum(k, 1), INT32_MAX)",
    "jnp.minimum(jnp.maximum(k, 0), INT32_MAX)",
    [EDGES, "-k", "below_one"],
    "a schedule returning 0 or -1: current_every_k reads 0",
  ),
  _m(
    "issue-5 k=1 pass-through forgets weight_seen",
    "_accumulate.py",
    "weight_seen=_every_k.add_weight_seen(\n      state.weight_seen,"
    " jnp.ones([], jnp.float32)\n    ),",
    "weight_seen=state.weight_seen,",
    [EDGES, "-k", "weight_seen_of_every_call"],
    "every_k=1: weight_seen stays 0 (a token schedule never advances)",
  ),
  _m(
    "issue-6 weightless cycle's inner state kept under selects",
    "_cycle.py",
    "new_state = _tree.select(emitted, new_state, state)",
    "new_state = new_state",
    [EDGES, "-k", "weightless"],
    "a weightless cycle ended with emit=True (or on GPU/TPU) steps Adam",
  ),
  _m(
    "issue-7 k=1 pass-through drops extra arguments",
    "_accumulate.py",
    "grads, state.inner_state, params, **extra_args\n  )",
    "grads, state.inner_state, params\n  )",
    [EDGES, "-k", "extra_arguments"],
    "every_k=1 with value=: the inner raises a TypeError",
  ),
  _m(
    "issue-8 summed noise sample times its weight",
    "_noise_scale.py",
    "sample = norm / jnp.where(weight > 0, weight, 1.0)",
    "sample = weight * norm",
    [EDGES, "-k", "noise_scale"],
    'gradients="sum": the noise scale -33.8 instead of 3.53',
  ),
  _m(
    "issue-9 bias correction one cycle late",
    "_noise_scale.py",
    "** cycles.astype(jnp.float32)",
    "** (cycles + 1).astype(jnp.float32)",
    [EDGES, "-k", "closed_form"],
    "noise_scale_components after 1 cycle: half the truth",
  ),
  _m(
    "issue-10 from_multisteps loses has_updated",
    "multisteps.py",
    "emitted=(n == 0) & (step > 0),",
    "emitted=fresh.emitted,",
    [EDGES, "-k", "keeps_has_updated"],
    "converted at a boundary: has_updated False where MultiSteps said True",
  ),
  _m(
    "issue-11 from_multisteps ignores every_k=",
    "multisteps.py",
    "k = fresh.every_k if every_k is None else jnp.asarray(every_k, jnp.int32)",
    "k = fresh.every_k",
    [EDGES, "-k", "honours_every_k"],
    "the converted run updates after the target's k, not the one given",
  ),
]


# ----------------------------------------------------------------------------
# Running them.
# ----------------------------------------------------------------------------


def _files() -> list[str]:
  out = subprocess.run(
    ["git", "ls-files", "-co", "--exclude-standard", "-z"],
    cwd=REPO,
    capture_output=True,
    check=True,
  ).stdout.decode()
  return [f for f in out.split("\0") if f and (REPO / f).is_file()]


def _copy(dest: pathlib.Path) -> pathlib.Path:
  for name in _files():
    target = dest / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / name, target)
  return dest


def _pytest(copy: pathlib.Path, tests: tuple, timeout: float):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(copy), env.get("PYTHONPATH", "")])
  env.setdefault("OPTAX_ACCUM_ACCEL", str(REPO / ".venv" / "accel"))
  argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
  try:
    result = subprocess.run(
      [*argv, *tests],
      cwd=copy,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return "timeout", ""
  return result.returncode, result.stdout + result.stderr


def _first_failure(output: str) -> str:
  match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
  return match.group(1) if match else output.strip().splitlines()[-1:][0]


def apply(mutant: Mutant, root: pathlib.Path) -> str | None:
  """Plants `mutant` in `root`; returns the original text, or None when its
  `old` text does not occur exactly once."""
  path = root / mutant.path
  text = path.read_text()
  if text.count(mutant.old) != 1:
    return None
  path.write_text(text.replace(mutant.old, mutant.new))
  return text


def _run_one(mutant: Mutant, root: pathlib.Path, timeout: float) -> dict:
  start = time.monotonic()
  original = apply(mutant, root)
  if original is None:
    return dict(mutant=mutant, status="NOT APPLIED", detail="", seconds=0.0)
  try:
    code, output = _pytest(root, mutant.tests, timeout)
  finally:
    (root / mutant.path).write_text(original)
  if code == "timeout":
    status, detail = "KILLED", f"timeout after {timeout:.0f} s"
  elif code == 1:
    status, detail = "KILLED", _first_failure(output)
  elif code == 0:
    status, detail = "SURVIVED", ""
  else:  # collection errors, no tests selected, usage errors
    status, detail = "ERROR", f"pytest exit {code}: {_first_failure(output)}"
  seconds = time.monotonic() - start
  return dict(mutant=mutant, status=status, detail=detail, seconds=seconds)


def _select(names: list[str]) -> list[Mutant]:
  if not names:
    return MUTANTS
  chosen = [m for m in MUTANTS if any(n in m.name for n in names)]
  if not chosen:
    raise SystemExit(f"no mutant matches {names}")
  return chosen


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("names", nargs="*", help="mutants (name substrings)")
  parser.add_argument("-j", "--jobs", type=int, default=1)
  parser.add_argument("--timeout", type=float, default=600.0)
  parser.add_argument("--list", action="store_true")
  parser.add_argument("--no-baseline", action="store_true")
  args = parser.parse_args(argv)
  mutants = _select(args.names)
  if args.list:
    for m in mutants:
      print(f"{m.name}\n  {m.path}: {m.why}\n  tests: {' '.join(m.tests)}")
    return 0
  jobs = max(1, args.jobs)
  with tempfile.TemporaryDirectory(prefix="optax_accum_mutants_") as tmp:
    roots = [_copy(pathlib.Path(tmp) / f"copy{i}") for i in range(jobs)]
    # Mutants that no longer apply are known before anything runs.
    stale = [
      m for m in mutants if (REPO / m.path).read_text().count(m.old) != 1
    ]
    if not args.no_baseline:
      selections = sorted({m.tests for m in mutants if m not in stale})
      for tests in selections:
        code, output = _pytest(roots[0], tests, args.timeout)
        if code != 0:
          print(
            f"baseline FAILS for {' '.join(tests)}: {_first_failure(output)}"
          )
          return 2
      print(f"baseline: {len(selections)} test selections pass unmutated")
    free = list(roots)
    results = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
      futures = {}
      for m in mutants:
        if len(futures) >= jobs:
          done, _ = concurrent.futures.wait(
            futures, return_when=concurrent.futures.FIRST_COMPLETED
          )
          for f in done:
            free.append(futures.pop(f))
            results.append(f.result())
            _print(results[-1])
        root = free.pop()
        futures[pool.submit(_run_one, m, root, args.timeout)] = root
      for f in concurrent.futures.as_completed(futures):
        results.append(f.result())
        _print(results[-1])
  return _summary(results)


def _print(result: dict) -> None:
  m = result["mutant"]
  detail = f"  ({result['detail']})" if result["detail"] else ""
  print(
    f"{result['status']:<11} {result['seconds']:6.1f} s  {m.name}{detail}",
    flush=True,
  )


def _summary(results: list[dict]) -> int:
  by = {}
  for r in results:
    by.setdefault(r["status"], []).append(r["mutant"])
  killed = len(by.get("KILLED", []))
  judged = killed + len(by.get("SURVIVED", []))
  rate = 100.0 * killed / judged if judged else 0.0
  print(f"\nkilled {killed} of {judged} mutants: {rate:.1f}%")
  for status in ("SURVIVED", "NOT APPLIED", "ERROR"):
    for m in by.get(status, []):
      print(f"  {status}: {m.name} ({m.path}): {m.why}")
  return 0 if killed == judged == len(results) else 1


if __name__ == "__main__":
  sys.exit(main())
