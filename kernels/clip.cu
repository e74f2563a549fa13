/* clip.cu - gradient clipping on the device: the total norm of the flat gradient buffer, in
 * double precision and in an order fixed by the element count alone (so the CPU backend gives
 * the same bits), and the scaling by min(1, max_norm / (norm + 1e-6)) read from the device, or
 * the clamp to [-v, v]. Nothing waits for the host.
 */
#include "common.cuh"
#include "kernels.h"

/* ---- the norm ---- */

enum { NORM_L2 = 0, NORM_L1 = 1, NORM_INF = 2, NORM_P = 3, NORM_MIN = 4 };

/* |x| in double after the CPU's DAZ read of x (a subnormal counts as zero); for the p-norms the
 * term |x|^p (exact for p = 1 and 2: a float's square fits a double). */
template <int KIND>
__device__ __forceinline__ double norm_term(float x, double p) {
    const double a = fabs(f_to_double(x));
    if (KIND == NORM_L2) return __dmul_rn(a, a);
    if (KIND == NORM_P) return pow(a, p);
    return a;
}

/* The running value: a sum, or for the inf-norm a maximum and for the -inf-norm a minimum that
 * keep a NaN. */
template <int KIND>
__device__ __forceinline__ double norm_join(double acc, double t) {
    if (KIND == NORM_INF) return (t > acc || t != t) ? t : acc;
    if (KIND == NORM_MIN) return (t < acc || t != t) ? t : acc;
    return __dadd_rn(acc, t);
}

/* One block per partial result: thread t of the grid joins elements t, t + S, t + 2S, ... (S the
 * grid's threads) in that order, a warp joins its lanes by the xor butterfly, thread 0 the
 * warps in order; the block that finishes last joins the partials in block order, takes the
 * root and writes the float result. */
template <int KIND>
__global__ void __launch_bounds__(CMLP_K_NORM_THREADS) k_grad_norm(const float *g, int64_t n, double p, float *out,
                                                                  double *part, unsigned int *blocks_done) {
    const int64_t stride = cmlp_nthreads();
    int64_t i = cmlp_tid();
    double acc = KIND == NORM_MIN ? (double)INFINITY : 0.0; /* a thread past n joins as nothing */
    /* four loads in flight, joined in element order */
    for (; i + 3 * stride < n; i += 4 * stride) {
        const float x0 = g[i], x1 = g[i + stride], x2 = g[i + 2 * stride], x3 = g[i + 3 * stride];
        acc = norm_join<KIND>(acc, norm_term<KIND>(x0, p));
        acc = norm_join<KIND>(acc, norm_term<KIND>(x1, p));
        acc = norm_join<KIND>(acc, norm_term<KIND>(x2, p));
        acc = norm_join<KIND>(acc, norm_term<KIND>(x3, p));
    }
    for (; i < n; i += stride) acc = norm_join<KIND>(acc, norm_term<KIND>(g[i], p));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = norm_join<KIND>(acc, __shfl_xor_sync(CMLP_FULL_WARP, acc, o));
    __shared__ double warps[CMLP_K_NORM_THREADS / 32];
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x != 0) return;
    double b = warps[0];
    for (int w = 1; w < CMLP_K_NORM_THREADS / 32; w++) b = norm_join<KIND>(b, warps[w]);
    part[blockIdx.x] = b;
    __threadfence();
    if (atomicAdd(blocks_done, 1u) != gridDim.x - 1) return;
    __threadfence();
    const volatile double *vpart = part; /* written by other blocks */
    double s = vpart[0];
    for (unsigned int k = 1; k < gridDim.x; k++) s = norm_join<KIND>(s, vpart[k]);
    if (KIND == NORM_L2) s = sqrt(s);
    else if (KIND == NORM_P) s = pow(s, 1.0 / p);
    *out = f_from_double(s);
    *blocks_done = 0; /* for the next launch */
}

extern "C" cudaError_t cmlp_k_grad_norm(const float *g, int64_t n, double norm_type, float *out, double *part,
                                        unsigned int *blocks_done, cudaStream_t stream) {
    if (n <= 0 || !out || !part || !blocks_done || norm_type == 0.0 || norm_type != norm_type)
        return cudaErrorInvalidValue;
    const unsigned int blocks = (unsigned int)cmlp_k_norm_blocks(n);
    if (norm_type == 2.0)
        k_grad_norm<NORM_L2><<<blocks, CMLP_K_NORM_THREADS, 0, stream>>>(g, n, norm_type, out, part, blocks_done);
    else if (norm_type == 1.0)
        k_grad_norm<NORM_L1><<<blocks, CMLP_K_NORM_THREADS, 0, stream>>>(g, n, norm_type, out, part, blocks_done);
    else if (norm_type == (double)INFINITY)
        k_grad_norm<NORM_INF><<<blocks, CMLP_K_NORM_THREADS, 0, stream>>>(g, n, norm_type, out, part, blocks_done);
    else if (norm_type == -(double)INFINITY)
        k_grad_norm<NORM_MIN><<<blocks, CMLP_K_NORM_THREADS, 0, stream>>>(g, n, norm_type, out, part, blocks_done);
    else
        k_grad_norm<NORM_P><<<blocks, CMLP_K_NORM_THREADS, 0, stream>>>(g, n, norm_type, out, part, blocks_done);
    return cudaGetLastError();
}

