/* alloc.c - the allocator module: one instance per device, a lock, a table of live blocks and
 * PyTorch-style statistics. Each block is its own segment of the rounded size; the caching
 * layer (segments, pools, splitting) sits behind the same functions.
 */
#include "internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct block_entry {
    uintptr_t ptr; /* 0: empty slot */
    size_t size;   /* rounded, what the segment holds */
    size_t requested;
} block_entry;

struct cmlp_allocator {
    pthread_mutex_t lock;
    const cmlp_backend_i *backend;
    void *bctx;
    char name[32];
    int64_t limit; /* -1: none */
    int64_t total_memory;
    cmlp_memory_stats stats;
    block_entry *table; /* open addressing, linear probing, power-of-two capacity */
    size_t cap, count;
};

static size_t round_request(size_t n) {
    if (n < CMLP_ALLOC_ROUND) return CMLP_ALLOC_ROUND;
    return (n + CMLP_ALLOC_ROUND - 1) / CMLP_ALLOC_ROUND * CMLP_ALLOC_ROUND;
}

static size_t slot_of(uintptr_t p, size_t cap) {
    uint64_t h = (uint64_t)p * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 20) & (cap - 1);
}

static cmlp_status table_grow(cmlp_allocator *a) {
    size_t ncap = a->cap ? a->cap * 2 : 64;
    block_entry *nt = calloc(ncap, sizeof *nt);
    if (!nt) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for the allocator's block table");
    for (size_t i = 0; i < a->cap; i++) {
        if (!a->table[i].ptr) continue;
        size_t j = slot_of(a->table[i].ptr, ncap);
        while (nt[j].ptr) j = (j + 1) & (ncap - 1);
        nt[j] = a->table[i];
    }
    free(a->table);
    a->table = nt;
    a->cap = ncap;
    return CMLP_OK;
}

static block_entry *table_find(cmlp_allocator *a, uintptr_t p) {
    if (!a->cap) return NULL;
    for (size_t j = slot_of(p, a->cap);; j = (j + 1) & (a->cap - 1)) {
        if (!a->table[j].ptr) return NULL;
        if (a->table[j].ptr == p) return &a->table[j];
    }
}

/* Backward-shift deletion keeps probe chains intact without tombstones. */
static void table_remove(cmlp_allocator *a, block_entry *e) {
    size_t i = (size_t)(e - a->table), mask = a->cap - 1;
    for (size_t j = (i + 1) & mask; a->table[j].ptr; j = (j + 1) & mask) {
        size_t home = slot_of(a->table[j].ptr, a->cap);
        /* move j into the hole at i when its home is not in (i, j] cyclically */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            a->table[i] = a->table[j];
            i = j;
        }
    }
    a->table[i].ptr = 0;
    a->count--;
}

static void stat_add(cmlp_stat *s, int64_t d) {
    s->current += d;
    if (d > 0) s->allocated += d;
    else s->freed -= d;
    if (s->current > s->peak) s->peak = s->current;
}

static void stat_pools(cmlp_allocator *a, cmlp_stat_kind k, int pool, int64_t d) {
    stat_add(&a->stats.stat[k][CMLP_POOL_ALL], d);
    stat_add(&a->stats.stat[k][pool], d);
}

/* One block is one segment: allocation/active/segment stats move together. */
static void account(cmlp_allocator *a, size_t size, size_t requested, int sign) {
    int pool = requested <= CMLP_ALLOC_SMALL_SIZE ? CMLP_POOL_SMALL : CMLP_POOL_LARGE;
    int64_t s = sign * (int64_t)size, r = sign * (int64_t)requested;
    stat_pools(a, CMLP_STAT_ALLOCATION, pool, sign);
    stat_pools(a, CMLP_STAT_ACTIVE, pool, sign);
    stat_pools(a, CMLP_STAT_SEGMENT, pool, sign);
    stat_pools(a, CMLP_STAT_ALLOCATED_BYTES, pool, s);
    stat_pools(a, CMLP_STAT_ACTIVE_BYTES, pool, s);
    stat_pools(a, CMLP_STAT_RESERVED_BYTES, pool, s);
    stat_pools(a, CMLP_STAT_REQUESTED_BYTES, pool, r);
}

void cmlp_format_bytes(char *buf, size_t cap, int64_t n) {
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)n;
    int u = 0;
    while (u < 4 && (v >= 1024.0 || v <= -1024.0)) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, cap, "%.2f %s", v, units[u]);
}

cmlp_status cmlp_allocator_create(const cmlp_backend_i *b, void *bctx, const char *device_name,
                                  cmlp_allocator **out) {
    cmlp_allocator *a = calloc(1, sizeof *a);
    if (!a) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory creating the allocator");
    pthread_mutex_init(&a->lock, NULL);
    a->backend = b;
    a->bctx = bctx;
    snprintf(a->name, sizeof a->name, "%s", device_name);
    a->limit = -1;
    a->total_memory = b->total_memory(bctx);
    a->stats.max_split_size = -1;
    *out = a;
    return CMLP_OK;
}

