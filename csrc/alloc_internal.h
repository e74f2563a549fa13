/* alloc_internal.h - the caching allocator's private structures, shared by alloc.c (pools,
 * the allocation ladder, statistics), alloc_segments.c (segments and pages from the device),
 * alloc_inspect.c (history, snapshot, validation), alloc_tree.c (best fit) and alloc_config.c
 * (settings).
 */
#ifndef CMLP_ALLOC_INTERNAL_H
#define CMLP_ALLOC_INTERNAL_H

#include "internal.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>

#define MIB ((size_t)1 << 20)
#define K_MIN_BLOCK ((size_t)512)    /* every request is rounded to this */
#define K_SMALL_SIZE MIB             /* largest "small" request */
#define K_SMALL_BUFFER (2 * MIB)     /* small-pool segment */
#define K_LARGE_BUFFER (20 * MIB)    /* large_segment_size_mb's default */
#define K_MIN_LARGE (10 * MIB)
#define K_ROUND_LARGE (2 * MIB)      /* larger segments round to this; also the page granule */

enum { POOL_LARGE = 0, POOL_SMALL = 1, NPOOLS = 2 };

/* Poisoning for AddressSanitizer (see cmlp_backend_i.host_memory); nothing in other builds. */
#if defined(__SANITIZE_ADDRESS__)
#define ALLOC_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ALLOC_ASAN 1
#endif
#endif
#ifdef ALLOC_ASAN
#include <sanitizer/asan_interface.h>
#define alloc_poison(a, p, n) ((a)->poison ? ASAN_POISON_MEMORY_REGION(p, n) : (void)0)
#define alloc_unpoison(a, p, n) ((a)->poison ? ASAN_UNPOISON_MEMORY_REGION(p, n) : (void)0)
#else
#define alloc_poison(a, p, n) ((void)(a), (void)(p), (void)(n))
#define alloc_unpoison(a, p, n) ((void)(a), (void)(p), (void)(n))
#endif

typedef struct alloc_segment alloc_segment;

/* What a segment (or an expandable segment's page) was made for: the request's what and the
 * caller's context (as an allocated block's), which its snapshot entry and its free show. */
typedef struct {
    const char *what;
    int64_t context;
} alloc_origin;

typedef struct alloc_block {
    char *ptr;
    size_t size;      /* bytes this block spans in its segment */
    size_t requested; /* what the caller asked for (allocated blocks) */
    bool allocated;
    bool oversize;    /* counted in oversize_allocations when it was handed out */
    uint64_t tick;    /* its pool's cache searches when it entered the pool: its age for the gc */
    const char *what; /* allocated blocks: what the memory holds */
    int64_t context;  /* allocated blocks: the caller's context, when recorded */
    /* free blocks of an expandable segment (computed when the block enters its pool): the
     * largest mapped piece, and the pieces that share their run of mapped pages with another
     * block (inactive_split), their number and bytes */
    size_t pmax, sbytes;
    uint32_t spieces;
    struct alloc_block *prev, *next; /* address neighbours in the segment */
    alloc_segment *seg;
    struct alloc_block *left, *right; /* treap links while free */
    uint32_t prio;
} alloc_block;

struct alloc_segment {
    char *base;
    size_t size;      /* bytes reserved from the device (mapped bytes when expandable) */
    size_t vsize;     /* expandable: the virtual range; else == size */
    int pool;
    bool expandable;
    /* expandable: blocks tile [base, base + vsize); one bit per K_ROUND_LARGE page, set while
     * mapped; no page at or above `hi` is mapped */
    uint64_t *map;
    size_t npages, hi;
    bool oversize;    /* created for a request >= max_split_size */
    alloc_origin origin; /* not expandable: the request it was made for */
    alloc_origin *page_origin; /* expandable: each page's, as it was mapped (NULL until a page is) */
    size_t poisoned_hi; /* expandable, with poisoning: pages below this were mapped once (and poisoned) */
    alloc_block *first;
    alloc_segment *prev, *next; /* all segments of the allocator */
};

typedef struct alloc_pool {
    alloc_block *root;
    uint32_t seed;
    int64_t count;
    size_t bytes;
    alloc_segment *expandable; /* the pool's growing segment, when enabled */
} alloc_pool;

