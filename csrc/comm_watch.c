/* comm_watch.c - the process group's timeout for collectives between devices (NCCL's), as torch's
 * watchdog: such a collective is queued on the device's stream and the host goes on, so MPI's
 * watched wait (comm_mpi.c) never sees it. Each one is armed before it is queued, then given a
 * fence (a mark on the stream after it). Two threads of their own watch them: a poller asks the
 * device about the fences, and a monitor, which never calls the device (a call about a fence can
 * block behind a hung collective), ends the job when one armed collective has not passed once the
 * group's timeout has run since it was armed: the ranks waiting in it would wait forever.
 */
#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

enum { SLOTS = 64 }; /* collectives watched at once: past it the oldest are (a hang holds them back) */
static const long POLL_NS = 20 * 1000 * 1000;

typedef enum { ARMED, PENDING, DONE } slot_state; /* queued with a fence: PENDING until it passed */

typedef struct {
    uint64_t ticket; /* cmlp_dist_watch_begin's */
    cmlp_device_ctx *dev;
    const char *what;
    double armed; /* when (a monotonic clock's seconds) */
    void *fence;
    slot_state state;
} watched;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work; /* on CLOCK_MONOTONIC (set_up) */
static watched slots[SLOTS];
static uint64_t head = 1, tail = 1; /* slots of tickets [head, tail) are in use */
static double timeout_;             /* > 0: the group's timeout */
static int rank_of;                 /* for the message */
static int running;                 /* watcher threads alive */
static bool closed;                 /* stopped for good (the group's end at exit) */
static pthread_once_t set_up_once = PTHREAD_ONCE_INIT;
static atomic_bool watching; /* timeout_ > 0 && !closed, read without the lock by every collective */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void init_cond(void) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&work, &attr);
    pthread_condattr_destroy(&attr);
}

/* The child of a fork has no watchers, and the parent's collectives are not its own. */
static void after_fork_child(void) {
    pthread_mutex_init(&mu, NULL);
    init_cond();
    head = tail = 1;
    running = 0;
    timeout_ = 0;
    atomic_store(&watching, false);
}

static void set_up(void) {
    init_cond();
    pthread_atfork(NULL, NULL, after_fork_child);
}

static void nap(void) { /* POLL_NS, or until woken; with mu held */
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_nsec += POLL_NS;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    (void)pthread_cond_timedwait(&work, &mu, &until);
}

static void drop_done(void) { /* with mu held */
    while (head != tail && slots[head % SLOTS].state == DONE) head++;
}

static void expire(const watched *w) {
    fprintf(stderr,
            "cmlp.distributed: rank %d waited %.0f s for %s on cuda:%d for the other ranks (the process group's "
            "timeout): one has ended or is stuck; ending the job (MPI_Abort)\n",
            rank_of, timeout_, w->what, w->dev->device.index);
    fflush(stderr);
    cmlp_dist_abort(1); /* from this thread: the others may be in MPI or the device, waiting for good */
}

/* Ends the job once an armed collective has not passed within the timeout. */
static void *monitor(void *unused) {
    (void)unused;
    pthread_mutex_lock(&mu);
    while (!closed) {
        if (head == tail) {
            pthread_cond_wait(&work, &mu);
            continue;
        }
        const double t = now();
        for (uint64_t i = head; i != tail; i++) {
            const watched *w = &slots[i % SLOTS];
            if (w->state != DONE && timeout_ > 0 && t - w->armed > timeout_) expire(w);
        }
        nap();
    }
    running--;
    pthread_cond_broadcast(&work);
    pthread_mutex_unlock(&mu);
    return NULL;
}

/* Asks the device about the queued collectives' fences (with mu let go: a call may take long). */
static void *poller(void *unused) {
    (void)unused;
    pthread_mutex_lock(&mu);
    while (!closed) {
        drop_done();
        bool pending = false;
        for (uint64_t i = head; i != tail && !closed; i++) {
            watched *w = &slots[i % SLOTS];
            if (w->state != PENDING) continue; /* (an armed one becomes so with a wake-up) */
            const watched seen = *w; /* the slot stays this ticket's until it is DONE: only this thread makes it so */
            pthread_mutex_unlock(&mu);
            const int passed = seen.dev->backend->fence_passed(seen.dev->bctx, seen.fence);
            if (passed) seen.dev->backend->fence_free(seen.dev->bctx, seen.fence);
            pthread_mutex_lock(&mu);
            if (passed) { /* (< 0: the device cannot say; the thread that waits for it gets the error) */
                w->fence = NULL;
                w->state = DONE;
            } else {
                pending = true;
            }
        }
        drop_done();
        if (closed) break;
        if (pending) nap();
        else pthread_cond_wait(&work, &mu);
    }
    running--;
    pthread_cond_broadcast(&work);
    pthread_mutex_unlock(&mu);
    return NULL;
}

static bool start(void *(*fn)(void *)) { /* with mu held */
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    const bool ok = pthread_create(&th, &attr, fn, NULL) == 0;
    pthread_attr_destroy(&attr);
    if (ok) running++;
    return ok;
}

