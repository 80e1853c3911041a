"""The docs run: every page as a script, the examples' --help, packaging.

Pages. Every page of the site (`make docs`: the Markdown files that
``docs/conf.py``'s ``include_patterns`` name: the guides under docs/, the
examples' index, the demo, the benchmark page) and the README runs as one
script: its ```python blocks, top to bottom, in one fresh namespace, with
nothing run before them or between them. A page makes the data and the model
it uses itself, where the reader sees it (as optax's and flax's
getting-started pages do). A page's ``{include}`` of another file
(``:start-after:``/``:end-before:``) runs the included blocks where the page
shows them: the landing page and getting started show the README's example
and quick start, then build on them.

A ```text block right after a ```python block (nothing but blank lines
between) is the block's expected output: what the block prints must equal it.

Two markers, an HTML comment on the line just above a block's opening fence,
take a block out of its page's script:

* ``<!-- docs-test: skip: REASON -->`` does not run the block (a cluster, a
  network). Used sparingly: `test_few_blocks_are_skipped` caps the count.
* ``<!-- docs-test: accelerator -->`` runs the block alone, in a process that
  compiles for a GPU or TPU without one (``_common.accel_env()``: the
  compilers ``make test`` installs, ``JAX_PLATFORMS=cpu``); it must define
  everything it uses.

Doctest-style ``>>>`` examples live in docstrings and run as doctests.
"""

import ast
import contextlib
import dataclasses
import importlib.util
import io
import pathlib
import re
import subprocess
import sys
import tomllib
import traceback

import _common
import pytest

import optax_accum

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDES = ROOT / "docs" / "guides"


def site_pages() -> list[pathlib.Path]:
  """The Markdown pages `make docs` builds: ``docs/conf.py``'s
  ``include_patterns`` (read, not imported: conf.py needs Sphinx)."""
  conf = ast.parse((ROOT / "docs" / "conf.py").read_text())
  (patterns,) = [
    ast.literal_eval(node.value)
    for node in conf.body
    if isinstance(node, ast.Assign)
    and [getattr(t, "id", None) for t in node.targets] == ["include_patterns"]
  ]
  pages = set()
  for pattern in patterns:
    pattern = (
      pattern.replace("**", "**/*") if pattern.endswith("**") else pattern
    )
    pages |= {
      path
      for path in ROOT.glob(pattern)
      if path.suffix == ".md" and "_build" not in path.parts
    }
  return sorted(pages)


PAGES = [ROOT / "README.md", *site_pages()]
MAX_SKIPPED = 2

_MARKER = re.compile(
  r"<!--\s*docs-test:\s*(skip:(?P<skip>.+?)|(?P<accelerator>accelerator))\s*-->"
)


@dataclasses.dataclass(frozen=True)
class Block:
  path: pathlib.Path  # the file that holds the block
  line: int  # 1-based line of the opening fence
  code: str
  skip: str | None
  expected_output: str | None
  accelerator: bool = False
  page: pathlib.Path | None = None  # the page that shows it (an include)

  @property
  def id(self) -> str:
    where = f"{self.path.relative_to(ROOT)}:{self.line}"
    if self.page in (None, self.path):
      return where
    return f"{self.page.relative_to(ROOT)}<{where}"

  @property
  def namespace(self) -> pathlib.Path:
    return self.page or self.path


def _fences(lines: list[str]) -> list[tuple[str, int, int, str]]:
  """(info, first line index, last line index, body) of every fence."""
  fences = []
  i = 0
  while i < len(lines):
    if lines[i].startswith("```"):
      info, start = lines[i][3:].strip(), i
      end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
      fences.append((info, start, end, "\n".join(lines[start + 1 : end])))
      i = end
    i += 1
  return fences


def _included(path: pathlib.Path, target: str, body: str) -> list[Block]:
  """The python blocks that ```{include} `target` on `path` shows."""
  included = (path.parent / target).resolve()
  option = dict(
    re.fullmatch(r":([\w-]+):\s*(.*)", line.strip()).groups()
    for line in body.splitlines()
    if line.strip()
  )
  text = included.read_text()
  first = 0
  last = len(text)
  if "start-after" in option:
    first = text.index(option["start-after"]) + len(option["start-after"])
  if "end-before" in option:
    last = text.index(option["end-before"], first)
  first_line = text[:first].count("\n") + 1
  last_line = text[:last].count("\n") + 1
  return [
    dataclasses.replace(block, page=path)
    for block in python_blocks(included)
    if first_line <= block.line <= last_line
  ]


