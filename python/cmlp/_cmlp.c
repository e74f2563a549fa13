/* _cmlp.c - the CPython extension: thin handles over the C API (Model, Optimizer, Trainer),
 * the memory functions, and the one place where a cmlp_status becomes a Python exception.
 * Arrays arrive already converted by the Python layer and are checked again here, so no call
 * can crash the interpreter. The GIL is released around every call that computes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL cmlp_ARRAY_API
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wundef"
#include <numpy/arrayobject.h>
#pragma GCC diagnostic pop

#include "cmlp.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyObject *oom_error;
    PyTypeObject *model_type, *optim_type, *trainer_type;
} module_state;

static module_state *state_of(PyObject *module) { return (module_state *)PyModule_GetState(module); }

/* ---- errors: the one mapping from cmlp_status to Python ---- */

/* This module's own status: a model lost to fork (ModelObject.lost). */
#define STATUS_LOST ((cmlp_status)-1)
#define LOST_TEXT                                                                                              \
    "this model, its optimizer and its trainer cannot be used in this process: another thread was using "     \
    "them when the process was forked, and that thread's call never finishes in the child, so their state "   \
    "here is incomplete (fork while no thread uses them, or start processes with 'spawn')"

static PyObject *raise_status(module_state *ms, cmlp_status s) {
    const char *msg = cmlp_last_error();
    if (s == STATUS_LOST) msg = LOST_TEXT;
    switch (s) {
    case CMLP_ERR_INVALID:
    case CMLP_ERR_NONFINITE: PyErr_SetString(PyExc_ValueError, msg); break;
    case CMLP_ERR_OOM: PyErr_SetString(ms->oom_error, msg); break;
    default: PyErr_SetString(PyExc_RuntimeError, msg); break;
    }
    return NULL;
}

/* ---- the Python stack of a call into the core, noted by the allocators that record their
 * history with context (cmlp_memory_set_context). A stack is stored once, as a tuple (code,
 * line, code, line, ...) from the innermost frame out, and known by its number. It is found by a
 * hash of its code objects' addresses and instruction offsets (a stored code object stays alive,
 * so its address names it), each candidate compared in full; the line numbers, which take a walk
 * of the code's line table, are computed only for a stack seen for the first time. ---- */

#define MAX_STACK 64

static int capture_stacks;  /* while some allocator keeps contexts */
static PyObject *stack_ids;  /* {hash (the next one on a collision): number} */
static PyObject *stack_list; /* [stack of number 1, stack of number 2, ...] */
static PyObject *stack_where; /* [the instruction offsets of stack 1 (bytes of ints), ...] */

typedef struct {
    PyCodeObject *code;
    int where; /* the instruction offset (before 3.11: the line) */
    PyFrameObject *frame;
} frame_ref;

static int frame_where(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else
    return PyFrame_GetLineNumber(f);
#endif
}

static int same_stack(Py_ssize_t k, const frame_ref *fr, Py_ssize_t n) {
    PyObject *codes = PyList_GET_ITEM(stack_list, k), *where = PyList_GET_ITEM(stack_where, k);
    if (PyTuple_GET_SIZE(codes) != 2 * n || PyBytes_GET_SIZE(where) != n * (Py_ssize_t)sizeof(int)) return 0;
    const int *w = (const int *)PyBytes_AS_STRING(where);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyTuple_GET_ITEM(codes, 2 * i) != (PyObject *)fr[i].code || w[i] != fr[i].where) return 0;
    return 1;
}

/* Stores a new stack; its number, or 0. */
static int64_t store_stack(PyObject *key, const frame_ref *fr, Py_ssize_t n) {
    PyObject *t = PyTuple_New(2 * n);
    for (Py_ssize_t i = 0; t && i < n; i++) {
        PyObject *line = PyLong_FromLong(PyFrame_GetLineNumber(fr[i].frame));
        if (!line) {
            Py_CLEAR(t);
            break;
        }
        Py_INCREF(fr[i].code);
        PyTuple_SET_ITEM(t, 2 * i, (PyObject *)fr[i].code);
        PyTuple_SET_ITEM(t, 2 * i + 1, line);
    }
    PyObject *where = t ? PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int)) : NULL;
    for (Py_ssize_t i = 0; where && i < n; i++) ((int *)PyBytes_AS_STRING(where))[i] = fr[i].where;
    int64_t number = 0;
    if (where && PyList_Append(stack_where, where) == 0) {
        Py_ssize_t len = PyList_GET_SIZE(stack_where);
        if (PyList_Append(stack_list, t) == 0) {
            PyObject *v = PyLong_FromSsize_t(len);
            if (v && PyDict_SetItem(stack_ids, key, v) == 0) number = len;
            Py_XDECREF(v);
        } else {
            PyList_SetSlice(stack_where, len - 1, len, NULL); /* the two lists stay in step */
        }
    }
    Py_XDECREF(where);
    Py_XDECREF(t);
    return number;
}

/* The number of the calling Python stack; 0 when not capturing or on any failure (a context is
 * a help, never a reason to fail). */
static int64_t stack_number(void) {
    if (!capture_stacks || !stack_ids) return 0;
    PyObject *err_type, *err_value, *err_tb; /* a deallocator may run while an exception is set */
    PyErr_Fetch(&err_type, &err_value, &err_tb);
    frame_ref fr[MAX_STACK];
    Py_ssize_t n = 0;
    uint64_t h = 0xcbf29ce484222325ull;
    PyFrameObject *f = PyEval_GetFrame();
    Py_XINCREF(f);
    while (f && n < MAX_STACK) { /* each frame held (a reference) until the end */
        fr[n] = (frame_ref){PyFrame_GetCode(f), frame_where(f), f};
        h = (h ^ (uint64_t)(uintptr_t)fr[n].code) * 0x100000001b3ull;
        h = (h ^ (uint64_t)(uint32_t)fr[n].where) * 0x100000001b3ull;
        n++;
        f = PyFrame_GetBack(f);
    }
    Py_XDECREF(f);
    int64_t number = 0;
    for (uint64_t probe = h;; probe++) {
        PyObject *key = PyLong_FromUnsignedLongLong(probe);
        PyObject *known = key ? PyDict_GetItemWithError(stack_ids, key) : NULL;
        if (known) {
            int64_t k = PyLong_AsLongLong(known);
            if (k >= 1 && k <= PyList_GET_SIZE(stack_list) && same_stack((Py_ssize_t)k - 1, fr, n)) {
                number = k;
                Py_DECREF(key);
                break;
            }
            Py_DECREF(key);
            continue; /* a collision: the next key */
        }
        if (key && !PyErr_Occurred()) number = store_stack(key, fr, n);
        Py_XDECREF(key);
        break;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(fr[i].code);
        Py_DECREF(fr[i].frame);
    }
    PyErr_Restore(err_type, err_value, err_tb); /* drops any error of ours */
    return number;
}

/* The GIL released around a call into the core, and the thread's current CUDA context put back
 * after it (cmlp_cuda_ctx_save), as torch's device guards put back the current device. */
#define NOGIL_BEGIN                                                                                            \
    {                                                                                                          \
        void *cuctx_ = cmlp_cuda_ctx_save();                                                                   \
        Py_BEGIN_ALLOW_THREADS
#define NOGIL_END                                                                                              \
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

static ModelObject *live_models;

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
        (st) = call;                                         \
        PyThread_release_lock((model)->lock);                \
        NOGIL_END                                            \
        cmlp_memory_set_context(0);                          \
    } while (0)

#define RUN_LOCKED_VOID(model, call)                         \
    do {                                                     \
        if ((model)->lost) break;                            \
        cmlp_memory_set_context(stack_number());             \
        NOGIL_BEGIN                                          \
        PyThread_acquire_lock((model)->lock, WAIT_LOCK);     \
        call;                                                \
        PyThread_release_lock((model)->lock);                \
        NOGIL_END                                            \
        cmlp_memory_set_context(0);                          \
    } while (0)

/* The UTF-8 text of str obj, refused (ValueError naming `what`) when it holds a NUL, which C
 * would read as its end. */
static const char *c_text(PyObject *obj, const char *what) {
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &len);
    if (s && strlen(s) != (size_t)len) {
        PyErr_Format(PyExc_ValueError, "%s must not contain a NUL character, got %R", what, obj);
        return NULL;
    }
    return s;
}

/* A tuple of the items of a sequence (a new reference), or NULL with a TypeError saying msg. Items
 * are read from it: a list (PySequence_Fast's own result) would lend them, and the conversion of
 * one (its __index__ or __float__) could change the list under the loop. */
static PyObject *items_of(PyObject *obj, const char *msg) {
    PyObject *fast = PySequence_Fast(obj, msg);
    if (!fast) return NULL;
    PyObject *tuple = PySequence_Tuple(fast);
    Py_DECREF(fast);
    return tuple;
}

/* Layer sizes from a sequence of ints into sizes[0..*n): an int that C's int cannot hold is
 * refused here, naming it; the range check proper is the C core's. */
static int parse_sizes(PyObject *obj, int sizes[CMLP_MAX_LAYERS + 1], int *n) {
    PyObject *seq = items_of(obj, "layer sizes must be a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > CMLP_MAX_LAYERS + 1) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "at most %d layer sizes are supported, got %zd", CMLP_MAX_LAYERS + 1, len);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (overflow || v < 1 || v > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "layer_sizes[%zd] = %R: every size must be >= 1 and fit in a C int", i,
                         item);
            Py_DECREF(seq);
            return -1;
        }
        sizes[i] = (int)v;
    }
    Py_DECREF(seq);
    *n = (int)len;
    return 0;
}

static int parse_device(module_state *ms, PyObject *obj, cmlp_device *out) {
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "device must be a str such as \"cpu\" or \"cuda:0\", got %R", obj);
        return -1;
    }
    const char *s = c_text(obj, "device");
    if (!s) return -1;
    cmlp_status st = cmlp_device_parse(s, out);
    if (st != CMLP_OK) {
        raise_status(ms, st);
        return -1;
    }
    return 0;
}

static PyObject *device_str(cmlp_device d) {
    if (d.type == CMLP_DEVICE_CPU) return PyUnicode_FromString("cpu");
    return PyUnicode_FromFormat("cuda:%d", d.index);
}

static int Model_init(ModelObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"sizes", "device", "seed", NULL};
    PyObject *sizes_obj, *dev_obj;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOK", kwlist, &sizes_obj, &dev_obj, &seed)) return -1;
    if (self->m) {
        PyErr_SetString(PyExc_RuntimeError, "Model is already initialised");
        return -1;
    }
    cmlp_device dev;
    if (parse_device(self->ms, dev_obj, &dev) < 0) return -1;
    int sizes[CMLP_MAX_LAYERS + 1], n;
    if (parse_sizes(sizes_obj, sizes, &n) < 0) return -1;
    cmlp_status st;
    cmlp_model *m = NULL;
    CALL_CORE(st = cmlp_model_init(&m, sizes, n, dev, seed));
    if (st != CMLP_OK) {
        raise_status(self->ms, st);
        return -1;
    }
    self->m = m;
    return 0;
}

static PyObject *Model_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    (void)args;
    (void)kw;
    ModelObject *self = (ModelObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->lock = PyThread_allocate_lock();
    PyObject *mod = PyType_GetModule(type);
    self->ms = mod ? state_of(mod) : NULL;
    if (!self->lock || !self->ms) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->next = live_models;
    if (live_models) live_models->prev = self;
    live_models = self;
    return (PyObject *)self;
}

