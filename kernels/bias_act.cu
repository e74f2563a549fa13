/* bias_act.cu - the bias and ReLU kernels: bias add with optional ReLU after a GEMM, the ReLU
 * mask in backward, and the bias gradient (column sums, reduced in a fixed order).
 */
#include "common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "kernels.h"

/* ---- bias + activation ----
 * Work is in units of U floats (U = 4 when every row starts 16-byte aligned, else 1). A thread
 * finds its unit's column once and then steps it by the grid stride modulo the row width, so
 * the loop has no division. */

__device__ __forceinline__ float bias_act1(float y, float b, int relu) {
    float v = f_add(y, b);
    /* as cuBLASLt's ReLU epilogue, for which this stands in: max(v, 0), a NaN taken to 0 */
    return relu ? (v > 0.0f ? v : 0.0f) : v;
}

template <int U>
__global__ void __launch_bounds__(CMLP_K_THREADS)
k_bias_act(float *y, const float *bias, int64_t units, int64_t ucols, int relu) {
    const int64_t stride = cmlp_nthreads();
    int64_t i = cmlp_tid();
    if (i >= units) return;
    int64_t c = i % ucols;
    const int64_t dc = stride % ucols;
    for (; i < units; i += stride) {
        if (U == 4) {
            float4 v = reinterpret_cast<float4 *>(y)[i];
            const float4 b = reinterpret_cast<const float4 *>(bias)[c];
            v.x = bias_act1(v.x, b.x, relu);
            v.y = bias_act1(v.y, b.y, relu);
            v.z = bias_act1(v.z, b.z, relu);
            v.w = bias_act1(v.w, b.w, relu);
            reinterpret_cast<float4 *>(y)[i] = v;
        } else {
            y[i] = bias_act1(y[i], bias[c], relu);
        }
        c += dc;
        if (c >= ucols) c -= ucols;
    }
}

extern "C" cudaError_t cmlp_k_bias_act(float *y, const float *bias, int64_t rows, int64_t cols, int relu,
                                       cudaStream_t stream) {
    if (rows < 0 || cols < 0) return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0) return cudaSuccess;
    const bool vec = cols % 4 == 0 && ((uintptr_t)y | (uintptr_t)bias) % 16 == 0;
    const int64_t ucols = vec ? cols / 4 : cols, units = rows * ucols;
    const unsigned int blocks = cmlp_k_blocks(units, CMLP_K_THREADS);
    if (vec) k_bias_act<4><<<blocks, CMLP_K_THREADS, 0, stream>>>(y, bias, units, ucols, relu);
    else k_bias_act<1><<<blocks, CMLP_K_THREADS, 0, stream>>>(y, bias, units, ucols, relu);
    return cudaGetLastError();
}

/* On fp16 / bf16 storage, for a GEMM whose fused bias epilogue is unavailable (cuBLASLt has
 * no algorithm for it): rows set to the bias before a GEMM that adds to them (beta 1: the sum
 * in fp32, rounded once, as the epilogue would), then the ReLU (exact on rounded values). */
template <bool BF16>
__global__ void __launch_bounds__(CMLP_K_THREADS)
k_rows_half(uint16_t *y, const uint16_t *bias, int64_t n, int64_t cols) {
    const int64_t stride = cmlp_nthreads();
    const uint16_t inf = BF16 ? 0x7F80 : 0x7C00;
    for (int64_t i = cmlp_tid(); i < n; i += stride) {
        if (bias) {
            y[i] = bias[i % cols];
        } else { /* on the bits: > 0 (subnormals too, whatever the flush mode); not NaN */
            const uint16_t h = y[i], mag = h & 0x7FFF;
            if ((h & 0x8000) || mag == 0 || mag > inf) y[i] = 0;
        }
    }
}

extern "C" cudaError_t cmlp_k_rows_half(uint16_t *y, const uint16_t *bias, int64_t rows, int64_t cols, int bf16,
                                        cudaStream_t stream) {
    if (rows < 0 || cols < 0) return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0) return cudaSuccess;
    const int64_t n = rows * cols;
    const unsigned int blocks = cmlp_k_blocks(n, CMLP_K_THREADS);
    if (bf16) k_rows_half<true><<<blocks, CMLP_K_THREADS, 0, stream>>>(y, bias, n, cols);
    else k_rows_half<false><<<blocks, CMLP_K_THREADS, 0, stream>>>(y, bias, n, cols);
    return cudaGetLastError();
}

/* ---- ReLU backward ---- */

