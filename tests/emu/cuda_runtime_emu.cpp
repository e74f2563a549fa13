/* cuda_runtime_emu.cpp - the CUDA runtime, the driver's virtual memory API and cuBLASLt, as far
 * as csrc/backend_cuda*.c use them, on the CPU. Linked with backend_cuda*.c and the kernels under
 * cuda_emu.h it makes build/emu/_cmlp_cuda_emu.so: a CUDA backend that cmlp loads through
 * CMLP_CUDA_LIBRARY, so that the GPU tests run against the backend's own host code on a machine
 * without a GPU.
 *
 * It keeps the semantics that host code gets wrong, and makes them fail deterministically:
 *  - Work is lazy. A launch, copy, memset or GEMM waits in its stream's queue until the host
 *    synchronises with it (stream or event), so a result read before its synchronisation is
 *    always stale, and a pinned host buffer reused before its copy ran is always read late.
 *    Copies to pageable host memory wait for the stream, and copies from it take the source
 *    at the call, as CUDA does. A collective (nccl*, or a graph launch holding one) runs its
 *    stream's queue through it when queued: on a GPU it progresses without the host, and left
 *    queued it would wait for this rank's next synchronisation, behind host collectives (MPI)
 *    that the other ranks are already in: a deadlock that hardware does not have.
 *  - Kernels and GEMMs take their arguments at launch; a graph replays exactly those.
 *  - Capture follows cudaStreamCaptureModeThreadLocal: while a thread captures, its calls that
 *    would allocate or wait fail and invalidate the capture; the capturing stream records.
 *  - A kernel's pointer argument must be null or device memory; a GEMM's matrices must be
 *    device memory whose shapes, leading dimensions and alignments agree with its layouts and
 *    with the alignment its algorithm was chosen for.
 *  - Device memory is finite (CMLP_EMU_MEMORY bytes per device, default 4 GiB): cudaMalloc and
 *    cuMemCreate fail with out-of-memory beyond it. New memory is poisoned (every byte 0xFF: NaN
 *    as a float, -1 as an integer), so a read before the first write shows. Expandable segments are real mappings:
 *    reserved addresses are inaccessible until a page is mapped and access is set, and again
 *    after it is unmapped, so a use after unmapping faults. Built with AddressSanitizer, the bytes
 *    of cudaMalloc's pages past the size asked for are poisoned, as compute-sanitizer's memcheck
 *    holds an access to each allocation's own bytes (with cmlp's caching off, each buffer is one).
 *  - CMLP_EMU_MODULE_BYTES=n: a kernel's first launch on a device loads its module into n bytes
 *    of device memory, and fails with out-of-memory where they are not free (lazy loading).
 *  - CMLP_EMU_KERNEL_IMAGE=none: no kernel has code for the device (a build for other
 *    architectures): a launch, or cudaFuncGetAttributes, fails with cudaErrorNoKernelImageForDevice;
 *    =ptx_too_new: with cudaErrorUnsupportedPtxVersion (PTX of a toolkit newer than the driver).
 *  - CMLP_EMU_DEVICES (default 1) devices share the host's memory.
 *  - A thread's current context (cudaSetDevice's primary one, or a test's: cmlp_emu_ctx_create)
 *    decides its device, and work queued to a stream made in another context fails, as CUDA's
 *    "invalid resource handle" does. With CMLP_EMU_SET_DEVICE_KEEPS_CONTEXT=1, cudaSetDevice of
 *    the device already current keeps another context of it current.
 *  - NVML (nvml* below) reports CMLP_EMU_NVML_DEVICES GPUs (default: CMLP_EMU_DEVICES), whose
 *    UUIDs share the prefix "GPU-7e57"; CMLP_EMU_NVML_FAIL=1 makes nvmlInit_v2 fail as without a
 *    driver. NVML starts nothing: a forked child may use CUDA after its parent asked NVML. The
 *    processes on a GPU are this one (its device memory plus a 256 MiB context) and those of
 *    CMLP_EMU_NVML_PROCESSES ("pid:bytes,pid:bytes").
 *  - CMLP_EMU_TRACE_GRAPHS=1 prints the launches of every graph instantiated, by name.
 *  - cublasLtMatmul and cublasGemmEx load their kernels on their first run too
 *    (CMLP_EMU_MODULE_BYTES, one module per epilogue, types and power of two of the largest side;
 *    CMLP_EMU_KERNEL_IMAGE does not touch them), and fail with CUBLAS_STATUS_EXECUTION_FAILED (the
 *    launch's error taken) where they find no room. Its split-K algorithms reduce through the
 *    workspace; CMLP_EMU_LT_INPLACE=1 has them report an in-place reduction instead.
 *    CMLP_EMU_LT_FAIL=1: every cublasLtMatmul fails to execute (a fault, not for memory).
 *  - cudaEventQuery, from any thread, says whether the stream has run up to the event; an event
 *    recorded on an idle stream (after a collective, which ran it) is reached at once.
 *  - CMLP_EMU_NCCL_STALL=r:n: rank r's n-th collective never ends, as on a device stuck in it
 *    (one recorded in a graph: at the graph's launch); r:n:queued leaves it in the stream's
 *    queue, where the host's wait for it never ends. ncclCommDestroy of a communicator that an
 *    instantiated graph (not destroyed) holds collectives of aborts: NCCL's would wait for ever.
 *  - CMLP_EMU_LAUNCH_DELAY_US=n pauses n microseconds after each kernel launch (no lock held),
 *    so that threads interleave their launches on a shared stream.
 *
 * Execution is one device: a global lock serialises the runtime and the running work. GEMMs
 * multiply in float64 (OpenBLAS dgemm) from inputs rounded as the compute type says (TF32 too)
 * and round once to the output type, so they differ from the CPU backend's sgemm in the last
 * bits, as a GPU's do.
 */
#include "cuda_emu.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#include <sys/mman.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define EMU_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define EMU_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define EMU_POISON(p, n) ((void)(p), (void)(n))
#define EMU_UNPOISON(p, n) ((void)(p), (void)(n))
#endif
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

extern "C" void scipy_cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a,
                                  int lda, const double *b, int ldb, double beta, double *c, int ldc);

namespace {

/* ---- fork ----
 * The CUDA driver does not survive fork(): a child of a process that started CUDA (called any
 * of it) must call nothing of it. Here such a call ends the child at once (SIGABRT), so that a
 * test sees it. A child of a process that had not started it starts its own. */
bool started, in_forked_child;
void mark_forked_child() { in_forked_child = started; }
struct fork_watch {
    fork_watch() { pthread_atfork(nullptr, nullptr, mark_forked_child); }
} watch_forks;
void fork_guard(const char *what) {
    if (!in_forked_child) {
        started = true;
        return;
    }
    std::fprintf(stderr, "cuda_emu: %s called in a process forked after CUDA was started\n", what);
    std::abort();
}

/* ---- state ---- */

struct op {
    std::shared_ptr<std::function<void()>> run;
    const char *name;
    uint64_t id;
    /* in a graph: the branch (0: the stream the capture began on; k > 0: the k-th stream that
     * joined it) and the op's place in it; a wait (no run) waits for branch wait_lane's ops up
     * to place wait_pos */
    int lane = 0;
    uint64_t pos = 0;
    int wait_lane = -1;
    uint64_t wait_pos = 0;
};

struct graph_t {
    std::vector<op> ops;
    std::vector<uint64_t> lane_ops{0};    /* ops (waits aside) per branch */
    std::vector<uint64_t> lane_joined{0}; /* how far the first branch waited for each */
    std::vector<CUstream_st *> lane_streams{nullptr};
    std::set<void *> comms; /* the NCCL communicators its collectives use */
};
std::set<const graph_t *> live_execs; /* instantiated graphs not destroyed (ncclCommDestroy waits for them) */

std::recursive_mutex gpu; /* the runtime's state and the running work */

struct capture_t {
    graph_t *graph = nullptr;
    bool invalid = false;
    const char *why = nullptr;
};

} /* namespace */

struct CUstream_st {
    std::deque<op> queue;
    uint64_t next_id = 1, done_id = 0;
    capture_t cap;
    bool capturing = false;
    /* a stream that joined another's capture (by waiting for an event recorded there): that
     * stream, and its branch in the graph */
    CUstream_st *cap_origin = nullptr;
    int cap_lane = 0;
    CUctx_st *ctx = nullptr; /* made in (the legacy stream: none, any context's) */
};
struct CUevent_st {
    CUstream_st *stream = nullptr; /* recorded outside a capture: after op `id` of `stream` */
    uint64_t id = 0;
    graph_t *cap_graph = nullptr; /* recorded in a capture: after `cap_pos` ops of branch `cap_lane` */
    int cap_lane = 0;
    uint64_t cap_pos = 0;
};
struct CUgraph_st {
    graph_t g;
};
struct CUgraphExec_st {
    graph_t g;
    bool uploaded = false; /* its code and memory on the device: at cudaGraphUpload or its first launch */
};
struct CUctx_st {
    int device;
    bool primary;
    bool destroyed; /* a test's context, destroyed (cmlp_emu_ctx_destroy) */
};

namespace {

CUstream_st legacy_stream;
thread_local int current_device = 0;

/* Contexts (CUctx_st above): each device's primary context (what cudaSetDevice makes current) and those a test
 * makes (cmlp_emu_ctx_create, as cuCtxCreate). A thread's current context, when it has one,
 * decides its device, as the runtime takes the context the driver API made current. */
CUctx_st *primary_ctx(int d) {
    static CUctx_st primaries[64];
    CUctx_st *c = &primaries[d & 63];
    c->device = d;
    c->primary = true;
    return c;
}
thread_local CUctx_st *current_ctx;
int cur_dev() { return current_ctx ? current_ctx->device : current_device; }
/* the context the runtime works in on this thread */
CUctx_st *work_ctx() { return current_ctx ? current_ctx : primary_ctx(current_device); }
thread_local CUstream_st *capturing_here; /* the stream this thread captures on */

size_t env_size(const char *name, size_t dflt) {
    const char *v = getenv(name);
    return v && v[0] ? (size_t)strtoull(v, nullptr, 10) : dflt;
}
int device_count() { return (int)env_size("CMLP_EMU_DEVICES", 1); }
size_t capacity() { return env_size("CMLP_EMU_MEMORY", (size_t)4 << 30); }

struct region {
    size_t size;
    int device;
    int kind; /* 0 cudaMalloc, 1 pinned host, 2 reserved virtual range */
};
std::map<uintptr_t, region> regions;
std::map<int, size_t> used; /* device bytes, per device */

const region *find_region(const void *p, uintptr_t *base) {
    uintptr_t a = (uintptr_t)p;
    auto it = regions.upper_bound(a);
    if (it == regions.begin()) return nullptr;
    --it;
    if (a >= it->first + it->second.size) return nullptr;
    if (base) *base = it->first;
    return &it->second;
}

/* Is [p, p + n) inside one piece of device memory? */
bool device_range(const void *p, size_t n) {
    uintptr_t base = 0;
    const region *r = find_region(p, &base);
    return r && r->kind != 1 && (uintptr_t)p + n <= base + r->size;
}
bool pinned(const void *p) {
    const region *r = find_region(p, nullptr);
    return r && r->kind == 1;
}

/* A GPU keeps subnormal floats (nvcc's default, -ftz=false), where cmlp's CPU compute, which the
 * host thread may be in when it runs the queue, flushes them: the device's work runs with
 * subnormals kept (MXCSR's FTZ and DAZ off), as on the GPU. */
void run_op(CUstream_st *s, op &o) {
#if defined(__SSE__)
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved & ~0x8040u);
#endif
    (*o.run)();
#if defined(__SSE__)
    _mm_setcsr(saved);
#endif
    __atomic_store_n(&s->done_id, o.id, __ATOMIC_RELEASE); /* cudaEventQuery reads it without the lock */
}