static void Model_dealloc(ModelObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->prev) self->prev->next = self->next;
    else if (live_models == self) live_models = self->next;
    if (self->next) self->next->prev = self->prev;
    if (!self->lost) { /* a lost model's state is left as the lost call left it */
        cmlp_memory_set_context(stack_number());
        GUARDED(cmlp_model_free(self->m));
        cmlp_memory_set_context(0);
    }
    if (self->lock) PyThread_free_lock(self->lock);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* In a child just forked (os.register_at_fork): a model whose lock is held was inside a call on
 * a thread that the child does not have. Its lock never comes free here: the model is marked
 * lost, so that calls on it (and its optimizer's and trainer's) fail instead of waiting for ever. */
static PyObject *mod_after_fork_child(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    for (ModelObject *m = live_models; m; m = m->next) {
        if (PyThread_acquire_lock(m->lock, NOWAIT_LOCK)) PyThread_release_lock(m->lock);
        else m->lost = 1; /* never taken again: every call checks lost first */
    }
    Py_RETURN_NONE;
}

static int model_made(ModelObject *self) {
    if (!self->m) {
        PyErr_SetString(PyExc_RuntimeError, "Model is not initialised");
        return -1;
    }
    return 0;
}

/* Made, and not lost to fork (a lost model's sizes and device still answer: model_made). */
static int model_ready(ModelObject *self) {
    if (model_made(self) < 0) return -1;
    if (self->lost) {
        PyErr_SetString(PyExc_RuntimeError, LOST_TEXT);
        return -1;
    }
    return 0;
}

/* A C-contiguous, aligned [n, features] array of float32 or uint8 (the Python layer converts). */
static int as_data(PyObject *x, PyObject *y, int64_t features, float mean, float std, cmlp_data *out) {
    if (!PyArray_Check(x)) {
        PyErr_SetString(PyExc_TypeError, "x must be a numpy array");
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)x;
    int t = PyArray_TYPE(a);
    if (PyArray_NDIM(a) != 2 || !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) ||
        (t != NPY_FLOAT32 && t != NPY_UINT8)) {
        PyErr_SetString(PyExc_TypeError, "x must be a C-contiguous 2-D float32 or uint8 array");
        return -1;
    }
    if (PyArray_DIM(a, 1) != features) {
        PyErr_Format(PyExc_ValueError, "x has %zd features per sample; the model expects %lld",
                     (Py_ssize_t)PyArray_DIM(a, 1), (long long)features);
        return -1;
    }
    *out = (cmlp_data){.x = PyArray_DATA(a), .x_dtype = t == NPY_UINT8 ? CMLP_DTYPE_U8 : CMLP_DTYPE_F32,
                       .n = PyArray_DIM(a, 0), .mean = mean, .std = std};
    if (y && y != Py_None) {
        PyArrayObject *b = (PyArrayObject *)y;
        if (!PyArray_Check(y) || PyArray_NDIM(b) != 1 || PyArray_TYPE(b) != NPY_INT32 ||
            !PyArray_IS_C_CONTIGUOUS(b) || !PyArray_ISALIGNED(b)) {
            PyErr_SetString(PyExc_TypeError, "y must be a C-contiguous 1-D int32 array");
            return -1;
        }
        if (PyArray_DIM(b, 0) != out->n) {
            PyErr_Format(PyExc_ValueError, "y has %zd labels for %lld samples", (Py_ssize_t)PyArray_DIM(b, 0),
                         (long long)out->n);
            return -1;
        }
        out->y = PyArray_DATA(b);
    }
    return 0;
}

static PyObject *Model_num_parameters(ModelObject *self, PyObject *unused) {
    (void)unused;
    if (model_made(self) < 0) return NULL;
    return PyLong_FromLongLong(cmlp_model_num_parameters(self->m));
}

static PyObject *Model_sizes(ModelObject *self, PyObject *unused) {
    (void)unused;
    if (model_made(self) < 0) return NULL;
    int L = cmlp_model_num_layers(self->m);
    PyObject *t = PyTuple_New(L + 1);
    if (!t) return NULL;
    for (int i = 0; i <= L; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLong(cmlp_model_size(self->m, i)));
    return t;
}

static PyObject *Model_device(ModelObject *self, PyObject *unused) {
    (void)unused;
    if (model_made(self) < 0) return NULL;
    return device_str(cmlp_model_device(self->m));
}

static PyObject *Model_offsets(ModelObject *self, PyObject *unused) {
    (void)unused;
    if (model_made(self) < 0) return NULL;
    int L = cmlp_model_num_layers(self->m);
    PyObject *lst = PyList_New(L);
    if (!lst) return NULL;
    for (int l = 0; l < L; l++) {
        PyObject *t = Py_BuildValue("(LL)", (long long)cmlp_model_weight_offset(self->m, l),
                                    (long long)cmlp_model_bias_offset(self->m, l));
        if (!t) {
            Py_DECREF(lst);
            return NULL;
        }
        PyList_SET_ITEM(lst, l, t);
    }
    return lst;
}

static PyObject *flat_out(ModelObject *self, int grads) {
    if (model_ready(self) < 0) return NULL;
    npy_intp n = (npy_intp)cmlp_model_num_parameters(self->m);
    PyObject *arr = PyArray_SimpleNew(1, &n, NPY_FLOAT32);
    if (!arr) return NULL;
    float *dst = PyArray_DATA((PyArrayObject *)arr);
    cmlp_status st;
    RUN_LOCKED(self, st, grads ? cmlp_model_get_grads(self->m, dst) : cmlp_model_get_params(self->m, dst));
    if (st != CMLP_OK) {
        Py_DECREF(arr);
        return raise_status(self->ms, st);
    }
    return arr;
}

static PyObject *Model_get_params(ModelObject *self, PyObject *unused) {
    (void)unused;
    return flat_out(self, 0);
}

static PyObject *Model_get_grads(ModelObject *self, PyObject *unused) {
    (void)unused;
    return flat_out(self, 1);
}

static int as_flat(PyObject *obj, int64_t n, const float **out) {
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!PyArray_Check(obj) || PyArray_NDIM(a) != 1 || PyArray_TYPE(a) != NPY_FLOAT32 ||
        !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || PyArray_DIM(a, 0) != n) {
        PyErr_Format(PyExc_TypeError, "expected a contiguous 1-D float32 array of %lld values", (long long)n);
        return -1;
    }
    *out = PyArray_DATA(a);
    return 0;
}

static PyObject *Model_set_params(ModelObject *self, PyObject *args) {
    PyObject *arg;
    int finite_only = 1; /* 0: as they are, NaN and inf too (a copy of another model's) */
    if (!PyArg_ParseTuple(args, "O|p", &arg, &finite_only)) return NULL;
    if (model_ready(self) < 0) return NULL;
    const float *src;
    if (as_flat(arg, cmlp_model_num_parameters(self->m), &src) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self, st, finite_only ? cmlp_model_set_params(self->m, src) : cmlp_model_copy_params(self->m, src));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Model_set_grads(ModelObject *self, PyObject *arg) {
    if (model_ready(self) < 0) return NULL;
    const float *src;
    if (as_flat(arg, cmlp_model_num_parameters(self->m), &src) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_set_grads(self->m, src));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Model_zero_grad(ModelObject *self, PyObject *unused) {
    (void)unused;
    if (model_ready(self) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_zero_grad(self->m));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Model_release_workspace(ModelObject *self, PyObject *unused) {
    (void)unused;
    if (model_ready(self) < 0) return NULL;
    RUN_LOCKED_VOID(self, cmlp_model_release_workspace(self->m));
    Py_RETURN_NONE;
}

static PyObject *Model_forward(ModelObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"x", "mean", "std", "chunk", NULL};
    PyObject *x;
    float mean = 0.5f, std = 0.5f;
    long long chunk = 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|ffL", kwlist, &x, &mean, &std, &chunk)) return NULL;
    if (model_ready(self) < 0) return NULL;
    cmlp_data d;
    if (as_data(x, NULL, cmlp_model_size(self->m, 0), mean, std, &d) < 0) return NULL;
    npy_intp dims[2] = {(npy_intp)d.n, cmlp_model_size(self->m, cmlp_model_num_layers(self->m))};
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (!out) return NULL;
    float *dst = PyArray_DATA((PyArrayObject *)out);
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_forward(self->m, &d, chunk, dst));
    if (st != CMLP_OK) {
        Py_DECREF(out);
        return raise_status(self->ms, st);
    }
    return out;
}

static PyObject *Model_evaluate(ModelObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"x", "y", "mean", "std", "chunk", NULL};
    PyObject *x, *y;
    float mean = 0.5f, std = 0.5f;
    long long chunk = 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|ffL", kwlist, &x, &y, &mean, &std, &chunk)) return NULL;
    if (model_ready(self) < 0) return NULL;
    cmlp_data d;
    if (as_data(x, y, cmlp_model_size(self->m, 0), mean, std, &d) < 0) return NULL;
    if (!d.y) {
        PyErr_SetString(PyExc_TypeError, "y must be an int32 array");
        return NULL;
    }
    double loss = 0.0;
    int64_t correct = 0;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_evaluate(self->m, &d, chunk, &loss, &correct));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    return Py_BuildValue("(dL)", loss, (long long)correct);
}

static PyObject *Model_forward_backward(ModelObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"x", "y", "grad_weight", "label_smoothing", "mean", "std", "amp", NULL};
    PyObject *x, *y;
    float gw = 1.0f, smoothing = 0.0f, mean = 0.5f, std = 0.5f;
    int amp = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOf|fffi", kwlist, &x, &y, &gw, &smoothing, &mean, &std, &amp))
        return NULL;
    if (model_ready(self) < 0) return NULL;
    cmlp_data d;
    if (as_data(x, y, cmlp_model_size(self->m, 0), mean, std, &d) < 0) return NULL;
    if (!d.y) {
        PyErr_SetString(PyExc_TypeError, "y must be an int32 array");
        return NULL;
    }
    double loss = 0.0;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_forward_backward(self->m, &d, gw, smoothing, (cmlp_amp)amp, &loss));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    return PyFloat_FromDouble(loss);
}

static PyObject *Model_unscale_grads(ModelObject *self, PyObject *arg) {
    if (model_ready(self) < 0) return NULL;
    double inv = PyFloat_AsDouble(arg);
    if (inv == -1.0 && PyErr_Occurred()) return NULL;
    int found = 0;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_unscale_grads(self->m, (float)inv, &found));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    return PyBool_FromLong(found);
}

static PyObject *Model_clip_grad_norm(ModelObject *self, PyObject *args) {
    double max_norm, norm_type;
    int error_if_nonfinite;
    if (!PyArg_ParseTuple(args, "ddp", &max_norm, &norm_type, &error_if_nonfinite)) return NULL;
    if (model_ready(self) < 0) return NULL;
    double total = 0.0;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_clip_grad_norm(self->m, max_norm, norm_type, error_if_nonfinite, &total));
    if (st == CMLP_ERR_NONFINITE) { /* torch raises RuntimeError here */
        PyErr_SetString(PyExc_RuntimeError, cmlp_last_error());
        return NULL;
    }
    if (st != CMLP_OK) return raise_status(self->ms, st);
    return PyFloat_FromDouble(total);
}

static PyObject *Model_grad_norm(ModelObject *self, PyObject *arg) {
    double norm_type = PyFloat_AsDouble(arg);
    if (norm_type == -1.0 && PyErr_Occurred()) return NULL;
    if (model_ready(self) < 0) return NULL;
    double total = 0.0;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_grad_norm(self->m, norm_type, &total));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    return PyFloat_FromDouble(total);
}

