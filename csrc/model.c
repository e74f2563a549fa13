/* model.c - the MLP: flat parameter and gradient buffers, nn.Linear initialisation, staging,
 * forward, fused loss and backward, moves between devices. Compute goes through the backend.
 * The activation workspace is in workspace.c; what is done to the gradients between backward
 * and the step is in model_grads.c.
 */
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_WIDTH (1 << 24)

static const cmlp_backend_i *B(const cmlp_model *m) { return m->dev->backend; }
static void *CTX(const cmlp_model *m) { return m->dev->bctx; }

int cmlp_model_num_layers(const cmlp_model *m) { return m->nlayers; }
int cmlp_model_size(const cmlp_model *m, int i) { return (i >= 0 && i <= m->nlayers) ? m->sizes[i] : 0; }
int64_t cmlp_model_num_parameters(const cmlp_model *m) { return m->nparams; }
int cmlp_model_half_weights_held(const cmlp_model *m) { return m->params_h != NULL; }
cmlp_device cmlp_model_device(const cmlp_model *m) { return m->dev->device; }
int64_t cmlp_model_weight_offset(const cmlp_model *m, int l) { return (l >= 0 && l < m->nlayers) ? m->w_off[l] : -1; }
int64_t cmlp_model_bias_offset(const cmlp_model *m, int l) { return (l >= 0 && l < m->nlayers) ? m->b_off[l] : -1; }

static cmlp_status dev_alloc(cmlp_device_ctx *d, size_t n, const char *what, void **out) {
    return cmlp_allocator_malloc(d->alloc, n, what, out);
}

static void dev_free(cmlp_device_ctx *d, void *p) {
    if (p) (void)cmlp_allocator_free(d->alloc, p);
}

cmlp_status cmlp_model_init(cmlp_model **out, const int *sizes, int nsizes, cmlp_device d, uint64_t seed) {
    if (!out) return CMLP_FAIL(CMLP_ERR_INVALID, "out must not be NULL");
    *out = NULL;
    if (!sizes || nsizes < 2 || nsizes > CMLP_MAX_LAYERS + 1)
        return CMLP_FAIL(CMLP_ERR_INVALID, "layer_sizes must list 2 to %d sizes (input, hidden..., output), got %d%s",
                         CMLP_MAX_LAYERS + 1, nsizes, sizes ? "" : " (and a NULL array)");
    for (int i = 0; i < nsizes; i++)
        if (sizes[i] < 1 || sizes[i] > MAX_WIDTH)
            return CMLP_FAIL(CMLP_ERR_INVALID, "layer_sizes[%d] = %d: every size must be in [1, %d]", i, sizes[i],
                             MAX_WIDTH);
    cmlp_device_ctx *dev;
    CMLP_TRY(cmlp_device_get(d, &dev));
    cmlp_model *m = calloc(1, sizeof *m);
    if (!m) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory creating the model");
    m->dev = dev;
    m->nlayers = nsizes - 1;
    memcpy(m->sizes, sizes, (size_t)nsizes * sizeof(int));
    int64_t off = 0;
    for (int l = 0; l < m->nlayers; l++) {
        m->w_off[l] = off;
        off += (int64_t)sizes[l] * sizes[l + 1];
    }
    for (int l = 0; l < m->nlayers; l++) {
        m->b_off[l] = off;
        off += sizes[l + 1];
    }
    m->nparams = off;
    size_t bytes = (size_t)off * sizeof(float);
    float *host = NULL;
    cmlp_status st;
    /* the device's memory first: a model that does not fit fails before any work */
    CMLP_TRY_GOTO(st, dev_alloc(dev, bytes, "parameters", (void **)&m->params), fail);
    CMLP_TRY_GOTO(st, dev_alloc(dev, cmlp_grads_bytes(m), "gradients", (void **)&m->grads), fail);
    m->ds = cmlp_model_ds(m, m->grads);
    /* the CPU's parameters are drawn in place, a GPU's on the host and copied */
    bool in_place = dev->device.type == CMLP_DEVICE_CPU;
    host = in_place ? m->params : malloc(bytes);
    if (!host) {
        st = CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for %lld initial parameters", (long long)off);
        goto fail;
    }
    /* nn.Linear: weight then bias of each layer, both U(-1/sqrt(fan_in), 1/sqrt(fan_in)) */
    cmlp_rng rng;
    cmlp_rng_seed(&rng, seed);
    for (int l = 0; l < m->nlayers; l++) {
        double bound = 1.0 / sqrt((double)sizes[l]);
        int64_t nw = (int64_t)sizes[l] * sizes[l + 1];
        for (int64_t i = 0; i < nw; i++) host[m->w_off[l] + i] = (float)((2.0 * cmlp_rng_uniform(&rng) - 1.0) * bound);
        for (int64_t i = 0; i < sizes[l + 1]; i++)
            host[m->b_off[l] + i] = (float)((2.0 * cmlp_rng_uniform(&rng) - 1.0) * bound);
    }
    if (!in_place) CMLP_TRY_GOTO(st, B(m)->copy_h2d(CTX(m), m->params, host, bytes), fail);
    CMLP_TRY_GOTO(st, B(m)->fill_zero(CTX(m), m->grads, cmlp_grads_bytes(m)), fail);
    if (!in_place) free(host);
    *out = m;
    return CMLP_OK;
fail:
    if (host != m->params) free(host);
    cmlp_model_free(m);
    return st;
}

