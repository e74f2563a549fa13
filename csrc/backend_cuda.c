/* backend_cuda.c - the CUDA backend's devices: opening one (its stream, cuBLASLt, workspace
 * and primary context), the device in use on each thread, its memory and processes (NVML), and
 * the library's entry. The operations are in backend_cuda_*.c: memory, GEMMs through cuBLASLt,
 * the kernels of kernels/, graphs and the second stream, NCCL. It is all built into its own
 * shared library (_cmlp_cuda.so), which the core loads on first use (cuda_loader.c), so that
 * cmlp imports where there is no CUDA at all.
 *
 * It calls nothing of the core but the error recorder handed to cmlp_cuda_entry. Every CUDA,
 * driver and cuBLAS(Lt) call is checked; a failure becomes CMLP_ERR_DEVICE carrying CUDA's
 * message (CMLP_ERR_OOM where a launch or cuBLAS ran out of device memory; with nothing recorded
 * where the allocator expects that).
 * CMLP_CUDA_SYNC=1 synchronises after every operation, so that an error names its operation.
 */
#include "backend_cuda.h"

#include <dlfcn.h>

cmlp_error_fn record_error;

cmlp_status cuda_fail(cudaError_t e, const char *what, const char *file, int line) {
    (void)cudaGetLastError(); /* clears a non-sticky error; a sticky one stays and says so again */
    return record_error(CMLP_ERR_DEVICE, file, line, "%s failed: %s (%s)", what, cudaGetErrorString(e),
                        cudaGetErrorName(e));
}

/* ---- the driver's virtual memory API, reached through the runtime (no link to libcuda) ---- */

cuda_vmm vmm;

static pthread_once_t vmm_once = PTHREAD_ONCE_INIT;

/* The entry point of the driver's function `name` as CUDA 12.0 defines it. The call that takes a
 * version came with CUDA 12.5 (and the one without it went in 13.0); before it, the version is
 * the runtime's own, 12.x, whose signatures of these functions are 12.0's. */
static void *driver_symbol(const char *name) {
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
#else
    cudaError_t e = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
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
    vmm.device_of = (fn_device_of)driver_symbol("cuDeviceGet");
    vmm.attribute = (fn_device_attribute)driver_symbol("cuDeviceGetAttribute");
    vmm.ok = vmm.create && vmm.release && vmm.map && vmm.unmap && vmm.set_access && vmm.reserve && vmm.free_range &&
             vmm.granularity && vmm.device_of && vmm.attribute;
}

/* The driver's current context of the calling thread: what a call from Python finds is put
 * back after it (ctx_save / ctx_restore, as torch's device guards put the device back), and
 * use() checks it, since a context another library made current on the thread (the same device
 * or not) is not the one this backend's streams and memory belong to. */
typedef CUresult (*fn_ctx_get)(CUcontext *);
typedef CUresult (*fn_ctx_set)(CUcontext);
typedef CUresult (*fn_device_get)(CUdevice *, int);
typedef CUresult (*fn_primary_retain)(CUcontext *, CUdevice);
typedef CUresult (*fn_primary_release)(CUdevice);
static fn_ctx_get ctx_get;
static fn_ctx_set ctx_set;
static fn_device_get device_get;
static fn_primary_retain primary_retain;
static fn_primary_release primary_release;
static pthread_once_t ctx_once = PTHREAD_ONCE_INIT;

static void ctx_load(void) {
    fn_ctx_get get = (fn_ctx_get)driver_symbol("cuCtxGetCurrent");
    fn_ctx_set set = (fn_ctx_set)driver_symbol("cuCtxSetCurrent");
    if (!get || !set) return;
    ctx_get = get;
    ctx_set = set;
    fn_device_get dev = (fn_device_get)driver_symbol("cuDeviceGet");
    fn_primary_retain retain = (fn_primary_retain)driver_symbol("cuDevicePrimaryCtxRetain");
    fn_primary_release release = (fn_primary_release)driver_symbol("cuDevicePrimaryCtxRelease");
    if (dev && retain && release) {
        device_get = dev;
        primary_retain = retain;
        primary_release = release;
    }
}

