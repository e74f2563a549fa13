/* _cmlp_lock.c - CoreLock: the reentrant lock Python code holds across calls into the core (a
 * model's move, an optimizer's settings, the memory history's records).
 *
 * Once the process's exit has begun (_cmlp.wait_for_calls, the package's exit hook), a daemon
 * thread's next call into the core waits for the process's end without raising: parked, it keeps
 * every lock its Python frames hold. The exit's own callbacks use cmlp as ever, so where the
 * exiting thread waits for such a lock whose holder is parked, it takes the lock over (that
 * thread never runs again). Otherwise it is threading.RLock, written in C so that no
 * KeyboardInterrupt can come between taking the lock and noting its holder, or between the two
 * on release (a lock written in Python could be left held).
 */
#include "_cmlp.h"

#include <time.h>

enum { POLL_US = 50000 }; /* how often a waiting exit thread asks whether the holder is parked */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner; /* the holding thread's ident, while count > 0 */
    long count;
    unsigned long over_thread; /* the exiting thread, while it holds the lock taken over */
    long over;
} CoreLockObject;

static PyObject *CoreLock_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) > 0 || (kwargs && PyDict_GET_SIZE(kwargs) > 0)) {
        PyErr_SetString(PyExc_TypeError, "CoreLock() takes no arguments");
        return NULL;
    }
    CoreLockObject *self = (CoreLockObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->lock = PyThread_allocate_lock();
    if (!self->lock) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void CoreLock_dealloc(CoreLockObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->lock) PyThread_free_lock(self->lock);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Whether the exiting thread may take the lock over: its holder is parked for good. */
static int takeover(CoreLockObject *self, unsigned long me) {
    if (!core_exit_thread() || self->count <= 0 || !core_parked(self->owner)) return 0;
    self->over_thread = me;
    self->over = 1;
    return 1;
}

static long long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

/* 1: taken; 0: not within timeout_us (-1: none); -1: an exception (a signal's handler raised). */
static int take(CoreLockObject *self, int blocking, long long timeout_us) {
    unsigned long me = PyThread_get_thread_ident();
    if (self->count > 0 && self->owner == me) {
        self->count++;
        return 1;
    }
    if (self->over > 0 && self->over_thread == me) {
        self->over++;
        return 1;
    }
    PyLockStatus got = PyThread_acquire_lock_timed(self->lock, 0, 0);
    if (got != PY_LOCK_ACQUIRED && blocking) {
        if (takeover(self, me)) return 1;
        const long long deadline = timeout_us < 0 ? -1 : now_us() + timeout_us; /* (as RLock's: the clock's) */
        for (;;) {
            long long wait = POLL_US;
            if (deadline >= 0) {
                long long left = deadline - now_us();
                if (left <= 0) break;
                if (left < wait) wait = left;
            }
            Py_BEGIN_ALLOW_THREADS
            got = PyThread_acquire_lock_timed(self->lock, wait, 0);
            Py_END_ALLOW_THREADS
            if (got == PY_LOCK_ACQUIRED) break;
            if (PyErr_CheckSignals() < 0) return -1; /* (as RLock's wait: nothing taken) */
            if (takeover(self, me)) return 1;
        }
    }
    if (got != PY_LOCK_ACQUIRED) return 0;
    self->owner = me;
    self->count = 1;
    return 1;
}

static PyObject *CoreLock_acquire(CoreLockObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|pd:acquire", names, &blocking, &timeout)) return NULL;
    if (!blocking && timeout != -1.0) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (!(timeout >= 0) && timeout != -1.0) { /* (NaN too) */
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    if (timeout > 1e12) { /* (RLock's bound is PY_TIMEOUT_MAX: about 292,000 years) */
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return NULL;
    }
    int r = take(self, blocking, timeout < 0 ? -1 : (long long)(timeout * 1e6));
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static PyObject *CoreLock_release(CoreLockObject *self, PyObject *unused) {
    (void)unused;
    unsigned long me = PyThread_get_thread_ident();
    if (self->over > 0 && self->over_thread == me) {
        self->over--;
        Py_RETURN_NONE;
    }
    if (self->count <= 0 || self->owner != me) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    if (--self->count == 0) {
        self->owner = 0;
        PyThread_release_lock(self->lock);
    }
    Py_RETURN_NONE;
}

static PyObject *CoreLock_enter(CoreLockObject *self, PyObject *unused) {
    (void)unused;
    int r = take(self, 1, -1);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

/* (fast-call: a with statement's exit passes three arguments, which no tuple need carry) */
static PyObject *CoreLock_exit(CoreLockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)args;
    (void)nargs;
    return CoreLock_release(self, NULL);
}

static PyMethodDef CoreLock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))CoreLock_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1): as threading.RLock's"},
    {"release", (PyCFunction)CoreLock_release, METH_NOARGS, "as threading.RLock's"},
    {"__enter__", (PyCFunction)CoreLock_enter, METH_NOARGS, "acquire()"},
    {"__exit__", (PyCFunction)(void (*)(void))CoreLock_exit, METH_FASTCALL, "release()"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot CoreLock_slots[] = {
    {Py_tp_new, CoreLock_new},
    {Py_tp_dealloc, CoreLock_dealloc},
    {Py_tp_methods, CoreLock_methods},
    {Py_tp_doc, "A reentrant lock held across calls into the core, which the exiting thread takes over from a "
                "thread parked for good at the exit"},
    {0, NULL},
};

PyType_Spec CoreLock_spec = {"cmlp._cmlp.CoreLock", sizeof(CoreLockObject), 0, Py_TPFLAGS_DEFAULT, CoreLock_slots};
