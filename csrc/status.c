/* status.c - status codes, the thread-local error message and build facts. */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#ifndef CMLP_VERSION
#define CMLP_VERSION "0.0.0"
#endif

static _Thread_local char last_error[2048];

cmlp_status cmlp_set_error(cmlp_status s, const char *file, int line, const char *fmt, ...) {
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    int n = snprintf(last_error, sizeof last_error, "%s:%d: ", base, line);
    if (n < 0 || (size_t)n >= sizeof last_error) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
    va_end(ap);
    return s;
}

const char *cmlp_last_error(void) { return last_error; }

const char *cmlp_error_text(const char *msg) {
    const char *p = msg;
    while ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '_' ||
           *p == '.' || *p == '/')
        p++;
    if (p - msg < 3 || p[-2] != '.' || (p[-1] != 'c' && p[-1] != 'h') || *p++ != ':') return msg;
    if (*p < '0' || *p > '9') return msg;
    while (*p >= '0' && *p <= '9') p++;
    return p[0] == ':' && p[1] == ' ' ? p + 2 : msg;
}

void cmlp_restore_error(const char *saved) {
    if (saved != last_error) snprintf(last_error, sizeof last_error, "%s", saved);
}

const char *cmlp_status_name(cmlp_status s) {
    switch (s) {
    case CMLP_OK: return "CMLP_OK";
    case CMLP_ERR_INVALID: return "CMLP_ERR_INVALID";
    case CMLP_ERR_NONFINITE: return "CMLP_ERR_NONFINITE";
    case CMLP_ERR_OOM: return "CMLP_ERR_OOM";
    case CMLP_ERR_DEVICE: return "CMLP_ERR_DEVICE";
    case CMLP_ERR_STATE: return "CMLP_ERR_STATE";
    case CMLP_ERR_INTERNAL: return "CMLP_ERR_INTERNAL";
    }
    return "CMLP_ERR_UNKNOWN";
}

const char *cmlp_version(void) { return CMLP_VERSION; }

const char *cmlp_compiler_info(void) {
#if defined(__clang__)
    return "clang " __clang_version__;
#elif defined(__GNUC__)
    return "gcc " __VERSION__;
#else
    return "unknown";
#endif
}
