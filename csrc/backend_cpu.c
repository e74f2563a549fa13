/* backend_cpu.c - the CPU backend, the reference every other backend is tested against:
 * GEMMs through CBLAS (OpenBLAS), everything else as plain loops the compiler vectorises.
 * "Device" memory is aligned host memory. With scipy-openblas32, OpenBLAS runs its threads
 * through cmlp's pool (cpu_pool.c), and the loops over large buffers run on the same threads.
 */
#include "backend_cpu.h"
#include "cpu_pool.h"

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cblas.h>

#ifndef CMLP_BLAS_OPENBLAS
#define CMLP_BLAS_OPENBLAS 0
#endif

#if CMLP_BLAS_SCIPY
#define SGEMM scipy_cblas_sgemm
#define BLAS_CORENAME scipy_openblas_get_corename
#define BLAS_CONFIG scipy_openblas_get_config
#define BLAS_NAME "scipy-openblas32"
#elif CMLP_BLAS_OPENBLAS
#define SGEMM cblas_sgemm
#define BLAS_CORENAME openblas_get_corename
#define BLAS_CONFIG openblas_get_config
#define BLAS_NAME "openblas"
#else
#define SGEMM cblas_sgemm
#define BLAS_NAME "cblas"
#endif

const char *cmlp_blas_info(void) {
    static char info[256];
#ifdef BLAS_CORENAME
    snprintf(info, sizeof info, "%s (%s; kernel %s)", BLAS_NAME, BLAS_CONFIG(), BLAS_CORENAME());
#else
    snprintf(info, sizeof info, "%s", BLAS_NAME);
#endif
    return info;
}

#if CMLP_BLAS_SCIPY
typedef struct {
    openblas_dojob_callback dojob;
    char *data;
    size_t size;
    int arg;
} blas_jobs;

static void blas_part(void *a, int part, int nparts) {
    const blas_jobs *j = a;
    (void)nparts;
    j->dojob(part, j->data + (size_t)part * j->size, j->arg);
}

/* OpenBLAS's parallel regions: one job per thread, run at the same time on the pool. */
static void blas_threads(int sync, openblas_dojob_callback dojob, int numjobs, size_t size, void *data, int arg) {
    (void)sync;
    blas_jobs j = {dojob, data, size, arg};
    cmlp_pool_run(blas_part, &j, numjobs);
}
#endif

static pthread_once_t threads_once = PTHREAD_ONCE_INIT;

#if CMLP_BLAS_SCIPY
/* A forked child keeps only the forking thread: OpenBLAS must not ask for two jobs at once. */
static void blas_after_fork(void) { scipy_openblas_set_num_threads(1); }
#endif

/* fork() runs OpenBLAS's pre-fork handler, which stops its threads and waits for them: with a
 * GEMM of another thread under way it waits for ever (OpenBLAS's own hang, NumPy's matmul in a
 * thread shows it too). GEMMs are read sections of this lock, and a pre-fork handler registered
 * after OpenBLAS's (so run before it) takes it to write: the fork waits for the GEMM in flight,
 * and new ones wait for the fork (writers first, or a loop of GEMMs would keep it waiting). */
static pthread_rwlock_t gemm_fork_lock;

static void gemm_fork_lock_init(void) {
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&gemm_fork_lock, &attr);
    pthread_rwlockattr_destroy(&attr);
}

static void gemm_fork_prepare(void) { pthread_rwlock_wrlock(&gemm_fork_lock); }
static void gemm_fork_parent(void) { pthread_rwlock_unlock(&gemm_fork_lock); }
/* the lock made again: it may record readers that waited in threads the child does not have */
static void gemm_fork_child(void) {
    gemm_fork_lock_init();
#if CMLP_BLAS_SCIPY
    blas_after_fork();
#endif
}

static void threads_init(void) {
    gemm_fork_lock_init();
#if CMLP_BLAS_SCIPY
    scipy_openblas_set_num_threads(cmlp_pool_threads()); /* never more jobs than pool threads */
    scipy_openblas_set_threads_callback_function(blas_threads);
#endif
    pthread_atfork(gemm_fork_prepare, gemm_fork_parent, gemm_fork_child);
}

static int64_t cpu_total_memory(void *ctx) {
    (void)ctx;
    pthread_once(&threads_once, threads_init);
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (int64_t)pages * page : 0;
}

