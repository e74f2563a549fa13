/* _cmlp_model.c - the Model object: a handle on cmlp_model whose lock serialises every C
 * call on the model, its optimizer and its trainer, and the models' fate in a forked child.
 */
#include "_cmlp.h"

static ModelObject *live_models;

static int Model_init(ModelObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"sizes", "device", "seed", NULL};
    PyObject *sizes_obj, *dev_obj, *seed_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO", kwlist, &sizes_obj, &dev_obj, &seed_obj)) return -1;
    if (!PyLong_Check(seed_obj)) {
        PyErr_Format(PyExc_TypeError, "seed must be an int, got %.100s", Py_TYPE(seed_obj)->tp_name);
        return -1;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(seed_obj); /* in [0, 2**64): no wrapping */
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "seed must be in [0, 2**64), got %R", seed_obj);
        return -1;
    }
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
int model_ready(ModelObject *self) {
    if (model_made(self) < 0) return -1;
    if (self->lost) {
        PyErr_SetString(PyExc_RuntimeError, LOST_TEXT);
        return -1;
    }
    return 0;
}

/* A C-contiguous, aligned [n, features] array of float32 or uint8 (the Python layer converts). */
int as_data(PyObject *x, PyObject *y, int64_t features, float mean, float std, cmlp_data *out) {
    if (!PyArray_Check(x)) {
        PyErr_SetString(PyExc_TypeError, "x must be a numpy array");
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)x;
    int t = PyArray_TYPE(a);
    if (PyArray_NDIM(a) != 2 || !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a) ||
        (t != NPY_FLOAT32 && t != NPY_UINT8)) {
        PyErr_SetString(PyExc_TypeError,
                        "x must be a C-contiguous 2-D float32 or uint8 array in the machine's byte order");
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
            !PyArray_IS_C_CONTIGUOUS(b) || !PyArray_ISALIGNED(b) || !PyArray_ISNOTSWAPPED(b)) {
            PyErr_SetString(PyExc_TypeError, "y must be a C-contiguous 1-D int32 array in the machine's byte order");
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
    for (int i = 0; i <= L; i++) {
        PyObject *v = PyLong_FromLong(cmlp_model_size(self->m, i));
        if (!v) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
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

int as_flat(PyObject *obj, int64_t n, const float **out) {
    PyArrayObject *a = (PyArrayObject *)obj;
    if (!PyArray_Check(obj) || PyArray_NDIM(a) != 1 || PyArray_TYPE(a) != NPY_FLOAT32 || !PyArray_IS_C_CONTIGUOUS(a) ||
        !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a) || PyArray_DIM(a, 0) != n) {
        PyErr_Format(PyExc_TypeError,
                     "expected a contiguous 1-D float32 array of %lld values in the machine's byte order",
                     (long long)n);
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

static PyObject *Model_half_weights_held(ModelObject *self, PyObject *unused) {
    (void)unused;
    if (model_ready(self) < 0) return NULL;
    int held = 0;
    RUN_LOCKED_VOID(self, held = cmlp_model_half_weights_held(self->m)); /* (a step in another thread sets it) */
    return PyBool_FromLong(held);
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
        set_error_text(PyExc_RuntimeError, user_error());
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

/* to(device, optimizers=()): the model and those of its optimizers, in one call under the lock */
static PyObject *Model_to(ModelObject *self, PyObject *args) {
    PyObject *dev, *opts_obj = NULL;
    if (!PyArg_ParseTuple(args, "O|O!:to", &dev, &PyTuple_Type, &opts_obj)) return NULL;
    if (model_ready(self) < 0) return NULL;
    cmlp_device d;
    if (parse_device(self->ms, dev, &d) < 0) return NULL;
    Py_ssize_t n = opts_obj ? PyTuple_GET_SIZE(opts_obj) : 0;
    if (n > INT_MAX) return PyErr_Format(PyExc_ValueError, "too many optimizers: %zd", n);
    cmlp_optim **opts = PyMem_Calloc(n ? (size_t)n : 1, sizeof *opts);
    if (!opts) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyTuple_GET_ITEM(opts_obj, i);
        if (!PyObject_TypeCheck(o, self->ms->optim_type) || ((OptimObject *)o)->model != self) {
            PyMem_Free(opts);
            return PyErr_Format(PyExc_TypeError, "to() moves optimizers of this model only, got %R", o);
        }
        if (optim_ready((OptimObject *)o) < 0) {
            PyMem_Free(opts);
            return NULL;
        }
        opts[i] = ((OptimObject *)o)->o;
    }
    cmlp_status st;
    RUN_LOCKED(self, st, cmlp_model_move(self->m, opts, (int)n, d)); /* the tuple keeps them alive */
    PyMem_Free(opts);
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
    {"half_weights_held", (PyCFunction)Model_half_weights_held, METH_NOARGS,
     "whether the model holds a half-precision copy of its weights now"},
    {"forward", (PyCFunction)(void (*)(void))Model_forward, METH_VARARGS | METH_KEYWORDS, "logits"},
    {"evaluate", (PyCFunction)(void (*)(void))Model_evaluate, METH_VARARGS | METH_KEYWORDS, "(loss_sum, correct)"},
    {"forward_backward", (PyCFunction)(void (*)(void))Model_forward_backward, METH_VARARGS | METH_KEYWORDS,
     "loss sum; adds grad_weight * per-sample gradient sums"},
    {"to", (PyCFunction)Model_to, METH_VARARGS,
     "to(device, optimizers=()): moves the model and those optimizers of it, all or nothing"},
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

PyType_Spec Model_spec = {"cmlp._cmlp.Model", sizeof(ModelObject), 0, Py_TPFLAGS_DEFAULT, Model_slots};

PyMethodDef cmlp_py_model_methods[] = {
    {"after_fork_child", mod_after_fork_child, METH_NOARGS, "marks the models a lost thread was using (in a forked child)"},
    {NULL, NULL, 0, NULL},
};
