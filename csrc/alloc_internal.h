/* alloc_internal.h - the caching allocator's private structures, shared by alloc.c (pools,
 * the allocation ladder, statistics), alloc_tree.c (best fit) and alloc_config.c (settings).
 */
#ifndef CMLP_ALLOC_INTERNAL_H
#define CMLP_ALLOC_INTERNAL_H

#include "internal.h"

#include <pthread.h>
#include <stdbool.h>

#define MIB ((size_t)1 << 20)
#define K_MIN_BLOCK ((size_t)512)    /* every request is rounded to this */
#define K_SMALL_SIZE MIB             /* largest "small" request */
#define K_SMALL_BUFFER (2 * MIB)     /* small-pool segment */
#define K_LARGE_BUFFER (20 * MIB)    /* large_segment_size_mb's default */
#define K_MIN_LARGE (10 * MIB)
#define K_ROUND_LARGE (2 * MIB)      /* larger segments round to this; also the page granule */

enum { POOL_LARGE = 0, POOL_SMALL = 1, NPOOLS = 2 };

typedef struct alloc_segment alloc_segment;

typedef struct alloc_block {
    char *ptr;
    size_t size;      /* bytes this block spans in its segment */
    size_t requested; /* what the caller asked for (allocated blocks) */
    bool allocated;
    bool oversize;    /* counted in oversize_allocations when it was handed out */
    uint64_t tick;    /* when it last became free: the gc frees the oldest first */
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

CMLP_HIDDEN void alloc_config_current(cmlp_alloc_settings *out);
/* Tells every allocator to re-read the settings before its next request. */
CMLP_HIDDEN void alloc_config_changed(void);
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
