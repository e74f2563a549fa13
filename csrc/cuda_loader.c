/* cuda_loader.c - finds the CUDA backend. It lives in its own shared library, _cmlp_cuda.so
 * beside this module (or at $CMLP_CUDA_LIBRARY), loaded on the first question about CUDA, so
 * that cmlp imports and runs on the CPU where there is no CUDA driver or GPU at all. Why CUDA
 * is unavailable (no library, no driver, no device) is kept for the error messages.
 *
 * Loading the library starts nothing; counting the devices starts the CUDA driver, which does
 * not survive fork(). NVML (the driver's management library, $CMLP_NVML_LIBRARY or
 * libnvidia-ml.so.1) counts them without starting it, for cmlp.cuda.device_count() in a process
 * that may fork workers (torch.cuda's NVML-based count).
 */
#include "internal.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if CMLP_WITH_CUDA
#include <dlfcn.h>

static pthread_once_t load_once = PTHREAD_ONCE_INIT, start_once = PTHREAD_ONCE_INIT;
static const cmlp_cuda_module *module;
static int ndevices;
static char why[512];
static bool started; /* the device count asked the driver (set before it is asked) */
static bool forked;  /* this process is a child forked after CUDA was started */

static void mark_forked(void) { forked = started; }

static void load(void) {
    char path[4096];
    const char *env = getenv("CMLP_CUDA_LIBRARY");
    if (env && env[0]) {
        snprintf(path, sizeof path, "%s", env);
    } else if (!cmlp_beside_module("_cmlp_cuda.so", path, sizeof path)) {
        snprintf(why, sizeof why, "cannot locate cmlp's own module to find _cmlp_cuda.so");
        return;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(why, sizeof why, "cannot load the CUDA backend: %s", dlerror());
        return;
    }
    cmlp_cuda_entry_fn entry = (cmlp_cuda_entry_fn)dlsym(h, "cmlp_cuda_entry");
    const cmlp_cuda_module *m = entry ? entry(cmlp_set_error) : NULL;
    if (!m || m->abi != CMLP_CUDA_ABI) {
        snprintf(why, sizeof why, "%.400s is not a CUDA backend of this version of cmlp", path);
        dlclose(h);
        return;
    }
    module = m;
    pthread_atfork(NULL, NULL, mark_forked);
}

static void start(void) {
    pthread_once(&load_once, load);
    if (!module) return;
    __atomic_store_n(&started, true, __ATOMIC_RELEASE);
    ndevices = module->device_count(why, sizeof why);
    if (ndevices > 0) return;
    /* without the driver's library CUDA says its version is insufficient: say there is none */
    void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (driver) {
        dlclose(driver);
    } else {
        char cuda[sizeof why];
        snprintf(cuda, sizeof cuda, "%s", why);
        snprintf(why, sizeof why, "no NVIDIA driver: libcuda.so.1 cannot be loaded; CUDA says %.300s", cuda);
    }
}

int cmlp_cuda_loadable(void) {
    pthread_once(&load_once, load);
    return module != NULL;
}

int cmlp_cuda_started(void) { return started; }

int cmlp_cuda_forked(void) { return forked; }

/* Nothing is saved before cmlp has started CUDA: asking the driver would start it, which a
 * process that forks later must not do. A call that names a GPU has it parsed first, which
 * starts CUDA, so every call that can make a context current finds CUDA started. */
void *cmlp_cuda_ctx_save(void) {
    if (!__atomic_load_n(&started, __ATOMIC_ACQUIRE) || forked || !module) return NULL;
    return module->ctx_save();
}

void cmlp_cuda_ctx_restore(void *saved) {
    if (saved && !forked && module) module->ctx_restore(saved);
}

int cmlp_cuda_device_count(void) {
    pthread_once(&start_once, start);
    return ndevices;
}

const char *cmlp_cuda_unavailable_reason(void) {
    pthread_once(&start_once, start);
    return ndevices > 0 ? "" : why;
}

const cmlp_backend_i *cmlp_cuda_backend(void) {
    pthread_once(&start_once, start);
    return module ? module->backend : NULL;
}

int cmlp_cuda_runtime_version(void) {
    pthread_once(&start_once, start);
    return module ? module->runtime_version() : 0;
}

