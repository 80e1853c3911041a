"""The state of :func:`optax_accum.accumulate` and the functions that read it.

The readers (:func:`has_updated`, :func:`inner_state`, the noise-scale
readers) accept any optimizer state that holds exactly one
:class:`AccumulateState`: the state itself, an ``optax.chain`` or
``inject_hyperparams`` state around it, or the ``opt_state`` of a
``flax.nnx.Optimizer``.
"""

import functools
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax


class NoiseScaleState(NamedTuple):
  """The gradient-noise-scale sums of ``accumulate(track_noise_scale=True)``.

  Attributes:
    sq_norm_sum: ``float32[]``. :math:`\\sum_i w_i |g_i|^2` over the current
      cycle.
    count: ``int32[]``. Micro-batches with positive weight in the current
      cycle.
    grad_sq: ``float32[]``. Exponential moving average of the unbiased
      per-cycle estimate of :math:`|G|^2` (not bias-corrected; read it with
      :func:`optax_accum.noise_scale_components`).
    trace: ``float32[]``. Exponential moving average of the unbiased
      per-cycle estimate of :math:`\\mathrm{tr}(\\Sigma)`.
    cycles: ``int32[]``. Cycles folded into the two averages above.
  """

  sq_norm_sum: jax.Array  # float32[]
  # A field named as tuple's method, as optax's states' `count` are: mypy
  # takes the name for the method (python/mypy#4507 family).
  count: jax.Array  # type: ignore[assignment]  # int32[]
  grad_sq: jax.Array  # float32[]
  trace: jax.Array  # float32[]
  cycles: jax.Array  # int32[]


# The public names (in help(), the API reference and pickles); each class
# lives here, where the state is packed.
NoiseScaleState.__module__ = "optax_accum.types"


class GrowState(NamedTuple):
  """The state of the controller :func:`optax_accum.grow_every_k`.

  Attributes:
    changed_at: ``int32[]``. The noise-scale cycle count
      (``cycles`` of :class:`~optax_accum.types.NoiseScaleState`) when k last changed; the controller
      waits for ``min_cycles`` more before it decides again.
    micro_batches: ``float32[]``. Micro-batches in the cycles that ended
      with an update, since the start: with the weight of those cycles
      (:func:`optax_accum.weight_seen`), the run-long mean micro-batch
      weight that ``grow_every_k(micro_batch_weight=None)`` uses.
  """

  changed_at: jax.Array  # int32[]
  micro_batches: jax.Array  # float32[]


GrowState.__module__ = "optax_accum.types"


# The fields of optax.MultiStepsState, and where their meaning went: reading
# one of them from an AccumulateState names its equivalent.
_MULTISTEPS_FIELDS = {
  "mini_step": "read `micro_step` (micro-batches accepted in the cycle)",
  "gradient_step": "read `step` (optimizer steps: updates emitted)",
  "inner_opt_state": (
    "read `inner_state` (or `optax_accum.inner_state(opt_state)`, which"
    " also finds it inside a chain or an nnx.Optimizer)"
  ),
  "skip_state": (
    "there is no equivalent; `num_skipped` counts the micro-batches that"
    " `skip_nonfinite=True` dropped over the run"
  ),
}


# The state's scalars live in two arrays, `counters` and `acc_scalars`:
# each leaf of a state is a buffer that every jitted call passes in and out,
# and under `nnx.jit` a Variable (each record a node) that flax's graph
# traversal visits on every call, 17-35 us a Variable on the 2-core box
# (issue 52). Two scalar arrays and no optional records: as many scalar
# buffers as optax.MultiStepsState, one node fewer. They are read by name:
# `state.micro_step`, `state.noise` etc. are properties, and `replace`
# writes them by name.
#
# `counters` (int32, the same on every device) holds, in order:
COUNTERS = ("micro_step", "step", "every_k", "num_skipped", "emitted")
_WEIGHT_SEEN = slice(5, 7)  # then weight_seen: two float32 words, as bits;
_NOISE_AT = 7  # with the noise scale, grad_sq and trace (bits) and cycles;
_GROW_AT = 10  # with grow_every_k, changed_at and micro_batches (bits).
# `acc_scalars` (float32, each device's own under shard_map, as acc_grads):
# acc_weight; with the noise scale, sq_norm_sum and count.


