/* plan.c - predicts the memory of a training run before anything is allocated: the bytes of
 * each category, from the same layout functions the model uses, and the peak allocated and
 * reserved bytes from a replay of the run's requests on an allocator with the device's rules
 * and settings over a device that only hands out addresses.
 */
#include "internal.h"
#include "cuda_workspace.h"

#include <string.h>

/* ---- a device of addresses: nothing is touched, so any size can be planned ---- */

static int64_t paper_total(void *ctx) { return ((cmlp_paper_device *)ctx)->total; }

static cmlp_status paper_reserve(void *ctx, size_t n, void **out) {
    cmlp_paper_device *d = ctx;
    *out = (void *)d->next;
    d->next += (n + ((size_t)4 << 20)) & ~(((size_t)2 << 20) - 1); /* a gap between segments */
    return CMLP_OK;
}

static cmlp_status paper_map(void *ctx, void *p, size_t n) {
    cmlp_paper_device *d = ctx;
    (void)p;
    if (n > (size_t)d->room) return CMLP_ERR_OOM;
    d->room -= (int64_t)n;
    return CMLP_OK;
}

static void paper_unmap(void *ctx, void *p, size_t n) {
    (void)p;
    ((cmlp_paper_device *)ctx)->room += (int64_t)n;
}

static cmlp_status paper_alloc(void *ctx, size_t n, void **out) {
    CMLP_TRY(paper_map(ctx, NULL, n));
    return paper_reserve(ctx, n, out);
}

static void paper_release(void *ctx, void *p, size_t n) {
    (void)ctx, (void)p, (void)n;
}

static bool paper_has_vm(void *ctx) { return !((cmlp_paper_device *)ctx)->no_vm; }

const cmlp_backend_i cmlp_paper_backend = {
    .name = "plan",
    .total_memory = paper_total,
    .raw_alloc = paper_alloc,
    .raw_free = paper_unmap,
    .vm_reserve = paper_reserve,
    .vm_map = paper_map,
    .vm_unmap = paper_unmap,
    .vm_release = paper_release,
    .vm_supported = paper_has_vm,
};

/* A device of addresses standing for a real one: its room is what the real one has free. */
typedef struct {
    cmlp_paper_device pd; /* first: the paper backend's context */
    cmlp_device_ctx *of;
} paper_of;

/* Called as the allocator is copied, under its lock: the device's free memory then, which the
 * copy's segments are counted against. */
static void read_room(void *ctx) {
    paper_of *p = ctx;
    int64_t free_now = p->of->backend->free_memory(p->of->bctx);
    if (free_now >= 0) p->pd.room = free_now;
}

/* Whether the n requests, made in this order on the device now (none freed), would be served
 * once the blocks at drop[0..ndrop) (allocated on it) are freed: tried on a copy of its allocator
 * over a device of addresses with the memory the device has free (off the host: there the
 * operating system decides), so that the limit, the pools, max_split_size, garbage collection,
 * expandable segments and the release ladder apply as they will. Nothing of the device's changes. */
cmlp_status cmlp_plan_try(cmlp_device_ctx *dev, const size_t *nbytes, int n, void *const *drop, int ndrop,
                          bool *served) {
    *served = false;
    const cmlp_backend_i *be = dev->backend;
    paper_of po = {.pd = {.next = (uintptr_t)1 << 62, .total = be->total_memory(dev->bctx), .room = INT64_MAX / 4},
                   .of = dev};
    const bool device_room = !be->host_memory && be->free_memory;
    cmlp_allocator *a;
    CMLP_TRY(cmlp_allocator_copy(dev->alloc, &cmlp_paper_backend, &po.pd, device_room ? read_room : NULL, &a));
    cmlp_status st = CMLP_OK;
    for (int i = 0; i < ndrop && st == CMLP_OK; i++) st = cmlp_allocator_free(a, drop[i]);
    void *p;
    int k = 0;
    while (st == CMLP_OK && k < n && cmlp_allocator_try_malloc(a, nbytes[k], "planned", &p) == CMLP_OK) k++;
    cmlp_allocator_destroy(a);
    if (st == CMLP_OK) *served = k == n;
    return st;
}