cmlp_status cmlp_cuda_device_properties(int index, cmlp_device_props *out) {
    pthread_once(&start_once, start);
    if (forked) return CMLP_FAIL(CMLP_ERR_DEVICE, "cuda:%d: " CMLP_CUDA_FORKED_TEXT, index);
    if (ndevices <= 0) return CMLP_FAIL(CMLP_ERR_DEVICE, CMLP_CUDA_NONE_TEXT, why);
    if (index < 0 || index >= ndevices)
        return CMLP_FAIL(CMLP_ERR_DEVICE, "cuda:%d is not a device here (%d found)", index, ndevices);
    return module->device_properties(index, out);
}

/* ---- NVML ---- */

typedef int (*nvml_void_fn)(void);
typedef int (*nvml_count_fn)(unsigned *count);
typedef int (*nvml_handle_fn)(unsigned index, void **device);
typedef int (*nvml_uuid_fn)(void *device, char *uuid, unsigned length);

static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static int nvml_count = -1;
static char (*nvml_uuids)[CMLP_NVML_UUID_BYTES];

static void nvml_query(void) {
    const char *env = getenv("CMLP_NVML_LIBRARY");
    void *h = dlopen(env && env[0] ? env : "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    nvml_void_fn init = (nvml_void_fn)dlsym(h, "nvmlInit_v2"), shutdown = (nvml_void_fn)dlsym(h, "nvmlShutdown");
    nvml_count_fn count = (nvml_count_fn)dlsym(h, "nvmlDeviceGetCount_v2");
    nvml_handle_fn handle = (nvml_handle_fn)dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    nvml_uuid_fn uuid = (nvml_uuid_fn)dlsym(h, "nvmlDeviceGetUUID");
    if (!init || !shutdown || !count || !handle || !uuid || init() != 0) return; /* h stays: NVML may hold threads */
    unsigned n = 0;
    char(*ids)[CMLP_NVML_UUID_BYTES] = NULL;
    bool ok = count(&n) == 0 && n <= CMLP_NVML_MAX_DEVICES;
    if (ok && n > 0) ok = (ids = calloc(n, sizeof *ids)) != NULL;
    for (unsigned i = 0; ok && i < n; i++) {
        void *d = NULL;
        ok = handle(i, &d) == 0 && uuid(d, ids[i], CMLP_NVML_UUID_BYTES) == 0;
        ids[i][CMLP_NVML_UUID_BYTES - 1] = '\0';
    }
    (void)shutdown();
    if (!ok) {
        free(ids);
        return;
    }
    nvml_uuids = ids;
    nvml_count = (int)n;
}

int cmlp_nvml_devices(const char **uuids, int cap) {
    pthread_once(&nvml_once, nvml_query);
    for (int i = 0; i < nvml_count && i < cap; i++) uuids[i] = nvml_uuids[i];
    return nvml_count;
}

#else

int cmlp_cuda_device_count(void) { return 0; }
int cmlp_cuda_loadable(void) { return 0; }
int cmlp_cuda_started(void) { return 0; }
int cmlp_cuda_forked(void) { return 0; }
void *cmlp_cuda_ctx_save(void) { return NULL; }
void cmlp_cuda_ctx_restore(void *saved) { (void)saved; }
int cmlp_nvml_devices(const char **uuids, int cap) {
    (void)uuids;
    (void)cap;
    return -1;
}
cmlp_status cmlp_cuda_device_properties(int index, cmlp_device_props *out) {
    (void)index;
    (void)out;
    return CMLP_FAIL(CMLP_ERR_DEVICE, "this build of cmlp has no CUDA backend");
}
const char *cmlp_cuda_unavailable_reason(void) { return "this build of cmlp has no CUDA backend"; }
const cmlp_backend_i *cmlp_cuda_backend(void) { return NULL; }
int cmlp_cuda_runtime_version(void) { return 0; }

#endif

int cmlp_cuda_compiled(void) { return CMLP_WITH_CUDA; }

const char *cmlp_cuda_version(void) {
#if CMLP_WITH_CUDA && defined(CMLP_CUDA_VERSION)
    return CMLP_CUDA_VERSION;
#else
    return NULL;
#endif
}
