/* train_dist.c - a data-parallel trainer: every rank makes the same calls with the same settings
 * on the same data set (checked, collectively), and the model's device joins the process group's
 * device collectives.
 */
#include "train_internal.h"
#include "comm.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Data-parallel, every rank must run the same loop: the values each gives must be equal. */
#define MAX_COMPARED 20
/* The values' maxima (hi) and minima (lo) over the ranks: two all-reductions. */
static cmlp_status extremes(const int64_t *v, int n, int64_t *hi, int64_t *lo) {
    if (n > MAX_COMPARED) return CMLP_FAIL(CMLP_ERR_INTERNAL, "%d values to compare", n);
    for (int i = 0; i < n; i++) {
        hi[i] = v[i];
        lo[i] = ~v[i]; /* the maximum of ~v is ~(the minimum of v), for every v */
    }
    CMLP_TRY(cmlp_dist_all_reduce(hi, n, CMLP_COMM_I64, CMLP_REDUCE_MAX));
    CMLP_TRY(cmlp_dist_all_reduce(lo, n, CMLP_COMM_I64, CMLP_REDUCE_MAX));
    for (int i = 0; i < n; i++) lo[i] = ~lo[i];
    return CMLP_OK;
}

/* As cmlp_train_same_on_every_rank, but for the values of the `free` bits, whose maxima come
 * back in v (they may differ). */
static cmlp_status same_but_free(const char *const *names, int64_t *v, int n, uint32_t hashes, uint32_t free) {
    int64_t hi[MAX_COMPARED], lo[MAX_COMPARED];
    CMLP_TRY(extremes(v, n, hi, lo));
    for (int i = 0; i < n; i++) {
        if (free >> i & 1u) v[i] = hi[i];
        if (hi[i] == lo[i] || free >> i & 1u) continue;
        char range[64] = ""; /* a hash's values say nothing */
        if (!(hashes >> i & 1u))
            snprintf(range, sizeof range, " (from %lld to %lld)", (long long)lo[i], (long long)hi[i]);
        return CMLP_FAIL(CMLP_ERR_INVALID,
                         "the ranks of the process group differ in %s%s: every rank must make the same calls with "
                         "the same settings on the same data set",
                         names[i], range);
    }
    return CMLP_OK;
}

cmlp_status cmlp_train_same_on_every_rank(const char *const *names, const int64_t *v, int n, uint32_t hashes) {
    int64_t copy[MAX_COMPARED];
    if (n > MAX_COMPARED) return CMLP_FAIL(CMLP_ERR_INTERNAL, "%d values to compare", n);
    memcpy(copy, v, (size_t)n * sizeof *v);
    return same_but_free(names, copy, n, hashes, 0);
}

/* Where a rank changed its parameters or optimizer state from outside the trainer (the flag of
 * any rank: every rank comes here), the ranks compare them bit for bit, a hash of each, and
 * the flags are cleared once they are found equal. */
static cmlp_status same_state(cmlp_trainer *t) {
    cmlp_model *m = t->model;
    bool *state_written = cmlp_optim_written(t->optim);
    uint64_t params = 0xCBF29CE484222325ull, state = params;
    cmlp_status st = cmlp_buffer_hash(m->dev, m->params, (size_t)m->nparams * sizeof(float), false, &params);
    if (st == CMLP_OK) st = cmlp_optim_state_hash(t->optim, &state);
    CMLP_TRY(cmlp_dist_agree(st)); /* (a rank that could not read them: every rank raises) */
    const int64_t v[3] = {(int64_t)params, (int64_t)state, m->written || *state_written};
    int64_t hi[3], lo[3];
    CMLP_TRY(extremes(v, 3, hi, lo));
    const bool params_differ = hi[0] != lo[0], state_differs = hi[1] != lo[1];
    if (!params_differ && !state_differs) {
        m->written = *state_written = false;
        return CMLP_OK;
    }
    return CMLP_FAIL(CMLP_ERR_INVALID,
                     "the ranks' %s differ after a change made outside this data-parallel trainer (load_state_dict, "
                     "optimizer.step(), a Trainer of one rank) %s: every rank must hold the same ones, so make the "
                     "same change on every rank (a checkpoint: load it on each)",
                     params_differ ? state_differs ? "parameters and optimizer states" : "parameters"
                                   : "optimizer states",
                     lo[2] ? "on every rank, to different values" : "on some ranks only");
}

