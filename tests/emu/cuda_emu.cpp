/* cuda_emu.cpp - the scheduler behind cuda_emu.h: blocks one after another, a block's threads
 * as ucontext fibers switched only where a GPU thread could wait (barriers and shuffles).
 */
#include "cuda_emu.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

static cudaError_t last_error = cudaSuccess;

extern "C" cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) { return last_error; }

namespace cmlp_emu {
namespace {

enum state { READY, AT_BLOCK_BARRIER, AT_WARP_EXCHANGE, DONE };

constexpr size_t STACK_BYTES = 256 << 10;

struct fiber {
    ucontext_t ctx;
    void *stack = nullptr;
    state st = DONE;
    uint3 tid{};
    unsigned mask = 0; /* of the exchange it waits at */
    uint64_t bits = 0; /* what it publishes there */
    void *fake_stack = nullptr;
};

struct block_run {
    std::vector<fiber> fibers; /* reused: stacks persist across blocks and launches */
    ucontext_t sched;
    const void *sched_bottom = nullptr;
    size_t sched_size = 0;
    void *sched_fake = nullptr;
    int current = -1;
    unsigned nthreads = 0;
    const std::function<void()> *body = nullptr;
    std::vector<uint64_t> published; /* per thread: the bits released at the last exchange */
};

block_run R;

[[noreturn]] void fail(const char *what) {
    std::fprintf(stderr, "cuda_emu: %s (block %u,%u,%u thread %u,%u,%u)\n", what, blockIdx.x, blockIdx.y, blockIdx.z,
                 threadIdx.x, threadIdx.y, threadIdx.z);
    std::abort();
}

/* Fiber side: back to the scheduler (finishing == the fiber never resumes). */
void yield_to_scheduler(bool finishing) {
    fiber &f = R.fibers[R.current];
#if EMU_ASAN
    __sanitizer_start_switch_fiber(finishing ? nullptr : &f.fake_stack, R.sched_bottom, R.sched_size);
#endif
    (void)finishing;
    swapcontext(&f.ctx, &R.sched);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

void fiber_main() {
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &R.sched_bottom, &R.sched_size);
#endif
    (*R.body)();
    R.fibers[R.current].st = DONE;
    yield_to_scheduler(true);
    fail("a finished thread was resumed");
}

void resume(unsigned t) {
    fiber &f = R.fibers[t];
    R.current = (int)t;
    threadIdx = f.tid;
#if EMU_ASAN
    __sanitizer_start_switch_fiber(&R.sched_fake, f.stack, STACK_BYTES);
#endif
    swapcontext(&R.sched, &f.ctx);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(R.sched_fake, nullptr, nullptr);
#endif
    R.current = -1;
}

void start(unsigned t) {
    fiber &f = R.fibers[t];
    if (!f.stack) {
        f.stack = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (f.stack == MAP_FAILED) fail("no memory for a thread's stack");
    }
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
    f.st = READY;
}

/* Every live thread of the block waits somewhere: release the exchanges whose lanes have all
 * arrived, or else the barrier. False when everything is done. */
bool release() {
    const unsigned n = R.nthreads, nwarps = (n + 31) / 32;
    bool any = false;
    for (unsigned w = 0; w < nwarps; w++) {
        unsigned mask = 0, arrived = 0, live = 0;
        for (unsigned l = 0; l < 32 && w * 32 + l < n; l++) {
            const fiber &f = R.fibers[w * 32 + l];
            if (f.st != DONE) live |= 1u << l;
            if (f.st == AT_WARP_EXCHANGE) {
                if (mask && f.mask != mask) fail("lanes of a warp exchange with different masks");
                mask = f.mask;
                arrived |= 1u << l;
            }
        }
        if (!arrived) continue;
        if ((mask & arrived) != mask) {
            threadIdx = R.fibers[w * 32 + __builtin_ctz(arrived)].tid;
            fail(mask & ~live ? "warp shuffle whose mask names a lane that has exited or does not exist"
                              : "warp shuffle whose mask names a lane waiting elsewhere (deadlock on a GPU)");
        }
        if (arrived & ~mask) fail("a lane outside the shuffle's mask is waiting at it");
        for (unsigned l = 0; l < 32; l++)
            if (mask >> l & 1) {
                R.published[w * 32 + l] = R.fibers[w * 32 + l].bits;
                R.fibers[w * 32 + l].st = READY;
            }
        any = true;
    }
    if (any) return true;
    bool waiting = false;
    for (unsigned t = 0; t < n; t++) waiting |= R.fibers[t].st == AT_BLOCK_BARRIER;
    if (!waiting) return false;
    for (unsigned t = 0; t < n; t++)
        if (R.fibers[t].st == AT_BLOCK_BARRIER) R.fibers[t].st = READY;
    return true;
}

void run_block(const std::function<void()> &body) {
    R.body = &body;
    for (unsigned t = 0; t < R.nthreads; t++) start(t);
    do {
        for (unsigned t = 0; t < R.nthreads; t++)
            if (R.fibers[t].st == READY) resume(t);
    } while (release());
}

} /* namespace */

void run_grid(dim3 grid, dim3 block, const std::function<void()> &body) {
    gridDim = grid;
    blockDim = block;
    R.nthreads = block.x * block.y * block.z;
    if (R.fibers.size() < R.nthreads) R.fibers.resize(R.nthreads);
    R.published.assign(R.nthreads, 0);
    for (unsigned t = 0; t < R.nthreads; t++)
        R.fibers[t].tid = make_uint3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = make_uint3(x, y, z);
                run_block(body);
            }
}

void block_barrier() {
    if (R.current < 0) fail("__syncthreads outside a kernel");
    R.fibers[R.current].st = AT_BLOCK_BARRIER;
    yield_to_scheduler(false);
}

int lane() {
    if (R.current < 0) fail("a warp operation outside a kernel");
    return R.current % 32;
}

uint64_t warp_exchange(unsigned mask, uint64_t bits, int src) {
    if (R.current < 0) fail("a warp operation outside a kernel");
    fiber &f = R.fibers[R.current];
    const unsigned warp = (unsigned)R.current / 32;
    if (!(mask >> (R.current % 32) & 1)) fail("a lane shuffles with a mask that leaves it out");
    f.st = AT_WARP_EXCHANGE;
    f.mask = mask;
    f.bits = bits;
    yield_to_scheduler(false);
    /* a source lane outside the mask gives an undefined value on a GPU */
    if (!(mask >> src & 1)) fail("a shuffle reads a lane outside its mask");
    return R.published[warp * 32 + (unsigned)src];
}

bool launch_ok(dim3 grid, dim3 block, size_t shmem, unsigned bound, const char *name) {
    const uint64_t threads = (uint64_t)block.x * block.y * block.z;
    const char *why = nullptr;
    cudaError_t e = cudaErrorInvalidConfiguration;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0)
        why = "a zero grid or block dimension";
    else if (grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u)
        why = "a grid dimension above the device's limit";
    else if (threads > 1024 || block.z > 64)
        why = "a block larger than 1024 threads";
    else if (bound && threads > bound)
        why = "a block larger than the kernel's __launch_bounds__", e = cudaErrorLaunchOutOfResources;
    else if (shmem > 48 * 1024)
        why = "more than 48 KiB of dynamic shared memory";
    if (!why) return true;
    std::fprintf(stderr, "cuda_emu: launch of %s refused: %s (grid %u,%u,%u block %u,%u,%u)\n", name, why, grid.x,
                 grid.y, grid.z, block.x, block.y, block.z);
    last_error = e;
    return false;
}

} /* namespace cmlp_emu */
