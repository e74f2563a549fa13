/* backend_cuda_graph.c - the second stream and CUDA graphs: work forked beside the
 * first stream and joined back, and the training step captured on a stream of the capturing
 * thread's own and replayed on the device's stream.
 */
#include "backend_cuda.h"

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

__thread cuda_ctx *cap_ctx;
__thread cudaStream_t cap_stream;
/* the capture's second stream (cap_side) and its events; cap_forked: work was forked to it and
 * is not joined back yet (a capture must end joined) */
__thread cudaStream_t cap_side;
static __thread cudaEvent_t cap_fork, cap_done;
static __thread bool cap_forked;
static __thread deferred_op *deferred;
static __thread int ndeferred, cap_deferred;
__thread const void *side_ctx;

/* Memory given back during a capture: kept until the capture ends. With no host memory left to
 * note it, it is kept for good (a leak, but freeing it now would break the capture). */
void defer(int kind, void *ctx, void *ptr, size_t nbytes) {
    if (ndeferred == cap_deferred) {
        int cap = cap_deferred ? 2 * cap_deferred : 16;
        deferred_op *d = realloc(deferred, (size_t)cap * sizeof *d);
        if (!d) return;
        deferred = d;
        cap_deferred = cap;
    }
    deferred[ndeferred++] = (deferred_op){kind, ctx, ptr, nbytes};
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
    free(deferred); /* (a thread's list goes with its capture: none is left at the thread's end) */
    deferred = NULL;
    ndeferred = cap_deferred = 0;
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
    /* the graph goes onto the device now, not at its first launch: that needs device memory
     * outside the caching allocator (the cache goes back for it, as for a kernel's code), and
     * a graph that cannot have it is no graph (the step runs eagerly, on every rank) */
    e = cudaGraphUpload(exec, c->stream);
    if (e == cudaErrorMemoryAllocation && relaunch(c)) e = cudaGraphUpload(exec, c->stream);
    if (e != cudaSuccess) {
        (void)cudaGraphExecDestroy(exec);
        return done(c, e, "uploading a training step's graph (cudaGraphUpload)");
    }
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
    if (e == cudaErrorMemoryAllocation && relaunch(c)) { /* (uploaded when made: nothing ran) */
        pthread_mutex_lock(&c->lock);
        e = cudaGraphLaunch((cudaGraphExec_t)graph, c->stream);
        pthread_mutex_unlock(&c->lock);
    }
    return done(c, e, "cudaGraphLaunch");
}

static void cu_graph_free(void *ctx, void *graph) {
    cuda_ctx *c = ctx;
    if (forked) return;
    if (graph && use(c) == CMLP_OK) (void)cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

void cuda_graph_ops(cmlp_backend_i *b) {
    b->stream_side = cu_stream_side;
    b->stream_join = cu_stream_join;
    b->capture_begin = cu_capture_begin;
    b->capture_end = cu_capture_end;
    b->graph_launch = cu_graph_launch;
    b->graph_free = cu_graph_free;
}