def python_blocks(path: pathlib.Path) -> list[Block]:
  """The ```python blocks a Markdown page shows, with markers and outputs:
  its own and those of the files it includes, in the page's order."""
  lines = path.read_text().splitlines()
  fences = _fences(lines)
  blocks = []
  for n, (info, start, end, code) in enumerate(fences):
    if info.startswith("{include}"):
      blocks += _included(path, info.removeprefix("{include}").strip(), code)
      continue
    if info != "python":
      continue
    before = next(
      (lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), ""
    )
    marker = _MARKER.fullmatch(before.strip())
    output = None
    if n + 1 < len(fences) and fences[n + 1][0] == "text":
      between = lines[end + 1 : fences[n + 1][1]]
      if not any(line.strip() for line in between):
        output = fences[n + 1][3]
    blocks.append(
      Block(
        path=path,
        line=start + 1,
        code=code,
        skip=marker and marker["skip"] and marker["skip"].strip(),
        expected_output=output,
        accelerator=bool(marker and marker["accelerator"]),
      )
    )
  return blocks


BLOCKS = [block for path in PAGES for block in python_blocks(path)]


def script_blocks(page: pathlib.Path) -> list[Block]:
  """The blocks that make `page`'s script, in the page's order: all but the
  skipped ones and those that run alone (``accelerator``)."""
  return [b for b in python_blocks(page) if not b.skip and not b.accelerator]


@dataclasses.dataclass(frozen=True)
class Script:
  """A page's blocks joined into one Python source, as a reader who copies
  them top to bottom runs them, and what it must print."""

  page: pathlib.Path
  source: str
  expected_output: str
  lines: tuple[tuple[int, Block], ...]  # (first script line, block)

  def where(self, lineno: int) -> str:
    """The file line (``path:line``) of line `lineno` of the script."""
    first, block = max((f, b) for f, b in self.lines if f <= lineno)
    line = f"{block.path.relative_to(ROOT)}:{block.line + lineno - first + 1}"
    return line if block.page is None else f"{line} (shown on {block.id})"


def page_script(page: pathlib.Path) -> Script:
  """`page`'s blocks as one script (see `Script`)."""
  source, expected, lines, at = [], [], [], 1
  for block in script_blocks(page):
    lines.append((at, block))
    source.append(block.code)
    at += block.code.count("\n") + 2  # the blank line between blocks
    if block.expected_output is not None:
      expected.append(block.expected_output.rstrip("\n"))
  return Script(page, "\n\n".join(source), "\n".join(expected), tuple(lines))


SCRIPT_PAGES = [page for page in PAGES if script_blocks(page)]


def run_script(script: Script) -> str:
  """Runs `script` in a fresh namespace; its stdout. An exception is
  re-raised naming the page line it came from."""
  name = f"<{script.page.relative_to(ROOT)} as one script>"
  code = compile(script.source, name, "exec")
  stdout = io.StringIO()
  try:
    with contextlib.redirect_stdout(stdout):
      exec(code, {"__name__": "__docs__"})
  except Exception as e:
    frames = [
      f for f in traceback.extract_tb(e.__traceback__) if f.filename == name
    ]
    where = script.where(frames[-1].lineno) if frames else name
    raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
  return stdout.getvalue()


@pytest.mark.parametrize(
  "page", SCRIPT_PAGES, ids=[str(p.relative_to(ROOT)) for p in SCRIPT_PAGES]
)
def test_page_runs_as_one_script(page):
  """The page's blocks as one script, nothing run before or between them;
  what it prints is the page's ```text blocks, in order (a block that
  prints shows its output)."""
  script = page_script(page)
  printed = run_script(script)
  assert printed.rstrip("\n") == script.expected_output