struct relu_bwd_op : cmlp_op_base {
    float *dy;
    const float *h;
    /* !(h <= 0) (torch's: a NaN h passes dy) with a subnormal h read as zero, as the CPU backend
     * compares under DAZ; dy itself passes through untouched. */
    __device__ __forceinline__ static float apply(float d, float hv) { return f_gtu(hv, 0.0f) ? d : 0.0f; }
    __device__ __forceinline__ bool one(int64_t i) const {
        dy[i] = apply(dy[i], h[i]);
        return false;
    }
    __device__ __forceinline__ bool four(int64_t i) const {
        float4 d = *reinterpret_cast<const float4 *>(dy + i);
        const float4 hv = *reinterpret_cast<const float4 *>(h + i);
        d.x = apply(d.x, hv.x);
        d.y = apply(d.y, hv.y);
        d.z = apply(d.z, hv.z);
        d.w = apply(d.w, hv.w);
        *reinterpret_cast<float4 *>(dy + i) = d;
        return false;
    }
};

extern "C" cudaError_t cmlp_k_relu_backward(float *dy, const float *h, int64_t n, cudaStream_t stream) {
    if (n < 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    relu_bwd_op op;
    op.dy = dy;
    op.h = h;
    const int mis[2] = {cmlp_misalign(dy, 4), cmlp_misalign(h, 4)};
    return cmlp_launch_map(op, n, mis, 2, stream);
}

/* ---- bias gradient ----
 * No atomics: one block owns a tile of w adjacent columns (w = cols when cols <= 32, else 32,
 * 16 or 8, narrower when that gives the GPU more blocks) and a range of rows. Its threads form
 * G = blockDim / w row groups, consecutive threads on consecutive columns (then on the next
 * row), so a warp reads contiguous memory. Group g sums rows r0 + g, r0 + g + G, ... of its
 * range in order; the groups are then combined by a fixed pairwise tree in shared memory.
 * Where the tiles alone give the GPU too few blocks (a tall matrix: a large batch), the rows are
 * split into S ranges whose sums go to scratch and are added in range order by a second
 * kernel. S depends only on (rows, cols) and the scratch's size, and so does the order. */

#define BIAS_GRAD_THREADS 512

/* dy as stored: float, or fp16 / bf16 bits (KIND 0, 1, 2) */
template <int KIND>
__device__ __forceinline__ float load_dy(const void *p, int64_t i) {
    if constexpr (KIND == 0) return static_cast<const float *>(p)[i];
    const unsigned short b = static_cast<const unsigned short *>(p)[i];
    if constexpr (KIND == 1) return __half2float(__ushort_as_half(b));
    return __bfloat162float(__ushort_as_bfloat16(b));
}

/* With MASK, dy goes through the ReLU's backward first (dy = !(h <= 0) ? dy : 0, as the ReLU
 * backward kernels decide it: under DAZ, as the CPU does, for half on the converted value) and the
 * result is written to out: when out is dy only the zeros are, when it is another buffer (h
 * itself, whose element each thread reads before it writes it) every element is. The sums are
 * of the masked values, in the same order. */
template <int KIND, bool MASK>
__device__ __forceinline__ float take_dy(void *dy, const void *h, void *out, int64_t i) {
    const float v = load_dy<KIND>(dy, i);
    if constexpr (MASK) {
        bool keep;
        if constexpr (KIND == 0) keep = f_gtu(static_cast<const float *>(h)[i], 0.0f);
        else keep = f_gtu(load_dy<KIND>(h, i), 0.0f); /* a bf16 subnormal converts to one */
        if (!keep || out != dy) {
            if constexpr (KIND == 0) static_cast<float *>(out)[i] = keep ? static_cast<const float *>(dy)[i] : 0.0f;
            else static_cast<uint16_t *>(out)[i] = keep ? static_cast<const uint16_t *>(dy)[i] : 0;
        }
        return keep ? v : 0.0f;
    }
    return v;
}

template <int KIND, bool MASK>
__global__ void __launch_bounds__(BIAS_GRAD_THREADS)
k_bias_grad(float *db, float *partial, void *dy, const void *h, void *out, int64_t rows, int64_t cols, int64_t tile_w,
            int64_t rows_per_split, int overwrite) {
    __shared__ float part[BIAS_GRAD_THREADS];
    const int64_t ntiles = (cols + tile_w - 1) / tile_w;
    const int64_t r0 = (int64_t)blockIdx.y * rows_per_split;
    const int64_t r1 = rows - r0 < rows_per_split ? rows : r0 + rows_per_split;
    const int t = threadIdx.x;
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const int64_t c0 = tile * tile_w;
        const int w = (int)(cols - c0 < tile_w ? cols - c0 : tile_w);
        const int G = BIAS_GRAD_THREADS / w, g = t / w, cw = t % w;
        float acc = 0.0f;
        if (g < G) {
            const int64_t col = c0 + cw;
            int64_t r = r0 + g;
            /* four loads in flight, added in row order */
            for (; r + 3 * (int64_t)G < r1; r += 4 * (int64_t)G) {
                const float a0 = take_dy<KIND, MASK>(dy, h, out, r * cols + col);
                const float a1 = take_dy<KIND, MASK>(dy, h, out, (r + G) * cols + col);
                const float a2 = take_dy<KIND, MASK>(dy, h, out, (r + 2 * (int64_t)G) * cols + col);
                const float a3 = take_dy<KIND, MASK>(dy, h, out, (r + 3 * (int64_t)G) * cols + col);
                acc = f_add(f_add(f_add(f_add(acc, a0), a1), a2), a3);
            }
            for (; r < r1; r += G) acc = f_add(acc, take_dy<KIND, MASK>(dy, h, out, r * cols + col));
        }
        part[t] = acc;
        __syncthreads();
        for (int hop = 1; hop < G; hop *= 2) {
            if (g < G && g % (2 * hop) == 0 && g + hop < G) part[t] = f_add(part[t], part[t + hop * w]);
            __syncthreads();
        }
        if (t < w) {
            if (partial) partial[(int64_t)blockIdx.y * cols + c0 + t] = part[t];
            else db[c0 + t] = f_add(overwrite ? 0.0f : db[c0 + t], part[t]);
        }
        __syncthreads(); /* part is reused by the next tile */
    }
}

