"""Fails the build when a public name has no entry in the API reference.

The public names of a module are its ``__all__``; a module without one (only
``optax_accum.targets``) offers its functions and classes. A name has an entry
when the Python domain holds it under that module's path (an autodoc
directive for ``optax_accum.flax.Optimizer``; the private module the object
lives in does not count).
Every missing name is reported, as a warning: ``make docs`` builds with
``-W``, so it fails the build.
"""

import importlib

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)


def public_names(module_name: str) -> list[str]:
  """The names of `module_name` that need an API entry."""
  module = importlib.import_module(module_name)
  names = getattr(module, "__all__", None)
  if names is not None:
    return list(names)
  return sorted(
    name
    for name, value in vars(module).items()
    if not name.startswith("_")
    # Functions (a `functools.cache`d one too) and classes defined there.
    and callable(value)
    and getattr(value, "__module__", None) == module_name
  )


def missing(app: Sphinx) -> list[str]:
  documented = set(app.env.get_domain("py").objects)
  return [
    f"{module}.{name}"
    for module in app.config.api_coverage_modules
    for name in public_names(module)
    if f"{module}.{name}" not in documented
  ]


def _check(app: Sphinx, env) -> None:
  for name in missing(app):
    module = name.rsplit(".", 1)[0]
    page = "optax_accum" if module == "optax_accum" else module.split(".")[1]
    logger.warning(
      "public name without an API entry: %s (add it to docs/api/%s.rst)",
      name,
      page,
      type="api_coverage",
      location=f"docs/api/{page}",
    )


def setup(app: Sphinx):
  app.add_config_value("api_coverage_modules", [], "env")
  # After every page is read, before any is written: with `-W` (make docs)
  # a missing name is an error, as every other warning.
  app.connect("env-check-consistency", _check)
  return {"parallel_read_safe": True, "env_version": 1}
