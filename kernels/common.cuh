/* common.cuh - what the kernel families share: grid sizing for grid-stride loops over int64
 * counts, fp32 arithmetic done the way the CPU backend does it, warp reductions, and one
 * elementwise loop that uses 16-byte accesses where the pointers allow.
 */
#ifndef CMLP_KERNELS_COMMON_CUH
#define CMLP_KERNELS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#define CMLP_K_THREADS 256    /* threads per block of the elementwise kernels */
#define CMLP_K_MAX_BLOCKS 4096 /* grid cap: about 30 blocks per SM; loops stride over the rest */
#define CMLP_FULL_WARP 0xFFFFFFFFu

/* Blocks for `work` items at `threads` per block, capped (work > 0). */
static inline unsigned int cmlp_k_blocks(int64_t work, int threads) {
    int64_t b = (work + threads - 1) / threads;
    return (unsigned int)(b < CMLP_K_MAX_BLOCKS ? b : CMLP_K_MAX_BLOCKS);
}

__device__ __forceinline__ int64_t cmlp_tid() { return (int64_t)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t cmlp_nthreads() { return (int64_t)gridDim.x * blockDim.x; }

/* ---- fp32 arithmetic as the CPU backend computes it ----
 * The core runs the CPU backend with subnormals flushed (FTZ and DAZ) and compiles it as ISO C
 * (no contraction into FMA). These helpers give the same results whatever nvcc's -ftz and
 * -fmad settings: each is one IEEE operation, round to nearest, subnormal inputs and results
 * flushed to a zero of the same sign, never fused with a neighbour. */
#ifndef CMLP_EMU /* tests/emu/cuda_emu.h gives host versions */
__device__ __forceinline__ float f_add(float a, float b) {
    float r;
    asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_sub(float a, float b) {
    float r;
    asm("sub.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_mul(float a, float b) {
    float r;
    asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_div(float a, float b) {
    float r;
    asm("div.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_sqrt(float a) {
    float r;
    asm("sqrt.rn.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
/* a > b with subnormal operands read as zero (DAZ). */
__device__ __forceinline__ bool f_gt(float a, float b) {
    unsigned int r;
    asm("{ .reg .pred p; setp.gt.ftz.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
/* a > b or either is NaN (unordered), with subnormal operands read as zero (DAZ). */
__device__ __forceinline__ bool f_gtu(float a, float b) {
    unsigned int r;
    asm("{ .reg .pred p; setp.gtu.ftz.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
/* a == b with subnormal operands read as zero. */
__device__ __forceinline__ bool f_eq(float a, float b) {
    unsigned int r;
    asm("{ .reg .pred p; setp.eq.ftz.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
/* float -> double as the CPU converts under DAZ: a subnormal becomes a zero of its sign. */
__device__ __forceinline__ double f_to_double(float a) { return (double)f_mul(a, 1.0f); }
/* double -> float, round to nearest, a subnormal result flushed. */
__device__ __forceinline__ float f_from_double(double a) {
    float r;
    asm("cvt.rn.ftz.f32.f64 %0, %1;" : "=f"(r) : "d"(a));
    return r;
}
#endif /* CMLP_EMU */
/* inf or NaN: the exponent bits all ones (the CPU backend's test). */
__device__ __forceinline__ bool f_nonfinite(float a) {
    return (__float_as_uint(a) & 0x7F800000u) == 0x7F800000u;
}

/* ---- fp16 / bf16 storage as 16 bits: round to nearest even, subnormals kept ---- */
template <bool BF16>
__device__ __forceinline__ uint16_t to_half1(float f) {
    if constexpr (BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(f));
    else return __half_as_ushort(__float2half_rn(f));
}

template <bool BF16>
__device__ __forceinline__ float from_half1(uint16_t h) {
    if constexpr (BF16) return __bfloat162float(__ushort_as_bfloat16(h));
    else return __half2float(__ushort_as_half(h));
}

/* ---- warp reductions (every lane gets the result; the butterfly gives each lane the same
 * bits, and the order depends only on the lane values) ---- */
template <typename T>
__device__ __forceinline__ T cmlp_warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(CMLP_FULL_WARP, v, o);
    return v;
}

/* ---- elementwise loop ----
 * An op over n elements provides
 *     bool one(int64_t i)    element i
 *     bool four(int64_t i)   elements i..i+3, where every pointer of the op is 4-element
 *                            aligned (16 bytes for float, 8 for uint16_t)
 *     bool begin()           once per thread, on the thread's own copy of the op: may set
 *                            per-thread values; true means the kernel must change nothing
 *     void finish(bool any)  called once per thread with the OR of what one/four returned
 * Elements [0, head) and [head + 4 nvec, n) go through one(), the body through four(). */
template <class Op>
__device__ __forceinline__ bool cmlp_map_elements(Op &op, int64_t n, int64_t head, int64_t nvec) {
    const int64_t t = cmlp_tid(), stride = cmlp_nthreads();
    bool any = false;
    for (int64_t q = t; q < nvec; q += stride) any |= op.four(head + 4 * q);
    const int64_t body_end = head + 4 * nvec, nscalar = head + (n - body_end);
    for (int64_t k = t; k < nscalar; k += stride) any |= op.one(k < head ? k : body_end + (k - head));
    return any;
}

template <class Op>
__global__ void __launch_bounds__(CMLP_K_THREADS) cmlp_k_map(const Op op_arg, int64_t n, int64_t head, int64_t nvec) {
    Op op = op_arg;
    if (op.begin()) return;
    op.finish(cmlp_map_elements(op, n, head, nvec));
}

/* Misalignment of p in elements of `size` bytes, relative to a 4-element vector; -1 when p is
 * not even element-aligned. */
static inline int cmlp_misalign(const void *p, int size) {
    uintptr_t a = (uintptr_t)p;
    if (a % (uintptr_t)size) return -1;
    return (int)((a / (uintptr_t)size) % 4u);
}

/* Launches cmlp_k_map over n > 0 elements. `mis` holds the misalignment of each pointer the
 * op touches (cmlp_misalign); the vector body is used when they all agree. */
/* The split of n > 0 elements into a scalar head, 4-element vectors and a scalar tail (the vector
 * body is used when every pointer's misalignment agrees); returns the blocks to launch. */
static inline unsigned int cmlp_map_split(int64_t n, const int *mis, int nmis, int64_t *head, int64_t *nvec) {
    bool same = mis[0] >= 0;
    for (int k = 1; k < nmis; k++) same = same && mis[k] == mis[0];
    *head = *nvec = 0;
    if (same) {
        *head = (4 - mis[0]) & 3;
        if (*head > n) *head = n;
        *nvec = (n - *head) / 4;
    }
    const int64_t nscalar = n - 4 * *nvec, work = *nvec > nscalar ? *nvec : nscalar;
    return cmlp_k_blocks(work, CMLP_K_THREADS);
}

template <class Op>
static cudaError_t cmlp_launch_map(const Op &op, int64_t n, const int *mis, int nmis, cudaStream_t stream) {
    int64_t head, nvec;
    const unsigned int blocks = cmlp_map_split(n, mis, nmis, &head, &nvec);
    cmlp_k_map<Op><<<blocks, CMLP_K_THREADS, 0, stream>>>(op, n, head, nvec);
    return cudaGetLastError();
}

/* Ops that never skip and keep no per-thread result derive from this. */
struct cmlp_op_base {
    __device__ __forceinline__ bool begin() { return false; }
    __device__ __forceinline__ void finish(bool) const {}
};

#endif /* CMLP_KERNELS_COMMON_CUH */