/* db[c] (or 0 when overwriting) += the S partial sums of column c, in range order. */
__global__ void __launch_bounds__(CMLP_K_THREADS)
k_bias_grad_combine(float *db, const float *partial, int64_t splits, int64_t cols, int overwrite) {
    for (int64_t c = cmlp_tid(); c < cols; c += cmlp_nthreads()) {
        float acc = 0.0f;
        for (int64_t s = 0; s < splits; s++) acc = f_add(acc, partial[s * cols + c]);
        db[c] = f_add(overwrite ? 0.0f : db[c], acc);
    }
}

template <int KIND, bool MASK>
static void launch_bias_grad(dim3 grid, float *db, float *partial, void *dy, const void *h, void *out, int64_t rows,
                             int64_t cols,
                             int64_t w, int64_t rows_per_split, int overwrite, cudaStream_t stream) {
    k_bias_grad<KIND, MASK><<<grid, BIAS_GRAD_THREADS, 0, stream>>>(db, partial, dy, h, out, rows, cols, w,
                                                                     rows_per_split,
                                                                     overwrite);
}

#define BIAS_GRAD_TARGET_BLOCKS 512 /* about 4 blocks of 512 threads per SM of a large GPU */

/* kind: 0 float, 1 fp16, 2 bf16; h: the ReLU's output when dy is to be masked first (into out) */
static cudaError_t bias_grad(float *db, void *dy, const void *h, void *out, int kind, int64_t rows, int64_t cols, int overwrite,
                             float *scratch, size_t scratch_bytes, cudaStream_t stream) {
    if (rows < 0 || cols < 0) return cudaErrorInvalidValue;
    if (cols == 0 || (rows == 0 && !overwrite)) return cudaSuccess;
    if (rows == 0) { /* nothing to sum: zeros */
        k_bias_grad_combine<<<cmlp_k_blocks(cols, CMLP_K_THREADS), CMLP_K_THREADS, 0, stream>>>(db, nullptr, 0, cols, 1);
        return cudaGetLastError();
    }
    int64_t w = cols;
    if (cols > 32) {
        w = 32;
        while (w > 8 && (cols + w - 1) / w < 128) w /= 2;
    }
    const int64_t ntiles = (cols + w - 1) / w, G = BIAS_GRAD_THREADS / w;
    const int64_t bx = ntiles < CMLP_K_MAX_BLOCKS ? ntiles : CMLP_K_MAX_BLOCKS;
    /* row ranges: enough blocks for the GPU, each range at least 8 rows per group, within the
     * scratch and the grid's second dimension */
    int64_t splits = 1;
    if (scratch && bx < BIAS_GRAD_TARGET_BLOCKS) {
        splits = BIAS_GRAD_TARGET_BLOCKS / bx;
        const int64_t by_rows = rows / (8 * G), by_scratch = (int64_t)(scratch_bytes / sizeof(float)) / cols;
        if (splits > by_rows) splits = by_rows;
        if (splits > by_scratch) splits = by_scratch;
        if (splits > 65535) splits = 65535;
        if (splits < 1) splits = 1;
    }
    const int64_t per = (rows + splits - 1) / splits;
    splits = (rows + per - 1) / per; /* no empty range */
    float *partial = splits > 1 ? scratch : NULL;
    const dim3 grid((unsigned int)bx, (unsigned int)splits);
    if (h) {
        if (kind == 0) launch_bias_grad<0, true>(grid, db, partial, dy, h, out, rows, cols, w, per, overwrite, stream);
        else if (kind == 1) launch_bias_grad<1, true>(grid, db, partial, dy, h, out, rows, cols, w, per, overwrite, stream);
        else launch_bias_grad<2, true>(grid, db, partial, dy, h, out, rows, cols, w, per, overwrite, stream);
    } else {
        if (kind == 0) launch_bias_grad<0, false>(grid, db, partial, dy, h, out, rows, cols, w, per, overwrite, stream);
        else if (kind == 1) launch_bias_grad<1, false>(grid, db, partial, dy, h, out, rows, cols, w, per, overwrite, stream);
        else launch_bias_grad<2, false>(grid, db, partial, dy, h, out, rows, cols, w, per, overwrite, stream);
    }
    if (partial) {
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
        k_bias_grad_combine<<<cmlp_k_blocks(cols, CMLP_K_THREADS), CMLP_K_THREADS, 0, stream>>>(db, partial, splits,
                                                                                                 cols, overwrite);
    }
    return cudaGetLastError();
}

