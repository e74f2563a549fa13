/* alloc_oom.c - what a request the allocator cannot serve reports: the out-of-memory error (PyTorch's
 * message, then the request as made, the largest free block and what would make the run fit),
 * the processes that hold the device, and the history's OOM entry.
 */
#include "alloc_internal.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* The largest free block, counting the mapped pieces of an expandable segment's blocks. */
int64_t alloc_largest_free(const cmlp_allocator *a) {
    size_t m = 0;
    for (const alloc_segment *s = a->segments; s; s = s->next)
        for (const alloc_block *b = s->first; b; b = b->next) {
            size_t n = b->allocated ? 0 : s->expandable ? b->pmax : b->size;
            if (n > m) m = n;
        }
    return (int64_t)m;
}

/* What the device has free: its driver's word where it has one (as the out-of-memory message and
 * torch's trace say, under a memory limit too), else its total less what is reserved. */
static int64_t device_free_bytes(cmlp_allocator *a) {
    int64_t r = reserved(a), free_bytes = a->backend->free_memory ? a->backend->free_memory(a->bctx) : -1;
    return free_bytes >= 0 ? free_bytes : a->total_memory > r ? a->total_memory - r : 0;
}

/* A request that failed, with what the device had free. */
void alloc_note_oom(cmlp_allocator *a, size_t nbytes, const char *what) {
    if (a->hist.mode != CMLP_HISTORY_ALL || (a->hist.skip >> CMLP_TRACE_OOM & 1u)) return;
    note(a, CMLP_TRACE_OOM, NULL, nbytes, what, alloc_context_for(a, CMLP_CONTEXT_ALLOC), device_free_bytes(a));
}

/* torch's lines on who holds the device's memory: the other processes, then this one's whole use
 * (its CUDA context and anything outside the allocator too); "" where the device cannot tell. */
static void memory_users(cmlp_allocator *a, char *out, size_t cap) {
    out[0] = '\0';
    enum { ASKED = 64, SHOWN = 4 };
    int64_t pids[ASKED], bytes[ASKED], self = -2;
    int n = a->backend->gpu_processes ? a->backend->gpu_processes(a->bctx, pids, bytes, ASKED) : -1;
    size_t at = 0;
    int shown = 0;
    char b[32];
    for (int i = 0; i < n && i < ASKED; i++) {
        if (pids[i] == (int64_t)getpid()) {
            self = bytes[i];
        } else if (shown < SHOWN && at < cap) {
            shown++;
            cmlp_format_bytes(b, sizeof b, bytes[i]);
            at += (size_t)(bytes[i] < 0 ? snprintf(out + at, cap - at, " Process %lld has memory in use.",
                                                   (long long)pids[i])
                                        : snprintf(out + at, cap - at, " Process %lld has %s memory in use.",
                                                   (long long)pids[i], b));
        }
    }
    /* past the first ASKED, this process (which holds a context here) is among the rest */
    const int others = n - (self != -2 || n > ASKED);
    if (others > shown && at < cap) at += (size_t)snprintf(out + at, cap - at, " (%d other processes.)", others);
    if (self >= 0 && at < cap) {
        cmlp_format_bytes(b, sizeof b, self);
        snprintf(out + at, cap - at, " Including memory outside cmlp's allocator, this process has %s in use.", b);
    }
}

/* PyTorch's message first (on a GPU its very words: code and people search for them), with what
 * the allocator tried to get from the device (the segment); then the request as made, the largest
 * free block and what would make the run fit. */
