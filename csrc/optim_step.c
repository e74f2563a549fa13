/* optim_step.c - an optimizer step with PyTorch's update rules, on the host (the bias corrections
 * computed there) and on a device (all of it read there, so that a captured step replays), part
 * by part of the parameter groups, then the gather of a sharded optimizer.
 */
#include "optim_internal.h"

#include <stddef.h>

cmlp_status cmlp_optim_step(cmlp_optim *o) {
    if (!o) return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer must not be NULL");
    if (o->shards)
        return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer's state is sharded over the process group: it steps in a "
                                         "data-parallel trainer (cmlp.Trainer), which sums the gradients over the "
                                         "ranks first");
    o->model->written = o->written = true; /* a step of the caller's, outside a trainer */
    return cmlp_optim_step_summed(o);
}

cmlp_status cmlp_optim_step_summed(cmlp_optim *o) { return cmlp_optim_step_summed_at(o, NULL, NULL, NULL); }

cmlp_status cmlp_optim_step_summed_at(cmlp_optim *o, const double *scales, const double *momenta, bool *zeroed) {
    if (zeroed) *zeroed = false;
    CMLP_TRY(cmlp_optim_check_model(o));
    if (o->dev->device.type != CMLP_DEVICE_CPU) {
        /* as the trainer steps there: the bias corrections computed on the device, so that a
         * step taken from Python and one taken in fit give the same bits */
        cmlp_dscalars *ds;
        CMLP_TRY(cmlp_model_scalars(o->model, &ds));
        struct {
            int64_t step;
            double lr, momentum;
        } h = {o->step, cmlp_optim_get_lr(o), cmlp_optim_get_momentum(o)}; /* ds->step, then ds->rates[0..1] */
        _Static_assert(offsetof(cmlp_dscalars, rates) == offsetof(cmlp_dscalars, step) + 8, "step, then rates");
        CMLP_TRY(o->dev->backend->copy_h2d(o->dev->bctx, &ds->step, &h, sizeof h));
        CMLP_TRY(cmlp_optim_step_device(o, NULL, &ds->step, ds->coef, ds->rates, NULL, NULL, 0, NULL, 0, NULL));
        o->step++;
        return CMLP_OK;
    }
    CMLP_TRY(cmlp_optim_ready(o, NULL));
    cmlp_model *m = o->model;
    const cmlp_backend_i *b = o->dev->backend;
    int64_t n = span(o), at = first_of(o), t = o->step + 1;
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st = CMLP_OK;
    const optim_part *parts;
    optim_part one;
    int np = cmlp_optim_parts_of(o, &parts, &one);
    /* the gradients are zeroed as they are read where every one of them is (not sharded) */
    const int zero = zeroed && b->beta_zero_pass && at == 0 && n == m->nparams && parts[np - 1].end == n;
    for (int i = 0; i < np && st == CMLP_OK; i++) { /* each part of this rank's at its own rate and decay */
        int64_t lo = i ? parts[i - 1].end : 0, hi = parts[i].end;
        lo = lo > at ? lo : at;
        hi = hi < at + n ? hi : at + n;
        if (lo >= hi) continue;
        int64_t k = lo - at; /* where its state starts */
        const optim_part *pt = &parts[i];
        double wd = pt->weight_decay, mom = part_momentum(o, pt);
        if (momenta && o->nparts && !isnan(momenta[i])) mom = momenta[i];
        if (o->kind == CMLP_OPTIM_ADAM) {
            const cmlp_adam_config *c = &o->adam;
            double lr = c->lr * (scales && o->nparts ? scales[i] : pt->lr_scale), beta2 = part_beta2(o, pt);
            double bc1 = 1.0 - pow(mom, (double)t), bc2 = 1.0 - pow(beta2, (double)t);
            bool dec = c->decoupled_weight_decay;
            st = b->adam(o->dev->bctx, m->params + lo, m->grads + lo, o->state + k, o->state + n + k,
                         amsgrad_max(o, part_amsgrad(o, pt), k), hi - lo, (float)(lr / bc1), (float)mom, (float)beta2, (float)(1.0 - mom),
                         (float)(1.0 - beta2), (float)sqrt(bc2), (float)part_eps(o, pt), dec ? 0.0f : (float)wd,
                         dec ? (float)(1.0 - lr * wd) : 1.0f, part_maximize(o, pt), NULL, NULL, zero);
        } else {
            const cmlp_sgd_config *c = &o->sgd;
            st = b->sgd(o->dev->bctx, m->params + lo, m->grads + lo, o->state ? o->state + k : NULL, hi - lo,
                        (float)(c->lr * (scales && o->nparts ? scales[i] : pt->lr_scale)), (float)mom,
                        (float)(1.0 - part_dampening(o, pt)), part_nesterov(o, pt), (float)wd, part_maximize(o, pt),
                        NULL, NULL, zero);
        }
    }
    if (st == CMLP_OK) st = cmlp_optim_gather(o, NULL);
    if (st == CMLP_OK) st = cmlp_model_refresh_half(m);
    cmlp_fpenv_leave(&fe);
    if (st == CMLP_OK) {
        o->step = t;
        o->unused = o->vmax_unused = false;
        if (zeroed) *zeroed = zero;
    }
    return st;
}

