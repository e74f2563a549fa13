/* optim_shard.c - ZeRO stage 1: the optimizer's state for this rank's part of the parameters
 * only, and the gather that gives every rank the parts the others updated.
 */
#include "optim_internal.h"
#include "comm.h"

/* Rank r's part: [r * chunk, (r + 1) * chunk) within the parameters (the last parts may be
 * short or empty). */
static void shard_range(const cmlp_optim *o, int r, int64_t *lo, int64_t *hi) {
    int64_t n = o->model->nparams;
    *lo = (int64_t)r * o->chunk < n ? (int64_t)r * o->chunk : n;
    *hi = *lo + o->chunk < n ? *lo + o->chunk : n;
}

/* A sharded optimizer steps with the process group its parts were cut for. */
cmlp_status cmlp_optim_check_group(const cmlp_optim *o) {
    if (!cmlp_dist_initialized())
        return CMLP_FAIL(CMLP_ERR_STATE, "this optimizer's state is sharded over a process group, and the group was "
                                         "destroyed");
    if (cmlp_dist_size() != o->shards || cmlp_dist_rank() != o->shard_rank)
        return CMLP_FAIL(CMLP_ERR_STATE,
                         "this optimizer's state is sharded as rank %d of %d, and this process is rank %d of %d now",
                         o->shard_rank, o->shards, cmlp_dist_rank(), cmlp_dist_size());
    return CMLP_OK;
}

cmlp_status cmlp_optim_shard(cmlp_optim *o, int on) {
    if (!o) return CMLP_FAIL(CMLP_ERR_INVALID, "optimizer must not be NULL");
    if (o->state || o->step > 0)
        return CMLP_FAIL(CMLP_ERR_STATE, "the optimizer has stepped or holds state: shard it before its first step");
    if (!on) {
        o->shards = 0;
        o->version++;
        return CMLP_OK;
    }
    if (!cmlp_dist_initialized())
        return CMLP_FAIL(CMLP_ERR_STATE, "no process group: call cmlp.distributed.init_process_group() first");
    int w = cmlp_dist_size();
    o->chunk = cmlp_shard_chunk(o->model->nparams, w);
    o->shards = w;
    o->shard_rank = cmlp_dist_rank();
    shard_range(o, o->shard_rank, &o->lo, &o->hi);
    o->version++;
    return CMLP_OK;
}

int cmlp_optim_shards(const cmlp_optim *o, int64_t *lo, int64_t *hi, int64_t *chunk) {
    if (lo) *lo = first_of(o);
    if (hi) *hi = first_of(o) + span(o);
    if (chunk) *chunk = o->shards ? o->chunk : o->model->nparams;
    return o->shards;
}

/* Every rank's part of the parameters to every rank, each sent by its owner (host memory through
 * MPI, device memory through the device collectives, on the stream: a capture records them). */
cmlp_status cmlp_optim_gather(cmlp_optim *o, void *dcomm) {
    if (!o->shards) return CMLP_OK;
    cmlp_model *m = o->model;
    if (o->dev->device.type == CMLP_DEVICE_CPU) return cmlp_dist_all_gather(m->params, m->nparams, o->chunk, CMLP_COMM_F32);
    return cmlp_dcomm_all_gather(o->dev, dcomm, m->params, m->nparams, o->chunk);
}
