/* backend_cuda.c - the CUDA backend: one stream per device, GEMMs through cuBLASLt, the
 * kernels of kernels/, raw memory from cudaMalloc and expandable segments on the driver's
 * virtual memory API. It is built into its own shared library (_cmlp_cuda.so), which the core
 * loads on first use (cuda_loader.c), so that cmlp imports where there is no CUDA at all.
 *
 * It calls nothing of the core but the error recorder handed to cmlp_cuda_entry. Every CUDA,
 * driver and cuBLASLt call is checked; a failure becomes CMLP_ERR_DEVICE carrying CUDA's
 * message (or CMLP_ERR_OOM, with nothing recorded, where the allocator expects that).
 * CMLP_CUDA_SYNC=1 synchronises after every operation, so that an error names its operation.
 */
#include "backend.h"
#include "kernels.h"

#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static cmlp_error_fn record_error;

#define FAIL(st, ...) record_error((st), __FILE__, __LINE__, __VA_ARGS__)

#define CU_TRY(call)                                                                                           \
    do {                                                                                                       \
        cudaError_t e_ = (call);                                                                               \
        if (e_ != cudaSuccess) return cuda_fail(e_, #call, __FILE__, __LINE__);                                \
    } while (0)

#define LT_TRY(call)                                                                                           \
    do {                                                                                                       \
        cublasStatus_t s_ = (call);                                                                            \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                     \
            (void)cudaGetLastError(); /* a failed launch inside cuBLASLt is not the next kernel's error */     \
            return record_error(CMLP_ERR_DEVICE, __FILE__, __LINE__, "%s failed: %s (%s)", #call,             \
                                cublasLtGetStatusString(s_), cublasLtGetStatusName(s_));                       \
        }                                                                                                      \
    } while (0)

static cmlp_status cuda_fail(cudaError_t e, const char *what, const char *file, int line) {
    (void)cudaGetLastError(); /* clears a non-sticky error; a sticky one stays and says so again */
    return record_error(CMLP_ERR_DEVICE, file, line, "%s failed: %s (%s)", what, cudaGetErrorString(e),
                        cudaGetErrorName(e));
}

/* ---- the driver's virtual memory API, reached through the runtime (no link to libcuda) ---- */

typedef CUresult (*fn_mem_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                  unsigned long long);
typedef CUresult (*fn_mem_release)(CUmemGenericAllocationHandle);
typedef CUresult (*fn_mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*fn_mem_unmap)(CUdeviceptr, size_t);
typedef CUresult (*fn_mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*fn_mem_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*fn_mem_free_range)(CUdeviceptr, size_t);
typedef CUresult (*fn_mem_granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*fn_get_error_string)(CUresult, const char **);

static struct {
    fn_mem_create create;
    fn_mem_release release;
    fn_mem_map map;
    fn_mem_unmap unmap;
    fn_mem_set_access set_access;
    fn_mem_reserve reserve;
    fn_mem_free_range free_range;
    fn_mem_granularity granularity;
    fn_get_error_string error_string;
    bool ok;
} vmm;

static pthread_once_t vmm_once = PTHREAD_ONCE_INIT;

static void *driver_symbol(const char *name) {
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return fn;
}

static void vmm_load(void) {
    vmm.create = (fn_mem_create)driver_symbol("cuMemCreate");
    vmm.release = (fn_mem_release)driver_symbol("cuMemRelease");
    vmm.map = (fn_mem_map)driver_symbol("cuMemMap");
    vmm.unmap = (fn_mem_unmap)driver_symbol("cuMemUnmap");
    vmm.set_access = (fn_mem_set_access)driver_symbol("cuMemSetAccess");
    vmm.reserve = (fn_mem_reserve)driver_symbol("cuMemAddressReserve");
    vmm.free_range = (fn_mem_free_range)driver_symbol("cuMemAddressFree");
    vmm.granularity = (fn_mem_granularity)driver_symbol("cuMemGetAllocationGranularity");
    vmm.error_string = (fn_get_error_string)driver_symbol("cuGetErrorString");
    vmm.ok = vmm.create && vmm.release && vmm.map && vmm.unmap && vmm.set_access && vmm.reserve && vmm.free_range &&
             vmm.granularity;
}

/* The driver's current context of the calling thread: what a call from Python finds is put
 * back after it (ctx_save / ctx_restore, as torch's device guards put the device back), and
 * use() checks it, since a context another library made current on the thread (the same device
 * or not) is not the one this backend's streams and memory belong to. */
typedef CUresult (*fn_ctx_get)(CUcontext *);
typedef CUresult (*fn_ctx_set)(CUcontext);
static fn_ctx_get ctx_get;
static fn_ctx_set ctx_set;
static pthread_once_t ctx_once = PTHREAD_ONCE_INIT;

static void ctx_load(void) {
    fn_ctx_get get = (fn_ctx_get)driver_symbol("cuCtxGetCurrent");
    fn_ctx_set set = (fn_ctx_set)driver_symbol("cuCtxSetCurrent");
    if (get && set) {
        ctx_get = get;
        ctx_set = set;
    }
}

/* The thread's current context, NULL when it has none or that cannot be told. */
static CUcontext ctx_current(void) {
    pthread_once(&ctx_once, ctx_load);
    CUcontext c = NULL;
    if (!ctx_get || ctx_get(&c) != CUDA_SUCCESS) return NULL;
    return c;
}

static cmlp_status drv_fail(CUresult r, const char *what, const char *file, int line) {
    const char *msg = NULL;
    if (!vmm.error_string || vmm.error_string(r, &msg) != CUDA_SUCCESS || !msg) msg = "unknown driver error";
    return record_error(CMLP_ERR_DEVICE, file, line, "%s failed: %s (CUresult %d)", what, msg, (int)r);
}

#define DRV_TRY(call)                                                                                          \
    do {                                                                                                       \
        CUresult r_ = (call);                                                                                  \
        if (r_ != CUDA_SUCCESS) return drv_fail(r_, #call, __FILE__, __LINE__);                               \
    } while (0)

/* The page of expandable segments: the allocator maps and unmaps 2 MiB pages. */
#define VM_PAGE ((size_t)2 << 20)

/* ---- the per-device context ---- */

typedef struct {
    uint64_t key[8];
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    bool used;
    bool none; /* cuBLASLt has no algorithm for this key (a fused epilogue's caller does without it) */
} gemm_plan;

#define NPLANS 64
#define STAGE_SLOTS 4

typedef struct {
    int index;
    void *nvml_dev; /* the GPU's NVML handle, found by UUID on first use (atomic) */
    cudaStream_t stream;
    /* the second stream, made on first use, with the events that fork work to it and join it
     * back (under the lock); two_streams is 0 where CMLP_CUDA_STREAMS=1 keeps all on one */
    cudaStream_t side;
    cudaEvent_t side_fork, side_done;
    int two_streams;
    cublasLtHandle_t lt;
    pthread_mutex_t lock; /* the scratch, the staging buffers, the plan cache, the second stream */
    void *ws;             /* the GEMM workspace of the first stream, from the allocator */
    size_t ws_bytes;
    /* the second stream's, from the end of the same block: one for work queued to it, one for
     * the second branch of captured graphs, which replay beside other threads' second-stream
     * work (graphs replay one after another on the first stream) */
    void *ws_side, *ws_graph_side;
    size_t ws_side_bytes;
    /* a fused bias epilogue may read its bias 16 bytes at a time, whatever the alignment
     * preferences say (they cover A, B, C and D only): a bias on a smaller alignment is copied
     * here first, in the first stream's order (the last BIAS_SLOT bytes of its workspace) */
    void *bias_slot;
    /* the loss kernel's scratch, so that a loss total has the same bits in every run (before
     * the bias slot; used in the first stream's order; NULL: its counter could not be zeroed) */
    void *xent_slot;
    /* pinned staging for host data: a ring of slots, each reused once the copy that last read
     * it has finished (its event), so that staging waits for the GPU only when it is behind */
    void *h_stage[STAGE_SLOTS];
    size_t h_stage_bytes[STAGE_SLOTS];
    cudaEvent_t h_stage_done[STAGE_SLOTS];
    bool h_stage_used[STAGE_SLOTS];
    int h_stage_next;
    bool vm_ok;
    bool sync_each;
    int tf32;
    gemm_plan plans[NPLANS];
    int next_plan;
    size_t first_ws; /* the first stream's share of the workspace block, slots included */
    CUcontext cuctx; /* the device's primary context (NULL: not known, use() goes by the device) */
} cuda_ctx;

/* The workspace block: the first stream's share (first_ws: 8 MiB, 32 MiB on compute
 * capability 9.x to 12.x, as torch sizes cuBLAS's; with CUBLASLT_WORKSPACE_SIZE, that many KiB
 * plus the slots), the last BIAS_SLOT + XENT_SLOT of it the kernels' slots, then the second
 * stream's two shares (its GEMMs have few rows to sum, CMLP_SIDE_ROWS, and its bias gradients
 * few partial sums). */
#define SIDE_WORKSPACE ((size_t)1 << 20)
#define BIAS_SLOT ((size_t)256 << 10) /* 64Ki fp32 or 128Ki half values */
#define XENT_SLOT (((size_t)CMLP_K_XENT_SCRATCH + 255) & ~(size_t)255)
#define FIRST_WS_MAX_KIB (4 << 20) /* 4 GiB */

/* ---- graph capture ----
 * A thread captures on a stream of its own (made for the capture), so that other threads'
 * work on the device's stream is neither recorded into its graph nor able to break the
 * capture; the graph is then launched on the device's stream, after the work queued there.
 * While capturing, the thread's work goes to that stream, nothing may allocate or wait for
 * the device (refused with an error), and memory given back is given back after the capture. */
typedef struct {
    int kind; /* 0: raw_free, 1: vm_unmap, 2: vm_release */
    void *ctx; /* the device it belongs to (any device: CUDA's rule is per thread) */
    void *ptr;
    size_t nbytes;
} deferred_op;

static __thread cuda_ctx *cap_ctx; /* the context this thread is capturing on, if any */
static __thread cudaStream_t cap_stream;
/* the capture's second stream and its events; cap_forked: work was forked to it and is not
 * joined back yet (a capture must end joined) */
static __thread cudaStream_t cap_side;
static __thread cudaEvent_t cap_fork, cap_done;
static __thread bool cap_forked;
static __thread deferred_op *deferred;
static __thread int ndeferred, cap_deferred;
/* The device whose second stream this thread queues its work to (stream_side), if any. */
static __thread const void *side_ctx;

static bool capturing(const cuda_ctx *c) { return cap_ctx == c; }
/* While a thread captures, what would allocate, free or wait breaks its capture on any device. */
static bool thread_capturing(void) { return cap_ctx != NULL; }
static bool on_side(const cuda_ctx *c) { return side_ctx == c; }
static cudaStream_t stream_of(const cuda_ctx *c) {
    if (cap_ctx == c) return on_side(c) ? cap_side : cap_stream;
    return on_side(c) ? c->side : c->stream;
}

#define REFUSE_WHILE_CAPTURING(c, what)                                                                       \
    do {                                                                                                       \
        if (thread_capturing())                                                                                \
            return FAIL(CMLP_ERR_DEVICE, "%s on cuda:%d while a training step is being captured as a graph",  \
                        (what), (c)->index);                                                                   \
    } while (0)

/* Memory given back during a capture: kept until the capture ends. With no host memory left to
 * note it, it is kept for good (a leak, but freeing it now would break the capture). */
static void defer(int kind, void *ctx, void *ptr, size_t nbytes) {
    if (ndeferred == cap_deferred) {
        int cap = cap_deferred ? 2 * cap_deferred : 16;
        deferred_op *d = realloc(deferred, (size_t)cap * sizeof *d);
        if (!d) return;
        deferred = d;
        cap_deferred = cap;
    }
    deferred[ndeferred++] = (deferred_op){kind, ctx, ptr, nbytes};
}

/* A child forked from this process cannot use the CUDA that the parent started (the driver
 * does not survive fork): from the fork on, every call in the child is refused, and what the
 * parent's memory and graphs would give back is left alone. */
static bool started, forked; /* started: the driver was asked for the devices */
static void mark_forked(void) { forked = started; }

/* Makes c's device current on this thread. cudaSetDevice also makes its primary context
 * current, which the driver API calls (the VMM path) need and cudaGetDevice does not give: so a
 * thread sets it at least once (bound_device), and again whenever it changes devices. */
static __thread int bound_device = -1;

static cmlp_status use(cuda_ctx *c) {
    if (forked) return FAIL(CMLP_ERR_DEVICE, "cuda:%d: " CMLP_CUDA_FORKED_TEXT, c->index);
    if (c->cuctx) { /* the device's primary context, or it is made current */
        if (ctx_current() == c->cuctx) return CMLP_OK;
        CU_TRY(cudaSetDevice(c->index));
        bound_device = c->index;
        if (ctx_current() != c->cuctx) DRV_TRY(ctx_set(c->cuctx));
        return CMLP_OK;
    }
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess) (void)cudaGetLastError();
    if (cur != c->index || bound_device != c->index) {
        CU_TRY(cudaSetDevice(c->index));
        bound_device = c->index;
    }
    return CMLP_OK;
}

