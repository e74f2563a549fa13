# Developer targets. `make test` is what CI runs (after scripts/setup.sh): the C core's tests
# under AddressSanitizer + UndefinedBehaviorSanitizer, then the Python suite.
PYTHON ?= $(shell [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
CC ?= cc
BLAS_INC := $(shell $(PYTHON) -c "import scipy_openblas32 as s; print(s.get_include_dir())" 2>/dev/null)
BLAS_LIB := $(shell $(PYTHON) -c "import scipy_openblas32 as s; print(s.get_lib_dir())" 2>/dev/null)
CORE_SRC := $(filter-out csrc/backend_cuda.c,$(wildcard csrc/*.c))
CORE_HDR := $(wildcard csrc/*.h)
WARN := -Wall -Wextra -Wundef -Werror -Wno-missing-field-initializers
DEFS := -DCMLP_BLAS_SCIPY=1 -DCMLP_WITH_CUDA=0 -D_GNU_SOURCE=1
SAN := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer

.PHONY: all build test test-c test-py bench clean

all: build

build:
	$(PYTHON) -m pip install --no-build-isolation -e .

C_TESTS := build/tests/test_core build/tests/test_alloc build/tests/test_half

build/tests/%: tests/c/%.c tests/c/check.h $(CORE_SRC) $(CORE_HDR)
	@test -n "$(BLAS_INC)" || { echo "scipy-openblas32 is not installed for $(PYTHON): run scripts/setup.sh"; exit 1; }
	@mkdir -p build/tests
	$(CC) -std=c11 -g -O1 $(SAN) $(WARN) $(DEFS) -fno-math-errno -Icsrc -I$(BLAS_INC) \
	    $< $(CORE_SRC) -o $@ -L$(BLAS_LIB) -lscipy_openblas -Wl,-rpath,$(BLAS_LIB) -lm -lpthread

test-c: $(C_TESTS)
	@for t in $(C_TESTS); do \
	    echo "== $$t"; \
	    ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	        OPENBLAS_NUM_THREADS=1 ./$$t || exit 1; \
	done

test-py:
	$(PYTHON) -m pytest tests -q

test: test-c test-py

bench:
	$(PYTHON) bench/bench_cpu.py

clean:
	rm -rf build python/cmlp/*.so
