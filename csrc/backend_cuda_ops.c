/* backend_cuda_ops.c - the operations that launch the kernels of kernels/: bias
 * gradients, elementwise and loss kernels, staging of host data and gathering of batches, the
 * optimizers and the mixed-precision steps.
 */
#include "backend_cuda.h"

/* Bias gradients of tall matrices put partial sums in the GEMM workspace between two launches:
 * both are queued under the lock, so that no other thread's GEMM or bias gradient comes between
 * them on the stream. kind: 0 float, 1 fp16, 2 bf16; h: mask through the ReLU first. */
static cmlp_status bias_grad_locked(cuda_ctx *c, void *dy, const void *h, void *out, int kind, float *db,
                                    int64_t rows, int64_t cols, int overwrite) {
    CMLP_TRY_USE(c);
    const bool mask = h != NULL;
    if (!c->bias_grad_loaded[kind][mask]) { /* where the cache can give memory back: not under the lock */
        cmlp_status st = KERNEL(c, cmlp_k_bias_grad_load(kind, mask));
        if (st != CMLP_OK) return st;
        c->bias_grad_loaded[kind][mask] = true;
    }
    pthread_mutex_lock(&c->lock);
    size_t nb;
    void *ws = ws_of(c, &nb);
    cudaError_t e = h ? cmlp_k_relu_backward_bias_grad(dy, h, out, kind, db, rows, cols, overwrite, ws, nb,
                                                       stream_of(c))
                    : kind == 0 ? cmlp_k_bias_grad(db, dy, rows, cols, overwrite, ws, nb, stream_of(c))
                                : cmlp_k_bias_grad_half(db, dy, rows, cols, kind == 2, overwrite, ws, nb,
                                                        stream_of(c));
    pthread_mutex_unlock(&c->lock);
    return done(c, e, "the bias gradient's kernels");
}

static int half_kind(cmlp_dtype dtype) { return dtype == CMLP_DTYPE_F32 ? 0 : dtype == CMLP_DTYPE_F16 ? 1 : 2; }

static cmlp_status cu_bias_grad_half(void *ctx, float *d_db, const uint16_t *d_dy, int64_t rows, int64_t cols,
                                     cmlp_dtype dtype, int overwrite) {
    return bias_grad_locked(ctx, (void *)d_dy, NULL, NULL, half_kind(dtype), d_db, rows, cols, overwrite);
}

/* ---- elementwise, loss, staging ---- */

static cmlp_status cu_bias_act(void *ctx, float *d_y, const float *d_bias, int64_t rows, int64_t cols, int relu) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_bias_act(d_y, d_bias, rows, cols, relu, stream_of(c)));
}

static cmlp_status cu_relu_backward(void *ctx, float *d_dy, const float *d_h, int64_t count) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_relu_backward(d_dy, d_h, count, stream_of(c)));
}

static cmlp_status cu_relu_backward_bias_grad(void *ctx, void *d_dy, const void *d_h, void *d_out, cmlp_dtype dtype,
                                              float *d_db, int64_t rows, int64_t cols, int overwrite) {
    if (d_out != d_dy && d_out != d_h) return FAIL(CMLP_ERR_INVALID, "the masked gradient goes to d_dy or d_h");
    return bias_grad_locked(ctx, d_dy, d_h, d_out, half_kind(dtype), d_db, rows, cols, overwrite);
}

static cmlp_status cu_bias_grad(void *ctx, float *d_db, const float *d_dy, int64_t rows, int64_t cols, int overwrite) {
    return bias_grad_locked(ctx, (void *)d_dy, NULL, NULL, 0, d_db, rows, cols, overwrite);
}

/* The loss kernel's scratch on the first stream (a capture's replays run there too); a loss on
 * the second stream, which does not occur, would be totalled by atomics. */
static void *xent_scratch(const cuda_ctx *c) { return on_side(c) ? NULL : c->xent_slot; }

