/* backend_cpu_optim.c - the CPU backend's optimizer steps (Adam, SGD), half-precision casts,
 * loss-scale unscaling and update, and gradient clipping (the norm summed in the order backend.h
 * fixes, the CUDA kernels' order).
 */
#include "backend_cpu.h"
#include "cpu_pool.h"
#include "half.h"

#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float *p, *m, *v, *vmax, *buf;
    float *g;
    float step_size, beta1, beta2, one_b1, one_b2, bc2_sqrt, eps, wd, decay, lr, momentum, keep;
    int nesterov, maximize, zero_g;
} optim_args;

/* Elements of a block an update finishes before it zeroes the block's gradients (zero_g): 8 KiB
 * of them, still in the first-level cache when they are written over. */
#define ZERO_BLOCK 2048

/* range(a, lo, hi) over [lo, hi), in blocks whose gradients are zeroed after it with zero_g */
static void blocks_zeroed(const optim_args *a, int64_t lo, int64_t hi,
                          void (*range)(const optim_args *, int64_t, int64_t)) {
    if (!a->zero_g) {
        range(a, lo, hi);
        return;
    }
    for (int64_t b = lo; b < hi; b += ZERO_BLOCK) {
        int64_t e = hi - b < ZERO_BLOCK ? hi : b + ZERO_BLOCK;
        range(a, b, e);
        memset(a->g + b, 0, (size_t)(e - b) * sizeof(float));
    }
}

/* torch.maximum of two floats: a NaN in either gives a NaN */
static inline float max_nan(float a, float b) { return b > a || b != b ? b : a; }

