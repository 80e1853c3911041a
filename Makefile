# make test  : create .venv (the newest Python, see below), install the package
#              with its test extras, run the suite, then test-py311 and
#              test-oldest
# make demo  : same set-up, then run the main example
# make bench : same set-up, then run the benchmark suite (never part of `make test`)
# make docs  : same set-up, then build the site into docs/_build/html
# make docs-check : make docs, then open every page in headless Chromium,
#              offline, and fail on raw math, cut-off tables, broken images,
#              private paths in signatures (about 20 s; not in `make test`)
# make test-oldest : the core suite on the oldest supported jax/optax (.venv-oldest)
# make test-py311 : the core suite on Python 3.11's newest jax (.venv-py311)
# make mutants : plant the project's mutants one at a time, report the kill rate

# --- The Pythons (issue 42) -------------------------------------------------
# The main venv's Python: the newest 3.12 or later on the machine
# (tools/newest_python.sh: PATH, then pyenv), where pip installs the newest
# jax (0.11 and later need Python 3.12; jax 0.12.0.1 on Python 3.13 here).
# Without one, Python 3.11 (whose newest jax is 0.10.2), and `make test`
# says loudly that the newest jax went untested (NEWEST_REQUIRED=1: it
# fails instead). The oldest stack runs on Python 3.11, the oldest Python
# pyproject.toml admits.
NEWEST_PYTHON := $(shell sh tools/newest_python.sh)
PY311 := $(shell python3.11 -c 'import sys; print(sys.executable)' 2>/dev/null)
PYTHON ?= $(or $(NEWEST_PYTHON),$(PY311),$(shell command -v python3))
OLDEST_PYTHON ?= $(or $(PY311),$(PYTHON))
NEWEST_REQUIRED ?= 0
# -----------------------------------------------------------------------------

VENV := .venv
PY := $(VENV)/bin/python
# Named after the Python, so that a venv of another Python is made anew.
STAMP := $(VENV)/.installed-$(notdir $(PYTHON))

.PHONY: test test-main test-oldest test-py311 python-note demo bench docs docs-check lint clean mutants

# Installs into a venv (1: the venv, 2: pip's arguments) with uv, from the
# package index like pip, which it resolves, downloads and unpacks in
# parallel (issue 40: the main venv and the compilers in 40 s from scratch
# on the 2-core box, pip took 94 s with its cache warm). uv comes from the
# package index into the venv; where it cannot be installed, or its install
# fails, pip does the install.
# --compile-bytecode, as pip does: without it, where PYTHONDONTWRITEBYTECODE
# is set (as on CI), every process compiles jax from source, 4 s a process.
define install
$(1)/bin/python -m pip install --quiet uv && \
  $(1)/bin/uv pip install --quiet --compile-bytecode \
    --python $(1)/bin/python $(2) || \
  $(1)/bin/python -m pip install --quiet $(2)
endef

MAIN_REQUIREMENTS := -e ".[test,examples,bench,docs]"

$(STAMP): pyproject.toml
	@if [ -x $(PY) ] && [ "$$($(PY) -c 'import sys; print(sys.base_prefix)')" \
	  != "$$($(PYTHON) -c 'import sys; print(sys.base_prefix)')" ]; then \
	  echo "$(VENV) has another Python: making it anew with $(PYTHON)"; \
	  rm -rf $(VENV); fi
	$(PYTHON) -m venv $(VENV)
	$(call install,$(VENV),$(MAIN_REQUIREMENTS))
	touch $(STAMP)

# The compilers for an H100 and a TPU, to compile for them without the
# devices (tests/test_accelerators.py, benchmarks/bench_compiled.py): the
# CUDA plugin of the installed jax without its NVIDIA libraries, and libtpu.
# Installed apart from the venv, so that only the processes that compile
# for an accelerator (with JAX_PLATFORMS=cpu) load them.
ACCEL := $(VENV)/accel
ACCEL_STAMP := $(ACCEL)/.installed

$(ACCEL_STAMP): $(STAMP)
	rm -rf $(ACCEL)
	$(call install,$(VENV),--no-deps --target $(ACCEL) $$($(PY) -m optax_accum.targets))
	touch $(ACCEL_STAMP)

# ruff, then the type checker (mypy, `[tool.mypy]` in pyproject.toml) over
# the package; tests/test_types.py checks the README's and the guides' code
# with the same settings.
lint: $(STAMP)
	$(PY) -m ruff check optax_accum tests examples benchmarks tools docs
	$(PY) -m ruff format --check optax_accum tests examples benchmarks tools docs
	$(PY) -m mypy

# Two workers: the CI machine has 2 cores and the suite is mostly
# single-threaded compiles. loadscope keeps a module's tests (and its
# module-scoped fixtures, e.g. the multi-process run) on one worker; the
# longest modules go out first (tests/conftest.py's order: without
# --no-loadscope-reorder xdist hands out the modules with the most tests
# first instead). Each worker compiles
# for the H100 and the TPU in one compile server of its own
# (tests/_accel_server.py), whatever modules it gets.
PYTEST_WORKERS ?= 2

