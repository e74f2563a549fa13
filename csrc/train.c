/* train.c - the training loop: effective batches split into micro-batches whose gradients
 * are summed exactly (each sample weighted by 1 / effective batch size), the seeded epoch
 * shuffle, and the optimizer step. A step that fails leaves parameters and optimizer alone.
 */
#include "internal.h"
#include "comm.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Everything a captured step bakes in: pointers, sizes and settings. A step with another key
 * cannot replay the graph. */
typedef struct step_key {
    const void *model, *dev, *x, *y, *order, *ws, *wsa, *wsr, *params, *grads, *params_h;
    int64_t n, n_all, start, micro, growth_interval; /* this rank's samples of n_all, from start */
    int64_t ws_rows, wsa_rows, wsa_chunk, wsr_rows; /* a workspace's layout follows its rows */
    float mean, std;                                /* the normalisation the gather applies */
    int x_dtype, wsa_recompute;
    bool ws_compact, ws_forward, wsa_compact; /* where the workspaces' pieces lie */
    uint64_t optim_version;
    double growth_factor, backoff_factor;
    float smoothing;
    int amp, recompute, scaled;
    double max_grad_norm;
    bool rates; /* the step reads its rate and momentum from the call's list (moving on), not ds->rates[0..1] */
    bool step_scales; /* and its param groups' scales from the optimizer's table of the call's steps */
} step_key;

struct cmlp_trainer {
    cmlp_model *model;
    cmlp_optim *optim;
    cmlp_train_config cfg;
    int64_t micro;
    int64_t fit_call[3]; /* the fit in progress: its epochs, validation samples (-1: none), per-step schedule */
    /* the epoch in progress */
    cmlp_data data;
    int64_t *order; /* host [data.n] sample order; NULL when not shuffling */
    int64_t order_cap;
    /* on a device that is not the host: the epoch's data set and order in its memory */
    cmlp_allocator *d_alloc; /* whose memory they are (the model may move) */
    /* a captured full step (device data, a device with graphs) and what it baked in */
    void *graph;
    cmlp_device_ctx *graph_dev;
    step_key graph_key, warm_key; /* warm_key: the last full step run eagerly */
    bool warm, graphs_off;        /* graphs_off: a capture failed; eager from then on */
    bool epoch_open;              /* between epoch_begin and the epoch's last step */
    void *d_x;
    int32_t *d_y;
    int64_t *d_order;
    int64_t epoch;
    int64_t pos;
    cmlp_scaler_state scaler;
    int64_t skipped;
    int64_t oom_retries, good_steps;
    int64_t target_micro; /* the micro-batch asked for; auto micro-batching grows back to it */
    int64_t grown_from;   /* the micro-batch before the last growth, which worked (0: none) */
    int64_t whole_rows;   /* this rank's rows of a whole step of the call (growth sizes for it, not
                           * for a short last step) */
    bool dist;            /* data-parallel over the process group */
    void *dcomm;          /* off the host: dcomm_dev's member of the group's device collectives */
    cmlp_device_ctx *dcomm_dev;
    uint64_t dgen;        /* the process group dcomm (and a captured step using it) belongs to */
    double last_norm;     /* the last step's gradient norm (clipping), when has_norm */
    bool has_norm;
    bool rates;           /* the call in progress has a rate per step (cmlp_trainer_epoch_run_rates) */
    bool step_scales;     /* and param-group scales per step (in the optimizer's table, on its device) */
    const double *scales_row; /* the step in progress's param-group scales, for a step on the host */
    const double *momenta_row; /* and their momenta (NULL: the parts' own) */
    bool host_data;       /* keep the data set in host memory (cmlp_trainer_set_host_data) */
};

/* Off the CPU the optimizer's step count and bias corrections live on the device too, so that a
 * step bakes no host value that changes from step to step (a captured step can replay). */
static bool device_steps(const cmlp_trainer *t);

/* CMLP_TRAIN_DEVICE_PATH=1 (tests): the CPU trains as a GPU does, with the data set copied to
 * device memory and the position and step count kept there. */
static bool device_path_forced(void) {
    static int forced = -1;
    if (forced < 0) {
        const char *e = getenv("CMLP_TRAIN_DEVICE_PATH");
        forced = e && e[0] == '1';
    }
    return forced;
}

static bool device_steps(const cmlp_trainer *t) {
    return t->model->dev->device.type != CMLP_DEVICE_CPU || device_path_forced();
}

cmlp_status cmlp_trainer_init(cmlp_trainer **out, cmlp_model *m, cmlp_optim *o, const cmlp_train_config *c) {
    if (!out || !m || !o || !c) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (c->batch_size < 1) return CMLP_FAIL(CMLP_ERR_INVALID, "batch_size must be >= 1, got %lld", (long long)c->batch_size);
    if (c->accumulation_steps < 1)
        return CMLP_FAIL(CMLP_ERR_INVALID, "accumulation_steps must be >= 1, got %lld", (long long)c->accumulation_steps);
    /* the samples of one step, and the arithmetic on them, fit in int64 */
    if (c->batch_size > CMLP_MAX_STEP_SAMPLES / c->accumulation_steps)
        return CMLP_FAIL(CMLP_ERR_INVALID, "batch_size * accumulation_steps must be at most 2**62, got %lld * %lld",
                         (long long)c->batch_size, (long long)c->accumulation_steps);
    if (c->microbatch_size < 0 || c->microbatch_size > CMLP_MAX_STEP_SAMPLES)
        return CMLP_FAIL(CMLP_ERR_INVALID, "microbatch_size must be in [1, 2**62], got %lld",
                         (long long)c->microbatch_size);
    if (c->amp != CMLP_AMP_NONE && c->amp != CMLP_AMP_FP16 && c->amp != CMLP_AMP_BF16)
        return CMLP_FAIL(CMLP_ERR_INVALID, "unknown amp mode %d", (int)c->amp);
    if (!(c->label_smoothing >= 0.0f && c->label_smoothing <= 1.0f))
        return CMLP_FAIL(CMLP_ERR_INVALID, "label_smoothing must be in [0, 1], got %g", (double)c->label_smoothing);
    if (!(c->max_grad_norm >= 0.0))
        return CMLP_FAIL(CMLP_ERR_INVALID, "max_grad_norm must be > 0 (0: no clipping), got %g", c->max_grad_norm);
    cmlp_trainer *t = calloc(1, sizeof *t);
    if (!t) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory creating the trainer");
    t->model = m;
    t->optim = o;
    t->cfg = *c;
    t->micro = c->microbatch_size ? c->microbatch_size : c->batch_size;
    if (!t->cfg.grow_interval) t->cfg.grow_interval = 100;
    t->target_micro = t->micro;
    const char *graphs = getenv("CMLP_CUDA_GRAPHS"); /* "0": every step eagerly */
    t->graphs_off = graphs && strcmp(graphs, "0") == 0;
    *out = t;
    return CMLP_OK;
}

/* The device copy of the epoch's data goes back to the cache. */
static void drop_device_data(cmlp_trainer *t) {
    cmlp_allocator *a = t->d_alloc;
    if (!a) return;
    if (t->d_x) (void)cmlp_allocator_free(a, t->d_x);
    if (t->d_y) (void)cmlp_allocator_free(a, t->d_y);
    if (t->d_order) (void)cmlp_allocator_free(a, t->d_order);
    t->d_x = NULL;
    t->d_y = NULL;
    t->d_order = NULL;
    t->d_alloc = NULL;
}

void cmlp_resident_sizes(int64_t n, size_t row_bytes, int shuffled, size_t out[3]) {
    out[0] = row_bytes * (size_t)n;
    out[1] = (size_t)n * sizeof(int32_t);
    out[2] = shuffled ? (size_t)n * sizeof(int64_t) : 0;
}

