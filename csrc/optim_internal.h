/* optim_internal.h - the optimizer's state and the helpers its files share: optim.c (settings,
 * state buffers), optim_parts.c (parameter groups), optim_shard.c (ZeRO-1 sharding) and
 * optim_step.c (the update on the host and on a device). Nothing else includes it.
 */
#ifndef CMLP_OPTIM_INTERNAL_H
#define CMLP_OPTIM_INTERNAL_H

#include "internal.h"

#include <math.h>

/* A parameter group's part of the parameters, [the end of the part before, end): its rate as a
 * multiple of the optimizer's, its weight decay and its other settings (cmlp_part_settings). */
typedef struct optim_part {
    int64_t end;
    double lr_scale, weight_decay;
    cmlp_part_settings s;
} optim_part;

struct cmlp_optim {
    cmlp_optim_kind kind;
    cmlp_model *model;
    cmlp_device_ctx *dev; /* where the state lives: the model's device */
    cmlp_adam_config adam;
    cmlp_sgd_config sgd;
    int64_t step;
    float *state; /* NULL before the first step; [arena_buffers(o) * span(o)] */
    float *vmax;  /* AMSGrad's max_exp_avg_sq, made at the first step with amsgrad (any part's):
                   * [span(o)], CMLP_VMAX_UNSTARTED where no step with amsgrad has been taken */
    bool unused;  /* state made ahead of the first step (cmlp_optim_prepare), which it still is */
    bool vmax_unused; /* likewise the AMSGrad maximum, made beside state in use (amsgrad turned on) */
    bool momentum_ahead; /* SGD: a step to come has momentum (cmlp_optim_expect_momentum) */
    uint64_t version; /* moves whenever the configuration (but for the rate) or the state buffer changes */
    /* ZeRO stage 1: with shards > 0 the state covers [lo, hi) of the parameters only, this rank's
     * part of `shards` parts of `chunk` floats; a step updates that part and gathers the others */
    int shards, shard_rank;
    int64_t chunk, lo, hi;
    /* parameter groups (cmlp_optim_set_parts): nparts parts, none when every parameter takes the
     * configuration's settings; d_parts holds 4 doubles per part for a step on the device (the
     * rate's scale, the decoupled weight decay, the momentum and beta2, NaN for the step's and the
     * configuration's), then a table of CMLP_MAX_RATES rows of a scale and a momentum per part (a
     * trainer call's steps, each its own: cmlp_optim_load_step_scales), then 5 floats of
     * coefficients per part */
    int nparts;
    optim_part *parts;
    void *d_parts;
    cmlp_device_ctx *d_parts_dev; /* where d_parts lives (host memory on the CPU) */
    bool written; /* the state changed from outside a data-parallel trainer (cmlp_optim_written) */
};

/* The parameters whose state this optimizer keeps: [lo, lo + span). */
static inline int64_t span(const cmlp_optim *o) { return o->shards ? o->hi - o->lo : o->model->nparams; }

static inline int64_t first_of(const cmlp_optim *o) { return o->shards ? o->lo : 0; }

/* The bytes of nb state buffers (a part left empty still gets one float each). */
static inline size_t state_bytes(const cmlp_optim *o, int nb) {
    return (size_t)nb * (size_t)(span(o) > 0 ? span(o) : 1) * sizeof(float);
}

/* Bytes of d_parts for n parts. */
static inline size_t parts_bytes(int n) {
    return (size_t)n * ((CMLP_PART_ARGS + 2 * CMLP_MAX_RATES) * sizeof(double) + 5 * sizeof(float));
}

/* d_parts' table of each step's scales, and its coefficients */
static inline double *step_table(const cmlp_optim *o) { return (double *)o->d_parts + CMLP_PART_ARGS * o->nparts; }

static inline float *part_coef(const cmlp_optim *o) {
    return (float *)((double *)o->d_parts + (CMLP_PART_ARGS + 2 * CMLP_MAX_RATES) * (size_t)o->nparts);
}

