/* _cmlp_memory.c - the memory functions: statistics, limits, raw allocations, the
 * allocator's settings, and snapshots of segments and history as PyTorch's dictionaries.
 */
#include "_cmlp.h"

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

/* The statistics of the device named by arg (0), or -1 with the exception set. */
static int stats_of(PyObject *mod, PyObject *arg, cmlp_memory_stats *s) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return -1;
    cmlp_status st;
    GUARDED(st = cmlp_memory_stats_get(d, s));
    if (st != CMLP_OK) {
        raise_status(state_of(mod), st);
        return -1;
    }
    return 0;
}

static PyObject *mod_memory_stats(PyObject *mod, PyObject *arg) {
    cmlp_memory_stats s;
    if (stats_of(mod, arg, &s) < 0) return NULL;
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

/* memory_stats(device)["limit"] without the dict (a trainer's step asks at each call) */
static PyObject *mod_memory_limit(PyObject *mod, PyObject *arg) {
    cmlp_memory_stats s;
    return stats_of(mod, arg, &s) < 0 ? NULL : PyLong_FromLongLong(s.limit);
}

typedef cmlp_status (*device_fn)(cmlp_device);

static PyObject *call_device_fn(PyObject *mod, PyObject *arg, device_fn fn) {
    cmlp_device d;
    if (parse_device(state_of(mod), arg, &d) < 0) return NULL;
    cmlp_status st;
    CALL_CORE(st = fn(d)); /* (the segments empty_cache returns are noted with the caller's stack) */
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

/* A list of request sizes (at most CMLP_TRY_REQUESTS ints) into out; its length, or -1. */
Py_ssize_t request_list(PyObject *list, int64_t *out) {
    PyObject *items = items_of(list, "requests must be a list of ints"); /* (an __index__ may change the list) */
    if (!items) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    if (n > CMLP_TRY_REQUESTS) {
        Py_DECREF(items);
        PyErr_Format(PyExc_ValueError, "at most %d requests can be tried, got %zd", CMLP_TRY_REQUESTS, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(items, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(items);
            return -1;
        }
        out[i] = v;
    }
    Py_DECREF(items);
    return n;
}

static PyObject *mod_try_requests(PyObject *mod, PyObject *args) {
    PyObject *dev, *list;
    if (!PyArg_ParseTuple(args, "OO!", &dev, &PyList_Type, &list)) return NULL;
    cmlp_device d;
    if (parse_device(state_of(mod), dev, &d) < 0) return NULL;
    int64_t req[CMLP_TRY_REQUESTS];
    Py_ssize_t n = request_list(list, req);
    if (n < 0) return NULL;
    int served = 0;
    cmlp_status st;
    GUARDED(st = cmlp_memory_try_requests(d, req, (int)n, &served));
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
    PyObject *r = PyLong_FromVoidPtr(p);
    if (!r) GUARDED((void)cmlp_memory_free(d, p)); /* the caller would never learn the address */
    return r;
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

static PyObject *segments_list(cmlp_device d, const cmlp_segment_info *segs, int64_t ns, const cmlp_block_info *blks) {
    PyObject *list = PyList_New((Py_ssize_t)ns), *dev = device_str(d);
    if (!dev) Py_CLEAR(list);
    for (int64_t i = 0; list && dev && i < ns; i++) {
        const cmlp_segment_info *s = &segs[i];
        PyObject *blocks = PyList_New((Py_ssize_t)s->nblocks);
        for (int64_t j = 0; blocks && j < s->nblocks; j++) {
            PyObject *b = block_dict(&blks[s->first_block + j]);
            if (!b) Py_CLEAR(blocks);
            else PyList_SET_ITEM(blocks, (Py_ssize_t)j, b);
        }
        PyObject *seg = blocks ? Py_BuildValue("{s:K,s:O,s:L,s:L,s:L,s:L,s:s,s:O,s:z,s:L,s:N}", "address",
                                               (unsigned long long)s->address, "device", dev, "total_size",
                                               (long long)s->total_size, "allocated_size", (long long)s->allocated_size,
                                               "active_size", (long long)s->active_size, "requested_size",
                                               (long long)s->requested_size, "segment_type",
                                               s->pool == CMLP_POOL_SMALL ? "small" : "large", "expandable",
                                               s->expandable ? Py_True : Py_False, "what", s->what, "context",
                                               (long long)s->context, "blocks", blocks)
                              : NULL;
        if (!seg) { /* (blocks is NULL, or Py_BuildValue's "N" took it, failing too) */
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

static PyObject *mod_set_caching(PyObject *mod, PyObject *arg) {
    (void)mod;
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    cmlp_memory_set_caching(on);
    Py_RETURN_NONE;
}

static PyObject *mod_get_settings(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    cmlp_alloc_settings c;
    cmlp_memory_get_settings(&c);
    PyObject *div = PyList_New(CMLP_ROUNDUP_INTERVALS);
    if (!div) return NULL;
    for (int i = 0; i < CMLP_ROUNDUP_INTERVALS; i++) {
        PyObject *v = PyLong_FromLong(c.roundup_power2_divisions[i]);
        if (!v) {
            Py_DECREF(div);
            return NULL;
        }
        PyList_SET_ITEM(div, i, v);
    }
    char *text = cmlp_memory_settings_text();
    if (!text) {
        Py_DECREF(div);
        return PyErr_NoMemory();
    }
    PyObject *out = Py_BuildValue(
        "{s:L,s:d,s:N,s:O,s:L,s:L,s:d,s:O,s:O,s:O,s:O,s:i,s:s,s:O}", "max_split_size", (long long)c.max_split_size,
        "garbage_collection_threshold", c.garbage_collection_threshold, "roundup_power2_divisions", div,
        "expandable_segments", c.expandable_segments ? Py_True : Py_False, "large_segment_size",
        (long long)c.large_segment_size, "max_non_split_rounding", (long long)c.max_non_split_rounding,
        "per_process_memory_fraction", c.per_process_memory_fraction, "backend_async",
        c.backend_async ? Py_True : Py_False, "release_lock_on_cudamalloc",
        c.release_lock_on_cudamalloc ? Py_True : Py_False, "pinned_use_host_register",
        c.pinned_use_host_register ? Py_True : Py_False, "graph_capture_record_stream_reuse",
        c.graph_capture_record_stream_reuse ? Py_True : Py_False, "pinned_num_register_threads",
        c.pinned_num_register_threads, "text", text, "caching_disabled",
        cmlp_memory_caching_disabled() ? Py_True : Py_False);
    free(text);
    return out;
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


PyMethodDef cmlp_py_memory_methods[] = {
    {"memory_stats", mod_memory_stats, METH_O, "memory_stats(device) -> dict"},
    {"memory_limit", mod_memory_limit, METH_O, "memory_limit(device) -> bytes, or -1 for none"},
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
    {"configure", mod_configure, METH_O, "set the allocator options (PyTorch syntax)"},
    {"get_settings", mod_get_settings, METH_NOARGS, "the allocator options in force"},
    {"set_caching", mod_set_caching, METH_O, "set_caching(on): caching on or off for every allocator"},
    {"note_env", mod_note_env, METH_O, "note_env('VAR=value' or None): the settings the environment gave at import"},
    {"validate", mod_validate, METH_O, "check the allocator's invariants"},
    {"fail_raw_alloc", mod_fail_raw_alloc, METH_VARARGS, "test hook: fail the k-th raw device call from now"},
    {"try_requests", mod_try_requests, METH_VARARGS,
     "try_requests(device, [bytes, ...]): whether those requests, made in order now, would be served (tried on a "
     "copy of the allocator: nothing changes)"},
    {NULL, NULL, 0, NULL},
};