/* On a device that is not the host, the epoch's data set (uint8 stays uint8) and its order are
 * copied there once, and every batch is gathered on the device. Without room for them, or when
 * the trainer was told to keep the data in host memory (cmlp_trainer_set_host_data), the batches
 * are staged from host memory instead, as for a single step; a copy that the device's memory
 * limit cannot take is not tried (it would only run the allocator out of memory, and empty its
 * cache), and one that failed is not tried again until the trainer is told to (a new fit). */
static void upload_epoch(cmlp_trainer *t, const cmlp_data *xy) {
    cmlp_device_ctx *dev = t->model->dev;
    if (!device_steps(t) || t->host_data) return;
    size_t sz[3];
    cmlp_resident_sizes(xy->n, (size_t)t->model->sizes[0] * (xy->x_dtype == CMLP_DTYPE_U8 ? 1 : sizeof(float)),
                        t->cfg.shuffle, sz);
    size_t nx = sz[0], ny = sz[1], no = sz[2];
    const cmlp_backend_i *b = dev->backend;
    cmlp_memory_stats s;
    cmlp_allocator_stats(dev->alloc, &s);
    const int64_t held = s.stat[CMLP_STAT_ALLOCATED_BYTES][CMLP_POOL_ALL].current;
    if (s.limit >= 0 && held + (int64_t)(nx + ny + no) > s.limit) {
        t->host_data = true;
        return;
    }
    t->d_alloc = dev->alloc;
    cmlp_status st = cmlp_allocator_malloc(dev->alloc, nx, "data set", &t->d_x);
    if (st == CMLP_OK) st = cmlp_allocator_malloc(dev->alloc, ny, "data set labels", (void **)&t->d_y);
    if (st == CMLP_OK && t->cfg.shuffle) st = cmlp_allocator_malloc(dev->alloc, no, "data set order", (void **)&t->d_order);
    if (st == CMLP_OK) st = b->copy_h2d(dev->bctx, t->d_x, xy->x, nx);
    if (st == CMLP_OK) st = b->copy_h2d(dev->bctx, t->d_y, xy->y, ny);
    if (st == CMLP_OK && t->cfg.shuffle) st = b->copy_h2d(dev->bctx, t->d_order, t->order, no);
    if (st != CMLP_OK) {
        drop_device_data(t);
        t->host_data = true;
    }
}

static void drop_graph(cmlp_trainer *t) {
    if (t->graph) t->graph_dev->backend->graph_free(t->graph_dev->bctx, t->graph);
    t->graph = NULL;
    t->graph_dev = NULL;
}

void cmlp_trainer_free(cmlp_trainer *t) {
    if (!t) return;
    drop_graph(t);
    drop_device_data(t);
    free(t->order);
    free(t);
}

int64_t cmlp_trainer_microbatch_size(const cmlp_trainer *t) { return t->micro; }

void cmlp_trainer_set_fit_call(cmlp_trainer *t, int64_t epochs, int64_t validation_samples, int per_step_schedule) {
    t->fit_call[0] = epochs;
    t->fit_call[1] = validation_samples;
    t->fit_call[2] = per_step_schedule != 0;
}
int64_t cmlp_trainer_skipped_steps(const cmlp_trainer *t) { return t->skipped; }
int64_t cmlp_trainer_oom_retries(const cmlp_trainer *t) { return t->oom_retries; }
int cmlp_trainer_last_grad_norm(const cmlp_trainer *t, double *norm) {
    if (t->has_norm) *norm = t->last_norm;
    return t->has_norm;
}
void cmlp_trainer_get_scaler(const cmlp_trainer *t, cmlp_scaler_state *out) { *out = t->scaler; }

cmlp_status cmlp_trainer_set_scaler(cmlp_trainer *t, const cmlp_scaler_state *s) {
    if (s->enabled) {
        if (!(s->scale > 0.0 && isfinite(s->scale)))
            return CMLP_FAIL(CMLP_ERR_INVALID, "loss scale must be finite and > 0, got %g", s->scale);
        if (!(s->growth_factor > 1.0)) return CMLP_FAIL(CMLP_ERR_INVALID, "growth_factor should be > 1");
        if (!(s->backoff_factor > 0.0 && s->backoff_factor < 1.0))
            return CMLP_FAIL(CMLP_ERR_INVALID, "backoff_factor should be in (0, 1)");
        if (s->growth_interval < 1 || s->growth_tracker < 0)
            return CMLP_FAIL(CMLP_ERR_INVALID, "growth_interval must be >= 1 and the tracker >= 0");
    }
    t->scaler = *s;
    t->scaler.scale = (float)s->scale;
    return CMLP_OK;
}

cmlp_status cmlp_trainer_start_microbatch(cmlp_trainer *t, int64_t size) {
    if (size < 1 || size > t->target_micro)
        return CMLP_FAIL(CMLP_ERR_INVALID, "a starting micro-batch must be in [1, %lld], got %lld",
                         (long long)t->target_micro, (long long)size);
    t->micro = size;
    t->good_steps = t->grown_from = 0;
    return CMLP_OK;
}

cmlp_status cmlp_trainer_set_microbatch_size(cmlp_trainer *t, int64_t size) {
    if (size < 1 || size > CMLP_MAX_STEP_SAMPLES)
        return CMLP_FAIL(CMLP_ERR_INVALID, "microbatch_size must be in [1, 2**62], got %lld", (long long)size);
    t->micro = t->target_micro = size;
    t->good_steps = t->grown_from = 0;
    return CMLP_OK;
}

/* Reads the call's results back: the loss sum and the skipped steps are returned, the scaler
 * and the optimizer's step count taken over (after a failure too: they hold the steps done). */
static cmlp_status run_end(cmlp_trainer *t, cmlp_dscalars *ds, bool stepped, double *loss_sum, int64_t *skipped,
                           double *norm_sum, int64_t *norm_steps) {
    cmlp_model *m = t->model;
    cmlp_dscalars h;
    CMLP_TRY(m->dev->backend->copy_d2h(m->dev->bctx, &h, ds, sizeof h));
    /* the group's loss (every rank skips the same steps: they check the same summed gradients) */
    if (t->dist) CMLP_TRY(cmlp_dist_all_reduce(&h.loss, 1, CMLP_COMM_F64, CMLP_REDUCE_SUM));
    if (t->scaler.enabled) {
        t->scaler.scale = h.scale;
        t->scaler.growth_tracker = h.growth_tracker;
    }
    if (t->scaler.enabled || device_steps(t)) cmlp_optim_set_step(t->optim, h.step);
    t->skipped += h.skipped;
    *loss_sum = h.loss;
    *skipped = h.skipped;
    *norm_sum = h.norm_sum;
    *norm_steps = h.norm_steps;
    if (t->cfg.max_grad_norm > 0.0 && stepped) {
        t->last_norm = h.grad_norm;
        t->has_norm = true;
    }
    return CMLP_OK;
}

/* Ranks taking part in a step: the process group's, when data-parallel. */
static int64_t group_size(const cmlp_trainer *t) { return t->dist ? cmlp_dist_size() : 1; }

/* This rank's share of a step of n samples (all ranks): [*off, *off + *k), the first n % size
 * ranks one sample more. */
static void share_of(const cmlp_trainer *t, int64_t n, int64_t *off, int64_t *k) {
    int64_t w = group_size(t), r = t->dist ? cmlp_dist_rank() : 0, q = n / w, rem = n % w;
    *off = r * q + (r < rem ? r : rem);
    *k = q + (r < rem);
}

