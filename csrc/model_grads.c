/* model_grads.c - what is done to a model's gradients between backward and the optimizer's step:
 * unscaling with the non-finite check (amp), torch's clip_grad_norm_ (every norm order, 0 and
 * inf included), clip_grads_with_norm_ and clip_grad_value_, and zeroing. The scalars live on
 * the device (cmlp_dscalars), so a captured step reads them there.
 */
#include "internal.h"

#include <math.h>

static const cmlp_backend_i *B(const cmlp_model *m) { return m->dev->backend; }
static void *CTX(const cmlp_model *m) { return m->dev->bctx; }

cmlp_status cmlp_model_unscale_grads(cmlp_model *m, float inv_scale, int *found_inf) {
    if (!m || !found_inf) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    cmlp_dscalars *ds;
    CMLP_TRY(cmlp_model_scalars(m, &ds));
    float flag = 0.0f;
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st = B(m)->fill_zero(CTX(m), &ds->found_inf, sizeof flag);
    if (st == CMLP_OK) st = B(m)->unscale(CTX(m), m->grads, m->nparams, inv_scale, NULL, &ds->found_inf);
    if (st == CMLP_OK) st = B(m)->copy_d2h(CTX(m), &flag, &ds->found_inf, sizeof flag);
    cmlp_fpenv_leave(&fe);
    if (st == CMLP_OK) *found_inf = flag != 0.0f;
    return st;
}

static cmlp_status check_norm_type(double norm_type) {
    if (!isnan(norm_type)) return CMLP_OK; /* torch's vector_norm: 0, negative and +-inf included */
    return CMLP_FAIL(CMLP_ERR_INVALID, "norm_type must be a number or +-inf, got %g", norm_type);
}

/* torch's clip_grad_norm_ with norm_type 0: the 0-"norm" (count of nonzeros) of each parameter
 * tensor's gradient, then that of those counts, so the number of weight and bias tensors with a
 * gradient that is not 0 (a NaN or inf counts; a subnormal reads as 0). Each tensor's test is its
 * max |g| (which keeps a NaN) against 0; the count goes to ds->grad_norm for the scaling. */
static cmlp_status tensors_nonzero(cmlp_model *m, float *count) {
    cmlp_dscalars *ds = m->ds;
    float c = 0.0f;
    for (int l = 0; l < m->nlayers; l++)
        for (int k = 0; k < 2; k++) {
            const int64_t off = k ? m->b_off[l] : m->w_off[l];
            const int64_t n = (int64_t)m->sizes[l + 1] * (k ? 1 : m->sizes[l]);
            float h = 0.0f;
            CMLP_TRY(B(m)->grad_norm(CTX(m), m->grads + off, n, INFINITY, &ds->grad_norm, ds->norm_part,
                                     &ds->norm_blocks));
            CMLP_TRY(B(m)->copy_d2h(CTX(m), &h, &ds->grad_norm, sizeof h));
            c += h != 0.0f;
        }
    *count = c;
    return B(m)->copy_h2d(CTX(m), &ds->grad_norm, count, sizeof *count);
}

/* The gradients' norm into ds->grad_norm (on the device) and *total_norm. */
static cmlp_status grad_norm(cmlp_model *m, double norm_type, double *total_norm) {
    cmlp_dscalars *ds = m->ds;
    float h = 0.0f;
    if (norm_type == 0.0) {
        CMLP_TRY(tensors_nonzero(m, &h));
    } else {
        CMLP_TRY(B(m)->grad_norm(CTX(m), m->grads, m->nparams, norm_type, &ds->grad_norm, ds->norm_part,
                                 &ds->norm_blocks));
        CMLP_TRY(B(m)->copy_d2h(CTX(m), &h, &ds->grad_norm, sizeof h));
    }
    *total_norm = h;
    return CMLP_OK;
}

cmlp_status cmlp_model_grad_norm(cmlp_model *m, double norm_type, double *total_norm) {
    if (!m || !total_norm) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    CMLP_TRY(check_norm_type(norm_type));
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st = grad_norm(m, norm_type, total_norm);
    cmlp_fpenv_leave(&fe);
    return st;
}

static cmlp_status check_max_norm(double max_norm) {
    if (max_norm >= 0.0) return CMLP_OK;
    return CMLP_FAIL(CMLP_ERR_INVALID, "max_norm must be a number >= 0, got %g", max_norm);
}

cmlp_status cmlp_model_clip_grads_with_norm(cmlp_model *m, double max_norm, double total_norm) {
    if (!m) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    CMLP_TRY(check_max_norm(max_norm));
    if (total_norm < 0.0) /* a norm never is: its scale would turn every gradient round */
        return CMLP_FAIL(CMLP_ERR_INVALID, "total_norm must be >= 0 (a norm; NaN and inf scale as torch's), got %g",
                         total_norm);
    const float norm = (float)total_norm;
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st = B(m)->copy_h2d(CTX(m), &m->ds->grad_norm, &norm, sizeof norm);
    if (st == CMLP_OK)
        st = B(m)->clip_by_norm(CTX(m), m->grads, m->nparams, &m->ds->grad_norm, (float)max_norm, NULL, NULL);
    cmlp_fpenv_leave(&fe);
    return st;
}

cmlp_status cmlp_model_clip_grad_norm(cmlp_model *m, double max_norm, double norm_type, int error_if_nonfinite,
                                      double *total_norm) {
    if (!m || !total_norm) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    CMLP_TRY(check_max_norm(max_norm));
    CMLP_TRY(check_norm_type(norm_type));
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st = grad_norm(m, norm_type, total_norm);
    if (st == CMLP_OK && error_if_nonfinite && !isfinite(*total_norm))
        st = CMLP_FAIL(CMLP_ERR_NONFINITE,
                       "The total norm of order %g of the gradients is non-finite (%g), so it cannot be clipped; "
                       "set error_if_nonfinite=False to scale the gradients by it anyway",
                       norm_type, *total_norm);
    if (st == CMLP_OK)
        st = B(m)->clip_by_norm(CTX(m), m->grads, m->nparams, &m->ds->grad_norm, (float)max_norm, NULL, NULL);
    cmlp_fpenv_leave(&fe);
    return st;
}

cmlp_status cmlp_model_clip_grad_value(cmlp_model *m, double clip_value) {
    if (!m) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (!(clip_value >= 0.0))
        return CMLP_FAIL(CMLP_ERR_INVALID, "clip_value must be a number >= 0, got %g", clip_value);
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st = B(m)->clip_by_value(CTX(m), m->grads, m->nparams, (float)clip_value);
    cmlp_fpenv_leave(&fe);
    return st;
}

cmlp_status cmlp_model_zero_grad(cmlp_model *m) {
    return B(m)->fill_zero(CTX(m), m->grads, (size_t)m->nparams * sizeof(float));
}