/* A part's settings, resolved: its own, else the configuration's. */
static inline double own_or(double own, double config) { return isnan(own) ? config : own; }

static inline int own_flag_or(int own, int config) { return own < 0 ? config : own; }

static inline double part_momentum(const cmlp_optim *o, const optim_part *p) {
    return own_or(p->s.momentum, o->kind == CMLP_OPTIM_ADAM ? o->adam.beta1 : o->sgd.momentum);
}

static inline double part_beta2(const cmlp_optim *o, const optim_part *p) { return own_or(p->s.beta2, o->adam.beta2); }

static inline double part_eps(const cmlp_optim *o, const optim_part *p) { return own_or(p->s.eps, o->adam.eps); }

static inline double part_dampening(const cmlp_optim *o, const optim_part *p) {
    return own_or(p->s.dampening, o->sgd.dampening);
}

static inline int part_nesterov(const cmlp_optim *o, const optim_part *p) {
    return own_flag_or(p->s.nesterov, o->sgd.nesterov);
}

static inline int part_maximize(const cmlp_optim *o, const optim_part *p) {
    return own_flag_or(p->s.maximize, o->kind == CMLP_OPTIM_ADAM ? o->adam.maximize : o->sgd.maximize);
}

static inline int part_amsgrad(const cmlp_optim *o, const optim_part *p) {
    return o->kind == CMLP_OPTIM_ADAM && own_flag_or(p->s.amsgrad, o->adam.amsgrad);
}

/* Adam's weight decay as the backends take it: L2 (added to the gradient), or with decoupled
 * weight decay none (the parameters are first multiplied by torch's AdamW factor,
 * 1 - lr * weight_decay, formed in double and applied in float). */
static inline float adam_l2(const cmlp_adam_config *c) {
    return c->decoupled_weight_decay ? 0.0f : (float)c->weight_decay;
}

/* The same weight decay as a step on the device takes it (cmlp_rate_src: 0 for none). */
static inline double adam_decoupled_wd(const cmlp_adam_config *c) {
    return c->decoupled_weight_decay ? c->weight_decay : 0.0;
}

/* AMSGrad's running maximum of exp_avg_sq from k, NULL where the step takes none (on: amsgrad
 * there) */
static inline float *amsgrad_max(const cmlp_optim *o, bool on, int64_t k) { return on && o->vmax ? o->vmax + k : NULL; }

/* optim.c */
/* A hyperparameter >= 0 (PyTorch's check) that stays finite in float32, where the update
 * computes with it: an inf or overflowing value would only turn the parameters into inf or NaN. */
CMLP_HIDDEN cmlp_status cmlp_optim_check_real(const char *what, double v);
/* The model is still on the optimizer's device. */
CMLP_HIDDEN cmlp_status cmlp_optim_check_model(cmlp_optim *o);
/* The state a step needs is there (made now where missing); sharded, checked as a collective. */
CMLP_HIDDEN cmlp_status cmlp_optim_ready(cmlp_optim *o, const void *dcomm);

/* optim_parts.c */
/* The parts a step takes: the parameter groups', or one part with the configuration's settings. */
CMLP_HIDDEN int cmlp_optim_parts_of(const cmlp_optim *o, const optim_part **out, optim_part *one);
/* n parts' settings where a step on the optimizer's device reads them (d_parts): *out, made anew
 * (*fresh) when missing, elsewhere or of another size. */
CMLP_HIDDEN cmlp_status cmlp_optim_upload_parts(cmlp_optim *o, const optim_part *parts, int n, void **out,
                                                bool *fresh);
CMLP_HIDDEN void cmlp_optim_free_device_parts(cmlp_optim *o);

/* optim_shard.c */
/* A sharded optimizer steps with the process group its parts were cut for. */
CMLP_HIDDEN cmlp_status cmlp_optim_check_group(const cmlp_optim *o);
/* Sharded: every rank's part of the parameters to every rank (nothing otherwise). */
CMLP_HIDDEN cmlp_status cmlp_optim_gather(cmlp_optim *o, void *dcomm);

#endif