/* One number from a file (a cgroup's memory.max or memory.current); -1 when absent or "max". */
static int64_t file_number(const char *path) {
    FILE *f = fopen(path, "r");
    long long v = -1;
    if (f && fscanf(f, "%lld", &v) != 1) v = -1;
    if (f) fclose(f);
    return (int64_t)v;
}

/* MemAvailable (what can be had without swapping), else the free pages; within a cgroup (v2)
 * memory limit, no more than the limit leaves. */
static int64_t cpu_free_memory(void *ctx) {
    (void)ctx;
    FILE *f = fopen("/proc/meminfo", "r");
    char line[128];
    long long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
    if (f) fclose(f);
    int64_t avail = -1;
    if (kib >= 0) {
        avail = (int64_t)kib * 1024;
    } else {
        long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        if (pages > 0 && page > 0) avail = (int64_t)pages * page;
    }
    int64_t max = file_number("/sys/fs/cgroup/memory.max"), used = file_number("/sys/fs/cgroup/memory.current");
    if (max >= 0 && used >= 0) {
        int64_t room = max > used ? max - used : 0;
        if (avail < 0 || room < avail) avail = room;
    }
    return avail;
}

/* The bytes the CPU's allocator holds (segments and mapped pages). */
static _Atomic int64_t held_bytes;

/* Takes nbytes more for the allocator, or refuses (false) what the machine cannot give: the
 * kernel would grant the address range and end the process as its pages are touched, where a
 * device's allocation fails. So the allocator holds no more than the machine's memory, and no
 * segment more than is available now (read at each segment; the cache serves the rest). */
static bool take_bytes(size_t nbytes) {
    int64_t total = cpu_total_memory(NULL), avail = cpu_free_memory(NULL);
    if (nbytes > (size_t)INT64_MAX / 2 || (avail >= 0 && (int64_t)nbytes > avail)) return false;
    int64_t after = atomic_fetch_add(&held_bytes, (int64_t)nbytes) + (int64_t)nbytes;
    if (total > 0 && after > total) {
        atomic_fetch_sub(&held_bytes, (int64_t)nbytes);
        return false;
    }
    return true;
}

/* Segments of 1 MiB and more are mapped from the kernel and unmapped when freed, so that
 * empty_cache gives their memory back to the system: glibc keeps what is freed to its heap, and
 * after the first large free it raises its mmap threshold, so that later segments would come from
 * the heap. Under AddressSanitizer they come from malloc, which checks their bounds. */
#if defined(__SANITIZE_ADDRESS__)
#define CPU_SEGMENTS_MAPPED 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CPU_SEGMENTS_MAPPED 0
#endif
#endif
#ifndef CPU_SEGMENTS_MAPPED
#define CPU_SEGMENTS_MAPPED 1
#endif
static bool mapped_segment(size_t nbytes) { return CPU_SEGMENTS_MAPPED && nbytes >= ((size_t)1 << 20); }

static cmlp_status cpu_raw_alloc(void *ctx, size_t nbytes, void **out) {
    (void)ctx;
    void *p = NULL;
    if (!take_bytes(nbytes)) return CMLP_ERR_OOM;
    if (mapped_segment(nbytes)) {
        p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) p = NULL;
    } else if (posix_memalign(&p, 64, nbytes) != 0) {
        p = NULL;
    }
    if (!p) {
        atomic_fetch_sub(&held_bytes, (int64_t)nbytes);
        return CMLP_ERR_OOM;
    }
    *out = p;
    return CMLP_OK;
}

static void cpu_raw_free(void *ctx, void *ptr, size_t nbytes) {
    (void)ctx;
    if (mapped_segment(nbytes)) (void)munmap(ptr, nbytes);
    else free(ptr);
    atomic_fetch_sub(&held_bytes, (int64_t)nbytes);
}

/* Expandable segments on the CPU: an address range reserved without access, pages made
 * accessible when mapped and returned to the kernel when unmapped. */