static PyObject *Model_clip_grads_with_norm(ModelObject *self, PyObject *args) {
    double max_norm, total_norm;
    if (!PyArg_ParseTuple(args, "dd", &max_norm, &total_norm)) return NULL;
    if (model_ready(self) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_clip_grads_with_norm(self->m, max_norm, total_norm));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Model_clip_grad_value(ModelObject *self, PyObject *arg) {
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred()) return NULL;
    if (model_ready(self) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_clip_grad_value(self->m, v));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Model_to(ModelObject *self, PyObject *arg) {
    if (model_ready(self) < 0) return NULL;
    cmlp_device d;
    if (parse_device(self->ms, arg, &d) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_to(self->m, d));
    if (st != CMLP_OK) return raise_status(self->ms, st);
    Py_RETURN_NONE;
}

static PyMethodDef Model_methods[] = {
    {"num_parameters", (PyCFunction)Model_num_parameters, METH_NOARGS, "number of parameters"},
    {"sizes", (PyCFunction)Model_sizes, METH_NOARGS, "layer sizes as a tuple"},
    {"device", (PyCFunction)Model_device, METH_NOARGS, "device string"},
    {"offsets", (PyCFunction)Model_offsets, METH_NOARGS, "[(weight_offset, bias_offset)] per layer"},
    {"get_params", (PyCFunction)Model_get_params, METH_NOARGS, "flat float32 copy of the parameters"},
    {"set_params", (PyCFunction)Model_set_params, METH_VARARGS,
     "replace parameters from a flat float32 array (finite_only=False: NaN and inf too)"},
    {"get_grads", (PyCFunction)Model_get_grads, METH_NOARGS, "flat float32 copy of the gradients"},
    {"set_grads", (PyCFunction)Model_set_grads, METH_O, "replaces the gradients (flat float32)"},
    {"zero_grad", (PyCFunction)Model_zero_grad, METH_NOARGS, "zero the gradient buffer"},
    {"release_workspace", (PyCFunction)Model_release_workspace, METH_NOARGS, "free the activation workspace"},
    {"forward", (PyCFunction)(void (*)(void))Model_forward, METH_VARARGS | METH_KEYWORDS, "logits"},
    {"evaluate", (PyCFunction)(void (*)(void))Model_evaluate, METH_VARARGS | METH_KEYWORDS, "(loss_sum, correct)"},
    {"forward_backward", (PyCFunction)(void (*)(void))Model_forward_backward, METH_VARARGS | METH_KEYWORDS,
     "loss sum; adds grad_weight * per-sample gradient sums"},
    {"to", (PyCFunction)Model_to, METH_O, "move to a device"},
    {"unscale_grads", (PyCFunction)Model_unscale_grads, METH_O,
     "multiply every gradient by inv_scale (a float32); True when any is inf or NaN"},
    {"clip_grad_norm", (PyCFunction)Model_clip_grad_norm, METH_VARARGS,
     "(max_norm, norm_type, error_if_nonfinite): scale the gradients to at most max_norm; their norm before"},
    {"grad_norm", (PyCFunction)Model_grad_norm, METH_O, "(norm_type): the gradients' norm, as clip_grad_norm's"},
    {"clip_grads_with_norm", (PyCFunction)Model_clip_grads_with_norm, METH_VARARGS,
     "(max_norm, total_norm): scale the gradients by min(1, max_norm / (total_norm + 1e-6))"},
    {"clip_grad_value", (PyCFunction)Model_clip_grad_value, METH_O, "clamp every gradient to [-v, v]"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Model_slots[] = {
    {Py_tp_new, Model_new},
    {Py_tp_init, Model_init},
    {Py_tp_dealloc, Model_dealloc},
    {Py_tp_methods, Model_methods},
    {Py_tp_doc, "C model handle (use cmlp.MLP)"},
    {0, NULL},
};

static PyType_Spec Model_spec = {"cmlp._cmlp.Model", sizeof(ModelObject), 0, Py_TPFLAGS_DEFAULT, Model_slots};

/* ---- optimizer ---- */

typedef struct {
    PyObject_HEAD
    cmlp_optim *o;
    ModelObject *model; /* strong reference: the optimizer points into it */
} OptimObject;

static int Optim_init(OptimObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"model",    "kind",     "lr",       "beta1",     "beta2",
                             "eps",      "weight_decay", "momentum", "dampening", "nesterov",
                             "decoupled_weight_decay", "amsgrad", "maximize", NULL};
    PyObject *model;
    const char *kind;
    cmlp_adam_config ac = cmlp_adam_defaults();
    cmlp_sgd_config sc = cmlp_sgd_defaults();
    double lr, wd = 0.0;
    int nesterov = 0, maximize = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Osd|ddddddpppp", kwlist, &model, &kind, &lr, &ac.beta1, &ac.beta2,
                                     &ac.eps, &wd, &sc.momentum, &sc.dampening, &nesterov,
                                     &ac.decoupled_weight_decay, &ac.amsgrad, &maximize))
        return -1;
    ac.maximize = sc.maximize = maximize;
    PyObject *mod = PyType_GetModule(Py_TYPE(self));
    module_state *ms = state_of(mod);
    if (!PyObject_TypeCheck(model, ms->model_type) || model_ready((ModelObject *)model) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "model must be a cmlp model");
        return -1;
    }
    if (self->o) {
        PyErr_SetString(PyExc_RuntimeError, "Optimizer is already initialised");
        return -1;
    }
    ModelObject *mo = (ModelObject *)model;
    cmlp_status st;
    if (strcmp(kind, "adam") == 0) {
        ac.lr = lr;
        ac.weight_decay = wd;
        GUARDED(st = cmlp_optim_init_adam(&self->o, mo->m, &ac));
    } else if (strcmp(kind, "sgd") == 0) {
        sc.lr = lr;
        sc.weight_decay = wd;
        sc.nesterov = nesterov;
        GUARDED(st = cmlp_optim_init_sgd(&self->o, mo->m, &sc));
    } else {
        PyErr_Format(PyExc_ValueError, "unknown optimizer kind \"%s\": expected \"adam\" or \"sgd\"", kind);
        return -1;
    }
    if (st != CMLP_OK) {
        raise_status(ms, st);
        return -1;
    }
    Py_INCREF(model);
    self->model = mo;
    return 0;
}

static void Optim_dealloc(OptimObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (!self->model || !self->model->lost) {
        cmlp_memory_set_context(stack_number());
        GUARDED(cmlp_optim_free(self->o));
        cmlp_memory_set_context(0);
    }
    Py_XDECREF(self->model);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int optim_ready(OptimObject *self) {
    if (!self->o) {
        PyErr_SetString(PyExc_RuntimeError, "Optimizer is not initialised");
        return -1;
    }
    return model_ready(self->model);
}

static PyObject *Optim_step(OptimObject *self, PyObject *unused) {
    (void)unused;
    if (optim_ready(self) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self->model, st, cmlp_optim_step(self->o));
    if (st != CMLP_OK) return raise_status(self->model->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Optim_get_lr(OptimObject *self, void *closure) {
    (void)closure;
    if (optim_ready(self) < 0) return NULL;
    return PyFloat_FromDouble(cmlp_optim_get_lr(self->o));
}

static PyObject *Optim_get_momentum(OptimObject *self, void *closure) {
    (void)closure;
    if (optim_ready(self) < 0) return NULL;
    return PyFloat_FromDouble(cmlp_optim_get_momentum(self->o));
}

static int Optim_set_momentum(OptimObject *self, PyObject *value, void *closure) {
    (void)closure;
    if (optim_ready(self) < 0) return -1;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "momentum cannot be deleted");
        return -1;
    }
    double m = PyFloat_AsDouble(value);
    if (m == -1.0 && PyErr_Occurred()) return -1;
    cmlp_status st;
    RUN_LOCKED(self->model, st, cmlp_optim_set_momentum(self->o, m));
    if (st != CMLP_OK) {
        raise_status(self->model->ms, st);
        return -1;
    }
    return 0;
}

static int Optim_set_lr(OptimObject *self, PyObject *value, void *closure) {
    (void)closure;
    if (optim_ready(self) < 0) return -1;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "lr cannot be deleted");
        return -1;
    }
    double lr = PyFloat_AsDouble(value);
    if (lr == -1.0 && PyErr_Occurred()) return -1;
    cmlp_status st;
    RUN_LOCKED(self->model, st, cmlp_optim_set_lr(self->o, lr));
    if (st != CMLP_OK) {
        raise_status(self->model->ms, st);
        return -1;
    }
    return 0;
}

/* The step count and every buffer, read together (under the model's lock, in one go: a trainer
 * stepping on another thread never gives a state of two steps); *changed when the optimizer no
 * longer keeps nb buffers (settings changed meanwhile: the caller reads again). */
static cmlp_status read_state(cmlp_optim *o, int nb, PyObject *bufs, int64_t *step, int *changed) {
    *changed = cmlp_optim_num_buffers(o) != nb;
    if (*changed) return CMLP_OK;
    for (int i = 0; i < nb; i++) { /* the arrays' data, made by the caller: no Python call here */
        cmlp_status st;
        GUARDED(st = cmlp_optim_get_buffer(o, i, PyArray_DATA((PyArrayObject *)PyList_GET_ITEM(bufs, i))));
        if (st != CMLP_OK) return st;
    }
    *step = cmlp_optim_get_step(o);
    return CMLP_OK;
}

static PyObject *Optim_get_state(OptimObject *self, PyObject *unused) {
    (void)unused;
    if (optim_ready(self) < 0) return NULL;
    npy_intp n = (npy_intp)cmlp_model_num_parameters(self->model->m);
    for (;;) {
        int nb = cmlp_optim_num_buffers(self->o), changed = 0;
        PyObject *bufs = PyList_New(nb);
        if (!bufs) return NULL;
        for (int i = 0; i < nb; i++) {
            PyObject *arr = PyArray_SimpleNew(1, &n, NPY_FLOAT32);
            if (!arr) {
                Py_DECREF(bufs);
                return NULL;
            }
            PyList_SET_ITEM(bufs, i, arr);
        }
        cmlp_status st;
        int64_t step = 0;
        RUN_LOCKED(self->model, st, read_state(self->o, nb, bufs, &step, &changed));
        if (st != CMLP_OK) {
            Py_DECREF(bufs);
            return raise_status(self->model->ms, st);
        }
        if (!changed) return Py_BuildValue("(LN)", (long long)step, bufs);
        Py_DECREF(bufs);
    }
}

static PyObject *Optim_set_state(OptimObject *self, PyObject *args) {
    long long step;
    PyObject *bufs;
    if (!PyArg_ParseTuple(args, "LO!", &step, &PyList_Type, &bufs)) return NULL;
    if (optim_ready(self) < 0) return NULL;
    Py_ssize_t nb = PyList_GET_SIZE(bufs);
    if (nb > 3) {
        PyErr_SetString(PyExc_ValueError, "optimizer state has at most 3 buffers");
        return NULL;
    }
    const float *ptrs[3] = {NULL, NULL, NULL};
    for (Py_ssize_t i = 0; i < nb; i++)
        if (as_flat(PyList_GET_ITEM(bufs, i), cmlp_model_num_parameters(self->model->m), &ptrs[i]) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self->model, st, cmlp_optim_set_state(self->o, step, (int)nb, ptrs));
    if (st != CMLP_OK) return raise_status(self->model->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Optim_configure(OptimObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"lr",       "beta1",    "beta2",     "eps",      "weight_decay",
                             "momentum", "dampening", "nesterov", "decoupled_weight_decay", "amsgrad",
                             "maximize", NULL};
    cmlp_adam_config ac = cmlp_adam_defaults();
    cmlp_sgd_config sc = cmlp_sgd_defaults();
    double lr, wd = 0.0;
    int nesterov = 0, maximize = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "d|ddddddpppp", kwlist, &lr, &ac.beta1, &ac.beta2, &ac.eps, &wd,
                                     &sc.momentum, &sc.dampening, &nesterov, &ac.decoupled_weight_decay,
                                     &ac.amsgrad, &maximize))
        return NULL;
    if (optim_ready(self) < 0) return NULL;
    ac.maximize = sc.maximize = maximize;
    ac.lr = sc.lr = lr;
    ac.weight_decay = sc.weight_decay = wd;
    sc.nesterov = nesterov;
    cmlp_status st;
    if (cmlp_optim_get_kind(self->o) == CMLP_OPTIM_ADAM) RUN_LOCKED(self->model, st, cmlp_optim_configure_adam(self->o, &ac));
    else RUN_LOCKED(self->model, st, cmlp_optim_configure_sgd(self->o, &sc));
    if (st != CMLP_OK) return raise_status(self->model->ms, st);
    Py_RETURN_NONE;
}

