/* model_amp.c - forward and backward under mixed precision. Stored activations, the gradients
 * flowing between layers and the weight copy used by the GEMMs are fp16/bf16; products
 * accumulate in fp32 (into the fp32 master gradients for dW); logits, softmax and loss stay
 * fp32. Where the device multiplies half-precision operands itself (cuBLASLt), each product is
 * one GEMM with the bias and ReLU fused; where the backend needs fp32 operands (the CPU), each
 * layer's GEMMs run over blocks of rows converted into a bounded scratch, so the half-precision
 * saving is real.
 */
#include "half.h"

#include <stdlib.h>
#include <string.h>

#define AMP_CHUNK 256 /* rows converted at a time */

static const cmlp_backend_i *B(const cmlp_model *m) { return m->dev->backend; }
static void *CTX(const cmlp_model *m) { return m->dev->bctx; }
static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

cmlp_dtype cmlp_amp_dtype(cmlp_amp amp) { return amp == CMLP_AMP_BF16 ? CMLP_DTYPE_BF16 : CMLP_DTYPE_F16; }

void cmlp_amp_release(cmlp_model *m) {
    if (m->wsa.block) (void)cmlp_allocator_free(m->dev->alloc, m->wsa.block);
    memset(&m->wsa, 0, sizeof m->wsa);
}

static void drop_half_params(cmlp_model *m) {
    if (m->params_h) (void)cmlp_allocator_free(m->dev->alloc, m->params_h);
    m->params_h = NULL;
    m->half_dtype = CMLP_DTYPE_F32;
}

void cmlp_amp_free(cmlp_model *m) {
    cmlp_amp_release(m);
    drop_half_params(m);
}

/* A copy that could not be refreshed is marked stale (half_dtype F32), so its next use makes it
 * again rather than read old weights. */
static cmlp_status refresh_as(cmlp_model *m, cmlp_dtype dt) {
    cmlp_status st = B(m)->to_half(CTX(m), m->params_h, m->params, m->nparams, dt);
    m->half_dtype = st == CMLP_OK ? dt : CMLP_DTYPE_F32;
    return st;
}

cmlp_status cmlp_model_refresh_half(cmlp_model *m) {
    if (!m->params_h || m->half_dtype == CMLP_DTYPE_F32) return CMLP_OK;
    return refresh_as(m, m->half_dtype);
}

/* The half-precision weight copy in the requested format (made on first use). */
static cmlp_status ensure_half_params(cmlp_model *m, cmlp_dtype dt) {
    if (m->params_h && m->half_dtype == dt) return CMLP_OK;
    if (!m->params_h)
        CMLP_TRY(cmlp_allocator_malloc(m->dev->alloc, (size_t)m->nparams * sizeof(uint16_t), "half-precision weights",
                                       (void **)&m->params_h));
    return refresh_as(m, dt);
}

int cmlp_amp_native(const cmlp_backend_i *b) { return b->gemm_half && b->softmax_xent_half; }

/* Activations [rows, sizes[l]] for l < L in half precision, logits and their gradient in fp32,
 * two half gradient buffers (cmlp_grad_widths), labels; then the fp32 scratch for one block
 * of rows (three [chunk, widest]) and one layer's weights and bias. On a native backend the
 * logits' gradient, two of the scratch blocks and the layer's weights are not needed (size 0),
 * the scratch block stages host rows of the input ([chunk, sizes[0]]) and the bias is the last
 * layer's. Without recompute and with more than one layer, in cmlp_ws_layout's order: the
 * input, layer 1's output, the gradient buffer that holds layer 2's input gradient, the outputs
 * of layers 2..L-1, the logits and their gradient, the other gradient buffer (layer 1's input
 * gradient is written over these). *inside: the pieces a compact step places in the first
 * layer's weight gradient, after its half weights (cmlp_ws_layout): all but the input, layer
 * 1's output and the labels. */