class AccumulateState(NamedTuple):
  """State of :func:`optax_accum.accumulate`.

  Every leaf is an array, so the state can be saved and restored mid-cycle
  with any pytree serializer, carried through ``lax.scan``, donated to
  ``jit`` and sharded like the parameters. Reading a field of
  ``optax.MultiStepsState`` (``mini_step``, ``gradient_step``,
  ``inner_opt_state``, ``skip_state``) raises an ``AttributeError`` that
  names the equivalent.

  The scalars share two arrays, ``counters`` and ``acc_scalars``, so that a
  jitted call passes as many scalar buffers as with ``optax.MultiSteps``
  (and, under ``nnx.jit``, flax walks as few Variables). Read each value by
  name: ``micro_step``, ``step``, ``every_k``, ``num_skipped``,
  ``emitted``, ``weight_seen``, ``acc_weight``, ``noise`` and ``grow`` are
  properties (on arrays; on any other leaf, such as the ``PartitionSpec``
  of a layout, they return the leaf of the array that holds the value);
  write them with :meth:`replace`. A state saved by optax_accum 0.2, with a
  field per value, converts with :func:`optax_accum.upgrade.from_v0_2`.

  Attributes:
    counters: ``int32[7]``: ``micro_step``, ``step``, ``every_k``,
      ``num_skipped``, ``emitted`` (1 or 0), then ``weight_seen`` (its two
      float32 words as bits); ``int32[10]`` with ``track_noise_scale``
      (then the noise scale's ``grad_sq``, ``trace``, ``cycles``),
      ``int32[12]`` with ``grow_every_k`` (then the controller's
      ``changed_at`` and ``micro_batches``). The same on every device.
    acc_grads: The accumulator, a tree like the params with leaves in
      ``accumulator_dtype``: :math:`\\sum_i w_i g_i` over the micro-batches
      of the current cycle, zeros where no cycle is open (``micro_step ==
      0``: fresh, or after a call that ends a cycle), on every backend. Read
      by name, that is what it gives. The field itself (its place in the
      tuple, what ``jax.tree`` functions, Orbax and ``jit`` see) is the
      accumulator's buffer, :attr:`acc_buffer`, which may hold more.
    acc_scalars: ``float32[1]``: ``acc_weight``; ``float32[3]`` with
      ``track_noise_scale`` (then the noise scale's ``sq_norm_sum`` and
      ``count``). Like ``acc_grads``, each device's own under
      ``shard_map``.
    inner_state: The wrapped transformation's state; changes only on
      emitting calls (read it with :func:`inner_state`).
  """

  counters: jax.Array  # int32[7 | 10 | 12], see COUNTERS
  acc_grads: optax.Updates  # read by name: see _read_acc_grads below
  acc_scalars: jax.Array  # float32[1 | 3]
  inner_state: optax.OptState

  @property
  def acc_buffer(self) -> optax.Updates:
    """The accumulator's buffer, as stored (the ``acc_grads`` field's
    place in the tuple). While a cycle is open it is ``acc_grads``;
    where none is, it holds zeros, or what the last cycle left there (a
    program compiled for CPU leaves the cycle's updates rather than spend a
    pass over the accumulator on zeros; the stored weight beside them, not
    0, marks them), which no call reads. Write it with :meth:`replace`."""
    return tuple.__getitem__(self, 1)  # the slot, whatever acc_grads reads

  @property
  def micro_step(self) -> jax.Array:
    """``int32[]``. Micro-batches accepted in the current cycle (skipped
    ones excluded); ``0`` right after an update was emitted."""
    return _entry(self.counters, 0)

  @property
  def step(self) -> jax.Array:
    """``int32[]``. Updates emitted so far: the optimizer step. A schedule
    passed as ``every_k`` is called with this value."""
    return _entry(self.counters, 1)

  @property
  def every_k(self) -> jax.Array:
    """``int32[]``. The number of micro-batches the current cycle wants;
    decided when the previous cycle ended, so it never changes mid-cycle
    (read it with :func:`current_every_k`)."""
    return _entry(self.counters, 2)

  @property
  def num_skipped(self) -> jax.Array:
    """``int32[]``. Micro-batches dropped by ``skip_nonfinite`` over the
    whole run."""
    return _entry(self.counters, 3)

  @property
  def emitted(self) -> jax.Array:
    """``bool[]``. Whether the most recent ``update`` emitted a real update
    (read it with :func:`has_updated`)."""
    return _entry(self.counters, 4, jnp.bool_)

  @property
  def weight_seen(self) -> jax.Array:
    """``float32[2]``. The total weight of the cycles that ended with an
    update over the whole run (tokens or examples, the unit of ``weight``),
    as a compensated sum ``[total, -rounding error]`` so that small cycles
    still count after billions (read it with :func:`weight_seen`)."""
    return _entry(self.counters, _WEIGHT_SEEN, "bits")

  @property
  def acc_weight(self) -> jax.Array:
    """``float32[]``. :math:`\\sum_i w_i`, the total weight accumulated in
    the current cycle (with the default weight of 1, the number of
    micro-batches); 0 where no cycle is open (``micro_step == 0``), on every
    backend. (Stored, ``acc_scalars[..., 0]``, it may mark what the last
    cycle left in :attr:`acc_buffer`: its weight, -inf for a weightless
    one.)"""
    return _open_cycle(self, _entry(self.acc_scalars, 0))

  @property
  def noise(self) -> "NoiseScaleState | optax.EmptyState":
    """A :class:`~optax_accum.types.NoiseScaleState` with
    ``track_noise_scale=True``, else ``optax.EmptyState()``."""
    length = _length(self.counters)
    if length is None:
      return self.counters
    if length <= _NOISE_AT:
      return optax.EmptyState()
    at = _NOISE_AT
    return NoiseScaleState(
      sq_norm_sum=_entry(self.acc_scalars, 1),
      count=_entry(self.acc_scalars, 2, jnp.int32),
      grad_sq=_entry(self.counters, at, "bits"),
      trace=_entry(self.counters, at + 1, "bits"),
      cycles=_entry(self.counters, at + 2),
    )

  @property
  def grow(self) -> "GrowState | optax.EmptyState":
    """A :class:`~optax_accum.types.GrowState` with
    ``every_k=grow_every_k(...)``, else ``optax.EmptyState()``."""
    length = _length(self.counters)
    if length is None:
      return self.counters
    if length <= _GROW_AT:
      return optax.EmptyState()
    return GrowState(
      changed_at=_entry(self.counters, _GROW_AT),
      micro_batches=_entry(self.counters, _GROW_AT + 1, "bits"),
    )

  def replace(self, **values: Any) -> "AccumulateState":
    """The state with `values` replaced, by field or by name
    (``state.replace(micro_step=0, acc_weight=2.0)``). ``acc_grads`` and
    ``acc_buffer`` both write the buffer, and ``acc_weight`` the stored
    weight."""
    if "acc_buffer" in values:
      values["acc_grads"] = values.pop("acc_buffer")
    named = {name: values.pop(name) for name in _NAMED if name in values}
    if named:
      current = {name: getattr(self, name) for name in _NAMED}
      # As stored, not as read: a mark beside leftovers stays.
      current["acc_weight"] = _entry(self.acc_scalars, 0)
      if "acc_weight" in named and "acc_grads" not in values:
        # Where no cycle is open the weight reads 0 whatever is stored,
        # and what is stored may mark leftovers in the buffer, which stays:
        # the mark too (written with the buffer, the weight is the one
        # given).
        is_open = jnp.asarray(named.get("micro_step", current["micro_step"]))
        named["acc_weight"] = jnp.where(
          is_open > 0, named["acc_weight"], current["acc_weight"]
        )
      values.update(pack(**{**current, **named}))
    return self._replace(**values)


