/* alloc_segments.c - the caching allocator's raw memory: segments from the device, the pages of
 * expandable segments (mapped, unmapped, and moved to where a request needs them), and their
 * release (empty_cache, the oversize blocks, garbage collection under a limit).
 */
#include "alloc_internal.h"

#include <stdlib.h>

/* ---- pages of expandable segments ---- */

/* The first page in [i, end) that is mapped (or, with mapped false, unmapped); end if none.
 * A word of the bitmap at a time (no page at or above hi is mapped, so its bits are 0). */
static size_t next_page(const alloc_segment *s, size_t i, size_t end, bool mapped) {
    while (i < end) {
        uint64_t w = s->map[i >> 6];
        w = (mapped ? w : ~w) >> (i & 63);
        if (w) {
            size_t k = i + (size_t)__builtin_ctzll(w);
            return k < end ? k : end;
        }
        i = (i | 63) + 1;
    }
    return end;
}

/* The mapped bytes of [lo, hi) in a segment, as maximal runs of mapped pages; "split" runs are
 * those that reach outside [lo, hi) (their pages hold other blocks too). */
span_info alloc_mapped_span(const alloc_segment *s, const char *lo, const char *hi) {
    span_info r = {0, 0, 0, 0, 0};
    size_t end = pg_up(s, hi);
    if (end > s->hi) end = s->hi;
    for (size_t i = next_page(s, pg_down(s, lo), end, true); i < end; i = next_page(s, i, end, true)) {
        size_t j = next_page(s, i, end, false);
        const char *a = s->base + i * PAGE, *b = s->base + j * PAGE;
        size_t n = (size_t)((b < hi ? b : hi) - (a > lo ? a : lo));
        r.bytes += n;
        r.runs++;
        if (n > r.largest) r.largest = n;
        if (a < lo || b > hi || (i > 0 && pg_on(s, i - 1)) || pg_on(s, j)) {
            r.split_runs++;
            r.split_bytes += n;
        }
        i = j;
    }
    return r;
}

char *alloc_mapped_fit(const alloc_block *b, size_t size) {
    const alloc_segment *s = b->seg;
    const char *end = b->ptr + b->size;
    if (size > b->size || b->pmax < size) return NULL;
    size_t last = pg_up(s, end);
    if (last > s->hi) last = s->hi;
    for (size_t i = next_page(s, pg_down(s, b->ptr), last, true); i < last; i = next_page(s, i, last, true)) {
        size_t j = next_page(s, i, last, false);
        char *lo = s->base + i * PAGE, *hi = s->base + j * PAGE;
        if (lo < b->ptr) lo = b->ptr;
        if ((size_t)((hi < end ? hi : end) - lo) >= size) return lo;
        i = j;
    }
    return NULL;
}

/* A free block taken out of its pool starts at `at` from here: what lies before goes back to
 * the pool as a free block of its own, with the block's age. False, the block unchanged, without
 * host memory for it. */
bool alloc_carve_head(cmlp_allocator *a, alloc_block *b, char *at) {
    alloc_block *head = alloc_block_new(a);
    if (!head) return false;
    *head = (alloc_block){.ptr = b->ptr, .size = (size_t)(at - b->ptr), .seg = b->seg, .prev = b->prev, .next = b,
                          .tick = b->tick};
    if (b->prev) b->prev->next = head;
    else b->seg->first = head;
    b->prev = head;
    b->ptr = at;
    b->size -= head->size;
    alloc_pool_return(a, head);
    return true;
}

size_t alloc_unmapped_pages(const alloc_segment *s, size_t i, size_t j) {
    size_t n = 0;
    while (i < j) {
        size_t bit = i & 63, take = 64 - bit < j - i ? 64 - bit : j - i;
        uint64_t w = s->map[i >> 6] >> bit;
        if (take < 64) w &= ((uint64_t)1 << take) - 1;
        n += take - (size_t)__builtin_popcountll(w);
        i += take;
    }
    return n;
}

/* ---- raw memory ---- */

/* A device call's status: true when it succeeded. Out of memory is the ladder's to handle;
 * any other failure (recorded by the backend) ends the request with that error. */
static bool device_ok(cmlp_allocator *a, cmlp_status st) {
    if (st != CMLP_OK && st != CMLP_ERR_OOM && a->device_error == CMLP_OK) a->device_error = st;
    return st == CMLP_OK;
}