#define CMLP_TRY_USE(c)                                                                                        \
    do {                                                                                                       \
        cmlp_status u_ = use(c);                                                                               \
        if (u_ != CMLP_OK) return u_;                                                                          \
    } while (0)

/* After enqueuing work: the launch error, or with CMLP_CUDA_SYNC=1 the execution error too. */
static cmlp_status done(cuda_ctx *c, cudaError_t launch, const char *what) {
    if (launch != cudaSuccess) return cuda_fail(launch, what, __FILE__, __LINE__);
    if (c->sync_each && !thread_capturing()) {
        cudaError_t e = cudaStreamSynchronize(stream_of(c));
        if (e != cudaSuccess) return cuda_fail(e, what, __FILE__, __LINE__);
    }
    return CMLP_OK;
}

#define KERNEL(c, call) done((c), (call), #call)

static int env_flag(const char *name) {
    const char *v = getenv(name);
    return v && v[0] && strcmp(v, "0") != 0;
}

static void cu_close(void *ctx) {
    cuda_ctx *c = ctx;
    if (!c) return;
    if (c->lt) cublasLtDestroy(c->lt);
    if (c->stream) cudaStreamDestroy(c->stream);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* CUBLASLT_WORKSPACE_SIZE, the KiB cuBLASLt gets on the first stream (torch's variable): -1 when
 * it is not set, else a whole number from 0 to FIRST_WS_MAX_KIB (any other value fails the
 * device's opening, before it touches the GPU). */
static cmlp_status workspace_env(long long *kib) {
    const char *env = getenv("CUBLASLT_WORKSPACE_SIZE");
    *kib = -1;
    if (!env || !env[0]) return CMLP_OK;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(env, &end, 10);
    while (end && (*end == ' ' || *end == '\t')) end++;
    if (errno || !end || *end || end == env || v < 0 || v > FIRST_WS_MAX_KIB)
        return FAIL(CMLP_ERR_INVALID,
                    "CUBLASLT_WORKSPACE_SIZE=%.40s: expected the KiB of cuBLASLt's workspace on the first stream, a "
                    "whole number from 0 to %d",
                    env, FIRST_WS_MAX_KIB);
    *kib = v;
    return CMLP_OK;
}

/* The first stream's share of the workspace block: the KiB asked for plus the kernels' slots,
 * or torch's size for cuBLAS on this architecture (the slots inside it). */
static cmlp_status first_workspace(int index, long long kib, size_t *out) {
    if (kib >= 0) {
        *out = ((size_t)kib << 10) + BIAS_SLOT + XENT_SLOT;
        return CMLP_OK;
    }
    struct cudaDeviceProp p;
    CU_TRY(cudaGetDeviceProperties(&p, index));
    bool large = p.major >= 9 && p.major <= 12; /* Hopper, Blackwell and Thor */
    *out = (size_t)(large ? 32 : 8) << 20;
    return CMLP_OK;
}

static cmlp_status cu_open(int index, void **out) {
    cuda_ctx *c = calloc(1, sizeof *c);
    if (!c) return FAIL(CMLP_ERR_OOM, "out of host memory opening cuda:%d", index);
    c->index = index;
    pthread_mutex_init(&c->lock, NULL);
    c->sync_each = env_flag("CMLP_CUDA_SYNC");
    c->tf32 = env_flag("CMLP_ALLOW_TF32");
    const char *streams = getenv("CMLP_CUDA_STREAMS");
    c->two_streams = !(streams && strcmp(streams, "1") == 0);
    long long ws_kib = -1;
    cmlp_status st = workspace_env(&ws_kib);
    if (st != CMLP_OK) {
        cu_close(c);
        return st;
    }
    cudaError_t e = cudaSetDevice(index);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        st = cuda_fail(e, "opening the device (cudaSetDevice, stream)", __FILE__, __LINE__);
    } else {
        cublasStatus_t s = cublasLtCreate(&c->lt);
        if (s != CUBLAS_STATUS_SUCCESS)
            st = FAIL(CMLP_ERR_DEVICE, "cublasLtCreate failed on cuda:%d: %s", index, cublasLtGetStatusString(s));
    }
    if (st == CMLP_OK) st = first_workspace(index, ws_kib, &c->first_ws);
    if (st == CMLP_OK) c->cuctx = ctx_current(); /* current since cudaSetDevice made the stream */
    if (st == CMLP_OK) {
        pthread_once(&vmm_once, vmm_load);
        size_t gran = 0;
        CUmemAllocationProp prop = {0};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = index;
        c->vm_ok = vmm.ok && vmm.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS && gran &&
                   VM_PAGE % gran == 0;
    }
    if (st != CMLP_OK) {
        cu_close(c);
        return st;
    }
    *out = c;
    return CMLP_OK;
}

static int64_t cu_total_memory(void *ctx) {
    cuda_ctx *c = ctx;
    size_t free_b = 0, total = 0;
    if (use(c) != CMLP_OK || cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return (int64_t)total;
}

/* ---- NVML: who holds the GPU's memory (for out-of-memory messages and list_gpu_processes) ----
 * Loaded on first use ($CMLP_NVML_LIBRARY or libnvidia-ml.so.1) and kept initialised, as torch
 * keeps it. The GPU is found by its UUID, which CUDA and NVML share. */
typedef struct {
    unsigned int pid;
    unsigned long long used; /* bytes; all ones where NVML may not say */
    unsigned int gpu_instance, compute_instance;
} nvml_process; /* nvmlProcessInfo_v2_t, which the _v3 query fills */

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static int (*nvml_by_uuid)(const char *uuid, void **device);
static int (*nvml_processes)(void *device, unsigned int *count, nvml_process *infos);

static void nvml_load(void) {
    const char *env = getenv("CMLP_NVML_LIBRARY");
    void *h = dlopen(env && env[0] ? env : "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    int (*init)(void) = h ? (int (*)(void))dlsym(h, "nvmlInit_v2") : NULL;
    if (!init || init() != 0) return;
    nvml_by_uuid = (int (*)(const char *, void **))dlsym(h, "nvmlDeviceGetHandleByUUID");
    nvml_processes = (int (*)(void *, unsigned int *, nvml_process *))dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v3");
}

/* A GPU's UUID as NVML writes it, without its "GPU-" prefix (torch's device property). */
static void uuid_text(const cudaUUID_t *id, char *out, size_t cap) {
    const unsigned char *u = (const unsigned char *)id->bytes;
    snprintf(out, cap, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2], u[3],
             u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

static int cu_gpu_processes(void *ctx, int64_t *pids, int64_t *bytes, int cap) {
    cuda_ctx *c = ctx;
    if (forked) return -1;
    pthread_once(&nvml_once, nvml_load);
    if (!nvml_by_uuid || !nvml_processes) return -1;
    /* found once: an out-of-memory message asks under the allocator's lock, and the device
     * properties take a while */
    void *dev = __atomic_load_n(&c->nvml_dev, __ATOMIC_ACQUIRE);
    if (!dev) {
        struct cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, c->index) != cudaSuccess) {
            (void)cudaGetLastError();
            return -1;
        }
        char uuid[64] = "GPU-";
        uuid_text(&p.uuid, uuid + 4, sizeof uuid - 4);
        if (nvml_by_uuid(uuid, &dev) != 0 || !dev) return -1;
        __atomic_store_n(&c->nvml_dev, dev, __ATOMIC_RELEASE);
    }
    /* NVML_ERROR_INSUFFICIENT_SIZE (7) fills nothing and says how many there are: ask again */
    nvml_process *infos = NULL;
    unsigned int room = 64, n = 0;
    int rc = 7;
    for (int tries = 0; rc == 7 && tries < 4; tries++) {
        free(infos);
        infos = malloc(room * sizeof *infos);
        if (!infos) return -1;
        n = room;
        rc = nvml_processes(dev, &n, infos);
        if (rc == 7) room = n + 16; /* room for processes that start meanwhile */
    }
    if (rc != 0) {
        free(infos);
        return -1;
    }
    for (unsigned int i = 0; i < n && (int)i < cap; i++) { /* bytes -1: NVML may not say (another container's) */
        pids[i] = infos[i].pid;
        bytes[i] = infos[i].used == ~0ULL ? -1 : (int64_t)infos[i].used;
    }
    free(infos);
    return (int)n;
}

static int64_t cu_free_memory(void *ctx) {
    cuda_ctx *c = ctx;
    size_t free_b = 0, total = 0;
    if (use(c) != CMLP_OK || cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return (int64_t)free_b;
}

static size_t cu_workspace_bytes(void *ctx) {
    cuda_ctx *c = ctx;
    return c->first_ws + 2 * SIDE_WORKSPACE;
}

static void cu_set_workspace(void *ctx, void *d_ptr, size_t nbytes) {
    cuda_ctx *c = ctx;
    c->ws = d_ptr;
    c->ws_bytes = d_ptr ? nbytes : 0;
    c->ws_side = c->ws_graph_side = c->bias_slot = c->xent_slot = NULL;
    c->ws_side_bytes = 0;
    if (d_ptr && nbytes >= 2 * SIDE_WORKSPACE + BIAS_SLOT + XENT_SLOT) {
        c->ws_bytes = nbytes - 2 * SIDE_WORKSPACE;
        c->ws_side = (char *)d_ptr + c->ws_bytes;
        c->ws_graph_side = (char *)c->ws_side + SIDE_WORKSPACE;
        c->ws_side_bytes = SIDE_WORKSPACE;
        c->ws_bytes -= BIAS_SLOT;
        c->bias_slot = (char *)d_ptr + c->ws_bytes;
        c->ws_bytes -= XENT_SLOT;
        /* the blocks-done counter starts at 0 (the allocator's memory is not cleared); where
         * that cannot be queued, the loss kernel totals by atomics instead */
        void *slot = (char *)d_ptr + c->ws_bytes;
        if (use(c) == CMLP_OK && cudaMemsetAsync(slot, 0, XENT_SLOT, c->stream) == cudaSuccess)
            c->xent_slot = slot;
        else
            (void)cudaGetLastError();
    }
}

/* The workspace of the stream this thread queues to on c. */
static void *ws_of(const cuda_ctx *c, size_t *nbytes) {
    *nbytes = on_side(c) ? c->ws_side_bytes : c->ws_bytes;
    return !on_side(c) ? c->ws : capturing(c) ? c->ws_graph_side : c->ws_side;
}

/* ---- raw memory and virtual memory ---- */

static cmlp_status cu_raw_alloc(void *ctx, size_t nbytes, void **out) {
    cuda_ctx *c = ctx;
    *out = NULL;
    REFUSE_WHILE_CAPTURING(c, "allocating device memory");
    CMLP_TRY_USE(c);
    cudaError_t e = cudaMalloc(out, nbytes);
    if (e == cudaSuccess) return CMLP_OK;
    *out = NULL;
    if (e != cudaErrorMemoryAllocation) return cuda_fail(e, "cudaMalloc", __FILE__, __LINE__);
    (void)cudaGetLastError();
    return CMLP_ERR_OOM; /* the allocator's ladder takes it from here */
}

static void cu_raw_free(void *ctx, void *ptr, size_t nbytes) {
    cuda_ctx *c = ctx;
    if (forked) return;
    if (thread_capturing()) {
        defer(0, c, ptr, nbytes);
        return;
    }
    if (use(c) == CMLP_OK && cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError();
}

static cmlp_status cu_vm_reserve(void *ctx, size_t nbytes, void **out) {
    cuda_ctx *c = ctx;
    if (!c->vm_ok)
        return FAIL(CMLP_ERR_DEVICE, "expandable segments need the driver's virtual memory API with 2 MiB pages, "
                                     "which cuda:%d does not offer",
                    c->index);
    REFUSE_WHILE_CAPTURING(c, "reserving device addresses");
    CMLP_TRY_USE(c);
    CUdeviceptr p = 0;
    DRV_TRY(vmm.reserve(&p, nbytes, VM_PAGE, 0, 0));
    *out = (void *)(uintptr_t)p;
    return CMLP_OK;
}

static void unmap_pages(cuda_ctx *c, char *ptr, size_t npages) {
    for (size_t i = 0; i < npages; i++) (void)vmm.unmap((CUdeviceptr)(uintptr_t)(ptr + i * VM_PAGE), VM_PAGE);
    (void)c;
}

/* One physical allocation per page, so that any page can be unmapped on its own later; access
 * is granted once over the whole run. */
static cmlp_status cu_vm_map(void *ctx, void *ptr, size_t nbytes) {
    cuda_ctx *c = ctx;
    REFUSE_WHILE_CAPTURING(c, "mapping device memory");
    CMLP_TRY_USE(c);
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = c->index;
    CUmemAccessDesc access = {0};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t npages = nbytes / VM_PAGE, mapped = 0;
    CUresult r = CUDA_SUCCESS;
    for (; mapped < npages; mapped++) {
        CUdeviceptr at = (CUdeviceptr)(uintptr_t)((char *)ptr + mapped * VM_PAGE);
        CUmemGenericAllocationHandle h = 0;
        r = vmm.create(&h, VM_PAGE, &prop, 0);
        if (r != CUDA_SUCCESS) break;
        r = vmm.map(at, VM_PAGE, 0, h, 0);
        (void)vmm.release(h); /* the mapping keeps the memory */
        if (r != CUDA_SUCCESS) break;
    }
    if (r == CUDA_SUCCESS) r = vmm.set_access((CUdeviceptr)(uintptr_t)ptr, nbytes, &access, 1);
    if (r == CUDA_SUCCESS) return CMLP_OK;
    unmap_pages(c, ptr, mapped);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return CMLP_ERR_OOM;
    return drv_fail(r, "mapping pages of an expandable segment", __FILE__, __LINE__);
}

static void cu_vm_unmap(void *ctx, void *ptr, size_t nbytes) {
    cuda_ctx *c = ctx;
    if (forked) return;
    if (thread_capturing()) {
        defer(1, c, ptr, nbytes);
        return;
    }
    if (use(c) != CMLP_OK) return;
    /* queued kernels may still use the pages: unmapping does not wait for them (either stream's) */
    pthread_mutex_lock(&c->lock);
    cudaStream_t side = c->side;
    pthread_mutex_unlock(&c->lock);
    if (cudaStreamSynchronize(c->stream) != cudaSuccess) (void)cudaGetLastError();
    if (side && cudaStreamSynchronize(side) != cudaSuccess) (void)cudaGetLastError();
    unmap_pages(c, ptr, nbytes / VM_PAGE);
}

static void cu_vm_release(void *ctx, void *ptr, size_t nbytes) {
    cuda_ctx *c = ctx;
    if (forked) return;
    if (thread_capturing()) {
        defer(2, c, ptr, nbytes);
        return;
    }
    if (use(c) == CMLP_OK) (void)vmm.free_range((CUdeviceptr)(uintptr_t)ptr, nbytes);
}

/* ---- copies ---- */

static cmlp_status cu_copy_h2d(void *ctx, void *d_dst, const void *h_src, size_t nbytes) {
    cuda_ctx *c = ctx;
    if (!nbytes) return CMLP_OK;
    REFUSE_WHILE_CAPTURING(c, "copying host memory");
    CMLP_TRY_USE(c);
    /* the caller may reuse the source at once: wait for the copy (from pinned memory it runs
     * later; from pageable memory CUDA stages it before returning in practice, but only says it
     * "might be synchronous"). Callers copy once per call or epoch, never per step. */
    CU_TRY(cudaMemcpyAsync(d_dst, h_src, nbytes, cudaMemcpyHostToDevice, stream_of(c)));
    CU_TRY(cudaStreamSynchronize(stream_of(c)));
    return CMLP_OK;
}

static cmlp_status cu_copy_d2h(void *ctx, void *h_dst, const void *d_src, size_t nbytes) {
    cuda_ctx *c = ctx;
    if (!nbytes) return CMLP_OK;
    REFUSE_WHILE_CAPTURING(c, "copying to the host");
    CMLP_TRY_USE(c);
    CU_TRY(cudaMemcpyAsync(h_dst, d_src, nbytes, cudaMemcpyDeviceToHost, stream_of(c)));
    CU_TRY(cudaStreamSynchronize(stream_of(c)));
    return CMLP_OK;
}

static cmlp_status cu_copy_d2d(void *ctx, void *d_dst, const void *d_src, size_t nbytes) {
    cuda_ctx *c = ctx;
    if (!nbytes) return CMLP_OK;
    CMLP_TRY_USE(c);
    return done(c, cudaMemcpyAsync(d_dst, d_src, nbytes, cudaMemcpyDeviceToDevice, stream_of(c)), "device copy");
}

static cmlp_status cu_fill_zero(void *ctx, void *d_dst, size_t nbytes) {
    cuda_ctx *c = ctx;
    if (!nbytes) return CMLP_OK;
    CMLP_TRY_USE(c);
    return done(c, cudaMemsetAsync(d_dst, 0, nbytes, stream_of(c)), "cudaMemsetAsync");
}

static cmlp_status cu_fill_byte(void *ctx, void *d_dst, int byte, size_t nbytes) {
    cuda_ctx *c = ctx;
    if (!nbytes) return CMLP_OK;
    CMLP_TRY_USE(c);
    return done(c, cudaMemsetAsync(d_dst, byte, nbytes, stream_of(c)), "cudaMemsetAsync");
}

/* ---- GEMM: cuBLASLt, with a cache of plans per shape, layout and alignment ---- */

static unsigned align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    unsigned al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1; /* half-precision views may be 2-byte aligned */
    return al;
}

static void plan_free(gemm_plan *p) {
    if (!p->used) return;
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->c) cublasLtMatrixLayoutDestroy(p->c);
    memset(p, 0, sizeof *p);
}

/* One GEMM as cuBLASLt sees it: row-major C[m,n] = op(A) op(B) is column-major
 * C^T[n,m] = op(B)^T op(A)^T, so cuBLASLt's "A" is our B and its "B" is our A. */
typedef struct {
    int ta, tb;
    int64_t m, n, k, lda, ldb, ldc;
    cudaDataType_t ab, cd;          /* A and B; C and D */
    cublasLtEpilogue_t epilogue;    /* DEFAULT, BIAS or RELU_BIAS (bias: cd elements, [n]) */
} gemm_desc;

static cmlp_status plan_make(cuda_ctx *c, gemm_plan *p, const uint64_t key[8], const gemm_desc *g, unsigned al_a,
                             unsigned al_b, unsigned al_c, const void *d_bias, size_t ws, bool *no_algo) {
    /* TF32 only where A and B are float and it was asked for */
    cublasComputeType_t ct = c->tf32 && g->ab == CUDA_R_32F ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    cublasOperation_t op_l = g->tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_r = g->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    uint64_t m = (uint64_t)g->m, n = (uint64_t)g->n, k = (uint64_t)g->k;
    memset(p, 0, sizeof *p);
    LT_TRY(cublasLtMatmulDescCreate(&p->op, ct, CUDA_R_32F));
    p->used = true; /* from here plan_free releases what exists; the rest are NULL */
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_l, sizeof op_l));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_r, sizeof op_r));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &g->epilogue, sizeof g->epilogue));
    /* the heuristic reads the bias pointer's alignment from the pointer itself (the key has it) */
    if (g->epilogue != CUBLASLT_EPILOGUE_DEFAULT)
        LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &d_bias, sizeof d_bias));
    /* stored shapes (before op), column-major */
    LT_TRY(cublasLtMatrixLayoutCreate(&p->a, g->ab, g->tb ? k : n, g->tb ? n : k, g->ldb));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->b, g->ab, g->ta ? m : k, g->ta ? k : m, g->lda));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->c, g->cd, n, m, g->ldc));
    cublasLtMatmulPreference_t pref = NULL;
    LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
    uint32_t aa = al_b, ab = al_a, ac = al_c; /* cuBLASLt's A is our B */
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac);
    cublasLtMatmulHeuristicResult_t h;
    int found = 0;
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &h, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
        *no_algo = found == 0 && (s == CUBLAS_STATUS_SUCCESS || s == CUBLAS_STATUS_NOT_SUPPORTED);
        plan_free(p);
        return FAIL(CMLP_ERR_DEVICE, "cuBLASLt has no algorithm for a GEMM of %lld x %lld x %lld (%s)", (long long)g->m,
                    (long long)g->n, (long long)g->k,
                    s == CUBLAS_STATUS_SUCCESS ? "none found" : cublasLtGetStatusString(s));
    }
    p->algo = h.algo;
    memcpy(p->key, key, sizeof p->key);
    return CMLP_OK;
}

