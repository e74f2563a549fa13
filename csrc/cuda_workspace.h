/* cuda_workspace.h - the workspace block a CUDA device holds from the moment it opens: its size
 * as the backend makes it and the planner plans it, for a GPU that is here or one described
 * (cmlp_gpu_desc). No CUDA header: a build without CUDA plans for a GPU too.
 *
 * The block: the first stream's share (8 MiB, 32 MiB on compute capability 9.x to 12.x, as torch
 * sizes cuBLAS's; with CUBLASLT_WORKSPACE_SIZE, that many KiB plus the slots), the last BIAS_SLOT +
 * XENT_SLOT of it the kernels' slots, then the second stream's two shares (its GEMMs have few
 * rows to sum, CMLP_SIDE_ROWS, and its bias gradients few partial sums).
 */
#ifndef CMLP_CUDA_WORKSPACE_H
#define CMLP_CUDA_WORKSPACE_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>

#define CMLP_CUDA_XENT_SCRATCH (4096 * 8 + 64) /* kernels.h's CMLP_K_XENT_SCRATCH (checked there) */
#define SIDE_WORKSPACE ((size_t)1 << 20)
#define BIAS_SLOT ((size_t)256 << 10) /* 64Ki fp32 or 128Ki half values */
#define XENT_SLOT (((size_t)CMLP_CUDA_XENT_SCRATCH + 255) & ~(size_t)255)
#define FIRST_WS_MAX_KIB (4 << 20) /* 4 GiB */

/* CUBLASLT_WORKSPACE_SIZE, the KiB cuBLASLt gets on the first stream (torch's variable): *kib is
 * -1 where it is not set (or empty), else a whole number from 0 to FIRST_WS_MAX_KIB; false (and
 * *text the value) for any other value. */
static inline bool cmlp_cuda_workspace_env(long long *kib, const char **text) {
    const char *env = getenv("CUBLASLT_WORKSPACE_SIZE");
    *kib = -1;
    *text = env;
    if (!env || !env[0]) return true;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(env, &end, 10);
    while (end && (*end == ' ' || *end == '\t')) end++;
    if (errno || !end || *end || end == env || v < 0 || v > FIRST_WS_MAX_KIB) return false;
    *kib = v;
    return true;
}

/* The first stream's share of the block on a GPU of compute capability `major`: kib KiB plus the
 * slots where kib >= 0 (CUBLASLT_WORKSPACE_SIZE), else torch's size for cuBLAS there (the slots
 * inside it). */
static inline size_t cmlp_cuda_first_workspace(int major, long long kib) {
    if (kib >= 0) return ((size_t)kib << 10) + BIAS_SLOT + XENT_SLOT;
    const bool large = major >= 9 && major <= 12; /* Hopper, Blackwell and Thor */
    return (size_t)(large ? 32 : 8) << 20;
}

/* The whole block, of a first stream's share. */
static inline size_t cmlp_cuda_workspace_bytes(size_t first) { return first + 2 * SIDE_WORKSPACE; }

#endif