static bool hook_fires(cmlp_allocator *a) {
    a->stats.num_raw_alloc_calls++;
    return a->fail_in > 0 && --a->fail_in == 0;
}

static alloc_segment *segment_new(cmlp_allocator *a, char *base, size_t size, size_t vsize, int pool, bool expandable) {
    alloc_segment *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    *s = (alloc_segment){.base = base, .size = size, .vsize = vsize, .pool = pool, .expandable = expandable};
    s->next = a->segments;
    if (a->segments) a->segments->prev = s;
    a->segments = s;
    return s;
}

static void segment_unlink(cmlp_allocator *a, alloc_segment *s) {
    if (s->prev) s->prev->next = s->next;
    else a->segments = s->next;
    if (s->next) s->next->prev = s->prev;
}

static void account_segment(cmlp_allocator *a, alloc_segment *s, int sign) {
    alloc_stat(a, CMLP_STAT_SEGMENT, s->pool, sign);
    alloc_stat(a, CMLP_STAT_RESERVED_BYTES, s->pool, sign * (int64_t)s->size);
    if (s->oversize) alloc_stat(a, CMLP_STAT_OVERSIZE_SEGMENTS, s->pool, sign);
}

/* A new segment for a rounded request: NULL when the limit or the device says no. */
alloc_block *alloc_new_segment(cmlp_allocator *a, int pool, size_t size) {
    size_t seg_size = a->uncached ? size : alloc_segment_size(&a->cfg, size);
    if (over_limit(a, seg_size)) return NULL;
    if (hook_fires(a)) return NULL;
    void *p = NULL;
    if (!device_ok(a, a->backend->raw_alloc(a->bctx, seg_size, &p)) || !p) return NULL;
    alloc_segment *s = segment_new(a, p, seg_size, seg_size, pool, false);
    alloc_block *b = s ? calloc(1, sizeof *b) : NULL;
    if (!b) {
        if (s) {
            segment_unlink(a, s);
            free(s);
        }
        a->backend->raw_free(a->bctx, p, seg_size);
        return NULL;
    }
    *b = (alloc_block){.ptr = p, .size = seg_size, .seg = s};
    s->first = b;
    s->oversize = oversize(a, seg_size);
    s->origin = alloc_origin_now(a);
    a->stats.num_device_alloc++;
    account_segment(a, s, +1);
    alloc_note_segment(a, CMLP_TRACE_SEGMENT_ALLOC, p, seg_size, s->origin);
    alloc_poison(a, p, seg_size); /* (a free block until the request takes its part) */
    return b;
}

/* Maps the unmapped pages among [i, j) of an expandable segment, one device call per run. */
static bool map_pages(cmlp_allocator *a, alloc_segment *s, size_t i, size_t j) {
    while (i < j) {
        if (pg_on(s, i)) {
            i++;
            continue;
        }
        size_t k = i;
        while (k < j && !pg_on(s, k)) k++;
        if (hook_fires(a) || !device_ok(a, a->backend->vm_map(a->bctx, s->base + i * PAGE, (k - i) * PAGE)))
            return false;
        a->stats.num_device_alloc++;
        const alloc_origin origin = alloc_origin_now(a);
        alloc_note_segment(a, CMLP_TRACE_SEGMENT_MAP, s->base + i * PAGE, (k - i) * PAGE, origin);
        if (!s->page_origin) s->page_origin = calloc(s->npages, sizeof *s->page_origin); /* (none: not shown) */
        for (size_t g = i; s->page_origin && g < k; g++) s->page_origin[g] = origin;
        alloc_poison(a, s->base + i * PAGE, (k - i) * PAGE); /* free until a request takes its part */
        if (k > s->poisoned_hi) s->poisoned_hi = k;
        int64_t runs = 1 - (i > 0 && pg_on(s, i - 1)) - pg_on(s, k);
        for (size_t g = i; g < k; g++) s->map[g >> 6] |= (uint64_t)1 << (g & 63);
        if (k > s->hi) s->hi = k;
        s->size += (k - i) * PAGE;
        alloc_stat(a, CMLP_STAT_RESERVED_BYTES, s->pool, (int64_t)((k - i) * PAGE));
        alloc_stat(a, CMLP_STAT_SEGMENT, s->pool, runs);
        i = k;
    }
    return true;
}

