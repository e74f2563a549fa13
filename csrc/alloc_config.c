/* alloc_config.c - the allocator settings every device shares, parsed from PyTorch's
 * PYTORCH_CUDA_ALLOC_CONF syntax ("key:value,key:value", the keys and rules of PyTorch's
 * parser), and the size rules that depend on them: request rounding (512 bytes, or power-of-two
 * divisions) and segment sizes.
 */
#include "alloc_internal.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int floor_log2(size_t v) { return v ? 63 - __builtin_clzll((unsigned long long)v) : -1; }

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

/* Read once, as PyTorch reads its variable: CMLP_NO_MEMORY_CACHING where it is set, else
 * PYTORCH_NO_CUDA_MEMORY_CACHING; "1" turns caching off. cmlp_memory_set_caching switches it
 * later, each switch a new generation that every allocator takes up at its next call. */
static _Atomic int caching_disabled = -1;
static _Atomic uint64_t caching_generation = 1;

static void read_caching_env(void) {
    const char *v = getenv("CMLP_NO_MEMORY_CACHING");
    if (!v) v = getenv("PYTORCH_NO_CUDA_MEMORY_CACHING");
    atomic_store(&caching_disabled, v && strcmp(v, "1") == 0);
}

static pthread_once_t caching_once = PTHREAD_ONCE_INIT;

int cmlp_memory_caching_disabled(void) {
    pthread_once(&caching_once, read_caching_env);
    return atomic_load(&caching_disabled);
}

void cmlp_memory_set_caching(int on) {
    pthread_once(&caching_once, read_caching_env); /* (the environment read first: this call wins) */
    atomic_store(&caching_disabled, !on);
    atomic_fetch_add(&caching_generation, 1);
}

uint64_t alloc_caching_generation(void) { return atomic_load(&caching_generation); }

size_t alloc_segment_size(const cmlp_alloc_settings *c, size_t rounded) {
    if (rounded <= K_SMALL_SIZE) return K_SMALL_BUFFER;
    if (rounded < K_MIN_LARGE) return (size_t)c->large_segment_size;
    return (rounded + K_ROUND_LARGE - 1) / K_ROUND_LARGE * K_ROUND_LARGE;
}

/* ---- parsing ---- */

#define DEFAULTS                                                                                                   \
    {.max_split_size = -1, .large_segment_size = K_LARGE_BUFFER, .max_non_split_rounding = K_LARGE_BUFFER,          \
     .per_process_memory_fraction = -1.0, .pinned_num_register_threads = 1}

static const cmlp_alloc_settings defaults = DEFAULTS;

static pthread_mutex_t config_lock = PTHREAD_MUTEX_INITIALIZER;
static cmlp_alloc_settings current = DEFAULTS;
static char *current_text; /* what current was parsed from; NULL: "" */

void alloc_config_current(cmlp_alloc_settings *out) {
    pthread_mutex_lock(&config_lock);
    *out = current;
    pthread_mutex_unlock(&config_lock);
}

void cmlp_memory_get_settings(cmlp_alloc_settings *out) { alloc_config_current(out); }

char *cmlp_memory_settings_text(void) {
    pthread_mutex_lock(&config_lock);
    char *copy = strdup(current_text ? current_text : "");
    pthread_mutex_unlock(&config_lock);
    return copy;
}

/* The text cut into tokens as PyTorch's parser cuts it: ',', ':', '[' and ']' alone, the runs
 * between them with their spaces dropped ("1 28" is "128"). */
typedef struct {
    char **tok;
    size_t n;
} tokens;

static bool delimiter(char c) { return c == ',' || c == ':' || c == '[' || c == ']'; }

/* buf: 2 strlen(src) + 1 bytes, tok: strlen(src) entries (each character may be a token) */
static void tokenize(const char *src, char *buf, tokens *t) {
    t->n = 0;
    char *w = buf;
    for (const char *p = src; *p;) {
        if (isspace((unsigned char)*p)) {
            p++;
            continue;
        }
        t->tok[t->n++] = w;
        if (delimiter(*p)) {
            *w++ = *p++;
        } else {
            for (; *p && !delimiter(*p); p++)
                if (!isspace((unsigned char)*p)) *w++ = *p;
        }
        *w++ = '\0';
    }
}

static const char *at(const tokens *t, size_t i) { return i < t->n ? t->tok[i] : ""; }