AccumulateState.__module__ = "optax_accum"


# One meaning on every backend (issue 54): read by name, `acc_grads` is the
# open cycle's sum, zeros where none is open, though the CPU form leaves the
# cycle's updates in the buffer (`_forms.close`). The field keeps its
# name and place, so that checkpoints of optax.MultiSteps and optax_accum
# 0.2, whose `acc_grads` shares the name, still land there in a lenient
# restore and are caught (`_checks.not_a_foreign_restore`); reading the name
# gives the meaning, and the buffer as stored is `acc_buffer`. Serializers
# see the buffer (`jax.tree` flattens by position), but flax's reads named
# tuples by name: its state dicts hold the meaning, which resumes the same
# (the TrainState drop-in saves the buffer, `flax/_linen.py`).
def _read_acc_grads(self: AccumulateState) -> optax.Updates:
  """The current cycle's sum :math:`\\sum_i w_i g_i` (a tree like the
  params, in ``accumulator_dtype``): zeros where no cycle is open
  (``micro_step == 0``), on every backend. On a layout (``PartitionSpec``
  or sharding leaves) or abstract values, the field's own leaves."""
  return _open_cycle(self, self.acc_buffer)


AccumulateState.acc_grads = property(_read_acc_grads)


def _no_such_field(self: AccumulateState, name: str) -> Any:
  """Called only for a name that is not a field, property or method: a
  ``MultiStepsState`` field's names its equivalent."""
  equivalent = _MULTISTEPS_FIELDS.get(name)
  if equivalent is None:
    raise AttributeError(
      f"'{type(self).__name__}' object has no attribute '{name}'"
    )
  raise AttributeError(
    f"AccumulateState has no `{name}` (a field of optax.MultiStepsState):"
    f" {equivalent}. See help(optax_accum.multisteps)."
  )


