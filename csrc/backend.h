/* backend.h - the only seam between the core and a device: a table of function pointers over
 * device memory. The core calls nothing else device-specific; a backend calls nothing above it.
 * All pointers named d_* are device pointers; h_* are host pointers. Matrices are row-major.
 */
#ifndef CMLP_BACKEND_H
#define CMLP_BACKEND_H

#include "cmlp.h"

#include <stdbool.h>

#ifndef CMLP_WITH_CUDA
#define CMLP_WITH_CUDA 0
#endif

/* A loss scale kept on the device and PyTorch's rule for moving it (torch's
 * _amp_update_scale_): with an inf/NaN the scale backs off (and ++*d_skipped); else after
 * growth_interval finite steps it grows unless that overflows. */
typedef struct cmlp_scale_step {
    float *d_scale;
    int32_t *d_tracker;
    int64_t *d_skipped; /* may be NULL */
    double growth_factor, backoff_factor;
    int32_t growth_interval;
} cmlp_scale_step;

/* Where a step whose bookkeeping is on the device reads its learning rate and momentum (Adam's
 * beta1, SGD's momentum): the pair d_rates[2k], d_rates[2k + 1] with k = *d_next, or k = 0 when
 * d_next is NULL. With d_next every step moves *d_next on by one, skipped or not (a schedule with
 * a rate and momentum per step). decoupled_wd is AdamW's weight decay (0: none): the step forms
 * its factor (float)(1 - lr * decoupled_wd) from the rate it read. */
/* doubles per part of the parameter groups' settings a step on the device reads (cmlp_rate_src;
 * the same as kernels.h's) */
#define CMLP_PART_ARGS 4

typedef struct cmlp_rate_src {
    const double *d_rates;
    int64_t *d_next;
    double decoupled_wd;
    /* Parameter groups (may be 0): for part p, with part = d_parts + CMLP_PART_ARGS * p, part[0]
     * scales the rate, part[1] is its decoupled weight decay, part[2] its momentum and part[3] its
     * beta2 (NaN: the step's momentum, the beta2 given); a step that is taken writes the part's
     * coefficients, as d_coef's with that rate, decay, momentum and beta2, to d_part_coef[5p..5p + 4] */
    int nparts;
    const double *d_parts;
    float *d_part_coef;
    /* when not NULL, each step's own scale and momentum of each part: with
     * row = d_step_scales + 2 * (k * nparts + p), the step that reads the pair k scales part p's
     * rate by row[0] instead of part[0], and its momentum is row[1] (NaN: as without the table) */
    const double *d_step_scales;
} cmlp_rate_src;

/* The weight of the loss's gradient: value, or with d_scale the weight of a loss-scaled step,
 * (float)((double)*d_scale / count), read on the device. With d_found_inf the loss's launch also
 * sets *d_found_inf = 0: the step's inf/NaN check starts clean, with no launch of its own. */
typedef struct cmlp_loss_weight {
    float value;
    const float *d_scale;
    double count;
    float *d_found_inf;
} cmlp_loss_weight;

