#!/usr/bin/env bash
# Builds and runs bench/bench_alloc.c (the caching allocator benchmark) against the C core,
# linking the scipy-openblas32 that the Makefile's test build uses. Run from the repo root:
#     bash bench/run_alloc.sh            (PYTHON=... to pick the interpreter that has it)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
read -r BLAS_INC BLAS_LIB < <("$PYTHON" -c "import scipy_openblas32 as s; print(s.get_include_dir(), s.get_lib_dir())") ||
    { echo "scipy-openblas32 is not installed for $PYTHON: run scripts/setup.sh" >&2; exit 1; }
mkdir -p build/bench
${CC:-cc} -O2 -std=c11 -D_GNU_SOURCE=1 -DCMLP_WITH_CUDA=0 -DCMLP_BLAS_SCIPY=1 -Icsrc -I"$BLAS_INC" \
    bench/bench_alloc.c $(ls csrc/*.c | grep -v -e backend_cuda -e comm_mpi) -L"$BLAS_LIB" -lscipy_openblas -Wl,-rpath,"$BLAS_LIB" -lm -lpthread \
    -o build/bench/bench_alloc
# OpenBLAS's idle worker threads spin on a small machine and steal time from the timed loops
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
exec ./build/bench/bench_alloc "$@"
