/* comm.c - the process group of data parallelism: loads the MPI module (_cmlp_mpi.so beside this
 * module, or $CMLP_MPI_LIBRARY) when the group is made, and serialises every collective (MPI is
 * initialised for MPI_THREAD_SERIALIZED: a step on one thread and a barrier on another take
 * turns). The group lives until destroyed; MPI itself lives until the process ends, as it
 * cannot be initialised twice.
 */
#include "internal.h"
#include "comm.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static const cmlp_mpi_module *mpi; /* loaded once, kept to the end */
static bool group;                 /* between cmlp_dist_init and cmlp_dist_destroy */
static int rank_, size_ = 1, local_rank_, local_size_ = 1;
static int backend_; /* CMLP_DIST_MPI, or CMLP_DIST_NCCL: devices other than the host sum through NCCL */
static uint64_t generation; /* moves with every group made: what a trainer joined may be gone */
/* each device's member of the group's device collectives, made when first asked for */
static struct {
    cmlp_device_ctx *dev;
    void *comm;
} dcomms[16];
static int ndcomms;

/* A group of one without MPI: for a build without the MPI module, in a process no MPI launcher
 * started (the same code runs; there is nothing to sum). */
static cmlp_status solo_init(int *rank, int *size, int *local_rank, int *local_size) {
    *rank = *local_rank = 0;
    *size = *local_size = 1;
    return CMLP_OK;
}
static cmlp_status solo_all_reduce(void *buf, int64_t count, cmlp_comm_type type, cmlp_reduce_op op) {
    (void)buf, (void)count, (void)type, (void)op;
    return CMLP_OK;
}
static cmlp_status solo_broadcast(void *buf, int64_t bytes, int root) {
    (void)buf, (void)bytes, (void)root;
    return CMLP_OK;
}
static cmlp_status solo_barrier(void) { return CMLP_OK; }
static void solo_finalize(int live) { (void)live; }
static void solo_abort(int code) { _exit(code); }
static void solo_version(char *out, size_t cap) { snprintf(out, cap, "none (a group of one, without MPI)"); }
static cmlp_status solo_all_gather(void *buf, int64_t count, int64_t chunk, cmlp_comm_type type) {
    (void)buf, (void)count, (void)chunk, (void)type;
    return CMLP_OK;
}
static cmlp_status solo_reduce_scatter(float *buf, int64_t count, int64_t chunk) {
    (void)buf, (void)count, (void)chunk;
    return CMLP_OK;
}
static void solo_set_timeout(double seconds) { (void)seconds; }
static const cmlp_mpi_module solo = {CMLP_MPI_ABI,        solo_init,       solo_all_reduce, solo_broadcast,
                                     solo_barrier,        solo_finalize,   solo_abort,      solo_version,
                                     solo_all_gather,     solo_reduce_scatter, solo_set_timeout};

/* orphan: this process was forked from one that had started MPI. MPI and the group's
 * collectives belong to the parent: the child takes part in none and never finalizes MPI. */
static bool mpi_started, orphan;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void after_fork_child(void) {
    pthread_mutex_init(&lock, NULL); /* a thread that the child lacks may have held it */
    orphan = orphan || mpi_started;
    ndcomms = 0; /* the devices' communicators are the parent's */
}

static void fork_register(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* The lock, with the child's handler registered before its first use (a fork while a thread
 * holds it leaves the child a lock that nobody releases; the handler makes a new one). */
static void take_lock(void) {
    pthread_once(&fork_once, fork_register); /* registering is not done under the lock */
    pthread_mutex_lock(&lock);
}

#define ORPHANED()                                                                                             \
    CMLP_FAIL(CMLP_ERR_STATE, "this process was forked from a rank of a process group: MPI and the group's "   \
                              "collectives belong to that rank, and a forked child cannot take part in them")

/* Variables that MPI launchers (Open MPI, MPICH/PMI, PMIx, srun's PMI) set in the ranks they start. */
static bool launched(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK",
                                       "MPI_LOCALNRANKS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i])) return true;
    return false;
}

/* A process that a launcher of torch's kind (torchrun) started as one of several: MPI would make
 * it a group of one, and each would train alone. */