typedef struct cmlp_backend_i {
    const char *name;
    /* Its memory is the process's own, and its work is done when a call returns (the CPU): in a
     * build with AddressSanitizer the allocator then poisons every byte no caller holds (free
     * blocks, and each block past the bytes requested), so that an access there is reported. */
    bool host_memory;
    /* Its GEMM with beta = 0 zeroes C in a pass of its own before it adds the product (OpenBLAS
     * does): gradients that adam or sgd zeroed as they read them (zero_g) then take the next
     * step's first weight gradients with beta = 1 instead, that pass spared. */
    bool beta_zero_pass;

    /* Per-device instance (streams, handles); NULL is fine for the CPU. */
    cmlp_status (*open)(int index, void **ctx);
    /* Undoes open, for a device whose setup failed after it (contexts of devices in use live as
     * long as the process). NULL where open is. */
    void (*close)(void *ctx);
    /* Where a launch runs out of device memory (CUDA loads a kernel's code at its first launch,
     * into memory the caching allocator may hold), the backend may call reclaim(arg), which
     * gives the allocator's cached, unused memory back to the device, and launch once more.
     * NULL where launches take no memory (the CPU). */
    void (*set_reclaim)(void *ctx, void (*reclaim)(void *arg), void *arg);
    /* Physical memory of the device in bytes. */
    int64_t (*total_memory)(void *ctx);
    /* Memory the device could still give (the driver's free memory; on the CPU, what the
     * operating system reports available); -1 when it cannot say. */
    int64_t (*free_memory)(void *ctx);
    /* The processes holding memory on the device, as the driver's management library (NVML)
     * sees them: up to cap (pid, bytes) pairs, and their count (which may exceed cap), or -1
     * where it cannot tell. NULL where the device has no such library (the CPU). */
    int (*gpu_processes)(void *ctx, int64_t *pids, int64_t *bytes, int cap);
    /* Device memory the backend needs for itself (GEMM workspace, reduction scratch), taken
     * from the device's allocator after open and handed over once; NULL when none. */
    size_t (*workspace_bytes)(void *ctx);
    void (*set_workspace)(void *ctx, void *d_ptr, size_t nbytes);

    /* Raw memory, called only by the allocator. raw_alloc returns CMLP_ERR_OOM when the device
     * has no memory left, with nothing recorded in the error buffer; any other failure is
     * recorded and ends the allocation with that status (no cache is released for it). */
    cmlp_status (*raw_alloc)(void *ctx, size_t nbytes, void **out);
    void (*raw_free)(void *ctx, void *ptr, size_t nbytes);

    /* Virtual memory for expandable segments (NULL where the device has none): reserve an
     * address range, map (commit) and unmap pages inside it, release the range. vm_map
     * returns CMLP_ERR_OOM, with nothing recorded, when the device has no memory left. */
    cmlp_status (*vm_reserve)(void *ctx, size_t nbytes, void **out);
    cmlp_status (*vm_map)(void *ctx, void *ptr, size_t nbytes);
    void (*vm_unmap)(void *ctx, void *ptr, size_t nbytes);
    void (*vm_release)(void *ctx, void *ptr, size_t nbytes);
    /* Whether this device has them (NULL: it has, where vm_reserve is set); asked once, as the
     * allocator is made: without them expandable_segments:True is ignored, as PyTorch ignores it */
    bool (*vm_supported)(void *ctx);

    cmlp_status (*copy_h2d)(void *ctx, void *d_dst, const void *h_src, size_t nbytes);
    cmlp_status (*copy_d2h)(void *ctx, void *h_dst, const void *d_src, size_t nbytes);
    cmlp_status (*copy_d2d)(void *ctx, void *d_dst, const void *d_src, size_t nbytes);
    cmlp_status (*fill_zero)(void *ctx, void *d_dst, size_t nbytes);
    /* Every byte of [d_dst, d_dst + nbytes) set to byte (0xFF: floats that are all NaN). */
    cmlp_status (*fill_byte)(void *ctx, void *d_dst, int byte, size_t nbytes);

    /* C[m,n] = alpha * op(A) op(B) + beta * C with op(A) [m,k], op(B) [k,n]. */
    cmlp_status (*gemm)(void *ctx, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                        float alpha, const float *d_a, int64_t lda, const float *d_b, int64_t ldb,
                        float beta, float *d_c, int64_t ldc);
    /* Optional fusions (NULL where the backend has none; the core then uses gemm and bias_act):
     * C[m,n] = act(op(A) op(B) + bias) with bias [n], act ReLU when relu != 0. */
    cmlp_status (*gemm_bias_act)(void *ctx, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                                 const float *d_a, int64_t lda, const float *d_b, int64_t ldb, float *d_c,
                                 int64_t ldc, const float *d_bias, int relu);
    /* Optional mixed-precision GEMM (NULL where the backend has none; the core then converts
     * blocks to fp32): A and B in half storage of type ab (F16 or BF16), C of type c_type (F32
     * or ab), fp32 accumulation; C = act(alpha op(A) op(B) + beta C + bias), bias (c_type
     * elements, [n]) may be NULL, relu needs a bias. With it comes the half-storage pass below,
     * db (fp32) += column sums of dy (overwrite: as bias_grad); the ReLU's backward in half
     * storage is relu_backward_bias_grad's. */
    cmlp_status (*gemm_half)(void *ctx, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                             float alpha, const uint16_t *d_a, int64_t lda, const uint16_t *d_b, int64_t ldb,
                             cmlp_dtype ab, float beta, void *d_c, cmlp_dtype c_type, int64_t ldc,
                             const void *d_bias, int relu);
    cmlp_status (*bias_grad_half)(void *ctx, float *d_db, const uint16_t *d_dy, int64_t rows, int64_t cols,
                                  cmlp_dtype dtype, int overwrite);
    /* y[r, c] = act(y[r, c] + bias[c]); act is ReLU when relu != 0, identity otherwise. */
    cmlp_status (*bias_act)(void *ctx, float *d_y, const float *d_bias, int64_t rows, int64_t cols,
                            int relu);
    /* dy[i] = h[i] > 0 ? dy[i] : 0 (the mask is recovered from the ReLU output). */
    cmlp_status (*relu_backward)(void *ctx, float *d_dy, const float *d_h, int64_t count);
    /* relu_backward, then bias_grad or bias_grad_half, in one pass over d_dy [rows, cols] stored
     * as dtype (F32, or F16 / BF16 where the backend has gemm_half), with the same results; the
     * masked gradient goes to d_out, which is d_dy or d_h (then it replaces the activations it
     * was masked by, and d_dy is only read). */
    cmlp_status (*relu_backward_bias_grad)(void *ctx, void *d_dy, const void *d_h, void *d_out, cmlp_dtype dtype,
                                           float *d_db, int64_t rows, int64_t cols, int overwrite);
    /* db[c] += sum_r dy[r, c]; with overwrite != 0, db[c] = 0 + that sum (the bits of zeroing db
     * first: the first micro-batch of a step writes its gradients instead of adding to them). */
    cmlp_status (*bias_grad)(void *ctx, float *d_db, const float *d_dy, int64_t rows, int64_t cols, int overwrite);
    /* Fused stable softmax cross-entropy over logits [rows, cols]. Adds the per-sample losses
     * to *d_loss_sum (a device double; NULL: not wanted) and, when d_dlogits is not NULL, writes
     * d_dlogits = w * (softmax - q), q = (1 - smoothing) onehot + smoothing / cols, where w is
     * the gradient weight that `weight` gives (cmlp_loss_weight). When d_correct is not NULL adds
     * to it the number of rows whose argmax equals the label. d_dlogits may be d_logits.
     * Nothing is read back: the results stay on the device. */
    cmlp_status (*softmax_xent)(void *ctx, const float *d_logits, const int32_t *d_labels,
                                int64_t rows, int64_t cols, float smoothing, cmlp_loss_weight weight,
                                float *d_dlogits, double *d_loss_sum, int64_t *d_correct);
    /* Optional, with gemm_half (NULL: softmax_xent into fp32, then to_half): the same with
     * d_dlogits in half storage of type half (F16 or BF16), each value rounded once. */
    cmlp_status (*softmax_xent_half)(void *ctx, const float *d_logits, const int32_t *d_labels, int64_t rows,
                                     int64_t cols, float smoothing, cmlp_loss_weight weight, uint16_t *d_dlogits,
                                     cmlp_dtype half, double *d_loss_sum, int64_t *d_correct);
    /* dst[r, :] = convert(src row idx[r]) (row start + r when idx is NULL) for r < rows, where
     * src is host data [*, cols] of dtype; uint8 becomes v * scale + shift. Labels likewise. */
    cmlp_status (*stage_rows)(void *ctx, float *d_dst, const void *h_src, cmlp_dtype dtype,
                              int64_t cols, const int64_t *h_idx, int64_t start, int64_t rows,
                              float scale, float shift);
    cmlp_status (*stage_labels)(void *ctx, int32_t *d_dst, const int32_t *h_src,
                                const int64_t *h_idx, int64_t start, int64_t rows);
    /* The same from a data set (and sample order) already in device memory; when d_pos is not
     * NULL, *d_pos (device) is added to every row position (to start, or to the index). When
     * d_labels is not NULL the rows' labels are gathered in the same pass from d_label_src. */
    cmlp_status (*gather_rows)(void *ctx, float *d_dst, const void *d_src, cmlp_dtype dtype,
                               int64_t cols, const int64_t *d_idx, int64_t start, const int64_t *d_pos,
                               int64_t rows, float scale, float shift, int32_t *d_labels,
                               const int32_t *d_label_src);
    /* Optional (NULL: gather_rows into fp32, then to_half): the same rows straight into half
     * storage of type half (F16 or BF16), each value rounded once from what gather_rows gives. */
    cmlp_status (*gather_rows_half)(void *ctx, uint16_t *d_dst, cmlp_dtype half, const void *d_src, cmlp_dtype dtype,
                                    int64_t cols, const int64_t *d_idx, int64_t start, const int64_t *d_pos,
                                    int64_t rows, float scale, float shift, int32_t *d_labels,
                                    const int32_t *d_label_src);
    cmlp_status (*gather_labels)(void *ctx, int32_t *d_dst, const int32_t *d_src,
                                 const int64_t *d_idx, int64_t start, const int64_t *d_pos,
                                 int64_t rows);

    /* Fused optimizers over flat buffers of n floats. Scalars precomputed by the core, or on the
     * device: when d_found_inf is not NULL and *d_found_inf != 0 the step changes nothing; when
     * d_coef is not NULL, Adam reads step_size, bc2_sqrt, decay, beta1 and one_b1 from d_coef[0..4]
     * and SGD its lr and momentum from d_coef[0..1] (as optim_prepare wrote them). weight_decay is L2 (added to the
     * gradient); with decay != 1 each parameter is first multiplied by decay (decoupled weight
     * decay, AdamW). one_b1, one_b2 and SGD's keep are 1 - beta1, 1 - beta2 and 1 - dampening
     * formed in double and rounded once, as torch's scalars are (1.0f - (float)0.999 is 1.3e-5 off).
     * maximize != 0: the gradient's sign is flipped first (torch's maximize). Adam's d_vmax, when
     * not NULL, is AMSGrad's running maximum of d_v: d_vmax = max(d_vmax, d_v) (a NaN in either
     * gives a NaN, as torch.maximum), and the denominator is made of it. zero_g != 0: every
     * gradient is +0 when the call returns (read first; a skipped step zeroes them too). */
    cmlp_status (*adam)(void *ctx, float *d_p, float *d_g, float *d_m, float *d_v, float *d_vmax, int64_t n,
                        float step_size, float beta1, float beta2, float one_b1, float one_b2, float bc2_sqrt,
                        float eps, float weight_decay, float decay, int maximize, const float *d_found_inf,
                        const float *d_coef, int zero_g);
    /* buf = g (momentum's first step) for each element whose buf has not started (bits
     * CMLP_MOMENTUM_UNSTARTED_BITS, as the buffer is made). d_buf may be NULL when momentum == 0.
     * zero_g as adam's. */
    cmlp_status (*sgd)(void *ctx, float *d_p, float *d_g, float *d_buf, int64_t n, float lr,
                       float momentum, float keep, int nesterov, float weight_decay, int maximize,
                       const float *d_found_inf, const float *d_coef, int zero_g);
    /* Before a step whose skip is decided on the device: *d_pos += pos_add when d_pos is not
     * NULL (the data position, which moves whether or not the step is skipped); the rate and
     * momentum are read from `rate` (which moves on too); when scale is not NULL, the loss scale
     * moves by its rule on the same *d_found_inf (one launch for both); then unless
     * *d_found_inf != 0, t = ++*d_step and d_coef[0..4] = {lr / (1 - beta1^t), sqrt(1 - beta2^t),
     * decay, beta1, 1 - beta1} for Adam (in double, rounded to float; decay as cmlp_rate_src says;
     * beta1 the momentum), {lr, momentum} for SGD. */
    cmlp_status (*optim_prepare)(void *ctx, int64_t *d_step, float *d_coef, const float *d_found_inf,
                                 const cmlp_rate_src *rate, double beta2, int adam, int64_t *d_pos, int64_t pos_add,
                                 const cmlp_scale_step *scale);
    /* Optional (NULL where kernels need no loading): loads the code of every kernel an update
     * launches (optim_prepare's, Adam's (adam != 0) or SGD's, and with `unscale` and `clip` set,
     * unscale's and gradient clipping's), as CUDA would at their first launch, into device
     * memory that may be short: called before a step's update, so that its out-of-memory comes
     * while nothing is decided (data-parallel, before the ranks agree on the step), not from
     * inside the update on one rank. */
    cmlp_status (*update_load)(void *ctx, int adam, int unscale, int clip);
    /* Optional (NULL: optim_prepare for Adam, then adam with d_coef): both in one launch, with
     * the same results (d_coef is written too). *d_blocks_done is a device counter that is 0
     * between calls; the kernel's blocks count themselves on it. */
    cmlp_status (*adam_prepared)(void *ctx, float *d_p, const float *d_g, float *d_m, float *d_v, float *d_vmax,
                                 int64_t n, const cmlp_rate_src *rate, double beta2, float eps, float weight_decay,
                                 int maximize, const float *d_found_inf, int64_t *d_step, float *d_coef, int64_t *d_pos,
                                 int64_t pos_add, const cmlp_scale_step *scale, uint32_t *d_blocks_done);
    /* Mixed precision. Conversions between fp32 and fp16/bf16 storage (dtype F16 or BF16). */
    cmlp_status (*to_half)(void *ctx, uint16_t *d_dst, const float *d_src, int64_t n, cmlp_dtype dtype);
    cmlp_status (*from_half)(void *ctx, float *d_dst, const uint16_t *d_src, int64_t n, cmlp_dtype dtype);
    /* g[i] *= inv for all i, inv = d_scale ? (float)(1 / (double)*d_scale) : inv_scale;
     * *d_found_inf = 1 when any result is inf or NaN (it is never reset here). One pass over
     * the flat gradient buffer. */
    cmlp_status (*unscale)(void *ctx, float *d_g, int64_t n, float inv_scale, const float *d_scale,
                           float *d_found_inf);
    /* Gradient clipping over the flat gradient buffer (torch.nn.utils' clip_grad_norm_ and
     * clip_grad_value_). grad_norm: *d_norm = the norm_type-norm of g[0..n) (torch's
     * vector_norm: any norm_type but 0 and NaN; INFINITY for max |g|, -INFINITY for min |g|, a
     * negative p with a zero element gives 0), as a float, computed in double in the order that
     * cmlp_norm_blocks' comment fixes from n alone (so every backend gives the same bits for
     * p = 1, 2 and +-inf); a NaN gives NaN. d_part: CMLP_NORM_PARTS device doubles of scratch; *d_blocks_done a device
     * counter that is 0 between calls. n > 0. */
    cmlp_status (*grad_norm)(void *ctx, const float *d_g, int64_t n, double norm_type, float *d_norm, double *d_part,
                             uint32_t *d_blocks_done);
    /* g *= c, c = min(1, (1 / (*d_norm + 1e-6)) * max_norm) in float (torch's rounding of
     * max_norm / (norm + 1e-6), with torch's subnormals: a norm above 2^126 has a subnormal
     * reciprocal; only a product g * c that is itself subnormal is flushed); a NaN norm gives NaN
     * gradients; at c == 1 nothing is written; when d_norm_sum is not NULL a finite *d_norm is added to it
     * and counted in *d_norm_steps. clip_value: g = min(max(g, -v), v), a NaN kept. */
    cmlp_status (*clip_by_norm)(void *ctx, float *d_g, int64_t n, const float *d_norm, float max_norm,
                                double *d_norm_sum, int64_t *d_norm_steps);
    cmlp_status (*clip_by_value)(void *ctx, float *d_g, int64_t n, float v);
    /* Waits for the device's queued work (a second stream's: once joined to the first). */
    cmlp_status (*synchronize)(void *ctx);

    /* A second stream (NULL where the device has none; with stream_side comes stream_join).
     * stream_side(ctx, 1): the work this thread queues next on the device goes to its second
     * stream, after all work queued before; stream_side(ctx, 0): back to the first stream,
     * which does not wait for the second. stream_join: the first stream's work queued next
     * waits for all the second's queued before (and the thread queues to the first). A step
     * that forks joins before it ends, on errors too; a capture records both branches. */
    cmlp_status (*stream_side)(void *ctx, int on);
    cmlp_status (*stream_join)(void *ctx);

    /* Graphs (NULL where the device has none): the work queued between capture_begin and
     * capture_end is recorded, not run, and becomes a graph that graph_launch replays with the
     * same arguments. Nothing may allocate or wait for the device while capturing: such calls
     * fail with CMLP_ERR_DEVICE, and memory given back meanwhile is given back when the capture
     * ends. Capture is per thread: other threads' work runs as usual. On an error capture_end
     * discards what was captured. */
    cmlp_status (*capture_begin)(void *ctx);
    cmlp_status (*capture_end)(void *ctx, void **graph);
    cmlp_status (*graph_launch)(void *ctx, void *graph);
    void (*graph_free)(void *ctx, void *graph);

    /* Collectives between the devices of the ranks of a process group (NULL where the device
     * has none; the CUDA backend's are NCCL's, loaded on first use from $CMLP_NCCL_LIBRARY or
     * libnccl.so.2). comm_id: a new group's id (CMLP_COMM_ID_BYTES), made on one rank and
     * handed to the others by the caller; comm_init: this device's member of the group, made by
     * every rank at once (it waits for all); comm_all_reduce: a float sum in place, queued on the
     * device's stream like a kernel (a capture records it); comm_free. */
    cmlp_status (*comm_prepare)(void *ctx); /* what comm_init needs is there (NCCL loads, the device) */
    cmlp_status (*comm_id)(void *ctx, void *id);
    cmlp_status (*comm_init)(void *ctx, const void *id, int rank, int size, void **comm);
    cmlp_status (*comm_all_reduce)(void *ctx, void *comm, float *d_buf, int64_t n);
    /* In place: rank r's part of d_buf, [r * chunk, (r + 1) * chunk) within n floats, to every
     * rank; queued on the stream as comm_all_reduce is. */
    cmlp_status (*comm_all_gather)(void *ctx, void *comm, float *d_buf, int64_t n, int64_t chunk);
    /* In place: the sum over the ranks of rank r's part of d_buf (parts as comm_all_gather's) to
     * rank r's part; the other parts of d_buf are left undefined. Queued as comm_all_reduce is. */
    cmlp_status (*comm_reduce_scatter)(void *ctx, void *comm, float *d_buf, int64_t n, int64_t chunk);
    void (*comm_free)(void *ctx, void *comm);
    /* Fences (NULL where the device has none), for the process group's timeout: fence_record
     * makes a mark after the work this thread has queued on the device (*fence NULL while it
     * captures: nothing runs then); fence_passed, from any thread: 1 once the device has run
     * everything before it, 0 while it has not, -1 where it cannot say (a device error, which
     * the thread that waits for the device gets); fence_free, from any thread. */
    cmlp_status (*fence_record)(void *ctx, void **fence);
    int (*fence_passed)(void *ctx, void *fence);
    void (*fence_free)(void *ctx, void *fence);
} cmlp_backend_i;

