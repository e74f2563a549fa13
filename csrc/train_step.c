/* train_step.c - one optimizer step: the micro-batches' gradients summed, then (summed over the
 * ranks, unscaled, clipped) the update; the retry with smaller micro-batches after out-of-memory;
 * and the step captured once as a graph and replayed.
 */
#include "train_internal.h"
#include "comm.h"

#include <stdio.h>
#include <string.h>

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
    /* zeros the last update left are for this step's first micro-batch only: a retry's writes */
    const bool zeroed = t->grads_zeroed;
    t->grads_zeroed = false;
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
        w.zeroed = w.fresh && zeroed;
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
                                                     : cmlp_dcomm_all_gather(m->dev, t->dcomm, scratch, parts, 1));
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
        CMLP_TRY(scatter ? cmlp_dcomm_reduce_scatter(m->dev, t->dcomm, m->grads, m->nparams, chunk)
                         : cmlp_dcomm_all_reduce(m->dev, t->dcomm, m->grads, m->nparams));
    if (!t->scaler.enabled && !cmlp_train_device_steps(t)) {
        if (clip) CMLP_TRY(scatter ? clip_part(t, ds, lo, hi, chunk, parts) : clip_grads(t, ds));
        /* where the next step of this call takes the gradients as they are (not amp's, which
         * writes them afresh), its first weight gradients are added to zeros */
        const bool zero = t->more_steps && !scatter && t->cfg.amp == CMLP_AMP_NONE;
        return cmlp_optim_step_summed_at(t->optim, t->scales_row, t->momenta_row, zero ? &t->grads_zeroed : NULL);
    }
    const float *found_inf = NULL;
    if (t->scaler.enabled) {
        if (hi > lo) CMLP_TRY(b->unscale(ctx, m->grads + lo, hi - lo, 0.0f, &ds->scale, &ds->found_inf));
        if (scatter) /* every rank checked its part: all skip or take the step together */
            CMLP_TRY(cpu ? cmlp_dist_all_reduce(&ds->found_inf, 1, CMLP_COMM_F32, CMLP_REDUCE_MAX)
                         : cmlp_dcomm_all_reduce(m->dev, t->dcomm, &ds->found_inf, 1));
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
 * then the update (the ranks agree on it after the capture: see cmlp_train_graph_step). */
static cmlp_status effective_step(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy, const int64_t *idx,
                                  int64_t start, int64_t k, int64_t n_all) {
    CMLP_TRY(step_grads(t, ds, xy, idx, start, k, n_all));
    return step_update(t, ds, xy, n_all);
}

static int optimizer_buffers(const cmlp_trainer *t) { return cmlp_optim_buffers_planned(t->optim); }

/* Even one sample did not fit: say so, with what one sample needs. */
static cmlp_status one_sample_oom(cmlp_trainer *t, const char *cause) {
    char why[1200];
    snprintf(why, sizeof why, "%s", cause);
    char *advice = strstr(why, " Try micro-batches"); /* tried: the allocator's advice does not apply */
    if (advice) *advice = '\0';
    cmlp_model *m = t->model;
    cmlp_plan p;
    char b[8][32];
    int solo = cmlp_train_effective_batch(t) == 1; /* steps of one sample, or accumulating micro-batches of one */
    int shards = cmlp_optim_shards(t->optim, NULL, NULL, NULL);
    if (cmlp_plan_compute(m->sizes, m->nlayers + 1, 1, optimizer_buffers(t), shards ? shards : 1,
                          cmlp_optim_num_parts(t->optim), t->cfg.amp, t->cfg.recompute, t->scaler.enabled, solo, 0, 0,
                          0, 0, 0, 1, 0, m->dev->device, NULL, &p) != CMLP_OK)
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
                     "peak %s allocated, %s reserved (in whole segments, or pages where they are expandable).%s%s "
                     "The last failure: %s",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], held_note, shard_hint, why);
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

/* A step that completed, at the micro-batch in use (whole: it ran micro-batches of that size; a
 * short last step's one smaller micro-batch says nothing of a size just grown to). Good steps
 * count from each change of size (at the target, where no growth is due, up to 1); the first
 * after a growth shows it worked, and the next growth waits grow_interval good steps. */