/* no_algo (may be NULL): set when cuBLASLt has no algorithm for this GEMM (then nothing ran). */
static cmlp_status lt_gemm(cuda_ctx *c, const gemm_desc *g, float alpha, const void *d_a, const void *d_b, float beta,
                           void *d_c, const void *d_bias, bool *no_algo) {
    bool none = false;
    if (no_algo) *no_algo = false;
    if (g->m == 0 || g->n == 0) return CMLP_OK;
    if (g->k <= 0) return FAIL(CMLP_ERR_INVALID, "GEMM with k = %lld", (long long)g->k);
    CMLP_TRY_USE(c);
    /* a bias aligned to less than 16 bytes is read from the aligned slot (see bias_slot) */
    const void *bias_src = NULL;
    size_t bias_bytes = 0;
    if (d_bias && align_of(d_bias) < 16) {
        bias_bytes = (size_t)g->n * (g->cd == CUDA_R_32F ? 4 : 2);
        if (on_side(c) || !c->bias_slot || bias_bytes > BIAS_SLOT) { /* no fusing it: see gemm_bias */
            if (no_algo) *no_algo = true;
            return FAIL(CMLP_ERR_DEVICE,
                        "a fused bias of %lld values at an address aligned to %u bytes: cuBLASLt reads it 16 bytes "
                        "at a time, and the aligned slot holds %zu bytes",
                        (long long)g->n, align_of(d_bias), BIAS_SLOT);
        }
        bias_src = d_bias;
        d_bias = c->bias_slot;
    }
    unsigned al_a = align_of(d_a), al_b = align_of(d_b), al_c = align_of(d_c), al_bias = d_bias ? align_of(d_bias) : 0;
    size_t ws_bytes;
    void *ws = ws_of(c, &ws_bytes); /* the plan is chosen for the workspace it gets */
    uint64_t key[8] = {(uint64_t)g->m, (uint64_t)g->n, (uint64_t)g->k, (uint64_t)g->lda, (uint64_t)g->ldb,
                       (uint64_t)g->ldc,
                       (uint64_t)(g->ta != 0) | (uint64_t)(g->tb != 0) << 1 | (uint64_t)c->tf32 << 2 |
                           (uint64_t)on_side(c) << 3 |
                           (uint64_t)g->ab << 8 | (uint64_t)g->cd << 24 | (uint64_t)g->epilogue << 40,
                       (uint64_t)al_a | (uint64_t)al_b << 16 | (uint64_t)al_c << 32 | (uint64_t)al_bias << 48};
    pthread_mutex_lock(&c->lock);
    gemm_plan *p = NULL;
    for (int i = 0; i < NPLANS && !p; i++)
        if (c->plans[i].used && memcmp(c->plans[i].key, key, sizeof key) == 0) p = &c->plans[i];
    cmlp_status st = CMLP_OK;
    if (!p) { /* made aside, so that a key with no algorithm evicts no plan but one entry noting that */
        gemm_plan made;
        st = plan_make(c, &made, key, g, al_a, al_b, al_c, d_bias, ws_bytes, &none);
        if (st == CMLP_OK || none) {
            p = &c->plans[c->next_plan];
            c->next_plan = (c->next_plan + 1) % NPLANS;
            plan_free(p);
            if (st == CMLP_OK) *p = made;
            else *p = (gemm_plan){.used = true, .none = true};
            memcpy(p->key, key, sizeof key);
        } else {
            plan_free(&made); /* what a failed descriptor call left */
        }
    } else if (p->none) {
        none = true;
        st = FAIL(CMLP_ERR_DEVICE, "cuBLASLt has no algorithm for a GEMM of %lld x %lld x %lld", (long long)g->m,
                  (long long)g->n, (long long)g->k);
    }
    if (no_algo) *no_algo = none;
    if (st == CMLP_OK && bias_src) { /* in stream order under the lock: no other GEMM's copy comes between */
        cudaError_t e = cudaMemcpyAsync(c->bias_slot, bias_src, bias_bytes, cudaMemcpyDeviceToDevice, stream_of(c));
        if (e != cudaSuccess) st = cuda_fail(e, "copying a bias to its aligned slot", __FILE__, __LINE__);
    }
    if (st == CMLP_OK && g->epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
        cublasStatus_t s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &d_bias,
                                                          sizeof d_bias);
        if (s != CUBLAS_STATUS_SUCCESS)
            st = FAIL(CMLP_ERR_DEVICE, "setting a GEMM's bias failed: %s", cublasLtGetStatusString(s));
    }
    if (st == CMLP_OK) {
        cublasStatus_t s = cublasLtMatmul(c->lt, p->op, &alpha, d_b, p->a, d_a, p->b, &beta, d_c, p->c, d_c, p->c,
                                          &p->algo, ws, ws_bytes, stream_of(c));
        if (s != CUBLAS_STATUS_SUCCESS) {
            (void)cudaGetLastError();
            st = FAIL(CMLP_ERR_DEVICE, "cublasLtMatmul (%lld x %lld x %lld) failed: %s", (long long)g->m,
                      (long long)g->n, (long long)g->k, cublasLtGetStatusString(s));
        }
    }
    pthread_mutex_unlock(&c->lock);
    if (st == CMLP_OK && c->sync_each) st = done(c, cudaSuccess, "cublasLtMatmul");
    return st;
}