void cmlp_model_release_workspace(cmlp_model *m) {
    if (!m) return;
    dev_free(m->dev, m->ws.block);
    memset(&m->ws, 0, sizeof m->ws);
    cmlp_amp_release(m);
    cmlp_rc_release(m);
}

void cmlp_model_free(cmlp_model *m) {
    if (!m) return;
    cmlp_model_release_workspace(m);
    cmlp_amp_free(m);
    dev_free(m->dev, m->params);
    dev_free(m->dev, m->grads);
    free(m);
}

cmlp_status cmlp_data_validate(const cmlp_model *m, const cmlp_data *xy, bool need_labels) {
    if (!xy || !xy->x) return CMLP_FAIL(CMLP_ERR_INVALID, "x must not be NULL");
    if (xy->n < 1) return CMLP_FAIL(CMLP_ERR_INVALID, "x must hold at least one sample, got %lld", (long long)xy->n);
    if (xy->on_device && m->dev->device.type != CMLP_DEVICE_CPU)
        return CMLP_FAIL(CMLP_ERR_INVALID, "data in device memory cannot be checked: pass host memory (the trainer "
                                           "keeps a data set on the device itself)");
    int64_t cols = m->sizes[0], classes = m->sizes[m->nlayers];
    if (xy->n > INT64_MAX / cols)
        return CMLP_FAIL(CMLP_ERR_INVALID, "%lld samples of %lld features are more values than int64 counts",
                         (long long)xy->n, (long long)cols);
    if (xy->x_dtype == CMLP_DTYPE_U8) {
        if (!isfinite(xy->mean) || !isfinite(xy->std) || xy->std == 0.0f)
            return CMLP_FAIL(CMLP_ERR_INVALID, "normalize=(mean, std) must be finite with std != 0, got (%g, %g)",
                             (double)xy->mean, (double)xy->std);
        /* a pixel v becomes v * scale + shift in float32: every one of them must be finite */
        float scale = 1.0f / (255.0f * xy->std), shift = -xy->mean / xy->std;
        if (!isfinite(scale) || !isfinite(shift) || !isfinite(255.0f * scale + shift))
            return CMLP_FAIL(CMLP_ERR_INVALID,
                             "normalize=(mean, std) = (%g, %g) maps pixels outside float32's range (v / (255 std) "
                             "- mean / std overflows)", (double)xy->mean, (double)xy->std);
    } else if (xy->x_dtype == CMLP_DTYPE_F32) {
        const float *x = xy->x;
        int64_t total = xy->n * cols, bad = -1;
        for (int64_t i = 0; i < total; i++)
            if (!isfinite(x[i])) {
                bad = i;
                break;
            }
        if (bad >= 0)
            return CMLP_FAIL(CMLP_ERR_NONFINITE, "x contains NaN or inf (first at sample %lld, feature %lld)",
                             (long long)(bad / cols), (long long)(bad % cols));
    } else {
        return CMLP_FAIL(CMLP_ERR_INVALID, "x must be float32 or uint8 data (dtype %d is not an input dtype)",
                         (int)xy->x_dtype);
    }
    if (need_labels) {
        if (!xy->y) return CMLP_FAIL(CMLP_ERR_INVALID, "labels must not be NULL");
        for (int64_t i = 0; i < xy->n; i++)
            if (xy->y[i] < 0 || xy->y[i] >= classes)
                return CMLP_FAIL(CMLP_ERR_INVALID, "y[%lld] = %d is outside [0, %lld): labels must be class indices",
                                 (long long)i, xy->y[i], (long long)classes);
    }
    return CMLP_OK;
}

