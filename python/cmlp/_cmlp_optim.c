/* _cmlp_optim.c - the Optimizer object: a handle on cmlp_optim over a model's flat buffers,
 * its hyper-parameters as attributes, and its state read and written as arrays.
 */
#include "_cmlp.h"

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
        RUN_LOCKED(mo, st, cmlp_optim_init_adam(&self->o, mo->m, &ac)); /* the model's device, not moving */
    } else if (strcmp(kind, "sgd") == 0) {
        sc.lr = lr;
        sc.weight_decay = wd;
        sc.nesterov = nesterov;
        RUN_LOCKED(mo, st, cmlp_optim_init_sgd(&self->o, mo->m, &sc));
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

int optim_ready(OptimObject *self) {
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
    RUN_LOCKED_BRIEF(self->model, st, cmlp_optim_set_momentum(self->o, m));
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
    RUN_LOCKED_BRIEF(self->model, st, cmlp_optim_set_lr(self->o, lr));
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
    int checked = 1; /* 0: the values as they are (a copy's: NaN and inf too) */
    if (!PyArg_ParseTuple(args, "LO!|p", &step, &PyList_Type, &bufs, &checked)) return NULL;
    if (optim_ready(self) < 0) return NULL;
    /* the buffers are held by a tuple of ours while the call runs without the GIL (the list may
     * change meanwhile) */
    PyObject *held = items_of(bufs, "buffers must be a list of arrays");
    if (!held) return NULL;
    Py_ssize_t nb = PyTuple_GET_SIZE(held);
    if (nb > 3) {
        Py_DECREF(held);
        PyErr_SetString(PyExc_ValueError, "optimizer state has at most 3 buffers");
        return NULL;
    }
    const float *ptrs[3] = {NULL, NULL, NULL};
    for (Py_ssize_t i = 0; i < nb; i++)
        if (as_flat(PyTuple_GET_ITEM(held, i), cmlp_model_num_parameters(self->model->m), &ptrs[i]) < 0) {
            Py_DECREF(held);
            return NULL;
        }
    cmlp_status st;
    RUN_LOCKED(self->model, st,
               checked ? cmlp_optim_set_state(self->o, step, (int)nb, ptrs)
                       : cmlp_optim_copy_state(self->o, step, (int)nb, ptrs));
    Py_DECREF(held);
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

static cmlp_status counts_of(const cmlp_optim *o, int64_t *step, int *nbuffers) {
    *step = cmlp_optim_get_step(o);
    nbuffers[0] = cmlp_optim_num_buffers(o);
    nbuffers[1] = cmlp_optim_buffers_held(o);
    return CMLP_OK;
}

static PyObject *Optim_state_counts(OptimObject *self, PyObject *Py_UNUSED(unused)) {
    if (optim_ready(self) < 0) return NULL;
    int64_t step = 0;
    int nb[2] = {0, 0};
    cmlp_status st;
    RUN_LOCKED(self->model, st, counts_of(self->o, &step, nb));
    if (st != CMLP_OK) return raise_status(self->model->ms, st);
    return Py_BuildValue("(Lii)", (long long)step, nb[0], nb[1]);
}

static cmlp_status parts_of(const cmlp_optim *o, int *on_device) {
    *on_device = cmlp_optim_parts_on_device(o);
    return CMLP_OK;
}

/* Under the model's lock: a step or a move on another thread sets what it reads. */
static PyObject *Optim_parts_on_device(OptimObject *self, PyObject *Py_UNUSED(unused)) {
    if (optim_ready(self) < 0) return NULL;
    int on = 0;
    cmlp_status st;
    RUN_LOCKED(self->model, st, parts_of(self->o, &on));
    if (st != CMLP_OK) return raise_status(self->model->ms, st);
    return PyBool_FromLong(on);
}

static PyObject *Optim_buffers_planned(OptimObject *self, PyObject *Py_UNUSED(unused)) {
    if (optim_ready(self) < 0) return NULL;
    return PyLong_FromLong(cmlp_optim_buffers_planned(self->o));
}

static PyMethodDef Optim_methods[] = {
    {"step", (PyCFunction)Optim_step, METH_NOARGS, "one update from the model's gradients"},
    {"get_state", (PyCFunction)Optim_get_state, METH_NOARGS, "(step, [flat float32 buffers])"},
    {"parts_on_device", (PyCFunction)Optim_parts_on_device, METH_NOARGS,
     "whether the param groups' settings are in the device's memory (a plan's optimizer_parts request is held)"},
    {"state_counts", (PyCFunction)Optim_state_counts, METH_NOARGS,
     "(step, number of state buffers, buffers held in memory): get_state's without copying the buffers"},
    {"set_state", (PyCFunction)Optim_set_state, METH_VARARGS, "set_state(step, [buffers], checked=True)"},
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

PyType_Spec Optim_spec = {"cmlp._cmlp.Optimizer", sizeof(OptimObject), 0, Py_TPFLAGS_DEFAULT, Optim_slots};
