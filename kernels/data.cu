/* data.cu - gathering rows of a device-resident data set into a batch: uint8 or float32
 * features scaled and shifted into float32, and int32 labels. Rows come from an index array or
 * a contiguous range.
 *
 * Work is in units of U columns (U = 4 when every row of source and destination is 4-element
 * aligned, else 1). A thread finds the (row, column) of its first unit once and then steps both
 * by the grid stride, so the loop has no division.
 */
#include "common.cuh"
#include "kernels.h"

/* u8: v * scale + shift. f32 with scale 1 and shift 0: the bits themselves (the CPU backend
 * copies float rows); otherwise v * scale + shift. */
template <typename T>
__device__ __forceinline__ float convert1(T v, float scale, float shift, bool copy) {
    const float f = (float)v;
    return copy ? f : f_add(f_mul(f, scale), shift);
}

/* The destination: float (OUT 0), or fp16 / bf16 bits (OUT 1, 2) rounded once from the float. */
template <int OUT>
__device__ __forceinline__ void store1(void *dst, int64_t i, float v) {
    if constexpr (OUT == 0) static_cast<float *>(dst)[i] = v;
    else static_cast<uint16_t *>(dst)[i] = to_half1<OUT == 2>(v);
}

template <int OUT>
__device__ __forceinline__ void store4(void *dst, int64_t unit, float4 v) {
    if constexpr (OUT == 0) {
        static_cast<float4 *>(dst)[unit] = v;
    } else {
        uint2 h;
        h.x = (uint32_t)to_half1<OUT == 2>(v.x) | (uint32_t)to_half1<OUT == 2>(v.y) << 16;
        h.y = (uint32_t)to_half1<OUT == 2>(v.z) | (uint32_t)to_half1<OUT == 2>(v.w) << 16;
        static_cast<uint2 *>(dst)[unit] = h;
    }
}

template <typename T, int U, int OUT>
__global__ void __launch_bounds__(CMLP_K_THREADS)
k_gather(void *dst, const T *src, const int64_t *idx, int64_t start, const int64_t *pos, int64_t rows, int64_t ucols,
         float scale, float shift, int copy, int32_t *ldst, const int32_t *lsrc) {
    const int64_t total = rows * ucols, stride = cmlp_nthreads();
    int64_t i = cmlp_tid();
    if (i >= total) return;
    if (pos) { /* a position kept on the device moves every row */
        if (idx) idx += *pos;
        else start += *pos;
    }
    int64_t r = i / ucols, c = i - r * ucols;
    const int64_t dr = stride / ucols, dc = stride - dr * ucols;
    for (; i < total; i += stride) {
        const int64_t s = idx ? idx[r] : start + r;
        const int64_t at = s * ucols + c; /* in units */
        if (ldst && c == 0) ldst[r] = lsrc[s]; /* the row's label, by the row's first unit */
        if constexpr (U == 4) {
            float4 o;
            if constexpr (sizeof(T) == 1) {
                const uchar4 v = reinterpret_cast<const uchar4 *>(src)[at];
                o = make_float4(convert1(v.x, scale, shift, copy), convert1(v.y, scale, shift, copy),
                                convert1(v.z, scale, shift, copy), convert1(v.w, scale, shift, copy));
            } else {
                const float4 v = reinterpret_cast<const float4 *>(src)[at];
                o = make_float4(convert1(v.x, scale, shift, copy), convert1(v.y, scale, shift, copy),
                                convert1(v.z, scale, shift, copy), convert1(v.w, scale, shift, copy));
            }
            store4<OUT>(dst, i, o);
        } else {
            store1<OUT>(dst, i, convert1(src[at], scale, shift, copy));
        }
        c += dc;
        r += dr;
        if (c >= ucols) {
            c -= ucols;
            r++;
        }
    }
}

