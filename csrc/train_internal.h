/* train_internal.h - the trainer's state, shared by the training loop (train.c), the optimizer
 * step with its retries and graph capture (train_step.c) and the data-parallel agreement
 * (train_dist.c). Nothing outside these three files includes it.
 */
#ifndef CMLP_TRAIN_INTERNAL_H
#define CMLP_TRAIN_INTERNAL_H

#include "internal.h"

/* Everything a captured step bakes in: pointers, sizes and settings. A step with another key
 * cannot replay the graph. */
typedef struct step_key {
    const void *model, *dev, *x, *y, *order, *ws, *wsa, *wsr, *params, *grads, *params_h;
    int64_t n, n_all, start, micro, growth_interval; /* this rank's samples of n_all, from start */
    int64_t ws_rows, wsa_rows, wsa_chunk, wsr_rows; /* a workspace's layout follows its rows */
    float mean, std;                                /* the normalisation the gather applies */
    int x_dtype, wsa_recompute;
    bool ws_compact, ws_forward, wsa_compact; /* where the workspaces' pieces lie */
    uint64_t optim_version;
    double growth_factor, backoff_factor;
    float smoothing;
    int amp, recompute, scaled;
    double max_grad_norm;
    bool rates; /* the step reads its rate and momentum from the call's list (moving on), not ds->rates[0..1] */
    bool step_scales; /* and its param groups' scales from the optimizer's table of the call's steps */
} step_key;

struct cmlp_trainer {
    cmlp_model *model;
    cmlp_optim *optim;
    cmlp_train_config cfg;
    int64_t micro;
    /* the fit in progress: its epochs, validation samples (-1: none), per-step schedule, and a
     * hash of the validation set */
    int64_t fit_call[4];
    /* the epoch in progress */
    cmlp_data data;
    int64_t *order; /* host [data.n] sample order; NULL when not shuffling */
    int64_t order_cap;
    /* on a device that is not the host: the epoch's data set and order in its memory */
    cmlp_allocator *d_alloc; /* whose memory they are (the model may move) */
    /* a captured full step (device data, a device with graphs) and what it baked in */
    void *graph;
    cmlp_device_ctx *graph_dev;
    step_key graph_key, warm_key; /* warm_key: the last full step run eagerly */
    bool warm, graphs_off;        /* graphs_off: CMLP_CUDA_GRAPHS=0, every step eager */
    bool capture_failed;          /* a capture failed in this fit call: eager until the next call */
    int64_t graph_counts[3];      /* captures kept, replays, captures dropped */
    bool epoch_open;              /* between epoch_begin and the epoch's last step */
    /* the open epoch's loss and clipping norms so far on this rank: each call's device scalars
     * start from them, so that the steps add up in their order whatever the calls' lengths */
    double epoch_loss, epoch_norms;
    void *d_x;
    int32_t *d_y;
    int64_t *d_order;
    int64_t epoch;
    int64_t pos;
    cmlp_scaler_state scaler;
    int64_t skipped;
    int64_t oom_retries, good_steps;
    int64_t target_micro; /* the micro-batch asked for; auto micro-batching grows back to it */
    int64_t grown_from;   /* the micro-batch before the last growth, which worked (0: none) */
    int64_t grow_wait;    /* the good steps before the next growth: cfg.grow_interval, doubled by each
                           * growth that ran out of memory at its first step */
    int64_t ran_micro;    /* the micro-batch the last step that completed ran with, of those with at
                           * least its rows (a short last step runs one smaller one; 0: none yet) */
    int64_t whole_rows;   /* this rank's rows of a whole step of the call (growth sizes for it, not
                           * for a short last step) */
    bool dist;            /* data-parallel over the process group */
    void *dcomm;          /* off the host: dcomm_dev's member of the group's device collectives */
    cmlp_device_ctx *dcomm_dev;
    uint64_t dgen;        /* the process group dcomm (and a captured step using it) belongs to */
    cmlp_trainer *joined_prev, *joined_next; /* in the list of trainers holding a dcomm (train_dist.c) */
    bool joined;
    double last_norm;     /* the last step's gradient norm (clipping), when has_norm */
    bool has_norm;
    bool rates;           /* the call in progress has a rate per step (cmlp_trainer_epoch_run_rates) */
    bool step_scales;     /* and param-group scales per step (in the optimizer's table, on its device) */
    const double *scales_row; /* the step in progress's param-group scales, for a step on the host */
    const double *momenta_row; /* and their momenta (NULL: the parts' own) */
    bool more_steps;      /* another step of this call follows the one in progress: nothing outside
                           * the call sees the gradients in between, which its update may zero */
    bool grads_zeroed;    /* the last update zeroed the gradients (cmlp_gw's zeroed); the next step's
                           * first micro-batch adds to them */
    bool host_data;       /* keep the data set in host memory (cmlp_trainer_set_host_data) */
    bool oom_at_one;      /* the last step failed even in micro-batches of 1 sample, or (with the data set's
                           * device copy, which is to go first) at all (train_step.c) */
};

