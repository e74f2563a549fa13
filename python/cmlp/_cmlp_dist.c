/* _cmlp_dist.c - the process group of cmlp.distributed: its start and end, and the
 * collectives on NumPy arrays, each with the GIL released.
 */
#include "_cmlp.h"

#include <limits.h>

static PyObject *mod_dist_init(PyObject *mod, PyObject *arg) {
    long backend = PyLong_AsLong(arg);
    if (backend == -1 && PyErr_Occurred()) return NULL;
    if (backend != 0 && backend != 1) return PyErr_Format(PyExc_ValueError, "backend must be 0 (MPI) or 1 (NCCL)");
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
    if (PyDataType_REFCHK(PyArray_DESCR(a))) { /* its bytes are one process's pointers */
        PyErr_Format(PyExc_TypeError, "%s must hold numbers, not Python objects (dtype %R)", what,
                     (PyObject *)PyArray_DESCR(a));
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

static PyObject *mod_dist_set_timeout(PyObject *mod, PyObject *arg) {
    (void)mod;
    const double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    cmlp_dist_set_timeout(seconds);
    Py_RETURN_NONE;
}

static PyObject *mod_dist_set_check(PyObject *mod, PyObject *arg) {
    (void)mod;
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    cmlp_dist_set_check(on);
    Py_RETURN_NONE;
}

static PyObject *mod_dist_abort(PyObject *mod, PyObject *arg) {
    (void)mod;
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred()) return NULL;
    if (code < INT_MIN || code > INT_MAX) return PyErr_Format(PyExc_ValueError, "an exit code must fit in a C int");
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


PyMethodDef cmlp_py_dist_methods[] = {
    {"dist_init", mod_dist_init, METH_O, "dist_init(backend: 0 mpi, 1 nccl): the process group -> (rank, size)"},
    {"dist_state", mod_dist_state, METH_NOARGS,
     "(initialized, rank, size, local_rank, local_size, backend, forked from a rank)"},
    {"dist_all_reduce", mod_dist_all_reduce, METH_VARARGS, "dist_all_reduce(array, op): in place; op 0 sum 1 max 2 min 3 product 4 band 5 bor 6 bxor (int64)"},
    {"dist_broadcast", mod_dist_broadcast, METH_VARARGS, "dist_broadcast(array, root): in place"},
    {"dist_barrier", mod_dist_barrier, METH_NOARGS, "waits for every rank"},
    {"dist_destroy", mod_dist_destroy, METH_NOARGS, "ends the process group"},
    {"dist_finalize", mod_dist_finalize, METH_NOARGS, "finalizes MPI where cmlp initialised it (at exit)"},
    {"dist_set_timeout", mod_dist_set_timeout, METH_O,
     "dist_set_timeout(seconds): > 0, an MPI collective waiting longer ends the job; 0, none"},
    {"dist_set_check", mod_dist_set_check, METH_O, "whether each collective first checks the ranks' calls agree"},
    {"dist_abort", mod_dist_abort, METH_O, "ends every rank's process (MPI_Abort)"},
    {"dist_library_version", mod_dist_library_version, METH_NOARGS, "the MPI library's version, once loaded"},
    {NULL, NULL, 0, NULL},
};