/* The gradients of this rank's k samples of an optimizer step of n_all (all ranks): rows
 * idx[0..k) of xy, or rows [start, start + k), each weighted by 1 / n_all. With a loss scaler
 * the scale is the same for every micro-batch of the step. */
static cmlp_status step_grads(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy, const int64_t *idx,
                              int64_t start, int64_t k, int64_t n_all) {
    cmlp_model *m = t->model;
    const cmlp_backend_i *b = m->dev->backend;
    void *ctx = m->dev->bctx;
    /* the state exists before the gradients are written: a step refused for want of memory for
     * it leaves the gradients as they were (and data-parallel, nothing may run out once the
     * ranks agree on the step) */
    CMLP_TRY(cmlp_optim_prepare(t->optim));
    /* no zeroing: the first micro-batch writes the gradients, the others add to them */
    cmlp_gw w = {{(float)(1.0 / (double)n_all)}, true};
    /* with a scaler, the weight comes from the current scale, and the loss's launch starts the
     * inf/NaN check clean (each micro-batch's, and a retry's: unscale alone sets it, after them) */
    if (t->scaler.enabled) w.loss = (cmlp_loss_weight){0.0f, &ds->scale, (double)n_all, &ds->found_inf};
    for (int64_t off = 0; off < k; off += t->micro) {
        int64_t kk = k - off < t->micro ? k - off : t->micro;
        w.fresh = off == 0;
        w.solo = kk == k;
        CMLP_TRY(cmlp_model_fb(m, xy, idx ? idx + off : NULL, start + off, kk, w, t->cfg.label_smoothing, t->cfg.amp,
                               t->cfg.recompute, &ds->loss));
    }
    if (k > 0) return CMLP_OK;
    /* a rank with no sample in a short last step adds zeros to the sum */
    CMLP_TRY(b->fill_zero(ctx, m->grads, (size_t)m->nparams * sizeof(float)));
    return t->scaler.enabled ? b->fill_zero(ctx, &ds->found_inf, sizeof ds->found_inf) : CMLP_OK;
}

/* torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm) on the device: the L2 norm of the
 * step's gradients, counted in ds (a finite one) and applied by the clipping pass. */
static cmlp_status clip_grads(cmlp_trainer *t, cmlp_dscalars *ds) {
    cmlp_model *m = t->model;
    const cmlp_backend_i *b = m->dev->backend;
    void *ctx = m->dev->bctx;
    CMLP_TRY(b->grad_norm(ctx, m->grads, m->nparams, 2.0, &ds->grad_norm, ds->norm_part, &ds->norm_blocks));
    return b->clip_by_norm(ctx, m->grads, m->nparams, &ds->grad_norm, (float)t->cfg.max_grad_norm, &ds->norm_sum,
                           &ds->norm_steps);
}

/* Where rank r of `parts` keeps the scratch of clip_part: `parts` floats of the gradients outside
 * its part [r * chunk, (r + 1) * chunk) (which the reduce-scatter leaves undefined), before it or
 * after it; -1 where its part is empty or there is no room. */
static int64_t norm_scratch(int64_t n, int64_t chunk, int parts, int r) {
    const int64_t lo = r * chunk, hi = lo + chunk < n ? lo + chunk : n;
    if (lo >= n) return -1;
    if (lo >= parts) return 0;
    return n - hi >= parts ? hi : -1;
}

/* Clipping with every rank's part of the summed gradients on its owner only: every part's L2
 * norm (a float) into the scratch, the parts' norms gathered (a collective of one float a rank)
 * and the total the L2 norm of them, in double and in rank order, so the same bits on every
 * rank; torch's clip_grad_norm_ takes the norm of its tensors' norms so too. Each rank scales
 * its part. */
static cmlp_status clip_part(cmlp_trainer *t, cmlp_dscalars *ds, int64_t lo, int64_t hi, int64_t chunk, int parts) {
    cmlp_model *m = t->model;
    const cmlp_backend_i *b = m->dev->backend;
    void *ctx = m->dev->bctx;
    const int r = (int)(lo / chunk);
    float *scratch = m->grads + norm_scratch(m->nparams, chunk, parts, r);
    CMLP_TRY(b->grad_norm(ctx, m->grads + lo, hi - lo, 2.0, scratch + r, ds->norm_part, &ds->norm_blocks));
    CMLP_TRY(m->dev->device.type == CMLP_DEVICE_CPU ? cmlp_dist_all_gather(scratch, parts, 1, CMLP_COMM_F32)
                                                     : b->comm_all_gather(ctx, t->dcomm, scratch, parts, 1));
    CMLP_TRY(b->grad_norm(ctx, scratch, parts, 2.0, &ds->grad_norm, ds->norm_part, &ds->norm_blocks));
    return b->clip_by_norm(ctx, m->grads + lo, hi - lo, &ds->grad_norm, (float)t->cfg.max_grad_norm, &ds->norm_sum,
                           &ds->norm_steps);
}

/* Whether clip_part can serve: every rank's part holds gradients and has room for the scratch
 * (the same answer on every rank). */
static bool parts_clip(int64_t n, int64_t chunk, int parts) {
    for (int r = 0; r < parts; r++)
        if (norm_scratch(n, chunk, parts, r) < 0) return false;
    return true;
}

/* The update of a step of n_all samples whose gradients are in: summed over the ranks, then with
 * a loss scaler unscaled and checked once, skipped or taken, on the device.
 * With a sharded optimizer each rank updates its part of the parameters only, so it needs only
 * its part of the summed gradients: a reduce-scatter instead of the all-reduce (half the
 * traffic), which leaves the other parts of its gradients undefined; the ranks then share their
 * verdicts on inf/NaN, and with clipping their parts' norms (clip_part). */
static cmlp_status step_update(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy, int64_t n_all) {
    cmlp_model *m = t->model;
    const cmlp_backend_i *b = m->dev->backend;
    void *ctx = m->dev->bctx;
    const bool clip = t->cfg.max_grad_norm > 0.0, cpu = m->dev->device.type == CMLP_DEVICE_CPU;
    int64_t lo = 0, hi = m->nparams, chunk = 0;
    const int parts = cmlp_optim_shards(t->optim, &lo, &hi, &chunk);
    const bool scatter = t->dist && (cpu || (b->comm_reduce_scatter && (!clip || b->comm_all_gather))) &&
                         parts > 0 && (!clip || parts_clip(m->nparams, chunk, parts));
    if (!scatter) lo = 0, hi = m->nparams;
    if (t->dist && cpu)
        CMLP_TRY(scatter ? cmlp_dist_reduce_scatter(m->grads, m->nparams, chunk)
                         : cmlp_dist_all_reduce(m->grads, m->nparams, CMLP_COMM_F32, CMLP_REDUCE_SUM));
    else if (t->dist) /* on the device's stream, in a capture too */
        CMLP_TRY(scatter ? b->comm_reduce_scatter(ctx, t->dcomm, m->grads, m->nparams, chunk)
                         : b->comm_all_reduce(ctx, t->dcomm, m->grads, m->nparams));
    if (!t->scaler.enabled && !device_steps(t)) {
        if (clip) CMLP_TRY(scatter ? clip_part(t, ds, lo, hi, chunk, parts) : clip_grads(t, ds));
        return cmlp_optim_step_summed_at(t->optim, t->scales_row, t->momenta_row);
    }
    const float *found_inf = NULL;
    if (t->scaler.enabled) {
        if (hi > lo) CMLP_TRY(b->unscale(ctx, m->grads + lo, hi - lo, 0.0f, &ds->scale, &ds->found_inf));
        if (scatter) /* every rank checked its part: all skip or take the step together */
            CMLP_TRY(cpu ? cmlp_dist_all_reduce(&ds->found_inf, 1, CMLP_COMM_F32, CMLP_REDUCE_MAX)
                         : b->comm_all_reduce(ctx, t->dcomm, &ds->found_inf, 1));
        found_inf = &ds->found_inf;
    }
    if (clip) CMLP_TRY(scatter ? clip_part(t, ds, lo, hi, chunk, parts) : clip_grads(t, ds));
    /* the position moves with the optimizer's step count (one kernel): after the optimizer's
     * state exists, so a step retried after running out of memory reads the same samples */
    /* the loss scale moves in the same launch, on the same verdict (after this step's unscale,
     * before the next step's gradient weight) */
    const cmlp_scaler_state *s = &t->scaler;
    cmlp_scale_step scale = {&ds->scale,       &ds->growth_tracker, &ds->skipped, s->growth_factor,
                             s->backoff_factor, (int32_t)s->growth_interval};
    return cmlp_optim_step_device(t->optim, found_inf, &ds->step, ds->coef, ds->rates,
                                  t->rates ? &ds->lr_next : NULL, xy->pos ? &ds->pos : NULL, n_all,
                                  s->enabled ? &scale : NULL, t->step_scales, t->dcomm);
}

