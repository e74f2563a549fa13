/* optim.c - Adam and SGD with PyTorch's update rules over the model's flat buffers. State
 * (one arena: Adam's exp_avg and exp_avg_sq, or SGD's momentum buffer; and AMSGrad's
 * max_exp_avg_sq in a buffer of its own) is created at the first step that needs it; a step that
 * cannot allocate it changes nothing.
 */
#include "internal.h"
#include "comm.h"

#include <float.h>
#include <stddef.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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
};

/* The parameters whose state this optimizer keeps: [lo, lo + span). */
static int64_t span(const cmlp_optim *o) { return o->shards ? o->hi - o->lo : o->model->nparams; }
static int64_t first_of(const cmlp_optim *o) { return o->shards ? o->lo : 0; }
/* The bytes of nb state buffers (a part left empty still gets one float each). */
static size_t state_bytes(const cmlp_optim *o, int nb) {
    return (size_t)nb * (size_t)(span(o) > 0 ? span(o) : 1) * sizeof(float);
}

static cmlp_status upload_parts(cmlp_optim *o, const optim_part *parts, int n, void **out, bool *fresh);

/* Bytes of d_parts for n parts. */
static size_t parts_bytes(int n) {
    return (size_t)n * ((CMLP_PART_ARGS + 2 * CMLP_MAX_RATES) * sizeof(double) + 5 * sizeof(float));
}
/* d_parts' table of each step's scales, and its coefficients */
static double *step_table(const cmlp_optim *o) { return (double *)o->d_parts + CMLP_PART_ARGS * o->nparts; }
static float *part_coef(const cmlp_optim *o) {
    return (float *)((double *)o->d_parts + (CMLP_PART_ARGS + 2 * CMLP_MAX_RATES) * (size_t)o->nparts);
}

cmlp_part_settings cmlp_part_settings_inherit(void) { return (cmlp_part_settings){NAN, NAN, NAN, NAN, -1, -1, -1}; }

/* A part's settings, resolved: its own, else the configuration's. */
static double own_or(double own, double config) { return isnan(own) ? config : own; }
static int own_flag_or(int own, int config) { return own < 0 ? config : own; }
static double part_momentum(const cmlp_optim *o, const optim_part *p) {
    return own_or(p->s.momentum, o->kind == CMLP_OPTIM_ADAM ? o->adam.beta1 : o->sgd.momentum);
}
static double part_beta2(const cmlp_optim *o, const optim_part *p) { return own_or(p->s.beta2, o->adam.beta2); }
static double part_eps(const cmlp_optim *o, const optim_part *p) { return own_or(p->s.eps, o->adam.eps); }
static double part_dampening(const cmlp_optim *o, const optim_part *p) {
    return own_or(p->s.dampening, o->sgd.dampening);
}
static int part_nesterov(const cmlp_optim *o, const optim_part *p) {
    return own_flag_or(p->s.nesterov, o->sgd.nesterov);
}
static int part_maximize(const cmlp_optim *o, const optim_part *p) {
    return own_flag_or(p->s.maximize, o->kind == CMLP_OPTIM_ADAM ? o->adam.maximize : o->sgd.maximize);
}
static int part_amsgrad(const cmlp_optim *o, const optim_part *p) {
    return o->kind == CMLP_OPTIM_ADAM && own_flag_or(p->s.amsgrad, o->adam.amsgrad);
}
/* Whether a step with these settings takes AMSGrad's maximum somewhere. */
static bool any_amsgrad(const cmlp_optim *o) {
    bool on = o->kind == CMLP_OPTIM_ADAM && o->nparts == 0 && o->adam.amsgrad;
    for (int i = 0; i < o->nparts && !on; i++) on = part_amsgrad(o, &o->parts[i]);
    return on;
}
size_t cmlp_optim_parts_bytes(int n) { return parts_bytes(n); }

cmlp_adam_config cmlp_adam_defaults(void) { return (cmlp_adam_config){1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 0, 0}; }
cmlp_sgd_config cmlp_sgd_defaults(void) { return (cmlp_sgd_config){0.01, 0.0, 0.0, 0.0, 0, 0}; }

/* Adam's weight decay as the backends take it: L2 (added to the gradient), or with decoupled
 * weight decay none (the parameters are first multiplied by torch's AdamW factor,
 * 1 - lr * weight_decay, formed in double and applied in float). */
static float adam_l2(const cmlp_adam_config *c) { return c->decoupled_weight_decay ? 0.0f : (float)c->weight_decay; }
/* The same weight decay as a step on the device takes it (cmlp_rate_src: 0 for none). */
static double adam_decoupled_wd(const cmlp_adam_config *c) {
    return c->decoupled_weight_decay ? c->weight_decay : 0.0;
}

/* A hyperparameter >= 0 (PyTorch's check) that stays finite in float32, where the update
 * computes with it: an inf or overflowing value would only turn the parameters into inf or NaN. */
static cmlp_status check_real(const char *what, double v) {
    if (!(v >= 0.0 && v <= FLT_MAX))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid %s: %g (must be >= 0 and finite in float32)", what, v);
    return CMLP_OK;
}

static cmlp_status optim_new(cmlp_optim **out, cmlp_model *m, cmlp_optim_kind kind) {
    if (!out || !m) return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer and model must not be NULL");
    cmlp_optim *o = calloc(1, sizeof *o);
    if (!o) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory creating the optimizer");
    o->kind = kind;
    o->model = m;
    o->dev = m->dev;
    *out = o;
    return CMLP_OK;
}