/* set_parts([(end, lr_scale, weight_decay[, momentum, beta2, eps, dampening, nesterov, maximize, amsgrad]),
 * ...]):
 * the parameter groups' parts (cmlp_optim_set_parts); a setting NaN (or -1), or left out, is the
 * optimizer's. */
#define PART_FORMAT "(end, lr_scale, weight_decay[, momentum, beta2, eps, dampening, nesterov, maximize, amsgrad])"
static PyObject *Optim_set_parts(OptimObject *self, PyObject *arg) {
    PyObject *seq = items_of(arg, "parts must be a sequence of " PART_FORMAT);
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > CMLP_MAX_PARTS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "at most %d parameter-group parts, got %zd", CMLP_MAX_PARTS, n);
        return NULL;
    }
    int64_t *ends = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *ends);
    double *scale = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *scale);
    double *wd = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *wd);
    cmlp_part_settings *own = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *own);
    PyObject *result = NULL;
    if (!ends || !scale || !wd || !own) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long end;
        cmlp_part_settings *s = &own[i];
        *s = cmlp_part_settings_inherit();
        PyObject *part = items_of(PySequence_Fast_GET_ITEM(seq, i), "a part is " PART_FORMAT);
        int ok = part && PyArg_ParseTuple(part, "Ldd|ddddiii;a part is " PART_FORMAT, &end, &scale[i], &wd[i],
                                          &s->momentum, &s->beta2, &s->eps, &s->dampening, &s->nesterov,
                                          &s->maximize, &s->amsgrad);
        Py_XDECREF(part);
        if (!ok) goto done;
        ends[i] = end;
    }
    if (optim_ready(self) < 0) goto done;
    cmlp_status st;
    RUN_LOCKED(self->model, st, cmlp_optim_set_parts(self->o, (int)n, ends, scale, wd, own));
    if (st != CMLP_OK) {
        raise_status(self->model->ms, st);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(ends);
    PyMem_Free(scale);
    PyMem_Free(wd);
    PyMem_Free(own);
    Py_DECREF(seq);
    return result;
}

static PyObject *Optim_to(OptimObject *self, PyObject *arg) {
    if (optim_ready(self) < 0) return NULL;
    cmlp_device d;
    if (parse_device(self->model->ms, arg, &d) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self->model, st, cmlp_optim_to(self->o, d));
    if (st != CMLP_OK) return raise_status(self->model->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Optim_shard(OptimObject *self, PyObject *arg) {
    if (optim_ready(self) < 0) return NULL;
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self->model, st, cmlp_optim_shard(self->o, on));
    if (st != CMLP_OK) return raise_status(self->model->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Optim_shards(OptimObject *self, PyObject *Py_UNUSED(unused)) {
    if (optim_ready(self) < 0) return NULL;
    int64_t lo, hi, chunk;
    int n = cmlp_optim_shards(self->o, &lo, &hi, &chunk);
    return Py_BuildValue("(iLLL)", n, (long long)lo, (long long)hi, (long long)chunk);
}

static PyObject *Optim_buffers_planned(OptimObject *self, PyObject *Py_UNUSED(unused)) {
    if (optim_ready(self) < 0) return NULL;
    return PyLong_FromLong(cmlp_optim_buffers_planned(self->o));
}

static PyMethodDef Optim_methods[] = {
    {"step", (PyCFunction)Optim_step, METH_NOARGS, "one update from the model's gradients"},
    {"get_state", (PyCFunction)Optim_get_state, METH_NOARGS, "(step, [flat float32 buffers])"},
    {"set_state", (PyCFunction)Optim_set_state, METH_VARARGS, "set_state(step, [buffers])"},
    {"to", (PyCFunction)Optim_to, METH_O, "move the state to a device (after the model)"},
    {"set_parts", (PyCFunction)Optim_set_parts, METH_O,
     "set_parts([" PART_FORMAT ", ...]): parameter groups' parts of the flat parameters (a setting NaN "
     "or -1, or left out: the optimizer's)"},
    {"shard", (PyCFunction)Optim_shard, METH_O, "keep state for this rank's part of the parameters only (or not)"},
    {"buffers_planned", (PyCFunction)Optim_buffers_planned, METH_NOARGS,
     "state buffers held once the next step is taken (what a plan counts)"},
    {"shards", (PyCFunction)Optim_shards, METH_NOARGS,
     "(parts, lo, hi, chunk): 0 parts when not sharded; rank r's part starts at r * chunk"},
    {"configure", (PyCFunction)(void (*)(void))Optim_configure, METH_VARARGS | METH_KEYWORDS,
     "replace the hyperparameters, keeping the state"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Optim_getset[] = {
    {"lr", (getter)Optim_get_lr, (setter)Optim_set_lr, "learning rate", NULL},
    {"momentum", (getter)Optim_get_momentum, (setter)Optim_set_momentum, "Adam's beta1 or SGD's momentum", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Optim_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Optim_init},
    {Py_tp_dealloc, Optim_dealloc},
    {Py_tp_methods, Optim_methods},
    {Py_tp_getset, Optim_getset},
    {Py_tp_doc, "C optimizer handle (use cmlp.optim)"},
    {0, NULL},
};

static PyType_Spec Optim_spec = {"cmlp._cmlp.Optimizer", sizeof(OptimObject), 0, Py_TPFLAGS_DEFAULT, Optim_slots};

/* ---- trainer ---- */

typedef struct {
    PyObject_HEAD
    cmlp_trainer *t;
    OptimObject *optim; /* strong: keeps the optimizer and its model alive */
    PyObject *epoch_x, *epoch_y; /* the arrays of the last epoch begun (until release_data) */
    long long run_steps;         /* the steps the last epoch_run took, also when it failed */
} TrainerObject;

static int Trainer_init(TrainerObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"optimizer", "batch_size", "accumulation_steps", "microbatch_size", "shuffle",
                             "seed", "label_smoothing", "amp", "auto_microbatch", "grow_interval", "recompute",
                             "max_grad_norm", NULL};
    PyObject *opt;
    long long batch = 32, accum = 1, micro = 0, grow = 0;
    int shuffle = 1, amp = 0, automb = 1, recompute = 0;
    unsigned long long seed = 0;
    float smoothing = 0.0f;
    double max_grad_norm = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OL|LLpKfipLpd", kwlist, &opt, &batch, &accum, &micro, &shuffle,
                                     &seed, &smoothing, &amp, &automb, &grow, &recompute, &max_grad_norm))
        return -1;
    module_state *ms = state_of(PyType_GetModule(Py_TYPE(self)));
    if (!PyObject_TypeCheck(opt, ms->optim_type) || optim_ready((OptimObject *)opt) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "optimizer must be a cmlp optimizer");
        return -1;
    }
    if (self->t) {
        PyErr_SetString(PyExc_RuntimeError, "Trainer is already initialised");
        return -1;
    }
    OptimObject *o = (OptimObject *)opt;
    cmlp_train_config c = {.batch_size = batch, .accumulation_steps = accum, .microbatch_size = micro,
                           .shuffle = shuffle, .seed = seed, .label_smoothing = smoothing, .amp = (cmlp_amp)amp,
                           .auto_microbatch = automb, .grow_interval = grow, .recompute = recompute,
                           .max_grad_norm = max_grad_norm};
    cmlp_status st;
    GUARDED(st = cmlp_trainer_init(&self->t, o->model->m, o->o, &c));
    if (st != CMLP_OK) {
        raise_status(ms, st);
        return -1;
    }
    Py_INCREF(opt);
    self->optim = o;
    return 0;
}

static void Trainer_dealloc(TrainerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (!self->optim || !self->optim->model || !self->optim->model->lost) {
        cmlp_memory_set_context(stack_number());
        GUARDED(cmlp_trainer_free(self->t));
        cmlp_memory_set_context(0);
    }
    Py_XDECREF(self->epoch_x);
    Py_XDECREF(self->epoch_y);
    Py_XDECREF(self->optim);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int trainer_ready(TrainerObject *self) {
    if (!self->t) {
        PyErr_SetString(PyExc_RuntimeError, "Trainer is not initialised");
        return -1;
    }
    return optim_ready(self->optim);
}

static PyObject *Trainer_step(TrainerObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"x", "y", "mean", "std", NULL};
    PyObject *x, *y;
    float mean = 0.5f, std = 0.5f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|ff", kwlist, &x, &y, &mean, &std)) return NULL;
    if (trainer_ready(self) < 0) return NULL;
    ModelObject *mo = self->optim->model;
    cmlp_data d;
    if (as_data(x, y, cmlp_model_size(mo->m, 0), mean, std, &d) < 0) return NULL;
    if (!d.y) {
        PyErr_SetString(PyExc_TypeError, "y must be an int32 array");
        return NULL;
    }
    double loss = 0.0;
    cmlp_status st;
    RUN_LOCKED(mo, st, cmlp_trainer_step(self->t, &d, &loss));
    if (st != CMLP_OK) return raise_status(mo->ms, st);
    return PyFloat_FromDouble(loss);
}

static PyObject *Trainer_epoch_begin(TrainerObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"x", "y", "mean", "std", "same_data", NULL};
    PyObject *x, *y;
    float mean = 0.5f, std = 0.5f;
    int same_data = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|ffp", kwlist, &x, &y, &mean, &std, &same_data)) return NULL;
    if (trainer_ready(self) < 0) return NULL;
    self->run_steps = 0; /* none of this epoch yet */
    ModelObject *mo = self->optim->model;
    cmlp_data d;
    if (as_data(x, y, cmlp_model_size(mo->m, 0), mean, std, &d) < 0) return NULL;
    if (!d.y) {
        PyErr_SetString(PyExc_TypeError, "y must be an int32 array");
        return NULL;
    }
    /* the promise holds only for the very arrays of the last epoch, which are still referenced
     * here (so no other array can have their addresses) */
    same_data = same_data && x == self->epoch_x && y == self->epoch_y;
    cmlp_epoch_state es;
    cmlp_status st;
    RUN_LOCKED(mo, st, cmlp_trainer_epoch_begin(self->t, &d, same_data, &es));
    if (st != CMLP_OK) return raise_status(mo->ms, st);
    Py_INCREF(x);
    Py_INCREF(y);
    Py_XSETREF(self->epoch_x, x);
    Py_XSETREF(self->epoch_y, y);
    return PyLong_FromLongLong(es.total_steps);
}

/* 1 to CMLP_MAX_RATES floats from a sequence into out; returns how many, or -1 with an exception. */
static Py_ssize_t floats_of(PyObject *obj, const char *what, double *out) {
    PyObject *seq = items_of(obj, "expected a sequence of floats");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > CMLP_MAX_RATES) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s must hold 1 to %d values, got %zd", what, CMLP_MAX_RATES, n);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        out[k] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, k));
        if (out[k] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return n;
}

/* A buffer of floats from a sequence of n * width numbers (the param groups' scales, or momenta,
 * of each step). */