static void adam_block(const optim_args *a, int64_t lo, int64_t hi) {
    float *restrict p = a->p, *restrict m = a->m, *restrict v = a->v, *restrict vmax = a->vmax;
    const float *restrict g = a->g;
    const float beta1 = a->beta1, beta2 = a->beta2, one_b1 = a->one_b1, one_b2 = a->one_b2;
    const float step_size = a->step_size, bc2_sqrt = a->bc2_sqrt, eps = a->eps, wd = a->wd, decay = a->decay;
    const bool decoupled = decay != 1.0f, maximize = a->maximize;
    for (int64_t i = lo; i < hi; i++) {
        const float pi = decoupled ? p[i] * decay : p[i];
        float gi = maximize ? -g[i] : g[i];
        if (wd != 0.0f) gi += wd * pi; /* (as torch: none at 0, where an infinite weight would make NaN) */
        float mi = beta1 * m[i] + one_b1 * gi;
        float vi = beta2 * v[i] + one_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        if (vmax) vi = vmax[i] = max_nan(vmax[i], vi); /* AMSGrad */
        p[i] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}

static void adam_range(void *arg, int64_t lo, int64_t hi) { blocks_zeroed(arg, lo, hi, adam_block); }

cmlp_status cpu_adam(void *ctx, float *restrict p, float *restrict g, float *restrict m, float *restrict v,
                     float *restrict vmax, int64_t n, float step_size, float beta1, float beta2, float one_b1,
                     float one_b2, float bc2_sqrt, float eps, float wd, float decay, int maximize,
                     const float *found_inf, const float *coef, int zero_g) {
    (void)ctx;
    if (found_inf && *found_inf != 0.0f) return zero_g ? cpu_fill_zero(ctx, g, (size_t)n * sizeof(float)) : CMLP_OK;
    if (coef) {
        step_size = coef[0];
        bc2_sqrt = coef[1];
        decay = coef[2];
        beta1 = coef[3];
        one_b1 = coef[4];
    }
    optim_args a = {.p = p, .m = m, .v = v, .vmax = vmax, .g = g, .step_size = step_size, .beta1 = beta1,
                    .beta2 = beta2, .one_b1 = one_b1, .one_b2 = one_b2, .bc2_sqrt = bc2_sqrt, .eps = eps, .wd = wd,
                    .decay = decay, .maximize = maximize, .zero_g = zero_g};
    cmlp_pool_for(n, 16, MIN_PER_THREAD, adam_range, &a);
    return CMLP_OK;
}

/* A momentum buffer's element that has not started (not any NaN: one that has stays NaN). */
static inline bool unstarted(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u == CMLP_MOMENTUM_UNSTARTED_BITS;
}

static void sgd_block(const optim_args *a, int64_t lo, int64_t hi) {
    float *restrict p = a->p, *restrict buf = a->buf;
    const float *restrict g = a->g;
    const float lr = a->lr, wd = a->wd, momentum = a->momentum;
    const bool maximize = a->maximize;
    if (momentum == 0.0f) {
        if (wd == 0.0f)
            for (int64_t i = lo; i < hi; i++) p[i] -= lr * (maximize ? -g[i] : g[i]);
        else
            for (int64_t i = lo; i < hi; i++) p[i] -= lr * ((maximize ? -g[i] : g[i]) + wd * p[i]);
        return;
    }
    const float keep = a->keep;
    for (int64_t i = lo; i < hi; i++) {
        float gi = maximize ? -g[i] : g[i];
        if (wd != 0.0f) gi += wd * p[i];
        float b = unstarted(buf[i]) ? gi : momentum * buf[i] + keep * gi;
        buf[i] = b;
        p[i] -= lr * (a->nesterov ? gi + momentum * b : b);
    }
}

static void sgd_range(void *arg, int64_t lo, int64_t hi) { blocks_zeroed(arg, lo, hi, sgd_block); }

cmlp_status cpu_sgd(void *ctx, float *restrict p, float *restrict g, float *restrict buf, int64_t n, float lr,
                    float momentum, float keep, int nesterov, float wd, int maximize, const float *found_inf,
                    const float *coef, int zero_g) {
    (void)ctx;
    if (found_inf && *found_inf != 0.0f) return zero_g ? cpu_fill_zero(ctx, g, (size_t)n * sizeof(float)) : CMLP_OK;
    if (coef) {
        lr = coef[0];
        momentum = coef[1];
    }
    if (momentum != 0.0f && !buf) return CMLP_FAIL(CMLP_ERR_INTERNAL, "SGD with momentum has no momentum buffer");
    optim_args a = {.p = p, .buf = buf, .g = g, .lr = lr, .momentum = momentum, .keep = keep, .wd = wd,
                    .nesterov = nesterov, .maximize = maximize, .zero_g = zero_g};
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
cmlp_status cpu_to_half(void *ctx, uint16_t *dst, const float *src, int64_t n, cmlp_dtype dtype) {
    (void)ctx;
    cast_args a = {.h = dst, .cf = src, .bf16 = dtype == CMLP_DTYPE_BF16};
    cmlp_pool_for(n, 32, MIN_PER_THREAD, to_half_range, &a);
    return CMLP_OK;
}

cmlp_status cpu_from_half(void *ctx, float *dst, const uint16_t *src, int64_t n, cmlp_dtype dtype) {
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

cmlp_status cpu_optim_prepare(void *ctx, int64_t *step, float *coef, const float *found_inf,
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

cmlp_status cpu_unscale(void *ctx, float *restrict g, int64_t n, float inv, const float *scale,
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
    double *part; /* [blocks]: each block's value */
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

/* The "threads" [lo, hi) of one block: thread j joins elements j, j + S, j + 2S, ... in order
 * (the rows of an S-wide matrix) into acc[j - lo], one loop per kind so that each vectorises. */
#define NORM_ROWS(STMT)                                                     \
    for (int64_t row = 0; row < n; row += S) {                              \
        const int64_t end = n - row < hi ? n - row : hi;                    \
        const float *restrict x = g + row;                                  \
        for (int64_t j = lo; j < end; j++) {                                \
            const double d = norm_abs(x[j]);                                \
            STMT;                                                           \
        }                                                                   \
    }

static void norm_threads(const norm_args *a, double *restrict acc, int64_t lo, int64_t hi) {
    const float *restrict g = a->g;
    const int64_t n = a->n, S = a->threads;
    const double p = a->p;
    const double start = a->kind == NORM_MIN ? INFINITY : 0.0;
    for (int64_t j = 0; j < hi - lo; j++) acc[j] = start;
    switch (a->kind) {
    case NORM_L2: NORM_ROWS(acc[j - lo] += d * d); break;
    case NORM_L1: NORM_ROWS(acc[j - lo] += d); break;
    case NORM_INF: NORM_ROWS(acc[j - lo] = max_bits(acc[j - lo], d)); break;
    case NORM_MIN: NORM_ROWS(acc[j - lo] = min_nan(acc[j - lo], d)); break;
    default: NORM_ROWS(acc[j - lo] += pow(d, p));
    }
}

/* Blocks [lo, hi): each one's threads, then its warps by the butterfly and the warps in order
 * (the threads' values on the stack: 2 KiB, nothing to allocate). */
static void norm_blocks(void *arg, int64_t lo, int64_t hi) {
    const norm_args *a = arg;
    for (int64_t b = lo; b < hi; b++) {
        double acc[CMLP_NORM_THREADS], warps[CMLP_NORM_THREADS / 32];
        norm_threads(a, acc, b * CMLP_NORM_THREADS, (b + 1) * CMLP_NORM_THREADS);
        for (int w = 0; w < CMLP_NORM_THREADS / 32; w++) {
            /* the butterfly's lane 0: at each stage it needs only the lanes below o (a join is
             * commutative, so lane l's join(v[l], v[l ^ o]) is this one's) */
            double *v = acc + w * 32;
            for (int o = 16; o > 0; o >>= 1)
                for (int l = 0; l < o; l++) v[l] = norm_join(v[l], v[l + o], a->kind);
            warps[w] = v[0];
        }
        double blk = warps[0];
        for (int w = 1; w < CMLP_NORM_THREADS / 32; w++) blk = norm_join(blk, warps[w], a->kind);
        a->part[b] = blk;
    }
}

cmlp_status cpu_grad_norm(void *ctx, const float *g, int64_t n, double norm_type, float *out, double *part,
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
    const int64_t blocks = cmlp_norm_blocks(n), per_block = n / blocks + 1;
    norm_args a = {g, n, blocks * CMLP_NORM_THREADS, kind, norm_type, part};
    cmlp_pool_for(blocks, 1, MIN_PER_THREAD / per_block + 1, norm_blocks, &a);
    double s = part[0];
    for (int64_t b = 1; b < blocks; b++) s = norm_join(s, part[b], kind);
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

cmlp_status cpu_clip_by_norm(void *ctx, float *g, int64_t n, const float *norm, float max_norm,
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

cmlp_status cpu_clip_by_value(void *ctx, float *g, int64_t n, float v) {
    (void)ctx;
    grads_args a = {g, v};
    cmlp_pool_for(n, 16, MIN_PER_THREAD, clamp_range, &a);
    return CMLP_OK;
}
