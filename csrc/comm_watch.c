/* comm_watch.c - the process group's timeout for collectives between devices (NCCL's), as torch's
 * watchdog: such a collective is queued on the device's stream and the host goes on, so MPI's
 * watched wait (comm_mpi.c) never sees it. Each one is armed before it is queued, then given a
 * fence (a mark on the stream after it); a thread of its own polls the fences, and one that has
 * not passed when the group's timeout has run since it was armed ends the job, as a host
 * collective that waits too long does: the ranks waiting in it would wait forever.
 */
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

enum { SLOTS = 64 }; /* collectives watched at once: the oldest are, beyond it (one that hangs is among them) */
static const double POLL_SECONDS = 0.05;

typedef struct {
    cmlp_device_ctx *dev;
    const char *what;
    double armed;  /* when it was armed (a monotonic clock's seconds) */
    void *fence;   /* once queued, NULL where none could be made (a capture) */
    bool queued;   /* cmlp_dist_watch_end was called */
} watched;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static watched slots[SLOTS];
static uint64_t head, tail; /* slots[head % SLOTS .. tail % SLOTS) are armed */
static double timeout_;     /* > 0: the group's timeout */
static int rank_of;         /* for the message */
static bool running, stopping;
static pthread_t thread;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The child of a fork has no watcher, and the parent's collectives are not its own. */
static void after_fork_child(void) {
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&wake, NULL);
    head = tail = 0;
    running = stopping = false;
    timeout_ = 0;
}

static void fork_register(void) { pthread_atfork(NULL, NULL, after_fork_child); }

static void expire(const watched *w) {
    fprintf(stderr,
            "cmlp.distributed: rank %d waited %.0f s for %s on cuda:%d for the other ranks (the process group's "
            "timeout): one has ended or is stuck; ending the job (MPI_Abort)\n",
            rank_of, timeout_, w->what, w->dev->device.index);
    fflush(stderr);
    cmlp_dist_abort(1);
}

/* Polls the armed collectives' fences (with the lock released: a fence may take time to ask
 * about) until none is left or the watch stops; past the timeout, one still pending ends the job. */
static void *watch(void *unused) {
    (void)unused;
    pthread_mutex_lock(&mu);
    while (!stopping && head != tail) {
        for (uint64_t i = head; i != tail; i++) {
            watched *w = &slots[i % SLOTS];
            if (!w->queued || !w->fence) {
                if (!w->queued && timeout_ > 0 && now() - w->armed > timeout_) expire(w);
                continue;
            }
            watched seen = *w;
            pthread_mutex_unlock(&mu);
            int passed = seen.dev->backend->fence_passed(seen.dev->bctx, seen.fence);
            pthread_mutex_lock(&mu);
            if (passed) { /* an error: the device says so to the thread that waits for it */
                seen.dev->backend->fence_free(seen.dev->bctx, seen.fence);
                w->fence = NULL;
            } else if (timeout_ > 0 && now() - seen.armed > timeout_) {
                expire(&seen);
            }
        }
        while (head != tail && slots[head % SLOTS].queued && !slots[head % SLOTS].fence) head++;
        if (head == tail) break;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += (long)(POLL_SECONDS * 1e9);
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        int rc = pthread_cond_timedwait(&wake, &mu, &until);
        (void)rc; /* ETIMEDOUT or a wake-up: poll again */
    }
    running = false;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);
    return NULL;
}

void cmlp_dist_watch_configure(double seconds, int rank) {
    pthread_once(&fork_once, fork_register);
    pthread_mutex_lock(&mu);
    timeout_ = seconds > 0 ? seconds : 0;
    rank_of = rank;
    pthread_mutex_unlock(&mu);
}

int cmlp_dist_watch_begin(cmlp_device_ctx *dev, const char *what) {
    if (!dev->backend->fence_record) return -1;
    pthread_once(&fork_once, fork_register);
    pthread_mutex_lock(&mu);
    int slot = -1;
    if (timeout_ > 0 && !stopping && tail - head < SLOTS) {
        slot = (int)(tail % SLOTS);
        slots[slot] = (watched){.dev = dev, .what = what, .armed = now()};
        tail++;
        if (!running) {
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            running = pthread_create(&thread, &attr, watch, NULL) == 0;
            pthread_attr_destroy(&attr);
            if (!running) { /* no thread: nothing is watched */
                tail--;
                slot = -1;
            }
        }
    }
    pthread_mutex_unlock(&mu);
    return slot;
}

void cmlp_dist_watch_end(int slot) {
    if (slot < 0) return;
    void *fence = NULL;
    cmlp_device_ctx *dev = slots[slot].dev; /* only the watcher reads the slot until it is queued */
    if (dev->backend->fence_record(dev->bctx, &fence) != CMLP_OK) fence = NULL; /* unwatched, not an error */
    pthread_mutex_lock(&mu);
    slots[slot].fence = fence;
    slots[slot].queued = true;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);
}

void cmlp_dist_watch_stop(void) {
    pthread_mutex_lock(&mu);
    stopping = true;
    pthread_cond_broadcast(&wake);
    while (running) pthread_cond_wait(&wake, &mu);
    /* what is left is the device's to finish: its fences go with the process */
    head = tail;
    stopping = false;
    pthread_mutex_unlock(&mu);
}

/* ---- the device collectives, watched ---- */

cmlp_status cmlp_dcomm_all_reduce(cmlp_device_ctx *dev, void *comm, float *d_buf, int64_t n) {
    int w = cmlp_dist_watch_begin(dev, "an all-reduce (NCCL)");
    cmlp_status st = dev->backend->comm_all_reduce(dev->bctx, comm, d_buf, n);
    cmlp_dist_watch_end(w);
    return st;
}

cmlp_status cmlp_dcomm_all_gather(cmlp_device_ctx *dev, void *comm, float *d_buf, int64_t n, int64_t chunk) {
    int w = cmlp_dist_watch_begin(dev, "an all-gather (NCCL)");
    cmlp_status st = dev->backend->comm_all_gather(dev->bctx, comm, d_buf, n, chunk);
    cmlp_dist_watch_end(w);
    return st;
}

cmlp_status cmlp_dcomm_reduce_scatter(cmlp_device_ctx *dev, void *comm, float *d_buf, int64_t n, int64_t chunk) {
    int w = cmlp_dist_watch_begin(dev, "a reduce-scatter (NCCL)");
    cmlp_status st = dev->backend->comm_reduce_scatter(dev->bctx, comm, d_buf, n, chunk);
    cmlp_dist_watch_end(w);
    return st;
}

cmlp_status cmlp_dcomm_graph_launch(cmlp_device_ctx *dev, void *graph) {
    int w = cmlp_dist_watch_begin(dev, "a captured training step's collectives (NCCL, in a CUDA graph)");
    cmlp_status st = dev->backend->graph_launch(dev->bctx, graph);
    cmlp_dist_watch_end(w);
    return st;
}
