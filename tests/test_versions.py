"""The minimum jax, jaxlib and optax: declared once, checked at import.

``optax_accum/_versions.py`` holds the minimums; ``pyproject.toml`` and the
README must say the same. An older jax or optax fails ``import optax_accum``
with an ImportError naming the installed and the minimum versions, not with
whatever API it lacks first (the issue: on jax 0.4.28, ``cannot import name
'AxisType' from 'jax.sharding'``). The import tests run in subprocesses with
a fake old package ahead of the real one on the path.
"""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

from optax_accum import _versions

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
README = (ROOT / "README.md").read_text()

# jax 0.4.28 as the issue's user had it: a version, and a jax.sharding
# without AxisType.
FAKE_OLD_JAX = {
  "jax/__init__.py": '__version__ = "0.4.28"\n',
  "jax/sharding.py": "class Mesh: ...\n\n\nclass PartitionSpec: ...\n",
}
FAKE_OLD_OPTAX = {"optax/__init__.py": '__version__ = "0.2.2"\n'}
# optax 0.2.7 on jax 0.10.2: installed, new enough for optax_accum, but its
# import fails.
FAKE_BROKEN_OPTAX = {
  "optax/__init__.py": (
    "raise AttributeError('Unrecognized config option: jax_pmap_shmap_merge')\n"
  ),
  "optax-0.2.7.dist-info/METADATA": (
    "Metadata-Version: 2.1\nName: optax\nVersion: 0.2.7\n"
  ),
}


def _run_with(tmp_path, files, code):
  """Runs `code` in a fresh Python with `files` ahead of site-packages."""
  for name, text in files.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  return subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    cwd=ROOT,  # this checkout's optax_accum
    env=env,
    timeout=300,
    check=False,
  )


def _import_error(tmp_path, files):
  """`import optax_accum` with `files` installed: fails, and the last line
  of the traceback (the error it raises)."""
  result = _run_with(tmp_path, files, "import optax_accum")
  assert result.returncode != 0
  return result, result.stderr.strip().splitlines()[-1]


def test_the_fake_old_jax_reproduces_the_issue(tmp_path):
  result = _run_with(
    tmp_path, FAKE_OLD_JAX, "from jax.sharding import AxisType"
  )
  assert result.returncode != 0
  assert "cannot import name 'AxisType' from 'jax.sharding'" in result.stderr


def test_an_old_jax_fails_at_import_naming_the_minimum(tmp_path):
  result, last = _import_error(tmp_path, FAKE_OLD_JAX)
  assert last.startswith("ImportError: optax_accum needs jax>=0.7.1,"), last
  assert "installed: jax 0.4.28." in last, last
  assert '"jax>=0.7.1" "jaxlib>=0.7.1" "optax>=0.2.4"' in last, last
  assert "AxisType" not in result.stderr


def test_an_old_optax_fails_at_import_naming_the_minimum(tmp_path):
  result, last = _import_error(tmp_path, FAKE_OLD_OPTAX)
  assert last.startswith("ImportError: optax_accum needs"), last
  assert "optax>=0.2.4" in last, last
  assert "installed: optax 0.2.2." in last, last


def test_release_compares_numbers_not_strings():
  release = _versions.release
  assert release("0.10.2") == (0, 10, 2)
  assert release("0.9.0.1") == (0, 9, 0, 1)
  assert release("0.10.3.dev20260101") == (0, 10, 3)
  assert release("0.9.2") < release("0.10.2")  # "0.9.2" > "0.10.2" as text
  assert release("0.10.1") < release("0.10.2") <= release("0.10.2.dev1")
  assert release("0.4.28") < release("0.10")


def test_only_the_versions_below_the_minimum_are_named():
  assert _versions.too_old({"jax": "0.7.1", "jaxlib": "0.7.0"}) == ["jaxlib"]
  message = _versions.message({"jax": "0.7.1", "jaxlib": "0.7.0"})
  assert "installed: jaxlib 0.7.0." in message
  message = _versions.message({"jax": "0.4.28", "jaxlib": "0.4.28"})
  assert "installed: jax 0.4.28 and jaxlib 0.4.28." in message
  new = {"jax": "0.10.3.dev20260101", "jaxlib": "0.11.0", "optax": "0.2.8"}
  assert _versions.message(new) is None
  assert _versions.message(_versions.MINIMUM) is None


def test_pyproject_declares_the_minimums():
  declared = {
    re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0]: dep
    for dep in PYPROJECT["project"]["dependencies"]
  }
  assert declared == {
    name: f"{name}>={version}" for name, version in _versions.MINIMUM.items()
  }


def test_readme_states_the_minimums():
  (paragraph,) = [
    " ".join(p.split())
    for p in README.split("\n\n")
    if p.startswith("**Requirements:**")
  ]
  python = PYPROJECT["project"]["requires-python"].removeprefix(">=")
  assert f"Python {python} or newer" in paragraph
  for name, version in _versions.MINIMUM.items():
    assert f"`{name}>={version}`" in paragraph


def test_an_optax_that_does_not_import_is_named(tmp_path):
  # Not too old for optax_accum (0.2.7 works on older jax), but too old for
  # the installed jax: the message names both and the error.
  result, last = _import_error(tmp_path, FAKE_BROKEN_OPTAX)
  assert last.startswith(
    "ImportError: optax_accum needs an optax that imports with jax"
  ), last
  assert "installed: optax 0.2.7, whose import fails (AttributeError:" in last
  assert "pip install --upgrade optax" in last, last
  # The cause stays in the traceback.
  assert "jax_pmap_shmap_merge" in result.stderr


def test_an_optax_too_old_that_does_not_import_names_the_minimum(tmp_path):
  files = {
    name.replace("0.2.7", "0.2.3"): text.replace("0.2.7", "0.2.3")
    for name, text in FAKE_BROKEN_OPTAX.items()
  }
  result, last = _import_error(tmp_path, files)
  assert last.startswith("ImportError: optax_accum needs"), last
  assert "installed: optax 0.2.3." in last, last


def _pins(name):
  text = (ROOT / "constraints" / name).read_text()
  return dict(
    line.split("==", 1)
    for line in text.splitlines()
    if line and not line.startswith("#")
  )


def test_readme_names_the_tested_pairs():
  """The pinned legs of `make test` (constraints/*.txt), each with its
  Python, are the ones the README's requirements name."""
  (paragraph,) = [
    " ".join(p.split())
    for p in README.split("\n\n")
    if p.startswith("**Requirements:**")
  ]
  oldest, py311 = _pins("oldest.txt"), _pins("py311.txt")
  assert (
    f"on jax {oldest['jax']}, optax {oldest['optax']} on Python 3.11"
    " (`make test-oldest`)" in paragraph
  )
  assert f"on jax {py311['jax']} on Python 3.11 (`make test-py311`)" in (
    paragraph
  )
  assert "the whole suite on the newest jax for the newest Python" in paragraph


def test_the_oldest_stack_pins_the_minimums():
  """`make test-oldest` runs the core on exactly the declared minimums."""
  text = (ROOT / "constraints" / "oldest.txt").read_text()
  pins = dict(
    line.split("==", 1)
    for line in text.splitlines()
    if line and not line.startswith("#")
  )
  for name, version in _versions.MINIMUM.items():
    assert pins[name] == version, name
