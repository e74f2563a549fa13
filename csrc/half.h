/* half.h - the conversion loops behind cmlp_convert_to_half / from_half, shared by the CPU
 * backend (which stores half precision where the GPU would). */
#ifndef CMLP_HALF_H
#define CMLP_HALF_H

#include "internal.h"

CMLP_HIDDEN void cmlp_f32_to_f16(uint16_t *restrict dst, const float *restrict src, int64_t n);
CMLP_HIDDEN void cmlp_f16_to_f32(float *restrict dst, const uint16_t *restrict src, int64_t n);
CMLP_HIDDEN void cmlp_f32_to_bf16(uint16_t *restrict dst, const float *restrict src, int64_t n);
CMLP_HIDDEN void cmlp_bf16_to_f32(float *restrict dst, const uint16_t *restrict src, int64_t n);

#endif /* CMLP_HALF_H */