# Then the core on Python 3.11 (test-py311, with its own compilers) and on
# the oldest supported stack (test-oldest), both below, with two workers
# too. Where the time goes: tools/suite_stats.py (the main suite on
# 2026-11-29, empty caches, the quiet 2-core box: about 920 CPU s, of which
# 430 s XLA:CPU compiles, 170 s the accelerator compile servers and 130 s
# subprocesses; test-py311 about 250 CPU s, test-oldest about 95; since
# then the compile servers compile without GEMM autotuning, 30% less:
# tests/_common.accel_env). Tried
# side by side (make -j3, 2026-11-29): no sooner done on 2 cores, every run
# being bound by its CPU, and one main-suite worker died in jax's
# persistent-cache write under that load (a segmentation fault, not seen
# with the runs one after the other); test-py311 and test-oldest side by
# side (make -j2 --output-sync, empty caches): 149 s, as one after the
# other. They run one after the other.
test: python-note test-main
	$(MAKE) --no-print-directory test-py311
	$(MAKE) --no-print-directory test-oldest python-note

# The main suite alone (the site first: docs, below, about 15 s).
test-main: $(STAMP) $(ACCEL_STAMP) lint docs
	OPTAX_ACCUM_ACCEL=$(abspath $(ACCEL)) $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=30

# The core on the oldest stack optax_accum supports (constraints/oldest.txt:
# jax 0.7.1, optax 0.2.4), in a venv of its own. The package is not
# installed there: pytest imports it from this checkout (pyproject's
# `pythonpath`). The core: accumulate, apply_updates, microbatch, the state
# readers, grow_every_k, shardings, and axis_name in shard_map, pmap and
# vmap; plus tests/test_old_jax.py, the error that deferring under plain
# jit names on a jax that lacks it. Their jitted variants only: the eager
# ones (`nojit`) run the same code at twice the time. Not here: the
# argument checks (plain Python), the modules tests/conftest.py skips on an
# old jax, the examples and benchmarks.
OLD_VENV := .venv-oldest
OLD_PY := $(OLD_VENV)/bin/python
OLD_STAMP := $(OLD_VENV)/.installed
CORE_TESTS := tests/test_accumulate.py tests/test_apply_updates.py \
  tests/test_microbatch.py tests/test_every_k.py tests/test_axis_name.py \
  tests/test_pmap.py tests/test_sharding.py tests/test_chain_placement.py \
  tests/test_old_jax.py

$(OLD_STAMP): constraints/oldest.txt
	rm -rf $(OLD_VENV)
	$(OLDEST_PYTHON) -m venv $(OLD_VENV)
	$(call install,$(OLD_VENV),-r constraints/oldest.txt)
	touch $(OLD_STAMP)

# The core's run, for a leg's Python: test-oldest and test-py311.
LEG_PYTEST := -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope -k "not nojit"

test-oldest: $(OLD_STAMP)
	$(OLD_PY) $(LEG_PYTEST) $(CORE_TESTS)

# --- Python 3.11's leg (issue 42) ---------------------------------------------
# When the main venv runs a newer Python: the same core on the newest jax
# Python 3.11 gets (jax 0.10.2, constraints/py311.txt), in a venv of its
# own, imported from this checkout as test-oldest does; and the programs
# compiled for an H100 and a TPU (tests/test_accelerators.py, the recipes
# of tests/test_recipes.py), with that jax's compilers.
PY311_VENV := .venv-py311
PY311_PY := $(PY311_VENV)/bin/python
PY311_STAMP := $(PY311_VENV)/.installed

$(PY311_STAMP): constraints/py311.txt
	rm -rf $(PY311_VENV)
	$(PY311) -m venv $(PY311_VENV)
	$(call install,$(PY311_VENV),-r constraints/py311.txt)
	touch $(PY311_STAMP)

# The leg's own compilers for an H100 and a TPU (the CUDA plugin and libtpu
# of jax 0.10.2), so that the compiled-program tests hold that XLA too
# (issue 60: its XLA copies a program jax 0.12's does not): the programs for
# one H100 (the traced step, f32/bf16/weight=, the emitting step, the
# recipes; OPTAX_ACCUM_ACCEL_SCOPE=one_h100 deselects those of several
# devices, held on the newest jax). And Flax's sharding recipes with the NNX
# drop-in on its flax (tests/test_nnx_sharding.py, issue 67: flax 0.12.8).
PY311_ACCEL := $(PY311_VENV)/accel
PY311_ACCEL_STAMP := $(PY311_ACCEL)/.installed
PY311_TESTS := $(CORE_TESTS) tests/test_accelerators.py tests/test_recipes.py \
  tests/test_nnx_sharding.py

$(PY311_ACCEL_STAMP): $(PY311_STAMP)
	rm -rf $(PY311_ACCEL)
	$(call install,$(PY311_VENV),--no-deps --target $(PY311_ACCEL) $$($(PY311_PY) -m optax_accum.targets))
	touch $(PY311_ACCEL_STAMP)