/* An allocated block in the allocator's table, by address. */
typedef struct {
    uintptr_t key; /* 0: empty */
    alloc_block *block;
} table_slot;

/* The history: a ring of up to `max` entries, `n` of them noted, the oldest at `head`. It grows
 * by doubling until it holds `max` (or host memory runs out: then it wraps where it is). */
typedef struct {
    cmlp_history_mode mode;
    cmlp_context_mode context;
    uint32_t skip;
    cmlp_trace_entry *ring;
    int64_t cap, max, n, head;
} alloc_history;

/* The allocator (alloc.c); its history, snapshot and checks are alloc_inspect.c's. */
struct cmlp_allocator {
    pthread_mutex_t lock;
    const cmlp_backend_i *backend;
    void *bctx;
    char name[32];
    int64_t limit; /* -1: none */
    int64_t total_memory;
    cmlp_memory_stats stats;
    int64_t ooms_ever; /* the out-of-memory errors raised, never reset (cmlp_allocator_ooms_ever) */
    int64_t window_peak; /* the allocated bytes' peak since cmlp_allocator_window restarted it */
    /* inactive_split's change (blocks, bytes) in the operation under way: the statistics take each
     * operation's net change, as PyTorch's do (a block taken from its pool and put back in pieces
     * is one change, not a free and an allocation) */
    int64_t split_net[NPOOLS][2];
    alloc_pool pools[NPOOLS];
    alloc_segment *segments;
    table_slot *table; /* allocated blocks by address: open addressing, linear probing */
    size_t cap, count;
    uint64_t gc_calls[NPOOLS]; /* each pool's cache searches with the gc on (get_free_blocks_call_count) */
    int64_t fail_in; /* test hook: the fail_in-th raw call from now fails; 0: off */
    uint64_t config_gen;
    uint64_t caching_gen; /* the caching switch last taken up (alloc_caching_generation) */
    cmlp_alloc_settings cfg;
    bool pytorch_ladder; /* benchmarks only: no second cache search after releasing */
    bool no_vm;          /* the device has no virtual memory: expandable_segments is taken as off */
    bool uncached;       /* caching off (cmlp_memory_caching_disabled): a segment per request, freed with it */
    bool poison;         /* AddressSanitizer build over host memory: what no caller holds is poisoned */
    bool quiet_oom;      /* cmlp_allocator_try_malloc: out of memory is no error of the allocator's */
    bool lend_large;     /* cmlp_allocator_malloc_lent: the large pool may serve a small request */
    cmlp_status device_error; /* a device call failed for a reason other than memory (recorded) */
    alloc_history hist;
    const char *what; /* the request being served: what its memory will hold */
    alloc_block *spare; /* block structs that merges gave up, linked by `next`, for splits to reuse */
    int nspare;
};

/* Notes one history entry (alloc.c). */
CMLP_HIDDEN void alloc_note_entry(cmlp_allocator *a, cmlp_trace_action action, const void *addr, size_t size,
                                  const char *what, int64_t context, int64_t device_free);
/* The caller's context for an entry that keeps it from mode `need` on (alloc.c). */
CMLP_HIDDEN int64_t alloc_context_for(const cmlp_allocator *a, cmlp_context_mode need);
/* alloc_oom.c: the largest free block (the mapped pieces of an expandable segment's blocks); a
 * failed request's history entry; the out-of-memory error for a request of nbytes (size rounded). */
CMLP_HIDDEN int64_t alloc_largest_free(const cmlp_allocator *a);
CMLP_HIDDEN void alloc_note_oom(cmlp_allocator *a, size_t nbytes, const char *what);
CMLP_HIDDEN cmlp_status alloc_oom(cmlp_allocator *a, size_t nbytes, size_t size);
/* Notes an action while the history is kept (one predictable branch otherwise). */
static inline void note(cmlp_allocator *a, cmlp_trace_action action, const void *addr, size_t size, const char *what,
                        int64_t context, int64_t device_free) {
    if (__builtin_expect(a->hist.mode == CMLP_HISTORY_ALL, 0))
        alloc_note_entry(a, action, addr, size, what, context, device_free);
}

static inline int spool(int pool) { return pool == POOL_SMALL ? CMLP_POOL_SMALL : CMLP_POOL_LARGE; }

/* A block with a neighbour in its segment. */
static inline bool is_split(const alloc_block *b) { return b->prev || b->next; }