static double *scales_of(PyObject *obj, Py_ssize_t n, Py_ssize_t width) {
    PyObject *seq = items_of(obj, "scales must be a sequence of numbers (each step's parts' scales or momenta)");
    if (!seq) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    double *out = NULL;
    if (width < 1 || m != n * width)
        PyErr_Format(PyExc_ValueError, "scales must hold %zd numbers (%zd steps of %zd parts), got %zd", n * width, n,
                     width, m);
    else if (!(out = PyMem_Malloc((size_t)m * sizeof *out)))
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; out && i < m; i++) {
        out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (out[i] == -1.0 && PyErr_Occurred()) {
            PyMem_Free(out);
            out = NULL;
        }
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *Trainer_epoch_run(TrainerObject *self, PyObject *args) {
    long long max_steps;
    PyObject *rates = Py_None, *momenta = Py_None, *scales_obj = Py_None, *part_momenta_obj = Py_None;
    if (!PyArg_ParseTuple(args, "L|OOOO", &max_steps, &rates, &momenta, &scales_obj, &part_momenta_obj)) return NULL;
    self->run_steps = 0;
    double lr[CMLP_MAX_RATES], mom[CMLP_MAX_RATES], *scales = NULL, *part_momenta = NULL;
    Py_ssize_t nlr = 0, nmom = 0;
    if (rates != Py_None && (nlr = floats_of(rates, "rates", lr)) < 0) return NULL; /* a step per rate */
    if (momenta != Py_None && (nmom = floats_of(momenta, "momenta", mom)) < 0) return NULL;
    if (nmom && nmom != nlr)
        return PyErr_Format(PyExc_ValueError, "momenta must hold one value per rate (%zd), got %zd", nlr, nmom);
    if (trainer_ready(self) < 0) return NULL;
    if (!self->epoch_x) {
        PyErr_SetString(PyExc_RuntimeError, "epoch_run called before epoch_begin");
        return NULL;
    }
    if (scales_obj != Py_None && !nlr) {
        PyErr_SetString(PyExc_ValueError, "scales come with a rate per step");
        return NULL;
    }
    if (part_momenta_obj != Py_None && scales_obj == Py_None) {
        PyErr_SetString(PyExc_ValueError, "the parts' momenta come with their scales");
        return NULL;
    }
    if (scales_obj != Py_None &&
        !(scales = scales_of(scales_obj, nlr, cmlp_trainer_optim_parts(self->t))))
        return NULL;
    if (part_momenta_obj != Py_None &&
        !(part_momenta = scales_of(part_momenta_obj, nlr, cmlp_trainer_optim_parts(self->t)))) {
        PyMem_Free(scales);
        return NULL;
    }
    ModelObject *mo = self->optim->model;
    cmlp_epoch_state es = {0};
    cmlp_status st;
    if (nlr)
        RUN_LOCKED(mo, st, cmlp_trainer_epoch_run_rates(self->t, lr, nmom ? mom : NULL, scales, part_momenta, nlr, &es));
    else RUN_LOCKED(mo, st, cmlp_trainer_epoch_run(self->t, max_steps, &es));
    PyMem_Free(scales);
    PyMem_Free(part_momenta);
    self->run_steps = (long long)es.steps;
    if (st != CMLP_OK) { /* a finished epoch keeps its arrays: the next may be on the same data */
        Py_CLEAR(self->epoch_x);
        Py_CLEAR(self->epoch_y);
    }
    if (st != CMLP_OK) return raise_status(mo->ms, st);
    return Py_BuildValue("(LLdOLdL)", (long long)es.steps, (long long)es.samples, es.loss_sum,
                         es.done ? Py_True : Py_False, (long long)es.skipped, es.grad_norm_sum,
                         (long long)es.grad_norm_steps);
}

static PyObject *Trainer_set_host_data(TrainerObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0 || trainer_ready(self) < 0) return NULL;
    ModelObject *mo = self->optim->model;
    RUN_LOCKED_VOID(mo, cmlp_trainer_set_host_data(self->t, on));
    Py_RETURN_NONE;
}

static PyObject *Trainer_data_resident(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    return PyBool_FromLong(cmlp_trainer_data_resident(self->t));
}

static PyObject *Trainer_release_data(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    ModelObject *mo = self->optim->model;
    RUN_LOCKED_VOID(mo, cmlp_trainer_release_data(self->t));
    Py_CLEAR(self->epoch_x);
    Py_CLEAR(self->epoch_y);
    Py_RETURN_NONE;
}

