# Developer targets. `make test` is what CI runs (after scripts/setup.sh): the C core's tests
# under AddressSanitizer + UndefinedBehaviorSanitizer, then the Python suite.
PYTHON ?= $(shell [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
CC ?= cc
BLAS_INC := $(shell $(PYTHON) -c "import scipy_openblas32 as s; print(s.get_include_dir())" 2>/dev/null)
BLAS_LIB := $(shell $(PYTHON) -c "import scipy_openblas32 as s; print(s.get_lib_dir())" 2>/dev/null)
CUDA_BACKEND_SRC := $(wildcard csrc/backend_cuda*.c)
CORE_SRC := $(filter-out $(CUDA_BACKEND_SRC) csrc/comm_mpi.c,$(wildcard csrc/*.c))
CORE_HDR := $(wildcard csrc/*.h)
WARN := -Wall -Wextra -Wundef -Werror -Wno-missing-field-initializers
DEFS := -DCMLP_BLAS_SCIPY=1 -DCMLP_WITH_CUDA=0 -D_GNU_SOURCE=1
SAN := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer

.PHONY: all build test test-c test-py bench clean emu-cuda asan-emu
.PRECIOUS: build/emu/%.cpp

all: build

build:
	$(PYTHON) -m pip install --no-build-isolation -e .

C_TESTS := build/tests/test_core build/tests/test_alloc build/tests/test_half

# The CUDA kernels run on the CPU under tests/emu (needs the toolkit's headers, not a GPU).
NVCC := $(shell command -v nvcc 2>/dev/null)
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(realpath $(NVCC))),/usr/local/cuda)
CUDA_INC := $(CUDA_HOME)/include
ifneq ($(wildcard $(CUDA_INC)/cuda_runtime.h),)
C_TESTS += build/tests/test_kernels
endif
EMU_OBJ := $(patsubst kernels/%.cu,build/emu/%.o,$(wildcard kernels/*.cu)) build/emu/cuda_emu.o
EMU_CXX := $(CXX) -std=c++17 -g -O1 $(SAN) $(WARN) -Wno-unknown-pragmas -DCMLP_EMU -isystem $(CUDA_INC)

build/emu/common.cuh: kernels/common.cuh tests/emu/translate.py
	@mkdir -p build/emu
	$(PYTHON) tests/emu/translate.py $< $@

build/emu/%.cpp: kernels/%.cu kernels/common.cuh tests/emu/translate.py
	@mkdir -p build/emu
	$(PYTHON) tests/emu/translate.py kernels/common.cuh $< $@

build/emu/%.o: build/emu/%.cpp build/emu/common.cuh kernels/kernels.h tests/emu/cuda_emu.h
	$(EMU_CXX) -include tests/emu/cuda_emu.h -Ikernels -c $< -o $@

build/emu/cuda_emu.o: tests/emu/cuda_emu.cpp tests/emu/cuda_emu.h
	@mkdir -p build/emu
	$(EMU_CXX) -c $< -o $@

build/tests/test_kernels: tests/c/test_kernels.c tests/c/check.h $(CORE_SRC) $(CORE_HDR) $(EMU_OBJ)
	@mkdir -p build/tests
	$(CC) -std=c11 -g -O1 $(SAN) $(WARN) $(DEFS) -fno-math-errno -ffp-contract=off -Icsrc -Ikernels -isystem $(CUDA_INC) \
	    -I$(BLAS_INC) $< $(CORE_SRC) $(EMU_OBJ) -o $@ -L$(BLAS_LIB) -lscipy_openblas -Wl,-rpath,$(BLAS_LIB) \
	    -lstdc++ -lm -lpthread

# The whole CUDA backend (csrc/backend_cuda.c, the kernels) over an emulated CUDA runtime and
# cuBLASLt (tests/emu/cuda_runtime_emu.cpp): cmlp loads it through CMLP_CUDA_LIBRARY, and the GPU
# tests run against it on the CPU (tests/test_cuda_emulated.py). EMU_DIR, EMU_SO and EMU_OPT make
# the sanitized variant (asan-emu).
EMU_DIR ?= build/emu/so
EMU_SO ?= build/emu/_cmlp_cuda_emu.so
EMU_OPT ?= -O2
EMU_SO_OBJ := $(patsubst kernels/%.cu,$(EMU_DIR)/%.o,$(wildcard kernels/*.cu)) \
    $(EMU_DIR)/cuda_emu.o $(EMU_DIR)/cuda_runtime_emu.o $(patsubst csrc/%.c,$(EMU_DIR)/%.o,$(CUDA_BACKEND_SRC))
EMU_SO_CXX := $(CXX) -std=c++17 -g $(EMU_OPT) -fPIC -fvisibility=hidden $(WARN) -Wno-unknown-pragmas -DCMLP_EMU \
    -isystem $(CUDA_INC)
# with Open MPI, the emulated runtime is NCCL too (over MPI), for data-parallel tests on it
MPICC := $(shell command -v mpicc 2>/dev/null)
ifneq ($(MPICC),)
EMU_MPI_FLAGS := -DCMLP_EMU_MPI -DOMPI_SKIP_MPICXX=1 -DMPICH_SKIP_MPICXX=1 $(shell $(MPICC) --showme:compile 2>/dev/null)
EMU_MPI_LIBS := $(shell $(MPICC) --showme:link 2>/dev/null)
endif

$(EMU_DIR)/%.o: build/emu/%.cpp build/emu/common.cuh kernels/kernels.h tests/emu/cuda_emu.h
	@mkdir -p $(EMU_DIR)
	$(EMU_SO_CXX) -include tests/emu/cuda_emu.h -Ikernels -c $< -o $@

$(EMU_DIR)/cuda_emu.o: $(EMU_DIR)/%.o: tests/emu/%.cpp tests/emu/cuda_emu.h
	@mkdir -p $(EMU_DIR)
	$(EMU_SO_CXX) -c $< -o $@

$(EMU_DIR)/cuda_runtime_emu.o: tests/emu/cuda_runtime_emu.cpp tests/emu/cuda_emu.h
	@mkdir -p $(EMU_DIR)
	$(EMU_SO_CXX) $(EMU_MPI_FLAGS) -c $< -o $@

$(patsubst csrc/%.c,$(EMU_DIR)/%.o,$(CUDA_BACKEND_SRC)): $(EMU_DIR)/%.o: csrc/%.c csrc/backend_cuda.h csrc/backend.h \
    csrc/cuda_workspace.h csrc/cmlp.h kernels/kernels.h
	@mkdir -p $(EMU_DIR)
	$(CC) -std=c11 -g $(EMU_OPT) -fPIC -fvisibility=hidden $(WARN) -D_GNU_SOURCE=1 -Icsrc -Ikernels \
	    -isystem $(CUDA_INC) -c $< -o $@

$(EMU_SO): $(EMU_SO_OBJ)
	@test -n "$(BLAS_LIB)" || { echo "scipy-openblas32 is not installed for $(PYTHON): run scripts/setup.sh"; exit 1; }
	$(CXX) -shared $(EMU_OPT) -o $@ $(EMU_SO_OBJ) -L$(BLAS_LIB) -lscipy_openblas -Wl,-rpath,$(BLAS_LIB) -lpthread \
	    $(EMU_MPI_LIBS)

emu-cuda: $(EMU_SO)

# The emulated backend and cmlp's extension (into build/asan/lib, beside a copy of the package)
# under AddressSanitizer and UndefinedBehaviorSanitizer, for a run of the GPU tests with the
# sanitizers' runtimes preloaded into Python (tests/test_cuda_emulated.py).
ASAN_LIB := build/asan/lib
asan-emu:
	$(MAKE) emu-cuda EMU_DIR=build/asan/emu EMU_SO=build/asan/_cmlp_cuda_emu.so EMU_OPT="-O1 $(SAN)"
	@rm -rf $(ASAN_LIB)/cmlp && mkdir -p $(ASAN_LIB)
	cp -r python/cmlp $(ASAN_LIB)/cmlp
	rm -f $(ASAN_LIB)/cmlp/*.so
	CMLP_CUDA=1 CMLP_CUDA_ARCH=90 CFLAGS="$(SAN)" LDFLAGS="$(SAN)" $(PYTHON) setup.py -q build_ext \
	    --build-lib $(ASAN_LIB) --build-temp build/asan/tmp

$(filter-out build/tests/test_kernels,$(C_TESTS)): build/tests/%: tests/c/%.c tests/c/check.h $(CORE_SRC) $(CORE_HDR)
	@test -n "$(BLAS_INC)" || { echo "scipy-openblas32 is not installed for $(PYTHON): run scripts/setup.sh"; exit 1; }
	@mkdir -p build/tests
	$(CC) -std=c11 -g -O1 $(SAN) $(WARN) $(DEFS) -fno-math-errno -ffp-contract=off -Icsrc -I$(BLAS_INC) \
	    $< $(CORE_SRC) -o $@ -L$(BLAS_LIB) -lscipy_openblas -Wl,-rpath,$(BLAS_LIB) -lm -lpthread

# test_kernels runs twice: blocks in order, then the last block first and a block's threads last
# first between barriers (a result that depends on either order is a race on a GPU)
test-c: $(C_TESTS)
	@for t in $(C_TESTS); do \
	    echo "== $$t"; \
	    ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	        OPENBLAS_NUM_THREADS=1 ./$$t || exit 1; \
	    if [ $$t = build/tests/test_kernels ]; then \
	        echo "== $$t (blocks in reverse)"; \
	        CMLP_EMU_BLOCK_ORDER=reverse ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 \
	            UBSAN_OPTIONS=print_stacktrace=1 OPENBLAS_NUM_THREADS=1 ./$$t || exit 1; \
	    fi; \
	done

test-py:
	$(PYTHON) -m pytest tests -q

test: test-c test-py

bench:
	$(PYTHON) bench/bench_cpu.py

clean:
	rm -rf build python/cmlp/*.so
