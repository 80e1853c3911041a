"""Accelerators to compile for without one: an H100 and TPU v5e slices.

JAX compiles ahead of time for a device that is not there ("deviceless
AOT"): ``jax.experimental.topologies`` describes the target, a mesh over its
devices takes ``jax.ShapeDtypeStruct`` arguments, and ``jit(f).lower(...)
.compile()`` runs the target's own compiler (XLA:GPU, the TPU compiler), so
the compiled text and ``memory_analysis()`` are the program that device
would run. Nothing runs, so nothing is timed.

What it needs, besides jax: the CUDA plugin of the same version installed
without its NVIDIA libraries (only its compiler is used), libtpu, and
``JAX_PLATFORMS=cpu`` set before JAX starts, so that the CUDA plugin looks
for no driver. :func:`requirements` names the packages for the installed
jax; ``python -m optax_accum.targets`` prints them for ``pip install
--no-deps``. The test suite installs them apart from the package's own
environment and compiles in subprocesses (``tests/test_accelerators.py``).

The H100 is described by ``h100_sxm.txtpb`` (beside this file), written from NVIDIA's
published figures with a CUDA runtime of 12.8: XLA:GPU puts conditionals
in CUDA command buffers from 12.3 on.
"""

import functools
import importlib.metadata
import os
import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

TARGET_DIR = pathlib.Path(__file__).resolve().parent


class Target(NamedTuple):
  """A device to compile for.

  Attributes:
    name: how tests and benchmarks name it.
    platform: ``"cuda"`` or ``"tpu"``.
    topology: the topology string ``jax.experimental.topologies`` takes.
    devices: how many devices it has.
    description: what it is, in words.
  """

  name: str
  platform: str
  topology: str
  devices: int
  description: str
  memory_bytes: int = 0
  peak_flops: float = 0.0
  memory_bandwidth: float = 0.0


# Per device, from the vendors' published figures: the H100 SXM's 80 GiB
# (``device_memory_size`` in ``h100_sxm.txtpb``), 989 TFLOP/s dense bf16 and
# 3.35 TB/s; the TPU v5e's 16 GiB of HBM of which XLA:TPU offers programs
# 15.75 GiB (its out-of-memory message says so), 197 TFLOP/s bf16 and
# 819 GB/s. The rates are for estimates only (nothing here is timed).
# (memory_bytes, peak_flops, memory_bandwidth), Target's last three fields.
_H100 = (80 * 2**30, 989e12, 3.35e12)
_V5E = (int(15.75 * 2**30), 197e12, 819e9)

#: Every target, keyed by its name (``"h100"``, ``"h100x8"``, ``"v5e_2x2"``,
#: ``"v5e_2x4"``).
TARGETS = {
  t.name: t
  for t in (
    Target("h100", "cuda", "1x1x1", 1, "1 NVIDIA H100 SXM", *_H100),
    Target(
      "h100x8", "cuda", "1x1x8", 8, "8 NVIDIA H100 SXM (one host)", *_H100
    ),
    Target("v5e_2x2", "tpu", "v5e:2x2", 4, "TPU v5e, 2x2 (4 chips)", *_V5E),
    Target("v5e_2x4", "tpu", "v5e:2x4", 8, "TPU v5e, 2x4 (8 chips)", *_V5E),
  )
}

# JAX's share of a GPU's memory by default (its allocator preallocates
# XLA_PYTHON_CLIENT_MEM_FRACTION of the device, 0.75 unless set).
_GPU_MEMORY_FRACTION = 0.75


def memory_limit(name: str) -> int:
  """Bytes a program may use on one device of target `name`, as JAX would
  give them: on a GPU, ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default 0.75) of
  the device's memory; on a TPU, what XLA:TPU offers programs."""
  target = TARGETS[name]
  if target.platform != "cuda":
    return target.memory_bytes
  fraction = float(
    os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", _GPU_MEMORY_FRACTION)
  )
  return int(target.memory_bytes * fraction)


def requirements() -> list[str]:
  """The pip requirements of the compilers, for the installed jax.

  Install them with ``pip install --no-deps``: the CUDA plugin's NVIDIA
  libraries are needed to run on a GPU, not to compile for one.
  """
  version = importlib.metadata.version("jax")
  libtpu = [
    r.split(";")[0].replace(" ", "")
    for r in importlib.metadata.requires("jax") or ()
    if r.startswith("libtpu") and 'extra == "tpu"' in r
  ]
  return [
    f"jax-cuda12-plugin=={version}",
    f"jax-cuda12-pjrt=={version}",
    *libtpu,
  ]


def h100_description() -> str:
  """The ``GpuTargetConfigProto`` text of an H100 SXM."""
  return (TARGET_DIR / "h100_sxm.txtpb").read_text()


def check_cpu_only() -> None:
  """Raises unless JAX runs on CPU only (``JAX_PLATFORMS=cpu``)."""
  import jax

  if jax.config.jax_platforms != "cpu":
    raise RuntimeError(
      "Compiling for an accelerator without one needs JAX_PLATFORMS=cpu set"
      " before JAX starts, so that the CUDA plugin looks for no driver; got"
      f" jax_platforms={jax.config.jax_platforms!r}."
    )


@functools.cache
def topology(name: str) -> Any:
  """The ``TopologyDescription`` of target `name` (see :data:`TARGETS`)."""
  from jax.experimental import topologies

  check_cpu_only()
  target = TARGETS[name]
  if target.platform == "cuda":
    return topologies.get_topology_desc(
      platform="cuda",
      target_config=h100_description(),
      topology=target.topology,
    )
  return topologies.get_topology_desc(
    topology_name=target.topology, platform="tpu"
  )


def mesh(
  name: str,
  shape: Sequence[int],
  axis_names: Sequence[str],
  *,
  explicit: bool = False,
) -> Any:
  """A mesh over the devices of target `name`.

  Args:
    name: the target (see :data:`TARGETS`).
    shape: the mesh shape; its product is the target's device count.
    axis_names: one name per mesh axis.
    explicit: make every axis ``AxisType.Explicit`` (for gradients typed
      unreduced under plain ``jit``).
  """
  import jax
  from jax.experimental import topologies

  devices = topologies.make_mesh(
    topology(name), tuple(shape), tuple(axis_names)
  ).devices
  if not explicit:
    return jax.sharding.Mesh(devices, tuple(axis_names))
  types = (jax.sharding.AxisType.Explicit,) * len(axis_names)
  return jax.sharding.Mesh(devices, tuple(axis_names), axis_types=types)
