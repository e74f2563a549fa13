/* backend_cpu.c - the CPU backend, the reference every other backend is tested against:
 * GEMMs through CBLAS (OpenBLAS), everything else as plain loops the compiler vectorises.
 * "Device" memory is aligned host memory.
 */
#include "half.h"

#include <limits.h>
#include <math.h>
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

static int64_t cpu_total_memory(void *ctx) {
    (void)ctx;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (int64_t)pages * page : 0;
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

static cmlp_status cpu_fill_zero(void *ctx, void *dst, size_t nbytes) {
    (void)ctx;
    if (nbytes) memset(dst, 0, nbytes);
    return CMLP_OK;
}

static cmlp_status cpu_gemm(void *ctx, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                            const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                            float *c, int64_t ldc) {
    (void)ctx;
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX || ldc > INT_MAX)
        return CMLP_FAIL(CMLP_ERR_INVALID, "GEMM of %lld x %lld x %lld exceeds the BLAS's 32-bit sizes",
                         (long long)m, (long long)n, (long long)k);
    if (m == 0 || n == 0) return CMLP_OK;
    SGEMM(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n,
          (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
    return CMLP_OK;
}

static cmlp_status cpu_bias_act(void *ctx, float *y, const float *bias, int64_t rows, int64_t cols,
                                int relu) {
    (void)ctx;
    for (int64_t r = 0; r < rows; r++) {
        float *restrict row = y + r * cols;
        if (relu)
            for (int64_t c = 0; c < cols; c++) {
                float v = row[c] + bias[c];
                row[c] = v > 0.0f ? v : 0.0f;
            }
        else
            for (int64_t c = 0; c < cols; c++) row[c] += bias[c];
    }
    return CMLP_OK;
}

static cmlp_status cpu_relu_backward(void *ctx, float *dy, const float *h, int64_t count) {
    (void)ctx;
    for (int64_t i = 0; i < count; i++) dy[i] = h[i] > 0.0f ? dy[i] : 0.0f;
    return CMLP_OK;
}

static cmlp_status cpu_bias_grad(void *ctx, float *db, const float *dy, int64_t rows, int64_t cols) {
    (void)ctx;
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict row = dy + r * cols;
        for (int64_t c = 0; c < cols; c++) db[c] += row[c];
    }
    return CMLP_OK;
}

static cmlp_status cpu_softmax_xent(void *ctx, const float *logits, const int32_t *labels, int64_t rows,
                                    int64_t cols, float smoothing, float grad_weight, const float *grad_weight_p,
                                    float *dlogits, double *loss_sum, int64_t *correct) {
    (void)ctx;
    if (grad_weight_p) grad_weight = *grad_weight_p;
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
        total += lse - (1.0 - smoothing) * x[y] - (double)smoothing / (double)cols * xsum;
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

static cmlp_status cpu_stage_rows(void *ctx, float *dst, const void *src, cmlp_dtype dtype, int64_t cols,
                                  const int64_t *idx, int64_t start, int64_t rows, float scale,
                                  float shift) {
    (void)ctx;
    for (int64_t r = 0; r < rows; r++) {
        int64_t s = idx ? idx[r] : start + r;
        float *restrict d = dst + r * cols;
        if (dtype == CMLP_DTYPE_U8) {
            const uint8_t *restrict u = (const uint8_t *)src + s * cols;
            for (int64_t c = 0; c < cols; c++) d[c] = (float)u[c] * scale + shift;
        } else {
            memcpy(d, (const float *)src + s * cols, (size_t)cols * sizeof(float));
        }
    }
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
                                   float shift) {
    if (pos) {
        if (idx) idx += *pos;
        else start += *pos;
    }
    return cpu_stage_rows(ctx, dst, src, dtype, cols, idx, start, rows, scale, shift);
}

static cmlp_status cpu_gather_labels(void *ctx, int32_t *dst, const int32_t *src, const int64_t *idx, int64_t start,
                                     const int64_t *pos, int64_t rows) {
    if (pos) {
        if (idx) idx += *pos;
        else start += *pos;
    }
    return cpu_stage_labels(ctx, dst, src, idx, start, rows);
}

static cmlp_status cpu_add_i64(void *ctx, int64_t *x, int64_t v) {
    (void)ctx;
    *x += v;
    return CMLP_OK;
}

static cmlp_status cpu_adam(void *ctx, float *restrict p, const float *restrict g, float *restrict m,
                            float *restrict v, int64_t n, float step_size, float beta1, float beta2,
                            float bc2_sqrt, float eps, float wd, const float *found_inf, const float *coef) {
    (void)ctx;
    if (found_inf && *found_inf != 0.0f) return CMLP_OK;
    if (coef) {
        step_size = coef[0];
        bc2_sqrt = coef[1];
    }
    const float one_b1 = 1.0f - beta1, one_b2 = 1.0f - beta2;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i] + wd * p[i];
        float mi = beta1 * m[i] + one_b1 * gi;
        float vi = beta2 * v[i] + one_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] -= step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
    return CMLP_OK;
}

