"""Shardings of an optimizer state that follow the parameters' shardings."""

import inspect
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _init_fn(tx: Any) -> Callable[[Any], Any]:
  """`tx`'s init function; raises naming `tx` for anything else."""
  init = getattr(tx, "init", None)
  if callable(init):
    return init
  name = getattr(tx, "__name__", None)
  # A module-level function of optax is a factory (`optax.sgd`); the init
  # functions it returns are local functions.
  is_factory = getattr(tx, "__module__", "").split(".")[0] in (
    "optax",
    "optax_accum",
  ) and "<locals>" not in getattr(tx, "__qualname__", "<locals>")
  if not callable(tx) or is_factory:
    hint = (
      f" (call the factory first, e.g. `{name}(...)`)" if is_factory else ""
    )
    raise TypeError(
      "`tx` must be an optax.GradientTransformation (or its init function),"
      f" got {tx!r} of type {type(tx).__name__}{hint}."
    )

  _check_takes_params(tx)

  def checked_init(params: Any) -> Any:
    state = tx(params)
    if isinstance(state, optax.GradientTransformation):
      raise TypeError(
        f"`tx` must be an optax.GradientTransformation or its init function,"
        f" got the factory {tx!r}: call it first."
      )
    return state

  return checked_init


def _check_takes_params(tx: Callable) -> None:
  """Raises naming `tx` unless it can be called as ``init(params)``."""
  try:
    signature = inspect.signature(tx)
  except (TypeError, ValueError):  # no signature (some builtins): try it
    return
  try:
    signature.bind(None)
  except TypeError:
    hint = ""
    if not signature.parameters:
      name = getattr(tx, "__name__", "the factory")
      hint = f"; a factory? Call it first, e.g. `tx={name}()`"
    raise TypeError(
      "`tx` must be an optax.GradientTransformation or its init function,"
      " called as `init(params)`; got"
      f" {tx!r} with signature {signature}{hint}."
    ) from None


def param_shardings(params: Any) -> list[tuple[tuple, tuple, NamedSharding]]:
  """(key path, shape, NamedSharding) of each param, longest path first;
  raises naming `params` when a leaf has no NamedSharding."""
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      raise TypeError(
        "`params` must be a tree of arrays or jax.ShapeDtypeStruct whose"
        " `.sharding` is a jax.sharding.NamedSharding (e.g. put them with"
        " `jax.device_put(params, NamedSharding(mesh, spec))`); leaf"
        f" {jax.tree_util.keystr(path) or '<root>'} has sharding"
        f" {sharding!r}."
      )
    found.append((tuple(path), tuple(leaf.shape), sharding))
  if not found:
    raise ValueError("`params` must hold at least one array, got none.")
  meshes = {s.mesh for _, _, s in found}
  if len(meshes) > 1:
    raise ValueError(
      "`params` must all be sharded over one mesh, got"
      f" {len(meshes)} different meshes: {sorted(map(str, meshes))}."
    )
  # Longest param path first, so that {"a": {"w"}} wins over {"w"}.
  return sorted(found, key=lambda item: len(item[0]), reverse=True)