static int64_t bits_of(double v) {
    int64_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

/* The settings that decide which samples a step takes and how it is computed, the call being
 * made (an epoch on one rank and a step on another would mix), and for a call with data its
 * normalisation (xy, or NULL). */
cmlp_status cmlp_train_same_settings(cmlp_trainer *t, int call, const cmlp_data *xy) {
    static const char *const names[] = {"the call (1 Trainer, 2 fit's epoch, 3 step)",
                                        "batch_size",
                                        "accumulation_steps",
                                        "shuffle",
                                        "seed",
                                        "amp",
                                        "label_smoothing (its bits)",
                                        "the loss scaler (on, scale, growth and backoff factors, interval, tracker)",
                                        "the model's layer sizes",
                                        "the optimizer (kind, settings, step count)",
                                        "the kind of device the model is on",
                                        "the epoch count",
                                        "the normalisation's mean (its bits)",
                                        "the normalisation's std (its bits)",
                                        "max_grad_norm (its bits)",
                                        "fit's epochs",
                                        "fit's validation samples (-1: none)",
                                        "fit's schedule per step (scheduler_interval='step')",
                                        "fit's validation set (its labels, and rows spread over it)",
                                        "a change of the parameters or the optimizer's state (not compared)"};
    const cmlp_train_config *c = &t->cfg;
    const cmlp_model *m = t->model;
    const cmlp_scaler_state *sc = &t->scaler;
    uint64_t scaler = 0, layers = (uint64_t)m->nlayers; /* hashes (unsigned: wrapping is defined) */
    if (sc->enabled)
        scaler = (uint64_t)bits_of(sc->scale) ^ (uint64_t)bits_of(sc->growth_factor) * 3u ^
                 (uint64_t)bits_of(sc->backoff_factor) * 5u ^ (uint64_t)sc->growth_interval * 7u ^
                 (uint64_t)sc->growth_tracker * 11u ^ 1u;
    for (int i = 0; i <= m->nlayers; i++) layers = layers * 1000003u + (uint64_t)m->sizes[i];
    int64_t v[20] = {call,
                     c->batch_size,
                     c->accumulation_steps,
                     c->shuffle,
                     (int64_t)c->seed,
                     (int64_t)c->amp,
                     bits_of(c->label_smoothing),
                     (int64_t)scaler,
                     (int64_t)layers,
                     (int64_t)cmlp_optim_fingerprint(t->optim),
                     (int64_t)m->dev->device.type,
                     t->epoch,
                     xy ? bits_of(xy->mean) : 0,
                     xy ? bits_of(xy->std) : 0,
                     bits_of(c->max_grad_norm),
                     call == CALL_EPOCH ? t->fit_call[0] : 0,
                     call == CALL_EPOCH ? t->fit_call[1] : 0,
                     call == CALL_EPOCH ? t->fit_call[2] : 0,
                     call == CALL_EPOCH ? t->fit_call[3] : 0,
                     m->written || *cmlp_optim_written(t->optim)};
    /* hashes: the scaler, the layers, the optimizer, the validation set; free: the change, whose
     * maximum says whether any rank made one (the Trainer's own call gives every rank rank 0's
     * parameters after it: its optimizers' states are compared at the next call) */
    CMLP_TRY(same_but_free(names, v, 20, 1u << 7 | 1u << 8 | 1u << 9 | 1u << 18, 1u << 19));
    return v[19] && call != CALL_TRAINER ? same_state(t) : CMLP_OK;
}

cmlp_status cmlp_train_same_data(const cmlp_trainer *t, const cmlp_data *xy) {
    static const char *const names[3] = {"the data set's sample count", "the data set's image type",
                                         "the data set's contents (its labels, and rows spread over it)"};
    enum { ROWS = 256 }; /* another data set differs in them; their hash costs about one step's reading */
    uint64_t h = 0xCBF29CE484222325ull;
    if (!xy->on_device && xy->n > 0) {
        const size_t row = (size_t)t->model->sizes[0] * (xy->x_dtype == CMLP_DTYPE_U8 ? 1 : sizeof(float));
        const int64_t rows = xy->n < ROWS ? xy->n : ROWS;
        for (int64_t k = 0; k < rows; k++) { /* the first row, the last, and evenly between */
            const size_t at = (size_t)(rows > 1 ? k * (xy->n - 1) / (rows - 1) : 0) * row;
            h = cmlp_hash_bytes(h, (const char *)xy->x + at, row);
        }
        h = cmlp_hash_bytes(h, xy->y, (size_t)xy->n * sizeof *xy->y);
    }
    const int64_t v[3] = {xy->n, (int64_t)xy->x_dtype, (int64_t)h};
    return cmlp_train_same_on_every_rank(names, v, 3, 1u << 2);
}

/* ---- the trainers holding a device communicator ----
 * A captured step holds the communicator's collectives, and NCCL's destroy of a communicator
 * waits until every graph holding it is gone: at the group's end the trainers drop theirs first
 * (no data-parallel call runs then: destroy_process_group's rule). */
static pthread_mutex_t joined_lock = PTHREAD_MUTEX_INITIALIZER;
static cmlp_trainer *joined_head;
static pthread_once_t joined_once = PTHREAD_ONCE_INIT;

static void joined_after_fork_child(void) { pthread_mutex_init(&joined_lock, NULL); }
static void joined_register(void) { pthread_atfork(NULL, NULL, joined_after_fork_child); }

static void joined_add(cmlp_trainer *t) {
    pthread_once(&joined_once, joined_register);
    pthread_mutex_lock(&joined_lock);
    if (!t->joined) {
        t->joined = true;
        t->joined_prev = NULL;
        t->joined_next = joined_head;
        if (joined_head) joined_head->joined_prev = t;
        joined_head = t;
    }
    pthread_mutex_unlock(&joined_lock);
}

static void joined_remove(cmlp_trainer *t) { /* with joined_lock held */
    if (!t->joined) return;
    if (t->joined_prev) t->joined_prev->joined_next = t->joined_next;
    else joined_head = t->joined_next;
    if (t->joined_next) t->joined_next->joined_prev = t->joined_prev;
    t->joined = false;
    t->joined_prev = t->joined_next = NULL;
}

void cmlp_train_leave_group(cmlp_trainer *t) {
    pthread_once(&joined_once, joined_register);
    pthread_mutex_lock(&joined_lock);
    joined_remove(t);
    pthread_mutex_unlock(&joined_lock);
    t->dcomm = NULL;
    t->dcomm_dev = NULL;
}

void cmlp_train_drop_group_graphs(void) {
    pthread_once(&joined_once, joined_register);
    pthread_mutex_lock(&joined_lock);
    while (joined_head) {
        cmlp_trainer *t = joined_head;
        joined_remove(t);
        cmlp_train_drop_graph(t);
        t->dcomm = NULL;
        t->dcomm_dev = NULL;
    }
    pthread_mutex_unlock(&joined_lock);
}

void cmlp_train_mark_local(cmlp_trainer *t) {
    if (!t->dist) t->model->written = *cmlp_optim_written(t->optim) = true;
}

/* Every rank takes rank 0's parameters, as DistributedDataParallel does when it wraps a model:
 * they are then the same on every rank (no change of one rank's own). */
static cmlp_status take_rank_0s(cmlp_model *m) {
    const size_t bytes = (size_t)m->nparams * sizeof(float);
    float *host = malloc(bytes);
    cmlp_status st = host ? cmlp_model_get_params(m, host)
                          : CMLP_FAIL(CMLP_ERR_OOM, "out of host memory for the parameters (%zu bytes)", bytes);
    st = cmlp_dist_agree(st);
    if (st == CMLP_OK) st = cmlp_dist_broadcast(host, (int64_t)bytes, 0);
    if (st == CMLP_OK) st = cmlp_dist_agree(cmlp_model_copy_params(m, host));
    free(host);
    if (st == CMLP_OK) m->written = false;
    return st;
}

/* Off the host, the model's device joins the group's device collectives (every rank at once:
 * after cmlp_train_same_settings, so that all are on devices of one kind). */
cmlp_status cmlp_train_join_group(cmlp_trainer *t) {
    cmlp_device_ctx *dev = t->model->dev;
    if (dev->device.type == CMLP_DEVICE_CPU) return CMLP_OK;
    void *comm;
    CMLP_TRY(cmlp_dist_device_comm(dev, &comm)); /* collective: every rank asks every time */
    if (t->dcomm != comm) cmlp_train_drop_graph(t); /* a capture holds the communicator it was made with */
    t->dcomm = comm;
    t->dcomm_dev = dev;
    t->dgen = cmlp_dist_generation();
    joined_add(t);
    return CMLP_OK;
}

/* A data-parallel step takes the effective batch on every rank: the group's samples must count. */
cmlp_status cmlp_train_group_batch_fits(const cmlp_trainer *t) {
    if (cmlp_train_effective_batch(t) <= CMLP_MAX_STEP_SAMPLES / cmlp_train_group_size(t)) return CMLP_OK;
    return CMLP_FAIL(CMLP_ERR_INVALID,
                     "batch_size x accumulation_steps = %lld on each of %lld ranks is over 2**62 samples a step",
                     (long long)cmlp_train_effective_batch(t), (long long)cmlp_train_group_size(t));
}

cmlp_status cmlp_trainer_set_distributed(cmlp_trainer *t, int on) {
    if (!t) return CMLP_FAIL(CMLP_ERR_INVALID, "arguments must not be NULL");
    if (on && !cmlp_dist_initialized())
        return CMLP_FAIL(CMLP_ERR_STATE, "no process group: call cmlp.distributed.init_process_group() first");
    cmlp_train_drop_graph(t);
    t->warm = false;
    t->dist = false;
    cmlp_train_leave_group(t);
    if (!on) return CMLP_OK;
    t->dist = true; /* collectives from here: every rank makes its trainer data-parallel */
    cmlp_status st = cmlp_train_same_settings(t, CALL_TRAINER, NULL);
    if (st == CMLP_OK) st = cmlp_train_group_batch_fits(t); /* the same on every rank, as the settings are */
    if (st == CMLP_OK) st = cmlp_train_join_group(t);
    if (st == CMLP_OK) st = take_rank_0s(t->model);
    if (st != CMLP_OK) t->dist = false;
    return st;
}

/* Data-parallel, the group is still there (and the trainer's device collectives are its
 * model's device's: where the model moved, epoch_begin and step join the group again). */
cmlp_status cmlp_train_check_group(cmlp_trainer *t, bool joined) {
    if (!t->dist && cmlp_optim_shards(t->optim, NULL, NULL, NULL))
        return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer's state is sharded over the process group: it steps from "
                                         "gradients summed over the ranks, in a data-parallel trainer");
    if (!t->dist) return CMLP_OK;
    if (!cmlp_dist_initialized())
        return CMLP_FAIL(CMLP_ERR_STATE, "this trainer is data-parallel, and the process group was destroyed");
    if (t->dcomm && t->dgen != cmlp_dist_generation()) { /* the group was made again: its old communicator is gone */
        if (joined) return CMLP_FAIL(CMLP_ERR_STATE, "the process group was made again during the epoch");
        cmlp_train_drop_graph(t);
        cmlp_train_leave_group(t);
    }
    if (joined && t->model->dev->device.type != CMLP_DEVICE_CPU && t->dcomm_dev != t->model->dev)
        return CMLP_FAIL(CMLP_ERR_STATE, "the model moved to another device during the epoch");
    return CMLP_OK;
}
