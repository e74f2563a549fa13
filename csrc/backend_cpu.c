/* backend_cpu.c - the CPU backend, the reference every other backend is tested against:
 * GEMMs through CBLAS (OpenBLAS), everything else as plain loops the compiler vectorises.
 * "Device" memory is aligned host memory. With scipy-openblas32, OpenBLAS runs its threads
 * through cmlp's pool (cpu_pool.c), and the loops over large buffers run on the same threads.
 */
#include "half.h"
#include "cpu_pool.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cblas.h>

#ifndef CMLP_BLAS_SCIPY
#define CMLP_BLAS_SCIPY 0
#endif
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

#if CMLP_BLAS_SCIPY
#define MIN_PER_THREAD ((int64_t)1 << 15) /* elements below which a loop stays on one thread */
#else
/* a BLAS with threads of its own: a second pool beside them would fight them for the cores */
#define MIN_PER_THREAD INT64_MAX
#endif

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

static cmlp_status cpu_raw_alloc(void *ctx, size_t nbytes, void **out) {
    (void)ctx;
    void *p = NULL;
    if (posix_memalign(&p, 64, nbytes) != 0) return CMLP_ERR_OOM;
    *out = p;
    return CMLP_OK;
}

static void cpu_raw_free(void *ctx, void *ptr, size_t nbytes) {
    (void)ctx;
    (void)nbytes;
    free(ptr);
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
    return mprotect(ptr, nbytes, PROT_READ | PROT_WRITE) == 0 ? CMLP_OK : CMLP_ERR_OOM;
}