if not TYPE_CHECKING:  # So that a checker says "no attribute", as Python.
  AccumulateState.__getattr__ = _no_such_field


def _open_cycle(state: AccumulateState, tree: Any) -> Any:
  """`tree` (the state's buffer or stored weight) where a cycle is open
  (``micro_step > 0``), else zeros in its place, leaf by leaf over any
  leading axes (a stacked state's).

  A layout or abstract values are returned as they are; array-likes (the
  Variables of a ``flax.nnx.Optimizer``) are read as arrays. A concrete
  state that holds nothing beside an open cycle (no stored weight where
  none is open: what every GPU/TPU program, and every ``axis_name`` engine
  but ``shard_map``'s, leaves) is returned as it is, with no select:
  an unreduced buffer cannot be selected from outside ``jit``. A state
  spread over several processes is read with the select, as every eager op
  on it is: called by every process.
  """
  counters, weights = state.counters, state.acc_scalars
  leaves = jax.tree.leaves(tree)
  if not all(
    isinstance(x, jax.Array) or hasattr(x, "__jax_array__")
    for x in [counters, weights, *leaves]
  ):
    return tree
  micro_step = jnp.asarray(counters)[..., 0]
  stored = jnp.asarray(weights)[..., 0]
  # Concrete and readable here (not a tracer; not spanning other processes'
  # devices, whose values this process cannot fetch).
  readable = all(
    not isinstance(x, jax.core.Tracer)
    and getattr(x, "is_fully_addressable", True)
    for x in (micro_step, stored)
  )
  if readable and bool(jnp.all((micro_step > 0) | (stored == 0))):
    return jax.tree.map(jnp.asarray, tree)

  def read(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    lead = micro_step.shape + (1,) * (x.ndim - micro_step.ndim)
    is_open = jnp.reshape(micro_step > 0, lead)
    return jnp.where(is_open, x, jnp.zeros([], x.dtype))

  return jax.tree.map(read, tree)


# What `pack` and `replace` take by name.
_NAMED = (*COUNTERS, "weight_seen", "acc_weight", "noise", "grow")


def _length(packed: Any) -> int | None:
  """The length of a packed array (or of its abstract value); None for a
  leaf that has none, e.g. a ``PartitionSpec``."""
  shape = getattr(packed, "shape", None)
  return None if shape is None or not len(shape) else shape[-1]


def _entry(packed: Any, index: int | slice, kind: Any = None) -> Any:
  """Entry `index` of `packed` over any leading axes (a ``pmap``-stacked
  state gives one per device): as stored, as ``kind``, or ``"bits"``
  read as float32. An abstract value gives its type; a leaf with no shape
  (a ``PartitionSpec``, a sharding) is returned as is."""
  if _length(packed) is None:
    return packed
  if isinstance(packed, jax.ShapeDtypeStruct):
    width = () if isinstance(index, int) else (index.stop - index.start,)
    dtype = jnp.float32 if kind == "bits" else (kind or packed.dtype)
    return jax.ShapeDtypeStruct((*packed.shape[:-1], *width), dtype)
  value = jnp.asarray(packed)[..., index]
  if kind == "bits":
    return lax.bitcast_convert_type(value, jnp.float32)
  if kind is jnp.bool_:
    return value != 0
  return value if kind is None else value.astype(kind)


def pack(
  *,
  micro_step: Any,
  step: Any,
  every_k: Any,
  num_skipped: Any,
  emitted: Any,
  weight_seen: Any,
  acc_weight: Any,
  noise: Any = optax.EmptyState(),  # noqa: B008  (immutable)
  grow: Any = optax.EmptyState(),  # noqa: B008
) -> dict[str, jax.Array]:
  """``counters`` and ``acc_scalars`` (a dict of the two fields) from the
  values they hold, with any leading axes the values share (a stacked
  state's)."""
  # In the order of COUNTERS: the five counters, weight_seen, then the
  # noise scale's grad_sq, trace and cycles, then the controller's. A
  # "bits" part is float32 values along its last axis, stored as bits.
  parts = [
    (x, "int") for x in (micro_step, step, every_k, num_skipped, emitted)
  ]
  parts.append((weight_seen, "bits"))
  sums = [acc_weight]
  if isinstance(noise, NoiseScaleState):
    parts += [(jnp.stack([noise.grad_sq, noise.trace], -1), "bits")]
    parts += [(noise.cycles, "int")]
    sums += [noise.sq_norm_sum, noise.count]
  if isinstance(grow, GrowState):
    micro_batches = jnp.asarray(grow.micro_batches)[..., None]
    parts += [(grow.changed_at, "int"), (micro_batches, "bits")]
  lead = jnp.broadcast_shapes(
    *[
      jnp.shape(x) if kind == "int" else jnp.shape(x)[:-1] for x, kind in parts
    ],
    *[jnp.shape(x) for x in sums],
  )
  columns = []
  for x, kind in parts:
    if kind == "int":
      x = jnp.broadcast_to(jnp.asarray(x).astype(jnp.int32), lead)[..., None]
    else:
      x = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
      x = jnp.broadcast_to(x, (*lead, x.shape[-1]))
    columns.append(x)
  return {
    "counters": jnp.concatenate(columns, axis=-1),
    "acc_scalars": jnp.stack(
      [
        jnp.broadcast_to(jnp.asarray(x).astype(jnp.float32), lead) for x in sums
      ],
      axis=-1,
    ),
  }


class Values(NamedTuple):
  """An :class:`AccumulateState`'s values, unpacked by name: what
  ``update`` reads (:func:`unpack`) and writes (:func:`pack`)."""

  micro_step: jax.Array  # int32[]
  step: jax.Array  # int32[]
  every_k: jax.Array  # int32[]
  num_skipped: jax.Array  # int32[]
  emitted: jax.Array  # bool[]
  weight_seen: jax.Array  # float32[2]
  acc_buffer: Any  # as stored: see AccumulateState.acc_buffer
  acc_weight: jax.Array  # float32[], as stored: a mark beside leftovers
  inner_state: Any
  noise: "NoiseScaleState | optax.EmptyState"
  grow: "GrowState | optax.EmptyState"


def unpack(state: AccumulateState) -> Values:
  """`state`'s values by name, in one pass over its two arrays (what the
  properties give one by one)."""
  c, s = jnp.asarray(state.counters), jnp.asarray(state.acc_scalars)
  bits = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.float32)
  noise = grow = optax.EmptyState()
  if c.shape[-1] > _NOISE_AT:
    at = _NOISE_AT
    noise = NoiseScaleState(
      sq_norm_sum=s[..., 1],
      count=s[..., 2].astype(jnp.int32),
      grad_sq=bits(c[..., at]),
      trace=bits(c[..., at + 1]),
      cycles=c[..., at + 2],
    )
  if c.shape[-1] > _GROW_AT:
    grow = GrowState(
      changed_at=c[..., _GROW_AT], micro_batches=bits(c[..., _GROW_AT + 1])
    )
  return Values(
    micro_step=c[..., 0],
    step=c[..., 1],
    every_k=c[..., 2],
    num_skipped=c[..., 3],
    emitted=c[..., 4] != 0,
    weight_seen=bits(c[..., _WEIGHT_SEEN]),
    acc_buffer=state[1],  # the slot (AccumulateState.acc_buffer)
    acc_weight=s[..., 0],
    inner_state=state.inner_state,
    noise=noise,
    grow=grow,
  )


