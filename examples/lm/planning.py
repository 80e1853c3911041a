"""Plans the demo's accumulation before a run: the largest micro-batch of its
transformer that fits, and the ``every_k`` that gives the batch asked for
(``optax_accum.plan_micro_batch``; it compiles the step, never runs it).

  python examples/lm/planning.py                       # this machine
  JAX_PLATFORMS=cpu python examples/lm/planning.py --target h100   # needs the
      # H100 compiler: pip install --no-deps $(python -m optax_accum.targets)

``main.py`` (``make demo``) prints both: this machine in its own process,
the H100 in a subprocess with the compilers that ``make demo`` installs.
"""

import argparse
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import optax_accum

from config import Config
from models import TransformerLM
from train import make_tx, mean_token_loss

# A scaled-up run of the demo's model: this many sequences per optimizer step.
GLOBAL_BATCH = 2**16


def step_and_args(cfg: Config):
  """The demo's weighted micro-step as a pure function of (params, state,
  batch), jitted and donated as it runs, and ``args_for(n)``."""
  model = TransformerLM(cfg, rngs=nnx.Rngs(cfg.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = make_tx(cfg, "weighted")

  def step(params, opt_state, batch):
    tokens, lengths = batch

    def loss(p):
      return mean_token_loss(nnx.merge(graphdef, p, rest), tokens, lengths)

    grads, count = jax.grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params, weight=count)
    return optax_accum.apply_updates(params, updates, opt_state), opt_state

  abstract = jax.eval_shape(lambda: params)
  state = jax.eval_shape(tx.init, abstract)

  def args_for(n: int):
    batch = (
      jax.ShapeDtypeStruct((n, cfg.max_len + 1), jnp.int32),
      jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    return abstract, state, batch

  return jax.jit(step, donate_argnums=(0, 1)), args_for


def physical_memory() -> int:
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(cfg: Config, target: str | None, global_batch: int):
  step, args_for = step_and_args(cfg)
  # JAX reports no memory limit for a CPU: plan for the machine's memory.
  limit = None
  if target is None and jax.default_backend() == "cpu":
    limit = physical_memory()
  return optax_accum.plan_micro_batch(
    step, args_for, global_batch, target=target, memory_limit=limit
  )


def plan_in_subprocess(target: str, global_batch: int, cfg: Config) -> str:
  """This script's output for `target`, run with the accelerator compilers
  (``OPTAX_ACCUM_ACCEL``, else ``.venv/accel``) and ``JAX_PLATFORMS=cpu``."""
  repo = pathlib.Path(__file__).resolve().parents[2]
  accel = pathlib.Path(
    os.environ.get("OPTAX_ACCUM_ACCEL", repo / ".venv" / "accel")
  )
  if not (accel / "jax_plugins").is_dir():
    return (
      f"(no plan for {target}: its compiler is not installed; `make demo`"
      " installs it, or `pip install --no-deps --target .venv/accel"
      " $(python -m optax_accum.targets)`)"
    )
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
  env["PYTHONPATH"] = os.pathsep.join([str(accel), str(repo)])
  command = [sys.executable, __file__, "--target", target]
  command += ["--global-batch", str(global_batch)]
  command += [
    "--d-model",
    str(cfg.d_model),
    "--num-layers",
    str(cfg.num_layers),
  ]
  result = subprocess.run(command, env=env, capture_output=True, text=True)
  if result.returncode:
    return f"(the {target} plan failed: {result.stderr.strip()[-2000:]})"
  return result.stdout.rstrip()


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default=None, help="e.g. h100, v5e_2x2")
  parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
  parser.add_argument("--d-model", type=int, default=Config().d_model)
  parser.add_argument("--num-layers", type=int, default=Config().num_layers)
  args = parser.parse_args(argv)
  cfg = Config(d_model=args.d_model, num_layers=args.num_layers)
  print(plan(cfg, args.target, args.global_batch))


if __name__ == "__main__":
  main()
