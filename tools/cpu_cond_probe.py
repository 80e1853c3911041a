"""What costs the traced CPU micro-step its distance from the floor (issue 38,
item 4): a probe of XLA:CPU, not a benchmark of the package's pages.

Hand-written micro-steps of 4 dense ``W``-square tanh layers (``W=2048``:
64 MiB of params), params, accumulator and momentum donated, timed
interleaved (7 rounds of 10 calls, medians) against the floor (the gradient
added into the accumulator), with each one's compiled temporary bytes:

- ``floor``: ``acc + g``, the params passed through untouched;
- ``cond_big``: the floor, and a ``lax.cond`` that reads the new accumulator
  and updates params and momentum on the cycle's last call (passes them
  through otherwise): is a conditional passing big buffers through costly?
- ``cond_then_select``: ``cond_big``, then the accumulator back to zeros
  with a select on every call (the shape of the package's CPU form);
- ``zeros_in_branch``: the accumulator an output of the conditional, zeros
  in its updating branch;
- ``add_in_branch``: the add inside both branches;
- ``split_close``: the updates written into the accumulator's buffer by
  the updating branch, applied to the params in a conditional of their own,
  then (ordered after it by ``lax.optimization_barrier``) a third
  conditional that zeroes the buffer on the cycle's last call and passes it
  through otherwise: the floor;
- ``split_close_read_after``: ``split_close`` whose caller also reads the
  updates after it (``optax.apply_updates``): XLA:CPU cannot order that
  read before the zeroing conditional and copies the accumulator on every
  call;
- ``lazy_start`` and ``lazy_start_read_after``: nothing zeroes the buffer
  after the updates are written there; the cycle's first add starts from
  zeros instead (a select fused into the add), and the params are applied
  in a conditional of their own, or by the caller after the step;
- ``accumulate`` and ``accumulate+optax_apply``: the package's traced step
  (momentum SGD, ``every_k`` never reached) with ``optax_accum.apply_updates``
  and with ``optax.apply_updates``.

What it showed (jax 0.12.0.1): zeroing the buffer after the updates are
read costs either caller something: the zeroing conditional is the floor
for ``optax_accum.apply_updates`` and costs a copy of the accumulator on
every call, and as many bytes of memory, when the caller reads the updates
after it (``optax.apply_updates``); a select after the conditional costs
one pass over the accumulator for either caller. Not zeroing it, with the
next cycle's first add starting from zeros, is the floor for both: what the
package does since (the closing notes of issue 38 give the figures).

Run: ``.venv/bin/python tools/cpu_cond_probe.py [W]``.
"""

import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optax_accum

W = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
LAYERS = 4
ENDS_AT = 3  # the hand-written steps update on their 4th call only


def loss(p, x):
  for i in range(LAYERS):
    x = jnp.tanh(x @ p[i])
  return jnp.mean(x**2)


grad = jax.grad(loss)


def zeros(tree):
  return jax.tree.map(jnp.zeros_like, tree)


def add(acc, g):
  return jax.tree.map(jnp.add, acc, g)


def update(p, mu, acc):
  mu = jax.tree.map(lambda m, a: 0.9 * m + a, mu, acc)
  return jax.tree.map(lambda q, m: q - 1e-3 * m, p, mu), mu


def hold(p, mu, acc):
  del acc
  return p, mu


donated = functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def floor(p, acc, x):
  return p, add(acc, grad(p, x))


@donated
def cond_big(p, acc, mu, n, x):
  acc = add(acc, grad(p, x))
  p, mu = jax.lax.cond(n == ENDS_AT, update, hold, p, mu, acc)
  return p, acc, mu, n + 1


@donated
def cond_then_select(p, acc, mu, n, x):
  ends = n == ENDS_AT
  acc = add(acc, grad(p, x))
  p, mu = jax.lax.cond(ends, update, hold, p, mu, acc)
  acc = jax.tree.map(lambda a: jnp.where(ends, 0, a), acc)
  return p, acc, mu, n + 1


@donated
def zeros_in_branch(p, acc, mu, n, x):
  acc = add(acc, grad(p, x))

  def updating(p, mu, acc):
    return (*update(p, mu, acc), zeros(acc))

  def holding(p, mu, acc):
    return p, mu, acc

  p, mu, acc = jax.lax.cond(n == ENDS_AT, updating, holding, p, mu, acc)
  return p, acc, mu, n + 1


@donated
def add_in_branch(p, acc, mu, n, x):
  def updating(p, mu, acc, g):
    acc = add(acc, g)
    return (*update(p, mu, acc), zeros(acc))

  def holding(p, mu, acc, g):
    return p, mu, add(acc, g)

  g = grad(p, x)
  p, mu, acc = jax.lax.cond(n == ENDS_AT, updating, holding, p, mu, acc, g)
  return p, acc, mu, n + 1


def momentum_into(mu, acc):
  """Momentum SGD whose updates are written over the accumulator."""
  mu = jax.tree.map(lambda m, a: 0.9 * m + a, mu, acc)
  return mu, jax.tree.map(lambda m: -1e-3 * m, mu)