# The fields that hold one device's own, unreduced sums during a cycle when
# `axis_name` is used inside `shard_map`; every other field is the same on
# every device. The one place that knows the layout (see _layout.py).
DEVICE_LOCAL_FIELDS = ("acc_grads", "acc_scalars")


def is_accumulate_state(x: Any) -> bool:
  return isinstance(x, AccumulateState)


@overload
def find_state(
  opt_state: Any, reader: str, *, missing_ok: Literal[False] = False
) -> AccumulateState: ...


@overload
def find_state(
  opt_state: Any, reader: str, *, missing_ok: bool
) -> AccumulateState | None: ...


def find_state(
  opt_state: Any, reader: str, *, missing_ok: bool = False
) -> AccumulateState | None:
  """The one :class:`AccumulateState` inside `opt_state`.

  Args:
    opt_state: Any optimizer state (a pytree).
    reader: The public function asking, for the message.
    missing_ok: Return None (instead of raising) when there is none.

  Raises:
    TypeError: If there is none (unless `missing_ok`).
    ValueError: If there are several.
  """
  found = [
    x
    for x in jax.tree.leaves(opt_state, is_leaf=is_accumulate_state)
    if is_accumulate_state(x)
  ]
  if len(found) == 1:
    return found[0]
  if not found:
    if missing_ok:
      return None
    raise TypeError(
      f"`{reader}` needs an optimizer state that holds the AccumulateState"
      " of optax_accum.accumulate (the state itself, or an optax.chain,"
      " inject_hyperparams or nnx.Optimizer state around it); got a"
      f" {type(opt_state).__name__} with none inside."
    )
  raise ValueError(
    f"`{reader}` needs an optimizer state that holds exactly one"
    f" AccumulateState, got one with {len(found)} (several accumulate"
    " transformations): pass the part of the state that holds the one you"
    " mean, e.g. `opt_state[0]` of an optax.chain."
  )