static cmlp_status cu_softmax_xent(void *ctx, const float *d_logits, const int32_t *d_labels, int64_t rows,
                                   int64_t cols, float smoothing, cmlp_loss_weight w, float *d_dlogits,
                                   double *d_loss_sum, int64_t *d_correct) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_softmax_xent(d_logits, d_labels, rows, cols, smoothing, w.value, w.d_scale, w.count,
                                         w.d_found_inf, d_dlogits, d_loss_sum, (unsigned long long *)d_correct,
                                         xent_scratch(c), stream_of(c)));
}

static cmlp_status cu_softmax_xent_half(void *ctx, const float *d_logits, const int32_t *d_labels, int64_t rows,
                                        int64_t cols, float smoothing, cmlp_loss_weight w, uint16_t *d_dlogits,
                                        cmlp_dtype half, double *d_loss_sum, int64_t *d_correct) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_softmax_xent_half(d_logits, d_labels, rows, cols, smoothing, w.value, w.d_scale, w.count,
                                              w.d_found_inf, d_dlogits, half == CMLP_DTYPE_BF16, d_loss_sum,
                                              (unsigned long long *)d_correct, xent_scratch(c), stream_of(c)));
}

/* The next staging slot with room for nbytes, once the copy that last read it is done. Called
 * with the lock held; stage_sent() records the copy that reads it. */
static cmlp_status stage_buffer(cuda_ctx *c, size_t nbytes, int *slot, void **out) {
    int i = c->h_stage_next;
    c->h_stage_next = (i + 1) % STAGE_SLOTS;
    if (!c->h_stage_done[i]) CU_TRY(cudaEventCreateWithFlags(&c->h_stage_done[i], cudaEventDisableTiming));
    if (c->h_stage_used[i]) CU_TRY(cudaEventSynchronize(c->h_stage_done[i]));
    if (nbytes > c->h_stage_bytes[i]) {
        size_t want = nbytes < ((size_t)1 << 20) ? ((size_t)1 << 20) : nbytes + nbytes / 2;
        if (c->h_stage[i]) CU_TRY(cudaFreeHost(c->h_stage[i]));
        c->h_stage[i] = NULL;
        c->h_stage_bytes[i] = 0;
        CU_TRY(cudaMallocHost(&c->h_stage[i], want));
        c->h_stage_bytes[i] = want;
    }
    c->h_stage_used[i] = false;
    *slot = i;
    *out = c->h_stage[i];
    return CMLP_OK;
}

static cmlp_status stage_sent(cuda_ctx *c, int slot, cudaError_t copy, const char *what) {
    if (copy == cudaSuccess) copy = cudaEventRecord(c->h_stage_done[slot], stream_of(c));
    c->h_stage_used[slot] = copy == cudaSuccess;
    return done(c, copy, what);
}