cmlp_status cmlp_stage_x(cmlp_model *m, float *dst, const cmlp_data *xy, const int64_t *idx, int64_t start,
                         int64_t n, float scale, float shift, int32_t *ldst) {
    if (xy->on_device)
        return B(m)->gather_rows(CTX(m), dst, xy->x, xy->x_dtype, m->sizes[0], idx, start, xy->pos, n, scale, shift,
                                 ldst, ldst ? xy->y : NULL);
    CMLP_TRY(B(m)->stage_rows(CTX(m), dst, xy->x, xy->x_dtype, m->sizes[0], idx, start, n, scale, shift));
    return ldst ? cmlp_stage_y(m, ldst, xy, idx, start, n) : CMLP_OK;
}

cmlp_status cmlp_stage_y(cmlp_model *m, int32_t *dst, const cmlp_data *xy, const int64_t *idx, int64_t start,
                         int64_t n) {
    if (xy->on_device) return B(m)->gather_labels(CTX(m), dst, xy->y, idx, start, xy->pos, n);
    return B(m)->stage_labels(CTX(m), dst, xy->y, idx, start, n);
}

bool cmlp_data_in_place(const cmlp_model *m, const cmlp_data *xy) {
    return !xy->pos && (xy->on_device || m->dev->device.type == CMLP_DEVICE_CPU);
}

/* Whether rows of xy are copied into the workspace (else read where they are). */
static bool staged(const cmlp_model *m, const cmlp_data *xy, const int64_t *idx) {
    return !(cmlp_data_in_place(m, xy) && !idx && xy->x_dtype == CMLP_DTYPE_F32);
}

/* The input (and labels) of rows [start, start + n), in place or in the reserved workspace. */
static cmlp_status stage(cmlp_model *m, const cmlp_data *xy, const int64_t *idx, int64_t start, int64_t n,
                         const float **input, const int32_t **labels) {
    /* labels are read in place or staged, with the inputs when those are staged too */
    int32_t *ldst = labels && !(cmlp_data_in_place(m, xy) && !idx) ? m->ws.labels : NULL;
    if (labels) *labels = ldst ? ldst : xy->y + start;
    if (!staged(m, xy, idx)) {
        *input = (const float *)xy->x + start * m->sizes[0];
        return ldst ? cmlp_stage_y(m, ldst, xy, idx, start, n) : CMLP_OK;
    }
    float scale = 1.0f / (255.0f * xy->std), shift = -xy->mean / xy->std;
    CMLP_TRY(cmlp_stage_x(m, m->ws.act[0], xy, idx, start, n, scale, shift, ldst));
    *input = m->ws.act[0];
    return CMLP_OK;
}

cmlp_status cmlp_model_stage(cmlp_model *m, const cmlp_data *xy, const int64_t *idx, int64_t start, int64_t n,
                             bool compact, const float **input, const int32_t **labels) {
    CMLP_TRY(cmlp_workspace_reserve(m, n, compact));
    return stage(m, xy, idx, start, n, input, labels);
}

static cmlp_status stage_forward(cmlp_model *m, const cmlp_data *xy, int64_t start, int64_t n, const float **input,
                                 const int32_t **labels) {
    CMLP_TRY(cmlp_forward_reserve(m, n, staged(m, xy, NULL)));
    return stage(m, xy, NULL, start, n, input, labels);
}