extern "C" cudaError_t cmlp_k_bias_grad(float *db, const float *dy, int64_t rows, int64_t cols, int overwrite,
                                        float *scratch, size_t scratch_bytes, cudaStream_t stream) {
    return bias_grad(db, const_cast<float *>(dy), NULL, NULL, 0, rows, cols, overwrite, scratch, scratch_bytes, stream);
}

extern "C" cudaError_t cmlp_k_bias_grad_half(float *db, const uint16_t *dy, int64_t rows, int64_t cols, int bf16,
                                             int overwrite, float *scratch, size_t scratch_bytes, cudaStream_t stream) {
    return bias_grad(db, const_cast<uint16_t *>(dy), NULL, NULL, bf16 ? 2 : 1, rows, cols, overwrite, scratch, scratch_bytes,
                     stream);
}

extern "C" cudaError_t cmlp_k_relu_backward_bias_grad(void *dy, const void *h, void *out, int kind, float *db,
                                                      int64_t rows, int64_t cols, int overwrite, float *scratch,
                                                      size_t scratch_bytes, cudaStream_t stream) {
    if (kind < 0 || kind > 2 || !h || (out != dy && out != h)) return cudaErrorInvalidValue;
    return bias_grad(db, dy, h, out, kind, rows, cols, overwrite, scratch, scratch_bytes, stream);
}

template <int KIND, bool MASK>
static const void *bias_grad_kernel() {
    return (const void *)k_bias_grad<KIND, MASK>;
}

extern "C" cudaError_t cmlp_k_bias_grad_load(int kind, int mask) {
    static const void *const kernels[3][2] = {{bias_grad_kernel<0, false>(), bias_grad_kernel<0, true>()},
                                              {bias_grad_kernel<1, false>(), bias_grad_kernel<1, true>()},
                                              {bias_grad_kernel<2, false>(), bias_grad_kernel<2, true>()}};
    if (kind < 0 || kind > 2) return cudaErrorInvalidValue;
    cudaFuncAttributes attr;
    const cudaError_t e = cudaFuncGetAttributes(&attr, kernels[kind][mask != 0]);
    return e != cudaSuccess ? e : cudaFuncGetAttributes(&attr, (const void *)k_bias_grad_combine);
}

/* ---- ReLU backward in half precision: dy[i] = !(h[i] <= 0) ? dy[i] : 0 on fp16 / bf16 bits, h
 * converted to float and compared under DAZ ---- */

template <int KIND>
__global__ void __launch_bounds__(CMLP_K_THREADS) k_relu_backward_half(uint16_t *dy, const uint16_t *h, int64_t n) {
    for (int64_t i = cmlp_tid(); i < n; i += cmlp_nthreads())
        if (!f_gtu(load_dy<KIND>(h, i), 0.0f)) dy[i] = 0;
}

extern "C" cudaError_t cmlp_k_relu_backward_half(uint16_t *dy, const uint16_t *h, int64_t n, int bf16,
                                                 cudaStream_t stream) {
    if (n < 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    const unsigned int blocks = cmlp_k_blocks(n, CMLP_K_THREADS);
    if (bf16) k_relu_backward_half<2><<<blocks, CMLP_K_THREADS, 0, stream>>>(dy, h, n);
    else k_relu_backward_half<1><<<blocks, CMLP_K_THREADS, 0, stream>>>(dy, h, n);
    return cudaGetLastError();
}
