"""Where a call of the tiny model's loop spends its time: on the host
(dispatching it) or on the device (running it). For the GPU page's tiny
model, where ours loses to ``optax.MultiSteps`` (``render.GPU_REASONS``).

For each loop of ``bench_loop.py`` named below, in interleaved rounds:
``calls`` calls back to back, timed twice, when the loop returns (the
host's dispatch, the device still running) and when its results are
ready (the whole). Host-bound: the two are about equal. Prints one JSON
line: per loop and k, the rounds' seconds per call of both.

``--form`` compiles the traced step (``readme``, ``bare``) in another
program form, for ``tiny_variants.py``: ``library`` (as shipped: on a GPU
a small state decides with selects), ``conditionals`` (the two conditionals
of a large state at every size: the library before issue 61) or
``one_switch`` (one conditional: the updating branch applies the params
itself, as the bf16 step does).

Usage::

  python benchmarks/tiny_call_probe.py [--rounds 5] [--calls 400] [--form F]
"""

import argparse
import json
import statistics
import time

import jax.numpy as jnp
from _common import machine_info
from _loops import INNERS, Problem, build
from _models import make_problem

LOOPS = ("readme", "bare", "static", "multisteps", "floor")
FORMS = ("library", "conditionals", "one_switch")


def use_form(form: str) -> None:
  """Compiles the traced step in `form` from now on (see the module's
  docstring): the library's own functions, chosen differently."""
  import functools  # noqa: PLC0415

  from optax_accum import _control, _forms  # noqa: PLC0415

  if form in ("conditionals", "one_switch"):
    _control.SELECTS_BELOW_BYTES = 0
  if form == "one_switch":

    def one_switch(config, engine, inner, cycle):
      decide = functools.partial(_forms.apply_inside, config, engine)
      if cycle.params is None:
        return _forms.decide(config, engine, inner, cycle, shares=True)
      return decide(inner, cycle)

    _forms.decide_on_device = one_switch


def probe(k: int, rounds: int, calls: int) -> dict:
  base = make_problem(0.25, jnp.float32, 8)
  problem = Problem(base.params, base.batch, base.loss, INNERS["adam"], k)
  loops = build(problem, set(LOOPS))
  done = dict.fromkeys(loops, 0)
  for name, loop in loops.items():  # compile and warm up
    for i in range(4 * k):
      loop.call(i)
    loop.block()
    done[name] = 4 * k
  out = {name: {"dispatch_s": [], "total_s": []} for name in loops}
  order = sorted(loops)
  for r in range(rounds):
    for name in order[r % len(order) :] + order[: r % len(order)]:
      loop, start = loops[name], done[name]
      loop.block()
      t0 = time.perf_counter()
      for i in range(start, start + calls):
        loop.call(i)
      t1 = time.perf_counter()
      loop.block()
      t2 = time.perf_counter()
      out[name]["dispatch_s"].append((t1 - t0) / calls)
      out[name]["total_s"].append((t2 - t0) / calls)
      done[name] = start + calls
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=400)
  p.add_argument("--k", type=int, nargs="+", default=[2, 8])
  p.add_argument("--form", choices=FORMS, default="library")
  args = p.parse_args()
  use_form(args.form)
  results = {str(k): probe(k, args.rounds, args.calls) for k in args.k}
  for k, loops in results.items():
    for name, r in sorted(loops.items()):
      d, t = statistics.median(r["dispatch_s"]), statistics.median(r["total_s"])
      print(
        f"k={k} {name:11s} dispatch {d * 1e6:7.1f} us  total {t * 1e6:7.1f} us"
      )
  print(
    json.dumps(
      {"machine": machine_info(), "form": args.form, "results": results}
    )
  )


if __name__ == "__main__":
  main()