static cmlp_status check_adam(const cmlp_adam_config *c) {
    CMLP_TRY(check_real("learning rate", c->lr));
    CMLP_TRY(check_real("epsilon value", c->eps));
    if (!(c->beta1 >= 0.0 && c->beta1 < 1.0))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid beta parameter at index 0: %g (must be in [0, 1))", c->beta1);
    if (!(c->beta2 >= 0.0 && c->beta2 < 1.0))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid beta parameter at index 1: %g (must be in [0, 1))", c->beta2);
    if ((c->amsgrad != 0 && c->amsgrad != 1) || (c->maximize != 0 && c->maximize != 1))
        return CMLP_FAIL(CMLP_ERR_INVALID, "amsgrad and maximize must be 0 or 1, got %d and %d", c->amsgrad,
                         c->maximize);
    return check_real("weight_decay value", c->weight_decay);
}

static cmlp_status check_sgd(const cmlp_sgd_config *c) {
    CMLP_TRY(check_real("learning rate", c->lr));
    CMLP_TRY(check_real("momentum value", c->momentum));
    CMLP_TRY(check_real("weight_decay value", c->weight_decay));
    if (!(fabs(c->dampening) <= FLT_MAX))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid dampening value: %g (must be finite in float32)", c->dampening);
    if (c->maximize != 0 && c->maximize != 1)
        return CMLP_FAIL(CMLP_ERR_INVALID, "maximize must be 0 or 1, got %d", c->maximize);
    return CMLP_OK;
}

/* torch checks Nesterov's needs when the optimizer is made only: a schedule may later take the
 * momentum to 0 (OneCycleLR), and the steps are then plain SGD's */
static cmlp_status check_nesterov(const cmlp_sgd_config *c) {
    if (c->nesterov && (c->momentum <= 0.0 || c->dampening != 0.0))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Nesterov momentum requires a momentum and zero dampening");
    return CMLP_OK;
}

cmlp_status cmlp_optim_init_adam(cmlp_optim **out, cmlp_model *m, const cmlp_adam_config *c) {
    if (!c) return CMLP_FAIL(CMLP_ERR_INVALID, "config must not be NULL");
    CMLP_TRY(check_adam(c));
    CMLP_TRY(optim_new(out, m, CMLP_OPTIM_ADAM));
    (*out)->adam = *c;
    return CMLP_OK;
}

cmlp_status cmlp_optim_init_sgd(cmlp_optim **out, cmlp_model *m, const cmlp_sgd_config *c) {
    if (!c) return CMLP_FAIL(CMLP_ERR_INVALID, "config must not be NULL");
    CMLP_TRY(check_sgd(c));
    CMLP_TRY(check_nesterov(c));
    CMLP_TRY(optim_new(out, m, CMLP_OPTIM_SGD));
    (*out)->sgd = *c;
    return CMLP_OK;
}

static void free_device_parts(cmlp_optim *o) {
    if (!o->d_parts) return;
    if (o->d_parts_dev->device.type == CMLP_DEVICE_CPU) free(o->d_parts);
    else (void)cmlp_allocator_free(o->d_parts_dev->alloc, o->d_parts);
    o->d_parts = NULL;
    o->d_parts_dev = NULL;
}

void cmlp_optim_free(cmlp_optim *o) {
    if (!o) return;
    if (o->state) (void)cmlp_allocator_free(o->dev->alloc, o->state);
    if (o->vmax) (void)cmlp_allocator_free(o->dev->alloc, o->vmax);
    free_device_parts(o);
    free(o->parts);
    free(o);
}

cmlp_optim_kind cmlp_optim_get_kind(const cmlp_optim *o) { return o->kind; }
int64_t cmlp_optim_get_step(const cmlp_optim *o) { return o->step; }
double cmlp_optim_get_lr(const cmlp_optim *o) { return o->kind == CMLP_OPTIM_ADAM ? o->adam.lr : o->sgd.lr; }

cmlp_status cmlp_optim_set_lr(cmlp_optim *o, double lr) {
    CMLP_TRY(check_real("learning rate", lr));
    CMLP_TRY(cmlp_optim_check_rate(o, lr));
    /* no new version: a step on a device reads the rate there (cmlp_dscalars), so a captured
     * step stays valid at any rate */
    *(o->kind == CMLP_OPTIM_ADAM ? &o->adam.lr : &o->sgd.lr) = lr;
    return CMLP_OK;
}

cmlp_status cmlp_optim_check_rate(const cmlp_optim *o, double lr) {
    for (int i = 0; i < o->nparts; i++)
        if (!(lr * o->parts[i].lr_scale <= FLT_MAX))
            return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid learning rate: %g, whose parameter group at %g times it steps "
                                               "at %g (must be finite in float32)", lr, o->parts[i].lr_scale,
                             lr * o->parts[i].lr_scale);
    return CMLP_OK;
}

double cmlp_optim_get_momentum(const cmlp_optim *o) {
    return o->kind == CMLP_OPTIM_ADAM ? o->adam.beta1 : o->sgd.momentum;
}

cmlp_status cmlp_optim_set_momentum(cmlp_optim *o, double momentum) {
    if (o->kind == CMLP_OPTIM_ADAM) {
        if (!(momentum >= 0.0 && momentum < 1.0))
            return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid beta parameter at index 0: %g (must be in [0, 1))", momentum);
        o->adam.beta1 = momentum;
    } else {
        CMLP_TRY(check_real("momentum value", momentum));
        o->sgd.momentum = momentum;
    }
    return CMLP_OK; /* no new version: a step on a device reads it there (cmlp_dscalars) */
}