static cmlp_status expect(const tokens *t, size_t i, const char *what, const char *key) {
    if (strcmp(at(t, i), what) == 0) return CMLP_OK;
    return CMLP_FAIL(CMLP_ERR_INVALID, "CachingAllocator option %s: expected '%s'%s%s", key, what,
                     i < t->n ? ", got " : " at the end", at(t, i));
}

static cmlp_status bad(const char *key, const char *val, const char *why) {
    return CMLP_FAIL(CMLP_ERR_INVALID, "CachingAllocator option %s: invalid value '%s' (%s)", key, val, why);
}

static cmlp_status to_long(const char *key, const char *val, long lo, long *out) {
    char *end;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (!*val || *end || errno) return bad(key, val, "expected an integer");
    if (v < lo) return bad(key, val, lo ? "too small" : "must not be negative");
    *out = v;
    return CMLP_OK;
}

static cmlp_status to_double(const char *key, const char *val, double *out) {
    char *end;
    double v = strtod(val, &end);
    if (!*val || *end || !isfinite(v)) return bad(key, val, "expected a number");
    *out = v;
    return CMLP_OK;
}

/* PyTorch's spelling alone: a setting written here also works there (PyTorch refuses "true"). */
static cmlp_status to_bool(const char *key, const char *val, int *out) {
    if (!strcmp(val, "True")) *out = 1;
    else if (!strcmp(val, "False")) *out = 0;
    else return bad(key, val, "expected True or False, as PyTorch spells them");
    return CMLP_OK;
}

static bool is_pow2(long v) { return v > 0 && (v & (v - 1)) == 0; }
static bool divisions_ok(long v) { return is_pow2(v) && v <= (1L << 30); } /* stored as int */

/* A size in MiB of at least `min_mb`, as bytes; as PyTorch's, a larger one than any device has is
 * taken as the largest (2**36 MiB here: sums of sizes stay far from overflowing). */
static cmlp_status to_mib(const char *key, const char *val, long min_mb, bool above, int64_t *out) {
    long v = 0;
    CMLP_TRY(to_long(key, val, 0, &v));
    if (above ? v <= min_mb : v < min_mb)
        return CMLP_FAIL(CMLP_ERR_INVALID, "CachingAllocator option %s too small, must be %s %ld", key,
                         above ? ">" : ">=", min_mb);
    if (v > (1L << 36)) v = 1L << 36;
    *out = (int64_t)v * (int64_t)MIB;
    return CMLP_OK;
}

/* roundup_power2_divisions: one count for every size, or a list of size_mb:divisions where
 * size_mb (a power of two) sets the interval [size_mb, 2 size_mb) MiB, the first entry also
 * every interval below it, and ">:divisions" every interval after the last size given: the
 * rule of PyTorch's parser (whose documentation reads the key as an upper bound instead). */
static cmlp_status parse_roundup(const tokens *t, size_t *i, cmlp_alloc_settings *c) {
    const char *key = "roundup_power2_divisions";
    int *div = c->roundup_power2_divisions;
    long v = 0;
    if (strcmp(at(t, ++*i), "[") != 0) {
        CMLP_TRY(to_long(key, at(t, *i), 0, &v));
        if (!divisions_ok(v)) return bad(key, at(t, *i), "divisions must be a power of 2 up to 2**30");
        for (int k = 0; k < CMLP_ROUNDUP_INTERVALS; k++) div[k] = (int)v;
        return CMLP_OK;
    }
    int last = 0;
    bool first = true;
    while (++*i < t->n && strcmp(t->tok[*i], "]") != 0) {
        const char *size = t->tok[*i];
        CMLP_TRY(expect(t, ++*i, ":", key));
        const char *val = at(t, ++*i);
        CMLP_TRY(to_long(key, val, 0, &v));
        if (v != 0 && !divisions_ok(v)) return bad(key, val, "divisions must be 0 or a power of 2 up to 2**30");
        if (strcmp(size, ">") == 0) {
            for (int k = last + 1; k < CMLP_ROUNDUP_INTERVALS; k++) div[k] = (int)v;
        } else {
            long mb = 0;
            CMLP_TRY(to_long(key, size, 0, &mb));
            if (!is_pow2(mb)) return bad(key, size, "sizes are MiB and must be powers of 2");
            int idx = floor_log2((size_t)mb);
            if (idx > CMLP_ROUNDUP_INTERVALS - 1) idx = CMLP_ROUNDUP_INTERVALS - 1;
            for (int k = 0; first && k < idx; k++) div[k] = (int)v;
            first = false;
            div[idx] = (int)v;
            last = idx;
        }
        if (strcmp(at(t, *i + 1), "]") != 0) CMLP_TRY(expect(t, ++*i, ",", key));
    }
    if (*i >= t->n) return bad(key, "[", "expected ']' at the end of the list");
    return CMLP_OK;
}