def state_shardings(
  tx: optax.GradientTransformation | Callable[[optax.Params], Any],
  params: optax.Params,
) -> Any:
  """Shardings for the state of ``tx`` that follow the shardings of ``params``.

  Returns a tree with the structure of ``tx.init(params)`` (found with
  :func:`jax.eval_shape`, nothing is allocated) whose leaves are
  ``NamedSharding``\\s on the params' mesh:

  * a state leaf that is a copy of a param, such as the accumulator
    ``acc_grads`` of :func:`optax_accum.accumulate` or the ``mu`` and ``nu``
    of ``optax.adam``, gets that param's sharding. A copy is recognised by its
    key path, which ends with the param's key path, and by its shape, which
    equals the param's (the longest matching path wins);
  * every other leaf (step counters, the total weight, factored second
    moments of another shape, ...) is replicated: ``NamedSharding(mesh, P())``;
  * except, on a mesh with ``AxisType.Explicit`` axes, a leaf whose type
    ``init`` makes unreduced, such as the accumulator of
    ``accumulate(..., axis_name="data")`` under plain ``jit``: it gets the
    spec ``init`` gives it, e.g. ``P(None, "model", unreduced={"data"})``.

  Any sharding is numerically correct; these only decide where each leaf
  lives. Pass them to ``jax.jit(tx.init, out_shardings=...)`` (a jitted
  ``init`` does not see the params' shardings: its zeros do not depend on the
  params), to ``jax.device_put`` or to a checkpoint restore as the target
  layout. (``jax.device_put`` of host arrays to an unreduced sharding
  raises ``NotImplementedError``; a restored state goes through
  :func:`regroup_state`, which places it, on any number of devices.) ``tx.update`` under ``jit`` then keeps them: the accumulator and
  the inner state are computed from arrays sharded like the params.

  Args:
    tx: The transformation whose state is wanted (any
      ``optax.GradientTransformation``, e.g. an ``optax.chain`` holding
      :func:`optax_accum.accumulate`), or its ``init`` function.
    params: The params, as arrays or ``jax.ShapeDtypeStruct``\\s, each with a
      ``NamedSharding`` (all on one mesh).

  Returns:
    A tree like ``tx.init(params)`` with ``NamedSharding`` leaves.

  Raises:
    TypeError: If ``tx`` has no ``init`` or a param has no ``NamedSharding``.
    ValueError: If the params are on more than one mesh, or there are none.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_accum
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> params = {"w": jax.device_put(jnp.zeros((8, 2)),
    ...                               NamedSharding(mesh, P("data")))}
    >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4)
    >>> shardings = optax_accum.distributed.state_shardings(tx, params)
    >>> print(shardings.acc_grads["w"].spec, shardings.micro_step.spec)
    P('data',) P()
    >>> print(shardings.inner_state[0].mu["w"].spec)
    P('data',)
    >>> state = jax.jit(tx.init, out_shardings=shardings)(params)
    >>> state.acc_grads["w"].sharding == params["w"].sharding
    True
  """
  init = _init_fn(tx)
  found = param_shardings(params)
  replicated = NamedSharding(found[0][2].mesh, P())
  abstract = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params
  )
  state_shapes = jax.eval_shape(init, abstract)
  typed_shapes = _typed_state_shapes(init, params, replicated.mesh)
  if typed_shapes is None:
    typed_shapes = state_shapes

  def follow(path: tuple, leaf: Any, typed: Any) -> NamedSharding:
    spec = getattr(getattr(typed, "sharding", None), "spec", None)
    if spec is not None and getattr(spec, "unreduced", None):
      return NamedSharding(replicated.mesh, spec)
    return param_copied(found, path, leaf.shape) or replicated

  return jax.tree_util.tree_map_with_path(follow, state_shapes, typed_shapes)


def param_copied(
  found: list[tuple[tuple, tuple, NamedSharding]], path: tuple, shape: Any
) -> NamedSharding | None:
  """The sharding of the param a state leaf at `path` of `shape` is a copy
  of (its path ends with the param's, its shape is the param's), or None.
  `found` as :func:`param_shardings` gives it."""
  for param_path, param_shape, sharding in found:
    ends_with = len(param_path) <= len(path) and (
      not param_path or tuple(path[-len(param_path) :]) == param_path
    )
    if ends_with and tuple(shape) == param_shape:
      return sharding
  return None


def _typed_state_shapes(init: Callable, params: Any, mesh: Any) -> Any:
  """On a mesh with explicit axes, the state's types as ``init`` makes them
  from params typed with their shardings; ``None`` otherwise."""
  explicit = jax.sharding.AxisType.Explicit
  if not any(t == explicit for t in getattr(mesh, "axis_types", ())):
    return None
  typed = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding),
    params,
  )
  with jax.set_mesh(mesh):
    return jax.eval_shape(init, typed)
