/* alloc_inspect.c - what the caching allocator shows of itself: its history of actions (PyTorch's
 * _record_memory_history), snapshots of its segments and blocks by address (an expandable
 * segment seen as one segment per run of mapped pages), and the check of its invariants.
 */
#include "alloc_internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

/* ---- history ---- */

cmlp_status cmlp_allocator_record_history(cmlp_allocator *a, cmlp_history_mode mode, cmlp_context_mode context,
                                          int64_t max_entries, uint32_t skip_actions, bool clear) {
    if (mode < CMLP_HISTORY_OFF || mode > CMLP_HISTORY_ALL)
        return CMLP_FAIL(CMLP_ERR_INVALID, "unknown history mode %d", (int)mode);
    if (context < CMLP_CONTEXT_NONE || context > CMLP_CONTEXT_ALL)
        return CMLP_FAIL(CMLP_ERR_INVALID, "unknown context mode %d", (int)context);
    if (mode != CMLP_HISTORY_OFF && max_entries < 1)
        return CMLP_FAIL(CMLP_ERR_INVALID, "max_entries must be >= 1, got %lld", (long long)max_entries);
    pthread_mutex_lock(&a->lock);
    alloc_history *h = &a->hist;
    /* like torch, the entries go when the history stops being kept */
    int64_t keep = clear || mode != CMLP_HISTORY_ALL ? 0 : h->n < max_entries ? h->n : max_entries;
    if (keep < h->n || h->head != 0 || (mode != CMLP_HISTORY_OFF && h->cap > max_entries)) {
        /* the newest `keep`, from the ring's start, in a ring no larger than they need */
        cmlp_trace_entry *r = keep ? malloc((size_t)keep * sizeof *r) : NULL;
        if (keep && !r) {
            pthread_mutex_unlock(&a->lock);
            return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for the memory history");
        }
        for (int64_t i = 0; i < keep; i++) r[i] = h->ring[(h->head + h->n - keep + i) % h->cap];
        free(h->ring);
        h->ring = r;
        h->cap = keep;
        h->head = 0;
    }
    h->n = keep;
    h->mode = mode;
    h->context = context;
    h->skip = skip_actions;
    if (mode != CMLP_HISTORY_OFF) h->max = max_entries;
    pthread_mutex_unlock(&a->lock);
    return CMLP_OK;
}

/* A copy of the entries, oldest first (the lock held): NULL when out of host memory. */
static cmlp_trace_entry *history_copy(const cmlp_allocator *a, int64_t *n) {
    const alloc_history *h = &a->hist;
    cmlp_trace_entry *e = malloc((size_t)(h->n ? h->n : 1) * sizeof *e);
    if (!e) return NULL;
    for (int64_t i = 0; i < h->n; i++) e[i] = h->ring[(h->head + i) % h->cap];
    *n = h->n;
    return e;
}

cmlp_status cmlp_allocator_history(cmlp_allocator *a, cmlp_trace_entry **entries, int64_t *n) {
    pthread_mutex_lock(&a->lock);
    cmlp_trace_entry *e = history_copy(a, n);
    pthread_mutex_unlock(&a->lock);
    if (!e) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for a copy of the memory history");
    *entries = e;
    return CMLP_OK;
}

/* ---- snapshot and validation ---- */

static int by_address(const void *x, const void *y) {
    uintptr_t a = (uintptr_t)(*(alloc_segment *const *)x)->base, b = (uintptr_t)(*(alloc_segment *const *)y)->base;
    return a < b ? -1 : a > b;
}

/* Segments in address order (skipping an expandable segment with nothing mapped). */
static alloc_segment **sorted_segments(cmlp_allocator *a, int64_t *n) {
    int64_t count = 0;
    for (alloc_segment *s = a->segments; s; s = s->next) count += s->size > 0;
    alloc_segment **v = malloc((size_t)(count ? count : 1) * sizeof *v);
    if (!v) return NULL;
    int64_t i = 0;
    for (alloc_segment *s = a->segments; s; s = s->next)
        if (s->size > 0) v[i++] = s;
    qsort(v, (size_t)count, sizeof *v, by_address);
    *n = count;
    return v;
}

typedef struct {
    cmlp_segment_info *segs;
    cmlp_block_info *blks;
    int64_t ns, nb;
} snap_out;

