/* workspace.c - a model's activation workspace: the layouts of a training step's and of a
 * forward pass's buffers (the planner sizes its plans with the same functions) and their
 * reservation from the device's allocator.
 */
#include "internal.h"

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

void cmlp_grad_widths(const int *sizes, int L, int amp, int64_t widths[2]) {
    widths[0] = widths[1] = 1;
    for (int l = L; l >= (L > 1 ? 2 : 1); l--) {
        int i = (L - l) & 1;
        if (sizes[l] > widths[i]) widths[i] = sizes[l];
    }
    if (L < 2) return;
    /* layer 1's input gradient spans the outputs of layers 2..L and the buffer after them */
    int64_t have = 0;
    for (int l = 2; l <= L; l++) have += (l == L && amp ? 2 : 1) * (int64_t)sizes[l];
    int64_t need = sizes[1] - have, *w = &widths[(L - 1) & 1];
    if (need > *w) *w = need;
}

size_t cmlp_first_grad_bytes(const int *sizes) { return (size_t)sizes[0] * (size_t)sizes[1] * sizeof(float); }

bool cmlp_compact_place(int L, const size_t *sz, int nv, uint64_t inside, size_t first, size_t room, size_t *off) {
    size_t used = first;
    for (int i = 0; i < nv; i++) {
        off[i] = used;
        if (cmlp_piece_in(inside, i)) used += sz[i];
    }
    return L > 1 && nv <= 64 && used <= room;
}

size_t cmlp_place_pieces(const size_t *sz, int nv, uint64_t inside, const size_t *off, void *grads, void *block,
                         char **piece) {
    size_t used = 0;
    for (int i = 0; i < nv; i++) {
        if (cmlp_piece_in(inside, i)) {
            piece[i] = sz[i] && grads ? (char *)grads + off[i] : NULL;
        } else {
            piece[i] = sz[i] && block ? (char *)block + used : NULL;
            used += sz[i];
        }
    }
    return used;
}

/* Workspace for `rows` samples: inputs and every layer's output (kept for backward: the
 * activations), the two gradient buffers (cmlp_grad_widths) and labels (the workspace proper),
 * in the order input, layer 1's output, the gradient buffer that holds layer 2's input gradient,
 * the outputs of layers 2..L, the other gradient buffer, labels: layer 1's input gradient is
 * written over the outputs of layers 2..L and the buffer after them, which are free by then
 * (ws.dx1_bytes of them). The pieces in *inside (bits by index) are those a step that is alone
 * in its optimizer step may place in the first layer's weight gradient instead
 * (cmlp_compact_place): everything but the input and layer 1's output (then its input
 * gradient), which the GEMM that writes that gradient reads, and the labels. One allocation;
 * grows, never shrinks. The planner sizes it with the same function. */
int cmlp_ws_layout(const int *sizes, int L, int64_t rows, size_t *sz, size_t *act_bytes, uint64_t *inside) {
    int nv = 0;
    int64_t g[2];
    cmlp_grad_widths(sizes, L, 0, g);
    *act_bytes = 0;
    *inside = 0;
    int cur1 = L > 1 ? (L - 2) & 1 : 0; /* the buffer that holds layer 2's input gradient */
    for (int l = 0; l <= 1; l++) *act_bytes += sz[nv++] = align64((size_t)rows * sizes[l] * sizeof(float));
    cmlp_piece_set(inside, nv);
    sz[nv++] = align64((size_t)(rows * g[cur1]) * sizeof(float));
    for (int l = 2; l <= L; l++) {
        cmlp_piece_set(inside, nv);
        *act_bytes += sz[nv++] = align64((size_t)rows * sizes[l] * sizeof(float));
    }
    cmlp_piece_set(inside, nv);
    sz[nv++] = align64((size_t)(rows * g[1 - cur1]) * sizeof(float));
    sz[nv++] = align64((size_t)rows * sizeof(int32_t));
    return nv;
}