static PyObject *Trainer_set_scaler(TrainerObject *self, PyObject *args) {
    cmlp_scaler_state s = {0};
    long long interval = 1, tracker = 0;
    if (!PyArg_ParseTuple(args, "pdddLL", &s.enabled, &s.scale, &s.growth_factor, &s.backoff_factor, &interval,
                          &tracker))
        return NULL;
    if (trainer_ready(self) < 0) return NULL;
    s.growth_interval = interval;
    s.growth_tracker = tracker;
    cmlp_status st;
    RUN_LOCKED(self->optim->model, st, cmlp_trainer_set_scaler(self->t, &s));
    if (st != CMLP_OK) return raise_status(self->optim->model->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Trainer_get_scaler(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    cmlp_scaler_state s;
    cmlp_trainer_get_scaler(self->t, &s);
    return Py_BuildValue("(dL)", s.scale, (long long)s.growth_tracker);
}

static PyObject *Trainer_start_microbatch(TrainerObject *self, PyObject *arg) {
    if (trainer_ready(self) < 0) return NULL;
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    cmlp_status st;
    RUN_LOCKED(self->optim->model, st, cmlp_trainer_start_microbatch(self->t, v));
    if (st != CMLP_OK) return raise_status(self->optim->model->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Trainer_set_fit_call(TrainerObject *self, PyObject *args) {
    long long epochs, validation;
    int per_step;
    if (!PyArg_ParseTuple(args, "LLp", &epochs, &validation, &per_step)) return NULL;
    if (trainer_ready(self) < 0) return NULL;
    cmlp_trainer_set_fit_call(self->t, epochs, validation, per_step);
    Py_RETURN_NONE;
}

static PyObject *Trainer_oom_retries(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    return PyLong_FromLongLong(cmlp_trainer_oom_retries(self->t));
}

static PyObject *Trainer_last_grad_norm(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    double norm = 0.0;
    if (!cmlp_trainer_last_grad_norm(self->t, &norm)) Py_RETURN_NONE;
    return PyFloat_FromDouble(norm);
}

static PyObject *Trainer_skipped_steps(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    return PyLong_FromLongLong(cmlp_trainer_skipped_steps(self->t));
}

static PyObject *Trainer_get_micro(TrainerObject *self, void *closure) {
    (void)closure;
    if (trainer_ready(self) < 0) return NULL;
    return PyLong_FromLongLong(cmlp_trainer_microbatch_size(self->t));
}

static int Trainer_set_micro(TrainerObject *self, PyObject *value, void *closure) {
    (void)closure;
    if (trainer_ready(self) < 0) return -1;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "microbatch_size cannot be deleted");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    cmlp_status st;
    RUN_LOCKED(self->optim->model, st, cmlp_trainer_set_microbatch_size(self->t, v)); /* not mid-step */
    if (st != CMLP_OK) {
        raise_status(self->optim->model->ms, st);
        return -1;
    }
    return 0;
}

static PyObject *Trainer_set_distributed(TrainerObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0 || trainer_ready(self) < 0) return NULL;
    cmlp_status st;
    RUN_LOCKED(self->optim->model, st, cmlp_trainer_set_distributed(self->t, on));
    if (st != CMLP_OK) return raise_status(self->optim->model->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Trainer_run_steps(TrainerObject *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromLongLong(self->run_steps);
}

static PyObject *Trainer_microbatch_state(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    int64_t size, target, good, grown_from;
    cmlp_trainer_get_microbatch_state(self->t, &size, &target, &good, &grown_from);
    return Py_BuildValue("(LLLL)", (long long)size, (long long)target, (long long)good, (long long)grown_from);
}

static PyObject *Trainer_set_microbatch_state(TrainerObject *self, PyObject *args) {
    long long size, target, good, grown_from;
    if (!PyArg_ParseTuple(args, "LLLL", &size, &target, &good, &grown_from)) return NULL;
    if (trainer_ready(self) < 0) return NULL;
    ModelObject *mo = self->optim->model;
    cmlp_status st;
    RUN_LOCKED(mo, st, cmlp_trainer_set_microbatch_state(self->t, size, target, good, grown_from));
    if (st != CMLP_OK) return raise_status(mo->ms, st);
    Py_RETURN_NONE;
}

static PyObject *Trainer_get_epochs(TrainerObject *self, void *closure) {
    (void)closure;
    if (trainer_ready(self) < 0) return NULL;
    return PyLong_FromLongLong(cmlp_trainer_epochs(self->t));
}

static int Trainer_set_epochs(TrainerObject *self, PyObject *value, void *closure) {
    (void)closure;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "epochs cannot be deleted");
        return -1;
    }
    long long n = PyLong_AsLongLong(value);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (trainer_ready(self) < 0) return -1;
    ModelObject *mo = self->optim->model;
    cmlp_status st;
    RUN_LOCKED(mo, st, cmlp_trainer_set_epochs(self->t, n));
    if (st != CMLP_OK) {
        raise_status(mo->ms, st);
        return -1;
    }
    return 0;
}

static PyMethodDef Trainer_methods[] = {
    {"set_distributed", (PyCFunction)Trainer_set_distributed, METH_O, "data-parallel over the process group or not"},
    {"step", (PyCFunction)(void (*)(void))Trainer_step, METH_VARARGS | METH_KEYWORDS, "one optimizer step"},
    {"set_fit_call", (PyCFunction)Trainer_set_fit_call, METH_VARARGS,
     "(epochs, validation_samples or -1, per_step_schedule): what the ranks compare at each epoch's start"},
    {"epoch_begin", (PyCFunction)(void (*)(void))Trainer_epoch_begin, METH_VARARGS | METH_KEYWORDS,
     "validate and shuffle; returns the epoch's step count"},
    {"epoch_run", (PyCFunction)Trainer_epoch_run, METH_VARARGS,
     "(max_steps, rates=None, momenta=None, scales=None, part_momenta=None) -> (steps, samples, loss_sum, done, "
     "skipped, grad_norm_sum, grad_norm_steps); with rates (at most MAX_RATES), one step at each (and at each "
     "momentum; with scales, each step's parts' multiples of its rate, and with part_momenta their momenta, "
     "NaN: the part's own)"},
    {"release_data", (PyCFunction)Trainer_release_data, METH_NOARGS, "free the device copy of the data set"},
    {"set_host_data", (PyCFunction)Trainer_set_host_data, METH_O,
     "True: keep the data set in host memory (and free a device copy); False: copy it to the device"},
    {"data_resident", (PyCFunction)Trainer_data_resident, METH_NOARGS, "whether the data set is on the device"},
    {"set_scaler", (PyCFunction)Trainer_set_scaler, METH_VARARGS,
     "set_scaler(enabled, scale, growth_factor, backoff_factor, growth_interval, growth_tracker)"},
    {"get_scaler", (PyCFunction)Trainer_get_scaler, METH_NOARGS, "(scale, growth_tracker)"},
    {"skipped_steps", (PyCFunction)Trainer_skipped_steps, METH_NOARGS, "steps skipped for inf/NaN gradients"},
    {"last_grad_norm", (PyCFunction)Trainer_last_grad_norm, METH_NOARGS,
     "the last step's gradient norm before clipping (None without clipping)"},
    {"oom_retries", (PyCFunction)Trainer_oom_retries, METH_NOARGS, "steps retried with a smaller micro-batch"},
    {"start_microbatch", (PyCFunction)Trainer_start_microbatch, METH_O, "compute with a smaller micro-batch for now"},
    {"microbatch_state", (PyCFunction)Trainer_microbatch_state, METH_NOARGS, "(size, target, good_steps, grown_from)"},
    {"run_steps", (PyCFunction)Trainer_run_steps, METH_NOARGS, "the steps the last epoch_run took (failed or not)"},
    {"set_microbatch_state", (PyCFunction)Trainer_set_microbatch_state, METH_VARARGS,
     "set_microbatch_state(size, target, good_steps, grown_from)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Trainer_getset[] = {
    {"microbatch_size", (getter)Trainer_get_micro, (setter)Trainer_set_micro, "rows computed at once", NULL},
    {"epochs", (getter)Trainer_get_epochs, (setter)Trainer_set_epochs, "epochs begun (the next one's order)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Trainer_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Trainer_init},
    {Py_tp_dealloc, Trainer_dealloc},
    {Py_tp_methods, Trainer_methods},
    {Py_tp_getset, Trainer_getset},
    {Py_tp_doc, "C training loop handle (use cmlp.Trainer)"},
    {0, NULL},
};

static PyType_Spec Trainer_spec = {"cmlp._cmlp.Trainer", sizeof(TrainerObject), 0, Py_TPFLAGS_DEFAULT, Trainer_slots};

/* ---- memory ---- */

static const char *stat_names[CMLP_STAT_KIND_COUNT] = {
    "allocation", "allocated_bytes", "requested_bytes", "active", "active_bytes", "segment",
    "reserved_bytes", "inactive_split", "inactive_split_bytes", "oversize_allocations", "oversize_segments"};
static const char *pool_names[CMLP_POOL_COUNT] = {"all", "large_pool", "small_pool"};

static int put_int(PyObject *d, const char *key, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (!o) return -1;
    int r = PyDict_SetItemString(d, key, o);
    Py_DECREF(o);
    return r;
}

static int put_stat(PyObject *d, const char *prefix, const cmlp_stat *s) {
    char key[96];
    const char *metric[4] = {"current", "peak", "allocated", "freed"};
    long long v[4] = {s->current, s->peak, s->allocated, s->freed};
    for (int i = 0; i < 4; i++) {
        snprintf(key, sizeof key, "%s.%s", prefix, metric[i]);
        if (put_int(d, key, v[i]) < 0) return -1;
    }
    return 0;
}

static PyObject *mod_mem_get_info(PyObject *mod, PyObject *arg) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return NULL;
    int64_t free_bytes = -1, total = 0;
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_memory_get_info(d, &free_bytes, &total);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    return Py_BuildValue("(LL)", (long long)free_bytes, (long long)total);
}

static PyObject *mod_memory_stats(PyObject *mod, PyObject *arg) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return NULL;
    cmlp_memory_stats s;
    cmlp_status st;
    GUARDED(st = cmlp_memory_stats_get(d, &s));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    PyObject *dict = PyDict_New();
    if (!dict) return NULL;
    char prefix[64];
    for (int k = 0; k < CMLP_STAT_KIND_COUNT; k++) {
        int oversize = k == CMLP_STAT_OVERSIZE_ALLOCATIONS || k == CMLP_STAT_OVERSIZE_SEGMENTS;
        for (int p = 0; p < (oversize ? 1 : CMLP_POOL_COUNT); p++) {
            if (oversize) snprintf(prefix, sizeof prefix, "%s", stat_names[k]);
            else snprintf(prefix, sizeof prefix, "%s.%s", stat_names[k], pool_names[p]);
            if (put_stat(dict, prefix, &s.stat[k][p]) < 0) goto fail;
        }
    }
    if (put_int(dict, "num_alloc_retries", s.num_alloc_retries) < 0 || put_int(dict, "num_ooms", s.num_ooms) < 0 ||
        put_int(dict, "num_sync_all_streams", s.num_sync_all_streams) < 0 ||
        put_int(dict, "num_device_alloc", s.num_device_alloc) < 0 ||
        put_int(dict, "num_device_free", s.num_device_free) < 0 ||
        put_int(dict, "num_oom_rejections", 0) < 0 || /* torch's throw_on_cudamalloc_oom policy: not applied */
        put_int(dict, "max_split_size", s.max_split_size) < 0 || put_int(dict, "limit", s.limit) < 0 ||
        put_int(dict, "total_memory", s.total_memory) < 0 ||
        put_int(dict, "largest_free_block", s.largest_free_block) < 0 ||
        put_int(dict, "num_raw_alloc_calls", s.num_raw_alloc_calls) < 0)
        goto fail;
    return dict;
fail:
    Py_DECREF(dict);
    return NULL;
}

typedef cmlp_status (*device_fn)(cmlp_device);

static PyObject *call_device_fn(PyObject *mod, PyObject *arg, device_fn fn) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return NULL;
    cmlp_status st;
    NOGIL_BEGIN
    st = fn(d);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static PyObject *mod_reset_peak(PyObject *mod, PyObject *arg) { return call_device_fn(mod, arg, cmlp_memory_reset_peak); }
static PyObject *mod_empty_cache(PyObject *mod, PyObject *arg) { return call_device_fn(mod, arg, cmlp_memory_empty_cache); }
static PyObject *mod_reset_accumulated(PyObject *mod, PyObject *arg) {
    return call_device_fn(mod, arg, cmlp_memory_reset_accumulated);
}

static PyObject *mod_window_peak(PyObject *mod, PyObject *args) {
    PyObject *dev;
    int restart;
    if (!PyArg_ParseTuple(args, "Op", &dev, &restart)) return NULL;
    cmlp_device d;
    if (parse_device(state_of(mod), dev, &d) < 0) return NULL;
    int64_t peak = 0;
    cmlp_status st;
    GUARDED(st = cmlp_memory_window_peak(d, restart, &peak));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    return PyLong_FromLongLong(peak);
}

static PyObject *mod_cache_serves(PyObject *mod, PyObject *args) {
    PyObject *dev, *list;
    if (!PyArg_ParseTuple(args, "OO!", &dev, &PyList_Type, &list)) return NULL;
    cmlp_device d;
    if (parse_device(state_of(mod), dev, &d) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n > 16) {
        PyErr_Format(PyExc_ValueError, "at most 16 requests can be tried, got %zd", n);
        return NULL;
    }
    int64_t req[16];
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
        if (v == -1 && PyErr_Occurred()) return NULL;
        req[i] = v;
    }
    int served = 0;
    cmlp_status st;
    GUARDED(st = cmlp_memory_cache_serves(d, req, (int)n, &served));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    return PyBool_FromLong(served);
}

static PyObject *mod_set_memory_limit(PyObject *mod, PyObject *args) {
    PyObject *dev;
    long long limit;
    if (!PyArg_ParseTuple(args, "OL", &dev, &limit)) return NULL;
    cmlp_device d;
    if (parse_device(state_of(mod), dev, &d) < 0) return NULL;
    cmlp_status st;
    GUARDED(st = cmlp_memory_set_limit(d, limit));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static PyObject *mod_alloc(PyObject *mod, PyObject *args) {
    PyObject *dev;
    long long n;
    if (!PyArg_ParseTuple(args, "OL", &dev, &n)) return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %lld", n);
        return NULL;
    }
    cmlp_device d;
    if (parse_device(state_of(mod), dev, &d) < 0) return NULL;
    void *p = NULL;
    cmlp_status st;
    CALL_CORE(st = cmlp_memory_alloc(d, (size_t)n, &p));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    return PyLong_FromVoidPtr(p);
}

static PyObject *mod_free(PyObject *mod, PyObject *args) {
    PyObject *dev, *ptr;
    if (!PyArg_ParseTuple(args, "OO", &dev, &ptr)) return NULL;
    cmlp_device d;
    if (parse_device(state_of(mod), dev, &d) < 0) return NULL;
    void *p = PyLong_AsVoidPtr(ptr);
    if (!p && PyErr_Occurred()) return NULL;
    cmlp_memory_set_context(stack_number());
    cmlp_status st;
    GUARDED(st = cmlp_memory_free(d, p));
    cmlp_memory_set_context(0);
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

/* A block as the snapshot shows it; "what" and "context" become its frames in Python. */
static PyObject *block_dict(const cmlp_block_info *b) {
    return Py_BuildValue("{s:K,s:L,s:L,s:s,s:z,s:L}", "address", (unsigned long long)b->address, "size",
                         (long long)b->size, "requested_size", (long long)b->requested_size, "state",
                         b->allocated ? "active_allocated" : "inactive", "what", b->what, "context",
                         (long long)b->context);
}

static const char *const trace_actions[CMLP_TRACE_ACTION_COUNT] = {
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom", "snapshot",
};

/* The history as a list of tuples (action, addr, size, time_us, what, context, device_free). */
static PyObject *history_list(const cmlp_trace_entry *e, int64_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; list && i < n; i++) {
        int a = e[i].action >= 0 && e[i].action < CMLP_TRACE_ACTION_COUNT ? e[i].action : CMLP_TRACE_SNAPSHOT;
        PyObject *t = Py_BuildValue("(sKLLzLL)", trace_actions[a], (unsigned long long)e[i].addr, (long long)e[i].size,
                                    (long long)e[i].time_us, e[i].what, (long long)e[i].context,
                                    (long long)e[i].device_free);
        if (!t) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    return list;
}

static PyObject *segments_list(cmlp_device d, const cmlp_segment_info *segs, int64_t ns, const cmlp_block_info *blks);

static PyObject *mod_snapshot(PyObject *mod, PyObject *arg) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return NULL;
    cmlp_segment_info *segs = NULL;
    cmlp_block_info *blks = NULL;
    int64_t ns = 0, nb = 0;
    cmlp_status st;
    GUARDED(st = cmlp_memory_snapshot(d, &segs, &ns, &blks, &nb));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    PyObject *list = segments_list(d, segs, ns, blks);
    cmlp_memory_snapshot_free(segs, blks);
    return list;
}

/* (segments, history) at one instant. */
static PyObject *mod_snapshot_history(PyObject *mod, PyObject *arg) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return NULL;
    cmlp_segment_info *segs = NULL;
    cmlp_block_info *blks = NULL;
    cmlp_trace_entry *e = NULL;
    int64_t ns = 0, nb = 0, ne = 0;
    cmlp_status st;
    GUARDED(st = cmlp_memory_snapshot_history(d, &segs, &ns, &blks, &nb, &e, &ne));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    PyObject *list = segments_list(d, segs, ns, blks);
    cmlp_memory_snapshot_free(segs, blks);
    PyObject *hist = list ? history_list(e, ne) : NULL;
    cmlp_memory_history_free(e);
    if (!hist) {
        Py_XDECREF(list);
        return NULL;
    }
    return Py_BuildValue("(NN)", list, hist);
}

static PyObject *mod_record_history(PyObject *mod, PyObject *args) {
    PyObject *dev;
    int mode, context, clear;
    long long max_entries;
    unsigned int skip;
    if (!PyArg_ParseTuple(args, "OiiLIp", &dev, &mode, &context, &max_entries, &skip, &clear)) return NULL;
    cmlp_device d;
    if (parse_device(state_of(mod), dev, &d) < 0) return NULL;
    cmlp_status st;
    GUARDED(st = cmlp_memory_record_history(d, (cmlp_history_mode)mode, (cmlp_context_mode)context,
                                                (int64_t)max_entries, (uint32_t)skip, clear));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static PyObject *mod_capture_stacks(PyObject *mod, PyObject *arg) {
    (void)mod;
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    capture_stacks = on;
    Py_RETURN_NONE;
}

/* The frames of stack number n, innermost first: [(filename, line, name), ...]. */
static PyObject *mod_stack_frames(PyObject *mod, PyObject *arg) {
    (void)mod;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > PyList_GET_SIZE(stack_list)) return PyErr_Format(PyExc_ValueError, "no stack number %zd", n);
    PyObject *key = PyList_GET_ITEM(stack_list, n - 1);
    Py_ssize_t depth = PyTuple_GET_SIZE(key) / 2;
    PyObject *frames = PyList_New(depth);
    for (Py_ssize_t i = 0; frames && i < depth; i++) {
        PyObject *code = PyTuple_GET_ITEM(key, 2 * i);
        PyObject *file = PyObject_GetAttrString(code, "co_filename");
        PyObject *name = file ? PyObject_GetAttrString(code, "co_name") : NULL;
        PyObject *t = name ? PyTuple_Pack(3, file, PyTuple_GET_ITEM(key, 2 * i + 1), name) : NULL;
        Py_XDECREF(file);
        Py_XDECREF(name);
        if (!t) Py_CLEAR(frames);
        else PyList_SET_ITEM(frames, i, t);
    }
    return frames;
}