/* One optimizer step as a capture records it: this rank's k samples of n_all (see step_grads),
 * then the update (the ranks agree on it after the capture: see graph_step). */
static cmlp_status effective_step(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy, const int64_t *idx,
                                  int64_t start, int64_t k, int64_t n_all) {
    CMLP_TRY(step_grads(t, ds, xy, idx, start, k, n_all));
    return step_update(t, ds, xy, n_all);
}

static int optimizer_buffers(const cmlp_trainer *t) { return cmlp_optim_buffers_planned(t->optim); }

static int64_t effective_batch(const cmlp_trainer *t) { return t->cfg.batch_size * t->cfg.accumulation_steps; }

/* Even one sample did not fit: say so, with what one sample needs. */
static cmlp_status one_sample_oom(cmlp_trainer *t, const char *cause) {
    char why[1200];
    snprintf(why, sizeof why, "%s", cause);
    char *advice = strstr(why, " Try micro-batches"); /* tried: the allocator's advice does not apply */
    if (advice) *advice = '\0';
    cmlp_model *m = t->model;
    cmlp_plan p;
    char b[8][32];
    int solo = effective_batch(t) == 1; /* steps of one sample, or accumulating micro-batches of one */
    int shards = cmlp_optim_shards(t->optim, NULL, NULL, NULL);
    if (cmlp_plan_compute(m->sizes, m->nlayers + 1, 1, optimizer_buffers(t), shards ? shards : 1,
                          cmlp_optim_num_parts(t->optim), t->cfg.amp, t->cfg.recompute, t->scaler.enabled, solo, 0, 0,
                          0, 0, 0, 1, m->dev->device, &p) != CMLP_OK)
        return CMLP_FAIL(CMLP_ERR_OOM, "even a micro-batch of 1 sample does not fit: %s", why);
    int64_t v[8] = {p.parameters, p.gradients, p.optimizer_state, p.half_weights, p.activations, p.workspace,
                    p.peak_allocated, p.peak_reserved};
    for (int i = 0; i < 8; i++) cmlp_format_bytes(b[i], sizeof b[i], v[i]);
    char shard_hint[200] = ""; /* data-parallel, the state need not be whole on every rank */
    if (t->dist && !shards && p.optimizer_state > 0 && cmlp_dist_size() > 1)
        snprintf(shard_hint, sizeof shard_hint,
                 " The optimizer state could be sharded over the %d ranks, 1/%d of it on each "
                 "(cmlp.distributed.optim.ZeroRedundancyOptimizer).",
                 cmlp_dist_size(), cmlp_dist_size());
    char held_note[300] = ""; /* what no micro-batch can make smaller */
    cmlp_memory_stats s;
    cmlp_allocator_stats(m->dev->alloc, &s);
    int64_t held = p.parameters + p.gradients + p.optimizer_state + p.half_weights;
    if (s.limit >= 0 && held > s.limit) {
        char hb[32], lb[32];
        cmlp_format_bytes(hb, sizeof hb, held);
        cmlp_format_bytes(lb, sizeof lb, s.limit);
        snprintf(held_note, sizeof held_note,
                 " The parameters, gradients and optimizer state alone take %s, more than the memory limit of %s: "
                 "only a larger limit, a smaller model or less optimizer state (SGD without momentum keeps "
                 "none) can fit.",
                 hb, lb);
    }
    return CMLP_FAIL(CMLP_ERR_OOM,
                     "out of memory even with a micro-batch of 1 sample. The plan for one sample: parameters %s, "
                     "gradients %s, optimizer state %s, half-precision weights %s, activations %s, workspace %s; "
                     "peak %s allocated, %s reserved (in whole segments).%s%s The last failure: %s",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], held_note, shard_hint, why);
}

/* The device scalars of a call (cmlp_dscalars): written when the call begins, read when it
 * ends. In between, every step runs on the device without the host waiting: the loss adds up
 * there, and under loss scaling the check, the skip, the optimizer's step count and the scale
 * update happen there too. */
static cmlp_status run_begin(cmlp_trainer *t, cmlp_dscalars **out, const double *lr, const double *momentum,
                             const double *scales, const double *part_momenta, int64_t nlr) {
    cmlp_model *m = t->model;
    CMLP_TRY(cmlp_model_scalars(m, out));
    /* the param groups' scales and momenta of each step, where a step on the device reads them */
    if (scales && lr) CMLP_TRY(cmlp_optim_load_step_scales(t->optim, scales, part_momenta, nlr));
    t->step_scales = scales && lr;
    cmlp_dscalars h = {0};
    h.step = cmlp_optim_get_step(t->optim);
    /* the rates and momenta of the call's steps: the optimizer's, or one each (a step on the device
     * reads them there, so one that changes does not change what a capture baked in) */
    t->rates = lr != NULL;
    const double own = cmlp_optim_get_momentum(t->optim);
    for (int64_t k = 0; k < (lr ? nlr : 1); k++) {
        h.rates[2 * k] = lr ? lr[k] : cmlp_optim_get_lr(t->optim);
        h.rates[2 * k + 1] = momentum ? momentum[k] : own;
    }
    h.scale = (float)t->scaler.scale;
    h.growth_tracker = (int32_t)t->scaler.growth_tracker;
    h.pos = t->pos;
    return m->dev->backend->copy_h2d(m->dev->bctx, *out, &h, sizeof h);
}

/* The micro-batch that tries half as many micro-batches of a step of `rows` (this rank's), as
 * equal as they come: 8000 rows in 3 of 2667 grow to 2 of 4000, not to 5334 and 2666; at most
 * the target. Where the step is one micro-batch already, it doubles. */
static int64_t grown_micro(int64_t micro, int64_t target, int64_t rows) {
    const int64_t n = rows > micro ? (rows + micro - 1) / micro : 1;
    const int64_t fewer = (n + 1) / 2; /* < n for n >= 2, so the result is > micro */
    const int64_t m = n > 1 ? (rows + fewer - 1) / fewer : micro * 2;
    return m < target ? m : target;
}

/* The micro-batch that tries twice as many micro-batches of a step of `rows`, as equal as they
 * come: 8000 rows in 3 of 2667 shrink to 6 of 1334, not to 7 of 1333 (the last of 2 rows); a
 * micro-batch larger than the step, to half the step. Below micro for micro >= 2. */
static int64_t shrunk_micro(int64_t micro, int64_t rows) {
    const int64_t n = rows > micro ? (rows + micro - 1) / micro : 1; /* <= rows / 2 + 1: 2n cannot overflow */
    const int64_t m = (rows + 2 * n - 1) / (2 * n);
    return m >= 1 && m < micro ? m : micro / 2;
}

