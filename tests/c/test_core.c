/* test_core.c - unit tests of the C core through its public header, built with
 * AddressSanitizer and UndefinedBehaviorSanitizer: status codes and messages, the allocator's
 * statistics and limit, gradients against finite differences (double), exact accumulation,
 * optimizer rules, determinism. Exits non-zero when any check fails.
 */
#include "cmlp.h"
#include "internal.h" /* cmlp_optim_version */

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static int64_t allocated_now(void) {
    cmlp_memory_stats s;
    if (cmlp_memory_stats_get(cmlp_cpu(), &s) != CMLP_OK) return -1;
    return s.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current;
}

static float frand(unsigned *state) {
    *state = *state * 1664525u + 1013904223u;
    return (float)((*state >> 8) & 0xFFFF) / 65536.0f * 2.0f - 1.0f;
}

static void test_status_and_devices(void) {
    cmlp_device d;
    OK(cmlp_device_parse("cpu", &d));
    CHECK(d.type == CMLP_DEVICE_CPU && d.index == 0, "cpu parsed as %d:%d", d.type, d.index);
    CHECK(cmlp_device_parse("gpu", &d) == CMLP_ERR_INVALID, "gpu accepted");
    CHECK(strstr(cmlp_last_error(), "unknown device") != NULL, "message: %s", cmlp_last_error());
    CHECK(cmlp_device_parse("cuda:x", &d) == CMLP_ERR_INVALID, "cuda:x accepted");
    CHECK(cmlp_device_parse(NULL, &d) == CMLP_ERR_INVALID, "NULL accepted");
    /* a GPU index no machine has here: a device error (torch's invalid ordinal), not a bad spelling */
    CHECK(cmlp_device_parse("cuda:99999999999999999999", &d) == CMLP_ERR_DEVICE, "cuda:huge accepted");
    CHECK(!cmlp_cuda_compiled() || cmlp_cuda_device_count() == 0 ||
              strstr(cmlp_last_error(), "cuda:99999999999999999999 does not exist") != NULL,
          "message: %s", cmlp_last_error());
    cmlp_status s = cmlp_device_parse("cuda", &d);
    CHECK(cmlp_cuda_compiled() ? (s == CMLP_OK || s == CMLP_ERR_DEVICE) : s == CMLP_ERR_DEVICE,
          "cuda gave %s", cmlp_status_name(s));
    /* the current GPU ("cuda"): 0 until set, and set only to a GPU that is there */
    CHECK(cmlp_cuda_current_device() == 0, "current device %d", cmlp_cuda_current_device());
    s = cmlp_cuda_set_device(0);
    CHECK(s == CMLP_OK || s == CMLP_ERR_DEVICE, "set_device(0) gave %s", cmlp_status_name(s));
    CHECK(cmlp_cuda_set_device(-1) == CMLP_ERR_DEVICE && cmlp_cuda_set_device(CMLP_MAX_CUDA_DEVICES) == CMLP_ERR_DEVICE,
          "set_device out of range accepted");
    CHECK(cmlp_cuda_current_device() == 0, "current device %d after refusals", cmlp_cuda_current_device());
    CHECK(strcmp(cmlp_status_name(CMLP_ERR_OOM), "CMLP_ERR_OOM") == 0, "status name");
    cmlp_model_free(NULL);
    cmlp_optim_free(NULL);
    cmlp_trainer_free(NULL);
}

static void test_bad_models(void) {
    cmlp_model *m = (cmlp_model *)0x1;
    int one[] = {5};
    int zero[] = {5, 0, 3};
    int neg[] = {5, -2, 3};
    CHECK(cmlp_model_init(&m, one, 1, cmlp_cpu(), 0) == CMLP_ERR_INVALID && m == NULL, "1 size accepted");
    CHECK(cmlp_model_init(&m, zero, 3, cmlp_cpu(), 0) == CMLP_ERR_INVALID, "size 0 accepted");
    CHECK(strstr(cmlp_last_error(), "layer_sizes[1]") != NULL, "message: %s", cmlp_last_error());
    CHECK(cmlp_model_init(&m, neg, 3, cmlp_cpu(), 0) == CMLP_ERR_INVALID, "negative size accepted");
    CHECK(cmlp_model_init(&m, NULL, 3, cmlp_cpu(), 0) == CMLP_ERR_INVALID, "NULL sizes accepted");
}

/* Loss of the model on (x, y) in double from the float parameters, for finite differences. */
static double loss_double(const int *sizes, int L, const float *p, const int64_t *woff, const int64_t *boff,
                          const float *x, const int32_t *y, int n) {
    double total = 0.0;
    double a[64], z[64];
    for (int r = 0; r < n; r++) {
        for (int i = 0; i < sizes[0]; i++) a[i] = x[r * sizes[0] + i];
        for (int l = 0; l < L; l++) {
            for (int o = 0; o < sizes[l + 1]; o++) {
                double s = p[boff[l] + o];
                for (int i = 0; i < sizes[l]; i++) s += (double)p[woff[l] + (int64_t)o * sizes[l] + i] * a[i];
                z[o] = (l + 1 < L && s < 0) ? 0.0 : s;
            }
            memcpy(a, z, sizeof(double) * (size_t)sizes[l + 1]);
        }
        int C = sizes[L];
        double mx = a[0], sum = 0.0;
        for (int c = 1; c < C; c++) mx = a[c] > mx ? a[c] : mx;
        for (int c = 0; c < C; c++) sum += exp(a[c] - mx);
        total += mx + log(sum) - a[y[r]];
    }
    return total / n;
}

static void test_gradients(void) {
    int sizes[] = {6, 9, 7, 4};
    const int L = 3, n = 5;
    cmlp_model *m;
    OK(cmlp_model_init(&m, sizes, 4, cmlp_cpu(), 42));
    if (!m) return;
    int64_t np_ = cmlp_model_num_parameters(m);
    CHECK(np_ == 6 * 9 + 9 + 9 * 7 + 7 + 7 * 4 + 4, "num_parameters %lld", (long long)np_);
    int64_t woff[3], boff[3];
    for (int l = 0; l < L; l++) {
        woff[l] = cmlp_model_weight_offset(m, l);
        boff[l] = cmlp_model_bias_offset(m, l);
    }
    float x[5 * 6];
    int32_t y[5] = {0, 3, 1, 2, 3};
    unsigned rs = 7;
    for (int i = 0; i < n * 6; i++) x[i] = frand(&rs);
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = n};
    double loss_sum = 0.0;
    OK(cmlp_model_zero_grad(m));
    OK(cmlp_model_forward_backward(m, &d, 1.0f / n, 0.0f, CMLP_AMP_NONE, &loss_sum));
    float *p = malloc(sizeof(float) * (size_t)np_), *g = malloc(sizeof(float) * (size_t)np_);
    OK(cmlp_model_get_params(m, p));
    OK(cmlp_model_get_grads(m, g));
    double ref = loss_double(sizes, L, p, woff, boff, x, y, n);
    CHECK(fabs(loss_sum / n - ref) < 1e-5, "loss %g vs %g", loss_sum / n, ref);
    /* central differences in double on every parameter (the net is tiny) */
    double err = 0.0, norm = 0.0;
    for (int64_t i = 0; i < np_; i++) {
        /* the step actually taken in float, so rounding of p + h does not bias the quotient */
        float keep = p[i], hi = keep + 1e-4f, lo = keep - 1e-4f;
        p[i] = hi;
        double up = loss_double(sizes, L, p, woff, boff, x, y, n);
        p[i] = lo;
        double dn = loss_double(sizes, L, p, woff, boff, x, y, n);
        p[i] = keep;
        double fd = (up - dn) / ((double)hi - (double)lo);
        err += (fd - g[i]) * (fd - g[i]);
        norm += fd * fd;
    }
    CHECK(sqrt(err / norm) < 1e-3, "finite-difference relative error %g", sqrt(err / norm));
    /* logits from forward equal what forward_backward used: loss again via evaluate */
    double eloss = 0.0;
    int64_t correct = -1;
    OK(cmlp_model_evaluate(m, &d, 2, &eloss, &correct));
    CHECK(fabs(eloss - loss_sum) < 1e-4, "evaluate loss %g vs %g", eloss, loss_sum);
    CHECK(correct >= 0 && correct <= n, "correct %lld", (long long)correct);
    /* bad inputs change nothing */
    int32_t bad_y[5] = {0, 4, 1, 2, 3};
    cmlp_data bd = d;
    bd.y = bad_y;
    CHECK(cmlp_model_forward_backward(m, &bd, 1.0f, 0.0f, CMLP_AMP_NONE, &loss_sum) == CMLP_ERR_INVALID, "label 4 accepted");
    float nanx[5 * 6];
    memcpy(nanx, x, sizeof nanx);
    nanx[13] = NAN;
    bd = d;
    bd.x = nanx;
    CHECK(cmlp_model_forward_backward(m, &bd, 1.0f, 0.0f, CMLP_AMP_NONE, &loss_sum) == CMLP_ERR_NONFINITE, "NaN accepted");
    CHECK(strstr(cmlp_last_error(), "sample 2") != NULL, "message: %s", cmlp_last_error());
    float *g2 = malloc(sizeof(float) * (size_t)np_);
    OK(cmlp_model_get_grads(m, g2));
    CHECK(memcmp(g, g2, sizeof(float) * (size_t)np_) == 0, "a rejected call changed the gradients");
    free(p);
    free(g);
    free(g2);
    cmlp_model_free(m);
}