static cmlp_status cpu_sgd(void *ctx, float *restrict p, const float *restrict g, float *restrict buf,
                           int64_t n, float lr, float momentum, float dampening, int nesterov, float wd,
                           int first, const float *found_inf, const int64_t *step) {
    (void)ctx;
    if (found_inf && *found_inf != 0.0f) return CMLP_OK;
    if (step && *step == 1) first = 1;
    if (momentum == 0.0f) {
        for (int64_t i = 0; i < n; i++) p[i] -= lr * (g[i] + wd * p[i]);
        return CMLP_OK;
    }
    const float keep = 1.0f - dampening;
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i] + wd * p[i];
        float b = first ? gi : momentum * buf[i] + keep * gi;
        buf[i] = b;
        p[i] -= lr * (nesterov ? gi + momentum * b : b);
    }
    return CMLP_OK;
}

/* Called inside the core's floating-point environment: the loops directly. */
static cmlp_status cpu_to_half(void *ctx, uint16_t *dst, const float *src, int64_t n, cmlp_dtype dtype) {
    (void)ctx;
    if (dtype == CMLP_DTYPE_F16) cmlp_f32_to_f16(dst, src, n);
    else cmlp_f32_to_bf16(dst, src, n);
    return CMLP_OK;
}

static cmlp_status cpu_from_half(void *ctx, float *dst, const uint16_t *src, int64_t n, cmlp_dtype dtype) {
    (void)ctx;
    if (dtype == CMLP_DTYPE_F16) cmlp_f16_to_f32(dst, src, n);
    else cmlp_bf16_to_f32(dst, src, n);
    return CMLP_OK;
}

static cmlp_status cpu_optim_prepare(void *ctx, int64_t *step, float *coef, const float *found_inf, double lr,
                                     double beta1, double beta2, int adam) {
    (void)ctx;
    if (found_inf && *found_inf != 0.0f) return CMLP_OK;
    int64_t t = ++*step;
    if (adam) {
        double bc1 = 1.0 - pow(beta1, (double)t), bc2 = 1.0 - pow(beta2, (double)t);
        coef[0] = (float)(lr / bc1);
        coef[1] = (float)sqrt(bc2);
    }
    return CMLP_OK;
}

static cmlp_status cpu_scale_update(void *ctx, float *scale, int32_t *tracker, const float *found_inf, double growth,
                                    double backoff, int32_t interval, int64_t *skipped) {
    (void)ctx;
    if (found_inf && *found_inf != 0.0f) {
        *scale = (float)((double)*scale * backoff);
        *tracker = 0;
        if (skipped) ++*skipped;
        return CMLP_OK;
    }
    if (++*tracker == interval) {
        float grown = (float)((double)*scale * growth);
        if (isfinite(grown)) *scale = grown;
        *tracker = 0;
    }
    return CMLP_OK;
}

static cmlp_status cpu_grad_weight(void *ctx, float *w, const float *scale, double count) {
    (void)ctx;
    *w = (float)((double)*scale / count);
    return CMLP_OK;
}

static cmlp_status cpu_unscale(void *ctx, float *restrict g, int64_t n, float inv, const float *scale,
                               float *found_inf) {
    (void)ctx;
    if (scale) inv = (float)(1.0 / (double)*scale);
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = g[i] * inv;
        uint32_t bits;
        memcpy(&bits, &v, 4);
        bad |= (bits & 0x7F800000u) == 0x7F800000u; /* exponent all ones: inf or NaN */
        g[i] = v;
    }
    if (bad) *found_inf = 1.0f;
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
    .gemm = cpu_gemm,
    .bias_act = cpu_bias_act,
    .relu_backward = cpu_relu_backward,
    .bias_grad = cpu_bias_grad,
    .softmax_xent = cpu_softmax_xent,
    .stage_rows = cpu_stage_rows,
    .stage_labels = cpu_stage_labels,
    .gather_rows = cpu_gather_rows,
    .gather_labels = cpu_gather_labels,
    .add_i64 = cpu_add_i64,
    .adam = cpu_adam,
    .sgd = cpu_sgd,
    .to_half = cpu_to_half,
    .from_half = cpu_from_half,
    .optim_prepare = cpu_optim_prepare,
    .unscale = cpu_unscale,
    .scale_update = cpu_scale_update,
    .grad_weight = cpu_grad_weight,
    .synchronize = cpu_synchronize,
};