static PyObject *segments_list(cmlp_device d, const cmlp_segment_info *segs, int64_t ns, const cmlp_block_info *blks) {
    PyObject *list = PyList_New((Py_ssize_t)ns), *dev = device_str(d);
    for (int64_t i = 0; list && dev && i < ns; i++) {
        const cmlp_segment_info *s = &segs[i];
        PyObject *blocks = PyList_New((Py_ssize_t)s->nblocks);
        for (int64_t j = 0; blocks && j < s->nblocks; j++) {
            PyObject *b = block_dict(&blks[s->first_block + j]);
            if (!b) Py_CLEAR(blocks);
            else PyList_SET_ITEM(blocks, (Py_ssize_t)j, b);
        }
        PyObject *seg = blocks ? Py_BuildValue("{s:K,s:O,s:L,s:L,s:L,s:L,s:s,s:O,s:N}", "address",
                                               (unsigned long long)s->address, "device", dev, "total_size",
                                               (long long)s->total_size, "allocated_size", (long long)s->allocated_size,
                                               "active_size", (long long)s->active_size, "requested_size",
                                               (long long)s->requested_size, "segment_type",
                                               s->pool == CMLP_POOL_SMALL ? "small" : "large", "expandable",
                                               s->expandable ? Py_True : Py_False, "blocks", blocks)
                              : NULL;
        if (!seg) {
            Py_XDECREF(blocks);
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, seg);
    }
    Py_XDECREF(dev);
    return list;
}

static PyObject *mod_configure(PyObject *mod, PyObject *arg) {
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "the allocator configuration must be a str such as \"max_split_size_mb:128\"");
        return NULL;
    }
    const char *s = c_text(arg, "the allocator configuration");
    if (!s) return NULL;
    cmlp_status st;
    GUARDED(st = cmlp_memory_configure(s));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

/* note_env("VAR=value" or None): the environment's settings applied at import (cmlp_memory_note_env). */
static PyObject *mod_note_env(PyObject *mod, PyObject *arg) {
    const char *s = NULL;
    if (arg != Py_None && !(s = c_text(arg, "the environment's settings"))) return NULL;
    cmlp_status st = cmlp_memory_note_env(s);
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static PyObject *mod_get_settings(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    cmlp_alloc_settings c;
    cmlp_memory_get_settings(&c);
    PyObject *div = PyList_New(CMLP_ROUNDUP_INTERVALS);
    if (!div) return NULL;
    for (int i = 0; i < CMLP_ROUNDUP_INTERVALS; i++) PyList_SET_ITEM(div, i, PyLong_FromLong(c.roundup_power2_divisions[i]));
    return Py_BuildValue("{s:L,s:d,s:N,s:O,s:L,s:L,s:d,s:O}", "max_split_size", (long long)c.max_split_size,
                         "garbage_collection_threshold", c.garbage_collection_threshold, "roundup_power2_divisions", div,
                         "expandable_segments", c.expandable_segments ? Py_True : Py_False, "large_segment_size",
                         (long long)c.large_segment_size, "max_non_split_rounding", (long long)c.max_non_split_rounding,
                         "per_process_memory_fraction", c.per_process_memory_fraction, "backend_async",
                         c.backend_async ? Py_True : Py_False);
}

static PyObject *mod_validate(PyObject *mod, PyObject *arg) {
    return call_device_fn(mod, arg, cmlp_memory_validate);
}

static PyObject *mod_fail_raw_alloc(PyObject *mod, PyObject *args) {
    PyObject *dev;
    long long k;
    if (!PyArg_ParseTuple(args, "OL", &dev, &k)) return NULL;
    cmlp_device d;
    if (parse_device(state_of(mod), dev, &d) < 0) return NULL;
    cmlp_status st;
    GUARDED(st = cmlp_memory_fail_raw_alloc(d, k));
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static int half_dtype(PyObject *name, cmlp_dtype *out) {
    const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (s && strcmp(s, "fp16") == 0) *out = CMLP_DTYPE_F16;
    else if (s && strcmp(s, "bf16") == 0) *out = CMLP_DTYPE_BF16;
    else {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "dtype must be 'fp16' or 'bf16', got %R", name);
        return -1;
    }
    return 0;
}

/* to_half(float32 array, dtype) -> uint16 array of the same shape, and back. */
static PyObject *convert(PyObject *args, int to_half) {
    PyObject *obj, *name;
    if (!PyArg_ParseTuple(args, "OO", &obj, &name)) return NULL;
    cmlp_dtype dt;
    if (half_dtype(name, &dt) < 0) return NULL;
    PyArrayObject *src = (PyArrayObject *)PyArray_FROM_OTF(obj, to_half ? NPY_FLOAT32 : NPY_UINT16,
                                                           NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!src) return NULL;
    PyObject *dst = PyArray_SimpleNew(PyArray_NDIM(src), PyArray_DIMS(src), to_half ? NPY_UINT16 : NPY_FLOAT32);
    if (!dst) {
        Py_DECREF(src);
        return NULL;
    }
    int64_t n = (int64_t)PyArray_SIZE(src);
    void *d = PyArray_DATA((PyArrayObject *)dst), *s = PyArray_DATA(src);
    cmlp_status st;
    NOGIL_BEGIN
    st = to_half ? cmlp_convert_to_half(d, s, n, dt) : cmlp_convert_from_half(d, s, n, dt);
    NOGIL_END
    Py_DECREF(src);
    if (st != CMLP_OK) {
        Py_DECREF(dst);
        PyErr_SetString(PyExc_ValueError, cmlp_last_error());
        return NULL;
    }
    return dst;
}

static PyObject *mod_to_half(PyObject *mod, PyObject *args) {
    (void)mod;
    return convert(args, 1);
}

static PyObject *mod_from_half(PyObject *mod, PyObject *args) {
    (void)mod;
    return convert(args, 0);
}

static PyObject *mod_plan(PyObject *mod, PyObject *args) {
    PyObject *sizes_obj, *dev_obj;
    long long batch, eval_rows, data_rows, row_bytes, epochs;
    int nbuf, shards, parts, amp, recompute, scaling, solo, shuffled, eval_staged;
    if (!PyArg_ParseTuple(args, "OLiiiipppLLpLpLO", &sizes_obj, &batch, &nbuf, &shards, &parts, &amp, &recompute,
                          &scaling, &solo, &data_rows, &row_bytes, &shuffled, &eval_rows, &eval_staged, &epochs,
                          &dev_obj))
        return NULL;
    cmlp_device d;
    if (parse_device(state_of(mod), dev_obj, &d) < 0) return NULL;
    int sizes[CMLP_MAX_LAYERS + 1], n;
    if (parse_sizes(sizes_obj, sizes, &n) < 0) return NULL;
    cmlp_plan p;
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_plan_compute(sizes, n, batch, nbuf, shards, parts, (cmlp_amp)amp, recompute, scaling, solo, data_rows,
                           row_bytes, shuffled, eval_rows, eval_staged, epochs, d, &p);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    static const char *const held_names[] = {"model", "optimizer_state", "half_weights", "data", "step"};
    PyObject *requests = PyList_New(p.nrequests);
    if (!requests) return NULL;
    for (int i = 0; i < p.nrequests; i++) {
        PyObject *r = Py_BuildValue("(sL)", held_names[p.request_held[i]], (long long)p.request_bytes[i]);
        if (!r) {
            Py_DECREF(requests);
            return NULL;
        }
        PyList_SET_ITEM(requests, i, r);
    }
    return Py_BuildValue("{s:N,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "requests", requests,
                         "allocated_model",
                         (long long)p.allocated_model, "allocated_state", (long long)p.allocated_state,
                         "allocated_half", (long long)p.allocated_half, "allocated_data", (long long)p.allocated_data,
                         "standing_reserved",
                         (long long)p.standing_reserved, "evaluation", (long long)p.evaluation,
                         "parameters", (long long)p.parameters, "gradients",
                         (long long)p.gradients, "optimizer_state", (long long)p.optimizer_state, "half_weights",
                         (long long)p.half_weights, "activations", (long long)p.activations, "workspace",
                         (long long)p.workspace, "data", (long long)p.data, "peak_allocated",
                         (long long)p.peak_allocated, "peak_reserved", (long long)p.peak_reserved, "in_gradients",
                         (long long)p.in_gradients);
}

static PyObject *mod_parse_device(PyObject *mod, PyObject *arg) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return NULL;
    return device_str(d);
}

static PyObject *mod_build_info(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    const char *cuda = cmlp_cuda_version();
    return Py_BuildValue("{s:s,s:s,s:s,s:O,s:z}", "version", cmlp_version(), "blas", cmlp_blas_info(), "compiler",
                         cmlp_compiler_info(), "cuda_compiled", cmlp_cuda_compiled() ? Py_True : Py_False, "cuda",
                         cuda);
}

static PyObject *mod_synchronize(PyObject *mod, PyObject *arg) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return NULL;
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_device_synchronize(d);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static PyObject *mod_cuda_device_count(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyLong_FromLong(cmlp_cuda_device_count());
}

/* The processes holding memory on a device: [(pid, bytes), ...], or None where it cannot tell */
static PyObject *mod_gpu_processes(PyObject *mod, PyObject *arg) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return NULL;
    enum { CAP = 4096 };
    int64_t *pids = PyMem_Malloc(2 * CAP * sizeof *pids), *bytes = pids + CAP;
    if (!pids) return PyErr_NoMemory();
    int n = -1;
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_device_processes(d, pids, bytes, CAP, &n);
    NOGIL_END
    PyObject *list = NULL;
    if (st != CMLP_OK) raise_status(state_of(mod), st);
    else if (n < 0) {
        Py_INCREF(Py_None);
        list = Py_None;
    }
    else list = PyList_New(0);
    for (int i = 0; list && list != Py_None && i < n && i < CAP; i++) { /* bytes -1: NVML does not say */
        PyObject *pair = Py_BuildValue("(LL)", (long long)pids[i], (long long)bytes[i]);
        if (!pair || PyList_Append(list, pair) < 0) Py_CLEAR(list);
        Py_XDECREF(pair);
    }
    PyMem_Free(pids);
    return list;
}

/* torch.cuda.get_device_properties' fields of GPU index, as a dict */
static PyObject *mod_cuda_device_properties(PyObject *mod, PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    const int index = v < 0 || v > INT_MAX ? -1 : (int)v; /* -1: refused by the core, as not a device */
    cmlp_device_props p;
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_cuda_device_properties(index, &p);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    return Py_BuildValue("{s:s,s:i,s:i,s:L,s:i,s:i,s:i,s:L,s:s}", "name", p.name, "major", p.major, "minor", p.minor,
                         "total_memory", (long long)p.total_memory, "multi_processor_count", p.multi_processor_count,
                         "max_threads_per_multi_processor", p.max_threads_per_multi_processor, "warp_size",
                         p.warp_size, "L2_cache_size", (long long)p.l2_cache_size, "uuid", p.uuid);
}

static PyObject *mod_cuda_loadable(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyBool_FromLong(cmlp_cuda_loadable());
}

static PyObject *mod_cuda_started(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyBool_FromLong(cmlp_cuda_started());
}

