"""Public classes say their public module, and public signatures name them.

`help()`, `inspect.signature`, pickles and the API reference all print a
class by its `__module__`; a private one (`optax_accum._state`) sends a user
to a module they should not import.
"""

import importlib
import inspect
import pickle
import pydoc

import jax.numpy as jnp
import optax
import pytest

import optax_accum
import optax_accum.distributed
import optax_accum.types

PUBLIC_CLASSES = [
  *((optax_accum.types, name) for name in optax_accum.types.__all__),
  (optax_accum.distributed, "NoiseStats"),
]


@pytest.mark.parametrize(("module", "name"), PUBLIC_CLASSES)
def test_class_names_a_public_module(module, name):
  cls = getattr(module, name)
  assert not any(part.startswith("_") for part in cls.__module__.split("."))
  home = importlib.import_module(cls.__module__)
  assert getattr(home, name) is cls


@pytest.mark.parametrize(
  "function",
  [
    optax_accum.accumulate,
    optax_accum.grow_every_k,
    optax_accum.inner_for_every_k,
    optax_accum.plan_micro_batch,
  ],
  ids=lambda f: f.__name__,
)
def test_signature_names_public_types(function):
  text = str(inspect.signature(function))
  assert "optax_accum._" not in text, text


def test_state_pickles_under_its_public_name():
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, track_noise_scale=True)
  state = tx.init(jnp.zeros(2))
  data = pickle.dumps(state)
  assert b"optax_accum._" not in data
  again = pickle.loads(data)
  assert type(again) is optax_accum.AccumulateState
  assert type(again.noise) is optax_accum.types.NoiseScaleState


def test_update_documents_itself():
  """``help(tx.update)`` is the update's own documentation (issue 53): its
  keyword arguments by name, what each does, and public types only."""
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  signature = inspect.signature(tx.update)
  assert list(signature.parameters) == [
    "updates",
    "state",
    "params",
    "weight",
    "flush",
    "emit",
    "noise_stats",
    "extra_args",
  ]
  assert "optax_accum._" not in str(signature)
  assert "optax._src" not in str(signature)
  doc = inspect.getdoc(tx.update)
  for name in ("weight:", "flush:", "emit:", "noise_stats:", "params:"):
    assert name in doc, name
  pydoc_text = pydoc.render_doc(tx.update)
  assert "functools.partial" not in pydoc_text
  assert "emit:" in pydoc_text
