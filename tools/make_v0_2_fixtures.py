"""Writes tests/data/v0_2/: checkpoints that optax_accum 0.2 saved, and what
0.2 did after them (tests/test_upgrade.py restores and continues them).

Run once against the 0.2 code, never as part of the tests::

  git worktree add /tmp/v02 cffd32a   # the last 0.2 commit
  cd /tmp/v02 && $OLDPWD/.venv/bin/python -c "import runpy, sys;
    sys.path.insert(0, '.'); runpy.run_path('$OLDPWD/tools/make_v0_2_fixtures.py',
    run_name='__main__')"

(the package from the worktree, ahead of the installed one).

For each configuration (`CONFIGS`: plain, weighted with the noise scale,
grow_every_k) it runs `CALLS` calls, saves the state mid-cycle with flax
(msgpack), Orbax (StandardCheckpointer) and equinox (leaves by position),
then records the updates and counters of `AFTER` more calls.
"""

import pathlib
import shutil

import equinox as eqx
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_accum

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "v0_2"
CALLS, AFTER = 5, 7


def configs():
  """name -> (transformation, per-call weight). Also imported by the test,
  which builds the same transformations with today's code."""
  return {
    "plain": (optax_accum.accumulate(optax.adam(0.1), 3), None),
    "noise": (
      optax_accum.accumulate(optax.adam(0.1), 3, track_noise_scale=True),
      lambda i: 1.0 + i % 3,
    ),
    "grow": (
      optax_accum.accumulate(
        optax.sgd(0.1),
        optax_accum.grow_every_k(8, k_min=2, min_cycles=1),
        track_noise_scale=True,
      ),
      lambda i: 2.0,
    ),
  }


def params():
  return {"w": jnp.arange(6.0).reshape(2, 3) / 7, "b": jnp.ones(3)}


def grads(i: int):
  key = jax.random.key(i)
  return jax.tree.map(
    lambda p: jax.random.normal(key, p.shape) * (1 + i), params()
  )


def run(tx, weight, state, first: int, count: int):
  """`count` calls from call `first`: the updates and the states."""
  update = jax.jit(tx.update)
  outs = []
  for i in range(first, first + count):
    kwargs = {} if weight is None else {"weight": weight(i)}
    updates, state = update(grads(i), state, params(), **kwargs)
    outs.append((updates, state))
  return outs


def main() -> None:
  shutil.rmtree(OUT, ignore_errors=True)
  OUT.mkdir(parents=True)
  checkpointer = ocp.StandardCheckpointer()
  for name, (tx, weight) in configs().items():
    state = tx.init(params())
    *_, (_, state) = run(tx, weight, state, 0, CALLS)
    (OUT / f"{name}.msgpack").write_bytes(flax.serialization.to_bytes(state))
    checkpointer.save(OUT / f"{name}.orbax", state)
    checkpointer.wait_until_finished()
    eqx.tree_serialise_leaves(OUT / f"{name}.eqx", state)
    after = run(tx, weight, state, CALLS, AFTER)
    record = {}
    for j, (updates, s) in enumerate(after):
      for key, leaf in updates.items():
        record[f"{j}/updates/{key}"] = np.asarray(leaf)
      record[f"{j}/step"] = np.asarray(s.step)
      record[f"{j}/micro_step"] = np.asarray(s.micro_step)
      record[f"{j}/every_k"] = np.asarray(s.every_k)
      record[f"{j}/weight_seen"] = np.asarray(s.weight_seen)
    np.savez(OUT / f"{name}.after.npz", **record)
  checkpointer.close()
  print(f"wrote {sorted(p.name for p in OUT.iterdir())}")


if __name__ == "__main__":
  main()
