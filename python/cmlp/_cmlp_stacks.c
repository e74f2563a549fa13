/* _cmlp_stacks.c - the Python stack of each call into the core, for the allocators' history
 * with context: stored once, known by its number, and turned into frames for a snapshot.
 */
#include "_cmlp.h"

/* ---- the Python stack of a call into the core, noted by the allocators that record their
 * history with context (cmlp_memory_set_context). A stack is stored once, as a tuple of its
 * frames (filename, line, name) from the innermost out, and known by its number: stacks of the
 * same frames have one number. It is found by a hash of its code objects' addresses and
 * instruction offsets, whose entry holds weak references to those code objects (a stack keeps no
 * code alive: code compiled afresh for each call, a notebook's cells or exec's, is freed, and an
 * entry whose code is gone is taken again or swept); the frames, whose line numbers take a walk
 * of the code's line table, are computed only where no entry is found. The frames stay (their
 * numbers are in the history), once for each different stack. ---- */

#define MAX_STACK 64

static int capture_stacks;        /* while some allocator keeps contexts */
static PyObject *stack_ids;       /* {hash (the next one on a collision): (number, codes' weak refs, offsets)} */
static Py_ssize_t sweep_at = 4096; /* entries in stack_ids past which those of code that is gone go */
static PyObject *stack_list;      /* [the frames of stack 1, of stack 2, ...] */
static PyObject *stack_by_frames; /* {frames: number} */
static PyObject *frame_cache;     /* {(filename, line, name): itself}: one tuple a frame */

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

/* The object weak reference r refers to (borrowed; Py_None where it is gone). */
static PyObject *referent(PyObject *r) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *o = NULL;
    if (PyWeakref_GetRef(r, &o) <= 0) {
        PyErr_Clear();
        return Py_None;
    }
    Py_DECREF(o); /* (only its address is compared, against code a frame holds) */
    return o;
#else
    return PyWeakref_GetObject(r);
#endif
}

/* Whether an entry of stack_ids holds code that is gone. */
static int entry_gone(PyObject *entry) {
    PyObject *codes = PyTuple_GET_ITEM(entry, 1);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(codes); i++)
        if (referent(PyTuple_GET_ITEM(codes, i)) == Py_None) return 1;
    return 0;
}

/* Whether entry is the stack fr[0..n). */
static int same_stack(PyObject *entry, const frame_ref *fr, Py_ssize_t n) {
    PyObject *codes = PyTuple_GET_ITEM(entry, 1), *where = PyTuple_GET_ITEM(entry, 2);
    if (PyTuple_GET_SIZE(codes) != n || PyBytes_GET_SIZE(where) != n * (Py_ssize_t)sizeof(int)) return 0;
    const int *w = (const int *)PyBytes_AS_STRING(where);
    for (Py_ssize_t i = 0; i < n; i++)
        if (w[i] != fr[i].where || referent(PyTuple_GET_ITEM(codes, i)) != (PyObject *)fr[i].code) return 0;
    return 1;
}

/* The frames of fr[0..n) (a new reference), each frame's tuple shared with the stacks stored. */
static PyObject *frames_of(const frame_ref *fr, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t && i < n; i++) {
        PyObject *line = PyLong_FromLong(PyFrame_GetLineNumber(fr[i].frame));
        PyObject *f = line ? PyTuple_Pack(3, fr[i].code->co_filename, line, fr[i].code->co_name) : NULL;
        Py_XDECREF(line);
        PyObject *known = f ? PyDict_SetDefault(frame_cache, f, f) : NULL;
        Py_XINCREF(known);
        Py_XDECREF(f);
        if (!known) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, known);
    }
    return t;
}

/* The number of the stack of these frames, stored where new; 0 on a failure. */
static int64_t number_of(PyObject *frames) {
    PyObject *known = PyDict_GetItemWithError(stack_by_frames, frames);
    if (known) return PyLong_AsLongLong(known);
    if (PyErr_Occurred() || PyList_Append(stack_list, frames) < 0) return 0;
    Py_ssize_t len = PyList_GET_SIZE(stack_list);
    PyObject *v = PyLong_FromSsize_t(len);
    int ok = v && PyDict_SetItem(stack_by_frames, frames, v) == 0;
    Py_XDECREF(v);
    if (!ok) {
        PyList_SetSlice(stack_list, len - 1, len, NULL);
        return 0;
    }
    return len;
}