void cmlp_dist_watch_configure(double seconds, int rank) {
    pthread_once(&set_up_once, set_up);
    pthread_mutex_lock(&mu);
    timeout_ = seconds > 0 ? seconds : 0;
    rank_of = rank;
    atomic_store(&watching, timeout_ > 0 && !closed);
    pthread_cond_broadcast(&work);
    pthread_mutex_unlock(&mu);
}

uint64_t cmlp_dist_watch_begin(cmlp_device_ctx *dev, const char *what) {
    if (!dev->backend->fence_record || !atomic_load(&watching)) return 0; /* no timeout: no lock per step */
    pthread_once(&set_up_once, set_up);
    pthread_mutex_lock(&mu);
    uint64_t ticket = 0;
    if (timeout_ > 0 && !closed && tail - head < SLOTS) {
        /* both watchers, started once: a poller alone could hang in a call about a fence */
        if (running == 0 && !(start(monitor) && start(poller))) { /* no threads: none watched */
            closed = true;
            atomic_store(&watching, false);
        }
        if (!closed) {
            ticket = tail++;
            slots[ticket % SLOTS] = (watched){.ticket = ticket, .dev = dev, .what = what, .armed = now(), .state = ARMED};
            pthread_cond_broadcast(&work);
        }
    }
    pthread_mutex_unlock(&mu);
    return ticket;
}

void cmlp_dist_watch_end(uint64_t ticket, bool queued) {
    if (!ticket) return;
    void *fence = NULL;
    cmlp_device_ctx *dev = slots[ticket % SLOTS].dev; /* the slot is this ticket's until it is DONE */
    if (queued) {
        char saved[1024]; /* a fence that cannot be made leaves the collective unwatched, its message as it was */
        snprintf(saved, sizeof saved, "%s", cmlp_last_error());
        if (dev->backend->fence_record(dev->bctx, &fence) != CMLP_OK) {
            fence = NULL;
            cmlp_restore_error(saved);
        }
    }
    pthread_mutex_lock(&mu);
    watched *w = &slots[ticket % SLOTS];
    const bool mine = ticket >= head && w->ticket == ticket && w->state == ARMED; /* not after a stop */
    if (mine) {
        w->fence = fence;
        w->state = fence ? PENDING : DONE;
        pthread_cond_broadcast(&work);
    }
    pthread_mutex_unlock(&mu);
    if (!mine && fence) dev->backend->fence_free(dev->bctx, fence);
}

void cmlp_dist_watch_stop(void) {
    pthread_once(&set_up_once, set_up);
    pthread_mutex_lock(&mu);
    closed = true; /* for good: the process is ending */
    timeout_ = 0;
    atomic_store(&watching, false);
    pthread_cond_broadcast(&work);
    /* a while for the watchers to end; a poller stuck in a call about a fence ends with the process */
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += 1;
    while (running > 0 && pthread_cond_timedwait(&work, &mu, &until) == 0) {
    }
    head = tail; /* what is left is the device's to finish: its fences go with the process */
    pthread_mutex_unlock(&mu);
}

/* ---- the device collectives, watched ---- */

cmlp_status cmlp_dcomm_all_reduce(cmlp_device_ctx *dev, void *comm, float *d_buf, int64_t n) {
    uint64_t w = cmlp_dist_watch_begin(dev, "an all-reduce (NCCL)");
    cmlp_status st = dev->backend->comm_all_reduce(dev->bctx, comm, d_buf, n);
    cmlp_dist_watch_end(w, st == CMLP_OK);
    return st;
}

cmlp_status cmlp_dcomm_all_gather(cmlp_device_ctx *dev, void *comm, float *d_buf, int64_t n, int64_t chunk) {
    uint64_t w = cmlp_dist_watch_begin(dev, "an all-gather (NCCL)");
    cmlp_status st = dev->backend->comm_all_gather(dev->bctx, comm, d_buf, n, chunk);
    cmlp_dist_watch_end(w, st == CMLP_OK);
    return st;
}

cmlp_status cmlp_dcomm_reduce_scatter(cmlp_device_ctx *dev, void *comm, float *d_buf, int64_t n, int64_t chunk) {
    uint64_t w = cmlp_dist_watch_begin(dev, "a reduce-scatter (NCCL)");
    cmlp_status st = dev->backend->comm_reduce_scatter(dev->bctx, comm, d_buf, n, chunk);
    cmlp_dist_watch_end(w, st == CMLP_OK);
    return st;
}

cmlp_status cmlp_dcomm_graph_launch(cmlp_device_ctx *dev, void *graph) {
    uint64_t w = cmlp_dist_watch_begin(dev, "a captured training step's collectives (NCCL, in a CUDA graph)");
    cmlp_status st = dev->backend->graph_launch(dev->bctx, graph);
    cmlp_dist_watch_end(w, st == CMLP_OK);
    return st;
}

/* Every rank makes its member at once, on the host: watched while it waits, with no fence. */
cmlp_status cmlp_dcomm_init(cmlp_device_ctx *dev, const void *id, int rank, int size, void **comm) {
    uint64_t w = cmlp_dist_watch_begin(dev, "the making of a communicator (NCCL)");
    cmlp_status st = dev->backend->comm_init(dev->bctx, id, rank, size, comm);
    cmlp_dist_watch_end(w, false);
    return st;
}
