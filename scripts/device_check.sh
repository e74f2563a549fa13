#!/usr/bin/env bash
# The device check: on a GPU machine with python3, numpy, pytest and torch (and no network), builds
# cmlp in place with the CUDA backend, makes a first synchronised pass over the main GPU paths
# (scripts/gpu_smoke.py), the GPU benchmark (bench/bench_gpu.py), the GPU tests
# (tests/test_cuda.py), every kind of kernel under compute-sanitizer's memcheck and racecheck
# (scripts/gpu_sanitize.py), a profile of the kernels of a batch-32 step (bench/profile_gpu.py) and,
# in the time left, synccheck, and
# ends with a summary: build seconds, test counts, the benchmark's table and targets, each side's
# kernel time per step. Each phase runs under `timeout`, within its own limit and what is left of
# DEADLINE (seconds from the start, 540 by default, so that the summary is printed within a
# 10-minute call); a phase that fails or times out is reported and the later phases still run.
#
#   bash scripts/fetch_device_wheels.sh      # with network, once: the BLAS wheel into .whl/ (git-ignored)
#   bash scripts/device_check.sh             # on the GPU machine, from the repository root, with .whl/
#                                            # (the device tool: run(..., carry=[".whl"]))
#
# Without a GPU, the same script runs over the emulated CUDA backend (tests/test_cuda_emulated.py),
# which checks the script itself (about 3 minutes on 2 cores):
#   make emu-cuda && CMLP_CUDA_LIBRARY=$PWD/build/emu/_cmlp_cuda_emu.so BENCH_FLAGS=--smoke \
#       SMOKE_LIMIT=600 TEST_LIMIT=900 DEADLINE=3000 bash scripts/device_check.sh
#
# Wheels in .whl/ (scipy-openblas32, which the build links, and setuptools if the machine lacks
# it) are installed offline into /tmp/site. Everything is also written to $OUT/device_check.log
# when $OUT is set. Limits (seconds) can be changed with BUILD_LIMIT, SMOKE_LIMIT, TEST_LIMIT,
# BENCH_LIMIT, SANITIZE_LIMIT, PROFILE_LIMIT; PYTEST_FLAGS (default: every test, one line each,
# stopping after 30 failures, so that one run shows as much as it can; each test at most 120 s
# where pytest-timeout is installed) and BENCH_FLAGS (e.g. --quick) are passed on. Exit status: 0
# when every phase passed (benchmark targets missed do not count), else 1.
set -euo pipefail
cd "$(dirname "$0")/.."

DEADLINE=${DEADLINE:-540}
BUILD_LIMIT=${BUILD_LIMIT:-150} # the kernels compiled in parallel: about 60 s on 2 cores
SMOKE_LIMIT=${SMOKE_LIMIT:-60}  # about 25 s on 2 cores with the CPU standing in
BENCH_LIMIT=${BENCH_LIMIT:-150}
TEST_LIMIT=${TEST_LIMIT:-200}
PROFILE_LIMIT=${PROFILE_LIMIT:-90}
SANITIZE_LIMIT=${SANITIZE_LIMIT:-60} # each of memcheck, racecheck and synccheck
SANITIZER=$(command -v compute-sanitizer || true)
[ -n "$SANITIZER" ] || [ ! -x /usr/local/cuda/bin/compute-sanitizer ] || SANITIZER=/usr/local/cuda/bin/compute-sanitizer
SMALL_LIMIT=30 # wheels, probe
PYTEST_FLAGS=${PYTEST_FLAGS:--v --maxfail=30 --durations=8}
BENCH_FLAGS=${BENCH_FLAGS:-}
export PY=${PYTHON:-python3}
TMP=$(mktemp -d /tmp/device_check.XXXXXX)

declare -A STATUS SECONDS_TAKEN
PHASES=()