/* One step over 10 samples equals micro-batches of 4 + 4 + 2 and accumulation 2 x 5. */
static void test_accumulation(void) {
    int sizes[] = {8, 16, 5};
    float x[10 * 8];
    int32_t y[10];
    unsigned rs = 3;
    for (int i = 0; i < 80; i++) x[i] = frand(&rs);
    for (int i = 0; i < 10; i++) y[i] = i % 5;
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 10};
    float *res[3];
    int64_t micro[3] = {0, 4, 0}, accum[3] = {1, 1, 2}, batch[3] = {10, 10, 5};
    int64_t np_ = 0;
    for (int v = 0; v < 3; v++) {
        cmlp_model *m;
        cmlp_optim *o;
        cmlp_trainer *t;
        OK(cmlp_model_init(&m, sizes, 3, cmlp_cpu(), 1));
        cmlp_sgd_config sc = cmlp_sgd_defaults();
        sc.lr = 0.5;
        OK(cmlp_optim_init_sgd(&o, m, &sc));
        cmlp_train_config tc = {.batch_size = batch[v], .accumulation_steps = accum[v], .microbatch_size = micro[v]};
        OK(cmlp_trainer_init(&t, m, o, &tc));
        double loss;
        if (v < 2) {
            OK(cmlp_trainer_step(t, &d, &loss));
        } else {
            cmlp_epoch_state st;
            OK(cmlp_trainer_epoch_begin(t, &d, 0, &st));
            CHECK(st.total_steps == 1, "total steps %lld", (long long)st.total_steps);
            OK(cmlp_trainer_epoch_run(t, 0, &st));
            CHECK(st.done && st.steps == 1 && st.samples == 10, "epoch state %lld %lld", (long long)st.steps,
                  (long long)st.samples);
        }
        np_ = cmlp_model_num_parameters(m);
        res[v] = malloc(sizeof(float) * (size_t)np_);
        OK(cmlp_model_get_params(m, res[v]));
        cmlp_trainer_free(t);
        cmlp_optim_free(o);
        cmlp_model_free(m);
    }
    for (int v = 1; v < 3; v++) {
        double e = 0.0, nrm = 0.0;
        for (int64_t i = 0; i < np_; i++) {
            e += (res[v][i] - res[0][i]) * (double)(res[v][i] - res[0][i]);
            nrm += res[0][i] * (double)res[0][i];
        }
        CHECK(sqrt(e / nrm) < 1e-6, "variant %d differs by %g", v, sqrt(e / nrm));
    }
    for (int v = 0; v < 3; v++) free(res[v]);
}

/* Adam's first step moves every parameter with a nonzero gradient by lr (sign of -g). */
static void test_adam_first_step(void) {
    int sizes[] = {3, 4, 2};
    cmlp_model *m;
    cmlp_optim *o;
    OK(cmlp_model_init(&m, sizes, 3, cmlp_cpu(), 5));
    cmlp_adam_config ac = cmlp_adam_defaults();
    ac.lr = 0.01;
    OK(cmlp_optim_init_adam(&o, m, &ac));
    int64_t before = allocated_now();
    float x[6] = {0.5f, -1.0f, 2.0f, 1.0f, 0.25f, -0.5f};
    int32_t y[2] = {1, 0};
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 2};
    double loss;
    OK(cmlp_model_forward_backward(m, &d, 0.5f, 0.0f, CMLP_AMP_NONE, &loss));
    int64_t n = cmlp_model_num_parameters(m);
    float *p0 = malloc(sizeof(float) * (size_t)n), *p1 = malloc(sizeof(float) * (size_t)n),
          *g = malloc(sizeof(float) * (size_t)n);
    OK(cmlp_model_get_params(m, p0));
    OK(cmlp_model_get_grads(m, g));
    CHECK(cmlp_optim_num_buffers(o) == 0, "state before the first step");
    OK(cmlp_optim_step(o));
    CHECK(cmlp_optim_num_buffers(o) == 2 && cmlp_optim_get_step(o) == 1, "state after the first step");
    CHECK(allocated_now() - before >= 2 * n * 4, "Adam state not from the allocator");
    OK(cmlp_model_get_params(m, p1));
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        double expect = fabs(g[i]) > 1e-6 ? -0.01 * (g[i] > 0 ? 1 : -1) : 0.0;
        if (fabs(g[i]) > 1e-6 && fabs((p1[i] - p0[i]) - expect) > 1e-5) bad++;
    }
    CHECK(bad == 0, "%d parameters moved by other than lr", bad);
    cmlp_adam_config badc = ac;
    badc.beta1 = 1.0;
    cmlp_optim *o2 = NULL;
    CHECK(cmlp_optim_init_adam(&o2, m, &badc) == CMLP_ERR_INVALID && o2 == NULL, "beta1 = 1 accepted");
    cmlp_sgd_config sc = cmlp_sgd_defaults();
    sc.nesterov = 1;
    CHECK(cmlp_optim_init_sgd(&o2, m, &sc) == CMLP_ERR_INVALID, "nesterov without momentum accepted");
    free(p0);
    free(p1);
    free(g);
    cmlp_optim_free(o);
    cmlp_model_free(m);
}

/* AMSGrad turned on after steps: the next step adds its maximum beside exp_avg and exp_avg_sq
 * (kept as they were), and turned off the maximum stays in the state, unused. */
static void test_amsgrad_buffers(void) {
    int sizes[] = {3, 4, 2};
    cmlp_model *m;
    cmlp_optim *o;
    OK(cmlp_model_init(&m, sizes, 3, cmlp_cpu(), 5));
    cmlp_adam_config ac = cmlp_adam_defaults();
    OK(cmlp_optim_init_adam(&o, m, &ac));
    float x[6] = {0.5f, -1.0f, 2.0f, 1.0f, 0.25f, -0.5f};
    int32_t y[2] = {1, 0};
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 2};
    double loss;
    OK(cmlp_model_forward_backward(m, &d, 0.5f, 0.0f, CMLP_AMP_NONE, &loss));
    OK(cmlp_optim_step(o));
    int64_t n = cmlp_model_num_parameters(m);
    float *b[3], *after[3];
    for (int i = 0; i < 3; i++) b[i] = calloc((size_t)n, sizeof(float)), after[i] = calloc((size_t)n, sizeof(float));
    OK(cmlp_optim_get_buffer(o, 0, b[0]));
    OK(cmlp_optim_get_buffer(o, 1, b[1]));
    CHECK(cmlp_optim_buffers_planned(o) == 2, "Adam plans 2 buffers");
    ac.amsgrad = 1;
    OK(cmlp_optim_configure_adam(o, &ac));
    CHECK(cmlp_optim_num_buffers(o) == 2 && cmlp_optim_buffers_planned(o) == 3,
          "AMSGrad turned on: %d buffers held, %d planned", cmlp_optim_num_buffers(o), cmlp_optim_buffers_planned(o));
    OK(cmlp_model_zero_grad(m));
    OK(cmlp_optim_step(o)); /* a zero gradient: exp_avg_sq decays, the maximum starts from it */
    CHECK(cmlp_optim_num_buffers(o) == 3, "AMSGrad's step keeps %d buffers", cmlp_optim_num_buffers(o));
    for (int i = 0; i < 3; i++) OK(cmlp_optim_get_buffer(o, i, after[i]));
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bad += after[0][i] != (float)(0.9f * b[0][i]) || after[1][i] != (float)(0.999f * b[1][i]);
        bad += after[2][i] != after[1][i];
    }
    CHECK(bad == 0, "AMSGrad's growth lost the state: %d differences", bad);
    ac.amsgrad = 0;
    OK(cmlp_optim_configure_adam(o, &ac));
    OK(cmlp_optim_step(o));
    OK(cmlp_optim_get_buffer(o, 2, b[2]));
    CHECK(cmlp_optim_num_buffers(o) == 3 && memcmp(b[2], after[2], (size_t)n * sizeof(float)) == 0,
          "AMSGrad turned off: its maximum is kept as it was");
    ac.maximize = 2;
    CHECK(cmlp_optim_configure_adam(o, &ac) == CMLP_ERR_INVALID, "maximize = 2 accepted");
    const float *three[3] = {b[0], b[1], b[2]};
    CHECK(cmlp_optim_set_state(o, 5, 1, three) == CMLP_ERR_INVALID, "Adam state of 1 buffer accepted");
    OK(cmlp_optim_set_state(o, 5, 3, three));
    CHECK(cmlp_optim_num_buffers(o) == 3 && cmlp_optim_get_step(o) == 5, "3 buffers loaded");
    b[0][1] = NAN, b[1][2] = INFINITY; /* a run that diverged: a copy keeps it, a load refuses it */
    CHECK(cmlp_optim_set_state(o, 6, 3, three) == CMLP_ERR_NONFINITE && cmlp_optim_get_step(o) == 5,
          "NaN state loaded");
    OK(cmlp_optim_copy_state(o, 6, 3, three));
    OK(cmlp_optim_get_buffer(o, 0, after[0]));
    OK(cmlp_optim_get_buffer(o, 1, after[1]));
    CHECK(cmlp_optim_get_step(o) == 6 && isnan(after[0][1]) && isinf(after[1][2]) && after[0][0] == b[0][0],
          "a copied state is not the state as it was");
    for (int i = 0; i < 3; i++) free(b[i]), free(after[i]);
    cmlp_optim_free(o);
    cmlp_model_free(m);
}