/* effective_step, surviving out-of-memory by smaller micro-batches when allowed. A failed
 * attempt changed nothing that matters: the retry's first micro-batch writes the gradients
 * afresh, the loss it added is taken back, and the optimizer and the scaler move only at the end
 * of a step (a step fails before). Data-parallel, a rank retries its share alone, before the
 * ranks agree on the step; once they have, nothing is retried. */
static cmlp_status robust_step(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy, const int64_t *idx,
                               int64_t start, int64_t k, int64_t n_all) {
    const int64_t micro_before = t->micro;
    /* micro-batches are sized for a whole step of this rank's, not for a short last one */
    const int64_t whole = t->whole_rows > k ? t->whole_rows : k;
    const cmlp_backend_i *b = t->model->dev->backend;
    void *ctx = t->model->dev->bctx;
    if (t->cfg.auto_microbatch) /* only a retry takes the loss back */
        CMLP_TRY(b->copy_d2d(ctx, &ds->loss_mark, &ds->loss, sizeof ds->loss));
    for (;;) {
        cmlp_status st = step_grads(t, ds, xy, idx, start, k, n_all);
        bool agreed = false;
        if (st == CMLP_OK && t->dist) {
            st = cmlp_dist_agree(CMLP_OK);
            agreed = true;
        }
        if (st == CMLP_OK) st = step_update(t, ds, xy, n_all);
        if (st == CMLP_OK) {
            if (t->micro < t->target_micro && ++t->good_steps >= t->cfg.grow_interval) {
                t->grown_from = t->micro;
                t->micro = grown_micro(t->micro, t->target_micro, whole);
                t->good_steps = 0;
            }
            return CMLP_OK;
        }
        if (st != CMLP_ERR_OOM || !t->cfg.auto_microbatch || agreed)
            return t->dist && !agreed ? cmlp_dist_agree(st) : st;
        CMLP_TRY(b->copy_d2d(ctx, &ds->loss, &ds->loss_mark, sizeof ds->loss));
        cmlp_model_release_workspace(t->model);
        cmlp_allocator_empty_cache(t->model->dev->alloc);
        if (t->micro == 1) {
            t->micro = micro_before; /* nothing worked: the next step starts where this one did */
            st = one_sample_oom(t, cmlp_last_error());
            return t->dist ? cmlp_dist_agree(st) : st;
        }
        /* back to the size that worked before the last growth (2667, not 4000 / 2), else
         * twice as many micro-batches */
        t->micro = t->grown_from && t->grown_from < t->micro ? t->grown_from : shrunk_micro(t->micro, whole);
        t->good_steps = t->grown_from = 0;
        t->oom_retries++;
    }
}

static void make_key(const cmlp_trainer *t, const cmlp_data *xy, const int64_t *idx, int64_t start, int64_t n,
                     int64_t n_all, step_key *k) {
    const cmlp_model *m = t->model;
    memset(k, 0, sizeof *k); /* the padding too: keys are compared with memcmp */
    k->model = m;
    k->dev = m->dev;
    k->x = xy->x;
    k->y = xy->y;
    k->order = idx;
    k->ws = m->ws.block;
    k->wsa = m->wsa.block;
    k->wsr = m->wsr.block;
    k->ws_rows = m->ws.rows;
    k->wsa_rows = m->wsa.rows;
    k->wsa_chunk = m->wsa.chunk;
    k->wsa_recompute = m->wsa.recompute;
    k->ws_compact = m->ws.compact;
    k->ws_forward = m->ws.forward;
    k->wsa_compact = m->wsa.compact;
    k->wsr_rows = m->wsr.rows;
    k->x_dtype = (int)xy->x_dtype;
    k->mean = xy->mean;
    k->std = xy->std;
    k->params = m->params;
    k->grads = m->grads;
    k->params_h = m->params_h;
    k->n = n;
    k->n_all = n_all;
    k->start = start;
    k->micro = t->micro;
    k->optim_version = cmlp_optim_version(t->optim);
    k->scaled = t->scaler.enabled;
    if (t->scaler.enabled) {
        k->growth_factor = t->scaler.growth_factor;
        k->backoff_factor = t->scaler.backoff_factor;
        k->growth_interval = t->scaler.growth_interval;
    }
    k->smoothing = t->cfg.label_smoothing;
    k->amp = (int)t->cfg.amp;
    k->recompute = t->cfg.recompute;
    k->max_grad_norm = t->cfg.max_grad_norm;
    k->rates = t->rates;
    k->step_scales = t->step_scales;
}

/* How a step runs: eagerly, captured as a graph (then launched), or as a replay of the capture. */
enum { PATH_EAGER = 0, PATH_CAPTURE = 1, PATH_REPLAY = 2 };

/* A step on a device with graphs. A full step on device data (`eligible`) runs as a graph: the
 * first step with a new key runs eagerly (it makes the workspace, the optimizer state and the
 * GEMM plans), the next one with that key is captured, and the ones after it replay the capture.
 * A capture that fails turns graphs off for this trainer and the step runs eagerly.
 * Data-parallel, every rank must take the same path (NCCL requires an operation to be captured
 * on all ranks or on none, and a replay to be of captures made together): each rank says which
 * it could take, and all take the least of them (a rank that halved its micro-batch, or has no
 * device copy of the data, makes every rank run eagerly; a rank that could replay captures
 * again when another can only capture). A capture that failed on any rank turns graphs off on
 * all. */
static cmlp_status graph_step(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy, const int64_t *idx,
                              int64_t start, int64_t n, int64_t n_all, bool eligible) {
    cmlp_device_ctx *dev = t->model->dev;
    const cmlp_backend_i *b = dev->backend;
    step_key key;
    make_key(t, xy, idx, start, n, n_all, &key);
    /* a step whose optimizer state is still to be made (SGD's momentum buffer, when a momentum
     * that was 0 no longer is) runs eagerly: a replay would not have it, a capture cannot allocate */
    bool warm = t->warm && memcmp(&key, &t->warm_key, sizeof key) == 0 && !cmlp_optim_state_missing(t->optim);
    int64_t path = !eligible || cmlp_optim_state_missing(t->optim) ? PATH_EAGER
                   : t->graph && t->graph_dev == dev && memcmp(&key, &t->graph_key, sizeof key) == 0 ? PATH_REPLAY
                   : warm ? PATH_CAPTURE
                          : PATH_EAGER;
    if (t->dist) CMLP_TRY(cmlp_dist_all_reduce(&path, 1, CMLP_COMM_I64, CMLP_REDUCE_MIN));
    if (path == PATH_REPLAY) return b->graph_launch(dev->bctx, t->graph);
    if (path == PATH_EAGER) {
        CMLP_TRY(robust_step(t, ds, xy, idx, start, n, n_all));
        if (eligible && !warm) {
            make_key(t, xy, idx, start, n, n_all, &t->warm_key); /* after the step: what it allocated is in */
            t->warm = true;
        }
        return CMLP_OK;
    }
    drop_graph(t);
    cmlp_status st = b->capture_begin(dev->bctx);
    void *g = NULL;
    if (st == CMLP_OK) {
        cmlp_allocator_capturing(dev->alloc, true); /* cached memory only: nothing may allocate */
        st = effective_step(t, ds, xy, idx, start, n, n_all);
        cmlp_allocator_capturing(dev->alloc, false);
        cmlp_status end = b->capture_end(dev->bctx, &g);
        if (st == CMLP_OK) st = end;
    }
    if (t->dist) st = cmlp_dist_agree(st); /* every rank captured this step: one failed, all run it eagerly */
    if (st == CMLP_OK) {
        t->graph = g;
        t->graph_dev = dev;
        t->graph_key = key;
        return b->graph_launch(dev->bctx, g);
    }
    if (g) b->graph_free(dev->bctx, g);
    t->graphs_off = true; /* nothing captured ran: the step runs eagerly */
    return robust_step(t, ds, xy, idx, start, n, n_all);
}