/* Runs the stream's queued work, all of it or up to the op `until`. */
void flush(CUstream_st *s, uint64_t until = UINT64_MAX) {
    std::lock_guard<std::recursive_mutex> g(gpu);
    while (!s->queue.empty() && s->queue.front().id <= until) {
        op o = std::move(s->queue.front());
        s->queue.pop_front();
        run_op(s, o);
    }
}

std::vector<CUstream_st *> streams{&legacy_stream};

void flush_all() {
    std::lock_guard<std::recursive_mutex> g(gpu);
    for (CUstream_st *s : streams) flush(s);
}

CUstream_st *resolve(cudaStream_t s) { return s ? s : &legacy_stream; }

/* The stream whose capture s records into (s itself, or the one it joined). */
CUstream_st *origin(CUstream_st *s) { return s->cap_origin ? s->cap_origin : s; }

/* A call that CUDA refuses while this thread captures (it would allocate or wait): it breaks
 * the capture, as CUDA's does. */
bool refused_while_capturing(const char *what) {
    if (!capturing_here) return false;
    capturing_here = origin(capturing_here);
    capturing_here->cap.invalid = true;
    if (!capturing_here->cap.why) capturing_here->cap.why = what;
    std::fprintf(stderr, "cuda_emu: %s while this thread captures a graph\n", what);
    return true;
}

cudaError_t submit(cudaStream_t stream, std::function<void()> run, const char *name) {
    fork_guard("submit");
    std::lock_guard<std::recursive_mutex> g(gpu);
    CUstream_st *s = resolve(stream);
    if (s->ctx && s->ctx->destroyed) {
        std::fprintf(stderr, "cuda_emu: %s queued to a stream of a destroyed context (device %d)\n", name,
                     s->ctx->device);
        return cudaErrorContextIsDestroyed;
    }
    if (s->ctx && s->ctx != work_ctx()) { /* CUDA's "invalid resource handle" */
        std::fprintf(stderr, "cuda_emu: %s queued to a stream of another context (device %d) than the current one "
                     "(device %d%s)\n", name, s->ctx->device, work_ctx()->device,
                     work_ctx()->primary ? "" : ", not its primary context");
        return cudaErrorInvalidResourceHandle;
    }
    op o{std::make_shared<std::function<void()>>(std::move(run)), name, 0};
    if (s->capturing) {
        CUstream_st *cs = origin(s);
        if (cs->cap.invalid) return cudaErrorStreamCaptureInvalidated; /* work after a breaking call */
        o.lane = s->cap_lane;
        o.pos = ++cs->cap.graph->lane_ops[(size_t)o.lane];
        cs->cap.graph->ops.push_back(std::move(o));
        return cudaSuccess;
    }
    o.id = s->next_id++;
    s->queue.push_back(std::move(o));
    if (s->queue.size() > 4096) flush(s); /* a real queue is bounded too */
    return cudaSuccess;
}

bool kernel_pointer_ok(const void *p, const char *kernel, int index) {
    if (!p) return true;
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (!device_range(p, 1)) {
        std::fprintf(stderr, "cuda_emu: argument %d of kernel %s is %p, which is not device memory\n", index, kernel,
                     p);
        return false;
    }
    /* another GPU's memory: an illegal address on a GPU without peer access (none is enabled) */
    const region *r = find_region(p, nullptr);
    if (r->device == cur_dev()) return true;
    std::fprintf(stderr, "cuda_emu: argument %d of kernel %s is %p, device %d's memory, launched on device %d\n",
                 index, kernel, p, r->device, cur_dev());
    return false;
}

/* With CMLP_EMU_MODULE_BYTES=n, a kernel (each template instantiation) loads on its first launch
 * on a device (CUDA's lazy loading) and keeps n bytes of the device's memory; where they are not
 * free, the launch fails with out-of-memory (and loads nothing). */
cudaError_t load_module(const void *kernel);

cudaError_t load_kernel(const void *kernel, const char *) {
    /* CMLP_EMU_KERNEL_IMAGE=none: the build has no code for this GPU's architecture; =ptx_too_new:
     * only PTX of a toolkit newer than the driver */
    static const char *const image = getenv("CMLP_EMU_KERNEL_IMAGE");
    if (image && std::strcmp(image, "none") == 0) return cudaErrorNoKernelImageForDevice;
    if (image && std::strcmp(image, "ptx_too_new") == 0) return cudaErrorUnsupportedPtxVersion;
    return load_module(kernel);
}

/* A module's first use on a device (cuBLAS's kernels too, which CMLP_EMU_KERNEL_IMAGE, a build
 * of cmlp's, does not touch), with CMLP_EMU_MODULE_BYTES. */
cudaError_t load_module(const void *kernel) {
    static const size_t bytes = env_size("CMLP_EMU_MODULE_BYTES", 0);
    if (!bytes) return cudaSuccess;
    std::lock_guard<std::recursive_mutex> g(gpu);
    static std::set<std::pair<int, const void *>> loaded;
    const int d = cur_dev();
    if (loaded.count({d, kernel})) return cudaSuccess;
    if (bytes > capacity() - std::min(capacity(), used[d])) return cudaErrorMemoryAllocation;
    used[d] += bytes;
    loaded.insert({d, kernel});
    return cudaSuccess;
}

/* A kernel launch, then with CMLP_EMU_LAUNCH_DELAY_US=n a pause of n microseconds, with no lock
 * held: other threads' work then lands between a thread's launches as often as it may on a GPU. */
cudaError_t launch(cudaStream_t stream, std::function<void()> run, const char *name) {
    fork_guard("launch");
    static const size_t delay = env_size("CMLP_EMU_LAUNCH_DELAY_US", 0);
    cudaError_t e = submit(stream, std::move(run), name);
    if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    return e;
}

struct install {
    install() {
        cmlp_emu::submit_hook = launch;
        cmlp_emu::pointer_hook = kernel_pointer_ok;
        cmlp_emu::load_hook = load_kernel;
    }
} installed;

cudaError_t fail(cudaError_t e) {
    cmlp_emu::set_last_error(e);
    return e;
}

size_t page_round(size_t n) {
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) / pg * pg;
}

} /* namespace */

/* ---- runtime: devices, errors ---- */

extern "C" {

cudaError_t cudaGetDeviceCount(int *n) {
    fork_guard("cudaGetDeviceCount");
    *n = device_count();
    return cudaSuccess;
}
/* An emulated GPU: compute capability 9.0 (the machine code built for it), its memory the
 * emulator's capacity. */
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int d) {
    fork_guard("cudaGetDeviceProperties");
    if (!prop) return fail(cudaErrorInvalidValue);
    if (d < 0 || d >= device_count()) return fail(cudaErrorInvalidDevice);
    *prop = cudaDeviceProp{};
    std::snprintf(prop->name, sizeof prop->name, "cmlp emulated GPU %d", d);
    prop->major = 9;
    prop->minor = 0;
    prop->totalGlobalMem = capacity();
    prop->multiProcessorCount = 4;
    prop->maxThreadsPerMultiProcessor = 2048;
    prop->warpSize = 32;
    prop->l2CacheSize = 1 << 20;
    const unsigned char uuid[16] = {0x7e, 0x57, (unsigned char)(d >> 8), (unsigned char)d, 0, 0, 0x40, 0, 0x80, 0, 0, 0,
                                    (unsigned char)(d * 7919u >> 24), (unsigned char)(d * 7919u >> 16),
                                    (unsigned char)(d * 7919u >> 8), (unsigned char)(d * 7919u)};
    std::memcpy(prop->uuid.bytes, uuid, 16); /* NVML's UUID below, as bytes */
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
    fork_guard("cudaSetDevice");
    if (d < 0 || d >= device_count()) return fail(cudaErrorInvalidDevice);
    /* CMLP_EMU_SET_DEVICE_KEEPS_CONTEXT=1: a runtime that leaves another context of the device
     * it takes as current in place (CUDA's makes the primary context current every time) */
    static const bool keeps = env_size("CMLP_EMU_SET_DEVICE_KEEPS_CONTEXT", 0) != 0;
    if (keeps && current_ctx && current_ctx->device == d && current_device == d) return cudaSuccess;
    current_device = d;
    current_ctx = primary_ctx(d);
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
    fork_guard("cudaGetDevice");
    *d = cur_dev();
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) {
    fork_guard("cudaRuntimeGetVersion");
    *v = CUDART_VERSION;
    return cudaSuccess;
}

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    case cudaErrorUnsupportedPtxVersion: return "cudaErrorUnsupportedPtxVersion";
    default: return "cudaErrorUnknown";
    }
}
const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    default: return "unknown error (emulated)";
    }
}

/* ---- memory ---- */