static cmlp_status not_torchrun(void) {
    const char *ws = getenv("WORLD_SIZE");
    char *end;
    long n = ws ? strtol(ws, &end, 10) : 1;
    if (!ws || *end || n <= 1 || launched()) return CMLP_OK;
    return CMLP_FAIL(CMLP_ERR_STATE,
                     "WORLD_SIZE=%ld says this process is one of %ld that a launcher such as torchrun started, but "
                     "cmlp's process group is MPI's and no MPI launcher started it: each process would train "
                     "alone; start the job with mpirun -np %ld python ... instead",
                     n, n, n);
}

static cmlp_status load(void) {
    if (mpi) return CMLP_OK;
    char path[4096];
    const char *env = getenv("CMLP_MPI_LIBRARY");
    if (env && env[0]) {
        snprintf(path, sizeof path, "%s", env);
    } else {
        if (!cmlp_beside_module("_cmlp_mpi.so", path, sizeof path))
            return CMLP_FAIL(CMLP_ERR_DEVICE, "cannot locate cmlp's own module to find _cmlp_mpi.so");
        struct stat sb;
        if (stat(path, &sb) != 0 && !launched()) {
            mpi = &solo;
            return CMLP_OK;
        }
        if (stat(path, &sb) != 0)
            return CMLP_FAIL(CMLP_ERR_DEVICE,
                             "this process was started by an MPI launcher, and this build of cmlp has no MPI support "
                             "(%s is missing: no MPI compiler wrapper, mpicc, was found when it was built; install an "
                             "MPI, e.g. apt-get install libopenmpi-dev openmpi-bin, and build cmlp again)",
                             path);
    }
    /* global: Open MPI's components, loaded later, resolve MPI's symbols through it */
    void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!h) return CMLP_FAIL(CMLP_ERR_DEVICE, "cannot load cmlp's MPI module: %s", dlerror());
    cmlp_mpi_entry_fn entry = (cmlp_mpi_entry_fn)dlsym(h, "cmlp_mpi_entry");
    const cmlp_mpi_module *m = entry ? entry(cmlp_set_error) : NULL;
    if (!m || m->abi != CMLP_MPI_ABI) {
        dlclose(h);
        return CMLP_FAIL(CMLP_ERR_DEVICE, "%.400s is not an MPI module of this version of cmlp", path);
    }
    mpi = m;
    return CMLP_OK;
}

cmlp_status cmlp_dist_init(int backend, int *rank, int *size) {
    if (backend != CMLP_DIST_MPI && backend != CMLP_DIST_NCCL)
        return CMLP_FAIL(CMLP_ERR_INVALID, "unknown process group backend %d", backend);
    take_lock();
    cmlp_status st = orphan  ? ORPHANED()
                     : group ? CMLP_FAIL(CMLP_ERR_STATE, "the process group is initialised already")
                             : not_torchrun();
    if (st == CMLP_OK) st = load();
    if (st == CMLP_OK) {
        mpi_started = mpi_started || mpi != &solo; /* before: a fork while MPI starts makes an orphan too */
        st = mpi->init(&rank_, &size_, &local_rank_, &local_size_);
    }
    if (st == CMLP_OK) {
        group = true;
        backend_ = backend;
        generation++;
        if (rank) *rank = rank_;
        if (size) *size = size_;
    }
    pthread_mutex_unlock(&lock);
    return st;
}

int cmlp_dist_initialized(void) {
    take_lock();
    int on = group;
    pthread_mutex_unlock(&lock);
    return on;
}

int cmlp_dist_orphaned(void) { return orphan; }

int cmlp_dist_rank(void) { return group ? rank_ : 0; }
int cmlp_dist_size(void) { return group ? size_ : 1; }
int cmlp_dist_local_rank(void) { return group ? local_rank_ : 0; }
int cmlp_dist_local_size(void) { return group ? local_size_ : 1; }
int cmlp_dist_backend(void) { return group ? backend_ : -1; }
uint64_t cmlp_dist_generation(void) { return generation; }

#define NO_GROUP() CMLP_FAIL(CMLP_ERR_STATE, "no process group: call cmlp.distributed.init_process_group() first")

/* CMLP_OK when the group can run a collective (under the lock). */
static cmlp_status usable(void) { return !group ? NO_GROUP() : orphan ? ORPHANED() : CMLP_OK; }

/* ---- checked calls (TORCH_DISTRIBUTED_DEBUG=DETAIL, as torch's): before each collective the
 * ranks compare what each is calling, in a collective of its own that pairs whatever they call,
 * so that ranks making different calls all raise, naming this rank's, instead of pairing them
 * (MPI would mix their buffers, or fail on one rank and leave the others waiting). ---- */