static void cpu_vm_unmap(void *ctx, void *ptr, size_t nbytes) {
    (void)ctx;
    (void)madvise(ptr, nbytes, MADV_DONTNEED);
    (void)mprotect(ptr, nbytes, PROT_NONE);
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

static cmlp_status cpu_fill_zero(void *ctx, void *dst, size_t nbytes) {
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

typedef struct {
    float *y, *out; /* out: where a masked gradient goes (the gradient itself, or h) */
    const float *mdy; /* the gradient to mask */
    const float *bias, *h, *dy;
    int64_t rows, cols;
    int relu, overwrite;
} rows_args;

static void bias_act_rows(void *a, int64_t lo, int64_t hi) {
    const rows_args *r = a;
    const float *restrict bias = r->bias;
    for (int64_t i = lo; i < hi; i++) {
        float *restrict row = r->y + i * r->cols;
        if (r->relu)
            for (int64_t c = 0; c < r->cols; c++) { /* torch's ReLU: a NaN stays NaN, -0 becomes 0 */
                float v = row[c] + bias[c];
                row[c] = !(v <= 0.0f) ? v : 0.0f;
            }
        else
            for (int64_t c = 0; c < r->cols; c++) row[c] += bias[c];
    }
}

static cmlp_status cpu_bias_act(void *ctx, float *y, const float *bias, int64_t rows, int64_t cols,
                                int relu) {
    (void)ctx;
    rows_args a = {.y = y, .bias = bias, .cols = cols, .relu = relu};
    cmlp_pool_for(rows, 1, cols > 0 ? MIN_PER_THREAD / cols + 1 : rows, bias_act_rows, &a);
    return CMLP_OK;
}

static void relu_backward_range(void *a, int64_t lo, int64_t hi) {
    const rows_args *r = a;
    float *restrict dy = r->y;
    const float *restrict h = r->h;
    for (int64_t i = lo; i < hi; i++) dy[i] = !(h[i] <= 0.0f) ? dy[i] : 0.0f; /* torch's: passes at a NaN h */
}

static cmlp_status cpu_relu_backward(void *ctx, float *dy, const float *h, int64_t count) {
    (void)ctx;
    rows_args a = {.y = dy, .h = h};
    cmlp_pool_for(count, 16, MIN_PER_THREAD, relu_backward_range, &a);
    return CMLP_OK;
}

/* Columns [lo, hi) of db, each summed over the rows in order: the same sums on any number of
 * threads. With h (the ReLU's output), each row goes through the ReLU's backward first and is
 * written to out: the bits of relu_backward followed by bias_grad, in one pass. out may be the
 * gradient or h (each element is read before it is written, by the same thread). */
static void bias_grad_cols(void *a, int64_t lo, int64_t hi) {
    const rows_args *r = a;
    float *restrict db = r->y;
    if (r->overwrite)
        for (int64_t c = lo; c < hi; c++) db[c] = 0.0f;
    for (int64_t i = 0; i < r->rows; i++) {
        if (!r->h) {
            const float *restrict row = r->dy + i * r->cols;
            for (int64_t c = lo; c < hi; c++) db[c] += row[c];
            continue;
        }
        const float *row = r->mdy + i * r->cols, *h = r->h + i * r->cols;
        float *out = r->out + i * r->cols;
        for (int64_t c = lo; c < hi; c++) {
            float v = !(h[c] <= 0.0f) ? row[c] : 0.0f;
            out[c] = v;
            db[c] += v;
        }
    }
}

static void bias_grad_run(rows_args *a) {
    cmlp_pool_for(a->cols, 16, a->rows > 0 ? MIN_PER_THREAD / a->rows + 1 : a->cols, bias_grad_cols, a);
}

static cmlp_status cpu_bias_grad(void *ctx, float *db, const float *dy, int64_t rows, int64_t cols, int overwrite) {
    (void)ctx;
    rows_args a = {.y = db, .dy = dy, .rows = rows, .cols = cols, .overwrite = overwrite};
    bias_grad_run(&a);
    return CMLP_OK;
}

static cmlp_status cpu_relu_backward_bias_grad(void *ctx, void *dy, const void *h, void *out, cmlp_dtype dtype,
                                               float *db, int64_t rows, int64_t cols, int overwrite) {
    (void)ctx;
    if (dtype != CMLP_DTYPE_F32)
        return CMLP_FAIL(CMLP_ERR_INVALID, "the CPU backend keeps no gradients in half precision");
    if (out != dy && out != h) return CMLP_FAIL(CMLP_ERR_INVALID, "the masked gradient goes to dy or h");
    rows_args a = {.y = db, .out = out, .mdy = dy, .h = h, .rows = rows, .cols = cols, .overwrite = overwrite};
    bias_grad_run(&a);
    return CMLP_OK;
}

static cmlp_status cpu_softmax_xent(void *ctx, const float *logits, const int32_t *labels, int64_t rows,
                                    int64_t cols, float smoothing, cmlp_loss_weight w, float *dlogits,
                                    double *loss_sum, int64_t *correct) {
    (void)ctx;
    const float grad_weight = w.d_scale ? (float)((double)*w.d_scale / w.count) : w.value;
    if (w.d_found_inf) *w.d_found_inf = 0.0f;
    double total = 0.0;
    int64_t hits = 0;
    const float off = smoothing / (float)cols, on = 1.0f - smoothing + off;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * cols;
        int32_t y = labels[r];
        float mx = x[0];
        int64_t arg = 0;
        for (int64_t c = 1; c < cols; c++)
            if (x[c] > mx) {
                mx = x[c];
                arg = c;
            }
        double sum = 0.0, xsum = 0.0;
        for (int64_t c = 0; c < cols; c++) {
            sum += exp((double)x[c] - mx);
            xsum += x[c];
        }
        double lse = mx + log(sum);
        /* -sum_c q_c log p_c with q = (1 - e) onehot + e / C */
        /* a label outside [0, cols) (checked before, but the caller's array may change while the
         * GIL is released) reads nothing outside the row: no one-hot, as on the GPU */
        const float xy = y >= 0 && y < cols ? x[y] : 0.0f;
        total += lse - (1.0 - smoothing) * xy - (double)smoothing / (double)cols * xsum;
        hits += arg == y;
        if (dlogits) {
            float *d = dlogits + r * cols;
            float inv = (float)(1.0 / sum);
            for (int64_t c = 0; c < cols; c++) {
                float p = expf(x[c] - mx) * inv;
                d[c] = grad_weight * (p - (c == y ? on : off));
            }
        }
    }
    if (loss_sum) *loss_sum += total;
    if (correct) *correct += hits;
    return CMLP_OK;
}

typedef struct {
    float *dst;
    const void *src;
    cmlp_dtype dtype;
    int64_t cols, start;
    const int64_t *idx;
    float scale, shift;
    uint16_t *hdst; /* when set, rows go here in half storage of type half instead */
    cmlp_dtype half;
    int32_t *ldst; /* when set, the rows' labels too, from lsrc */
    const int32_t *lsrc;
} stage_args;

/* Source row s into half storage, through a float block at a time. */
static void stage_row_half(const stage_args *g, int64_t s, uint16_t *d) {
    float buf[256];
    for (int64_t c0 = 0; c0 < g->cols; c0 += 256) {
        int64_t k = g->cols - c0 < 256 ? g->cols - c0 : 256;
        if (g->dtype == CMLP_DTYPE_U8) {
            const uint8_t *u = (const uint8_t *)g->src + s * g->cols + c0;
            for (int64_t c = 0; c < k; c++) buf[c] = (float)u[c] * g->scale + g->shift;
        } else {
            memcpy(buf, (const float *)g->src + s * g->cols + c0, (size_t)k * sizeof(float));
        }
        if (g->half == CMLP_DTYPE_BF16) cmlp_f32_to_bf16(d + c0, buf, k);
        else cmlp_f32_to_f16(d + c0, buf, k);
    }
}

static void stage_range(void *a, int64_t lo, int64_t hi) {
    const stage_args *g = a;
    for (int64_t r = lo; r < hi; r++) {
        int64_t s = g->idx ? g->idx[r] : g->start + r;
        if (g->ldst) g->ldst[r] = g->lsrc[s];
        if (g->hdst) {
            stage_row_half(g, s, g->hdst + r * g->cols);
            continue;
        }
        float *restrict d = g->dst + r * g->cols;
        if (g->dtype == CMLP_DTYPE_U8) {
            const uint8_t *restrict u = (const uint8_t *)g->src + s * g->cols;
            for (int64_t c = 0; c < g->cols; c++) d[c] = (float)u[c] * g->scale + g->shift;
        } else {
            memcpy(d, (const float *)g->src + s * g->cols, (size_t)g->cols * sizeof(float));
        }
    }
}

static cmlp_status cpu_stage_rows(void *ctx, float *dst, const void *src, cmlp_dtype dtype, int64_t cols,
                                  const int64_t *idx, int64_t start, int64_t rows, float scale,
                                  float shift) {
    (void)ctx;
    stage_args a = {dst, src, dtype, cols, start, idx, scale, shift, NULL, CMLP_DTYPE_F32, NULL, NULL};
    cmlp_pool_for(rows, 1, cols > 0 ? MIN_PER_THREAD / cols + 1 : rows, stage_range, &a);
    return CMLP_OK;
}

static cmlp_status cpu_stage_labels(void *ctx, int32_t *dst, const int32_t *src, const int64_t *idx,
                                    int64_t start, int64_t rows) {
    (void)ctx;
    for (int64_t r = 0; r < rows; r++) dst[r] = src[idx ? idx[r] : start + r];
    return CMLP_OK;
}

/* Device memory is host memory: gathering is staging, moved by the position. */
static cmlp_status cpu_gather_rows(void *ctx, float *dst, const void *src, cmlp_dtype dtype, int64_t cols,
                                   const int64_t *idx, int64_t start, const int64_t *pos, int64_t rows, float scale,
                                   float shift, int32_t *ldst, const int32_t *lsrc) {
    (void)ctx;
    if (pos) {
        if (idx) idx += *pos;
        else start += *pos;
    }
    stage_args a = {dst, src, dtype, cols, start, idx, scale, shift, NULL, CMLP_DTYPE_F32, ldst, lsrc};
    cmlp_pool_for(rows, 1, cols > 0 ? MIN_PER_THREAD / cols + 1 : rows, stage_range, &a);
    return CMLP_OK;
}

static cmlp_status cpu_gather_rows_half(void *ctx, uint16_t *dst, cmlp_dtype half, const void *src, cmlp_dtype dtype,
                                        int64_t cols, const int64_t *idx, int64_t start, const int64_t *pos,
                                        int64_t rows, float scale, float shift, int32_t *ldst, const int32_t *lsrc) {
    (void)ctx;
    if (pos) {
        if (idx) idx += *pos;
        else start += *pos;
    }
    stage_args a = {NULL, src, dtype, cols, start, idx, scale, shift, dst, half, ldst, lsrc};
    cmlp_pool_for(rows, 1, cols > 0 ? MIN_PER_THREAD / cols + 1 : rows, stage_range, &a);
    return CMLP_OK;
}

static cmlp_status cpu_gather_labels(void *ctx, int32_t *dst, const int32_t *src, const int64_t *idx, int64_t start,
                                     const int64_t *pos, int64_t rows) {
    if (pos) {
        if (idx) idx += *pos;
        else start += *pos;
    }
    return cpu_stage_labels(ctx, dst, src, idx, start, rows);
}

typedef struct {
    float *p, *m, *v, *vmax, *buf;
    const float *g;
    float step_size, beta1, beta2, one_b1, one_b2, bc2_sqrt, eps, wd, decay, lr, momentum, keep;
    int nesterov, maximize;
} optim_args;

/* torch.maximum of two floats: a NaN in either gives a NaN */
static inline float max_nan(float a, float b) { return b > a || b != b ? b : a; }

static void adam_range(void *arg, int64_t lo, int64_t hi) {
    const optim_args *a = arg;
    float *restrict p = a->p, *restrict m = a->m, *restrict v = a->v, *restrict vmax = a->vmax;
    const float *restrict g = a->g;
    const float beta1 = a->beta1, beta2 = a->beta2, one_b1 = a->one_b1, one_b2 = a->one_b2;
    const float step_size = a->step_size, bc2_sqrt = a->bc2_sqrt, eps = a->eps, wd = a->wd, decay = a->decay;
    const bool decoupled = decay != 1.0f, maximize = a->maximize;
    for (int64_t i = lo; i < hi; i++) {
        const float pi = decoupled ? p[i] * decay : p[i];
        float gi = (maximize ? -g[i] : g[i]) + wd * pi;
        float mi = beta1 * m[i] + one_b1 * gi;
        float vi = beta2 * v[i] + one_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        if (vmax) vi = vmax[i] = max_nan(vmax[i], vi); /* AMSGrad */
        p[i] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}

static cmlp_status cpu_adam(void *ctx, float *restrict p, const float *restrict g, float *restrict m,
                            float *restrict v, float *restrict vmax, int64_t n, float step_size, float beta1,
                            float beta2, float one_b1, float one_b2, float bc2_sqrt, float eps, float wd, float decay,
                            int maximize, const float *found_inf, const float *coef) {
    (void)ctx;
    if (found_inf && *found_inf != 0.0f) return CMLP_OK;
    if (coef) {
        step_size = coef[0];
        bc2_sqrt = coef[1];
        decay = coef[2];
        beta1 = coef[3];
        one_b1 = coef[4];
    }
    optim_args a = {.p = p, .m = m, .v = v, .vmax = vmax, .g = g, .step_size = step_size, .beta1 = beta1,
                    .beta2 = beta2, .one_b1 = one_b1, .one_b2 = one_b2, .bc2_sqrt = bc2_sqrt, .eps = eps, .wd = wd,
                    .decay = decay, .maximize = maximize};
    cmlp_pool_for(n, 16, MIN_PER_THREAD, adam_range, &a);
    return CMLP_OK;
}

static void sgd_range(void *arg, int64_t lo, int64_t hi) {
    const optim_args *a = arg;
    float *restrict p = a->p, *restrict buf = a->buf;
    const float *restrict g = a->g;
    const float lr = a->lr, wd = a->wd, momentum = a->momentum;
    const bool maximize = a->maximize;
    if (momentum == 0.0f) {
        for (int64_t i = lo; i < hi; i++) p[i] -= lr * ((maximize ? -g[i] : g[i]) + wd * p[i]);
        return;
    }
    const float keep = a->keep;
    for (int64_t i = lo; i < hi; i++) {
        float gi = (maximize ? -g[i] : g[i]) + wd * p[i];
        float b = isnan(buf[i]) ? gi : momentum * buf[i] + keep * gi; /* NaN: not started */
        buf[i] = b;
        p[i] -= lr * (a->nesterov ? gi + momentum * b : b);
    }
}

static cmlp_status cpu_sgd(void *ctx, float *restrict p, const float *restrict g, float *restrict buf,
                           int64_t n, float lr, float momentum, float keep, int nesterov, float wd, int maximize,
                           const float *found_inf, const float *coef) {
    (void)ctx;
    if (found_inf && *found_inf != 0.0f) return CMLP_OK;
    if (coef) {
        lr = coef[0];
        momentum = coef[1];
    }
    if (momentum != 0.0f && !buf) return CMLP_FAIL(CMLP_ERR_INTERNAL, "SGD with momentum has no momentum buffer");
    optim_args a = {.p = p, .buf = buf, .g = g, .lr = lr, .momentum = momentum, .keep = keep, .wd = wd,
                    .nesterov = nesterov, .maximize = maximize};
    cmlp_pool_for(n, 16, MIN_PER_THREAD, sgd_range, &a);
    return CMLP_OK;
}

typedef struct {
    uint16_t *h;
    float *f;
    const uint16_t *ch;
    const float *cf;
    int bf16;
} cast_args;

static void to_half_range(void *arg, int64_t lo, int64_t hi) {
    const cast_args *a = arg;
    if (a->bf16) cmlp_f32_to_bf16(a->h + lo, a->cf + lo, hi - lo);
    else cmlp_f32_to_f16(a->h + lo, a->cf + lo, hi - lo);
}

static void from_half_range(void *arg, int64_t lo, int64_t hi) {
    const cast_args *a = arg;
    if (a->bf16) cmlp_bf16_to_f32(a->f + lo, a->ch + lo, hi - lo);
    else cmlp_f16_to_f32(a->f + lo, a->ch + lo, hi - lo);
}

/* Called inside the core's floating-point environment (the pool's threads take it over). */
static cmlp_status cpu_to_half(void *ctx, uint16_t *dst, const float *src, int64_t n, cmlp_dtype dtype) {
    (void)ctx;
    cast_args a = {.h = dst, .cf = src, .bf16 = dtype == CMLP_DTYPE_BF16};
    cmlp_pool_for(n, 32, MIN_PER_THREAD, to_half_range, &a);
    return CMLP_OK;
}

static cmlp_status cpu_from_half(void *ctx, float *dst, const uint16_t *src, int64_t n, cmlp_dtype dtype) {
    (void)ctx;
    cast_args a = {.f = dst, .ch = src, .bf16 = dtype == CMLP_DTYPE_BF16};
    cmlp_pool_for(n, 32, MIN_PER_THREAD, from_half_range, &a);
    return CMLP_OK;
}

/* PyTorch's loss-scale update (torch's _amp_update_scale_), products in double. */
static void scale_update(float *scale, int32_t *tracker, const float *found_inf, double growth, double backoff,
                         int32_t interval, int64_t *skipped) {
    if (found_inf && *found_inf != 0.0f) {
        *scale = (float)((double)*scale * backoff);
        *tracker = 0;
        if (skipped) ++*skipped;
        return;
    }
    if (++*tracker == interval) {
        float grown = (float)((double)*scale * growth);
        if (isfinite(grown)) *scale = grown;
        *tracker = 0;
    }
}

/* A step's coefficients (optim_prepare's d_coef) at rate lr, in double, each rounded to float. */
static void step_coef(int64_t t, double lr, double momentum, double beta2, double decoupled_wd, int adam,
                      float *coef) {
    if (adam) {
        double bc1 = 1.0 - pow(momentum, (double)t), bc2 = 1.0 - pow(beta2, (double)t);
        coef[0] = (float)(lr / bc1);
        coef[1] = (float)sqrt(bc2);
        coef[2] = decoupled_wd != 0.0 ? (float)(1.0 - lr * decoupled_wd) : 1.0f;
        coef[3] = (float)momentum;
        coef[4] = (float)(1.0 - momentum);
    } else {
        coef[0] = (float)lr;
        coef[1] = (float)momentum;
    }
}

static cmlp_status cpu_optim_prepare(void *ctx, int64_t *step, float *coef, const float *found_inf,
                                     const cmlp_rate_src *rate, double beta2, int adam, int64_t *pos, int64_t pos_add,
                                     const cmlp_scale_step *scale) {
    (void)ctx;
    if (pos) *pos += pos_add;
    const int64_t k = rate->d_next ? *rate->d_next : 0;
    const double *r = rate->d_rates + 2 * k, lr = r[0], momentum = r[1];
    if (rate->d_next) ++*rate->d_next;
    if (scale)
        scale_update(scale->d_scale, scale->d_tracker, found_inf, scale->growth_factor, scale->backoff_factor,
                     scale->growth_interval, scale->d_skipped);
    if (found_inf && *found_inf != 0.0f) return CMLP_OK;
    int64_t t = ++*step;
    step_coef(t, lr, momentum, beta2, rate->decoupled_wd, adam, coef);
    for (int i = 0; i < rate->nparts; i++) { /* parameter groups: each part at its own rate and decay */
        const double *part = rate->d_parts + CMLP_PART_ARGS * i; /* NaN momentum or beta2: the step's */
        const double *row = rate->d_step_scales ? rate->d_step_scales + 2 * (k * rate->nparts + i) : NULL;
        double mom = isnan(part[2]) ? momentum : part[2];
        if (row && !isnan(row[1])) mom = row[1];
        step_coef(t, lr * (row ? row[0] : part[0]), mom, isnan(part[3]) ? beta2 : part[3], part[1], adam,
                  rate->d_part_coef + 5 * i);
    }
    return CMLP_OK;
}

typedef struct {
    float *g;
    float inv, post; /* g * 1/scale is (g * inv) * post */
    _Atomic unsigned bad;
} unscale_args;

static void unscale_range(void *arg, int64_t lo, int64_t hi) {
    unscale_args *a = arg;
    float *restrict g = a->g;
    const float inv = a->inv, post = a->post;
    uint32_t bad = 0;
    for (int64_t i = lo; i < hi; i++) {
        float v = g[i] * inv * post; /* post 1: exactly g * inv */
        uint32_t bits;
        memcpy(&bits, &v, 4);
        bad |= (bits & 0x7F800000u) == 0x7F800000u; /* exponent all ones: inf or NaN */
        g[i] = v;
    }
    if (bad) atomic_fetch_or(&a->bad, 1u);
}

/* The factor that unscales, torch's (float)(1 / scale), as inv * post. Past a scale of 2^126 it is
 * a subnormal float, which this backend's compute (subnormals flushed, for speed) would read as 0,
 * unscaling every gradient to 0 unseen: it is then taken as a normal float times 2^-64 (its bits
 * moved up by 64 exponents, exactly), and g * inv is rounded once as with the subnormal, unless the
 * product is itself subnormal (flushed, as every subnormal result here). */
static void unscale_factor(float given, const float *scale, float *inv, float *post) {
    *post = 1.0f;
    if (scale) {
        const double r = 1.0 / (double)*scale;
        if (!(r > 0.0 && r < 0x1p-126)) { /* a normal float (or 0, inf, NaN: found by the check) */
            *inv = (float)r;
            return;
        }
        /* rounded to float's subnormal grid (multiples of 2^-149, ties to even), moved up */
        *inv = (float)(nearbyint(r * 0x1p149) * 0x1p-85);
        *post = 0x1p-64f;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &given, 4);
    *inv = given;
    if ((bits & 0x7F800000u) == 0 && (bits & 0x007FFFFFu) != 0) { /* subnormal */
        const float up = (float)(bits & 0x007FFFFFu) * 0x1p-85f; /* exact: an integer < 2^23 times 2^-85 */
        *inv = bits & 0x80000000u ? -up : up;
        *post = 0x1p-64f;
    }
}

static cmlp_status cpu_unscale(void *ctx, float *restrict g, int64_t n, float inv, const float *scale,
                               float *found_inf) {
    (void)ctx;
    unscale_args a = {.g = g};
    unscale_factor(inv, scale, &a.inv, &a.post);
    atomic_init(&a.bad, 0u);
    cmlp_pool_for(n, 16, MIN_PER_THREAD, unscale_range, &a);
    if (atomic_load(&a.bad)) *found_inf = 1.0f;
    return CMLP_OK;
}

/* ---- gradient clipping: the norm in the order backend.h fixes (the CUDA kernels' threads,
 * warps and blocks, replayed) ---- */

enum { NORM_L2 = 0, NORM_L1 = 1, NORM_INF = 2, NORM_P = 3, NORM_MIN = 4 };



typedef struct {
    const float *g;
    int64_t n, threads;
    int kind;
    double p;
    double *acc; /* [threads]: each "thread"'s running value */
} norm_args;

/* |x| in double with a subnormal read as zero (DAZ; a NaN passes), by masks rather than
 * comparisons: with trapping math the compiler vectorises no branch on a float compare. */
static inline double norm_abs(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    b &= 0x7FFFFFFFu;
    b &= -(uint32_t)(b >= 0x00800000u);
    float a;
    memcpy(&a, &b, 4);
    return (double)a;
}

/* The inf-norm's join on values >= 0 or NaN (sign bit clear): their bits order as they do, a NaN
 * above everything, so an integer max is the maximum that keeps a NaN. */
static inline double max_bits(double acc, double d) {
    uint64_t x, y;
    memcpy(&x, &acc, 8);
    memcpy(&y, &d, 8);
    x = y > x ? y : x;
    memcpy(&acc, &x, 8);
    return acc;
}

/* The -inf-norm's join: a minimum that keeps a NaN (the kernels' expression, so a NaN's payload
 * is theirs). */
static inline double min_nan(double acc, double t) { return t < acc || t != t ? t : acc; }

/* a sum, or for the inf-norm a maximum and for the -inf-norm a minimum that keep a NaN */
static inline double norm_join(double acc, double t, int kind) {
    return kind == NORM_INF ? max_bits(acc, t) : kind == NORM_MIN ? min_nan(acc, t) : acc + t;
}

/* The "threads" [lo, hi): thread j joins elements j, j + S, j + 2S, ... in order (the rows of
 * an S-wide matrix), one loop per kind so that each vectorises. */
#define NORM_ROWS(STMT)                                                     \
    for (int64_t row = 0; row < n; row += S) {                              \
        const int64_t end = n - row < hi ? n - row : hi;                    \
        const float *restrict x = g + row;                                  \
        for (int64_t j = lo; j < end; j++) {                                \
            const double d = norm_abs(x[j]);                                \
            STMT;                                                           \
        }                                                                   \
    }

static void norm_threads(void *arg, int64_t lo, int64_t hi) {
    const norm_args *a = arg;
    double *restrict acc = a->acc;
    const float *restrict g = a->g;
    const int64_t n = a->n, S = a->threads;
    const double p = a->p;
    const double start = a->kind == NORM_MIN ? INFINITY : 0.0;
    for (int64_t j = lo; j < hi; j++) acc[j] = start;
    switch (a->kind) {
    case NORM_L2: NORM_ROWS(acc[j] += d * d); break;
    case NORM_L1: NORM_ROWS(acc[j] += d); break;
    case NORM_INF: NORM_ROWS(acc[j] = max_bits(acc[j], d)); break;
    case NORM_MIN: NORM_ROWS(acc[j] = min_nan(acc[j], d)); break;
    default: NORM_ROWS(acc[j] += pow(d, p));
    }
}

static cmlp_status cpu_grad_norm(void *ctx, const float *g, int64_t n, double norm_type, float *out, double *part,
                                 uint32_t *blocks_done) {
    (void)ctx;
    (void)blocks_done;
    if (n <= 0 || norm_type == 0.0 || isnan(norm_type))
        return CMLP_FAIL(CMLP_ERR_INVALID, "grad_norm needs n > 0 and a norm_type other than 0 and NaN, got %lld and %g",
                         (long long)n, norm_type);
    const int kind = norm_type == 2.0         ? NORM_L2
                     : norm_type == 1.0       ? NORM_L1
                     : norm_type == INFINITY  ? NORM_INF
                     : norm_type == -INFINITY ? NORM_MIN
                                              : NORM_P;
    const int64_t blocks = cmlp_norm_blocks(n), threads = blocks * CMLP_NORM_THREADS;
    double *acc = malloc((size_t)threads * sizeof *acc); /* up to 64 KiB: not on a thread's stack */
    if (!acc) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for a gradient norm's %lld partial sums",
                               (long long)threads);
    norm_args a = {g, n, threads, kind, norm_type, acc};
    cmlp_pool_for(threads, 64, MIN_PER_THREAD / 64, norm_threads, &a);
    double s = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        double warps[CMLP_NORM_THREADS / 32];
        for (int w = 0; w < CMLP_NORM_THREADS / 32; w++) {
            /* the butterfly's lane 0: at each stage it needs only the lanes below o (a join is
             * commutative, so lane l's join(v[l], v[l ^ o]) is this one's) */
            double *v = acc + b * CMLP_NORM_THREADS + w * 32;
            for (int o = 16; o > 0; o >>= 1)
                for (int l = 0; l < o; l++) v[l] = norm_join(v[l], v[l + o], kind);
            warps[w] = v[0];
        }
        double blk = warps[0];
        for (int w = 1; w < CMLP_NORM_THREADS / 32; w++) blk = norm_join(blk, warps[w], kind);
        part[b] = blk;
        s = b == 0 ? blk : norm_join(s, blk, kind);
    }
    free(acc);
    if (kind == NORM_L2) s = sqrt(s);
    else if (kind == NORM_P) s = pow(s, 1.0 / norm_type);
    float f = (float)s;
    if (fabsf(f) < FLT_MIN) f = 0.0f; /* FTZ */
    *out = f;
    return CMLP_OK;
}

