/* kernels.h - the CUDA kernels of the CUDA backend, callable from C (csrc/backend_cuda.c).
 *
 *     cudaError_t e = cmlp_k_relu_backward(d_dy, d_h, n, stream);
 *
 * Every launcher enqueues its work on `stream`, never synchronises, and returns the launch's
 * cudaError_t (cudaSuccess when n or rows is 0: nothing is launched; cudaErrorInvalidValue for
 * a negative count). All pointers are device pointers aligned to their element type (16-byte
 * alignment lets the kernels use vector accesses); matrices are row-major [rows, cols]. Counts
 * are int64_t; a launcher splits work that exceeds one grid itself. Kernels never read or
 * write outside the given extents.
 *
 * fp32 arithmetic is the CPU backend's, operation for operation: round to nearest, no FMA
 * contraction, subnormals flushed (the core runs the CPU backend under FTZ/DAZ), so the
 * elementwise kernels and the optimizers give the CPU's bits.
 *
 * Families: bias_act.cu (bias, ReLU), loss.cu (softmax cross-entropy), data.cu (gathering a
 * device-resident data set), optim.cu (Adam, SGD, a step's bookkeeping and the loss-scale
 * update), amp.cu (casts, unscale, the gradient weight), clip.cu (gradient norm and clipping).
 */
#ifndef CMLP_KERNELS_H
#define CMLP_KERNELS_H

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- bias_act.cu ---- */

/* y[r, c] = act(y[r, c] + bias[c]); act is ReLU when relu != 0, identity otherwise. */
cudaError_t cmlp_k_bias_act(float *y, const float *bias, int64_t rows, int64_t cols, int relu, cudaStream_t stream);
/* fp16 (bf16 == 0) or bf16 storage [rows, cols]: with bias, y[r, c] = bias[c]; with bias NULL,
 * y = ReLU(y). A GEMM with no fused bias epilogue: rows of bias, the GEMM adding to them, ReLU. */
cudaError_t cmlp_k_rows_half(uint16_t *y, const uint16_t *bias, int64_t rows, int64_t cols, int bf16,
                             cudaStream_t stream);
/* dy[i] = h[i] > 0 ? dy[i] : 0 for i < n (h is the ReLU's output). */
cudaError_t cmlp_k_relu_backward(float *dy, const float *h, int64_t n, cudaStream_t stream);
/* db[c] += sum over r of dy[r, c], or with overwrite != 0 db[c] = 0 + that sum (the bits of
 * zeroing db first). The sum over rows is done in fp32 in an order fixed by (rows, cols,
 * scratch_bytes): deterministic.
 * scratch (may be NULL) is device memory of scratch_bytes the launcher may use, stream-ordered,
 * for partial sums of a tall dy (a second kernel then adds them): the backend passes its GEMM
 * workspace, which is free between GEMMs on the same stream as long as nothing else is queued
 * between the two launches (the backend queues them under its lock). */
cudaError_t cmlp_k_bias_grad(float *db, const float *dy, int64_t rows, int64_t cols, int overwrite, float *scratch,
                             size_t scratch_bytes, cudaStream_t stream);
/* The same two over fp16 (bf16 == 0) or bf16 storage: db (fp32) += column sums of dy; dy[i] = 0
 * where h[i] > 0 does not hold. */
cudaError_t cmlp_k_bias_grad_half(float *db, const uint16_t *dy, int64_t rows, int64_t cols, int bf16, int overwrite,
                                  float *scratch, size_t scratch_bytes, cudaStream_t stream);
cudaError_t cmlp_k_relu_backward_half(uint16_t *dy, const uint16_t *h, int64_t n, int bf16, cudaStream_t stream);
/* Both in one pass over dy [rows, cols] of kind 0 (float), 1 (fp16) or 2 (bf16): dy goes
 * through the ReLU backward as above (h of the same kind) into out, which is dy or h (then the
 * gradient replaces the activations it was masked by), and db += its column sums, with the bits
 * of cmlp_k_relu_backward(_half) followed by cmlp_k_bias_grad(_half) given the same scratch. */