int cmlp_amp_layout(const int *sizes, int L, int64_t rows, int recompute, int native, size_t *sz, size_t *act_bytes,
                    uint64_t *inside) {
    int C = sizes[L];
    /* gradients flow between layers 1..L only; the scratch also holds layer 0's input */
    int64_t maxg = 1, maxw = sizes[0], maxwt = 1, chunk = rows < AMP_CHUNK ? rows : AMP_CHUNK;
    for (int l = 1; l <= L; l++) maxg = sizes[l] > maxg ? sizes[l] : maxg;
    maxw = maxg > maxw ? maxg : maxw;
    for (int l = 0; l < L; l++) {
        int64_t w = (int64_t)sizes[l] * sizes[l + 1];
        maxwt = w > maxwt ? w : maxwt;
    }
    /* kept for backward: every layer's input, or with recompute the first one only */
    const int nact = recompute ? 1 : L, split = !recompute && L > 1, cur1 = split ? (L - 2) & 1 : 0;
    /* the gradients between layers (two buffers, in turn), plus one to recompute through (then
     * each of the three may hold any layer's activations or gradient) */
    int64_t g[2];
    cmlp_grad_widths(sizes, L, 1, g);
    int nv = 0;
    *act_bytes = 0;
    *inside = 0;
#define INSIDE() cmlp_piece_set(inside, nv)
#define DACT(i) (sz[nv++] = align64((size_t)(rows * (recompute ? maxg : g[i])) * sizeof(uint16_t)))
    for (int l = 0; l < nact && l < 2; l++) *act_bytes += sz[nv++] = align64((size_t)rows * sizes[l] * sizeof(uint16_t));
    if (split) INSIDE(), DACT(cur1);
    for (int l = 2; l < nact; l++) {
        INSIDE();
        *act_bytes += sz[nv++] = align64((size_t)rows * sizes[l] * sizeof(uint16_t));
    }
    INSIDE();
    *act_bytes += sz[nv++] = align64((size_t)rows * C * sizeof(float));
    INSIDE();
    sz[nv++] = native ? 0 : align64((size_t)rows * C * sizeof(float));
    if (split)
        INSIDE(), DACT(1 - cur1);
    else
        for (int i = 0; i < (recompute ? 3 : 2); i++) INSIDE(), DACT(i);
    sz[nv++] = align64((size_t)rows * sizeof(int32_t));
    for (int i = 0; i < 3; i++) {
        INSIDE();
        sz[nv++] = !native ? align64((size_t)chunk * maxw * sizeof(float))
                   : i == 0 ? align64((size_t)chunk * sizes[0] * sizeof(float))
                            : 0;
    }
    INSIDE();
    sz[nv++] = native ? 0 : align64((size_t)maxwt * sizeof(float));
    INSIDE();
    sz[nv++] = align64((size_t)(native ? C : maxw) * sizeof(float));
#undef DACT
#undef INSIDE
    return nv;
}

size_t cmlp_amp_half_bytes(int64_t nparams) { return align64((size_t)nparams * sizeof(uint16_t)); }

/* The layout of a workspace for `rows`; whether a compact step (cmlp_workspace_reserve) can
 * place its pieces: only where the device multiplies half operands itself, and without
 * recompute (which reads the weights again while the gradients are written). */
static bool layout(const cmlp_model *m, int64_t rows, int recompute, size_t *sz, int *nv, uint64_t *inside,
                   size_t *off) {
    int native = cmlp_amp_native(B(m));
    size_t act;
    *nv = cmlp_amp_layout(m->sizes, m->nlayers, rows, recompute, native, sz, &act, inside);
    return native && !recompute &&
           cmlp_compact_place(m->nlayers, sz, *nv, *inside, cmlp_amp_half_bytes(m->nparams),
                              cmlp_first_grad_bytes(m->sizes), off);
}

