/* train.c - the training loop: effective batches split into micro-batches whose gradients
 * are summed exactly (each sample weighted by 1 / effective batch size), the seeded epoch
 * shuffle, and the optimizer step. A step that fails leaves parameters and optimizer alone.
 */
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct cmlp_trainer {
    cmlp_model *model;
    cmlp_optim *optim;
    cmlp_train_config cfg;
    int64_t micro;
    /* the epoch in progress */
    cmlp_data data;
    int64_t *order; /* host [data.n] sample order; NULL when not shuffling */
    int64_t order_cap;
    int64_t epoch;
    int64_t pos;
};

cmlp_status cmlp_trainer_init(cmlp_trainer **out, cmlp_model *m, cmlp_optim *o, const cmlp_train_config *c) {
    if (!out || !m || !o || !c) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (c->batch_size < 1) return CMLP_FAIL(CMLP_ERR_INVALID, "batch_size must be >= 1, got %lld", (long long)c->batch_size);
    if (c->accumulation_steps < 1)
        return CMLP_FAIL(CMLP_ERR_INVALID, "accumulation_steps must be >= 1, got %lld", (long long)c->accumulation_steps);
    if (c->microbatch_size < 0)
        return CMLP_FAIL(CMLP_ERR_INVALID, "microbatch_size must be >= 1, got %lld", (long long)c->microbatch_size);
    if (!(c->label_smoothing >= 0.0f && c->label_smoothing <= 1.0f))
        return CMLP_FAIL(CMLP_ERR_INVALID, "label_smoothing must be in [0, 1], got %g", (double)c->label_smoothing);
    cmlp_trainer *t = calloc(1, sizeof *t);
    if (!t) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory creating the trainer");
    t->model = m;
    t->optim = o;
    t->cfg = *c;
    t->micro = c->microbatch_size ? c->microbatch_size : c->batch_size;
    *out = t;
    return CMLP_OK;
}

void cmlp_trainer_free(cmlp_trainer *t) {
    if (!t) return;
    free(t->order);
    free(t);
}

int64_t cmlp_trainer_microbatch_size(const cmlp_trainer *t) { return t->micro; }

cmlp_status cmlp_trainer_set_microbatch_size(cmlp_trainer *t, int64_t size) {
    if (size < 1) return CMLP_FAIL(CMLP_ERR_INVALID, "microbatch_size must be >= 1, got %lld", (long long)size);
    t->micro = size;
    return CMLP_OK;
}

/* One optimizer step over n samples: rows idx[0..n) of xy, or rows [start, start + n). */
static cmlp_status effective_step(cmlp_trainer *t, const cmlp_data *xy, const int64_t *idx, int64_t start,
                                  int64_t n, double *loss_sum) {
    cmlp_model *m = t->model;
    CMLP_TRY(cmlp_model_zero_grad(m));
    const float w = (float)(1.0 / (double)n);
    double loss = 0.0;
    for (int64_t off = 0; off < n; off += t->micro) {
        int64_t k = n - off < t->micro ? n - off : t->micro;
        const float *in;
        const int32_t *lab;
        CMLP_TRY(cmlp_model_stage(m, xy, idx ? idx + off : NULL, start + off, k, &in, &lab));
        CMLP_TRY(cmlp_model_fb_rows(m, in, lab, k, w, t->cfg.label_smoothing, &loss));
    }
    CMLP_TRY(cmlp_optim_step(t->optim));
    *loss_sum += loss;
    return CMLP_OK;
}

cmlp_status cmlp_trainer_step(cmlp_trainer *t, const cmlp_data *xy, double *loss_mean) {
    if (!t || !loss_mean) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    CMLP_TRY(cmlp_data_validate(t->model, xy, true));
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    double loss = 0.0;
    cmlp_status st = effective_step(t, xy, NULL, 0, xy->n, &loss);
    cmlp_fpenv_leave(&fe);
    if (st == CMLP_OK) *loss_mean = loss / (double)xy->n;
    return st;
}

static int64_t effective_batch(const cmlp_trainer *t) { return t->cfg.batch_size * t->cfg.accumulation_steps; }

cmlp_status cmlp_trainer_epoch_begin(cmlp_trainer *t, const cmlp_data *xy, cmlp_epoch_state *st) {
    if (!t || !st) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    CMLP_TRY(cmlp_data_validate(t->model, xy, true));
    int64_t n = xy->n;
    if (t->cfg.shuffle) {
        if (n > t->order_cap) {
            int64_t *o = realloc(t->order, (size_t)n * sizeof *o);
            if (!o) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for an epoch order of %lld samples", (long long)n);
            t->order = o;
            t->order_cap = n;
        }
        /* Fisher-Yates with a generator seeded by (seed, epoch): reproducible per epoch */
        cmlp_rng rng;
        cmlp_rng_seed(&rng, t->cfg.seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(t->epoch + 1)));
        for (int64_t i = 0; i < n; i++) t->order[i] = i;
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = (int64_t)cmlp_rng_below(&rng, (uint64_t)i + 1);
            int64_t tmp = t->order[i];
            t->order[i] = t->order[j];
            t->order[j] = tmp;
        }
    }
    t->data = *xy;
    t->epoch++;
    t->pos = 0;
    int64_t eb = effective_batch(t);
    *st = (cmlp_epoch_state){.total_steps = (n + eb - 1) / eb};
    return CMLP_OK;
}

cmlp_status cmlp_trainer_epoch_run(cmlp_trainer *t, int64_t max_steps, cmlp_epoch_state *st) {
    if (!t || !st) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (!t->data.x) return CMLP_FAIL(CMLP_ERR_STATE, "epoch_run called before epoch_begin");
    int64_t n = t->data.n, eb = effective_batch(t);
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status s = CMLP_OK;
    for (int64_t done = 0; t->pos < n && (max_steps <= 0 || done < max_steps); done++) {
        int64_t k = n - t->pos < eb ? n - t->pos : eb;
        double loss = 0.0;
        const int64_t *idx = t->cfg.shuffle ? t->order + t->pos : NULL;
        s = effective_step(t, &t->data, idx, t->pos, k, &loss);
        if (s != CMLP_OK) break;
        t->pos += k;
        st->steps++;
        st->samples += k;
        st->loss_sum += loss;
    }
    cmlp_fpenv_leave(&fe);
    st->done = t->pos >= n;
    if (st->done) memset(&t->data, 0, sizeof t->data);
    return s;
}