/* Unmaps pages [i, j), all mapped and inside free blocks. */
static void unmap_pages(cmlp_allocator *a, alloc_segment *s, size_t i, size_t j) {
    a->backend->vm_unmap(a->bctx, s->base + i * PAGE, (j - i) * PAGE);
    a->stats.num_device_free++;
    alloc_note_segment(a, CMLP_TRACE_SEGMENT_UNMAP, s->base + i * PAGE, (j - i) * PAGE, alloc_page_origin(s, i));
    int64_t runs = (int64_t)(i > 0 && pg_on(s, i - 1)) + pg_on(s, j) - 1;
    for (size_t g = i; g < j; g++) s->map[g >> 6] &= ~((uint64_t)1 << (g & 63));
    while (s->hi > 0 && !pg_on(s, s->hi - 1)) s->hi--; /* pg_on reads below hi only */
    s->size -= (j - i) * PAGE;
    alloc_stat(a, CMLP_STAT_RESERVED_BYTES, s->pool, -(int64_t)((j - i) * PAGE));
    alloc_stat(a, CMLP_STAT_SEGMENT, s->pool, runs);
}

/* Whole mapped pages of free blocks in expandable segments, highest address first, up to
 * `want` pages, are unmapped (or, when `dry`, only counted). `held` is a free block taken out of
 * its pool for a request whose pages start at its first page and end before page `keep_hi`:
 * only its pages from keep_hi on may go. Returns the number of pages. */
static size_t reclaim_pages(cmlp_allocator *a, size_t want, const alloc_block *held, size_t keep_hi, bool dry) {
    size_t got = 0;
    for (alloc_segment *s = a->segments; s && got < want; s = s->next) {
        if (!s->expandable || s->size == 0) continue;
        alloc_block *c = s->first;
        while (c->next) c = c->next;
        for (; c && got < want; c = c->prev) {
            if (c->allocated) continue;
            size_t lo = pg_up(s, c->ptr), hi = pg_down(s, c->ptr + c->size);
            if (c == held && lo < keep_hi) lo = keep_hi;
            if (hi > s->hi) hi = s->hi;
            if (lo >= hi) continue;
            bool taken = false;
            for (size_t j = hi; j > lo && got < want;) {
                if (!pg_on(s, j - 1)) {
                    j--;
                    continue;
                }
                size_t i = j;
                while (i > lo && pg_on(s, i - 1) && got + (j - i) < want) i--;
                got += j - i;
                if (!dry) {
                    if (!taken && c != held) alloc_pool_take(a, c);
                    taken = c != held;
                    unmap_pages(a, s, i, j);
                }
                j = i;
            }
            if (taken) alloc_pool_return(a, c);
        }
    }
    return got;
}

/* Makes the pages under the first `size` bytes of a free block of an expandable segment
 * mapped. The physical memory comes from free pages elsewhere first (which are unmapped), so
 * reserved memory grows only when no free page is left to give; the limit is checked first. */
bool alloc_map_block(cmlp_allocator *a, alloc_block *b, size_t size) {
    alloc_segment *s = b->seg;
    size_t i = pg_down(s, b->ptr), j = pg_up(s, b->ptr + size);
    size_t need = alloc_unmapped_pages(s, i, j);
    if (need == 0) return true;
    size_t give = reclaim_pages(a, need, b, j, true);
    if (over_limit(a, (need - give) * PAGE)) return false;
    if (give) reclaim_pages(a, give, b, j, false);
    return map_pages(a, s, i, j);
}

/* The pool's expandable segment: a virtual range the size of the device's memory, one free
 * block with nothing mapped. */
bool alloc_new_expandable(cmlp_allocator *a, int pool) {
    const cmlp_backend_i *be = a->backend;
    size_t vsize = ((size_t)a->total_memory + PAGE - 1) / PAGE * PAGE;
    void *base = NULL;
    if (vsize == 0 || !device_ok(a, be->vm_reserve(a->bctx, vsize, &base))) return false;
    size_t npages = vsize / PAGE;
    uint64_t *map = calloc((npages + 63) / 64, sizeof *map);
    alloc_block *b = map ? calloc(1, sizeof *b) : NULL;
    alloc_segment *s = b ? segment_new(a, base, 0, vsize, pool, true) : NULL;
    if (!s) {
        free(b);
        free(map);
        be->vm_release(a->bctx, base, vsize);
        return false;
    }
    s->map = map;
    s->npages = npages;
    *b = (alloc_block){.ptr = base, .size = vsize, .seg = s};
    s->first = b;
    a->pools[pool].expandable = s;
    alloc_pool_put(a, b);
    return true;
}

