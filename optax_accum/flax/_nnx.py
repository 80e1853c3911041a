"""``optax_accum.flax.Optimizer``: ``nnx.Optimizer`` applying with
:func:`optax_accum.apply_updates`, its optimizer state one Variable.

Read top to bottom: the Variable that holds the whole optimizer state
(:class:`OptStateTree`, and how Flax's sharding functions see each of its
leaves), the trees the inner optimizer takes (:class:`_TxTrees`), the
drop-in (its constructor, ``update`` and :meth:`Optimizer.load`, the one
call that takes a checkpoint of any layout), then the checkpoints.

Why one Variable: under ``nnx.jit`` flax walks the model and the optimizer
in Python on every call, and pays for every Variable it meets (about 40 µs
a Variable on the 2-core CPU box); the stock class keeps one per leaf of the
optimizer state (the accumulator, each Adam moment, the counters). Held as
one, the state costs one Variable whatever the model, with the same
compiled step (``benchmarks/bench_loop.py``, the NNX rows).

Why Flax's own functions still see every leaf: ``nnx.get_partition_spec``
(and so ``nnx.get_named_sharding``, ``nnx.get_abstract_model`` and every
recipe built on them) gives each Variable one spec, through the Variable's
``replace``. :class:`OptStateTree` answers that call with a tree of specs,
one per leaf, each the spec the stock class's Variable for that leaf gets
(its param's annotations, resolved under the logical axis rules in effect
at the call), so ``jax.lax.with_sharding_constraint``, ``jax.device_put``
and restore targets place every leaf where the stock class places it.
"""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import spmd
from flax.nnx.training.optimizer import to_opt_state
from jax.sharding import NamedSharding, PartitionSpec

from optax_accum import _apply, _checks, _state

# The annotations of a Variable that decide its PartitionSpec
# (``nnx.spmd.get_var_pspec``) and, for ``nnx.as_abstract``, its mesh.
_SHARDING_KEYS = ("out_sharding", "sharding_rules", "mesh")

_MISSING = object()


class OptStateTree(nnx.OptState):
  """An optax optimizer state held whole in one ``nnx`` Variable.

  Its value is the state ``tx.init`` returned for the params, with every
  ``nnx.State`` in it as nested dicts, so it saves with any checkpointer,
  flax msgpack included. Attributes read through to the value:
  ``optimizer.opt_state.step``, ``.acc_grads``, ``.micro_step`` read the
  :class:`~optax_accum.AccumulateState`'s own (``opt_state[1]`` an
  ``optax.chain``'s second state).

  Flax's sharding functions see each leaf: ``nnx.get_partition_spec`` gives
  this Variable a tree of specs like its value, each leaf the spec of the
  Variable the stock ``nnx.Optimizer`` keeps for it (the param's
  annotations for a param-shaped leaf, ``P()`` for the counters), resolved
  under the logical axis rules in effect, as the stock class's are; so do
  ``nnx.get_named_sharding`` and what is built on them. ``leaf_sharding``
  (metadata) holds those annotations, one entry per leaf in
  ``jax.tree.leaves`` order.
  """

  def replace(self, value: Any = _MISSING, **metadata: Any) -> Any:
    """``nnx.Variable.replace``; given the one spec that
    ``nnx.get_partition_spec`` computes for a Variable (a ``PartitionSpec``,
    or None for one without a shape), the tree of each leaf's instead."""
    if value is None or isinstance(value, PartitionSpec):
      value = partition_specs(self)
    if value is _MISSING:
      return super().replace(**metadata)
    return super().replace(value, **metadata)

  @property
  def sharding(self) -> Any:
    """Each leaf's sharding, a tree like the value (None where a leaf has
    none).

    An abstract value made under a mesh whose leaves carry none
    (``nnx.eval_shape`` under ``jax.set_mesh`` of ``Auto`` axes) takes
    here, on its first read, each leaf's ``NamedSharding`` of its spec on
    that mesh (or on the mesh its param names), as ``nnx.eval_shape`` gives
    each of the stock class's Variables: flax reads this property as it
    makes the abstract Variable, so that the leaves of a restore target
    made from it are placed as the stock class's.
    """
    value = self.get_raw_value()
    mesh = jax.sharding.get_abstract_mesh()
    leaves, treedef = jax.tree.flatten(value)
    unplaced = [
      isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None for x in leaves
    ]
    if not mesh.empty and any(unplaced):
      specs = jax.tree.leaves(
        partition_specs(self), is_leaf=lambda x: isinstance(x, PartitionSpec)
      )
      annotations = self.get_metadata()["leaf_sharding"]
      leaves = [
        jax.ShapeDtypeStruct(
          x.shape,
          x.dtype,
          sharding=NamedSharding(dict(a).get("mesh") or mesh, spec),
        )
        if bare
        else x
        for x, bare, spec, a in zip(
          leaves, unplaced, specs, annotations, strict=True
        )
      ]
      value = jax.tree.unflatten(treedef, leaves)
      self.set_raw_value(value)
    return jax.tree.map(lambda x: getattr(x, "sharding", None), value)


