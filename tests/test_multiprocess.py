"""A real multi-process run: 2 processes x 2 CPU devices on `jax.distributed`.

The worker (tests/_multiprocess_worker.py) trains with accumulation under
GSPMD ``jit``, under ``shard_map`` + ``axis_name`` and under plain ``jit``
with unreduced gradients + ``axis_name``, with the data sharded
across the processes, and compares both with a big-batch reference. The
processes talk over loopback (coordinator on 127.0.0.1, gloo collectives),
are bounded by a timeout and are always killed at the end. The checkpoints
the two processes write mid-cycle resume here, in one process on 2 devices
(issue 69).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
HSDP_WORKER = Path(__file__).with_name("_multiprocess_hsdp_worker.py")
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker_env(devices: int) -> dict[str, str]:
  env = dict(os.environ)
  # Replace (not extend) the 8 devices this test process was given.
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  return env


def _run_workers(
  tmp_path: Path, worker: Path = WORKER, devices: int = DEVICES_PER_PROCESS
) -> list[dict]:
  address = f"127.0.0.1:{_free_port()}"
  outs = [tmp_path / f"process_{i}.json" for i in range(NUM_PROCESSES)]
  logs = [tmp_path / f"process_{i}.log" for i in range(NUM_PROCESSES)]
  procs = []
  try:
    for i in range(NUM_PROCESSES):
      with open(logs[i], "w") as log:
        procs.append(
          subprocess.Popen(
            [
              sys.executable,
              str(worker),
              "--coordinator",
              address,
              "--num-processes",
              str(NUM_PROCESSES),
              "--process-id",
              str(i),
              "--out",
              str(outs[i]),
            ],
            env=_worker_env(devices),
            stdout=log,
            stderr=subprocess.STDOUT,
          )
        )
    for proc in procs:
      proc.wait(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    pytest.fail(
      f"workers did not finish within {TIMEOUT_S}s; logs:\n"
      + "\n".join(log.read_text()[-3000:] for log in logs)
    )
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  for i, proc in enumerate(procs):
    assert proc.returncode == 0, (
      f"process {i} exited with {proc.returncode}:\n"
      + logs[i].read_text()[-5000:]
    )
  return [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return _run_workers(tmp_path_factory.mktemp("multiprocess"))


def test_workers_form_one_job_of_all_devices(results):
  for r in results:
    assert r["process_count"] == NUM_PROCESSES
    assert r["local_device_count"] == DEVICES_PER_PROCESS
    assert r["device_count"] == NUM_PROCESSES * DEVICES_PER_PROCESS


@pytest.mark.parametrize("recipe", ["gspmd", "shard_map", "unreduced"])
def test_matches_single_process_big_batch(results, recipe):
  """Two optimizer steps of accumulated, token-weighted micro-batches, with
  the data split over processes, land on the big-batch params (float32
  sums in a different order: rtol 1e-5)."""
  for r in results:
    assert r[f"{recipe}_step"] == 2
    for name in ("w", "b"):
      np.testing.assert_allclose(
        r[recipe][name], r["reference"][name], rtol=1e-5, atol=1e-6
      )


@pytest.mark.parametrize("recipe", ["gspmd", "shard_map", "unreduced"])
def test_processes_agree(results, recipe):
  """Every process ends with the same (replicated) params, bit for bit."""
  for name in ("w", "b"):
    np.testing.assert_array_equal(
      results[0][recipe][name], results[1][recipe][name]
    )


# ----------------------------------------------------------------------------
# Two processes' checkpoint, resumed in one (issue 69): the workers saved
# their state (4 devices) at the boundary before the second cycle and in its
# middle, after a skipped NaN micro-batch; here, on 2 devices, regrouped
# with `regroup_state`, the run ends on the two processes' params.
# ----------------------------------------------------------------------------

RESUMED_ON = 2
K = 2  # the worker's micro-batches per optimizer step
SAVED_AFTER = {"boundary": K, "mid": K + 2}  # as the worker's calls count


def _mean_loss(params, x, y, mask):
  """The worker's loss: the mean over the real tokens, and their number."""
  err = jnp.einsum("btd,do->bto", x, params["w"]) + params["b"][None, None]
  tokens = jnp.sum(mask)
  loss = jnp.sum(jnp.sum((err - y) ** 2, axis=-1) * mask)
  return loss / jnp.maximum(tokens, 1.0), tokens


