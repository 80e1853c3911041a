"""Sphinx configuration of the optax_accum site (`make docs`).

Built with warnings as errors and nitpicky cross-references (`make docs`
passes `-W --keep-going -n`): a role that names a function that is not there
(a rename a guide missed), a dead link between pages, a page that no toctree
reaches, or a public name without an API entry (`_ext/api_coverage.py`) fails
the build.
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed one
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "_ext"))

import optax_accum  # noqa: E402

project = "optax_accum"
author = "The optax_accum authors"
copyright = "The optax_accum authors"  # noqa: A001
release = optax_accum.__version__
version = release

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  # MathJax 3 (its scripts and fonts) copied into the site's _static, so
  # that formulas render with no network: opened from disk, on an
  # air-gapped cluster. It sets `mathjax_path` to the copy.
  "sphinx-mathjax-offline",
  "sphinx.ext.viewcode",
  "myst_parser",
  "api_coverage",
  "readable_signatures",
]

# The source directory is the repository's root (`make docs` runs
# `sphinx-build -c docs . docs/_build/html`): the pages that live beside their
# code (the examples' index, the demo, the benchmark page) are pages of the
# site as they are, and their relative links work both here and in a
# repository browser.
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
include_patterns = [
  "docs/**",
  "examples/README.md",
  "examples/lm/README.md",
  "benchmarks/README.md",
  "benchmarks/results/*.md",
  "benchmarks/results/gpu/*.md",
  "examples/lm/results/*.md",
]
# Not walked at all: the virtual environments (tens of thousands of files)
# and the other folders that hold no page.
exclude_patterns = [
  ".*",
  "build",
  "constraints",
  "optax_accum",
  "tests",
  "tools",
  "**/__pycache__",
  "docs/_build",
  "docs/_ext",
  "docs/_root",
  "docs/_static",
]
root_doc = "docs/index"
# `docs/_build/html/index.html`: a redirect to the site's index.
html_extra_path = ["_root"]

html_theme = "furo"
html_title = f"optax_accum {release}"
# Wide tables wrap to the text column rather than scroll out of sight.
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_js_files = ["table-breaks.js"]

# Markdown pages: `#anchor` and `page.md#anchor` links resolve to headings
# (a dead one is a warning, so an error); `$...$` and `{role}` as in the
# docstrings.
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath", "colon_fence"]

# The API reference: entries in the order of the source, signatures with
# their annotations, the docstrings' Google sections (napoleon).
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# optax's tree aliases by name, not as the union each stands for
# (`_ext/readable_signatures.py` hands autodoc the annotation as written).
autodoc_type_aliases = {
  name: name
  for name in (
    "optax.Updates",
    "optax.Params",
    "optax.OptState",
    "chex.ArrayTree",
  )
}
autosummary_generate = False  # the API pages list their names themselves
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True

nitpicky = True
# The build has no network (a CI box reaches package registries only), so no
# intersphinx: names from other libraries and the standard library are not
# linked, and are not errors. Every name of optax_accum must resolve.
nitpick_ignore_regex = [
  (
    r"py:.*",
    r"(jax|jaxlib|optax|flax|nnx|orbax|numpy|np|jnp|chex|equinox)"
    r"(\..*)?",
  ),
  (
    r"py:.*",
    r"(typing|collections|collections\.abc|pathlib|enum|types)"
    r"\..*",
  ),
  (
    r"py:class",
    r"(Any|Callable|Sequence|Mapping|Iterable|Iterator|"
    r"NamedTuple|Literal|Optional|Union|ArrayTree|PyTree|Array|"
    r"ArrayLike|Params|Updates|OptState|Schedule|DTypeLike|Shape)",
  ),
  (
    r"py:(class|obj|data)",
    r"(int|float|bool|str|bytes|object|tuple|list|"
    r"dict|set|frozenset|type|None|callable|function|Exception|ValueError|"
    r"TypeError|NotImplementedError|AttributeError|RuntimeError|"
    r"ImportError)",
  ),
]

# Public names per module, for the coverage check: each module's `__all__`
# (`optax_accum.targets` has none: its functions and classes).
api_coverage_modules = [
  "optax_accum",
  "optax_accum.flax",
  "optax_accum.distributed",
  "optax_accum.inspect",
  "optax_accum.multisteps",
  "optax_accum.types",
  "optax_accum.targets",
]


# Titles of the results files that their scripts write without a heading.
_RESULTS_TITLES = {
  "examples/lm/results/results": (
    "Adaptive batch size: fixed k, a token schedule, the noise-scale"
    " controller (`examples/lm/adaptive.py`)"
  ),
  "examples/lm/results/wire_dtype": (
    "The reduction's dtype on the wire: float32 or bfloat16"
    " (`examples/lm/wire_dtype.py`)"
  ),
}


def _title_results(app, docname, source):
  """A results file that its script wrote without a heading gets a title (a
  page needs one to be listed): its own from `_RESULTS_TITLES`, else its
  name in words."""
  del app
  if "/results/" in docname and not source[0].lstrip().startswith("#"):
    title = _RESULTS_TITLES.get(docname)
    if title is None:
      words = docname.rsplit("/", 1)[-1].replace("_", " ")
      title = f"Results: {words} (`{docname}.md`)"
    source[0] = f"# {title}\n\n" + source[0]


def setup(app):
  app.connect("source-read", _title_results)
