"""``optax_accum.flax.Optimizer``: ``nnx.Optimizer`` applying with
:func:`optax_accum.apply_updates`, its optimizer state one Variable.

Read top to bottom: the Variable that holds the whole optimizer state
(:class:`OptStateTree`), the drop-in (its constructor, ``update`` and
:meth:`Optimizer.load`, the one call that takes a checkpoint of any layout),
then the shardings (:func:`get_partition_spec`, :func:`get_named_sharding`,
``nnx``'s own for every other Variable).

Why one Variable: under ``nnx.jit`` flax walks the model and the optimizer
in Python on every call, and pays for every Variable it meets (about 40 µs
a Variable on the 2-core CPU box); the stock class keeps one per leaf of the
optimizer state (the accumulator, each Adam moment, the counters). Held as
one, the state costs one Variable whatever the model, with the same
compiled step (``benchmarks/bench_loop.py``, the NNX rows).
"""

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from optax_accum import _apply, _checks, _state


class OptStateTree(nnx.OptState):
  """An optax optimizer state held whole in one ``nnx`` Variable.

  Its value is the state ``tx.init`` returned for the params as nested
  dicts (``nnx.to_pure_dict``), so it saves with any checkpointer, flax
  msgpack included. Attributes read through to the value:
  ``optimizer.opt_state.step``, ``.acc_grads``, ``.micro_step`` read the
  :class:`~optax_accum.AccumulateState`'s own (``opt_state[1]`` an
  ``optax.chain``'s second state). ``leaf_specs`` (metadata) holds each
  leaf's ``PartitionSpec``, taken from the params' Variables as the stock
  class takes them: :func:`get_partition_spec` reads it.
  """

  @property
  def sharding(self) -> Any:
    """Each leaf's sharding, a tree like the value (None where a leaf has
    none). ``nnx.eval_shape`` under a mesh gives a Variable without one the
    sharding of its single spec; this one's leaves keep their own, which
    ``tx.init`` made like the params'."""
    return jax.tree.map(
      lambda x: getattr(x, "sharding", None), self.get_value()
    )