static bool whole_and_free(const alloc_segment *s) {
    return !s->expandable && s->first && !s->first->allocated && !s->first->next;
}

static size_t release_segment(cmlp_allocator *a, alloc_segment *s) {
    size_t size = s->size;
    alloc_pool_take(a, s->first);
    account_segment(a, s, -1);
    segment_unlink(a, s);
    alloc_unpoison(a, s->base, s->size);
    a->backend->raw_free(a->bctx, s->base, s->size);
    a->stats.num_device_free++;
    alloc_note_segment(a, CMLP_TRACE_SEGMENT_FREE, s->base, size, s->origin);
    free(s->first);
    free(s);
    return size;
}

void alloc_release_if_free(cmlp_allocator *a, alloc_segment *s) {
    if (s->expandable) (void)reclaim_pages(a, SIZE_MAX, NULL, 0, false); /* (its free pages) */
    else if (whole_and_free(s)) release_segment(a, s);
}

/* Every whole free segment and every free page of an expandable segment goes back (after the
 * device's work, which PyTorch counts in num_sync_all_streams). */
size_t alloc_release_cached(cmlp_allocator *a) {
    size_t freed = 0;
    a->stats.num_sync_all_streams++;
    for (alloc_segment *s = a->segments, *next; s; s = next) {
        next = s->next;
        if (whole_and_free(s)) freed += release_segment(a, s);
    }
    return freed + reclaim_pages(a, SIZE_MAX, NULL, 0, false) * PAGE;
}

/* PyTorch's release_available_cached_blocks, for a large-pool request under max_split_size:
 * whole free oversize segments go back, the smallest that covers the request (at least
 * max_split_size), else the largest ones until it is covered. True if it was covered; else the
 * caller releases the whole cache (what went back stays back). */
bool alloc_release_oversize(cmlp_allocator *a, int pool, size_t size) {
    if (a->cfg.max_split_size < 0 || pool != POOL_LARGE) return false;
    const size_t msz = (size_t)a->cfg.max_split_size, key = size > msz ? size : msz;
    size_t freed = 0;
    while (freed < key) {
        alloc_segment *best = NULL, *largest = NULL;
        for (alloc_segment *s = a->segments; s; s = s->next) {
            if (!whole_and_free(s) || s->pool != POOL_LARGE || s->size < msz) continue;
            if (s->size >= key && (!best || s->size < best->size)) best = s;
            if (!largest || s->size > largest->size) largest = s;
        }
        if (!largest) break;
        freed += release_segment(a, best ? best : largest);
        if (best) break;
    }
    return freed >= key;
}

/* A segment whose one block is free (an expandable one's too: PyTorch's unsplit free blocks). */
static bool one_free_block(const alloc_segment *s) {
    return s->first && !s->first->allocated && !s->first->next;
}

/* PyTorch's garbage collection, under a limit with a threshold, before a new segment is made:
 * once reserved memory is past threshold x limit, whole free segments of the large pool go
 * back, in passes: each frees every one at least as old as the average (the age of a block is
 * the number of the pool's cache searches since it entered the pool; an expandable segment's
 * unsplit free block counts in the average, and stays), not stopping at the target, until
 * reserved memory is back under the threshold or none is left. */
void alloc_collect_garbage(cmlp_allocator *a) {
    if (!alloc_gc_on(a)) return;
    const double threshold = a->cfg.garbage_collection_threshold * (double)a->limit;
    const int64_t held = reserved(a);
    if ((double)held <= threshold) return;
    const double target = (double)held - threshold;
    const uint64_t now = a->gc_calls[POOL_LARGE];
    uint64_t total_age = 0;
    size_t count = 0;
    for (alloc_segment *s = a->segments; s; s = s->next)
        if (one_free_block(s) && s->pool == POOL_LARGE) {
            total_age += now - s->first->tick;
            count++;
        }
    double reclaimed = 0;
    for (bool freed_one = true; freed_one && count > 0 && reclaimed < target;) {
        const double average = (double)total_age / (double)count;
        freed_one = false;
        for (alloc_segment *s = a->segments, *next; s; s = next) {
            next = s->next;
            if (!whole_and_free(s) || s->pool != POOL_LARGE || (double)(now - s->first->tick) < average) continue;
            total_age -= now - s->first->tick;
            count--;
            reclaimed += (double)release_segment(a, s);
            freed_one = true;
        }
    }
}