static cmlp_status cu_gemm(void *ctx, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, const float *d_a,
                           int64_t lda, const float *d_b, int64_t ldb, float beta, float *d_c, int64_t ldc) {
    gemm_desc g = {ta, tb, m, n, k, lda, ldb, ldc, CUDA_R_32F, CUDA_R_32F, CUBLASLT_EPILOGUE_DEFAULT};
    return lt_gemm(ctx, &g, alpha, d_a, d_b, beta, d_c, NULL, NULL);
}

/* C = alpha op(A) op(B) with the bias (and ReLU) fused where cuBLASLt has an algorithm for
 * that. Where it has none (rows of C contiguous): in fp32 the GEMM, then the bias kernel; in
 * half precision C's rows set to the bias, the GEMM adding to them, then the ReLU, which gives
 * the fused epilogue's values (the sum in fp32, rounded once). */
static cmlp_status gemm_bias(cuda_ctx *c, gemm_desc *g, float alpha, const void *d_a, const void *d_b, void *d_c,
                             const void *d_bias, int relu) {
    bool none;
    cmlp_status st = lt_gemm(c, g, alpha, d_a, d_b, 0.0f, d_c, d_bias, &none);
    if (st == CMLP_OK || !none || g->ldc != g->n) return st;
    g->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    if (g->cd == CUDA_R_32F) {
        st = lt_gemm(c, g, alpha, d_a, d_b, 0.0f, d_c, NULL, NULL);
        return st != CMLP_OK ? st : KERNEL(c, cmlp_k_bias_act(d_c, d_bias, g->m, g->n, relu, stream_of(c)));
    }
    const int bf16 = g->cd == CUDA_R_16BF;
    st = KERNEL(c, cmlp_k_rows_half(d_c, d_bias, g->m, g->n, bf16, stream_of(c)));
    if (st == CMLP_OK) st = lt_gemm(c, g, alpha, d_a, d_b, 1.0f, d_c, NULL, NULL);
    if (st == CMLP_OK && relu) st = KERNEL(c, cmlp_k_rows_half(d_c, NULL, g->m, g->n, bf16, stream_of(c)));
    return st;
}

