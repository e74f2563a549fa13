/* loss.cu - fused softmax cross-entropy with label smoothing: per-row loss, the gradient of
 * the logits, and the count of correct argmaxes. One warp per row; rows up to 128 wide are
 * read once into registers, wider rows are read three times (max, sums, gradient).
 *
 * The arithmetic follows the CPU backend operation for operation: the max is the first maximum
 * (a NaN in column 0 makes it NaN; a NaN elsewhere never wins), the argmax counted as correct is
 * torch.argmax's (the first NaN where there is one, else the first maximum), the sums of exp
 * and of the logits and the loss are in double, and
 * p_c = expf(x_c - max) * (float)(1 / sum) in float, expf evaluated in double and rounded once
 * (glibc's expf is within 0.502 ulp of exact; CUDA's expf is within 2). What differs is the
 * order of the two row sums (a warp tree instead of left to right) and of the loss total, which
 * with scratch is still the same in every run: the blocks leave their parts there and the last
 * one to finish joins them by a tree fixed by their number, instead of adding them atomically in
 * the order they finish.
 */
#include <math.h>

#include "common.cuh"
#include "kernels.h"

#define XENT_THREADS 256
#define XENT_WARPS (XENT_THREADS / 32)

/* Running first maximum over (value, column) pairs, comparing as the CPU does under DAZ: a
 * pair wins when strictly greater, or equal at a lower column (which matters only when lanes
 * are combined: each lane visits its columns in increasing order). NaN values come in as -inf,
 * so they never win. A total order, so the warp butterfly leaves every lane the same pair. */
__device__ __forceinline__ void argmax_take(float &bv, int64_t &bi, float v, int64_t i) {
    if (f_gt(v, bv) || (f_eq(v, bv) && i < bi)) {
        bv = v;
        bi = i;
    }
}

struct xent_args {
    const float *logits;
    const int32_t *labels;
    int64_t rows, cols;
    float smoothing, grad_weight;
    const float *scale; /* when set, the weight is *scale / count (a loss-scaled step) */
    double count;
    float *found_inf; /* when set, reset by the first thread */
    void *dlogits;                /* float, or fp16 / bf16 bits (OUT 1, 2) */
    double *loss_sum;
    unsigned long long *correct;
    double *part;             /* with scratch: a part per block, then the blocks done */
    unsigned int *blocks_done;
};

/* K > 0: each lane keeps columns lane + 32 k, k < K, in registers (cols <= 32 K).
 * K == 0: any cols, three passes over global memory. Either way a lane only ever reads and
 * writes its own columns, and reads each one before writing it, so dlogits may alias logits. */
/* dlogits[i] = v, stored as float (OUT 0) or rounded once to fp16 / bf16 (OUT 1, 2) */
template <int OUT>
__device__ __forceinline__ void store_grad(void *d, int64_t i, float v) {
    if constexpr (OUT == 0) static_cast<float *>(d)[i] = v;
    else static_cast<uint16_t *>(d)[i] = to_half1<OUT == 2>(v);
}