static int64_t reserved_now(cmlp_allocator *a) {
    cmlp_memory_stats s;
    cmlp_allocator_stats(a, &s);
    return s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].current;
}

/* A fit's epochs with validation, the first one's step buffers (ws_block, ws bytes) allocated:
 * after each epoch the step's buffers go back, the evaluation's (fwd bytes) are taken and go
 * back, and the next epoch's first step takes the step's again. Mostly these come back from the
 * cache, but not always: a request below max_split_size may not take a block at or above it, and
 * a new segment for it can be that large (a 20 MiB one when max_split_size_mb is 20), so that
 * each epoch reserves segments again. An epoch that reserves nothing leaves the cache as it
 * found it (each block it took went back before the next request), and so does every later
 * one; two in a row that add the same bytes are the pattern the later ones repeat.
 * *later: the reserved bytes the epochs not replayed add. */
/* A request of the replay, under the allocator's limit where it has room (past it, the run does
 * not fit: the request is made without the limit, and the reserved bytes show by how much). */
static cmlp_status replay_malloc(cmlp_allocator *a, size_t nbytes, bool lent, const char *what, void **p,
                                 int64_t *limit) {
    /* an evaluation's buffers as cmlp_forward_reserve takes them, the step's as the workspace */
    cmlp_status st = lent ? cmlp_allocator_malloc_lent(a, nbytes, what, p) : cmlp_allocator_malloc(a, nbytes, what, p);
    if (st != CMLP_ERR_OOM || *limit < 0) return st;
    *limit = -1;
    cmlp_allocator_set_limit(a, -1);
    return cmlp_allocator_malloc(a, nbytes, what, p);
}

/* *limit: the allocator's limit (-1: none), lifted where a request finds no room under it. */
static cmlp_status replay_epochs(cmlp_allocator *a, void *ws_block, size_t ws, size_t fwd, int64_t epochs,
                                 int64_t *limit, int64_t *later) {
    enum { MAX_REPLAYED = 64 };
    int64_t grew_before = -1;
    *later = 0;
    for (int64_t e = 1; e <= epochs; e++) {
        int64_t before = reserved_now(a);
        void *p;
        if (e > 1) CMLP_TRY(replay_malloc(a, ws, false, "planned", &ws_block, limit));
        CMLP_TRY(cmlp_allocator_free(a, ws_block));
        CMLP_TRY(replay_malloc(a, fwd, true, "planned evaluation", &p, limit));
        CMLP_TRY(cmlp_allocator_free(a, p));
        if (e == 1) continue; /* its step's buffers were the run's first */
        int64_t grew = reserved_now(a) - before;
        if (grew == 0) return CMLP_OK;
        if (grew == grew_before || e == MAX_REPLAYED) {
            int64_t left = epochs - e; /* the caller caps the sum at what the device has */
            *later = grew > INT64_MAX / 4 / (left > 0 ? left : 1) ? INT64_MAX / 4 : grew * left;
            return CMLP_OK;
        }
        grew_before = grew;
    }
    return CMLP_OK;
}