cmlp_status cmlp_model_forward_rows(cmlp_model *m, const float *input, int64_t n) {
    const float *a = input;
    for (int l = 0; l < m->nlayers; l++) {
        int64_t in = m->sizes[l], out = m->sizes[l + 1];
        float *y = m->ws.act[l + 1];
        const float *w = m->params + m->w_off[l], *bias = m->params + m->b_off[l];
        int relu = l + 1 < m->nlayers;
        if (B(m)->gemm_bias_act) { /* one fused GEMM where the device has it */
            CMLP_TRY(B(m)->gemm_bias_act(CTX(m), 0, 1, n, out, in, a, in, w, in, y, out, bias, relu));
        } else {
            CMLP_TRY(B(m)->gemm(CTX(m), 0, 1, n, out, in, 1.0f, a, in, w, in, 0.0f, y, out));
            CMLP_TRY(B(m)->bias_act(CTX(m), y, bias, n, out, relu));
        }
        a = y;
    }
    return CMLP_OK;
}

size_t cmlp_grads_bytes(const cmlp_model *m) {
    return ((size_t)m->nparams * sizeof(float) + 63) / 64 * 64 + sizeof(cmlp_dscalars);
}

cmlp_dscalars *cmlp_model_ds(const cmlp_model *m, float *grads) {
    return (cmlp_dscalars *)((char *)grads + cmlp_grads_bytes(m) - sizeof(cmlp_dscalars));
}

cmlp_status cmlp_model_scalars(cmlp_model *m, cmlp_dscalars **out) {
    *out = m->ds;
    return CMLP_OK;
}

bool cmlp_side_use(const cmlp_model *m, int64_t n) {
    return B(m)->stream_side && B(m)->stream_join && m->nlayers > 1 && n <= CMLP_SIDE_ROWS;
}

cmlp_status cmlp_side(cmlp_model *m, bool use, int on) { return use ? B(m)->stream_side(CTX(m), on) : CMLP_OK; }

cmlp_status cmlp_side_join(cmlp_model *m, bool use) { return use ? B(m)->stream_join(CTX(m)) : CMLP_OK; }

/* The backward pass from the logits' gradient in dact[0]. With side, layer l's weight gradient
 * (and the top bias gradient) is made on the second stream while its input gradient is made on
 * the first; the join comes before the first writes what that GEMM reads: layer 1's output (the
 * ReLU's masked gradient replaces it), or for l > 1 the gradient it reads (the next layer's input
 * gradient goes there). Layer 0's weight gradient, the last, is made on the first stream. */
static cmlp_status backward_rows(cmlp_model *m, const float *input, int64_t n, cmlp_gw w, bool side) {
    int L = m->nlayers;
    float *cur = m->ws.dact[0], *other = m->ws.dact[1];
    const float beta = w.fresh && !w.zeroed ? 0.0f : 1.0f;
    for (int l = L - 1; l >= 0; l--) {
        int64_t in = m->sizes[l], out = m->sizes[l + 1];
        float *a = l == 0 ? (float *)input : m->ws.act[l];
        bool branch = side && l > 0;
        /* dW [out, in] += dY^T [out, n] . A [n, in];  db += colsum(dY) */
        CMLP_TRY(cmlp_side(m, branch, 1));
        if (l == 0 && w.fresh && w.zeroed && m->ws.compact) /* the pieces, read for the last time */
            CMLP_TRY(B(m)->fill_zero(CTX(m), m->grads, m->ws.inside_bytes));
        CMLP_TRY(B(m)->gemm(CTX(m), 1, 0, out, in, n, 1.0f, cur, out, a, in, beta, m->grads + m->w_off[l], in));
        if (l == L - 1) CMLP_TRY(B(m)->bias_grad(CTX(m), m->grads + m->b_off[l], cur, n, out, w.fresh));
        CMLP_TRY(cmlp_side(m, branch, 0));
        if (l == 0) break;
        /* dA [n, in] = dY [n, out] . W [out, in], then through the ReLU that produced A, with the
         * bias gradient of the layer below from the same pass. Layer 1's input gradient is
         * computed over the buffers from layer 2's output on (free by then) and, masked,
         * replaces layer 1's output (A is not needed after it): the last GEMM reads it there,
         * out of the first layer's weight gradient that it writes. */
        float *dx = l == 1 ? m->ws.act[2] : other, *dst = l == 1 ? a : other; /* cmlp_ws_layout */
        if (l == 1 && (size_t)(n * in) * sizeof(float) > m->ws.dx1_bytes)
            return CMLP_FAIL(CMLP_ERR_STATE, "layer 1's input gradient needs %lld bytes, its place holds %zu",
                             (long long)(n * in * 4), m->ws.dx1_bytes);
        CMLP_TRY(B(m)->gemm(CTX(m), 0, 0, n, in, out, 1.0f, cur, out, m->params + m->w_off[l], in, 0.0f, dx, in));
        CMLP_TRY(cmlp_side_join(m, branch && l == 1));
        CMLP_TRY(B(m)->relu_backward_bias_grad(CTX(m), dx, a, dst, CMLP_DTYPE_F32, m->grads + m->b_off[l - 1], n, in,
                                               w.fresh));
        CMLP_TRY(cmlp_side_join(m, branch && l > 1));
        other = cur;
        cur = dst;
    }
    return CMLP_OK;
}