static void test_allocator(void) {
    int64_t base = allocated_now();
    void *p[200];
    unsigned rs = 11;
    size_t total = 0, requested = 0;
    cmlp_memory_stats s;
    OK(cmlp_memory_stats_get(cmlp_cpu(), &s));
    int64_t req0 = s.stat[CMLP_STAT_REQUESTED_BYTES][CMLP_POOL_ALL].current;
    for (int i = 0; i < 200; i++) {
        size_t n = 1 + ((unsigned)(frand(&rs) * 1e6f + 1e6f) % 3000000u);
        OK(cmlp_memory_alloc(cmlp_cpu(), n, &p[i]));
        total += (n + 511) / 512 * 512;
        requested += n;
        if (p[i]) memset(p[i], i & 0xFF, n);
    }
    OK(cmlp_memory_stats_get(cmlp_cpu(), &s));
    CHECK(s.stat[CMLP_STAT_REQUESTED_BYTES][CMLP_POOL_ALL].current - req0 == (int64_t)requested, "requested bytes");
    CHECK(allocated_now() - base >= (int64_t)total, "allocated %lld, at least %zu", (long long)(allocated_now() - base),
          total);
    OK(cmlp_memory_validate(cmlp_cpu()));
    for (int i = 0; i < 200; i += 2) OK(cmlp_memory_free(cmlp_cpu(), p[i]));
    for (int i = 1; i < 200; i += 2) OK(cmlp_memory_free(cmlp_cpu(), p[i]));
    CHECK(allocated_now() == base, "leak: %lld", (long long)(allocated_now() - base));
    int dummy;
    CHECK(cmlp_memory_free(cmlp_cpu(), &dummy) == CMLP_ERR_INVALID, "foreign pointer accepted");
    void *z = (void *)0x1;
    OK(cmlp_memory_alloc(cmlp_cpu(), 0, &z));
    CHECK(z == NULL, "0 bytes gave a pointer");
    int64_t free_bytes = 0, total_bytes = 0;
    OK(cmlp_memory_get_info(cmlp_cpu(), &free_bytes, &total_bytes));
    CHECK(total_bytes == s.total_memory && free_bytes > 0 && free_bytes <= total_bytes, "mem_get_info %lld of %lld",
          (long long)free_bytes, (long long)total_bytes);
    /* the limit: an OOM that says why, counts, and leaves the allocator working */
    OK(cmlp_memory_empty_cache(cmlp_cpu()));
    OK(cmlp_memory_stats_get(cmlp_cpu(), &s));
    int64_t ooms = s.num_ooms;
    int64_t reserved = s.stat[CMLP_STAT_RESERVED_BYTES][CMLP_POOL_ALL].current;
    OK(cmlp_memory_set_limit(cmlp_cpu(), reserved + (1 << 20)));
    void *big = NULL;
    CHECK(cmlp_memory_alloc(cmlp_cpu(), 4 << 20, &big) == CMLP_ERR_OOM && big == NULL, "limit ignored");
    CHECK(strstr(cmlp_last_error(), "out of memory") && strstr(cmlp_last_error(), "4.00 MiB"), "message: %s",
          cmlp_last_error());
    int sizes[] = {784, 512, 256, 10};
    cmlp_model *m = NULL;
    CHECK(cmlp_model_init(&m, sizes, 4, cmlp_cpu(), 0) == CMLP_ERR_OOM && m == NULL, "model under limit");
    OK(cmlp_memory_stats_get(cmlp_cpu(), &s));
    CHECK(s.num_ooms == ooms + 2, "num_ooms %lld", (long long)(s.num_ooms - ooms));
    CHECK(allocated_now() == base, "leak after OOM: %lld", (long long)(allocated_now() - base));
    OK(cmlp_memory_set_limit(cmlp_cpu(), -1));
    OK(cmlp_memory_alloc(cmlp_cpu(), 4 << 20, &big));
    OK(cmlp_memory_free(cmlp_cpu(), big));
    OK(cmlp_memory_validate(cmlp_cpu()));
    /* a model's block is not a raw block: refused, and it stays the model's */
    OK(cmlp_model_init(&m, sizes, 4, cmlp_cpu(), 0));
    int64_t with_model = allocated_now(), nseg = 0, nblk = 0;
    cmlp_segment_info *segs = NULL;
    cmlp_block_info *blks = NULL;
    OK(cmlp_memory_snapshot(cmlp_cpu(), &segs, &nseg, &blks, &nblk));
    void *held = NULL;
    for (int64_t i = 0; i < nblk && !held; i++)
        if (blks[i].allocated && blks[i].what && strcmp(blks[i].what, "caching_allocator_alloc") != 0)
            held = (void *)(uintptr_t)blks[i].address;
    cmlp_memory_snapshot_free(segs, blks);
    CHECK(held != NULL, "no model block in the snapshot");
    CHECK(cmlp_memory_free(cmlp_cpu(), held) == CMLP_ERR_INVALID && strstr(cmlp_last_error(), "stays allocated"),
          "a model's block freed as a raw one: %s", cmlp_last_error());
    CHECK(allocated_now() == with_model, "the model's block was released");
    OK(cmlp_memory_validate(cmlp_cpu()));
    cmlp_model_free(m);
    m = NULL;
    CHECK(allocated_now() == base, "leak after the model: %lld", (long long)(allocated_now() - base));
    OK(cmlp_memory_reset_peak(cmlp_cpu()));
    OK(cmlp_memory_stats_get(cmlp_cpu(), &s));
    CHECK(s.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].peak == s.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current,
          "peak not reset");
}

static void test_determinism(void) {
    int sizes[] = {20, 30, 6};
    float x[64 * 20];
    int32_t y[64];
    unsigned rs = 9;
    for (int i = 0; i < 64 * 20; i++) x[i] = frand(&rs);
    for (int i = 0; i < 64; i++) y[i] = (i * 7) % 6;
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 64};
    float *out[2];
    for (int v = 0; v < 2; v++) {
        cmlp_model *m;
        cmlp_optim *o;
        cmlp_trainer *t;
        OK(cmlp_model_init(&m, sizes, 3, cmlp_cpu(), 3));
        cmlp_adam_config ac = cmlp_adam_defaults();
        OK(cmlp_optim_init_adam(&o, m, &ac));
        cmlp_train_config tc = {.batch_size = 8, .accumulation_steps = 1, .shuffle = 1, .seed = 17};
        OK(cmlp_trainer_init(&t, m, o, &tc));
        cmlp_epoch_state st;
        for (int e = 0; e < 2; e++) {
            OK(cmlp_trainer_epoch_begin(t, &d, 0, &st));
            while (!st.done) OK(cmlp_trainer_epoch_run(t, 3, &st));
            CHECK(st.steps == 8 && st.samples == 64, "epoch %lld steps", (long long)st.steps);
        }
        CHECK(cmlp_trainer_epochs(t) == 2, "%lld epochs begun", (long long)cmlp_trainer_epochs(t));
        CHECK(cmlp_trainer_set_epochs(t, -1) == CMLP_ERR_INVALID && cmlp_trainer_epochs(t) == 2,
              "a negative epoch count accepted");
        out[v] = malloc(sizeof(float) * (size_t)cmlp_model_num_parameters(m));
        OK(cmlp_model_get_params(m, out[v]));
        int64_t n = cmlp_model_num_parameters(m);
        cmlp_trainer_free(t);
        cmlp_optim_free(o);
        cmlp_model_free(m);
        if (v == 1) CHECK(memcmp(out[0], out[1], sizeof(float) * (size_t)n) == 0, "same seed, different weights");
    }
    free(out[0]);
    free(out[1]);
}

/* A rate and momentum per step (cmlp_trainer_epoch_run_rates): the epoch's steps at the given
 * values equal the same steps taken one by one with them set before each (Adam with decoupled
 * weight decay, and SGD with momentum, through 0 and back); the optimizer's rate and momentum are
 * as before each call; refusals change nothing. */