/* Drops the entries whose code is gone, once stack_ids has grown to twice what it held after
 * the last sweep. (A live entry after one dropped on its collision chain is not found again,
 * and is made anew before it: the old one goes when its code does.) */
static void sweep(void) {
    if (PyDict_GET_SIZE(stack_ids) < sweep_at) return;
    PyObject *gone = PyList_New(0), *key, *entry;
    Py_ssize_t pos = 0;
    while (gone && PyDict_Next(stack_ids, &pos, &key, &entry))
        if (entry_gone(entry) && PyList_Append(gone, key) < 0) Py_CLEAR(gone);
    for (Py_ssize_t i = 0; gone && i < PyList_GET_SIZE(gone); i++)
        if (PyDict_DelItem(stack_ids, PyList_GET_ITEM(gone, i)) < 0) break;
    Py_XDECREF(gone);
    sweep_at = 2 * PyDict_GET_SIZE(stack_ids) + 4096;
}

/* Stores the entry of stack fr[0..n) under key; its number, or 0. */
static int64_t store_stack(PyObject *key, const frame_ref *fr, Py_ssize_t n) {
    PyObject *frames = frames_of(fr, n);
    int64_t number = frames ? number_of(frames) : 0;
    Py_XDECREF(frames);
    PyObject *codes = number > 0 ? PyTuple_New(n) : NULL;
    for (Py_ssize_t i = 0; codes && i < n; i++) {
        PyObject *r = PyWeakref_NewRef((PyObject *)fr[i].code, NULL);
        if (!r) Py_CLEAR(codes);
        else PyTuple_SET_ITEM(codes, i, r);
    }
    PyObject *where = codes ? PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int)) : NULL;
    for (Py_ssize_t i = 0; where && i < n; i++) ((int *)PyBytes_AS_STRING(where))[i] = fr[i].where;
    PyObject *entry = where ? Py_BuildValue("(LOO)", (long long)number, codes, where) : NULL;
    if (entry) (void)PyDict_SetItem(stack_ids, key, entry); /* (not kept: found by its frames next time) */
    Py_XDECREF(entry);
    Py_XDECREF(where);
    Py_XDECREF(codes);
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
    sweep();
    int64_t number = 0;
    for (uint64_t probe = h;; probe++) {
        PyObject *key = PyLong_FromUnsignedLongLong(probe);
        PyObject *entry = key ? PyDict_GetItemWithError(stack_ids, key) : NULL;
        if (entry && same_stack(entry, fr, n)) {
            number = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0));
        } else if (entry && !entry_gone(entry)) {
            Py_DECREF(key);
            continue; /* a collision: the next key */
        } else if (key && !PyErr_Occurred()) { /* a free slot, or one whose code is gone */
            number = store_stack(key, fr, n);
        }
        Py_XDECREF(key);
        break;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(fr[i].code);
        Py_DECREF(fr[i].frame);
    }
    PyErr_Restore(err_type, err_value, err_tb); /* drops any error of ours */
    return number < 0 ? 0 : number;
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
    return PySequence_List(PyList_GET_ITEM(stack_list, n - 1));
}

/* The tables' sizes: {"stacks": numbers given, "entries": code stacks known, "frames": frames}. */
static PyObject *mod_stack_tables(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return Py_BuildValue("{snsnsn}", "stacks", PyList_GET_SIZE(stack_list), "entries", PyDict_GET_SIZE(stack_ids),
                         "frames", PyDict_GET_SIZE(frame_cache));
}

int stacks_init(void) {
    if (!stack_ids && !(stack_ids = PyDict_New())) return -1;
    if (!stack_list && !(stack_list = PyList_New(0))) return -1;
    if (!stack_by_frames && !(stack_by_frames = PyDict_New())) return -1;
    if (!frame_cache && !(frame_cache = PyDict_New())) return -1;
    return 0;
}

PyMethodDef cmlp_py_stack_methods[] = {
    {"capture_stacks", mod_capture_stacks, METH_O, "note the Python stack of every call into the core"},
    {"stack_frames", mod_stack_frames, METH_O, "stack_frames(n) -> [(filename, line, name)], innermost first"},
    {"stack_tables", mod_stack_tables, METH_NOARGS, "the sizes of the stacks' tables"},
    {NULL, NULL, 0, NULL},
};
