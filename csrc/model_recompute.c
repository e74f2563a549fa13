/* model_recompute.c - forward and backward that keep only the micro-batch's input: backward
 * recomputes each layer's input from it when needed. Three buffers of the widest layer hold
 * whatever is alive (the gradient flowing back and the two sides of a recomputation), so the
 * memory no longer grows with the depth of the network. Same GEMMs in the same order as the
 * stored path, so the gradients are the same.
 */
#include "internal.h"

#include <string.h>

static const cmlp_backend_i *B(const cmlp_model *m) { return m->dev->backend; }
static void *CTX(const cmlp_model *m) { return m->dev->bctx; }
static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

int cmlp_rc_layout(const int *sizes, int L, int64_t rows, size_t *sz, size_t *act_bytes) {
    int maxg = 1, nv = 0;
    for (int l = 1; l <= L; l++) maxg = sizes[l] > maxg ? sizes[l] : maxg;
    *act_bytes = sz[nv++] = align64((size_t)rows * sizes[0] * sizeof(float)); /* the kept input */
    for (int i = 0; i < 3; i++) sz[nv++] = align64((size_t)rows * maxg * sizeof(float));
    sz[nv++] = align64((size_t)rows * sizeof(int32_t));
    return nv;
}

void cmlp_rc_release(cmlp_model *m) {
    if (m->wsr.block) (void)cmlp_allocator_free(m->dev->alloc, m->wsr.block);
    memset(&m->wsr, 0, sizeof m->wsr);
}

static cmlp_status reserve(cmlp_model *m, int64_t rows) {
    if (rows <= m->wsr.rows) return CMLP_OK;
    size_t sz[8], total = 0, act;
    int nv = cmlp_rc_layout(m->sizes, m->nlayers, rows, sz, &act);
    for (int i = 0; i < nv; i++) total += sz[i];
    char *p;
    cmlp_rc_release(m); /* first: see cmlp_workspace_reserve */
    CMLP_TRY(cmlp_allocator_malloc(m->dev->alloc, total, "activations (recomputed)", (void **)&p));
    m->wsr.block = p;
    m->wsr.rows = rows;
    m->wsr.input = (float *)p, p += sz[0];
    for (int i = 0; i < 3; i++) m->wsr.buf[i] = (float *)p, p += sz[1 + i];
    m->wsr.labels = (int32_t *)p;
    return CMLP_OK;
}

/* Layers [0, upto) from the input; the result lands in one of a, b (returned). */
static cmlp_status run_layers(cmlp_model *m, const float *input, int64_t n, int upto, float *a, float *b,
                              float *last_out, float **result) {
    const float *x = input;
    for (int l = 0; l < upto; l++) {
        int64_t in = m->sizes[l], out = m->sizes[l + 1];
        float *y = l + 1 == m->nlayers ? last_out : (l % 2 == 0 ? a : b);
        CMLP_TRY(B(m)->gemm(CTX(m), 0, 1, n, out, in, 1.0f, x, in, m->params + m->w_off[l], in, 0.0f, y, out));
        CMLP_TRY(B(m)->bias_act(CTX(m), y, m->params + m->b_off[l], n, out, l + 1 < m->nlayers));
        x = y;
    }
    *result = (float *)x;
    return CMLP_OK;
}

cmlp_status cmlp_rc_fb(cmlp_model *m, const cmlp_data *xy, const int64_t *idx, int64_t start, int64_t n,
                       cmlp_gw gw, float smoothing, double *d_loss) {
    CMLP_TRY(reserve(m, n));
    cmlp_rc_workspace *w = &m->wsr;
    const float *input;
    const int32_t *labels;
    if (cmlp_data_in_place(m, xy) && !idx && xy->x_dtype == CMLP_DTYPE_F32) {
        input = (const float *)xy->x + start * m->sizes[0];
        labels = xy->y + start;
    } else {
        float scale = 1.0f / (255.0f * xy->std), shift = -xy->mean / xy->std;
        CMLP_TRY(cmlp_stage_x(m, w->input, xy, idx, start, n, scale, shift, w->labels));
        input = w->input;
        labels = w->labels;
    }
    int L = m->nlayers;
    float *cur;
    CMLP_TRY(run_layers(m, input, n, L, w->buf[0], w->buf[1], w->buf[2], &cur)); /* logits in buf[2] */
    /* the logits' gradient overwrites the logits */
    CMLP_TRY(B(m)->softmax_xent(CTX(m), cur, labels, n, m->sizes[L], smoothing, gw.loss, cur, d_loss,
                                NULL));
    for (int l = L - 1; l >= 0; l--) {
        int64_t in = m->sizes[l], out = m->sizes[l + 1];
        float *p = NULL, *q = NULL, *a;
        for (int i = 0; i < 3; i++)
            if (w->buf[i] != cur) {
                if (!p) p = w->buf[i];
                else q = w->buf[i];
            }
        CMLP_TRY(run_layers(m, input, n, l, p, q, NULL, &a)); /* layer l's input, recomputed */
        CMLP_TRY(B(m)->gemm(CTX(m), 1, 0, out, in, n, 1.0f, cur, out, a, in, gw.fresh && !gw.zeroed ? 0.0f : 1.0f,
                            m->grads + m->w_off[l], in)); /* (nothing of this workspace's in them) */
        if (l == L - 1) CMLP_TRY(B(m)->bias_grad(CTX(m), m->grads + m->b_off[l], cur, n, out, gw.fresh));
        if (l == 0) break;
        float *dx = a == p ? q : p;
        CMLP_TRY(B(m)->gemm(CTX(m), 0, 0, n, in, out, 1.0f, cur, out, m->params + m->w_off[l], in, 0.0f, dx, in));
        /* the bias gradient of the layer below comes with the mask */
        CMLP_TRY(B(m)->relu_backward_bias_grad(CTX(m), dx, a, dx, CMLP_DTYPE_F32, m->grads + m->b_off[l - 1], n, in,
                                               gw.fresh));
        cur = dx;
    }
    return CMLP_OK;
}
