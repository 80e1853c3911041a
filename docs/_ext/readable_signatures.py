"""Signatures as the source writes them: type aliases by name, no private path.

Python evaluates an annotation when the module loads (no module of
optax_accum uses ``from __future__ import annotations``), so autodoc sees
``optax.Updates`` as the union it stands for and prints ``Array | ndarray |
bool | number | ... | Mapping[Any, ArrayTree]``; ``autodoc_type_aliases``
only applies to annotations that are still strings. Before autodoc reads a
signature, this extension hands it, for each annotation that names one of
``autodoc_type_aliases``, the annotation's source text (from the function's
``def``, or from the class body for the ``__new__``/``__init__`` that
``NamedTuple`` and ``dataclass`` generate), and puts the evaluated ones back
afterwards. Other annotations stay evaluated (``jax.Array`` reads
``Array``, as before).

A default that ``autodoc_preserve_defaults`` would print as a private name
(``_noise_scale.DEFAULT_DECAY``, ``_FROM_TX``) is printed as its value
(``0.99``, the sentinel's own ``repr``).
"""

import ast
import importlib
import inspect
import pathlib
import re
import sys
import textwrap
from typing import Any

from sphinx.application import Sphinx

# A default whose source text is a private name, or an attribute of one.
_PRIVATE_DEFAULT = re.compile(r"^_\w*(\.\w+)*$|^\w+(\.\w+)*\._\w*")

# (object, its original __annotations__), put back after the signature.
_PATCHED: list[tuple[Any, dict[str, Any]]] = []


def _defining_module(cls: type) -> str | None:
  """Where *cls* is defined, when its ``__module__`` names where it is public.

  A class of optax_accum says its public module in ``__module__`` (as numpy's
  and jax's do), so ``inspect.getsource`` looks for it there in vain. The
  module that defines it holds it and has a ``class`` statement of its name.
  """
  pattern = re.compile(rf"^class {re.escape(cls.__name__)}\b", re.M)
  for module_name, module in sorted(sys.modules.items()):
    if (
      module_name.startswith("optax_accum")
      and vars(module).get(cls.__name__) is cls
      and getattr(module, "__file__", None)
      and pattern.search(pathlib.Path(module.__file__).read_text())
    ):
      return module_name
  return None


def _parse(obj: Any) -> ast.AST | None:
  """The ``def`` or ``class`` statement of *obj*."""
  if isinstance(obj, type) and obj.__module__.startswith("optax_accum"):
    module = _defining_module(obj)
    if module is None:
      return None
    tree = ast.parse(pathlib.Path(sys.modules[module].__file__).read_text())
    return next(
      (
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == obj.__name__
      ),
      None,
    )
  try:
    source = textwrap.dedent(inspect.getsource(obj))
  except (OSError, TypeError):
    return None
  try:
    return ast.parse(source).body[0]
  except (SyntaxError, IndexError):
    return None


def _function_annotations(func: Any) -> dict[str, str]:
  """Each parameter's (and the return's) annotation as written."""
  node = _parse(inspect.unwrap(func))
  if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
    return {}
  args = node.args
  found = {
    arg.arg: ast.unparse(arg.annotation)
    for arg in (
      *args.posonlyargs,
      *args.args,
      *args.kwonlyargs,
      *(a for a in (args.vararg, args.kwarg) if a is not None),
    )
    if arg.annotation is not None
  }
  if node.returns is not None:
    found["return"] = ast.unparse(node.returns)
  return found


def _field_annotations(cls: type) -> dict[str, str]:
  """The class's fields as annotated in its body (and its bases')."""
  found: dict[str, str] = {}
  for klass in reversed(cls.__mro__):
    if klass.__module__ == "builtins":
      continue
    node = _parse(klass)
    if not isinstance(node, ast.ClassDef):
      continue
    for statement in node.body:
      if isinstance(statement, ast.AnnAssign) and isinstance(
        statement.target, ast.Name
      ):
        found[statement.target.id] = ast.unparse(statement.annotation)
  return found