cudaError_t cudaMalloc(void **p, size_t n) {
    fork_guard("cudaMalloc");
    *p = nullptr;
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (refused_while_capturing("cudaMalloc")) return fail(cudaErrorStreamCaptureUnsupported);
    if (n == 0) return cudaSuccess;
    const size_t sz = page_round(n);
    if (sz > capacity() - std::min(capacity(), used[cur_dev()])) return fail(cudaErrorMemoryAllocation);
    void *m = mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return fail(cudaErrorMemoryAllocation);
    memset(m, 0xFF, sz); /* poison: a read before the first write gives NaN (and -1 as an integer) */
    EMU_POISON((char *)m + n, sz - n);
    regions[(uintptr_t)m] = region{sz, cur_dev(), 0};
    used[cur_dev()] += sz;
    *p = m;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    fork_guard("cudaFree");
    if (!p) return cudaSuccess;
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (refused_while_capturing("cudaFree")) return fail(cudaErrorStreamCaptureUnsupported);
    auto it = regions.find((uintptr_t)p);
    if (it == regions.end() || it->second.kind != 0) return fail(cudaErrorInvalidValue);
    flush_all(); /* cudaFree waits for the device */
    used[it->second.device] -= it->second.size;
    EMU_UNPOISON(p, it->second.size);
    munmap(p, it->second.size);
    regions.erase(it);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t n) {
    fork_guard("cudaMallocHost");
    *p = nullptr;
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (refused_while_capturing("cudaMallocHost")) return fail(cudaErrorStreamCaptureUnsupported);
    const size_t sz = page_round(n ? n : 1);
    void *m = mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return fail(cudaErrorMemoryAllocation);
    regions[(uintptr_t)m] = region{sz, cur_dev(), 1};
    *p = m;
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p) {
    fork_guard("cudaFreeHost");
    if (!p) return cudaSuccess;
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (refused_while_capturing("cudaFreeHost")) return fail(cudaErrorStreamCaptureUnsupported);
    auto it = regions.find((uintptr_t)p);
    if (it == regions.end() || it->second.kind != 1) return fail(cudaErrorInvalidValue);
    flush_all();
    munmap(p, it->second.size);
    regions.erase(it);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total) {
    fork_guard("cudaMemGetInfo");
    std::lock_guard<std::recursive_mutex> g(gpu);
    *total = capacity();
    *free_b = capacity() - std::min(capacity(), used[cur_dev()]);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *at, const void *p) {
    fork_guard("cudaPointerGetAttributes");
    std::lock_guard<std::recursive_mutex> g(gpu);
    memset(at, 0, sizeof *at);
    const region *r = find_region(p, nullptr);
    at->type = !r ? cudaMemoryTypeUnregistered : r->kind == 1 ? cudaMemoryTypeHost : cudaMemoryTypeDevice;
    at->device = r ? r->device : -1;
    if (r && r->kind == 1) at->hostPointer = (void *)p;
    else if (r) at->devicePointer = (void *)p;
    else at->hostPointer = (void *)p;
    return cudaSuccess;
}

/* ---- streams, events, copies ---- */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int) {
    fork_guard("cudaStreamCreateWithFlags");
    std::lock_guard<std::recursive_mutex> g(gpu);
    *s = new CUstream_st;
    (*s)->ctx = work_ctx();
    streams.push_back(*s);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
    fork_guard("cudaStreamDestroy");
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (!s || s->capturing) return fail(cudaErrorInvalidResourceHandle);
    flush(s); /* its work still runs */
    streams.erase(std::find(streams.begin(), streams.end(), s));
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    fork_guard("cudaStreamSynchronize");
    std::lock_guard<std::recursive_mutex> g(gpu);
    CUstream_st *s = resolve(stream);
    if (s->capturing) {
        origin(s)->cap.invalid = true;
        if (!origin(s)->cap.why) origin(s)->cap.why = "cudaStreamSynchronize on the capturing stream";
        return fail(cudaErrorStreamCaptureUnsupported);
    }
    flush(s);
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int) {
    fork_guard("cudaEventCreateWithFlags");
    *e = new CUevent_st;
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
    fork_guard("cudaEventDestroy");
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
    fork_guard("cudaEventRecord");
    std::lock_guard<std::recursive_mutex> g(gpu);
    CUstream_st *s = resolve(stream);
    if (s->capturing) { /* a node of the graph that other branches may wait for */
        CUstream_st *cs = origin(s);
        if (cs->cap.invalid) return fail(cudaErrorStreamCaptureInvalidated);
        e->stream = nullptr;
        e->cap_graph = cs->cap.graph;
        e->cap_lane = s->cap_lane;
        e->cap_pos = cs->cap.graph->lane_ops[(size_t)s->cap_lane];
        return cudaSuccess;
    }
    const bool idle = s->queue.empty();
    if (cudaError_t err = submit(s, [] {}, "event")) return fail(err);
    e->stream = s;
    e->id = s->next_id - 1;
    e->cap_graph = nullptr;
    if (idle) flush(s); /* on an idle stream it is reached at once */
    return cudaSuccess;
}

/* Outside a capture the stream's later work waits for the event's (the emulator runs a stream's
 * work only when something waits for it, so work on a second stream runs at its join: as late
 * as the order allows, which shows a missing dependency). Inside one, a stream that waits for an
 * event recorded in a capture joins that capture as a new branch. */
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t e, unsigned int) {
    fork_guard("cudaStreamWaitEvent");
    std::lock_guard<std::recursive_mutex> g(gpu);
    CUstream_st *s = resolve(stream);
    if (!e) return fail(cudaErrorInvalidResourceHandle);
    if (e->cap_graph) {
        graph_t *graph = e->cap_graph;
        if (s->capturing && origin(s)->cap.graph != graph) return fail(cudaErrorStreamCaptureIsolation);
        if (!s->capturing) {
            CUstream_st *cs = nullptr;
            for (CUstream_st *t : streams)
                if (t->capturing && !t->cap_origin && t->cap.graph == graph) cs = t;
            if (!cs) return fail(cudaErrorStreamCaptureIsolation); /* that capture has ended */
            s->capturing = true;
            s->cap_origin = cs;
            s->cap_lane = (int)graph->lane_ops.size();
            graph->lane_ops.push_back(0);
            graph->lane_joined.push_back(0);
            graph->lane_streams.push_back(s);
        }
        if (origin(s)->cap.invalid) return fail(cudaErrorStreamCaptureInvalidated);
        op w{nullptr, "wait", 0};
        w.lane = s->cap_lane;
        w.wait_lane = e->cap_lane;
        w.wait_pos = e->cap_pos;
        if (w.lane == 0 && w.wait_lane > 0)
            graph->lane_joined[(size_t)w.wait_lane] = std::max(graph->lane_joined[(size_t)w.wait_lane], w.wait_pos);
        graph->ops.push_back(std::move(w));
        return cudaSuccess;
    }
    if (s->capturing) { /* a graph cannot wait for work outside it */
        origin(s)->cap.invalid = true;
        if (!origin(s)->cap.why) origin(s)->cap.why = "a wait for an event recorded outside the capture";
        return fail(cudaErrorStreamCaptureIsolation);
    }
    if (!e->stream) return cudaSuccess; /* never recorded: nothing to wait for */
    CUstream_st *es = e->stream;
    const uint64_t id = e->id;
    auto wait = [es, id] { /* a destroyed stream ran its work when it was destroyed */
        if (std::find(streams.begin(), streams.end(), es) != streams.end()) flush(es, id);
    };
    if (cudaError_t err = submit(s, wait, "wait")) return fail(err);
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    fork_guard("cudaEventSynchronize");
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (refused_while_capturing("cudaEventSynchronize")) return fail(cudaErrorStreamCaptureUnsupported);
    if (e->stream) flush(e->stream, e->id);
    return cudaSuccess;
}

/* From any thread, without the runtime's lock (a thread may hold it for good, stuck in a
 * collective): whether the stream has run up to the event. Work runs when the host waits for
 * it, and a collective runs its stream's queue when queued, so an event recorded after one is
 * reached at once (cudaEventRecord on an idle stream). */
cudaError_t cudaEventQuery(cudaEvent_t e) {
    fork_guard("cudaEventQuery");
    if (!e) return cudaErrorInvalidResourceHandle;
    if (refused_while_capturing("cudaEventQuery")) return cudaErrorStreamCaptureUnsupported; /* (the capturing thread's) */
    /* recorded before the call (the caller ordered it); the stream lives on */
    if (!e->stream || __atomic_load_n(&e->stream->done_id, __ATOMIC_ACQUIRE) >= e->id) return cudaSuccess;
    return cudaErrorNotReady; /* not an error: the last error stays */
}

/* The emulated capture is per thread whatever the mode: the mode is kept, and given back. */
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
    static thread_local enum cudaStreamCaptureMode current = cudaStreamCaptureModeGlobal;
    if (!mode) return fail(cudaErrorInvalidValue);
    std::swap(*mode, current);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t stream) {
    fork_guard("cudaMemcpyAsync");
    std::lock_guard<std::recursive_mutex> g(gpu);
    CUstream_st *s = resolve(stream);
    if (n == 0) return cudaSuccess;
    const bool d_dev = device_range(dst, n), s_dev = device_range(src, n);
    if (kind == cudaMemcpyHostToDevice) {
        if (!d_dev || s_dev) return fail(cudaErrorInvalidValue);
        if (!pinned(src)) {
            if (s->capturing) { /* a graph cannot read pageable memory later */
                origin(s)->cap.invalid = true;
                origin(s)->cap.why = "a copy from pageable host memory";
                return fail(cudaErrorStreamCaptureUnsupported);
            }
            /* the source is taken now (staged), the copy is in stream order */
            auto staged = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + n);
            if (cudaError_t e = submit(s, [dst, staged] { memcpy(dst, staged->data(), staged->size()); },
                                       "memcpy HtoD (staged)"))
                return fail(e);
            return cudaSuccess;
        }
    } else if (kind == cudaMemcpyDeviceToHost) {
        if (d_dev || !s_dev) return fail(cudaErrorInvalidValue);
        if (!pinned(dst)) { /* returns once the copy is done */
            if (s->capturing) {
                origin(s)->cap.invalid = true;
                origin(s)->cap.why = "a copy to pageable host memory";
                return fail(cudaErrorStreamCaptureUnsupported);
            }
            flush(s);
            memcpy(dst, src, n);
            return cudaSuccess;
        }
    } else if (kind == cudaMemcpyDeviceToDevice) {
        if (!d_dev || !s_dev) return fail(cudaErrorInvalidValue);
    } else {
        return fail(cudaErrorInvalidValue);
    }
    if (cudaError_t e = submit(s, [dst, src, n] { memmove(dst, src, n); }, "memcpy")) return fail(e);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *dst, int v, size_t n, cudaStream_t stream) {
    fork_guard("cudaMemsetAsync");
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (n == 0) return cudaSuccess;
    if (!device_range(dst, n)) return fail(cudaErrorInvalidValue);
    if (cudaError_t e = submit(resolve(stream), [dst, v, n] { memset(dst, v, n); }, "memset")) return fail(e);
    return cudaSuccess;
}

