/* bench_alloc.c - benchmark of cmlp's caching allocator on the CPU backend.
 * 1. Latency of a cached alloc+free pair (512 B, 64 KiB, 4 MiB, and a mixed working set of
 *    100 live blocks), next to posix_memalign(64)+free and malloc+free.
 * 2. Fragmentation on a replayed trace of MLP 784-512-256-10 training steps (PyTorch-style,
 *    one allocation per tensor) whose batch size changes: peak reserved / peak allocated per
 *    configuration and ladder; the same trace under a memory limit (OOMs counted); and the
 *    smallest limit under which it runs without an OOM.
 * Prints markdown tables. Build and run with bench/run_alloc.sh.
 */
#include "alloc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MIB ((int64_t)1 << 20)
#define MIB_D (1024.0 * 1024.0)

static void die(const char *what) {
    fprintf(stderr, "bench_alloc: %s: %s\n", what, cmlp_last_error());
    exit(1);
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* Keeps the compiler from eliding an allocation whose pointer is never used. */
static inline void escape(void *p) { __asm__ volatile("" : : "r"(p) : "memory"); }

static uint64_t rng_state;
static uint64_t rng(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_unit(void) { return (double)(rng() >> 11) / 9007199254740992.0; }

static cmlp_allocator *new_allocator(const char *conf, bool pytorch_ladder) {
    cmlp_allocator *a = NULL;
    if (cmlp_memory_configure(conf) != CMLP_OK) die("configure");
    if (cmlp_allocator_create(&cmlp_backend_cpu, NULL, "cpu", &a) != CMLP_OK) die("create");
    cmlp_allocator_pytorch_ladder(a, pytorch_ladder);
    return a;
}

/* ---------------------------------------------------------------- 1. latency */

enum { IMPL_CMLP, IMPL_MEMALIGN, IMPL_MALLOC, NIMPL };
enum { PAIRS = 1000000, REPEATS = 7, LIVE = 100, MIXED_SEQ = 1 << 16 };

static cmlp_allocator *lat_alloc;
static bool lat_history; /* the cmlp allocator records its history (every action, in a ring) */

static void *get(int impl, size_t n) {
    void *p = NULL;
    if (impl == IMPL_CMLP) {
        if (cmlp_allocator_malloc(lat_alloc, n, "bench", &p) != CMLP_OK) die("malloc");
    } else if (impl == IMPL_MEMALIGN) {
        if (posix_memalign(&p, 64, n) != 0) p = NULL;
    } else {
        p = malloc(n);
    }
    if (!p) die("allocation");
    escape(p);
    return p;
}

static void put(int impl, void *p) {
    if (impl == IMPL_CMLP) cmlp_allocator_free(lat_alloc, p);
    else free(p);
}

/* size > 0: alloc+free of that size; size == 0: the mixed working set, where each pair frees
 * a random live block and allocates a random size in its place. One timed loop of PAIRS after a
 * warm-up of PAIRS / 10, on a fresh allocator; returns ns per pair. */
static double latency(int impl, size_t size, const size_t *mixed_size, const int *mixed_slot) {
    lat_alloc = impl == IMPL_CMLP ? new_allocator("", false) : NULL;
    if (lat_alloc && lat_history &&
        cmlp_allocator_record_history(lat_alloc, CMLP_HISTORY_ALL, CMLP_CONTEXT_ALL, 1 << 16, 0, false) != CMLP_OK)
        die("record_history");
    void *live[LIVE] = {0};
    if (!size)
        for (int i = 0; i < LIVE; i++) live[i] = get(impl, mixed_size[i]);
    double ns = 0.0;
    for (int timed = 0; timed < 2; timed++) {
        long n = timed ? PAIRS : PAIRS / 10;
        double t0 = now_ns();
        if (size) {
            for (long i = 0; i < n; i++) put(impl, get(impl, size));
        } else {
            for (long i = 0; i < n; i++) {
                int k = mixed_slot[i & (MIXED_SEQ - 1)];
                put(impl, live[k]);
                live[k] = get(impl, mixed_size[i & (MIXED_SEQ - 1)]);
            }
        }
        ns = (now_ns() - t0) / (double)n;
    }
    if (!size)
        for (int i = 0; i < LIVE; i++) put(impl, live[i]);
    cmlp_allocator_destroy(lat_alloc);
    return ns;
}

static void bench_latency(void) {
    /* mixed sizes: log-uniform in [64 B, 8 MiB]; slots uniform over the 100 live blocks */
    static size_t mixed_size[MIXED_SEQ];
    static int mixed_slot[MIXED_SEQ];
    rng_state = 1;
    for (int i = 0; i < MIXED_SEQ; i++) {
        mixed_size[i] = (size_t)(64.0 * exp2(rng_unit() * 17.0));
        mixed_slot[i] = (int)(rng() % LIVE);
    }
    static const struct { const char *name; size_t size; } rows[] = {
        {"512 B", 512}, {"64 KiB", 64 << 10}, {"4 MiB", 4 << 20}, {"mixed (100 live, 64 B-8 MiB)", 0}};
    enum { NROWS = sizeof rows / sizeof rows[0] };
    double best[NROWS][NIMPL];
    /* repeats interleaved over rows and allocators, so that a busy moment of a shared machine
     * spoils one sample of each rather than every sample of one */
    for (int rep = 0; rep < REPEATS; rep++)
        for (int r = 0; r < NROWS; r++)
            for (int impl = 0; impl < NIMPL; impl++) {
                double ns = latency(impl, rows[r].size, mixed_size, mixed_slot);
                if (rep == 0 || ns < best[r][impl]) best[r][impl] = ns;
            }
    printf("### Latency: one alloc+free pair, ns (best of %d interleaved loops of %d pairs)\n\n", REPEATS, PAIRS);
    printf("| size | cmlp ns/pair | posix_memalign ns/pair | malloc ns/pair | ratio cmlp/posix_memalign |\n");
    printf("|---|---:|---:|---:|---:|\n");
    for (int r = 0; r < NROWS; r++)
        printf("| %s | %.1f | %.1f | %.1f | %.2f |\n", rows[r].name, best[r][IMPL_CMLP], best[r][IMPL_MEMALIGN],
               best[r][IMPL_MALLOC], best[r][IMPL_CMLP] / best[r][IMPL_MEMALIGN]);
    /* the same 512 B pair while the history is recorded: three entries a pair (alloc,
     * free_requested, free_completed), each with its time, in a ring of 65,536 */
    double plain = best[0][IMPL_CMLP], recorded = 0.0;
    lat_history = true;
    for (int rep = 0; rep < REPEATS; rep++) {
        double ns = latency(IMPL_CMLP, rows[0].size, mixed_size, mixed_slot);
        if (rep == 0 || ns < recorded) recorded = ns;
    }
    lat_history = false;
    printf("\nWith the memory history recorded (3 entries a pair, ring of 65,536): %s %.1f ns/pair (+%.1f ns)\n",
           rows[0].name, recorded, recorded - plain);
    printf("\n");
}

/* ---------------------------------------------------------------- 2. the training trace */

enum { PHASE_STEPS = 300, DATASET = 20000, RANDOM_EVERY = 25, MAX_B = 8192 };
static const int64_t PHASES[] = {64, 1024, 96, 4096, 3000, 512, 8192, 2500, 128};
#define NPHASES ((int)(sizeof PHASES / sizeof PHASES[0]))
#define NSTEPS (NPHASES * PHASE_STEPS)

/* Batch size of every step: each phase walks epochs of DATASET samples in batches of its B (the
 * last batch of an epoch is DATASET % B); every RANDOM_EVERY-th step instead takes a random
 * batch in [1, MAX_B] that does not advance the epoch. */
static void make_trace(int64_t *batch) {
    rng_state = 42;
    for (int p = 0, s = 0; p < NPHASES; p++) {
        int64_t left = DATASET;
        for (int i = 0; i < PHASE_STEPS; i++, s++) {
            if (s % RANDOM_EVERY == RANDOM_EVERY - 1) {
                batch[s] = 1 + (int64_t)(rng() % MAX_B);
                continue;
            }
            batch[s] = left < PHASES[p] ? left : PHASES[p];
            left -= batch[s];
            if (left == 0) left = DATASET;
        }
    }
}

enum { MAX_TENSORS = 96 }; /* 24 persistent + at most 32 per step */

/* One replay of the trace. With a == NULL nothing is allocated: only the live bytes (rounded
 * to 512 as the allocator rounds requests) are counted, which gives the trace's own peak. */
typedef struct {
    cmlp_allocator *a;
    void *ptr[MAX_TENSORS];
    size_t bytes[MAX_TENSORS];
    int n;              /* tensors taken this step (slots 0..n-1) */
    bool failed;        /* an allocation of this step failed: the rest of the step is skipped */
    int64_t live, peak_live, requested;
    int64_t peak_alloc, peak_res, allocs, ooms, steps_ok;
    int64_t busy_steps, busy_last_phase; /* steps that called the device (map, unmap, alloc, free) */
} replay;

static size_t round512(size_t n) { return n < 512 ? 512 : (n + 511) / 512 * 512; }

/* Takes a tensor of n bytes; returns its handle, or -1 once the step has failed. */
static int take(replay *r, size_t n) {
    if (r->failed) return -1;
    void *p = (void *)1;
    if (r->a && cmlp_allocator_malloc(r->a, n, "bench", &p) != CMLP_OK) {
        r->failed = true;
        r->ooms++;
        return -1;
    }
    int h = r->n++;
    r->ptr[h] = p;
    r->bytes[h] = n;
    r->allocs++;
    r->requested += (int64_t)n;
    r->live += (int64_t)round512(n);
    if (r->live > r->peak_live) r->peak_live = r->live;
    if (r->a) {
        cmlp_memory_stats s;
        cmlp_allocator_stats(r->a, &s);
        int64_t al = s.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current;
        int64_t rs = s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].current;
        if (al > r->peak_alloc) r->peak_alloc = al;
        if (rs > r->peak_res) r->peak_res = rs;
        if (s.stat[CMLP_STAT_REQUESTED_BYTES][CMLP_POOL_ALL].current != r->requested) {
            fprintf(stderr, "bench_alloc: requested_bytes disagrees with the trace\n");
            exit(1);
        }
    }
    return h;
}

static void drop(replay *r, int h) {
    if (h < 0 || !r->ptr[h]) return;
    if (r->a && cmlp_allocator_free(r->a, r->ptr[h]) != CMLP_OK) die("free");
    r->requested -= (int64_t)r->bytes[h];
    r->live -= (int64_t)round512(r->bytes[h]);
    r->ptr[h] = NULL;
}

static const int64_t WIDTH[4] = {784, 512, 256, 10};
#define F32(k) ((size_t)(k) * 4)
#define I64(k) ((size_t)(k) * 8)

/* Parameters, gradients and Adam's exp_avg / exp_avg_sq: one tensor per weight and bias, taken
 * once before the first step and kept (slots 0..23 of the replay, never dropped). */
static void persistent(replay *r) {
    for (int kind = 0; kind < 4; kind++) /* param, grad, exp_avg, exp_avg_sq */
        for (int l = 0; l < 3; l++) {
            take(r, F32(WIDTH[l + 1] * WIDTH[l])); /* W [out, in] */
            take(r, F32(WIDTH[l + 1]));            /* b [out] */
        }
}

/* One training step at batch B, in the order PyTorch would allocate and free: forward
 * (addmm, then a non-inplace ReLU that frees the pre-activation), cross-entropy, backward
 * (weight and bias gradients into temporaries accumulated into the persistent .grad, as with
 * zero_grad(set_to_none=False)), foreach Adam (one sqrt temporary per parameter), an accuracy
 * count. Activations and the loss stay until the end of the step. */
static void step(replay *r, int64_t B) {
    int first = r->n;
    take(r, F32(B * 784)); /* x */
    take(r, I64(B));       /* labels */
    int z1 = take(r, F32(B * 512));
    take(r, F32(B * 512)); /* h1 = relu(z1) */
    drop(r, z1);
    int z2 = take(r, F32(B * 256));
    take(r, F32(B * 256)); /* h2 */
    drop(r, z2);
    take(r, F32(B * 10));  /* logits */
    take(r, F32(B * 10));  /* log_softmax, saved */
    take(r, F32(1));       /* loss */
    int tw = take(r, F32(1)); /* nll total_weight */
    /* backward */
    int one = take(r, F32(1));
    int dlsm = take(r, F32(B * 10));
    int dz = take(r, F32(B * 10)); /* d logits */
    drop(r, dlsm);
    drop(r, one);
    drop(r, tw);
    for (int l = 2; l >= 0; l--) {
        int gb = take(r, F32(WIDTH[l + 1]));
        int dh = l > 0 ? take(r, F32(B * WIDTH[l])) : -1; /* d input */
        int gw = take(r, F32(WIDTH[l + 1] * WIDTH[l]));
        drop(r, gb);
        drop(r, gw);
        drop(r, dz);
        if (l > 0) { /* relu backward allocates the masked gradient */
            dz = take(r, F32(B * WIDTH[l]));
            drop(r, dh);
        }
    }
    /* optimizer */
    int sq[6];
    for (int l = 0; l < 3; l++) {
        sq[2 * l] = take(r, F32(WIDTH[l + 1] * WIDTH[l]));
        sq[2 * l + 1] = take(r, F32(WIDTH[l + 1]));
    }
    for (int i = 0; i < 6; i++) drop(r, sq[i]);
    /* metrics: argmax, eq, sum */
    int am = take(r, I64(B)), eq = take(r, (size_t)B), cnt = take(r, I64(1));
    drop(r, am);
    drop(r, eq);
    drop(r, cnt);
    for (int h = first; h < r->n; h++) drop(r, h); /* end of step (or of a failed one) */
    r->n = first;
    if (!r->failed) r->steps_ok++;
    r->failed = false;
}

static void run_trace(replay *r, cmlp_allocator *a, int64_t limit, const int64_t *batch) {
    memset(r, 0, sizeof *r);
    r->a = a;
    if (a) cmlp_allocator_set_limit(a, limit);
    persistent(r);
    if (r->failed) die("persistent tensors under the limit");
    for (int s = 0; s < NSTEPS; s++) {
        cmlp_memory_stats m0, m1;
        if (a) cmlp_allocator_stats(a, &m0);
        step(r, batch[s]);
        if (!a) continue;
        if (cmlp_allocator_validate(a) != CMLP_OK) die("validate");
        cmlp_allocator_stats(a, &m1);
        if (m1.num_device_alloc + m1.num_device_free != m0.num_device_alloc + m0.num_device_free) {
            r->busy_steps++;
            r->busy_last_phase += s >= NSTEPS - PHASE_STEPS;
        }
    }
}

/* max_split_size_mb:128 is the usual setting and never bites here (the largest tensor is
 * 24.5 MiB); 21, the smallest value allowed, does. Combined with expandable segments it once
 * sent refused free tails to the device (fixed in 13e8145): the last entry guards that. */
static const char *CONFS[] = {"", "max_split_size_mb:128", "max_split_size_mb:21", "expandable_segments:True",
                              "max_split_size_mb:21,expandable_segments:True"};
#define NCONFS ((int)(sizeof CONFS / sizeof CONFS[0]))
#define NRUNS (2 * NCONFS) /* each configuration with cmlp's ladder, then PyTorch's */

typedef struct {
    replay r;
    cmlp_memory_stats s;
} result;

static void run_config(int c, int64_t limit, const int64_t *batch, result *out) {
    cmlp_allocator *a = new_allocator(CONFS[c / 2], c % 2);
    run_trace(&out->r, a, limit, batch);
    cmlp_allocator_stats(a, &out->s);
    cmlp_allocator_destroy(a);
    /* the peaks seen after every allocation must be the allocator's own */
    if (out->r.peak_res != out->s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].peak ||
        out->r.peak_alloc != out->s.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].peak) {
        fprintf(stderr, "bench_alloc: peak statistics disagree with the trace (%s)\n", CONFS[c / 2]);
        exit(1);
    }
}