/* Data-parallel, every rank must run the same loop: the values each gives must be equal. */
#define MAX_COMPARED 20
static cmlp_status same_on_every_rank(const char *const *names, const int64_t *v, int n) {
    int64_t hi[MAX_COMPARED], lo[MAX_COMPARED];
    if (n > MAX_COMPARED) return CMLP_FAIL(CMLP_ERR_INTERNAL, "%d values to compare", n);
    for (int i = 0; i < n; i++) {
        hi[i] = v[i];
        lo[i] = ~v[i]; /* the maximum of ~v is ~(the minimum of v), for every v */
    }
    CMLP_TRY(cmlp_dist_all_reduce(hi, n, CMLP_COMM_I64, CMLP_REDUCE_MAX));
    CMLP_TRY(cmlp_dist_all_reduce(lo, n, CMLP_COMM_I64, CMLP_REDUCE_MAX));
    for (int i = 0; i < n; i++)
        if (hi[i] != ~lo[i])
            return CMLP_FAIL(CMLP_ERR_INVALID,
                             "the ranks of the process group differ in %s (from %lld to %lld): every rank must make "
                             "the same calls with the same settings on the same data set",
                             names[i], (long long)~lo[i], (long long)hi[i]);
    return CMLP_OK;
}

static int64_t bits_of(double v) {
    int64_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

/* The calls whose collectives must pair up, and where they come from. */
enum { CALL_TRAINER = 1, CALL_EPOCH = 2, CALL_STEP = 3 };

/* The settings that decide which samples a step takes and how it is computed, the call being
 * made (an epoch on one rank and a step on another would mix), and for a call with data its
 * normalisation (xy, or NULL). */
static cmlp_status same_settings(const cmlp_trainer *t, int call, const cmlp_data *xy) {
    static const char *const names[] = {"the call (1 Trainer, 2 fit's epoch, 3 step)",
                                        "batch_size",
                                        "accumulation_steps",
                                        "shuffle",
                                        "seed",
                                        "amp",
                                        "label_smoothing (its bits)",
                                        "the loss scaler (on, scale, growth and backoff factors, interval, tracker)",
                                        "the model's layer sizes",
                                        "the optimizer (kind, settings, step count)",
                                        "the kind of device the model is on",
                                        "the epoch count",
                                        "the normalisation's mean (its bits)",
                                        "the normalisation's std (its bits)",
                                        "max_grad_norm (its bits)",
                                        "fit's epochs",
                                        "fit's validation samples (-1: none)",
                                        "fit's schedule per step (scheduler_interval='step')"};
    const cmlp_train_config *c = &t->cfg;
    const cmlp_model *m = t->model;
    const cmlp_scaler_state *sc = &t->scaler;
    uint64_t scaler = 0, layers = (uint64_t)m->nlayers; /* hashes (unsigned: wrapping is defined) */
    if (sc->enabled)
        scaler = (uint64_t)bits_of(sc->scale) ^ (uint64_t)bits_of(sc->growth_factor) * 3u ^
                 (uint64_t)bits_of(sc->backoff_factor) * 5u ^ (uint64_t)sc->growth_interval * 7u ^
                 (uint64_t)sc->growth_tracker * 11u ^ 1u;
    for (int i = 0; i <= m->nlayers; i++) layers = layers * 1000003u + (uint64_t)m->sizes[i];
    int64_t v[18] = {call,
                     c->batch_size,
                     c->accumulation_steps,
                     c->shuffle,
                     (int64_t)c->seed,
                     (int64_t)c->amp,
                     bits_of(c->label_smoothing),
                     (int64_t)scaler,
                     (int64_t)layers,
                     (int64_t)cmlp_optim_fingerprint(t->optim),
                     (int64_t)m->dev->device.type,
                     t->epoch,
                     xy ? bits_of(xy->mean) : 0,
                     xy ? bits_of(xy->std) : 0,
                     bits_of(c->max_grad_norm),
                     call == CALL_EPOCH ? t->fit_call[0] : 0,
                     call == CALL_EPOCH ? t->fit_call[1] : 0,
                     call == CALL_EPOCH ? t->fit_call[2] : 0};
    return same_on_every_rank(names, v, 18);
}

/* Off the host, the model's device joins the group's device collectives (every rank at once:
 * after same_settings, so that all are on devices of one kind). */
static cmlp_status join_device_group(cmlp_trainer *t) {
    cmlp_device_ctx *dev = t->model->dev;
    if (dev->device.type == CMLP_DEVICE_CPU) return CMLP_OK;
    void *comm;
    CMLP_TRY(cmlp_dist_device_comm(dev, &comm)); /* collective: every rank asks every time */
    if (t->dcomm != comm) drop_graph(t); /* a capture holds the communicator it was made with */
    t->dcomm = comm;
    t->dcomm_dev = dev;
    t->dgen = cmlp_dist_generation();
    return CMLP_OK;
}

/* A data-parallel step takes the effective batch on every rank: the group's samples must count. */
static cmlp_status group_batch_fits(const cmlp_trainer *t) {
    if (effective_batch(t) <= CMLP_MAX_STEP_SAMPLES / group_size(t)) return CMLP_OK;
    return CMLP_FAIL(CMLP_ERR_INVALID,
                     "batch_size x accumulation_steps = %lld on each of %lld ranks is over 2**62 samples a step",
                     (long long)effective_batch(t), (long long)group_size(t));
}

cmlp_status cmlp_trainer_set_distributed(cmlp_trainer *t, int on) {
    if (!t) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (on && !cmlp_dist_initialized())
        return CMLP_FAIL(CMLP_ERR_STATE, "no process group: call cmlp.distributed.init_process_group() first");
    drop_graph(t);
    t->warm = false;
    t->dist = false;
    t->dcomm = NULL;
    t->dcomm_dev = NULL;
    if (!on) return CMLP_OK;
    t->dist = true; /* collectives from here: every rank makes its trainer data-parallel */
    cmlp_status st = same_settings(t, CALL_TRAINER, NULL);
    if (st == CMLP_OK) st = group_batch_fits(t); /* the same on every rank, as the settings are */
    if (st == CMLP_OK) st = join_device_group(t);
    if (st != CMLP_OK) t->dist = false;
    return st;
}

/* Data-parallel, the group is still there (and the trainer's device collectives are its
 * model's device's: where the model moved, epoch_begin and step join the group again). */
static cmlp_status check_group(cmlp_trainer *t, bool joined) {
    if (!t->dist && cmlp_optim_shards(t->optim, NULL, NULL, NULL))
        return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer's state is sharded over the process group: it steps from "
                                         "gradients summed over the ranks, in a data-parallel trainer");
    if (!t->dist) return CMLP_OK;
    if (!cmlp_dist_initialized())
        return CMLP_FAIL(CMLP_ERR_STATE, "this trainer is data-parallel, and the process group was destroyed");
    if (t->dcomm && t->dgen != cmlp_dist_generation()) { /* the group was made again: its old communicator is gone */
        if (joined) return CMLP_FAIL(CMLP_ERR_STATE, "the process group was made again during the epoch");
        drop_graph(t);
        t->dcomm = NULL;
        t->dcomm_dev = NULL;
    }
    if (joined && t->model->dev->device.type != CMLP_DEVICE_CPU && t->dcomm_dev != t->model->dev)
        return CMLP_FAIL(CMLP_ERR_STATE, "the model moved to another device during the epoch");
    return CMLP_OK;
}