cmlp_status cmlp_model_fb_rows(cmlp_model *m, const float *input, const int32_t *labels, int64_t n, cmlp_gw w,
                               float smoothing, double *d_loss) {
    int L = m->nlayers;
    CMLP_TRY(cmlp_model_forward_rows(m, input, n));
    CMLP_TRY(B(m)->softmax_xent(CTX(m), m->ws.act[L], labels, n, m->sizes[L], smoothing, w.loss,
                                m->ws.dact[0], d_loss, NULL));
    bool side = cmlp_side_use(m, n);
    cmlp_status st = backward_rows(m, input, n, w, side);
    if (st != CMLP_OK) (void)cmlp_side_join(m, side); /* nothing is left forked */
    return st;
}

cmlp_status cmlp_model_forward(cmlp_model *m, const cmlp_data *x, int64_t chunk, float *logits_out) {
    if (!m || !logits_out) return CMLP_FAIL(CMLP_ERR_INVALID, "model and logits_out must not be NULL");
    CMLP_TRY(cmlp_data_validate(m, x, false));
    if (chunk < 1) chunk = 1024;
    if (chunk > x->n) chunk = x->n;
    int64_t C = m->sizes[m->nlayers];
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st = CMLP_OK;
    for (int64_t s = 0; s < x->n && st == CMLP_OK; s += chunk) {
        int64_t k = x->n - s < chunk ? x->n - s : chunk;
        const float *in;
        st = stage_forward(m, x, s, k, &in, NULL);
        if (st == CMLP_OK) st = cmlp_model_forward_rows(m, in, k);
        if (st == CMLP_OK)
            st = B(m)->copy_d2h(CTX(m), logits_out + s * C, m->ws.act[m->nlayers], (size_t)(k * C) * sizeof(float));
    }
    cmlp_fpenv_leave(&fe);
    return st;
}