/* Pages of expandable segments: page i is mapped; the page of p, and the first at or after it. */
#define PAGE K_ROUND_LARGE

static inline bool pg_on(const alloc_segment *s, size_t i) { return i < s->hi && (s->map[i >> 6] >> (i & 63) & 1u); }
static inline size_t pg_down(const alloc_segment *s, const char *p) { return (size_t)(p - s->base) / PAGE; }
static inline size_t pg_up(const alloc_segment *s, const char *p) { return ((size_t)(p - s->base) + PAGE - 1) / PAGE; }
/* What an expandable segment's mapped page i was mapped for. */
static inline alloc_origin alloc_page_origin(const alloc_segment *s, size_t i) {
    return s->page_origin ? s->page_origin[i] : (alloc_origin){NULL, 0};
}

typedef struct {
    size_t bytes, largest, split_bytes;
    uint32_t runs, split_runs;
} span_info;

/* The mapped bytes of [lo, hi) in a segment, as maximal runs of mapped pages; "split" runs are
 * those that reach outside [lo, hi) (their pages hold other blocks too). */
CMLP_HIDDEN span_info alloc_mapped_span(const alloc_segment *s, const char *lo, const char *hi);
/* Where `size` bytes of a free block of an expandable segment lie on mapped pages only: the
 * start of the first of its mapped pieces that holds them (its own start when it can); NULL when
 * none does (pmax must be current). */
CMLP_HIDDEN char *alloc_mapped_fit(const alloc_block *b, size_t size);
/* A free block taken out of its pool starts at `at` from here (alloc_mapped_fit's answer): what
 * lies before goes back to the pool as a free block of its own. False (nothing changed) without
 * host memory for that block. */
CMLP_HIDDEN bool alloc_carve_head(cmlp_allocator *a, alloc_block *b, char *at);
/* The unmapped pages among [i, j) of an expandable segment. */
CMLP_HIDDEN size_t alloc_unmapped_pages(const alloc_segment *s, size_t i, size_t j);

static inline int64_t reserved(const cmlp_allocator *a) {
    return a->stats.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].current;
}

/* Reserving `more` bytes would pass the memory limit. */
static inline bool over_limit(const cmlp_allocator *a, size_t more) {
    return a->limit >= 0 && (more > (size_t)(INT64_MAX - reserved(a)) || reserved(a) + (int64_t)more > a->limit);
}

/* A block (or segment) of this size is oversize: never split, released first under pressure. */
static inline bool oversize(const cmlp_allocator *a, size_t size) {
    return a->cfg.max_split_size >= 0 && size >= (size_t)a->cfg.max_split_size;
}

/* Statistics: stat k moves by d, with its peak and totals, for all pools and (but for the
 * oversize counts) for `pool`; allocated bytes also move the window's peak. Inline, so that the
 * hot path's calls, with k constant, reduce to the stores they make. */
static inline void stat_add(cmlp_stat *s, int64_t d) {
    s->current += d;
    if (d > 0) s->allocated += d;
    else s->freed -= d;
    if (s->current > s->peak) s->peak = s->current;
}

static inline void alloc_stat(cmlp_allocator *a, cmlp_stat_kind k, int pool, int64_t d) {
    stat_add(&a->stats.stat[k][CMLP_POOL_ALL], d);
    if (k == CMLP_STAT_ALLOCATED_BYTES && a->stats.stat[k][CMLP_POOL_ALL].current > a->window_peak)
        a->window_peak = a->stats.stat[k][CMLP_POOL_ALL].current;
    if (k != CMLP_STAT_OVERSIZE_ALLOCATIONS && k != CMLP_STAT_OVERSIZE_SEGMENTS) stat_add(&a->stats.stat[k][spool(pool)], d);
}

/* Block structs for splits, spares first: an allocation and its free make no heap call. Every
 * field is the caller's to set; NULL without host memory. */
#define MAX_SPARE_BLOCKS 64
static inline alloc_block *alloc_block_new(cmlp_allocator *a) {
    alloc_block *b = a->spare;
    if (!b) return malloc(sizeof *b);
    a->spare = b->next;
    a->nspare--;
    return b;
}

static inline void alloc_block_drop(cmlp_allocator *a, alloc_block *b) {
    if (a->nspare == MAX_SPARE_BLOCKS) {
        free(b);
        return;
    }
    b->next = a->spare;
    a->spare = b;
    a->nspare++;
}

