/* _cmlp.c - the CPython extension module: its types and functions put together (each object
 * and each family of functions has its own _cmlp_*.c), the checks of arguments they share, and
 * the one place where a cmlp_status becomes a Python exception. Arrays arrive already converted
 * by the Python layer and are checked again in C, so no call can crash the interpreter. The GIL
 * is released around every call that computes.
 */
#define CMLP_EXT_MAIN
#include "_cmlp.h"

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- errors: the one mapping from cmlp_status to Python ---- */

const char *user_error(void) { return cmlp_error_text(cmlp_last_error()); }

/* ---- the model calls under way, waited for at exit (core_enter in _cmlp.h) ---- */
static _Atomic int core_calls, core_exiting;
static pthread_t exit_thread; /* the thread that runs the exit (set before core_exiting) */

/* A call of another thread than the exiting one, once the exit has begun. */
static int held_back(void) { return atomic_load(&core_exiting) && !pthread_equal(pthread_self(), exit_thread); }

/* The threads parked for good (their Python idents: pthread_self's value, as CPython's on
 * POSIX), which hold whatever Python locks they held: cmlp's own (CoreLock, _cmlp_lock.c) are
 * taken over from them by the exiting thread, so that the exit's callbacks do not wait for ever. */
enum { MAX_PARKED = 256 };
static _Atomic unsigned long parked_ids[MAX_PARKED];
static _Atomic int parked_count;

/* Never returns: a daemon thread's work after the exit began waits here, without the GIL and
 * without an exception, until the process ends. */
static void park(void) {
    int i = atomic_fetch_add(&parked_count, 1);
    if (i < MAX_PARKED) atomic_store(&parked_ids[i], (unsigned long)pthread_self());
    for (;;) pause();
}

int core_parked(unsigned long id) {
    int n = atomic_load(&parked_count);
    for (int i = 0; i < n && i < MAX_PARKED; i++)
        if (atomic_load(&parked_ids[i]) == id) return 1;
    return 0;
}

int core_exit_thread(void) { return atomic_load(&core_exiting) && pthread_equal(pthread_self(), exit_thread); }

int core_enter(void) {
    atomic_fetch_add(&core_calls, 1);
    if (!held_back()) return 1; /* seq_cst both sides: the exit's wait sees this call */
    atomic_fetch_sub(&core_calls, 1);
    return 0;
}

void core_leave(void) { atomic_fetch_sub(&core_calls, 1); }

void core_busy(int delta) { atomic_fetch_add(&core_calls, delta); }

void core_gate(int delta) {
    if (delta < 0) atomic_fetch_add(&core_calls, delta);
    if (!held_back()) return;
    if (delta > 0) atomic_fetch_sub(&core_calls, delta);
    park();
}

/* One wait of EXIT_WAIT_MS at most for the whole exit (the Python hook's and the C handler's): a
 * call that never ends (a collective whose peers are gone) does not hold the exit for good. */
#define EXIT_WAIT_MS 30000

static void core_wait_at_exit(void) {
    static struct timespec deadline;
    if (!atomic_load(&core_exiting)) {
        exit_thread = pthread_self();
        atomic_store(&core_exiting, 1);
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += EXIT_WAIT_MS / 1000;
    }
    for (;;) {
        struct timespec now, ts = {0, 1000000};
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (atomic_load(&core_calls) <= 0 || now.tv_sec > deadline.tv_sec ||
            (now.tv_sec == deadline.tv_sec && now.tv_nsec >= deadline.tv_nsec))
            return;
        nanosleep(&ts, NULL);
    }
}

/* From the package's Python exit hook, before any C library's exit handler (the CUDA runtime's
 * is registered after cmlp's own, at the first use of a GPU, so it would run first): the wait,
 * with the GIL held (a call under way ends without it, its count gone before it asks for the
 * GIL). From here on this thread's calls (the exit callbacks') run as ever; another thread's new
 * call waits for the process's end, parked without the GIL, and raises nothing. */
static PyObject *mod_wait_for_calls(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    core_wait_at_exit();
    Py_RETURN_NONE;
}

