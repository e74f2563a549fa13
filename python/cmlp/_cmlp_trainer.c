/* _cmlp_trainer.c - the Trainer object: a handle on cmlp_trainer, the epochs it runs in C
 * over arrays held for their duration, its loss scaler and its micro-batching state.
 */
#include "_cmlp.h"

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
        RUN_LOCKED_VOID(mo, cmlp_trainer_release_data(self->t)); /* its device copy goes with them */
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

static PyObject *Trainer_try_requests(TrainerObject *self, PyObject *args) {
    PyObject *list;
    int drop_data;
    if (!PyArg_ParseTuple(args, "O!p", &PyList_Type, &list, &drop_data) || trainer_ready(self) < 0) return NULL;
    int64_t req[CMLP_TRY_REQUESTS];
    Py_ssize_t n = request_list(list, req);
    if (n < 0) return NULL;
    ModelObject *mo = self->optim->model;
    int served = 0;
    cmlp_status st;
    RUN_LOCKED(mo, st, cmlp_trainer_try_requests(self->t, req, (int)n, drop_data, &served));
    if (st != CMLP_OK) return raise_status(mo->ms, st);
    return PyBool_FromLong(served);
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
    unsigned long long validation_hash;
    int per_step;
    if (!PyArg_ParseTuple(args, "LLKp", &epochs, &validation, &validation_hash, &per_step)) return NULL;
    if (trainer_ready(self) < 0) return NULL;
    cmlp_trainer_set_fit_call(self->t, epochs, validation, validation_hash, per_step);
    Py_RETURN_NONE;
}

static PyObject *Trainer_oom_retries(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    return PyLong_FromLongLong(cmlp_trainer_oom_retries(self->t));
}

static PyObject *Trainer_graph_counts(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    int64_t n[3];
    cmlp_trainer_graph_counts(self->t, n);
    return Py_BuildValue("(LLL)", (long long)n[0], (long long)n[1], (long long)n[2]);
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
    int64_t size, target, good, grown_from, wait;
    cmlp_trainer_get_microbatch_state(self->t, &size, &target, &good, &grown_from, &wait);
    return Py_BuildValue("(LLLLL)", (long long)size, (long long)target, (long long)good, (long long)grown_from,
                         (long long)wait);
}

static PyObject *Trainer_last_microbatch(TrainerObject *self, PyObject *unused) {
    (void)unused;
    if (trainer_ready(self) < 0) return NULL;
    return PyLong_FromLongLong(cmlp_trainer_last_microbatch(self->t));
}

static PyObject *Trainer_set_microbatch_state(TrainerObject *self, PyObject *args) {
    long long size, target, good, grown_from, wait;
    if (!PyArg_ParseTuple(args, "LLLLL", &size, &target, &good, &grown_from, &wait)) return NULL;
    if (trainer_ready(self) < 0) return NULL;
    ModelObject *mo = self->optim->model;
    cmlp_status st;
    RUN_LOCKED(mo, st, cmlp_trainer_set_microbatch_state(self->t, size, target, good, grown_from, wait));
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
     "skipped, grad_norm_sum, grad_norm_steps), the two sums the epoch's so far; with rates (at most "
     "MAX_RATES), one step at each (and at each momentum; with scales, each step's parts' multiples of its "
     "rate, and with part_momenta their momenta, NaN: the part's own)"},
    {"release_data", (PyCFunction)Trainer_release_data, METH_NOARGS, "free the device copy of the data set"},
    {"set_host_data", (PyCFunction)Trainer_set_host_data, METH_O,
     "True: keep the data set in host memory (and free a device copy); False: copy it to the device"},
    {"data_resident", (PyCFunction)Trainer_data_resident, METH_NOARGS, "whether the data set is on the device"},
    {"try_requests", (PyCFunction)Trainer_try_requests, METH_VARARGS,
     "try_requests([bytes, ...], drop_data): whether those requests, made in order now on the model's device, would "
     "be served, its copy of the data set freed first where drop_data (tried on a copy of the allocator)"},
    {"set_scaler", (PyCFunction)Trainer_set_scaler, METH_VARARGS,
     "set_scaler(enabled, scale, growth_factor, backoff_factor, growth_interval, growth_tracker)"},
    {"get_scaler", (PyCFunction)Trainer_get_scaler, METH_NOARGS, "(scale, growth_tracker)"},
    {"skipped_steps", (PyCFunction)Trainer_skipped_steps, METH_NOARGS, "steps skipped for inf/NaN gradients"},
    {"last_grad_norm", (PyCFunction)Trainer_last_grad_norm, METH_NOARGS,
     "the last step's gradient norm before clipping (None without clipping)"},
    {"oom_retries", (PyCFunction)Trainer_oom_retries, METH_NOARGS, "steps retried with a smaller micro-batch"},
    {"graph_counts", (PyCFunction)Trainer_graph_counts, METH_NOARGS,
     "(captures kept, replays, captures dropped) of full steps on a device with graphs"},
    {"start_microbatch", (PyCFunction)Trainer_start_microbatch, METH_O, "compute with a smaller micro-batch for now"},
    {"microbatch_state", (PyCFunction)Trainer_microbatch_state, METH_NOARGS, "(size, target, good_steps, grown_from, grow_wait)"},
    {"run_steps", (PyCFunction)Trainer_run_steps, METH_NOARGS, "the steps the last epoch_run took (failed or not)"},
    {"last_microbatch", (PyCFunction)Trainer_last_microbatch, METH_NOARGS,
     "the micro-batch the last step that completed ran with (0: none yet)"},
    {"set_microbatch_state", (PyCFunction)Trainer_set_microbatch_state, METH_VARARGS,
     "set_microbatch_state(size, target, good_steps, grown_from, grow_wait)"},
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

PyType_Spec Trainer_spec = {"cmlp._cmlp.Trainer", sizeof(TrainerObject), 0, Py_TPFLAGS_DEFAULT, Trainer_slots};