def switch(pred, true_fun, false_fun, *operands):
  """``lax.cond`` as the package writes it (``_control.cond``)."""
  return jax.lax.switch(
    pred.astype(jnp.int32), (false_fun, true_fun), *operands
  )


def _split_close(p, acc, mu, n, x):
  ends = n == ENDS_AT
  acc = add(acc, grad(p, x))
  mu, out = switch(ends, momentum_into, lambda mu, acc: (mu, acc), mu, acc)
  p = switch(ends, add, lambda p, o: p, p, out)
  p, out = jax.lax.optimization_barrier((p, out))
  acc = switch(ends, zeros, lambda o: o, out)
  return p, acc, mu, n + 1, ends, out


@donated
def split_close(p, acc, mu, n, x):
  return _split_close(p, acc, mu, n, x)[:4]


@donated
def split_close_read_after(p, acc, mu, n, x):
  p, acc, mu, n, ends, out = _split_close(p, acc, mu, n, x)
  updates = jax.tree.map(lambda o: jnp.where(ends, o, 0), out)
  return add(p, updates), acc, mu, n


def _lazy_start(p, acc, mu, n, x):
  ends, fresh = n == ENDS_AT, n == 0
  acc = jax.tree.map(
    lambda a, g: jnp.where(fresh, jnp.zeros([], a.dtype), a) + g,
    acc,
    grad(p, x),
  )
  mu, out = switch(ends, momentum_into, lambda mu, acc: (mu, acc), mu, acc)
  return ends, out, mu


@donated
def lazy_start(p, acc, mu, n, x):
  ends, out, mu = _lazy_start(p, acc, mu, n, x)
  p = switch(ends, add, lambda p, o: p, p, out)
  return p, out, mu, n + 1


@donated
def lazy_start_read_after(p, acc, mu, n, x):
  ends, out, mu = _lazy_start(p, acc, mu, n, x)
  updates = jax.tree.map(lambda o: jnp.where(ends, o, 0), out)
  return add(p, updates), out, mu, n + 1


tx = optax_accum.accumulate(optax.sgd(1e-3, momentum=0.9), every_k=10**6)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def accumulate(p, s, x):
  u, s = tx.update(grad(p, x), s, p)
  return optax_accum.apply_updates(p, u, s), s


@functools.partial(jax.jit, donate_argnums=(0, 1))
def accumulate_optax_apply(p, s, x):
  u, s = tx.update(grad(p, x), s, p)
  return optax.apply_updates(p, u), s


def main() -> None:
  key = jax.random.key(0)
  params = [
    0.01 * jax.random.normal(jax.random.fold_in(key, i), (W, W))
    for i in range(LAYERS)
  ]
  x = jnp.ones((8, W))

  def fresh(extra):
    return lambda: [jax.tree.map(jnp.copy, params), *extra()]

  hand = lambda: (zeros(params), zeros(params), jnp.int32(0))  # noqa: E731
  steps = {
    "floor": (floor, fresh(lambda: (zeros(params),))),
    "cond_big": (cond_big, fresh(hand)),
    "cond_then_select": (cond_then_select, fresh(hand)),
    "zeros_in_branch": (zeros_in_branch, fresh(hand)),
    "add_in_branch": (add_in_branch, fresh(hand)),
    "split_close": (split_close, fresh(hand)),
    "split_close_read_after": (split_close_read_after, fresh(hand)),
    "lazy_start": (lazy_start, fresh(hand)),
    "lazy_start_read_after": (lazy_start_read_after, fresh(hand)),
    "accumulate": (accumulate, fresh(lambda: (tx.init(params),))),
    "accumulate+optax_apply": (
      accumulate_optax_apply,
      fresh(lambda: (tx.init(params),)),
    ),
  }
  print(f"jax {jax.__version__}, {LAYERS} x {W}^2 float32 params")
  for name, (step, make) in steps.items():
    memory = step.lower(*make(), x).compile().memory_analysis()
    print(f"{name:24s} temp {memory.temp_size_in_bytes / 2**20:7.1f} MiB")
  state = {name: make() for name, (_, make) in steps.items()}
  seconds = {name: [] for name in steps}
  for _ in range(7):
    for name, (step, _) in steps.items():
      args = state[name]
      for _ in range(2):
        args = list(step(*args, x))
      jax.block_until_ready(args)
      start = time.perf_counter()
      for _ in range(10):
        args = list(step(*args, x))
      jax.block_until_ready(args)
      seconds[name].append((time.perf_counter() - start) / 10)
      state[name] = args
  base = statistics.median(seconds["floor"])
  for name, s in seconds.items():
    print(
      f"{name:24s} {statistics.median(s) * 1e3:7.2f} ms"
      f"  x{statistics.median(s) / base:.2f} the floor"
      f" (rounds {min(s) / base:.2f}-{max(s) / base:.2f})"
    )


if __name__ == "__main__":
  main()
