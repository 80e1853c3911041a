"""One process of the multi-process HSDP test (run by
tests/test_multiprocess.py).

Two processes of 4 CPU devices each join a ``jax.distributed`` job over
loopback and train on an explicit ``("replica", "fsdp") = (2, 4)`` mesh
whose ``"replica"`` axis runs across the processes, as slices do: params
sharded over ``"fsdp"`` within a process, gradients from
``local_value_and_grad(..., axis_name="replica")`` and
``accumulate(inner, K, axis_name="replica")``, which all-reduces the shards
across the processes once per optimizer step. The params must equal a
big-batch reference that this process computes alone on one device; the
compiled step must pass ``assert_reduction_deferred(...,
axis_name="replica")``. The results go to ``--out`` as JSON.

Not a test module: importing it does nothing.
"""

import json
import os
import sys

from _multiprocess_worker import big_batch_reference, parse_args

K = 4  # micro-batches per optimizer step
STEPS = 2  # optimizer steps
PER_DEVICE = 2  # examples per device per micro-batch
DIM, OUT = 16, 8
REPLICAS, FSDP = 2, 4


def main(argv=None) -> None:
  args = parse_args(argv, __doc__.splitlines()[0])
  os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={FSDP}"
  )
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import AxisType, NamedSharding
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
    # One row of the mesh per process: "replica" runs across processes.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(
      np.asarray(devices).reshape(REPLICAS, FSDP),
      ("replica", "fsdp"),
      axis_types=(AxisType.Explicit,) * 2,
    )
    rows = [{d.process_index for d in row} for row in mesh.devices]

    rng = np.random.default_rng(0)
    batch = REPLICAS * FSDP * PER_DEVICE
    x = rng.normal(size=(STEPS, K, batch, DIM)).astype(np.float32)
    y = rng.normal(size=(STEPS, K, batch, OUT)).astype(np.float32)
    mask = (rng.uniform(size=(STEPS, K, batch)) > 0.3).astype(np.float32)
    params0 = {
      "w": np.asarray(rng.normal(size=(DIM, OUT)) / 4, np.float32),
      "b": np.zeros(OUT, np.float32),
    }
    specs = {"w": P("fsdp", None), "b": P()}

    def mean_loss(params, x, y, mask):
      """Token mean over the micro-batch and its token count."""
      if not jax.sharding.get_abstract_mesh().empty:  # FSDP's all-gather
        params = jax.tree.map(lambda w: jax.sharding.reshard(w, P()), params)
      err = jnp.sum((x @ params["w"] + params["b"][None] - y) ** 2, axis=-1)
      tokens = jnp.sum(mask)
      return jnp.sum(err * mask) / jnp.maximum(tokens, 1.0), tokens

    # SGD with momentum: linear in the gradient, a weighting error shows.
    inner = optax.sgd(0.1, momentum=0.9)

    ref = big_batch_reference(mean_loss, inner, params0, (x, y, mask))

    by_batch = NamedSharding(mesh, P(("replica", "fsdp")))

    def global_batch(a, s, i):
      part = a[s, i]
      return jax.make_array_from_callback(
        part.shape, by_batch, lambda index: part[index]
      )

    tx = optax_accum.accumulate(inner, K, axis_name="replica")
    grad_fn = optax_accum.distributed.local_value_and_grad(
      mean_loss, axis_name="replica", has_weight=True
    )

    @jax.jit
    def step(params, state, x, y, mask):
      (_, tokens), grads = grad_fn(params, x, y, mask)
      updates, state = tx.update(grads, state, params, weight=tokens)
      return optax_accum.apply_updates(params, updates, state), state

    with jax.set_mesh(mesh):
      params = {
        k: jax.make_array_from_callback(
          v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i]
        )
        for k, v in params0.items()
      }
      state = tx.init(params)
      acc_shard = state.acc_buffer["w"].addressable_shards[0].data.nbytes
      for s in range(STEPS):
        for i in range(K):
          micro = [global_batch(a, s, i) for a in (x, y, mask)]
          if s == i == 0:
            optax_accum.inspect.assert_reduction_deferred(
              step, params, state, *micro, axis_name="replica", min_bytes=64
            )
          params, state = step(params, state, *micro)
      gathered = jax.jit(
        lambda p: jax.tree.map(lambda w: jax.sharding.reshard(w, P()), p)
      )(params)

    results = {
      "hsdp": jax.tree.map(
        lambda a: np.asarray(a.addressable_shards[0].data).tolist(), gathered
      ),
      "hsdp_step": int(state.step),
      "reference": jax.tree.map(lambda a: np.asarray(a).tolist(), ref),
      "replica_processes": [sorted(r) for r in rows],
      "acc_shard_bytes": int(acc_shard),
      "param_bytes": int(params0["w"].nbytes),
      "process_count": jax.process_count(),
      "device_count": jax.device_count(),
    }
    with open(args.out, "w") as f:
      json.dump(results, f)
  finally:
    jax.distributed.shutdown()


if __name__ == "__main__":
  sys.exit(main())
