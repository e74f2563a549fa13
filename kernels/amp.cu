/* amp.cu - mixed precision on the device: fp32 <-> fp16 / bf16 storage casts (round to nearest
 * even, subnormals kept), the fused gradient unscale and inf/NaN check, and the gradient weight
 * of a loss-scaled step, all without a host synchronisation (the loss-scale update runs with
 * the optimizer's prepare, optim.cu).
 */
#include "common.cuh"
#include "kernels.h"

/* ---- casts; half values are stored as their 16 bits (common.cuh's to_half1 / from_half1) ---- */

template <bool BF16>
struct to_half_op : cmlp_op_base {
    uint16_t *dst;
    const float *src;
    __device__ __forceinline__ bool one(int64_t i) const {
        dst[i] = to_half1<BF16>(src[i]);
        return false;
    }
    __device__ __forceinline__ bool four(int64_t i) const {
        const float4 f = *reinterpret_cast<const float4 *>(src + i);
        uint2 h;
        h.x = (uint32_t)to_half1<BF16>(f.x) | (uint32_t)to_half1<BF16>(f.y) << 16;
        h.y = (uint32_t)to_half1<BF16>(f.z) | (uint32_t)to_half1<BF16>(f.w) << 16;
        *reinterpret_cast<uint2 *>(dst + i) = h;
        return false;
    }
};

template <bool BF16>
struct from_half_op : cmlp_op_base {
    float *dst;
    const uint16_t *src;
    __device__ __forceinline__ bool one(int64_t i) const {
        dst[i] = from_half1<BF16>(src[i]);
        return false;
    }
    __device__ __forceinline__ bool four(int64_t i) const {
        const uint2 h = *reinterpret_cast<const uint2 *>(src + i);
        *reinterpret_cast<float4 *>(dst + i) =
            make_float4(from_half1<BF16>((uint16_t)(h.x & 0xFFFFu)), from_half1<BF16>((uint16_t)(h.x >> 16)),
                        from_half1<BF16>((uint16_t)(h.y & 0xFFFFu)), from_half1<BF16>((uint16_t)(h.y >> 16)));
        return false;
    }
};

extern "C" cudaError_t cmlp_k_to_half(uint16_t *dst, const float *src, int64_t n, int bf16, cudaStream_t stream) {
    if (n < 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    const int mis[2] = {cmlp_misalign(dst, 2), cmlp_misalign(src, 4)};
    if (bf16) {
        to_half_op<true> op;
        op.dst = dst;
        op.src = src;
        return cmlp_launch_map(op, n, mis, 2, stream);
    }
    to_half_op<false> op;
    op.dst = dst;
    op.src = src;
    return cmlp_launch_map(op, n, mis, 2, stream);
}

extern "C" cudaError_t cmlp_k_from_half(float *dst, const uint16_t *src, int64_t n, int bf16, cudaStream_t stream) {
    if (n < 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    const int mis[2] = {cmlp_misalign(dst, 4), cmlp_misalign(src, 2)};
    if (bf16) {
        from_half_op<true> op;
        op.dst = dst;
        op.src = src;
        return cmlp_launch_map(op, n, mis, 2, stream);
    }
    from_half_op<false> op;
    op.dst = dst;
    op.src = src;
    return cmlp_launch_map(op, n, mis, 2, stream);
}

/* ---- unscale ---- */

/* g * inv_scale, torch's unscale, as (g * inv) * post. Past a scale of 2^126, inv_scale =
 * (float)(1 / scale) is a subnormal float, which these kernels' flushing arithmetic (.ftz, as the
 * CPU backend's) would read as 0, unscaling every gradient to 0 unseen: it is then taken as a
 * normal float times 2^-64 (its value on float's subnormal grid, moved up by 64 exponents,
 * exactly), the same product rounded once unless that product is itself subnormal (flushed). */
struct unscale_op {
    float *g;
    float inv_scale;
    const float *scale; /* when set, inv_scale becomes (float)(1 / *scale) in begin() */
    float *found_inf;
    float post;

    __device__ __forceinline__ bool begin() {
        post = 1.0f;
        if (scale) {
            const double r = 1.0 / (double)*scale;
            if (r > 0.0 && r < 0x1p-126) {
                inv_scale = (float)__dmul_rn(rint(__dmul_rn(r, 0x1p149)), 0x1p-85);
                post = 0x1p-64f;
            } else {
                inv_scale = (float)r;
            }
        } else if ((__float_as_uint(inv_scale) & 0x7F800000u) == 0 && (__float_as_uint(inv_scale) & 0x007FFFFFu)) {
            const unsigned bits = __float_as_uint(inv_scale);
            const float up = (float)(bits & 0x007FFFFFu) * 0x1p-85f; /* exact: an integer < 2^23 times 2^-85 */
            inv_scale = bits & 0x80000000u ? -up : up;
            post = 0x1p-64f;
        }
        return false;
    }
    __device__ __forceinline__ bool one(int64_t i) const {
        const float v = f_mul(f_mul(g[i], inv_scale), post); /* post 1: exactly g * inv_scale */
        g[i] = v;
        return f_nonfinite(v);
    }
    __device__ __forceinline__ bool four(int64_t i) const {
        const float s = inv_scale, p = post;
        float4 v = *reinterpret_cast<const float4 *>(g + i);
        v.x = f_mul(f_mul(v.x, s), p);
        v.y = f_mul(f_mul(v.y, s), p);
        v.z = f_mul(f_mul(v.z, s), p);
        v.w = f_mul(f_mul(v.w, s), p);
        *reinterpret_cast<float4 *>(g + i) = v;
        return f_nonfinite(v.x) | f_nonfinite(v.y) | f_nonfinite(v.z) | f_nonfinite(v.w);
    }
    /* only threads that saw a non-finite value write, and they all write the same value */
    __device__ __forceinline__ void finish(bool any) const {
        if (any && found_inf) *found_inf = 1.0f;
    }
};

extern "C" cudaError_t cmlp_k_unscale(float *g, int64_t n, float inv_scale, const float *scale, float *found_inf,
                                      cudaStream_t stream) {
    if (n < 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    unscale_op op;
    op.g = g;
    op.inv_scale = inv_scale;
    op.scale = scale;
    op.found_inf = found_inf;
    op.post = 1.0f; /* begin() sets it again, per thread */
    const int mis[1] = {cmlp_misalign(g, 4)};
    return cmlp_launch_map(op, n, mis, 1, stream);
}

extern "C" cudaError_t cmlp_k_unscale_load(void) {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, (const void *)cmlp_k_map<unscale_op>);
}
