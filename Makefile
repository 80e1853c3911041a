# make test  : create .venv, install the package with its test extras, run the suite
# make demo  : same set-up, then run the main example
# make bench : same set-up, then run the benchmark suite (never part of `make test`)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples,bench]"
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
	$(PY) -m pip install --quiet --no-deps --target $(ACCEL) $$($(PY) -m optax_accum.targets)
	touch $(ACCEL_STAMP)

lint: $(STAMP)
	$(PY) -m ruff check optax_accum tests examples benchmarks tools
	$(PY) -m ruff format --check optax_accum tests examples benchmarks tools

# Two workers: the CI machine has 2 cores and the suite is mostly
# single-threaded compiles. loadscope keeps a module's tests (and its
# module-scoped fixtures, e.g. the multi-process run) on one worker.
PYTEST_WORKERS ?= 2

test: $(STAMP) $(ACCEL_STAMP) lint
	OPTAX_ACCUM_ACCEL=$(abspath $(ACCEL)) $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope

demo: $(STAMP)
	$(PY) examples/lm/main.py

# Adaptive batch size on the demo (~15 min on 2 busy cores): rewrites
# examples/lm/results/, the figures that examples/lm/README.md quotes.
.PHONY: adaptive
adaptive: $(STAMP)
	$(PY) examples/lm/adaptive.py

# The benchmark suite (~10 min on 2 cores), then the pages' figures.
# bench_comm's sharded table and bench_compiled compile for accelerators.
bench: $(STAMP) $(ACCEL_STAMP)
	$(PY) benchmarks/bench_step.py
	$(PY) benchmarks/bench_train.py
	JAX_PLATFORMS=cpu PYTHONPATH=$(abspath $(ACCEL)) $(PY) benchmarks/bench_comm.py
	JAX_PLATFORMS=cpu PYTHONPATH=$(abspath $(ACCEL)) $(PY) benchmarks/bench_compiled.py
	$(PY) benchmarks/render_readme.py

clean:
	rm -rf $(VENV) build *.egg-info
