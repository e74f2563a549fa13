/* _cmlp_stacks.c - the Python stack of each call into the core, for the allocators' history
 * with context: stored once, known by its number, and turned into frames for a snapshot.
 */
#include "_cmlp.h"

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
int64_t stack_number(void) {
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

int stacks_init(void) {
    if (!stack_ids && !(stack_ids = PyDict_New())) return -1;
    if (!stack_list && !(stack_list = PyList_New(0))) return -1;
    if (!stack_where && !(stack_where = PyList_New(0))) return -1;
    return 0;
}

PyMethodDef cmlp_py_stack_methods[] = {
    {"capture_stacks", mod_capture_stacks, METH_O, "note the Python stack of every call into the core"},
    {"stack_frames", mod_stack_frames, METH_O, "stack_frames(n) -> [(filename, line, name)], innermost first"},
    {NULL, NULL, 0, NULL},
};
