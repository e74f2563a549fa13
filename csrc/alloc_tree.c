/* alloc_tree.c - the ordered set of free blocks of one pool: a treap keyed by (size, address),
 * so that best fit (the smallest block that fits, lowest address first) is O(log n).
 */
#include "alloc_internal.h"

static int key_less(const alloc_block *a, const alloc_block *b) {
    if (a->size != b->size) return a->size < b->size;
    return (uintptr_t)a->ptr < (uintptr_t)b->ptr;
}

/* Inserts b below the last node of higher priority on its search path; the subtree it replaces
 * is split by b's key into b's two children. */
void alloc_tree_insert(alloc_pool *p, alloc_block *b) {
    /* xorshift priorities: deterministic, well spread */
    p->seed ^= p->seed << 13;
    p->seed ^= p->seed >> 7;
    p->seed ^= p->seed << 17;
    b->prio = p->seed;
    alloc_block **link = &p->root;
    while (*link && (*link)->prio > b->prio) link = key_less(*link, b) ? &(*link)->right : &(*link)->left;
    alloc_block *t = *link, **lo = &b->left, **hi = &b->right;
    while (t) {
        if (key_less(t, b)) {
            *lo = t;
            lo = &t->right;
            t = t->right;
        } else {
            *hi = t;
            hi = &t->left;
            t = t->left;
        }
    }
    *lo = *hi = NULL;
    *link = b;
    p->count++;
    p->bytes += b->size;
}

/* Unlinks b; its two subtrees merge in its place by priority. */
int alloc_tree_remove(alloc_pool *p, alloc_block *b) {
    alloc_block **link = &p->root;
    while (*link && *link != b) link = key_less(b, *link) ? &(*link)->left : &(*link)->right;
    if (!*link) return 0;
    alloc_block *l = b->left, *r = b->right;
    while (l && r) {
        if (l->prio > r->prio) {
            *link = l;
            link = &l->right;
            l = l->right;
        } else {
            *link = r;
            link = &r->left;
            r = r->left;
        }
    }
    *link = l ? l : r;
    p->count--;
    p->bytes -= b->size;
    b->left = b->right = NULL;
    return 1;
}

alloc_block *alloc_tree_lower_bound(const alloc_pool *p, size_t size) {
    alloc_block *t = p->root, *best = NULL;
    while (t) {
        if (t->size >= size) {
            best = t;
            t = t->left;
        } else {
            t = t->right;
        }
    }
    return best;
}

alloc_block *alloc_tree_next(const alloc_pool *p, const alloc_block *b) {
    alloc_block *t = p->root, *best = NULL;
    while (t) {
        if (key_less(b, t)) {
            best = t;
            t = t->left;
        } else {
            t = t->right;
        }
    }
    return best;
}

alloc_block *alloc_tree_max(const alloc_pool *p) {
    alloc_block *t = p->root;
    while (t && t->right) t = t->right;
    return t;
}