cmlp_status cmlp_workspace_reserve(cmlp_model *m, int64_t rows, bool compact) {
    /* a full workspace serves a step that could be compact too */
    if (rows <= m->ws.rows && (compact || !m->ws.compact) && !m->ws.forward) return CMLP_OK;
    size_t sz[CMLP_MAX_LAYERS + 4], off[CMLP_MAX_LAYERS + 4], total, act;
    uint64_t inside;
    int L = m->nlayers, nv = cmlp_ws_layout(m->sizes, L, rows, sz, &act, &inside);
    if (!compact || !cmlp_compact_place(L, sz, nv, inside, 0, cmlp_first_grad_bytes(m->sizes), off))
        inside = 0, compact = false;
    char *piece[CMLP_MAX_LAYERS + 4], *block;
    total = cmlp_place_pieces(sz, nv, inside, off, NULL, NULL, piece); /* the bytes outside */
    /* the smaller workspace goes first (its contents are a step's, done): the new one may take
     * its memory, and the peak is the larger one's alone, as the planner counts it */
    cmlp_model_release_workspace(m);
    CMLP_TRY(cmlp_allocator_malloc(m->dev->alloc, total, "activations", (void **)&block));
    m->ws.block = block;
    m->ws.rows = rows;
    m->ws.compact = compact;
    m->ws.inside_bytes = 0;
    for (int i = 0; i < nv; i++)
        if (cmlp_piece_in(inside, i) && off[i] + sz[i] > m->ws.inside_bytes) m->ws.inside_bytes = off[i] + sz[i];
    cmlp_place_pieces(sz, nv, inside, off, m->grads, block, piece);
    int cur1 = L > 1 ? (L - 2) & 1 : 0, v = 0;
    m->ws.act[0] = (float *)piece[v++];
    m->ws.act[1] = (float *)piece[v++];
    m->ws.dact[cur1] = (float *)piece[v++];
    for (int l = 2; l <= L; l++) m->ws.act[l] = (float *)piece[v++];
    m->ws.dact[1 - cur1] = (float *)piece[v++];
    m->ws.labels = (int32_t *)piece[v];
    m->ws.dx1_bytes = 0;
    for (int i = 3; L > 1 && i < v; i++) m->ws.dx1_bytes += sz[i]; /* layer 2's output to the buffer after */
    return CMLP_OK;
}

int cmlp_fwd_layout(const int *sizes, int L, int64_t rows, bool input, size_t *sz) {
    int64_t w[2] = {0, 0}; /* odd layers' outputs, even layers' */
    for (int l = 1; l <= L; l++)
        if (sizes[l] > w[(l - 1) & 1]) w[(l - 1) & 1] = sizes[l];
    sz[0] = input ? align64((size_t)rows * sizes[0] * sizeof(float)) : 0;
    sz[1] = align64((size_t)(rows * w[0]) * sizeof(float));
    sz[2] = align64((size_t)(rows * w[1]) * sizeof(float));
    sz[3] = align64((size_t)rows * sizeof(int32_t));
    return 4;
}

/* The workspace of a forward pass (forward, predict, evaluate) over `rows` samples: a step's
 * serves when it is large enough and all its own (not compact); else one without gradients
 * (cmlp_fwd_layout), on the reference model a third of a step's per row, or two thirds with
 * the input staged. */
cmlp_status cmlp_forward_reserve(cmlp_model *m, int64_t rows, bool input) {
    if (rows <= m->ws.rows && !m->ws.compact && (!input || m->ws.act[0])) return CMLP_OK;
    size_t sz[4], total = 0;
    int L = m->nlayers, nv = cmlp_fwd_layout(m->sizes, L, rows, input, sz);
    for (int i = 0; i < nv; i++) total += sz[i];
    char *block;
    /* a few rows whose pool can make no segment (under a limit, say) may take a piece of a cached
     * large-pool block (the room a step's buffers left): fewer rows would not help them */
    cmlp_model_release_workspace(m); /* (first, as a step's above) */
    CMLP_TRY(cmlp_allocator_malloc_lent(m->dev->alloc, total, "activations", (void **)&block));
    m->ws.block = block;
    m->ws.rows = rows;
    m->ws.forward = true;
    m->ws.act[0] = input ? (float *)block : NULL;
    for (int l = 1; l <= L; l++) m->ws.act[l] = (float *)(block + sz[0] + ((l - 1) & 1 ? sz[1] : 0));
    m->ws.labels = (int32_t *)(block + sz[0] + sz[1] + sz[2]);
    return CMLP_OK;
}