def _owner(method: Any) -> type | None:
  """The class whose generated ``__new__``/``__init__`` *method* is."""
  name = getattr(method, "__name__", "")
  if name not in ("__new__", "__init__"):
    return None
  for module_name, module in list(sys.modules.items()):
    if not module_name.startswith("optax_accum") or module is None:
      continue
    for value in vars(module).values():
      found = getattr(value, "__dict__", {}).get(name)
      if (
        isinstance(value, type) and getattr(found, "__func__", found) is method
      ):
        return value
  return None


def _written(obj: Any) -> dict[str, str]:
  written = _function_annotations(obj)
  if not written:  # a generated __new__ or __init__: no source of its own
    owner = _owner(obj)
    if owner is not None:
      written = {**_field_annotations(owner), **written}
  return written


def _names_alias(text: str, aliases: Any) -> bool:
  return any(
    re.search(rf"(?<![\w.]){re.escape(alias)}(?![\w])", text)
    for alias in aliases
  )


def _use_written_aliases(app: Sphinx, obj: Any, bound_method: bool) -> None:
  del bound_method
  aliases = app.config.autodoc_type_aliases
  func = getattr(obj, "__func__", obj)
  annotations = getattr(func, "__annotations__", None)
  if not aliases or not isinstance(annotations, dict) or not annotations:
    return
  written = _written(func)
  new = {
    name: written[name]
    if name in written and _names_alias(written[name], aliases)
    else value
    for name, value in annotations.items()
  }
  if new != annotations:
    _PATCHED.append((func, annotations))
    func.__annotations__ = new


def _real_defaults(func: Any) -> dict[str, Any]:
  code = getattr(func, "__code__", None)
  if code is None:
    return {}
  positional = code.co_varnames[: code.co_argcount]
  defaults = func.__defaults__ or ()
  names = positional[len(positional) - len(defaults) :]
  found = dict(zip(names, defaults, strict=True))
  found.update(func.__kwdefaults__ or {})
  return found


def _value_for_private_defaults(
  app: Sphinx, obj: Any, bound_method: bool
) -> None:
  del app, bound_method
  func = getattr(obj, "__func__", obj)
  sig = getattr(func, "__signature__", None)
  if not isinstance(sig, inspect.Signature):
    return
  real = _real_defaults(inspect.unwrap(func))
  parameters = [
    param.replace(default=real[param.name])
    if param.name in real
    and param.default is not param.empty
    and _PRIVATE_DEFAULT.search(repr(param.default))
    else param
    for param in sig.parameters.values()
  ]
  func.__signature__ = sig.replace(parameters=parameters)


# Sphinx names an alias inside a larger annotation (`Callable[[optax.Params],
# Any]`) by its placeholder's repr.
_NESTED_ALIAS = re.compile(r"TypeAliasForwardRef\('([\w.]+)'\)")


def _put_back(
  app: Sphinx,
  what: str,
  name: str,
  obj: Any,
  options: Any,
  signature: str | None,
  return_annotation: str | None,
) -> tuple[str | None, str | None]:
  del app, what, name, obj, options
  while _PATCHED:
    func, annotations = _PATCHED.pop()
    func.__annotations__ = annotations
  return tuple(
    None if text is None else _NESTED_ALIAS.sub(r"\1", text)
    for text in (signature, return_annotation)
  )


def _follow_to_definition(app: Sphinx, modname: str, attribute: str):
  """viewcode's [source] link of a class goes to the module defining it."""
  del app
  try:
    obj = importlib.import_module(modname)
    for part in attribute.split("."):
      obj = getattr(obj, part)
  except (ImportError, AttributeError):
    return None
  if isinstance(obj, type) and obj.__module__.startswith("optax_accum"):
    return _defining_module(obj)
  return None


def setup(app: Sphinx) -> dict[str, Any]:
  # After autodoc_preserve_defaults has put the source text of the defaults
  # in `__signature__` (it runs before the event).
  app.connect("autodoc-before-process-signature", _use_written_aliases)
  app.connect("autodoc-before-process-signature", _value_for_private_defaults)
  app.connect("autodoc-process-signature", _put_back)
  app.connect("viewcode-follow-imported", _follow_to_definition)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