static cmlp_status cu_stage_rows(void *ctx, float *d_dst, const void *h_src, cmlp_dtype dtype, int64_t cols,
                                 const int64_t *h_idx, int64_t start, int64_t rows, float scale, float shift) {
    cuda_ctx *c = ctx;
    if (rows == 0 || cols == 0) return CMLP_OK;
    REFUSE_WHILE_CAPTURING(c, "staging host rows");
    CMLP_TRY_USE(c);
    size_t nbytes = (size_t)rows * (size_t)cols * sizeof(float);
    pthread_mutex_lock(&c->lock);
    void *buf = NULL;
    int slot = 0;
    cmlp_status st = stage_buffer(c, nbytes, &slot, &buf);
    if (st == CMLP_OK) {
        float *dst = buf;
        for (int64_t r = 0; r < rows; r++) {
            int64_t s = h_idx ? h_idx[r] : start + r;
            float *d = dst + r * cols;
            if (dtype == CMLP_DTYPE_U8) {
                const uint8_t *u = (const uint8_t *)h_src + s * cols;
                for (int64_t k = 0; k < cols; k++) d[k] = (float)u[k] * scale + shift;
            } else {
                memcpy(d, (const float *)h_src + s * cols, (size_t)cols * sizeof(float));
            }
        }
        cudaError_t e = cudaMemcpyAsync(d_dst, buf, nbytes, cudaMemcpyHostToDevice, stream_of(c));
        st = stage_sent(c, slot, e, "staging rows");
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cmlp_status cu_stage_labels(void *ctx, int32_t *d_dst, const int32_t *h_src, const int64_t *h_idx, int64_t start,
                                   int64_t rows) {
    cuda_ctx *c = ctx;
    if (rows == 0) return CMLP_OK;
    REFUSE_WHILE_CAPTURING(c, "staging host labels");
    CMLP_TRY_USE(c);
    pthread_mutex_lock(&c->lock);
    void *buf = NULL;
    int slot = 0;
    const size_t nbytes = (size_t)rows * sizeof(int32_t);
    cmlp_status st = stage_buffer(c, nbytes, &slot, &buf);
    if (st == CMLP_OK) {
        int32_t *dst = buf;
        for (int64_t r = 0; r < rows; r++) dst[r] = h_src[h_idx ? h_idx[r] : start + r];
        cudaError_t e = cudaMemcpyAsync(d_dst, buf, nbytes, cudaMemcpyHostToDevice, stream_of(c));
        st = stage_sent(c, slot, e, "staging labels");
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cmlp_status cu_gather_rows(void *ctx, float *d_dst, const void *d_src, cmlp_dtype dtype, int64_t cols,
                                  const int64_t *d_idx, int64_t start, const int64_t *d_pos, int64_t rows, float scale,
                                  float shift, int32_t *d_labels, const int32_t *d_label_src) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    if (dtype == CMLP_DTYPE_U8)
        return KERNEL(c, cmlp_k_gather_u8(d_dst, d_src, d_idx, start, d_pos, rows, cols, scale, shift, d_labels,
                                          d_label_src, stream_of(c)));
    /* float rows are copied as they are */
    return KERNEL(c, cmlp_k_gather_f32(d_dst, d_src, d_idx, start, d_pos, rows, cols, 1.0f, 0.0f, d_labels,
                                       d_label_src, stream_of(c)));
}

static cmlp_status cu_gather_rows_half(void *ctx, uint16_t *d_dst, cmlp_dtype half, const void *d_src,
                                       cmlp_dtype dtype, int64_t cols, const int64_t *d_idx, int64_t start,
                                       const int64_t *d_pos, int64_t rows, float scale, float shift, int32_t *d_labels,
                                       const int32_t *d_label_src) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    const int u8 = dtype == CMLP_DTYPE_U8; /* float rows are taken as they are */
    return KERNEL(c, cmlp_k_gather_half(d_dst, half == CMLP_DTYPE_BF16, d_src, u8, d_idx, start, d_pos, rows, cols,
                                        u8 ? scale : 1.0f, u8 ? shift : 0.0f, d_labels, d_label_src, stream_of(c)));
}

static cmlp_status cu_gather_labels(void *ctx, int32_t *d_dst, const int32_t *d_src, const int64_t *d_idx,
                                    int64_t start, const int64_t *d_pos, int64_t rows) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_gather_labels(d_dst, d_src, d_idx, start, d_pos, rows, stream_of(c)));
}

/* ---- optimizers and mixed precision ---- */

/* zero_g's zeroing after an update's launch (on the same stream: after it has read them). A GEMM's
 * beta = 0 costs cuBLAS nothing (no beta_zero_pass), so the core does not ask for it here. */
static cmlp_status zero_after(cuda_ctx *c, cmlp_status st, float *d_g, int64_t n, int zero_g) {
    if (st != CMLP_OK || !zero_g || n <= 0) return st;
    return done(c, cudaMemsetAsync(d_g, 0, (size_t)n * sizeof(float), stream_of(c)), "cudaMemsetAsync");
}

