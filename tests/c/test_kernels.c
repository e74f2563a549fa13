/* test_kernels.c - the CUDA kernels (the .cu files of kernels/), run on the CPU by tests/emu/cuda_emu.h,
 * against the CPU backend: bit for bit where kernels.h promises the CPU's bits (elementwise
 * ops, optimizers, casts, gathers, scalar updates), within stated tolerances where the order
 * of a sum differs (bias gradients, the loss total). Buffers are malloc'd to their exact size
 * and the kernels run under AddressSanitizer, so a read or write outside a tensor fails the
 * run; offsets of 1..3 elements take the kernels through their unaligned paths.
 *
 * Inputs include subnormals, signed zeros, infinities and NaNs where an op must handle them.
 */
#include "backend.h"
#include "half.h"
#include "internal.h"
#include "kernels.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static const cmlp_backend_i *cpu = &cmlp_backend_cpu;
static const cudaStream_t S = 0;

/* ---- inputs ---- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)((next_u64() >> 40) * 0x1p-24); }

/* Mostly values in [-2, 2]; one in 16 is a special (subnormal, signed zero, tiny) when asked. */
static void fill(float *x, int64_t n, int specials) {
    static const float special[] = {0x1p-140f, -0x1p-135f, 0.0f, -0.0f, 0x1p-126f, -0x1.8p-127f, 1e-30f, 65504.0f};
    for (int64_t i = 0; i < n; i++)
        x[i] = specials && next_u64() % 16 == 0 ? special[next_u64() % 8] : uniform(-2.0f, 2.0f);
}

/* An exact-size buffer of n elements of `size` bytes, starting `off` elements into its block. */
typedef struct {
    char *block;
    void *p;
} buf;
static buf make(int64_t n, size_t size, int off) {
    buf b;
    b.block = malloc((size_t)(n + off) * size + 1);
    b.p = b.block + (size_t)off * size;
    return b;
}
#define F(b) ((float *)(b).p)

static int same_bits(const void *a, const void *b, size_t nbytes) { return memcmp(a, b, nbytes) == 0; }

/* first index where float arrays differ bitwise, or -1 */
static int64_t first_diff(const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, 4)) return i;
    return -1;
}