/* PyTorch's options with no effect on cmlp's allocator (pinned host memory, its other CUDA
 * backend's details, graph capture's stream reuse): checked as PyTorch checks them, so that a
 * PYTORCH_CUDA_ALLOC_CONF written for PyTorch works here too, and otherwise ignored; those a
 * PyTorch snapshot lists among its settings are kept (at `field`, an int; -1: not kept). */
#define KEPT(f) offsetof(cmlp_alloc_settings, f)
static const struct {
    const char *key;
    char kind; /* 'b': True/False, 'n': an integer >= 0, 'p': > 0, '2': a power of 2 up to 128, 'v': any one value,
                * 'l': a list [name:value, ...] */
    ptrdiff_t field;
} accepted[] = {
    {"pinned_use_background_threads", 'b', -1},
    {"release_lock_on_cudamalloc", 'b', KEPT(release_lock_on_cudamalloc)},
    {"release_lock_on_hipmalloc", 'b', KEPT(release_lock_on_cudamalloc)},
    {"pinned_use_cuda_host_register", 'b', KEPT(pinned_use_host_register)},
    {"pinned_use_hip_host_register", 'b', KEPT(pinned_use_host_register)},
    {"graph_capture_record_stream_reuse", 'b', KEPT(graph_capture_record_stream_reuse)},
    {"pinned_free_catch_all", 'b', -1},
    {"throw_on_cudamalloc_oom", 'b', -1},
    {"pinned_num_register_threads", '2', KEPT(pinned_num_register_threads)},
    {"pinned_reserve_segment_size_mb", 'p', -1},
    {"pinned_max_round_threshold_mb", 'n', -1},
    {"pinned_max_cached_size_mb", 'n', -1},
    {"expandable_segments_handle_type", 'v', -1},
    {"expandable_segments_reserve", 'v', -1}, /* (a pool's segment spans the device) */
    {"expandable_segments_reserve_by_class", 'l', -1},
};
#undef KEPT

static const char *const own_keys[] = {
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
    "roundup_power2_divisions", "expandable_segments", "per_process_memory_fraction", "backend",
};

/* A list of name:value pairs, [] or [a:0.5,b:40G], at *i (its "["); *i ends at its "]". */
static cmlp_status skip_pairs(const tokens *t, size_t *i, const char *key) {
    CMLP_TRY(expect(t, *i, "[", key));
    if (!strcmp(at(t, *i + 1), "]")) {
        ++*i;
        return CMLP_OK;
    }
    for (;;) {
        const char *name = at(t, ++*i);
        if (*i >= t->n || strchr(",:[]", name[0])) return bad(key, name, "expected name:value in the list");
        CMLP_TRY(expect(t, ++*i, ":", key));
        const char *val = at(t, ++*i);
        if (*i >= t->n || strchr(",:[]", val[0])) return bad(key, val, "expected name:value in the list");
        const char *next = at(t, ++*i);
        if (!strcmp(next, "]")) return CMLP_OK;
        CMLP_TRY(expect(t, *i, ",", key));
    }
}

static char kind_of(const char *key) {
    for (size_t k = 0; k < sizeof accepted / sizeof accepted[0]; k++)
        if (!strcmp(key, accepted[k].key)) return accepted[k].kind;
    return 0;
}

static bool known(const char *key) {
    for (size_t k = 0; k < sizeof own_keys / sizeof own_keys[0]; k++)
        if (!strcmp(key, own_keys[k])) return true;
    return kind_of(key) != 0;
}