static cmlp_status cu_adam(void *ctx, float *d_p, float *d_g, float *d_m, float *d_v, float *d_vmax, int64_t n,
                           float step_size, float beta1, float beta2, float one_b1, float one_b2, float bc2_sqrt,
                           float eps, float weight_decay, float decay, int maximize, const float *d_found_inf,
                           const float *d_coef, int zero_g) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    cmlp_status st = KERNEL(c, cmlp_k_adam(d_p, d_g, d_m, d_v, d_vmax, n, step_size, beta1, beta2, one_b1, one_b2,
                                           bc2_sqrt, eps, weight_decay, decay, maximize, d_found_inf, d_coef,
                                           stream_of(c)));
    return zero_after(c, st, d_g, n, zero_g);
}

static cmlp_status cu_sgd(void *ctx, float *d_p, float *d_g, float *d_buf, int64_t n, float lr, float momentum,
                          float keep, int nesterov, float weight_decay, int maximize, const float *d_found_inf,
                          const float *d_coef, int zero_g) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    cmlp_status st = KERNEL(c, cmlp_k_sgd(d_p, d_g, d_buf, n, lr, momentum, keep, nesterov, weight_decay, maximize,
                                          d_found_inf, d_coef, stream_of(c)));
    return zero_after(c, st, d_g, n, zero_g);
}

/* The kernels' copy of a loss-scale update (zeros when scale is NULL). */
static cmlp_k_scaler k_scaler(const cmlp_scale_step *scale) {
    cmlp_k_scaler k = {0};
    if (scale)
        k = (cmlp_k_scaler){scale->d_scale, scale->d_tracker, (long long *)scale->d_skipped, scale->growth_factor,
                            scale->backoff_factor, scale->growth_interval};
    return k;
}

/* The kernels' copy of a rate's source. */
static cmlp_k_rate k_rate(const cmlp_rate_src *rate) {
    return (cmlp_k_rate){rate->d_rates,  (long long *)rate->d_next, rate->decoupled_wd, rate->nparts,
                         rate->d_parts,  rate->d_part_coef,         rate->d_step_scales};
}

/* CUDA loads a kernel at its first launch (or reference), into device memory that may be short:
 * each group of the update's kernels is loaded once, ahead (see update_load in backend.h). */
static cmlp_status load_update(cuda_ctx *c, int adam, int unscale, int clip) {
    const int k = adam != 0;
    cmlp_status st = CMLP_OK;
    if (!c->update_loaded[k] && (st = KERNEL(c, cmlp_k_update_load(k))) == CMLP_OK) c->update_loaded[k] = true;
    if (st == CMLP_OK && unscale && !c->unscale_loaded && (st = KERNEL(c, cmlp_k_unscale_load())) == CMLP_OK)
        c->unscale_loaded = true;
    if (st == CMLP_OK && clip && !c->clip_loaded && (st = KERNEL(c, cmlp_k_clip_load())) == CMLP_OK)
        c->clip_loaded = true;
    return st;
}

static cmlp_status cu_update_load(void *ctx, int adam, int unscale, int clip) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return load_update(c, adam, unscale, clip);
}

static cmlp_status cu_optim_prepare(void *ctx, int64_t *d_step, float *d_coef, const float *d_found_inf,
                                    const cmlp_rate_src *rate, double beta2, int adam, int64_t *d_pos, int64_t pos_add,
                                    const cmlp_scale_step *scale) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    /* the update's own kernels first, so that where they cannot be loaded the step fails with its
     * bookkeeping (step count, data position, loss scale) where it was */
    cmlp_status st = load_update(c, adam, 0, 0);
    if (st != CMLP_OK) return st;
    const cmlp_k_scaler k = k_scaler(scale);
    return KERNEL(c, cmlp_k_optim_prepare(d_step, d_coef, d_found_inf, k_rate(rate), beta2, adam, d_pos, pos_add,
                                          scale ? &k : NULL, stream_of(c)));
}

