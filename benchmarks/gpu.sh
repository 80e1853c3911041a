#!/usr/bin/env bash
# The whole loop timed on a GPU, in one command (bench_loop.py --preset gpu).
#
#   benchmarks/gpu.sh OUTDIR [--smoke] [bench_loop.py options]
#
# Runs on the machine's own Python as found (python3, or $PYTHON) with the
# package taken from this checkout (PYTHONPATH); builds no venv and needs no
# network (flax and equinox are optional: their loops are skipped, with the
# reason, where they are missing). Writes OUTDIR/loop.json (rewritten after
# every configuration, so a run cut short keeps what it measured) and
# OUTDIR/gpu.log (this console output). The Python side stops starting
# configurations after --budget-s (default 360 s); GPU_SH_TIMEOUT (default
# 420 s, 7 minutes) is the hard stop. To publish a run: copy OUTDIR to
# benchmarks/results/gpu/DATE-NAME/ and run benchmarks/render.py.
#
# On CPU, tiny: JAX_PLATFORMS=cpu benchmarks/gpu.sh OUT --smoke
set -uo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1
shift
preset=(--preset gpu --budget-s "${GPU_SH_BUDGET:-360}")
if [[ "${1:-}" == "--smoke" ]]; then
  preset=(--preset smoke)
  shift
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
python=${PYTHON:-python3}
mkdir -p "$out"

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}

log="$out/gpu.log"
echo "gpu.sh: $("$python" --version 2>&1) at $(command -v "$python"), checkout $root" | tee "$log"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log"
fi

timeout -k 15 "${GPU_SH_TIMEOUT:-420}" \
  "$python" "$here/bench_loop.py" "${preset[@]}" --out "$out/loop.json" "$@" \
  2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
echo "gpu.sh: exit $status; files in $out:" | tee -a "$log"
ls -l "$out" | tee -a "$log"
exit "$status"