static void snap_piece(snap_out *o, const alloc_segment *s, const alloc_block *b, const char *lo, const char *hi) {
    bool starts = !s->expandable ? lo == s->base
                                 : (size_t)(lo - s->base) % PAGE == 0 && (lo == s->base || !pg_on(s, pg_down(s, lo) - 1));
    if (starts) {
        const alloc_origin origin = s->expandable ? alloc_page_origin(s, pg_down(s, lo)) : s->origin;
        if (o->segs)
            o->segs[o->ns] = (cmlp_segment_info){.address = (uint64_t)(uintptr_t)lo, .pool = spool(s->pool),
                                                 .expandable = s->expandable, .first_block = o->nb,
                                                 .what = origin.what, .context = origin.context};
        o->ns++;
    }
    if (o->segs) {
        cmlp_segment_info *g = &o->segs[o->ns - 1];
        int64_t n = (int64_t)(hi - lo);
        o->blks[o->nb] = (cmlp_block_info){(uint64_t)(uintptr_t)lo, n, (int64_t)b->requested, b->allocated, b->what,
                                           b->context};
        g->total_size += n;
        g->nblocks++;
        if (b->allocated) {
            g->allocated_size += n;
            g->active_size += n;
            g->requested_size += (int64_t)b->requested;
        }
    }
    o->nb++;
}

/* One entry per segment, or per run of mapped pages of an expandable segment; its blocks are the
 * mapped pieces of the blocks in it. */
static void snap_walk(snap_out *o, alloc_segment **v, int64_t n) {
    for (int64_t k = 0; k < n; k++) {
        const alloc_segment *s = v[k];
        for (const alloc_block *b = s->first; b; b = b->next) {
            const char *end = b->ptr + b->size;
            if (!s->expandable || b->allocated) {
                snap_piece(o, s, b, b->ptr, end);
                continue;
            }
            size_t i = pg_down(s, b->ptr), stop = pg_up(s, end) < s->hi ? pg_up(s, end) : s->hi;
            while (i < stop) {
                if (!pg_on(s, i)) {
                    i++;
                    continue;
                }
                size_t j = i;
                while (j < stop && pg_on(s, j)) j++;
                const char *lo = s->base + i * PAGE, *hi = s->base + j * PAGE;
                snap_piece(o, s, b, lo > b->ptr ? lo : b->ptr, hi < end ? hi : end);
                i = j;
            }
        }
    }
}

cmlp_status cmlp_allocator_snapshot(cmlp_allocator *a, cmlp_segment_info **segs, int64_t *nseg, cmlp_block_info **blks,
                                    int64_t *nblk, cmlp_trace_entry **entries, int64_t *nentries) {
    pthread_mutex_lock(&a->lock);
    int64_t n = 0;
    alloc_segment **v = sorted_segments(a, &n);
    snap_out count = {0};
    if (v) snap_walk(&count, v, n);
    snap_out o = {0};
    o.segs = v ? calloc((size_t)(count.ns ? count.ns : 1), sizeof *o.segs) : NULL;
    o.blks = o.segs ? calloc((size_t)(count.nb ? count.nb : 1), sizeof *o.blks) : NULL;
    cmlp_trace_entry *e = NULL;
    if (o.blks) {
        /* the history up to the snapshot, whose own entry the next one shows (as torch's) */
        if (entries) e = history_copy(a, nentries);
        if (!entries || e)
            note(a, CMLP_TRACE_SNAPSHOT, NULL, (size_t)a->stats.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current,
                 NULL, 0, 0);
    }
    if (!o.blks || (entries && !e)) {
        pthread_mutex_unlock(&a->lock);
        free(v);
        free(o.segs);
        free(o.blks);
        return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for a memory snapshot");
    }
    snap_walk(&o, v, n);
    pthread_mutex_unlock(&a->lock);
    free(v);
    if (entries) *entries = e;
    *segs = o.segs;
    *nseg = o.ns;
    *blks = o.blks;
    *nblk = o.nb;
    return CMLP_OK;
}

static int64_t tree_check(const alloc_block *t, int pool, bool *ok) {
    if (!t) return 0;
    if (t->allocated || !t->seg || t->seg->pool != pool) *ok = false;
    return 1 + tree_check(t->left, pool, ok) + tree_check(t->right, pool, ok);
}

#define INVARIANT(cond, ...)                                               \
    do {                                                                   \
        if (!(cond)) {                                                     \
            st = CMLP_FAIL(CMLP_ERR_INTERNAL, "allocator invariant: " __VA_ARGS__); \
            goto done;                                                     \
        }                                                                  \
    } while (0)

