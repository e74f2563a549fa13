/* optim.c - Adam and SGD: their settings, checked as PyTorch checks them, and their state over
 * the model's flat buffers (one arena: Adam's exp_avg and exp_avg_sq, or SGD's momentum buffer;
 * and AMSGrad's max_exp_avg_sq in a buffer of its own), created at the first step that needs it;
 * a step that cannot allocate it changes nothing. The steps are in optim_step.c.
 */
#include "optim_internal.h"
#include "comm.h"

#include <float.h>
#include <stddef.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

cmlp_part_settings cmlp_part_settings_inherit(void) { return (cmlp_part_settings){NAN, NAN, NAN, NAN, -1, -1, -1}; }

/* Whether a step with these settings takes AMSGrad's maximum somewhere. */
static bool any_amsgrad(const cmlp_optim *o) {
    bool on = o->kind == CMLP_OPTIM_ADAM && o->nparts == 0 && o->adam.amsgrad;
    for (int i = 0; i < o->nparts && !on; i++) on = part_amsgrad(o, &o->parts[i]);
    return on;
}

size_t cmlp_optim_parts_bytes(int n) { return parts_bytes(n); }

cmlp_adam_config cmlp_adam_defaults(void) { return (cmlp_adam_config){1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 0, 0}; }
cmlp_sgd_config cmlp_sgd_defaults(void) { return (cmlp_sgd_config){0.01, 0.0, 0.0, 0.0, 0, 0}; }

/* A hyperparameter >= 0 (PyTorch's check) that stays finite in float32, where the update
 * computes with it: an inf or overflowing value would only turn the parameters into inf or NaN. */
cmlp_status cmlp_optim_check_real(const char *what, double v) {
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
    CMLP_TRY(cmlp_optim_check_real("learning rate", c->lr));
    CMLP_TRY(cmlp_optim_check_real("epsilon value", c->eps));
    if (!(c->beta1 >= 0.0 && c->beta1 < 1.0))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid beta parameter at index 0: %g (must be in [0, 1))", c->beta1);
    if (!(c->beta2 >= 0.0 && c->beta2 < 1.0))
        return CMLP_FAIL(CMLP_ERR_INVALID, "Invalid beta parameter at index 1: %g (must be in [0, 1))", c->beta2);
    if ((c->amsgrad != 0 && c->amsgrad != 1) || (c->maximize != 0 && c->maximize != 1))
        return CMLP_FAIL(CMLP_ERR_INVALID, "amsgrad and maximize must be 0 or 1, got %d and %d", c->amsgrad,
                         c->maximize);
    return cmlp_optim_check_real("weight_decay value", c->weight_decay);
}