/* The CPU backend runs under FTZ/DAZ inside the core; so does the reference here. */
#define CPU_CALL(expr)                 \
    do {                               \
        cmlp_fpenv env_;               \
        cmlp_fpenv_enter(&env_);       \
        cmlp_status s_ = (expr);       \
        cmlp_fpenv_leave(&env_);       \
        CHECK(s_ == CMLP_OK, "%s", #expr); \
    } while (0)

#define KOK(expr) CHECK((expr) == cudaSuccess, "%s", #expr)

static const int64_t COUNTS[] = {1, 2, 3, 4, 5, 7, 8, 9, 31, 255, 256, 257, 1029};
#define NCOUNTS (int)(sizeof COUNTS / sizeof COUNTS[0])

/* ---- bias_act.cu ---- */

static void test_bias_act(void) {
    static const int64_t R[] = {1, 2, 5, 33}, C[] = {1, 3, 4, 8, 10, 33, 512};
    for (int ri = 0; ri < 4; ri++)
        for (int ci = 0; ci < 7; ci++)
            for (int off = 0; off < 2; off++)
                for (int relu = 0; relu < 2; relu++) {
                    int64_t rows = R[ri], cols = C[ci], n = rows * cols;
                    buf y = make(n, 4, off), b = make(cols, 4, off), ref = make(n, 4, 0);
                    fill(F(y), n, 1);
                    fill(F(b), cols, 1);
                    memcpy(F(ref), F(y), (size_t)n * 4);
                    CPU_CALL(cpu->bias_act(NULL, F(ref), F(b), rows, cols, relu));
                    KOK(cmlp_k_bias_act(F(y), F(b), rows, cols, relu, S));
                    int64_t d = first_diff(F(y), F(ref), n);
                    CHECK(d < 0, "bias_act %lldx%lld relu %d off %d: element %lld", (long long)rows, (long long)cols,
                          relu, off, (long long)d);
                    free(y.block), free(b.block), free(ref.block);
                }
}

static void test_relu_backward(void) {
    for (int i = 0; i < NCOUNTS; i++)
        for (int off = 0; off < 4; off++) {
            int64_t n = COUNTS[i];
            buf dy = make(n, 4, off), h = make(n, 4, (off + i) % 4), ref = make(n, 4, 0), was = make(n, 4, 0);
            fill(F(dy), n, 1);
            fill(F(h), n, 1);
            for (int64_t k = off; k < n; k += 7) F(h)[k] = k % 2 ? NAN : -0.0f; /* a NaN passes dy, -0 does not */
            memcpy(F(ref), F(dy), (size_t)n * 4);
            memcpy(F(was), F(dy), (size_t)n * 4);
            CPU_CALL(cpu->relu_backward(NULL, F(ref), F(h), n));
            KOK(cmlp_k_relu_backward(F(dy), F(h), n, S));
            CHECK(first_diff(F(dy), F(ref), n) < 0, "relu_backward n %lld off %d", (long long)n, off);
            for (int64_t k = off; k < n; k += 7) /* at a NaN, dy as it was (its bits); at -0, +0 */
                CHECK(k % 2 ? same_bits(F(dy) + k, F(was) + k, 4) : same_bits(F(dy) + k, &(float){0.0f}, 4),
                      "relu_backward at %s", k % 2 ? "NaN" : "-0");
            free(dy.block), free(h.block), free(ref.block), free(was.block);
        }
}

/* Column sums: within 1e-6 of the column's sum of magnitudes (fp32 sums in another order),
 * added to what db held, and the same bits on a second run. */
static void check_bias_grad(const float *db, const float *db0, const double *sum, const double *mag, int64_t cols,
                            const char *what, int64_t rows) {
    int bad = -1;
    for (int64_t c = 0; c < cols && bad < 0; c++)
        if (fabs((double)db[c] - ((double)db0[c] + sum[c])) > 1e-6 * (mag[c] + fabs(db0[c])) + 1e-30) bad = (int)c;
    CHECK(bad < 0, "%s %lldx%lld: column %d", what, (long long)rows, (long long)cols, bad);
}

/* scratch for the row-split bias gradients: none, room for two ranges of a row, or plenty */
static size_t scratch_bytes_of(int variant, int64_t cols) {
    return variant == 0 ? 0 : variant == 1 ? (size_t)(2 * cols) * 4 : (size_t)1 << 20;
}

static void test_bias_grad(void) {
    static const int64_t R[] = {1, 2, 3, 31, 64, 1000, 3000}, C[] = {1, 2, 5, 32, 33, 100, 512};
    for (int ri = 0; ri < 7; ri++)
        for (int ci = 0; ci < 7; ci++)
            for (int kind = 0; kind < 3; kind++)
                for (int sv = 0; sv < 3; sv++) {
                    int64_t rows = R[ri], cols = C[ci], n = rows * cols;
                    if (n > 400000 || (sv && rows < 1000)) continue; /* the emulator's time; splits need rows */
                    size_t sb = scratch_bytes_of(sv, cols);
                    float *scratch = sb ? malloc(sb) : NULL;
                    buf dy = make(n, kind ? 2 : 4, 0), db = make(cols, 4, 0), db2 = make(cols, 4, 0),
                        db0 = make(cols, 4, 0);
                    double *sum = calloc((size_t)cols, sizeof(double)), *mag = calloc((size_t)cols, sizeof(double));
                    float *vals = malloc((size_t)n * 4);
                    fill(vals, n, 0);
                    fill(F(db0), cols, 0);
                    if (kind == 1) cmlp_f32_to_f16(dy.p, vals, n), cmlp_f16_to_f32(vals, dy.p, n);
                    if (kind == 2) cmlp_f32_to_bf16(dy.p, vals, n), cmlp_bf16_to_f32(vals, dy.p, n);
                    if (kind == 0) memcpy(dy.p, vals, (size_t)n * 4);
                    for (int64_t r = 0; r < rows; r++)
                        for (int64_t c = 0; c < cols; c++) {
                            sum[c] += vals[r * cols + c];
                            mag[c] += fabs(vals[r * cols + c]);
                        }
                    /* overwriting: what db held (NaN here) is not read */
                    int ow = (ri + ci + kind) % 2;
                    for (int64_t c = 0; c < cols; c++) F(db)[c] = F(db2)[c] = ow ? NAN : F(db0)[c];
                    if (ow) memset(F(db0), 0, (size_t)cols * 4);
                    if (kind == 0) {
                        KOK(cmlp_k_bias_grad(F(db), F(dy), rows, cols, ow, scratch, sb, S));
                        KOK(cmlp_k_bias_grad(F(db2), F(dy), rows, cols, ow, scratch, sb, S));
                        if (sv == 0) { /* the CPU backend's own sums agree to the same tolerance */
                            buf cdb = make(cols, 4, 0);
                            for (int64_t c = 0; c < cols; c++) F(cdb)[c] = ow ? NAN : F(db0)[c];
                            CPU_CALL(cpu->bias_grad(NULL, F(cdb), F(dy), rows, cols, ow));
                            check_bias_grad(F(cdb), F(db0), sum, mag, cols, "cpu bias_grad", rows);
                            free(cdb.block);
                        }
                    } else {
                        KOK(cmlp_k_bias_grad_half(F(db), dy.p, rows, cols, kind == 2, ow, scratch, sb, S));
                        KOK(cmlp_k_bias_grad_half(F(db2), dy.p, rows, cols, kind == 2, ow, scratch, sb, S));
                    }
                    check_bias_grad(F(db), F(db0), sum, mag, cols, kind == 0 ? "bias_grad" : "bias_grad_half", rows);
                    CHECK(same_bits(F(db), F(db2), (size_t)cols * 4), "bias_grad %lldx%lld scratch %d: not deterministic",
                          (long long)rows, (long long)cols, sv);
                    free(dy.block), free(db.block), free(db2.block), free(db0.block), free(sum), free(mag), free(vals);
                    free(scratch);
                }
}

/* Rows set to a half bias, then the ReLU of half values: on any bits (as bias_act's ReLU: what
 * is not > 0, NaN included, becomes +0), odd widths and offsets. */
static void test_rows_half(void) {
    static const int64_t R[] = {1, 3, 33}, C[] = {1, 7, 64};
    for (int ri = 0; ri < 3; ri++)
        for (int ci = 0; ci < 3; ci++)
            for (int bf = 0; bf < 2; bf++) {
                int64_t rows = R[ri], cols = C[ci], n = rows * cols;
                buf y = make(n, 2, 1), b = make(cols, 2, 1);
                for (int64_t c = 0; c < cols; c++) ((uint16_t *)b.p)[c] = (uint16_t)next_u64();
                KOK(cmlp_k_rows_half(y.p, b.p, rows, cols, bf, S));
                int bad = 0;
                for (int64_t k = 0; k < n; k++) bad |= ((uint16_t *)y.p)[k] != ((uint16_t *)b.p)[k % cols];
                CHECK(!bad, "rows_half %lldx%lld bf16 %d: rows are not the bias", (long long)rows, (long long)cols, bf);
                float *f = malloc((size_t)n * 4);
                uint16_t *ref = malloc((size_t)n * 2);
                if (bf) cmlp_bf16_to_f32(f, y.p, n);
                else cmlp_f16_to_f32(f, y.p, n);
                for (int64_t k = 0; k < n; k++) ref[k] = f[k] > 0.0f ? ((uint16_t *)y.p)[k] : 0;
                KOK(cmlp_k_rows_half(y.p, NULL, rows, cols, bf, S));
                bad = !same_bits(y.p, ref, (size_t)n * 2);
                CHECK(!bad, "rows_half %lldx%lld bf16 %d: ReLU", (long long)rows, (long long)cols, bf);
                free(f), free(ref), free(y.block), free(b.block);
            }
}

static void test_relu_backward_half(void) {
    for (int i = 0; i < NCOUNTS; i++)
        for (int bf = 0; bf < 2; bf++) {
            int64_t n = COUNTS[i];
            buf dy = make(n, 2, i % 3), h = make(n, 2, i % 2);
            uint16_t *ref = malloc((size_t)n * 2);
            float *hf = malloc((size_t)n * 4);
            for (int64_t k = 0; k < n; k++) {
                ((uint16_t *)dy.p)[k] = ref[k] = (uint16_t)next_u64();
                /* any bits, NaNs and subnormals included */
                ((uint16_t *)h.p)[k] = (uint16_t)next_u64();
            }
            if (bf) cmlp_bf16_to_f32(hf, h.p, n);
            else cmlp_f16_to_f32(hf, h.p, n);
            /* torch's threshold_backward (it passes at a NaN), with h compared under DAZ as the CPU
             * compares it: a bf16 subnormal, a float subnormal too, counts as 0 */
            for (int64_t k = 0; k < n; k++)
                if (hf[k] <= 0.0f || fpclassify(hf[k]) == FP_SUBNORMAL) ref[k] = 0;
            KOK(cmlp_k_relu_backward_half(dy.p, h.p, n, bf, S));
            CHECK(same_bits(dy.p, ref, (size_t)n * 2), "relu_backward_half n %lld bf16 %d", (long long)n, bf);
            free(dy.block), free(h.block), free(ref), free(hf);
        }
}

/* The fused ReLU backward and bias gradient: the bits of the two kernels run one after the
 * other, in float and both half formats, with the result in place or over the activations (then
 * the gradient is only read); and in float the CPU backend's fused op agrees, both ways. */
static void test_relu_backward_bias_grad(void) {
    static const int64_t R[] = {1, 3, 31, 64, 300, 3000}, C[] = {1, 2, 5, 33, 100, 512};
    for (int ri = 0; ri < 6; ri++)
        for (int ci = 0; ci < 6; ci++)
            for (int kind = 0; kind < 3; kind++) {
                int64_t rows = R[ri], cols = C[ci], n = rows * cols;
                if (n > 400000) continue;
                size_t sb = scratch_bytes_of(ri == 5 ? 2 : 0, cols);
                float *scratch = sb ? malloc(sb) : NULL;
                size_t es = kind ? 2 : 4;
                buf dy = make(n, es, 0), dy2 = make(n, es, 0), h = make(n, es, 0), dy3 = make(n, es, 0);
                buf h3 = make(n, es, 0), db3 = make(cols, 4, 0), ch = make(n, 4, 0), cdb3 = make(cols, 4, 0);
                buf db = make(cols, 4, 0), db2 = make(cols, 4, 0), cdy = make(n, 4, 0), cdb = make(cols, 4, 0);
                float *v = malloc((size_t)n * 4), *hv = malloc((size_t)n * 4);
                fill(v, n, kind == 0);
                fill(hv, n, 1);
                if (kind == 0) memcpy(dy.p, v, (size_t)n * 4), memcpy(h.p, hv, (size_t)n * 4);
                if (kind == 1) cmlp_f32_to_f16(dy.p, v, n), cmlp_f32_to_f16(h.p, hv, n);
                if (kind == 2) cmlp_f32_to_bf16(dy.p, v, n), cmlp_f32_to_bf16(h.p, hv, n);
                memcpy(dy2.p, dy.p, (size_t)n * es);
                memcpy(dy3.p, dy.p, (size_t)n * es);
                memcpy(h3.p, h.p, (size_t)n * es);
                fill(F(db), cols, 0);
                memcpy(F(db2), F(db), (size_t)cols * 4);
                memcpy(F(db3), F(db), (size_t)cols * 4);
                memcpy(F(cdb), F(db), (size_t)cols * 4);
                memcpy(F(cdb3), F(db), (size_t)cols * 4);
                KOK(cmlp_k_relu_backward_bias_grad(dy.p, h.p, dy.p, kind, F(db), rows, cols, 0, scratch, sb, S));
                KOK(cmlp_k_relu_backward_bias_grad(dy3.p, h3.p, h3.p, kind, F(db3), rows, cols, 0, scratch, sb, S));
                CHECK(same_bits(h3.p, dy.p, (size_t)n * es) && same_bits(F(db3), F(db), (size_t)cols * 4),
                      "fused relu/bias grad %lldx%lld kind %d over h differs from in place", (long long)rows,
                      (long long)cols, kind);
                CHECK(kind != 0 || first_diff(F(dy3), v, n) < 0, "fused relu/bias grad over h changed dy");
                if (kind == 0) {
                    memcpy(F(ch), hv, (size_t)n * 4);
                    memcpy(F(cdy), v, (size_t)n * 4);
                    CPU_CALL(cpu->relu_backward_bias_grad(NULL, F(cdy), F(ch), F(ch), CMLP_DTYPE_F32, F(cdb3), rows,
                                                          cols, 0));
                    CHECK(first_diff(F(ch), F(dy), n) < 0 && first_diff(F(cdy), v, n) < 0,
                          "CPU fused relu/bias grad %lldx%lld over h: wrong values, or dy changed", (long long)rows,
                          (long long)cols);
                    KOK(cmlp_k_relu_backward(F(dy2), F(h), n, S));
                    KOK(cmlp_k_bias_grad(F(db2), F(dy2), rows, cols, 0, scratch, sb, S));
                    memcpy(F(cdy), v, (size_t)n * 4);
                    CPU_CALL(cpu->relu_backward_bias_grad(NULL, F(cdy), F(h), F(cdy), CMLP_DTYPE_F32, F(cdb), rows, cols,
                                                          0));
                    CHECK(same_bits(F(cdb3), F(cdb), (size_t)cols * 4), "CPU fused relu/bias grad: db over h differs");
                    CHECK(first_diff(F(dy), F(cdy), n) < 0, "fused relu/bias grad %lldx%lld: dy differs from the CPU's",
                          (long long)rows, (long long)cols);
                    int bad = -1;
                    for (int64_t c = 0; c < cols && bad < 0; c++) {
                        double mag = fabs(F(cdb)[c]);
                        for (int64_t r = 0; r < rows; r++) mag += fabs(v[r * cols + c]);
                        if (fabs((double)F(db)[c] - F(cdb)[c]) > 1e-6 * mag + 1e-30) bad = (int)c;
                    }
                    CHECK(bad < 0, "fused relu/bias grad %lldx%lld: db[%d] far from the CPU's", (long long)rows,
                          (long long)cols, bad);
                } else {
                    KOK(cmlp_k_relu_backward_half(dy2.p, h.p, n, kind == 2, S));
                    KOK(cmlp_k_bias_grad_half(F(db2), dy2.p, rows, cols, kind == 2, 0, scratch, sb, S));
                }
                CHECK(same_bits(dy.p, dy2.p, (size_t)n * es) && same_bits(F(db), F(db2), (size_t)cols * 4),
                      "fused relu/bias grad %lldx%lld kind %d differs from the two kernels", (long long)rows,
                      (long long)cols, kind);
                free(dy.block), free(dy2.block), free(h.block), free(db.block), free(db2.block), free(cdy.block);
                free(cdb.block), free(v), free(hv), free(scratch);
                free(dy3.block), free(h3.block), free(db3.block), free(ch.block), free(cdb3.block);
            }
    float x = 0, y = 1, o = 2;
    CHECK(cmlp_k_relu_backward_bias_grad(&x, NULL, &x, 0, &x, 1, 1, 0, NULL, 0, S) == cudaErrorInvalidValue,
          "fused without h");
    CHECK(cmlp_k_relu_backward_bias_grad(&x, &y, &o, 0, &x, 1, 1, 0, NULL, 0, S) == cudaErrorInvalidValue,
          "fused into a third buffer");
    CHECK(cpu->relu_backward_bias_grad(NULL, &x, &y, &o, CMLP_DTYPE_F32, &x, 1, 1, 0) == CMLP_ERR_INVALID,
          "CPU fused into a third buffer");
    /* overwriting with no rows leaves zeros */
    float z[3] = {NAN, 5, -1};
    KOK(cmlp_k_bias_grad(z, z, 0, 3, 1, NULL, 0, S));
    CHECK(z[0] == 0 && z[1] == 0 && z[2] == 0 && !signbit(z[0]), "bias_grad overwriting with no rows: %g %g %g", z[0],
          z[1], z[2]);
}

/* ---- loss.cu ---- */

/* The loss kernel's scratch: static, so its blocks-done counter starts at 0. */
static double xent_scratch[CMLP_K_XENT_SCRATCH / 8];
#define XS ((void *)xent_scratch)
static unsigned int xent_blocks_done(void) { return *(unsigned int *)(xent_scratch + CMLP_K_XENT_BLOCKS); }

static void test_softmax_xent(void) {
    static const int64_t R[] = {1, 2, 7, 8, 9, 33}, C[] = {1, 2, 5, 10, 31, 32, 33, 64, 65, 100, 128, 129, 300};
    for (int ri = 0; ri < 6; ri++)
        for (int ci = 0; ci < 13; ci++)
            for (int mode = 0; mode < 4; mode++) {
                /* mode 0: plain; 1: smoothing, the weight of a loss scale on the device; 2: dlogits
                 * in place; 3: NaN and ties in the logits, no gradient */
                int64_t rows = R[ri], cols = C[ci], n = rows * cols;
                float smoothing = mode == 1 ? 0.1f : 0.0f, gw = 0.25f, scale = 1000.0f;
                const double count = 96.0;
                const float gwd = (float)(1000.0 / count);
                buf x = make(n, 4, 0), lab = make(rows, 4, 0), dl = make(n, 4, 0), cx = make(n, 4, 0),
                    cdl = make(n, 4, 0);
                for (int64_t k = 0; k < n; k++) F(x)[k] = uniform(-8.0f, 8.0f);
                for (int64_t r = 0; r < rows; r++) ((int32_t *)lab.p)[r] = (int32_t)(next_u64() % (uint64_t)cols);
                if (mode == 3)
                    for (int64_t r = 0; r < rows; r++) {
                        int64_t c = (int64_t)(next_u64() % (uint64_t)cols);
                        if (r % 3 == 0) F(x)[r * cols + c] = NAN;
                        if (r % 3 == 1) F(x)[r * cols] = NAN;
                        if (r % 3 == 2) F(x)[r * cols + c] = F(x)[r * cols + (c + 1) % cols] = 9.0f;
                    }
                memcpy(F(cx), F(x), (size_t)n * 4);
                double loss = 0.5, closs = 0.5;
                unsigned long long hits = 3;
                int64_t chits = 3;
                float *d = mode == 2 ? F(x) : mode == 3 ? NULL : F(dl);
                float *cd = mode == 2 ? F(cx) : mode == 3 ? NULL : F(cdl);
                float fi = 1.0f, cfi = 1.0f; /* reset by the loss scale's launch */
                const float *sdev = mode == 1 ? &scale : NULL;
                if (mode == 0 || mode == 1) { /* the half-precision gradient: the float one, rounded once */
                    for (int bf = 0; bf < 2; bf++) {
                        buf dh = make(n, 2, 0), dref = make(n, 4, 0), href = make(n, 2, 0);
                        double l2 = 0.0;
                        unsigned long long h2 = 0;
                        float hfi = 1.0f; /* reset by the loss scale's launch, as in fp32 */
                        KOK(cmlp_k_softmax_xent_half(F(x), lab.p, rows, cols, smoothing, gw, sdev, count,
                                                     mode == 1 ? &hfi : NULL, dh.p, bf, &l2, &h2, XS, S));
                        CHECK((hfi == 0.0f) == (mode == 1), "xent_half mode %d: found_inf %g", mode, hfi);
                        double lref = 0.0;
                        unsigned long long href_hits = 0;
                        KOK(cmlp_k_softmax_xent(F(x), lab.p, rows, cols, smoothing, gw, sdev, count, NULL, F(dref),
                                                &lref, &href_hits, XS, S));
                        KOK(cmlp_k_to_half(href.p, F(dref), n, bf, S));
                        CHECK(same_bits(dh.p, href.p, (size_t)n * 2) && l2 == lref && h2 == href_hits,
                              "xent_half %lldx%lld bf16 %d: gradient bits, loss %.17g vs %.17g, hits %llu vs %llu",
                              (long long)rows, (long long)cols, bf, l2, lref, h2, href_hits);
                        free(dh.block), free(dref.block), free(href.block);
                    }
                }
                float *fip = mode == 1 ? &fi : NULL, *cfip = mode == 1 ? &cfi : NULL;
                /* the loss totalled in a fixed order (mode 0, 1) or by atomics (mode 2, 3) */
                KOK(cmlp_k_softmax_xent(F(x), lab.p, rows, cols, smoothing, gw, sdev, count, fip, d, &loss, &hits,
                                        mode < 2 ? XS : NULL, S));
                CHECK(xent_blocks_done() == 0, "xent: the blocks-done counter is %u after a launch", xent_blocks_done());
                CPU_CALL(cpu->softmax_xent(NULL, F(cx), lab.p, rows, cols, smoothing,
                                           (cmlp_loss_weight){gw, sdev, count, cfip}, cd, &closs, &chits));
                CHECK((int64_t)hits == chits, "xent %lldx%lld mode %d: hits %llu vs %lld", (long long)rows,
                      (long long)cols, mode, hits, (long long)chits);
                CHECK((fi == 0.0f) == (mode == 1) && fi == cfi, "xent mode %d: found_inf %g vs %g", mode, fi, cfi);
                if (mode == 3) {
                    CHECK(isnan(loss) == isnan(closs), "xent NaN rows: loss %g vs %g", loss, closs);
                } else {
                    CHECK(fabs(loss - closs) <= 1e-12 * fabs(closs), "xent %lldx%lld mode %d: loss %.17g vs %.17g",
                          (long long)rows, (long long)cols, mode, loss, closs);
                    /* p differs by an ulp at most (exp in double, rounded once, against expf) */
                    float w = mode == 1 ? gwd : gw;
                    int64_t bad = -1;
                    for (int64_t k = 0; k < n && bad < 0; k++)
                        if (!(fabsf(d[k] - cd[k]) <= 2.0f * FLT_EPSILON * w)) bad = k;
                    CHECK(bad < 0, "xent %lldx%lld mode %d: dlogits[%lld] %.9g vs %.9g", (long long)rows,
                          (long long)cols, mode, (long long)bad, bad < 0 ? 0.0 : d[bad], bad < 0 ? 0.0 : cd[bad]);
                }
                free(x.block), free(lab.block), free(dl.block), free(cx.block), free(cdl.block);
            }
    /* labels outside [0, cols): no read outside the row, no hit, and a finite loss */
    int64_t rows = 4, cols = 10;
    buf x = make(rows * cols, 4, 0), lab = make(rows, 4, 0), dl = make(rows * cols, 4, 0);
    fill(F(x), rows * cols, 0);
    int32_t bad[4] = {-1, 10, INT32_MAX, INT32_MIN};
    memcpy(lab.p, bad, sizeof bad);
    double loss = 0.0;
    unsigned long long hits = 0;
    KOK(cmlp_k_softmax_xent(F(x), lab.p, rows, cols, 0.0f, 1.0f, NULL, 0.0, NULL, F(dl), &loss, &hits, XS, S));
    CHECK(hits == 0 && isfinite(loss), "xent with labels out of range: hits %llu loss %g", hits, loss);
    { /* the CPU backend too (its caller checks labels, but they may change while it runs) */
        buf cdl = make(rows * cols, 4, 0);
        double closs = 0.0;
        int64_t chits = 0;
        CPU_CALL(cpu->softmax_xent(NULL, F(x), lab.p, rows, cols, 0.0f, (cmlp_loss_weight){1.0f}, F(cdl), &closs,
                                   &chits));
        CHECK(chits == 0 && fabs(closs - loss) <= 1e-12 * fabs(loss), "CPU xent with labels out of range: hits %lld "
              "loss %.17g vs %.17g", (long long)chits, closs, loss);
        free(cdl.block);
    }
    KOK(cmlp_k_softmax_xent(F(x), lab.p, 0, cols, 0.0f, 1.0f, NULL, 0.0, NULL, F(dl), &loss, &hits, XS, S));
    { /* no rows: the non-finite flag is reset all the same, as the CPU backend does */
        buf flag = make(1, 4, 0);
        F(flag)[0] = 1.0f;
        float one = 1.0f, cflag = 1.0f;
        KOK(cmlp_k_softmax_xent(F(x), lab.p, 0, cols, 0.0f, 0.0f, &one, 1.0, F(flag), F(dl), &loss, &hits, XS, S));
        CPU_CALL(cpu->softmax_xent(NULL, F(x), lab.p, 0, cols, 0.0f, (cmlp_loss_weight){0.0f, &one, 1.0, &cflag},
                                   F(dl), NULL, NULL));
        CHECK(F(flag)[0] == 0.0f && cflag == 0.0f, "xent of no rows: found_inf %g, CPU %g", F(flag)[0], cflag);
        free(flag.block);
    }
    CHECK(cmlp_k_softmax_xent(F(x), lab.p, rows, 0, 0.0f, 1.0f, NULL, 0.0, NULL, F(dl), &loss, &hits, NULL, S) ==
              cudaErrorInvalidValue,
          "xent with no columns");
    /* a loss scale's weight, exactly: two equal logits give p = 1/2, so dlogits = -w/2, w/2 */
    float s = 1000.0f, fi = 1.0f, cfi = 1.0f, two[2] = {0.0f, 0.0f}, ctwo[2] = {0.0f, 0.0f};
    const int32_t zero = 0;
    KOK(cmlp_k_softmax_xent(two, &zero, 1, 2, 0.0f, 0.0f, &s, 96.0, &fi, two, NULL, NULL, XS, S));
    CPU_CALL(cpu->softmax_xent(NULL, ctwo, &zero, 1, 2, 0.0f, (cmlp_loss_weight){0.0f, &s, 96.0, &cfi}, ctwo, NULL,
                               NULL));
    const float half_w = 0.5f * (float)(1000.0 / 96.0);
    CHECK(same_bits(two, ctwo, sizeof two) && two[1] == half_w && two[0] == -half_w && fi == 0.0f && cfi == 0.0f,
          "xent with a loss scale: %.9g %.9g vs %.9g %.9g, found_inf %g %g", two[0], two[1], ctwo[0], ctwo[1], fi, cfi);
    free(x.block), free(lab.block), free(dl.block);
}

/* The emulator's block order (tests/emu/cuda_emu.cpp): 0 first to last, 1 last first (and a
 * block's threads last first between barriers). */
int cmlp_emu_block_order(int order);

/* With scratch the loss total has the same bits whatever order the blocks finish in (on a GPU,
 * any): 301 blocks (more parts than the joining block's threads) and 4096 blocks striding over
 * 33,000 rows, each run with the blocks first to last and last to first. By atomics the two
 * orders give other bits, which is what the scratch is for. */
static void test_softmax_xent_total_is_fixed(void) {
    static const int64_t R[] = {8 * 300 + 5, 33000};
    const int64_t cols = 10;
    const int before = cmlp_emu_block_order(-1);
    int atomics_differ = 0;
    for (int ri = 0; ri < 2; ri++) {
        const int64_t rows = R[ri], n = rows * cols;
        buf x = make(n, 4, 0), lab = make(rows, 4, 0);
        for (int64_t k = 0; k < n; k++) F(x)[k] = uniform(-8.0f, 8.0f);
        for (int64_t r = 0; r < rows; r++) ((int32_t *)lab.p)[r] = (int32_t)(next_u64() % (uint64_t)cols);
        double fixed[2], atomic[2];
        unsigned long long hits[2];
        for (int order = 0; order < 2; order++) {
            cmlp_emu_block_order(order);
            fixed[order] = atomic[order] = 0.25;
            hits[order] = 0;
            KOK(cmlp_k_softmax_xent(F(x), lab.p, rows, cols, 0.0f, 1.0f, NULL, 0.0, NULL, NULL, &fixed[order],
                                    &hits[order], XS, S));
            CHECK(xent_blocks_done() == 0, "xent total: counter %u", xent_blocks_done());
            KOK(cmlp_k_softmax_xent(F(x), lab.p, rows, cols, 0.0f, 1.0f, NULL, 0.0, NULL, NULL, &atomic[order], NULL,
                                    NULL, S));
        }
        double closs = 0.25;
        int64_t chits = 0;
        CPU_CALL(cpu->softmax_xent(NULL, F(x), lab.p, rows, cols, 0.0f, (cmlp_loss_weight){1.0f}, NULL, &closs, &chits));
        CHECK(same_bits(&fixed[0], &fixed[1], sizeof(double)) && hits[0] == hits[1] && (int64_t)hits[0] == chits,
              "xent total of %lld rows by block order: %.17g vs %.17g, hits %llu %llu vs %lld", (long long)rows,
              fixed[0], fixed[1], hits[0], hits[1], (long long)chits);
        CHECK(fabs(fixed[0] - closs) <= 1e-12 * fabs(closs) && fabs(atomic[0] - closs) <= 1e-12 * fabs(closs),
              "xent total of %lld rows: %.17g and %.17g vs %.17g", (long long)rows, fixed[0], atomic[0], closs);
        atomics_differ += !same_bits(&atomic[0], &atomic[1], sizeof(double));
        free(x.block), free(lab.block);
    }
    CHECK(atomics_differ > 0, "the atomics' totals came out the same in both block orders");
    cmlp_emu_block_order(before);
}

/* ---- data.cu ---- */

static void test_gather(void) {
    static const int64_t C[] = {1, 3, 4, 5, 8, 784};
    const int64_t nsrc = 23;
    for (int ci = 0; ci < 6; ci++)
        for (int variant = 0; variant < 8; variant++) {
            /* bit 0: index array; bit 1: device position; bit 2: misaligned destination */
            int64_t cols = C[ci], rows = 9;
            int use_idx = variant & 1, use_pos = variant >> 1 & 1, off = variant >> 2 & 1;
            buf u8 = make(nsrc * cols, 1, 0), f32 = make(nsrc * cols, 4, 0), lab = make(nsrc, 4, 0);
            buf idx = make(rows + 5, 8, 0), d = make(rows * cols, 4, off), cd = make(rows * cols, 4, 0);
            buf dl = make(rows, 4, off), cdl = make(rows, 4, 0);
            for (int64_t k = 0; k < nsrc * cols; k++) ((uint8_t *)u8.p)[k] = (uint8_t)next_u64();
            fill(F(f32), nsrc * cols, 1);
            for (int64_t k = 0; k < nsrc; k++) ((int32_t *)lab.p)[k] = (int32_t)(next_u64() % 1000);
            for (int64_t k = 0; k < rows + 5; k++) ((int64_t *)idx.p)[k] = (int64_t)(next_u64() % (uint64_t)nsrc);
            int64_t pos = 5, start = use_idx ? 0 : 3;
            const int64_t *ip = use_idx ? idx.p : NULL, *pp = use_pos ? &pos : NULL;
            /* the CPU gather takes no device position: move its start or index instead */
            const int64_t *cip = use_idx ? (const int64_t *)idx.p + (use_pos ? pos : 0) : NULL;
            int64_t cstart = start + (!use_idx && use_pos ? pos : 0);
            float scale = 1.0f / (255.0f * 0.3f), shift = -0.1307f / 0.3f;

            /* with the labels in the same pass (into dl2 / cdl2) on odd variants */
            buf dl2 = make(rows, 4, 0), cdl2 = make(rows, 4, 0);
            int32_t *ld = variant & 1 ? dl2.p : NULL, *cld = variant & 1 ? cdl2.p : NULL;
            const int32_t *ls = ld ? lab.p : NULL;
            KOK(cmlp_k_gather_u8(F(d), u8.p, ip, start, pp, rows, cols, scale, shift, ld, ls, S));
            CPU_CALL(cpu->gather_rows(NULL, F(cd), u8.p, CMLP_DTYPE_U8, cols, cip, cstart, NULL, rows, scale, shift, cld,
                                      ls));
            CHECK(first_diff(F(d), F(cd), rows * cols) < 0, "gather_u8 cols %lld variant %d", (long long)cols,
                  variant);
            CHECK(!ld || same_bits(ld, cld, (size_t)rows * 4), "gather_u8's labels variant %d", variant);
            KOK(cmlp_k_gather_f32(F(d), F(f32), ip, start, pp, rows, cols, 1.0f, 0.0f, ld, ls, S));
            CPU_CALL(cpu->gather_rows(NULL, F(cd), F(f32), CMLP_DTYPE_F32, cols, cip, cstart, NULL, rows, 1.0f, 0.0f,
                                      NULL, NULL));
            CHECK(first_diff(F(d), F(cd), rows * cols) < 0, "gather_f32 cols %lld variant %d", (long long)cols,
                  variant);
            CHECK(!ld || same_bits(ld, cld, (size_t)rows * 4), "gather_f32's labels variant %d", variant);
            for (int bf = 0; bf < 2; bf++)
                for (int src_u8 = 0; src_u8 < 2; src_u8++) {
                    buf h = make(rows * cols, 2, off), ch = make(rows * cols, 2, 0);
                    const void *src = src_u8 ? u8.p : f32.p;
                    float sc = src_u8 ? scale : 1.0f, sh = src_u8 ? shift : 0.0f;
                    memset(dl2.p, 0, (size_t)rows * 4);
                    KOK(cmlp_k_gather_half(h.p, bf, src, src_u8, ip, start, pp, rows, cols, sc, sh, ld, ls, S));
                    CHECK(!ld || same_bits(ld, cld, (size_t)rows * 4), "gather_half's labels variant %d", variant);
                    CPU_CALL(cpu->gather_rows_half(NULL, ch.p, bf ? CMLP_DTYPE_BF16 : CMLP_DTYPE_F16, src,
                                                   src_u8 ? CMLP_DTYPE_U8 : CMLP_DTYPE_F32, cols, cip, cstart, NULL,
                                                   rows, sc, sh, NULL, NULL));
                    CHECK(same_bits(h.p, ch.p, (size_t)(rows * cols) * 2), "gather_half cols %lld variant %d bf16 %d u8 %d",
                          (long long)cols, variant, bf, src_u8);
                    free(h.block), free(ch.block);
                }
            KOK(cmlp_k_gather_labels(dl.p, lab.p, ip, start, pp, rows, S));
            CPU_CALL(cpu->gather_labels(NULL, cdl.p, lab.p, cip, cstart, NULL, rows));
            CHECK(same_bits(dl.p, cdl.p, (size_t)rows * 4), "gather_labels variant %d", variant);
            free(u8.block), free(f32.block), free(lab.block), free(idx.block), free(d.block), free(cd.block);
            free(dl.block), free(cdl.block), free(dl2.block), free(cdl2.block);
        }
}

/* ---- optim.cu ---- */

static void test_adam(void) {
    for (int i = 0; i < NCOUNTS; i++)
        for (int variants = 0; variants < 32; variants++) {
            /* bit 0: weight decay; bit 1: coefficients on the device; variant % 8 = 4, 5: found_inf;
             * 6, 7: decoupled weight decay (AdamW); bit 3: AMSGrad (its maximum misaligned apart from
             * the others at odd counts, as a part of a sharded arena may be); bit 4: maximize */
            int64_t n = COUNTS[i];
            const bool ams = variants >> 3 & 1;
            const int maximize = variants >> 4 & 1, variant = variants % 8;
            int off = variant % 4 == 3 ? 1 : 0;
            buf p = make(n, 4, off), g = make(n, 4, off), m = make(n, 4, off), v = make(n, 4, off);
            buf x = make(n, 4, ams && n % 2 ? !off : off), cx = make(n, 4, 0);
            buf cp = make(n, 4, 0), cm = make(n, 4, 0), cv = make(n, 4, 0);
            fill(F(p), n, 1), fill(F(g), n, 1), fill(F(m), n, 1);
            for (int64_t k = 0; k < n; k++) F(v)[k] = uniform(0.0f, 1e-3f);
            for (int64_t k = 0; k < n; k++) F(x)[k] = uniform(0.0f, 1e-3f); /* above the new v here and there */
            memcpy(F(cp), F(p), (size_t)n * 4), memcpy(F(cm), F(m), (size_t)n * 4), memcpy(F(cv), F(v), (size_t)n * 4);
            memcpy(F(cx), F(x), (size_t)n * 4);
            float wd = variant & 1 && variant < 6 ? 0.01f : 0.0f;
            float decay = variant >= 6 ? (float)(1.0 - 1e-3 * 0.01) : 1.0f;
            /* from the device the decay and beta1 come with the coefficients (the arguments are then
             * ignored) */
            float coef[5] = {1.1e-3f, 0.3f, decay, 0.9f, 0.1f};
            if (variant & 2) decay = 0.5f;
            const float beta1 = variant & 2 ? 0.25f : 0.9f;
            float inf = variant == 4 ? 1.0f : 0.0f;
            const float *fi = variant == 4 || variant == 5 ? &inf : NULL, *cf = variant & 2 ? coef : NULL;
            const float one_b1 = (float)(1.0 - beta1), one_b2 = (float)(1.0 - 0.999);
            KOK(cmlp_k_adam(F(p), F(g), F(m), F(v), ams ? F(x) : NULL, n, 1e-3f, beta1, 0.999f, one_b1, one_b2, 0.05f,
                            1e-8f, wd, decay, maximize, fi, cf, S));
            CPU_CALL(cpu->adam(NULL, F(cp), F(g), F(cm), F(cv), ams ? F(cx) : NULL, n, 1e-3f, beta1, 0.999f, one_b1,
                               one_b2, 0.05f, 1e-8f, wd, decay, maximize, fi, cf, 0));
            CHECK(first_diff(F(p), F(cp), n) < 0 && first_diff(F(m), F(cm), n) < 0 && first_diff(F(v), F(cv), n) < 0 &&
                      first_diff(F(x), F(cx), n) < 0,
                  "adam n %lld variant %d amsgrad %d maximize %d", (long long)n, variant, ams, maximize);
            free(p.block), free(g.block), free(m.block), free(v.block), free(cp.block), free(cm.block), free(cv.block);
            free(x.block), free(cx.block);
        }
}

/* Whether every float of a is +0. */
static bool all_plus_zero(const float *a, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &a[i], sizeof u);
        if (u) return false;
    }
    return true;
}