/* An fp32 trainer has no use for the half-precision weights an amp run left (each step would
 * refresh them, and they hold memory): they go, and come back when a step needs them. */
static void drop_half_weights(cmlp_trainer *t) {
    if (t->cfg.amp == CMLP_AMP_NONE) cmlp_amp_free(t->model);
}

cmlp_status cmlp_trainer_step(cmlp_trainer *t, const cmlp_data *xy, double *loss_mean) {
    if (!t || !loss_mean) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    drop_half_weights(t);
    CMLP_TRY(check_group(t, false));
    cmlp_status st = cmlp_data_validate(t->model, xy, true);
    int64_t n_all = xy->n;
    if (t->dist) { /* each rank's own batch: the step is all of them */
        if (st == CMLP_OK && xy->n > CMLP_MAX_STEP_SAMPLES / cmlp_dist_size())
            st = CMLP_FAIL(CMLP_ERR_INVALID, "a batch of %lld samples on each of %d ranks is more than 2**62",
                           (long long)xy->n, cmlp_dist_size());
        CMLP_TRY(cmlp_dist_agree(st));
        CMLP_TRY(same_settings(t, CALL_STEP, xy));
        CMLP_TRY(join_device_group(t));
        CMLP_TRY(cmlp_dist_all_reduce(&n_all, 1, CMLP_COMM_I64, CMLP_REDUCE_SUM));
        if (n_all > CMLP_MAX_STEP_SAMPLES)
            return CMLP_FAIL(CMLP_ERR_INVALID, "the ranks' batches add up to %lld samples, more than 2**62",
                             (long long)n_all);
    }
    CMLP_TRY(st);
    cmlp_dscalars *ds;
    st = run_begin(t, &ds, NULL, NULL, NULL, NULL, 0); /* it may allocate: data-parallel, the ranks agree on it */
    CMLP_TRY(t->dist ? cmlp_dist_agree(st) : st);
    const bool had_state = cmlp_optim_has_state(t->optim);
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    t->whole_rows = xy->n;
    st = robust_step(t, ds, xy, NULL, 0, xy->n, n_all);
    cmlp_fpenv_leave(&fe);
    if (st != CMLP_OK) cmlp_optim_drop_unused(t->optim, !had_state); /* the memory as it was */
    double loss = 0.0, norm_sum;
    int64_t skipped, norm_steps;
    cmlp_status end = run_end(t, ds, st == CMLP_OK, &loss, &skipped, &norm_sum, &norm_steps);
    if (st == CMLP_OK) st = end;
    if (st == CMLP_OK) *loss_mean = loss / (double)n_all;
    return st;
}

/* The device copy of the previous epoch serves this one: the same data set, unchanged (the
 * caller's word), on the same device; the new order goes into the same buffer, so a captured
 * step stays valid. */
static bool keep_epoch(cmlp_trainer *t, const cmlp_data *xy) {
    if (!t->d_x || t->d_alloc != t->model->dev->alloc || xy->x != t->data.x || xy->y != t->data.y ||
        xy->n != t->data.n || xy->x_dtype != t->data.x_dtype || (t->cfg.shuffle && !t->d_order))
        return false;
    if (!t->cfg.shuffle) return true;
    cmlp_device_ctx *dev = t->model->dev;
    return dev->backend->copy_h2d(dev->bctx, t->d_order, t->order, (size_t)xy->n * sizeof(int64_t)) == CMLP_OK;
}

cmlp_status cmlp_trainer_epoch_begin(cmlp_trainer *t, const cmlp_data *xy, int same_data, cmlp_epoch_state *st) {
    if (!t || !st) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    drop_half_weights(t);
    CMLP_TRY(check_group(t, false));
    cmlp_status valid = cmlp_data_validate(t->model, xy, true);
    if (t->dist) {
        CMLP_TRY(cmlp_dist_agree(valid));
        CMLP_TRY(same_settings(t, CALL_EPOCH, xy));
        CMLP_TRY(group_batch_fits(t));
        CMLP_TRY(join_device_group(t));
        static const char *const names[2] = {"the data set's sample count", "the data set's image type"};
        int64_t shape[2] = {xy->n, (int64_t)xy->x_dtype};
        CMLP_TRY(same_on_every_rank(names, shape, 2));
    }
    CMLP_TRY(valid);
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
    if (!(same_data && keep_epoch(t, xy))) {
        drop_device_data(t);
        upload_epoch(t, xy);
    }
    t->data = *xy;
    t->epoch_open = true;
    t->epoch++;
    t->pos = 0;
    int64_t eb = effective_batch(t) * group_size(t);
    *st = (cmlp_epoch_state){.total_steps = (n + eb - 1) / eb};
    return CMLP_OK;
}

/* epoch_run's steps; with lr (nlr rates), at most nlr of them, the k-th at rate lr[k] and, with
 * momentum, momentum[k]; with scales (and part_momenta), its parts' row k of them. */
static cmlp_status epoch_run(cmlp_trainer *t, int64_t max_steps, const double *lr, const double *momentum,
                             const double *scales, const double *part_momenta, int64_t nlr, cmlp_epoch_state *st) {
    if (!t || !st) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (!t->epoch_open) return CMLP_FAIL(CMLP_ERR_STATE, "epoch_run called before epoch_begin");
    CMLP_TRY(check_group(t, true));
    /* a step takes eb samples from the order, of which this rank computes its share */
    int64_t n = t->data.n, eb = effective_batch(t) * group_size(t), unused;
    const bool graphs = t->model->dev->backend->capture_begin != NULL; /* the device has graphs */
    share_of(t, n < eb ? n : eb, &unused, &t->whole_rows);
    cmlp_dscalars *ds;
    /* SGD's buffer, for a call whose parts' momenta step by step may have momentum the parts hold
     * now do not (its first step makes it) */
    bool ahead = false;
    for (int64_t i = 0; part_momenta && i < nlr * cmlp_optim_num_parts(t->optim); i++)
        ahead = ahead || (!isnan(part_momenta[i]) && part_momenta[i] != 0.0);
    cmlp_optim_expect_momentum(t->optim, ahead);
    /* run_begin may allocate: data-parallel, the ranks agree */
    cmlp_status s = run_begin(t, &ds, lr, momentum, scales, part_momenta, nlr);
    const int np = scales ? cmlp_optim_num_parts(t->optim) : 0;
    s = t->dist ? cmlp_dist_agree(s) : s;
    if (s != CMLP_OK) {
        cmlp_optim_expect_momentum(t->optim, false);
        return s;
    }
    const int64_t steps_before = st->steps;
    const bool had_state = cmlp_optim_has_state(t->optim);
    const double lr_before = cmlp_optim_get_lr(t->optim), momentum_before = cmlp_optim_get_momentum(t->optim);
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    for (int64_t done = 0; t->pos < n && (max_steps <= 0 || done < max_steps); done++) {
        /* a step on the host reads the optimizer's rate and momentum (validated by the caller) */
        if (lr) (void)cmlp_optim_set_lr(t->optim, lr[done]);
        if (momentum) (void)cmlp_optim_set_momentum(t->optim, momentum[done]);
        t->scales_row = np ? scales + done * np : NULL;
        t->momenta_row = np && part_momenta ? part_momenta + done * np : NULL;
        int64_t k = n - t->pos < eb ? n - t->pos : eb, off, mine;
        share_of(t, k, &off, &mine);
        const int64_t *idx = t->cfg.shuffle ? t->order + t->pos + off : NULL;
        if (t->d_x && t->d_alloc != t->model->dev->alloc) drop_device_data(t); /* the model moved */
        if (t->d_x) { /* the device copy, at the position kept on the device */
            cmlp_data on_dev = t->data;
            on_dev.x = t->d_x;
            on_dev.y = t->d_y;
            on_dev.on_device = 1;
            on_dev.pos = &ds->pos;
            idx = t->cfg.shuffle ? t->d_order + off : NULL;
            /* with automatic micro-batching, only while no growth back is pending (a replay
             * allocates nothing, so it cannot run out of memory) */
            bool eligible = k == eb && !t->graphs_off && t->micro == t->target_micro;
            if (graphs) /* data-parallel, every step: the ranks agree on the path */
                s = graph_step(t, ds, &on_dev, idx, off, mine, k, eligible);
            else
                s = robust_step(t, ds, &on_dev, idx, off, mine, k);
        } else if (graphs && t->dist) { /* no device copy here: eagerly, and so on every rank */
            s = graph_step(t, ds, &t->data, idx, t->pos + off, mine, k, false);
        } else {
            s = robust_step(t, ds, &t->data, idx, t->pos + off, mine, k);
        }
        if (s != CMLP_OK) break;
        t->pos += k;
        st->steps++;
        st->samples += k;
    }
    cmlp_fpenv_leave(&fe);
    cmlp_optim_expect_momentum(t->optim, false);
    if (s != CMLP_OK) cmlp_optim_drop_unused(t->optim, !had_state); /* no step used it */
    (void)cmlp_optim_set_lr(t->optim, lr_before);
    (void)cmlp_optim_set_momentum(t->optim, momentum_before);
    t->rates = false;
    t->step_scales = false;
    t->scales_row = t->momenta_row = NULL;
    double loss = 0.0, norm_sum = 0.0;
    int64_t skipped = 0, norm_steps = 0;
    cmlp_status end = run_end(t, ds, st->steps > steps_before, &loss, &skipped, &norm_sum, &norm_steps);
    if (s == CMLP_OK) s = end;
    if (end == CMLP_OK) {
        st->loss_sum += loss;
        st->skipped += skipped;
        st->grad_norm_sum += norm_sum;
        st->grad_norm_steps += norm_steps;
    }
    st->done = t->pos >= n;
    if (st->done) t->epoch_open = false; /* the device copy stays for a next epoch on the same data */
    return s;
}