/* ---- graphs ---- */

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
    fork_guard("cudaStreamBeginCapture");
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (!stream || stream->capturing || capturing_here) return fail(cudaErrorIllegalState);
    if (mode != cudaStreamCaptureModeThreadLocal) return fail(cudaErrorInvalidValue); /* the one mode emulated */
    flush(stream);
    stream->capturing = true;
    stream->cap = capture_t{new graph_t, false, nullptr};
    capturing_here = stream;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *out) {
    fork_guard("cudaStreamEndCapture");
    std::lock_guard<std::recursive_mutex> g(gpu);
    *out = nullptr;
    if (!stream || !stream->capturing || stream->cap_origin || capturing_here != stream)
        return fail(cudaErrorIllegalState);
    stream->capturing = false;
    capturing_here = nullptr;
    std::unique_ptr<graph_t> graph(stream->cap.graph);
    stream->cap.graph = nullptr;
    bool unjoined = false; /* every branch's last op is waited for by the first branch */
    for (size_t k = 1; k < graph->lane_streams.size(); k++) {
        CUstream_st *t = graph->lane_streams[k];
        t->capturing = false;
        t->cap_origin = nullptr;
        t->cap_lane = 0;
        if (graph->lane_joined[k] < graph->lane_ops[k]) unjoined = true;
    }
    if (stream->cap.invalid) {
        std::fprintf(stderr, "cuda_emu: the capture was invalidated by %s\n", stream->cap.why);
        return fail(cudaErrorStreamCaptureInvalidated);
    }
    if (unjoined) {
        std::fprintf(stderr, "cuda_emu: a capture ended with work on a second stream not joined back\n");
        return fail(cudaErrorStreamCaptureUnjoined);
    }
    *out = new CUgraph_st{std::move(*graph)};
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long) {
    fork_guard("cudaGraphInstantiateWithFlags");
    if (refused_while_capturing("cudaGraphInstantiate")) return fail(cudaErrorStreamCaptureUnsupported);
    if (getenv("CMLP_EMU_TRACE_GRAPHS")) { /* what a graph launches, for tests of the launch count */
        std::string names;
        size_t n = 0, branched = 0;
        for (const op &o : graph->g.ops)
            if (o.run) {
                names += std::string(" ") + o.name;
                n++;
                branched += o.lane != 0;
            }
        std::fprintf(stderr, "cuda_emu: graph of %zu launches (%zu on other streams):%s\n", n, branched,
                     names.c_str());
    }
    *exec = new CUgraphExec_st{graph->g};
    std::lock_guard<std::recursive_mutex> g(gpu);
    live_execs.insert(&(*exec)->g);
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    fork_guard("cudaGraphDestroy");
    delete graph;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    fork_guard("cudaGraphExecDestroy");
    std::lock_guard<std::recursive_mutex> g(gpu);
    flush_all(); /* launches of it that are queued keep their ops alive anyway (shared) */
    live_execs.erase(&exec->g);
    delete exec;
    return cudaSuccess;
}

/* A graph's upload needs device memory outside any allocator: CMLP_EMU_GRAPH_UPLOAD_OOM=n makes
 * the process's first n uploads (cudaGraphUpload's, or a first launch's) run out of it, and
 * CMLP_EMU_GRAPH_UPLOAD_OOM_AT=i,j,... the uploads tried i-th, j-th, ... (counted from 1). */
static bool upload_fails(long attempt) {
    static const long first = (long)env_size("CMLP_EMU_GRAPH_UPLOAD_OOM", 0);
    if (attempt <= first) return true;
    const char *at = getenv("CMLP_EMU_GRAPH_UPLOAD_OOM_AT");
    for (char *end; at && *at; at = *end ? end + 1 : end) {
        if (strtol(at, &end, 10) == attempt) return true;
        if (end == at) break; /* not a number: the rest is ignored */
    }
    return false;
}

static cudaError_t upload(cudaGraphExec_t exec) {
    static long attempts = 0;
    if (exec->uploaded) return cudaSuccess;
    const bool trace = getenv("CMLP_EMU_TRACE_GRAPHS") != nullptr;
    if (upload_fails(++attempts)) {
        if (trace) std::fprintf(stderr, "cuda_emu: a graph's upload ran out of memory\n");
        return fail(cudaErrorMemoryAllocation);
    }
    if (trace) std::fprintf(stderr, "cuda_emu: a graph uploaded\n");
    exec->uploaded = true;
    return cudaSuccess;
}

cudaError_t cudaGraphUpload(cudaGraphExec_t exec, cudaStream_t stream) {
    fork_guard("cudaGraphUpload");
    std::lock_guard<std::recursive_mutex> g(gpu);
    CUstream_st *s = resolve(stream);
    if (!exec) return fail(cudaErrorInvalidValue);
    if (s->capturing) return fail(cudaErrorStreamCaptureUnsupported);
    return upload(exec);
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
    fork_guard("cudaGraphLaunch");
    if (cudaError_t e = cudaGraphUpload(exec, stream)) return e; /* its checks, and a first launch's upload */
    std::lock_guard<std::recursive_mutex> g(gpu);
    CUstream_st *s = resolve(stream);
    /* one stream in an order the graph's edges allow: the first branch in its order, every other
     * branch's ops as late as they can run, where the first waits for them */
    std::map<int, std::deque<const op *>> later;
    bool collective = false; /* runs without the host: as queue_collective */
    auto queue = [s, &collective](const op &o) {
        auto run = o.run;
        collective = collective || strncmp(o.name, "nccl", 4) == 0;
        (void)submit(s, [run] { (*run)(); }, o.name); /* s is not capturing: cannot fail */
    };
    for (const op &o : exec->g.ops) {
        if (o.wait_lane >= 0) {
            std::deque<const op *> &q = later[o.wait_lane];
            while (!q.empty() && q.front()->pos <= o.wait_pos) {
                queue(*q.front());
                q.pop_front();
            }
        } else if (o.lane == 0) {
            queue(o);
        } else {
            later[o.lane].push_back(&o);
        }
    }
    for (auto &kv : later) /* none: a capture ends joined */
        for (const op *o : kv.second) queue(*o);
    if (collective) flush(s);
    return cudaSuccess;
}

} /* extern "C" */

/* ---- the driver's virtual memory API ---- */