static void test_rates_per_step(void) {
    int sizes[] = {7, 11, 3};
    float x[40 * 7];
    int32_t y[40];
    unsigned rs = 21;
    for (int i = 0; i < 40 * 7; i++) x[i] = frand(&rs);
    for (int i = 0; i < 40; i++) y[i] = (i * 5) % 3;
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 40};
    const double lr[10] = {1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 5e-3, 2.5e-3, 1.25e-3, 0.0, 0.5};
    /* a momentum per step too (Adam's beta1, SGD's momentum), through 0 and back */
    const double mom[10] = {0.95, 0.9, 0.85, 0.0, 0.0, 0.5, 0.8, 0.9, 0.95, 0.99};
    for (int kind = 0; kind < 2; kind++) {
        cmlp_model *m[2];
        cmlp_optim *o[2];
        cmlp_trainer *t[2];
        cmlp_train_config tc = {.batch_size = 4, .accumulation_steps = 1};
        for (int k = 0; k < 2; k++) {
            OK(cmlp_model_init(&m[k], sizes, 3, cmlp_cpu(), 8));
            if (kind == 0) {
                cmlp_adam_config ac = cmlp_adam_defaults();
                ac.weight_decay = 0.1;
                ac.decoupled_weight_decay = 1;
                OK(cmlp_optim_init_adam(&o[k], m[k], &ac));
            } else {
                cmlp_sgd_config sc = cmlp_sgd_defaults();
                sc.momentum = 0.9;
                OK(cmlp_optim_init_sgd(&o[k], m[k], &sc));
            }
            OK(cmlp_trainer_init(&t[k], m[k], o[k], &tc));
        }
        cmlp_epoch_state st;
        OK(cmlp_trainer_epoch_begin(t[0], &d, 0, &st));
        const double bad[3] = {1e-3, -1.0, NAN};
        CHECK(cmlp_trainer_epoch_run_rates(t[0], bad, NULL, NULL, NULL, 2, &st) == CMLP_ERR_INVALID,
              "a negative rate accepted");
        CHECK(cmlp_trainer_epoch_run_rates(t[0], bad + 2, NULL, NULL, NULL, 1, &st) == CMLP_ERR_INVALID,
              "a NaN rate accepted");
        CHECK(cmlp_trainer_epoch_run_rates(t[0], lr, NULL, NULL, NULL, 0, &st) == CMLP_ERR_INVALID,
              "no rates accepted");
        CHECK(cmlp_trainer_epoch_run_rates(t[0], lr, NULL, NULL, NULL, CMLP_MAX_RATES + 1, &st) == CMLP_ERR_INVALID,
              "more rates than a call takes accepted");
        CHECK(st.steps == 0, "a refused call stepped");
        const double bad_mom[2] = {0.9, kind == 0 ? 1.0 : -0.5};
        CHECK(cmlp_trainer_epoch_run_rates(t[0], lr, bad_mom, NULL, NULL, 2, &st) == CMLP_ERR_INVALID && st.steps == 0,
              "a momentum out of range accepted");
        OK(cmlp_trainer_epoch_run_rates(t[0], lr, mom, NULL, NULL, 3, &st));
        OK(cmlp_trainer_epoch_run_rates(t[0], lr + 3, mom + 3, NULL, NULL, 7, &st));
        CHECK(st.steps == 10 && st.done && cmlp_optim_get_lr(o[0]) == (kind == 0 ? 1e-3 : 0.01) &&
                  cmlp_optim_get_momentum(o[0]) == 0.9,
              "%lld steps, done %d, rate %g", (long long)st.steps, st.done, cmlp_optim_get_lr(o[0]));
        for (int k = 0; k < 10; k++) {
            cmlp_data b = {.x = x + k * 4 * 7, .x_dtype = CMLP_DTYPE_F32, .y = y + k * 4, .n = 4};
            double loss;
            OK(cmlp_optim_set_lr(o[1], lr[k]));
            OK(cmlp_optim_set_momentum(o[1], mom[k]));
            OK(cmlp_trainer_step(t[1], &b, &loss));
        }
        const int64_t np_ = cmlp_model_num_parameters(m[0]);
        float *p0 = malloc(sizeof(float) * (size_t)np_), *p1 = malloc(sizeof(float) * (size_t)np_);
        OK(cmlp_model_get_params(m[0], p0));
        OK(cmlp_model_get_params(m[1], p1));
        CHECK(memcmp(p0, p1, sizeof(float) * (size_t)np_) == 0, "kind %d: a rate per step differs from the hand's",
              kind);
        free(p0), free(p1);
        for (int k = 0; k < 2; k++) {
            cmlp_trainer_free(t[k]);
            cmlp_optim_free(o[k]);
            cmlp_model_free(m[k]);
        }
    }
}

/* Parameter groups (cmlp_optim_set_parts): refusals change nothing; SGD's step moves each part at
 * its own rate and L2 weight decay; Adam (decoupled decay) with parts in an epoch with a rate per
 * step equals the same steps by hand, bit for bit; parts that all take the configuration's
 * settings are the plain step. */
static void test_parts(void) {
    int sizes[] = {7, 11, 3};
    float x[40 * 7];
    int32_t y[40];
    unsigned rs = 33;
    for (int i = 0; i < 40 * 7; i++) x[i] = frand(&rs);
    for (int i = 0; i < 40; i++) y[i] = (i * 7) % 3;
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 40};
    cmlp_model *m[2];
    cmlp_optim *o[2];
    cmlp_trainer *t[2];
    for (int k = 0; k < 2; k++) OK(cmlp_model_init(&m[k], sizes, 3, cmlp_cpu(), 9));
    const int64_t n = cmlp_model_num_parameters(m[0]); /* 7*11 + 11 + 11*3 + 3 = 124 */
    const int64_t ends[4] = {77, 88, 121, 124};
    const double scale[4] = {2.0, 0.5, 1.0, 0.0}, wd[4] = {0.1, 0.0, 0.2, 0.3};
    /* SGD without momentum: p - lr * scale * (g + wd * p), in float */
    cmlp_sgd_config sc = cmlp_sgd_defaults();
    sc.lr = 0.1;
    OK(cmlp_optim_init_sgd(&o[0], m[0], &sc));
    const int64_t bad_ends[4] = {77, 77, 121, 124}, short_ends[3] = {77, 88, 121};
    const double bad_scale[4] = {2.0, -1.0, 1.0, 0.0}, bad_wd[4] = {0.1, NAN, 0.2, 0.3};
    CHECK(cmlp_optim_set_parts(o[0], -1, NULL, NULL, NULL, NULL) == CMLP_ERR_INVALID, "-1 parts accepted");
    CHECK(cmlp_optim_set_parts(o[0], 4, bad_ends, scale, wd, NULL) == CMLP_ERR_INVALID, "an empty part accepted");
    CHECK(cmlp_optim_set_parts(o[0], 3, short_ends, scale, wd, NULL) == CMLP_ERR_INVALID, "parts short of the end");
    CHECK(cmlp_optim_set_parts(o[0], 4, ends, bad_scale, wd, NULL) == CMLP_ERR_INVALID, "a negative scale accepted");
    CHECK(cmlp_optim_set_parts(o[0], 4, ends, scale, bad_wd, NULL) == CMLP_ERR_INVALID, "a NaN weight decay accepted");
    uint64_t v = cmlp_optim_version(o[0]);
    OK(cmlp_optim_set_parts(o[0], 4, ends, scale, wd, NULL));
    CHECK(cmlp_optim_version(o[0]) != v, "new parts kept the version");
    float *p0 = malloc(sizeof(float) * (size_t)n), *p1 = malloc(sizeof(float) * (size_t)n),
          *g = malloc(sizeof(float) * (size_t)n);
    cmlp_data b = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 8};
    double loss;
    OK(cmlp_model_forward_backward(m[0], &b, 1.0f, 0.0f, CMLP_AMP_NONE, &loss));
    OK(cmlp_model_get_params(m[0], p0));
    OK(cmlp_model_get_grads(m[0], g));
    OK(cmlp_optim_step(o[0]));
    OK(cmlp_model_get_params(m[0], p1));
    int bad = 0;
    for (int64_t i = 0, part = 0; i < n; i++) {
        while (i >= ends[part]) part++;
        float gi = g[i] + (float)wd[part] * p0[i];
        if (p1[i] != p0[i] - (float)(0.1 * scale[part]) * gi) bad++;
    }
    CHECK(bad == 0, "%d parameters not at their part's rate and decay", bad);
    v = cmlp_optim_version(o[0]);
    const double other_scale[4] = {3.0, 0.25, 1.0, 0.0};
    OK(cmlp_optim_set_parts(o[0], 4, ends, other_scale, wd, NULL));
    CHECK(cmlp_optim_version(o[0]) == v, "other scales changed the version (a captured step reads them)");
    cmlp_optim_free(o[0]);
    /* Adam, decoupled decay: an epoch with a rate per step equals the steps by hand */
    cmlp_train_config tc = {.batch_size = 4, .accumulation_steps = 1};
    for (int k = 0; k < 2; k++) {
        cmlp_model_free(m[k]);
        OK(cmlp_model_init(&m[k], sizes, 3, cmlp_cpu(), 9));
        cmlp_adam_config ac = cmlp_adam_defaults();
        ac.weight_decay = 0.1;
        ac.decoupled_weight_decay = 1;
        OK(cmlp_optim_init_adam(&o[k], m[k], &ac));
        OK(cmlp_optim_set_parts(o[k], 4, ends, scale, wd, NULL));
        OK(cmlp_trainer_init(&t[k], m[k], o[k], &tc));
    }
    const double lr[10] = {1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 5e-3, 2.5e-3, 1.25e-3, 0.0, 0.5};
    cmlp_epoch_state st;
    OK(cmlp_trainer_epoch_begin(t[0], &d, 0, &st));
    OK(cmlp_trainer_epoch_run_rates(t[0], lr, NULL, NULL, NULL, 10, &st));
    for (int k = 0; k < 10; k++) {
        cmlp_data bk = {.x = x + k * 4 * 7, .x_dtype = CMLP_DTYPE_F32, .y = y + k * 4, .n = 4};
        OK(cmlp_optim_set_lr(o[1], lr[k]));
        OK(cmlp_trainer_step(t[1], &bk, &loss));
    }
    OK(cmlp_model_get_params(m[0], p0));
    OK(cmlp_model_get_params(m[1], p1));
    CHECK(memcmp(p0, p1, sizeof(float) * (size_t)n) == 0, "parts: a rate per step differs from the hand's");
    /* parts of the configuration's settings: the plain step */
    const int64_t one_end[2] = {50, 124};
    const double ones[2] = {1.0, 1.0}, decays[2] = {0.1, 0.1};
    OK(cmlp_optim_set_parts(o[0], 2, one_end, ones, decays, NULL));
    OK(cmlp_optim_set_parts(o[1], 0, NULL, NULL, NULL, NULL));
    for (int k = 0; k < 2; k++) {
        OK(cmlp_optim_set_lr(o[k], 1e-3));
        OK(cmlp_trainer_step(t[k], &b, &loss));
    }
    OK(cmlp_model_get_params(m[0], p0));
    OK(cmlp_model_get_params(m[1], p1));
    CHECK(memcmp(p0, p1, sizeof(float) * (size_t)n) == 0, "parts of the configuration's settings differ");
    free(p0), free(p1), free(g);
    for (int k = 0; k < 2; k++) {
        cmlp_trainer_free(t[k]);
        cmlp_optim_free(o[k]);
        cmlp_model_free(m[k]);
    }
}