template <int K, int OUT>
__global__ void __launch_bounds__(XENT_THREADS) k_softmax_xent(xent_args a) {
    if (a.scale) a.grad_weight = (float)((double)*a.scale / a.count);
    if (a.found_inf && blockIdx.x == 0 && threadIdx.x == 0) *a.found_inf = 0.0f;
    __shared__ double s_loss[XENT_WARPS];
    __shared__ unsigned long long s_hits[XENT_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t cols = a.cols;
    const float off = f_div(a.smoothing, (float)cols), on = f_add(f_sub(1.0f, a.smoothing), off);
    const double keep = 1.0 - (double)a.smoothing, spread = (double)a.smoothing / (double)cols;
    double loss = 0.0;
    unsigned long long hits = 0;

    for (int64_t r = (int64_t)blockIdx.x * XENT_WARPS + warp; r < a.rows; r += (int64_t)gridDim.x * XENT_WARPS) {
        const float *x = a.logits + r * cols;
        const int32_t y = a.labels[r];
        float xv[K > 0 ? K : 1];

        /* max and first argmax */
        float bv = -INFINITY;
        int64_t bi = cols, nan_at = cols; /* no column yet; no NaN yet (each lane's first) */
        int nan0 = 0;
        if constexpr (K > 0) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int64_t c = lane + 32 * k;
                xv[k] = c < cols ? x[c] : 0.0f;
                if (c < cols) argmax_take(bv, bi, isnan(xv[k]) ? -INFINITY : xv[k], c);
                if (c < cols && isnan(xv[k]) && nan_at == cols) nan_at = c;
            }
            nan0 = lane == 0 && isnan(xv[0]);
        } else {
            for (int64_t c = lane; c < cols; c += 32) {
                const float v = x[c];
                if (c == 0) nan0 = isnan(v);
                argmax_take(bv, bi, isnan(v) ? -INFINITY : v, c);
                if (isnan(v) && nan_at == cols) nan_at = c;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(CMLP_FULL_WARP, bv, o);
            const int64_t oi = __shfl_xor_sync(CMLP_FULL_WARP, bi, o);
            const int64_t on = __shfl_xor_sync(CMLP_FULL_WARP, nan_at, o);
            argmax_take(bv, bi, ov, oi);
            if (on < nan_at) nan_at = on;
        }
        nan0 = __shfl_sync(CMLP_FULL_WARP, nan0, 0);
        const float mx = nan0 ? NAN : bv;
        const int64_t arg = nan_at < cols ? nan_at : bi;

        /* sum of exp(x - max) and of x, in double; the label's logit */
        const double mxd = f_to_double(mx);
        double sum = 0.0, xsum = 0.0;
        float xl = 0.0f;
        if constexpr (K > 0) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int64_t c = lane + 32 * k;
                if (c < cols) {
                    const double v = f_to_double(xv[k]);
                    sum = __dadd_rn(sum, exp(v - mxd)); /* (no FMA with exp's last product) */
                    xsum += v;
                    if (c == y) xl = xv[k];
                }
            }
        } else {
            for (int64_t c = lane; c < cols; c += 32) {
                const float xc = x[c];
                const double v = f_to_double(xc);
                sum = __dadd_rn(sum, exp(v - mxd));
                xsum += v;
                if (c == y) xl = xc;
            }
        }
        sum = cmlp_warp_sum(sum);
        xsum = cmlp_warp_sum(xsum);
        const bool valid = y >= 0 && (int64_t)y < cols;
        xl = __shfl_sync(CMLP_FULL_WARP, xl, valid ? (int)(y & 31) : 0);
        if (!valid) xl = 0.0f;
        /* lse - (1 - e) x_y - e / C sum_c x_c, products kept out of FMAs as on the CPU */
        const double lse = __dadd_rn(mxd, log(sum));
        /* (without smoothing no sum of the logits: an infinite one would make a NaN of 0 * inf) */
        const double spread_sum = spread != 0.0 ? __dmul_rn(spread, xsum) : 0.0;
        loss += __dsub_rn(__dsub_rn(lse, __dmul_rn(keep, f_to_double(xl))), spread_sum);
        hits += arg == (int64_t)y;

        /* dlogits = grad_weight * (p - q) */
        if (a.dlogits) {
            const int64_t d = r * cols;
            const float inv = (float)(1.0 / sum);
            if constexpr (K > 0) {
#pragma unroll
                for (int k = 0; k < K; k++) {
                    const int64_t c = lane + 32 * k;
                    if (c < cols) {
                        const float p = f_mul(f_from_double(exp((double)f_sub(xv[k], mx))), inv);
                        store_grad<OUT>(a.dlogits, d + c, f_mul(a.grad_weight, f_sub(p, c == y ? on : off)));
                    }
                }
            } else {
                for (int64_t c = lane; c < cols; c += 32) {
                    const float p = f_mul(f_from_double(exp((double)f_sub(x[c], mx))), inv);
                    store_grad<OUT>(a.dlogits, d + c, f_mul(a.grad_weight, f_sub(p, c == y ? on : off)));
                }
            }
        }
    }

    /* the block's totals: the hits by an atomic (integers add in any order), the loss by an
     * atomic too without scratch, else left in the block's part */
    __shared__ bool s_last;
    if (lane == 0) {
        s_loss[warp] = loss;
        s_hits[warp] = hits;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double l = 0.0;
        unsigned long long h = 0;
        for (int w = 0; w < XENT_WARPS; w++) {
            l += s_loss[w];
            h += s_hits[w];
        }
        if (a.correct && h) atomicAdd(a.correct, h);
        if (a.loss_sum && !a.part) atomicAdd(a.loss_sum, l);
        if (a.loss_sum && a.part) {
            a.part[blockIdx.x] = l;
            __threadfence();
            s_last = atomicAdd(a.blocks_done, 1u) == gridDim.x - 1;
            __threadfence(); /* what the count saw comes before what the block reads next */
        }
    }
    if (!a.loss_sum || !a.part) return;
    __syncthreads();
    if (!s_last) return;
    /* the last block joins the parts: thread t those at t, t + 256, ... in order, then the warp
     * tree, then the warps in order */
    __threadfence();
    const volatile double *vpart = a.part; /* written by other blocks */
    double s = 0.0;
    for (unsigned int k = threadIdx.x; k < gridDim.x; k += XENT_THREADS) s += vpart[k];
    s = cmlp_warp_sum(s);
    if (lane == 0) s_loss[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double l = 0.0;
        for (int w = 0; w < XENT_WARPS; w++) l += s_loss[w];
        *a.loss_sum += l;
        *a.blocks_done = 0; /* for the next launch */
    }
}

