/* alloc_copy.c - a copy of an allocator over another backend: its segments (the pages mapped in
 * expandable ones), blocks, settings, limit and statistics, at the same addresses, so that
 * requests tried on the copy are served, or refused, as the allocator itself would serve them
 * now, and nothing of the allocator's changes.
 */
#include "alloc_internal.h"

#include <stdlib.h>
#include <string.h>

/* The segment's copy, its blocks in order; allocated ones go into the table, free ones into
 * their pool's tree (the statistics are copied whole afterwards). */
static bool copy_segment(cmlp_allocator *c, const cmlp_allocator *a, const alloc_segment *s, alloc_segment **out) {
    alloc_segment *t = calloc(1, sizeof *t);
    if (!t) return false;
    *t = (alloc_segment){.base = s->base, .size = s->size, .vsize = s->vsize, .pool = s->pool,
                         .expandable = s->expandable, .npages = s->npages, .oversize = s->oversize,
                         .origin = s->origin}; /* (an expandable one's pages: no history is kept of a copy) */
    *out = t;
    if (s->expandable) {
        size_t words = (s->npages + 63) / 64;
        if (!(t->map = malloc(words * sizeof *t->map))) return false;
        memcpy(t->map, s->map, words * sizeof *t->map);
        t->hi = s->hi; /* (set once there is a map: destroy reads it below hi) */
        if (a->pools[s->pool].expandable == s) c->pools[s->pool].expandable = t;
    }
    alloc_block **link = &t->first, *prev = NULL;
    for (const alloc_block *b = s->first; b; b = b->next) {
        alloc_block *n = malloc(sizeof *n);
        if (!n) return false;
        *n = *b;
        n->seg = t, n->prev = prev, n->next = NULL, n->left = n->right = NULL;
        *link = prev = n;
        link = &n->next;
        if (!n->allocated) {
            alloc_tree_insert(&c->pools[t->pool], n);
        } else {
            if (!alloc_table_reserve(c)) return false;
            alloc_table_put(c, n);
        }
    }
    return true;
}

cmlp_status cmlp_allocator_copy(cmlp_allocator *a, const cmlp_backend_i *b, void *bctx, void (*at_copy)(void *bctx),
                                cmlp_allocator **out) {
    *out = NULL;
    cmlp_allocator *c;
    CMLP_TRY(cmlp_allocator_create(b, bctx, a->name, &c));
    pthread_mutex_lock(&a->lock);
    if (at_copy) at_copy(bctx);
    c->limit = a->limit;
    c->total_memory = a->total_memory;
    c->cfg = a->cfg;
    c->config_gen = a->config_gen;
    c->pytorch_ladder = a->pytorch_ladder;
    c->uncached = a->uncached;
    c->caching_gen = a->caching_gen; /* (a switch it has not taken up yet, the copy takes up as it would) */
    c->no_vm = a->no_vm;
    memcpy(c->gc_calls, a->gc_calls, sizeof c->gc_calls);
    bool ok = true;
    alloc_segment **tail = &c->segments, *prev = NULL;
    for (const alloc_segment *s = a->segments; s && ok; s = s->next) {
        alloc_segment *t = NULL;
        ok = copy_segment(c, a, s, &t);
        if (t) { /* linked even when incomplete: destroy frees what was made */
            t->prev = prev;
            *tail = prev = t;
            tail = &t->next;
        }
    }
    c->stats = a->stats;
    c->window_peak = a->window_peak;
    pthread_mutex_unlock(&a->lock);
    if (!ok) {
        cmlp_allocator_destroy(c);
        return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory copying the %s allocator", a->name);
    }
    *out = c;
    return CMLP_OK;
}