/* Buffers a step with these settings uses: Adam's exp_avg and exp_avg_sq, and max_exp_avg_sq
 * with AMSGrad (any group's); SGD's momentum buffer while it has momentum (any group's). */
static int buffers_needed(const cmlp_optim *o) {
    if (o->kind == CMLP_OPTIM_ADAM) return any_amsgrad(o) ? 3 : 2;
    bool momentum = o->momentum_ahead || (o->nparts == 0 && o->sgd.momentum != 0.0); /* or any group's */
    for (int i = 0; i < o->nparts && !momentum; i++) momentum = part_momentum(o, &o->parts[i]) != 0.0;
    return momentum ? 1 : 0;
}

/* The arena's buffers (Adam's exp_avg and exp_avg_sq, SGD's momentum buffer), and those held. */
static int arena_buffers(const cmlp_optim *o) { return o->kind == CMLP_OPTIM_ADAM ? 2 : 1; }
static int held(const cmlp_optim *o) { return (o->state ? arena_buffers(o) : 0) + (o->vmax != NULL); }

/* Buffers this optimizer keeps once it has stepped: those its state holds, which stay when the
 * settings stop using them (SGD's momentum buffer at momentum 0, AMSGrad's maximum when amsgrad
 * is turned off: torch keeps them in its state, and they serve again when the setting comes
 * back), and those the next step needs. */
static int buffers_of(const cmlp_optim *o) {
    int need = buffers_needed(o), have = held(o);
    return have > need ? have : need;
}

/* AMSGrad is on (somewhere) and its maximum not made yet. */
static bool vmax_missing(const cmlp_optim *o) { return !o->vmax && any_amsgrad(o); }

/* A step skipped on the device (inf/NaN under loss scaling) may have made the state; it holds
 * zeros and counts only once a step was taken, as PyTorch makes state at the first step. */
int cmlp_optim_num_buffers(const cmlp_optim *o) { return o->state && o->step > 0 && !o->unused ? held(o) : 0; }

int cmlp_optim_buffers_planned(const cmlp_optim *o) { return buffers_of(o); }

int cmlp_optim_num_parts(const cmlp_optim *o) { return o->nparts; }

void cmlp_optim_expect_momentum(cmlp_optim *o, bool on) { o->momentum_ahead = on; }

/* AMSGrad's running maximum of exp_avg_sq from k, NULL where the step takes none (on: amsgrad
 * there) */
static float *amsgrad_max(const cmlp_optim *o, bool on, int64_t k) { return on && o->vmax ? o->vmax + k : NULL; }

cmlp_status cmlp_optim_configure_adam(cmlp_optim *o, const cmlp_adam_config *c) {
    if (o->kind != CMLP_OPTIM_ADAM) return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer is not Adam");
    CMLP_TRY(check_adam(c));
    cmlp_adam_config before = o->adam;
    o->adam = *c;
    o->version++;
    if (o->nparts && c->decoupled_weight_decay != before.decoupled_weight_decay) { /* the parts' decays move */
        void *d;
        bool fresh;
        cmlp_status st = upload_parts(o, o->parts, o->nparts, &d, &fresh);
        if (st != CMLP_OK) {
            o->adam = before;
            return st;
        }
        if (fresh) {
            free_device_parts(o);
            o->d_parts = d;
            o->d_parts_dev = o->dev;
        }
    }
    return CMLP_OK;
}

cmlp_status cmlp_optim_configure_sgd(cmlp_optim *o, const cmlp_sgd_config *c) {
    if (o->kind != CMLP_OPTIM_SGD) return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer is not SGD");
    CMLP_TRY(check_sgd(c));
    o->sgd = *c;
    o->version++;
    return CMLP_OK;
}

static cmlp_status check_model(const cmlp_optim *o) {
    if (o->model->dev != o->dev)
        return CMLP_FAIL(CMLP_ERR_STATE, "the model was moved to another device without its optimizer: "
                                         "use model.to(device) through the optimizer (optimizer.to(device))");
    return CMLP_OK;
}

/* Rank r's part: [r * chunk, (r + 1) * chunk) within the parameters (the last parts may be
 * short or empty). */
static void shard_range(const cmlp_optim *o, int r, int64_t *lo, int64_t *hi) {
    int64_t n = o->model->nparams;
    *lo = (int64_t)r * o->chunk < n ? (int64_t)r * o->chunk : n;
    *hi = *lo + o->chunk < n ? *lo + o->chunk : n;
}

/* A sharded optimizer steps with the process group its parts were cut for. */
static cmlp_status check_group(const cmlp_optim *o) {
    if (!cmlp_dist_initialized())
        return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer's state is sharded over a process group, and the group was "
                                         "destroyed");
    if (cmlp_dist_size() != o->shards || cmlp_dist_rank() != o->shard_rank)
        return CMLP_FAIL(CMLP_ERR_STATE,
                         "this optimizer's state is sharded as rank %d of %d, and this process is rank %d of %d now",
                         o->shard_rank, o->shards, cmlp_dist_rank(), cmlp_dist_size());
    return CMLP_OK;
}

