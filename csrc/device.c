/* device.c - parses device strings and keeps one context (backend instance + allocator) per
 * device for the life of the process. Also the public memory functions, which only route.
 */
#include "internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static cmlp_device_ctx *cpu_ctx;
static cmlp_device_ctx *cuda_ctx[CMLP_MAX_CUDA_DEVICES];

static _Thread_local int current_cuda; /* what "cuda" names in this thread */

cmlp_device cmlp_cpu(void) { return (cmlp_device){CMLP_DEVICE_CPU, 0}; }

int cmlp_cuda_current_device(void) { return current_cuda; }

cmlp_status cmlp_cuda_set_device(int index) {
    CMLP_TRY(cmlp_device_check((cmlp_device){CMLP_DEVICE_CUDA, index}));
    current_cuda = index;
    return CMLP_OK;
}

cmlp_status cmlp_device_check(cmlp_device d) {
    if (d.type == CMLP_DEVICE_CPU) {
        if (d.index != 0) return CMLP_FAIL(CMLP_ERR_INVALID, "device cpu:%d does not exist; use \"cpu\"", d.index);
        return CMLP_OK;
    }
    if (d.type != CMLP_DEVICE_CUDA) return CMLP_FAIL(CMLP_ERR_INVALID, "unknown device type %d", (int)d.type);
    if (!cmlp_cuda_compiled())
        return CMLP_FAIL(CMLP_ERR_DEVICE, "CUDA is not available: this build of cmlp has no CUDA backend "
                                          "(rebuild with the CUDA toolkit installed, CMLP_CUDA=1)");
    int count = cmlp_cuda_device_count();
    if (count == 0)
        return CMLP_FAIL(CMLP_ERR_DEVICE, CMLP_CUDA_NONE_TEXT, cmlp_cuda_unavailable_reason());
    if (d.index < 0 || d.index >= count)
        return CMLP_FAIL(CMLP_ERR_DEVICE, "cuda:%d does not exist: %d CUDA device(s) found", d.index, count);
    if (cmlp_cuda_forked()) return CMLP_FAIL(CMLP_ERR_DEVICE, "cuda:%d: " CMLP_CUDA_FORKED_TEXT, d.index);
    return CMLP_OK;
}

cmlp_status cmlp_device_parse(const char *s, cmlp_device *out) {
    if (!s) return CMLP_FAIL(CMLP_ERR_INVALID, "device must be a string such as \"cpu\" or \"cuda:0\"");
    cmlp_device d = {CMLP_DEVICE_CPU, 0};
    if (strcmp(s, "cpu") == 0 || strcmp(s, "cpu:0") == 0) { /* torch's CPU takes index 0 only */
        *out = d;
        return CMLP_OK;
    }
    if (strncmp(s, "cpu:", 4) == 0 && s[4] >= '0' && s[4] <= '9' && strspn(s + 4, "0123456789") == strlen(s + 4))
        return CMLP_FAIL(CMLP_ERR_INVALID, "unknown device \"%.64s\": the CPU's device index is 0", s);
    if (strncmp(s, "cuda", 4) != 0) goto bad;
    d.type = CMLP_DEVICE_CUDA;
    d.index = current_cuda;
    if (s[4] == ':') {
        const char *p = s + 5;
        if (*p < '0' || *p > '9') goto bad;
        long v = 0;
        for (; *p >= '0' && *p <= '9'; p++)
            if (v < CMLP_MAX_CUDA_DEVICES) v = v * 10 + (*p - '0'); /* (then only read on) */
        if (*p) goto bad;
        if (v >= CMLP_MAX_CUDA_DEVICES) { /* a GPU this machine cannot have: torch's invalid ordinal */
            const cmlp_device first = {CMLP_DEVICE_CUDA, 0};
            CMLP_TRY(cmlp_device_check(first)); /* where there is no GPU, why not */
            return CMLP_FAIL(CMLP_ERR_DEVICE, "%.64s does not exist: %d CUDA device(s) found", s,
                             cmlp_cuda_device_count());
        }
        d.index = (int)v;
    } else if (s[4] != '\0') {
        goto bad;
    }
    CMLP_TRY(cmlp_device_check(d));
    *out = d;
    return CMLP_OK;
bad:
    return CMLP_FAIL(CMLP_ERR_INVALID, "unknown device \"%.64s\": expected \"cpu\", \"cuda\" or \"cuda:N\"", s);
}