static PyObject *mod_cuda_device_opened(PyObject *mod, PyObject *arg) {
    (void)mod;
    long long index = PyLong_AsLongLong(arg);
    if (index == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(index >= 0 && index <= INT32_MAX && cmlp_cuda_device_opened((int)index));
}

/* NVML's GPUs as a list of their UUIDs, or None where NVML is not there or fails */
static PyObject *mod_nvml_devices(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    const char *uuids[CMLP_NVML_MAX_DEVICES];
    int n;
    NOGIL_BEGIN
    n = cmlp_nvml_devices(uuids, CMLP_NVML_MAX_DEVICES);
    NOGIL_END
    if (n < 0) Py_RETURN_NONE;
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *u = PyUnicode_DecodeASCII(uuids[i], (Py_ssize_t)strlen(uuids[i]), "replace");
        if (!u) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, u);
    }
    return list;
}

static PyObject *mod_cuda_forked(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyBool_FromLong(cmlp_cuda_forked());
}

/* ---- the process group (cmlp.distributed) ---- */

static PyObject *mod_dist_init(PyObject *mod, PyObject *arg) {
    long backend = PyLong_AsLong(arg);
    if (backend == -1 && PyErr_Occurred()) return NULL;
    int rank = 0, size = 1;
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_dist_init((int)backend, &rank, &size);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    return Py_BuildValue("(ii)", rank, size);
}

static PyObject *mod_dist_state(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return Py_BuildValue("(OiiiiiO)", cmlp_dist_initialized() ? Py_True : Py_False, cmlp_dist_rank(), cmlp_dist_size(),
                         cmlp_dist_local_rank(), cmlp_dist_local_size(), cmlp_dist_backend(),
                         cmlp_dist_orphaned() ? Py_True : Py_False);
}

/* The array a collective works on in place: a writable, C-contiguous ndarray. */
static PyArrayObject *collective_array(PyObject *obj, const char *what) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a NumPy array, got %.100s", what, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISWRITEABLE(a) || !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be a writable, aligned, C-contiguous array (it is changed in place)",
                     what);
        return NULL;
    }
    if (!PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be in the machine's byte order", what);
        return NULL;
    }
    return a;
}

static PyObject *mod_dist_all_reduce(PyObject *mod, PyObject *args) {
    PyObject *obj;
    int op;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &op)) return NULL;
    PyArrayObject *a = collective_array(obj, "tensor");
    if (!a) return NULL;
    int t = PyArray_TYPE(a);
    int i64 = PyArray_ISSIGNED(a) && PyArray_ITEMSIZE(a) == 8; /* int64, whichever C type it is */
    int type = t == NPY_FLOAT32 ? 0 : t == NPY_FLOAT64 ? 1 : i64 ? 2 : -1;
    if (type < 0) {
        PyErr_SetString(PyExc_TypeError, "all_reduce takes float32, float64 or int64 arrays");
        return NULL;
    }
    void *data = PyArray_DATA(a);
    int64_t n = (int64_t)PyArray_SIZE(a);
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_dist_all_reduce(data, n, type, op);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static PyObject *mod_dist_broadcast(PyObject *mod, PyObject *args) {
    PyObject *obj;
    int root;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &root)) return NULL;
    PyArrayObject *a = collective_array(obj, "tensor");
    if (!a) return NULL;
    void *data = PyArray_DATA(a);
    int64_t bytes = (int64_t)PyArray_NBYTES(a);
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_dist_broadcast(data, bytes, root);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static PyObject *mod_dist_barrier(PyObject *mod, PyObject *unused) {
    (void)unused;
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_dist_barrier();
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static PyObject *mod_dist_destroy(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    GUARDED(cmlp_dist_destroy());
    Py_RETURN_NONE;
}

static PyObject *mod_dist_finalize(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    NOGIL_BEGIN
    cmlp_dist_finalize();
    NOGIL_END
    Py_RETURN_NONE;
}

static PyObject *mod_dist_abort(PyObject *mod, PyObject *arg) {
    (void)mod;
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred()) return NULL;
    cmlp_dist_abort((int)code);
    Py_RETURN_NONE;
}

static PyObject *mod_dist_library_version(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    char v[256];
    cmlp_dist_library_version(v, sizeof v);
    return PyUnicode_DecodeUTF8(v, (Py_ssize_t)strlen(v), "replace");
}

static PyMethodDef module_methods[] = {
    {"dist_init", mod_dist_init, METH_O, "dist_init(backend: 0 mpi, 1 nccl): the process group -> (rank, size)"},
    {"dist_state", mod_dist_state, METH_NOARGS,
     "(initialized, rank, size, local_rank, local_size, backend, forked from a rank)"},
    {"dist_all_reduce", mod_dist_all_reduce, METH_VARARGS, "dist_all_reduce(array, op): in place; op 0 sum 1 max 2 min"},
    {"dist_broadcast", mod_dist_broadcast, METH_VARARGS, "dist_broadcast(array, root): in place"},
    {"dist_barrier", mod_dist_barrier, METH_NOARGS, "waits for every rank"},
    {"dist_destroy", mod_dist_destroy, METH_NOARGS, "ends the process group"},
    {"dist_finalize", mod_dist_finalize, METH_NOARGS, "finalizes MPI where cmlp initialised it (at exit)"},
    {"after_fork_child", mod_after_fork_child, METH_NOARGS, "marks the models a lost thread was using (in a forked child)"},
    {"dist_abort", mod_dist_abort, METH_O, "ends every rank's process (MPI_Abort)"},
    {"dist_library_version", mod_dist_library_version, METH_NOARGS, "the MPI library's version, once loaded"},
    {"memory_stats", mod_memory_stats, METH_O, "memory_stats(device) -> dict"},
    {"mem_get_info", mod_mem_get_info, METH_O, "mem_get_info(device) -> (free bytes or -1, total bytes)"},
    {"reset_peak_memory_stats", mod_reset_peak, METH_O, "reset every peak to its current value"},
    {"memory_window_peak", mod_window_peak, METH_VARARGS,
     "(device, restart): the allocated bytes' peak since the last restart (the statistics' peaks untouched)"},
    {"empty_cache", mod_empty_cache, METH_O, "release cached memory"},
    {"reset_accumulated_memory_stats", mod_reset_accumulated, METH_O, "allocated/freed totals and event counts to 0"},
    {"set_memory_limit", mod_set_memory_limit, METH_VARARGS, "set_memory_limit(device, bytes or -1)"},
    {"alloc", mod_alloc, METH_VARARGS, "alloc(device, nbytes) -> int"},
    {"free", mod_free, METH_VARARGS, "free(device, ptr)"},
    {"snapshot", mod_snapshot, METH_O, "segments with their blocks, by address"},
    {"snapshot_history", mod_snapshot_history, METH_O, "(segments, history) at one instant"},
    {"record_history", mod_record_history, METH_VARARGS,
     "record_history(device, mode, context, max_entries, skip_mask, clear)"},
    {"capture_stacks", mod_capture_stacks, METH_O, "note the Python stack of every call into the core"},
    {"stack_frames", mod_stack_frames, METH_O, "stack_frames(n) -> [(filename, line, name)], innermost first"},
    {"configure", mod_configure, METH_O, "set the allocator options (PyTorch syntax)"},
    {"get_settings", mod_get_settings, METH_NOARGS, "the allocator options in force"},
    {"note_env", mod_note_env, METH_O, "note_env('VAR=value' or None): the settings the environment gave at import"},
    {"validate", mod_validate, METH_O, "check the allocator's invariants"},
    {"fail_raw_alloc", mod_fail_raw_alloc, METH_VARARGS, "test hook: fail the k-th raw device call from now"},
    {"to_half", mod_to_half, METH_VARARGS, "to_half(float32 array, 'fp16'|'bf16') -> uint16 array"},
    {"from_half", mod_from_half, METH_VARARGS, "from_half(uint16 array, 'fp16'|'bf16') -> float32 array"},
    {"plan", mod_plan, METH_VARARGS,
     "plan(sizes, batch, optimizer_buffers, optimizer_shards, optimizer_parts, amp, recompute, loss_scaling, solo, "
     "data_rows, data_row_bytes, data_shuffled, eval_rows, eval_staged, epochs, device) -> dict"},
    {"parse_device", mod_parse_device, METH_O, "canonical device string; raises when unavailable"},
    {"build_info", mod_build_info, METH_NOARGS, "build facts"},
    {"cuda_device_count", mod_cuda_device_count, METH_NOARGS, "number of usable CUDA devices"},
    {"gpu_processes", mod_gpu_processes, METH_O, "the processes holding a device's memory (NVML), or None"},
    {"cuda_device_properties", mod_cuda_device_properties, METH_O, "a GPU's properties (starts CUDA)"},
    {"cuda_loadable", mod_cuda_loadable, METH_NOARGS, "whether the CUDA backend's library loads (starts nothing)"},
    {"cache_serves", mod_cache_serves, METH_VARARGS,
     "cache_serves(device, [bytes, ...]): whether the cache's free blocks serve those requests (tries nothing)"},
    {"cuda_started", mod_cuda_started, METH_NOARGS, "whether the CUDA driver was asked for the devices"},
    {"cuda_device_opened", mod_cuda_device_opened, METH_O, "whether GPU N was opened here (opens nothing)"},
    {"nvml_devices", mod_nvml_devices, METH_NOARGS, "NVML's GPUs' UUIDs (None: no NVML), without starting CUDA"},
    {"cuda_forked", mod_cuda_forked, METH_NOARGS, "whether this process was forked after CUDA was started"},
    {"synchronize", mod_synchronize, METH_O, "synchronize(device): waits for the device's queued work"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *mod) {
    module_state *ms = state_of(mod);
    if (_import_array() < 0) return -1;
    ms->oom_error = PyErr_NewExceptionWithDoc("cmlp.OutOfMemoryError",
                                              "A device ran out of memory (a RuntimeError, like PyTorch's).",
                                              PyExc_RuntimeError, NULL);
    if (!ms->oom_error || PyModule_AddObjectRef(mod, "OutOfMemoryError", ms->oom_error) < 0) return -1;
    ms->model_type = (PyTypeObject *)PyType_FromModuleAndSpec(mod, &Model_spec, NULL);
    if (!ms->model_type || PyModule_AddType(mod, ms->model_type) < 0) return -1;
    ms->optim_type = (PyTypeObject *)PyType_FromModuleAndSpec(mod, &Optim_spec, NULL);
    if (!ms->optim_type || PyModule_AddType(mod, ms->optim_type) < 0) return -1;
    ms->trainer_type = (PyTypeObject *)PyType_FromModuleAndSpec(mod, &Trainer_spec, NULL);
    if (!ms->trainer_type || PyModule_AddType(mod, ms->trainer_type) < 0) return -1;
    if (PyModule_AddIntConstant(mod, "MAX_RATES", CMLP_MAX_RATES) < 0) return -1;
    if (!stack_ids && !(stack_ids = PyDict_New())) return -1;
    if (!stack_list && !(stack_list = PyList_New(0))) return -1;
    if (!stack_where && !(stack_where = PyList_New(0))) return -1;
    return 0;
}

static int module_traverse(PyObject *mod, visitproc visit, void *arg) {
    module_state *ms = state_of(mod);
    Py_VISIT(ms->oom_error);
    Py_VISIT(ms->model_type);
    Py_VISIT(ms->optim_type);
    Py_VISIT(ms->trainer_type);
    return 0;
}

static int module_clear(PyObject *mod) {
    module_state *ms = state_of(mod);
    Py_CLEAR(ms->oom_error);
    Py_CLEAR(ms->model_type);
    Py_CLEAR(ms->optim_type);
    Py_CLEAR(ms->trainer_type);
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_cmlp", "cmlp's C core", sizeof(module_state), module_methods, module_slots,
    module_traverse, module_clear, NULL,
};

PyMODINIT_FUNC PyInit__cmlp(void) { return PyModuleDef_Init(&module_def); }
