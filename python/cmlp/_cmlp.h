/* _cmlp.h - what the extension module's files share: the module's state, the one mapping from
 * cmlp_status to a Python exception, the macros that call into the core with the GIL released,
 * and the Model and Optimizer objects that the optimizer and the trainer hold.
 */
#ifndef CMLP_EXT_H
#define CMLP_EXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

/* NumPy's API table lives in _cmlp.c (which imports it); the other files use it from there. */
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL cmlp_ARRAY_API
#ifndef CMLP_EXT_MAIN
#define NO_IMPORT_ARRAY
#endif
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wundef"
#include <numpy/arrayobject.h>
#pragma GCC diagnostic pop

#include "cmlp.h"

typedef struct {
    PyObject *oom_error;
    PyTypeObject *model_type, *optim_type, *trainer_type;
} module_state;

static inline module_state *state_of(PyObject *module) { return (module_state *)PyModule_GetState(module); }

/* The process is exiting (core_enter refused another thread's call): never seen in Python, as
 * that thread parks at the call's end (core_gate) and never takes the GIL back. */
#define STATUS_EXITING ((cmlp_status)-2)
/* A model's computation (GEMMs through OpenBLAS, on cmlp's pool) runs between core_enter and
 * core_leave. At exit() (after Py_Finalize, which leaves threads that released the GIL
 * running) cmlp's handler refuses new ones and waits for those under way (30 s at most),
 * before the shared libraries' destructors run: OpenBLAS's unmaps its buffers and joins its
 * threads, and a GEMM of a daemon thread still going there crashes or hangs the exit. */
int core_enter(void);
void core_leave(void);
int core_exit_init(void);
/* Every call made with the GIL released (NOGIL_BEGIN .. NOGIL_END) is counted too, so that the
 * exit waits for it: a daemon thread may be copying to a GPU or freeing its memory when the
 * process ends. The wait is made first from a Python exit hook (_cmlp.wait_for_calls, registered
 * by the package), before any C exit handler: the CUDA runtime, loaded at the first use of a
 * GPU, registers its teardown after cmlp's handler, so it would run first. core_busy(1) counts a
 * call (the GIL held); core_gate(+1), once the GIL is let go, and core_gate(-1), at the call's
 * end, park a thread that is not the exiting one for good once the exit has begun (it raises
 * nothing; its refused model call, STATUS_EXITING, is never seen). */
void core_busy(int delta);
void core_gate(int delta);
/* Whether thread `id` (its Python ident) is parked for good; whether the caller runs the exit. */
int core_parked(unsigned long id);
int core_exit_thread(void);

/* This module's own status: a model lost to fork (ModelObject.lost). */
#define STATUS_LOST ((cmlp_status)-1)
#define LOST_TEXT                                                                                              \
    "this model, its optimizer and its trainer cannot be used in this process: another thread was using "     \
    "them when the process was forked, and that thread's call never finishes in the child, so their state "   \
    "here is incomplete (fork while no thread uses them, or start processes with 'spawn')"

/* Sets the Python exception for status s and returns NULL: a ValueError for bad input, an
 * OutOfMemoryError, or a RuntimeError (a device, a call out of order, a bug). Its text says what
 * happened, as torch's do (user_error); only a bug's (CMLP_ERR_INTERNAL) also says where, with
 * cmlp_last_error's "file:line: ". LOST_TEXT for a model lost in a fork. */
PyObject *raise_status(module_state *ms, cmlp_status s);
/* msg (UTF-8, perhaps cut inside a character) as an exception of type `type`. */
void set_error_text(PyObject *type, const char *msg);
/* cmlp_last_error()'s text without its "file.c:line: " prefix. */
const char *user_error(void);

/* The number of the calling Python stack for the allocators' history, 0 when none is kept
 * (_cmlp_stacks.c); stacks_init makes its tables, at the module's start. */
int64_t stack_number(void);
int stacks_init(void);

/* The GIL released around a call into the core, and the thread's current CUDA context put back
 * after it (cmlp_cuda_ctx_save), as torch's device guards put back the current device. */
#define NOGIL_BEGIN                                                                                            \
    {                                                                                                          \
        void *cuctx_ = cmlp_cuda_ctx_save();                                                                   \
        core_busy(1);                                                                                          \
        Py_BEGIN_ALLOW_THREADS                                                                                 \
        core_gate(1);
#define NOGIL_END                                                                                              \
    core_gate(-1);                                                                                             \
    Py_END_ALLOW_THREADS                                                                                       \
    cmlp_cuda_ctx_restore(cuctx_);                                                                             \
    }

/* A call made with the GIL held that may use a GPU, with the same care for the caller's context. */
#define GUARDED(stmt)                                                                                          \
    do {                                                                                                       \
        void *gctx_ = cmlp_cuda_ctx_save();                                                                    \
        stmt;                                                                                                  \
        cmlp_cuda_ctx_restore(gctx_);                                                                          \
    } while (0)

