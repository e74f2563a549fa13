/* alloc.h - the caching allocator: every byte of a device passes through one instance, which
 * caches freed blocks, keeps PyTorch's statistics and enforces the device's memory limit. It is
 * given the raw alloc/free (and virtual memory calls) of its backend and nothing else.
 */
#ifndef CMLP_ALLOC_H
#define CMLP_ALLOC_H

#include "cmlp.h"
#include "backend.h"

#include <stdbool.h>

typedef struct cmlp_allocator cmlp_allocator;


__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_create(const cmlp_backend_i *b, void *bctx, const char *device_name,
                                  cmlp_allocator **out);
/* Whether the device has virtual memory for expandable segments (without it the setting is
 * taken as off). */
__attribute__((visibility("hidden")))
bool cmlp_backend_has_vm(const cmlp_backend_i *b, void *bctx);
/* nbytes == 0 gives NULL and CMLP_OK. On failure CMLP_ERR_OOM with the full story in the
 * error message: request, rounded request, allocated, reserved, limit, free, hints. `what` names
 * what the memory will hold (a string that lives as long as the program: snapshots and the
 * history show it). */
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_malloc(cmlp_allocator *a, size_t nbytes, const char *what, void **out);
/* As cmlp_allocator_malloc, but a request of the small pool for which no segment can be made,
 * even with the cache given back, takes a piece of a cached block of the large pool before it
 * fails (a forward pass's few rows beside the room a step's buffers left: fewer would not help). */
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_malloc_lent(cmlp_allocator *a, size_t nbytes, const char *what, void **out);
/* As cmlp_allocator_malloc, for memory the caller can do without (a copy of data it can read
 * from the host instead): where even the cache given back leaves no room, CMLP_ERR_OOM that is
 * not counted as the allocator's out-of-memory (no num_ooms, no history entry, no advice). */
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_try_malloc(cmlp_allocator *a, size_t nbytes, const char *what, void **out);
/* NULL is a no-op; a pointer this allocator did not hand out is CMLP_ERR_INVALID. */
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_free(cmlp_allocator *a, void *ptr);
/* As cmlp_allocator_free, for a block handed out with this `what` (the same pointer) only: any
 * other block (a model's parameters, say) is CMLP_ERR_INVALID and stays allocated. */
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_free_of(cmlp_allocator *a, void *ptr, const char *what);
/* A copy of the allocator (segments and blocks at the same addresses, settings, limit, statistics;
 * not its history) over backend b, which reserves memory for the copy's new segments and pages:
 * requests on the copy are served or refused as the allocator would serve them now. Destroy it
 * with cmlp_allocator_destroy, which gives every segment back to b. at_copy (may be NULL) is
 * called with bctx while a cannot change, before it is copied: to read what b may give then. */
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_copy(cmlp_allocator *a, const cmlp_backend_i *b, void *bctx, void (*at_copy)(void *bctx),
                                cmlp_allocator **out);
void cmlp_allocator_stats(cmlp_allocator *a, cmlp_memory_stats *out);
/* The out-of-memory errors the allocator has raised, which no reset of the statistics clears. */
__attribute__((visibility("hidden")))
int64_t cmlp_allocator_ooms_ever(cmlp_allocator *a);
__attribute__((visibility("hidden")))
void cmlp_allocator_reset_peak(cmlp_allocator *a);
/* The peak of the allocated bytes since the last restart (a second peak, beside the statistics'
 * own, which it leaves alone); with restart, it starts again from the current allocated bytes. */
int64_t cmlp_allocator_window(cmlp_allocator *a, bool restart);
/* Takes (hold) or gives back the allocator's lock: around fork(), so that the child does not
 * inherit it taken by a thread it does not have. */
__attribute__((visibility("hidden")))
void cmlp_allocator_hold(cmlp_allocator *a, bool hold);
/* PyTorch's resetAccumulatedStats: every stat's allocated and freed totals, and the counts of
 * retries, OOMs, syncs and device allocations and frees, back to 0. */
__attribute__((visibility("hidden")))
void cmlp_allocator_reset_accumulated(cmlp_allocator *a);
__attribute__((visibility("hidden")))
void cmlp_allocator_empty_cache(cmlp_allocator *a);
__attribute__((visibility("hidden")))
void cmlp_allocator_set_limit(cmlp_allocator *a, int64_t limit);
__attribute__((visibility("hidden")))
void cmlp_allocator_destroy(cmlp_allocator *a);
/* Test hook: caching on or off for this allocator, which must hold nothing (it starts as
 * cmlp_memory_caching_disabled says). */
__attribute__((visibility("hidden")))
void cmlp_allocator_set_caching(cmlp_allocator *a, bool on);
/* Test hook: the k-th raw device call (allocation or mapping) from now fails; 0 disables. */
__attribute__((visibility("hidden")))
void cmlp_allocator_fail_raw(cmlp_allocator *a, int64_t k);
__attribute__((visibility("hidden")))
/* With entries != NULL, the history too (taken under the same lock; the snapshot's own entry,
 * when it is kept, is noted after it, as torch's: the next snapshot shows it). */
cmlp_status cmlp_allocator_snapshot(cmlp_allocator *a, cmlp_segment_info **segs, int64_t *nseg,
                                    cmlp_block_info **blks, int64_t *nblk, cmlp_trace_entry **entries,
                                    int64_t *nentries);
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_validate(cmlp_allocator *a);
/* The history (cmlp_memory_record_history, cmlp_memory_history). */
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_record_history(cmlp_allocator *a, cmlp_history_mode mode, cmlp_context_mode context,
                                          int64_t max_entries, uint32_t skip_actions, bool clear);
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_history(cmlp_allocator *a, cmlp_trace_entry **entries, int64_t *n);
/* Benchmarks only: follow PyTorch's ladder exactly (no cache search after releasing), to
 * measure what cmlp's changes to it are worth. */
__attribute__((visibility("hidden")))
void cmlp_allocator_pytorch_ladder(cmlp_allocator *a, bool on);
/* While the calling thread captures a graph on a's device (on != 0): its requests are served
 * from cached memory only (already mapped, for expandable segments); a miss fails with
 * CMLP_ERR_DEVICE at once, releasing nothing, since a capture may neither allocate nor wait.
 * Other threads allocate as usual. Turned off, false where the thread allocated or freed any
 * block of a's since it was turned on: such a graph must not be kept (a block that changed
 * hands is the cache's while the graph still uses it). */
__attribute__((visibility("hidden")))
bool cmlp_allocator_capturing(cmlp_allocator *a, bool on);
/* Formats n bytes as PyTorch's messages do: "512 bytes", "1024.00 KiB", "158.00 MiB". */
__attribute__((visibility("hidden")))
void cmlp_format_bytes(char *buf, size_t cap, int64_t n);

#endif /* CMLP_ALLOC_H */