static cmlp_status reserve(cmlp_model *m, int64_t rows, int recompute, bool compact) {
    if (rows <= m->wsa.rows && recompute == m->wsa.recompute && (compact || !m->wsa.compact)) return CMLP_OK;
    size_t sz[CMLP_MAX_LAYERS + 12], off[CMLP_MAX_LAYERS + 12], total;
    uint64_t inside;
    int nv;
    if (!layout(m, rows, recompute, sz, &nv, &inside, off) || !compact) inside = 0, compact = false;
    int64_t chunk = rows < AMP_CHUNK ? rows : AMP_CHUNK;
    int L = m->nlayers;
    char *piece[CMLP_MAX_LAYERS + 12], *p;
    total = cmlp_place_pieces(sz, nv, inside, off, NULL, NULL, piece); /* the bytes outside */
    cmlp_amp_release(m); /* first: see cmlp_workspace_reserve */
    CMLP_TRY(cmlp_allocator_malloc(m->dev->alloc, total, "activations (mixed precision)", (void **)&p));
    cmlp_amp_workspace *w = &m->wsa;
    w->block = p;
    w->rows = rows;
    w->chunk = chunk;
    w->recompute = recompute;
    w->compact = compact;
    cmlp_place_pieces(sz, nv, inside, off, m->grads, p, piece);
    /* as cmlp_amp_layout lists them */
    const int nact = recompute ? 1 : L, split = !recompute && L > 1, cur1 = split ? (L - 2) & 1 : 0;
    int v = 0;
    for (int l = 0; l < nact && l < 2; l++) w->act[l] = (uint16_t *)piece[v++];
    if (split) w->dact[cur1] = (uint16_t *)piece[v++];
    for (int l = 2; l < nact; l++) w->act[l] = (uint16_t *)piece[v++];
    w->logits = (float *)piece[v++];
    w->dlogits = (float *)piece[v++];
    if (split)
        w->dact[1 - cur1] = (uint16_t *)piece[v++];
    else
        for (int i = 0; i < (recompute ? 3 : 2); i++) w->dact[i] = (uint16_t *)piece[v++];
    w->dx1_bytes = 0;
    for (int i = 3; split && i < v; i++) w->dx1_bytes += sz[i]; /* layer 2's output to the buffer after */
    w->labels = (int32_t *)piece[v++];
    for (int i = 0; i < 3; i++) w->scratch[i] = (float *)piece[v++];
    w->w32 = (float *)piece[v++];
    w->b32 = (float *)piece[v];
    return CMLP_OK;
}

/* Rows of xy (through idx, or from start) into the half input buffer: gathered straight into
 * half storage from a device data set where the backend can, else a block at a time. */
static cmlp_status stage(cmlp_model *m, const cmlp_data *xy, const int64_t *idx, int64_t start, int64_t n,
                         const int32_t **labels) {
    cmlp_amp_workspace *w = &m->wsa;
    int64_t in = m->sizes[0];
    float scale = xy->x_dtype == CMLP_DTYPE_U8 ? 1.0f / (255.0f * xy->std) : 1.0f;
    float shift = xy->x_dtype == CMLP_DTYPE_U8 ? -xy->mean / xy->std : 0.0f;
    /* labels are read in place or staged (from a device data set with the inputs) */
    int32_t *ldst = cmlp_data_in_place(m, xy) && !idx ? NULL : w->labels;
    *labels = ldst ? ldst : xy->y + start;
    if (xy->on_device && B(m)->gather_rows_half) /* one pass, no float block in between */
        return B(m)->gather_rows_half(CTX(m), w->act[0], m->wsa.dt, xy->x, xy->x_dtype, in, idx, start, xy->pos, n,
                                      scale, shift, ldst, ldst ? xy->y : NULL);
    for (int64_t r = 0; r < n; r += w->chunk) {
        int64_t k = n - r < w->chunk ? n - r : w->chunk;
        CMLP_TRY(cmlp_stage_x(m, w->scratch[0], xy, idx ? idx + r : NULL, start + r, k, scale, shift, NULL));
        CMLP_TRY(B(m)->to_half(CTX(m), w->act[0] + r * in, w->scratch[0], k * in, m->wsa.dt));
    }
    return ldst ? cmlp_stage_y(m, ldst, xy, idx, start, n) : CMLP_OK;
}

/* Layer l's half weights and bias as fp32 values, for backends that multiply in fp32. */
static cmlp_status layer_weights(cmlp_model *m, int l) {
    int64_t in = m->sizes[l], out = m->sizes[l + 1];
    CMLP_TRY(B(m)->from_half(CTX(m), m->wsa.w32, m->wsa.wh + m->w_off[l], in * out, m->wsa.dt));
    return B(m)->from_half(CTX(m), m->wsa.b32, m->wsa.wh + m->b_off[l], out, m->wsa.dt);
}