def _resume_steps(recipe, tx, params):
  """(target state, step) of `recipe` on this process's first 2 devices."""
  devices = jax.devices()[:RESUMED_ON]
  if recipe == "shard_map":
    mesh = jax.make_mesh(
      (RESUMED_ON,), ("data",), (AxisType.Auto,), devices=devices
    )
    specs = optax_accum.distributed.shard_map_specs(
      jax.eval_shape(tx.init, params), "data"
    )

    def local_step(params, state, x, y, mask):
      local = jax.lax.pcast(params, "data", to="varying")
      grad, tokens = jax.grad(_mean_loss, has_aux=True)(local, x, y, mask)
      state = optax_accum.distributed.drop_device_axis(state)
      updates, state = tx.update(grad, state, params, weight=tokens)
      state = optax_accum.distributed.add_device_axis(state)
      return optax.apply_updates(params, updates), state

    init = jax.shard_map(
      lambda p: optax_accum.distributed.add_device_axis(tx.init(p)),
      mesh=mesh,
      in_specs=P(),
      out_specs=specs,
    )
    step = jax.jit(
      jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data"), P("data")),
        out_specs=(P(), specs),
      )
    )
    return jax.jit(init)(params), step
  mesh = jax.make_mesh(
    (RESUMED_ON,), ("data",), (AxisType.Explicit,), devices=devices
  )
  grad_fn = optax_accum.distributed.local_value_and_grad(
    _mean_loss, has_weight=True
  )

  @jax.jit
  def unreduced_step(params, state, x, y, mask):
    (_, tokens), grads = grad_fn(params, x, y, mask)
    updates, state = tx.update(grads, state, params, weight=tokens)
    return optax.apply_updates(params, updates), state

  def step(params, state, *batch):
    with jax.set_mesh(mesh):
      params = jax.device_put(params, NamedSharding(mesh, P()))
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      return unreduced_step(params, state, *batch)

  with jax.set_mesh(mesh):
    return tx.init(jax.device_put(params, NamedSharding(mesh, P()))), step


@pytest.mark.parametrize("point", list(SAVED_AFTER))
@pytest.mark.parametrize("recipe", ["shard_map", "unreduced"])
def test_two_processes_checkpoint_resumes_in_one(results, recipe, point):
  saved = np.load(results[0]["checkpoints"])
  tx = optax_accum.accumulate(
    optax.sgd(0.1, momentum=0.9), K, axis_name="data", skip_nonfinite=True
  )
  dim, out = saved["x"].shape[-1], saved["y"].shape[-1]
  shapes = {
    "w": np.zeros((dim, out), np.float32),
    "b": np.zeros(out, np.float32),
  }
  target, step = _resume_steps(recipe, tx, shapes)
  treedef = jax.tree.structure((shapes, target))
  leaves = [saved[f"{recipe}/{point}/{n}"] for n in range(treedef.num_leaves)]
  params, restored = jax.tree.unflatten(treedef, leaves)
  if recipe == "shard_map":  # a partial sum for each of the 4 devices
    assert restored.acc_scalars.shape[0] == 4
  state = optax_accum.distributed.regroup_state(restored, target)
  calls = [(0, 0), (0, 1), (1, 0), "nan", (1, 1)][SAVED_AFTER[point] :]
  for call in calls:
    if call == "nan":
      data = (saved["nan_x"], saved["y"][1, 0], saved["mask"][1, 0])
    else:
      data = tuple(saved[a][call] for a in ("x", "y", "mask"))
    params, state = step(params, state, *data)
  assert int(np.asarray(state.step)) == 2
  assert (
    int(np.asarray(state.num_skipped)) == results[0][f"{recipe}_skipped"] == 1
  )
  for name in ("w", "b"):
    np.testing.assert_allclose(
      np.asarray(params[name]), results[0][recipe][name], rtol=1e-5, atol=1e-6
    )


# ----------------------------------------------------------------------------
# HSDP (issue 21): 2 processes x 4 devices, "replica" across the processes.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hsdp_results(tmp_path_factory):
  return _run_workers(
    tmp_path_factory.mktemp("multiprocess_hsdp"), HSDP_WORKER, devices=4
  )


def test_hsdp_replicas_are_the_processes(hsdp_results):
  for r in hsdp_results:
    assert r["process_count"] == 2 and r["device_count"] == 8
    assert r["replica_processes"] == [[0], [1]]
    # The accumulator holds one fsdp shard of w per device.
    assert r["acc_shard_bytes"] * 4 == r["param_bytes"]


def test_hsdp_across_processes_matches_the_single_process_big_batch(
  hsdp_results,
):
  """Token-weighted SGD with momentum, deferred across the processes and
  reduce-scattered within each: the single-process big-batch params."""
  for r in hsdp_results:
    assert r["hsdp_step"] == 2
    for name in ("w", "b"):
      np.testing.assert_allclose(
        r["hsdp"][name], r["reference"][name], rtol=1e-5, atol=1e-6
      )
  for name in ("w", "b"):
    np.testing.assert_array_equal(
      hsdp_results[0]["hsdp"][name], hsdp_results[1]["hsdp"][name]
    )