/* Off the CPU the optimizer's step count and bias corrections live on the device too, so that a
 * step bakes no host value that changes from step to step (a captured step can replay). */
CMLP_HIDDEN bool cmlp_train_device_steps(const cmlp_trainer *t);
/* The captured step goes (a step with another key captures again). */
CMLP_HIDDEN void cmlp_train_drop_graph(cmlp_trainer *t);

/* Samples of one optimizer step on one rank. */
static inline int64_t cmlp_train_effective_batch(const cmlp_trainer *t) {
    return t->cfg.batch_size * t->cfg.accumulation_steps;
}
/* Ranks taking part in a step: the process group's, when data-parallel. */
static inline int64_t cmlp_train_group_size(const cmlp_trainer *t) { return t->dist ? cmlp_dist_size() : 1; }

/* Growth starts afresh at the micro-batch in use: no good steps, no size to go back to, the
 * wait at grow_interval. */
static inline void cmlp_train_restart_growth(cmlp_trainer *t) {
    t->good_steps = t->grown_from = 0;
    t->grow_wait = t->cfg.grow_interval;
}
/* The bookkeeping of a step that completed (train_step.c): good steps, growth back. */
CMLP_HIDDEN void cmlp_train_good_step(cmlp_trainer *t, bool whole_micro, int64_t rows);
/* train_step.c: one optimizer step of this rank's k samples of n_all (all ranks), rows idx[0..k)
 * of xy or rows [start, start + k), surviving out-of-memory by smaller micro-batches where the
 * trainer allows; cmlp_train_graph_step runs it captured or replayed where the device has graphs (eligible:
 * a full step on device data). */
CMLP_HIDDEN cmlp_status cmlp_train_robust_step(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy,
                                               const int64_t *idx, int64_t start, int64_t k, int64_t n_all);
CMLP_HIDDEN cmlp_status cmlp_train_graph_step(cmlp_trainer *t, cmlp_dscalars *ds, const cmlp_data *xy,
                                              const int64_t *idx, int64_t start, int64_t n, int64_t n_all,
                                              bool eligible);

/* train_dist.c: data-parallel, the calls whose collectives must pair up, and the checks that the
 * ranks make them alike (each is a collective: every rank calls it). */
enum { CALL_TRAINER = 1, CALL_EPOCH = 2, CALL_STEP = 3 };
/* (hashes: bit i set where v[i] is a hash, whose values the error does not show) */
CMLP_HIDDEN cmlp_status cmlp_train_same_on_every_rank(const char *const *names, const int64_t *v, int n,
                                                      uint32_t hashes);
/* The settings of a call (one of CALL_*) and its data's normalisation (xy, or NULL); and after a
 * rank changed its parameters or optimizer state from outside the trainer (cmlp_model.written,
 * cmlp_optim_written), but for the Trainer's own call, those too. A trainer of one rank alone
 * marks them so (cmlp_train_mark_local). */
CMLP_HIDDEN cmlp_status cmlp_train_same_settings(cmlp_trainer *t, int call, const cmlp_data *xy);
/* A call of a trainer that is not data-parallel may change its model's parameters and its
 * optimizer's state: where a data-parallel trainer shares them, its next call compares them. */
CMLP_HIDDEN void cmlp_train_mark_local(cmlp_trainer *t);
/* Data-parallel, fit's ranks train on one data set: its sample count, image type and contents
 * (a hash of its labels and of rows spread over it) are compared. */
CMLP_HIDDEN cmlp_status cmlp_train_same_data(const cmlp_trainer *t, const cmlp_data *xy);
CMLP_HIDDEN cmlp_status cmlp_train_join_group(cmlp_trainer *t);
/* The trainer holds no device communicator any more (off the list the group's end goes over). */
CMLP_HIDDEN void cmlp_train_leave_group(cmlp_trainer *t);
CMLP_HIDDEN cmlp_status cmlp_train_group_batch_fits(const cmlp_trainer *t);
CMLP_HIDDEN cmlp_status cmlp_train_check_group(cmlp_trainer *t, bool joined);

#endif