/* The smallest limit, in whole MiB, under which the trace runs without an OOM, by bisection
 * between lo (too small) and hi (enough). */
static int64_t min_limit(int c, int64_t lo, int64_t hi, const int64_t *batch) {
    static result r;
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        run_config(c, mid << 20, batch, &r);
        if (r.r.ooms) lo = mid;
        else hi = mid;
    }
    return hi;
}

static const char *conf_name(int c) { return CONFS[c / 2][0] ? CONFS[c / 2] : "default"; }
static const char *ladder(int c) { return c % 2 ? "pytorch" : "cmlp"; }
static double mib(int64_t n) { return (double)n / MIB_D; }

static void bench_trace(void) {
    static int64_t batch[NSTEPS];
    static result free_run[NRUNS], lim_run[NRUNS];
    int64_t least[NRUNS];
    make_trace(batch);
    replay dry;
    run_trace(&dry, NULL, -1, batch);
    int64_t limit = (int64_t)(1.15 * (double)dry.peak_live);
    printf("### Fragmentation: %d training steps, %lld allocations, peak live %.1f MiB (requests rounded to 512 B)\n\n",
           NSTEPS, (long long)dry.allocs, mib(dry.peak_live));
    printf("| config | ladder | peak reserved MiB | peak allocated MiB | ratio | end reserved MiB | device allocs | "
           "device frees | steps with device calls (last phase) | alloc retries |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int c = 0; c < NRUNS; c++) {
        result *x = &free_run[c];
        run_config(c, -1, batch, x);
        printf("| %s | %s | %.1f | %.1f | %.3f | %.1f | %lld | %lld | %lld (%lld) | %lld |\n", conf_name(c), ladder(c),
               mib(x->r.peak_res), mib(x->r.peak_alloc), (double)x->r.peak_res / (double)x->r.peak_alloc,
               mib(x->s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].current), (long long)x->s.num_device_alloc,
               (long long)x->s.num_device_free, (long long)x->r.busy_steps, (long long)x->r.busy_last_phase,
               (long long)x->s.num_alloc_retries);
    }

    printf("\n### Under a limit of %.1f MiB (1.15 x peak live), and the smallest limit without an OOM\n\n", mib(limit));
    printf("| config | ladder | steps without OOM | OOMs | peak reserved MiB | alloc retries | device allocs | "
           "smallest OOM-free limit MiB | / peak live |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int c = 0; c < NRUNS; c++) {
        result *x = &lim_run[c];
        run_config(c, limit, batch, x);
        least[c] = min_limit(c, (dry.peak_live >> 20) - 1, (free_run[c].r.peak_res + MIB - 1) >> 20, batch);
        printf("| %s | %s | %lld / %d | %lld | %.1f | %lld | %lld | %lld | %.2f |\n", conf_name(c), ladder(c),
               (long long)x->r.steps_ok, NSTEPS, (long long)x->r.ooms, mib(x->r.peak_res),
               (long long)x->s.num_alloc_retries, (long long)x->s.num_device_alloc, (long long)least[c],
               (double)(least[c] << 20) / (double)dry.peak_live);
    }

    bool ok_ratio = true, ok_twin = true;
    for (int c = 0; c < NRUNS; c += 2) {
        if (strcmp(CONFS[c / 2], "expandable_segments:True") == 0 &&
            (double)free_run[c].r.peak_res > 1.10 * (double)free_run[c].r.peak_alloc)
            ok_ratio = false;
        if (free_run[c].r.peak_res > free_run[c + 1].r.peak_res || lim_run[c].r.ooms > lim_run[c + 1].r.ooms ||
            least[c] > least[c + 1])
            ok_twin = false;
    }
    printf("\ntargets: expandable_segments:True ratio <= 1.10: %s; every configuration no worse than its pytorch-ladder "
           "twin (peak reserved, OOMs, smallest limit): %s\n\n",
           ok_ratio ? "met" : "MISSED", ok_twin ? "met" : "MISSED");
}

/* ---------------------------------------------------------------- main */

static void print_machine(void) {
    char model[256] = "unknown", line[512];
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon) {
            snprintf(model, sizeof model, "%s", colon + 2);
            model[strcspn(model, "\n")] = '\0';
            break;
        }
    }
    if (f) fclose(f);
    printf("machine: %s, nproc %ld\n\n", model, sysconf(_SC_NPROCESSORS_ONLN));
}

int main(void) {
    print_machine();
    bench_latency();
    bench_trace();
    return 0;
}
