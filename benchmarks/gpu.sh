#!/usr/bin/env bash
# The whole GPU measurement in one command (benchmarks/bench_gpu.py).
#
#   benchmarks/gpu.sh OUTDIR [--smoke] [bench_gpu.py options]
#
# Runs on the machine's own Python as found (python3, or $PYTHON) with the
# package taken from this checkout (PYTHONPATH); builds no venv and needs no
# network. Writes into OUTDIR: bench_gpu.json (rewritten after every
# configuration, so a run cut short leaves its results), bench_gpu.md,
# bench_gpu.png and bench_gpu.log (this console output). The Python side
# keeps to --budget-s (default 330 s); GPU_SH_TIMEOUT (default 400 s) is the
# hard stop, after which whatever JSON there is gets rendered.
#
# On CPU, tiny: JAX_PLATFORMS=cpu benchmarks/gpu.sh OUT --smoke
set -uo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
python=${PYTHON:-python3}
mkdir -p "$out"

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# XLA preallocates 75% of the GPU by default; the largest configuration
# keeps every variant's state alive at once (interleaved rounds), so give
# the allocator nearly all of it.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}

log="$out/bench_gpu.log"
echo "gpu.sh: $("$python" --version 2>&1) at $(command -v "$python"), checkout $root" | tee "$log"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log"
fi

timeout -k 15 "${GPU_SH_TIMEOUT:-400}" \
  "$python" "$here/bench_gpu.py" --out "$out" "$@" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}

if [[ -f "$out/bench_gpu.json" && ( $status -ne 0 || ! -f "$out/bench_gpu.md" ) ]]; then
  echo "gpu.sh: bench_gpu.py exited with $status; rendering what it wrote" | tee -a "$log"
  "$python" "$here/bench_gpu.py" --render "$out/bench_gpu.json" 2>&1 | tee -a "$log"
fi
rm -f "$out/bench_gpu.json.tmp"
echo "gpu.sh: exit $status; files in $out:" | tee -a "$log"
ls -l "$out" | tee -a "$log"
if [[ -f "$out/bench_gpu.md" ]]; then
  cat "$out/bench_gpu.md"
fi
exit "$status"