cmlp_status cmlp_optim_shard(cmlp_optim *o, int on) {
    if (!o) return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer must not be NULL");
    if (o->state || o->step > 0)
        return CMLP_FAIL(CMLP_ERR_STATE, "the optimizer has stepped or holds state: shard it before its first step");
    if (!on) {
        o->shards = 0;
        o->version++;
        return CMLP_OK;
    }
    if (!cmlp_dist_initialized())
        return CMLP_FAIL(CMLP_ERR_STATE, "no process group: call cmlp.distributed.init_process_group() first");
    int w = cmlp_dist_size();
    o->chunk = cmlp_shard_chunk(o->model->nparams, w);
    o->shards = w;
    o->shard_rank = cmlp_dist_rank();
    shard_range(o, o->shard_rank, &o->lo, &o->hi);
    o->version++;
    return CMLP_OK;
}

int cmlp_optim_shards(const cmlp_optim *o, int64_t *lo, int64_t *hi, int64_t *chunk) {
    if (lo) *lo = first_of(o);
    if (hi) *hi = first_of(o) + span(o);
    if (chunk) *chunk = o->shards ? o->chunk : o->model->nparams;
    return o->shards;
}

/* A buffer of nb state buffers, new: Adam's arena zeros; SGD's momentum buffer all NaN and
 * AMSGrad's maximum (vmax) all CMLP_VMAX_UNSTARTED (not started anywhere). */
static cmlp_status zeros(cmlp_optim *o, int nb, bool vmax, float **out) {
    size_t bytes = state_bytes(o, nb);
    CMLP_TRY(cmlp_allocator_malloc(o->dev->alloc, bytes, "optimizer state", (void **)out));
    const cmlp_backend_i *b = o->dev->backend;
    cmlp_status st = vmax ? b->fill_byte(o->dev->bctx, *out, 0xBF, bytes)
                     : o->kind == CMLP_OPTIM_SGD ? b->fill_byte(o->dev->bctx, *out, 0xFF, bytes)
                                                 : b->fill_zero(o->dev->bctx, *out, bytes);
    if (st != CMLP_OK) {
        (void)cmlp_allocator_free(o->dev->alloc, *out);
        *out = NULL;
    }
    return st;
}

/* Whether the state a step with these settings needs is all there. */
static bool complete(const cmlp_optim *o) {
    return (o->state || buffers_needed(o) == 0) && !vmax_missing(o);
}

/* Makes the state a step needs: the arena at the first step, and AMSGrad's maximum at the first
 * step with amsgrad in any group (turned on later, it starts there, beside the arena as it is).
 * All or nothing: a maximum that cannot be made takes an arena made with it back. */
static cmlp_status ensure_state(cmlp_optim *o) {
    if (complete(o)) return CMLP_OK;
    bool fresh = false;
    if (!o->state && buffers_needed(o) > 0) {
        CMLP_TRY(zeros(o, arena_buffers(o), false, &o->state));
        o->unused = fresh = true;
        o->version++;
    }
    if (vmax_missing(o)) {
        cmlp_status st = zeros(o, 1, true, &o->vmax);
        if (st != CMLP_OK && fresh) {
            (void)cmlp_allocator_free(o->dev->alloc, o->state);
            o->state = NULL;
            o->unused = false;
        }
        CMLP_TRY(st);
        o->vmax_unused = true;
        o->version++;
    }
    return CMLP_OK;
}

/* A sharded step is a collective (its gather), checked before anything changes: the group is the
 * one its parts were cut for, the device's collectives are at hand, and the state it makes is
 * made on every rank or on none (a rank that cannot make its part does not leave the others
 * waiting). */
static cmlp_status ready_to_step(cmlp_optim *o, const void *dcomm) {
    if (!o->shards) return ensure_state(o);
    CMLP_TRY(check_group(o));
    if (o->dev->device.type != CMLP_DEVICE_CPU && !(dcomm && o->dev->backend->comm_all_gather))
        return CMLP_FAIL(CMLP_ERR_STATE, "a sharded optimizer on a device gathers its parts through the process "
                                         "group's device collectives (NCCL), in a data-parallel trainer");
    if (complete(o)) return CMLP_OK;
    bool had = o->state != NULL, had_vmax = o->vmax != NULL;
    cmlp_status st = cmlp_dist_agree(ensure_state(o));
    if (st != CMLP_OK) { /* another rank could not: none keeps what it made, and the next try agrees again */
        if (!had && o->state) {
            (void)cmlp_allocator_free(o->dev->alloc, o->state);
            o->state = NULL;
            o->unused = false;
            o->version++;
        }
        if (!had_vmax && o->vmax) {
            (void)cmlp_allocator_free(o->dev->alloc, o->vmax);
            o->vmax = NULL;
            o->version++;
        }
    }
    return st;
}

/* Every rank's part of the parameters to every rank, each sent by its owner (host memory through
 * MPI, device memory through the device collectives, on the stream: a capture records them). */
static cmlp_status gather(cmlp_optim *o, void *dcomm) {
    if (!o->shards) return CMLP_OK;
    cmlp_model *m = o->model;
    if (o->dev->device.type == CMLP_DEVICE_CPU) return cmlp_dist_all_gather(m->params, m->nparams, o->chunk, CMLP_COMM_F32);
    return o->dev->backend->comm_all_gather(o->dev->bctx, dcomm, m->params, m->nparams, o->chunk);
}

bool cmlp_optim_state_missing(const cmlp_optim *o) { return !complete(o) || (o->state && o->unused); }

