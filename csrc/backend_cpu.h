/* backend_cpu.h - what the CPU backend's files share: the size below which a loop over a buffer
 * stays on one thread, and the operations backend_cpu_ops.c (the layers' passes and the batch's
 * staging) and backend_cpu_optim.c (optimizer steps, casts, loss scaling, clipping) give the
 * backend's table in backend_cpu.c.
 */
#ifndef CMLP_BACKEND_CPU_H
#define CMLP_BACKEND_CPU_H

#include "internal.h"

#include <stdint.h>

#ifndef CMLP_BLAS_SCIPY
#define CMLP_BLAS_SCIPY 0
#endif

#if CMLP_BLAS_SCIPY
#define MIN_PER_THREAD ((int64_t)1 << 15) /* elements below which a loop stays on one thread */
#else
/* a BLAS with threads of its own: a second pool beside them would fight them for the cores */
#define MIN_PER_THREAD INT64_MAX
#endif

/* backend_cpu_ops.c */
CMLP_HIDDEN cmlp_status cpu_bias_act(void *ctx, float *y, const float *bias, int64_t rows, int64_t cols, int relu);
CMLP_HIDDEN cmlp_status cpu_relu_backward(void *ctx, float *dy, const float *h, int64_t count);
CMLP_HIDDEN cmlp_status cpu_bias_grad(void *ctx, float *db, const float *dy, int64_t rows, int64_t cols,
                                      int overwrite);
CMLP_HIDDEN cmlp_status cpu_relu_backward_bias_grad(void *ctx, void *dy, const void *h, void *out, cmlp_dtype dtype,
                                                    float *db, int64_t rows, int64_t cols, int overwrite);
CMLP_HIDDEN cmlp_status cpu_softmax_xent(void *ctx, const float *logits, const int32_t *labels, int64_t rows,
                                         int64_t cols, float smoothing, cmlp_loss_weight w, float *dlogits,
                                         double *loss_sum, int64_t *correct);
CMLP_HIDDEN cmlp_status cpu_stage_rows(void *ctx, float *dst, const void *src, cmlp_dtype dtype, int64_t cols,
                                       const int64_t *idx, int64_t start, int64_t rows, float scale, float shift);
CMLP_HIDDEN cmlp_status cpu_stage_labels(void *ctx, int32_t *dst, const int32_t *src, const int64_t *idx, int64_t start,
                                         int64_t rows);
CMLP_HIDDEN cmlp_status cpu_gather_rows(void *ctx, float *dst, const void *src, cmlp_dtype dtype, int64_t cols,
                                        const int64_t *idx, int64_t start, const int64_t *pos, int64_t rows,
                                        float scale, float shift, int32_t *ldst, const int32_t *lsrc);
CMLP_HIDDEN cmlp_status cpu_gather_rows_half(void *ctx, uint16_t *dst, cmlp_dtype half, const void *src,
                                             cmlp_dtype dtype, int64_t cols, const int64_t *idx, int64_t start,
                                             const int64_t *pos, int64_t rows, float scale, float shift, int32_t *ldst,
                                             const int32_t *lsrc);
CMLP_HIDDEN cmlp_status cpu_gather_labels(void *ctx, int32_t *dst, const int32_t *src, const int64_t *idx,
                                          int64_t start, const int64_t *pos, int64_t rows);

/* backend_cpu.c: every byte of [dst, dst + nbytes) zeroed, on the pool's threads */
CMLP_HIDDEN cmlp_status cpu_fill_zero(void *ctx, void *dst, size_t nbytes);

/* backend_cpu_optim.c */
CMLP_HIDDEN cmlp_status cpu_adam(void *ctx, float *restrict p, float *restrict g, float *restrict m,
                                 float *restrict v, float *restrict vmax, int64_t n, float step_size, float beta1,
                                 float beta2, float one_b1, float one_b2, float bc2_sqrt, float eps, float wd,
                                 float decay, int maximize, const float *found_inf, const float *coef, int zero_g);
CMLP_HIDDEN cmlp_status cpu_sgd(void *ctx, float *restrict p, float *restrict g, float *restrict buf, int64_t n,
                                float lr, float momentum, float keep, int nesterov, float wd, int maximize,
                                const float *found_inf, const float *coef, int zero_g);
CMLP_HIDDEN cmlp_status cpu_to_half(void *ctx, uint16_t *dst, const float *src, int64_t n, cmlp_dtype dtype);
CMLP_HIDDEN cmlp_status cpu_from_half(void *ctx, float *dst, const uint16_t *src, int64_t n, cmlp_dtype dtype);
CMLP_HIDDEN cmlp_status cpu_optim_prepare(void *ctx, int64_t *step, float *coef, const float *found_inf,
                                          const cmlp_rate_src *rate, double beta2, int adam, int64_t *pos,
                                          int64_t pos_add, const cmlp_scale_step *scale);
CMLP_HIDDEN cmlp_status cpu_unscale(void *ctx, float *restrict g, int64_t n, float inv, const float *scale,
                                    float *found_inf);
CMLP_HIDDEN cmlp_status cpu_grad_norm(void *ctx, const float *g, int64_t n, double norm_type, float *out, double *part,
                                      uint32_t *blocks_done);
CMLP_HIDDEN cmlp_status cpu_clip_by_norm(void *ctx, float *g, int64_t n, const float *norm, float max_norm,
                                         double *norm_sum, int64_t *norm_steps);
CMLP_HIDDEN cmlp_status cpu_clip_by_value(void *ctx, float *g, int64_t n, float v);

#endif
