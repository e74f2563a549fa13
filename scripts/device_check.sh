#!/usr/bin/env bash
# The device check: on a GPU machine with python3, numpy, pytest and torch (and no network), builds
# cmlp in place with the CUDA backend, makes a first synchronised pass over the main GPU paths
# (scripts/gpu_smoke.py), runs the GPU tests (tests/test_cuda.py, plus the allocator's
# tests/test_allocator.py), the GPU benchmark (bench/bench_gpu.py) and a profile of the kernels
# of a batch-32 step (bench/profile_gpu.py), and ends with a summary: build seconds, test counts,
# the benchmark's table and targets, each side's kernel time per step. Under 8 minutes: each phase runs
# under `timeout`; a phase that fails or times out is reported and the later phases still run.
#
#   bash scripts/fetch_device_wheels.sh      # with network, once: the BLAS wheel into .whl/ (git-ignored)
#   bash scripts/device_check.sh             # on the GPU machine, from the repository root, with .whl/
#
# Without a GPU, the same script runs over the emulated CUDA backend (tests/test_cuda_emulated.py),
# which checks the script itself (about 3 minutes on 2 cores):
#   make emu-cuda && CMLP_CUDA_LIBRARY=$PWD/build/emu/_cmlp_cuda_emu.so BENCH_FLAGS=--smoke \
#       SMOKE_LIMIT=600 TEST_LIMIT=900 bash scripts/device_check.sh
#
# Wheels in .whl/ (scipy-openblas32, which the build links, and setuptools if the machine lacks
# it) are installed offline into /tmp/site. Everything is also written to $OUT/device_check.log
# when $OUT is set. Limits (seconds) can be changed with BUILD_LIMIT, SMOKE_LIMIT, TEST_LIMIT,
# BENCH_LIMIT, PROFILE_LIMIT; PYTEST_FLAGS (default: every test, one line each, stopping after 30
# failures, so that one run shows as much as it can) and BENCH_FLAGS (e.g. --quick) are passed on. Exit status: 0 when
# every phase passed (benchmark targets missed do not count), else 1.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_LIMIT=${BUILD_LIMIT:-100} # measured: about 15 s on 2 cores
SMOKE_LIMIT=${SMOKE_LIMIT:-60}  # about 25 s on 2 cores with the CPU standing in
TEST_LIMIT=${TEST_LIMIT:-150}
BENCH_LIMIT=${BENCH_LIMIT:-150}
PROFILE_LIMIT=${PROFILE_LIMIT:-45}
SMALL_LIMIT=30 # wheels, probe
PYTEST_FLAGS=${PYTEST_FLAGS:--v --maxfail=30 --durations=8}
BENCH_FLAGS=${BENCH_FLAGS:-}
export PY=${PYTHON:-python3}
TMP=$(mktemp -d /tmp/device_check.XXXXXX)

declare -A STATUS SECONDS_TAKEN
PHASES=()

# run_phase NAME LIMIT COMMAND...: runs it under timeout (a shell function through bash -c,
# exported), records its status and duration.
run_phase() {
    local name=$1 limit=$2 rc=0 start=$SECONDS
    shift 2
    PHASES+=("$name")
    echo
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" || rc=$?
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
        "${wheels[@]}"
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

main() {
    echo "device check of cmlp $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)'), $(date -u '+%Y-%m-%d %H:%M UTC')"
    nvidia-smi -L || echo "nvidia-smi: not available"
    if ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDA_HOME:-}" ]; then
        for d in /usr/local/cuda /usr/local/cuda-*; do
            if [ -x "$d/bin/nvcc" ]; then
                export CUDA_HOME=$d
                break
            fi
        done
    fi
    local nvcc=${CUDA_HOME:+$CUDA_HOME/bin/}nvcc
    "$nvcc" --version | tail -n 2 || echo "nvcc: not found (set CUDA_HOME)"
    "$PY" --version
    "$PY" -c "import numpy, torch; print('numpy', numpy.__version__, 'torch', torch.__version__)" || true

    export PYTHONPATH="$PWD/python:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1
    unset CMLP_ALLOW_TF32 CMLP_CUDA_SYNC CMLP_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF
    [ -z "${CMLP_CUDA_LIBRARY:-}" ] || echo "CUDA backend: $CMLP_CUDA_LIBRARY (CMLP_CUDA_LIBRARY)"

    run_phase wheels "$SMALL_LIMIT" bash -c install_wheels
    run_phase build "$BUILD_LIMIT" env CMLP_CUDA=1 CMLP_CUDA_ARCH=90 "$PY" setup.py build_ext --inplace
    run_phase probe "$SMALL_LIMIT" bash -c "set -o pipefail; probe | tee '$TMP/probe.log'"
    # every operation synchronised, one line per path: where a crash stops it is where to look
    run_phase smoke "$SMOKE_LIMIT" env CMLP_CUDA_SYNC=1 "$PY" -X faulthandler scripts/gpu_smoke.py
    # shellcheck disable=SC2086 # PYTEST_FLAGS and BENCH_FLAGS are word lists
    run_phase tests "$TEST_LIMIT" bash -c "set -o pipefail; '$PY' -m pytest -rfEs $PYTEST_FLAGS \
        tests/test_cuda.py tests/test_allocator.py 2>&1 | tee '$TMP/pytest.log'"
    # shellcheck disable=SC2086
    run_phase bench "$BENCH_LIMIT" bash -c "set -o pipefail; '$PY' bench/bench_gpu.py $BENCH_FLAGS \
        | tee '$TMP/bench.log'"
    # every kernel of a batch-32 step, cmlp's and PyTorch's, from the CUDA profiler
    run_phase profile "$PROFILE_LIMIT" bash -c "set -o pipefail; '$PY' bench/profile_gpu.py \
        | tee '$TMP/profile.log'"

    local counts=""
    if [ -f "$TMP/pytest.log" ]; then
        counts=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|errors|deselected)' "$TMP/pytest.log" \
            | tail -n 1 | sed -E 's/^=+ //; s/ =+$//') || true
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
        grep -E '^\||^targets|: .*\((met|MISSED)\)$|^FAILED|^cmlp |^torch |^bench_gpu' "$TMP/bench.log" || true
    fi
    if [ -f "$TMP/profile.log" ]; then
        echo
        grep -E 'per step; wall|^profile_gpu: nothing' "$TMP/profile.log" || true
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
