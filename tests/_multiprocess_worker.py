"""One process of the multi-process test (run by tests/test_multiprocess.py).

Each process joins a `jax.distributed` job over loopback, owns
``--xla_force_host_platform_device_count`` CPU devices (set by the parent),
and trains a token-weighted linear model for two optimizer steps of
``K`` micro-batches, twice:

* ``gspmd``: ``jit`` with the batch sharded over every device of every
  process and the params replicated; XLA reduces each micro-batch gradient.
* ``shard_map``: each device passes its local, unreduced gradient to
  ``accumulate(..., axis_name="data")``; the reduction happens once per
  optimizer step.
* ``unreduced``: plain ``jit`` on a mesh whose ``data`` axis is explicit;
  ``local_value_and_grad`` gives gradients typed unreduced over it and the
  same ``accumulate(..., axis_name="data")`` reduces once per optimizer step.

The last two skip non-finite micro-batches, and get one (a NaN in process
1's shard) in the middle of the second cycle; their states are saved
through the host, as a checkpoint is, at the boundary before that cycle and
in its middle, after the NaN (``--out`` with ``.npz``), for the parent to
resume in one process on other devices (issue 69).

Both must equal a big-batch reference that this process computes alone on one
of its devices from the whole data set (every process can build it: the data
come from a fixed seed, and each process only puts its own shards on its
devices). The results go to ``--out`` as JSON for the parent to check.

Not a test module: importing it does nothing (pytest imports it to look for
doctests).
"""

import argparse
import json
import os
import sys

K = 2  # micro-batches per optimizer step
STEPS = 2  # optimizer steps
PER_DEVICE = 2  # examples per device per micro-batch
SEQ, DIM, OUT = 5, 4, 3