def _run_on_its_own(block: Block, tmp_path: pathlib.Path) -> str:
  """Runs an accelerator block in a process of its own; its stdout."""
  script = tmp_path / "block.py"
  script.write_text(block.code)
  return _common.run_with_compilers(
    [script], timeout=600, what=f"{block.id}:\n"
  )


ALONE = [b for b in BLOCKS if b.accelerator and not b.skip]


@pytest.mark.parametrize("block", ALONE, ids=[b.id for b in ALONE])
def test_accelerator_block_runs_alone(block, tmp_path):
  stdout = _run_on_its_own(block, tmp_path)
  if block.expected_output is not None:
    assert stdout.rstrip() == block.expected_output.rstrip()


def test_getting_started_is_one_script_with_its_data():
  """Issue 53: getting started runs as shown, top to bottom: the README's
  quick start (included) makes its params and micro-batches itself, and
  no block of the page is taken out of the script."""
  page = GUIDES / "getting_started.md"
  assert page in SCRIPT_PAGES
  assert script_blocks(page) == python_blocks(page)
  first = script_blocks(page)[0]
  assert first.path == ROOT / "README.md"  # the quick start, included
  tree = ast.parse(first.code)
  made = {
    t.id
    for node in ast.walk(tree)
    if isinstance(node, ast.Assign)
    for t in node.targets
    if isinstance(t, ast.Name)
  }
  assert {"params", "micro_batches"} <= made, made
  assert page_script(page).expected_output  # it shows what it prints


# The python blocks on the pages when the guides moved into docs/ (issue 39:
# README.md, examples/README.md and examples/lm/README.md held 31); the site
# shows the README's quick start again, on the getting-started page.
BLOCKS_BEFORE_THE_SITE = 31


def test_blocks_are_found_and_markers_are_known():
  assert ROOT / "README.md" in PAGES
  assert GUIDES / "getting_started.md" in PAGES
  assert ROOT / "benchmarks" / "README.md" in PAGES
  own = [b for b in BLOCKS if b.page is None]
  assert len(own) >= BLOCKS_BEFORE_THE_SITE, len(own)
  assert any(b.page is not None for b in BLOCKS)  # the quick start, included
  for path in PAGES:
    text = path.read_text()
    # Every marker sits right above a python block (no stray, ignored ones),
    # and none asks for a hidden set-up: a page makes what it uses.
    assert "docs-test: setup=" not in text, path
    markers = re.findall(r"^<!-- docs-test:", text, flags=re.M)
    assert len(markers) == sum(
      1
      for b in python_blocks(path)
      if b.page is None and (b.skip or b.accelerator)
    ), path
    for block in python_blocks(path):
      ast.parse(block.code)  # skipped blocks must at least be Python


def test_every_guide_is_a_page_of_the_site():
  """A Markdown file under docs/ that the build skipped would be neither
  rendered nor run here."""
  on_disk = {
    p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts
  }
  assert on_disk <= set(PAGES), on_disk - set(PAGES)


def test_few_blocks_are_skipped():
  skipped = [b.id for b in BLOCKS if b.skip]
  assert len(skipped) <= MAX_SKIPPED, skipped


