/* alloc.h - the allocator module: every byte of a device passes through one instance, which
 * keeps PyTorch-style statistics and enforces the device's memory limit. It is given the raw
 * alloc/free of its backend and knows nothing else about the device.
 */
#ifndef CMLP_ALLOC_H
#define CMLP_ALLOC_H

#include "cmlp.h"
#include "backend.h"

typedef struct cmlp_allocator cmlp_allocator;

#define CMLP_ALLOC_ROUND 512                 /* every request is a multiple of this */
#define CMLP_ALLOC_SMALL_SIZE (1 << 20)      /* requests up to 1 MiB are "small pool" */

__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_create(const cmlp_backend_i *b, void *bctx, const char *device_name,
                                  cmlp_allocator **out);
/* nbytes == 0 gives NULL and CMLP_OK. On failure CMLP_ERR_OOM with the full story in the
 * error message: request, rounded request, allocated, reserved, limit, free, hints. */
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_malloc(cmlp_allocator *a, size_t nbytes, void **out);
/* NULL is a no-op; a pointer this allocator did not hand out is CMLP_ERR_INVALID. */
__attribute__((visibility("hidden")))
cmlp_status cmlp_allocator_free(cmlp_allocator *a, void *ptr);
__attribute__((visibility("hidden")))
void cmlp_allocator_stats(cmlp_allocator *a, cmlp_memory_stats *out);
__attribute__((visibility("hidden")))
void cmlp_allocator_reset_peak(cmlp_allocator *a);
__attribute__((visibility("hidden")))
void cmlp_allocator_empty_cache(cmlp_allocator *a);
__attribute__((visibility("hidden")))
void cmlp_allocator_set_limit(cmlp_allocator *a, int64_t limit);
/* Formats n bytes as PyTorch does: "158.00 MiB". */
__attribute__((visibility("hidden")))
void cmlp_format_bytes(char *buf, size_t cap, int64_t n);

#endif /* CMLP_ALLOC_H */
