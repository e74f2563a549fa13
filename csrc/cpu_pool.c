/* cpu_pool.c - the CPU's one thread pool. OpenBLAS runs its parallel GEMMs through it (its
 * threads callback), and the CPU backend's loops (Adam, SGD, bias, ReLU, staging, casts) run on
 * the same threads: one pool, so that no thread spins on a core that another pool needs.
 *
 * Workers spin briefly after a job (the next one usually follows within microseconds), then
 * sleep on a futex. A job carries the caller's MXCSR, so that workers flush subnormals exactly
 * when the caller does. When the pool is busy (another thread is using it), work runs inline.
 */
#include "cpu_pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#define GET_FPCSR() _mm_getcsr()
#define SET_FPCSR(v) _mm_setcsr(v)
#else
#define CPU_RELAX() ((void)0)
#define GET_FPCSR() 0u
#define SET_FPCSR(v) ((void)(v))
#endif

#define MAX_THREADS 64
#define SPIN_ROUNDS 20000 /* pauses before a worker sleeps: tens of microseconds */

typedef struct {
    cmlp_pool_fn fn;
    void *arg;
    int nparts;
    unsigned fpcsr;
} pool_job;

static struct {
    pthread_mutex_t busy; /* one caller at a time */
    int nthreads;         /* workers + the caller */
    pool_job job;
    _Atomic int generation; /* bumped for each job; workers wait for a change */
    _Atomic int pending;    /* workers still running the job */
    _Atomic int sleepers;   /* workers asleep on the futex (only then is a wake-up needed) */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .nthreads = 1};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void futex_wait(_Atomic int *addr, int expected) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic int *addr) { syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

static void run_parts(const pool_job *j, int thread) {
    for (int p = thread; p < j->nparts; p += pool.nthreads) j->fn(j->arg, p, j->nparts);
}

static void *worker(void *arg) {
    /* 0: the generation before the first job, which may come before this thread runs */
    int thread = (int)(intptr_t)arg, seen = 0;
    for (;;) {
        int g, spins = 0;
        while ((g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen) {
            if (++spins < SPIN_ROUNDS) CPU_RELAX();
            else {
                atomic_fetch_add(&pool.sleepers, 1);
                futex_wait(&pool.generation, seen);
                atomic_fetch_sub(&pool.sleepers, 1);
                spins = 0;
            }
        }
        seen = g;
        pool_job j = pool.job;
        unsigned saved = GET_FPCSR();
        SET_FPCSR(j.fpcsr);
        run_parts(&j, thread);
        SET_FPCSR(saved);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

/* A count of threads in the environment variable, as atoi reads it but held to [1, MAX_THREADS]
 * (a huge one is MAX_THREADS, not atoi's overflow); 0 where it is unset, or has no count. */
static int env_threads(const char *name) {
    const char *e = getenv(name);
    if (!e) return 0;
    char *end;
    long long v = strtoll(e, &end, 10);
    return end == e || v < 1 ? 0 : v > MAX_THREADS ? MAX_THREADS : (int)v;
}

static int wanted_threads(void) {
    int n = env_threads("CMLP_NUM_THREADS");
    if (n <= 0) n = env_threads("OPENBLAS_NUM_THREADS");
    if (n <= 0) {
        cpu_set_t set;
        n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    }
    return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
}

/* A forked child has the caller's thread only: from then on everything runs inline. */
static void after_fork_child(void) {
    pool.nthreads = 1;
    pthread_mutex_init(&pool.busy, NULL);
}

static void pool_start(void) {
    pthread_atfork(NULL, NULL, after_fork_child);
    int want = wanted_threads();
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int started = 1;
    for (int t = 1; t < want; t++) {
        pthread_t th;
        if (pthread_create(&th, &attr, worker, (void *)(intptr_t)t) != 0) break;
        started++;
    }
    pthread_attr_destroy(&attr);
    pool.nthreads = started;
}

int cmlp_pool_threads(void) {
    pthread_once(&pool_once, pool_start);
    return pool.nthreads;
}

/* With the pool held: parts spread over the threads, the caller taking part 0. */
static void dispatch(cmlp_pool_fn fn, void *arg, int nparts) {
    pool.job = (pool_job){fn, arg, nparts, GET_FPCSR()};
    atomic_store_explicit(&pool.pending, pool.nthreads - 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&pool.sleepers, memory_order_seq_cst) > 0) futex_wake_all(&pool.generation);
    run_parts(&pool.job, 0);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) CPU_RELAX();
}

typedef struct {
    cmlp_pool_fn fn;
    void *arg;
    int part, nparts;
    unsigned fpcsr;
} extra_part;

static void *extra_thread(void *a) {
    extra_part *e = a;
    SET_FPCSR(e->fpcsr);
    e->fn(e->arg, e->part, e->nparts);
    return NULL;
}

/* More parts than threads (someone raised OpenBLAS's thread count behind the pool's back): the
 * parts may wait for each other, so each gets a thread of its own for this call. */
static void run_on_new_threads(cmlp_pool_fn fn, void *arg, int nparts) {
    pthread_t th[MAX_THREADS];
    extra_part ex[MAX_THREADS];
    int started = 0;
    for (int p = 1; p < nparts && p < MAX_THREADS; p++) {
        ex[p] = (extra_part){fn, arg, p, nparts, GET_FPCSR()};
        if (pthread_create(&th[p], NULL, extra_thread, &ex[p]) != 0) break;
        started = p;
    }
    fn(arg, 0, nparts);
    for (int p = started + 1; p < nparts; p++) fn(arg, p, nparts); /* could not start: best effort */
    for (int p = 1; p <= started; p++) pthread_join(th[p], NULL);
}

void cmlp_pool_run(cmlp_pool_fn fn, void *arg, int nparts) {
    if (nparts <= 0) return;
    pthread_once(&pool_once, pool_start);
    if (nparts == 1) {
        fn(arg, 0, 1);
        return;
    }
    if (nparts > pool.nthreads) {
        run_on_new_threads(fn, arg, nparts);
        return;
    }
    /* the parts may wait for each other (OpenBLAS's do): they need a thread each, so wait for
     * the pool rather than run them one after another */
    pthread_mutex_lock(&pool.busy);
    dispatch(fn, arg, nparts);
    pthread_mutex_unlock(&pool.busy);
}

typedef struct {
    cmlp_range_fn fn;
    void *arg;
    int64_t n, grain;
} range_job;

static void range_part(void *a, int part, int nparts) {
    const range_job *r = a;
    /* equal shares, each a multiple of grain (the last takes the rest) */
    int64_t units = (r->n + r->grain - 1) / r->grain;
    int64_t lo = units * part / nparts * r->grain, hi = units * (part + 1) / nparts * r->grain;
    if (hi > r->n) hi = r->n;
    if (lo < hi) r->fn(r->arg, lo, hi);
}

void cmlp_pool_for(int64_t n, int64_t grain, int64_t min_per_thread, cmlp_range_fn fn, void *arg) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    int threads = cmlp_pool_threads();
    int64_t parts = min_per_thread > 0 ? n / min_per_thread : threads;
    if (parts > threads) parts = threads;
    if (parts <= 1) {
        fn(arg, 0, n);
        return;
    }
    range_job r = {fn, arg, n, grain};
    if (pthread_mutex_trylock(&pool.busy) != 0) { /* in use by another caller: run here */
        fn(arg, 0, n);
        return;
    }
    dispatch(range_part, &r, (int)parts);
    pthread_mutex_unlock(&pool.busy);
}