def parse_args(argv, description):
  """The worker's arguments (shared with _multiprocess_hsdp_worker.py)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--coordinator", required=True, help="host:port")
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--out", required=True, help="JSON result file")
  return parser.parse_args(argv)


def big_batch_reference(mean_loss, inner, params0, arrays):
  """The reference: on one local device, one optimizer step per big batch.

  `arrays` are ``(steps, K, per-process batch, ...)``; a step's big batch
  is all its micro-batches, of every process, as one batch. `mean_loss`
  returns ``(loss, aux)``."""
  import jax
  import optax

  local = jax.local_devices()[0]
  ref = jax.device_put(params0, local)
  ref_state = inner.init(ref)
  for s in range(len(arrays[0])):
    big = [
      jax.device_put(a[s].reshape(-1, *a.shape[3:]), local) for a in arrays
    ]
    grad, _ = jax.grad(mean_loss, has_aux=True)(ref, *big)
    updates, ref_state = inner.update(grad, ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  return ref


def main(argv=None) -> None:
  args = parse_args(argv, __doc__.splitlines()[0])
  # Before the backend starts: the parent sets the device count, this keeps
  # the worker runnable by hand too.
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_accum

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.distributed.initialize(
    coordinator_address=args.coordinator,
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=60,
  )
  try:
    n_dev = jax.device_count()
    mesh = jax.make_mesh(
      (n_dev,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    replicated = NamedSharding(mesh, P())
    by_batch = NamedSharding(mesh, P("data"))

    # The whole data set, identical in every process: [step, micro, batch..].
    rng = np.random.default_rng(0)
    batch = n_dev * PER_DEVICE
    x = rng.normal(size=(STEPS, K, batch, SEQ, DIM)).astype(np.float32)
    y = rng.normal(size=(STEPS, K, batch, SEQ, OUT)).astype(np.float32)
    # A different number of valid tokens per example (1 to SEQ).
    lengths = rng.integers(1, SEQ + 1, size=(STEPS, K, batch))
    mask = (np.arange(SEQ) < lengths[..., None]).astype(np.float32)
    params0 = {
      "w": np.asarray(rng.normal(size=(DIM, OUT)), np.float32),
      "b": np.zeros(OUT, np.float32),
    }

    def sum_loss(params, x, y, mask):
      err = (
        jnp.einsum("btd,do->bto", x, params["w"]) + params["b"][None, None] - y
      )
      return jnp.sum(jnp.sum(err**2, axis=-1) * mask)

    def mean_loss(params, x, y, mask):
      """Token mean over the micro-batch, and its token count (the weight)."""
      tokens = jnp.sum(mask)
      return sum_loss(params, x, y, mask) / jnp.maximum(tokens, 1.0), tokens

    # SGD with momentum: its update is linear in the gradient, so any error
    # in the weighting shows (adam's first step would hide a scale error).
    inner = optax.sgd(0.1, momentum=0.9)

    ref = big_batch_reference(mean_loss, inner, params0, (x, y, mask))

    def global_batch(a, s, i, sharding=by_batch):
      """Micro-batch i of step s, each process filling only its shards."""
      part = a[s, i]
      return jax.make_array_from_callback(
        part.shape, sharding, lambda index: part[index]
      )

    def fetch(tree):
      return jax.tree.map(
        lambda a: np.asarray(a.addressable_shards[0].data), tree
      )

    results = {}
    # The micro-batch skipped in the second cycle: a NaN in the last example
    # (process 1's shard).
    nan_x = x[1, 0].copy()
    nan_x[-1, 0, 0] = np.nan
    calls = [(s, i) for s in range(STEPS) for i in range(K)]
    calls.insert(K + 1, "nan")
    saved_after = {"boundary": K, "mid": K + 2}  # calls run before a save
    checkpoints = {"x": x, "y": y, "mask": mask, "nan_x": nan_x}

    def call_data(call, sharding=by_batch):
      if call == "nan":
        part = (nan_x, y[1, 0], mask[1, 0])
        return [
          jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i])
          for a in part
        ]
      return [global_batch(a, *call, sharding) for a in (x, y, mask)]

    def save(recipe, point, params, state):
      """Every process gathers the global arrays; process 0 writes them."""
      gathered = multihost_utils.process_allgather((params, state), tiled=True)
      for n, leaf in enumerate(jax.tree.leaves(gathered)):
        checkpoints[f"{recipe}/{point}/{n}"] = np.asarray(leaf)

    # GSPMD: jit with a batch-sharded micro-batch, replicated params.
    tx = optax_accum.accumulate(inner, K)
    params = jax.device_put(params0, replicated)
    state = jax.jit(
      tx.init, out_shardings=optax_accum.distributed.state_shardings(tx, params)
    )(params)

    @jax.jit
    def gspmd_step(params, state, x, y, mask):
      grad, tokens = jax.grad(mean_loss, has_aux=True)(params, x, y, mask)
      updates, state = tx.update(grad, state, params, weight=tokens)
      return optax.apply_updates(params, updates), state

    for s in range(STEPS):
      for i in range(K):
        params, state = gspmd_step(
          params, state, *(global_batch(a, s, i) for a in (x, y, mask))
        )
    results["gspmd"] = fetch(params)
    results["gspmd_step"] = int(fetch(state.step))

    # shard_map: local gradients, reduced once per optimizer step.
    tx = optax_accum.accumulate(inner, K, axis_name="data", skip_nonfinite=True)
    specs = optax_accum.distributed.shard_map_specs(
      jax.eval_shape(tx.init, params0), "data"
    )
    add_device_axis = optax_accum.distributed.add_device_axis
    drop_device_axis = optax_accum.distributed.drop_device_axis

    init = jax.jit(
      jax.shard_map(
        lambda p: add_device_axis(tx.init(p)),
        mesh=mesh,
        in_specs=P(),
        out_specs=specs,
      )
    )

    def local_step(params, state, x, y, mask):
      # Device-varying params: jax.grad returns the local gradient instead
      # of all-reducing it itself on every micro-batch.
      local_params = jax.lax.pcast(params, "data", to="varying")
      grad, tokens = jax.grad(mean_loss, has_aux=True)(local_params, x, y, mask)
      updates, state = tx.update(
        grad, drop_device_axis(state), params, weight=tokens
      )
      return optax.apply_updates(params, updates), add_device_axis(state)

    shard_step = jax.jit(
      jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data"), P("data")),
        out_specs=(P(), specs),
      )
    )
    params = jax.device_put(params0, replicated)
    state = init(params)
    for n, call in enumerate(calls):
      for point, after in saved_after.items():
        if n == after:
          save("shard_map", point, params, state)
      params, state = shard_step(params, state, *call_data(call))
    results["shard_map"] = fetch(params)
    results["shard_map_skipped"] = int(fetch(state.num_skipped))
    results["shard_map_step"] = int(fetch(state.step))

    # Plain jit, unreduced gradients: the same accumulate, no shard_map.
    explicit = jax.make_mesh(
      (n_dev,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    grad_fn = optax_accum.distributed.local_value_and_grad(
      mean_loss, has_weight=True
    )

    @jax.jit
    def unreduced_step(params, state, x, y, mask):
      (_, tokens), grads = grad_fn(params, x, y, mask)
      updates, state = tx.update(grads, state, params, weight=tokens)
      return optax.apply_updates(params, updates), state

    with jax.set_mesh(explicit):
      params = jax.device_put(params0, NamedSharding(explicit, P()))
      state = tx.init(params)
      by_batch = NamedSharding(explicit, P("data"))
      for n, call in enumerate(calls):
        batch = call_data(call, by_batch)
        for point, after in saved_after.items():
          if n == after:
            reduced = optax_accum.distributed.reduce_state(state)
            save("unreduced", point, params, reduced)
        if n == 0:  # The gradient is reduced in the emitting branch.
          optax_accum.inspect.assert_reduction_deferred(
            unreduced_step, params, state, *batch, min_bytes=4 * OUT
          )
        params, state = unreduced_step(params, state, *batch)
    results["unreduced"] = fetch(params)
    results["unreduced_skipped"] = int(fetch(state.num_skipped))
    results["unreduced_step"] = int(fetch(state.step))
    results["reference"] = fetch(ref)
    results["process_count"] = jax.process_count()
    results["device_count"] = n_dev
    results["local_device_count"] = jax.local_device_count()

    results["checkpoints"] = f"{args.out}.npz"
    if jax.process_index() == 0:
      np.savez(results["checkpoints"], **checkpoints)
    with open(args.out, "w") as f:
      json.dump(
        jax.tree.map(
          lambda a: a.tolist() if isinstance(a, np.ndarray) else a,
          results,
        ),
        f,
      )
  finally:
    jax.distributed.shutdown()


if __name__ == "__main__":
  sys.exit(main())