cmlp_status cmlp_plan_compute(const int *sizes, int nsizes, int64_t batch, int optimizer_buffers, int optimizer_shards,
                              int optimizer_parts, cmlp_amp amp, int recompute, int loss_scaling, int solo,
                              int64_t data_rows, int64_t data_row_bytes, int data_shuffled, int64_t eval_rows,
                              int eval_staged, int64_t epochs, int64_t eval_budget, cmlp_device d,
                              const cmlp_gpu_desc *gpu, cmlp_plan *out) {
    if (!out) return CMLP_FAIL(CMLP_ERR_INVALID, "out must not be NULL");
    if (!sizes || nsizes < 2 || nsizes > CMLP_MAX_LAYERS + 1)
        return CMLP_FAIL(CMLP_ERR_INVALID, "layer_sizes must list 2 to %d sizes, got %d%s", CMLP_MAX_LAYERS + 1, nsizes,
                         sizes ? "" : " (and a NULL array)");
    for (int i = 0; i < nsizes; i++)
        if (sizes[i] < 1 || sizes[i] > (1 << 24))
            return CMLP_FAIL(CMLP_ERR_INVALID, "layer_sizes[%d] = %d: every size must be in [1, %d]", i, sizes[i],
                             1 << 24);
    if (batch < 1) return CMLP_FAIL(CMLP_ERR_INVALID, "batch_size must be >= 1, got %lld", (long long)batch);
    if (epochs < 1) return CMLP_FAIL(CMLP_ERR_INVALID, "epochs must be >= 1, got %lld", (long long)epochs);
    if (amp != CMLP_AMP_NONE && amp != CMLP_AMP_FP16 && amp != CMLP_AMP_BF16)
        return CMLP_FAIL(CMLP_ERR_INVALID, "unknown amp mode %d", (int)amp);
    if (eval_budget < 0 || eval_budget > ((int64_t)1 << 62))
        return CMLP_FAIL(CMLP_ERR_INVALID, "the budget must be in [0, 2**62] bytes, got %lld", (long long)eval_budget);
    /* the byte counts below stay far from overflowing: at most 2**56 activation values */
    int64_t width_sum = 0;
    for (int i = 0; i < nsizes; i++) width_sum += sizes[i];
    if (eval_rows < 0 || eval_rows > ((int64_t)1 << 56) / width_sum)
        return CMLP_FAIL(CMLP_ERR_INVALID, "evaluation rows must be in [0, 2**56 / %lld], got %lld",
                         (long long)width_sum, (long long)eval_rows);
    if (batch > ((int64_t)1 << 56) / width_sum)
        return CMLP_FAIL(CMLP_ERR_INVALID,
                         "batch_size %lld is too large to plan: its activations alone would be over 2**56 values "
                         "(%lld per sample)",
                         (long long)batch, (long long)width_sum);
    if (optimizer_buffers < 0 || optimizer_buffers > 3)
        return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer state buffers must be 0 to 3, got %d", optimizer_buffers);
    if (optimizer_shards < 1 || optimizer_shards > (1 << 20))
        return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer_shards must be in [1, 2**20], got %d", optimizer_shards);
    if (optimizer_parts < 0 || optimizer_parts > CMLP_MAX_PARTS)
        return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer_parts must be in [0, %d], got %d", CMLP_MAX_PARTS,
                         optimizer_parts);
    if (data_rows < 0 || data_row_bytes < 0 || data_row_bytes > ((int64_t)4 << 24) ||
        data_rows > ((int64_t)1 << 56) / (data_row_bytes + 12))
        return CMLP_FAIL(CMLP_ERR_INVALID, "a data set of %lld rows of %lld bytes cannot be planned (rows >= 0, at "
                                           "most 2**56 bytes)", (long long)data_rows, (long long)data_row_bytes);
    /* the device planned for: what it holds from the moment it opens, its memory, whether it
     * multiplies half operands directly and has the virtual memory API */
    bool on_host = false, no_vm = false;
    int native = 1; /* (a GPU's backend does) */
    int64_t total = 0;
    size_t standing = 0;
    if (gpu) {
        if (gpu->major < 1 || gpu->major > 99 || gpu->total_memory < 0)
            return CMLP_FAIL(CMLP_ERR_INVALID,
                             "a GPU to plan for needs a compute capability (major) from 1 to 99 and its memory in bytes "
                             "(>= 0), got %d and %lld",
                             gpu->major, (long long)gpu->total_memory);
        long long kib;
        const char *text;
        if (!cmlp_cuda_workspace_env(&kib, &text))
            return CMLP_FAIL(CMLP_ERR_INVALID,
                             "CUBLASLT_WORKSPACE_SIZE=%.40s: expected the KiB of cuBLASLt's workspace on the first "
                             "stream, a whole number from 0 to %d",
                             text, FIRST_WS_MAX_KIB);
        standing = cmlp_cuda_workspace_bytes(cmlp_cuda_first_workspace(gpu->major, kib));
        total = gpu->total_memory;
    } else {
        cmlp_device_ctx *dev;
        CMLP_TRY(cmlp_device_get(d, &dev));
        on_host = dev->device.type == CMLP_DEVICE_CPU;
        no_vm = !cmlp_backend_has_vm(dev->backend, dev->bctx);
        native = cmlp_amp_native(dev->backend);
        total = dev->backend->total_memory(dev->bctx);
        standing = dev->backend->workspace_bytes ? dev->backend->workspace_bytes(dev->bctx) : 0;
    }
    int L = nsizes - 1;
    int64_t nparams = 0;
    for (int l = 0; l < L; l++) nparams += (int64_t)sizes[l] * sizes[l + 1] + sizes[l + 1];
    size_t sz[CMLP_MAX_LAYERS + 12], off[CMLP_MAX_LAYERS + 12], act = 0, ws = 0, inside_bytes = 0;
    uint64_t inside = 0;
    int nv = amp         ? cmlp_amp_layout(sizes, L, batch, recompute, native, sz, &act, &inside)
             : recompute ? cmlp_rc_layout(sizes, L, batch, sz, &act)
                         : cmlp_ws_layout(sizes, L, batch, sz, &act, &inside);
    /* as the model decides it (cmlp_workspace_reserve, and reserve in model_amp.c) */
    size_t half_in = amp ? cmlp_amp_half_bytes(nparams) : 0;
    bool compact = solo && !recompute && (!amp || native) &&
                   cmlp_compact_place(L, sz, nv, inside, half_in, cmlp_first_grad_bytes(sizes), off);
    if (!compact) inside = 0;
    for (int i = 0; i < nv; i++) {
        if (cmlp_piece_in(inside, i))
            inside_bytes += sz[i];
        else
            ws += sz[i];
    }
    if (compact) act = sz[0] + sz[1]; /* the activations left outside: the input and layer 1's output, listed first */
    memset(out, 0, sizeof *out);
    out->parameters = nparams * 4;
    out->gradients = nparams * 4;
    /* sharded, the first rank's part (the largest) */
    int64_t kept = optimizer_shards > 1 ? cmlp_shard_chunk(nparams, optimizer_shards) : nparams;
    out->optimizer_state = (int64_t)optimizer_buffers * (kept < nparams ? kept : nparams) * 4;
    /* off the host, the groups' settings and a fit's data set are in the device's memory */
    size_t parts = on_host || !optimizer_parts ? 0 : cmlp_optim_parts_bytes(optimizer_parts), data[3] = {0, 0, 0};
    if (!on_host && data_rows > 0) cmlp_resident_sizes(data_rows, (size_t)data_row_bytes, data_shuffled, data);
    out->optimizer_state += (int64_t)parts;
    out->data = (int64_t)(data[0] + data[1] + data[2]);
    out->half_weights = amp && !compact ? nparams * 2 : 0;
    out->activations = (int64_t)act;
    out->in_gradients = compact ? (int64_t)(inside_bytes + half_in) : 0;
    /* the device scalars (loss, scaler, step count) follow the gradients, padded to 64 bytes */
    size_t grads_bytes = ((size_t)out->gradients + 63) / 64 * 64 + sizeof(cmlp_dscalars);
    out->workspace = (int64_t)(ws - act) + (int64_t)(grads_bytes - (size_t)out->gradients);
    (void)loss_scaling; /* the scaler's state is among them whether or not it is used */

    /* the run's requests in the order the library makes them: the model, the optimizer's groups,
     * the fit's data set at its first epoch, the optimizer state at the first step */
    size_t req[CMLP_PLAN_REQUESTS];
    cmlp_plan_held kind[CMLP_PLAN_REQUESTS];
    int nreq = 0;
    kind[nreq] = CMLP_HELD_MODEL, req[nreq++] = (size_t)out->parameters;
    kind[nreq] = CMLP_HELD_MODEL, req[nreq++] = grads_bytes;
    if (parts) kind[nreq] = CMLP_HELD_PARTS, req[nreq++] = parts;
    for (int i = 0; i < 3; i++)
        if (data[i]) kind[nreq] = CMLP_HELD_DATA, req[nreq++] = data[i];
    if (optimizer_buffers) { /* before the first gradients: the arena, and AMSGrad's maximum apart */
        size_t one = (size_t)(out->optimizer_state - (int64_t)parts) / (size_t)optimizer_buffers;
        kind[nreq] = CMLP_HELD_STATE;
        req[nreq++] = one * (size_t)(optimizer_buffers == 3 ? 2 : optimizer_buffers);
        if (optimizer_buffers == 3) kind[nreq] = CMLP_HELD_STATE, req[nreq++] = one;
    }
    if (out->half_weights) kind[nreq] = CMLP_HELD_HALF, req[nreq++] = (size_t)out->half_weights;
    kind[nreq] = CMLP_HELD_STEP, req[nreq++] = ws;
    int64_t *held[] = {&out->allocated_model, &out->allocated_state, &out->allocated_half, &out->allocated_data, NULL,
                       &out->allocated_state};
    out->nrequests = nreq;
    for (int i = 0; i < nreq; i++) out->request_bytes[i] = (int64_t)req[i], out->request_held[i] = kind[i];
    cmlp_paper_device pd = {.next = (uintptr_t)1 << 44, .total = total, .room = INT64_MAX / 4, .no_vm = no_vm};
    if (pd.total <= 0) pd.total = INT64_MAX / 4;
    cmlp_allocator *a;
    CMLP_TRY(cmlp_allocator_create(&cmlp_paper_backend, &pd, "plan", &a));
    cmlp_status st = CMLP_OK;
    /* A device with a standing workspace (CUDA's GEMM workspace) allocated it when it opened:
     * it comes first here too, so that the run's blocks land beside it as they will, and the
     * plan counts what the run adds to it. */
    int64_t base_allocated = 0, base_reserved = 0;
    if (standing) {
        void *p;
        st = cmlp_allocator_malloc(a, standing, "GEMM workspace", &p);
        cmlp_memory_stats s;
        cmlp_allocator_stats(a, &s);
        base_allocated = s.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current;
        base_reserved = s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].current;
    }
    void *ws_block = NULL;
    int64_t later = 0, limit = -1; /* reserved bytes the epochs not replayed add; the budget's limit */
    for (int i = 0; i < nreq && st == CMLP_OK; i++) {
        cmlp_memory_stats before, after;
        cmlp_allocator_stats(a, &before);
        st = cmlp_allocator_malloc(a, req[i], "planned", &ws_block);
        cmlp_allocator_stats(a, &after);
        if (held[kind[i]])
            *held[kind[i]] += after.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current -
                        before.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current;
    }
    if (st == CMLP_OK && eval_rows > 0) {
        /* the step's buffers go back (the workspace, the last request), then the evaluation's */
        size_t fsz[4], fwd = 0;
        int nf = cmlp_fwd_layout(sizes, L, eval_rows, eval_staged != 0, fsz);
        for (int i = 0; i < nf; i++) fwd += fsz[i];
        out->evaluation = (int64_t)fwd;
        limit = eval_budget > 0 ? eval_budget + base_reserved : -1;
        if (limit >= 0 && reserved_now(a) > limit) limit = -1; /* (past it, the run does not fit anyway) */
        if (limit >= 0) cmlp_allocator_set_limit(a, limit);
        st = replay_epochs(a, ws_block, ws, fwd, epochs, &limit, &later);
    }
    if (st == CMLP_OK) {
        cmlp_memory_stats s;
        cmlp_allocator_stats(a, &s);
        out->peak_allocated = s.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].peak - base_allocated;
        out->peak_reserved = s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].peak - base_reserved;
        /* at most what the device has: there the allocator empties its cache and goes on */
        int64_t room = pd.total - s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].peak;
        /* (under the budget's limit, there: the allocator gives cached segments back when it reaches it) */
        if (limit >= 0 && limit - s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].peak < room)
            room = limit - s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].peak;
        out->peak_reserved += later < room ? later : (room > 0 ? room : 0);
        out->standing_reserved = base_reserved;
    }
    cmlp_allocator_destroy(a);
    return st;
}
