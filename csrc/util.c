/* util.c - small services of the core: the seeded random generator (xoshiro256** seeded by
 * splitmix64), the floating-point environment (subnormals flushed while cmlp computes), the
 * path of a library that lives beside this module, and the hash the ranks compare values by.
 */
#include "internal.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define CMLP_HAVE_MXCSR 1
#else
#define CMLP_HAVE_MXCSR 0
#endif

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void cmlp_rng_seed(cmlp_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t cmlp_rng_next(cmlp_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double cmlp_rng_uniform(cmlp_rng *r) { return (double)(cmlp_rng_next(r) >> 11) * 0x1.0p-53; }

uint64_t cmlp_rng_below(cmlp_rng *r, uint64_t n) {
    /* rejection keeps the draw unbiased for any n */
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = cmlp_rng_next(r);
    while (x >= limit);
    return x % n;
}

/* FTZ (bit 15) and DAZ (bit 6): a dead unit's Adam moments decay into subnormals otherwise,
 * and every operation on them takes a microcode assist. */
void cmlp_fpenv_enter(cmlp_fpenv *e) {
#if CMLP_HAVE_MXCSR
    e->saved = _mm_getcsr();
    _mm_setcsr(e->saved | 0x8040u);
#else
    e->saved = 0;
#endif
}

bool cmlp_beside_module(const char *name, char *out, size_t cap) {
    Dl_info info;
    if (!dladdr((void *)cmlp_beside_module, &info) || !info.dli_fname) return false;
    const char *slash = strrchr(info.dli_fname, '/');
    int dir = slash ? (int)(slash - info.dli_fname) : 0;
    snprintf(out, cap, "%.*s%s%s", dir, info.dli_fname, slash ? "/" : "", name);
    return true;
}

void cmlp_fpenv_leave(const cmlp_fpenv *e) {
#if CMLP_HAVE_MXCSR
    _mm_setcsr(e->saved);
#else
    (void)e;
#endif
}

uint64_t cmlp_hash_bytes(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t w = 0;
        memcpy(&w, b + i, n - i < 8 ? n - i : 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
    }
    return h;
}