# run_phase NAME LIMIT COMMAND...: runs it under timeout (a shell function through bash -c,
# exported), within what is left of DEADLINE, and records its status and duration.
run_phase() {
    local name=$1 limit=$2 rc=0 start=$SECONDS left
    shift 2
    PHASES+=("$name")
    left=$((DEADLINE - SECONDS - 15))
    if [ "$left" -lt 10 ]; then
        STATUS[$name]="SKIPPED (the deadline of ${DEADLINE}s is reached)"
        SECONDS_TAKEN[$name]=0
        echo "=== $name: ${STATUS[$name]}"
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" || rc=$?
    SECONDS_TAKEN[$name]=$((SECONDS - start))
    case $rc in
        0) STATUS[$name]=ok ;;
        124 | 137) STATUS[$name]="TIMEOUT after ${limit}s" ;;
        *) STATUS[$name]="FAILED (exit $rc)" ;;
    esac
    echo "=== $name: ${STATUS[$name]} in ${SECONDS_TAKEN[$name]}s"
}

# shellcheck disable=SC2317 # run through bash -c by run_phase
install_wheels() {
    shopt -s nullglob
    local wheels=() w
    for w in .whl/*.whl; do
        case $(basename "$w") in
            setuptools-*) "$PY" -c "import setuptools" 2>/dev/null || wheels+=("$w") ;;
            *) wheels+=("$w") ;;
        esac
    done
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "no wheels to install from .whl/ (run scripts/fetch_device_wheels.sh where there is network and copy .whl/ here)"
        "$PY" -c "import scipy_openblas32" 2>/dev/null || pkg-config --exists openblas 2>/dev/null || {
            echo "and no BLAS for the build: neither scipy-openblas32 nor pkg-config openblas"
            return 1
        }
        return 0
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${wheels[@]}" || return 1
    ls /tmp/site
}
export -f install_wheels

# shellcheck disable=SC2317 # run through bash -c by run_phase
probe() {
    "$PY" - <<'EOF'
import cmlp
info = cmlp.build_info()
print("cmlp", info["version"], "CUDA", info["cuda"], "BLAS", info["blas"])
print("cuda.is_available():", cmlp.cuda.is_available(), "device_count():", cmlp.cuda.device_count())
if not cmlp.cuda.is_available():
    try:
        cmlp.MLP([2, 2], device="cuda")
    except RuntimeError as e:
        print("why:", e)
    raise SystemExit("cmlp sees no GPU: the GPU tests would all be skipped")
# a NaN inside the network (inf - inf after an overflow) meets cuBLASLt's fused ReLU: kept, as
# torch's ReLU and the CPU's keep it, or taken to 0
import numpy as np
m = cmlp.MLP([2, 2, 2, 2], device="cuda", normalize=(0.0, 1.0))
m.load_state_dict({"fc1.weight": np.full((2, 2), 1e30, np.float32) * [[1, 0], [1, 0]],
                   "fc2.weight": np.array([[1, -1], [0, 0]], np.float32), "fc3.weight": np.eye(2, dtype=np.float32),
                   **{f"fc{i}.bias": np.zeros(2, np.float32) for i in (1, 2, 3)}})
print("fused ReLU keeps a NaN:", bool(np.isnan(m.forward(np.array([[1e10, 0]], np.float32))).any()))
EOF
}
export -f probe

# A digest of the sources, which names the code checked where the checkout travels without .git.
source_digest() {
    find csrc kernels python tests bench scripts setup.py -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' \
        -o -name '*.cuh' -o -name '*.cpp' -o -name '*.py' -o -name '*.sh' \) -print0 2>/dev/null | sort -z \
        | xargs -0 sha1sum | sha1sum | cut -c1-12
}

main() {
    echo "device check of cmlp $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)') (sources $(source_digest)), $(date -u '+%Y-%m-%d %H:%M UTC')"
    timeout 20 nvidia-smi --query-gpu=index,name,driver_version,compute_cap,memory.total --format=csv,noheader \
        || echo "nvidia-smi: not available"
    if ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDA_HOME:-}" ]; then
        # a toolkit in /usr/local, else one of pip's wheels (nvidia/cuNN/bin/nvcc beside the Python)
        for d in /usr/local/cuda /usr/local/cuda-* $("$PY" -c 'import glob, os, sys
print(" ".join(os.path.dirname(os.path.dirname(f)) for p in sys.path for f in glob.glob(p + "/nvidia/*/bin/nvcc")))' \
            2>/dev/null); do
            if [ -x "$d/bin/nvcc" ]; then
                export CUDA_HOME=$d
                break
            fi
        done
    fi
    local nvcc=${CUDA_HOME:+$CUDA_HOME/bin/}nvcc
    "$nvcc" --version | tail -n 2 || echo "nvcc: not found (set CUDA_HOME)"
    "$PY" --version
    timeout 30 "$PY" -c "from importlib.metadata import version as v; print('numpy', v('numpy'), 'torch', v('torch'))" \
        || true

    export PYTHONPATH="$PWD/python:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1
    # settings that would change what is measured, on either side
    unset CMLP_ALLOW_TF32 CMLP_CUDA_SYNC CMLP_CUDA_STREAMS CMLP_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF \
        TORCH_ALLOW_TF32_CUBLAS_OVERRIDE NVIDIA_TF32_OVERRIDE CUDA_LAUNCH_BLOCKING CUBLAS_WORKSPACE_CONFIG \
        CUBLASLT_WORKSPACE_SIZE CMLP_NO_MEMORY_CACHING PYTORCH_NO_CUDA_MEMORY_CACHING CMLP_TEST_CUDA_DEVICE
    env | grep -E '^(CUDA|NVIDIA|TORCH|PYTORCH|CMLP|CUBLAS|NCCL|PYTEST)' || true
    [ -z "${CMLP_CUDA_LIBRARY:-}" ] || echo "CUDA backend: $CMLP_CUDA_LIBRARY (CMLP_CUDA_LIBRARY)"

    run_phase wheels "$SMALL_LIMIT" bash -c install_wheels
    run_phase build "$BUILD_LIMIT" env CMLP_CUDA=1 CMLP_CUDA_ARCH=90 CMLP_MPI=0 "$PY" setup.py build_ext --inplace
    # what the backend links and finds (a toolkit newer than the driver, or a cuBLASLt not found,
    # shows here rather than as every later phase failing)
    if [ -f python/cmlp/_cmlp_cuda.so ]; then
        ldd python/cmlp/_cmlp_cuda.so 2>&1 | grep -E 'cublas|not found' || true
    else
        ls "${CUDA_HOME:-/usr/local/cuda}"/lib64/libcublasLt* "${CUDA_HOME:-/usr/local/cuda}"/lib/libcublasLt* 2>&1 \
            | head -n 4 || true
    fi
    run_phase probe "$SMALL_LIMIT" bash -c "set -o pipefail; probe | tee '$TMP/probe.log'"
    # every operation synchronised, one line per path: where a crash stops it is where to look
    run_phase smoke "$SMOKE_LIMIT" env CMLP_CUDA_SYNC=1 "$PY" -X faulthandler scripts/gpu_smoke.py
    # shellcheck disable=SC2086 # BENCH_FLAGS and PYTEST_FLAGS are word lists
    run_phase bench "$BENCH_LIMIT" bash -c "set -o pipefail; '$PY' bench/bench_gpu.py $BENCH_FLAGS 2>&1 \
        | tee '$TMP/bench.log'"
    local per_test=""
    # pytest-timeout is loaded through its entry point ("timeout"): `-p pytest_timeout` would register it
    # a second time and stop pytest before any test ("Plugin already registered under a different name")
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then
        per_test="--timeout=120"
        [ -z "${PYTEST_DISABLE_PLUGIN_AUTOLOAD:-}" ] || per_test="-p pytest_timeout $per_test"
    fi
    # shellcheck disable=SC2086
    run_phase tests "$TEST_LIMIT" bash -c "set -o pipefail; '$PY' -m pytest -rfEs $per_test $PYTEST_FLAGS \
        tests/test_cuda.py 2>&1 | tee '$TMP/pytest.log'"
    # every kind of kernel once, under compute-sanitizer's memcheck (out-of-bounds and misaligned
    # accesses) and racecheck (shared-memory hazards); over the emulated backend, which no sanitizer
    # watches, the script alone. memcheck runs with cmlp's caching off (CMLP_NO_MEMORY_CACHING=1):
    # each buffer is then a cudaMalloc of exactly its bytes, so that an access past a buffer's end
    # is out of bounds, not in the next block of a cached segment
    if [ -n "${CMLP_CUDA_LIBRARY:-}" ]; then
        run_phase sanitize "$SANITIZE_LIMIT" "$PY" scripts/gpu_sanitize.py
    elif [ -n "$SANITIZER" ]; then
        local tool uncached
        for tool in memcheck racecheck; do
            uncached=0
            [ "$tool" != memcheck ] || uncached=1
            run_phase "$tool" "$SANITIZE_LIMIT" env CMLP_NO_MEMORY_CACHING=$uncached "$SANITIZER" --tool "$tool" \
                --error-exitcode 86 --print-limit 20 "$PY" scripts/gpu_sanitize.py
        done
    else
        echo "=== memcheck, racecheck: no compute-sanitizer on PATH or in /usr/local/cuda/bin: not run"
    fi
    # every kernel of a batch-32 step, cmlp's and PyTorch's, from the CUDA profiler
    run_phase profile "$PROFILE_LIMIT" bash -c "set -o pipefail; '$PY' bench/profile_gpu.py \
        | tee '$TMP/profile.log'"
    # synccheck (a barrier or warp shuffle that not every thread it waits for reaches), last, in the
    # time left (a minute at least: not a phase, and no failure, where there is less)
    if [ -z "${CMLP_CUDA_LIBRARY:-}" ] && [ -n "$SANITIZER" ]; then
        if [ $((DEADLINE - SECONDS)) -ge 75 ]; then
            run_phase synccheck "$SANITIZE_LIMIT" "$SANITIZER" --tool synccheck --error-exitcode 86 \
                --print-limit 20 "$PY" scripts/gpu_sanitize.py
        else
            echo "=== synccheck: not run (under 75 s of the ${DEADLINE}s deadline left)"
        fi
    fi

    local counts=""
    if [ -f "$TMP/pytest.log" ]; then
        counts=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|errors|deselected)' "$TMP/pytest.log" \
            | tail -n 1 | sed -E 's/^=+ //; s/ =+$//') || true
        if [ -z "$counts" ]; then # cut short: the verbose lines' verdicts so far
            counts="so far $(grep -cE ' PASSED' "$TMP/pytest.log") passed, $(grep -cE ' (FAILED|ERROR)' \
                "$TMP/pytest.log") failed"
        fi
    fi
    echo
    echo "================ device check summary ================"
    echo "| phase | result | seconds |"
    echo "|---|---|---:|"
    local p result failed=0
    for p in "${PHASES[@]}"; do
        result=${STATUS[$p]}
        [ "$p" = tests ] && [ -n "$counts" ] && result="$result: $counts"
        echo "| $p | $result | ${SECONDS_TAKEN[$p]} |"
        [ "${STATUS[$p]}" = ok ] || failed=1
    done
    [ -f "$TMP/probe.log" ] && grep -E '^fused ReLU' "$TMP/probe.log" || true
    if [ -f "$TMP/bench.log" ]; then
        echo
        grep -E '^\||^targets|: .*\((met|MISSED)\)$|^FAILED|^cmlp |^torch |^cuBLASLt |^bench_gpu' "$TMP/bench.log" \
            || true
        # cut short before its tables: the configurations measured so far (its progress lines)
        grep -q '^| batch' "$TMP/bench.log" \
            || grep -E '^batch [0-9]+ fp(32|16): |^cuBLAS alone' "$TMP/bench.log" || true
    fi
    if [ -f "$TMP/profile.log" ]; then
        echo
        grep -E 'per step; wall|^profile_gpu: nothing|^profile_gpu: no kernels' "$TMP/profile.log" || true
    fi
    echo "total: ${SECONDS}s"
    return $failed
}

LOG=/dev/null
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    LOG="$OUT/device_check.log"
fi
rc=0
main "$@" 2>&1 | tee "$LOG" || rc=$?
rm -rf "$TMP"
exit $rc
