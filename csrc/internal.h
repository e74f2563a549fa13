/* internal.h - private declarations shared by the core's files: error recording, the device
 * registry and the structs behind the public handles. Never installed, never included by users.
 */
#ifndef CMLP_INTERNAL_H
#define CMLP_INTERNAL_H

#include "cmlp.h"
#include "backend.h"
#include "alloc.h"

#include <stdbool.h>

#define CMLP_HIDDEN __attribute__((visibility("hidden")))

/* Records "file:line: message" in the thread-local error buffer and returns the status. */
CMLP_HIDDEN cmlp_status cmlp_set_error(cmlp_status s, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define CMLP_FAIL(status, ...) cmlp_set_error((status), __FILE__, __LINE__, __VA_ARGS__)
/* Puts back a message saved from cmlp_last_error() (2048 bytes at most), as it was. */
CMLP_HIDDEN void cmlp_restore_error(const char *saved);

/* Evaluates a cmlp_status expression; on failure records nothing new and returns it. */
#define CMLP_TRY(expr)                        \
    do {                                      \
        cmlp_status cmlp_try_s_ = (expr);     \
        if (cmlp_try_s_ != CMLP_OK) return cmlp_try_s_; \
    } while (0)

/* Same, but jumps to the function's single cleanup label with st set. */
#define CMLP_TRY_GOTO(st, expr, label)        \
    do {                                      \
        (st) = (expr);                        \
        if ((st) != CMLP_OK) goto label;      \
    } while (0)

/* ---- device registry ---- */

typedef struct cmlp_device_ctx {
    cmlp_device device;
    const cmlp_backend_i *backend;
    void *bctx; /* the backend's per-device instance */
    cmlp_allocator *alloc;
} cmlp_device_ctx;

/* The CUDA backend once loaded (NULL when unavailable) and why CUDA is unavailable. */
CMLP_HIDDEN const cmlp_backend_i *cmlp_cuda_backend(void);
CMLP_HIDDEN const char *cmlp_cuda_unavailable_reason(void);

/* The context of a checked device (created on first use, lives for the process). */
CMLP_HIDDEN cmlp_status cmlp_device_get(cmlp_device d, cmlp_device_ctx **out);
/* A copy of one device buffer of nbytes on another device, through host memory, into *dst
 * (the source is kept; nothing is allocated on failure; a NULL buffer copies to NULL). */
CMLP_HIDDEN cmlp_status cmlp_buffer_copy(cmlp_device_ctx *from, cmlp_device_ctx *to, const void *buf, size_t nbytes,
                                         const char *what, void **dst);
/* A hash of nbytes of a device buffer, carried on from h: equal bytes, equal hash (read through
 * host memory, a few MiB at a time). negatives_alike: a buffer of floats whose values < 0 are
 * one mark (AMSGrad's maximum where it has not started), hashed as one value. */
CMLP_HIDDEN cmlp_status cmlp_buffer_hash(cmlp_device_ctx *dev, const void *buf, size_t nbytes, bool negatives_alike,
                                         uint64_t *h);

/* A device of addresses (plan.c): it hands out addresses from `next` and touches nothing;
 * segments and mapped pages take from `room`, and give back to it when released. */
typedef struct {
    uintptr_t next;
    int64_t total;
    int64_t room;
    bool no_vm; /* standing for a device without virtual memory (no expandable segments) */
} cmlp_paper_device;
CMLP_HIDDEN extern const cmlp_backend_i cmlp_paper_backend; /* its context: a cmlp_paper_device */
/* n requests (at most CMLP_TRY_REQUESTS) checked (>= 0 bytes) into out. */
CMLP_HIDDEN cmlp_status cmlp_requests_check(const int64_t *nbytes, int n, size_t *out);
/* Whether n requests, made in order on the device now, would be served once the blocks at
 * drop[0..ndrop) are freed: tried on a copy of its allocator (plan.c); nothing changes. */
CMLP_HIDDEN cmlp_status cmlp_plan_try(cmlp_device_ctx *dev, const size_t *nbytes, int n, void *const *drop, int ndrop,
                                      bool *served);

/* ---- model ---- */

/* The most samples one optimizer step (batch_size * accumulation_steps) may have: sample
 * counts and positions then add without overflowing int64. */
#define CMLP_MAX_STEP_SAMPLES ((int64_t)1 << 62)

/* Activation workspace for a capacity of `rows` samples, one allocation carved into views. */
typedef struct cmlp_workspace {
    void *block;
    int64_t rows;
    bool compact;                    /* the pieces cmlp_ws_layout marks lie in the first layer's
                                      * weight gradient: for steps alone in their optimizer step */
    size_t inside_bytes;             /* with compact: those pieces' bytes from that gradient's start */
    bool forward;                    /* cmlp_fwd_layout's: a forward pass's buffers alone */
    float *act[CMLP_MAX_LAYERS + 1]; /* act[0]: input [rows, sizes[0]]; act[i]: layer i output */
    float *dact[2];                  /* ping-pong gradients (cmlp_grad_widths) */
    int32_t *labels;                 /* [rows] */
    size_t dx1_bytes;                /* from act[2] on, where layer 1's input gradient is made */
} cmlp_workspace;

/* The same under mixed precision (model_amp.c). */
typedef struct cmlp_amp_workspace {
    void *block;
    int64_t rows, chunk;
    uint16_t *act[CMLP_MAX_LAYERS]; /* act[l]: input of layer l [rows, sizes[l]], half */
    float *logits, *dlogits;        /* [rows, classes], fp32 */
    uint16_t *dact[3];              /* gradients between layers, half (cmlp_grad_widths; the third:
                                     * recompute only, all three [rows, max width]) */
    int recompute;
    cmlp_dtype dt;                  /* the half format of the step in progress */
    bool compact;                   /* as cmlp_workspace's, with the half weights of the step */
    size_t dx1_bytes;               /* as cmlp_workspace's (native, without recompute) */
    const uint16_t *wh;             /* the half weights a step multiplies by: the model's copy, or
                                     * (compact) one made in the first layer's weight gradient */
    int32_t *labels;                /* [rows] */
    float *scratch[3];              /* fp32 operands of one block of rows [chunk, max width] */
    float *w32, *b32;               /* one layer's half weights and bias as fp32 */
    /* the step's half weights (compact) and the logits' bias in b32 are being made on the second
     * stream (joined before the first layer); b32_made: b32 holds the bias */
    bool forked, b32_made;
} cmlp_amp_workspace;

/* The same with recomputation (model_recompute.c): the input and three buffers. */
typedef struct cmlp_rc_workspace {
    void *block;
    int64_t rows;
    float *input;  /* [rows, sizes[0]] */
    float *buf[3]; /* [rows, max width of layers 1..L] */
    int32_t *labels;
} cmlp_rc_workspace;

/* Scalars of a model that stay on its device (one allocation, made on first use): what the
 * steps of a call accumulate and decide there. The host writes them when a call begins and
 * reads them when it ends, so steps in between need no synchronisation. */
typedef struct cmlp_dscalars {
    double loss;           /* loss sum of the call in progress */
    double loss_mark;      /* `loss` when the effective step in progress began (for a retry) */
    int64_t correct;       /* rows whose argmax is the label (evaluation) */
    int64_t step;          /* the optimizer's step count, when skips are decided on the device */
    /* the learning rate and momentum (Adam's beta1, SGD's momentum) of the call's steps: the pair
     * rates[0..1], or with one per step (cmlp_trainer_epoch_run_rates) the pair at lr_next */
    double rates[2 * CMLP_MAX_RATES];
    int64_t lr_next;
    int64_t skipped;       /* steps skipped for an inf or NaN gradient */
    float found_inf;       /* 1 when the last unscale met an inf or NaN */
    float scale;           /* the loss scale */
    int32_t growth_tracker;
    uint32_t blocks_done;  /* adam_prepared's counter: 0 between steps */
    float coef[5];         /* optim_prepare's coefficients of the step (Adam's step size, sqrt(1 - beta2^t),
                            * decay, beta1 and 1 - beta1; SGD's rate and momentum) */
    int64_t pos;           /* the epoch's position: the first sample of the next step */
    float grad_norm;       /* grad_norm's result: the gradients' total norm */
    uint32_t norm_blocks;  /* grad_norm's counter: 0 between calls */
    double norm_sum;       /* clipping: the sum of the call's finite gradient norms */
    int64_t norm_steps;    /* and their count */
    uint8_t spare[8];      /* keeps the size at 640 bytes (with the padding after coef) */
    double norm_part[CMLP_NORM_PARTS]; /* grad_norm's partial results */
} cmlp_dscalars;
_Static_assert(sizeof(cmlp_dscalars) == 640, "cmlp_dscalars is 640 bytes");

struct cmlp_model {
    cmlp_device_ctx *dev;
    int nlayers;
    int sizes[CMLP_MAX_LAYERS + 1];
    int64_t nparams;
    int64_t w_off[CMLP_MAX_LAYERS], b_off[CMLP_MAX_LAYERS];
    float *params; /* [nparams]: weights of every layer [out, in], then biases */
    float *grads;  /* [nparams], same layout */
    cmlp_dscalars *ds; /* device scalars, in the gradient allocation after the gradients */
    uint16_t *params_h;   /* [nparams] half copy for amp GEMMs, refreshed after each update */
    cmlp_dtype half_dtype; /* format of params_h (F16 or BF16) */
    cmlp_workspace ws;
    cmlp_amp_workspace wsa;
    cmlp_rc_workspace wsr;
    /* the parameters were changed from outside a data-parallel trainer's calls (set_params, an
     * optimizer's step, a trainer's of this rank alone) since such a trainer last found them
     * equal on every rank (cmlp_train_same_settings) */
    bool written;
};

/* compact: the step is the only micro-batch of its optimizer step and writes the gradients, so
 * the first layer's weight gradient is free until the step's last GEMM writes it. */
CMLP_HIDDEN cmlp_status cmlp_workspace_reserve(cmlp_model *m, int64_t rows, bool compact);
/* The pieces of a workspace for `rows` samples (fp32, or amp): fills sz[] (at most
 * CMLP_MAX_LAYERS + 12 entries), returns their count, the bytes that are activations, and in
 * *inside the pieces (bits by index) that a compact step places in the first layer's weight
 * gradient. */
CMLP_HIDDEN int cmlp_ws_layout(const int *sizes, int L, int64_t rows, size_t *sz, size_t *act_bytes,
                               uint64_t *inside);
/* The pieces of a workspace for a forward pass of `rows` samples alone (no gradients): the
 * input when it is staged, the two buffers the layers' outputs alternate between (odd layers in
 * the first), the labels. Fills sz[] (4 entries), returns their count. */
CMLP_HIDDEN int cmlp_fwd_layout(const int *sizes, int L, int64_t rows, bool input, size_t *sz);
/* Makes the workspace serve a forward pass (forward, predict, evaluate) over `rows` samples,
 * the input staged in it when `input`. */
CMLP_HIDDEN cmlp_status cmlp_forward_reserve(cmlp_model *m, int64_t rows, bool input);
/* Bit i of a mask of pieces (cmlp_ws_layout's *inside); a mask holds the first 64 pieces, and
 * cmlp_compact_place refuses a layout with more. */
static inline bool cmlp_piece_in(uint64_t mask, int i) { return i < 64 && (mask >> i & 1); }
static inline void cmlp_piece_set(uint64_t *mask, int i) {
    if (i < 64) *mask |= 1ull << i;
}
/* The bytes of the first layer's weight gradient (at the start of the gradients). */
CMLP_HIDDEN size_t cmlp_first_grad_bytes(const int *sizes);
/* Offsets in the first layer's weight gradient of the pieces in `inside`, one after another in
 * index order after `first` bytes (each piece is a multiple of 64 bytes); whether they fit in
 * `room` bytes (and the model has more than one layer: a single layer's gradient is read as its
 * weight gradient is written; and at most 64 pieces, what a mask holds). */
CMLP_HIDDEN bool cmlp_compact_place(int L, const size_t *sz, int nv, uint64_t inside, size_t first, size_t room,
                                    size_t *off);
/* Where each piece lies: those in `inside` at grads + off[i], the others one after another from
 * block (a piece of 0 bytes: NULL). Returns the bytes the others take (block may be NULL to
 * count them first). */
CMLP_HIDDEN size_t cmlp_place_pieces(const size_t *sz, int nv, uint64_t inside, const size_t *off, void *grads,
                                     void *block, char **piece);
/* The widths of the two buffers the gradient flows back through: widths[0] holds the logits'
 * gradient and every second layer's input gradient below it (sizes[L], sizes[L-2], ...),
 * widths[1] the others (sizes[L-1], sizes[L-3], ...), down to layer 2's input. Layer 1's input
 * gradient (L > 1) is written over the outputs of layers 2..L and the buffer laid out after them,
 * widths[(L - 1) & 1], which is made wide enough for it; masked by the ReLU it then replaces
 * layer 1's output, where the last weight gradient reads it. amp: the outputs are half precision
 * but the logits fp32 (two half elements each). */
CMLP_HIDDEN void cmlp_grad_widths(const int *sizes, int L, int amp, int64_t widths[2]);
CMLP_HIDDEN int cmlp_amp_layout(const int *sizes, int L, int64_t rows, int recompute, int native, size_t *sz,
                                size_t *act_bytes, uint64_t *inside);
/* Does backend b multiply half-precision operands itself and write the logits' gradient in half
 * precision (CUDA)? Then amp needs no fp32 copies of weights or of blocks of rows. */
CMLP_HIDDEN int cmlp_amp_native(const cmlp_backend_i *b);
/* Forward of rows [0, n) already in ws.act[0] (or in `input` when not NULL). */
CMLP_HIDDEN cmlp_status cmlp_model_forward_rows(cmlp_model *m, const float *input, int64_t n);
/* Rows idx[0..n) (or [start, start+n)) of xy's inputs or labels into device memory dst, from
 * host memory or, when xy->on_device, from the device. cmlp_stage_x also stages the labels into
 * ldst when that is not NULL (from a device data set in the same pass). */
CMLP_HIDDEN cmlp_status cmlp_stage_x(cmlp_model *m, float *dst, const cmlp_data *xy, const int64_t *idx,
                                     int64_t start, int64_t n, float scale, float shift, int32_t *ldst);
CMLP_HIDDEN cmlp_status cmlp_stage_y(cmlp_model *m, int32_t *dst, const cmlp_data *xy, const int64_t *idx,
                                     int64_t start, int64_t n);
/* Whether xy can be read in place by the model's device (on the CPU, or already on the device). */
CMLP_HIDDEN bool cmlp_data_in_place(const cmlp_model *m, const cmlp_data *xy);
/* Stages rows idx[0..n) (or [start, start+n) when idx is NULL) of xy into the workspace and
 * returns the float input to use (a view of the caller's data when no copy is needed). */
CMLP_HIDDEN cmlp_status cmlp_model_stage(cmlp_model *m, const cmlp_data *xy, const int64_t *idx,
                                         int64_t start, int64_t n, bool compact, const float **input,
                                         const int32_t **labels);
/* The gradient weight of a step (a host value, or from the loss scale on the device). */
typedef struct cmlp_gw {
    cmlp_loss_weight loss;
    /* the gradients are written, not added to: the first micro-batch of a training step, which
     * then needs no zeroing before it (the same values; a GEMM may leave a -0 where zero-then-add
     * gives +0) */
    bool fresh;
    /* the only micro-batch of its optimizer step (with fresh): nothing in the gradients has to
     * outlive its forward pass, so its buffers may lie in the first layer's weight gradient */
    bool solo;
    /* (with fresh) the gradients hold +0, zeroed by the last update as it read them (see
     * beta_zero_pass in backend.h): the weight gradients are added to them, which spares the
     * GEMM's pass that beta = 0 costs, and gives the same values (OpenBLAS's beta = 0 zeroes C,
     * then adds); a compact workspace's pieces are zeroed before the first layer's is added */
    bool zeroed;
} cmlp_gw;

/* A backward pass of at most CMLP_SIDE_ROWS rows runs each layer's weight-gradient GEMM on the
 * device's second stream (where it has one), beside the input-gradient GEMM and ReLU that follow
 * it on the first: at such sizes a GEMM fills a small part of a GPU and the chain of launches is
 * the step's time. The order of each buffer's readers and writers is kept by a join per layer. */
#define CMLP_SIDE_ROWS 1024
CMLP_HIDDEN bool cmlp_side_use(const cmlp_model *m, int64_t n);
/* With use: the work queued next goes to the second stream (on) or back to the first. */
CMLP_HIDDEN cmlp_status cmlp_side(cmlp_model *m, bool use, int on);
/* With use: the first stream's work queued next waits for the second's. */
CMLP_HIDDEN cmlp_status cmlp_side_join(cmlp_model *m, bool use);

/* The model's device scalars. They share the gradients' allocation (cmlp_grads_bytes: the
 * gradients, padded to 64 bytes, then the scalars), so they cost no allocation of their own. */
CMLP_HIDDEN cmlp_status cmlp_model_scalars(cmlp_model *m, cmlp_dscalars **out);
CMLP_HIDDEN size_t cmlp_grads_bytes(const cmlp_model *m);
CMLP_HIDDEN cmlp_dscalars *cmlp_model_ds(const cmlp_model *m, float *grads);
/* Forward + backward of n staged rows, adding w * per-sample gradient sums to the gradients
 * and the loss sum to the device double *d_loss. */
CMLP_HIDDEN cmlp_status cmlp_model_fb_rows(cmlp_model *m, const float *input, const int32_t *labels,
                                           int64_t n, cmlp_gw w, float smoothing, double *d_loss);
/* One forward + backward of rows idx[0..n) (or [start, start + n)) of xy, in fp32 or amp. */
CMLP_HIDDEN cmlp_status cmlp_model_fb(cmlp_model *m, const cmlp_data *xy, const int64_t *idx, int64_t start,
                                      int64_t n, cmlp_gw w, float smoothing, cmlp_amp amp, int recompute,
                                      double *d_loss);
CMLP_HIDDEN cmlp_status cmlp_amp_fb(cmlp_model *m, const cmlp_data *xy, const int64_t *idx, int64_t start,
                                    int64_t n, cmlp_gw w, float smoothing, cmlp_amp amp, int recompute,
                                    double *d_loss);
CMLP_HIDDEN cmlp_dtype cmlp_amp_dtype(cmlp_amp amp);
/* The bytes a compact step's half weights take at the start of the first layer's weight gradient. */
CMLP_HIDDEN size_t cmlp_amp_half_bytes(int64_t nparams);
CMLP_HIDDEN cmlp_status cmlp_rc_fb(cmlp_model *m, const cmlp_data *xy, const int64_t *idx, int64_t start, int64_t n,
                                   cmlp_gw w, float smoothing, double *d_loss);
/* An optimizer step whose skip, step count, rate and momentum live on the device (loss scaling):
 * skipped when *d_found_inf != 0; the host's step count is not moved (the caller reads d_step).
 * The rate and momentum are the pair at d_rates[2 * *d_lr_next], or d_rates[0..1] when d_lr_next
 * is NULL (cmlp_rate_src); the optimizer's own are not read. When d_pos is not NULL, *d_pos += pos_add on the device (skipped step or
 * not), and when scale is not NULL the loss scale is updated on the same verdict, in the same
 * launch, once the optimizer's state exists. */
/* The next step makes optimizer state, or is the first to write it (its first step, or SGD's
 * buffer once the momentum is no longer 0; also after a skipped step that made it). */
CMLP_HIDDEN bool cmlp_optim_state_missing(const cmlp_optim *o);
/* step_scales: each step's parts take their scales and momenta from the table
 * cmlp_optim_load_step_scales wrote, row *d_lr_next (with parameter groups only). */
CMLP_HIDDEN cmlp_status cmlp_optim_step_device(cmlp_optim *o, const float *d_found_inf, int64_t *d_step,
                                               float *d_coef, const double *d_rates, int64_t *d_lr_next,
                                               int64_t *d_pos, int64_t pos_add, const cmlp_scale_step *scale,
                                               int step_scales, void *dcomm);
CMLP_HIDDEN void cmlp_optim_set_step(cmlp_optim *o, int64_t step);
/* cmlp_optim_step from a gradient buffer that holds the sum over the ranks (a data-parallel
 * trainer's): a sharded optimizer steps here. */
CMLP_HIDDEN cmlp_status cmlp_optim_step_summed(cmlp_optim *o);
/* The same with each part's rate scaled by scales[p] and its momentum momenta[p] (NULL, or a
 * NaN momentum: the parts' own; with parameter groups only). With zeroed, the gradients are
 * zeroed as they are read where the device's GEMM would spend a pass of its own on beta = 0
 * (beta_zero_pass) and this rank updates every parameter; *zeroed says whether they were. */
CMLP_HIDDEN cmlp_status cmlp_optim_step_summed_at(cmlp_optim *o, const double *scales, const double *momenta,
                                                  bool *zeroed);
/* Writes the scales and momenta of up to CMLP_MAX_RATES steps, nparts each (row k: the step at
 * rate k of a trainer call; momenta NULL, or a NaN in it: the part's own), where a step with
 * step_scales reads them (cmlp_optim_step_device). */
CMLP_HIDDEN cmlp_status cmlp_optim_load_step_scales(cmlp_optim *o, const double *scales, const double *momenta,
                                                    int64_t nsteps);
/* Moves whenever the optimizer's configuration or state buffer changes (a captured step that
 * baked them in is then stale). */
/* The environment's allocator settings, read again as the first GPU opens (cmlp_memory_note_env). */
CMLP_HIDDEN cmlp_status cmlp_memory_env_recheck(void);
CMLP_HIDDEN uint64_t cmlp_optim_version(const cmlp_optim *o);
CMLP_HIDDEN const cmlp_model *cmlp_optim_model(const cmlp_optim *o); /* the model it steps */
/* Whether every parameter group's part steps at a rate finite in float32 when the optimizer's is lr. */
CMLP_HIDDEN cmlp_status cmlp_optim_check_rate(const cmlp_optim *o, double lr);
/* A hash of the optimizer's kind, settings and (Adam's) step count (equal settings, equal hash). */
CMLP_HIDDEN uint64_t cmlp_optim_fingerprint(const cmlp_optim *o);
/* A hash of the optimizer's state buffers in use, carried on from h; h as it was for a sharded
 * optimizer, whose state is its rank's part. */
CMLP_HIDDEN cmlp_status cmlp_optim_state_hash(const cmlp_optim *o, uint64_t *h);
/* The optimizer's state was changed from outside a data-parallel trainer's calls (set_state, a
 * step of the caller's or of a trainer of this rank alone) since such a trainer last found it
 * equal on every rank: the flag, to read and set. */
CMLP_HIDDEN bool *cmlp_optim_written(cmlp_optim *o);
/* The device's member of the process group's device collectives (NCCL); made on first use by
 * every rank at once (comm.c). */
CMLP_HIDDEN cmlp_status cmlp_dist_device_comm(cmlp_device_ctx *dev, void **comm);
/* The parameters whose optimizer state each of w ranks keeps under ZeRO stage 1 (rank r: from
 * r * chunk): n / w rounded up to 64 floats, so that every part starts 256-byte aligned. */
static inline int64_t cmlp_shard_chunk(int64_t n, int w) {
    int64_t chunk = (n + w - 1) / w;
    return (chunk + 63) / 64 * 64;
}
/* Every rank says whether it computed its share of a step (mine): a step that some rank could
 * not compute is taken by none (the others would otherwise wait for it in a collective). */
CMLP_HIDDEN cmlp_status cmlp_dist_agree(cmlp_status mine);
/* In place, on host memory: rank r's part of buf, elements [r * chunk, (r + 1) * chunk) of
 * count, to every rank (CMLP_COMM_* elements; the parts must cover count). */
CMLP_HIDDEN cmlp_status cmlp_dist_all_gather(void *buf, int64_t count, int64_t chunk, int type);
/* In place, on host floats in parts as cmlp_dist_all_gather's: the sum over the ranks of this
 * rank's part ends in its part of buf; the other parts of buf are left undefined. */
CMLP_HIDDEN cmlp_status cmlp_dist_reduce_scatter(float *buf, int64_t count, int64_t chunk);
/* The group's timeout for device collectives (comm_watch.c): each is armed before it is queued
 * (a ticket, 0 where it is not watched) and watched until the device has passed it; one still
 * pending once `seconds` (0: none) have run since ends the job (cmlp_dist_abort), as a host
 * collective that waits that long does. watch_end: queued, a fence is made after it (else the
 * watch ends there); watch_stop: for good, at the group's end (finalize). */
CMLP_HIDDEN void cmlp_dist_watch_configure(double seconds, int rank);
CMLP_HIDDEN uint64_t cmlp_dist_watch_begin(cmlp_device_ctx *dev, const char *what);
CMLP_HIDDEN void cmlp_dist_watch_end(uint64_t ticket, bool queued);
CMLP_HIDDEN void cmlp_dist_watch_stop(void);
/* The device's collectives, the launch of a graph holding them and the making of its member of
 * the group (comm_init, which waits for every rank on the host), watched so. */
CMLP_HIDDEN cmlp_status cmlp_dcomm_all_reduce(cmlp_device_ctx *dev, void *comm, float *d_buf, int64_t n);
CMLP_HIDDEN cmlp_status cmlp_dcomm_all_gather(cmlp_device_ctx *dev, void *comm, float *d_buf, int64_t n,
                                              int64_t chunk);
CMLP_HIDDEN cmlp_status cmlp_dcomm_reduce_scatter(cmlp_device_ctx *dev, void *comm, float *d_buf, int64_t n,
                                                  int64_t chunk);
CMLP_HIDDEN cmlp_status cmlp_dcomm_graph_launch(cmlp_device_ctx *dev, void *graph);
CMLP_HIDDEN cmlp_status cmlp_dcomm_init(cmlp_device_ctx *dev, const void *id, int rank, int size, void **comm);
/* At the group's end, before its device communicators go: every trainer holding one drops it and
 * its captured step (NCCL's destroy waits for every graph holding a communicator's collectives). */
CMLP_HIDDEN void cmlp_train_drop_group_graphs(void);
/* Moves with every process group made (a trainer's communicator from an older one is gone). */
CMLP_HIDDEN uint64_t cmlp_dist_generation(void);
/* Makes the optimizer's state now if it has none (zeros; its first step still treats it as new). */
CMLP_HIDDEN cmlp_status cmlp_optim_prepare(cmlp_optim *o);
CMLP_HIDDEN bool cmlp_optim_has_state(const cmlp_optim *o);
/* The parameter groups' parts (0 without them), and the device bytes their settings take for n parts. */
CMLP_HIDDEN int cmlp_optim_num_parts(const cmlp_optim *o);
/* SGD: on = a step to come (a trainer call's, whose steps carry their own momenta) has momentum,
 * though the settings now may not: the momentum buffer is made as the call begins (NaN, not
 * started, wherever no step has had momentum yet). */
CMLP_HIDDEN void cmlp_optim_expect_momentum(cmlp_optim *o, bool on);
CMLP_HIDDEN size_t cmlp_optim_parts_bytes(int n);
/* The three device buffers of a data set of n samples of row_bytes each that a fit keeps on a
 * device: the samples, their int32 labels and, when shuffled, their int64 order (0 bytes when not). */
CMLP_HIDDEN void cmlp_resident_sizes(int64_t n, size_t row_bytes, int shuffled, size_t out[3]);
/* Frees state that cmlp_optim_prepare made and no step has used yet (a call that failed before
 * its first step leaves the memory as it found it): an AMSGrad maximum made beside state in use,
 * and with arena the state itself (then unused too). */
CMLP_HIDDEN void cmlp_optim_drop_unused(cmlp_optim *o, bool arena);
CMLP_HIDDEN int cmlp_rc_layout(const int *sizes, int L, int64_t rows, size_t *sz, size_t *act_bytes);
CMLP_HIDDEN void cmlp_rc_release(cmlp_model *m);
CMLP_HIDDEN void cmlp_amp_release(cmlp_model *m); /* the amp workspace */
CMLP_HIDDEN void cmlp_amp_free(cmlp_model *m);    /* and the half weight copy */
/* Re-derives the half weight copy from the fp32 master weights (no-op without one). */
CMLP_HIDDEN cmlp_status cmlp_model_refresh_half(cmlp_model *m);
CMLP_HIDDEN cmlp_status cmlp_data_validate(const cmlp_model *m, const cmlp_data *xy, bool need_labels);

/* ---- floating-point environment: subnormals flushed while cmlp computes ---- */

typedef struct cmlp_fpenv {
    unsigned int saved;
} cmlp_fpenv;
CMLP_HIDDEN void cmlp_fpenv_enter(cmlp_fpenv *e);
CMLP_HIDDEN void cmlp_fpenv_leave(const cmlp_fpenv *e);

/* out = the path of `name` in the directory of the library holding this code (the extension);
 * false where that cannot be found. */
CMLP_HIDDEN bool cmlp_beside_module(const char *name, char *out, size_t cap);

/* ---- random numbers ---- */

typedef struct cmlp_rng {
    uint64_t s[4];
} cmlp_rng;
CMLP_HIDDEN void cmlp_rng_seed(cmlp_rng *r, uint64_t seed);
CMLP_HIDDEN uint64_t cmlp_rng_next(cmlp_rng *r);
CMLP_HIDDEN double cmlp_rng_uniform(cmlp_rng *r);              /* [0, 1) with 53 bits */
CMLP_HIDDEN uint64_t cmlp_rng_below(cmlp_rng *r, uint64_t n); /* uniform in [0, n), unbiased */

/* ---- hashes: the ranks' agreement on values (not cryptographic) ---- */

/* h, then n bytes at p mixed in 8 at a time (the last word's missing bytes taken as 0). */
CMLP_HIDDEN uint64_t cmlp_hash_bytes(uint64_t h, const void *p, size_t n);

#endif /* CMLP_INTERNAL_H */