static cmlp_status cu_adam_prepared(void *ctx, float *d_p, const float *d_g, float *d_m, float *d_v, float *d_vmax,
                                    int64_t n, const cmlp_rate_src *rate, double beta2, float eps, float weight_decay,
                                    int maximize, const float *d_found_inf, int64_t *d_step, float *d_coef,
                                    int64_t *d_pos, int64_t pos_add, const cmlp_scale_step *scale,
                                    uint32_t *d_blocks_done) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    const cmlp_k_scaler k = k_scaler(scale);
    return KERNEL(c, cmlp_k_adam_prepared(d_p, d_g, d_m, d_v, d_vmax, n, k_rate(rate), beta2, eps, weight_decay,
                                          maximize, d_found_inf, d_step, d_coef, d_pos, pos_add, scale ? &k : NULL,
                                          d_blocks_done, stream_of(c)));
}

static cmlp_status cu_to_half(void *ctx, uint16_t *d_dst, const float *d_src, int64_t n, cmlp_dtype dtype) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_to_half(d_dst, d_src, n, dtype == CMLP_DTYPE_BF16, stream_of(c)));
}

static cmlp_status cu_from_half(void *ctx, float *d_dst, const uint16_t *d_src, int64_t n, cmlp_dtype dtype) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_from_half(d_dst, d_src, n, dtype == CMLP_DTYPE_BF16, stream_of(c)));
}

static cmlp_status cu_unscale(void *ctx, float *d_g, int64_t n, float inv_scale, const float *d_scale,
                              float *d_found_inf) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_unscale(d_g, n, inv_scale, d_scale, d_found_inf, stream_of(c)));
}

_Static_assert(CMLP_K_NORM_THREADS == CMLP_NORM_THREADS && CMLP_K_NORM_PARTS == CMLP_NORM_PARTS,
               "the norm's order is backend.h's");

static cmlp_status cu_grad_norm(void *ctx, const float *d_g, int64_t n, double norm_type, float *d_norm,
                                double *d_part, uint32_t *d_blocks_done) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_grad_norm(d_g, n, norm_type, d_norm, d_part, d_blocks_done, stream_of(c)));
}

static cmlp_status cu_clip_by_norm(void *ctx, float *d_g, int64_t n, const float *d_norm, float max_norm,
                                   double *d_norm_sum, int64_t *d_norm_steps) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_clip_by_norm(d_g, n, d_norm, max_norm, d_norm_sum, (long long *)d_norm_steps,
                                         stream_of(c)));
}

static cmlp_status cu_clip_by_value(void *ctx, float *d_g, int64_t n, float v) {
    cuda_ctx *c = ctx;
    CMLP_TRY_USE(c);
    return KERNEL(c, cmlp_k_clip_by_value(d_g, n, v, stream_of(c)));
}

/* Waits for the first stream: a step's work on the second is joined to it before the step ends
 * (another thread's step in progress may still have work there). */
static cmlp_status cu_synchronize(void *ctx) {
    cuda_ctx *c = ctx;
    REFUSE_WHILE_CAPTURING(c, "waiting for the device");
    CMLP_TRY_USE(c);
    CU_TRY(cudaStreamSynchronize(c->stream));
    return CMLP_OK;
}

void cuda_kernel_ops(cmlp_backend_i *b) {
    b->bias_grad_half = cu_bias_grad_half;
    b->bias_act = cu_bias_act;
    b->relu_backward = cu_relu_backward;
    b->relu_backward_bias_grad = cu_relu_backward_bias_grad;
    b->bias_grad = cu_bias_grad;
    b->softmax_xent = cu_softmax_xent;
    b->softmax_xent_half = cu_softmax_xent_half;
    b->stage_rows = cu_stage_rows;
    b->stage_labels = cu_stage_labels;
    b->gather_rows = cu_gather_rows;
    b->gather_rows_half = cu_gather_rows_half;
    b->gather_labels = cu_gather_labels;
    b->adam = cu_adam;
    b->sgd = cu_sgd;
    b->to_half = cu_to_half;
    b->from_half = cu_from_half;
    b->update_load = cu_update_load;
    b->optim_prepare = cu_optim_prepare;
    b->adam_prepared = cu_adam_prepared;
    b->unscale = cu_unscale;
    b->grad_norm = cu_grad_norm;
    b->clip_by_norm = cu_clip_by_norm;
    b->clip_by_value = cu_clip_by_value;
    b->synchronize = cu_synchronize;
}
