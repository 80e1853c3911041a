"""Tools for this repository's tests and benchmarks; not part of the package.

Nothing here ships in the wheel: the package's users never need it.

* :mod:`tools.program`: what a compiled accumulation step does on one call
  (kernels, bytes, copies, GEMMs), the reader behind the accelerator tests
  and ``benchmarks/bench_compiled.py``.
"""