template <typename T, int OUT>
static cudaError_t gather(void *dst, const T *src, const int64_t *idx, int64_t start, const int64_t *pos,
                          int64_t rows, int64_t cols, float scale, float shift, int copy, int32_t *ldst,
                          const int32_t *lsrc, cudaStream_t stream) {
    if (rows < 0 || cols < 0) return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0) return cudaSuccess;
    const uintptr_t out_unit = OUT == 0 ? 16 : 8; /* four destination elements */
    const bool vec = cols % 4 == 0 && (uintptr_t)dst % out_unit == 0 && (uintptr_t)src % (4 * sizeof(T)) == 0;
    const int64_t ucols = vec ? cols / 4 : cols;
    const unsigned int blocks = cmlp_k_blocks(rows * ucols, CMLP_K_THREADS);
    if (vec)
        k_gather<T, 4, OUT><<<blocks, CMLP_K_THREADS, 0, stream>>>(dst, src, idx, start, pos, rows, ucols, scale,
                                                                   shift, copy, ldst, lsrc);
    else
        k_gather<T, 1, OUT><<<blocks, CMLP_K_THREADS, 0, stream>>>(dst, src, idx, start, pos, rows, ucols, scale,
                                                                   shift, copy, ldst, lsrc);
    return cudaGetLastError();
}

extern "C" cudaError_t cmlp_k_gather_u8(float *dst, const uint8_t *src, const int64_t *idx, int64_t start,
                                        const int64_t *pos, int64_t rows, int64_t cols, float scale, float shift,
                                        int32_t *ldst, const int32_t *lsrc, cudaStream_t stream) {
    return gather<uint8_t, 0>(dst, src, idx, start, pos, rows, cols, scale, shift, 0, ldst, lsrc, stream);
}

extern "C" cudaError_t cmlp_k_gather_f32(float *dst, const float *src, const int64_t *idx, int64_t start,
                                         const int64_t *pos, int64_t rows, int64_t cols, float scale, float shift,
                                         int32_t *ldst, const int32_t *lsrc, cudaStream_t stream) {
    return gather<float, 0>(dst, src, idx, start, pos, rows, cols, scale, shift, scale == 1.0f && shift == 0.0f, ldst,
                            lsrc, stream);
}

extern "C" cudaError_t cmlp_k_gather_half(uint16_t *dst, int bf16, const void *src, int src_u8, const int64_t *idx,
                                          int64_t start, const int64_t *pos, int64_t rows, int64_t cols, float scale,
                                          float shift, int32_t *ldst, const int32_t *lsrc, cudaStream_t stream) {
    const int copy = !src_u8 && scale == 1.0f && shift == 0.0f;
    if (src_u8) {
        const uint8_t *s = static_cast<const uint8_t *>(src);
        return bf16 ? gather<uint8_t, 2>(dst, s, idx, start, pos, rows, cols, scale, shift, copy, ldst, lsrc, stream)
                    : gather<uint8_t, 1>(dst, s, idx, start, pos, rows, cols, scale, shift, copy, ldst, lsrc, stream);
    }
    const float *s = static_cast<const float *>(src);
    return bf16 ? gather<float, 2>(dst, s, idx, start, pos, rows, cols, scale, shift, copy, ldst, lsrc, stream)
                : gather<float, 1>(dst, s, idx, start, pos, rows, cols, scale, shift, copy, ldst, lsrc, stream);
}

__global__ void __launch_bounds__(CMLP_K_THREADS)
k_gather_labels(int32_t *dst, const int32_t *src, const int64_t *idx, int64_t start, const int64_t *pos, int64_t rows) {
    if (pos) {
        if (idx) idx += *pos;
        else start += *pos;
    }
    for (int64_t r = cmlp_tid(); r < rows; r += cmlp_nthreads()) dst[r] = src[idx ? idx[r] : start + r];
}

extern "C" cudaError_t cmlp_k_gather_labels(int32_t *dst, const int32_t *src, const int64_t *idx, int64_t start,
                                            const int64_t *pos, int64_t rows, cudaStream_t stream) {
    if (rows < 0) return cudaErrorInvalidValue;
    if (rows == 0) return cudaSuccess;
    k_gather_labels<<<cmlp_k_blocks(rows, CMLP_K_THREADS), CMLP_K_THREADS, 0, stream>>>(dst, src, idx, start, pos,
                                                                                          rows);
    return cudaGetLastError();
}

