"""The docs run: every page's Python blocks, the examples' --help, packaging.

Page blocks. Every ```python block of every page of the site (`make docs`:
the Markdown files that ``docs/conf.py``'s ``include_patterns`` name: the
guides under docs/, the examples' index, the demo, the benchmark page) and of
the README is executed. The blocks of one page run in order in one
namespace, so a later block can use names an earlier one defined. A page's
``{include}`` of another file (``:start-after:``/``:end-before:``) runs the
included blocks in the page's namespace, where the page shows them: the
getting-started page shows the README's quick start, then builds on it.
Three markers, an HTML comment on the line just above a block's opening
fence, change that:

* ``<!-- docs-test: setup=NAME -->`` first runs ``SETUPS[NAME]`` (below) in
  the README's namespace: the model, data or step that the prose leaves to
  the reader. Keep setups small; they are part of the docs' contract.
* ``<!-- docs-test: skip: REASON -->`` does not run the block (a cluster, a
  network). Used sparingly: `test_few_blocks_are_skipped` caps the count.
* ``<!-- docs-test: accelerator -->`` runs the block alone, in a process that
  compiles for a GPU or TPU without one (``_common.accel_env()``: the
  compilers ``make test`` installs, ``JAX_PLATFORMS=cpu``); it must define
  everything it uses.

A ```text block right after a ```python block (nothing but blank lines
between) is the block's expected output: what the block prints must equal it.
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

# The names a block uses but the prose leaves to the reader. `_docs_tmp` is a
# fresh directory (set by the runner).
SETUPS = {
  # `params` for a linear model x @ w, and 6 micro-batches of 8 rows,
  # each with its own number of real rows (`mask`).
  "micro_batches": """
import jax, jax.numpy as jnp, numpy as np
_rng = np.random.default_rng(0)
params = {"w": jnp.zeros((3, 1))}
micro_batches = [
  {
    "x": jnp.asarray(_rng.normal(size=(8, 3)), jnp.float32),
    "y": jnp.asarray(_rng.normal(size=(8, 1)), jnp.float32),
    "mask": (jnp.arange(8) < real).astype(jnp.float32),
  }
  for real in (8, 3, 5, 1, 6, 2)
]
""",
  # A linen model, its params, one micro-batch's gradients and tokens.
  "linen": """
import jax, jax.numpy as jnp, optax, optax_accum
import flax.linen as nn
model = nn.Dense(1)
params = model.init(jax.random.key(0), jnp.ones((1, 3)))
grads = jax.tree.map(jnp.ones_like, params)
n_tokens = jnp.float32(5)
""",
  # Params whose `w` rows split over 8 devices, a step, a batch.
  "fsdp": """
import jax, jax.numpy as jnp, optax, optax_accum
params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros((1, 4))}
batch = {"x": jnp.ones((16, 16)), "y": jnp.ones((16, 4))}
def train_step(params, opt_state, batch):
  def loss_fn(params):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)
  updates, opt_state = tx.update(jax.grad(loss_fn)(params), opt_state, params)
  return optax_accum.apply_updates(params, updates, opt_state), opt_state
""",
  # An optax.MultiSteps run's params and state, 6 micro-batches in (one
  # cycle of 4, then 2), saved with Orbax at `path`.
  "multisteps_checkpoint": """
import jax, jax.numpy as jnp, optax
import orbax.checkpoint as ocp
params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
_old = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)
_state = _old.init(params)
for _i in range(6):
  _grads = jax.tree.map(lambda p: p * (_i + 1), params)
  _updates, _state = _old.update(_grads, _state, params)
  params = optax.apply_updates(params, _updates)
path = _docs_tmp / "multisteps"
with ocp.StandardCheckpointer() as _checkpointer:
  _checkpointer.save(path, {"params": params, "opt_state": _state})
""",
  # The same run as a flax TrainState, saved by the trainer's own
  # flax.training.checkpoints at `ckpt_dir`.
  "multisteps_train_state": """
from flax.training import checkpoints, train_state
ckpt_dir = _docs_tmp / "multisteps_train_state"
_state = train_state.TrainState.create(
  apply_fn=None,
  params=params,
  tx=optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation(),
)
for _i in range(6):
  _grads = jax.tree.map(lambda p: p * (_i + 1), _state.params)
  _state = _state.apply_gradients(grads=_grads)
checkpoints.save_checkpoint(ckpt_dir, _state, step=6)
""",
  # The previous block's optimizer state, saved with Orbax at `path`.
  "orbax_saved": """