cmlp_status alloc_oom(cmlp_allocator *a, size_t nbytes, size_t size) {
    char tried[32], req[32], alc[32], cap[32], fre[32], big[32], unalloc[32], lim[128] = "", sg[32], seg_note[400] = "";
    char users[320];
    memory_users(a, users, sizeof users);
    int64_t r = reserved(a), al = a->stats.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current;
    int64_t device_free = device_free_bytes(a);
    int64_t largest = alloc_largest_free(a);
    /* fragmentation: the free bytes inside segments that hold allocations (torch's non-releasable
     * memory); a whole free segment is cache, which the ladder gives back */
    const int64_t split_free = a->stats.stat[CMLP_STAT_INACTIVE_SPLIT_BYTES][CMLP_POOL_ALL].current;
    double frag = r > 0 ? 100.0 * (double)split_free / (double)r : 0.0;
    a->stats.num_ooms++;
    a->ooms_ever++;
    /* a small request that fits in what is free can still need a whole new segment (caching off,
     * the request's own size) */
    size_t seg = a->cfg.expandable_segments || a->uncached ? size : alloc_segment_size(&a->cfg, size);
    cmlp_format_bytes(tried, sizeof tried, (int64_t)seg);
    cmlp_format_bytes(req, sizeof req, (int64_t)nbytes);
    cmlp_format_bytes(alc, sizeof alc, al);
    cmlp_format_bytes(unalloc, sizeof unalloc, r - al);
    cmlp_format_bytes(cap, sizeof cap, a->total_memory);
    cmlp_format_bytes(fre, sizeof fre, device_free);
    cmlp_format_bytes(big, sizeof big, largest);
    if (a->limit >= 0) {
        char l[32], lf[32];
        cmlp_format_bytes(l, sizeof l, a->limit);
        cmlp_format_bytes(lf, sizeof lf, a->limit > r ? a->limit - r : 0);
        snprintf(lim, sizeof lim, " %s allowed (the memory limit, of which %s is free);", l, lf);
    }
    alloc_note_oom(a, size, a->what); /* the rounded size, as PyTorch's trace has it */
    if (seg > size) {
        char lsg[32];
        cmlp_format_bytes(sg, sizeof sg, (int64_t)seg);
        cmlp_format_bytes(lsg, sizeof lsg, a->cfg.large_segment_size);
        const int64_t room = a->limit >= 0 ? (a->limit > r ? a->limit - r : 0) : device_free;
        snprintf(seg_note, sizeof seg_note,
                 " It needs a new segment of %s (requests up to 1 MiB share 2 MiB segments, up to 10 MiB %s "
                 "ones).%s", sg, lsg,
                 room >= (int64_t)size && room < (int64_t)seg && !a->no_vm
                     ? " The request fits in what is free, its segment does not: expandable_segments:True "
                       "(cmlp.memory.configure, or CMLP_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF in the environment) "
                       "maps 2 MiB pages instead of whole segments."
                     : "");
    }
    /* the model's own buffers do not shrink with the batch: micro-batches would not help */
    const char *what = a->what ? a->what : "";
    const bool model_state = !strcmp(what, "parameters") || !strcmp(what, "gradients") ||
                             !strcmp(what, "optimizer state");
    const char *frag_hint = frag <= 20.0             ? ""
                            : a->cfg.expandable_segments ? " Reserved but unallocated memory is large: "
                                                           "empty_cache() returns free segments and tails."
                            : a->no_vm ? " If reserved but unallocated memory is large try setting a max_split_size_mb "
                                         "(cmlp.memory.configure) to avoid fragmentation (this device has no virtual "
                                         "memory for expandable_segments)."
                                       : " If reserved but unallocated memory is large try setting "
                                         "expandable_segments:True (cmlp.memory.configure) or a max_split_size_mb to "
                                         "avoid fragmentation.";
    char head[192];
    if (!strncmp(a->name, "cuda:", 5))
        snprintf(head, sizeof head, "CUDA out of memory. Tried to allocate %s. GPU %s", tried, a->name + 5);
    else
        snprintf(head, sizeof head, "%s out of memory. Tried to allocate %s. The %s", a->name, tried, a->name);
    return CMLP_FAIL(CMLP_ERR_OOM,
                     "%s has a total capacity of %s of which %s is free.%s%s Of the allocated memory %s is "
                     "allocated by cmlp, and %s is reserved by cmlp but unallocated. The request was %s (%zu "
                     "bytes requested, rounded to %zu); the largest free block is %s (fragmentation %.1f%%: the "
                     "share of reserved memory free inside segments in use).%s%s%s",
                     head, cap, fre, users, lim, alc, unalloc, req, nbytes, size, big, frag, seg_note, frag_hint,
                     model_state ? " The model's parameters, gradients and optimizer state do not shrink with the "
                                   "batch: only a larger limit, a smaller model or less optimizer state (SGD without "
                                   "momentum keeps none; data-parallel, ZeroRedundancyOptimizer shards it) make "
                                   "them fit."
                                 : " Try micro-batches (Trainer(auto_microbatch=True) or a smaller batch_size with "
                                   "accumulation_steps), amp=\"fp16\" or \"bf16\", or for deep networks recompute=True "
                                   "(cmlp.memory.plan says whether it saves memory).");
}
