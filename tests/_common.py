"""Small trees and transformations shared by the test modules."""

import jax
import jax.numpy as jnp
import optax

# Every behaviour runs eagerly and under jit (the `maybe_jit` fixture).
MODES = {"nojit": lambda f: f, "jit": jax.jit}


def params():
  return {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}


def grads(i):
  """A deterministic, distinct gradient per micro-step."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(i))
  return {"w": jax.random.normal(k1, (2, 3)), "b": jax.random.normal(k2, (3,))}


def identity():
  """An inner that returns the gradient it receives: shows what reached it."""
  return optax.GradientTransformation(
    lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s)
  )


def flat(tree):
  """{key path: leaf}."""
  return {
    jax.tree_util.keystr(path): leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }
