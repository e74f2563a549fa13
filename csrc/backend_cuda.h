/* backend_cuda.h - what the CUDA backend's files share (not a public header): the per-device
 * context, the checks that turn CUDA, driver and cuBLAS(Lt) failures into statuses, the thread's
 * capture and second-stream state that decides where work is queued, and each file's part of
 * the backend's table.
 */
#ifndef CMLP_BACKEND_CUDA_H
#define CMLP_BACKEND_CUDA_H

#include "backend.h"
#include "cuda_workspace.h"
#include "kernels.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors ---- */

extern cmlp_error_fn record_error;

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


cmlp_status cuda_fail(cudaError_t e, const char *what, const char *file, int line);
cmlp_status drv_fail(CUresult r, const char *what, const char *file, int line);

#define DRV_TRY(call)                                                                                          \
    do {                                                                                                       \
        CUresult r_ = (call);                                                                                  \
        if (r_ != CUDA_SUCCESS) return drv_fail(r_, #call, __FILE__, __LINE__);                               \
    } while (0)

/* ---- the driver's virtual memory API (loaded when a device opens: backend_cuda.c) ---- */

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
typedef CUresult (*fn_device_of)(CUdevice *, int);
typedef CUresult (*fn_device_attribute)(int *, CUdevice_attribute, CUdevice);

typedef struct {
    fn_mem_create create;
    fn_mem_release release;
    fn_mem_map map;
    fn_mem_unmap unmap;
    fn_mem_set_access set_access;
    fn_mem_reserve reserve;
    fn_mem_free_range free_range;
    fn_mem_granularity granularity;
    fn_get_error_string error_string;
    fn_device_of device_of;
    fn_device_attribute attribute;
    bool ok;
} cuda_vmm;
extern cuda_vmm vmm;

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
    /* a failed first run may be made again whatever beta is: no pass writes D before the last
     * (no split-K, or one reduced through the workspace) */
    bool rerun_safe;
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
    /* cuBLAS, for a GEMM cuBLASLt has no algorithm for (made then, outside a capture: under
     * the lock, with the stream's workspace at each call) */
    cublasHandle_t blas;
    /* gives the allocator's cache back to the device, for a launch out of memory (set_reclaim) */
    void (*reclaim)(void *arg);
    void *reclaim_arg;
    /* the update's kernels (SGD's, Adam's; unscale's; clipping's) loaded ahead (cu_update_load,
     * and cu_optim_prepare before the launch that moves a step's bookkeeping), so that a step
     * cannot fail between the two, nor data-parallel after the ranks agree on it */
    _Atomic bool update_loaded[2], unscale_loaded, clip_loaded;
    /* the bias gradients' kernels (by kind, masked or not) loaded before the lock they are
     * launched under is taken: a load out of memory there could not give the cache back */
    _Atomic bool bias_grad_loaded[3][2];
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
    CUdevice cudev;
    bool retained; /* cuctx retained here (cuDevicePrimaryCtxRetain), released on close */
} cuda_ctx;

/* The workspace block (first_ws its first stream's share): see cuda_workspace.h. */
_Static_assert(CMLP_CUDA_XENT_SCRATCH == CMLP_K_XENT_SCRATCH, "the loss kernel's slot in the workspace block");
_Static_assert(CMLP_K_MOMENTUM_UNSTARTED == CMLP_MOMENTUM_UNSTARTED_BITS, "SGD's buffer where it has not started");

/* ---- where this thread's work goes (backend_cuda_graph.c) ----
 * cap_ctx: the device this thread is capturing a graph on, if any, with the capture's streams;
 * side_ctx: the device whose second stream this thread queues its work to (stream_side), if any. */
extern __thread cuda_ctx *cap_ctx;
extern __thread cudaStream_t cap_stream, cap_side;
extern __thread const void *side_ctx;

static inline bool capturing(const cuda_ctx *c) { return cap_ctx == c; }
/* While a thread captures, what would allocate, free or wait breaks its capture on any device. */
static inline bool thread_capturing(void) { return cap_ctx != NULL; }
static inline bool on_side(const cuda_ctx *c) { return side_ctx == c; }
static inline cudaStream_t stream_of(const cuda_ctx *c) {
    if (cap_ctx == c) return on_side(c) ? cap_side : cap_stream;
    return on_side(c) ? c->side : c->stream;
}

#define REFUSE_WHILE_CAPTURING(c, what)                                                                       \
    do {                                                                                                       \
        if (thread_capturing())                                                                                \
            return FAIL(CMLP_ERR_DEVICE, "%s on cuda:%d while a training step is being captured as a graph",  \
                        (what), (c)->index);                                                                   \
    } while (0)

/* Memory given back during a capture (kind 0: raw_free, 1: vm_unmap, 2: vm_release), given back
 * once the capture ends. */
void defer(int kind, void *ctx, void *ptr, size_t nbytes);

/* The workspace of the stream this thread queues to on c. */
static inline void *ws_of(const cuda_ctx *c, size_t *nbytes) {
    *nbytes = on_side(c) ? c->ws_side_bytes : c->ws_bytes;
    return !on_side(c) ? c->ws : capturing(c) ? c->ws_graph_side : c->ws_side;
}

/* ---- the device in use (backend_cuda.c) ---- */

/* Set in a child forked after CUDA started: every call refuses, and nothing is given back. */
extern bool forked;

/* Makes c's device, in its primary context, current on this thread. */
cmlp_status use(cuda_ctx *c);

#define CMLP_TRY_USE(c)                                                                                        \
    do {                                                                                                       \
        cmlp_status u_ = use(c);                                                                               \
        if (u_ != CMLP_OK) return u_;                                                                          \
    } while (0)

/* After enqueuing work: the launch error, or with CMLP_CUDA_SYNC=1 the execution error too. */
cmlp_status done(cuda_ctx *c, cudaError_t launch, const char *what);

/* A kernel launch: out of memory (its code loads at its first launch, into memory the cache may
 * hold), the cache goes back to the device and the launch is made once more (relaunch). */
extern __thread cudaError_t kernel_err;
bool relaunch(cuda_ctx *c);
#define KERNEL(c, call)                                                                                       \
    (kernel_err = (call),                                                                                      \
     kernel_err == cudaErrorMemoryAllocation && relaunch(c) ? (void)(kernel_err = (call)) : (void)0,         \
     done((c), kernel_err, #call))

/* Memory given back (backend_cuda_memory.c), also by a capture's end for what it deferred. */
void cu_raw_free(void *ctx, void *ptr, size_t nbytes);
void cu_vm_unmap(void *ctx, void *ptr, size_t nbytes);
void cu_vm_release(void *ctx, void *ptr, size_t nbytes);

/* ---- each file's operations, put in the backend's table ---- */

void cuda_memory_ops(cmlp_backend_i *b); /* backend_cuda_memory.c: raw and virtual memory, copies */
void cuda_gemm_ops(cmlp_backend_i *b);   /* backend_cuda_gemm.c: cuBLASLt */
void cuda_kernel_ops(cmlp_backend_i *b); /* backend_cuda_ops.c: the kernels of kernels/ */
void cuda_graph_ops(cmlp_backend_i *b);  /* backend_cuda_graph.c: the second stream, graphs */
void cuda_comm_ops(cmlp_backend_i *b);   /* backend_cuda_nccl.c: NCCL */

/* Frees c's cached GEMM plans (at its close). */
void cuda_plans_free(cuda_ctx *c);

#endif