/* x[i..i+3] = f(x[i..i+3]) elementwise, one 16-byte load and store (x + i 16-byte aligned). */
template <class F>
__device__ __forceinline__ void map4(float *x, int64_t i, F f) {
    float4 v = *reinterpret_cast<const float4 *>(x + i);
    v.x = f(v.x);
    v.y = f(v.y);
    v.z = f(v.z);
    v.w = f(v.w);
    *reinterpret_cast<float4 *>(x + i) = v;
}

/* ---- scaling by the norm ---- */

/* x rounded to float with subnormals kept (the value held in a double), as the CPU backend does */
__device__ __forceinline__ double f32_subnormal(double x) {
    return x < 0x1p-126 ? __dmul_rn(rint(__dmul_rn(x, 0x1p149)), 0x1p-149) : (double)f_from_double(x);
}

struct clip_norm_op {
    float *g;
    const float *norm;
    float max_norm;
    float coef, post; /* g * coef * post: post = 2^-64 scales a subnormal coefficient back */
    double *norm_sum;
    long long *norm_steps;

    /* torch's clip_grad_norm_: coef = max_norm / (norm + 1e-6) in float, which torch forms as a
     * reciprocal times max_norm (two roundings, subnormals kept: a norm above 2^126 has a
     * subnormal reciprocal), clamped to 1 (a NaN stays NaN); at 1 the gradients stay as they
     * are. A subnormal coefficient is applied as coef * 2^64, then 2^-64: the product rounded
     * once, as the CPU backend does. Thread 0 counts a finite norm. */
    __device__ __forceinline__ bool begin() {
        const float total = *norm;
        if (cmlp_tid() == 0 && norm_sum && !f_nonfinite(total)) {
            *norm_sum = __dadd_rn(*norm_sum, (double)total);
            *norm_steps += 1;
        }
        const double r = f32_subnormal(__ddiv_rn(1.0, (double)f_add(total, 1e-6f)));
        const double c = f32_subnormal(__dmul_rn(r, (double)max_norm));
        if (c >= 1.0) return true; /* a NaN goes on */
        const bool tiny = c > 0.0 && c < 0x1p-126;
        coef = f_from_double(tiny ? __dmul_rn(c, 0x1p64) : c);
        post = tiny ? 0x1p-64f : 1.0f;
        return false;
    }
    __device__ __forceinline__ float scaled(float x) const {
        x = f_mul(x, coef);
        return post != 1.0f ? f_mul(x, post) : x;
    }
    __device__ __forceinline__ bool one(int64_t i) const {
        g[i] = scaled(g[i]);
        return false;
    }
    __device__ __forceinline__ bool four(int64_t i) const {
        const clip_norm_op &op = *this;
        map4(g, i, [&op](float x) { return op.scaled(x); });
        return false;
    }
    __device__ __forceinline__ void finish(bool) const {}
};

extern "C" cudaError_t cmlp_k_clip_by_norm(float *g, int64_t n, const float *norm, float max_norm, double *norm_sum,
                                           long long *norm_steps, cudaStream_t stream) {
    if (n <= 0 || !norm || (!norm_sum) != (!norm_steps)) return cudaErrorInvalidValue;
    clip_norm_op op;
    op.g = g;
    op.norm = norm;
    op.max_norm = max_norm;
    op.coef = 1.0f;
    op.post = 1.0f;
    op.norm_sum = norm_sum;
    op.norm_steps = norm_steps;
    const int mis[1] = {cmlp_misalign(g, 4)};
    return cmlp_launch_map(op, n, mis, 1, stream);
}

/* ---- clamping ---- */

/* min(max(x, -v), v) with a NaN kept (torch.clamp_). */
__device__ __forceinline__ float clamp1(float x, float v) {
    if (f_gt(x, v)) return v;
    if (f_gt(-v, x)) return -v;
    return x;
}

struct clip_value_op : cmlp_op_base {
    float *g;
    float v;
    __device__ __forceinline__ bool one(int64_t i) const {
        g[i] = clamp1(g[i], v);
        return false;
    }
    __device__ __forceinline__ bool four(int64_t i) const {
        const float b = v;
        map4(g, i, [b](float x) { return clamp1(x, b); });
        return false;
    }
};

extern "C" cudaError_t cmlp_k_clip_by_value(float *g, int64_t n, float v, cudaStream_t stream) {
    if (n < 0 || !(v >= 0.0f)) return cudaErrorInvalidValue; /* v may be inf */
    if (n == 0) return cudaSuccess;
    clip_value_op op;
    op.g = g;
    op.v = v;
    const int mis[1] = {cmlp_misalign(g, 4)};
    return cmlp_launch_map(op, n, mis, 1, stream);
}

extern "C" cudaError_t cmlp_k_clip_load(void) {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, (const void *)k_grad_norm<NORM_L2>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, (const void *)cmlp_k_map<clip_norm_op>);
    return e;
}
