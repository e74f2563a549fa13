/* train_state.c - the trainer's state as its callers read and set it: the micro-batch sizes,
 * the loss scaler, the counters and the epoch count. A setter checks every value first and
 * changes nothing when it refuses one.
 */
#include "train_internal.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

int64_t cmlp_trainer_microbatch_size(const cmlp_trainer *t) { return t->micro; }

void cmlp_trainer_set_fit_call(cmlp_trainer *t, int64_t epochs, int64_t validation_samples, uint64_t validation_hash,
                               int per_step_schedule) {
    t->fit_call[0] = epochs;
    t->fit_call[1] = validation_samples;
    t->fit_call[2] = per_step_schedule != 0;
    t->fit_call[3] = (int64_t)validation_hash;
    t->capture_failed = false; /* a capture that failed in the last call is tried again */
}
int64_t cmlp_trainer_skipped_steps(const cmlp_trainer *t) { return t->skipped; }
int64_t cmlp_trainer_oom_retries(const cmlp_trainer *t) { return t->oom_retries; }
void cmlp_trainer_graph_counts(const cmlp_trainer *t, int64_t out[3]) {
    memcpy(out, t->graph_counts, sizeof t->graph_counts);
}
int cmlp_trainer_last_grad_norm(const cmlp_trainer *t, double *norm) {
    if (t->has_norm) *norm = t->last_norm;
    return t->has_norm;
}
void cmlp_trainer_get_scaler(const cmlp_trainer *t, cmlp_scaler_state *out) { *out = t->scaler; }

cmlp_status cmlp_trainer_set_scaler(cmlp_trainer *t, const cmlp_scaler_state *s) {
    if (!t || !s) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (s->enabled) {
        /* the scale is kept in float32: checked there (a normal number, as GradScaler's; the
         * range first, where converting would overflow) */
        if (!(s->scale > 0.0 && s->scale <= FLT_MAX) || (float)s->scale < FLT_MIN)
            return CMLP_FAIL(CMLP_ERR_INVALID, "loss scale must be finite and >= 2**-126 in float32, got %g",
                             s->scale);
        if (!(s->growth_factor > 1.0 && isfinite(s->growth_factor)))
            return CMLP_FAIL(CMLP_ERR_INVALID, "growth_factor must be finite and > 1, got %g", s->growth_factor);
        if (!(s->backoff_factor > 0.0 && s->backoff_factor < 1.0))
            return CMLP_FAIL(CMLP_ERR_INVALID, "backoff_factor must be in (0, 1), got %g", s->backoff_factor);
        /* the device keeps the tracker in an int32, as torch does */
        if (s->growth_interval < 1 || s->growth_interval > INT32_MAX)
            return CMLP_FAIL(CMLP_ERR_INVALID, "growth_interval must be in [1, 2**31 - 1], got %lld",
                             (long long)s->growth_interval);
        if (s->growth_tracker < 0 || s->growth_tracker >= s->growth_interval)
            return CMLP_FAIL(CMLP_ERR_INVALID, "the growth tracker must be in [0, growth_interval), got %lld of %lld",
                             (long long)s->growth_tracker, (long long)s->growth_interval);
    }
    t->scaler = *s;
    t->scaler.scale = s->enabled ? (float)s->scale : 1.0f; /* (disabled: not read, and not converted) */
    return CMLP_OK;
}

cmlp_status cmlp_trainer_start_microbatch(cmlp_trainer *t, int64_t size) {
    if (!t) return CMLP_FAIL(CMLP_ERR_INVALID, "the trainer must not be NULL");
    if (size < 1 || size > t->target_micro)
        return CMLP_FAIL(CMLP_ERR_INVALID, "a starting micro-batch must be in [1, %lld], got %lld",
                         (long long)t->target_micro, (long long)size);
    t->micro = size;
    cmlp_train_restart_growth(t);
    return CMLP_OK;
}

cmlp_status cmlp_trainer_set_microbatch_size(cmlp_trainer *t, int64_t size) {
    if (!t) return CMLP_FAIL(CMLP_ERR_INVALID, "the trainer must not be NULL");
    const int64_t most = t->cfg.batch_size * t->cfg.accumulation_steps; /* (at most 2**62) */
    if (size < 1 || size > most)
        return CMLP_FAIL(CMLP_ERR_INVALID, "microbatch_size must be in [1, batch_size * accumulation_steps = %lld], "
                         "got %lld", (long long)most, (long long)size);
    t->micro = t->target_micro = size;
    cmlp_train_restart_growth(t);
    return CMLP_OK;
}

int64_t cmlp_trainer_last_microbatch(const cmlp_trainer *t) { return t->ran_micro; }

void cmlp_trainer_get_microbatch_state(const cmlp_trainer *t, int64_t *size, int64_t *target,
                                       int64_t *good_steps, int64_t *grown_from, int64_t *grow_wait) {
    *size = t->micro;
    *target = t->target_micro;
    *good_steps = t->good_steps;
    *grown_from = t->grown_from;
    *grow_wait = t->grow_wait;
}

cmlp_status cmlp_trainer_set_microbatch_state(cmlp_trainer *t, int64_t size, int64_t target, int64_t good_steps,
                                              int64_t grown_from, int64_t grow_wait) {
    if (!t) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    const int64_t most = t->cfg.batch_size * t->cfg.accumulation_steps; /* a step's rows (at most 2**62) */
    if (target < 1 || target > most)
        return CMLP_FAIL(CMLP_ERR_INVALID, "the micro-batch target must be in [1, batch_size * accumulation_steps = %lld], "
                         "got %lld", (long long)most, (long long)target);
    if (size < 1 || size > target)
        return CMLP_FAIL(CMLP_ERR_INVALID, "the micro-batch in use must be in [1, %lld] (its target), got %lld",
                         (long long)target, (long long)size);
    if (good_steps < 0)
        return CMLP_FAIL(CMLP_ERR_INVALID, "good_steps must be >= 0, got %lld", (long long)good_steps);
    if (grown_from < 0 || grown_from >= size)
        return CMLP_FAIL(CMLP_ERR_INVALID, "the micro-batch grown from must be 0 (none) or in [1, %lld), got %lld",
                         (long long)size, (long long)grown_from);
    if (grow_wait < 0)
        return CMLP_FAIL(CMLP_ERR_INVALID, "grow_wait must be >= 0 (0: grow_interval), got %lld", (long long)grow_wait);
    t->micro = size;
    t->target_micro = target;
    t->good_steps = good_steps;
    t->grown_from = grown_from;
    t->grow_wait = grow_wait ? grow_wait : t->cfg.grow_interval;
    return CMLP_OK;
}

int64_t cmlp_trainer_epochs(const cmlp_trainer *t) { return t ? t->epoch : 0; }

cmlp_status cmlp_trainer_set_epochs(cmlp_trainer *t, int64_t epochs) {
    if (!t) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (epochs < 0 || epochs > ((int64_t)1 << 62)) /* room to count on, as the state_dict's bound */
        return CMLP_FAIL(CMLP_ERR_INVALID, "epochs must be in [0, 2**62], got %lld", (long long)epochs);
    t->epoch_open = false; /* an epoch left unfinished (by a failure) is abandoned */
    t->epoch = epochs;
    return CMLP_OK;
}

int cmlp_trainer_optim_parts(const cmlp_trainer *t) { return cmlp_optim_num_parts(t->optim); }