/* The table of allocated blocks by address (alloc.c): room for one more (false without host
 * memory), and a block into it. */
CMLP_HIDDEN bool alloc_table_reserve(cmlp_allocator *a);
CMLP_HIDDEN void alloc_table_put(cmlp_allocator *a, alloc_block *b);

/* The history and the pools (alloc.c). */
/* A segment's history entry, on behalf of the request being served (if any). */
CMLP_HIDDEN void alloc_note_segment(cmlp_allocator *a, cmlp_trace_action action, const void *addr, size_t size,
                                    alloc_origin origin);
/* The origin of memory a request being served makes now (its what and the caller's context). */
CMLP_HIDDEN alloc_origin alloc_origin_now(const cmlp_allocator *a);
CMLP_HIDDEN void alloc_pool_put(cmlp_allocator *a, alloc_block *b);
/* Must be called before the block's size, neighbours or mapped pages change. */
CMLP_HIDDEN void alloc_pool_take(cmlp_allocator *a, alloc_block *b);
/* Back into its pool with its age kept. */
CMLP_HIDDEN void alloc_pool_return(cmlp_allocator *a, alloc_block *b);

/* Raw memory (alloc_segments.c). A new segment for a rounded request (with caching off, of
 * exactly that size): NULL when the limit or the device says no. */
CMLP_HIDDEN alloc_block *alloc_new_segment(cmlp_allocator *a, int pool, size_t size);
/* A segment that is one free block goes back to the device, and an expandable segment's free
 * pages (caching off: at each free). */
CMLP_HIDDEN void alloc_release_if_free(cmlp_allocator *a, alloc_segment *s);
/* Maps the pages under the first `size` bytes of a free block of an expandable segment, taking
 * free pages from elsewhere first; false when the limit or the device says no. */
CMLP_HIDDEN bool alloc_map_block(cmlp_allocator *a, alloc_block *b, size_t size);
/* The pool's expandable segment: a virtual range the size of the device, nothing mapped. */
CMLP_HIDDEN bool alloc_new_expandable(cmlp_allocator *a, int pool);
/* Every whole free segment and free page goes back to the device; returns the bytes. */
CMLP_HIDDEN size_t alloc_release_cached(cmlp_allocator *a);
/* Whole free oversize segments go back until the large-pool request is covered; true if it is. */
CMLP_HIDDEN bool alloc_release_oversize(cmlp_allocator *a, int pool, size_t size);
/* Under a limit with a gc threshold, past it: whole free large-pool segments, oldest first. */
CMLP_HIDDEN void alloc_collect_garbage(cmlp_allocator *a);
/* The gc threshold applies: one is set, and a limit. */
static inline bool alloc_gc_on(const cmlp_allocator *a) {
    return a->cfg.garbage_collection_threshold > 0.0 && a->limit >= 0;
}

CMLP_HIDDEN void alloc_config_current(cmlp_alloc_settings *out);
/* Tells every allocator to re-read the settings before its next request. */
CMLP_HIDDEN void alloc_config_changed(void);
/* Bumped by each cmlp_memory_set_caching: an allocator whose caching_gen differs takes up the
 * process's switch. */
CMLP_HIDDEN uint64_t alloc_caching_generation(void);
CMLP_HIDDEN size_t alloc_round_size(const cmlp_alloc_settings *c, size_t n);
CMLP_HIDDEN size_t alloc_segment_size(const cmlp_alloc_settings *c, size_t rounded);
/* Sets each open GPU's memory limit to the settings' per_process_memory_fraction (device.c). */
CMLP_HIDDEN void cmlp_devices_apply_fraction(const cmlp_alloc_settings *c);

CMLP_HIDDEN void alloc_tree_insert(alloc_pool *p, alloc_block *b);
CMLP_HIDDEN int alloc_tree_remove(alloc_pool *p, alloc_block *b);
CMLP_HIDDEN alloc_block *alloc_tree_lower_bound(const alloc_pool *p, size_t size);
CMLP_HIDDEN alloc_block *alloc_tree_next(const alloc_pool *p, const alloc_block *b);
CMLP_HIDDEN alloc_block *alloc_tree_max(const alloc_pool *p);

#endif /* CMLP_ALLOC_INTERNAL_H */