cudaError_t cmlp_k_relu_backward_bias_grad(void *dy, const void *h, void *out, int kind, float *db, int64_t rows,
                                           int64_t cols, int overwrite, float *scratch, size_t scratch_bytes,
                                           cudaStream_t stream);
/* Loads the kernels of the bias gradients of kind 0, 1 or 2 (masked through the ReLU first when
 * mask != 0) without launching them, as cmlp_k_update_load: the backend launches them under a
 * lock, where a launch that finds no room for its code cannot have the cache given back. */
cudaError_t cmlp_k_bias_grad_load(int kind, int mask);

/* ---- loss.cu ---- */

/* The scratch of a softmax cross-entropy launch that totals its loss in a fixed order: a
 * double per block, then the counter of the blocks done (0 between launches: zero it once). */
#define CMLP_K_XENT_BLOCKS 4096
#define CMLP_K_XENT_SCRATCH (CMLP_K_XENT_BLOCKS * 8 + 64)

/* Fused, numerically stable softmax cross-entropy over logits [rows, cols], labels int32 in
 * [0, cols). With q = (1 - smoothing) * onehot(label) + smoothing / cols and
 * p = softmax(logits row), the row loss is -sum_c q_c log p_c (computed as
 * logsumexp - sum_c q_c * logit_c, with the max subtracted).
 *   - *loss_sum (double) += the sum of the row losses (may be NULL). With scratch
 *     (CMLP_K_XENT_SCRATCH bytes, 8-byte aligned, its counter 0; launches sharing it run one
 *     after another) the rows' losses are summed in an order fixed by rows alone, so the total
 *     has the same bits in every run; with scratch NULL each block adds its part atomically,
 *     in the order the blocks finish.
 *   - dlogits (may be NULL, may equal logits): dlogits[r, c] = w * (p_c - q_c), where w is
 *     grad_weight, or (float)((double)*scale / count) when scale is not NULL (the weight of a
 *     loss-scaled step, from the scale on the device).
 *   - *found_inf = 0 when found_inf is not NULL (a loss-scaled step's check starts clean).
 *   - *correct (may be NULL) += the number of rows whose argmax (first maximum) is the label.
 * One warp per row, read once when cols <= 128 (10 for the reference model), three times when
 * wider; any cols >= 1 works (cols == 0 with rows > 0 is cudaErrorInvalidValue). A label
 * outside [0, cols) reads nothing out of bounds: its row counts no hit and q has no one-hot. */
cudaError_t cmlp_k_softmax_xent(const float *logits, const int32_t *labels, int64_t rows, int64_t cols, float smoothing,
                                float grad_weight, const float *scale, double count, float *found_inf, float *dlogits,
                                double *loss_sum, unsigned long long *correct, void *scratch, cudaStream_t stream);
/* The same with the gradient stored in fp16 (bf16 == 0) or bf16, each value rounded once from the
 * float above (dlogits may not alias logits here). */
cudaError_t cmlp_k_softmax_xent_half(const float *logits, const int32_t *labels, int64_t rows, int64_t cols,
                                     float smoothing, float grad_weight, const float *scale, double count,
                                     float *found_inf, uint16_t *dlogits, int bf16, double *loss_sum, unsigned long long *correct,
                                     void *scratch, cudaStream_t stream);

/* ---- data.cu ---- */

/* dst[r, :] = src[i, :] * scale + shift for r < rows, i = idx ? idx[p + r] : start + p + r, with
 * p = pos ? *pos : 0 (a position kept on the device, so that a captured graph can move through a
 * data set), where src is [*, cols] uint8 (u8 variant) or float32 (f32 variant: scale and shift
 * also apply; with scale 1 and shift 0 the rows are copied bit for bit). When ldst is not NULL
 * the rows' labels come in the same launch: ldst[r] = lsrc[i]. */