/* Parameter groups' own hyperparameters (cmlp_part_settings): bad ones refused; what a step on the
 * device reads (the momentum) keeps the version, what its launches take does not; AMSGrad in one
 * part, its maximum not started in the other until that part's amsgrad is turned on; SGD's parts at
 * their own momentum, dampening, nesterov and maximize; an epoch whose parts' momenta move apart
 * step by step (a table) equals the same steps by hand, bit for bit. */
static void test_part_settings(void) {
    int sizes[] = {7, 11, 3};
    float x[40 * 7];
    int32_t y[40];
    unsigned rs = 35;
    for (int i = 0; i < 40 * 7; i++) x[i] = frand(&rs);
    for (int i = 0; i < 40; i++) y[i] = (i * 5) % 3;
    const int64_t ends[2] = {88, 124};
    const double scale[2] = {1.0, 0.5}, wd[2] = {0.0, 0.01};
    cmlp_model *m[2];
    cmlp_optim *o[2];
    cmlp_trainer *t[2];
    for (int k = 0; k < 2; k++) OK(cmlp_model_init(&m[k], sizes, 3, cmlp_cpu(), 4));
    const int64_t n = cmlp_model_num_parameters(m[0]);
    cmlp_adam_config ac = cmlp_adam_defaults();
    OK(cmlp_optim_init_adam(&o[0], m[0], &ac));
    cmlp_part_settings own[2] = {cmlp_part_settings_inherit(), cmlp_part_settings_inherit()};
    own[1].momentum = 1.0; /* Adam's beta1 */
    CHECK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own) == CMLP_ERR_INVALID, "beta1 1 accepted");
    own[1].momentum = 0.8, own[1].beta2 = -0.1;
    CHECK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own) == CMLP_ERR_INVALID, "beta2 < 0 accepted");
    own[1].beta2 = 0.99, own[1].dampening = 0.1;
    CHECK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own) == CMLP_ERR_INVALID, "Adam took a dampening");
    own[1].dampening = NAN, own[1].maximize = 2;
    CHECK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own) == CMLP_ERR_INVALID, "maximize 2 accepted");
    CHECK(cmlp_optim_num_parts(o[0]) == 0, "a refused part kept");
    own[1].maximize = 1;
    OK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own));
    uint64_t v = cmlp_optim_version(o[0]);
    own[1].momentum = 0.7; /* read on the device */
    OK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own));
    CHECK(cmlp_optim_version(o[0]) == v, "another beta1 changed the version (a step on the device reads it)");
    own[1].eps = 1e-4; /* a launch's argument */
    OK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own));
    CHECK(cmlp_optim_version(o[0]) != v, "another eps kept the version");
    /* AMSGrad in part 1 only: its maximum spans both parts, not started in part 0 until its turn */
    own[1].amsgrad = 2;
    CHECK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own) == CMLP_ERR_INVALID, "amsgrad 2 accepted");
    own[1].amsgrad = 1;
    v = cmlp_optim_version(o[0]);
    OK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own));
    CHECK(cmlp_optim_version(o[0]) != v, "a part's amsgrad kept the version");
    CHECK(cmlp_optim_buffers_planned(o[0]) == 3, "a part's amsgrad plans %d buffers", cmlp_optim_buffers_planned(o[0]));
    float *vmax = malloc(sizeof(float) * (size_t)n);
    cmlp_data b8 = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 8};
    double loss8;
    for (int turn = 0; turn < 2; turn++) {
        OK(cmlp_model_zero_grad(m[0]));
        OK(cmlp_model_forward_backward(m[0], &b8, 1.0f, 0.0f, CMLP_AMP_NONE, &loss8));
        OK(cmlp_optim_step(o[0]));
        CHECK(cmlp_optim_num_buffers(o[0]) == 3, "%d buffers after a step with a part's amsgrad",
              cmlp_optim_num_buffers(o[0]));
        OK(cmlp_optim_get_buffer(o[0], 2, vmax));
        int unstarted = 0, negative = 0;
        for (int64_t i = 0; i < n; i++) {
            unstarted += i < ends[0] && vmax[i] == CMLP_VMAX_UNSTARTED;
            negative += (i >= ends[0] || turn) && vmax[i] < 0.0f;
        }
        CHECK(unstarted == (turn ? 0 : (int)ends[0]) && negative == 0,
              "turn %d: AMSGrad's maximum not started at %d of part 0's %d, negative at %d elsewhere", turn, unstarted,
              (int)ends[0], negative);
        own[0].amsgrad = 1; /* part 0's turn: it starts at the next step */
        OK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own));
    }
    free(vmax);
    own[0].amsgrad = -1;
    cmlp_optim_free(o[0]);
    /* SGD: part 0 the configuration's (momentum 0.9, nesterov), part 1 its own */
    cmlp_sgd_config sc = cmlp_sgd_defaults();
    sc.lr = 0.1, sc.momentum = 0.9, sc.nesterov = 1;
    OK(cmlp_optim_init_sgd(&o[0], m[0], &sc));
    own[1] = cmlp_part_settings_inherit();
    own[1].amsgrad = 1;
    CHECK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own) == CMLP_ERR_INVALID, "SGD took amsgrad");
    own[1].amsgrad = -1;
    own[1].momentum = 0.5, own[1].dampening = 0.25, own[1].nesterov = 0, own[1].maximize = 1;
    OK(cmlp_optim_set_parts(o[0], 2, ends, scale, wd, own));
    float *p0 = malloc(sizeof(float) * (size_t)n), *p1 = malloc(sizeof(float) * (size_t)n),
          *g = malloc(sizeof(float) * (size_t)n), *buf = calloc((size_t)n, sizeof(float));
    cmlp_data b = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 8};
    double loss;
    int bad = 0;
    for (int step = 0; step < 3; step++) {
        OK(cmlp_model_zero_grad(m[0]));
        OK(cmlp_model_forward_backward(m[0], &b, 1.0f, 0.0f, CMLP_AMP_NONE, &loss));
        OK(cmlp_model_get_params(m[0], p0));
        OK(cmlp_model_get_grads(m[0], g));
        OK(cmlp_optim_step(o[0]));
        OK(cmlp_model_get_params(m[0], p1));
        for (int64_t i = 0; i < n; i++) { /* torch's SGD in float, part by part */
            const int part = i >= ends[0];
            const float mu = part ? 0.5f : 0.9f, keep = part ? 0.75f : 1.0f;
            float gi = (part ? -g[i] : g[i]) + (float)wd[part] * p0[i];
            buf[i] = step == 0 ? gi : mu * buf[i] + keep * gi;
            const float d = part ? buf[i] : gi + mu * buf[i];
            if (p1[i] != p0[i] - (float)(0.1 * scale[part]) * d) bad++;
        }
    }
    CHECK(bad == 0, "%d SGD updates not at their part's own settings", bad);
    cmlp_optim_free(o[0]);
    /* Adam: an epoch whose parts' momenta are a table per step equals the steps by hand */
    cmlp_train_config tc = {.batch_size = 4, .accumulation_steps = 1};
    own[1] = cmlp_part_settings_inherit();
    own[1].beta2 = 0.9;
    for (int k = 0; k < 2; k++) {
        cmlp_model_free(m[k]);
        OK(cmlp_model_init(&m[k], sizes, 3, cmlp_cpu(), 4));
        OK(cmlp_optim_init_adam(&o[k], m[k], &ac));
        OK(cmlp_optim_set_parts(o[k], 2, ends, scale, wd, own));
        OK(cmlp_trainer_init(&t[k], m[k], o[k], &tc));
    }
    const double lr[4] = {1e-3, 2e-3, 3e-3, 4e-3}, mom[4] = {0.9, 0.85, 0.8, 0.75};
    const double scales[8] = {1.0, 0.5, 1.0, 0.25, 0.5, 1.0, 1.0, 1.0};
    const double momenta[8] = {NAN, 0.6, 0.95, 0.5, 0.9, NAN, 0.0, 0.3}, bad_momenta[8] = {NAN, 1.5};
    cmlp_epoch_state st;
    OK(cmlp_trainer_epoch_begin(t[0], &(cmlp_data){.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 16}, 0, &st));
    CHECK(cmlp_trainer_epoch_run_rates(t[0], lr, mom, scales, bad_momenta, 1, &st) == CMLP_ERR_INVALID &&
              st.steps == 0, "a part's beta1 of 1.5 accepted");
    CHECK(cmlp_trainer_epoch_run_rates(t[0], lr, mom, NULL, momenta, 4, &st) == CMLP_ERR_INVALID,
          "momenta without scales accepted");
    OK(cmlp_trainer_epoch_run_rates(t[0], lr, mom, scales, momenta, 4, &st));
    for (int k = 0; k < 4; k++) {
        cmlp_data bk = {.x = x + k * 4 * 7, .x_dtype = CMLP_DTYPE_F32, .y = y + k * 4, .n = 4};
        cmlp_part_settings row[2] = {own[0], own[1]};
        row[0].momentum = momenta[2 * k], row[1].momentum = momenta[2 * k + 1];
        const double row_scales[2] = {scales[2 * k], scales[2 * k + 1]};
        OK(cmlp_optim_set_lr(o[1], lr[k]));
        OK(cmlp_optim_set_momentum(o[1], mom[k]));
        OK(cmlp_optim_set_parts(o[1], 2, ends, row_scales, wd, row));
        OK(cmlp_trainer_step(t[1], &bk, &loss));
    }
    CHECK(cmlp_optim_get_momentum(o[0]) == 0.9, "the call left the optimizer's momentum at %g",
          cmlp_optim_get_momentum(o[0]));
    OK(cmlp_model_get_params(m[0], p0));
    OK(cmlp_model_get_params(m[1], p1));
    CHECK(memcmp(p0, p1, sizeof(float) * (size_t)n) == 0, "parts' momenta per step differ from the hand's");
    free(p0), free(p1), free(g), free(buf);
    for (int k = 0; k < 2; k++) {
        cmlp_trainer_free(t[k]);
        cmlp_optim_free(o[k]);
        cmlp_model_free(m[k]);
    }
}