def swap_state(tree: Any, old: Any, new: Any) -> Any:
  """`tree` with the node `old` (found by identity) replaced by `new`."""
  if tree is old:
    return new
  return jax.tree.map(
    lambda x: new if x is old else x, tree, is_leaf=lambda x: x is old
  )


def placed_like(tree: Any, like: Any) -> Any:
  """`tree`'s leaves on the devices of `like`'s (a restored state beside a
  fresh one made on a mesh), where both are concrete."""

  def place(x, y):
    concrete = not isinstance(x, jax.core.Tracer)
    if (
      concrete
      and isinstance(y, jax.Array)
      and not isinstance(y, jax.core.Tracer)
    ):
      return jax.device_put(x, y.sharding)
    return x

  return jax.tree.map(place, tree, like)


def has_updated(opt_state: optax.OptState) -> jax.Array:
  """Whether the most recent ``update`` call emitted a real update.

  ``False`` on the accumulating calls of a cycle, on calls dropped by
  ``skip_nonfinite`` and on a cycle whose total weight was zero; ``True``
  when the inner transformation ran.

  Args:
    opt_state: An optimizer state holding exactly one
      :class:`AccumulateState` (itself, or inside an ``optax.chain``,
      ``inject_hyperparams`` or a ``flax.nnx.Optimizer``'s ``opt_state``).

  Returns:
    A ``bool[]`` array (batched under ``vmap``). Outside a transformation,
    a state with a leading axis whose flags agree (replicated by ``pmap``:
    the devices agree when ``axis_name`` is given) gives one ``bool[]``, so
    ``if has_updated(state):`` works; one whose flags differ (a stacked
    ensemble) gives them all. An abstract state (``jax.eval_shape(tx.init,
    params)``) gives the type, a ``jax.ShapeDtypeStruct``, as every reader
    here does.

  Raises:
    TypeError: If `opt_state` holds no :class:`AccumulateState`.
    ValueError: If it holds several.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax.chain(optax.clip(1.0),
    ...                  optax_accum.accumulate(optax.sgd(0.1), every_k=2))
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   _, state = tx.update(jnp.ones(3), state, params)
    ...   print(bool(optax_accum.has_updated(state)))
    False
    True
  """
  emitted = find_state(opt_state, "has_updated").emitted
  if isinstance(emitted, jax.ShapeDtypeStruct):
    return as_read(emitted)
  # jnp.asarray unwraps array-like leaves too, such as the OptArray leaves
  # of a flax.nnx.Optimizer's opt_state.
  emitted = jnp.asarray(emitted)
  if emitted.ndim and not isinstance(emitted, jax.core.Tracer):
    flags = np.asarray(emitted)  # A replicated (pmap) or stacked state.
    if (flags == flags.flat[0]).all():
      return jnp.asarray(flags.flat[0])
  return emitted