class Optimizer(nnx.Optimizer):
  """A drop-in for ``flax.nnx.Optimizer`` around ``optax_accum.accumulate``.

  The same constructor (``Optimizer(model, tx, wrt=nnx.Param)``), the same
  ``update(model, grads, **kwargs)`` and the same fields. ``update`` also
  takes :func:`optax_accum.accumulate`'s ``weight=``, ``flush=`` and
  ``emit=`` (a ``TypeError`` naming them with a `tx` that holds no
  ``accumulate``; the inner optimizer's own extra arguments pass through),
  and applies the updates with :func:`optax_accum.apply_updates`:
  on a micro-step the model's params are neither read nor written (the
  stock class adds zeros to them on every call). Jit the step with
  ``nnx.jit(..., donate_argnums=...)`` over the model and the optimizer (or
  ``jax.jit`` over their split state, donated) so that the accumulator and
  the params are updated in place.

  ``opt_state`` is one Variable (:class:`OptStateTree`) whose value is the
  whole optimizer state, where the stock class keeps a Variable per leaf:
  ``nnx.jit`` walks it once per call instead of once per leaf. Its fields
  read as before (``optimizer.opt_state.acc_grads``, ``.step``, ...).
  Checkpoints: ``nnx.state(optimizer)`` saves and restores as it is; a
  checkpoint of the stock ``nnx.Optimizer(model, optax.MultiSteps(...))``
  or of optax_accum 0.3's drop-in (a Variable per leaf) comes in with
  :meth:`load`. Shardings: :func:`get_partition_spec` and
  :func:`get_named_sharding` in place of ``nnx``'s (which see one Variable
  here) give every leaf the layout of its param.

  ``step`` counts ``update`` calls (micro-batches), as in ``nnx.Optimizer``;
  :attr:`optimizer_step` counts the optimizer steps (updates applied), and
  ``optax_accum.has_updated(optimizer.opt_state)`` says whether the last
  call applied one.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=2)
    >>> optimizer = optax_accum.flax.Optimizer(model, tx, wrt=nnx.Param)
    >>> loss = lambda m: jnp.mean(m(jnp.ones((4, 2))) ** 2)
    >>> for _ in range(4):
    ...   _ = optimizer.update(model, nnx.grad(loss)(model))
    >>> print(int(optimizer.step[...]), int(optimizer.optimizer_step))
    4 2
    >>> print(int(optimizer.opt_state.micro_step))
    0
  """

  def __init__(
    self,
    model: Any,
    tx: optax.GradientTransformation,
    *,
    wrt: Any,
    graph: bool | None = None,
  ):
    """As ``nnx.Optimizer``'s: the optimizer state of `tx` for the
    Variables of `model` that `wrt` selects (required, as there)."""
    params = nnx.state(model, wrt, graph=graph)
    specs = _leaf_specs(tx, params)
    self.graph = graph
    self.step = nnx.OptState(jnp.array(0, dtype=jnp.uint32))
    self.tx = tx
    self.opt_state = OptStateTree(
      _on_the_mesh(tx.init(nnx.to_pure_dict(params)), specs), leaf_specs=specs
    )
    self.wrt = wrt

  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> optax.Updates:
    """Accumulates `grads` and, when a cycle ends, updates `model`.

    Args:
      model: The model whose params `grads` are for.
      grads: The gradients, from ``nnx.grad`` with this ``wrt``.
      **kwargs: ``weight=``, ``flush=``, ``emit=`` and the inner
        optimizer's extra arguments, passed to ``tx.update``.

    Returns:
      The updates (exact zeros on a micro-step), as ``nnx.Optimizer``
      returns them.
    """
    if not hasattr(nnx, "as_pure"):
      raise RuntimeError(
        "optax_accum.flax.Optimizer needs flax>=0.12.7 (installed"
        f" {flax.__version__}), for `nnx.as_pure`; flax 0.12.7 needs"
        " jax>=0.10. Upgrade flax, or apply with"
        " optax_accum.apply_updates in your own step."
      )
    param_state = nnx.state(model, self.wrt, graph=self.graph)
    params = nnx.to_pure_dict(param_state)
    grads = nnx.to_pure_dict(nnx.state(grads, self.wrt, graph=self.graph))
    opt_state = self.opt_state.get_value()
    kwargs = nnx.as_pure(kwargs)
    options = _checks.dropin_options(
      opt_state,
      "Optimizer.update",
      **{k: kwargs.pop(k) for k in ("weight", "flush", "emit") if k in kwargs},
    )
    updates, opt_state = self.tx.update(
      grads, opt_state, params, **options, **kwargs
    )
    new_params = _apply.apply_updates(params, updates, opt_state)
    nnx.replace_by_pure_dict(param_state, new_params)
    nnx.update(model, param_state)
    self.opt_state.set_value(opt_state)
    self.step[...] += 1
    return nnx.State(updates)

  @property
  def optimizer_step(self) -> jnp.ndarray:
    """The number of updates applied so far (the state's ``step``)."""
    state = _state.find_state(self.opt_state, "optimizer_step")
    return jnp.asarray(state.step)

  def load(self, saved: Any) -> None:
    """Takes the optimizer of a checkpoint, in place: its state and ``step``.

    `saved` is the optimizer's part of what a checkpointer restored
    without a target (Orbax ``restore(path)``, flax
    ``serialization.msgpack_restore``), or into ``nnx.state`` /
    ``nnx.to_pure_dict`` of an optimizer of its own layout:

    * this class's (``nnx.state(optimizer)``): taken as it is;
    * optax_accum 0.3's drop-in, a Variable per state leaf: the same
      values, one Variable;
    * the stock ``nnx.Optimizer(model, optax.MultiSteps(...), wrt=...)``
      around the ``MultiSteps`` that this optimizer's ``accumulate``
      replaces (:func:`optax_accum.multisteps.equivalent`): converted with
      :func:`optax_accum.multisteps.from_multisteps`, mid-cycle too.

    Restored naively into this class's target instead, such a checkpoint
    fails: Orbax's structure error, flax msgpack's field names, or, where
    the restorer fills what it lacks from the target (Orbax's
    ``partial_restore=True``), :func:`optax_accum.multisteps.check_restored`
    naming this method.

    Args:
      saved: ``{"step": ..., "opt_state": ...}``, as nested dicts, an
        ``nnx.State`` or a pure dict.

    Raises:
      ValueError: If `saved` fits none of the layouts above (the first
        path that differs is named).
    """
    saved = _unwrapped(nnx.as_pure(saved))
    if not isinstance(saved, dict) or not {"step", "opt_state"} <= set(saved):
      raise ValueError(
        "`saved` must be an optimizer's state, a mapping with 'step' and"
        f" 'opt_state', got {type(saved).__name__}"
        + (
          f" with keys {sorted(map(str, saved))}"
          if isinstance(saved, dict)
          else ""
        )
        + ": pass the optimizer's part of the restored checkpoint."
      )
    current = self.opt_state.get_value()
    raw = saved["opt_state"]
    if isinstance(raw, dict) and {"mini_step", "inner_opt_state"} <= set(raw):
      state = _from_stock_multisteps(self.tx, current, raw)
    else:
      state = _filled(current, raw, "opt_state")
    self.opt_state.set_value(state)
    self.step[...] = jnp.asarray(saved["step"], jnp.uint32)


# ----------------------------------------------------------------------------
# Checkpoints of any layout.
# ----------------------------------------------------------------------------


def _unwrapped(tree: Any) -> Any:
  """`tree` as nested dicts: ``nnx.State`` made a dict, and the ``value``
  level an ``nnx.state`` checkpoint puts under each Variable dropped."""
  if isinstance(tree, nnx.State):
    tree = nnx.to_pure_dict(tree)
  if isinstance(tree, dict):
    if set(tree) == {"value"}:
      return _unwrapped(tree["value"])
    return {k: _unwrapped(v) for k, v in tree.items()}
  return tree