/* The data-parallel trainer in a group of one (this binary has no MPI module beside it and no
 * launcher started it): every collective of the step runs (the ranks' agreement, the settings'
 * comparison, the sum of the gradients, the group's loss) and the run equals the trainer alone,
 * bit for bit, with fp16 loss scaling, accumulation and a short last step; wrong uses fail. */
/* Gradient clipping: the model's clip_grad_norm (refusals change nothing; the result against a
 * double norm; the scaling), and a trainer clipping in its step as the same calls by hand do. */
static void test_clipping(void) {
    int sizes[] = {6, 9, 3};
    float x[12 * 6];
    int32_t y[12];
    unsigned rs = 5;
    for (int i = 0; i < 12 * 6; i++) x[i] = 4.0f * frand(&rs);
    for (int i = 0; i < 12; i++) y[i] = i % 3;
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 12};
    cmlp_model *m[2];
    cmlp_optim *o[2];
    for (int k = 0; k < 2; k++) {
        OK(cmlp_model_init(&m[k], sizes, 3, cmlp_cpu(), 4));
        cmlp_adam_config ac = cmlp_adam_defaults();
        OK(cmlp_optim_init_adam(&o[k], m[k], &ac));
    }
    const int64_t np_ = cmlp_model_num_parameters(m[0]);
    float *g = malloc(sizeof(float) * (size_t)np_), *g2 = malloc(sizeof(float) * (size_t)np_);
    double loss, norm = -1.0;
    OK(cmlp_model_forward_backward(m[1], &d, 1.0f / 12, 0.0f, CMLP_AMP_NONE, &loss));
    OK(cmlp_model_get_grads(m[1], g));
    CHECK(cmlp_model_clip_grad_norm(m[1], -1.0, 2.0, 0, &norm) == CMLP_ERR_INVALID, "max_norm -1 accepted");
    CHECK(cmlp_model_clip_grad_norm(m[1], 1.0, NAN, 0, &norm) == CMLP_ERR_INVALID, "norm_type NaN accepted");
    CHECK(cmlp_model_clip_grad_value(m[1], -1.0) == CMLP_ERR_INVALID, "clip_value -1 accepted");
    CHECK(cmlp_model_clip_grad_norm(NULL, 1.0, 2.0, 0, &norm) == CMLP_ERR_INVALID, "no model");
    OK(cmlp_model_get_grads(m[1], g2));
    CHECK(memcmp(g, g2, sizeof(float) * (size_t)np_) == 0 && norm == -1.0, "a refused call changed something");
    /* norm_type 0: the tensors whose gradient is not all zeros (4 here); max_norm 5: unscaled */
    OK(cmlp_model_clip_grad_norm(m[1], 5.0, 0.0, 0, &norm));
    OK(cmlp_model_get_grads(m[1], g2));
    CHECK(norm == 4.0 && memcmp(g, g2, sizeof(float) * (size_t)np_) == 0, "norm_type 0 gave %g", norm);
    double ss = 0.0;
    for (int64_t i = 0; i < np_; i++) ss += (double)g[i] * g[i];
    const float max_norm = (float)(sqrt(ss) / 4);
    OK(cmlp_model_clip_grad_norm(m[1], max_norm, 2.0, 1, &norm));
    CHECK(fabs(norm - sqrt(ss)) <= 1e-7 * sqrt(ss), "norm %.9g against %.9g", norm, sqrt(ss));
    OK(cmlp_model_get_grads(m[1], g2));
    const float c = 1.0f / ((float)norm + 1e-6f) * max_norm;
    int64_t bad = -1;
    for (int64_t i = 0; i < np_ && bad < 0; i++)
        if (g2[i] != g[i] * c) bad = i;
    CHECK(bad < 0, "gradient %lld not scaled by %g", (long long)bad, c);
    /* a step by hand (m[1]: zero, forward-backward, clip, Adam) against the trainer's (m[0]) */
    cmlp_train_config tc = {.batch_size = 12, .accumulation_steps = 1};
    cmlp_trainer *t;
    tc.max_grad_norm = -1.0;
    CHECK(cmlp_trainer_init(&t, m[0], o[0], &tc) == CMLP_ERR_INVALID, "max_grad_norm -1 accepted");
    tc.max_grad_norm = max_norm;
    OK(cmlp_trainer_init(&t, m[0], o[0], &tc));
    double last = 0.0;
    CHECK(!cmlp_trainer_last_grad_norm(t, &last), "a norm before any step");
    OK(cmlp_trainer_step(t, &d, &loss));
    OK(cmlp_optim_step(o[1]));
    float *p0 = malloc(sizeof(float) * (size_t)np_), *p1 = malloc(sizeof(float) * (size_t)np_);
    OK(cmlp_model_get_params(m[0], p0));
    OK(cmlp_model_get_params(m[1], p1));
    CHECK(memcmp(p0, p1, sizeof(float) * (size_t)np_) == 0, "the trainer's clipped step differs from the hand's");
    CHECK(cmlp_trainer_last_grad_norm(t, &last) && last == norm, "last norm %.9g against %.9g", last, norm);
    cmlp_epoch_state st;
    OK(cmlp_trainer_epoch_begin(t, &d, 0, &st));
    OK(cmlp_trainer_epoch_run(t, 0, &st));
    CHECK(st.grad_norm_steps == 1 && st.grad_norm_sum > 0.0 && cmlp_trainer_last_grad_norm(t, &last) &&
              (float)st.grad_norm_sum == (float)last,
          "epoch: %lld norms summing to %g, last %g", (long long)st.grad_norm_steps, st.grad_norm_sum, last);
    /* gradients overflowing in half precision: the norm is not finite; asked to, the call refuses
     * and changes nothing */
    OK(cmlp_model_forward_backward(m[1], &d, 1e9f, 0.0f, CMLP_AMP_FP16, &loss));
    OK(cmlp_model_get_grads(m[1], g));
    CHECK(cmlp_model_clip_grad_norm(m[1], 1.0, 2.0, 1, &norm) == CMLP_ERR_NONFINITE && !isfinite(norm),
          "a non-finite norm: %g", norm);
    OK(cmlp_model_get_grads(m[1], g2));
    CHECK(memcmp(g, g2, sizeof(float) * (size_t)np_) == 0, "a refused clip changed the gradients");
    OK(cmlp_model_clip_grad_value(m[1], 0.0));
    OK(cmlp_model_get_grads(m[1], g2));
    bad = -1;
    for (int64_t i = 0; i < np_ && bad < 0; i++)
        if (!(isnan(g[i]) ? isnan(g2[i]) : g2[i] == 0.0f || fabsf(g2[i]) < FLT_MIN)) bad = i;
    CHECK(bad < 0, "clip_grad_value 0: gradient %lld is %g", (long long)bad, bad < 0 ? 0.0 : g2[bad]);
    free(g), free(g2), free(p0), free(p1);
    cmlp_trainer_free(t);
    for (int k = 0; k < 2; k++) {
        cmlp_optim_free(o[k]);
        cmlp_model_free(m[k]);
    }
}

