"""Whether a refactor changed what the CPU compiles: the traced, emit=True
and emit=False steps (float32 adam, bfloat16 clip+adamw; 8 MiB of params,
k=4, donated, applied with ``optax_accum.apply_updates``), compiled at this
checkout and at a git revision, compared by memory (``memory_analysis()``)
and by the count of each HLO opcode.

A refactor that keeps them all equal keeps every CPU step figure of the
benchmark pages: the same programs run. Prints one line per step, ``SAME``
or ``DIFF`` with what differs, and exits 1 on any difference.

Usage (the project's .venv python, from the repository root)::

  python tools/compare_compiled.py 8675139
"""

import collections
import functools
import json
import pathlib
import re
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def probe() -> dict:
  """The steps' memory and opcode counts, compiled by the optax_accum that
  `import` finds first."""
  import jax  # noqa: PLC0415  (in the probing process only)
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415

  import optax_accum  # noqa: PLC0415

  inners = {
    "adam": (jnp.float32, lambda: optax.adam(1e-3)),
    "clip_adamw": (
      jnp.bfloat16,
      lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    ),
  }
  out = {"module": optax_accum.__file__}
  for name, (dtype, inner) in inners.items():
    params = {"a": jnp.ones((1024, 2048), dtype), "b": jnp.ones(2048, dtype)}
    for emit in (None, True, False):
      tx = optax_accum.accumulate(inner(), 4)
      options = {} if emit is None else {"emit": emit}

      @functools.partial(jax.jit, donate_argnums=(0, 1))
      def step(p, s, g, tx=tx, options=options):
        u, s = tx.update(g, s, p, **options)
        return optax_accum.apply_updates(p, u, s), s

      compiled = step.lower(params, tx.init(params), params).compile()
      memory = compiled.memory_analysis()
      ops = collections.Counter(
        re.findall(r"= \S+ (\w[\w-]*)\(", compiled.as_text())
      )
      out[f"{jnp.dtype(dtype).name} {name} emit={emit}"] = {
        "temp": memory.temp_size_in_bytes,
        "output": memory.output_size_in_bytes,
        "alias": memory.alias_size_in_bytes,
        "ops": dict(sorted(ops.items())),
      }
  return out


def _run_at(root: pathlib.Path) -> dict:
  done = subprocess.run(
    [sys.executable, __file__, "--probe"],
    cwd=root,
    env={"PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu", "PATH": ""},
    capture_output=True,
    text=True,
    check=True,
  )
  out = json.loads(done.stdout)
  # The checkout's own package, not an installed one.
  assert pathlib.Path(out.pop("module")).is_relative_to(root), out
  return out


def main(rev: str) -> int:
  with tempfile.TemporaryDirectory() as tmp:
    old = pathlib.Path(tmp) / "old"
    subprocess.run(
      ["git", "worktree", "add", "-q", "--detach", str(old), rev],
      cwd=REPO,
      check=True,
    )
    try:
      before = _run_at(old)
    finally:
      subprocess.run(
        ["git", "worktree", "remove", "--force", str(old)], cwd=REPO
      )
  after = _run_at(REPO)
  differ = 0
  for key in before:
    a, b = before[key], after.get(key)
    if a == b:
      print(f"SAME  {key}")
      continue
    differ += 1
    what = [f"{f} {a[f]} -> {b[f]}" for f in a if f != "ops" and a[f] != b[f]]
    ops = set(a["ops"]) | set(b["ops"])
    what += [
      f"{op} {a['ops'].get(op, 0)} -> {b['ops'].get(op, 0)}"
      for op in sorted(ops)
      if a["ops"].get(op) != b["ops"].get(op)
    ]
    print(f"DIFF  {key}: " + "; ".join(what))
  return 1 if differ else 0


if __name__ == "__main__":
  if sys.argv[1:] == ["--probe"]:
    print(json.dumps(probe()))
  else:
    sys.exit(main(*sys.argv[1:]))