def partition_specs(variable: OptStateTree) -> Any:
  """Each leaf's ``PartitionSpec``, a tree like `variable`'s value: what
  ``nnx.get_partition_spec`` gives the stock class's Variable for it."""
  return _specs(variable.get_value(), variable.get_metadata()["leaf_sharding"])


def _specs(value: Any, annotations: tuple) -> Any:
  leaves, treedef = jax.tree.flatten(value)
  if len(annotations) != len(leaves):
    raise ValueError(
      f"This OptStateTree holds {len(leaves)} leaves and the shardings of"
      f" {len(annotations)}: its value was replaced by another optimizer's"
      " state; build the Optimizer for the tx and params it holds."
    )
  return jax.tree.unflatten(
    treedef,
    [_spec(x, dict(a)) for x, a in zip(leaves, annotations, strict=True)],
  )


def _spec(leaf: Any, annotations: dict) -> PartitionSpec:
  """The spec flax gives an optimizer-state Variable with `annotations`."""
  if not annotations.get("out_sharding"):
    return PartitionSpec()
  shape = jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf))
  spec = spmd.get_var_pspec(
    nnx.OptVariable(shape, eager_sharding=False, **annotations)
  )
  return PartitionSpec() if spec is None else spec


def _leaf_sharding(stock: Any) -> tuple:
  """Each leaf's sharding annotations, in leaf order, from the stock
  class's optimizer state (traced): a Variable per leaf, with its param's
  annotations (``optimizer_sharding`` taking the place of
  ``out_sharding``), none for a counter."""
  stock = jax.tree.leaves(stock, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return tuple(
    tuple(
      (key, value)
      for key, value in sorted(v.get_metadata().items())
      if key in _SHARDING_KEYS and value is not None
    )
    for v in stock
  )


# ----------------------------------------------------------------------------
# The trees the inner optimizer takes.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _TxTrees:
  """How the params, grads and state reach `tx`, decided once per Optimizer.

  The stock class hands `tx` an ``nnx.State`` (of Variables at ``init``,
  of arrays at ``update``), so a mask or labels tree built from
  ``nnx.state(model, ...)`` matches it; where `tx.init` refuses that tree
  (a mask built as nested dicts), nested dicts. The state is stored as
  nested dicts either way (:func:`_dicts`), and given back to `tx` in its
  own tree (``given``).

  Attributes:
    as_state: `tx` takes ``nnx.State`` trees (else nested dicts).
    given: The tree of the state as `tx` made it.
  """

  as_state: bool
  given: Any

  @staticmethod
  def takes_state(tx: Any, params: nnx.State) -> tuple[bool, Any]:
    """Whether `tx` takes ``nnx.State`` trees for `params` (an
    ``nnx.State`` of Variables), and the stock class's optimizer state for
    them, traced (flax's own ``to_opt_state`` of ``tx.init`` over the
    Variables)."""
    refused = []
    for as_state in (True, False):
      variables = params if as_state else _dicts(params)
      try:
        traced = jax.eval_shape(lambda p: to_opt_state(tx.init(p)), variables)
      except (TypeError, ValueError) as e:  # a tree built on the other form
        refused.append(e)
        continue
      return as_state, traced
    raise refused[0]

  def params(self, state: nnx.State) -> Any:
    """A pure ``nnx.State`` (params, grads) as `tx` takes it."""
    return state if self.as_state else nnx.to_pure_dict(state)

  def to_model(self, tree: Any, like: Any) -> Any:
    """`tree` (params or updates, as `tx` took them) as the model's
    ``nnx.State`` of structure `like`: as it is where `tx` takes them."""
    if self.as_state:
      return tree
    return jax.tree.unflatten(like, jax.tree.leaves(tree))

  def to_tx(self, stored: Any) -> Any:
    return jax.tree.unflatten(self.given, jax.tree.leaves(stored))


def _dicts(tree: Any) -> Any:
  """`tree` with every ``nnx.State`` in it as nested dicts, its leaves
  (arrays, or Variables) as they are."""

  def convert(x):
    if isinstance(x, nnx.State):
      return {k: convert(v) for k, v in x.items()}
    return x

  return jax.tree.map(
    convert, tree, is_leaf=lambda x: isinstance(x, (nnx.State, nnx.Variable))
  )


# ----------------------------------------------------------------------------
# The drop-in.
# ----------------------------------------------------------------------------


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

  `tx` sees the trees the stock class gives it: ``nnx.State`` params and
  grads, so that a mask or labels tree built from ``nnx.state(model, ...)``
  (``optax.masked``, ``optax.multi_transform``, ``adamw(mask=...)``) works
  as there; a tree built as nested dicts, which the stock class refuses,
  works too (`tx` then sees nested dicts).

  ``opt_state`` is one Variable (:class:`OptStateTree`) whose value is the
  whole optimizer state, where the stock class keeps a Variable per leaf:
  ``nnx.jit`` walks it once per call instead of once per leaf. Its fields
  read as before (``optimizer.opt_state.acc_grads``, ``.step``, ...), and
  Flax's sharding functions (``nnx.get_partition_spec``,
  ``nnx.get_named_sharding``, ``nnx.get_abstract_model``) give each of its
  leaves the layout the stock class gives it, so Flax's recipes for a
  sharded model and for restoring into an abstract target work unchanged.
  Checkpoints: ``nnx.state(optimizer)`` saves and restores as it is; a
  checkpoint of the stock ``nnx.Optimizer(model, optax.MultiSteps(...))``
  or of optax_accum 0.3's drop-in (a Variable per leaf) comes in with
  :meth:`load`.

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
    as_state, traced = _TxTrees.takes_state(tx, params)
    leaf_sharding = _leaf_sharding(traced)
    pure = nnx.as_pure(params)
    made = tx.init(pure if as_state else nnx.to_pure_dict(pure))
    trees = _TxTrees(as_state, jax.tree.structure(made))
    state = _dicts(made)
    self.graph = graph
    self.step = nnx.OptState(jnp.array(0, dtype=jnp.uint32))
    self.tx = tx
    self.opt_state = OptStateTree(
      _on_the_mesh(state, _specs(state, leaf_sharding)),
      leaf_sharding=leaf_sharding,
    )
    self.wrt = wrt
    self._tx_trees = trees

  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> optax.Updates:
    """Accumulates `grads` and, when a cycle ends, updates `model`.

    Args:
      model: The model whose params `grads` are for.
      grads: The gradients, from ``nnx.grad`` with this ``wrt``.
      **kwargs: ``weight=``, ``flush=``, ``emit=`` and the inner
        optimizer's extra arguments, passed to ``tx.update``.

    Returns:
      The updates (exact zeros on a micro-step), an ``nnx.State`` as
      ``nnx.Optimizer`` returns them.
    """
    if not hasattr(nnx, "as_pure"):
      raise RuntimeError(
        "optax_accum.flax.Optimizer needs flax>=0.12.7 (installed"
        f" {flax.__version__}), for `nnx.as_pure`; flax 0.12.7 needs"
        " jax>=0.10. Upgrade flax, or apply with"
        " optax_accum.apply_updates in your own step."
      )
    trees = self._tx_trees
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    as_params = jax.tree.structure(params)
    grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    opt_state = trees.to_tx(self.opt_state.get_value())
    kwargs = nnx.as_pure(kwargs)
    options = _checks.dropin_options(
      opt_state,
      "Optimizer.update",
      **{k: kwargs.pop(k) for k in ("weight", "flush", "emit") if k in kwargs},
    )
    params, grads = trees.params(params), trees.params(grads)
    updates, opt_state = self.tx.update(
      grads, opt_state, params, **options, **kwargs
    )
    new_params = _apply.apply_updates(params, updates, opt_state)
    nnx.update(model, trees.to_model(new_params, as_params))
    self.opt_state.set_value(_dicts(opt_state))
    self.step[...] += 1
    return trees.to_model(updates, as_params)

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
      :func:`optax_accum.multisteps.from_multisteps`, mid-cycle too, as
      the ``MultiSteps`` run saved it: an inner optimizer that keeps no
      state (``optax.sgd``), ``use_grad_mean=False`` (``reduction="sum"``
      here), an ``every_k_schedule`` (the open cycle keeps the k
      ``MultiSteps`` gave it), ``should_skip_update_fn``, any
      ``accumulator_dtype`` (the inner state comes in in its own dtypes,
      never the accumulator's).

    Whatever the model's names (a param or module called ``value``, which
    a checkpointer also writes for each Variable), and each leaf placed
    where this optimizer's own is (its param's sharding on a mesh).

    Restored naively into this class's target instead, a checkpoint of
    another layout fails: Orbax's structure error, flax msgpack's field
    names, or, where the restorer fills what it lacks from the target
    (Orbax's ``partial_restore=True``),
    :func:`optax_accum.multisteps.check_restored` naming this method.

    Args:
      saved: ``{"step": ..., "opt_state": ...}``, as nested dicts, an
        ``nnx.State`` or a pure dict.

    Raises:
      ValueError: If `saved` fits none of the layouts above (the first
        path that differs is named).
    """
    saved = nnx.as_pure(saved)
    if isinstance(saved, nnx.State):
      saved = nnx.to_pure_dict(saved)
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
    trees = self._tx_trees
    current = trees.to_tx(self.opt_state.get_value())
    raw = _unwrapped(saved["opt_state"])
    if isinstance(raw, dict) and {"mini_step", "gradient_step"} <= set(raw):
      state = _from_stock_multisteps(self.tx, current, raw)
    else:
      state = _filled(current, raw, "opt_state")
    self.opt_state.set_value(_dicts(_state.placed_like(state, current)))
    step = _filled(self.step.get_value(), saved["step"], "step")
    self.step.set_value(_state.placed_like(step, self.step.get_value()))


# ----------------------------------------------------------------------------
# Checkpoints of any layout.
# ----------------------------------------------------------------------------


def _unwrapped(node: Any, key: Any = None) -> Any:
  """`node` without the level a checkpointer writes for a Variable
  (``{"value": x}``), where the tree read goes on with another `key` (or
  ends): under a param or module named ``value`` the name is the model's."""
  if isinstance(node, dict) and set(node) == {"value"} and key != "value":
    return node["value"]
  return node


def _names(key: Any) -> tuple:
  """The names a checkpointer may give a template's path entry (a field
  name, a dict key or a sequence index)."""
  if isinstance(key, jax.tree_util.GetAttrKey):
    return (key.name,)
  if isinstance(key, jax.tree_util.DictKey):
    return (key.key, str(key.key))
  return (key.idx, str(key.idx))


def _child(raw: Any, key: Any, path: str) -> Any:
  """`raw`'s child at the key of a template's path entry, as any
  checkpointer spells it."""
  names = _names(key)
  raw = _unwrapped(raw, names[0])
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


def _filled(template: Any, raw: Any, where: str, *, cast: bool = True) -> Any:
  """`template`'s tree with the leaves of `raw` at its paths, in its
  dtypes (with `cast`; else the checkpoint's own); `raw` is nested dicts,
  lists or the template's own types."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(template)
  leaves = []
  for path, leaf in paths:
    node = raw
    for depth, key in enumerate(path):
      node = _child(node, key, where + jax.tree_util.keystr(path[:depth]))
    node = _unwrapped(node)
    value = jnp.asarray(node, leaf.dtype) if cast else jnp.asarray(node)
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

  fresh = _state.find_state(current, "Optimizer.load")
  params = jax.tree.map(jnp.zeros_like, fresh.acc_grads)
  try:
    target = multisteps.restore_target(tx, params)
  except TypeError as e:
    raise ValueError(
      "A checkpoint of nnx.Optimizer(model, optax.MultiSteps(...)) converts"
      " into an Optimizer whose tx is the optax_accum.accumulate that"
      " replaces it (not a chain around one)."
    ) from e
  # In the checkpoint's own dtypes: the target's inner state is made from
  # the zeros above, in the accumulator's dtype; from_multisteps casts each
  # leaf to this optimizer's own.
  restored = _filled(target, raw, "opt_state", cast=False)
  return multisteps.from_multisteps(restored, current, tx=tx)


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