static cmlp_status cu_gemm_bias_act(void *ctx, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *d_a,
                                    int64_t lda, const float *d_b, int64_t ldb, float *d_c, int64_t ldc,
                                    const float *d_bias, int relu) {
    gemm_desc g = {ta, tb, m, n, k, lda, ldb, ldc, CUDA_R_32F, CUDA_R_32F,
                   relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS};
    return gemm_bias(ctx, &g, 1.0f, d_a, d_b, d_c, d_bias, relu);
}

static cudaDataType_t cuda_type(cmlp_dtype t) {
    return t == CMLP_DTYPE_F16 ? CUDA_R_16F : t == CMLP_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

static cmlp_status cu_gemm_half(void *ctx, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                                const uint16_t *d_a, int64_t lda, const uint16_t *d_b, int64_t ldb, cmlp_dtype ab,
                                float beta, void *d_c, cmlp_dtype c_type, int64_t ldc, const void *d_bias, int relu) {
    gemm_desc g = {ta, tb, m, n, k, lda, ldb, ldc, cuda_type(ab), cuda_type(c_type),
                   !d_bias ? CUBLASLT_EPILOGUE_DEFAULT : relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS};
    if (relu && !d_bias) return FAIL(CMLP_ERR_INVALID, "a GEMM's ReLU epilogue comes with its bias");
    if (d_bias && beta == 0.0f) return gemm_bias(ctx, &g, alpha, d_a, d_b, d_c, d_bias, relu);
    return lt_gemm(ctx, &g, alpha, d_a, d_b, beta, d_c, d_bias, NULL);
}

/* Bias gradients of tall matrices put partial sums in the GEMM workspace between two launches:
 * both are queued under the lock, so that no other thread's GEMM or bias gradient comes between
 * them on the stream. kind: 0 float, 1 fp16, 2 bf16; h: mask through the ReLU first. */
static cmlp_status bias_grad_locked(cuda_ctx *c, void *dy, const void *h, void *out, int kind, float *db,
                                    int64_t rows, int64_t cols, int overwrite) {
    CMLP_TRY_USE(c);
    pthread_mutex_lock(&c->lock);
    size_t nb;
    void *ws = ws_of(c, &nb);
    cudaError_t e = h ? cmlp_k_relu_backward_bias_grad(dy, h, out, kind, db, rows, cols, overwrite, ws, nb,
                                                       stream_of(c))
                    : kind == 0 ? cmlp_k_bias_grad(db, dy, rows, cols, overwrite, ws, nb, stream_of(c))
                                : cmlp_k_bias_grad_half(db, dy, rows, cols, kind == 2, overwrite, ws, nb,
                                                        stream_of(c));
    pthread_mutex_unlock(&c->lock);
    return KERNEL(c, e);
}

static int half_kind(cmlp_dtype dtype) { return dtype == CMLP_DTYPE_F32 ? 0 : dtype == CMLP_DTYPE_F16 ? 1 : 2; }

static cmlp_status cu_bias_grad_half(void *ctx, float *d_db, const uint16_t *d_dy, int64_t rows, int64_t cols,
                                     cmlp_dtype dtype, int overwrite) {
    return bias_grad_locked(ctx, (void *)d_dy, NULL, NULL, half_kind(dtype), d_db, rows, cols, overwrite);
}

/* ---- elementwise, loss, staging ---- */

static cmlp_status cu_bias_act(void *ctx, float *d_y, const float *d_bias, int64_t rows, int64_t cols, int relu) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_bias_act(d_y, d_bias, rows, cols, relu, stream_of(c)));
}

static cmlp_status cu_relu_backward(void *ctx, float *d_dy, const float *d_h, int64_t count) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_relu_backward(d_dy, d_h, count, stream_of(c)));
}

static cmlp_status cu_relu_backward_bias_grad(void *ctx, void *d_dy, const void *d_h, void *d_out, cmlp_dtype dtype,
                                              float *d_db, int64_t rows, int64_t cols, int overwrite) {
    if (d_out != d_dy && d_out != d_h) return FAIL(CMLP_ERR_INVALID, "the masked gradient goes to d_dy or d_h");
    return bias_grad_locked(ctx, d_dy, d_h, d_out, half_kind(dtype), d_db, rows, cols, overwrite);
}

static cmlp_status cu_bias_grad(void *ctx, float *d_db, const float *d_dy, int64_t rows, int64_t cols, int overwrite) {
    return bias_grad_locked(ctx, (void *)d_dy, NULL, NULL, 0, d_db, rows, cols, overwrite);
}

/* The loss kernel's scratch on the first stream (a capture's replays run there too); a loss on
 * the second stream, which does not occur, would be totalled by atomics. */
static void *xent_scratch(const cuda_ctx *c) { return on_side(c) ? NULL : c->xent_slot; }

static cmlp_status cu_softmax_xent(void *ctx, const float *d_logits, const int32_t *d_labels, int64_t rows,
                                   int64_t cols, float smoothing, cmlp_loss_weight w, float *d_dlogits,
                                   double *d_loss_sum, int64_t *d_correct) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_softmax_xent(d_logits, d_labels, rows, cols, smoothing, w.value, w.d_scale, w.count,
                                         w.d_found_inf, d_dlogits, d_loss_sum, (unsigned long long *)d_correct,
                                         xent_scratch(c), stream_of(c)));
}

static cmlp_status cu_softmax_xent_half(void *ctx, const float *d_logits, const int32_t *d_labels, int64_t rows,
                                        int64_t cols, float smoothing, cmlp_loss_weight w, uint16_t *d_dlogits,
                                        cmlp_dtype half, double *d_loss_sum, int64_t *d_correct) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_softmax_xent_half(d_logits, d_labels, rows, cols, smoothing, w.value, w.d_scale, w.count,
                                              w.d_found_inf, d_dlogits, half == CMLP_DTYPE_BF16, d_loss_sum,
                                              (unsigned long long *)d_correct, xent_scratch(c), stream_of(c)));
}

/* The next staging slot with room for nbytes, once the copy that last read it is done. Called
 * with the lock held; stage_sent() records the copy that reads it. */
static cmlp_status stage_buffer(cuda_ctx *c, size_t nbytes, int *slot, void **out) {
    int i = c->h_stage_next;
    c->h_stage_next = (i + 1) % STAGE_SLOTS;
    if (!c->h_stage_done[i]) CU_TRY(cudaEventCreateWithFlags(&c->h_stage_done[i], cudaEventDisableTiming));
    if (c->h_stage_used[i]) CU_TRY(cudaEventSynchronize(c->h_stage_done[i]));
    if (nbytes > c->h_stage_bytes[i]) {
        size_t want = nbytes < ((size_t)1 << 20) ? ((size_t)1 << 20) : nbytes + nbytes / 2;
        if (c->h_stage[i]) CU_TRY(cudaFreeHost(c->h_stage[i]));
        c->h_stage[i] = NULL;
        c->h_stage_bytes[i] = 0;
        CU_TRY(cudaMallocHost(&c->h_stage[i], want));
        c->h_stage_bytes[i] = want;
    }
    c->h_stage_used[i] = false;
    *slot = i;
    *out = c->h_stage[i];
    return CMLP_OK;
}

static cmlp_status stage_sent(cuda_ctx *c, int slot, cudaError_t copy, const char *what) {
    if (copy == cudaSuccess) copy = cudaEventRecord(c->h_stage_done[slot], c->stream);
    c->h_stage_used[slot] = copy == cudaSuccess;
    return done(c, copy, what);
}