cmlp_status cmlp_optim_prepare(cmlp_optim *o) {
    CMLP_TRY(check_model(o));
    return ensure_state(o);
}

bool cmlp_optim_has_state(const cmlp_optim *o) { return o->state != NULL; }

void cmlp_optim_drop_unused(cmlp_optim *o, bool arena) {
    if (o->vmax && o->vmax_unused) {
        (void)cmlp_allocator_free(o->dev->alloc, o->vmax);
        o->vmax = NULL;
        o->vmax_unused = false;
        o->version++;
    }
    if (!arena || !o->state || !o->unused) return;
    (void)cmlp_allocator_free(o->dev->alloc, o->state);
    if (o->vmax) (void)cmlp_allocator_free(o->dev->alloc, o->vmax);
    o->state = o->vmax = NULL;
    o->unused = false;
    o->version++;
}

uint64_t cmlp_optim_version(const cmlp_optim *o) { return o->version; }

static double config_weight_decay(const cmlp_optim *o) {
    return o->kind == CMLP_OPTIM_ADAM ? o->adam.weight_decay : o->sgd.weight_decay;
}

/* The parts a step takes: the parameter groups', or one part with the configuration's settings. */
static int parts_of(const cmlp_optim *o, const optim_part **out, optim_part *one) {
    if (o->nparts) {
        *out = o->parts;
        return o->nparts;
    }
    *one = (optim_part){o->model->nparams, 1.0, config_weight_decay(o), cmlp_part_settings_inherit()};
    *out = one;
    return 1;
}

/* Writes n parts' rate scales and decoupled weight decays where a step on the optimizer's device
 * reads them (d_parts), allocated there anew when it is missing, elsewhere or of another size;
 * *fresh says whether it was. On the CPU it is host memory of the optimizer's own, as the
 * optimizer's struct (a few bytes a part; the CPU's allocator holds tensors). On failure no new
 * buffer is kept, but a copy into the one in use may have written part of it (a device error). */
static cmlp_status upload_parts(cmlp_optim *o, const optim_part *parts, int n, void **out, bool *fresh) {
    bool adam = o->kind == CMLP_OPTIM_ADAM, decoupled = adam && o->adam.decoupled_weight_decay;
    size_t bytes = parts_bytes(n);
    double *args = malloc(CMLP_PART_ARGS * (size_t)n * sizeof(double));
    if (!args) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for the optimizer's parameter groups");
    for (int i = 0; i < n; i++) {
        args[CMLP_PART_ARGS * i] = parts[i].lr_scale;
        args[CMLP_PART_ARGS * i + 1] = decoupled ? parts[i].weight_decay : 0.0;
        args[CMLP_PART_ARGS * i + 2] = parts[i].s.momentum; /* NaN: the step's (cmlp_rate_src) */
        args[CMLP_PART_ARGS * i + 3] = parts[i].s.beta2;
    }
    *fresh = !o->d_parts || o->d_parts_dev != o->dev || o->nparts != n;
    void *d = *fresh ? NULL : o->d_parts;
    cmlp_status st = CMLP_OK;
    if (*fresh && o->dev->device.type == CMLP_DEVICE_CPU) {
        d = calloc(1, bytes);
        if (!d) st = CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for the optimizer's parameter groups");
    } else if (*fresh) {
        st = cmlp_allocator_malloc(o->dev->alloc, bytes, "optimizer param groups", &d);
    }
    if (st == CMLP_OK)
        st = o->dev->backend->copy_h2d(o->dev->bctx, d, args, CMLP_PART_ARGS * (size_t)n * sizeof(double));
    free(args);
    if (st != CMLP_OK && *fresh && d) {
        if (o->dev->device.type == CMLP_DEVICE_CPU) free(d);
        else (void)cmlp_allocator_free(o->dev->alloc, d);
    }
    if (st == CMLP_OK) *out = d;
    return st;
}

/* A part's own settings, checked as the configuration's are (NaN and -1: the configuration's). */
static cmlp_status check_part_settings(const cmlp_optim *o, int i, const cmlp_part_settings *s) {
    bool adam = o->kind == CMLP_OPTIM_ADAM;
    if ((s->nesterov < -1 || s->nesterov > 1) || (s->maximize < -1 || s->maximize > 1) ||
        (s->amsgrad < -1 || s->amsgrad > 1))
        return CMLP_FAIL(CMLP_ERR_INVALID, "parameter groups: part %d's nesterov, maximize and amsgrad must be -1, 0 "
                                           "or 1, got %d, %d and %d", i, s->nesterov, s->maximize, s->amsgrad);
    if (adam && !isnan(s->momentum) && !(s->momentum >= 0.0 && s->momentum < 1.0))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid beta parameter at index 0: %g (must be in [0, 1))", s->momentum);
    if (adam && !isnan(s->beta2) && !(s->beta2 >= 0.0 && s->beta2 < 1.0))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid beta parameter at index 1: %g (must be in [0, 1))", s->beta2);
    if (!adam && !isnan(s->momentum)) CMLP_TRY(check_real("momentum value", s->momentum));
    if (!isnan(s->eps)) CMLP_TRY(check_real("epsilon value", s->eps));
    if (!isnan(s->dampening) && !(fabs(s->dampening) <= FLT_MAX))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid dampening value: %g (must be finite in float32)", s->dampening);
    if (adam ? !isnan(s->dampening) || s->nesterov >= 0 : !isnan(s->beta2) || !isnan(s->eps) || s->amsgrad >= 0)
        return CMLP_FAIL(CMLP_ERR_INVALID, "parameter groups: part %d sets a setting %s does not have", i,
                         adam ? "Adam" : "SGD");
    return CMLP_OK;
}

