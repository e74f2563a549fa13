/* cuda_emu.cpp - the scheduler behind cuda_emu.h: blocks one after another, a block's threads
 * as fibers switched only where a GPU thread could wait (barriers and shuffles). A switch is a
 * few instructions on x86-64 and swapcontext elsewhere.
 */
#include "cuda_emu.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

static thread_local cudaError_t last_error = cudaSuccess; /* per host thread, as in CUDA */

extern "C" cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) { return last_error; }

namespace cmlp_emu {
extern load_fn load_hook;
}

/* A reference to a kernel loads it, as under CUDA's lazy loading (the emulated runtime's
 * load_hook: out of memory where the device has no room); the attributes are those of a small
 * kernel on sm_90. */
extern "C" cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *attr, const void *func) {
    if (!attr || !func) return cudaErrorInvalidValue;
    if (cmlp_emu::load_hook)
        if (cudaError_t e = cmlp_emu::load_hook(func, "cudaFuncGetAttributes")) return e;
    std::memset(attr, 0, sizeof *attr);
    attr->maxThreadsPerBlock = 1024;
    attr->numRegs = 32;
    attr->ptxVersion = attr->binaryVersion = 90;
    return cudaSuccess;
}

/* The order of a grid's blocks: 0 first to last, 1 last first (a kernel whose result depends on
 * the order of its blocks, a race on a GPU, gives other bits then), and with them the order of a
 * block's threads between two barriers (a thread that reads what a higher one writes, with no
 * barrier between, reads it written then); CMLP_EMU_BLOCK_ORDER=reverse starts at 1.
 * cmlp_emu_block_order(order) sets it and returns the one before; -1 only reads it. */
static int block_order = -1;

extern "C" int cmlp_emu_block_order(int order) {
    if (block_order < 0) {
        const char *v = getenv("CMLP_EMU_BLOCK_ORDER");
        block_order = v && std::strcmp(v, "reverse") == 0;
    }
    const int before = block_order;
    if (order == 0 || order == 1) block_order = order;
    return before;
}

namespace cmlp_emu {

submit_fn submit_hook;
pointer_check_fn pointer_hook;
load_fn load_hook;
void set_last_error(cudaError_t e) { last_error = e; }

namespace {

#if defined(__x86_64__)
/* A switch pushes the callee-saved registers on the stack it leaves and pops them from the one
 * it enters: no signal mask and no system call, where swapcontext makes two. */
extern "C" void cmlp_emu_switch(void **save_sp, void *to_sp);
asm(R"(
    .text
    .p2align 4
    .type cmlp_emu_switch, @function
cmlp_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cmlp_emu_switch, .-cmlp_emu_switch
)");

struct context {
    void *sp = nullptr;
};
void ctx_switch(context &from, const context &to) { cmlp_emu_switch(&from.sp, to.sp); }
/* The first switch to c pops six zeros and returns into entry, with the stack aligned as after
 * a call. */
void ctx_make(context &c, void *stack, size_t size, void (*entry)()) {
    void **sp = (void **)((((uintptr_t)stack + size) & ~(uintptr_t)15) - 64);
    for (int i = 0; i < 6; i++) sp[i] = nullptr;
    sp[6] = (void *)entry;
    sp[7] = nullptr;
    c.sp = sp;
}
#else
struct context {
    ucontext_t uc;
};
void ctx_switch(context &from, const context &to) { swapcontext(&from.uc, &to.uc); }
void ctx_make(context &c, void *stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

enum state { READY, AT_BLOCK_BARRIER, AT_WARP_EXCHANGE, DONE };

constexpr size_t STACK_BYTES = 256 << 10;

struct fiber {
    context ctx;
    void *stack = nullptr;
    state st = DONE;
    uint3 tid{};
    unsigned mask = 0; /* of the exchange it waits at */
    uint64_t bits = 0; /* what it publishes there */
    void *fake_stack = nullptr;
};

struct block_run {
    std::vector<fiber> fibers; /* reused: stacks persist across blocks and launches */
    context sched;
    const void *sched_bottom = nullptr;
    size_t sched_size = 0;
    void *sched_fake = nullptr;
    int current = -1;
    unsigned nthreads = 0;
    const std::function<void()> *body = nullptr;
    std::vector<uint64_t> published; /* per thread: the bits released at the last exchange */
    bool direct = false;             /* threads run in turn, without fibers */
    bool waited = false;             /* a thread of this launch waited somewhere */
    const char *name = nullptr;
};

/* kernels whose first launch never waited (keyed by their name's address, a literal) */
std::unordered_map<const void *, bool> sync_free;

block_run R;

[[noreturn]] void fail(const char *what) {
    std::fprintf(stderr, "cuda_emu: %s (kernel %s, block %u,%u,%u thread %u,%u,%u)\n", what, R.name ? R.name : "?",
                 blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    std::abort();
}

/* Fiber side: back to the scheduler (finishing == the fiber never resumes). */
void yield_to_scheduler(bool finishing) {
    fiber &f = R.fibers[R.current];
#if EMU_ASAN
    __sanitizer_start_switch_fiber(finishing ? nullptr : &f.fake_stack, R.sched_bottom, R.sched_size);
#endif
    (void)finishing;
    ctx_switch(f.ctx, R.sched);
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
    ctx_switch(R.sched, f.ctx);
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
    ctx_make(f.ctx, f.stack, STACK_BYTES, fiber_main);
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

void run_block(const std::function<void()> &body, bool reverse) {
    R.body = &body;
    for (unsigned t = 0; t < R.nthreads; t++) start(t);
    do {
        for (unsigned k = 0; k < R.nthreads; k++) {
            const unsigned t = reverse ? R.nthreads - 1 - k : k;
            if (R.fibers[t].st == READY) resume(t);
        }
    } while (release());
}

} /* namespace */

void run_grid(dim3 grid, dim3 block, const std::function<void()> &body, const char *name) {
    auto known = sync_free.find(name);
    R.direct = known != sync_free.end() && known->second;
    R.waited = false;
    R.name = name;
    gridDim = grid;
    blockDim = block;
    R.nthreads = block.x * block.y * block.z;
    if (R.fibers.size() < R.nthreads) R.fibers.resize(R.nthreads);
    R.published.assign(R.nthreads, 0);
    for (unsigned t = 0; t < R.nthreads; t++)
        R.fibers[t].tid = make_uint3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
    const bool reverse = cmlp_emu_block_order(-1) == 1;
    const uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
    for (uint64_t i = 0; i < nblocks; i++) {
        const uint64_t b = reverse ? nblocks - 1 - i : i;
        blockIdx = make_uint3((unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                              (unsigned)(b / ((uint64_t)grid.x * grid.y)));
        if (!R.direct) {
            run_block(body, reverse);
            continue;
        }
        for (unsigned k = 0; k < R.nthreads; k++) {
            const unsigned t = reverse ? R.nthreads - 1 - k : k;
            R.current = (int)t;
            threadIdx = R.fibers[t].tid;
            body();
        }
        R.current = -1;
    }
    if (known == sync_free.end()) sync_free[name] = !R.waited;
}

/* A thread is about to wait: impossible for a kernel that runs without fibers. */
static void about_to_wait() {
    if (R.direct) fail("a kernel that did not wait at a barrier or shuffle in its first launch waits now "
                       "(tests/emu runs its threads without fibers)");
    R.waited = true;
}

void block_barrier() {
    if (R.current < 0) fail("__syncthreads outside a kernel");
    about_to_wait();
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
    about_to_wait();
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