static cmlp_status cpu_vm_reserve(void *ctx, size_t nbytes, void **out) {
    (void)ctx;
    void *p = mmap(NULL, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CMLP_ERR_OOM;
    *out = p;
    return CMLP_OK;
}

static cmlp_status cpu_vm_map(void *ctx, void *ptr, size_t nbytes) {
    (void)ctx;
    if (!take_bytes(nbytes)) return CMLP_ERR_OOM;
    if (mprotect(ptr, nbytes, PROT_READ | PROT_WRITE) == 0) return CMLP_OK;
    atomic_fetch_sub(&held_bytes, (int64_t)nbytes);
    return CMLP_ERR_OOM;
}

static void cpu_vm_unmap(void *ctx, void *ptr, size_t nbytes) {
    (void)ctx;
    (void)madvise(ptr, nbytes, MADV_DONTNEED);
    (void)mprotect(ptr, nbytes, PROT_NONE);
    atomic_fetch_sub(&held_bytes, (int64_t)nbytes);
}

static void cpu_vm_release(void *ctx, void *ptr, size_t nbytes) {
    (void)ctx;
    (void)munmap(ptr, nbytes);
}

static cmlp_status cpu_copy(void *ctx, void *dst, const void *src, size_t nbytes) {
    (void)ctx;
    if (nbytes) memmove(dst, src, nbytes);
    return CMLP_OK;
}

static void zero_range(void *a, int64_t lo, int64_t hi) { memset((char *)a + lo, 0, (size_t)(hi - lo)); }

cmlp_status cpu_fill_zero(void *ctx, void *dst, size_t nbytes) {
    (void)ctx;
    cmlp_pool_for((int64_t)nbytes, 64, 4 * MIN_PER_THREAD, zero_range, dst);
    return CMLP_OK;
}

static cmlp_status cpu_fill_byte(void *ctx, void *dst, int byte, size_t nbytes) {
    (void)ctx;
    memset(dst, byte, nbytes); /* optimizer state, once */
    return CMLP_OK;
}

static cmlp_status cpu_gemm(void *ctx, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                            const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                            float *c, int64_t ldc) {
    (void)ctx;
    pthread_once(&threads_once, threads_init);
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX || ldc > INT_MAX)
        return CMLP_FAIL(CMLP_ERR_INVALID, "GEMM of %lld x %lld x %lld exceeds the BLAS's 32-bit sizes",
                         (long long)m, (long long)n, (long long)k);
    if (m == 0 || n == 0) return CMLP_OK;
    pthread_rwlock_rdlock(&gemm_fork_lock);
    SGEMM(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n,
          (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
    pthread_rwlock_unlock(&gemm_fork_lock);
    return CMLP_OK;
}

static cmlp_status cpu_synchronize(void *ctx) {
    (void)ctx;
    return CMLP_OK;
}

const cmlp_backend_i cmlp_backend_cpu = {
    .name = "cpu",
    .host_memory = true,
    .beta_zero_pass = true, /* OpenBLAS's */
    .open = NULL,
    .total_memory = cpu_total_memory,
    .free_memory = cpu_free_memory,
    .raw_alloc = cpu_raw_alloc,
    .raw_free = cpu_raw_free,
    .vm_reserve = cpu_vm_reserve,
    .vm_map = cpu_vm_map,
    .vm_unmap = cpu_vm_unmap,
    .vm_release = cpu_vm_release,
    .copy_h2d = cpu_copy,
    .copy_d2h = cpu_copy,
    .copy_d2d = cpu_copy,
    .fill_zero = cpu_fill_zero,
    .fill_byte = cpu_fill_byte,
    .gemm = cpu_gemm,
    .bias_act = cpu_bias_act,
    .relu_backward = cpu_relu_backward,
    .relu_backward_bias_grad = cpu_relu_backward_bias_grad,
    .bias_grad = cpu_bias_grad,
    .softmax_xent = cpu_softmax_xent,
    .stage_rows = cpu_stage_rows,
    .stage_labels = cpu_stage_labels,
    .gather_rows = cpu_gather_rows,
    .gather_rows_half = cpu_gather_rows_half,
    .gather_labels = cpu_gather_labels,
    .adam = cpu_adam,
    .sgd = cpu_sgd,
    .to_half = cpu_to_half,
    .from_half = cpu_from_half,
    .optim_prepare = cpu_optim_prepare,
    .unscale = cpu_unscale,
    .grad_norm = cpu_grad_norm,
    .clip_by_norm = cpu_clip_by_norm,
    .clip_by_value = cpu_clip_by_value,
    .synchronize = cpu_synchronize,
};