/* The thread's current context, NULL when it has none or that cannot be told. */
static CUcontext ctx_current(void) {
    pthread_once(&ctx_once, ctx_load);
    CUcontext c = NULL;
    if (!ctx_get || ctx_get(&c) != CUDA_SUCCESS) return NULL;
    return c;
}

cmlp_status drv_fail(CUresult r, const char *what, const char *file, int line) {
    const char *msg = NULL;
    pthread_once(&vmm_once, vmm_load);
    if (!vmm.error_string || vmm.error_string(r, &msg) != CUDA_SUCCESS || !msg) msg = "unknown driver error";
    return record_error(CMLP_ERR_DEVICE, file, line, "%s failed: %s (CUresult %d)", what, msg, (int)r);
}

/* A child forked from this process cannot use the CUDA that the parent started (the driver
 * does not survive fork): from the fork on, every call in the child is refused, and what the
 * parent's memory and graphs would give back is left alone. */
bool forked;
static bool started; /* the driver was asked for the devices */
static void mark_forked(void) { forked = started; }

/* Makes c's device current on this thread. cudaSetDevice also makes its primary context
 * current, which the driver API calls (the VMM path) need and cudaGetDevice does not give: so a
 * thread sets it at least once (bound_device), and again whenever it changes devices. */
static __thread int bound_device = -1;