/* Where the device multiplies half-precision operands itself: one GEMM per product, fp32
 * accumulation, the bias and ReLU fused, half-precision results (fp32 logits). */
static cmlp_status forward_native(cmlp_model *m, int64_t n, int upto, uint16_t *const *acts) {
    cmlp_amp_workspace *w = &m->wsa;
    const cmlp_backend_i *b = B(m);
    cmlp_dtype dt = m->wsa.dt;
    int L = m->nlayers;
    for (int l = 0; l < upto; l++) {
        int64_t in = m->sizes[l], out = m->sizes[l + 1];
        const uint16_t *wh = m->wsa.wh + m->w_off[l], *bh = m->wsa.wh + m->b_off[l];
        if (w->forked) { /* the half weights and the logits' bias, made beside the batch's gather */
            w->forked = false;
            CMLP_TRY(cmlp_side_join(m, true));
        }
        if (l + 1 < L) {
            CMLP_TRY(b->gemm_half(CTX(m), 0, 1, n, out, in, 1.0f, acts[l], in, wh, in, dt, 0.0f, acts[l + 1], dt, out,
                                  bh, 1));
        } else { /* the logits in fp32, with the half bias as fp32 */
            if (!w->b32_made) CMLP_TRY(b->from_half(CTX(m), w->b32, bh, out, dt));
            w->b32_made = false;
            CMLP_TRY(b->gemm_half(CTX(m), 0, 1, n, out, in, 1.0f, acts[l], in, wh, in, dt, 0.0f, w->logits,
                                  CMLP_DTYPE_F32, out, w->b32, 0));
        }
    }
    return CMLP_OK;
}

/* Layers [0, upto): layer l reads acts[l] and writes acts[l + 1] (the last layer: the logits). */
static cmlp_status forward(cmlp_model *m, int64_t n, int upto, uint16_t *const *acts) {
    if (B(m)->gemm_half) return forward_native(m, n, upto, acts);
    cmlp_amp_workspace *w = &m->wsa;
    const cmlp_backend_i *b = B(m);
    int L = m->nlayers;
    for (int l = 0; l < upto; l++) {
        int64_t in = m->sizes[l], out = m->sizes[l + 1];
        bool last = l + 1 == L;
        CMLP_TRY(layer_weights(m, l));
        for (int64_t r = 0; r < n; r += w->chunk) {
            int64_t k = n - r < w->chunk ? n - r : w->chunk;
            float *z = last ? w->logits + r * out : w->scratch[1];
            CMLP_TRY(b->from_half(CTX(m), w->scratch[0], acts[l] + r * in, k * in, m->wsa.dt));
            CMLP_TRY(b->gemm(CTX(m), 0, 1, k, out, in, 1.0f, w->scratch[0], in, w->w32, in, 0.0f, z, out));
            CMLP_TRY(b->bias_act(CTX(m), z, w->b32, k, out, !last));
            if (!last) CMLP_TRY(b->to_half(CTX(m), acts[l + 1] + r * out, z, k * out, m->wsa.dt));
        }
    }
    return CMLP_OK;
}

/* With recompute, layer l's input is recomputed from the kept input through the two gradient
 * buffers that do not hold the gradient flowing back. half_grad: the logits' gradient is
 * already in dact[0], in half precision. */