/* a forked child has only the forking thread, which was in no call */
static void core_after_fork_child(void) {
    atomic_store(&core_calls, 0);
    atomic_store(&parked_count, 0); /* (none of them is in the child) */
}

int core_exit_init(void) {
    static int done;
    if (done) return 0;
    if (atexit(core_wait_at_exit) != 0 || pthread_atfork(NULL, NULL, core_after_fork_child) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "cmlp: could not register its exit and fork handlers");
        return -1;
    }
    done = 1;
    return 0;
}

/* The C core's message as the exception: its text is UTF-8 cut to a size in bytes, which can
 * end inside a character (a long device name or setting quoted back), so it is decoded with
 * that character replaced, never refused. */
void set_error_text(PyObject *type, const char *msg) {
    PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
    if (!text) return;
    PyErr_SetObject(type, text);
    Py_DECREF(text);
}

PyObject *raise_status(module_state *ms, cmlp_status s) {
    const char *msg = s == CMLP_ERR_INTERNAL ? cmlp_last_error() : user_error();
    if (s == STATUS_LOST) msg = LOST_TEXT;
    if (s == STATUS_EXITING) msg = "cmlp: the process is exiting";
    switch (s) {
    case CMLP_ERR_INVALID:
    case CMLP_ERR_NONFINITE: set_error_text(PyExc_ValueError, msg); break;
    case CMLP_ERR_OOM: set_error_text(ms->oom_error, msg); break;
    default: set_error_text(PyExc_RuntimeError, msg); break;
    }
    return NULL;
}

/* The UTF-8 text of str obj, refused (ValueError naming `what`) when it holds a NUL, which C
 * would read as its end. */
const char *c_text(PyObject *obj, const char *what) {
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &len);
    if (!s && PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) { /* a lone surrogate: no UTF-8 */
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be text that UTF-8 can encode, got %R", what, obj);
        return NULL;
    }
    if (s && strlen(s) != (size_t)len) {
        PyErr_Format(PyExc_ValueError, "%s must not contain a NUL character, got %R", what, obj);
        return NULL;
    }
    return s;
}

/* A tuple of the items of a sequence (a new reference), or NULL with a TypeError saying msg. Items
 * are read from it: a list (PySequence_Fast's own result) would lend them, and the conversion of
 * one (its __index__ or __float__) could change the list under the loop. */
PyObject *items_of(PyObject *obj, const char *msg) {
    PyObject *fast = PySequence_Fast(obj, msg);
    if (!fast) return NULL;
    PyObject *tuple = PySequence_Tuple(fast);
    Py_DECREF(fast);
    return tuple;
}

/* Layer sizes from a sequence of ints into sizes[0..*n): an int that C's int cannot hold is
 * refused here, naming it; the range check proper is the C core's. */