cmlp_status cmlp_optim_step_device(cmlp_optim *o, const float *d_found_inf, int64_t *d_step, float *d_coef,
                                   const double *d_rates, int64_t *d_lr_next, int64_t *d_pos, int64_t pos_add,
                                   const cmlp_scale_step *scale, int step_scales, void *dcomm) {
    CMLP_TRY(cmlp_optim_check_model(o));
    CMLP_TRY(cmlp_optim_ready(o, dcomm));
    bool first = o->unused; /* the state was made for this step (SGD's buffer not started anywhere) */
    cmlp_model *m = o->model;
    const cmlp_backend_i *b = o->dev->backend;
    void *ctx = o->dev->bctx;
    int64_t n = span(o), at = first_of(o);
    float *p = m->params + at;
    float *g = m->grads + at;
    bool adam = o->kind == CMLP_OPTIM_ADAM;
    cmlp_dscalars *ds;
    CMLP_TRY(cmlp_model_scalars(m, &ds));
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st;
    cmlp_rate_src rate = {d_rates, d_lr_next, adam ? adam_decoupled_wd(&o->adam) : 0.0, 0, NULL, NULL};
    if (o->nparts) { /* parameter groups: the coefficients of each part, then a launch for each */
        rate.nparts = o->nparts;
        rate.d_parts = o->d_parts;
        rate.d_part_coef = part_coef(o);
        rate.d_step_scales = step_scales ? step_table(o) : NULL;
        st = b->optim_prepare(ctx, d_step, d_coef, d_found_inf, &rate, adam ? o->adam.beta2 : 0.0, adam, d_pos,
                              pos_add, scale);
        for (int i = 0; i < o->nparts && st == CMLP_OK; i++) {
            int64_t lo = i ? o->parts[i - 1].end : 0, hi = o->parts[i].end;
            lo = lo > at ? lo : at;
            hi = hi < at + n ? hi : at + n;
            if (lo >= hi) continue;
            int64_t k = lo - at;
            const float *pc = rate.d_part_coef + 5 * i;
            const optim_part *pt = &o->parts[i];
            float wd = (float)pt->weight_decay;
            if (adam) {
                const double beta2 = part_beta2(o, pt);
                st = b->adam(ctx, m->params + lo, m->grads + lo, o->state + k, o->state + n + k,
                             amsgrad_max(o, part_amsgrad(o, pt), k), hi - lo, 0.0f, 0.0f, (float)beta2, 0.0f, (float)(1.0 - beta2), 1.0f,
                             (float)part_eps(o, pt), o->adam.decoupled_weight_decay ? 0.0f : wd, 1.0f,
                             part_maximize(o, pt), d_found_inf, pc, 0);
            } else {
                /* the momentum is the device's (pc); the host's tells the launch whether it may be 0 */
                st = b->sgd(ctx, m->params + lo, m->grads + lo, o->state ? o->state + k : NULL, hi - lo, 0.0f,
                            (float)part_momentum(o, pt), (float)(1.0 - part_dampening(o, pt)), part_nesterov(o, pt),
                            wd, part_maximize(o, pt), d_found_inf, pc, 0);
            }
        }
    } else if (adam && b->adam_prepared && n > 0) { /* the bookkeeping in Adam's launch */
        const cmlp_adam_config *c = &o->adam;
        st = b->adam_prepared(ctx, p, g, o->state, o->state + n, amsgrad_max(o, c->amsgrad, 0), n, &rate, c->beta2,
                              (float)c->eps, adam_l2(c), c->maximize, d_found_inf, d_step, d_coef, d_pos, pos_add,
                              scale, &ds->blocks_done);
    } else if (adam) {
        const cmlp_adam_config *c = &o->adam;
        st = b->optim_prepare(ctx, d_step, d_coef, d_found_inf, &rate, c->beta2, 1, d_pos, pos_add, scale);
        if (st == CMLP_OK)
            st = b->adam(ctx, p, g, o->state, o->state + n, amsgrad_max(o, c->amsgrad, 0), n, 0.0f, 0.0f,
                         (float)c->beta2,
                         0.0f, (float)(1.0 - c->beta2), 1.0f, (float)c->eps, adam_l2(c), 1.0f, c->maximize,
                         d_found_inf, d_coef, 0);
    } else {
        const cmlp_sgd_config *c = &o->sgd;
        st = b->optim_prepare(ctx, d_step, d_coef, d_found_inf, &rate, 0.0, 0, d_pos, pos_add, scale);
        if (st == CMLP_OK)
            st = b->sgd(ctx, p, g, o->state, n, 0.0f, (float)c->momentum, (float)(1.0 - c->dampening), c->nesterov,
                        (float)c->weight_decay, c->maximize, d_found_inf, d_coef, 0);
    }
    if (st == CMLP_OK) st = cmlp_optim_gather(o, dcomm);
    if (st == CMLP_OK) st = cmlp_model_refresh_half(m);
    cmlp_fpenv_leave(&fe);
    if (st == CMLP_OK && first && d_found_inf) {
        /* state this step made is still unused if the device skipped the step (torch's scaler
         * skips optimizer.step(): SGD's next step starts its buffer from the gradient); read once,
         * where the state was made (never in a capture: cmlp_optim_state_missing) */
        float inf = 0.0f;
        st = b->copy_d2h(ctx, &inf, d_found_inf, sizeof inf);
        if (st == CMLP_OK && inf != 0.0f) return CMLP_OK;
    }
    if (st == CMLP_OK) o->unused = o->vmax_unused = false;
    return st;
}