static cmlp_status cu_stage_rows(void *ctx, float *d_dst, const void *h_src, cmlp_dtype dtype, int64_t cols,
                                 const int64_t *h_idx, int64_t start, int64_t rows, float scale, float shift) {
    cuda_ctx *c = ctx;
    if (rows == 0 || cols == 0) return CMLP_OK;
    REFUSE_WHILE_CAPTURING(c, "staging host rows");
    CMLP_TRY_USE(c);
    size_t nbytes = (size_t)rows * (size_t)cols * sizeof(float);
    pthread_mutex_lock(&c->lock);
    void *buf = NULL;
    int slot = 0;
    cmlp_status st = stage_buffer(c, nbytes, &slot, &buf);
    if (st == CMLP_OK) {
        float *dst = buf;
        for (int64_t r = 0; r < rows; r++) {
            int64_t s = h_idx ? h_idx[r] : start + r;
            float *d = dst + r * cols;
            if (dtype == CMLP_DTYPE_U8) {
                const uint8_t *u = (const uint8_t *)h_src + s * cols;
                for (int64_t k = 0; k < cols; k++) d[k] = (float)u[k] * scale + shift;
            } else {
                memcpy(d, (const float *)h_src + s * cols, (size_t)cols * sizeof(float));
            }
        }
        st = stage_sent(c, slot, cudaMemcpyAsync(d_dst, buf, nbytes, cudaMemcpyHostToDevice, c->stream), "staging rows");
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cmlp_status cu_stage_labels(void *ctx, int32_t *d_dst, const int32_t *h_src, const int64_t *h_idx, int64_t start,
                                   int64_t rows) {
    cuda_ctx *c = ctx;
    if (rows == 0) return CMLP_OK;
    REFUSE_WHILE_CAPTURING(c, "staging host labels");
    CMLP_TRY_USE(c);
    pthread_mutex_lock(&c->lock);
    void *buf = NULL;
    int slot = 0;
    cmlp_status st = stage_buffer(c, (size_t)rows * sizeof(int32_t), &slot, &buf);
    if (st == CMLP_OK) {
        int32_t *dst = buf;
        for (int64_t r = 0; r < rows; r++) dst[r] = h_src[h_idx ? h_idx[r] : start + r];
        st = stage_sent(c, slot,
                        cudaMemcpyAsync(d_dst, buf, (size_t)rows * sizeof(int32_t), cudaMemcpyHostToDevice, c->stream),
                        "staging labels");
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cmlp_status cu_gather_rows(void *ctx, float *d_dst, const void *d_src, cmlp_dtype dtype, int64_t cols,
                                  const int64_t *d_idx, int64_t start, const int64_t *d_pos, int64_t rows, float scale,
                                  float shift, int32_t *d_labels, const int32_t *d_label_src) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    if (dtype == CMLP_DTYPE_U8)
        return KERNEL(c, cmlp_k_gather_u8(d_dst, d_src, d_idx, start, d_pos, rows, cols, scale, shift, d_labels,
                                          d_label_src, stream_of(c)));
    /* float rows are copied as they are */
    return KERNEL(c, cmlp_k_gather_f32(d_dst, d_src, d_idx, start, d_pos, rows, cols, 1.0f, 0.0f, d_labels,
                                       d_label_src, stream_of(c)));
}

static cmlp_status cu_gather_rows_half(void *ctx, uint16_t *d_dst, cmlp_dtype half, const void *d_src,
                                       cmlp_dtype dtype, int64_t cols, const int64_t *d_idx, int64_t start,
                                       const int64_t *d_pos, int64_t rows, float scale, float shift, int32_t *d_labels,
                                       const int32_t *d_label_src) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    const int u8 = dtype == CMLP_DTYPE_U8; /* float rows are taken as they are */
    return KERNEL(c, cmlp_k_gather_half(d_dst, half == CMLP_DTYPE_BF16, d_src, u8, d_idx, start, d_pos, rows, cols,
                                        u8 ? scale : 1.0f, u8 ? shift : 0.0f, d_labels, d_label_src, stream_of(c)));
}

static cmlp_status cu_gather_labels(void *ctx, int32_t *d_dst, const int32_t *d_src, const int64_t *d_idx,
                                    int64_t start, const int64_t *d_pos, int64_t rows) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_gather_labels(d_dst, d_src, d_idx, start, d_pos, rows, stream_of(c)));
}

/* ---- optimizers and mixed precision ---- */

static cmlp_status cu_adam(void *ctx, float *d_p, const float *d_g, float *d_m, float *d_v, float *d_vmax, int64_t n,
                           float step_size, float beta1, float beta2, float one_b1, float one_b2, float bc2_sqrt,
                           float eps, float weight_decay, float decay, int maximize, const float *d_found_inf,
                           const float *d_coef) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_adam(d_p, d_g, d_m, d_v, d_vmax, n, step_size, beta1, beta2, one_b1, one_b2, bc2_sqrt,
                                 eps, weight_decay, decay, maximize, d_found_inf, d_coef, stream_of(c)));
}

static cmlp_status cu_sgd(void *ctx, float *d_p, const float *d_g, float *d_buf, int64_t n, float lr, float momentum,
                          float keep, int nesterov, float weight_decay, int maximize, const float *d_found_inf,
                          const float *d_coef) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_sgd(d_p, d_g, d_buf, n, lr, momentum, keep, nesterov, weight_decay, maximize, d_found_inf,
                                d_coef, stream_of(c)));
}

/* The kernels' copy of a loss-scale update (zeros when scale is NULL). */
static cmlp_k_scaler k_scaler(const cmlp_scale_step *scale) {
    cmlp_k_scaler k = {0};
    if (scale)
        k = (cmlp_k_scaler){scale->d_scale, scale->d_tracker, (long long *)scale->d_skipped, scale->growth_factor,
                            scale->backoff_factor, scale->growth_interval};
    return k;
}

/* The kernels' copy of a rate's source. */
static cmlp_k_rate k_rate(const cmlp_rate_src *rate) {
    return (cmlp_k_rate){rate->d_rates,  (long long *)rate->d_next, rate->decoupled_wd, rate->nparts,
                         rate->d_parts,  rate->d_part_coef,         rate->d_step_scales};
}

static cmlp_status cu_optim_prepare(void *ctx, int64_t *d_step, float *d_coef, const float *d_found_inf,
                                    const cmlp_rate_src *rate, double beta2, int adam, int64_t *d_pos, int64_t pos_add,
                                    const cmlp_scale_step *scale) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    const cmlp_k_scaler k = k_scaler(scale);
    return KERNEL(c, cmlp_k_optim_prepare(d_step, d_coef, d_found_inf, k_rate(rate), beta2, adam, d_pos, pos_add,
                                          scale ? &k : NULL, stream_of(c)));
}

static cmlp_status cu_adam_prepared(void *ctx, float *d_p, const float *d_g, float *d_m, float *d_v, float *d_vmax,
                                    int64_t n, const cmlp_rate_src *rate, double beta2, float eps, float weight_decay,
                                    int maximize, const float *d_found_inf, int64_t *d_step, float *d_coef,
                                    int64_t *d_pos, int64_t pos_add, const cmlp_scale_step *scale,
                                    uint32_t *d_blocks_done) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    const cmlp_k_scaler k = k_scaler(scale);
    return KERNEL(c, cmlp_k_adam_prepared(d_p, d_g, d_m, d_v, d_vmax, n, k_rate(rate), beta2, eps, weight_decay,
                                          maximize, d_found_inf, d_step, d_coef, d_pos, pos_add, scale ? &k : NULL,
                                          d_blocks_done, stream_of(c)));
}

static cmlp_status cu_to_half(void *ctx, uint16_t *d_dst, const float *d_src, int64_t n, cmlp_dtype dtype) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_to_half(d_dst, d_src, n, dtype == CMLP_DTYPE_BF16, stream_of(c)));
}

static cmlp_status cu_from_half(void *ctx, float *d_dst, const uint16_t *d_src, int64_t n, cmlp_dtype dtype) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_from_half(d_dst, d_src, n, dtype == CMLP_DTYPE_BF16, stream_of(c)));
}

static cmlp_status cu_unscale(void *ctx, float *d_g, int64_t n, float inv_scale, const float *d_scale,
                              float *d_found_inf) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_unscale(d_g, n, inv_scale, d_scale, d_found_inf, stream_of(c)));
}

_Static_assert(CMLP_K_NORM_THREADS == CMLP_NORM_THREADS && CMLP_K_NORM_PARTS == CMLP_NORM_PARTS,
               "the norm's order is backend.h's");

static cmlp_status cu_grad_norm(void *ctx, const float *d_g, int64_t n, double norm_type, float *d_norm,
                                double *d_part, uint32_t *d_blocks_done) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_grad_norm(d_g, n, norm_type, d_norm, d_part, d_blocks_done, stream_of(c)));
}

static cmlp_status cu_clip_by_norm(void *ctx, float *d_g, int64_t n, const float *d_norm, float max_norm,
                                   double *d_norm_sum, int64_t *d_norm_steps) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_clip_by_norm(d_g, n, d_norm, max_norm, d_norm_sum, (long long *)d_norm_steps,
                                         stream_of(c)));
}

static cmlp_status cu_clip_by_value(void *ctx, float *d_g, int64_t n, float v) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_clip_by_value(d_g, n, v, stream_of(c)));
}

/* Waits for the first stream: a step's work on the second is joined to it before the step ends
 * (another thread's step in progress may still have work there). */
static cmlp_status cu_synchronize(void *ctx) {
    cuda_ctx *c = ctx;
    REFUSE_WHILE_CAPTURING(c, "waiting for the device");
    CMLP_TRY_USE(c);
    CU_TRY(cudaStreamSynchronize(c->stream));
    return CMLP_OK;
}

/* ---- the second stream ----
 * Work forked to it runs beside the work queued after the fork on the first stream, until a
 * join; while capturing, the capture's own pair of streams is used, so the graph gets both
 * branches. */

static cmlp_status side_make(cuda_ctx *c) { /* with the lock held */
    if (!c->side) CU_TRY(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking));
    if (!c->side_fork) CU_TRY(cudaEventCreateWithFlags(&c->side_fork, cudaEventDisableTiming));
    if (!c->side_done) CU_TRY(cudaEventCreateWithFlags(&c->side_done, cudaEventDisableTiming));
    return CMLP_OK;
}

/* record on `from`, then `to` waits for it */
static cmlp_status link_streams(cudaEvent_t ev, cudaStream_t from, cudaStream_t to) {
    CU_TRY(cudaEventRecord(ev, from));
    CU_TRY(cudaStreamWaitEvent(to, ev, 0));
    return CMLP_OK;
}

static cmlp_status cu_stream_side(void *ctx, int on) {
    cuda_ctx *c = ctx;
    if (!on) {
        if (on_side(c)) side_ctx = NULL;
        return CMLP_OK;
    }
    if (!c->two_streams || on_side(c)) return CMLP_OK;
    if (side_ctx) return FAIL(CMLP_ERR_STATE, "this thread already queues to another device's second stream");
    CMLP_TRY_USE(c);
    cmlp_status st = CMLP_OK;
    if (capturing(c)) {
        st = link_streams(cap_fork, cap_stream, cap_side);
        if (st == CMLP_OK) cap_forked = true;
    } else {
        REFUSE_WHILE_CAPTURING(c, "forking to a second stream");
        pthread_mutex_lock(&c->lock);
        st = side_make(c);
        if (st == CMLP_OK) st = link_streams(c->side_fork, c->stream, c->side);
        pthread_mutex_unlock(&c->lock);
    }
    if (st == CMLP_OK) side_ctx = c;
    return st;
}