cudaError_t cmlp_k_gather_u8(float *dst, const uint8_t *src, const int64_t *idx, int64_t start, const int64_t *pos,
                             int64_t rows, int64_t cols, float scale, float shift, int32_t *ldst, const int32_t *lsrc,
                             cudaStream_t stream);
cudaError_t cmlp_k_gather_f32(float *dst, const float *src, const int64_t *idx, int64_t start, const int64_t *pos,
                              int64_t rows, int64_t cols, float scale, float shift, int32_t *ldst, const int32_t *lsrc,
                              cudaStream_t stream);
/* The same into fp16 (bf16 == 0) or bf16 storage: each value computed in float as above
 * (src_u8: src is uint8, else float32), then rounded once to nearest even. */
cudaError_t cmlp_k_gather_half(uint16_t *dst, int bf16, const void *src, int src_u8, const int64_t *idx, int64_t start,
                               const int64_t *pos, int64_t rows, int64_t cols, float scale, float shift, int32_t *ldst,
                               const int32_t *lsrc, cudaStream_t stream);
/* dst[r] = src[i] for r < rows, i as above. */
cudaError_t cmlp_k_gather_labels(int32_t *dst, const int32_t *src, const int64_t *idx, int64_t start,
                                 const int64_t *pos, int64_t rows, cudaStream_t stream);

/* ---- optim.cu ---- */

/* One fused Adam (PyTorch's rule, L2 weight decay added to the gradient) over n floats, with
 * decay != 1 first p = decay * p (decoupled weight decay, AdamW: decay = 1 - lr * wd):
 *   g' = g + weight_decay * p;  m = beta1 m + one_b1 g';  v = beta2 v + one_b2 g'^2
 *   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
 * where step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t), one_b1 = 1 - beta1 and
 * one_b2 = 1 - beta2 are computed by the caller in double and rounded (the same float operations,
 * in the same order, as the CPU backend), or when coef is not NULL read from coef[0..4] =
 * {step_size, bc2_sqrt, decay, beta1, one_b1}. When found_inf is not NULL and *found_inf != 0 the
 * kernel changes nothing. maximize != 0 flips the gradient's sign first; vmax, when not NULL, is
 * AMSGrad's running maximum: vmax = max(vmax, v) (NaN if either is), and the denominator is made
 * of vmax instead of v. */
cudaError_t cmlp_k_adam(float *p, const float *g, float *m, float *v, float *vmax, int64_t n, float step_size,
                        float beta1, float beta2, float one_b1, float one_b2, float bc2_sqrt, float eps,
                        float weight_decay, float decay, int maximize, const float *found_inf, const float *coef,
                        cudaStream_t stream);
/* SGD with PyTorch's rule: g' = (maximize ? -g : g) + weight_decay * p; with momentum != 0:
 *   buf = buf unstarted ? g' : momentum * buf + keep * g';  d = nesterov ? g' + momentum * buf : buf
 * (unstarted: bits 0xFFFFFFFF, CMLP_K_MOMENTUM_UNSTARTED, as a new buffer is filled: that
 * element's buffer has not started; any other NaN has, and stays NaN, as torch's)
 * (keep = 1 - dampening, computed by the caller in double and rounded)
 * else d = g'; then p -= lr * d (lr = coef[0] and momentum = coef[1] when coef is not NULL). buf
 * may be NULL when the momentum is 0. found_inf as for Adam. */
#define CMLP_K_MOMENTUM_UNSTARTED 0xFFFFFFFFu /* = cmlp.h's CMLP_MOMENTUM_UNSTARTED_BITS */
cudaError_t cmlp_k_sgd(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float keep,
                       int nesterov, float weight_decay, int maximize, const float *found_inf, const float *coef,
                       cudaStream_t stream);
/* A loss scale kept on the device, and PyTorch's rule for moving it (torch's
 * _amp_update_scale_): if the step found an inf/NaN, *scale *= backoff_factor and the tracker
 * resets (++*skipped); else if ++*growth_tracker == growth_interval then *scale *= growth_factor
 * unless that product is not finite, and the tracker resets. Products are formed in double and
 * rounded to float. */
