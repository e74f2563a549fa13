/* test_half.c - the portable fp16 conversions (used where the compiler has no _Float16) against
 * the native ones this build uses, for every fp16 value and a million floats including the
 * edges; bf16 against a plain bit reference. Exits non-zero when any check fails.
 */
#include "cmlp.h" /* the real (native) conversions, declared before the renaming below */

#define CMLP_HAVE_FLOAT16 0
#define cmlp_f32_to_f16 portable_f32_to_f16
#define cmlp_f16_to_f32 portable_f16_to_f32
#define cmlp_f32_to_bf16 portable_f32_to_bf16
#define cmlp_bf16_to_f32 portable_bf16_to_f32
#define cmlp_convert_to_half portable_convert_to_half
#define cmlp_convert_from_half portable_convert_from_half
#include "../../csrc/half.c"
#undef cmlp_f32_to_f16
#undef cmlp_f16_to_f32
#undef cmlp_f32_to_bf16
#undef cmlp_bf16_to_f32
#undef cmlp_convert_to_half
#undef cmlp_convert_from_half

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int same_float(float a, float b) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    return memcmp(&a, &b, 4) == 0;
}

int main(void) {
    int failed = 0, passed = 0;
    /* every fp16 pattern decodes the same */
    for (uint32_t h = 0; h < 65536; h++) {
        uint16_t u = (uint16_t)h;
        float a, b;
        portable_f16_to_f32(&a, &u, 1);
        cmlp_convert_from_half(&b, &u, 1, CMLP_DTYPE_F16);
        if (same_float(a, b)) passed++;
        else if (failed++ < 10) printf("FAIL decode %04x: %g vs %g\n", h, (double)a, (double)b);
    }
    /* a million floats: random bits, the fp16 range, midpoints between fp16 neighbours */
    uint64_t s = 0x243F6A8885A308D3ull;
    for (int i = 0; i < 1000000; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        uint32_t bits = (uint32_t)s;
        float f;
        if (i % 3 == 0) memcpy(&f, &bits, 4);
        else if (i % 3 == 1) f = ((float)(bits >> 8) / 16777216.0f - 0.5f) * 140000.0f * ((bits & 1) ? 1e-4f : 1.0f);
        else { /* exact midpoint of two neighbouring fp16 values */
            uint16_t lo = (uint16_t)(bits & 0x7BFF), hi = (uint16_t)(lo + 1);
            float a, b;
            cmlp_convert_from_half(&a, &lo, 1, CMLP_DTYPE_F16);
            cmlp_convert_from_half(&b, &hi, 1, CMLP_DTYPE_F16);
            f = (float)(((double)a + (double)b) / 2.0);
        }
        uint16_t p, n;
        portable_f32_to_f16(&p, &f, 1);
        cmlp_convert_to_half(&n, &f, 1, CMLP_DTYPE_F16);
        int nan = isnan(f);
        if (nan ? ((p & 0x7C00) == 0x7C00 && (p & 0x3FF) && (n & 0x7C00) == 0x7C00 && (n & 0x3FF)) : p == n) passed++;
        else if (failed++ < 10) printf("FAIL encode %a: portable %04x native %04x\n", (double)f, p, n);
    }
    /* bf16: round to nearest even on the top half, NaN kept, subnormals kept */
    float edge[] = {1.0f, 1.00390625f, 1.01171875f, 3.0e38f, 3.4028235e38f, 1e-39f, -1e-40f, INFINITY, NAN, 0.0f, -0.0f};
    uint16_t expect[] = {0x3F80, 0x3F80, 0x3F82, 0x7F62, 0x7F80, 0x000B, 0x8001, 0x7F80, 0x7FC0, 0x0000, 0x8000};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) {
        uint16_t got;
        cmlp_convert_to_half(&got, &edge[i], 1, CMLP_DTYPE_BF16);
        if (got == expect[i] || (isnan(edge[i]) && (got & 0x7F80) == 0x7F80 && (got & 0x7F))) passed++;
        else if (failed++ < 20) printf("FAIL bf16 %a: %04x, expected %04x\n", (double)edge[i], got, expect[i]);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