cmlp_status cmlp_model_evaluate(cmlp_model *m, const cmlp_data *xy, int64_t chunk, double *loss_sum,
                                int64_t *correct) {
    if (!m || !loss_sum || !correct) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    CMLP_TRY(cmlp_data_validate(m, xy, true));
    if (chunk < 1) chunk = 1024;
    if (chunk > xy->n) chunk = xy->n;
    cmlp_dscalars *ds, h;
    CMLP_TRY(cmlp_model_scalars(m, &ds));
    CMLP_TRY(B(m)->fill_zero(CTX(m), &ds->loss, sizeof ds->loss));
    CMLP_TRY(B(m)->fill_zero(CTX(m), &ds->correct, sizeof ds->correct));
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    cmlp_status st = CMLP_OK;
    for (int64_t s = 0; s < xy->n && st == CMLP_OK; s += chunk) {
        int64_t k = xy->n - s < chunk ? xy->n - s : chunk;
        const float *in;
        const int32_t *lab;
        st = stage_forward(m, xy, s, k, &in, &lab);
        if (st == CMLP_OK) st = cmlp_model_forward_rows(m, in, k);
        if (st == CMLP_OK)
            st = B(m)->softmax_xent(CTX(m), m->ws.act[m->nlayers], lab, k, m->sizes[m->nlayers], 0.0f,
                                    (cmlp_loss_weight){0}, NULL, &ds->loss, &ds->correct);
    }
    if (st == CMLP_OK) st = B(m)->copy_d2h(CTX(m), &h, ds, sizeof h);
    cmlp_fpenv_leave(&fe);
    if (st != CMLP_OK) return st;
    *loss_sum = h.loss;
    *correct = h.correct;
    return CMLP_OK;
}

cmlp_status cmlp_model_fb(cmlp_model *m, const cmlp_data *xy, const int64_t *idx, int64_t start, int64_t n, cmlp_gw w,
                          float smoothing, cmlp_amp amp, int recompute, double *d_loss) {
    if (amp != CMLP_AMP_NONE) return cmlp_amp_fb(m, xy, idx, start, n, w, smoothing, amp, recompute, d_loss);
    if (recompute) return cmlp_rc_fb(m, xy, idx, start, n, w, smoothing, d_loss);
    const float *in;
    const int32_t *lab;
    CMLP_TRY(cmlp_model_stage(m, xy, idx, start, n, w.fresh && w.solo, &in, &lab));
    return cmlp_model_fb_rows(m, in, lab, n, w, smoothing, d_loss);
}

cmlp_status cmlp_model_forward_backward(cmlp_model *m, const cmlp_data *xy, float grad_weight,
                                        float label_smoothing, cmlp_amp amp, double *loss_sum) {
    if (!m || !loss_sum) return CMLP_FAIL(CMLP_ERR_INVALID, "model and loss_sum must not be NULL");
    if (!isfinite(grad_weight)) return CMLP_FAIL(CMLP_ERR_INVALID, "the gradient weight (loss_scale / n) must be finite");
    if (!(label_smoothing >= 0.0f && label_smoothing <= 1.0f))
        return CMLP_FAIL(CMLP_ERR_INVALID, "label_smoothing must be in [0, 1], got %g", (double)label_smoothing);
    if (amp != CMLP_AMP_NONE && amp != CMLP_AMP_FP16 && amp != CMLP_AMP_BF16)
        return CMLP_FAIL(CMLP_ERR_INVALID, "unknown amp mode %d", (int)amp);
    CMLP_TRY(cmlp_data_validate(m, xy, true));
    cmlp_dscalars *ds;
    CMLP_TRY(cmlp_model_scalars(m, &ds));
    CMLP_TRY(B(m)->fill_zero(CTX(m), &ds->loss, sizeof ds->loss));
    cmlp_fpenv fe;
    cmlp_fpenv_enter(&fe);
    double loss = 0.0;
    cmlp_status st = cmlp_model_fb(m, xy, NULL, 0, xy->n, (cmlp_gw){{grad_weight}}, label_smoothing, amp, 0,
                                   &ds->loss);
    if (st == CMLP_OK) st = B(m)->copy_d2h(CTX(m), &loss, &ds->loss, sizeof loss);
    cmlp_fpenv_leave(&fe);
    if (st == CMLP_OK) *loss_sum = loss;
    return st;
}

cmlp_status cmlp_model_get_params(const cmlp_model *m, float *host_out) {
    return B(m)->copy_d2h(CTX(m), host_out, m->params, (size_t)m->nparams * sizeof(float));
}

cmlp_status cmlp_model_get_grads(const cmlp_model *m, float *host_out) {
    return B(m)->copy_d2h(CTX(m), host_out, m->grads, (size_t)m->nparams * sizeof(float));
}

cmlp_status cmlp_model_set_grads(cmlp_model *m, const float *host_in) {
    return B(m)->copy_h2d(CTX(m), m->grads, host_in, (size_t)m->nparams * sizeof(float));
}

