#!/usr/bin/env bash
# The checks that need an NVIDIA GPU: the lane-rANS and GPU decoder tests, and the GPU decode
# benchmark (JSON to $OUT/gpu_bench.json), run from this checkout without installing it and
# without the network. Every step runs under a timeout inside one budget, so the whole stays
# under 5 minutes; a failed step does not stop the later ones, and the exit status is 1 if
# any failed.
#   PYTHON   interpreter (default python3)
#   OUT      where gpu_bench.json goes (default .)
#   GPU_CHECK_BUDGET_S   seconds for all steps together (default 285)
set -euo pipefail

mkdir -p "${OUT:-.}"
OUT="$(cd "${OUT:-.}" && pwd)"  # before the cd: a relative OUT is the caller's
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-285}"
CALLER_PYTHONPATH="${PYTHONPATH:-}"
export PYTHONPATH="$PWD${CALLER_PYTHONPATH:+:$CALLER_PYTHONPATH}"
export PYTHONUNBUFFERED=1
failed=()

# step NAME CAP_S CMD...: run CMD for at most CAP_S seconds, and never past the budget.
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET - SECONDS))
    if ((left < cap)); then cap=$left; fi
    if ((cap <= 0)); then
        echo "!! $name: skipped, the ${BUDGET}s budget is spent"
        failed+=("$name")
        return 0
    fi
    echo "== $name (at ${SECONDS}s, limit ${cap}s)"
    local rc=0 why=""
    timeout -k 5 "$cap" "$@" || rc=$?
    if ((rc == 124 || rc == 137)); then why=", timed out"; fi
    if ((rc != 0)); then
        echo "!! $name failed (exit $rc$why)"
        failed+=("$name")
    fi
    return 0
}

# Packages this machine lacks (constriction, ...) travel as wheels in .whl/.
shopt -s nullglob
wheels=(.whl/*.whl)
shopt -u nullglob
if ((${#wheels[@]})); then
    step "install .whl/*.whl (${#wheels[@]}) into /tmp/site" 60 \
        "$PYTHON" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "${wheels[@]}"
    export PYTHONPATH="$PWD:/tmp/site${CALLER_PYTHONPATH:+:$CALLER_PYTHONPATH}"
fi

step "GPU" 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total,mig.mode.current --format=csv,noheader
step "versions" 60 "$PYTHON" - <<'EOF'
import shutil
import sys

import torch

print("python", sys.version.split()[0])
print("torch", torch.__version__, "CUDA", torch.version.cuda, "device:",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
try:
    import cupy
    print("cupy", cupy.__version__)
except ImportError as e:
    print("cupy: not installed", e)
# Without a C compiler the CPU library falls back to NumPy, ~100x slower: the reference
# decodes here would not fit the budget.
print("cc:", shutil.which("cc") or "none")
from codec import gpu
ok, why = gpu.available()
print("codec.gpu.available():", ok, why)
sys.exit(0 if ok else 1)
EOF
step "pytest tests/codec/test_rans.py tests/codec/test_gpu.py" 120 \
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/codec/test_rans.py tests/codec/test_gpu.py
# --device cuda: on a machine where the GPU path is unusable this fails at once, with the
# reason, instead of benchmarking the CPU stand-in.
step "benchmark -> $OUT/gpu_bench.json" 200 \
    "$PYTHON" -m kvstreamd.cli bench gpu --device cuda --quiet --json "$OUT/gpu_bench.json"

echo "== done in ${SECONDS}s"
if ((${#failed[@]})); then
    printf '!! failed: %s\n' "${failed[@]}"
    exit 1
fi
echo "all passed"
