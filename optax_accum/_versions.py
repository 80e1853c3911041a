"""The oldest jax, jaxlib and optax optax_accum works with, checked on import.

The minimums are the oldest releases with which the whole test suite passes
(README, "Requirements"; ``pyproject.toml`` declares the same):

* jax 0.10.2: the first with an unreduced/reduced rule for ``select_n`` (the
  accumulator's ``jnp.where`` under plain ``jit``, ``_unreduced.py``); 0.10.1
  raises ``NotImplementedError`` there. Older ones lack more: ``lax.pcast``
  and ``jax.reshard`` (before 0.8.2), ``jax.sharding.AxisType`` (0.4).
* jaxlib 0.10.2: jax 0.10.2 accepts jaxlib 0.10.1, with which XLA:GPU keeps
  the micro-step's conditionals out of the CUDA command buffer and the
  compiled collectives print their groups in another form.
* optax 0.2.8: 0.2.7 does not import on jax 0.10.2 (it sets the config
  option ``jax_pmap_shmap_merge``, which jax 0.10.2 no longer has); 0.2.4 to
  0.2.6 import ``chex`` and keep a smaller ``MultiSteps`` with bf16 params
  than the suite holds ``accumulate`` to; 0.2.3 lacks
  ``optax.safe_increment``.

Older releases fail later and obscurely (on jax 0.4.28, ``cannot import name
'AxisType' from 'jax.sharding'``). The package imports this module first,
and importing it runs :func:`check`, which names the installed and the
needed versions. jax is checked before optax is imported, since a new optax
may not import on an old jax; an optax that does not import is judged by
its installed metadata.
"""

import importlib.metadata
import re
from collections.abc import Mapping

MINIMUM = {"jax": "0.10.2", "jaxlib": "0.10.2", "optax": "0.2.8"}


def release(version: str) -> tuple[int, ...]:
  """The leading release numbers of `version`: ``"0.9.0.1"`` gives
  ``(0, 9, 0, 1)``. A suffix is dropped, so a pre-release or nightly of a
  release counts as that release (``"0.10.3.dev20260101"`` as 0.10.3)."""
  match = re.match(r"\d+(?:\.\d+)*", version)
  return tuple(int(part) for part in match.group().split(".")) if match else ()


def too_old(installed: Mapping[str, str]) -> list[str]:
  """The names in `installed` (name to version) below their minimum."""
  return [
    name
    for name, version in installed.items()
    if release(version) < release(MINIMUM[name])
  ]


def message(installed: Mapping[str, str]) -> str | None:
  """The ImportError message for `installed`, or None if all are new enough."""
  old = too_old(installed)
  if not old:
    return None
  needs = ", ".join(f"{name}>={version}" for name, version in MINIMUM.items())
  found = " and ".join(f"{name} {installed[name]}" for name in old)
  pins = " ".join(f'"{name}>={version}"' for name, version in MINIMUM.items())
  return (
    f"optax_accum needs {needs}; installed: {found}. Upgrade with"
    f" `pip install --upgrade {pins}`."
  )


def _distribution_version(name: str) -> str | None:
  """The version pip installed of `name`, or None if there is none."""
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def check() -> None:
  """Raises ImportError if the installed jax, jaxlib or optax is too old."""
  import jax
  import jaxlib.version

  found = message(
    {"jax": jax.__version__, "jaxlib": jaxlib.version.__version__}
  )
  if found:
    raise ImportError(found)
  try:
    import optax
  except Exception as error:
    version = _distribution_version("optax")
    found = version and message({"optax": version})
    if found:
      raise ImportError(found) from error
    raise
  found = message({"optax": optax.__version__})
  if found:
    raise ImportError(found)


check()