/* A call into the core with the GIL released, noted with the caller's Python stack. */
#define CALL_CORE(stmt)                             \
    do {                                            \
        cmlp_memory_set_context(stack_number());    \
        NOGIL_BEGIN                                 \
        stmt;                                       \
        NOGIL_END                                   \
        cmlp_memory_set_context(0);                 \
    } while (0)

/* ---- the model object; its lock serialises every C call on the model, its optimizer and
 * its trainer (taken with the GIL released, so waiting never blocks other threads) ---- */

typedef struct ModelObject {
    PyObject_HEAD
    cmlp_model *m;
    PyThread_type_lock lock;
    module_state *ms;
    /* lost: another thread was inside a call on the model when this process was forked from
     * its parent; the call never ends here, so the model's state in this child is unusable */
    int lost;
    struct ModelObject *prev, *next; /* the live models (under the GIL), for after_fork_child */
} ModelObject;

/* st = call, under the model's lock with the GIL released; a model lost to fork (STATUS_LOST)
 * runs nothing. */
#define RUN_LOCKED(model, st, call)                          \
    do {                                                     \
        if ((model)->lost) {                                 \
            (st) = STATUS_LOST;                              \
            break;                                           \
        }                                                    \
        cmlp_memory_set_context(stack_number());             \
        NOGIL_BEGIN                                          \
        PyThread_acquire_lock((model)->lock, WAIT_LOCK);     \
        if (core_enter()) {                                  \
            (st) = call;                                     \
            core_leave();                                    \
        } else {                                             \
            (st) = STATUS_EXITING;                           \
        }                                                    \
        PyThread_release_lock((model)->lock);                \
        NOGIL_END                                            \
        cmlp_memory_set_context(0);                          \
    } while (0)

/* RUN_LOCKED for a call that only sets a value of the model's C objects (no memory, no device
 * work, no waiting): where the model's lock is free at once it is taken without letting the GIL
 * go, which would cost more than the call itself (a schedule's step sets the rate this way); else
 * (the lock busy, or the interpreter exiting) as RUN_LOCKED. */
#define RUN_LOCKED_BRIEF(model, st, call)                                              \
    do {                                                                               \
        if (!(model)->lost && PyThread_acquire_lock((model)->lock, NOWAIT_LOCK)) {     \
            int entered_ = core_enter();                                               \
            if (entered_) {                                                            \
                (st) = call;                                                           \
                core_leave();                                                          \
            }                                                                          \
            PyThread_release_lock((model)->lock);                                      \
            if (entered_) break;                                                       \
        }                                                                              \
        RUN_LOCKED(model, st, call);                                                   \
    } while (0)

#define RUN_LOCKED_VOID(model, call)                         \
    do {                                                     \
        if ((model)->lost) break;                            \
        cmlp_memory_set_context(stack_number());             \
        NOGIL_BEGIN                                          \
        PyThread_acquire_lock((model)->lock, WAIT_LOCK);     \
        if (core_enter()) {                                  \
            call;                                            \
            core_leave();                                    \
        }                                                    \
        PyThread_release_lock((model)->lock);                \
        NOGIL_END                                            \
        cmlp_memory_set_context(0);                          \
    } while (0)

typedef struct {
    PyObject_HEAD
    cmlp_optim *o;
    ModelObject *model; /* strong reference: the optimizer points into it */
} OptimObject;

/* Arguments (_cmlp.c): each fails with the Python exception set (NULL or -1). */
const char *c_text(PyObject *obj, const char *what);
PyObject *items_of(PyObject *obj, const char *msg);
/* A list of at most 16 request sizes into out (_cmlp_memory.c): its length, or -1 with an error. */
Py_ssize_t request_list(PyObject *list, int64_t *out);
int parse_sizes(PyObject *obj, int sizes[CMLP_MAX_LAYERS + 1], int *n);
int parse_device(module_state *ms, PyObject *obj, cmlp_device *out);
PyObject *device_str(cmlp_device d);

/* The objects' checks (_cmlp_model.c, _cmlp_optim.c), and of the arrays given to a model. */
int model_ready(ModelObject *self);
int optim_ready(OptimObject *self);
int as_data(PyObject *x, PyObject *y, int64_t features, float mean, float std, cmlp_data *out);
int as_flat(PyObject *obj, int64_t n, const float **out);

/* Each file's types and module functions, put together by module_exec. */
extern PyType_Spec Model_spec, Optim_spec, Trainer_spec, CoreLock_spec;
extern PyMethodDef cmlp_py_model_methods[], cmlp_py_memory_methods[], cmlp_py_stack_methods[],
    cmlp_py_dist_methods[];

#endif