static cmlp_status check_sgd(const cmlp_sgd_config *c) {
    CMLP_TRY(cmlp_optim_check_real("learning rate", c->lr));
    CMLP_TRY(cmlp_optim_check_real("momentum value", c->momentum));
    CMLP_TRY(cmlp_optim_check_real("weight_decay value", c->weight_decay));
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

void cmlp_optim_free(cmlp_optim *o) {
    if (!o) return;
    if (o->state) (void)cmlp_allocator_free(o->dev->alloc, o->state);
    if (o->vmax) (void)cmlp_allocator_free(o->dev->alloc, o->vmax);
    cmlp_optim_free_device_parts(o);
    free(o->parts);
    free(o);
}

cmlp_optim_kind cmlp_optim_get_kind(const cmlp_optim *o) { return o->kind; }
int64_t cmlp_optim_get_step(const cmlp_optim *o) { return o->step; }
double cmlp_optim_get_lr(const cmlp_optim *o) { return o->kind == CMLP_OPTIM_ADAM ? o->adam.lr : o->sgd.lr; }

cmlp_status cmlp_optim_set_lr(cmlp_optim *o, double lr) {
    CMLP_TRY(cmlp_optim_check_real("learning rate", lr));
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
        CMLP_TRY(cmlp_optim_check_real("momentum value", momentum));
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

int cmlp_optim_buffers_held(const cmlp_optim *o) { return held(o); }

int cmlp_optim_num_parts(const cmlp_optim *o) { return o->nparts; }

int cmlp_optim_parts_on_device(const cmlp_optim *o) {
    return o->d_parts && o->d_parts_dev == o->dev && o->dev->device.type != CMLP_DEVICE_CPU;
}

void cmlp_optim_expect_momentum(cmlp_optim *o, bool on) { o->momentum_ahead = on; }

cmlp_status cmlp_optim_configure_adam(cmlp_optim *o, const cmlp_adam_config *c) {
    if (!o || !c) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (o->kind != CMLP_OPTIM_ADAM) return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer is not Adam");
    CMLP_TRY(check_adam(c));
    CMLP_TRY(cmlp_optim_check_rate(o, c->lr));
    cmlp_adam_config before = o->adam;
    o->adam = *c;
    o->version++;
    if (o->nparts && c->decoupled_weight_decay != before.decoupled_weight_decay) { /* the parts' decays move */
        void *d;
        bool fresh;
        cmlp_status st = cmlp_optim_upload_parts(o, o->parts, o->nparts, &d, &fresh);
        if (st != CMLP_OK) {
            o->adam = before;
            return st;
        }
        if (fresh) {
            cmlp_optim_free_device_parts(o);
            o->d_parts = d;
            o->d_parts_dev = o->dev;
        }
    }
    return CMLP_OK;
}

cmlp_status cmlp_optim_configure_sgd(cmlp_optim *o, const cmlp_sgd_config *c) {
    if (!o || !c) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (o->kind != CMLP_OPTIM_SGD) return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer is not SGD");
    CMLP_TRY(check_sgd(c));
    CMLP_TRY(cmlp_optim_check_rate(o, c->lr));
    o->sgd = *c;
    o->version++;
    return CMLP_OK;
}

/* An optimizer made while its model moved (in another thread) may be on the device the model
 * left; one that holds no state yet follows the model there (its parameter groups' settings,
 * all it has, go with it). One with state was left behind by a move made around it. */
cmlp_status cmlp_optim_check_model(cmlp_optim *o) {
    if (o->model->dev == o->dev) return CMLP_OK;
    if (!o->state && !o->vmax) return cmlp_optim_to(o, cmlp_model_device(o->model));
    return CMLP_FAIL(CMLP_ERR_STATE, "the model was moved to another device without its optimizer, whose state "
                                     "stayed on the device it left (model.to(device) moves every optimizer made "
                                     "for the model along)");
}

/* A buffer of nb state buffers, new: Adam's arena zeros; SGD's momentum buffer all
 * CMLP_MOMENTUM_UNSTARTED_BITS and AMSGrad's maximum (vmax) all CMLP_VMAX_UNSTARTED (not started
 * anywhere): bytes 0xFF and 0xBF. */
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
cmlp_status cmlp_optim_ready(cmlp_optim *o, const void *dcomm) {
    if (!o->shards) return ensure_state(o);
    CMLP_TRY(cmlp_optim_check_group(o));
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

bool cmlp_optim_state_missing(const cmlp_optim *o) { return !complete(o) || (o->state && o->unused); }

cmlp_status cmlp_optim_prepare(cmlp_optim *o) {
    CMLP_TRY(cmlp_optim_check_model(o));
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

uint64_t cmlp_optim_fingerprint(const cmlp_optim *o) {
    /* SGD's count changes no update, and its state_dict keeps none (torch's): a load sets it to 0, or to 1
     * where a momentum buffer comes with it */
    int64_t ints[3] = {(int64_t)o->kind, o->kind == CMLP_OPTIM_ADAM ? o->step : 0,
                       (int64_t)o->shards * 32 + (int64_t)o->sgd.maximize * 16 + (int64_t)o->adam.maximize * 8 +
                           (int64_t)o->adam.amsgrad * 4 + (int64_t)o->sgd.nesterov * 2 +
                           (int64_t)o->adam.decoupled_weight_decay};
    double reals[10] = {o->adam.lr, o->adam.beta1,       o->adam.beta2,   o->adam.eps,      o->adam.weight_decay,
                        o->sgd.lr,  o->sgd.momentum,     o->sgd.dampening, o->sgd.weight_decay, 0.0};
    uint64_t h = 1469598103934665603ull;
    h = cmlp_hash_bytes(h, ints, sizeof ints);
    h = cmlp_hash_bytes(h, reals, sizeof reals);
    for (int i = 0; i < o->nparts; i++) { /* parameter groups */
        h = cmlp_hash_bytes(h, &o->parts[i].end, sizeof o->parts[i].end);
        h = cmlp_hash_bytes(h, &o->parts[i].lr_scale, sizeof o->parts[i].lr_scale);
        h = cmlp_hash_bytes(h, &o->parts[i].weight_decay, sizeof o->parts[i].weight_decay);
        const cmlp_part_settings *s = &o->parts[i].s;
        double own[4] = {s->momentum, s->beta2, s->eps, s->dampening};
        int64_t flags = (int64_t)(s->amsgrad + 1) * 16 + (int64_t)(s->nesterov + 1) * 4 + (s->maximize + 1);
        h = cmlp_hash_bytes(h, own, sizeof own);
        h = cmlp_hash_bytes(h, &flags, sizeof flags);
    }
    return h;
}

bool *cmlp_optim_written(cmlp_optim *o) { return &o->written; }

cmlp_status cmlp_optim_state_hash(const cmlp_optim *o, uint64_t *h) {
    if (o->shards) return CMLP_OK;
    int nb = cmlp_optim_num_buffers(o);
    if (nb > 0 && o->vmax && o->vmax_unused) nb--; /* (the maximum is last) */
    const size_t n = (size_t)span(o);
    *h = cmlp_hash_bytes(*h, &nb, sizeof nb);
    for (int i = 0; i < nb; i++) { /* AMSGrad's maximum: where a group has not started, any value < 0 */
        const bool vmax = i >= arena_buffers(o);
        CMLP_TRY(cmlp_buffer_hash(o->dev, vmax ? o->vmax : o->state + i * n, n * sizeof(float), vmax, h));
    }
    return CMLP_OK;
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

void cmlp_optim_set_step(cmlp_optim *o, int64_t step) { o->step = step; }

/* set_state, and copy_state (checked false: the values as they are) */
static cmlp_status put_state(cmlp_optim *o, int64_t step, int nbuffers, const float *const *host, bool checked) {
    /* below 2**53: a float64 holds the count exactly (the state_dict's), and no step can overflow it */
    if (step < 0 || step >= ((int64_t)1 << 53))
        return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer step count must be in [0, 2**53), got %lld", (long long)step);
    /* Adam: exp_avg and exp_avg_sq, and max_exp_avg_sq (AMSGrad's, kept when it is turned off);
     * SGD: its momentum buffer, kept at momentum 0 too */
    const bool adam = o->kind == CMLP_OPTIM_ADAM;
    if (adam ? nbuffers != 0 && nbuffers != 2 && nbuffers != 3 : nbuffers != 0 && nbuffers != 1)
        return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer state has %d buffers; this optimizer keeps %s", nbuffers,
                         adam ? "2 (3 with AMSGrad)" : "1");
    CMLP_TRY(cmlp_optim_check_model(o));
    size_t all = (size_t)o->model->nparams, n = (size_t)span(o), at = (size_t)first_of(o);
    for (int i = 0; i < nbuffers && checked; i++) /* SGD's NaN: a buffer not started there, or holding NaN */
        for (size_t j = 0; j < all; j++)
            if (adam ? !isfinite(host[i][j]) : isinf(host[i][j]))
                return CMLP_FAIL(CMLP_ERR_NONFINITE, "optimizer state buffer %d holds %s at %zu", i,
                                 adam ? "NaN or inf" : "inf", j);
            else if (adam && i == 1 && host[i][j] < 0.0f) /* squares, whose root is taken (AMSGrad's maximum:
                                                             < 0 marks a group not started) */
                return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer state buffer 1 (exp_avg_sq) holds %g < 0 at %zu",
                                 (double)host[i][j], j);
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
    o->written = true;
    return CMLP_OK;
}

cmlp_status cmlp_optim_set_state(cmlp_optim *o, int64_t step, int nbuffers, const float *const *host) {
    return put_state(o, step, nbuffers, host, true);
}

cmlp_status cmlp_optim_copy_state(cmlp_optim *o, int64_t step, int nbuffers, const float *const *host) {
    return put_state(o, step, nbuffers, host, false);
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
        cmlp_status st = cmlp_optim_upload_parts(o, o->parts, o->nparts, &dp, &fresh);
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
        cmlp_optim_free_device_parts(o);
        o->d_parts = dp;
        o->d_parts_dev = to;
    }
    o->dev = to;
    o->version++;
    return CMLP_OK;
}

const cmlp_model *cmlp_optim_model(const cmlp_optim *o) { return o->model; }

cmlp_status cmlp_model_move(cmlp_model *m, cmlp_optim *const *opts, int nopts, cmlp_device d) {
    if (!m || nopts < 0 || (nopts && !opts))
        return CMLP_FAIL(CMLP_ERR_INVALID, "a model and nopts >= 0 optimizers are needed, got nopts %d", nopts);
    for (int i = 0; i < nopts; i++) {
        if (!opts[i]) return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer %d is NULL", i);
        if (opts[i]->model != m) return CMLP_FAIL(CMLP_ERR_STATE, "optimizer %d steps another model", i);
    }
    const cmlp_device from = cmlp_model_device(m);
    CMLP_TRY(cmlp_model_to(m, d));
    int moved = 0;
    cmlp_status st = CMLP_OK;
    while (moved < nopts && (st = cmlp_optim_to(opts[moved], d)) == CMLP_OK) moved++;
    if (st == CMLP_OK) return CMLP_OK;
    /* what moved goes back, with the first failure's message; the memory it left there may have
     * been taken meanwhile (by another model, or another process): then say where each one is */
    char why[2048];
    snprintf(why, sizeof why, "%s", cmlp_last_error());
    int stuck = 0;
    while (moved > 0) stuck += cmlp_optim_to(opts[--moved], from) != CMLP_OK;
    stuck += cmlp_model_to(m, from) != CMLP_OK;
    if (!stuck) {
        cmlp_restore_error(why);
        return st;
    }
    char where[128];
    int at = snprintf(where, sizeof where, "the model on %s, its optimizers on",
                      cmlp_model_device(m).type == CMLP_DEVICE_CUDA ? "cuda" : "cpu");
    for (int i = 0; i < nopts && at > 0 && (size_t)at < sizeof where; i++)
        at += snprintf(where + at, sizeof where - (size_t)at, " %s", opts[i]->dev == m->dev ? "the same" : "another");
    return CMLP_FAIL(CMLP_ERR_STATE, "%.1500s; and moving back failed too, which left %s: move them again", why, where);
}