/* The CPU's updates with zero_g: the same parameters and state as without, in blocks and over
 * the pool's threads at every edge, and every gradient +0 after, a skipped step's too. */
static void test_update_zero_g(void) {
    static const int64_t counts[] = {1, 2047, 2048, 2049, 4097, 70001};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        for (int variant = 0; variant < 8; variant++) {
            const int64_t n = counts[i];
            const bool adam = variant & 1, ams = variant & 2;
            const float inf = 1.0f, *fi = variant & 4 ? &inf : NULL;
            buf p = make(n, 4, 0), g = make(n, 4, 0), m = make(n, 4, 0), v = make(n, 4, 0), x = make(n, 4, 0);
            buf cp = make(n, 4, 0), cg = make(n, 4, 0), cm = make(n, 4, 0), cv = make(n, 4, 0), cx = make(n, 4, 0);
            buf og = make(n, 4, 0);
            fill(F(p), n, 1), fill(F(g), n, 1), fill(F(m), n, 1);
            for (int64_t k = 0; k < n; k++) F(v)[k] = uniform(0.0f, 1e-3f), F(x)[k] = uniform(0.0f, 1e-3f);
            F(g)[n / 2] = -0.0f; /* read as -0 first, then +0 */
            memcpy(F(cp), F(p), (size_t)n * 4), memcpy(F(cg), F(g), (size_t)n * 4), memcpy(F(og), F(g), (size_t)n * 4);
            memcpy(F(cm), F(m), (size_t)n * 4), memcpy(F(cv), F(v), (size_t)n * 4), memcpy(F(cx), F(x), (size_t)n * 4);
            if (adam) {
                CPU_CALL(cpu->adam(NULL, F(p), F(g), F(m), F(v), ams ? F(x) : NULL, n, 1e-3f, 0.9f, 0.999f, 0.1f,
                                   (float)(1.0 - 0.999), 0.05f, 1e-8f, 0.01f, 1.0f, 0, fi, NULL, 0));
                CPU_CALL(cpu->adam(NULL, F(cp), F(cg), F(cm), F(cv), ams ? F(cx) : NULL, n, 1e-3f, 0.9f, 0.999f,
                                   0.1f, (float)(1.0 - 0.999), 0.05f, 1e-8f, 0.01f, 1.0f, 0, fi, NULL, 1));
            } else { /* m: the momentum buffer (started), with momentum (ams) or without */
                const float momentum = ams ? 0.9f : 0.0f;
                CPU_CALL(cpu->sgd(NULL, F(p), F(g), F(m), n, 0.05f, momentum, 1.0f, 0, 1e-2f, 0, fi, NULL, 0));
                CPU_CALL(cpu->sgd(NULL, F(cp), F(cg), F(cm), n, 0.05f, momentum, 1.0f, 0, 1e-2f, 0, fi, NULL, 1));
            }
            CHECK(first_diff(F(p), F(cp), n) < 0 && first_diff(F(m), F(cm), n) < 0 && first_diff(F(v), F(cv), n) < 0 &&
                      first_diff(F(x), F(cx), n) < 0 && all_plus_zero(F(cg), n) && first_diff(F(g), F(og), n) < 0,
                  "update with zero_g n %lld variant %d", (long long)n, variant);
            free(p.block), free(g.block), free(m.block), free(v.block), free(x.block);
            free(cp.block), free(cg.block), free(cm.block), free(cv.block), free(cx.block), free(og.block);
        }
}