typedef struct {
    float *g;
    float x; /* the factor (scaling) or the bound (clamping) */
} grads_args;

static void scale_range(void *arg, int64_t lo, int64_t hi) {
    const grads_args *a = arg;
    float *restrict g = a->g;
    const float c = a->x;
    for (int64_t i = lo; i < hi; i++) g[i] *= c;
}

/* g * (c * 2^-64) for a subnormal factor c * 2^-64 given as c: the product rounded once, as
 * float arithmetic with subnormals gives it (flushed where it is itself subnormal) */
static void scale_tiny_range(void *arg, int64_t lo, int64_t hi) {
    const grads_args *a = arg;
    float *restrict g = a->g;
    const float c = a->x;
    for (int64_t i = lo; i < hi; i++) g[i] = g[i] * c * 0x1p-64f;
}

/* x rounded to float with subnormals kept (the value held in a double) */
static double f32_subnormal(double x) {
    return x < (double)FLT_MIN ? nearbyint(x * 0x1p149) * 0x1p-149 : (double)(float)x;
}

static cmlp_status cpu_clip_by_norm(void *ctx, float *g, int64_t n, const float *norm, float max_norm,
                                    double *norm_sum, int64_t *norm_steps) {
    (void)ctx;
    const float total = *norm;
    if (norm_sum && isfinite(total)) {
        *norm_sum += (double)total;
        ++*norm_steps;
    }
    /* torch's rounding: a reciprocal, then the product, each rounded to float with subnormals
     * (torch's arithmetic keeps them; a norm above 2^126 has a subnormal reciprocal) */
    const double r = f32_subnormal(1.0 / (double)(total + 1e-6f));
    const double c = f32_subnormal(r * (double)max_norm);
    if (c >= 1.0) return CMLP_OK; /* a NaN goes on */
    const bool tiny = c > 0.0 && c < (double)FLT_MIN;
    grads_args a = {g, tiny ? (float)(c * 0x1p64) : (float)c};
    cmlp_pool_for(n, 16, MIN_PER_THREAD, tiny ? scale_tiny_range : scale_range, &a);
    return CMLP_OK;
}

static void clamp_range(void *arg, int64_t lo, int64_t hi) {
    const grads_args *a = arg;
    float *restrict g = a->g;
    const float v = a->x;
    for (int64_t i = lo; i < hi; i++) g[i] = g[i] > v ? v : -v > g[i] ? -v : g[i];
}

static cmlp_status cpu_clip_by_value(void *ctx, float *g, int64_t n, float v) {
    (void)ctx;
    grads_args a = {g, v};
    cmlp_pool_for(n, 16, MIN_PER_THREAD, clamp_range, &a);
    return CMLP_OK;
}

static cmlp_status cpu_synchronize(void *ctx) {
    (void)ctx;
    return CMLP_OK;
}

const cmlp_backend_i cmlp_backend_cpu = {
    .name = "cpu",
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