static cmlp_status backward(cmlp_model *m, int64_t n, bool fresh, bool half_grad, bool side) {
    cmlp_amp_workspace *w = &m->wsa;
    const cmlp_backend_i *b = B(m);
    int L = m->nlayers;
    uint16_t *cur = w->dact[0], *other = w->dact[1];
    if (!half_grad) CMLP_TRY(b->to_half(CTX(m), cur, w->dlogits, n * m->sizes[L], m->wsa.dt));
    float *dy = w->scratch[1], *a = w->scratch[0], *dx = w->scratch[2];
    for (int l = L - 1; l >= 0; l--) {
        int64_t in = m->sizes[l], out = m->sizes[l + 1];
        const uint16_t *al = w->act[l];
        if (w->recompute && l > 0) {
            uint16_t *pq[2], *acts[CMLP_MAX_LAYERS + 1];
            for (int i = 0, j = 0; i < 3; i++)
                if (w->dact[i] != cur) pq[j++] = w->dact[i];
            acts[0] = w->act[0];
            for (int j = 1; j <= l; j++) acts[j] = pq[(j - 1) % 2];
            CMLP_TRY(forward(m, n, l, acts));
            al = acts[l];
            other = pq[0] == al ? pq[1] : pq[0];
        }
        if (b->gemm_half) { /* dW += dY^T A, db += colsum(dY), dA = relu'(dY W): all in half storage */
            cmlp_dtype dt = m->wsa.dt;
            const uint16_t *wh = m->wsa.wh + m->w_off[l];
            bool branch = side && l > 0; /* as backward_rows in model.c */
            CMLP_TRY(cmlp_side(m, branch, 1));
            CMLP_TRY(b->gemm_half(CTX(m), 1, 0, out, in, n, 1.0f, cur, out, al, in, dt, fresh ? 0.0f : 1.0f,
                                  m->grads + m->w_off[l], CMLP_DTYPE_F32, in, NULL, 0));
            if (l == L - 1) CMLP_TRY(b->bias_grad_half(CTX(m), m->grads + m->b_off[l], cur, n, out, dt, fresh));
            CMLP_TRY(cmlp_side(m, branch, 0));
            if (l > 0) { /* the bias gradient of the layer below comes with the mask; layer 1's input gradient
                          * over the buffers from layer 2's output on (cmlp_amp_layout) */
                bool first = l == 1 && !w->recompute;
                void *dx = !first ? (void *)other : L > 2 ? (void *)w->act[2] : (void *)w->logits;
                if (first && (size_t)(n * in) * sizeof(uint16_t) > w->dx1_bytes)
                    return CMLP_FAIL(CMLP_ERR_STATE, "layer 1's input gradient needs %lld bytes, its place holds %zu",
                                     (long long)(n * in * 2), w->dx1_bytes);
                CMLP_TRY(b->gemm_half(CTX(m), 0, 0, n, in, out, 1.0f, cur, out, wh, in, dt, 0.0f, dx, dt, in, NULL, 0));
                CMLP_TRY(cmlp_side_join(m, branch && l == 1));
                CMLP_TRY(b->relu_backward_bias_grad(CTX(m), dx, al, first ? (void *)al : dx, dt,
                                                    m->grads + m->b_off[l - 1], n, in, fresh));
                CMLP_TRY(cmlp_side_join(m, branch && l > 1));
            }
        } else {
            CMLP_TRY(layer_weights(m, l));
            for (int64_t r = 0; r < n; r += w->chunk) {
                int64_t k = n - r < w->chunk ? n - r : w->chunk;
                CMLP_TRY(b->from_half(CTX(m), dy, cur + r * out, k * out, m->wsa.dt));
                CMLP_TRY(b->from_half(CTX(m), a, al + r * in, k * in, m->wsa.dt));
                bool first = fresh && r == 0; /* the first block writes, the rest add */
                CMLP_TRY(b->gemm(CTX(m), 1, 0, out, in, k, 1.0f, dy, out, a, in, first ? 0.0f : 1.0f,
                                 m->grads + m->w_off[l], in));
                CMLP_TRY(b->bias_grad(CTX(m), m->grads + m->b_off[l], dy, k, out, first));
                if (l == 0) continue;
                CMLP_TRY(b->gemm(CTX(m), 0, 0, k, in, out, 1.0f, dy, out, w->w32, in, 0.0f, dx, in));
                CMLP_TRY(b->relu_backward(CTX(m), dx, a, k * in));
                uint16_t *dst = l == 1 && !w->recompute ? (uint16_t *)al : other; /* as cmlp_model_fb_rows */
                CMLP_TRY(b->to_half(CTX(m), dst + r * in, dx, k * in, m->wsa.dt));
            }
        }
        /* layer 1's input gradient, masked, replaces layer 1's input (cmlp_grad_widths) */
        uint16_t *dst = l == 1 && !w->recompute ? (uint16_t *)al : other;
        other = cur;
        cur = dst;
    }
    return CMLP_OK;
}