/* per_process_memory_fraction of the settings, on a GPU: the limit it makes (as torch's, of the
 * device's total memory) */
static void apply_fraction(cmlp_device_ctx *c, const cmlp_alloc_settings *s) {
    if (s->per_process_memory_fraction < 0.0) return;
    int64_t total = c->backend->total_memory(c->bctx);
    if (total > 0) cmlp_allocator_set_limit(c->alloc, (int64_t)(s->per_process_memory_fraction * (double)total));
}

void cmlp_devices_apply_fraction(const cmlp_alloc_settings *s) {
    if (s->per_process_memory_fraction < 0.0) return;
    pthread_mutex_lock(&registry_lock);
    for (int i = 0; i < CMLP_MAX_CUDA_DEVICES; i++)
        if (cuda_ctx[i]) apply_fraction(cuda_ctx[i], s);
    pthread_mutex_unlock(&registry_lock);
}

/* The allocator's cache given back to the device, for a launch that ran out of memory (see
 * cmlp_backend_i.set_reclaim). */
static void reclaim_cache(void *alloc) { cmlp_allocator_empty_cache(alloc); }

static cmlp_status ctx_create(cmlp_device d, cmlp_device_ctx **out) {
    cmlp_device_ctx *c = calloc(1, sizeof *c);
    if (!c) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory creating a device context");
    c->device = d;
    char name[32];
    c->backend = d.type == CMLP_DEVICE_CUDA ? cmlp_cuda_backend() : &cmlp_backend_cpu;
    if (!c->backend) {
        free(c);
        return CMLP_FAIL(CMLP_ERR_DEVICE, "CUDA is not available: %s", cmlp_cuda_unavailable_reason());
    }
    if (d.type == CMLP_DEVICE_CPU) snprintf(name, sizeof name, "cpu");
    else snprintf(name, sizeof name, "cuda:%d", d.index);
    void *bctx = NULL;
    cmlp_status st = c->backend->open ? c->backend->open(d.index, &bctx) : CMLP_OK;
    c->bctx = bctx;
    if (st == CMLP_OK) st = cmlp_allocator_create(c->backend, bctx, name, &c->alloc);
    if (st == CMLP_OK && c->backend->set_reclaim) c->backend->set_reclaim(bctx, reclaim_cache, c->alloc);
    if (st == CMLP_OK && c->backend->workspace_bytes) {
        size_t n = c->backend->workspace_bytes(bctx);
        void *ws = NULL;
        st = cmlp_allocator_malloc(c->alloc, n, "GEMM workspace", &ws);
        if (st == CMLP_OK) c->backend->set_workspace(bctx, ws, n);
    }
    /* after the workspace, which the device needs to open at all: a fraction below it (0, as
     * torch takes) leaves the device open, its statistics readable, and its requests refused */
    if (st == CMLP_OK && d.type == CMLP_DEVICE_CUDA) {
        cmlp_alloc_settings s;
        cmlp_memory_get_settings(&s);
        apply_fraction(c, &s);
    }
    if (st != CMLP_OK) {
        if (c->alloc) cmlp_allocator_destroy(c->alloc);
        if (bctx && c->backend->close) c->backend->close(bctx);
        free(c);
        return st;
    }
    __atomic_store_n(out, c, __ATOMIC_RELEASE); /* read without the lock (cmlp_cuda_device_opened) */
    return CMLP_OK;
}

/* fork(): every allocator's lock is taken before and given back after, in the parent and the
 * child alike, so a child never starts with a lock that a thread it lacks was holding. */
