/* alloc_tree.c - the ordered set of free blocks of one pool: a treap keyed by (size, address),
 * so that best fit (the smallest block that fits, lowest address first) is O(log n).
 */
#include "alloc_internal.h"

static int key_less(const alloc_block *a, const alloc_block *b) {
    if (a->size != b->size) return a->size < b->size;
    return (uintptr_t)a->ptr < (uintptr_t)b->ptr;
}

/* Splits t into (< key) and (>= key). */
static void split(alloc_block *t, const alloc_block *key, alloc_block **lo, alloc_block **hi) {
    if (!t) {
        *lo = *hi = NULL;
        return;
    }
    if (key_less(t, key)) {
        split(t->right, key, &t->right, hi);
        *lo = t;
    } else {
        split(t->left, key, lo, &t->left);
        *hi = t;
    }
}

static alloc_block *merge(alloc_block *a, alloc_block *b) {
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) {
        a->right = merge(a->right, b);
        return a;
    }
    b->left = merge(a, b->left);
    return b;
}

void alloc_tree_insert(alloc_pool *p, alloc_block *b) {
    /* xorshift priorities: deterministic, well spread */
    p->seed ^= p->seed << 13;
    p->seed ^= p->seed >> 7;
    p->seed ^= p->seed << 17;
    b->prio = p->seed;
    b->left = b->right = NULL;
    alloc_block *lo, *hi;
    split(p->root, b, &lo, &hi);
    p->root = merge(merge(lo, b), hi);
    p->count++;
    p->bytes += b->size;
}

static alloc_block *erase(alloc_block *t, const alloc_block *b, int *found) {
    if (!t) return NULL;
    if (t == b) {
        *found = 1;
        return merge(t->left, t->right);
    }
    if (key_less(b, t)) t->left = erase(t->left, b, found);
    else t->right = erase(t->right, b, found);
    return t;
}

int alloc_tree_remove(alloc_pool *p, alloc_block *b) {
    int found = 0;
    p->root = erase(p->root, b, &found);
    if (found) {
        p->count--;
        p->bytes -= b->size;
        b->left = b->right = NULL;
    }
    return found;
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
