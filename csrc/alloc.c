/* alloc.c - the caching allocator, one per device, with PyTorch's rules: requests rounded to
 * 512 bytes (or power-of-two divisions), a small pool of 2 MiB segments and a large pool of
 * 20 MiB / 2 MiB-rounded segments, best fit by (size, address), split and merge, oversize
 * blocks, garbage collection under a limit, expandable segments (whose free pages anywhere move
 * to where a request needs them before more is reserved), and the allocation ladder (which,
 * unlike PyTorch's, searches the cache again after each release). With the history on, it notes
 * what it does (PyTorch's _record_memory_history): each block remembers what it holds and the
 * caller's context. Segments and the pages of expandable segments come from alloc_segments.c,
 * the out-of-memory error from alloc_oom.c.
 */
#include "alloc_internal.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- history ---- */

static __thread int64_t current_context;

void cmlp_memory_set_context(int64_t context) { current_context = context; }

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t alloc_context_for(const cmlp_allocator *a, cmlp_context_mode need) {
    return a->hist.mode != CMLP_HISTORY_OFF && a->hist.context >= need ? current_context : 0;
}

/* Room for one more entry at the end: the ring grows while it may, else the oldest goes. */
static cmlp_trace_entry *history_slot(alloc_history *h) {
    if (h->n == h->cap && h->cap < h->max && h->head == 0) {
        int64_t cap = h->cap ? h->cap * 2 : 1024;
        if (cap > h->max) cap = h->max;
        cmlp_trace_entry *r = realloc(h->ring, (size_t)cap * sizeof *r);
        if (r) {
            h->ring = r;
            h->cap = cap;
        }
    }
    if (h->cap == 0) return NULL;
    if (h->n < h->cap) return &h->ring[(h->head + h->n++) % h->cap];
    cmlp_trace_entry *e = &h->ring[h->head];
    h->head = (h->head + 1) % h->cap;
    return e;
}

__attribute__((noinline)) void alloc_note_entry(cmlp_allocator *a, cmlp_trace_action action, const void *addr,
                                                size_t size, const char *what, int64_t context, int64_t device_free) {
    alloc_history *h = &a->hist;
    if (h->skip >> action & 1u) return;
    cmlp_trace_entry *e = history_slot(h);
    if (e)
        *e = (cmlp_trace_entry){.action = action, .addr = (uint64_t)(uintptr_t)addr,
                                .size = size > (size_t)INT64_MAX ? INT64_MAX : (int64_t)size,
                                .time_us = now_us(), .what = what, .context = context, .device_free = device_free};
}

alloc_origin alloc_origin_now(const cmlp_allocator *a) {
    return (alloc_origin){a->what, alloc_context_for(a, CMLP_CONTEXT_STATE)};
}

/* The context a free's entry keeps: the caller's where frees are recorded with theirs, else (as
 * torch's) that of the allocation, where entries keep contexts at all. */
static int64_t context_of_free(const cmlp_allocator *a, int64_t allocated) {
    int64_t context = alloc_context_for(a, CMLP_CONTEXT_ALL);
    return context ? context : a->hist.context >= CMLP_CONTEXT_ALLOC ? allocated : 0;
}

/* A segment's entry: one that grows is made for the request being served (if any); one that
 * goes back keeps what the memory was made for (its origin), as torch's. */
void alloc_note_segment(cmlp_allocator *a, cmlp_trace_action action, const void *addr, size_t size,
                        alloc_origin origin) {
    bool grows = action == CMLP_TRACE_SEGMENT_ALLOC || action == CMLP_TRACE_SEGMENT_MAP;
    if (grows)
        note(a, action, addr, size, a->what, a->what ? alloc_context_for(a, CMLP_CONTEXT_ALLOC) : 0, 0);
    else
        note(a, action, addr, size, origin.what, context_of_free(a, origin.context), 0);
}

/* ---- the table of allocated blocks ---- */