static void test_group_of_one(void) {
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK")) return;
    cmlp_trainer *t0 = NULL;
    int sizes[] = {8, 6, 3};
    cmlp_model *m0;
    cmlp_optim *o0;
    OK(cmlp_model_init(&m0, sizes, 3, cmlp_cpu(), 2));
    cmlp_adam_config ac = cmlp_adam_defaults();
    OK(cmlp_optim_init_adam(&o0, m0, &ac));
    cmlp_train_config tc = {.batch_size = 4, .accumulation_steps = 2, .microbatch_size = 3, .shuffle = 1, .seed = 9,
                            .amp = CMLP_AMP_FP16, .auto_microbatch = 1, .max_grad_norm = 0.01};
    OK(cmlp_trainer_init(&t0, m0, o0, &tc));
    CHECK(cmlp_trainer_set_distributed(t0, 1) == CMLP_ERR_STATE, "a trainer joined no group");
    int rank = -1, size = 0;
    OK(cmlp_dist_init(CMLP_DIST_MPI, &rank, &size));
    CHECK(rank == 0 && size == 1 && cmlp_dist_initialized(), "group of %d, rank %d", size, rank);
    CHECK(cmlp_dist_init(CMLP_DIST_MPI, &rank, &size) == CMLP_ERR_STATE, "a second group");
    double v[3] = {1.0, 2.0, 3.0};
    OK(cmlp_dist_all_reduce(v, 3, 1, 0));
    CHECK(v[0] == 1.0 && v[2] == 3.0, "sum of one %g %g", v[0], v[2]);
    CHECK(cmlp_dist_all_reduce(v, 3, 7, 0) == CMLP_ERR_INVALID, "type 7 accepted");
    CHECK(cmlp_dist_broadcast(v, 24, 1) == CMLP_ERR_INVALID, "root 1 of 1 accepted");
    float x[21 * 8];
    int32_t y[21];
    unsigned rs = 11;
    for (int i = 0; i < 21 * 8; i++) x[i] = frand(&rs);
    for (int i = 0; i < 21; i++) y[i] = i % 3;
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 21, .mean = 0.5f, .std = 0.5f};
    float *res[2];
    double losses[2];
    int64_t np_ = cmlp_model_num_parameters(m0);
    for (int dist = 0; dist < 2; dist++) {
        cmlp_model *m;
        cmlp_optim *o;
        cmlp_trainer *t;
        OK(cmlp_model_init(&m, sizes, 3, cmlp_cpu(), 2));
        OK(cmlp_optim_init_adam(&o, m, &ac));
        OK(cmlp_trainer_init(&t, m, o, &tc));
        cmlp_scaler_state sc = {1, 1024.0, 2.0, 0.5, 3, 0};
        OK(cmlp_trainer_set_scaler(t, &sc));
        OK(cmlp_trainer_set_distributed(t, dist));
        cmlp_epoch_state st;
        losses[dist] = 0.0;
        for (int e = 0; e < 2; e++) {
            OK(cmlp_trainer_epoch_begin(t, &d, e > 0, &st));
            OK(cmlp_trainer_epoch_run(t, 0, &st));
            CHECK(st.done && st.samples == 21 && st.steps == 3, "epoch %lld steps, %lld samples", (long long)st.steps,
                  (long long)st.samples);
            losses[dist] += st.loss_sum;
        }
        double loss;
        OK(cmlp_trainer_step(t, &d, &loss));
        losses[dist] += loss;
        res[dist] = malloc(sizeof(float) * (size_t)np_);
        OK(cmlp_model_get_params(m, res[dist]));
        cmlp_trainer_free(t);
        cmlp_optim_free(o);
        cmlp_model_free(m);
    }
    CHECK(memcmp(res[0], res[1], sizeof(float) * (size_t)np_) == 0, "the group of one trains otherwise");
    CHECK(losses[0] == losses[1], "losses %.17g and %.17g", losses[0], losses[1]);
    for (int i = 0; i < 2; i++) free(res[i]);
    cmlp_dist_destroy();
    CHECK(!cmlp_dist_initialized() && cmlp_dist_size() == 1, "the group outlived destroy");
    CHECK(cmlp_dist_barrier() == CMLP_ERR_STATE, "a barrier without a group");
    cmlp_trainer_free(t0);
    cmlp_optim_free(o0);
    cmlp_model_free(m0);
}

/* cmlp_model_move takes the model's own optimizers only, and moves them with it */
static void test_model_move(void) {
    int sizes[] = {3, 4, 2};
    cmlp_model *m, *other;
    OK(cmlp_model_init(&m, sizes, 3, cmlp_cpu(), 5));
    OK(cmlp_model_init(&other, sizes, 3, cmlp_cpu(), 6));
    cmlp_adam_config ac = cmlp_adam_defaults();
    cmlp_optim *o[2];
    OK(cmlp_optim_init_adam(&o[0], m, &ac));
    OK(cmlp_optim_init_adam(&o[1], other, &ac));
    CHECK(cmlp_model_move(m, o, 2, cmlp_cpu()) == CMLP_ERR_STATE, "an optimizer of another model moved");
    CHECK(strstr(cmlp_last_error(), "another model") != NULL, "message: %s", cmlp_last_error());
    CHECK(cmlp_model_move(m, o, -1, cmlp_cpu()) == CMLP_ERR_INVALID, "nopts -1 taken");
    cmlp_optim *none[1] = {NULL};
    CHECK(cmlp_model_move(m, none, 1, cmlp_cpu()) == CMLP_ERR_INVALID, "a NULL optimizer taken");
    OK(cmlp_model_move(m, o, 1, cmlp_cpu()));
    OK(cmlp_model_move(m, NULL, 0, cmlp_cpu()));
    cmlp_device gpu = {.type = CMLP_DEVICE_CUDA, .index = 0};
    CHECK(cmlp_model_move(m, o, 1, gpu) != CMLP_OK && cmlp_model_device(m).type == CMLP_DEVICE_CPU,
          "a move to a GPU this build cannot open");
    cmlp_optim_free(o[0]);
    cmlp_optim_free(o[1]);
    cmlp_model_free(m);
    cmlp_model_free(other);
}