def _child(raw: Any, key: Any, path: str) -> Any:
  """`raw`'s child at the key of a template's path entry (a field name, a
  dict key or a sequence index), as any checkpointer spells it."""
  if isinstance(key, jax.tree_util.GetAttrKey):
    names = (key.name,)
  elif isinstance(key, jax.tree_util.DictKey):
    names = (key.key, str(key.key))
  else:
    names = (key.idx, str(key.idx))
  if isinstance(raw, (list, tuple)) and isinstance(names[0], int):
    if names[0] < len(raw):
      return raw[names[0]]
  elif isinstance(raw, dict):
    for name in names:
      if name in raw:
        return raw[name]
  elif hasattr(raw, str(names[0])):  # a namedtuple restored as one
    return getattr(raw, str(names[0]))
  raise ValueError(
    f"The checkpoint has no {path}{jax.tree_util.keystr((key,))}: it is not"
    " the optimizer state of this tx for these params (see"
    " help(optax_accum.flax.Optimizer.load))."
  )


def _filled(template: Any, raw: Any, where: str) -> Any:
  """`template`'s tree with the leaves of `raw` at its paths, in its
  dtypes; `raw` is nested dicts, lists or the template's own types."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(template)
  leaves = []
  for path, leaf in paths:
    node = raw
    for depth, key in enumerate(path):
      node = _child(node, key, where + jax.tree_util.keystr(path[:depth]))
    value = jnp.asarray(node, leaf.dtype)
    if value.shape != leaf.shape:
      raise ValueError(
        f"The checkpoint's {where}{jax.tree_util.keystr(path)} has shape"
        f" {value.shape}, this optimizer's {leaf.shape}."
      )
    leaves.append(value)
  return jax.tree.unflatten(treedef, leaves)


def _from_stock_multisteps(tx: Any, current: Any, raw: dict) -> Any:
  """The state that continues a stock ``nnx.Optimizer(MultiSteps)`` run."""
  from optax_accum import multisteps  # noqa: PLC0415  (restores only)

  accumulate = _state.find_state(current, "Optimizer.load")
  params = jax.tree.map(jnp.zeros_like, accumulate.acc_grads)
  try:
    target = multisteps.restore_target(tx, params)
  except TypeError as e:
    raise ValueError(
      "A checkpoint of nnx.Optimizer(model, optax.MultiSteps(...)) converts"
      " into an Optimizer whose tx is the optax_accum.accumulate that"
      " replaces it (not a chain around one)."
    ) from e
  return multisteps.from_multisteps(_filled(target, raw, "opt_state"), current)


# ----------------------------------------------------------------------------
# Shardings.
# ----------------------------------------------------------------------------


def _leaf_specs(tx: Any, params: Any) -> Any:
  """Each optimizer-state leaf's ``PartitionSpec``, as the stock class
  gives them: ``tx.init`` traced over the params' Variables (whose metadata
  the state's param-shaped leaves carry through), the rest ``P()``."""
  traced = jax.eval_shape(tx.init, params)
  stored = jax.eval_shape(tx.init, nnx.to_pure_dict(params))
  specs = nnx.get_partition_spec(
    jax.tree.map(
      lambda x: x, traced, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
  )
  flat = jax.tree.leaves(
    specs,
    is_leaf=lambda x: isinstance(x, (nnx.Variable, PartitionSpec)),
  )
  flat = [s.get_value() if isinstance(s, nnx.Variable) else s for s in flat]
  return jax.tree.unflatten(jax.tree.structure(stored), flat)


def _on_the_mesh(state: Any, specs: Any) -> Any:
  """`state` with the leaves that carry no mesh (jax gives none to a scalar
  made under ``jax.set_mesh``, e.g. Adam's count) put on the mesh in use
  with their spec, as ``nnx.eval_shape`` puts the stock class's Variables:
  a step compiled over the mesh then takes them as its own."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return state
  explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

  def place(x, spec):
    if not jax.typeof(x).sharding.mesh.empty:
      return x
    if explicit:
      return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  return jax.tree.map(place, state, specs)


def get_partition_spec(tree: Any) -> Any:
  """``nnx.get_partition_spec``, seeing inside :class:`OptStateTree`.

  ``nnx.get_partition_spec(nnx.state(optimizer))`` gives the drop-in's
  state one ``PartitionSpec``, since it is one Variable; this gives each of
  its leaves the spec of its param, as the stock class's Variables do, and
  is ``nnx``'s own everywhere else.
  """

  def spec(x):
    if isinstance(x, OptStateTree):
      return x.replace(x.get_metadata()["leaf_specs"])
    return nnx.get_partition_spec(x)

  return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def get_named_sharding(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """``nnx.get_named_sharding``, seeing inside :class:`OptStateTree`
  (:func:`get_partition_spec`)."""
  return jax.tree.map(
    lambda p: NamedSharding(mesh, p), get_partition_spec(tree)
  )