#define CMLP_COMM_ID_BYTES 128

/* grad_norm's order of summation: thread t of blocks * CMLP_NORM_THREADS "threads" joins the
 * terms of elements t, t + S, t + 2S, ... (S the threads' count) in that order, starting from
 * 0; a warp (32 threads) joins its lanes by the xor butterfly (o = 16, 8, 4, 2, 1: lane l takes
 * its value joined with lane l ^ o's), a block its warps' results in order, and the blocks'
 * partials are joined in order. The blocks: one per 16 elements a thread, 1 to CMLP_NORM_PARTS. */
#define CMLP_NORM_THREADS 256
#define CMLP_NORM_PARTS 32
static inline int64_t cmlp_norm_blocks(int64_t n) {
    const int64_t b = (n + CMLP_NORM_THREADS * 16 - 1) / (CMLP_NORM_THREADS * 16);
    return b < 1 ? 1 : b > CMLP_NORM_PARTS ? CMLP_NORM_PARTS : b;
}

extern const cmlp_backend_i cmlp_backend_cpu;

/* The CUDA backend is its own shared library (_cmlp_cuda.so beside the extension), loaded on
 * first use by cuda_loader.c: its one exported symbol, cmlp_cuda_entry, takes the core's error
 * recorder and returns the module below. */
