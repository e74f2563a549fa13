/* cuda_loader.c - finds the CUDA backend. It lives in its own shared library, _cmlp_cuda.so
 * beside this module (or at $CMLP_CUDA_LIBRARY), loaded on the first question about CUDA, so
 * that cmlp imports and runs on the CPU where there is no CUDA driver or GPU at all. Why CUDA
 * is unavailable (no library, no driver, no device) is kept for the error messages.
 */
#include "internal.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if CMLP_WITH_CUDA
#include <dlfcn.h>

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static const cmlp_cuda_module *module;
static int ndevices;
static char why[512];
static bool forked; /* this process is a child forked after CUDA was loaded */

static void mark_forked(void) { forked = true; }

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
    pthread_atfork(NULL, NULL, mark_forked); /* before the device count, which starts the driver */
    ndevices = m->device_count(why, sizeof why);
}

int cmlp_cuda_forked(void) {
    pthread_once(&load_once, load);
    return forked;
}

int cmlp_cuda_device_count(void) {
    pthread_once(&load_once, load);
    return ndevices;
}

const char *cmlp_cuda_unavailable_reason(void) {
    pthread_once(&load_once, load);
    return ndevices > 0 ? "" : why;
}

const cmlp_backend_i *cmlp_cuda_backend(void) {
    pthread_once(&load_once, load);
    return module ? module->backend : NULL;
}

int cmlp_cuda_runtime_version(void) {
    pthread_once(&load_once, load);
    return module ? module->runtime_version() : 0;
}

#else

int cmlp_cuda_device_count(void) { return 0; }
int cmlp_cuda_forked(void) { return 0; }
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