static cmlp_status parse_key(const tokens *t, size_t *i, cmlp_alloc_settings *c) {
    const char *key = at(t, *i);
    if (!known(key)) return CMLP_FAIL(CMLP_ERR_INVALID, "Unrecognized CachingAllocator option: %s", key);
    CMLP_TRY(expect(t, ++*i, ":", key));
    if (!strcmp(key, "roundup_power2_divisions")) return parse_roundup(t, i, c);
    if (kind_of(key) == 'l') {
        ++*i;
        return skip_pairs(t, i, key);
    }
    const char *val = at(t, ++*i);
    if (*i >= t->n || strchr(",:[]", val[0])) return bad(key, val, "a value must follow the key");
    if (!strcmp(key, "large_segment_size_mb")) {
        return CMLP_OK; /* read first (parse_settings) */
    } else if (!strcmp(key, "max_split_size_mb")) {
        return to_mib(key, val, (long)(c->large_segment_size / (int64_t)MIB), false, &c->max_split_size);
    } else if (!strcmp(key, "max_non_split_rounding_mb")) {
        return to_mib(key, val, (long)(c->large_segment_size / (int64_t)MIB), false, &c->max_non_split_rounding);
    } else if (!strcmp(key, "garbage_collection_threshold")) {
        CMLP_TRY(to_double(key, val, &c->garbage_collection_threshold));
        if (!(c->garbage_collection_threshold > 0.0 && c->garbage_collection_threshold < 1.0))
            return bad(key, val, "garbage_collection_threshold must be in (0.0, 1.0)");
    } else if (!strcmp(key, "expandable_segments")) {
        return to_bool(key, val, &c->expandable_segments);
    } else if (!strcmp(key, "per_process_memory_fraction")) {
        CMLP_TRY(to_double(key, val, &c->per_process_memory_fraction));
        if (!(c->per_process_memory_fraction >= 0.0 && c->per_process_memory_fraction <= 1.0))
            return bad(key, val, "per_process_memory_fraction must be in [0.0, 1.0]");
    } else if (!strcmp(key, "backend")) {
        /* PyTorch's other backend, cudaMallocAsync, is not there: its request is noted (the caller
         * says it is ignored) so that a setting written for PyTorch still works */
        if (!strcmp(val, "cudaMallocAsync")) c->backend_async = 1;
        else if (strcmp(val, "native") != 0) return bad(key, val, "the backends are native and cudaMallocAsync");
    } else {
        for (size_t k = 0; k < sizeof accepted / sizeof accepted[0]; k++) {
            if (strcmp(key, accepted[k].key) != 0) continue;
            int flag = 0;
            long v = 0;
            if (accepted[k].kind == 'b') CMLP_TRY(to_bool(key, val, &flag));
            if (accepted[k].kind == 'n') CMLP_TRY(to_long(key, val, 0, &v));
            if (accepted[k].kind == 'p') CMLP_TRY(to_long(key, val, 1, &v));
            if (accepted[k].kind == '2') {
                CMLP_TRY(to_long(key, val, 0, &v));
                if (!(is_pow2(v) && v <= 128)) return bad(key, val, "a power of 2 up to 128");
            }
            int *kept = accepted[k].field >= 0 ? (int *)((char *)c + accepted[k].field) : NULL;
            if (kept) *kept = accepted[k].kind == 'b' ? flag : (int)v;
            break;
        }
    }
    return CMLP_OK;
}

static cmlp_status parse_settings(const tokens *t, cmlp_alloc_settings *c) {
    /* large_segment_size_mb first: the smallest max_split_size_mb and max_non_split_rounding_mb
     * follow it, and the latter defaults to it */
    for (size_t i = 0; i + 2 < t->n; i++)
        if (!strcmp(t->tok[i], "large_segment_size_mb") && !strcmp(t->tok[i + 1], ":"))
            CMLP_TRY(to_mib("large_segment_size_mb", t->tok[i + 2], (long)(K_MIN_LARGE / MIB), true,
                            &c->large_segment_size));
    c->max_non_split_rounding = c->large_segment_size;
    for (size_t i = 0; i < t->n; i++) {
        const char *key = t->tok[i];
        CMLP_TRY(parse_key(t, &i, c));
        if (i + 1 < t->n) CMLP_TRY(expect(t, ++i, ",", key));
    }
    return CMLP_OK;
}