typedef struct cmlp_k_scaler {
    float *scale;
    int32_t *growth_tracker;
    long long *skipped; /* may be NULL */
    double growth_factor, backoff_factor;
    int32_t growth_interval;
} cmlp_k_scaler;
/* The learning rate and momentum (Adam's beta1, SGD's momentum) of a step, on the device: the
 * pair rates[2k], rates[2k + 1] with k = *next, or k = 0 when next is NULL; with next, every step
 * moves *next on by one, skipped or not. decoupled_wd: AdamW's weight decay (0: none), whose
 * factor the step forms as (float)(1 - lr * decoupled_wd), each operation rounded in double. */
/* doubles per part in cmlp_k_rate.parts (the same as backend.h's) */
#define CMLP_PART_ARGS 4

typedef struct cmlp_k_rate {
    const double *rates;
    long long *next;
    double decoupled_wd;
    /* parameter groups (nparts may be 0): with part = parts + CMLP_PART_ARGS * p, part p's rate
     * is the step's times part[0], its decoupled weight decay part[1], its momentum part[2] and
     * its beta2 part[3] (NaN: the step's momentum, the beta2 given); a step taken writes its
     * coefficients, as coef's, to part_coef[5p..5p + 4] */
    int nparts;
    const double *parts;
    float *part_coef;
    /* when not NULL, a scale and a momentum per part for each step of the rates: with
     * row = step_scales + 2 * (k * nparts + p), the step at rates[2k] scales part p's rate by
     * row[0] instead of part[0], and its momentum is row[1] (NaN: as without the table) */
    const double *step_scales;
} cmlp_k_rate;

/* One thread, before a step whose skip is decided on the device: *pos += pos_add when pos is
 * not NULL (the data position, moved whether or not the step is skipped); lr and momentum read
 * from rate (which moves on); when scaler is not NULL, the loss-scale update (cmlp_k_scaler) on
 * the same found_inf; then unless *found_inf != 0 (found_inf may be NULL), t = ++*step and, for
 * Adam (adam != 0, momentum = beta1), coef[0] = (float)(lr / (1 - beta1^t)),
 * coef[1] = (float)sqrt(1 - beta2^t), coef[2] the decay, coef[3] = (float)beta1 and
 * coef[4] = (float)(1 - beta1), in double as the host computes them; for SGD coef[0] = (float)lr, coef[1] = (float)momentum. */
cudaError_t cmlp_k_optim_prepare(int64_t *step, float *coef, const float *found_inf, cmlp_k_rate rate, double beta2,
                                 int adam, int64_t *pos, int64_t pos_add, const cmlp_k_scaler *scaler,
                                 cudaStream_t stream);
/* Load kernels without launching them (CUDA loads a kernel's code at its first launch or
 * reference): cudaErrorMemoryAllocation where the device has no room for it. update_load: the
 * update's, cmlp_k_optim_prepare's and cmlp_k_adam (with cmlp_k_adam_prepared; adam != 0) or
 * cmlp_k_sgd; unscale_load: cmlp_k_unscale's; clip_load: clipping's (the L2 norm and scaling). */
cudaError_t cmlp_k_update_load(int adam);
cudaError_t cmlp_k_unscale_load(void);
cudaError_t cmlp_k_clip_load(void);
/* Loads an empty kernel: cudaErrorNoKernelImageForDevice (or cudaErrorUnsupportedPtxVersion)
 * where this build has no code the device runs. */
cudaError_t cmlp_k_probe(void);
/* cmlp_k_optim_prepare for Adam, then cmlp_k_adam (its coefficients from it), in one launch
 * with the same results: every block derives the step size, bias correction, decay and beta1 from
 * *step and the rate itself, and the block that finishes last does the bookkeeping and resets
 * *blocks_done, a counter that is 0 between launches (each launch's blocks count themselves on
 * it). n > 0. */