namespace {

struct phys {
    int fd;
    size_t size;
    int device;
    int maps = 0;
    bool released = false;
    bool poisoned = false;
};
std::map<CUmemGenericAllocationHandle, phys> handles;
CUmemGenericAllocationHandle next_handle = 1;
std::map<uintptr_t, std::pair<CUmemGenericAllocationHandle, size_t>> mappings; /* address -> handle, size */

void drop_if_unused(CUmemGenericAllocationHandle h) {
    auto it = handles.find(h);
    if (it == handles.end() || it->second.maps || !it->second.released) return;
    close(it->second.fd);
    used[it->second.device] -= it->second.size;
    handles.erase(it);
}

bool reserved(uintptr_t a, size_t n) {
    uintptr_t base = 0;
    const region *r = find_region((const void *)a, &base);
    return r && r->kind == 2 && a + n <= base + r->size;
}

CUresult CUDAAPI mem_create(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long) {
    fork_guard("mem_create");
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (refused_while_capturing("cuMemCreate")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (!size || size % ((size_t)2 << 20)) return CUDA_ERROR_INVALID_VALUE;
    const int dev = prop->location.id;
    if (size > capacity() - std::min(capacity(), used[dev])) return CUDA_ERROR_OUT_OF_MEMORY;
    int fd = memfd_create("cmlp-emu-page", 0);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    used[dev] += size;
    *h = next_handle++;
    handles[*h] = phys{fd, size, dev};
    return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_release(CUmemGenericAllocationHandle h) {
    fork_guard("mem_release");
    if (refused_while_capturing("cuMemRelease")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    std::lock_guard<std::recursive_mutex> g(gpu);
    auto it = handles.find(h);
    if (it == handles.end() || it->second.released) return CUDA_ERROR_INVALID_HANDLE;
    it->second.released = true;
    drop_if_unused(h);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long) {
    fork_guard("mem_map");
    if (refused_while_capturing("cuMemMap")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    std::lock_guard<std::recursive_mutex> g(gpu);
    auto it = handles.find(h);
    if (it == handles.end() || it->second.released) return CUDA_ERROR_INVALID_HANDLE;
    if (offset || size != it->second.size || !reserved(ptr, size)) return CUDA_ERROR_INVALID_VALUE;
    auto next = mappings.lower_bound(ptr);
    if (next != mappings.end() && next->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;
    if (next != mappings.begin() && std::prev(next)->first + std::prev(next)->second.second > ptr)
        return CUDA_ERROR_INVALID_VALUE;
    void *m = mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, it->second.fd, 0);
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!it->second.poisoned) { /* as cudaMalloc's memory, on its first mapping */
        mprotect(m, size, PROT_READ | PROT_WRITE);
        memset(m, 0xFF, size);
        mprotect(m, size, PROT_NONE);
        it->second.poisoned = true;
    }
    it->second.maps++;
    mappings[ptr] = {h, size};
    return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    fork_guard("mem_set_access");
    if (refused_while_capturing("cuMemSetAccess")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (count != 1 || desc->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) return CUDA_ERROR_INVALID_VALUE;
    /* every byte of the range must be mapped */
    for (uintptr_t a = ptr; a < ptr + size;) {
        auto it = mappings.upper_bound(a);
        if (it == mappings.begin()) return CUDA_ERROR_INVALID_VALUE;
        --it;
        if (a >= it->first + it->second.second) return CUDA_ERROR_INVALID_VALUE;
        a = it->first + it->second.second;
    }
    if (mprotect((void *)ptr, size, PROT_READ | PROT_WRITE) != 0) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_unmap(CUdeviceptr ptr, size_t size) {
    fork_guard("mem_unmap");
    if (refused_while_capturing("cuMemUnmap")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    std::lock_guard<std::recursive_mutex> g(gpu);
    auto it = mappings.find(ptr);
    if (it == mappings.end() || it->second.second != size) return CUDA_ERROR_INVALID_VALUE;
    /* back to an inaccessible reservation: queued work that still uses the page faults */
    mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    CUmemGenericAllocationHandle h = it->second.first;
    mappings.erase(it);
    handles[h].maps--;
    drop_if_unused(h);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_reserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long) {
    fork_guard("mem_reserve");
    if (refused_while_capturing("cuMemAddressReserve")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (addr || !size || size % ((size_t)2 << 20)) return CUDA_ERROR_INVALID_VALUE;
    const size_t al = alignment ? alignment : (size_t)2 << 20;
    char *m = (char *)mmap(nullptr, size + al, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t a = ((uintptr_t)m + al - 1) / al * al;
    if (a > (uintptr_t)m) munmap(m, a - (uintptr_t)m);
    if ((uintptr_t)m + size + al > a + size) munmap((void *)(a + size), (uintptr_t)m + size + al - (a + size));
    regions[a] = region{size, cur_dev(), 2};
    *ptr = a;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_free_range(CUdeviceptr ptr, size_t size) {
    fork_guard("mem_free_range");
    if (refused_while_capturing("cuMemAddressFree")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    std::lock_guard<std::recursive_mutex> g(gpu);
    auto it = regions.find(ptr);
    if (it == regions.end() || it->second.kind != 2 || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
    auto m = mappings.lower_bound(ptr);
    if (m != mappings.end() && m->first < ptr + size) return CUDA_ERROR_INVALID_VALUE; /* still mapped */
    munmap((void *)ptr, size);
    regions.erase(it);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_granularity(size_t *gran, const CUmemAllocationProp *, CUmemAllocationGranularity_flags) {
    fork_guard("mem_granularity");
    *gran = (size_t)2 << 20;
    return CUDA_SUCCESS;
}

/* CMLP_EMU_NO_VMM=1: a device without the virtual memory API (as some vGPUs) */
CUresult CUDAAPI device_attribute(int *v, CUdevice_attribute attr, CUdevice dev) {
    fork_guard("device_attribute");
    if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    if (attr != CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) return CUDA_ERROR_NOT_SUPPORTED;
    const char *no = getenv("CMLP_EMU_NO_VMM");
    *v = no && strcmp(no, "1") == 0 ? 0 : 1;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI ctx_get_current(CUcontext *c) {
    *c = current_ctx;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI ctx_set_current(CUcontext c) {
    if (c && c->destroyed) return CUDA_ERROR_INVALID_CONTEXT;
    current_ctx = c;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI device_get(CUdevice *dev, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}
/* The primary context is the one cudaSetDevice makes current; retaining it is counted nowhere,
 * since it lives as long as the process. */
CUresult CUDAAPI primary_ctx_retain(CUcontext *c, CUdevice dev) {
    if (dev < 0 || dev >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *c = primary_ctx(dev);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI primary_ctx_release(CUdevice dev) {
    return dev < 0 || dev >= device_count() ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

CUresult CUDAAPI error_string(CUresult r, const char **s) {
    *s = r == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory" : r == CUDA_ERROR_INVALID_VALUE ? "invalid argument"
                                                                                           : "driver error (emulated)";
    return CUDA_SUCCESS;
}

} /* namespace */

extern "C" cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int, unsigned long long,
                                                        cudaDriverEntryPointQueryResult *q) {
    fork_guard("cudaGetDriverEntryPointByVersion");
    static const std::map<std::string, void *> table = {
        {"cuMemCreate", (void *)mem_create},
        {"cuMemRelease", (void *)mem_release},
        {"cuMemMap", (void *)mem_map},
        {"cuMemUnmap", (void *)mem_unmap},
        {"cuMemSetAccess", (void *)mem_set_access},
        {"cuMemAddressReserve", (void *)mem_reserve},
        {"cuMemAddressFree", (void *)mem_free_range},
        {"cuMemGetAllocationGranularity", (void *)mem_granularity},
        {"cuGetErrorString", (void *)error_string},
        {"cuCtxGetCurrent", (void *)ctx_get_current},
        {"cuCtxSetCurrent", (void *)ctx_set_current},
        {"cuDeviceGet", (void *)device_get},
        {"cuDeviceGetAttribute", (void *)device_attribute},
        {"cuDevicePrimaryCtxRetain", (void *)primary_ctx_retain},
        {"cuDevicePrimaryCtxRelease", (void *)primary_ctx_release},
    };
    auto it = table.find(symbol);
    *fn = it == table.end() ? nullptr : it->second;
    if (q) *q = it == table.end() ? cudaDriverEntryPointSymbolNotFound : cudaDriverEntryPointSuccess;
    return cudaSuccess;
}

/* ---- cuBLASLt ---- */

namespace {

struct lt_desc {
    cublasComputeType_t compute;
    cudaDataType_t scale;
    int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
    uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    const void *bias = nullptr;
    int32_t bias_type = -1;
};
struct lt_layout {
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld;
};
struct lt_pref {
    uint64_t max_ws = 0;
    uint32_t align[4] = {256, 256, 256, 256}; /* A, B, C, D */
    uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_MASK; /* the split-K reductions allowed */
};
/* what an algorithm was chosen for (kept in cublasLtMatmulAlgo_t's data) */
struct lt_algo {
    uint32_t magic;
    uint32_t align[5]; /* A, B, C, D, bias: the alignment the algorithm may assume */
    uint64_t workspace; /* the bytes of workspace it needs (and overwrites) */
    uint32_t scheme;    /* how split-K's partial sums are reduced (NONE: no split) */
};
static_assert(sizeof(lt_algo) <= sizeof(cublasLtMatmulAlgo_t), "the algorithm's notes fit its data");
constexpr uint32_t ALGO_MAGIC = 0xC3A1E0u;

lt_desc *D(cublasLtMatmulDesc_t d) { return (lt_desc *)d; }
lt_layout *L(cublasLtMatrixLayout_t l) { return (lt_layout *)l; }
lt_pref *P(cublasLtMatmulPreference_t p) { return (lt_pref *)p; }

size_t type_size(cudaDataType_t t) {
    return t == CUDA_R_32F ? 4 : t == CUDA_R_16F || t == CUDA_R_16BF ? 2 : 0;
}

unsigned alignment(const void *p) {
    uintptr_t a = (uintptr_t)p;
    unsigned al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1;
    return al;
}

float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = h >> 10 & 31, m = h & 1023;
    uint32_t bits;
    if (e == 31) bits = sign | 0x7F800000u | m << 13;
    else if (e) bits = sign | (e + 112) << 23 | m << 13;
    else if (!m) bits = sign;
    else {
        float f = (float)m * 0x1p-24f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t float_to_half(float f) { /* round to nearest even, overflow to inf, as the GPU's cvt.rn */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)(x >> 16 & 0x8000);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000u ? 0x200 : 0));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00); /* rounds past 65504 */
    if (ax < 0x38800000u) { /* subnormal or zero in fp16 */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint16_t)std::nearbyint(a * 0x1p24f));
    }
    uint32_t r = ax + 0xFFFu + (ax >> 13 & 1);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)(x >> 16 | 0x40);
    return (uint16_t)((x + 0x7FFFu + (x >> 16 & 1)) >> 16);
}

double load(const void *p, cudaDataType_t t, size_t i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    if (t == CUDA_R_16F) return half_to_float(((const uint16_t *)p)[i]);
    return bf16_to_float(((const uint16_t *)p)[i]);
}

void store(void *p, cudaDataType_t t, size_t i, double v) {
    const float f = (float)v;
    if (t == CUDA_R_32F) ((float *)p)[i] = f;
    else if (t == CUDA_R_16F) ((uint16_t *)p)[i] = float_to_half(f);
    else ((uint16_t *)p)[i] = float_to_bf16(f);
}

float tf32(float f) { /* round to 10 mantissa bits, nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7F800000u) != 0x7F800000u) x = (x + 0xFFFu + (x >> 13 & 1)) & ~0x1FFFu;
    memcpy(&f, &x, 4);
    return f;
}

/* op(X) [r, c] of a column-major stored matrix, as a dense row-major double array */
std::vector<double> gather_op(const void *p, const lt_layout &l, int32_t trans, uint64_t r, uint64_t c, bool round_tf32) {
    std::vector<double> out(r * c);
    for (uint64_t i = 0; i < r; i++)
        for (uint64_t j = 0; j < c; j++) {
            const size_t at = trans == CUBLAS_OP_N ? i + j * (size_t)l.ld : j + i * (size_t)l.ld;
            double v = load(p, l.type, at);
            if (round_tf32) v = tf32((float)v);
            out[i * c + j] = v;
        }
    return out;
}

cublasStatus_t check_shapes(const lt_desc &d, const lt_layout &a, const lt_layout &b, const lt_layout &c,
                             const lt_layout &dd, uint64_t *M, uint64_t *N, uint64_t *K) {
    const uint64_t am = d.transa == CUBLAS_OP_N ? a.rows : a.cols, ak = d.transa == CUBLAS_OP_N ? a.cols : a.rows;
    const uint64_t bk = d.transb == CUBLAS_OP_N ? b.rows : b.cols, bn = d.transb == CUBLAS_OP_N ? b.cols : b.rows;
    if (ak != bk || c.rows != am || c.cols != bn || dd.rows != am || dd.cols != bn) {
        std::fprintf(stderr, "cuda_emu: cuBLASLt shapes disagree: op(A) %llux%llu, op(B) %llux%llu, C %llux%llu\n",
                     (unsigned long long)am, (unsigned long long)ak, (unsigned long long)bk, (unsigned long long)bn,
                     (unsigned long long)c.rows, (unsigned long long)c.cols);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (a.type != b.type || c.type != dd.type || !type_size(a.type) || !type_size(c.type) ||
        (a.type == CUDA_R_32F && c.type != CUDA_R_32F) || (c.type != CUDA_R_32F && c.type != a.type) ||
        d.scale != CUDA_R_32F ||
        (d.compute != CUBLAS_COMPUTE_32F && d.compute != CUBLAS_COMPUTE_32F_FAST_TF32) ||
        (d.compute == CUBLAS_COMPUTE_32F_FAST_TF32 && a.type != CUDA_R_32F))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (d.epilogue != CUBLASLT_EPILOGUE_DEFAULT && d.epilogue != CUBLASLT_EPILOGUE_BIAS &&
        d.epilogue != CUBLASLT_EPILOGUE_RELU_BIAS && d.epilogue != CUBLASLT_EPILOGUE_RELU)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (d.bias_type != -1 && d.bias_type != (int32_t)dd.type) return CUBLAS_STATUS_NOT_SUPPORTED;
    *M = am, *N = bn, *K = ak;
    return CUBLAS_STATUS_SUCCESS;
}

} /* namespace */

extern "C" {

const char *cublasLtGetStatusName(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    default: return "CUBLAS_STATUS_INTERNAL_ERROR";
    }
}
const char *cublasLtGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid value was used as an argument";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the requested functionality is not supported";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    default: return "an internal operation failed";
    }
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    fork_guard("cublasLtCreate");
    *h = (cublasLtHandle_t) new int(1);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
    fork_guard("cublasLtDestroy");
    delete (int *)h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType_t scale) {
    fork_guard("cublasLtMatmulDescCreate");
    lt_desc *x = new lt_desc;
    x->compute = compute;
    x->scale = scale;
    *d = (cublasLtMatmulDesc_t)x;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    fork_guard("cublasLtMatmulDescDestroy");
    delete D(d);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t n) {
    fork_guard("cublasLtMatmulDescSetAttribute");
    lt_desc *x = D(d);
    void *field = nullptr;
    size_t size = 0;
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA: field = &x->transa, size = sizeof x->transa; break;
    case CUBLASLT_MATMUL_DESC_TRANSB: field = &x->transb, size = sizeof x->transb; break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE: field = &x->epilogue, size = sizeof x->epilogue; break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: field = &x->bias, size = sizeof x->bias; break;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: field = &x->bias_type, size = sizeof x->bias_type; break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (n != size || !buf) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(field, buf, n);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
    fork_guard("cublasLtMatrixLayoutCreate");
    *l = nullptr;
    if (!type_size(type) || ld < (int64_t)std::max<uint64_t>(rows, 1)) return CUBLAS_STATUS_INVALID_VALUE;
    *l = (cublasLtMatrixLayout_t) new lt_layout{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    fork_guard("cublasLtMatrixLayoutDestroy");
    delete L(l);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    fork_guard("cublasLtMatmulPreferenceCreate");
    *p = (cublasLtMatmulPreference_t) new lt_pref;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    fork_guard("cublasLtMatmulPreferenceDestroy");
    delete P(p);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t n) {
    fork_guard("cublasLtMatmulPreferenceSetAttribute");
    lt_pref *x = P(p);
    switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
        if (n != sizeof x->max_ws) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&x->max_ws, buf, n);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
        if (n != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
        const int i = attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES   ? 0
                      : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES ? 1
                      : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES ? 2
                                                                           : 3;
        memcpy(&x->align[i], buf, n);
        return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
        if (n != sizeof x->schemes) return CUBLAS_STATUS_INVALID_VALUE;
        memcpy(&x->schemes, buf, n);
        return CUBLAS_STATUS_SUCCESS;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
    }
}

/* An algorithm's configuration: split-K keeps its partial sums in the workspace (reduced into D
 * by a last pass, which writes nothing of D before it); CMLP_EMU_LT_INPLACE=1 says they are
 * summed in D itself instead (a pass before them may have written D). Other attributes: not
 * emulated. */
cublasStatus_t cublasLtMatmulAlgoConfigGetAttribute(const cublasLtMatmulAlgo_t *algo,
                                                    cublasLtMatmulAlgoConfigAttributes_t attr, void *buf, size_t size,
                                                    size_t *written) {
    fork_guard("cublasLtMatmulAlgoConfigGetAttribute");
    lt_algo al;
    memcpy(&al, algo->data, sizeof al);
    if (al.magic != ALGO_MAGIC || !buf || size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
    uint32_t v;
    if (attr == CUBLASLT_ALGO_CONFIG_SPLITK_NUM) v = al.scheme != CUBLASLT_REDUCTION_SCHEME_NONE ? 4 : 1;
    else if (attr == CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) v = al.scheme;
    else return CUBLAS_STATUS_NOT_SUPPORTED;
    memcpy(buf, &v, sizeof v);
    if (written) *written = sizeof v;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t *results, int *found) {
    fork_guard("cublasLtMatmulAlgoGetHeuristic");
    *found = 0;
    if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
    uint64_t M, N, K;
    cublasStatus_t s = check_shapes(*D(op), *L(a), *L(b), *L(c), *L(d), &M, &N, &K);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    const bool bias = D(op)->epilogue & CUBLASLT_EPILOGUE_BIAS;
    if (bias && !D(op)->bias) return CUBLAS_STATUS_INVALID_VALUE;
    /* as PyTorch has seen: a fused epilogue on a GEMM with a side of 1 (a row, a column, a sum of
     * one term) makes the heuristic fail with INVALID_VALUE, not answer "none" */
    if (D(op)->epilogue != CUBLASLT_EPILOGUE_DEFAULT && (M == 1 || N == 1 || K == 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    /* CMLP_EMU_LT_NO_EPILOGUE=1: no algorithm for a fused epilogue, as cuBLASLt may answer for
     * some mixes of types, layouts and alignments (the caller must do without it) */
    static const bool no_epilogue = [] {
        const char *v = std::getenv("CMLP_EMU_LT_NO_EPILOGUE");
        return v && std::strcmp(v, "1") == 0;
    }();
    if (no_epilogue && D(op)->epilogue != CUBLASLT_EPILOGUE_DEFAULT) return CUBLAS_STATUS_SUCCESS;
    /* CMLP_EMU_LT_NO_ALGO=1: no algorithm for any GEMM (the caller turns to cuBLAS) */
    static const bool no_algo = [] {
        const char *v = std::getenv("CMLP_EMU_LT_NO_ALGO");
        return v && std::strcmp(v, "1") == 0;
    }();
    if (no_algo) return CUBLAS_STATUS_SUCCESS;
    /* an algorithm may use vector accesses up to 16 bytes where the alignments allow them */
    lt_algo al{ALGO_MAGIC, {}, 0, CUBLASLT_REDUCTION_SCHEME_NONE};
    for (int i = 0; i < 4; i++) al.align[i] = std::min<uint32_t>(P(pref)->align[i], 16);
    /* the epilogue's bias is not among the alignment preferences: as on the hardware, a kernel
     * may read it 16 bytes at a time (PyTorch's addmm falls back below 16 bytes) */
    al.align[4] = bias ? 16u : 1u;
    /* a split-K algorithm keeps partial sums in the workspace: take up to 1 MiB of what is
     * allowed, and overwrite it on every call, so that anything else kept there is lost; with
     * CMLP_EMU_LT_INPLACE=1 it says it sums them in D instead, where the preference allows that
     * (else it splits nothing) */
    static const bool inplace = [] {
        const char *v = std::getenv("CMLP_EMU_LT_INPLACE");
        return v && std::strcmp(v, "1") == 0;
    }();
    al.scheme = inplace ? CUBLASLT_REDUCTION_SCHEME_INPLACE : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    al.workspace = std::min<uint64_t>(P(pref)->max_ws, (uint64_t)1 << 20);
    if (!al.workspace || !(P(pref)->schemes & al.scheme)) al.scheme = CUBLASLT_REDUCTION_SCHEME_NONE, al.workspace = 0;
    memset(&results[0], 0, sizeof results[0]);
    memcpy(results[0].algo.data, &al, sizeof al);
    results[0].workspaceSize = al.workspace;
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *found = 1;
    return CUBLAS_STATUS_SUCCESS;
}

} /* extern "C" */

namespace {

/* The module of cuBLAS (blas 1) or cuBLASLt (0) kernels a GEMM loads: one per epilogue, types and
 * size class (a power of two of the largest side: tiles differ). */
const void *blas_module(uint32_t epilogue, const lt_layout &a, const lt_layout &d, int blas) {
    const uint64_t side = std::max({a.rows, a.cols, d.rows, d.cols, (uint64_t)1});
    return (const void *)(1 + ((uintptr_t)blas << 32 | (uintptr_t)(63 - __builtin_clzll(side)) << 24 |
                               (uintptr_t)epilogue << 16 | (uintptr_t)a.type << 8 | d.type));
}

/* D = alpha op(A) op(B) + beta C (+ bias, ReLU) as one algorithm al runs it, queued on the
 * stream: cublasLtMatmul's and cublasGemmEx's work (who: which of them, for messages) */
cublasStatus_t matmul(const char *who, const lt_desc &desc, const lt_layout &la, const lt_layout &lb,
                      const lt_layout &lc, const lt_layout &ld, const lt_algo &al, const void *alpha, const void *A,
                      const void *B, const void *beta, const void *C, void *Dp, void *ws, size_t ws_bytes,
                      cudaStream_t stream) {
    std::lock_guard<std::recursive_mutex> g(gpu);
    uint64_t M, N, K;
    cublasStatus_t s = check_shapes(desc, la, lb, lc, ld, &M, &N, &K);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    const bool has_bias = desc.epilogue & CUBLASLT_EPILOGUE_BIAS;
    /* the bias epilogue fails to run on a GEMM with a side of 65535 x 32 or more, as reported of
     * the hardware (torch's addmm does without it there) */
    if (has_bias && std::max({M, N, K}) >= (uint64_t)65535 * 32) {
        std::fprintf(stderr, "cuda_emu: %s's bias epilogue on a side of 65535 x 32 or more\n", who);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    const void *ptrs[5] = {A, B, C, Dp, has_bias ? desc.bias : nullptr};
    const char *names[5] = {"A", "B", "C", "D", "bias"};
    for (int i = 0; i < 5; i++) {
        if (i == 4 && !has_bias) continue;
        if (!ptrs[i] || alignment(ptrs[i]) < al.align[i]) {
            std::fprintf(stderr, "cuda_emu: %s's %s (%p) is aligned to less than its algorithm assumes (%u)\n", who,
                         names[i], ptrs[i], al.align[i]);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
    }
    /* every element of the matrices and the bias is device memory */
    auto extent = [](const lt_layout &l) {
        return l.cols ? ((l.cols - 1) * (size_t)l.ld + l.rows) * type_size(l.type) : 0;
    };
    const float al_v = *(const float *)alpha, be_v = *(const float *)beta;
    const bool reads_c = be_v != 0.0f;
    if (!device_range(A, extent(la)) || !device_range(B, extent(lb)) || (reads_c && !device_range(C, extent(lc))) ||
        !device_range(Dp, extent(ld)) || (has_bias && !device_range(desc.bias, M * type_size(ld.type)))) {
        std::fprintf(stderr, "cuda_emu: %s on memory that is not the device's\n", who);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (C != Dp && reads_c) return CUBLAS_STATUS_NOT_SUPPORTED; /* not used: C is D */
    /* D is written while A, B and the bias are read, by many blocks: overlapping them races on a
     * GPU (the emulator reads everything first, so it checks instead) */
    auto overlaps = [&](const void *p, size_t n) {
        const char *q = (const char *)p, *dq = (const char *)Dp;
        return p && n && extent(ld) && q < dq + extent(ld) && dq < q + n;
    };
    if (overlaps(A, extent(la)) || overlaps(B, extent(lb)) ||
        (has_bias && overlaps(desc.bias, M * type_size(ld.type)))) {
        std::fprintf(stderr, "cuda_emu: %s's D overlaps an operand it reads\n", who);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const size_t ws_need = al.workspace;
    if (ws_need && (ws_bytes < ws_need || !device_range(ws, ws_need))) {
        std::fprintf(stderr, "cuda_emu: %s's workspace (%p, %zu bytes) is not %zu bytes of device memory\n", who,
                     ws, ws_bytes, (size_t)ws_need);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const bool round_tf32 = desc.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    cudaError_t queued = submit(stream, [=] {
        if (ws_need) memset(ws, 0xA5, ws_need);
        std::vector<double> x = gather_op(A, la, desc.transa, M, K, round_tf32);
        std::vector<double> y = gather_op(B, lb, desc.transb, K, N, round_tf32);
        std::vector<double> acc(M * N); /* row-major [M, N] */
        scipy_cblas_dgemm(101 /* row major */, 111, 111, (int)M, (int)N, (int)K, 1.0, x.data(), (int)K, y.data(),
                          (int)N, 0.0, acc.data(), (int)N);
        for (uint64_t i = 0; i < M; i++)
            for (uint64_t j = 0; j < N; j++) {
                const size_t at = i + j * (size_t)ld.ld;
                /* float arithmetic from the fp32 accumulator, as the epilogue does */
                float v = (float)al_v * (float)acc[i * N + j];
                if (reads_c) v += be_v * (float)load(C, lc.type, at);
                if (has_bias) v += (float)load(desc.bias, ld.type, i);
                if (desc.epilogue & CUBLASLT_EPILOGUE_RELU) v = std::fmax(v, 0.0f);
                store(Dp, ld.type, at, v);
            }
    }, who);
    if (queued != cudaSuccess) {
        cmlp_emu::set_last_error(queued);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

} /* namespace */

extern "C" {

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t op, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t a, const void *B, cublasLtMatrixLayout_t b, const void *beta,
                              const void *C, cublasLtMatrixLayout_t c, void *Dp, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t ws_bytes, cudaStream_t stream) {
    fork_guard("cublasLtMatmul");
    lt_algo al;
    memcpy(&al, algo->data, sizeof al);
    if (al.magic != ALGO_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
    /* the algorithm's kernels load on its first run on a device (lazy loading, with
     * CMLP_EMU_MODULE_BYTES): one module for each epilogue, types and size class (a power of
     * two of the largest side: tiles differ); where its memory is not free, the call fails to
     * execute, and cuBLAS has taken the launch's error */
    if (load_module(blas_module(D(op)->epilogue, *L(a), *L(d), 0)) != cudaSuccess)
        return CUBLAS_STATUS_EXECUTION_FAILED;
    /* CMLP_EMU_LT_FAIL=1: every call fails to execute, as on a device fault (not for memory) */
    static const bool fails = [] {
        const char *v = std::getenv("CMLP_EMU_LT_FAIL");
        return v && std::strcmp(v, "1") == 0;
    }();
    if (fails) return CUBLAS_STATUS_EXECUTION_FAILED;
    return matmul("cublasLtMatmul", *D(op), *L(a), *L(b), *L(c), *L(d), al, alpha, A, B, beta, C, Dp, ws, ws_bytes,
                  stream);
}

/* cuBLAS: a handle holds its stream and workspace; cublasGemmEx runs as a cuBLASLt GEMM with
 * no epilogue whose algorithm assumes no alignment beyond the elements' and takes up to 1 MiB
 * of the workspace set (which must be aligned to 256 bytes, as cuBLAS requires). */
struct blas_handle {
    cudaStream_t stream = nullptr;
    void *ws = nullptr;
    size_t ws_bytes = 0;
};

const char *cublasGetStatusString(cublasStatus_t s) { return cublasLtGetStatusString(s); }

cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
    fork_guard("cublasCreate");
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    *h = (cublasHandle_t) new blas_handle;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    fork_guard("cublasDestroy");
    delete (blas_handle *)h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
    fork_guard("cublasSetStream");
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    ((blas_handle *)h)->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void *ws, size_t bytes) {
    fork_guard("cublasSetWorkspace");
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if ((uintptr_t)ws % 256 || (bytes && !device_range(ws, bytes))) return CUBLAS_STATUS_INVALID_VALUE;
    ((blas_handle *)h)->ws = ws, ((blas_handle *)h)->ws_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t) {
    fork_guard("cublasSetMathMode");
    return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t) {
    fork_guard("cublasGemmEx");
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    const blas_handle &bh = *(const blas_handle *)h;
    if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    const uint64_t ar = transa == CUBLAS_OP_N ? m : k, br = transb == CUBLAS_OP_N ? k : n;
    if (lda < (int64_t)std::max<uint64_t>(ar, 1) || ldb < (int64_t)std::max<uint64_t>(br, 1) ||
        ldc < std::max(m, 1) || !type_size(Atype) || !type_size(Ctype))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    lt_desc desc;
    desc.compute = compute, desc.scale = CUDA_R_32F, desc.transa = transa, desc.transb = transb;
    const lt_layout la{Atype, ar, transa == CUBLAS_OP_N ? (uint64_t)k : (uint64_t)m, lda};
    const lt_layout lb{Btype, br, transb == CUBLAS_OP_N ? (uint64_t)n : (uint64_t)k, ldb};
    const lt_layout lc{Ctype, (uint64_t)m, (uint64_t)n, ldc};
    lt_algo al{ALGO_MAGIC, {1, 1, 1, 1, 1}, std::min<uint64_t>(bh.ws_bytes, (uint64_t)1 << 20),
               CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE};
    if (load_module(blas_module(CUBLASLT_EPILOGUE_DEFAULT, la, lc, 1)) != cudaSuccess)
        return CUBLAS_STATUS_EXECUTION_FAILED; /* (as cublasLtMatmul's) */
    return matmul("cublasGemmEx", desc, la, lb, lc, lc, al, alpha, A, B, beta, C, C, bh.ws, bh.ws_bytes, bh.stream);
}

} /* extern "C" */

/* ---- NCCL over MPI (built where MPI is: CMLP_EMU_MPI) ----
 * The emulated backend's data parallelism: cmlp loads this library as NCCL too (tests set
 * CMLP_NCCL_LIBRARY to it). A communicator is a duplicate of MPI_COMM_WORLD; ncclAllReduce
 * (ncclBroadcast) checks its arguments as NCCL would and queues an MPI_Allreduce (MPI_Bcast)
 * on the stream like a kernel
 * (run when the host waits for the stream, recorded by a capture, repeated by each replay).
 * ncclCommInitRank checks that every rank was given rank 0's id and its own rank, and each sum
 * that every rank made it the same way (NCCL's rule: an operation is captured in a graph on
 * every rank or on none; a mix aborts the job). A group of one needs no MPI (cmlp's group of
 * one without a launcher): its sum is a copy. */
#ifdef CMLP_EMU_MPI
#include <mpi.h>

#define NCCL_EMU_API extern "C" __attribute__((visibility("default")))

namespace {
struct nccl_uid {
    char internal[128];
};
struct nccl_comm {
    MPI_Comm comm;
    size_t connected = 0; /* device bytes its connections hold (CMLP_EMU_NCCL_CONNECT_BYTES) */
    int device = 0;
};
std::set<nccl_comm *> live_comms; /* a sum queued or replayed on a destroyed one aborts */
enum { NCCL_OK = 0, NCCL_INTERNAL = 3, NCCL_INVALID_ARGUMENT = 4, NCCL_INVALID_USAGE = 5 };
} /* namespace */

NCCL_EMU_API int ncclGetUniqueId(nccl_uid *id) {
    fork_guard("ncclGetUniqueId");
    static int made;
    if (!id) return NCCL_INVALID_ARGUMENT;
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "cmlp-emu-nccl pid %ld id %d", (long)getpid(), ++made);
    return NCCL_OK;
}

NCCL_EMU_API int ncclCommInitRank(void **comm, int nranks, nccl_uid id, int rank) {
    fork_guard("ncclCommInitRank");
    int on = 0, world_rank = -1, world_size = 0;
    if (!comm || MPI_Initialized(&on) != MPI_SUCCESS) return NCCL_INVALID_USAGE;
    if (!on) { /* a group of one */
        if (nranks != 1 || rank != 0) return NCCL_INVALID_USAGE;
        nccl_comm *c = new nccl_comm{MPI_COMM_NULL};
        live_comms.insert(c);
        *comm = c;
        return NCCL_OK;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    if (nranks != world_size || rank != world_rank) {
        fprintf(stderr, "nccl_emu: ncclCommInitRank(nranks %d, rank %d) in a world of %d where this is rank %d\n",
                nranks, rank, world_size, world_rank);
        return NCCL_INVALID_ARGUMENT;
    }
    nccl_uid root = id;
    MPI_Bcast(&root, sizeof root, MPI_BYTE, 0, MPI_COMM_WORLD);
    int same = memcmp(&root, &id, sizeof id) == 0;
    MPI_Allreduce(MPI_IN_PLACE, &same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!same) {
        fprintf(stderr, "nccl_emu: the ranks were given different ids\n");
        return NCCL_INVALID_ARGUMENT;
    }
    nccl_comm *c = new nccl_comm;
    if (MPI_Comm_dup(MPI_COMM_WORLD, &c->comm) != MPI_SUCCESS) {
        delete c;
        return NCCL_INTERNAL;
    }
    live_comms.insert(c);
    *comm = c;
    return NCCL_OK;
}

/* CMLP_EMU_NCCL_STALL=r:n[:queued]: on world rank r, the n-th collective queued or recorded (from
 * 1) never ends; with :queued it is left in the stream's queue (the host goes on, as on a GPU,
 * and a wait for it never ends), else the call that runs it never returns. */
static int stalls_here() {
    static int queued;
    int rank = -1, n = 0, me = 0, on = 0;
    char how[16] = "";
    const char *v = getenv("CMLP_EMU_NCCL_STALL");
    ++queued;
    if (!v || sscanf(v, "%d:%d:%15s", &rank, &n, how) < 2) return 0;
    if (MPI_Initialized(&on) == MPI_SUCCESS && on) MPI_Comm_rank(MPI_COMM_WORLD, &me);
    return me == rank && queued == n ? (strcmp(how, "queued") == 0 ? 2 : 1) : 0;
}

/* Queues a collective's MPI work on the stream, after the checks every collective makes. */
template <class F>
static int queue_collective(const char *name, const void *send, void *recv, size_t count, void *comm,
                            cudaStream_t stream, F mpi_work) {
    std::lock_guard<std::recursive_mutex> g(gpu);
    if (!device_range(send, count * 4) || !device_range(recv, count * 4)) {
        fprintf(stderr, "nccl_emu: %s of %zu floats from %p to %p: not device memory\n", name, count, send, recv);
        return NCCL_INVALID_ARGUMENT;
    }
    nccl_comm *nc = static_cast<nccl_comm *>(comm);
    if (!live_comms.count(nc)) {
        fprintf(stderr, "nccl_emu: %s on a destroyed communicator\n", name);
        return NCCL_INVALID_ARGUMENT;
    }
    /* CMLP_EMU_NCCL_CONNECT_BYTES=n: a communicator's first collective connects its peers (NCCL's
     * runtime connection, from 2.22), whose buffers take n bytes of the device's memory outside
     * any allocator; where they are not free it fails, as NCCL's does (ncclUnhandledCudaError) */
    static const size_t connect_bytes = env_size("CMLP_EMU_NCCL_CONNECT_BYTES", 0);
    if (connect_bytes && !nc->connected) {
        const int d = cur_dev();
        if (connect_bytes > capacity() - std::min(capacity(), used[d])) return 1;
        used[d] += connect_bytes;
        nc->connected = connect_bytes;
        nc->device = d;
    }
    MPI_Comm mc = nc->comm;
    const int in_graph = resolve(stream)->capturing;
    if (in_graph) origin(resolve(stream))->cap.graph->comms.insert(nc);
    const int stall = stalls_here();
    cudaError_t e = submit(stream, [=] {
        if (!live_comms.count(nc)) { /* a graph replayed after its communicator was destroyed */
            fprintf(stderr, "nccl_emu: %s replayed on a destroyed communicator\n", name);
            abort();
        }
        while (stall) pause(); /* a device stuck in it: nothing it holds is let go */
        if (mc == MPI_COMM_NULL) {
            memmove(recv, send, count * 4);
            return;
        }
        int how[2] = {in_graph, -in_graph};
        MPI_Allreduce(MPI_IN_PLACE, how, 2, MPI_INT, MPI_MAX, mc);
        if (how[0] != -how[1]) {
            fprintf(stderr, "nccl_emu: %s captured in a graph on some ranks and not on others\n", name);
            MPI_Abort(MPI_COMM_WORLD, 3);
        }
        mpi_work(mc);
    }, name);
    if (e == cudaSuccess && !in_graph && stall != 2) flush(resolve(stream)); /* it runs without the host */
    return e == cudaSuccess ? NCCL_OK : NCCL_INVALID_USAGE;
}

NCCL_EMU_API int ncclAllReduce(const void *send, void *recv, size_t count, int type, int op, void *comm,
                               cudaStream_t stream) {
    fork_guard("ncclAllReduce");
    if (type != 7 /* ncclFloat32 */ || op != 0 /* ncclSum */ || !comm || count > (size_t)INT32_MAX)
        return NCCL_INVALID_ARGUMENT;
    return queue_collective("ncclAllReduce", send, recv, count, comm, stream, [=](MPI_Comm mc) {
        MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv, (int)count, MPI_FLOAT, MPI_SUM, mc);
    });
}

/* sendbuff is read on the root only; every rank's recvbuff receives it. */
NCCL_EMU_API int ncclBroadcast(const void *send, void *recv, size_t count, int type, int root, void *comm,
                               cudaStream_t stream) {
    fork_guard("ncclBroadcast");
    if (type != 7 /* ncclFloat32 */ || !comm || count > (size_t)INT32_MAX || root < 0) return NCCL_INVALID_ARGUMENT;
    nccl_comm *nc = static_cast<nccl_comm *>(comm);
    int size = 1;
    if (live_comms.count(nc) && nc->comm != MPI_COMM_NULL) MPI_Comm_size(nc->comm, &size);
    if (root >= size) return NCCL_INVALID_ARGUMENT;
    return queue_collective("ncclBroadcast", send, recv, count, comm, stream, [=](MPI_Comm mc) {
        int me = 0;
        MPI_Comm_rank(mc, &me);
        if (me == root && send != recv) memmove(recv, send, count * 4);
        MPI_Bcast(recv, (int)count, MPI_FLOAT, root, mc);
    });
}

/* The sum reaches the root's recvbuff; a rank other than the root gets nothing, and here its
 * recvbuff is filled with NaN, so that what reads a part it does not own shows at once. */
NCCL_EMU_API int ncclReduce(const void *send, void *recv, size_t count, int type, int op, int root, void *comm,
                            cudaStream_t stream) {
    fork_guard("ncclReduce");
    if (type != 7 /* ncclFloat32 */ || op != 0 /* ncclSum */ || !comm || count > (size_t)INT32_MAX || root < 0)
        return NCCL_INVALID_ARGUMENT;
    nccl_comm *nc = static_cast<nccl_comm *>(comm);
    int size = 1;
    if (live_comms.count(nc) && nc->comm != MPI_COMM_NULL) MPI_Comm_size(nc->comm, &size);
    if (root >= size) return NCCL_INVALID_ARGUMENT;
    return queue_collective("ncclReduce", send, recv, count, comm, stream, [=](MPI_Comm mc) {
        int me = 0;
        MPI_Comm_rank(mc, &me);
        if (me == root) {
            MPI_Reduce(send == recv ? MPI_IN_PLACE : send, recv, (int)count, MPI_FLOAT, MPI_SUM, root, mc);
            return;
        }
        MPI_Reduce(send, nullptr, (int)count, MPI_FLOAT, MPI_SUM, root, mc);
        float *out = static_cast<float *>(recv);
        for (size_t i = 0; i < count; i++) out[i] = NAN;
    });
}

/* Collectives in a group are queued in the order they were called, which every rank shares. */
static int group_depth;
NCCL_EMU_API int ncclGroupStart(void) {
    fork_guard("ncclGroupStart");
    group_depth++;
    return NCCL_OK;
}
NCCL_EMU_API int ncclGroupEnd(void) {
    fork_guard("ncclGroupEnd");
    if (group_depth == 0) return NCCL_INVALID_USAGE;
    group_depth--;
    return NCCL_OK;
}

/* The version the emulated NCCL claims: 2.21.5, or $CMLP_EMU_NCCL_VERSION (NCCL's code). */
NCCL_EMU_API int ncclGetVersion(int *version) {
    fork_guard("ncclGetVersion");
    if (!version) return NCCL_INVALID_ARGUMENT;
    const char *v = getenv("CMLP_EMU_NCCL_VERSION");
    *version = v && v[0] ? atoi(v) : 22105;
    return NCCL_OK;
}

NCCL_EMU_API int ncclCommDestroy(void *comm) {
    fork_guard("ncclCommDestroy");
    if (!comm) return NCCL_INVALID_ARGUMENT;
    flush_all(); /* its queued work runs first, as NCCL's does */
    nccl_comm *c = static_cast<nccl_comm *>(comm);
    /* NCCL's destroy waits until every graph holding the communicator's collectives is gone: one
     * still instantiated would make it wait for ever (here the job ends, saying so) */
    for (const graph_t *gr : live_execs)
        if (gr->comms.count(c)) {
            fprintf(stderr, "nccl_emu: ncclCommDestroy of a communicator that a CUDA graph not yet destroyed holds "
                            "collectives of (NCCL would wait for that graph's end for ever)\n");
            abort();
        }
    if (!live_comms.erase(c)) return NCCL_INVALID_ARGUMENT;
    used[c->device] -= c->connected;
    if (c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);
    delete c;
    return NCCL_OK;
}

NCCL_EMU_API const char *ncclGetErrorString(int r) {
    switch (r) {
    case NCCL_OK: return "no error";
    case 1: return "unhandled cuda error (emulated NCCL: its connections found no device memory)";
    case NCCL_INTERNAL: return "internal error (emulated NCCL)";
    case NCCL_INVALID_ARGUMENT: return "invalid argument (emulated NCCL)";
    case NCCL_INVALID_USAGE: return "invalid usage (emulated NCCL)";
    }
    return "unknown result (emulated NCCL)";
}
#endif

/* ---- NVML: the GPUs' count and UUIDs, without the runtime (no fork_guard: NVML is not CUDA) ---- */

extern "C" {

__attribute__((visibility("default"))) int nvmlInit_v2(void) {
    const char *v = getenv("CMLP_EMU_NVML_FAIL");
    return v && v[0] == '1' ? 9 /* NVML_ERROR_DRIVER_NOT_LOADED */ : 0;
}
__attribute__((visibility("default"))) int nvmlShutdown(void) { return 0; }
__attribute__((visibility("default"))) int nvmlDeviceGetCount_v2(unsigned *count) {
    if (!count) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *count = (unsigned)env_size("CMLP_EMU_NVML_DEVICES", (size_t)device_count());
    return 0;
}
__attribute__((visibility("default"))) int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **device) {
    unsigned n = 0;
    nvmlDeviceGetCount_v2(&n);
    if (!device || index >= n) return 2;
    *device = reinterpret_cast<void *>((uintptr_t)index + 1);
    return 0;
}
__attribute__((visibility("default"))) int nvmlDeviceGetHandleByUUID(const char *uuid, void **device) {
    unsigned n = 0;
    nvmlDeviceGetCount_v2(&n);
    char mine[96];
    /* CMLP_EMU_MIG=1: each device is a MIG instance, whose UUID (CUDA's too) NVML names "MIG-..." */
    const char *mig = getenv("CMLP_EMU_MIG");
    const char *kind = mig && mig[0] ? "MIG" : "GPU";
    for (unsigned i = 0; uuid && device && i < n; i++) {
        std::snprintf(mine, sizeof mine, "%s-7e57%04x-0000-4000-8000-%012x", kind, i, i * 7919u);
        if (std::strcmp(mine, uuid) == 0) {
            *device = reinterpret_cast<void *>((uintptr_t)i + 1);
            return 0;
        }
    }
    return 6; /* NVML_ERROR_NOT_FOUND */
}
struct nvml_process_emu {
    unsigned int pid;
    unsigned long long used;
    unsigned int gpu_instance, compute_instance;
};
__attribute__((visibility("default"))) int nvmlDeviceGetComputeRunningProcesses_v2(void *device, unsigned *count,
                                                                                  nvml_process_emu *infos) {
    if (!device || !count) return 2;
    const int d = (int)(reinterpret_cast<uintptr_t>(device) - 1);
    std::vector<nvml_process_emu> all;
    {
        std::lock_guard<std::recursive_mutex> g(gpu);
        all.push_back({(unsigned)getpid(), (unsigned long long)(used[d] + (256u << 20)), ~0u, ~0u});
    }
    const char *v = getenv("CMLP_EMU_NVML_PROCESSES");
    for (const char *p = v; p && *p;) {
        char *end = nullptr;
        const unsigned long pid = std::strtoul(p, &end, 10);
        if (*end != ':') break;
        const unsigned long long bytes = std::strtoull(end + 1, &end, 10);
        all.push_back({(unsigned)pid, bytes, ~0u, ~0u});
        p = *end == ',' ? end + 1 : end;
    }
    const unsigned room = *count;
    *count = (unsigned)all.size();
    if (room < all.size()) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    if (!all.empty()) std::memcpy(infos, all.data(), all.size() * sizeof all[0]);
    return 0;
}
/* as the drivers after R535 fill it (R535's own entries were 32 bytes) */
__attribute__((visibility("default"))) int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned *count,
                                                                                  nvml_process_emu *infos) {
    return nvmlDeviceGetComputeRunningProcesses_v2(device, count, infos);
}
__attribute__((visibility("default"))) int nvmlDeviceGetUUID(void *device, char *uuid, unsigned length) {
    if (!device || !uuid) return 2;
    const unsigned i = (unsigned)(reinterpret_cast<uintptr_t>(device) - 1);
    if (length < 41) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    std::snprintf(uuid, length, "GPU-7e57%04x-0000-4000-8000-%012x", i, i * 7919u);
    return 0;
}

} /* extern "C" */

/* ---- for tests: contexts of the driver API ---- */

/* A new context on device d, made current (as cuCtxCreate); its memory lives as long as the
 * process, so that a destroyed one is still known as such. */
extern "C" __attribute__((visibility("default"))) void *cmlp_emu_ctx_create(int d) {
    CUctx_st *c = new CUctx_st{d, false, false};
    current_ctx = c;
    return c;
}
/* Destroys a context of cmlp_emu_ctx_create (as cuCtxDestroy): no longer current on this thread,
 * and its streams refuse work. */
extern "C" __attribute__((visibility("default"))) void cmlp_emu_ctx_destroy(void *ctx) {
    CUctx_st *c = (CUctx_st *)ctx;
    if (!c || c->primary) return;
    c->destroyed = true;
    if (current_ctx == c) current_ctx = nullptr;
}
extern "C" __attribute__((visibility("default"))) void *cmlp_emu_ctx_current(void) { return current_ctx; }
