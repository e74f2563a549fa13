/* backend_cuda_memory.c - device memory for the caching allocator: cudaMalloc and cudaFree,
 * and expandable segments on the driver's virtual memory API (2 MiB pages mapped into a reserved
 * range); the copies and fills, queued on the stream this thread uses.
 */
#include "backend_cuda.h"

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

void cu_raw_free(void *ctx, void *ptr, size_t nbytes) {
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

void cu_vm_unmap(void *ctx, void *ptr, size_t nbytes) {
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

void cu_vm_release(void *ctx, void *ptr, size_t nbytes) {
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

static bool cu_vm_supported(void *ctx) { return ((cuda_ctx *)ctx)->vm_ok; }

void cuda_memory_ops(cmlp_backend_i *b) {
    b->raw_alloc = cu_raw_alloc;
    b->raw_free = cu_raw_free;
    b->vm_reserve = cu_vm_reserve;
    b->vm_map = cu_vm_map;
    b->vm_unmap = cu_vm_unmap;
    b->vm_release = cu_vm_release;
    b->vm_supported = cu_vm_supported;
    b->copy_h2d = cu_copy_h2d;
    b->copy_d2h = cu_copy_d2h;
    b->copy_d2d = cu_copy_d2d;
    b->fill_zero = cu_fill_zero;
    b->fill_byte = cu_fill_byte;
}