static cmlp_status oom(cmlp_allocator *a, size_t nbytes, size_t size, const char *why) {
    char req[32], rnd[32], alloc[32], res[32], lim[32], fre[32];
    int64_t reserved = a->stats.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].current;
    int64_t allocated = a->stats.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current;
    int64_t cap = a->limit >= 0 ? a->limit : a->total_memory;
    a->stats.num_ooms++;
    cmlp_format_bytes(req, sizeof req, (int64_t)nbytes);
    cmlp_format_bytes(rnd, sizeof rnd, (int64_t)size);
    cmlp_format_bytes(alloc, sizeof alloc, allocated);
    cmlp_format_bytes(res, sizeof res, reserved);
    cmlp_format_bytes(lim, sizeof lim, cap);
    cmlp_format_bytes(fre, sizeof fre, cap > reserved ? cap - reserved : 0);
    return CMLP_FAIL(CMLP_ERR_OOM,
                     "%s out of memory: tried to allocate %s (%zu bytes requested, rounded to %zu)"
                     " (%s). Allocated: %s; reserved: %s; %s: %s, of which %s is free; largest "
                     "free block: %s; fragmentation: 0.0%%. Try a smaller batch or micro-batches "
                     "(Trainer auto_microbatch), amp=\"fp16\"/\"bf16\", or recompute=True.",
                     a->name, req, nbytes, size, why, alloc, res,
                     a->limit >= 0 ? "limit" : "total capacity", lim, fre, fre);
}

cmlp_status cmlp_allocator_malloc(cmlp_allocator *a, size_t nbytes, void **out) {
    *out = NULL;
    if (nbytes == 0) return CMLP_OK;
    if (nbytes > (SIZE_MAX >> 2)) return CMLP_FAIL(CMLP_ERR_OOM, "out of memory: request of %zu bytes is impossibly large", nbytes);
    size_t size = round_request(nbytes);
    cmlp_status st = CMLP_OK;
    pthread_mutex_lock(&a->lock);
    int64_t reserved = a->stats.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].current;
    if (a->limit >= 0 && reserved + (int64_t)size > a->limit) {
        st = oom(a, nbytes, size, "the memory limit would be exceeded");
        goto done;
    }
    if (a->count + 1 > a->cap / 2) {
        st = table_grow(a);
        if (st != CMLP_OK) goto done;
    }
    void *p = NULL;
    if (a->backend->raw_alloc(a->bctx, size, &p) != CMLP_OK || !p) {
        st = oom(a, nbytes, size, "the device has no more memory");
        goto done;
    }
    a->stats.num_device_alloc++;
    size_t j = slot_of((uintptr_t)p, a->cap);
    while (a->table[j].ptr) j = (j + 1) & (a->cap - 1);
    a->table[j] = (block_entry){(uintptr_t)p, size, nbytes};
    a->count++;
    account(a, size, nbytes, +1);
    *out = p;
done:
    pthread_mutex_unlock(&a->lock);
    return st;
}

cmlp_status cmlp_allocator_free(cmlp_allocator *a, void *ptr) {
    if (!ptr) return CMLP_OK;
    pthread_mutex_lock(&a->lock);
    block_entry *e = table_find(a, (uintptr_t)ptr);
    if (!e) {
        pthread_mutex_unlock(&a->lock);
        return CMLP_FAIL(CMLP_ERR_INVALID, "pointer %p was not allocated by the %s allocator (or was already freed)",
                         ptr, a->name);
    }
    size_t size = e->size, requested = e->requested;
    table_remove(a, e);
    account(a, size, requested, -1);
    a->backend->raw_free(a->bctx, ptr, size);
    a->stats.num_device_free++;
    pthread_mutex_unlock(&a->lock);
    return CMLP_OK;
}

void cmlp_allocator_stats(cmlp_allocator *a, cmlp_memory_stats *out) {
    pthread_mutex_lock(&a->lock);
    *out = a->stats;
    out->limit = a->limit;
    out->total_memory = a->total_memory;
    pthread_mutex_unlock(&a->lock);
}

void cmlp_allocator_reset_peak(cmlp_allocator *a) {
    pthread_mutex_lock(&a->lock);
    for (int k = 0; k < CMLP_STAT_KIND_COUNT; k++)
        for (int p = 0; p < CMLP_POOL_COUNT; p++) a->stats.stat[k][p].peak = a->stats.stat[k][p].current;
    pthread_mutex_unlock(&a->lock);
}

void cmlp_allocator_empty_cache(cmlp_allocator *a) {
    /* Nothing is cached: every free goes straight back to the device. */
    (void)a;
}

void cmlp_allocator_set_limit(cmlp_allocator *a, int64_t limit) {
    pthread_mutex_lock(&a->lock);
    a->limit = limit < 0 ? -1 : limit;
    pthread_mutex_unlock(&a->lock);
}