/* AMSGrad and maximize against the rule worked by hand (a few elements): the maximum keeps the
 * larger exp_avg_sq, a NaN in either gives a NaN, and maximize climbs. */
static void test_adam_amsgrad_rule(void) {
    float p[4] = {1.0f, 1.0f, 1.0f, 1.0f}, g[4] = {0.5f, -0.5f, 0.25f, 1.0f}, m[4] = {0, 0, 0, 0};
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f}, x[4] = {1.0f, 0.0f, NAN, 0.0f};
    KOK(cmlp_k_adam(p, g, m, v, x, 4, 0.1f, 0.5f, 0.75f, 0.5f, 0.25f, 1.0f, 0.0f, 0.0f, 1.0f, 1, NULL, NULL, S));
    /* v = 0.25 g^2 = {1/16, 1/16, 1/64, 1/4}; the maximum {1, 1/16, NaN, 1/4}; m = -g / 2;
     * p -= 0.1 m / sqrt(max): {1 + 0.025, 1 - 0.1, NaN, 1 + 0.1} */
    CHECK(v[0] == 0.0625f && x[0] == 1.0f && x[1] == 0.0625f && isnan(x[2]) && x[3] == 0.25f,
          "amsgrad maximum: %g %g %g %g", x[0], x[1], x[2], x[3]);
    CHECK(p[0] == 1.0f - 0.1f * -0.25f && p[1] == 1.0f - 0.1f * 0.25f / 0.25f && isnan(p[2]) &&
              p[3] == 1.0f - 0.1f * -0.5f / 0.5f,
          "amsgrad maximize update: %.9g %.9g %.9g %.9g", p[0], p[1], p[2], p[3]);
}