def test_lr_schedule_output_in_the_guide_is_the_scripts():
  spec = importlib.util.spec_from_file_location(
    "example_lr_schedules", ROOT / "examples" / "lr_schedules.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    module.main()
  guide = (GUIDES / "schedules.md").read_text()
  for line in stdout.getvalue().splitlines():
    assert line.rstrip() in guide, line


# ---------------------------------------------------------------------------
# The changelog (Keep a Changelog), on the site.
# ---------------------------------------------------------------------------

CHANGELOG = ROOT / "CHANGELOG.md"
KAC_SECTIONS = {
  "Added",
  "Changed",
  "Deprecated",
  "Removed",
  "Fixed",
  "Security",
}


def test_changelog_is_keep_a_changelog():
  """An ``[Unreleased]`` section first, then released versions newest
  first, each ``## [X.Y.Z] - YYYY-MM-DD``; only the six kinds of change."""
  text = CHANGELOG.read_text()
  versions = re.findall(r"^## (.+)$", text, flags=re.M)
  assert versions[0] == "[Unreleased]", versions
  released = [
    re.fullmatch(r"\[(\d+\.\d+\.\d+)\] - \d{4}-\d\d-\d\d", v)
    for v in versions[1:]
  ]
  assert all(released), versions
  numbers = [tuple(map(int, m.group(1).split("."))) for m in released]
  assert numbers == sorted(numbers, reverse=True), numbers
  sections = set(re.findall(r"^### (.+)$", text, flags=re.M))
  assert sections <= KAC_SECTIONS, sections - KAC_SECTIONS
  # On the site: docs/changelog.md includes the file itself.
  assert (
    "```{include} ../CHANGELOG.md"
    in (ROOT / "docs" / "changelog.md").read_text()
  )


def test_changelog_lists_every_moved_name():
  """Each name that 0.2 moved behind a DeprecationWarning, with the name
  that replaces it, in the 0.2.0 section."""
  text = CHANGELOG.read_text()
  section = text[text.index("## [0.2.0]") : text.index("## [0.1.0]")]
  moved = optax_accum._MOVED
  assert len(moved) == 13
  for name, module in moved.items():
    row = f"| `optax_accum.{name}` | `{module}.{name}` |"
    assert row in section, row


# ---------------------------------------------------------------------------
# Every example answers --help.
# ---------------------------------------------------------------------------

EXAMPLE_SCRIPTS = sorted(
  path
  for path in (ROOT / "examples").rglob("*.py")
  if 'if __name__ == "__main__":' in path.read_text()
)


def test_every_example_answers_help():
  assert ROOT / "examples" / "lm" / "main.py" in EXAMPLE_SCRIPTS
  # All at once: each pays for importing JAX, none runs anything.
  procs = {
    path: subprocess.Popen(
      [sys.executable, str(path), "--help"],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      cwd=ROOT,
    )
    for path in EXAMPLE_SCRIPTS
  }
  for path, proc in procs.items():
    out, err = proc.communicate(timeout=300)
    name = path.relative_to(ROOT)
    assert proc.returncode == 0, f"{name}: {err[-2000:]}"
    assert out.startswith("usage:"), f"{name}: {out[:300]}"


# ---------------------------------------------------------------------------
# Install and packaging.
# ---------------------------------------------------------------------------

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

_CLEAN_IMPORT = """
import sys
# Anything beyond jax and optax: importing it now raises ImportError.
for name in ("flax", "chex", "orbax", "orbax.checkpoint", "rich",
             "matplotlib", "hypothesis", "pytest"):
  sys.modules[name] = None
import jax.numpy as jnp, optax
import optax_accum
tx = optax_accum.accumulate(optax.adam(1e-3), 2)
state = tx.init({"w": jnp.ones(3)})
updates, state = tx.update({"w": jnp.ones(3)}, state, weight=2.0)
print("ok", bool(optax_accum.has_updated(state)))
"""


def test_import_needs_only_jax_and_optax():
  names = {
    re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0]
    for dep in PYPROJECT["project"]["dependencies"]
  }
  assert names == {"jax", "jaxlib", "optax"}  # jaxlib: jax's own
  result = subprocess.run(
    [sys.executable, "-c", _CLEAN_IMPORT],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == "ok False"


def test_version_has_one_source():
  project = PYPROJECT["project"]
  assert "version" not in project
  assert "version" in project["dynamic"]
  attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
  assert attr == "optax_accum.__version__"
  assert re.fullmatch(r"\d+\.\d+\.\d+", optax_accum.__version__)


def test_license_is_an_spdx_string():
  assert PYPROJECT["project"]["license"] == "Apache-2.0"
  # SPDX strings need setuptools >= 77; older ones warn or fail.
  (setuptools,) = [
    r for r in PYPROJECT["build-system"]["requires"] if "setuptools" in r
  ]
  assert re.fullmatch(r"setuptools>=(\d+)", setuptools)
  assert int(setuptools.split(">=")[1]) >= 77


def test_test_extra_has_hypothesis():
  extras = PYPROJECT["project"]["optional-dependencies"]
  assert any(dep.startswith("hypothesis") for dep in extras["test"])