cudaError_t cmlp_k_adam_prepared(float *p, const float *g, float *m, float *v, float *vmax, int64_t n,
                                 cmlp_k_rate rate, double beta2, float eps, float weight_decay, int maximize,
                                 const float *found_inf, int64_t *step,
                                 float *coef, int64_t *pos, int64_t pos_add, const cmlp_k_scaler *scaler,
                                 unsigned int *blocks_done, cudaStream_t stream);

/* ---- amp.cu ---- */

/* fp32 <-> fp16 (bf16 == 0) or bf16 (bf16 != 0) storage, round to nearest even, subnormals
 * kept; n elements. A NaN stays a NaN, but its payload bits may differ from the CPU's. */
cudaError_t cmlp_k_to_half(uint16_t *dst, const float *src, int64_t n, int bf16, cudaStream_t stream);
cudaError_t cmlp_k_from_half(float *dst, const uint16_t *src, int64_t n, int bf16, cudaStream_t stream);
/* g[i] *= inv for i < n, where inv = scale ? (float)(1.0 / (double)*scale) : inv_scale; sets
 * *found_inf = 1.0f when any result is inf or NaN (never resets it). One pass. */
cudaError_t cmlp_k_unscale(float *g, int64_t n, float inv_scale, const float *scale, float *found_inf,
                           cudaStream_t stream);

/* ---- clip.cu ---- */

/* The reduction order of cmlp_k_grad_norm, a function of n alone (csrc/backend.h states the same
 * for every backend): blocks of CMLP_K_NORM_THREADS threads, one per 16 elements a thread, at
 * least 1 and at most CMLP_K_NORM_PARTS. */
#define CMLP_K_NORM_THREADS 256
#define CMLP_K_NORM_PARTS 32
static inline int64_t cmlp_k_norm_blocks(int64_t n) {
    const int64_t b = (n + CMLP_K_NORM_THREADS * 16 - 1) / (CMLP_K_NORM_THREADS * 16);
    return b < 1 ? 1 : b > CMLP_K_NORM_PARTS ? CMLP_K_NORM_PARTS : b;
}
/* *out = the norm_type-norm of g[0..n) (any norm_type but 0 and NaN: INFINITY for max |g|,
 * -INFINITY for min |g|, a negative p with a zero element gives 0) as a float:
 * terms |g|^p in double (a subnormal g counts as zero), thread t of the grid joining elements
 * t, t + S, ... (S = blocks * CMLP_K_NORM_THREADS) in order, each warp by the xor butterfly, each
 * block's warps in order into part[block], the partials in block order, then the p-th root;
 * a NaN anywhere gives NaN. part holds CMLP_K_NORM_PARTS doubles; *blocks_done is 0 between
 * launches (the block that finishes last resets it). Deterministic; bit for bit the CPU
 * backend's for p = 1, 2 and +-inf (pow may differ in the last bit elsewhere). n > 0. */
cudaError_t cmlp_k_grad_norm(const float *g, int64_t n, double norm_type, float *out, double *part,
                             unsigned int *blocks_done, cudaStream_t stream);
/* g *= c for c = min(1, (1 / (*norm + 1e-6)) * max_norm) in float, rounded as torch's
 * clip_grad_norm_ rounds max_norm / (norm + 1e-6) (a NaN norm gives NaN gradients); nothing is
 * written when c == 1. When norm_sum is not NULL a finite *norm
 * is also added to *norm_sum and counted in *norm_steps (both or neither). n > 0. */
cudaError_t cmlp_k_clip_by_norm(float *g, int64_t n, const float *norm, float max_norm, double *norm_sum,
                                long long *norm_steps, cudaStream_t stream);
/* g = min(max(g, -v), v) elementwise, a NaN kept (torch's clip_grad_value_); v >= 0. */
cudaError_t cmlp_k_clip_by_value(float *g, int64_t n, float v, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* CMLP_KERNELS_H */