/* SGD's momentum buffer where it has not started: bits 0xFFFFFFFF, as a new buffer is filled. */
static float unstarted_bits(void) {
    const uint32_t u = CMLP_K_MOMENTUM_UNSTARTED;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void test_sgd(void) {
    for (int i = 0; i < NCOUNTS; i++)
        for (int variant = 0; variant < 48; variant++) {
            int64_t n = COUNTS[i];
            float momentum = variant & 1 ? 0.9f : 0.0f, keep = variant & 2 ? (float)(1.0 - 0.1) : 1.0f;
            int nesterov = variant >> 2 & 1, fresh = variant >> 3 & 1, off = (variant >> 4) % 3;
            float wd = variant % 3 ? 1e-2f : 0.0f;
            /* the rate and momentum from the device (momentum 0 there: plain steps, the buffer untouched) */
            const float coef[2] = {0.07f, variant % 11 == 3 ? 0.0f : momentum + 0.05f};
            const float *cf = variant % 11 < 4 ? coef : NULL;
            buf p = make(n, 4, off), g = make(n, 4, (off + variant) % 2), b = make(n, 4, off);
            buf cp = make(n, 4, 0), cb = make(n, 4, 0);
            fill(F(p), n, 1), fill(F(g), n, 1), fill(F(b), n, 1);
            for (int64_t j = 0; (fresh || variant % 17 < 6) && j < n; j += fresh ? 1 : 3)
                F(b)[j] = unstarted_bits(); /* not started there (fresh: a new buffer, the first step's) */
            for (int64_t j = 1; !fresh && variant % 5 == 1 && j < n; j += 7)
                F(b)[j] = NAN; /* started, and NaN: it stays */
            memcpy(F(cp), F(p), (size_t)n * 4), memcpy(F(cb), F(b), (size_t)n * 4);
            const int maximize = variant % 13 < 4;
            KOK(cmlp_k_sgd(F(p), F(g), F(b), n, 0.05f, momentum, keep, nesterov, wd, maximize, NULL, cf, S));
            CPU_CALL(cpu->sgd(NULL, F(cp), F(g), F(cb), n, 0.05f, momentum, keep, nesterov, wd, maximize, NULL, cf, 0));
            CHECK(first_diff(F(p), F(cp), n) < 0 && first_diff(F(b), F(cb), n) < 0, "sgd n %lld variant %d",
                  (long long)n, variant);
            float inf = 1.0f;
            memcpy(F(cp), F(p), (size_t)n * 4);
            KOK(cmlp_k_sgd(F(p), F(g), F(b), n, 0.05f, momentum, keep, nesterov, wd, maximize, &inf, cf, S));
            CHECK(first_diff(F(p), F(cp), n) < 0, "sgd with found_inf changed the parameters");
            free(p.block), free(g.block), free(b.block), free(cp.block), free(cb.block);
        }
    /* momentum 0 never touches the buffer, which may be NULL */
    float p[5] = {1, 2, 3, 4, 5}, g[5] = {1, 1, 1, 1, 1};
    KOK(cmlp_k_sgd(p, g, NULL, 5, 0.5f, 0.0f, 1.0f, 0, 0.0f, 0, NULL, NULL, S));
    CHECK(p[0] == 0.5f && p[4] == 4.5f, "sgd without momentum: %g %g", p[0], p[4]);
    KOK(cmlp_k_sgd(p, g, NULL, 5, 0.5f, 0.0f, 1.0f, 0, 0.0f, 1, NULL, NULL, S)); /* maximize: back up */
    CHECK(p[0] == 1.0f && p[4] == 5.0f, "sgd maximize without momentum: %g %g", p[0], p[4]);
    KOK(cmlp_k_sgd(p, g, NULL, 5, 0.5f, 0.0f, 1.0f, 0, 0.0f, 0, NULL, NULL, S));
    /* the rate (and momentum 0) on the device win over the arguments */
    const float rate[2] = {0.25f, 0.0f};
    KOK(cmlp_k_sgd(p, g, NULL, 5, 0.5f, 0.0f, 1.0f, 0, 0.0f, 0, NULL, rate, S));
    CHECK(p[0] == 0.25f && p[4] == 4.25f, "sgd at the device's rate: %g %g", p[0], p[4]);
    /* where the buffer has not started it starts from the gradient (torch's first step); a NaN it
     * holds otherwise stays, as torch's */
    float q[3] = {1.0f, 1.0f, 1.0f}, h[3] = {2.0f, 2.0f, 2.0f}, mb[3] = {unstarted_bits(), 4.0f, NAN};
    KOK(cmlp_k_sgd(q, h, mb, 3, 0.5f, 0.5f, 0.25f, 0, 0.0f, 0, NULL, NULL, S));
    CHECK(mb[0] == 2.0f && mb[1] == 2.5f && q[0] == 0.0f && q[1] == -0.25f && isnan(mb[2]) && isnan(q[2]),
          "sgd from a buffer not started: buffer %g %g %g, parameters %g %g %g", mb[0], mb[1], mb[2], q[0], q[1], q[2]);
}

static void test_optim_prepare(void) {
    for (int adam = 0; adam < 2; adam++)
        for (int k = 0; k < 3; k++) {
            /* k == 1: a rate and momentum per step and decoupled weight decay; k == 2: a late step */
            int64_t step = k == 2 ? 12345 : k, cstep = step, pos = 7, cpos = 7, cnext = 0;
            long long next = 0;
            const double rates[6] = {3e-4, 0.9, 0.125, 0.85, 7.5e-3, 0.0}; /* (lr, momentum) pairs */
            float coef[5] = {-1, -1, -1, -1, -1}, ccoef[5] = {-1, -1, -1, -1, -1}, inf = 0.0f;
            cmlp_k_rate r = {rates, k == 1 ? &next : NULL, k == 1 ? 0.05 : 0.0};
            cmlp_rate_src cr = {rates, k == 1 ? &cnext : NULL, r.decoupled_wd};
            KOK(cmlp_k_optim_prepare(&step, coef, &inf, r, 0.999, adam, &pos, 32, NULL, S));
            CPU_CALL(cpu->optim_prepare(NULL, &cstep, ccoef, &inf, &cr, 0.999, adam, &cpos, 32, NULL));
            CHECK(step == cstep && same_bits(coef, ccoef, sizeof coef) && pos == 39 && cpos == 39,
                  "optim_prepare adam %d step %lld pos %lld", adam, (long long)step, (long long)pos);
            CHECK(adam ? coef[0] == (float)(3e-4 / (1.0 - pow(0.9, (double)step))) &&
                             coef[2] == (k == 1 ? (float)(1.0 - 3e-4 * 0.05) : 1.0f) && coef[3] == 0.9f &&
                             coef[4] == (float)(1.0 - 0.9)
                       : coef[0] == 3e-4f && coef[1] == 0.9f,
                  "optim_prepare adam %d k %d: coefficients %g %g %g %g", adam, k, coef[0], coef[1], coef[2], coef[3]);
            inf = 1.0f; /* a skipped step moves the position and the rate on */
            KOK(cmlp_k_optim_prepare(&step, coef, &inf, r, 0.999, adam, &pos, 32, NULL, S));
            CHECK(step == cstep && pos == 71 && next == (k == 1 ? 2 : 0),
                  "optim_prepare counted a skipped step, or did not move the position or the rate");
            KOK(cmlp_k_optim_prepare(&step, coef, NULL, r, 0.999, adam, NULL, 32, NULL, S));
            CHECK(step == cstep + 1 &&
                      (adam ? coef[3] == (k == 1 ? 0.0f : 0.9f)
                            : coef[0] == (k == 1 ? 7.5e-3f : 3e-4f) && coef[1] == (k == 1 ? 0.0f : 0.9f)),
                  "optim_prepare without found_inf or a position: step %lld rate %g momentum %g", (long long)step,
                  coef[0], coef[adam ? 3 : 1]);
        }
}

/* Parameter groups' parts in optim_prepare: each part's coefficients at its own scale, decay,
 * momentum and beta2 (NaN: the step's and the one given), or with a table of scales per step at
 * the step's row of it (skipped steps move on too), the same bits from the kernel as from the CPU. */
static void test_optim_prepare_parts(void) {
    enum { NP = 3 };
    const double rates[8] = {3e-4, 0.9, 0.125, 0.85, 7.5e-3, 0.0, 1e-2, 0.5};
    const double parts[CMLP_PART_ARGS * NP] = {1.0, 0.0, NAN, NAN, 0.5, 0.05, 0.5, 0.99, 0.25, 0.0, 0.0, NAN};
    /* each step's (scale, momentum) of each part; a NaN momentum: the part's own, else the step's */
    const double table[2 * 4 * NP] = {1.0, NAN, 0.5, 0.3, 0.25, NAN, 0.9, 0.2, 1.0, NAN, 0.1, NAN,
                                      0.0, NAN, 0.75, 0.6, 1.0, 0.4, 0.3, NAN, 0.2, NAN, 0.1, 0.0};
    for (int adam = 0; adam < 2; adam++)
        for (int per_step = 0; per_step < 2; per_step++) {
            int64_t step = 4, cstep = 4;
            long long next = 0;
            int64_t cnext = 0;
            float coef[5], ccoef[5], pc[5 * NP], cpc[5 * NP], inf = 0.0f;
            cmlp_k_rate r = {rates, &next, 0.0, NP, parts, pc, per_step ? table : NULL};
            cmlp_rate_src cr = {rates, &cnext, 0.0, NP, parts, cpc, per_step ? table : NULL};
            for (int t = 0; t < 4; t++) {
                inf = t == 1 ? 1.0f : 0.0f; /* the second step is skipped: its row is passed over */
                memset(pc, 0, sizeof pc), memset(cpc, 0, sizeof cpc);
                KOK(cmlp_k_optim_prepare(&step, coef, &inf, r, 0.999, adam, NULL, 0, NULL, S));
                CPU_CALL(cpu->optim_prepare(NULL, &cstep, ccoef, &inf, &cr, 0.999, adam, NULL, 0, NULL));
                CHECK(step == cstep && next == cnext && same_bits(pc, cpc, sizeof pc),
                      "optim_prepare parts adam %d per step %d step %d", adam, per_step, t);
                if (t == 1) continue;
                /* SGD's part rate is the step's rate times the part's scale, rounded once */
                for (int p = 0; p < NP; p++) { /* and each part's momentum: the row's, its own or the step's */
                    const double *row = table + 2 * (t * NP + p);
                    const double scale = per_step ? row[0] : parts[CMLP_PART_ARGS * p];
                    double mom = p == 0 ? rates[2 * t + 1] : parts[CMLP_PART_ARGS * p + 2];
                    if (per_step && !isnan(row[1])) mom = row[1];
                    const bool rate_ok = adam || pc[5 * p] == (float)(rates[2 * t] * scale);
                    CHECK(pc[5 * p + (adam ? 3 : 1)] == (float)mom && rate_ok,
                          "part %d of step %d (adam %d) at %g and momentum %g, not %g and %g", p, t, adam, pc[5 * p],
                          pc[5 * p + (adam ? 3 : 1)], (float)(rates[2 * t] * scale), (float)mom);
                }
                /* Adam's part 1 at its own beta1 and beta2, part 2 at beta1 0 and the beta2 given */
                const int64_t at = cstep;
                const double sc1 = per_step ? table[2 * (t * NP + 1)] : 0.5;
                const double sc2 = per_step ? table[2 * (t * NP + 2)] : 0.25;
                CHECK(per_step || !adam || (pc[5] == (float)(rates[2 * t] * sc1 / (1.0 - pow(0.5, (double)at))) &&
                                pc[6] == (float)sqrt(1.0 - pow(0.99, (double)at)) && pc[8] == 0.5f &&
                                pc[10] == (float)(rates[2 * t] * sc2) &&
                                pc[11] == (float)sqrt(1.0 - pow(0.999, (double)at)) && pc[13] == 0.0f),
                      "Adam's parts of step %d not at their own betas: %g %g %g / %g %g %g", t, pc[5], pc[6], pc[8],
                      pc[10], pc[11], pc[13]);
            }
        }
}

/* Adam with its bookkeeping in one launch: the bits of cmlp_k_optim_prepare then cmlp_k_adam, over
 * several steps (the block counter is back at 0 after each), with and without a skip, a loss
 * scale and a data position, across launches of one block to many. */
static void test_adam_prepared(void) {
    static const int64_t counts[] = {1, 5, 257, 1029, 100003};
    for (int i = 0; i < 5; i++)
        for (int variant = 0; variant < 8; variant++) {
            /* bit 0: weight decay (L2 at odd counts, else decoupled) and a misaligned start; bit 1:
             * loss scale; bit 2: found_inf and a position */
            int64_t n = counts[i];
            int off = variant & 1;
            buf p = make(n, 4, off), g = make(n, 4, off), m = make(n, 4, off), v = make(n, 4, off);
            buf rp = make(n, 4, 0), rm = make(n, 4, 0), rv = make(n, 4, 0);
            /* AMSGrad's maximum and maximize where the count is odd (at every variant but one) */
            const bool ams = n % 2 == 1 && variant != 5;
            buf x = make(n, 4, off), rx = make(n, 4, 0);
            fill(F(p), n, 1), fill(F(g), n, 1), fill(F(m), n, 1);
            for (int64_t k = 0; k < n; k++) F(v)[k] = uniform(0.0f, 1e-3f);
            for (int64_t k = 0; k < n; k++) F(x)[k] = uniform(0.0f, 1e-3f);
            memcpy(F(rp), F(p), (size_t)n * 4), memcpy(F(rm), F(m), (size_t)n * 4), memcpy(F(rv), F(v), (size_t)n * 4);
            memcpy(F(rx), F(x), (size_t)n * 4);
            const bool decoupled = (variant & 1) && i % 2 == 0;
            float wd = variant & 1 && !decoupled ? 0.01f : 0.0f, coef[5] = {0, 0, 0, 0, 0}, rcoef[5] = {0, 0, 0, 0, 0};
            /* variant 2, 3, 6, 7: a rate and beta1 per step */
            const double rates[8] = {3e-4, 0.9, 1e-2, 0.5, 2.5e-5, 0.0, 0.75, 0.95};
            long long next = 0, rnext = 0;
            const cmlp_k_rate rate = {rates, variant & 2 ? &next : NULL, decoupled ? 0.05 : 0.0};
            const cmlp_k_rate rrate = {rates, variant & 2 ? &rnext : NULL, rate.decoupled_wd};
            float scale = 1024.0f, rscale = scale, inf = 0.0f;
            int32_t tr = 0, rtr = 0;
            long long skipped = 0, rskipped = 0;
            int64_t step = 3, rstep = 3, pos = 5, rpos = 5;
            unsigned int done = 0;
            cmlp_k_scaler ks = {&scale, &tr, &skipped, 2.0, 0.5, 2}, rks = {&rscale, &rtr, &rskipped, 2.0, 0.5, 2};
            const cmlp_k_scaler *sc = variant & 2 ? &ks : NULL, *rsc = variant & 2 ? &rks : NULL;
            const float *fi = variant & 4 ? &inf : NULL;
            int64_t *pp = variant & 4 ? &pos : NULL, *rpp = variant & 4 ? &rpos : NULL;
            for (int t = 0; t < 4; t++) {
                inf = t == 2 ? 1.0f : 0.0f; /* read only where fi is set */
                KOK(cmlp_k_adam_prepared(F(p), F(g), F(m), F(v), ams ? F(x) : NULL, n, rate, 0.999, 1e-8f, wd, ams, fi,
                                         &step, coef, pp, 32, sc, &done, S));
                KOK(cmlp_k_optim_prepare(&rstep, rcoef, fi, rrate, 0.999, 1, rpp, 32, rsc, S));
                KOK(cmlp_k_adam(F(rp), F(g), F(rm), F(rv), ams ? F(rx) : NULL, n, 0.0f, 0.0f, 0.999f, 0.0f,
                                (float)(1.0 - 0.999), 1.0f, 1e-8f, wd, 1.0f, ams, fi, rcoef, S));
                CHECK(first_diff(F(p), F(rp), n) < 0 && first_diff(F(m), F(rm), n) < 0 &&
                          first_diff(F(v), F(rv), n) < 0 && first_diff(F(x), F(rx), n) < 0 && step == rstep &&
                          same_bits(coef, rcoef, sizeof coef) &&
                          pos == rpos && same_bits(&scale, &rscale, 4) && tr == rtr && skipped == rskipped &&
                          done == 0 && next == rnext && next == (variant & 2 ? t + 1 : 0),
                      "adam_prepared n %lld variant %d step %d: step %lld/%lld pos %lld/%lld done %u", (long long)n,
                      variant, t, (long long)step, (long long)rstep, (long long)pos, (long long)rpos, done);
            }
            CHECK(step == (variant & 4 ? 6 : 7) && (!(variant & 4) || pos == 5 + 4 * 32),
                  "adam_prepared counted %lld steps to position %lld", (long long)step, (long long)pos);
            free(p.block), free(g.block), free(m.block), free(v.block), free(rp.block), free(rm.block), free(rv.block);
            free(x.block), free(rx.block);
        }
}

/* ---- amp.cu ---- */

static void test_casts(void) {
    /* every half bit pattern, both formats, and back */
    const int64_t n = 65536;
    for (int bf = 0; bf < 2; bf++)
        for (int off = 0; off < 2; off++) {
            buf h = make(n, 2, off), f = make(n, 4, off ? 0 : 1), cf = make(n, 4, 0), h2 = make(n, 2, 0),
                ch2 = make(n, 2, 0);
            for (int64_t k = 0; k < n; k++) ((uint16_t *)h.p)[k] = (uint16_t)k;
            KOK(cmlp_k_from_half(F(f), h.p, n, bf, S));
            CPU_CALL(cpu->from_half(NULL, F(cf), h.p, n, bf ? CMLP_DTYPE_BF16 : CMLP_DTYPE_F16));
            int64_t bad = -1;
            for (int64_t k = 0; k < n && bad < 0; k++)
                if (!(isnan(F(f)[k]) ? isnan(F(cf)[k]) : same_bits(F(f) + k, F(cf) + k, 4))) bad = k;
            CHECK(bad < 0, "from_half bf16 %d: pattern %lld", bf, (long long)bad);
            KOK(cmlp_k_to_half(h2.p, F(f), n, bf, S));
            CPU_CALL(cpu->to_half(NULL, ch2.p, F(cf), n, bf ? CMLP_DTYPE_BF16 : CMLP_DTYPE_F16));
            bad = -1;
            for (int64_t k = 0; k < n && bad < 0; k++) {
                uint16_t a = ((uint16_t *)h2.p)[k], c = ((uint16_t *)ch2.p)[k];
                if (!(isnan(F(f)[k]) ? a != 0 : a == c)) bad = k; /* NaNs stay NaN, payload aside */
            }
            CHECK(bad < 0, "to_half round trip bf16 %d: pattern %lld", bf, (long long)bad);
            free(h.block), free(f.block), free(cf.block), free(h2.block), free(ch2.block);
        }
    /* float values that round: ties, overflow, the subnormal range of each format */
    for (int bf = 0; bf < 2; bf++)
        for (int i = 0; i < NCOUNTS; i++) {
            int64_t n = COUNTS[i] * 7;
            buf f = make(n, 4, i % 4), h = make(n, 2, i % 3), ch = make(n, 2, 0);
            for (int64_t k = 0; k < n; k++) {
                uint32_t bits = (uint32_t)next_u64();
                if (k % 3 == 0) bits = (bits & 0x807FFFFFu) | (uint32_t)(100 + k % 60) << 23; /* near the ranges */
                if (k % 5 == 0) bits = (bits & 0xFFFF0000u) | 0x8000u;                        /* a bf16 tie */
                if (k % 11 == 0) bits = (bits & 0xFFFFE000u) | 0x1000u;                       /* an fp16 tie */
                memcpy(F(f) + k, &bits, 4);
            }
            KOK(cmlp_k_to_half(h.p, F(f), n, bf, S));
            CPU_CALL(cpu->to_half(NULL, ch.p, F(f), n, bf ? CMLP_DTYPE_BF16 : CMLP_DTYPE_F16));
            int64_t bad = -1;
            for (int64_t k = 0; k < n && bad < 0; k++) {
                uint16_t a = ((uint16_t *)h.p)[k], c = ((uint16_t *)ch.p)[k];
                if (!(isnan(F(f)[k]) ? a != 0 : a == c)) bad = k;
            }
            CHECK(bad < 0, "to_half bf16 %d n %lld: element %lld", bf, (long long)n, (long long)bad);
            free(f.block), free(h.block), free(ch.block);
        }
}

static void test_unscale(void) {
    for (int i = 0; i < NCOUNTS; i++)
        for (int variant = 0; variant < 8; variant++) {
            /* bit 0: scale on the device; bit 1: a non-finite value (bit 2: in the last element) */
            int64_t n = COUNTS[i];
            buf g = make(n, 4, (i + variant) % 4), cg = make(n, 4, 0);
            fill(F(g), n, 1);
            if (variant & 2) F(g)[variant & 4 ? n - 1 : (int64_t)(next_u64() % (uint64_t)n)] = variant & 1 ? INFINITY : NAN;
            if (variant == 4) F(g)[n - 1] = 3e38f; /* finite, but not once multiplied by 4 */
            memcpy(F(cg), F(g), (size_t)n * 4);
            float scale = 0.25f, inv = 4.0f, fi = 0.0f, cfi = 0.0f;
            const float *sp = variant & 1 ? &scale : NULL;
            KOK(cmlp_k_unscale(F(g), n, inv, sp, &fi, S));
            CPU_CALL(cpu->unscale(NULL, F(cg), n, inv, sp, &cfi));
            int64_t bad = -1;
            for (int64_t k = 0; k < n && bad < 0; k++)
                if (!(isnan(F(g)[k]) ? isnan(F(cg)[k]) : same_bits(F(g) + k, F(cg) + k, 4))) bad = k;
            CHECK(bad < 0 && fi == cfi, "unscale n %lld variant %d: element %lld, found_inf %g vs %g", (long long)n,
                  variant, (long long)bad, fi, cfi);
            free(g.block), free(cg.block);
        }
}

/* The loss-scale update, done by the optimizer's prepare: PyTorch's rule, step for step as the
 * CPU does it (growth, backoff, growth that would overflow) */
static void test_scale_update(void) {
    float scale = 65536.0f, cscale = scale, coef[5], ccoef[5];
    const double rate[2] = {1e-3, 0.9};
    const cmlp_k_rate r = {rate, NULL, 0.0};
    const cmlp_rate_src cr = {rate, NULL, 0.0};
    int32_t tr = 0, ctr = 0;
    long long skipped = 0;
    int64_t cskipped = 0, step = 0, cstep = 0;
    for (int k = 0; k < 300; k++) {
        float fi = k % 37 == 5 ? 1.0f : 0.0f;
        if (k == 200) scale = cscale = 3e38f; /* growth would overflow: kept */
        cmlp_k_scaler ks = {&scale, &tr, &skipped, 2.0, 0.5, 7};
        cmlp_scale_step cs = {&cscale, &ctr, &cskipped, 2.0, 0.5, 7};
        KOK(cmlp_k_optim_prepare(&step, coef, &fi, r, 0.999, 1, NULL, 0, &ks, S));
        CPU_CALL(cpu->optim_prepare(NULL, &cstep, ccoef, &fi, &cr, 0.999, 1, NULL, 0, &cs));
        CHECK(same_bits(&scale, &cscale, 4) && tr == ctr && skipped == (long long)cskipped && step == cstep &&
                  same_bits(coef, ccoef, sizeof coef),
              "scale update step %d: %g/%d vs %g/%d", k, scale, tr, cscale, ctr);
    }
    CHECK(skipped == 8 && scale == 3e38f, "scale update: %lld skipped, scale %g", skipped, scale);
}

/* ---- clip.cu ---- */

/* The gradient norm: the CPU backend's bits for p = 1, 2 and +-inf (the same order of summation),
 * within float rounding of a long double reference; partials and counter as promised. */
static void test_grad_norm(void) {
    static const int64_t counts[] = {1, 3, 4, 5, 257, 4095, 4096, 4097, 12299, 131089, 140000};
    static const double ps[] = {2.0, 1.0, INFINITY, -INFINITY, 3.5, 0.5, -1.5};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        for (int variant = 0; variant < 4; variant++) { /* 1: specials; 2: one inf; 3: one NaN */
            int64_t n = counts[i];
            buf g = make(n, 4, (int)(i + variant) % 4);
            fill(F(g), n, variant == 1);
            if (variant >= 2) F(g)[(int64_t)(next_u64() % (uint64_t)n)] = variant == 2 ? -INFINITY : NAN;
            for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) {
                const double p = ps[k];
                double part[CMLP_NORM_PARTS], cpart[CMLP_NORM_PARTS];
                unsigned int done = 0;
                uint32_t cdone = 0;
                float out = -1.0f, cout = -2.0f;
                KOK(cmlp_k_grad_norm(F(g), n, p, &out, part, &done, S));
                CPU_CALL(cpu->grad_norm(NULL, F(g), n, p, &cout, cpart, &cdone));
                long double ref = p == -INFINITY ? INFINITY : 0.0L;
                for (int64_t e = 0; e < n; e++) {
                    long double a = fabsl((long double)F(g)[e]);
                    if (a < FLT_MIN) a = 0.0L; /* DAZ */
                    if (p == INFINITY) ref = a > ref || isnan(a) ? a : ref;
                    else if (p == -INFINITY) ref = a < ref || isnan(a) ? a : ref;
                    else ref += powl(a, (long double)p);
                }
                if (!isinf(p)) ref = powl(ref, 1.0L / (long double)p);
                const int blocks = (int)cmlp_norm_blocks(n);
                const bool exact = p == 1.0 || p == 2.0 || isinf(p);
                bool same = same_bits(&out, &cout, 4) || (isnan(out) && isnan(cout));
                for (int b = 0; exact && b < blocks; b++) /* a NaN's payload may differ */
                    same = same && (same_bits(part + b, cpart + b, 8) || (isnan(part[b]) && isnan(cpart[b])));
                if (!exact) same = same || fabsf(out - cout) <= 1e-6f * fabsf(cout);
                bool close = variant == 3              ? isnan(out)
                             : variant == 2 && p > 0.0 ? isinf(out) && out > 0
                                                       : (long double)out == ref ||
                                                             fabsl((long double)out - ref) <= 1.2e-7L * ref + 1e-30L;
                CHECK(same && close && done == 0, "grad_norm n %lld p %g variant %d: %.9g vs cpu %.9g, ref %.9Lg",
                      (long long)n, p, variant, out, cout, ref);
            }
            free(g.block);
        }
    float x = 0.0f, o = 0.0f;
    double part[CMLP_NORM_PARTS];
    unsigned int done = 0;
    CHECK(cmlp_k_grad_norm(&x, 0, 2.0, &o, part, &done, S) == cudaErrorInvalidValue, "grad_norm n 0");
    CHECK(cmlp_k_grad_norm(&x, 1, 0.0, &o, part, &done, S) == cudaErrorInvalidValue, "grad_norm p 0");
    CHECK(cmlp_k_grad_norm(&x, 1, NAN, &o, part, &done, S) == cudaErrorInvalidValue, "grad_norm p NaN");
}

