/* cpu_pool.h - the CPU backend's thread pool, shared with OpenBLAS (cpu_pool.c).
 *
 *     cmlp_pool_for(n, 16, 1 << 15, scale_rows, &args);   // fn(&args, lo, hi) over [0, n)
 */
#ifndef CMLP_CPU_POOL_H
#define CMLP_CPU_POOL_H

#include <stdint.h>

typedef void (*cmlp_pool_fn)(void *arg, int part, int nparts);
typedef void (*cmlp_range_fn)(void *arg, int64_t lo, int64_t hi);

/* Threads of the pool, the caller's included (CMLP_NUM_THREADS, else OPENBLAS_NUM_THREADS, else
 * the CPUs this process may run on). Starts the pool on first use. */
__attribute__((visibility("hidden"))) int cmlp_pool_threads(void);
/* fn(arg, p, nparts) for every p < nparts (at most cmlp_pool_threads()), each part on a thread of
 * its own at the same time (parts may wait for each other); returns when all are done. */
__attribute__((visibility("hidden"))) void cmlp_pool_run(cmlp_pool_fn fn, void *arg, int nparts);
/* fn(arg, lo, hi) over [0, n) in at most one range per thread, each a multiple of grain and at
 * least min_per_thread long (smaller work runs on the caller alone). */
__attribute__((visibility("hidden"))) void cmlp_pool_for(int64_t n, int64_t grain, int64_t min_per_thread,
                                                         cmlp_range_fn fn, void *arg);

#endif /* CMLP_CPU_POOL_H */
