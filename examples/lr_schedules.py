"""Where a learning-rate schedule goes: inside the accumulator, not around it.

``accumulate`` runs the inner optimizer only when a cycle completes, so a
schedule *inside* it (``optax.adam(optax.linear_schedule(...))``, or
``optax.inject_hyperparams(optax.adam)(learning_rate=schedule)``) advances
once per optimizer step, exactly as in big-batch training.

``optax.inject_hyperparams`` wrapped *around* the accumulator instead counts
every call, i.e. micro-batches: the schedule runs ``every_k`` times too fast
and the update of step ``t`` uses ``schedule(t * every_k + every_k - 1)``.
If that placement is unavoidable, give it ``lambda n: schedule(n // every_k)``.

Running this file prints the learning rate each optimizer step actually used
(measured from the update of a unit gradient under SGD) for the three
placements, and checks them.

  python examples/lr_schedules.py
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

EVERY_K = 4
STEPS = 5
SCHEDULE = optax.linear_schedule(1.0, 0.5, transition_steps=10)


def inside(every_k: int = EVERY_K) -> optax.GradientTransformation:
  """The recommended placement: the schedule belongs to the inner optimizer."""
  return optax_accum.accumulate(optax.sgd(SCHEDULE), every_k)


def around(every_k: int = EVERY_K) -> optax.GradientTransformation:
  """inject_hyperparams around the accumulator: counts micro-batches."""
  return optax.inject_hyperparams(
    lambda learning_rate: optax_accum.accumulate(
      optax.sgd(learning_rate), every_k
    )
  )(learning_rate=SCHEDULE)


def around_rescaled(every_k: int = EVERY_K) -> optax.GradientTransformation:
  """The same, with the schedule's argument converted back to steps."""
  return optax.inject_hyperparams(
    lambda learning_rate: optax_accum.accumulate(
      optax.sgd(learning_rate), every_k
    )
  )(learning_rate=lambda count: SCHEDULE(count // every_k))


def learning_rates(
  tx: optax.GradientTransformation, steps: int = STEPS, every_k: int = EVERY_K
) -> np.ndarray:
  """The learning rate applied at each optimizer step.

  Feeds unit gradients: SGD's update is then ``-learning_rate``.
  """
  params = jnp.zeros([1], jnp.float32)
  state = tx.init(params)
  update = jax.jit(tx.update)
  rates = []
  for _ in range(steps):
    for _ in range(every_k):
      updates, state = update(jnp.ones([1], jnp.float32), state, params)
    rates.append(-float(updates[0]))  # the k-th call of a cycle emits
  return np.asarray(rates)


def main() -> None:
  expected = np.asarray([SCHEDULE(t) for t in range(STEPS)])
  too_fast = np.asarray(
    [SCHEDULE(t * EVERY_K + EVERY_K - 1) for t in range(STEPS)]
  )
  for name, tx, want in [
    ("schedule inside accumulate", inside(), expected),
    ("inject_hyperparams around it", around(), too_fast),
    ("around it, schedule(n // k)", around_rescaled(), expected),
  ]:
    got = learning_rates(tx)
    print(f"{name:<30} {np.array2string(got, precision=3)}")
    np.testing.assert_allclose(got, want, rtol=1e-6)


if __name__ == "__main__":
  # No options: --help prints what the example shows.
  argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  ).parse_args()
  main()
