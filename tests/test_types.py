"""Users' code type-checks (issue 72): the README's and every guide's code,
each page as the one script the docs tests run, checked by mypy with the
project's settings (``[tool.mypy]`` in ``pyproject.toml``; ``make lint``
checks the package itself with them).

A page is a script of sections, and a later section may define a name
again (a second ``train_step``): checked as a reader runs it, with a name
allowed to take another type (``--allow-redefinition-new``) and a function
to be defined again (``no-redef`` off). Everything else a user's checker
would say of the code they copy is an error here: a wrong type in a call
of ``optax_accum``'s API, an attribute it does not have, a reader typed
as something else than what it returns.
"""

import pathlib
import subprocess
import sys

import test_docs

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A persistent cache, as the compilation cache, in the running venv.
CACHE = pathlib.Path(sys.prefix) / "mypy-cache"


def _check(files: list[pathlib.Path]) -> tuple[str, int]:
  """mypy on `files`, in a process of its own: mypy sets the recursion
  limit and the garbage collector's thresholds of the process it runs in,
  which the suite's jax then ran under (a worker crashed in XLA's
  compiler, twice, on an empty compilation cache)."""
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "mypy",
      "--config-file",
      str(ROOT / "pyproject.toml"),
      "--cache-dir",
      str(CACHE),
      "--allow-redefinition-new",
      "--local-partial-types",
      "--disable-error-code",
      "no-redef",
      *map(str, files),
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    check=False,
  )
  return done.stdout + done.stderr, done.returncode


def test_the_readme_and_the_guides_type_check(tmp_path):
  files = []
  for page in test_docs.SCRIPT_PAGES:
    name = str(page.relative_to(ROOT)).removesuffix(".md").replace("/", "__")
    path = tmp_path / f"{name.replace('.', '_')}.py"
    path.write_text(test_docs.page_script(page).source + "\n")
    files.append(path)
  assert len(files) >= 15  # the README and the guides, not nothing
  report, status = _check(files)
  assert status == 0, report


def test_a_wrong_type_in_a_page_is_found(tmp_path):
  """Control: the same check reports a user's misuse of the API (a
  transformation where a state goes), so the test above could fail."""
  path = tmp_path / "misuse.py"
  path.write_text(
    "import optax, optax_accum\n"
    "tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)\n"
    "n: int = optax_accum.has_updated(tx)\n"
  )
  report, status = _check([path])
  assert status == 1 and "misuse.py:3: error" in report, report