/* Scaling by a norm read on the device, and clamping: the CPU's bits, the counting of finite
 * norms, nothing written at a coefficient of 1. A subnormal compares as zero (DAZ), so clamping
 * to [0, 0] keeps it. */
static void test_clip(void) {
    static const float norms[] = {10.0f, 0.5f, 1.0f, INFINITY, NAN, 0.0f, 3e-39f};
    for (int i = 0; i < NCOUNTS; i++)
        for (size_t k = 0; k < sizeof norms / sizeof norms[0]; k++) {
            int64_t n = COUNTS[i];
            buf g = make(n, 4, (int)(i + k) % 4), cg = make(n, 4, 0);
            fill(F(g), n, 1);
            if (k == 3 && n > 2) F(g)[1] = INFINITY;
            memcpy(F(cg), F(g), (size_t)n * 4);
            const float norm = norms[k], max_norm = 2.0f;
            double sum = 0.5, csum = 0.5;
            long long steps = 3;
            int64_t csteps = 3;
            KOK(cmlp_k_clip_by_norm(F(g), n, &norm, max_norm, &sum, &steps, S));
            CPU_CALL(cpu->clip_by_norm(NULL, F(cg), n, &norm, max_norm, &csum, &csteps));
            int64_t bad = -1;
            for (int64_t e = 0; e < n && bad < 0; e++)
                if (!(isnan(F(g)[e]) ? isnan(F(cg)[e]) : same_bits(F(g) + e, F(cg) + e, 4))) bad = e;
            const bool finite = isfinite(norm);
            CHECK(bad < 0 && same_bits(&sum, &csum, 8) && steps == (long long)csteps &&
                      steps == 3 + (finite ? 1 : 0) && sum == 0.5 + (finite ? (double)norm : 0.0),
                  "clip_by_norm n %lld norm %g: element %lld, sum %g/%g steps %lld/%lld", (long long)n, norm,
                  (long long)bad, sum, csum, steps, (long long)csteps);
            if (norm <= 1.0f) { /* max_norm / (norm + 1e-6) > 1: unchanged, bit for bit */
                fill(F(cg), n, 1);
                memcpy(F(g), F(cg), (size_t)n * 4);
                KOK(cmlp_k_clip_by_norm(F(g), n, &norm, max_norm, NULL, NULL, S));
                CHECK(first_diff(F(g), F(cg), n) < 0, "clip_by_norm n %lld norm %g changed the gradients", (long long)n,
                      norm);
            }
            free(g.block), free(cg.block);
        }
    /* a norm above 2^126: torch's float arithmetic keeps the subnormal reciprocal (and a
     * subnormal coefficient), and so do both backends; only a product that is itself subnormal is
     * flushed. The reference is float arithmetic outside the core's environment (subnormals kept). */
    static const float huge[][2] = {{1e38f, 1000.0f}, {3.2e38f, 2.0f}, {9e37f, 1.0f}, {3.4e38f, 7e4f}};
    for (int i = 0; i < NCOUNTS; i++)
        for (int k = 0; k < 4; k++) {
            int64_t n = COUNTS[i];
            buf g = make(n, 4, (i + k) % 4), cg = make(n, 4, 0), orig = make(n, 4, 0);
            fill(F(g), n, 1);
            for (int64_t e = 0; e < n; e++) F(g)[e] *= e % 3 ? 3e37f : 1e-3f;
            memcpy(F(cg), F(g), (size_t)n * 4), memcpy(F(orig), F(g), (size_t)n * 4);
            const float norm = huge[k][0], max_norm = huge[k][1];
            KOK(cmlp_k_clip_by_norm(F(g), n, &norm, max_norm, NULL, NULL, S));
            CPU_CALL(cpu->clip_by_norm(NULL, F(cg), n, &norm, max_norm, NULL, NULL));
            volatile float r = 1.0f / (norm + 1e-6f);
            volatile float c = r * max_norm;
            int64_t bad = -1, kept = 0;
            for (int64_t e = 0; e < n && bad < 0; e++) {
                volatile float want = F(orig)[e] * c;
                if (fabsf(want) < FLT_MIN) want = 0.0f * want; /* flushed, with its sign */
                if (!same_bits(F(g) + e, F(cg) + e, 4) || !same_bits(F(g) + e, (const float *)&want, 4)) bad = e;
                kept += want != 0.0f;
            }
            CHECK(bad < 0 && r < FLT_MIN && (n < 3 || kept > 0),
                  "clip_by_norm n %lld norm %g max_norm %g (coefficient %g): element %lld", (long long)n, norm,
                  max_norm, c, (long long)bad);
            free(g.block), free(cg.block), free(orig.block);
        }
    for (int i = 0; i < NCOUNTS; i++)
        for (int variant = 0; variant < 3; variant++) {
            int64_t n = COUNTS[i];
            buf g = make(n, 4, (i + variant) % 4), cg = make(n, 4, 0);
            fill(F(g), n, 1);
            if (variant == 1) F(g)[n - 1] = NAN;
            if (variant == 2) F(g)[0] = -INFINITY;
            memcpy(F(cg), F(g), (size_t)n * 4);
            const float v = variant == 2 ? 0.0f : 0.75f;
            KOK(cmlp_k_clip_by_value(F(g), n, v, S));
            CPU_CALL(cpu->clip_by_value(NULL, F(cg), n, v));
            int64_t bad = -1;
            for (int64_t e = 0; e < n && bad < 0; e++) {
                const float a = F(g)[e];
                if (!(isnan(a) ? isnan(F(cg)[e]) : same_bits(F(g) + e, F(cg) + e, 4) && (fabsf(a) <= v || fabsf(a) < FLT_MIN))) bad = e;
            }
            CHECK(bad < 0 && (variant != 1 || isnan(F(g)[n - 1])), "clip_by_value n %lld variant %d: element %lld",
                  (long long)n, variant, (long long)bad);
            free(g.block), free(cg.block);
        }
    float x = 0.0f;
    CHECK(cmlp_k_clip_by_value(&x, 1, -1.0f, S) == cudaErrorInvalidValue, "clip_by_value v < 0");
    CHECK(cmlp_k_clip_by_norm(&x, 1, &x, 1.0f, NULL, (long long *)&x, S) == cudaErrorInvalidValue,
          "clip_by_norm: a count without a sum");
}

static void test_bad_counts(void) {
    float x = 0;
    CHECK(cmlp_k_relu_backward(&x, &x, -1, S) == cudaErrorInvalidValue, "negative count");
    CHECK(cmlp_k_bias_act(&x, &x, -1, 1, 0, S) == cudaErrorInvalidValue, "negative rows");
    KOK(cmlp_k_adam(&x, &x, &x, &x, NULL, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, NULL, NULL, S));
    KOK(cmlp_k_bias_grad(&x, &x, 0, 5, 0, NULL, 0, S));
}

int main(void) {
    test_bias_act();
    test_relu_backward();
    test_bias_grad();
    test_relu_backward_half();
    test_relu_backward_bias_grad();
    test_softmax_xent();
    test_softmax_xent_total_is_fixed();
    test_rows_half();
    test_gather();
    test_adam();
    test_sgd();
    test_optim_prepare();
    test_adam_prepared();
    test_adam_amsgrad_rule();
    test_update_zero_g();
    test_optim_prepare_parts();
    test_casts();
    test_unscale();
    test_scale_update();
    test_grad_norm();
    test_clip();
    test_bad_counts();
    return check_summary();
}