static cmlp_status cu_stream_join(void *ctx) {
    cuda_ctx *c = ctx;
    if (on_side(c)) side_ctx = NULL;
    if (!c->two_streams) return CMLP_OK;
    CMLP_TRY_USE(c);
    if (capturing(c)) {
        if (!cap_forked) return CMLP_OK; /* the capture's second stream is not in the graph */
        cap_forked = false;
        return link_streams(cap_done, cap_side, cap_stream);
    }
    pthread_mutex_lock(&c->lock);
    cmlp_status st = c->side ? link_streams(c->side_done, c->side, c->stream) : CMLP_OK;
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- graphs ---- */

static void capture_streams_free(void) {
    if (cap_side) (void)cudaStreamDestroy(cap_side);
    if (cap_fork) (void)cudaEventDestroy(cap_fork);
    if (cap_done) (void)cudaEventDestroy(cap_done);
    if (cap_stream) (void)cudaStreamDestroy(cap_stream);
    cap_side = cap_stream = NULL;
    cap_fork = cap_done = NULL;
    cap_forked = false;
}

static cmlp_status cu_capture_begin(void *ctx) {
    cuda_ctx *c = ctx;
    if (cap_ctx) return FAIL(CMLP_ERR_DEVICE, "this thread is already capturing a graph");
    if (side_ctx) return FAIL(CMLP_ERR_STATE, "capturing while this thread queues to a second stream");
    CMLP_TRY_USE(c);
    cudaError_t e = cudaStreamCreateWithFlags(&cap_stream, cudaStreamNonBlocking);
    if (e == cudaSuccess && c->two_streams) e = cudaStreamCreateWithFlags(&cap_side, cudaStreamNonBlocking);
    if (e == cudaSuccess && c->two_streams) e = cudaEventCreateWithFlags(&cap_fork, cudaEventDisableTiming);
    if (e == cudaSuccess && c->two_streams) e = cudaEventCreateWithFlags(&cap_done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaStreamBeginCapture(cap_stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        capture_streams_free();
        return cuda_fail(e, "beginning a capture (streams, events, cudaStreamBeginCapture)", __FILE__, __LINE__);
    }
    cap_ctx = c;
    ndeferred = 0;
    return CMLP_OK;
}

static cmlp_status cu_capture_end(void *ctx, void **graph) {
    cuda_ctx *c = ctx;
    *graph = NULL;
    if (!capturing(c)) return FAIL(CMLP_ERR_DEVICE, "no graph is being captured on cuda:%d by this thread", c->index);
    (void)use(c); /* the capture's context (begin and end come in one call from Python); it ends either way */
    /* a capture ends with its second stream joined, also after an error left it forked */
    cmlp_status joined = cap_forked ? cu_stream_join(c) : CMLP_OK;
    side_ctx = NULL;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(cap_stream, &g);
    if (e != cudaSuccess) (void)cudaGetLastError();
    if (e == cudaSuccess && joined != CMLP_OK) e = cudaErrorStreamCaptureUnjoined;
    cap_ctx = NULL;
    capture_streams_free();
    /* what was given back meanwhile, now that the device may be waited for */
    for (int i = 0; i < ndeferred; i++) {
        deferred_op d = deferred[i];
        if (d.kind == 0) cu_raw_free(d.ctx, d.ptr, d.nbytes);
        else if (d.kind == 1) cu_vm_unmap(d.ctx, d.ptr, d.nbytes);
        else cu_vm_release(d.ctx, d.ptr, d.nbytes);
    }
    ndeferred = 0;
    if (e != cudaSuccess) {
        if (g) cudaGraphDestroy(g);
        return cuda_fail(e, "capturing a training step", __FILE__, __LINE__);
    }
    cmlp_status st = use(c);
    if (st != CMLP_OK) {
        cudaGraphDestroy(g);
        return st;
    }
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiateWithFlags(&exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) return cuda_fail(e, "instantiating a training step's graph", __FILE__, __LINE__);
    *graph = exec;
    return CMLP_OK;
}

static cmlp_status cu_graph_launch(void *ctx, void *graph) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    /* under the lock, so that the graph's GEMMs cannot come between another thread's two
     * launches of a bias gradient, which keep partial sums in the workspace in between */
    pthread_mutex_lock(&c->lock);
    cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)graph, c->stream);
    pthread_mutex_unlock(&c->lock);
    return done(c, e, "cudaGraphLaunch");
}

static void cu_graph_free(void *ctx, void *graph) {
    cuda_ctx *c = ctx;
    if (forked) return;
    if (graph && use(c) == CMLP_OK) (void)cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

/* ---- NCCL: collectives between the GPUs of a process group, loaded on first use ---- */

/* NCCL's ABI as far as used here (nccl.h: ncclUniqueId, ncclFloat32 = 7, ncclSum = 0, results
 * with ncclSuccess = 0), so that the backend builds and loads without NCCL installed. */
typedef struct nccl_id {
    char internal[CMLP_COMM_ID_BYTES];
} nccl_id;
typedef int (*fn_nccl_get_unique_id)(nccl_id *);
typedef int (*fn_nccl_comm_init_rank)(void **comm, int nranks, nccl_id id, int rank);
typedef int (*fn_nccl_all_reduce)(const void *send, void *recv, size_t count, int type, int op, void *comm,
                                  cudaStream_t stream);
typedef int (*fn_nccl_broadcast)(const void *send, void *recv, size_t count, int type, int root, void *comm,
                                 cudaStream_t stream);
typedef int (*fn_nccl_reduce)(const void *send, void *recv, size_t count, int type, int op, int root, void *comm,
                              cudaStream_t stream);
typedef int (*fn_nccl_group)(void);
typedef int (*fn_nccl_comm_destroy)(void *comm);
typedef const char *(*fn_nccl_get_error_string)(int);
typedef int (*fn_nccl_get_version)(int *);
enum { NCCL_FLOAT32 = 7, NCCL_SUM = 0 };
/* The first NCCL whose collectives a CUDA graph can capture (the training step is captured). */
#define NCCL_MIN_VERSION 20906 /* 2.9.6 */

static struct {
    pthread_once_t once;
    bool ok;
    char why[600];
    fn_nccl_get_unique_id get_unique_id;
    fn_nccl_comm_init_rank comm_init_rank;
    fn_nccl_all_reduce all_reduce;
    fn_nccl_broadcast broadcast;
    fn_nccl_reduce reduce;
    fn_nccl_group group_start, group_end;
    fn_nccl_comm_destroy comm_destroy;
    fn_nccl_get_error_string error_string;
    int version; /* NCCL's code: major * 10000 + minor * 100 + patch (before 2.9: * 1000 + * 100 +) */
} nccl = {.once = PTHREAD_ONCE_INIT};

static void nccl_version_text(int code, char *out, size_t cap) {
    int major = code >= 10000 ? code / 10000 : code / 1000;
    int minor = code >= 10000 ? code % 10000 / 100 : code % 1000 / 100;
    snprintf(out, cap, "%d.%d.%d", major, minor, code % 100);
}

static void nccl_load(void) {
    const char *env = getenv("CMLP_NCCL_LIBRARY");
    const char *path = env && env[0] ? env : "libnccl.so.2";
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(nccl.why, sizeof nccl.why, "cannot load NCCL (%s; set CMLP_NCCL_LIBRARY to libnccl.so.2's path)",
                 dlerror());
        return;
    }
    nccl.get_unique_id = (fn_nccl_get_unique_id)dlsym(h, "ncclGetUniqueId");
    nccl.comm_init_rank = (fn_nccl_comm_init_rank)dlsym(h, "ncclCommInitRank");
    nccl.all_reduce = (fn_nccl_all_reduce)dlsym(h, "ncclAllReduce");
    nccl.broadcast = (fn_nccl_broadcast)dlsym(h, "ncclBroadcast");
    nccl.reduce = (fn_nccl_reduce)dlsym(h, "ncclReduce");
    nccl.group_start = (fn_nccl_group)dlsym(h, "ncclGroupStart");
    nccl.group_end = (fn_nccl_group)dlsym(h, "ncclGroupEnd");
    nccl.comm_destroy = (fn_nccl_comm_destroy)dlsym(h, "ncclCommDestroy");
    nccl.error_string = (fn_nccl_get_error_string)dlsym(h, "ncclGetErrorString");
    fn_nccl_get_version get_version = (fn_nccl_get_version)dlsym(h, "ncclGetVersion");
    nccl.ok = nccl.get_unique_id && nccl.comm_init_rank && nccl.all_reduce && nccl.broadcast && nccl.reduce &&
              nccl.group_start &&
              nccl.group_end && nccl.comm_destroy && nccl.error_string && get_version;
    if (!nccl.ok) {
        snprintf(nccl.why, sizeof nccl.why, "%.400s lacks NCCL's functions", path);
        return;
    }
    if (get_version(&nccl.version) != 0 || nccl.version < NCCL_MIN_VERSION) {
        char have[32], need[32];
        nccl_version_text(nccl.version, have, sizeof have);
        nccl_version_text(NCCL_MIN_VERSION, need, sizeof need);
        snprintf(nccl.why, sizeof nccl.why,
                 "NCCL %s (%.300s) is older than %s, the first whose collectives a CUDA graph can capture; install "
                 "a newer one (the nvidia-nccl wheel for this CUDA, or libnccl2) or point CMLP_NCCL_LIBRARY at it",
                 have, path, need);
        nccl.ok = false;
    }
}

static cmlp_status nccl_ready(void) {
    pthread_once(&nccl.once, nccl_load);
    return nccl.ok ? CMLP_OK : FAIL(CMLP_ERR_DEVICE, "%s", nccl.why);
}

