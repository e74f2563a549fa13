/* backend_cuda_nccl.c - collectives between the GPUs of a process group through NCCL,
 * loaded on first use and queued on the device's stream (so a captured step records them).
 */
#include "backend_cuda.h"

#include <dlfcn.h>

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
/* The first NCCL whose collectives a CUDA graph can capture (from 2.9.6) and run beside ones
 * not captured on the same communicator (NCCL_GRAPH_MIXING_SUPPORT, 2.13): the training step
 * is captured, and the first step of each shape, a validation's, runs eagerly. */
#define NCCL_MIN_VERSION 21300 /* 2.13.0 */

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
    /* NCCL registers the buffers of collectives captured in a graph where they come from a
     * qualified allocation (ncclMemAlloc's kind); the gradients here come from the caching
     * allocator, with expandable segments from many 2 MiB VMM pages, which such registration
     * is known to hang on. Off unless the environment says otherwise (the gradients are small
     * enough that the copy it saves does not matter); set once, here, before any communicator
     * reads it (setenv is not safe beside other threads' getenv). */
    setenv("NCCL_GRAPH_REGISTER", "0", 0);
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
                 "NCCL %s (%.300s) is older than %s, the first that runs collectives a CUDA graph captured beside "
                 "ones it did not on one communicator; install "
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
    /* (NCCL_GRAPH_REGISTER is off: nccl_load) */
    NCCL_TRY(nccl.comm_init_rank(comm, size, uid, rank), "ncclCommInitRank");
    return CMLP_OK;
}

/* NCCL makes its peers' connections, and their buffers, in device memory outside the caching
 * allocator, at a communicator's first collectives of each kind (from 2.22; before, as the
 * communicator is made): a CUDA or system error there with less than this much free is most
 * likely that. */
#define NCCL_ROOM ((size_t)1 << 30)

/* What a failed NCCL call's message adds: where it met a CUDA or system error with little device
 * memory free, that its buffers found no room, and what leaves them some. */
static void nccl_room_hint(int r, char *out, size_t cap) {
    size_t free_b = 0, total = 0;
    out[0] = '\0';
    if (r != 1 && r != 2) return; /* ncclUnhandledCudaError, ncclSystemError */
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    if (free_b >= NCCL_ROOM) return;
    snprintf(out, cap, ". With %.2f MiB of device memory free, this is most likely NCCL's own buffers, which it makes "
             "outside the caching allocator at a communicator's first collectives: cmlp.cuda.empty_cache() before "
             "the first step, a lower cmlp.memory.set_memory_limit, or NCCL_RUNTIME_CONNECT=0 in the environment "
             "(NCCL makes them as the process group is made) leaves them room", (double)free_b / (1 << 20));
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
    if (r != 0) {
        (void)cudaGetLastError(); /* a CUDA error NCCL met is its failure's, not the next launch's */
        char hint[400];
        nccl_room_hint(r, hint, sizeof hint);
        return FAIL(CMLP_ERR_DEVICE, "ncclAllReduce of %lld floats failed: %s (NCCL result %d)%s", (long long)n,
                    nccl.error_string(r), r, hint);
    }
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
    if (r != 0) {
        (void)cudaGetLastError(); /* (as in cu_comm_all_reduce) */
        char hint[400];
        nccl_room_hint(r, hint, sizeof hint);
        return FAIL(CMLP_ERR_DEVICE, "the %s of %lld floats (%s) failed: %s (NCCL result %d)%s", what, (long long)n,
                    call, nccl.error_string(r), r, hint);
    }
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

/* ---- fences: what the process group's timeout watches (comm_watch.c) ---- */

static cmlp_status cu_fence_record(void *ctx, void **fence) {
    cuda_ctx *c = ctx;
    *fence = NULL;
    if (thread_capturing()) return CMLP_OK; /* recorded, not run */
    CMLP_TRY_USE(c);
    cudaEvent_t e;
    CU_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    pthread_mutex_lock(&c->lock); /* in stream order with what other threads queue */
    cudaError_t r = cudaEventRecord(e, stream_of(c));
    pthread_mutex_unlock(&c->lock);
    if (r != cudaSuccess) {
        (void)cudaEventDestroy(e);
        return cuda_fail(r, "cudaEventRecord", __FILE__, __LINE__);
    }
    *fence = e;
    return CMLP_OK;
}

/* On the watcher's thread: its errors are its own (CUDA's last error is per thread), and its calls
 * are relaxed about captures (in the default, global mode they would break another thread's). */
static int cu_fence_passed(void *ctx, void *fence) {
    cuda_ctx *c = ctx;
    static __thread bool relaxed;
    if (!relaxed) {
        enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
        relaxed = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
        if (!relaxed) (void)cudaGetLastError();
    }
    if (forked || use(c) != CMLP_OK) return -1;
    cudaError_t r = cudaEventQuery((cudaEvent_t)fence);
    if (r == cudaSuccess) return 1;
    (void)cudaGetLastError();
    return r == cudaErrorNotReady ? 0 : -1;
}

static void cu_fence_free(void *ctx, void *fence) {
    cuda_ctx *c = ctx;
    if (!forked && fence && use(c) == CMLP_OK) (void)cudaEventDestroy((cudaEvent_t)fence);
}

void cuda_comm_ops(cmlp_backend_i *b) {
    b->fence_record = cu_fence_record;
    b->fence_passed = cu_fence_passed;
    b->fence_free = cu_fence_free;
    b->comm_prepare = cu_comm_prepare;
    b->comm_id = cu_comm_id;
    b->comm_init = cu_comm_init;
    b->comm_all_reduce = cu_comm_all_reduce;
    b->comm_all_gather = cu_comm_all_gather;
    b->comm_reduce_scatter = cu_comm_reduce_scatter;
    b->comm_free = cu_comm_free;
}
