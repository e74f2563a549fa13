/* backend_cpu_ops.c - the CPU backend's passes of a layer (bias and ReLU, their gradients, the
 * fused softmax cross-entropy) and the staging of a batch (rows gathered, normalised, cast).
 * Loops over large buffers run on cmlp's thread pool.
 */
#include "backend_cpu.h"
#include "cpu_pool.h"
#include "half.h"

#include <math.h>
#include <string.h>

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

cmlp_status cpu_bias_act(void *ctx, float *y, const float *bias, int64_t rows, int64_t cols,
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

cmlp_status cpu_relu_backward(void *ctx, float *dy, const float *h, int64_t count) {
    (void)ctx;
    rows_args a = {.y = dy, .h = h};
    cmlp_pool_for(count, 16, MIN_PER_THREAD, relu_backward_range, &a);
    return CMLP_OK;
}

/* Columns [lo, hi) of db, each summed over the rows in order in double precision and rounded
 * once (added to db's value unless overwrite): the same sums on any number of threads, and no
 * error growing with the rows (a float running sum of 2**21 rows of mixed signs was off by 1e-3
 * of the total; torch sums in a cascade). With h (the ReLU's output), each row goes through the
 * ReLU's backward first and is written to out: the bits of relu_backward followed by bias_grad,
 * in one pass. out may be the gradient or h (each element is read before it is written, by the
 * same thread). Columns go BIAS_TILE at a time, their sums on the stack. The row kernels below
 * take each buffer once, restrict, so that they vectorise (no branch per element). */
#define BIAS_TILE 256

static inline void sum_row(double *restrict acc, const float *restrict row, int64_t w) {
    for (int64_t c = 0; c < w; c++) acc[c] += row[c];
}

/* the gradient masked where it stands (out is the gradient), then summed: two loops, since GCC
 * vectorises neither the select nor the sum when they share one */
static inline void sum_row_masked(double *restrict acc, float *restrict d, const float *restrict h, int64_t w) {
    for (int64_t c = 0; c < w; c++) d[c] = !(h[c] <= 0.0f) ? d[c] : 0.0f; /* torch's: passes at a NaN h */
    sum_row(acc, d, w);
}

/* the masked gradient written over h (out is h), then summed */
static inline void sum_row_masked_into_h(double *restrict acc, float *restrict h, const float *restrict d,
                                         int64_t w) {
    for (int64_t c = 0; c < w; c++) h[c] = !(h[c] <= 0.0f) ? d[c] : 0.0f;
    sum_row(acc, h, w);
}

static void bias_grad_cols(void *a, int64_t lo, int64_t hi) {
    const rows_args *r = a;
    float *restrict db = r->y;
    double acc[BIAS_TILE];
    for (int64_t c0 = lo; c0 < hi; c0 += BIAS_TILE) {
        const int64_t w = hi - c0 < BIAS_TILE ? hi - c0 : BIAS_TILE;
        for (int64_t c = 0; c < w; c++) acc[c] = r->overwrite ? 0.0 : (double)db[c0 + c];
        for (int64_t i = 0; i < r->rows; i++) {
            const int64_t at = i * r->cols + c0;
            if (!r->h) sum_row(acc, r->dy + at, w);
            else if (r->out == r->mdy) sum_row_masked(acc, r->out + at, r->h + at, w);
            else sum_row_masked_into_h(acc, r->out + at, r->mdy + at, w);
        }
        for (int64_t c = 0; c < w; c++) db[c0 + c] = (float)acc[c];
    }
}

static void bias_grad_run(rows_args *a) {
    cmlp_pool_for(a->cols, 16, a->rows > 0 ? MIN_PER_THREAD / a->rows + 1 : a->cols, bias_grad_cols, a);
}

cmlp_status cpu_bias_grad(void *ctx, float *db, const float *dy, int64_t rows, int64_t cols, int overwrite) {
    (void)ctx;
    rows_args a = {.y = db, .dy = dy, .rows = rows, .cols = cols, .overwrite = overwrite};
    bias_grad_run(&a);
    return CMLP_OK;
}

cmlp_status cpu_relu_backward_bias_grad(void *ctx, void *dy, const void *h, void *out, cmlp_dtype dtype,
                                        float *db, int64_t rows, int64_t cols, int overwrite) {
    (void)ctx;
    if (dtype != CMLP_DTYPE_F32)
        return CMLP_FAIL(CMLP_ERR_INVALID, "the CPU backend keeps no gradients in half precision");
    if (out != dy && out != h) return CMLP_FAIL(CMLP_ERR_INVALID, "the masked gradient goes to dy or h");
    rows_args a = {.y = db, .out = out, .mdy = dy, .h = h, .rows = rows, .cols = cols, .overwrite = overwrite};
    bias_grad_run(&a);
    return CMLP_OK;
}

cmlp_status cpu_softmax_xent(void *ctx, const float *logits, const int32_t *labels, int64_t rows,
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
        int64_t arg = 0, nan_at = isnan(x[0]) ? 0 : -1;
        for (int64_t c = 1; c < cols; c++) {
            if (x[c] > mx) {
                mx = x[c];
                arg = c;
            }
            if (nan_at < 0 && isnan(x[c])) nan_at = c;
        }
        /* the prediction counted is torch.argmax's (and predict's): the first NaN where there is one
         * (the loss and gradients are NaN either way) */
        if (nan_at >= 0) arg = nan_at;
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
        /* (without smoothing no sum of the logits: an infinite one would make a NaN of 0 * inf) */
        total += lse - (1.0 - smoothing) * xy - (smoothing != 0.0f ? (double)smoothing / (double)cols * xsum : 0.0);
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

/* Shuffled rows are scattered over the data set: each row's cache lines are asked for this
 * many rows ahead of their conversion, whose loads would otherwise wait on memory. */
#define PREFETCH_ROWS 2

static void stage_range(void *a, int64_t lo, int64_t hi) {
    const stage_args *g = a;
    const size_t row_bytes = (size_t)g->cols * (g->dtype == CMLP_DTYPE_U8 ? 1 : sizeof(float));
    for (int64_t r = lo; r < hi; r++) {
        int64_t s = g->idx ? g->idx[r] : g->start + r;
        if (g->idx && r + PREFETCH_ROWS < hi) {
            const char *ahead = (const char *)g->src + (size_t)g->idx[r + PREFETCH_ROWS] * row_bytes;
            for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b);
        }
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

/* The rows staged on the pool's threads, a share of rows each (one thread for a small batch). */
static cmlp_status stage_all(stage_args *a, int64_t rows) {
    cmlp_pool_for(rows, 1, a->cols > 0 ? MIN_PER_THREAD / a->cols + 1 : rows, stage_range, a);
    return CMLP_OK;
}

cmlp_status cpu_stage_rows(void *ctx, float *dst, const void *src, cmlp_dtype dtype, int64_t cols,
                           const int64_t *idx, int64_t start, int64_t rows, float scale,
                           float shift) {
    (void)ctx;
    stage_args a = {dst, src, dtype, cols, start, idx, scale, shift, NULL, CMLP_DTYPE_F32, NULL, NULL};
    return stage_all(&a, rows);
}

cmlp_status cpu_stage_labels(void *ctx, int32_t *dst, const int32_t *src, const int64_t *idx,
                             int64_t start, int64_t rows) {
    (void)ctx;
    for (int64_t r = 0; r < rows; r++) dst[r] = src[idx ? idx[r] : start + r];
    return CMLP_OK;
}

/* Device memory is host memory: gathering is staging, from the rows the position moves to (the
 * order's, or the data set's from start). */
static void at_pos(const int64_t **idx, int64_t *start, const int64_t *pos) {
    if (!pos) return;
    if (*idx) *idx += *pos;
    else *start += *pos;
}

cmlp_status cpu_gather_rows(void *ctx, float *dst, const void *src, cmlp_dtype dtype, int64_t cols,
                            const int64_t *idx, int64_t start, const int64_t *pos, int64_t rows, float scale,
                            float shift, int32_t *ldst, const int32_t *lsrc) {
    (void)ctx;
    at_pos(&idx, &start, pos);
    stage_args a = {dst, src, dtype, cols, start, idx, scale, shift, NULL, CMLP_DTYPE_F32, ldst, lsrc};
    return stage_all(&a, rows);
}

cmlp_status cpu_gather_rows_half(void *ctx, uint16_t *dst, cmlp_dtype half, const void *src, cmlp_dtype dtype,
                                 int64_t cols, const int64_t *idx, int64_t start, const int64_t *pos,
                                 int64_t rows, float scale, float shift, int32_t *ldst, const int32_t *lsrc) {
    (void)ctx;
    at_pos(&idx, &start, pos);
    stage_args a = {NULL, src, dtype, cols, start, idx, scale, shift, dst, half, ldst, lsrc};
    return stage_all(&a, rows);
}

cmlp_status cpu_gather_labels(void *ctx, int32_t *dst, const int32_t *src, const int64_t *idx, int64_t start,
                              const int64_t *pos, int64_t rows) {
    at_pos(&idx, &start, pos);
    return cpu_stage_labels(ctx, dst, src, idx, start, rows);
}