cmlp_status use(cuda_ctx *c) {
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

cmlp_status done(cuda_ctx *c, cudaError_t launch, const char *what) {
    /* out of device memory at a launch: CUDA loads a kernel's code at its first launch (lazy
     * loading), into memory outside the caching allocator (KERNEL gave the cache back first,
     * where it could) */
    if (launch == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return FAIL(CMLP_ERR_OOM,
                    "CUDA out of memory at a launch: CUDA loads a kernel's code at its first launch, into device "
                    "memory outside the caching allocator, and the memory in use leaves none. Free tensors or "
                    "release cached memory (cmlp.cuda.empty_cache()) and retry. The launch: %.200s "
                    "(cudaErrorMemoryAllocation)", what);
    }
    if (launch != cudaSuccess) return cuda_fail(launch, what, __FILE__, __LINE__);
    if (c->sync_each && !thread_capturing()) {
        cudaError_t e = cudaStreamSynchronize(stream_of(c));
        if (e != cudaSuccess) return cuda_fail(e, what, __FILE__, __LINE__);
    }
    return CMLP_OK;
}

static int env_flag(const char *name) {
    const char *v = getenv(name);
    return v && v[0] && strcmp(v, "0") != 0;
}

static void cu_close(void *ctx) {
    cuda_ctx *c = ctx;
    if (!c) return;
    cuda_plans_free(c);
    if (c->lt) cublasLtDestroy(c->lt);
    if (c->blas) cublasDestroy(c->blas);
    /* a device closes only when its opening fails, before any of these exist; they go too,
     * should one ever close after use */
    for (int i = 0; i < STAGE_SLOTS; i++) {
        if (c->h_stage_done[i]) (void)cudaEventSynchronize(c->h_stage_done[i]);
        if (c->h_stage[i]) (void)cudaFreeHost(c->h_stage[i]);
        if (c->h_stage_done[i]) (void)cudaEventDestroy(c->h_stage_done[i]);
    }
    if (c->side_fork) (void)cudaEventDestroy(c->side_fork);
    if (c->side_done) (void)cudaEventDestroy(c->side_done);
    if (c->side) (void)cudaStreamDestroy(c->side);
    if (c->stream) cudaStreamDestroy(c->stream);
    if (c->retained && !forked) (void)primary_release(c->cudev);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* CUBLASLT_WORKSPACE_SIZE (cmlp_cuda_workspace_env): a value that is not a whole number from 0
 * to FIRST_WS_MAX_KIB fails the device's opening, before it touches the GPU. */
static cmlp_status workspace_env(long long *kib) {
    const char *env;
    if (!cmlp_cuda_workspace_env(kib, &env))
        return FAIL(CMLP_ERR_INVALID,
                    "CUBLASLT_WORKSPACE_SIZE=%.40s: expected the KiB of cuBLASLt's workspace on the first stream, a "
                    "whole number from 0 to %d",
                    env, FIRST_WS_MAX_KIB);
    return CMLP_OK;
}

/* The first stream's share of the workspace block on this GPU (cmlp_cuda_first_workspace). */
static cmlp_status first_workspace(int index, long long kib, size_t *out) {
    int major = 0;
    if (kib < 0) {
        struct cudaDeviceProp p;
        CU_TRY(cudaGetDeviceProperties(&p, index));
        major = p.major;
    }
    *out = cmlp_cuda_first_workspace(major, kib);
    return CMLP_OK;
}

#ifndef CMLP_CUDA_ARCHS
#define CMLP_CUDA_ARCHS "other architectures" /* (setup.py names those built for) */
#endif

/* Whether this build's kernels have code the GPU runs (machine code for its architecture, or
 * PTX its driver compiles): asked of an empty kernel as the device opens, so that a GPU the
 * build was not made for is refused there, in words, not at the first launch of a step. Out of
 * memory for its code is left to the launches. */
static cmlp_status kernels_runnable(int index) {
    const cudaError_t e = cmlp_k_probe();
    if (e == cudaSuccess) return CMLP_OK;
    (void)cudaGetLastError();
    if (e != cudaErrorNoKernelImageForDevice && e != cudaErrorInvalidDeviceFunction &&
        e != cudaErrorUnsupportedPtxVersion)
        return CMLP_OK;
    struct cudaDeviceProp p;
    CU_TRY(cudaGetDeviceProperties(&p, index));
    if (e == cudaErrorUnsupportedPtxVersion)
        return FAIL(CMLP_ERR_DEVICE,
                    "cuda:%d (%.100s) cannot run cmlp's kernels: this build has no machine code for its compute "
                    "capability %d.%d, and its PTX is from a CUDA toolkit (%d.%d) newer than the GPU's driver "
                    "supports. Update the driver, or reinstall cmlp with CMLP_CUDA_ARCH=%d%d set (%s)", index, p.name,
                    p.major, p.minor, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10, p.major, p.minor,
                    cudaGetErrorName(e));
    return FAIL(CMLP_ERR_DEVICE,
                "cuda:%d (%.100s, compute capability %d.%d) cannot run cmlp's kernels: this build has code for %s "
                "only (CMLP_CUDA_ARCH). Reinstall cmlp with CMLP_CUDA_ARCH=%d%d set (%s)", index,
                p.name, p.major, p.minor, CMLP_CUDA_ARCHS, p.major, p.minor, cudaGetErrorName(e));
}

/* Makes the device's primary context current on this thread, retained for as long as the device
 * is open: a context another library made current there (cuCtxCreate's, of the same device) is
 * left to it, whatever cudaSetDevice does with it, so the streams and memory made next are the
 * primary context's and outlive that one. Without the driver's entry points, the runtime's
 * choice stands (c->cuctx is what is current once the stream is made). */
static cmlp_status enter_primary(cuda_ctx *c) {
    pthread_once(&ctx_once, ctx_load);
    if (!primary_retain) return CMLP_OK;
    CUcontext primary = NULL;
    DRV_TRY(device_get(&c->cudev, c->index));
    DRV_TRY(primary_retain(&primary, c->cudev));
    c->retained = true;
    if (ctx_current() != primary) DRV_TRY(ctx_set(primary));
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
    if (e == cudaSuccess && (st = enter_primary(c)) == CMLP_OK)
        e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (st == CMLP_OK && e != cudaSuccess) {
        st = cuda_fail(e, "opening the device (cudaSetDevice, stream)", __FILE__, __LINE__);
    } else if (st == CMLP_OK) {
        cublasStatus_t s = cublasLtCreate(&c->lt);
        if (s != CUBLAS_STATUS_SUCCESS)
            st = FAIL(CMLP_ERR_DEVICE, "cublasLtCreate failed on cuda:%d: %s", index, cublasLtGetStatusString(s));
    }
    if (st == CMLP_OK) st = first_workspace(index, ws_kib, &c->first_ws);
    if (st == CMLP_OK) st = kernels_runnable(index);
    if (st == CMLP_OK) c->cuctx = ctx_current(); /* the one the stream was made in (enter_primary) */
    if (st == CMLP_OK) {
        pthread_once(&vmm_once, vmm_load);
        size_t gran = 0;
        CUmemAllocationProp prop = {0};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = index;
        /* the device's word (a vGPU or an old driver may have the entry points without it) */
        const CUdevice_attribute vm_attr = CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
        CUdevice cu_dev;
        int vm = 0;
        c->vm_ok = vmm.ok && vmm.device_of(&cu_dev, index) == CUDA_SUCCESS &&
                   vmm.attribute(&vm, vm_attr, cu_dev) == CUDA_SUCCESS && vm == 1 &&
                   vmm.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS && gran &&
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
} nvml_process; /* nvmlProcessInfo_v2_t (24 bytes), which the _v2 query fills on every driver */

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static int (*nvml_by_uuid)(const char *uuid, void **device);
static int (*nvml_processes)(void *device, unsigned int *count, nvml_process *infos);

static void nvml_load(void) {
    const char *env = getenv("CMLP_NVML_LIBRARY");
    void *h = dlopen(env && env[0] ? env : "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    int (*init)(void) = h ? (int (*)(void))dlsym(h, "nvmlInit_v2") : NULL;
    if (!init || init() != 0) return;
    nvml_by_uuid = (int (*)(const char *, void **))dlsym(h, "nvmlDeviceGetHandleByUUID");
    /* not _v3 where _v2 is: _v3's entries grew to 32 bytes (usedGpuCcProtectedMemory) with the
     * R535 drivers and shrank back later, under the same name; read as 24, every entry after the
     * first would be garbage, and the driver would write past the array */
    typedef int (*processes_fn)(void *, unsigned int *, nvml_process *);
    nvml_processes = (processes_fn)dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v2");
    if (!nvml_processes) nvml_processes = (processes_fn)dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v3");
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
        if (nvml_by_uuid(uuid, &dev) != 0 || !dev) {
            memcpy(uuid, "MIG-", 4); /* a MIG instance: CUDA's UUID is the instance's, which NVML names so */
            if (nvml_by_uuid(uuid, &dev) != 0 || !dev) return -1;
        }
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
    return cmlp_cuda_workspace_bytes(c->first_ws);
}

static void cu_set_reclaim(void *ctx, void (*reclaim)(void *arg), void *arg) {
    cuda_ctx *c = ctx;
    c->reclaim = reclaim;
    c->reclaim_arg = arg;
}

__thread cudaError_t kernel_err;

bool relaunch(cuda_ctx *c) {
    (void)cudaGetLastError(); /* the failed launch's */
    if (!c->reclaim || thread_capturing()) return false;
    /* giving memory back may need the lock (unmapping expandable pages): not where this thread
     * holds it (nor while another does) */
    if (pthread_mutex_trylock(&c->lock) != 0) return false;
    pthread_mutex_unlock(&c->lock);
    c->reclaim(c->reclaim_arg);
    return true;
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

static cmlp_backend_i backend = {
    .name = "cuda",
    .open = cu_open,
    .close = cu_close,
    .total_memory = cu_total_memory,
    .free_memory = cu_free_memory,
    .gpu_processes = cu_gpu_processes,
    .workspace_bytes = cu_workspace_bytes,
    .set_workspace = cu_set_workspace,
    .set_reclaim = cu_set_reclaim,
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
    cuda_memory_ops(&backend);
    cuda_gemm_ops(&backend);
    cuda_kernel_ops(&backend);
    cuda_graph_ops(&backend);
    cuda_comm_ops(&backend);
    pthread_atfork(NULL, NULL, mark_forked);
    return &module;
}