int parse_sizes(PyObject *obj, int sizes[CMLP_MAX_LAYERS + 1], int *n) {
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

int parse_device(module_state *ms, PyObject *obj, cmlp_device *out) {
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

PyObject *device_str(cmlp_device d) {
    if (d.type == CMLP_DEVICE_CPU) return PyUnicode_FromString("cpu");
    return PyUnicode_FromFormat("cuda:%d", d.index);
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
        set_error_text(PyExc_ValueError, user_error());
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

/* plan(..., device[, gpu]): gpu, a (major, total_memory) of a GPU to plan for in place of the
 * device (a CUDA device, which need not be here: its name is not read) */
static PyObject *mod_plan(PyObject *mod, PyObject *args) {
    PyObject *sizes_obj, *dev_obj, *gpu_obj = Py_None;
    long long batch, eval_rows, data_rows, row_bytes, epochs, budget;
    int nbuf, shards, parts, amp, recompute, scaling, solo, shuffled, eval_staged;
    if (!PyArg_ParseTuple(args, "OLiiiipppLLpLpLLO|O", &sizes_obj, &batch, &nbuf, &shards, &parts, &amp, &recompute,
                          &scaling, &solo, &data_rows, &row_bytes, &shuffled, &eval_rows, &eval_staged, &epochs,
                          &budget, &dev_obj, &gpu_obj))
        return NULL;
    cmlp_device d = {CMLP_DEVICE_CUDA, 0};
    cmlp_gpu_desc gpu;
    long long total = 0;
    if (gpu_obj != Py_None) {
        if (!PyArg_ParseTuple(gpu_obj, "iL", &gpu.major, &total)) return NULL;
        gpu.total_memory = total;
    } else if (parse_device(state_of(mod), dev_obj, &d) < 0) {
        return NULL;
    }
    int sizes[CMLP_MAX_LAYERS + 1], n;
    if (parse_sizes(sizes_obj, sizes, &n) < 0) return NULL;
    cmlp_plan p;
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_plan_compute(sizes, n, batch, nbuf, shards, parts, (cmlp_amp)amp, recompute, scaling, solo, data_rows,
                           row_bytes, shuffled, eval_rows, eval_staged, epochs, budget, d,
                           gpu_obj != Py_None ? &gpu : NULL, &p);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    static const char *const held_names[] = {"model", "optimizer_state", "half_weights", "data", "step",
                                             "optimizer_parts"};
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

static PyObject *mod_cuda_current_device(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyLong_FromLong(cmlp_cuda_current_device());
}

static PyObject *mod_cuda_set_device(PyObject *mod, PyObject *arg) {
    int overflow = 0;
    long index = PyLong_AsLongAndOverflow(arg, &overflow);
    if (index == -1 && PyErr_Occurred()) return NULL;
    if (overflow || index < INT_MIN || index > INT_MAX) index = CMLP_MAX_CUDA_DEVICES; /* no GPU has it */
    cmlp_status st;
    NOGIL_BEGIN
    st = cmlp_cuda_set_device((int)index);
    NOGIL_END
    if (st != CMLP_OK) return raise_status(state_of(mod), st);
    Py_RETURN_NONE;
}

static PyObject *mod_cuda_forked(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyBool_FromLong(cmlp_cuda_forked());
}

static PyMethodDef module_methods[] = {
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
    {"cuda_started", mod_cuda_started, METH_NOARGS, "whether the CUDA driver was asked for the devices"},
    {"cuda_device_opened", mod_cuda_device_opened, METH_O, "whether GPU N was opened here (opens nothing)"},
    {"nvml_devices", mod_nvml_devices, METH_NOARGS, "NVML's GPUs' UUIDs (None: no NVML), without starting CUDA"},
    {"cuda_current_device", mod_cuda_current_device, METH_NOARGS, "the GPU \"cuda\" names in this thread"},
    {"cuda_set_device", mod_cuda_set_device, METH_O, "cuda_set_device(N): \"cuda\" names GPU N in this thread"},
    {"cuda_forked", mod_cuda_forked, METH_NOARGS, "whether this process was forked after CUDA was started"},
    {"synchronize", mod_synchronize, METH_O, "synchronize(device): waits for the device's queued work"},
    {"wait_for_calls", mod_wait_for_calls, METH_NOARGS,
     "at exit: waits (30 s at most) for other threads' calls under way; their new ones wait for the end"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *mod) {
    module_state *ms = state_of(mod);
    if (_import_array() < 0) return -1;
    if (core_exit_init() < 0) return -1;
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
    PyObject *lock_type = PyType_FromModuleAndSpec(mod, &CoreLock_spec, NULL);
    if (!lock_type || PyModule_AddType(mod, (PyTypeObject *)lock_type) < 0) {
        Py_XDECREF(lock_type);
        return -1;
    }
    Py_DECREF(lock_type);
    if (PyModule_AddIntConstant(mod, "MAX_RATES", CMLP_MAX_RATES) < 0) return -1;
    if (PyModule_AddIntConstant(mod, "MAX_LAYERS", CMLP_MAX_LAYERS) < 0) return -1;
    PyMethodDef *more[] = {cmlp_py_model_methods, cmlp_py_memory_methods, cmlp_py_stack_methods,
                           cmlp_py_dist_methods};
    for (size_t i = 0; i < sizeof more / sizeof *more; i++)
        if (PyModule_AddFunctions(mod, more[i]) < 0) return -1;
    return stacks_init();
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