cmlp_status cmlp_allocator_validate(cmlp_allocator *a) {
    cmlp_status st = CMLP_OK;
    pthread_mutex_lock(&a->lock);
    int64_t seg[NPOOLS] = {0}, res[NPOOLS] = {0}, nal[NPOOLS] = {0}, bal[NPOOLS] = {0}, req[NPOOLS] = {0};
    int64_t nsplit[NPOOLS] = {0}, bsplit[NPOOLS] = {0}, nfree[NPOOLS] = {0}, bfree[NPOOLS] = {0}, allocated = 0;
    for (alloc_segment *s = a->segments; s; s = s->next) {
        INVARIANT(s->size <= s->vsize, "segment %p maps more than it reserves", (void *)s->base);
        if (s->expandable) {
            span_info m = alloc_mapped_span(s, s->base, s->base + s->vsize);
            INVARIANT(m.bytes == s->size && s->hi <= s->npages && (s->hi == 0 || pg_on(s, s->hi - 1)),
                      "expandable segment %p: %zu bytes mapped, size says %zu", (void *)s->base, m.bytes, s->size);
            seg[s->pool] += m.runs;
        } else {
            seg[s->pool]++;
        }
        res[s->pool] += (int64_t)s->size;
        char *expect = s->base;
        INVARIANT(s->first && !s->first->prev, "segment %p has no first block", (void *)s->base);
        for (alloc_block *b = s->first; b; b = b->next) {
            INVARIANT(b->seg == s && b->ptr == expect && b->size > 0, "blocks do not tile segment %p at %p",
                      (void *)s->base, (void *)b->ptr);
            INVARIANT(!b->next || b->next->prev == b, "broken neighbour links at %p", (void *)b->ptr);
            INVARIANT(b->allocated || !b->next || b->next->allocated, "free neighbours left unmerged at %p",
                      (void *)b->ptr);
            expect += b->size;
            span_info m = {b->size, b->size, b->size, 1, 1};
            if (s->expandable) {
                m = alloc_mapped_span(s, b->ptr, b->ptr + b->size);
                INVARIANT(!b->allocated || m.bytes == b->size, "allocated block %p has unmapped pages", (void *)b->ptr);
                INVARIANT(b->allocated || (m.split_bytes == b->sbytes && m.split_runs == b->spieces && m.largest == b->pmax),
                          "free block %p: mapped pieces changed behind its pool's back", (void *)b->ptr);
            }
            if (b->allocated) {
                nal[s->pool]++;
                bal[s->pool] += (int64_t)b->size;
                req[s->pool] += (int64_t)b->requested;
                allocated++;
            } else {
                nfree[s->pool]++;
                bfree[s->pool] += (int64_t)b->size;
                if (s->expandable) {
                    nsplit[s->pool] += m.split_runs;
                    bsplit[s->pool] += (int64_t)m.split_bytes;
                } else if (is_split(b)) {
                    nsplit[s->pool]++;
                    bsplit[s->pool] += (int64_t)b->size;
                }
            }
        }
        INVARIANT(expect == s->base + (s->expandable ? s->vsize : s->size), "blocks of segment %p do not add up to its size",
                  (void *)s->base);
    }
    INVARIANT((int64_t)a->count == allocated, "table holds %zu blocks, segments %" PRId64, a->count, allocated);
    for (int p = 0; p < NPOOLS; p++) {
        bool ok = true;
        int64_t in_tree = tree_check(a->pools[p].root, p, &ok);
        INVARIANT(ok && in_tree == a->pools[p].count && in_tree == nfree[p] && (int64_t)a->pools[p].bytes == bfree[p],
                  "pool %d holds %" PRId64 " blocks, %" PRId64 " are free", p, in_tree, nfree[p]);
        const cmlp_stat(*S)[CMLP_POOL_COUNT] = a->stats.stat;
        int sp = spool(p);
        INVARIANT(S[CMLP_STAT_SEGMENT][sp].current == seg[p] && S[CMLP_STAT_RESERVED_BYTES][sp].current == res[p],
                  "segment statistics of pool %d disagree with the segments", p);
        INVARIANT(S[CMLP_STAT_ALLOCATION][sp].current == nal[p] && S[CMLP_STAT_ALLOCATED_BYTES][sp].current == bal[p] &&
                      S[CMLP_STAT_ACTIVE_BYTES][sp].current == bal[p] && S[CMLP_STAT_REQUESTED_BYTES][sp].current == req[p],
                  "allocation statistics of pool %d disagree with the blocks", p);
        INVARIANT(S[CMLP_STAT_INACTIVE_SPLIT][sp].current == nsplit[p] &&
                      S[CMLP_STAT_INACTIVE_SPLIT_BYTES][sp].current == bsplit[p],
                  "inactive_split statistics of pool %d disagree with the blocks", p);
    }
    for (int k = 0; k < CMLP_STAT_OVERSIZE_ALLOCATIONS; k++)
        INVARIANT(a->stats.stat[k][CMLP_POOL_ALL].current ==
                      a->stats.stat[k][CMLP_POOL_LARGE].current + a->stats.stat[k][CMLP_POOL_SMALL].current,
                  "statistic %d: all != large + small", k);
done:
    pthread_mutex_unlock(&a->lock);
    return st;
}