cmlp_status cmlp_amp_fb(cmlp_model *m, const cmlp_data *xy, const int64_t *idx, int64_t start, int64_t n,
                        cmlp_gw w, float smoothing, cmlp_amp amp, int recompute, double *d_loss) {
    size_t sz[CMLP_MAX_LAYERS + 12], off[CMLP_MAX_LAYERS + 12];
    uint64_t inside;
    int nv;
    bool compact = w.fresh && w.solo && layout(m, n, recompute, sz, &nv, &inside, off);
    cmlp_dtype dt = cmlp_amp_dtype(amp);
    bool had_half = m->params_h != NULL;
    if (!compact) CMLP_TRY(ensure_half_params(m, dt)); /* before the workspace, as the planner has it */
    cmlp_status reserved = reserve(m, n, recompute, compact);
    if (reserved != CMLP_OK) { /* a refused step leaves the half weights as it found them */
        if (!had_half) drop_half_params(m);
        return reserved;
    }
    cmlp_amp_workspace *ws = &m->wsa;
    ws->dt = dt;
    const cmlp_backend_i *b = B(m);
    /* the second stream where the device multiplies half operands itself, without recompute */
    bool side = b->gemm_half && !recompute && cmlp_side_use(m, n);
    int L = m->nlayers;
    cmlp_status st = CMLP_OK;
    ws->forked = ws->b32_made = false;
    if (ws->compact) { /* this step's half weights, where the first layer's weight gradient goes last */
        ws->wh = (const uint16_t *)m->grads;
    } else {
        CMLP_TRY(ensure_half_params(m, dt)); /* a full workspace serves a step that could be compact */
        ws->wh = m->params_h;
    }
    if (side) { /* the half weights and the logits' bias through half precision, beside the gather */
        st = cmlp_side(m, true, 1);
        ws->forked = true;
    }
    if (st == CMLP_OK && ws->compact) st = b->to_half(CTX(m), (uint16_t *)m->grads, m->params, m->nparams, dt);
    if (st == CMLP_OK && side) {
        st = b->from_half(CTX(m), ws->b32, ws->wh + m->b_off[L - 1], m->sizes[L], dt);
        ws->b32_made = st == CMLP_OK;
    }
    (void)cmlp_side(m, side, 0);
    const int32_t *labels;
    if (st == CMLP_OK) st = stage(m, xy, idx, start, n, &labels);
    if (st == CMLP_OK && recompute) {
        /* to the logits through the gradient buffers, which are free until backward */
        uint16_t *acts[CMLP_MAX_LAYERS + 1];
        acts[0] = m->wsa.act[0];
        for (int j = 1; j < m->nlayers; j++) acts[j] = m->wsa.dact[(j - 1) % 2];
        st = forward(m, n, m->nlayers, acts);
    } else if (st == CMLP_OK) {
        st = forward(m, n, m->nlayers, m->wsa.act);
    }
    if (st != CMLP_OK) {
        if (ws->forked) (void)cmlp_side_join(m, true); /* nothing is left forked */
        ws->forked = ws->b32_made = false;
        return st;
    }
    int64_t C = m->sizes[m->nlayers];
    /* the logits' gradient straight into half precision where the device can (the first
     * gradient buffer is free: backward starts from it) */
    bool half_grad = b->gemm_half && b->softmax_xent_half;
    if (half_grad)
        CMLP_TRY(b->softmax_xent_half(CTX(m), m->wsa.logits, labels, n, C, smoothing, w.loss,
                                      m->wsa.dact[0], m->wsa.dt, d_loss, NULL));
    else
        CMLP_TRY(b->softmax_xent(CTX(m), m->wsa.logits, labels, n, C, smoothing, w.loss, m->wsa.dlogits,
                                 d_loss, NULL));
    st = backward(m, n, w.fresh, half_grad, side);
    if (st != CMLP_OK) (void)cmlp_side_join(m, side); /* nothing is left forked */
    return st;
}