#define NCCL_READY()                                                                                           \
    do {                                                                                                       \
        cmlp_status n_ = nccl_ready();                                                                         \
        if (n_ != CMLP_OK) return n_;                                                                          \
    } while (0)

#define NCCL_TRY(call, what)                                                                                   \
    do {                                                                                                       \
        int r_ = (call);                                                                                       \
        if (r_ != 0) return FAIL(CMLP_ERR_DEVICE, "%s failed: %s (NCCL result %d)", what,                     \
                                 nccl.error_string(r_), r_);                                                 \
    } while (0)

static cmlp_status cu_comm_prepare(void *ctx) {
    cuda_ctx *c = ctx;
    NCCL_READY();
    return use(c);
}

static cmlp_status cu_comm_id(void *ctx, void *id) {
    (void)ctx;
    NCCL_READY();
    NCCL_TRY(nccl.get_unique_id((nccl_id *)id), "ncclGetUniqueId");
    return CMLP_OK;
}

static cmlp_status cu_comm_init(void *ctx, const void *id, int rank, int size, void **comm) {
    cuda_ctx *c = ctx;
    NCCL_READY();
    CMLP_TRY_USE(c); /* NCCL takes the current device */
    nccl_id uid;
    memcpy(&uid, id, sizeof uid);
    *comm = NULL;
    /* NCCL registers the buffers of collectives captured in a graph where they come from a
     * qualified allocation (ncclMemAlloc's kind); the gradients here come from the caching
     * allocator, with expandable segments from many 2 MiB VMM pages, which such registration
     * is known to hang on. Off unless the environment says otherwise (read at the first
     * communicator; the gradients are small enough that the copy it saves does not matter). */
    setenv("NCCL_GRAPH_REGISTER", "0", 0);
    NCCL_TRY(nccl.comm_init_rank(comm, size, uid, rank), "ncclCommInitRank");
    return CMLP_OK;
}

static cmlp_status cu_comm_all_reduce(void *ctx, void *comm, float *d_buf, int64_t n) {
    cuda_ctx *c = ctx;
    NCCL_READY();
    CMLP_TRY_USE(c);
    if (n <= 0) return CMLP_OK;
    /* under the lock, in stream order with the GEMMs and kernels other threads queue */
    pthread_mutex_lock(&c->lock);
    int r = nccl.all_reduce(d_buf, d_buf, (size_t)n, NCCL_FLOAT32, NCCL_SUM, comm, stream_of(c));
    pthread_mutex_unlock(&c->lock);
    if (r != 0) return FAIL(CMLP_ERR_DEVICE, "ncclAllReduce of %lld floats failed: %s (NCCL result %d)", (long long)n,
                            nccl.error_string(r), r);
    return done(c, cudaSuccess, "ncclAllReduce");
}

/* One NCCL call per part, in one group (they run together): a broadcast from each part's owner (an
 * all-gather), or a reduce to it, in place there (a reduce-scatter whose parts may differ in size,
 * which ncclReduceScatter's may not). */
static cmlp_status per_part(void *ctx, void *comm, float *d_buf, int64_t n, int64_t chunk, bool reduce) {
    cuda_ctx *c = ctx;
    const char *what = reduce ? "reduce-scatter" : "all-gather", *call = reduce ? "ncclReduce" : "ncclBroadcast";
    NCCL_READY();
    CMLP_TRY_USE(c);
    if (n <= 0) return CMLP_OK;
    if (chunk <= 0) return FAIL(CMLP_ERR_INVALID, "%s parts of %lld floats", what, (long long)chunk);
    pthread_mutex_lock(&c->lock);
    int r = nccl.group_start();
    for (int64_t lo = 0, root = 0; r == 0 && lo < n; lo += chunk, root++) {
        size_t count = (size_t)(n - lo < chunk ? n - lo : chunk);
        r = reduce ? nccl.reduce(d_buf + lo, d_buf + lo, count, NCCL_FLOAT32, NCCL_SUM, (int)root, comm, stream_of(c))
                   : nccl.broadcast(d_buf + lo, d_buf + lo, count, NCCL_FLOAT32, (int)root, comm, stream_of(c));
    }
    int e = nccl.group_end(); /* also after a failed call: the group is closed either way */
    if (r == 0) r = e;
    pthread_mutex_unlock(&c->lock);
    if (r != 0)
        return FAIL(CMLP_ERR_DEVICE, "the %s of %lld floats (%s) failed: %s (NCCL result %d)", what, (long long)n,
                    call, nccl.error_string(r), r);
    return done(c, cudaSuccess, call);
}

static cmlp_status cu_comm_all_gather(void *ctx, void *comm, float *d_buf, int64_t n, int64_t chunk) {
    return per_part(ctx, comm, d_buf, n, chunk, false);
}

static cmlp_status cu_comm_reduce_scatter(void *ctx, void *comm, float *d_buf, int64_t n, int64_t chunk) {
    return per_part(ctx, comm, d_buf, n, chunk, true);
}

static void cu_comm_free(void *ctx, void *comm) {
    cuda_ctx *c = ctx;
    if (forked) return;
    if (comm && nccl.ok && use(c) == CMLP_OK) (void)nccl.comm_destroy(comm);
}

static const cmlp_backend_i backend = {
    .name = "cuda",
    .open = cu_open,
    .close = cu_close,
    .total_memory = cu_total_memory,
    .free_memory = cu_free_memory,
    .gpu_processes = cu_gpu_processes,
    .workspace_bytes = cu_workspace_bytes,
    .set_workspace = cu_set_workspace,
    .raw_alloc = cu_raw_alloc,
    .raw_free = cu_raw_free,
    .vm_reserve = cu_vm_reserve,
    .vm_map = cu_vm_map,
    .vm_unmap = cu_vm_unmap,
    .vm_release = cu_vm_release,
    .copy_h2d = cu_copy_h2d,
    .copy_d2h = cu_copy_d2h,
    .copy_d2d = cu_copy_d2d,
    .fill_zero = cu_fill_zero,
    .fill_byte = cu_fill_byte,
    .gemm = cu_gemm,
    .gemm_bias_act = cu_gemm_bias_act,
    .gemm_half = cu_gemm_half,
    .bias_grad_half = cu_bias_grad_half,
    .bias_act = cu_bias_act,
    .relu_backward = cu_relu_backward,
    .relu_backward_bias_grad = cu_relu_backward_bias_grad,
    .bias_grad = cu_bias_grad,
    .softmax_xent = cu_softmax_xent,
    .softmax_xent_half = cu_softmax_xent_half,
    .stage_rows = cu_stage_rows,
    .stage_labels = cu_stage_labels,
    .gather_rows = cu_gather_rows,
    .gather_rows_half = cu_gather_rows_half,
    .gather_labels = cu_gather_labels,
    .adam = cu_adam,
    .sgd = cu_sgd,
    .to_half = cu_to_half,
    .from_half = cu_from_half,
    .optim_prepare = cu_optim_prepare,
    .adam_prepared = cu_adam_prepared,
    .unscale = cu_unscale,
    .grad_norm = cu_grad_norm,
    .clip_by_norm = cu_clip_by_norm,
    .clip_by_value = cu_clip_by_value,
    .synchronize = cu_synchronize,
    .stream_side = cu_stream_side,
    .stream_join = cu_stream_join,
    .capture_begin = cu_capture_begin,
    .capture_end = cu_capture_end,
    .graph_launch = cu_graph_launch,
    .graph_free = cu_graph_free,
    .comm_prepare = cu_comm_prepare,
    .comm_id = cu_comm_id,
    .comm_init = cu_comm_init,
    .comm_all_reduce = cu_comm_all_reduce,
    .comm_all_gather = cu_comm_all_gather,
    .comm_reduce_scatter = cu_comm_reduce_scatter,
    .comm_free = cu_comm_free,
};

/* ---- the library's entry ---- */

static int cu_device_count(char *why, size_t cap) {
    started = true;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (why && cap) snprintf(why, cap, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        return 0;
    }
    if (n == 0 && why && cap) snprintf(why, cap, "the CUDA driver reports no device");
    return n;
}

static cmlp_status cu_device_properties(int index, cmlp_device_props *out) {
    if (forked) return FAIL(CMLP_ERR_DEVICE, "cuda:%d: " CMLP_CUDA_FORKED_TEXT, index);
    struct cudaDeviceProp p;
    CU_TRY(cudaGetDeviceProperties(&p, index));
    snprintf(out->name, sizeof out->name, "%s", p.name);
    uuid_text(&p.uuid, out->uuid, sizeof out->uuid);
    out->major = p.major;
    out->minor = p.minor;
    out->total_memory = (int64_t)p.totalGlobalMem;
    out->multi_processor_count = p.multiProcessorCount;
    out->max_threads_per_multi_processor = p.maxThreadsPerMultiProcessor;
    out->warp_size = p.warpSize;
    out->l2_cache_size = p.l2CacheSize;
    return CMLP_OK;
}

static void *cu_ctx_save(void) { return forked ? NULL : ctx_current(); }

static void cu_ctx_restore(void *saved) {
    if (forked || !saved || ctx_current() == saved) return;
    (void)ctx_set((CUcontext)saved);
}

static int cu_runtime_version(void) {
    int v = 0;
    if (cudaRuntimeGetVersion(&v) != cudaSuccess) (void)cudaGetLastError();
    return v;
}

static const cmlp_cuda_module module = {
    .abi = CMLP_CUDA_ABI,
    .backend = &backend,
    .device_count = cu_device_count,
    .runtime_version = cu_runtime_version,
    .device_properties = cu_device_properties,
    .ctx_save = cu_ctx_save,
    .ctx_restore = cu_ctx_restore,
};

__attribute__((visibility("default"))) const cmlp_cuda_module *cmlp_cuda_entry(cmlp_error_fn set_error) {
    record_error = set_error;
    pthread_atfork(NULL, NULL, mark_forked);
    return &module;
}