/* Two parts stepped by the same launches: alike (NaN alike) but for what a step on the device reads
 * there (the rate's scale and the momentum). */
static bool same_real(double a, double b) { return a == b || (isnan(a) && isnan(b)); }
static bool same_launches(const optim_part *a, const optim_part *b) {
    return a->end == b->end && a->weight_decay == b->weight_decay && same_real(a->s.beta2, b->s.beta2) &&
           same_real(a->s.eps, b->s.eps) && same_real(a->s.dampening, b->s.dampening) &&
           a->s.nesterov == b->s.nesterov && a->s.maximize == b->s.maximize && a->s.amsgrad == b->s.amsgrad;
}

cmlp_status cmlp_optim_set_parts(cmlp_optim *o, int n, const int64_t *ends, const double *lr_scale,
                                 const double *weight_decay, const cmlp_part_settings *settings) {
    if (!o) return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer must not be NULL");
    if (n < 0 || n > CMLP_MAX_PARTS)
        return CMLP_FAIL(CMLP_ERR_INVALID, "parameter groups: %d parts (0 to %d)", n, CMLP_MAX_PARTS);
    if (n > 0 && (!ends || !lr_scale || !weight_decay))
        return CMLP_FAIL(CMLP_ERR_INVALID, "parameter groups: %d parts without their ends and settings", n);
    CMLP_TRY(check_model(o));
    int64_t total = o->model->nparams;
    for (int i = 0; i < n; i++) {
        int64_t begin = i ? ends[i - 1] : 0;
        if (!(ends[i] > begin && ends[i] <= total))
            return CMLP_FAIL(CMLP_ERR_INVALID, "parameter groups: part %d ends at %lld, after %lld, within %lld "
                                               "parameters", i, (long long)ends[i], (long long)begin, (long long)total);
        if (!(lr_scale[i] >= 0.0 && lr_scale[i] <= FLT_MAX && cmlp_optim_get_lr(o) * lr_scale[i] <= FLT_MAX))
            return CMLP_FAIL(CMLP_ERR_INVALID, "parameter groups: part %d's rate scale %g (a rate of %g) is not >= 0 "
                                               "and finite in float32", i, lr_scale[i], cmlp_optim_get_lr(o) * lr_scale[i]);
        CMLP_TRY(check_real("weight_decay value", weight_decay[i]));
        if (settings) CMLP_TRY(check_part_settings(o, i, &settings[i]));
    }
    if (n > 0 && ends[n - 1] != total)
        return CMLP_FAIL(CMLP_ERR_INVALID, "parameter groups: the parts end at %lld, not at the model's %lld "
                                           "parameters", (long long)ends[n - 1], (long long)total);
    /* the parts as given (merged, neighbours of the same scale would make other scales other launches) */
    int m = n;
    optim_part *parts = m ? malloc((size_t)m * sizeof *parts) : NULL;
    if (m && !parts) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for the optimizer's parameter groups");
    for (int i = 0; i < m; i++)
        parts[i] = (optim_part){ends[i], lr_scale[i], weight_decay[i],
                                settings ? settings[i] : cmlp_part_settings_inherit()};
    bool same = m == o->nparts; /* the same launches: a captured step stays valid */
    for (int i = 0; same && i < m; i++) same = same_launches(&parts[i], &o->parts[i]);
    void *d = NULL;
    bool fresh = false;
    if (m) {
        cmlp_status st = upload_parts(o, parts, m, &d, &fresh);
        if (st != CMLP_OK) {
            free(parts);
            return st;
        }
    }
    if (!m || fresh) free_device_parts(o);
    if (m) {
        o->d_parts = d;
        o->d_parts_dev = o->dev;
    }
    free(o->parts);
    o->parts = m ? parts : NULL;
    o->nparts = m;
    if (!m) free(parts);
    if (!same) o->version++;
    return CMLP_OK;
}

/* FNV-1a over 8-byte words. */
static uint64_t mix(uint64_t h, const void *word) {
    const unsigned char *b = word;
    for (int i = 0; i < 8; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

uint64_t cmlp_optim_fingerprint(const cmlp_optim *o) {
    int64_t ints[3] = {(int64_t)o->kind, o->step,
                       (int64_t)o->shards * 32 + (int64_t)o->sgd.maximize * 16 + (int64_t)o->adam.maximize * 8 +
                           (int64_t)o->adam.amsgrad * 4 + (int64_t)o->sgd.nesterov * 2 +
                           (int64_t)o->adam.decoupled_weight_decay};
    double reals[10] = {o->adam.lr, o->adam.beta1,       o->adam.beta2,   o->adam.eps,      o->adam.weight_decay,
                        o->sgd.lr,  o->sgd.momentum,     o->sgd.dampening, o->sgd.weight_decay, 0.0};
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < 3; i++) h = mix(h, &ints[i]);
    for (int i = 0; i < 10; i++) h = mix(h, &reals[i]);
    for (int i = 0; i < o->nparts; i++) { /* parameter groups */
        h = mix(h, &o->parts[i].end);
        h = mix(h, &o->parts[i].lr_scale);
        h = mix(h, &o->parts[i].weight_decay);
        const cmlp_part_settings *s = &o->parts[i].s;
        double own[4] = {s->momentum, s->beta2, s->eps, s->dampening};
        int64_t flags = (int64_t)(s->amsgrad + 1) * 16 + (int64_t)(s->nesterov + 1) * 4 + (s->maximize + 1);
        for (int k = 0; k < 4; k++) h = mix(h, &own[k]);
        h = mix(h, &flags);
    }
    return h;
}

cmlp_status cmlp_optim_step(cmlp_optim *o) {
    if (!o) return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer must not be NULL");
    if (o->shards)
        return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer's state is sharded over the process group: it steps in a "
                                         "data-parallel trainer (cmlp.Trainer), which sums the gradients over the "
                                         "ranks first");
    return cmlp_optim_step_summed(o);
}