static void fork_prepare(void) {
    pthread_mutex_lock(&registry_lock);
    if (cpu_ctx) cmlp_allocator_hold(cpu_ctx->alloc, true);
    for (int i = 0; i < CMLP_MAX_CUDA_DEVICES; i++)
        if (cuda_ctx[i]) cmlp_allocator_hold(cuda_ctx[i]->alloc, true);
}

static void fork_release(void) {
    for (int i = CMLP_MAX_CUDA_DEVICES - 1; i >= 0; i--)
        if (cuda_ctx[i]) cmlp_allocator_hold(cuda_ctx[i]->alloc, false);
    if (cpu_ctx) cmlp_allocator_hold(cpu_ctx->alloc, false);
    pthread_mutex_unlock(&registry_lock);
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_register(void) { pthread_atfork(fork_prepare, fork_release, fork_release); }

cmlp_status cmlp_device_get(cmlp_device d, cmlp_device_ctx **out) {
    CMLP_TRY(cmlp_device_check(d));
    pthread_once(&fork_once, fork_register);
    /* the CPU backend's one-time setup registers fork handlers of its own: never under
     * registry_lock, which fork_prepare takes (a C library may run prepare handlers while it
     * holds the lock that registering needs) */
    if (d.type == CMLP_DEVICE_CPU && !__atomic_load_n(&cpu_ctx, __ATOMIC_ACQUIRE))
        (void)cmlp_backend_cpu.total_memory(NULL);
    cmlp_device_ctx **slot = d.type == CMLP_DEVICE_CPU ? &cpu_ctx : &cuda_ctx[d.index];
    cmlp_status st = CMLP_OK;
    /* the first GPU to open reads the environment's allocator settings again, as PyTorch's CUDA
     * start does (set after import, they apply from here; once): outside registry_lock, which
     * applying them takes */
    if (d.type == CMLP_DEVICE_CUDA && !__atomic_load_n(slot, __ATOMIC_ACQUIRE)) CMLP_TRY(cmlp_memory_env_recheck());
    pthread_mutex_lock(&registry_lock);
    if (!*slot) st = ctx_create(d, slot);
    *out = *slot;
    pthread_mutex_unlock(&registry_lock);
    return st;
}

int cmlp_cuda_device_opened(int index) {
    if (index < 0 || index >= CMLP_MAX_CUDA_DEVICES) return 0;
    return __atomic_load_n(&cuda_ctx[index], __ATOMIC_ACQUIRE) != NULL;
}

cmlp_status cmlp_device_synchronize(cmlp_device d) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    return c->backend->synchronize(c->bctx);
}

cmlp_status cmlp_memory_stats_get(cmlp_device d, cmlp_memory_stats *out) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    cmlp_allocator_stats(c->alloc, out);
    return CMLP_OK;
}

cmlp_status cmlp_memory_reset_peak(cmlp_device d) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    cmlp_allocator_reset_peak(c->alloc);
    return CMLP_OK;
}

cmlp_status cmlp_memory_window_peak(cmlp_device d, int restart, int64_t *peak) {
    if (!peak) return CMLP_FAIL(CMLP_ERR_INVALID, "peak must not be NULL");
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    *peak = cmlp_allocator_window(c->alloc, restart != 0);
    return CMLP_OK;
}

cmlp_status cmlp_memory_get_info(cmlp_device d, int64_t *free_bytes, int64_t *total_bytes) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    *free_bytes = c->backend->free_memory ? c->backend->free_memory(c->bctx) : -1;
    *total_bytes = c->backend->total_memory(c->bctx);
    return CMLP_OK;
}

cmlp_status cmlp_device_processes(cmlp_device d, int64_t *pids, int64_t *bytes, int cap, int *count) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    *count = c->backend->gpu_processes ? c->backend->gpu_processes(c->bctx, pids, bytes, cap) : -1;
    return CMLP_OK;
}

cmlp_status cmlp_memory_reset_accumulated(cmlp_device d) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    cmlp_allocator_reset_accumulated(c->alloc);
    return CMLP_OK;
}