ifeq ($(PY311),)
test-py311:
	@echo "test-py311: no Python 3.11 on this machine; not run."
else ifeq ($(PY311),$(PYTHON))
test-py311:
	@echo "test-py311: the main venv runs Python 3.11 already; not run again."
else
test-py311: $(PY311_STAMP) $(PY311_ACCEL_STAMP)
	OPTAX_ACCUM_ACCEL=$(abspath $(PY311_ACCEL)) OPTAX_ACCUM_ACCEL_SCOPE=one_h100 \
	  $(PY311_PY) $(LEG_PYTEST) $(PY311_TESTS)
endif

# Says which Python the main venv runs, loudly when it is not the newest
# jax's (before the suite and after it, so that a log's end says so too).
python-note:
ifeq ($(NEWEST_PYTHON),)
	@echo "*** NO PYTHON 3.12 OR LATER FOUND (PATH python3.N, pyenv): the suite" >&2
	@echo "*** runs on $(PYTHON), whose newest jax is older" >&2
	@echo "*** than PyPI's: the newest jax (0.11 and later) went UNTESTED." >&2
	@echo "*** Install one (e.g. pyenv install 3.13) to test it." >&2
	@test "$(NEWEST_REQUIRED)" != 1
else
	@echo "make test: the suite on $(NEWEST_PYTHON) ($(VENV)), the core on Python 3.11 ($(PY311_VENV), $(OLD_VENV))"
endif

# The demo ends with plans for this machine and one H100 (examples/lm/plan.py),
# the H100's compiled with the compilers of $(ACCEL).
demo: $(STAMP) $(ACCEL_STAMP)
	OPTAX_ACCUM_ACCEL=$(abspath $(ACCEL)) $(PY) examples/lm/main.py

# Adaptive batch size on the demo (~15 min on 2 busy cores): rewrites
# examples/lm/results/, the figures that examples/lm/README.md quotes.
.PHONY: adaptive
adaptive: $(STAMP)
	$(PY) examples/lm/adaptive.py

# The benchmark suite (~15 min on 2 cores), then every page's tables
# (benchmarks/render.py). bench_comm's sharded table, bench_compiled and
# bench_plan compile for accelerators.
bench: $(STAMP) $(ACCEL_STAMP)
	$(PY) benchmarks/bench_loop.py
	JAX_PLATFORMS=cpu PYTHONPATH=$(abspath $(ACCEL)) $(PY) benchmarks/bench_comm.py
	JAX_PLATFORMS=cpu PYTHONPATH=$(abspath $(ACCEL)) $(PY) benchmarks/bench_compiled.py
	JAX_PLATFORMS=cpu PYTHONPATH=$(abspath $(ACCEL)) $(PY) benchmarks/bench_plan.py
	$(PY) benchmarks/render.py

# The documentation site (Sphinx; the sources are docs/ and the pages that
# live beside their code, see docs/conf.py). Warnings are errors (-W),
# cross-references nitpicky (-n): a role naming a function that is not there,
# a dead link between pages, a page no toctree reaches, or a public name
# without an API entry (docs/_ext/api_coverage.py) fails it. -E: a fresh
# environment every time, so a warning is never hidden by a cached page.
# Open docs/_build/html/index.html.
docs: $(STAMP)
	$(PY) -m sphinx -E -W --keep-going -n -q -b html -c docs . docs/_build/html
	@echo "The site: $(abspath docs/_build/html/index.html)"

# The built site as a reader sees it (tools/docs_check.py): headless
# Chromium opens every page from disk with the network off and fails on math
# left raw (\( or \[ in the text: MathJax did not run), a table wider than
# its column, an image or any file that does not load, a request off the
# machine, or a private path (optax_accum._, optax._src) in a signature.
# Chromium is Debian's package, installed here where missing (apt-get, as
# root). Never part of `make test`: about 20 s on the 2-core box (the build
# 7 s, the 43 pages 10 s), plus a minute or two for Chromium's first install.
# DOCS_CHECK_ARGS: e.g. `--screenshots DIR` (the landing page, the API page,
# the migration guide at 1400 px), or pages to check.
docs-check: docs
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "docs-check: installing Debian's chromium"; \
	  apt-get update -qq && apt-get install -y -qq chromium; }
	$(PY) tools/docs_check.py $(DOCS_CHECK_ARGS)

# The project's mutants of the core and the migration code (tools/mutants.py;
# optax_accum/README.md, "Checking a change"), each planted in a temporary
# copy and run against the tests that cover it; never part of `make test`.
# MUTANTS_ARGS: e.g. `-j 2`, or names to run a few.
mutants: $(STAMP) $(ACCEL_STAMP)
	OPTAX_ACCUM_ACCEL=$(abspath $(ACCEL)) $(PY) tools/mutants.py $(MUTANTS_ARGS)

# The suite keeps one persistent compilation cache in each venv
# (tests/conftest.py): .venv/jax-cache, .venv-oldest/jax-cache.
clean:
	rm -rf $(VENV) $(OLD_VENV) $(PY311_VENV) build *.egg-info docs/_build