cmlp_status cmlp_optim_step_summed(cmlp_optim *o) { return cmlp_optim_step_summed_at(o, NULL, NULL); }

cmlp_status cmlp_optim_load_step_scales(cmlp_optim *o, const double *scales, const double *momenta, int64_t nsteps) {
    if (!o->nparts || !o->d_parts)
        return CMLP_FAIL(CMLP_ERR_STATE, "per-step scales need the optimizer's parameter-group parts");
    if (nsteps < 1 || nsteps > CMLP_MAX_RATES)
        return CMLP_FAIL(CMLP_ERR_INVALID, "1 to %d steps' scales, got %lld", CMLP_MAX_RATES, (long long)nsteps);
    CMLP_TRY(check_model(o));
    size_t n = (size_t)nsteps * (size_t)o->nparts;
    double *pairs = malloc(2 * n * sizeof(double));
    if (!pairs) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for the optimizer's per-step scales");
    for (size_t i = 0; i < n; i++) {
        pairs[2 * i] = scales[i];
        pairs[2 * i + 1] = momenta ? momenta[i] : NAN; /* NaN: the part's own, or the step's */
    }
    cmlp_status st = o->dev->backend->copy_h2d(o->dev->bctx, step_table(o), pairs, 2 * n * sizeof(double));
    free(pairs);
    return st;
}

cmlp_status cmlp_optim_step_summed_at(cmlp_optim *o, const double *scales, const double *momenta) {
    CMLP_TRY(check_model(o));
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
    CMLP_TRY(ready_to_step(o, NULL));
    cmlp_model *m = o->model;
    const cmlp_backend_i *b = o->dev->backend;
    int64_t n = span(o), at = first_of(o), t = o->step + 1;
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st = CMLP_OK;
    const optim_part *parts;
    optim_part one;
    int np = parts_of(o, &parts, &one);
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
                         dec ? (float)(1.0 - lr * wd) : 1.0f, part_maximize(o, pt), NULL, NULL);
        } else {
            const cmlp_sgd_config *c = &o->sgd;
            st = b->sgd(o->dev->bctx, m->params + lo, m->grads + lo, o->state ? o->state + k : NULL, hi - lo,
                        (float)(c->lr * (scales && o->nparts ? scales[i] : pt->lr_scale)), (float)mom,
                        (float)(1.0 - part_dampening(o, pt)), part_nesterov(o, pt), (float)wd, part_maximize(o, pt),
                        NULL, NULL);
        }
    }
    if (st == CMLP_OK) st = gather(o, NULL);
    if (st == CMLP_OK) st = cmlp_model_refresh_half(m);
    cmlp_fpenv_leave(&fe);
    if (st == CMLP_OK) {
        o->step = t;
        o->unused = o->vmax_unused = false;
    }
    return st;
}

cmlp_status cmlp_optim_get_buffer(const cmlp_optim *o, int i, float *host_out) {
    if (i < 0 || i >= cmlp_optim_num_buffers(o))
        return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer buffer %d does not exist (%d kept)", i, cmlp_optim_num_buffers(o));
    size_t n = (size_t)span(o), at = (size_t)first_of(o), all = (size_t)o->model->nparams;
    if (o->shards) { /* the other ranks' parts are theirs */
        memset(host_out, 0, at * sizeof(float));
        memset(host_out + at + n, 0, (all - at - n) * sizeof(float));
    }
    const float *src = i < arena_buffers(o) ? o->state + (size_t)i * n : o->vmax;
    return o->dev->backend->copy_d2h(o->dev->bctx, host_out + at, src, n * sizeof(float));
}

cmlp_status cmlp_optim_step_device(cmlp_optim *o, const float *d_found_inf, int64_t *d_step, float *d_coef,
                                   const double *d_rates, int64_t *d_lr_next, int64_t *d_pos, int64_t pos_add,
                                   const cmlp_scale_step *scale, int step_scales, void *dcomm) {
    CMLP_TRY(check_model(o));
    CMLP_TRY(ready_to_step(o, dcomm));
    bool first = o->unused; /* the state was made for this step (SGD's buffer all NaN, not started) */
    cmlp_model *m = o->model;
    const cmlp_backend_i *b = o->dev->backend;
    void *ctx = o->dev->bctx;
    int64_t n = span(o), at = first_of(o);
    float *p = m->params + at;
    const float *g = m->grads + at;
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
                             part_maximize(o, pt), d_found_inf, pc);
            } else {
                /* the momentum is the device's (pc); the host's tells the launch whether it may be 0 */
                st = b->sgd(ctx, m->params + lo, m->grads + lo, o->state ? o->state + k : NULL, hi - lo, 0.0f,
                            (float)part_momentum(o, pt), (float)(1.0 - part_dampening(o, pt)), part_nesterov(o, pt),
                            wd, part_maximize(o, pt), d_found_inf, pc);
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
                         d_found_inf, d_coef);
    } else {
        const cmlp_sgd_config *c = &o->sgd;
        st = b->optim_prepare(ctx, d_step, d_coef, d_found_inf, &rate, 0.0, 0, d_pos, pos_add, scale);
        if (st == CMLP_OK)
            st = b->sgd(ctx, p, g, o->state, n, 0.0f, (float)c->momentum, (float)(1.0 - c->dampening), c->nesterov,
                        (float)c->weight_decay, c->maximize, d_found_inf, d_coef);
    }
    if (st == CMLP_OK) st = gather(o, dcomm);
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