cmlp_status cmlp_memory_empty_cache(cmlp_device d) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    cmlp_allocator_empty_cache(c->alloc);
    return CMLP_OK;
}

/* The n requests as sizes, checked (bytes >= 0, n <= CMLP_TRY_REQUESTS). */
cmlp_status cmlp_requests_check(const int64_t *nbytes, int n, size_t *out) {
    if (n > 0 && !nbytes) return CMLP_FAIL(CMLP_ERR_INVALID, "nbytes must not be NULL");
    if (n < 0 || n > CMLP_TRY_REQUESTS)
        return CMLP_FAIL(CMLP_ERR_INVALID, "at most %d requests can be tried, got %d", CMLP_TRY_REQUESTS, n);
    for (int i = 0; i < n; i++) {
        if (nbytes[i] < 0) return CMLP_FAIL(CMLP_ERR_INVALID, "a request's bytes must be >= 0, got %lld", (long long)nbytes[i]);
        out[i] = (size_t)nbytes[i];
    }
    return CMLP_OK;
}

cmlp_status cmlp_memory_try_requests(cmlp_device d, const int64_t *nbytes, int n, int *served) {
    if (!served) return CMLP_FAIL(CMLP_ERR_INVALID, "served must not be NULL");
    size_t req[CMLP_TRY_REQUESTS];
    CMLP_TRY(cmlp_requests_check(nbytes, n, req));
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    bool ok;
    CMLP_TRY(cmlp_plan_try(c, req, n, NULL, 0, &ok));
    *served = ok;
    return CMLP_OK;
}

cmlp_status cmlp_memory_set_limit(cmlp_device d, int64_t limit) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    cmlp_allocator_set_limit(c->alloc, limit);
    return CMLP_OK;
}

cmlp_status cmlp_memory_snapshot(cmlp_device d, cmlp_segment_info **segments, int64_t *nsegments,
                                 cmlp_block_info **blocks, int64_t *nblocks) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    return cmlp_allocator_snapshot(c->alloc, segments, nsegments, blocks, nblocks, NULL, NULL);
}

cmlp_status cmlp_memory_snapshot_history(cmlp_device d, cmlp_segment_info **segments, int64_t *nsegments,
                                         cmlp_block_info **blocks, int64_t *nblocks, cmlp_trace_entry **entries,
                                         int64_t *nentries) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    return cmlp_allocator_snapshot(c->alloc, segments, nsegments, blocks, nblocks, entries, nentries);
}

void cmlp_memory_snapshot_free(cmlp_segment_info *segments, cmlp_block_info *blocks) {
    free(segments);
    free(blocks);
}

cmlp_status cmlp_memory_validate(cmlp_device d) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    return cmlp_allocator_validate(c->alloc);
}

cmlp_status cmlp_memory_fail_raw_alloc(cmlp_device d, int64_t k) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    cmlp_allocator_fail_raw(c->alloc, k);
    return CMLP_OK;
}

/* The raw blocks' `what`: cmlp_memory_free frees these only. */
static const char raw_block[] = "caching_allocator_alloc";

cmlp_status cmlp_memory_alloc(cmlp_device d, size_t nbytes, void **out) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    return cmlp_allocator_malloc(c->alloc, nbytes, raw_block, out);
}

cmlp_status cmlp_memory_free(cmlp_device d, void *ptr) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    return cmlp_allocator_free_of(c->alloc, ptr, raw_block);
}

cmlp_status cmlp_memory_record_history(cmlp_device d, cmlp_history_mode mode, cmlp_context_mode context,
                                       int64_t max_entries, uint32_t skip_actions, int clear) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    return cmlp_allocator_record_history(c->alloc, mode, context, max_entries, skip_actions, clear != 0);
}

cmlp_status cmlp_memory_history(cmlp_device d, cmlp_trace_entry **entries, int64_t *n) {
    cmlp_device_ctx *c;
    CMLP_TRY(cmlp_device_get(d, &c));
    return cmlp_allocator_history(c->alloc, entries, n);
}

void cmlp_memory_history_free(cmlp_trace_entry *entries) { free(entries); }