def inner_state(opt_state: optax.OptState) -> optax.OptState:
  """The state of the transformation wrapped by :func:`accumulate`.

  Use it where a function of the wrapped optimizer needs its own state, for
  instance ``optax.contrib.schedule_free_eval_params``.

  Args:
    opt_state: An optimizer state holding exactly one
      :class:`AccumulateState` (see :func:`has_updated`).

  Returns:
    ``inner_state`` of that :class:`AccumulateState`, as stored.

  Raises:
    TypeError: If `opt_state` holds no :class:`AccumulateState`.
    ValueError: If it holds several.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> params = jnp.ones(2)
    >>> tx = optax_accum.accumulate(
    ...     optax.contrib.schedule_free_sgd(1.0), every_k=2)
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   updates, state = tx.update(jnp.ones(2), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> eval_params = optax.contrib.schedule_free_eval_params(
    ...     optax_accum.inner_state(state), params)
    >>> print(eval_params)
    [0. 0.]
  """
  return find_state(opt_state, "inner_state").inner_state


def current_every_k(opt_state: optax.OptState) -> jax.Array:
  """How many micro-batches the current cycle wants in all.

  A data loader can ask it at the start of each cycle (``micro_step == 0``)
  to know how many micro-batches to draw; it changes only between cycles.

  Args:
    opt_state: An optimizer state holding exactly one
      :class:`AccumulateState` (see :func:`has_updated`).

  Returns:
    An ``int32[]`` (its type for an abstract state).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_accum
    >>> tx = optax_accum.accumulate(
    ...     optax.sgd(0.1), optax_accum.piecewise_every_k({3: 2}))
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> for _ in range(5):  # weight 1 per micro-batch
    ...   print(int(optax_accum.current_every_k(state)), end=" ")
    ...   _, state = tx.update(jnp.ones(2), state, params)
    1 1 1 2 2
  """
  every_k = find_state(opt_state, "current_every_k").every_k
  if isinstance(every_k, jax.ShapeDtypeStruct):
    return as_read(every_k)
  return jnp.asarray(every_k)


def weight_seen(opt_state: optax.OptState) -> jax.Array:
  """The total weight of the cycles that ended with an update, over the run.

  With ``weight=`` the number of tokens of each micro-batch, the number of
  tokens trained on; with the default weight, the number of micro-batches.

  Args:
    opt_state: An optimizer state holding exactly one
      :class:`AccumulateState` (see :func:`has_updated`).

  Returns:
    A ``float32[]`` (its type for an abstract state).
  """
  return total_of(find_state(opt_state, "weight_seen").weight_seen)


def as_read(value: jax.ShapeDtypeStruct) -> jax.Array:
  """What a reader gives for an abstract state (``jax.eval_shape``'s, as
  Orbax and sharding code build them): the type of the value it stands
  for, as ``jax.eval_shape`` gives types. Annotated as that value, so that
  a user's checker reads the readers as they are used, on concrete states
  (the one place the annotation and the abstract case part)."""
  return cast(jax.Array, value)


def total_of(weight_seen: Any) -> jax.Array:
  """The value of a compensated ``[total, -rounding error]`` sum (its type,
  of an abstract one)."""
  if isinstance(weight_seen, jax.ShapeDtypeStruct):
    return as_read(
      jax.ShapeDtypeStruct(weight_seen.shape[:-1], weight_seen.dtype)
    )
  seen = jnp.asarray(weight_seen)
  return seen[..., 0] - seen[..., 1]


def add_weight_seen(seen: jax.Array, weight: jax.Array) -> jax.Array:
  """Compensated (Kahan) float32 sum: ``seen`` is ``[total, -lost]``.

  Adding many small cycle weights to a large float32 total would round
  them away; the second entry keeps what each addition lost.
  """
  total, lost = seen[0], seen[1]
  y = weight - lost
  new_total = total + y
  lost = (new_total - total) - y
  return jnp.stack([new_total, lost])