void cmlp_trainer_get_microbatch_state(const cmlp_trainer *t, int64_t *size, int64_t *target,
                                       int64_t *good_steps, int64_t *grown_from) {
    *size = t->micro;
    *target = t->target_micro;
    *good_steps = t->good_steps;
    *grown_from = t->grown_from;
}

cmlp_status cmlp_trainer_set_microbatch_state(cmlp_trainer *t, int64_t size, int64_t target, int64_t good_steps,
                                              int64_t grown_from) {
    if (!t) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (target < 1 || target > CMLP_MAX_STEP_SAMPLES)
        return CMLP_FAIL(CMLP_ERR_INVALID, "the micro-batch target must be in [1, 2**62], got %lld", (long long)target);
    if (size < 1 || size > target)
        return CMLP_FAIL(CMLP_ERR_INVALID, "the micro-batch in use must be in [1, %lld] (its target), got %lld",
                         (long long)target, (long long)size);
    if (good_steps < 0)
        return CMLP_FAIL(CMLP_ERR_INVALID, "good_steps must be >= 0, got %lld", (long long)good_steps);
    if (grown_from < 0 || grown_from >= size)
        return CMLP_FAIL(CMLP_ERR_INVALID, "the micro-batch grown from must be 0 (none) or in [1, %lld), got %lld",
                         (long long)size, (long long)grown_from);
    t->micro = size;
    t->target_micro = target;
    t->good_steps = good_steps;
    t->grown_from = grown_from;
    return CMLP_OK;
}

int64_t cmlp_trainer_epochs(const cmlp_trainer *t) { return t ? t->epoch : 0; }

cmlp_status cmlp_trainer_set_epochs(cmlp_trainer *t, int64_t epochs) {
    if (!t) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (epochs < 0) return CMLP_FAIL(CMLP_ERR_INVALID, "epochs must be >= 0, got %lld", (long long)epochs);
    t->epoch_open = false; /* an epoch left unfinished (by a failure) is abandoned */
    t->epoch = epochs;
    return CMLP_OK;
}

cmlp_status cmlp_trainer_epoch_run(cmlp_trainer *t, int64_t max_steps, cmlp_epoch_state *st) {
    return epoch_run(t, max_steps, NULL, NULL, NULL, NULL, 0, st);
}

cmlp_status cmlp_trainer_epoch_run_rates(cmlp_trainer *t, const double *lr, const double *momentum,
                                         const double *scales, const double *part_momenta, int64_t n,
                                         cmlp_epoch_state *st) {
    if (!t || !lr) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (n < 1 || n > CMLP_MAX_RATES)
        return CMLP_FAIL(CMLP_ERR_INVALID, "a call takes 1 to %d rates, got %lld", CMLP_MAX_RATES, (long long)n);
    const bool adam = cmlp_optim_get_kind(t->optim) == CMLP_OPTIM_ADAM;
    for (int64_t k = 0; k < n; k++) {
        if (!(lr[k] >= 0.0 && lr[k] <= FLT_MAX))
            return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid learning rate %g for step %lld (must be >= 0 and finite in "
                                               "float32)", lr[k], (long long)k);
        CMLP_TRY(cmlp_optim_check_rate(t->optim, lr[k]));
        if (momentum && !(momentum[k] >= 0.0 && (adam ? momentum[k] < 1.0 : momentum[k] <= FLT_MAX)))
            return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid momentum %g for step %lld (must be %s)", momentum[k],
                             (long long)k, adam ? "in [0, 1), Adam's beta1" : ">= 0 and finite in float32");
    }
    const int np = cmlp_optim_num_parts(t->optim);
    if (scales && !np)
        return CMLP_FAIL(CMLP_ERR_INVALID, "per-step scales need an optimizer with parameter-group parts");
    if (part_momenta && !scales)
        return CMLP_FAIL(CMLP_ERR_INVALID, "per-step momenta of the parts come with their scales");
    for (int64_t k = 0; part_momenta && k < n; k++)
        for (int p = 0; p < np; p++) {
            const double v = part_momenta[k * np + p]; /* NaN: the part's own */
            if (!isnan(v) && !(v >= 0.0 && (adam ? v < 1.0 : v <= FLT_MAX)))
                return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid momentum %g of part %d for step %lld (must be %s)", v, p,
                                 (long long)k, adam ? "in [0, 1), Adam's beta1" : ">= 0 and finite in float32");
        }
    for (int64_t k = 0; scales && k < n; k++)
        for (int p = 0; p < np; p++) {
            const double v = scales[k * np + p];
            if (!(v >= 0.0 && v <= FLT_MAX && lr[k] * v <= FLT_MAX))
                return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid scale %g of part %d for step %lld (must be >= 0, its "
                                                   "rate finite in float32)", v, p, (long long)k);
        }
    return epoch_run(t, n, lr, momentum, scales, part_momenta, n, st);
}

void cmlp_trainer_set_host_data(cmlp_trainer *t, int on) {
    t->host_data = on != 0;
    if (!on) return;
    drop_graph(t); /* a capture reads the device copy */
    drop_device_data(t);
}

int cmlp_trainer_data_resident(const cmlp_trainer *t) { return t->d_x != NULL; }

int cmlp_trainer_optim_parts(const cmlp_trainer *t) { return cmlp_optim_num_parts(t->optim); }

void cmlp_trainer_release_data(cmlp_trainer *t) {
    if (!t) return;
    drop_device_data(t);
    memset(&t->data, 0, sizeof t->data);
    t->epoch_open = false;
}
