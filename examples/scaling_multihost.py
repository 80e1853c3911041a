"""Multi-host data parallelism: jax.distributed + deferred gradient reduction.

The same program runs on every host (process). Each one

1. joins the job with ``jax.distributed.initialize(coordinator_address,
   num_processes, process_id)`` before anything else touches JAX (on managed
   clusters, e.g. SLURM or Cloud TPU, ``jax.distributed.initialize()`` with no
   arguments finds these itself);
2. builds one mesh over the devices of all hosts (``jax.devices()``);
3. loads only its own part of every micro-batch and assembles the global
   batch with ``jax.make_array_from_process_local_data``;
4. runs the shard_map step of examples/scaling_shard_map.py: every device
   accumulates its local gradient, and the hosts talk once per optimizer
   step, when ``accumulate(..., axis_name="data")`` sums the accumulators.

(The GSPMD recipe of examples/scaling_fsdp.py also runs unchanged on a
multi-host mesh; it reduces every micro-batch.)

Three ways to run it::

  # One process, all local devices (8 simulated CPU devices):
  python examples/scaling_multihost.py

  # Two local processes x 2 CPU devices each, talking over loopback:
  python examples/scaling_multihost.py --spawn 2

  # A real cluster: on every host i of N (CPU hosts use gloo collectives):
  python examples/scaling_multihost.py --coordinator HOST0:1234 \\
      --num-processes N --process-id i

Every process checks its params against one big batch on one device (built
from every process's data with ``process_allgather``; only for the check).
"""

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

AXIS = "data"
SEQ, DIM, OUT = 8, 16, 4


def _parse_args(argv):
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--spawn",
    type=int,
    default=0,
    metavar="N",
    help="launch N local processes over loopback",
  )
  parser.add_argument(
    "--local-devices",
    type=int,
    default=None,
    help="CPU devices per process (default: 2 with --spawn, else 8)",
  )
  parser.add_argument(
    "--timeout",
    type=float,
    default=180,
    help="seconds before spawned processes are killed",
  )
  parser.add_argument("--coordinator", help="host:port of process 0")
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--every-k", type=int, default=2)
  parser.add_argument("--per-device-batch", type=int, default=2)
  return parser.parse_args(argv)


# ---------------------------------------------------------------------------
# Launcher (--spawn): N copies of this script on this machine.
# ---------------------------------------------------------------------------


def spawn(args) -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  training = [
    f"--steps={args.steps}",
    f"--every-k={args.every_k}",
    f"--per-device-batch={args.per_device_batch}",
  ]
  training.append(f"--local-devices={args.local_devices or 2}")
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  procs = []
  try:
    for i in range(args.spawn):
      procs.append(
        subprocess.Popen(
          [
            sys.executable,
            os.path.abspath(__file__),
            *training,
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            str(args.spawn),
            "--process-id",
            str(i),
          ],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
        )
      )
    deadline = time.monotonic() + args.timeout
    outputs = [
      p.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
      for p in procs
    ]
  except subprocess.TimeoutExpired:
    print(f"gave up after {args.timeout}s; killing the processes")
    return 1
  finally:
    for p in procs:  # a crashed peer leaves the others waiting: end them
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
    for line in out.splitlines():
      print(f"[process {i}] {line}")
    if p.returncode:
      print(f"[process {i}] exited with {p.returncode}")
  return max(p.returncode for p in procs)


# ---------------------------------------------------------------------------
# One process of the job.
# ---------------------------------------------------------------------------