typedef cmlp_status (*cmlp_error_fn)(cmlp_status s, const char *file, int line, const char *fmt, ...);

#define CMLP_CUDA_ABI 13

/* Why a process forked after CUDA was started cannot use it (the core's words and the backend's). */
#define CMLP_CUDA_FORKED_TEXT                                                                                  \
    "CUDA cannot be used in a process forked after CUDA was initialized in its parent (the CUDA driver "       \
    "does not survive fork); start worker processes with the 'spawn' or 'forkserver' method, e.g. "          \
    "multiprocessing.get_context(\"spawn\")"

/* Why a CUDA build finds no GPU here, around the reason (%s). */
#define CMLP_CUDA_NONE_TEXT                                                                                    \
    "CUDA is not available: cmlp was built with CUDA but no usable GPU or CUDA driver was found on this "     \
    "machine (%s)"

typedef struct cmlp_cuda_module {
    int abi; /* CMLP_CUDA_ABI of the library */
    const cmlp_backend_i *backend;
    /* Number of usable devices; when 0, why (CUDA's words) is written to why[cap]. */
    int (*device_count)(char *why, size_t cap);
    int (*runtime_version)(void); /* e.g. 13000 */
    cmlp_status (*device_properties)(int index, cmlp_device_props *out); /* CUDA's words on failure */
    /* The calling thread's current driver context (NULL: none), and putting it back when a
     * call left another current: cmlp_cuda_ctx_save / _restore. */
    void *(*ctx_save)(void);
    void (*ctx_restore)(void *saved);
} cmlp_cuda_module;

typedef const cmlp_cuda_module *(*cmlp_cuda_entry_fn)(cmlp_error_fn set_error);

#endif /* CMLP_BACKEND_H */
