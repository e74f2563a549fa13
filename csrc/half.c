/* half.c - fp32 <-> fp16 / bf16 conversions, the rounding points of mixed precision. fp16 uses
 * the compiler's _Float16 (F16C / AVX512-FP16 instructions where the target has them: round to
 * nearest even, overflow to inf, subnormals kept, whatever MXCSR's FTZ/DAZ say). bf16 is done
 * on the bits: the conversion instruction some CPUs offer flushes subnormals, which the GPU
 * does not.
 */
#include "half.h"

#include <string.h>

#if defined(CMLP_HAVE_FLOAT16)
/* set by the build (tests force 0 to check the portable path) */
#elif defined(__FLT16_MAX__)
#define CMLP_HAVE_FLOAT16 1
#else
#define CMLP_HAVE_FLOAT16 0
#endif

/* The conversion instructions themselves, 16 or 8 values at a time (compilers emit them only
 * one value at a time for _Float16 loops). */
#if CMLP_HAVE_FLOAT16 && defined(__AVX512F__)
#include <immintrin.h>
#define CMLP_F16_SIMD 512
#elif CMLP_HAVE_FLOAT16 && defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define CMLP_F16_SIMD 256
#else
#define CMLP_F16_SIMD 0
#endif

#if !CMLP_HAVE_FLOAT16
static uint16_t f32_to_f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);           /* NaN */
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);          /* rounds to inf */
    if (ax < 0x38800000u) {                                            /* fp16 subnormal or 0 */
        if (ax < 0x33000000u) return (uint16_t)sign;                   /* below half the min */
        uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
        int shift = 126 - (int)(ax >> 23);                             /* 14 + (113 - e) */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        r += rem > half || (rem == half && (r & 1));
        return (uint16_t)(sign | r);
    }
    uint32_t r = ax - 0x38000000u;                                     /* rebias 127 -> 15 */
    r += 0xFFFu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

static float f16_bits_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, x;
    if (e == 0x1F) x = sign | 0x7F800000u | (m << 13);
    else if (e) x = sign | ((e + 112u) << 23) | (m << 13);
    else if (!m) x = sign;
    else {
        int s = 0;
        while (!(m & 0x400u)) {
            m <<= 1;
            s++;
        }
        x = sign | ((uint32_t)(113 - s) << 23) | ((m & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}
#endif

void cmlp_f32_to_f16(uint16_t *restrict dst, const float *restrict src, int64_t n) {
#if CMLP_HAVE_FLOAT16
    int64_t i = 0;
#if CMLP_F16_SIMD == 512
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif CMLP_F16_SIMD == 256
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    _Float16 *d = (_Float16 *)(void *)dst;
    for (; i < n; i++) d[i] = (_Float16)src[i];
#else
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_f16_bits(src[i]);
#endif
}

void cmlp_f16_to_f32(float *restrict dst, const uint16_t *restrict src, int64_t n) {
#if CMLP_HAVE_FLOAT16
    int64_t i = 0;
#if CMLP_F16_SIMD == 512
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#elif CMLP_F16_SIMD == 256
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    const _Float16 *s = (const _Float16 *)(const void *)src;
    for (; i < n; i++) dst[i] = (float)s[i];
#else
    for (int64_t i = 0; i < n; i++) dst[i] = f16_bits_to_f32(src[i]);
#endif
}

void cmlp_f32_to_bf16(uint16_t *restrict dst, const float *restrict src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t x;
        memcpy(&x, &src[i], 4);
        uint32_t r = x + 0x7FFFu + ((x >> 16) & 1u); /* round to nearest even on the low 16 bits */
        bool nan = (x & 0x7FFFFFFFu) > 0x7F800000u;
        dst[i] = (uint16_t)(nan ? (x >> 16) | 0x40u : r >> 16);
    }
}

void cmlp_bf16_to_f32(float *restrict dst, const uint16_t *restrict src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t x = (uint32_t)src[i] << 16;
        memcpy(&dst[i], &x, 4);
    }
}

/* Both run in the floating-point environment training uses (subnormals flushed in fp32
 * arithmetic), so what these return is what training stores. */
cmlp_status cmlp_convert_to_half(uint16_t *dst, const float *src, int64_t n, cmlp_dtype dtype) {
    if (n < 0 || (n && (!dst || !src))) return CMLP_FAIL(CMLP_ERR_INVALID, "bad conversion arguments");
    if (dtype != CMLP_DTYPE_F16 && dtype != CMLP_DTYPE_BF16)
        return CMLP_FAIL(CMLP_ERR_INVALID, "half-precision dtype must be fp16 or bf16, got %d", (int)dtype);
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    if (dtype == CMLP_DTYPE_F16) cmlp_f32_to_f16(dst, src, n);
    else cmlp_f32_to_bf16(dst, src, n);
    cmlp_fpenv_leave(&fe);
    return CMLP_OK;
}

cmlp_status cmlp_convert_from_half(float *dst, const uint16_t *src, int64_t n, cmlp_dtype dtype) {
    if (n < 0 || (n && (!dst || !src))) return CMLP_FAIL(CMLP_ERR_INVALID, "bad conversion arguments");
    if (dtype != CMLP_DTYPE_F16 && dtype != CMLP_DTYPE_BF16)
        return CMLP_FAIL(CMLP_ERR_INVALID, "half-precision dtype must be fp16 or bf16, got %d", (int)dtype);
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    if (dtype == CMLP_DTYPE_F16) cmlp_f16_to_f32(dst, src, n);
    else cmlp_bf16_to_f32(dst, src, n);
    cmlp_fpenv_leave(&fe);
    return CMLP_OK;
}
