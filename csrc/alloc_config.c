/* alloc_config.c - the allocator settings every device shares, parsed from PyTorch's
 * PYTORCH_CUDA_ALLOC_CONF syntax ("key:value,key:value"), and the size rules that depend on
 * them: request rounding (512 bytes, or power-of-two divisions) and segment sizes.
 */
#include "alloc_internal.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t config_lock = PTHREAD_MUTEX_INITIALIZER;
static cmlp_alloc_settings current = {.max_split_size = -1};

void alloc_config_current(cmlp_alloc_settings *out) {
    pthread_mutex_lock(&config_lock);
    *out = current;
    pthread_mutex_unlock(&config_lock);
}

void cmlp_memory_get_settings(cmlp_alloc_settings *out) { alloc_config_current(out); }

static bool is_pow2(long v) { return v > 0 && (v & (v - 1)) == 0; }
static bool divisions_ok(long v) { return is_pow2(v) && v <= (1L << 30); } /* stored as int */

static int floor_log2(size_t v) {
    int r = -1;
    while (v) {
        v >>= 1;
        r++;
    }
    return r;
}

/* Interval i covers [2^i MiB, 2^(i+1) MiB); interval 0 also everything below 1 MiB. */
static int roundup_interval(size_t size) {
    int lg = floor_log2(size) - 20;
    if (lg < 0) lg = 0;
    return lg >= CMLP_ROUNDUP_INTERVALS ? CMLP_ROUNDUP_INTERVALS - 1 : lg;
}

/* The next of `divisions` equal steps between the powers of two around size
 * (1200 MiB with 4 divisions -> 1280 MiB). */
static size_t next_division(size_t size, size_t divisions) {
    if ((size & (size - 1)) == 0) return size;
    size_t floor2 = (size_t)1 << floor_log2(size);
    size_t step = floor2 / divisions;
    if (step == 0) return floor2 << 1;
    size_t down = size & ~(step - 1);
    return down == size ? size : down + step;
}

size_t alloc_round_size(const cmlp_alloc_settings *c, size_t n) {
    if (n < K_MIN_BLOCK) return K_MIN_BLOCK;
    size_t div = (size_t)c->roundup_power2_divisions[roundup_interval(n)];
    /* divisions finer than the 512-byte block would break the block granularity */
    if (div > 1 && n > K_MIN_BLOCK * div) return next_division(n, div);
    return (n + K_MIN_BLOCK - 1) / K_MIN_BLOCK * K_MIN_BLOCK;
}

size_t alloc_segment_size(size_t rounded) {
    if (rounded <= K_SMALL_SIZE) return K_SMALL_BUFFER;
    if (rounded < K_MIN_LARGE) return K_LARGE_BUFFER;
    return (rounded + K_ROUND_LARGE - 1) / K_ROUND_LARGE * K_ROUND_LARGE;
}

/* ---- parsing ---- */

static cmlp_status bad(const char *key, const char *val, const char *why) {
    return CMLP_FAIL(CMLP_ERR_INVALID, "CachingAllocator option %s: invalid value '%s' (%s)", key, val, why);
}

static cmlp_status parse_long(const char *key, const char *val, long *out) {
    char *end;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (!*val || *end || errno) return bad(key, val, "expected an integer");
    *out = v;
    return CMLP_OK;
}

static cmlp_status parse_roundup(const char *val, cmlp_alloc_settings *c) {
    const char *key = "roundup_power2_divisions";
    if (val[0] != '[') {
        long v = 0;
        CMLP_TRY(parse_long(key, val, &v));
        if (v != 0 && !divisions_ok(v)) return bad(key, val, "divisions must be 0 or a power of 2 up to 2**30");
        for (int i = 0; i < CMLP_ROUNDUP_INTERVALS; i++) c->roundup_power2_divisions[i] = (int)v;
        return CMLP_OK;
    }
    size_t len = strlen(val);
    if (len < 2 || val[len - 1] != ']') return bad(key, val, "expected [size_mb:divisions,...,>:divisions]");
    char buf[512];
    if (len - 2 >= sizeof buf) return bad(key, val, "too long");
    memcpy(buf, val + 1, len - 2);
    buf[len - 2] = '\0';
    int last = 0;
    bool rest = false;
    for (char *save = NULL, *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(item, ':');
        if (!colon || rest) return bad(key, val, "entries are size_mb:divisions, with >:divisions last");
        *colon = '\0';
        long div = 0;
        CMLP_TRY(parse_long(key, colon + 1, &div));
        if (div != 0 && !divisions_ok(div)) return bad(key, val, "divisions must be 0 or a power of 2 up to 2**30");
        if (strcmp(item, ">") == 0) {
            for (int i = last; i < CMLP_ROUNDUP_INTERVALS; i++) c->roundup_power2_divisions[i] = (int)div;
            rest = true;
            continue;
        }
        long mb = 0;
        CMLP_TRY(parse_long(key, item, &mb));
        if (!is_pow2(mb)) return bad(key, val, "sizes are MiB and must be powers of 2");
        int idx = floor_log2((size_t)mb);
        if (idx > CMLP_ROUNDUP_INTERVALS) idx = CMLP_ROUNDUP_INTERVALS;
        if (idx < last) return bad(key, val, "sizes must increase");
        /* "256:1" sets the divisions of every size below 256 MiB not set before */
        for (int i = last; i < idx; i++) c->roundup_power2_divisions[i] = (int)div;
        if (idx == last && idx < CMLP_ROUNDUP_INTERVALS) c->roundup_power2_divisions[idx] = (int)div;
        last = idx;
    }
    return CMLP_OK;
}

