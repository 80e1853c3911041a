"""``python -m optax_accum.targets``: the pip requirements of the
accelerator compilers (the Makefile installs them into ``.venv/accel``)."""

from optax_accum.targets import requirements

print(" ".join(requirements()))