cmlp_status cmlp_memory_parse_settings(const char *conf, cmlp_alloc_settings *out) {
    if (!conf) return CMLP_FAIL(CMLP_ERR_INVALID, "the allocator configuration must not be NULL");
    cmlp_alloc_settings c = defaults;
    size_t len = strlen(conf);
    char *buf = malloc(2 * len + 1);
    tokens t = {.tok = malloc((len + 1) * sizeof(char *))};
    cmlp_status st = CMLP_OK;
    if (!buf || !t.tok) {
        st = CMLP_FAIL(CMLP_ERR_OOM, "out of host memory parsing the allocator configuration");
    } else {
        tokenize(conf, buf, &t);
        st = parse_settings(&t, &c);
    }
    free(buf);
    free(t.tok);
    if (st == CMLP_OK) *out = c;
    return st;
}

/* The settings from the environment: the "VAR=value" last applied from it (NULL: none), and
 * whether cmlp_memory_configure was called since (settings given at run time stay). env_lock
 * makes the re-read as the first GPU opens (check, apply, note) one step against configure(), and
 * happen once; it is taken before config_lock (and registry_lock, which applying takes). */
static pthread_mutex_t env_lock = PTHREAD_MUTEX_INITIALIZER;
static char *env_applied;
static bool configured_by_call, env_rechecked;

static cmlp_status apply(const char *conf, bool by_call) {
    cmlp_alloc_settings c;
    CMLP_TRY(cmlp_memory_parse_settings(conf, &c));
    char *text = strdup(conf);
    if (!text) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory keeping the allocator's settings");
    pthread_mutex_lock(&config_lock);
    current = c;
    free(current_text);
    current_text = text;
    if (by_call) configured_by_call = true;
    pthread_mutex_unlock(&config_lock);
    alloc_config_changed();
    cmlp_devices_apply_fraction(&c);
    return CMLP_OK;
}

cmlp_status cmlp_memory_configure(const char *conf) {
    pthread_mutex_lock(&env_lock);
    cmlp_status st = apply(conf, true);
    pthread_mutex_unlock(&env_lock);
    return st;
}

static cmlp_status note_env(const char *applied) {
    char *copy = applied ? strdup(applied) : NULL;
    if (applied && !copy) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory noting the allocator's settings");
    pthread_mutex_lock(&config_lock);
    free(env_applied);
    env_applied = copy;
    configured_by_call = false;
    pthread_mutex_unlock(&config_lock);
    return CMLP_OK;
}

cmlp_status cmlp_memory_note_env(const char *applied) {
    pthread_mutex_lock(&env_lock);
    cmlp_status st = note_env(applied);
    pthread_mutex_unlock(&env_lock);
    return st;
}

/* The first of the variables that is set, as "VAR=value" (malloc'd) with *var and *value in
 * the environment; NULL with none set (or no memory: *st says). */
static char *env_text(const char **var, const char **value, cmlp_status *st) {
    static const char *const vars[] = {"CMLP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"};
    *value = NULL;
    for (size_t i = 0; i < sizeof vars / sizeof vars[0] && !*value; i++) *value = getenv(*var = vars[i]);
    *st = CMLP_OK;
    if (!*value) return NULL;
    size_t n = strlen(*var) + strlen(*value) + 2;
    char *text = malloc(n);
    if (!text) *st = CMLP_FAIL(CMLP_ERR_OOM, "out of host memory reading the allocator's settings");
    else snprintf(text, n, "%s=%s", *var, *value);
    return text;
}

cmlp_status cmlp_memory_env_recheck(void) {
    pthread_mutex_lock(&env_lock);
    cmlp_status st = CMLP_OK;
    if (!env_rechecked) {
        const char *var, *value;
        char *text = env_text(&var, &value, &st);
        bool stay = !text || configured_by_call || (env_applied && strcmp(env_applied, text) == 0);
        if (text && !stay) {
            st = apply(value, false);
            if (st == CMLP_OK) {
                st = note_env(text);
            } else {
                char why[1300]; /* the parser's message, copied out of the buffer the new one is written to */
                snprintf(why, sizeof why, "%s", cmlp_error_text(cmlp_last_error()));
                st = CMLP_FAIL(st, "%.200s=\"%.300s\" (set after import; read as the first GPU opens, as PyTorch "
                                   "reads it when CUDA starts): %s", var, value, why);
            }
        }
        free(text);
        env_rechecked = st == CMLP_OK; /* a bad one is read again at the next try */
    }
    pthread_mutex_unlock(&env_lock);
    return st;
}
