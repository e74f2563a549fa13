/* optim_parts.c - an optimizer's parameter groups: parts of the flat parameters, each with its
 * rate as a multiple of the optimizer's, its weight decay and its own settings, checked, and
 * kept where a step on the device reads them (with the table of a call's per-step scales).
 */
#include "optim_internal.h"

#include <float.h>
#include <stdlib.h>

static double config_weight_decay(const cmlp_optim *o) {
    return o->kind == CMLP_OPTIM_ADAM ? o->adam.weight_decay : o->sgd.weight_decay;
}

/* The parts a step takes: the parameter groups', or one part with the configuration's settings. */
int cmlp_optim_parts_of(const cmlp_optim *o, const optim_part **out, optim_part *one) {
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
cmlp_status cmlp_optim_upload_parts(cmlp_optim *o, const optim_part *parts, int n, void **out, bool *fresh) {
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
    if (!adam && !isnan(s->momentum)) CMLP_TRY(cmlp_optim_check_real("momentum value", s->momentum));
    if (!isnan(s->eps)) CMLP_TRY(cmlp_optim_check_real("epsilon value", s->eps));
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
    CMLP_TRY(cmlp_optim_check_model(o));
    int64_t total = o->model->nparams;
    for (int i = 0; i < n; i++) {
        int64_t begin = i ? ends[i - 1] : 0;
        if (!(ends[i] > begin && ends[i] <= total))
            return CMLP_FAIL(CMLP_ERR_INVALID, "parameter groups: part %d ends at %lld, after %lld, within %lld "
                                               "parameters", i, (long long)ends[i], (long long)begin, (long long)total);
        if (!(lr_scale[i] >= 0.0 && lr_scale[i] <= FLT_MAX && cmlp_optim_get_lr(o) * lr_scale[i] <= FLT_MAX))
            return CMLP_FAIL(CMLP_ERR_INVALID, "parameter groups: part %d's rate scale %g (a rate of %g) is not >= 0 "
                                               "and finite in float32", i, lr_scale[i], cmlp_optim_get_lr(o) * lr_scale[i]);
        CMLP_TRY(cmlp_optim_check_real("weight_decay value", weight_decay[i]));
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
        cmlp_status st = cmlp_optim_upload_parts(o, parts, m, &d, &fresh);
        if (st != CMLP_OK) {
            free(parts);
            return st;
        }
    }
    if (!m || fresh) cmlp_optim_free_device_parts(o);
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

cmlp_status cmlp_optim_load_step_scales(cmlp_optim *o, const double *scales, const double *momenta, int64_t nsteps) {
    if (!o->nparts || !o->d_parts)
        return CMLP_FAIL(CMLP_ERR_STATE, "per-step scales need the optimizer's parameter-group parts");
    if (nsteps < 1 || nsteps > CMLP_MAX_RATES)
        return CMLP_FAIL(CMLP_ERR_INVALID, "1 to %d steps' scales, got %lld", CMLP_MAX_RATES, (long long)nsteps);
    CMLP_TRY(cmlp_optim_check_model(o));
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

void cmlp_optim_free_device_parts(cmlp_optim *o) {
    if (!o->d_parts) return;
    if (o->d_parts_dev->device.type == CMLP_DEVICE_CPU) free(o->d_parts);
    else (void)cmlp_allocator_free(o->d_parts_dev->alloc, o->d_parts);
    o->d_parts = NULL;
    o->d_parts_dev = NULL;
}