enum { CALL_ALL_REDUCE = 1, CALL_ALL_GATHER, CALL_REDUCE_SCATTER, CALL_BROADCAST, CALL_BARRIER };
static bool check_calls;

void cmlp_dist_set_check(int on) {
    take_lock();
    check_calls = on != 0;
    pthread_mutex_unlock(&lock);
}

static const char *const call_names[] = {"", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"};
static const char *const type_names[] = {"float32", "float64", "int64"};
static const char *const op_names[] = {"sum", "max", "min", "product", "band", "bor", "bxor"};

/* Under the lock, with the group usable: CMLP_OK where every rank makes this call. count: its
 * elements (bytes: a broadcast), arg: its reduction, part size or root. */
static cmlp_status same_call(int call, int64_t count, int type, int64_t arg) {
    if (!check_calls) return CMLP_OK;
    int64_t v[8] = {call, count, type, arg};
    for (int i = 0; i < 4; i++) v[4 + i] = ~v[i]; /* the maximum of ~v is ~(the minimum of v) */
    CMLP_TRY(mpi->all_reduce(v, 8, CMLP_COMM_I64, CMLP_REDUCE_MAX));
    bool same = true;
    for (int i = 0; i < 4; i++) same = same && v[i] == ~v[4 + i];
    if (same) return CMLP_OK;
    char what[128];
    if (call == CALL_ALL_REDUCE)
        snprintf(what, sizeof what, "all_reduce of %lld %s elements (%s)", (long long)count, type_names[type],
                 op_names[arg]);
    else if (call == CALL_ALL_GATHER || call == CALL_REDUCE_SCATTER)
        snprintf(what, sizeof what, "%s of %lld %s elements in parts of %lld", call_names[call], (long long)count,
                 type_names[type], (long long)arg);
    else if (call == CALL_BROADCAST)
        snprintf(what, sizeof what, "broadcast of %lld bytes from rank %lld", (long long)count, (long long)arg);
    else
        snprintf(what, sizeof what, "barrier");
    return CMLP_FAIL(CMLP_ERR_INVALID,
                     "the ranks of the process group made different collective calls (TORCH_DISTRIBUTED_DEBUG=DETAIL "
                     "checks them): this rank's is %s, and another rank's differs in its %s; every rank must make "
                     "the same calls in the same order",
                     what, v[0] != ~v[4] ? "kind" : v[1] != ~v[5] ? "size" : v[2] != ~v[6] ? "element type"
                           : call == CALL_ALL_REDUCE ? "reduction" : call == CALL_BROADCAST ? "root" : "parts");
}

cmlp_status cmlp_dist_all_reduce(void *buf, int64_t count, int type, int op) {
    if (count < 0 || (count > 0 && !buf)) return CMLP_FAIL(CMLP_ERR_INVALID, "all_reduce of %lld elements at %p",
                                                           (long long)count, buf);
    if (type < CMLP_COMM_F32 || type > CMLP_COMM_I64) return CMLP_FAIL(CMLP_ERR_INVALID, "unknown element type %d", type);
    if (op < CMLP_REDUCE_SUM || op > CMLP_REDUCE_BXOR) return CMLP_FAIL(CMLP_ERR_INVALID, "unknown reduction %d", op);
    if (op >= CMLP_REDUCE_BAND && type != CMLP_COMM_I64)
        return CMLP_FAIL(CMLP_ERR_INVALID, "a bitwise reduction of floating-point elements");
    take_lock();
    cmlp_status st = usable();
    if (st == CMLP_OK) st = same_call(CALL_ALL_REDUCE, count, type, op);
    if (st == CMLP_OK) st = mpi->all_reduce(buf, count, (cmlp_comm_type)type, (cmlp_reduce_op)op);
    pthread_mutex_unlock(&lock);
    return st;
}

cmlp_status cmlp_dist_all_gather(void *buf, int64_t count, int64_t chunk, int type) {
    if (count < 0 || chunk < 1 || (count > 0 && !buf))
        return CMLP_FAIL(CMLP_ERR_INVALID, "all_gather of %lld elements in parts of %lld at %p", (long long)count,
                         (long long)chunk, buf);
    if (type < CMLP_COMM_F32 || type > CMLP_COMM_I64) return CMLP_FAIL(CMLP_ERR_INVALID, "unknown element type %d", type);
    take_lock();
    cmlp_status st = usable();
    if (st == CMLP_OK) st = same_call(CALL_ALL_GATHER, count, type, chunk);
    if (st == CMLP_OK)
        st = count > 0 && chunk < (count + size_ - 1) / size_
                 ? CMLP_FAIL(CMLP_ERR_INVALID, "%d parts of %lld cannot hold %lld elements", size_, (long long)chunk,
                             (long long)count)
                 : mpi->all_gather(buf, count, chunk, (cmlp_comm_type)type);
    pthread_mutex_unlock(&lock);
    return st;
}

cmlp_status cmlp_dist_reduce_scatter(float *buf, int64_t count, int64_t chunk) {
    if (count < 0 || chunk < 1 || (count > 0 && !buf))
        return CMLP_FAIL(CMLP_ERR_INVALID, "reduce_scatter of %lld elements in parts of %lld at %p", (long long)count,
                         (long long)chunk, (void *)buf);
    take_lock();
    cmlp_status st = usable();
    if (st == CMLP_OK) st = same_call(CALL_REDUCE_SCATTER, count, CMLP_COMM_F32, chunk);
    if (st == CMLP_OK)
        st = count > 0 && chunk < (count + size_ - 1) / size_
                 ? CMLP_FAIL(CMLP_ERR_INVALID, "%d parts of %lld cannot hold %lld elements", size_, (long long)chunk,
                             (long long)count)
                 : mpi->reduce_scatter(buf, count, chunk);
    pthread_mutex_unlock(&lock);
    return st;
}

cmlp_status cmlp_dist_broadcast(void *buf, int64_t bytes, int root) {
    if (bytes < 0 || (bytes > 0 && !buf)) return CMLP_FAIL(CMLP_ERR_INVALID, "broadcast of %lld bytes at %p",
                                                           (long long)bytes, buf);
    take_lock();
    cmlp_status st = usable();
    if (st == CMLP_OK) st = same_call(CALL_BROADCAST, bytes, 0, root);
    if (st == CMLP_OK)
        st = root < 0 || root >= size_
                 ? CMLP_FAIL(CMLP_ERR_INVALID, "src must be a rank in [0, %d), got %d", size_, root)
                 : mpi->broadcast(buf, bytes, root);
    pthread_mutex_unlock(&lock);
    return st;
}

/* Every rank says whether it computed its share of the step: a step that some rank could not
 * compute is taken by none (the others would otherwise wait for it in the gradients' sum). */
cmlp_status cmlp_dist_agree(cmlp_status mine) {
    char why[2048];
    snprintf(why, sizeof why, "%s", cmlp_last_error());
    int64_t first_failed = mine == CMLP_OK ? INT64_MAX : cmlp_dist_rank();
    cmlp_status st = cmlp_dist_all_reduce(&first_failed, 1, CMLP_COMM_I64, CMLP_REDUCE_MIN);
    if (mine != CMLP_OK) {
        if (st == CMLP_OK) cmlp_restore_error(why);
        return st == CMLP_OK ? mine : st;
    }
    if (st != CMLP_OK || first_failed == INT64_MAX) return st;
    return CMLP_FAIL(CMLP_ERR_STATE,
                     "rank %lld of the process group could not compute its share of this step (its own error says "
                     "why), so no rank took the step",
                     (long long)first_failed);
}

cmlp_status cmlp_dist_barrier(void) {
    take_lock();
    cmlp_status st = usable();
    if (st == CMLP_OK) st = same_call(CALL_BARRIER, 0, 0, 0);
    if (st == CMLP_OK) st = mpi->barrier();
    pthread_mutex_unlock(&lock);
    return st;
}

/* The devices' communicators go with the group (every rank destroys it). */
static void free_device_comms(void) {
    for (int i = 0; i < ndcomms; i++) dcomms[i].dev->backend->comm_free(dcomms[i].dev->bctx, dcomms[i].comm);
    ndcomms = 0;
}

/* Collective: every rank calls it with its model's device. Where every rank has a communicator
 * for its device already, that one; else all make a new one together (a rank that moved its
 * model to another device, or a first use): each says whether it can (NCCL loads, its device is
 * there), then rank 0 makes the id, sends it, and all join. */
cmlp_status cmlp_dist_device_comm(cmlp_device_ctx *dev, void **comm) {
    *comm = NULL;
    take_lock();
    cmlp_status st = CMLP_OK;
    void *found = NULL;
    for (int i = 0; i < ndcomms; i++) /* the latest for this device */
        if (dcomms[i].dev == dev) found = dcomms[i].comm;
    st = usable();
    if (st != CMLP_OK) goto out;
    if (backend_ != CMLP_DIST_NCCL || !dev->backend->comm_init) {
        st = CMLP_FAIL(CMLP_ERR_STATE,
                       "the process group's backend is '%s', which sums gradients of models on the CPU; for models "
                       "on CUDA devices make it with init_process_group(\"nccl\")",
                       backend_ == CMLP_DIST_NCCL ? "nccl" : "mpi");
        goto out;
    }
    /* {have one, lowest rank that cannot make one} */
    cmlp_status ready = found ? CMLP_OK : dev->backend->comm_prepare(dev->bctx);
    if (ready == CMLP_OK && ndcomms == (int)(sizeof dcomms / sizeof dcomms[0]))
        ready = CMLP_FAIL(CMLP_ERR_STATE, "more than %d device communicators in one process",
                          (int)(sizeof dcomms / sizeof dcomms[0]));
    char why[2048];
    snprintf(why, sizeof why, "%s", cmlp_last_error());
    int64_t both[2] = {found != NULL, ready == CMLP_OK ? INT64_MAX : rank_}; /* minima over the ranks */
    st = mpi->all_reduce(both, 2, CMLP_COMM_I64, CMLP_REDUCE_MIN);
    if (st != CMLP_OK) goto out;
    int64_t have = both[0], first_unready = both[1];
    if (have) {
        *comm = found;
        goto out;
    }
    if (first_unready != INT64_MAX) {
        if (ready != CMLP_OK) {
            cmlp_restore_error(why);
            st = ready;
        } else {
            st = CMLP_FAIL(CMLP_ERR_DEVICE, "rank %lld of the process group cannot join NCCL (its own error says why)",
                           (long long)first_unready);
        }
        goto out;
    }
    if (found) st = dev->backend->comm_prepare(dev->bctx); /* the others make one: this rank joins them */
    /* rank 0 makes the id and sends it, with a byte saying whether it could */
    unsigned char id[CMLP_COMM_ID_BYTES + 1] = {0};
    if (rank_ == 0) {
        if (st == CMLP_OK) st = dev->backend->comm_id(dev->bctx, id + 1);
        id[0] = st == CMLP_OK;
    }
    cmlp_status sent = mpi->broadcast(id, sizeof id, 0);
    if (st == CMLP_OK) st = sent;
    if (st == CMLP_OK && !id[0])
        st = CMLP_FAIL(CMLP_ERR_DEVICE, "rank 0 of the process group could not make a NCCL id (its own error says why)");
    if (st == CMLP_OK) st = cmlp_dcomm_init(dev, id + 1, rank_, size_, comm);
    if (st == CMLP_OK) {
        dcomms[ndcomms].dev = dev;
        dcomms[ndcomms].comm = *comm;
        ndcomms++;
    }
out:
    pthread_mutex_unlock(&lock);
    return st;
}

void cmlp_dist_destroy(void) {
    take_lock();
    cmlp_train_drop_group_graphs(); /* before the communicators their captured steps hold */
    free_device_comms();
    group = false;
    pthread_mutex_unlock(&lock);
}

void cmlp_dist_set_timeout(double seconds) {
    take_lock();
    if (mpi && !orphan) mpi->set_timeout(seconds);
    cmlp_dist_watch_configure(orphan ? 0.0 : seconds, rank_); /* the devices' collectives */
    pthread_mutex_unlock(&lock);
}

void cmlp_dist_finalize(void) {
    cmlp_dist_watch_stop(); /* not under the lock: the watcher may be ending the job */
    take_lock();
    const bool live = group;
    group = false;
    if (mpi && !orphan) mpi->finalize(live);
    pthread_mutex_unlock(&lock);
}

void cmlp_dist_abort(int code) {
    /* no lock: another thread may be waiting in a collective that will never complete */
    if (orphan) _exit(code); /* the job is the parent's to end */
    if (mpi) mpi->abort(code);
}

void cmlp_dist_library_version(char *out, size_t cap) {
    take_lock();
    if (mpi) mpi->version(out, cap);
    else if (cap) out[0] = 0;
    pthread_mutex_unlock(&lock);
}