cmlp_status cmlp_model_copy_params(cmlp_model *m, const float *host_in) {
    m->written = true; /* (a copy that fails may have written some) */
    CMLP_TRY(B(m)->copy_h2d(CTX(m), m->params, host_in, (size_t)m->nparams * sizeof(float)));
    return cmlp_model_refresh_half(m);
}

cmlp_status cmlp_model_set_params(cmlp_model *m, const float *host_in) {
    for (int64_t i = 0; i < m->nparams; i++)
        if (!isfinite(host_in[i]))
            return CMLP_FAIL(CMLP_ERR_NONFINITE, "parameter %lld is NaN or inf: parameters must be finite", (long long)i);
    return cmlp_model_copy_params(m, host_in);
}

cmlp_status cmlp_buffer_copy(cmlp_device_ctx *from, cmlp_device_ctx *to, const void *buf, size_t nbytes,
                             const char *what, void **dst) {
    *dst = NULL;
    if (!buf) return CMLP_OK;
    void *host = malloc(nbytes), *d = NULL;
    if (!host) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory moving %zu bytes", nbytes);
    cmlp_status st = from->backend->copy_d2h(from->bctx, host, buf, nbytes);
    if (st == CMLP_OK) st = dev_alloc(to, nbytes, what, &d);
    if (st == CMLP_OK) st = to->backend->copy_h2d(to->bctx, d, host, nbytes);
    free(host);
    if (st != CMLP_OK) {
        dev_free(to, d);
        return st;
    }
    *dst = d;
    return CMLP_OK;
}

cmlp_status cmlp_buffer_hash(cmlp_device_ctx *dev, const void *buf, size_t nbytes, bool negatives_alike,
                             uint64_t *h) {
    enum { CHUNK = 4 << 20 }; /* (a multiple of 8: only the last chunk's last word is short) */
    if (dev->device.type == CMLP_DEVICE_CPU && !negatives_alike) {
        *h = cmlp_hash_bytes(*h, buf, nbytes);
        return CMLP_OK;
    }
    unsigned char *host = malloc(nbytes < CHUNK ? nbytes : CHUNK);
    if (!host && nbytes) return CMLP_FAIL(CMLP_ERR_OOM, "out of host memory reading %zu bytes", nbytes);
    cmlp_status st = CMLP_OK;
    for (size_t at = 0; at < nbytes && st == CMLP_OK; at += CHUNK) {
        const size_t n = nbytes - at < CHUNK ? nbytes - at : CHUNK;
        st = dev->backend->copy_d2h(dev->bctx, host, (const unsigned char *)buf + at, n);
        if (st != CMLP_OK) break;
        for (size_t i = 0; negatives_alike && i + sizeof(float) <= n; i += sizeof(float)) {
            float v;
            memcpy(&v, host + i, sizeof v);
            if (v < 0.0f) memcpy(host + i, &(float){-1.0f}, sizeof v);
        }
        *h = cmlp_hash_bytes(*h, host, n);
    }
    free(host);
    return st;
}

cmlp_status cmlp_model_to(cmlp_model *m, cmlp_device d) {
    cmlp_device_ctx *to;
    CMLP_TRY(cmlp_device_get(d, &to));
    if (to == m->dev) return CMLP_OK;
    /* all or nothing: both copies made before the sources go */
    void *p, *g;
    CMLP_TRY(cmlp_buffer_copy(m->dev, to, m->params, (size_t)m->nparams * sizeof(float), "parameters", &p));
    cmlp_status st = cmlp_buffer_copy(m->dev, to, m->grads, cmlp_grads_bytes(m), "gradients", &g);
    if (st != CMLP_OK) {
        dev_free(to, p);
        return st;
    }
    cmlp_model_release_workspace(m);
    cmlp_amp_free(m); /* the half copy is made again on the new device when used */
    dev_free(m->dev, m->params);
    dev_free(m->dev, m->grads);
    m->params = p;
    m->grads = g;
    m->ds = cmlp_model_ds(m, g);
    m->dev = to;
    return CMLP_OK;
}
