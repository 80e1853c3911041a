"""The oldest jax, jaxlib and optax optax_accum works with, checked on import.

The minimums are the oldest releases with which the core passes:
``accumulate``, ``apply_updates``, ``microbatch``, the state readers,
``grow_every_k`` and ``axis_name`` inside ``jax.shard_map``, ``pmap`` or a
named ``vmap`` (``make test-oldest`` runs that part of the suite on exactly
these releases, pinned in ``constraints/oldest.txt``; README,
"Requirements"; ``pyproject.toml`` declares the same):

* jax 0.7.1: the first with ``jax.set_mesh`` (0.7.0 has only
  ``jax.sharding.use_mesh``; ``distributed.state_shardings`` on an explicit
  mesh and the tests set meshes with it). 0.6 lacks more: ``jnp.zeros`` has
  no ``out_sharding`` (accumulators on an explicit mesh, ``zeros_like_type`` in ``_records.py``), and
  a ``ShapeDtypeStruct``'s ``vma`` may be ``None``. Before jax 0.8.2
  ``lax.pcast(x, axes, to="varying")`` is ``lax.pvary(x, axes)``
  (``_control.to_varying``).
* jaxlib 0.7.1: the one jax 0.7.1 asks for.
* optax 0.2.4: 0.2.3 lacks ``optax.safe_increment``. An optax may also not
  import on a jax newer than itself (0.2.7 on jax 0.10.2 sets the config
  option ``jax_pmap_shmap_merge``, which that jax no longer has): then
  :func:`check` names both and asks for a newer optax.

One feature needs a newer jax, and says so when used instead of at import
(``UNREDUCED_JAX``): deferring the reduction under plain ``jax.jit``
(``axis_name=`` an explicit mesh axis outside ``shard_map``, gradients typed
unreduced, ``distributed.local_value_and_grad``, HSDP under plain ``jit``)
needs jax 0.10.2, the first with an unreduced rule for ``select_n`` (the
accumulator's ``jnp.where``; 0.10.1 raises ``NotImplementedError``; before
0.8.2 there is no ``jax.reshard`` either). The whole suite, that feature and
the compiled-program checks included, runs on the newest jax for the newest
Python on the machine (jax/jaxlib 0.12.0.1 on Python 3.13; jax 0.11 and
later need Python 3.12), and the core on jax 0.10.2 on Python 3.11 (``make
test``).

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

MINIMUM = {"jax": "0.7.1", "jaxlib": "0.7.1", "optax": "0.2.4"}

# The jax that deferring the reduction under plain `jit` needs (see above);
# `_unreduced.check_supported` raises naming it where the feature is used.
UNREDUCED_JAX = "0.10.2"


def release(version: str) -> tuple[int, ...]:
  """The leading release numbers of `version`: ``"0.9.0.1"`` gives
  ``(0, 9, 0, 1)``. A suffix is dropped, so a pre-release or nightly of a
  release counts as that release (``"0.10.3.dev20260101"`` as 0.10.3)."""
  match = re.match(r"\d+(?:\.\d+)*", version)
  return tuple(int(part) for part in match.group().split(".")) if match else ()


def jax_at_least(version: str) -> bool:
  """Whether the installed jax is `version` or newer."""
  import jax

  return release(jax.__version__) >= release(version)


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


def check_installed() -> None:
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
    if version is None:
      raise
    raise ImportError(
      message({"optax": version})
      or (
        f"optax_accum needs an optax that imports with jax {jax.__version__};"
        f" installed: optax {version}, whose import fails"
        f" ({type(error).__name__}: {error}). Upgrade with `pip install"
        " --upgrade optax`."
      )
    ) from error
  found = message({"optax": optax.__version__})
  if found:
    raise ImportError(found)


check_installed()