static_assert(CMLP_K_XENT_BLOCKS == CMLP_K_MAX_BLOCKS, "a part of the scratch for every block");

template <int OUT>
static void launch_xent(const xent_args &a, cudaStream_t stream) {
    const unsigned int blocks = cmlp_k_blocks(a.rows, XENT_WARPS);
    if (a.cols <= 32) k_softmax_xent<1, OUT><<<blocks, XENT_THREADS, 0, stream>>>(a);
    else if (a.cols <= 64) k_softmax_xent<2, OUT><<<blocks, XENT_THREADS, 0, stream>>>(a);
    else if (a.cols <= 128) k_softmax_xent<4, OUT><<<blocks, XENT_THREADS, 0, stream>>>(a);
    else k_softmax_xent<0, OUT><<<blocks, XENT_THREADS, 0, stream>>>(a);
}

__global__ void k_reset_flag(float *flag) { *flag = 0.0f; }

/* dlogits_kind: 0 float, 1 fp16, 2 bf16 */
static cudaError_t softmax_xent(const float *logits, const int32_t *labels, int64_t rows, int64_t cols, float smoothing,
                                float grad_weight, const float *scale, double count, float *found_inf, void *dlogits,
                                int dlogits_kind, double *loss_sum, unsigned long long *correct, void *scratch,
                                cudaStream_t stream) {
    if (rows < 0 || cols < 0 || dlogits_kind < 0 || dlogits_kind > 2) return cudaErrorInvalidValue;
    if (rows == 0) { /* nothing to add; the non-finite flag is reset all the same, as on the CPU */
        if (found_inf) k_reset_flag<<<1, 1, 0, stream>>>(found_inf);
        return cudaGetLastError();
    }
    if (cols == 0) return cudaErrorInvalidValue;
    double *part = static_cast<double *>(scratch);
    unsigned int *done = scratch ? reinterpret_cast<unsigned int *>(part + CMLP_K_XENT_BLOCKS) : nullptr;
    const xent_args a = {logits,    labels,  rows,     cols,    smoothing, grad_weight, scale, count,
                         found_inf, dlogits, loss_sum, correct, part,      done};
    if (dlogits_kind == 0) launch_xent<0>(a, stream);
    else if (dlogits_kind == 1) launch_xent<1>(a, stream);
    else launch_xent<2>(a, stream);
    return cudaGetLastError();
}

extern "C" cudaError_t cmlp_k_softmax_xent(const float *logits, const int32_t *labels, int64_t rows, int64_t cols,
                                           float smoothing, float grad_weight, const float *scale, double count,
                                           float *found_inf, float *dlogits, double *loss_sum,
                                           unsigned long long *correct, void *scratch, cudaStream_t stream) {
    return softmax_xent(logits, labels, rows, cols, smoothing, grad_weight, scale, count, found_inf, dlogits, 0,
                        loss_sum, correct, scratch, stream);
}

extern "C" cudaError_t cmlp_k_softmax_xent_half(const float *logits, const int32_t *labels, int64_t rows, int64_t cols,
                                                float smoothing, float grad_weight, const float *scale,
                                                double count, float *found_inf, uint16_t *dlogits, int bf16,
                                                double *loss_sum, unsigned long long *correct, void *scratch,
                                                cudaStream_t stream) {
    return softmax_xent(logits, labels, rows, cols, smoothing, grad_weight, scale, count, found_inf, dlogits,
                        bf16 ? 2 : 1, loss_sum, correct, scratch, stream);
}