void cmlp_optim_set_step(cmlp_optim *o, int64_t step) { o->step = step; }

cmlp_status cmlp_optim_set_state(cmlp_optim *o, int64_t step, int nbuffers, const float *const *host) {
    if (step < 0) return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer step count must be >= 0, got %lld", (long long)step);
    /* Adam: exp_avg and exp_avg_sq, and max_exp_avg_sq (AMSGrad's, kept when it is turned off);
     * SGD: its momentum buffer, kept at momentum 0 too */
    const bool adam = o->kind == CMLP_OPTIM_ADAM;
    if (adam ? nbuffers != 0 && nbuffers != 2 && nbuffers != 3 : nbuffers != 0 && nbuffers != 1)
        return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer state has %d buffers; this optimizer keeps %s", nbuffers,
                         adam ? "2 (3 with AMSGrad)" : "1");
    CMLP_TRY(check_model(o));
    size_t all = (size_t)o->model->nparams, n = (size_t)span(o), at = (size_t)first_of(o);
    for (int i = 0; i < nbuffers; i++) /* SGD's NaN: a buffer not started there */
        for (size_t j = 0; j < all; j++)
            if (adam ? !isfinite(host[i][j]) : isinf(host[i][j]))
                return CMLP_FAIL(CMLP_ERR_NONFINITE, "optimizer state buffer %d holds %s at %zu", i,
                                 adam ? "NaN or inf" : "inf", j);
    float *s = NULL, *x = NULL;
    const int arena = nbuffers < arena_buffers(o) ? nbuffers : arena_buffers(o);
    cmlp_status st = CMLP_OK;
    if (arena) st = cmlp_allocator_malloc(o->dev->alloc, state_bytes(o, arena), "optimizer state", (void **)&s);
    if (st == CMLP_OK && nbuffers > arena) /* AMSGrad's maximum */
        st = cmlp_allocator_malloc(o->dev->alloc, state_bytes(o, 1), "optimizer state", (void **)&x);
    for (int i = 0; i < nbuffers && st == CMLP_OK; i++) /* sharded: this rank's part of each */
        st = o->dev->backend->copy_h2d(o->dev->bctx, i < arena ? s + (size_t)i * n : x, host[i] + at,
                                       n * sizeof(float));
    if (st != CMLP_OK) {
        if (s) (void)cmlp_allocator_free(o->dev->alloc, s);
        if (x) (void)cmlp_allocator_free(o->dev->alloc, x);
        return st;
    }
    if (o->state) (void)cmlp_allocator_free(o->dev->alloc, o->state);
    if (o->vmax) (void)cmlp_allocator_free(o->dev->alloc, o->vmax);
    o->state = s;
    o->vmax = x;
    o->unused = o->vmax_unused = false;
    /* SGD keeps no count of its own: a loaded momentum buffer means it has stepped, so the next
     * step continues it (a step count of 0 would make the next step its first) */
    o->step = o->kind == CMLP_OPTIM_SGD && nbuffers && step == 0 ? 1 : step;
    o->version++;
    return CMLP_OK;
}

cmlp_status cmlp_optim_to(cmlp_optim *o, cmlp_device d) {
    cmlp_device_ctx *to;
    CMLP_TRY(cmlp_device_get(d, &to));
    if (to == o->dev) return CMLP_OK;
    cmlp_device_ctx *from = o->dev;
    void *dp = NULL;
    bool fresh = false;
    if (o->nparts) { /* the parameter groups' settings, written there first */
        o->dev = to;
        cmlp_status st = upload_parts(o, o->parts, o->nparts, &dp, &fresh);
        o->dev = from;
        CMLP_TRY(st);
    }
    /* both state buffers are copied before either source goes (all or nothing) */
    void *s = NULL, *x = NULL;
    cmlp_status st =
        cmlp_buffer_copy(o->dev, to, o->state, state_bytes(o, arena_buffers(o)), "optimizer state", &s);
    if (st == CMLP_OK) st = cmlp_buffer_copy(o->dev, to, o->vmax, state_bytes(o, 1), "optimizer state", &x);
    if (st != CMLP_OK) {
        if (s) (void)cmlp_allocator_free(to->alloc, s);
        if (dp && to->device.type == CMLP_DEVICE_CPU) free(dp);
        else if (dp) (void)cmlp_allocator_free(to->alloc, dp);
        return st;
    }
    if (o->state) (void)cmlp_allocator_free(o->dev->alloc, o->state);
    if (o->vmax) (void)cmlp_allocator_free(o->dev->alloc, o->vmax);
    o->state = s;
    o->vmax = x;
    if (o->nparts) {
        free_device_parts(o);
        o->d_parts = dp;
        o->d_parts_dev = to;
    }
    o->dev = to;
    o->version++;
    return CMLP_OK;
}