static size_t slot_of(uintptr_t p, size_t cap) { return (size_t)(((uint64_t)p * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1); }

bool alloc_table_reserve(cmlp_allocator *a) {
    if (a->count + 1 <= a->cap / 2) return true;
    size_t ncap = a->cap ? a->cap * 2 : 256;
    table_slot *nt = calloc(ncap, sizeof *nt);
    if (!nt) return false;
    for (size_t i = 0; i < a->cap; i++) {
        if (!a->table[i].key) continue;
        size_t j = slot_of(a->table[i].key, ncap);
        while (nt[j].key) j = (j + 1) & (ncap - 1);
        nt[j] = a->table[i];
    }
    free(a->table);
    a->table = nt;
    a->cap = ncap;
    return true;
}

void alloc_table_put(cmlp_allocator *a, alloc_block *b) {
    size_t j = slot_of((uintptr_t)b->ptr, a->cap);
    while (a->table[j].key) j = (j + 1) & (a->cap - 1);
    a->table[j] = (table_slot){(uintptr_t)b->ptr, b};
    a->count++;
}

static alloc_block *table_take(cmlp_allocator *a, uintptr_t key) {
    if (!a->cap || !key) return NULL;
    size_t mask = a->cap - 1, i = slot_of(key, a->cap);
    while (a->table[i].key && a->table[i].key != key) i = (i + 1) & mask;
    if (!a->table[i].key) return NULL;
    alloc_block *b = a->table[i].block;
    /* backward-shift deletion keeps probe chains whole without tombstones */
    for (size_t j = (i + 1) & mask; a->table[j].key; j = (j + 1) & mask) {
        size_t home = slot_of(a->table[j].key, a->cap);
        if (((j - home) & mask) >= ((j - i) & mask)) {
            a->table[i] = a->table[j];
            i = j;
        }
    }
    a->table[i].key = 0;
    a->count--;
    return b;
}

/* ---- free blocks: the pools' trees, with inactive_split accounting ---- */

/* inactive_split: free blocks with a neighbour. An expandable segment is seen (as in the
 * snapshot) as one segment per run of mapped pages, so there it counts the mapped pieces of free
 * blocks whose run holds other blocks too. */
static void split_stat(cmlp_allocator *a, const alloc_block *b, int sign) {
    int64_t n = 1, bytes = (int64_t)b->size;
    if (b->seg->expandable) {
        n = b->spieces;
        bytes = (int64_t)b->sbytes;
    } else if (!is_split(b)) {
        return;
    }
    a->split_net[b->seg->pool][0] += sign * n;
    a->split_net[b->seg->pool][1] += sign * bytes;
}

/* The operation's net change of inactive_split into the statistics (before they are read). */
static void split_settle(cmlp_allocator *a) {
    for (int p = 0; p < NPOOLS; p++) {
        if (a->split_net[p][0]) alloc_stat(a, CMLP_STAT_INACTIVE_SPLIT, p, a->split_net[p][0]);
        if (a->split_net[p][1]) alloc_stat(a, CMLP_STAT_INACTIVE_SPLIT_BYTES, p, a->split_net[p][1]);
        a->split_net[p][0] = a->split_net[p][1] = 0;
    }
}

/* (inline: the external definitions serve the other files; split and merge here get copies) */
inline void alloc_pool_put(cmlp_allocator *a, alloc_block *b) {
    b->tick = a->gc_calls[b->seg->pool];
    if (b->seg->expandable) {
        span_info m = alloc_mapped_span(b->seg, b->ptr, b->ptr + b->size);
        b->pmax = m.largest;
        b->spieces = m.split_runs;
        b->sbytes = m.split_bytes;
    }
    alloc_tree_insert(&a->pools[b->seg->pool], b);
    split_stat(a, b, +1);
}

/* Must be called before the block's size, neighbours or mapped pages change. */
inline void alloc_pool_take(cmlp_allocator *a, alloc_block *b) {
    alloc_tree_remove(&a->pools[b->seg->pool], b);
    split_stat(a, b, -1);
}

/* Back into its pool with its age kept. */
void alloc_pool_return(cmlp_allocator *a, alloc_block *b) {
    uint64_t t = b->tick;
    alloc_pool_put(a, b);
    b->tick = t;
}

/* ---- the ladder ---- */

/* The allocator this thread is capturing a graph with, if any (cmlp_allocator_capturing). */
static __thread const cmlp_allocator *capturing_with;

/* Its allocations and frees meanwhile: a block that changes hands during a capture would be the
 * cache's while the graph still uses it. */
static __thread int64_t calls_in_capture;

bool cmlp_allocator_capturing(cmlp_allocator *a, bool on) {
    const bool none = calls_in_capture == 0;
    capturing_with = on ? a : NULL;
    calls_in_capture = 0;
    return on || none;
}

static alloc_block *cached_block(cmlp_allocator *a, int pool, size_t size) {
    alloc_block *b = alloc_tree_lower_bound(&a->pools[pool], size);
    if (!b) return NULL;
    if (b->seg->expandable) {
        /* in an expandable segment, the best fit whose pages are all mapped (at its start, or
         * further in: a free block may begin on pages given back and go on over mapped ones;
         * the largest mapped piece, pmax, passes over the others at once); else the best fit,
         * mapped on demand (only while the setting is on) */
        alloc_block *pick = NULL, *c = b;
        char *at = NULL;
        for (; c && c->seg->expandable; c = alloc_tree_next(&a->pools[pool], c))
            if ((at = alloc_mapped_fit(c, size))) {
                pick = c;
                break;
            }
        if (!pick && a->cfg.expandable_segments && capturing_with != a)
            pick = b; /* mapping: not in a capture (pages it maps are new memory) */
        if (pick) {
            alloc_pool_take(a, pick);
            /* no host memory to carve with: no block (its start may not be mapped here) */
            if ((at && at > pick->ptr && !alloc_carve_head(a, pick, at)) || !alloc_map_block(a, pick, size)) {
                alloc_pool_return(a, pick);
                return NULL;
            }
            return pick;
        }
        if (!c || c->seg->expandable) return NULL;
        b = c; /* an ordinary segment's block, under the rules below */
    }
    /* oversize rules protect whole segments; an expandable segment always splits */
    if (a->cfg.max_split_size >= 0) {
        size_t msz = (size_t)a->cfg.max_split_size;
        if (size < msz && b->size >= msz) return NULL;            /* no oversize block for a small request */
        if (size >= msz && b->size >= size + (size_t)a->cfg.max_non_split_rounding) return NULL; /* nor one far larger */
    }
    alloc_pool_take(a, b);
    return b;
}

static alloc_block *new_memory(cmlp_allocator *a, int pool, size_t size) {
    if (a->uncached) return alloc_new_segment(a, pool, size);
    alloc_collect_garbage(a);
    if (a->cfg.expandable_segments) { /* (never on a device without virtual memory: refresh_config) */
        /* the pool's range is made once; after that the cache search has seen all of it */
        if (a->pools[pool].expandable || !alloc_new_expandable(a, pool)) return NULL;
        return cached_block(a, pool, size);
    }
    return alloc_new_segment(a, pool, size);
}

static bool should_split(const cmlp_allocator *a, const alloc_block *b, size_t size) {
    size_t rest = b->size - size;
    if (b->seg->pool == POOL_SMALL || b->seg->expandable) return rest >= K_MIN_BLOCK;
    return !oversize(a, size) && rest > K_SMALL_SIZE;
}

static void refresh_config(cmlp_allocator *a);

/* The rest of a block taken for `size` bytes goes back to the pool where the rules split it. */
static void split_off(cmlp_allocator *a, alloc_block *b, size_t size) {
    if (!should_split(a, b, size)) return;
    alloc_block *rest = alloc_block_new(a);
    if (!rest) return; /* without host memory for the split the whole block is handed out: still correct */
    *rest = (alloc_block){.ptr = b->ptr + size, .size = b->size - size, .seg = b->seg, .prev = b, .next = b->next};
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    alloc_pool_put(a, rest);
}


static cmlp_status allocate(cmlp_allocator *a, size_t nbytes, const char *what, void **out) {
    refresh_config(a);
    size_t size = a->uncached ? nbytes : alloc_round_size(&a->cfg, nbytes); /* (uncached: no free block to find) */
    int pool = size <= K_SMALL_SIZE ? POOL_SMALL : POOL_LARGE;
    if (!alloc_table_reserve(a)) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for the allocator's block table");
    a->device_error = CMLP_OK;
    calls_in_capture += capturing_with == a;
    if (alloc_gc_on(a) && !a->uncached) a->gc_calls[pool]++; /* the blocks' ages, for the gc */
    alloc_block *b = a->uncached ? NULL : cached_block(a, pool, size);
    if (!b && capturing_with == a)
        return CMLP_FAIL(CMLP_ERR_DEVICE, "%s: a request of %zu bytes that the cache cannot serve while a step is "
                                          "being captured as a graph",
                         a->name, nbytes);
    if (!b && !a->device_error) b = new_memory(a, pool, size);
    if (!b && !a->device_error && alloc_release_oversize(a, pool, size)) {
        if (!a->pytorch_ladder) b = cached_block(a, pool, size);
        if (!b && !a->device_error) b = new_memory(a, pool, size);
    }
    if (!b && !a->device_error) {
        a->stats.num_alloc_retries++;
        alloc_release_cached(a);
        if (!a->pytorch_ladder) b = cached_block(a, pool, size);
        if (!b && !a->device_error) b = new_memory(a, pool, size);
    }
    /* cmlp_allocator_malloc_lent, last: a piece of a cached large-pool block */
    if (!b && !a->device_error && a->lend_large && pool == POOL_SMALL) b = cached_block(a, POOL_LARGE, size);
    if (!b && a->device_error) return a->device_error; /* the backend said why */
    if (!b && a->quiet_oom) return CMLP_FAIL(CMLP_ERR_OOM, "%s: no room for %zu bytes (tried)", a->name, nbytes);
    if (!b) return alloc_oom(a, nbytes, size);
    split_off(a, b, size);
    b->allocated = true;
    b->requested = nbytes;
    b->what = what;
    b->context = alloc_context_for(a, CMLP_CONTEXT_STATE);
    note(a, CMLP_TRACE_ALLOC, b->ptr, nbytes, what, alloc_context_for(a, CMLP_CONTEXT_ALLOC), 0);
    alloc_table_put(a, b);
    int p = b->seg->pool;
    alloc_stat(a, CMLP_STAT_ALLOCATION, p, 1);
    alloc_stat(a, CMLP_STAT_ACTIVE, p, 1);
    alloc_stat(a, CMLP_STAT_ALLOCATED_BYTES, p, (int64_t)b->size);
    alloc_stat(a, CMLP_STAT_ACTIVE_BYTES, p, (int64_t)b->size);
    alloc_stat(a, CMLP_STAT_REQUESTED_BYTES, p, (int64_t)nbytes);
    b->oversize = oversize(a, b->size); /* remembered: the setting may change before the free */
    if (b->oversize) alloc_stat(a, CMLP_STAT_OVERSIZE_ALLOCATIONS, p, 1);
    alloc_unpoison(a, b->ptr, nbytes);
    alloc_poison(a, b->ptr + nbytes, b->size - nbytes);
    *out = b->ptr;
    return CMLP_OK;
}

/* A block just freed joins its free neighbours and goes back to its pool; the block it became. */
static alloc_block *merge_free(cmlp_allocator *a, alloc_block *b) {
    alloc_block *prev = b->prev, *next = b->next;
    if (prev && !prev->allocated) { /* absorb b into its free predecessor */
        alloc_pool_take(a, prev);
        prev->size += b->size;
        prev->next = next;
        if (next) next->prev = prev;
        alloc_block_drop(a, b);
        b = prev;
    }
    next = b->next;
    if (next && !next->allocated) {
        alloc_pool_take(a, next);
        b->size += next->size;
        b->next = next->next;
        if (next->next) next->next->prev = b;
        alloc_block_drop(a, next);
    }
    alloc_pool_put(a, b);
    return b;
}

static void release_block(cmlp_allocator *a, alloc_block *b) {
    int p = b->seg->pool;
    if (__builtin_expect(a->hist.mode == CMLP_HISTORY_ALL, 0)) {
        int64_t context = context_of_free(a, b->context);
        alloc_note_entry(a, CMLP_TRACE_FREE_REQUESTED, b->ptr, b->requested, b->what, context, 0);
        alloc_note_entry(a, CMLP_TRACE_FREE_COMPLETED, b->ptr, b->requested, b->what, context, 0);
    }
    alloc_stat(a, CMLP_STAT_ALLOCATION, p, -1);
    alloc_stat(a, CMLP_STAT_ACTIVE, p, -1);
    alloc_stat(a, CMLP_STAT_ALLOCATED_BYTES, p, -(int64_t)b->size);
    alloc_stat(a, CMLP_STAT_ACTIVE_BYTES, p, -(int64_t)b->size);
    alloc_stat(a, CMLP_STAT_REQUESTED_BYTES, p, -(int64_t)b->requested);
    if (b->oversize) alloc_stat(a, CMLP_STAT_OVERSIZE_ALLOCATIONS, p, -1);
    b->allocated = false;
    b->oversize = false;
    b->requested = 0;
    b->what = NULL;
    b->context = 0;
    alloc_poison(a, b->ptr, b->size);
    b = merge_free(a, b);
    if (a->uncached) alloc_release_if_free(a, b->seg);
}

/* ---- configuration and the public face ---- */

static _Atomic uint64_t config_generation = 1;

void alloc_config_changed(void) { atomic_fetch_add(&config_generation, 1); }

/* The process's caching switch, where it moved since this allocator last looked (under its lock). */
static void refresh_caching(cmlp_allocator *a) {
    const uint64_t gen = alloc_caching_generation();
    if (gen == a->caching_gen) return;
    a->uncached = cmlp_memory_caching_disabled();
    a->caching_gen = gen;
}

static void refresh_config(cmlp_allocator *a) {
    refresh_caching(a);
    uint64_t gen = atomic_load(&config_generation);
    if (gen == a->config_gen) return;
    alloc_config_current(&a->cfg);
    if (a->no_vm) a->cfg.expandable_segments = false;
    a->config_gen = gen;
    a->stats.max_split_size = a->cfg.max_split_size;
}

/* As torch's messages write sizes: up to 1024 in bytes, then with two decimals in the largest
 * unit it does not exceed (1 MiB is "1024.00 KiB"), GiB at most. */
void cmlp_format_bytes(char *buf, size_t cap, int64_t n) {
    const uint64_t m = n < 0 ? 0 - (uint64_t)n : (uint64_t)n;
    const char *sign = n < 0 ? "-" : "";
    if (m <= 1024) snprintf(buf, cap, "%s%llu bytes", sign, (unsigned long long)m);
    else if (m <= (1u << 20)) snprintf(buf, cap, "%s%.2f KiB", sign, (double)m / 1024.0);
    else if (m <= (1u << 30)) snprintf(buf, cap, "%s%.2f MiB", sign, (double)m / 1048576.0);
    else snprintf(buf, cap, "%s%.2f GiB", sign, (double)m / 1073741824.0);
}

bool cmlp_backend_has_vm(const cmlp_backend_i *b, void *bctx) {
    return b->vm_reserve && (!b->vm_supported || b->vm_supported(bctx));
}

cmlp_status cmlp_allocator_create(const cmlp_backend_i *b, void *bctx, const char *device_name, cmlp_allocator **out) {
    cmlp_allocator *a = calloc(1, sizeof *a);
    if (!a) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory creating the allocator");
    pthread_mutex_init(&a->lock, NULL);
    a->backend = b;
    a->bctx = bctx;
    snprintf(a->name, sizeof a->name, "%s", device_name);
    a->limit = -1;
    a->total_memory = b->total_memory(bctx);
    a->pools[POOL_LARGE].seed = 0x2545F491u;
    a->pools[POOL_SMALL].seed = 0x9E3779B9u;
    a->caching_gen = alloc_caching_generation();
    a->uncached = cmlp_memory_caching_disabled();
    a->no_vm = !cmlp_backend_has_vm(b, bctx);
#ifdef ALLOC_ASAN
    a->poison = b->host_memory;
#endif
    refresh_config(a);
    *out = a;
    return CMLP_OK;
}

void cmlp_allocator_destroy(cmlp_allocator *a) {
    if (!a) return;
    for (alloc_segment *s = a->segments, *next; s; s = next) {
        next = s->next;
        for (alloc_block *b = s->first, *bn; b; b = bn) {
            bn = b->next;
            free(b);
        }
        if (s->expandable) {
            for (size_t i = 0; i < s->hi;) {
                size_t j = i;
                while (j < s->hi && pg_on(s, j)) j++;
                if (j > i) a->backend->vm_unmap(a->bctx, s->base + i * PAGE, (j - i) * PAGE);
                i = j + 1;
            }
            alloc_unpoison(a, s->base, s->poisoned_hi * PAGE);
            a->backend->vm_release(a->bctx, s->base, s->vsize);
            free(s->map);
            free(s->page_origin);
        } else {
            alloc_unpoison(a, s->base, s->size);
            a->backend->raw_free(a->bctx, s->base, s->size);
        }
        free(s);
    }
    for (alloc_block *b = a->spare, *bn; b; b = bn) {
        bn = b->next;
        free(b);
    }
    free(a->table);
    free(a->hist.ring);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

static cmlp_status malloc_of(cmlp_allocator *a, size_t nbytes, const char *what, bool lend, void **out) {
    *out = NULL;
    if (nbytes == 0) return CMLP_OK;
    if (nbytes > ((size_t)1 << 56)) { /* beyond any device: refused as such, in PyTorch's words */
        pthread_mutex_lock(&a->lock);
        a->what = what;
        cmlp_status st = CMLP_ERR_OOM;
        if (nbytes <= ((size_t)1 << 62)) {
            st = alloc_oom(a, nbytes, nbytes);
        } else { /* (no segment size to say: it would overflow) */
            a->stats.num_ooms++;
            a->ooms_ever++;
            alloc_note_oom(a, nbytes, what);
            CMLP_FAIL(CMLP_ERR_OOM, "%s out of memory. Tried to allocate %zu bytes, which no device holds", a->name,
                      nbytes);
        }
        a->what = NULL;
        pthread_mutex_unlock(&a->lock);
        return st;
    }
    pthread_mutex_lock(&a->lock);
    a->what = what;
    a->lend_large = lend;
    cmlp_status st = allocate(a, nbytes, what, out);
    a->lend_large = false;
    a->what = NULL;
    split_settle(a);
    pthread_mutex_unlock(&a->lock);
    return st;
}

cmlp_status cmlp_allocator_malloc(cmlp_allocator *a, size_t nbytes, const char *what, void **out) {
    return malloc_of(a, nbytes, what, false, out);
}

cmlp_status cmlp_allocator_malloc_lent(cmlp_allocator *a, size_t nbytes, const char *what, void **out) {
    return malloc_of(a, nbytes, what, true, out);
}

cmlp_status cmlp_allocator_try_malloc(cmlp_allocator *a, size_t nbytes, const char *what, void **out) {
    *out = NULL;
    if (nbytes == 0) return CMLP_OK;
    if (nbytes > ((size_t)1 << 56)) return CMLP_FAIL(CMLP_ERR_OOM, "%s: %zu bytes is impossibly large", a->name, nbytes);
    pthread_mutex_lock(&a->lock);
    a->what = what;
    a->quiet_oom = true;
    cmlp_status st = allocate(a, nbytes, what, out);
    a->quiet_oom = false;
    a->what = NULL;
    split_settle(a);
    pthread_mutex_unlock(&a->lock);
    return st;
}

static cmlp_status free_of(cmlp_allocator *a, void *ptr, const char *what) {
    if (!ptr) return CMLP_OK;
    calls_in_capture += capturing_with == a;
    pthread_mutex_lock(&a->lock);
    refresh_caching(a); /* (a block freed after caching went off goes back to the device) */
    alloc_block *b = table_take(a, (uintptr_t)ptr);
    bool other = b && what && b->what != what;
    const char *held = other ? b->what : NULL; /* (b may be freed by its owner once unlocked) */
    if (other) alloc_table_put(a, b);          /* (the slot it left is free: no growth needed) */
    else if (b) release_block(a, b);
    split_settle(a);
    pthread_mutex_unlock(&a->lock);
    if (other)
        return CMLP_FAIL(CMLP_ERR_INVALID, "pointer %p holds %s, not a block from %s: it stays allocated", ptr,
                         held ? held : "memory of cmlp's", what);
    if (!b)
        return CMLP_FAIL(CMLP_ERR_INVALID, "pointer %p was not allocated by the %s allocator (or was already freed)",
                         ptr, a->name);
    return CMLP_OK;
}

cmlp_status cmlp_allocator_free(cmlp_allocator *a, void *ptr) { return free_of(a, ptr, NULL); }

cmlp_status cmlp_allocator_free_of(cmlp_allocator *a, void *ptr, const char *what) { return free_of(a, ptr, what); }

int64_t cmlp_allocator_ooms_ever(cmlp_allocator *a) {
    pthread_mutex_lock(&a->lock);
    const int64_t n = a->ooms_ever;
    pthread_mutex_unlock(&a->lock);
    return n;
}

void cmlp_allocator_stats(cmlp_allocator *a, cmlp_memory_stats *out) {
    pthread_mutex_lock(&a->lock);
    refresh_config(a);
    *out = a->stats;
    out->limit = a->limit;
    out->total_memory = a->total_memory;
    out->largest_free_block = alloc_largest_free(a);
    pthread_mutex_unlock(&a->lock);
}

void cmlp_allocator_reset_peak(cmlp_allocator *a) {
    pthread_mutex_lock(&a->lock);
    for (int k = 0; k < CMLP_STAT_KIND_COUNT; k++)
        for (int p = 0; p < CMLP_POOL_COUNT; p++) a->stats.stat[k][p].peak = a->stats.stat[k][p].current;
    pthread_mutex_unlock(&a->lock);
}

int64_t cmlp_allocator_window(cmlp_allocator *a, bool restart) {
    pthread_mutex_lock(&a->lock);
    const int64_t peak = a->window_peak;
    if (restart) a->window_peak = a->stats.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current;
    pthread_mutex_unlock(&a->lock);
    return peak;
}

void cmlp_allocator_hold(cmlp_allocator *a, bool hold) {
    if (hold) pthread_mutex_lock(&a->lock);
    else pthread_mutex_unlock(&a->lock);
}

void cmlp_allocator_reset_accumulated(cmlp_allocator *a) {
    pthread_mutex_lock(&a->lock);
    for (int k = 0; k < CMLP_STAT_KIND_COUNT; k++)
        for (int p = 0; p < CMLP_POOL_COUNT; p++) a->stats.stat[k][p].allocated = a->stats.stat[k][p].freed = 0;
    cmlp_memory_stats *s = &a->stats;
    s->num_alloc_retries = s->num_ooms = s->num_sync_all_streams = s->num_device_alloc = s->num_device_free = 0;
    s->num_raw_alloc_calls = 0;
    pthread_mutex_unlock(&a->lock);
}

void cmlp_allocator_empty_cache(cmlp_allocator *a) {
    pthread_mutex_lock(&a->lock);
    alloc_release_cached(a);
    split_settle(a);
    pthread_mutex_unlock(&a->lock);
}

void cmlp_allocator_set_limit(cmlp_allocator *a, int64_t limit) {
    pthread_mutex_lock(&a->lock);
    a->limit = limit < 0 ? -1 : limit;
    pthread_mutex_unlock(&a->lock);
}

void cmlp_allocator_pytorch_ladder(cmlp_allocator *a, bool on) {
    pthread_mutex_lock(&a->lock);
    a->pytorch_ladder = on;
    pthread_mutex_unlock(&a->lock);
}

void cmlp_allocator_set_caching(cmlp_allocator *a, bool on) {
    pthread_mutex_lock(&a->lock);
    a->caching_gen = alloc_caching_generation(); /* (until the process's switch moves again) */
    a->uncached = !on;
    pthread_mutex_unlock(&a->lock);
}

void cmlp_allocator_fail_raw(cmlp_allocator *a, int64_t k) {
    pthread_mutex_lock(&a->lock);
    a->fail_in = k > 0 ? k : 0;
    pthread_mutex_unlock(&a->lock);
}