/* The contract's refusals for a C caller: nothing changes, nothing crashes. */
static void test_misuse_refused(void) {
    int sizes[] = {3, 4, 2};
    cmlp_model *m, *other;
    OK(cmlp_model_init(&m, sizes, 3, cmlp_cpu(), 5));
    OK(cmlp_model_init(&other, sizes, 3, cmlp_cpu(), 6));
    cmlp_sgd_config sc = {.lr = 0.5};
    cmlp_optim *o, *o_other;
    OK(cmlp_optim_init_sgd(&o, m, &sc));
    OK(cmlp_optim_init_sgd(&o_other, other, &sc));
    cmlp_train_config tc = {.batch_size = 4, .accumulation_steps = 2};
    cmlp_trainer *t = NULL;
    CHECK(cmlp_trainer_init(&t, m, o_other, &tc) == CMLP_ERR_STATE && !t, "a trainer of another model's optimizer");
    tc.microbatch_size = 9;
    CHECK(cmlp_trainer_init(&t, m, o, &tc) == CMLP_ERR_INVALID, "a micro-batch above the step's 8 rows");
    tc.microbatch_size = 8;
    tc.grow_interval = -1;
    CHECK(cmlp_trainer_init(&t, m, o, &tc) == CMLP_ERR_INVALID, "a negative grow_interval");
    tc.grow_interval = 0;
    OK(cmlp_trainer_init(&t, m, o, &tc));
    CHECK(cmlp_trainer_set_microbatch_size(t, 9) == CMLP_ERR_INVALID && cmlp_trainer_microbatch_size(t) == 8,
          "a micro-batch above the step's rows set");
    double loss = 0.0;
    CHECK(cmlp_trainer_step(t, NULL, &loss) == CMLP_ERR_INVALID, "a NULL batch");

    /* the scaler: checked as the float32 and int32 the steps keep */
    cmlp_scaler_state good = {.enabled = 1, .scale = 1024.0, .growth_factor = 2.0, .backoff_factor = 0.5,
                              .growth_interval = 3, .growth_tracker = 2};
    OK(cmlp_trainer_set_scaler(t, &good));
    const cmlp_scaler_state bad[] = {
        {1, 1e39, 2.0, 0.5, 3, 0},                              /* inf in float32 */
        {1, 1e-50, 2.0, 0.5, 3, 0},                             /* 0 in float32 */
        {1, 1e-40, 2.0, 0.5, 3, 0},                             /* subnormal in float32 */
        {1, 1024.0, INFINITY, 0.5, 3, 0},                       /* an endless growth */
        {1, 1024.0, 2.0, 0.5, ((int64_t)1 << 32) + 1, 0},       /* an int32 would read 1 */
        {1, 1024.0, 2.0, 0.5, INT32_MAX, INT32_MAX},             /* its next step would overflow */
        {1, 1024.0, 2.0, 0.5, 3, 3},                            /* at the interval */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(cmlp_trainer_set_scaler(t, &bad[i]) == CMLP_ERR_INVALID, "scaler state %zu taken", i);
        cmlp_scaler_state now;
        cmlp_trainer_get_scaler(t, &now);
        CHECK(now.scale == 1024.0 && now.growth_interval == 3 && now.growth_tracker == 2, "state %zu changed it", i);
    }

    /* a configuration's rate times a parameter group's scale stays finite in float32 */
    int64_t ends[] = {6, 26}; /* 3*4 + 4 + 4*2 + 2 parameters */
    double scale[] = {1e30, 1.0}, wd[] = {0.0, 0.0};
    OK(cmlp_optim_set_parts(o, 2, ends, scale, wd, NULL));
    cmlp_sgd_config fast = {.lr = 1e10};
    CHECK(cmlp_optim_configure_sgd(o, &fast) == CMLP_ERR_INVALID && cmlp_optim_get_lr(o) == 0.5,
          "a rate whose group steps at inf");
    cmlp_adam_config ac = cmlp_adam_defaults();
    cmlp_optim *adam;
    OK(cmlp_optim_init_adam(&adam, m, &ac));
    OK(cmlp_optim_set_parts(adam, 2, ends, scale, wd, NULL));
    ac.lr = 1e10;
    CHECK(cmlp_optim_configure_adam(adam, &ac) == CMLP_ERR_INVALID && cmlp_optim_get_lr(adam) == 1e-3,
          "an Adam rate whose group steps at inf");
    cmlp_optim_free(adam);

    /* a sample count whose values int64 cannot count, refused before x is read */
    float x[3] = {0};
    int32_t y[1] = {0};
    cmlp_data huge = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = INT64_MAX / 2};
    CHECK(cmlp_model_forward_backward(m, &huge, 1.0f, 0.0f, CMLP_AMP_NONE, &loss) == CMLP_ERR_INVALID, "n * features overflowed");
    cmlp_data half = {.x = x, .x_dtype = CMLP_DTYPE_F16, .y = y, .n = 1};
    CHECK(cmlp_model_forward_backward(m, &half, 1.0f, 0.0f, CMLP_AMP_NONE, &loss) == CMLP_ERR_INVALID &&
              strstr(cmlp_last_error(), "float32 or uint8") != NULL,
          "fp16 input: %s", cmlp_last_error());
    cmlp_plan plan;
    CHECK(cmlp_plan_compute(sizes, 3, 4, 2, 0, 0, (cmlp_amp)7, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, cmlp_cpu(), NULL, &plan) ==
              CMLP_ERR_INVALID,
          "a plan for amp mode 7");
    CHECK(cmlp_plan_compute(sizes, 3, 4, 2, 0, 0, CMLP_AMP_NONE, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, cmlp_cpu(), NULL, NULL) ==
                  CMLP_ERR_INVALID && strstr(cmlp_last_error(), "out must not be NULL") != NULL,
          "a NULL plan: %s", cmlp_last_error());
    /* a GPU described, not opened: its workspace block (34 MiB on 9.x) is held before the run */
    cmlp_gpu_desc hopper = {.major = 9, .total_memory = (int64_t)80 << 30}, none = {.major = 0};
    CHECK(cmlp_plan_compute(sizes, 3, 4, 2, 1, 0, CMLP_AMP_NONE, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, cmlp_cpu(), &hopper,
                            &plan) == CMLP_OK &&
              plan.standing_reserved == (int64_t)34 << 20,
          "a plan for a GPU described: %s, standing %lld", cmlp_last_error(), (long long)plan.standing_reserved);
    CHECK(cmlp_plan_compute(sizes, 3, 4, 2, 1, 0, CMLP_AMP_NONE, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, cmlp_cpu(), &none,
                            &plan) == CMLP_ERR_INVALID &&
              strstr(cmlp_last_error(), "compute capability") != NULL,
          "a GPU of compute capability 0: %s", cmlp_last_error());
    cmlp_trainer_free(t);
    cmlp_optim_free(o);
    cmlp_optim_free(o_other);
    cmlp_model_free(m);
    cmlp_model_free(other);
}

/* What a model and its optimizer hold in memory now, as a planned start counts it. */
static void test_held_in_memory(void) {
    int sizes[] = {3, 4, 2};
    cmlp_model *m;
    OK(cmlp_model_init(&m, sizes, 3, cmlp_cpu(), 5));
    cmlp_adam_config ac = cmlp_adam_defaults();
    cmlp_optim *o;
    OK(cmlp_optim_init_adam(&o, m, &ac));
    CHECK(cmlp_optim_buffers_held(o) == 0 && cmlp_model_half_weights_held(m) == 0, "held before any step");
    float x[6] = {0.1f, -0.2f, 0.3f, 0.4f, 0.5f, -0.6f};
    int32_t y[2] = {0, 1};
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 2};
    double loss;
    OK(cmlp_model_forward_backward(m, &d, 0.5f, 0.0f, CMLP_AMP_BF16, &loss));
    CHECK(cmlp_model_half_weights_held(m) == 1, "no half weights after a bf16 pass");
    OK(cmlp_optim_step(o));
    CHECK(cmlp_optim_buffers_held(o) == 2 && cmlp_optim_num_buffers(o) == 2, "Adam holds %d buffers",
          cmlp_optim_buffers_held(o));
    cmlp_optim_free(o);
    cmlp_model_free(m);
}

/* The changed flag that a data-parallel trainer's agreement reads, and the hashes it compares
 * (a model of 13 parameters: the last one's 4 bytes are a short word). */
static void test_changes_and_hashes(void) {
    int sizes[] = {2, 3, 1};
    cmlp_model *a, *b;
    OK(cmlp_model_init(&a, sizes, 3, cmlp_cpu(), 1));
    OK(cmlp_model_init(&b, sizes, 3, cmlp_cpu(), 2));
    CHECK(a->nparams == 13 && !a->written && !b->written, "a new model is not changed");
    float p[13];
    OK(cmlp_model_get_params(a, p));
    OK(cmlp_model_set_params(b, p));
    CHECK(b->written && !a->written, "set_params marks the model changed");
    uint64_t ha = 7, hb = 7;
    OK(cmlp_buffer_hash(a->dev, a->params, 13 * sizeof(float), false, &ha));
    OK(cmlp_buffer_hash(b->dev, b->params, 13 * sizeof(float), false, &hb));
    CHECK(ha == hb && ha != 7, "equal parameters, equal hashes");
    p[12] = nextafterf(p[12], INFINITY); /* the last parameter alone */
    OK(cmlp_model_copy_params(b, p));
    hb = 7;
    OK(cmlp_buffer_hash(b->dev, b->params, 13 * sizeof(float), false, &hb));
    CHECK(ha != hb, "the last parameter's bit is not in the hash");
    float marks[2][3] = {{-1.0f, 2.0f, -0.5f}, {-1.4983f, 2.0f, -1.0f}}; /* AMSGrad's "not started", two ways */
    uint64_t h[4] = {7, 7, 7, 7};
    for (int i = 0; i < 4; i++) OK(cmlp_buffer_hash(a->dev, marks[i % 2], sizeof marks[0], i < 2, &h[i]));
    CHECK(h[0] == h[1] && h[2] != h[3], "values < 0 are one mark where asked, and only there");
    cmlp_adam_config ac = cmlp_adam_defaults();
    cmlp_optim *o;
    OK(cmlp_optim_init_adam(&o, a, &ac));
    uint64_t none = 7, stepped = 7;
    OK(cmlp_optim_state_hash(o, &none));
    float x[2] = {0.5f, -1.0f};
    int32_t y[1] = {0};
    cmlp_data d = {.x = x, .x_dtype = CMLP_DTYPE_F32, .y = y, .n = 1};
    double loss;
    OK(cmlp_model_forward_backward(a, &d, 1.0f, 0.0f, CMLP_AMP_NONE, &loss));
    OK(cmlp_optim_step(o));
    CHECK(a->written && *cmlp_optim_written(o), "an optimizer step of the caller's marks its model and state changed");
    OK(cmlp_optim_state_hash(o, &stepped));
    CHECK(none != stepped, "the state's hash does not see the state");
    a->written = *cmlp_optim_written(o) = false;
    float m0[13], v0[13];
    OK(cmlp_optim_get_buffer(o, 0, m0));
    OK(cmlp_optim_get_buffer(o, 1, v0));
    m0[12] = 0.25f;
    const float *bufs[2] = {m0, v0};
    OK(cmlp_optim_set_state(o, 1, 2, bufs));
    uint64_t loaded = 7;
    OK(cmlp_optim_state_hash(o, &loaded));
    CHECK(!a->written && *cmlp_optim_written(o) && loaded != stepped, "a loaded state is marked changed, and hashes apart");
    cmlp_optim_free(o);
    cmlp_model_free(a);
    cmlp_model_free(b);
}

int main(void) {
    int64_t base = allocated_now();
    test_status_and_devices();
    test_bad_models();
    test_gradients();
    test_accumulation();
    test_adam_first_step();
    test_amsgrad_buffers();
    test_allocator();
    test_determinism();
    test_clipping();
    test_rates_per_step();
    test_parts();
    test_part_settings();
    test_group_of_one();
    test_model_move();
    test_misuse_refused();
    test_held_in_memory();
    test_changes_and_hashes();
    CHECK(allocated_now() == base, "bytes left allocated: %lld", (long long)(allocated_now() - base));
    return check_summary();
}