def train(args) -> float:
  import jax

  # Simulated CPU devices; JAX starts its backend at the first operation.
  jax.config.update("jax_num_cpu_devices", args.local_devices or 8)
  if args.coordinator:
    # CPU collectives across processes; GPUs and TPUs bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
      initialization_timeout=60,
    )

  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import lax
  from jax.experimental import multihost_utils
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_accum

  n_dev, rank = jax.device_count(), jax.process_index()
  mesh = jax.make_mesh((n_dev,), (AXIS,), axis_types=(AxisType.Auto,))

  def loss_fn(params, x, y, mask):
    pred = jnp.einsum("btd,do->bto", x, params["w"]) + params["b"][None, None]
    tokens = jnp.sum(mask)
    err = jnp.sum(jnp.sum((pred - y) ** 2, axis=-1) * mask)
    return err / jnp.maximum(tokens, 1.0), tokens

  inner = optax.adam(0.05)
  tx = optax_accum.accumulate(inner, args.every_k, axis_name=AXIS)

  def local_step(params, state, x, y, mask):
    # Varying params: jax.grad returns this device's own gradient instead of
    # all-reducing it itself on every micro-batch.
    grads, tokens = jax.grad(loss_fn, has_aux=True)(
      lax.pcast(params, AXIS, to="varying"), x, y, mask
    )
    state = optax_accum.distributed.drop_device_axis(state)
    updates, state = tx.update(grads, state, params, weight=tokens)
    state = optax_accum.distributed.add_device_axis(state)
    return optax_accum.apply_updates(params, updates, state), state

  params0 = {
    "w": np.zeros((DIM, OUT), np.float32),
    "b": np.zeros(OUT, np.float32),
  }
  specs = optax_accum.distributed.shard_map_specs(
    jax.eval_shape(tx.init, params0), AXIS
  )
  init = jax.jit(
    jax.shard_map(
      lambda p: optax_accum.distributed.add_device_axis(tx.init(p)),
      mesh=mesh,
      in_specs=P(),
      out_specs=specs,
    )
  )
  step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(P(), specs, P(AXIS), P(AXIS), P(AXIS)),
      out_specs=(P(), specs),
    ),
    donate_argnums=(0, 1),
  )

  params = jax.device_put(params0, NamedSharding(mesh, P()))
  state = init(params)

  # This process's rows of every micro-batch: in real life, its own files.
  rng = np.random.default_rng(1000 + rank)
  rows = jax.local_device_count() * args.per_device_batch
  shape = (args.steps, args.every_k, rows, SEQ)
  x = rng.normal(size=(*shape, DIM)).astype(np.float32)
  y = rng.normal(size=(*shape, OUT)).astype(np.float32)
  lengths = rng.integers(1, SEQ + 1, size=shape[:-1])
  mask = (np.arange(SEQ) < lengths[..., None]).astype(np.float32)

  batch = NamedSharding(mesh, P(AXIS))
  for s in range(args.steps):
    for i in range(args.every_k):
      micro = [
        jax.make_array_from_process_local_data(batch, a[s, i])
        for a in (x, y, mask)
      ]
      params, state = step(params, state, *micro)
    if rank == 0:
      print(
        f"step {int(state.step)} done on {jax.process_count()}"
        f" process(es), {n_dev} devices"
      )

  # The check: every process's rows, one device, one batch per step.
  full = [
    np.asarray(multihost_utils.process_allgather(a)) for a in (x, y, mask)
  ]  # [process, step, micro, row, ...]
  ref = jax.device_put(params0, jax.local_devices()[0])
  ref_state = inner.init(ref)
  for s in range(args.steps):
    big = [a[:, s].reshape(-1, *a.shape[4:]) for a in full]
    grads, _ = jax.grad(loss_fn, has_aux=True)(ref, *big)
    updates, ref_state = inner.update(grads, ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  got = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), params)
  error = max(
    float(np.max(np.abs(a - np.asarray(b))))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
  )
  print(f"process {rank}: max |params - big-batch reference| = {error:.2e}")
  if args.coordinator:
    jax.distributed.shutdown()
  return error


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse_args(argv)
  if args.spawn:
    return spawn(args)
  error = train(args)
  return 0 if error <= 1e-4 else 1


if __name__ == "__main__":
  sys.exit(main())