import orbax.checkpoint as ocp
path = _docs_tmp / "opt_state"
with ocp.StandardCheckpointer() as _checkpointer:
  _checkpointer.save(path, opt_state)
""",
  # A token-mean loss returning its token count, params, and 8 micro-batches
  # of 16 sequences (2 per device) with 1 to 4 real tokens each.
  "shard_map": """
import jax, jax.numpy as jnp, numpy as np, optax, optax_accum
def loss_fn(params, x, y, mask):
  pred = jnp.einsum("btd,do->bto", x, params["w"]) + params["b"][None, None]
  err = jnp.sum((pred - y) ** 2, axis=-1)
  tokens = jnp.sum(mask)
  return jnp.sum(err * mask) / jnp.maximum(tokens, 1.0), tokens
params = {"w": jnp.zeros((8, 2)), "b": jnp.zeros(2)}
_rng = np.random.default_rng(0)
data_parallel_micro_batches = [
  (
    _rng.normal(size=(16, 4, 8)).astype(np.float32),
    _rng.normal(size=(16, 4, 2)).astype(np.float32),
    (np.arange(4) < _rng.integers(1, 5, size=(16, 1))).astype(np.float32),
  )
  for _ in range(8)
]
""",
}

_MARKER = re.compile(
  r"<!--\s*docs-test:\s*(setup=(?P<setup>\w+)|skip:(?P<skip>.+?)"
  r"|(?P<accelerator>accelerator))\s*-->"
)


@dataclasses.dataclass(frozen=True)
class Block:
  path: pathlib.Path  # the file that holds the block
  line: int  # 1-based line of the opening fence
  code: str
  setup: str | None
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
        setup=marker and marker["setup"],
        skip=marker and marker["skip"] and marker["skip"].strip(),
        expected_output=output,
        accelerator=bool(marker and marker["accelerator"]),
      )
    )
  return blocks


BLOCKS = [block for path in PAGES for block in python_blocks(path)]


class _Runner:
  """Runs one page's blocks in order, in one namespace, once each."""

  def __init__(self, tmp: pathlib.Path):
    self.namespace = {"__name__": "__docs__", "_docs_tmp": tmp}
    self.done: dict[str, tuple[BaseException | None, str]] = {}

  def run(self, block: Block) -> tuple[BaseException | None, str]:
    if block.id not in self.done:
      stdout = io.StringIO()
      error = None
      try:
        with contextlib.redirect_stdout(stdout):
          if block.setup:
            exec(SETUPS[block.setup], self.namespace)
          exec(compile(block.code, block.id, "exec"), self.namespace)
      except Exception as e:  # re-raised by the block's own test
        error = e
      self.done[block.id] = (error, stdout.getvalue())
    return self.done[block.id]


_RUNNERS: dict[pathlib.Path, _Runner] = {}


@pytest.fixture
def runner(request, tmp_path_factory):
  def get(path: pathlib.Path) -> _Runner:
    if path not in _RUNNERS:
      _RUNNERS[path] = _Runner(tmp_path_factory.mktemp("docs"))
    return _RUNNERS[path]

  return get


def _run_on_its_own(block: Block, tmp_path: pathlib.Path) -> str:
  """Runs an accelerator block in a process of its own; its stdout."""
  script = tmp_path / "block.py"
  script.write_text(block.code)
  return _common.run_with_compilers(
    [script], timeout=600, what=f"{block.id}:\n"
  )


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_page_block_runs(block, runner, tmp_path):
  if block.skip:
    pytest.skip(block.skip)
  if block.accelerator:
    stdout = _run_on_its_own(block, tmp_path)
  else:
    page = runner(block.namespace)
    # Earlier blocks first (when this test runs alone, e.g. with -k).
    for earlier in python_blocks(block.namespace):
      if earlier.id == block.id:
        break
      if not earlier.skip and not earlier.accelerator:
        page.run(earlier)
    error, stdout = page.run(block)
    if error is not None:
      raise error
  if block.expected_output is not None:
    assert stdout.rstrip() == block.expected_output.rstrip()


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
  used = {b.setup for b in BLOCKS if b.setup}
  assert used <= set(SETUPS), used - set(SETUPS)
  assert set(SETUPS) <= used, f"unused setups: {set(SETUPS) - used}"
  for path in PAGES:
    text = path.read_text()
    # Every marker sits right above a python block (no stray, ignored ones).
    markers = re.findall(r"^<!-- docs-test:", text, flags=re.M)
    assert len(markers) == sum(
      1
      for b in python_blocks(path)
      if b.page is None and (b.setup or b.skip or b.accelerator)
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