static cmlp_status parse_pair(char *key, char *val, cmlp_alloc_settings *c) {
    if (strcmp(key, "max_split_size_mb") == 0) {
        long v = 0;
        CMLP_TRY(parse_long(key, val, &v));
        if (v <= (long)(K_LARGE_BUFFER / MIB))
            return CMLP_FAIL(CMLP_ERR_INVALID, "CachingAllocator option max_split_size_mb too small, must be > %zu",
                             K_LARGE_BUFFER / MIB);
        if (v > (long)(INT64_MAX / (int64_t)MIB)) return bad(key, val, "too large");
        c->max_split_size = (int64_t)v * (int64_t)MIB;
    } else if (strcmp(key, "garbage_collection_threshold") == 0) {
        char *end;
        double v = strtod(val, &end);
        if (!*val || *end || !(v > 0.0 && v < 1.0))
            return bad(key, val, "garbage_collection_threshold must be in (0.0, 1.0)");
        c->garbage_collection_threshold = v;
    } else if (strcmp(key, "roundup_power2_divisions") == 0) {
        CMLP_TRY(parse_roundup(val, c));
    } else if (strcmp(key, "expandable_segments") == 0) {
        if (strcmp(val, "True") == 0 || strcmp(val, "true") == 0 || strcmp(val, "1") == 0) c->expandable_segments = 1;
        else if (strcmp(val, "False") == 0 || strcmp(val, "false") == 0 || strcmp(val, "0") == 0) c->expandable_segments = 0;
        else return bad(key, val, "expected True or False");
    } else if (strcmp(key, "backend") == 0) {
        if (strcmp(val, "native") != 0) return bad(key, val, "cmlp has one allocator backend: native");
    } else if (strcmp(key, "release_lock_on_cudamalloc") == 0 || strcmp(key, "pinned_use_cuda_host_register") == 0 ||
               strcmp(key, "pinned_num_register_threads") == 0 || strcmp(key, "pinned_use_background_threads") == 0) {
        /* PyTorch's host-side options: accepted so that a PYTORCH_CUDA_ALLOC_CONF written for
         * PyTorch also works here; they have no effect on cmlp's allocator */
    } else {
        return CMLP_FAIL(CMLP_ERR_INVALID, "Unrecognized CachingAllocator option: %s", key);
    }
    return CMLP_OK;
}

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
    return s;
}

cmlp_status cmlp_memory_parse_settings(const char *conf, cmlp_alloc_settings *out) {
    cmlp_alloc_settings c = {.max_split_size = -1};
    if (!conf) return CMLP_FAIL(CMLP_ERR_INVALID, "the allocator configuration must not be NULL");
    size_t len = strlen(conf);
    char *buf = malloc(len + 1);
    if (!buf) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory parsing the allocator configuration");
    memcpy(buf, conf, len + 1);
    cmlp_status st = CMLP_OK;
    /* split on commas outside brackets */
    char *start = buf;
    int depth = 0;
    for (char *p = buf;; p++) {
        if (*p == '[') depth++;
        if (*p == ']') depth--;
        if ((*p == ',' && depth == 0) || *p == '\0') {
            bool end = *p == '\0';
            *p = '\0';
            char *item = trim(start);
            if (*item) {
                char *colon = strchr(item, ':');
                if (!colon) {
                    st = CMLP_FAIL(CMLP_ERR_INVALID, "CachingAllocator option '%s' has no value (expected key:value)", item);
                    break;
                }
                *colon = '\0';
                st = parse_pair(trim(item), trim(colon + 1), &c);
                if (st != CMLP_OK) break;
            }
            if (end) break;
            start = p + 1;
        }
    }
    free(buf);
    if (st == CMLP_OK) *out = c;
    return st;
}

cmlp_status cmlp_memory_configure(const char *conf) {
    cmlp_alloc_settings c;
    CMLP_TRY(cmlp_memory_parse_settings(conf, &c));
    pthread_mutex_lock(&config_lock);
    current = c;
    pthread_mutex_unlock(&config_lock);
    alloc_config_changed();
    return CMLP_OK;
}