void cmlp_train_good_step(cmlp_trainer *t, bool whole_micro, int64_t rows) {
    const bool trial = t->grown_from && !t->good_steps;
    if (trial && !whole_micro) return;
    if (trial) t->grow_wait = t->cfg.grow_interval;
    if (t->micro < t->target_micro ? t->good_steps < INT64_MAX : !t->good_steps) t->good_steps++;
    if (t->micro < t->target_micro && t->good_steps >= t->grow_wait) {
        t->grown_from = t->micro;
        t->micro = grown_micro(t->micro, t->target_micro, rows);
        t->good_steps = 0;
    }
}

/* effective_step, surviving out-of-memory by smaller micro-batches when allowed. A failed
 * attempt changed nothing that matters: the retry's first micro-batch writes the gradients
 * afresh, the loss it added is taken back, and the optimizer and the scaler move only at the end
 * of a step (a step fails before). Data-parallel, a rank retries its share alone, before the
 * ranks agree on the step; once they have, nothing is retried. */
cmlp_status cmlp_train_robust_step(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy, const int64_t *idx,
                                   int64_t start, int64_t k, int64_t n_all) {
    const int64_t micro_before = t->micro, grown_before = t->grown_from, good_before = t->good_steps,
                  wait_before = t->grow_wait;
    bool reclaimed = false;
    t->oom_at_one = false;
    /* micro-batches are sized for a whole step of this rank's, not for a short last one */
    const int64_t whole = t->whole_rows > k ? t->whole_rows : k;
    const cmlp_backend_i *b = t->model->dev->backend;
    void *ctx = t->model->dev->bctx;
    if (t->cfg.auto_microbatch) /* only a retry takes the loss back */
        CMLP_TRY(b->copy_d2d(ctx, &ds->loss_mark, &ds->loss, sizeof ds->loss));
    for (;;) {
        /* an out-of-memory that is not the allocator's is a launch's (its kernel loads then, see
         * KERNEL in backend_cuda.h): the size of the micro-batch is not the cause */
        const int64_t ooms = cmlp_allocator_ooms_ever(t->model->dev->alloc);
        /* the update's kernels loaded first (on a GPU, where a first launch's load finds no room,
         * the step fails here, with nothing moved: data-parallel, not in the update on one rank
         * after the ranks agreed on it; no micro-batch's size is the cause: no smaller retry) */
        cmlp_status st = b->update_load ? b->update_load(ctx, cmlp_optim_get_kind(t->optim) == CMLP_OPTIM_ADAM,
                                                         t->scaler.enabled, t->cfg.max_grad_norm > 0.0)
                                        : CMLP_OK;
        const bool loaded = st == CMLP_OK;
        if (loaded) st = step_grads(t, ds, xy, idx, start, k, n_all);
        bool agreed = false, late = false, not_size = false;
        if (st == CMLP_ERR_OOM) not_size = cmlp_allocator_ooms_ever(t->model->dev->alloc) == ooms;
        if (st == CMLP_OK && t->dist) {
            st = cmlp_dist_agree(CMLP_OK);
            agreed = true;
        }
        if (st == CMLP_OK) {
            st = step_update(t, ds, xy, n_all);
            /* a launch's in the update: its bookkeeping (step count, loss scale, data position)
             * may have moved, and a retry would move it again */
            late = st == CMLP_ERR_OOM && cmlp_allocator_ooms_ever(t->model->dev->alloc) == ooms;
        }
        if (st == CMLP_OK) {
            if (k >= t->micro || !t->ran_micro) t->ran_micro = t->micro; /* not a short last step's */
            cmlp_train_good_step(t, k >= t->micro || k >= whole, whole);
            return CMLP_OK;
        }
        if (st != CMLP_ERR_OOM || !t->cfg.auto_microbatch || agreed || late || !loaded)
            return t->dist && !agreed ? cmlp_dist_agree(st) : st;
        CMLP_TRY(b->copy_d2d(ctx, &ds->loss, &ds->loss_mark, sizeof ds->loss));
        cmlp_model_release_workspace(t->model);
        cmlp_allocator_empty_cache(t->model->dev->alloc);
        if (not_size && !reclaimed) { /* once, at the same size, on the emptied cache */
            reclaimed = true;
            continue;
        }
        cmlp_memory_stats ms;
        cmlp_allocator_stats(t->model->dev->alloc, &ms);
        if (xy->on_device && t->d_x && !t->dist && ms.limit < 0 && !(t->grown_from && !t->good_steps)) {
            /* with no limit (under one, the planned start weighed the copy against the
             * micro-batch already), the device copy of the data set goes before any micro-batch
             * shrinks, as such a plan prefers the batches from host memory where they leave a
             * larger one: epoch_run drops it and takes the step again, at this size (a growth
             * trial that fails goes back to the size that worked, as ever) */
            t->oom_at_one = true;
            t->micro = micro_before;
            t->grown_from = grown_before, t->good_steps = good_before, t->grow_wait = wait_before;
            return st;
        }
        if (t->micro == 1) { /* nothing worked: the next step starts where this one did */
            t->oom_at_one = true;
            t->micro = micro_before;
            t->grown_from = grown_before, t->good_steps = good_before, t->grow_wait = wait_before;
            st = one_sample_oom(t, cmlp_error_text(cmlp_last_error()));
            return t->dist ? cmlp_dist_agree(st) : st;
        }
        /* back to the size that worked before the last growth (2667, not 4000 / 2), else
         * twice as many micro-batches. A growth that fails at its first step is tried again
         * after twice as many good steps as it waited for (not every grow_interval steps, each
         * an out-of-memory, a rollback and the cache emptied); a failure of a size that had
         * worked starts the wait afresh. */
        const bool back = t->grown_from && t->grown_from < t->micro, failed_growth = back && !t->good_steps;
        t->micro = back ? t->grown_from : shrunk_micro(t->micro, whole);
        t->grow_wait = !failed_growth ? t->cfg.grow_interval
                       : t->grow_wait <= INT64_MAX / 2 ? 2 * t->grow_wait : INT64_MAX;
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
 * A capture that fails (its graph's upload out of memory, say) turns graphs off for the rest of
 * this fit call and the step runs eagerly; the next call tries them again.
 * Data-parallel, every rank must take the same path (NCCL requires an operation to be captured
 * on all ranks or on none, and a replay to be of captures made together): each rank says which
 * it could take, and all take the least of them (a rank whose micro-batch changed, a growth
 * trial among them, or that has no device copy of the data, makes every rank run eagerly; a
 * rank that could replay captures again when another can only capture). A capture that failed
 * on any rank turns graphs off on all (every rank calls fit). */
cmlp_status cmlp_train_graph_step(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy, const int64_t *idx,
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
    if (path == PATH_REPLAY) {
        t->ran_micro = t->micro; /* a replay's steps are whole micro-batches asked for (eligible) */
        CMLP_TRY(t->dist ? cmlp_dcomm_graph_launch(dev, t->graph) : b->graph_launch(dev->bctx, t->graph));
        t->graph_counts[1]++;
        cmlp_train_good_step(t, true, n);
        return CMLP_OK;
    }
    if (path == PATH_EAGER) {
        CMLP_TRY(cmlp_train_robust_step(t, ds, xy, idx, start, n, n_all));
        if (eligible && !warm) {
            make_key(t, xy, idx, start, n, n_all, &t->warm_key); /* after the step: what it allocated is in */
            /* at the micro-batch it ran at: a growth its end made due is the next step's trial, which
             * runs eagerly (a capture of it would ask for a larger workspace, and fail) */
            t->warm_key.micro = t->ran_micro;
            t->warm = true;
        }
        return CMLP_OK;
    }
    cmlp_train_drop_graph(t);
    cmlp_status st = b->capture_begin(dev->bctx);
    void *g = NULL;
    if (st == CMLP_OK) {
        (void)cmlp_allocator_capturing(dev->alloc, true); /* cached memory only: nothing may allocate */
        st = effective_step(t, ds, xy, idx, start, n, n_all);
        const bool kept_blocks = cmlp_allocator_capturing(dev->alloc, false);
        cmlp_status end = b->capture_end(dev->bctx, &g);
        if (st == CMLP_OK) st = end;
        if (st == CMLP_OK && !kept_blocks)
            st = CMLP_FAIL(CMLP_ERR_DEVICE, "the captured step allocated or freed memory: its graph is not kept");
    }
    if (t->dist) st = cmlp_dist_agree(st); /* every rank captured this step: one failed, all run it eagerly */
    if (st == CMLP_OK) {
        t->graph = g;
        t->graph_dev = dev;
        t->graph_key = key;
        t->ran_micro = t->micro;
        CMLP_TRY(t->dist ? cmlp_dcomm_graph_launch(dev, g) : b->graph_launch(dev->bctx, g));
        t->graph_counts[0]++;
        cmlp_train_good_step(t, true, n);
        return CMLP_OK;
    }
    t->graph_counts[2]++;
    if (g) b->graph_free(dev->bctx, g);
    t->capture_failed = true; /* nothing captured ran: the step runs eagerly */
    return cmlp_train_robust_step(t, ds, xy, idx, start, n, n_all);
}
