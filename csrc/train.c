/* train.c - the training loop: the trainer's settings, the seeded epoch shuffle, the epoch's
 * data set on the device, and the calls (a step, an epoch's steps) whose steps train_step.c
 * takes. A step that fails leaves parameters and optimizer alone. The state callers read and
 * set between calls is in train_state.c.
 */
#include "train_internal.h"
#include "comm.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

bool cmlp_train_device_steps(const cmlp_trainer *t) {
    return t->model->dev->device.type != CMLP_DEVICE_CPU || device_path_forced();
}

cmlp_status cmlp_trainer_init(cmlp_trainer **out, cmlp_model *m, cmlp_optim *o, const cmlp_train_config *c) {
    if (!out || !m || !o || !c) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (cmlp_optim_model(o) != m) return CMLP_FAIL(CMLP_ERR_STATE, "the optimizer steps another model");
    if (c->batch_size < 1) return CMLP_FAIL(CMLP_ERR_INVALID, "batch_size must be >= 1, got %lld", (long long)c->batch_size);
    if (c->accumulation_steps < 1)
        return CMLP_FAIL(CMLP_ERR_INVALID, "accumulation_steps must be >= 1, got %lld", (long long)c->accumulation_steps);
    /* the samples of one step, and the arithmetic on them, fit in int64 */
    if (c->batch_size > CMLP_MAX_STEP_SAMPLES / c->accumulation_steps)
        return CMLP_FAIL(CMLP_ERR_INVALID, "batch_size * accumulation_steps must be at most 2**62, got %lld * %lld",
                         (long long)c->batch_size, (long long)c->accumulation_steps);
    if (c->microbatch_size < 0 || c->microbatch_size > c->batch_size * c->accumulation_steps)
        return CMLP_FAIL(CMLP_ERR_INVALID, "microbatch_size must be 0 or in [1, batch_size * accumulation_steps = %lld], "
                         "got %lld", (long long)(c->batch_size * c->accumulation_steps), (long long)c->microbatch_size);
    if (c->grow_interval < 0)
        return CMLP_FAIL(CMLP_ERR_INVALID, "grow_interval must be >= 1 (0: 100), got %lld", (long long)c->grow_interval);
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
    cmlp_train_restart_growth(t);
    t->target_micro = t->micro;
    const char *graphs = getenv("CMLP_CUDA_GRAPHS"); /* "0": every step eagerly */
    /* (so does every step while caching is off: a step's frees would go to the device, which a
     * capture may not call; see the run loop) */
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
 * limit cannot take as allocated bytes is not tried, one that finds no room is not the
 * allocator's out-of-memory (no num_ooms), and one that failed is not tried again until the
 * trainer is told to (a new fit). */
static void upload_epoch(cmlp_trainer *t, const cmlp_data *xy) {
    cmlp_device_ctx *dev = t->model->dev;
    if (!cmlp_train_device_steps(t) || t->host_data) return;
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
    /* where it finds no room the batches come from host memory: not an out-of-memory */
    cmlp_status st = cmlp_allocator_try_malloc(dev->alloc, nx, "data set", &t->d_x);
    if (st == CMLP_OK) st = cmlp_allocator_try_malloc(dev->alloc, ny, "data set labels", (void **)&t->d_y);
    if (st == CMLP_OK && t->cfg.shuffle)
        st = cmlp_allocator_try_malloc(dev->alloc, no, "data set order", (void **)&t->d_order);
    if (st == CMLP_OK) st = b->copy_h2d(dev->bctx, t->d_x, xy->x, nx);
    if (st == CMLP_OK) st = b->copy_h2d(dev->bctx, t->d_y, xy->y, ny);
    if (st == CMLP_OK && t->cfg.shuffle) st = b->copy_h2d(dev->bctx, t->d_order, t->order, no);
    if (st != CMLP_OK) {
        drop_device_data(t);
        t->host_data = true;
    }
}

void cmlp_train_drop_graph(cmlp_trainer *t) {
    if (t->graph) t->graph_dev->backend->graph_free(t->graph_dev->bctx, t->graph);
    t->graph = NULL;
    t->graph_dev = NULL;
}

void cmlp_trainer_free(cmlp_trainer *t) {
    if (!t) return;
    cmlp_train_leave_group(t);
    cmlp_train_drop_graph(t);
    drop_device_data(t);
    free(t->order);
    free(t);
}

/* Reads the call's results back: the loss sum and the skipped steps are returned, the scaler
 * and the optimizer's step count taken over (after a failure too: they hold the steps done).
 * With carry (an epoch's call) the loss and norm sums are the epoch's so far (run_begin). */
static cmlp_status run_end(cmlp_trainer *t, cmlp_dscalars *ds, bool carry, bool stepped, double *loss_sum,
                           int64_t *skipped, double *norm_sum, int64_t *norm_steps) {
    cmlp_model *m = t->model;
    cmlp_dscalars h;
    CMLP_TRY(m->dev->backend->copy_d2h(m->dev->bctx, &h, ds, sizeof h));
    if (carry) {
        t->epoch_loss = h.loss;
        t->epoch_norms = h.norm_sum;
    }
    /* the group's loss (every rank skips the same steps: they check the same summed gradients) */
    if (t->dist) CMLP_TRY(cmlp_dist_all_reduce(&h.loss, 1, CMLP_COMM_F64, CMLP_REDUCE_SUM));
    if (t->scaler.enabled) {
        t->scaler.scale = h.scale;
        t->scaler.growth_tracker = h.growth_tracker;
    }
    if (t->scaler.enabled || cmlp_train_device_steps(t)) cmlp_optim_set_step(t->optim, h.step);
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


/* This rank's share of a step of n samples (all ranks): [*off, *off + *k), the first n % size
 * ranks one sample more. */
static void share_of(const cmlp_trainer *t, int64_t n, int64_t *off, int64_t *k) {
    int64_t w = cmlp_train_group_size(t), r = t->dist ? cmlp_dist_rank() : 0, q = n / w, rem = n % w;
    *off = r * q + (r < rem ? r : rem);
    *k = q + (r < rem);
}

/* The device scalars of a call (cmlp_dscalars): written when the call begins, read when it
 * ends. In between, every step runs on the device without the host waiting: the loss adds up
 * there, and under loss scaling the check, the skip, the optimizer's step count and the scale
 * update happen there too. */
static cmlp_status run_begin(cmlp_trainer *t, cmlp_dscalars **out, bool carry, const double *lr,
                             const double *momentum, const double *scales, const double *part_momenta, int64_t nlr) {
    cmlp_model *m = t->model;
    CMLP_TRY(cmlp_model_scalars(m, out));
    /* the param groups' scales and momenta of each step, where a step on the device reads them */
    if (scales && lr) CMLP_TRY(cmlp_optim_load_step_scales(t->optim, scales, part_momenta, nlr));
    t->step_scales = scales && lr;
    cmlp_dscalars h = {0};
    if (carry) {
        h.loss = t->epoch_loss;
        h.norm_sum = t->epoch_norms;
    }
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

/* An fp32 trainer has no use for the half-precision weights an amp run left (each step would
 * refresh them, and they hold memory): they go, and come back when a step needs them. */
static void drop_half_weights(cmlp_trainer *t) {
    if (t->cfg.amp == CMLP_AMP_NONE) cmlp_amp_free(t->model);
}

cmlp_status cmlp_trainer_step(cmlp_trainer *t, const cmlp_data *xy, double *loss_mean) {
    if (!t || !loss_mean) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    drop_half_weights(t);
    CMLP_TRY(cmlp_train_check_group(t, false));
    cmlp_train_mark_local(t);
    cmlp_status st = cmlp_data_validate(t->model, xy, true);
    int64_t n_all = st == CMLP_OK ? xy->n : 0;
    if (t->dist) { /* each rank's own batch: the step is all of them */
        if (st == CMLP_OK && xy->n > CMLP_MAX_STEP_SAMPLES / cmlp_dist_size())
            st = CMLP_FAIL(CMLP_ERR_INVALID, "a batch of %lld samples on each of %d ranks is more than 2**62",
                           (long long)xy->n, cmlp_dist_size());
        CMLP_TRY(cmlp_dist_agree(st));
        CMLP_TRY(cmlp_train_same_settings(t, CALL_STEP, xy));
        CMLP_TRY(cmlp_train_join_group(t));
        CMLP_TRY(cmlp_dist_all_reduce(&n_all, 1, CMLP_COMM_I64, CMLP_REDUCE_SUM));
        if (n_all > CMLP_MAX_STEP_SAMPLES)
            return CMLP_FAIL(CMLP_ERR_INVALID, "the ranks' batches add up to %lld samples, more than 2**62",
                             (long long)n_all);
    }
    CMLP_TRY(st);
    cmlp_dscalars *ds;
    st = run_begin(t, &ds, false, NULL, NULL, NULL, NULL, 0); /* it may allocate: data-parallel, the ranks agree */
    CMLP_TRY(t->dist ? cmlp_dist_agree(st) : st);
    const bool had_state = cmlp_optim_has_state(t->optim);
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    t->whole_rows = xy->n;
    st = cmlp_train_robust_step(t, ds, xy, NULL, 0, xy->n, n_all);
    cmlp_fpenv_leave(&fe);
    if (st != CMLP_OK) cmlp_optim_drop_unused(t->optim, !had_state); /* the memory as it was */
    double loss = 0.0, norm_sum;
    int64_t skipped, norm_steps;
    cmlp_status end = run_end(t, ds, false, st == CMLP_OK, &loss, &skipped, &norm_sum, &norm_steps);
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
    CMLP_TRY(cmlp_train_check_group(t, false));
    cmlp_train_mark_local(t);
    cmlp_status valid = cmlp_data_validate(t->model, xy, true);
    if (t->dist) {
        CMLP_TRY(cmlp_dist_agree(valid));
        CMLP_TRY(cmlp_train_same_settings(t, CALL_EPOCH, xy));
        CMLP_TRY(cmlp_train_group_batch_fits(t));
        CMLP_TRY(cmlp_train_join_group(t));
        CMLP_TRY(cmlp_train_same_data(t, xy));
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
    t->epoch_loss = t->epoch_norms = 0.0;
    t->epoch++;
    t->pos = 0;
    int64_t eb = cmlp_train_effective_batch(t) * cmlp_train_group_size(t);
    *st = (cmlp_epoch_state){.total_steps = (n + eb - 1) / eb};
    return CMLP_OK;
}

/* epoch_run's steps; with lr (nlr rates), at most nlr of them, the k-th at rate lr[k] and, with
 * momentum, momentum[k]; with scales (and part_momenta), its parts' row k of them. */
static cmlp_status epoch_run(cmlp_trainer *t, int64_t max_steps, const double *lr, const double *momentum,
                             const double *scales, const double *part_momenta, int64_t nlr, cmlp_epoch_state *st) {
    if (!t || !st) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (!t->epoch_open) return CMLP_FAIL(CMLP_ERR_STATE, "epoch_run called before epoch_begin");
    CMLP_TRY(cmlp_train_check_group(t, true));
    /* a step takes eb samples from the order, of which this rank computes its share */
    int64_t n = t->data.n, eb = cmlp_train_effective_batch(t) * cmlp_train_group_size(t), unused;
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
    cmlp_status s = run_begin(t, &ds, true, lr, momentum, scales, part_momenta, nlr);
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
        t->more_steps = t->pos + k < n && (max_steps <= 0 || done + 1 < max_steps);
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
            /* at a micro-batch below the one asked for too (after an out-of-memory retry, or a
             * limit's plan): a replay allocates nothing from the allocator, and its graph was
             * uploaded when made; a growth trial changes the step's key, so it runs eagerly, with
             * its retries, and a capture follows it at whatever size then holds */
            bool eligible = k == eb && !t->graphs_off && !t->capture_failed && !cmlp_memory_caching_disabled();
            if (graphs) /* data-parallel, every step: the ranks agree on the path */
                s = cmlp_train_graph_step(t, ds, &on_dev, idx, off, mine, k, eligible);
            else
                s = cmlp_train_robust_step(t, ds, &on_dev, idx, off, mine, k);
        } else if (graphs && t->dist) { /* no device copy here: eagerly, and so on every rank */
            s = cmlp_train_graph_step(t, ds, &t->data, idx, t->pos + off, mine, k, false);
        } else {
            s = cmlp_train_robust_step(t, ds, &t->data, idx, t->pos + off, mine, k);
        }
        if (s == CMLP_ERR_OOM && t->oom_at_one && t->d_x && !t->dist) {
            /* the step did not fit beside the device copy of the data set (a GPU nearly full):
             * the copy goes, and the step is taken again at its micro-batch with its batches
             * staged from host memory, as every later one of this fit */
            cmlp_train_drop_graph(t);
            drop_device_data(t);
            t->host_data = true;
            cmlp_allocator_empty_cache(t->model->dev->alloc);
            done--;
            continue;
        }
        if (s != CMLP_OK) break;
        t->pos += k;
        st->steps++;
        st->samples += k;
    }
    cmlp_fpenv_leave(&fe);
    t->more_steps = t->grads_zeroed = false; /* the gradients are the last step's (or a failed one's) */
    cmlp_optim_expect_momentum(t->optim, false);
    if (s != CMLP_OK) cmlp_optim_drop_unused(t->optim, !had_state); /* no step used it */
    (void)cmlp_optim_set_lr(t->optim, lr_before);
    (void)cmlp_optim_set_momentum(t->optim, momentum_before);
    t->rates = false;
    t->step_scales = false;
    t->scales_row = t->momenta_row = NULL;
    double loss = 0.0, norm_sum = 0.0;
    int64_t skipped = 0, norm_steps = 0;
    cmlp_status end = run_end(t, ds, true, st->steps > steps_before, &loss, &skipped, &norm_sum, &norm_steps);
    if (s == CMLP_OK) s = end;
    if (end == CMLP_OK) { /* the sums are the epoch's so far */
        st->loss_sum = loss;
        st->skipped += skipped;
        st->grad_norm_sum = norm_sum;
        st->grad_norm_steps += norm_steps;
    }
    st->done = t->pos >= n;
    if (st->done) t->epoch_open = false; /* the device copy stays for a next epoch on the same data */
    return s;
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
    cmlp_train_drop_graph(t); /* a capture reads the device copy */
    drop_device_data(t);
}

int cmlp_trainer_data_resident(const cmlp_trainer *t) { return t->d_x != NULL; }

cmlp_status cmlp_trainer_try_requests(cmlp_trainer *t, const int64_t *nbytes, int n, int drop_data, int *served) {
    if (!t || !served) return CMLP_FAIL(CMLP_ERR_INVALID, "trainer and served must not be NULL");
    size_t req[CMLP_TRY_REQUESTS];
    CMLP_TRY(cmlp_requests_check(nbytes, n, req));
    void *drop[3];
    int ndrop = 0;
    if (drop_data && t->d_alloc == t->model->dev->alloc) {
        if (t->d_x) drop[ndrop++] = t->d_x;
        if (t->d_y) drop[ndrop++] = t->d_y;
        if (t->d_order) drop[ndrop++] = t->d_order;
    }
    bool ok;
    CMLP_TRY(cmlp_plan_try(t->model->dev, req, n, drop, ndrop, &ok));
    *served = ok;
    return CMLP_OK;
}

void cmlp_trainer_release_data(cmlp_trainer *t) {
    if (!t) return;
    drop_device_data(t);
    memset(&t->data, 0, sizeof t->data);
    t->epoch_open = false;
}
