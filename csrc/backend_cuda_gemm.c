/* backend_cuda_gemm.c - GEMMs through cuBLASLt: fp32 (TF32 where asked for), fp16 and
 * bf16 with fp32 accumulation, fused bias and ReLU epilogues, and a cache of plans per shape,
 * layout and alignment; cuBLAS for a GEMM cuBLASLt has no algorithm for.
 */
#include "backend_cuda.h"

/* ---- GEMM: cuBLASLt, with a cache of plans per shape, layout and alignment ---- */

static unsigned align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    unsigned al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1; /* half-precision views may be 2-byte aligned */
    return al;
}

static void plan_free(gemm_plan *p) {
    if (!p->used) return;
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->c) cublasLtMatrixLayoutDestroy(p->c);
    memset(p, 0, sizeof *p);
}

/* One GEMM as cuBLASLt sees it: row-major C[m,n] = op(A) op(B) is column-major
 * C^T[n,m] = op(B)^T op(A)^T, so cuBLASLt's "A" is our B and its "B" is our A. */
typedef struct {
    int ta, tb;
    int64_t m, n, k, lda, ldb, ldc;
    cudaDataType_t ab, cd;          /* A and B; C and D */
    cublasLtEpilogue_t epilogue;    /* DEFAULT, BIAS or RELU_BIAS (bias: cd elements, [n]) */
} gemm_desc;

static cmlp_status plan_make(cuda_ctx *c, gemm_plan *p, const uint64_t key[8], const gemm_desc *g, unsigned al_a,
                             unsigned al_b, unsigned al_c, const void *d_bias, size_t ws, bool *no_algo) {
    /* TF32 only where A and B are float and it was asked for */
    cublasComputeType_t ct = c->tf32 && g->ab == CUDA_R_32F ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    cublasOperation_t op_l = g->tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_r = g->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    uint64_t m = (uint64_t)g->m, n = (uint64_t)g->n, k = (uint64_t)g->k;
    memset(p, 0, sizeof *p);
    LT_TRY(cublasLtMatmulDescCreate(&p->op, ct, CUDA_R_32F));
    p->used = true; /* from here plan_free releases what exists; the rest are NULL */
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_l, sizeof op_l));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_r, sizeof op_r));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &g->epilogue, sizeof g->epilogue));
    /* the heuristic reads the bias pointer's alignment from the pointer itself (the key has it) */
    if (g->epilogue != CUBLASLT_EPILOGUE_DEFAULT)
        LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &d_bias, sizeof d_bias));
    /* stored shapes (before op), column-major */
    LT_TRY(cublasLtMatrixLayoutCreate(&p->a, g->ab, g->tb ? k : n, g->tb ? n : k, g->ldb));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->b, g->ab, g->ta ? m : k, g->ta ? k : m, g->lda));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->c, g->cd, n, m, g->ldc));
    cublasLtMatmulPreference_t pref = NULL;
    LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
    uint32_t aa = al_b, ab = al_a, ac = al_c; /* cuBLASLt's A is our B */
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac);
    /* a half-precision D: split-K's partial sums are added in fp32 (in the workspace), never in
     * D's type (in place in D, or in the workspace), as the cuBLAS fallback's math mode asks */
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    if (s == CUBLAS_STATUS_SUCCESS && (g->cd == CUDA_R_16F || g->cd == CUDA_R_16BF))
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                 sizeof schemes);
    cublasLtMatmulHeuristicResult_t h;
    int found = 0;
    bool asked = false;
    if (s == CUBLAS_STATUS_SUCCESS) {
        asked = true;
        s = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &h, &found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
        /* a heuristic that fails is no algorithm too (INVALID_VALUE for an epilogue on a GEMM with
         * a side of 1, as PyTorch has seen): the GEMM goes without it, as where none is found */
        *no_algo = asked;
        plan_free(p);
        if (*no_algo && g->epilogue == CUBLASLT_EPILOGUE_DEFAULT) return CMLP_ERR_DEVICE; /* cuBLAS runs it */
        return FAIL(CMLP_ERR_DEVICE, "cuBLASLt has no algorithm for a GEMM of %lld x %lld x %lld (%s)", (long long)g->m,
                    (long long)g->n, (long long)g->k,
                    s == CUBLAS_STATUS_SUCCESS ? "none found" : cublasLtGetStatusString(s));
    }
    p->algo = h.algo;
    memcpy(p->key, key, sizeof p->key);
    int32_t splitk = 0; /* (unknown: not safe) */
    uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_INPLACE;
    size_t w;
    if (cublasLtMatmulAlgoConfigGetAttribute(&p->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &w) ||
        cublasLtMatmulAlgoConfigGetAttribute(&p->algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof scheme,
                                             &w))
        splitk = 0, scheme = CUBLASLT_REDUCTION_SCHEME_INPLACE;
    p->rerun_safe = splitk == 1 || (splitk > 1 && (scheme == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE ||
                                                   scheme == CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE));
    return CMLP_OK;
}

/* A GEMM call's failure; out of device memory (ALLOC_FAILED, or the launch's error: what cuBLAS
 * loads or makes on first use, outside the caching allocator) is CMLP_ERR_OOM, as CUDA's
 * (cuda_fail). So is one that failed to execute where it was loading its kernels (see
 * gemm_failed), as done() words it. */
static cmlp_status blas_fail(cublasStatus_t s, cudaError_t e, bool loading, const char *what, const gemm_desc *g) {
    if (s == CUBLAS_STATUS_EXECUTION_FAILED && loading && e != cudaErrorMemoryAllocation)
        return FAIL(CMLP_ERR_OOM, "CUDA out of memory at a launch: CUDA loads a kernel's code at its first launch, "
                    "into device memory outside the caching allocator, and the memory in use leaves none. Free "
                    "tensors or release cached memory (cmlp.cuda.empty_cache()) and retry. The launch: %s (%lld x "
                    "%lld x %lld), which failed to execute with little device memory free (%s)", what, (long long)g->m,
                    (long long)g->n, (long long)g->k, cublasLtGetStatusString(s));
    if (s == CUBLAS_STATUS_ALLOC_FAILED || e == cudaErrorMemoryAllocation)
        return FAIL(CMLP_ERR_OOM, "CUDA out of memory in cuBLAS: what it loads or makes on first use needs device "
                    "memory outside the caching allocator. Release cached memory (cmlp.cuda.empty_cache()) and "
                    "retry. The call: %s (%lld x %lld x %lld): %s", what, (long long)g->m, (long long)g->n,
                    (long long)g->k, cublasLtGetStatusString(s));
    return FAIL(CMLP_ERR_DEVICE, "%s (%lld x %lld x %lld) failed: %s", what, (long long)g->m, (long long)g->n,
                (long long)g->k, cublasLtGetStatusString(s));
}

/* What again (lt_gemm_once) says: give the cache back and run once more, or give it back only. */
enum { RERUN = 1, GIVE_BACK = 2 };

/* Below this much free device memory, a GEMM that failed to execute (the launch's error taken
 * by cuBLAS, none pending) is taken for kernels that found no room to load: the modules cuBLAS
 * loads take some MiB. With more free, it is the device error it says. */
#define LOAD_ROOM ((size_t)256 << 20)

/* A GEMM that failed (s), by cuBLASLt or cuBLAS: its error. Where it failed as one whose kernels
 * found no room to load does (out of memory, or failing to execute with little memory free and
 * no other launch error pending: a plan's first run, or a kernel of its not launched before, as
 * for another beta), *again (when given) says to give the cache back, and to run once more where
 * that gives what one run would (beta 0, or rerun_safe: nothing written to C before the last
 * pass). */
static cmlp_status gemm_failed(cublasStatus_t s, float beta, bool rerun_safe, const char *what, const gemm_desc *g,
                               int *again) {
    cudaError_t e = cudaGetLastError();
    size_t free_b = 0, total = 0;
    bool loading = s == CUBLAS_STATUS_ALLOC_FAILED || e == cudaErrorMemoryAllocation ||
                   (s == CUBLAS_STATUS_EXECUTION_FAILED && e == cudaSuccess && !thread_capturing() &&
                    cudaMemGetInfo(&free_b, &total) == cudaSuccess && free_b < LOAD_ROOM);
    (void)cudaGetLastError(); /* (cudaMemGetInfo's, if it failed) */
    if (loading && again) *again = beta == 0.0f || rerun_safe ? RERUN : GIVE_BACK;
    return blas_fail(s, e, loading, what, g);
}

/* A GEMM without an epilogue that cuBLASLt has no algorithm for goes to cuBLAS's cublasGemmEx,
 * which takes any alignment the elements have (as torch's plain matrix products do): the same
 * types and compute type, fp32 accumulation (no reduction in half precision). The handle is
 * made on the first such GEMM, outside a capture (making it allocates); it runs on the stream
 * this thread queues to, with that stream's workspace. Under c->lock. */
static cmlp_status blas_gemm(cuda_ctx *c, const gemm_desc *g, float alpha, const void *d_a, const void *d_b,
                             float beta, void *d_c, void *ws, size_t ws_bytes, int *again) {
    const int64_t dims[6] = {g->m, g->n, g->k, g->lda, g->ldb, g->ldc};
    for (int i = 0; i < 6; i++)
        if (dims[i] > INT32_MAX)
            return FAIL(CMLP_ERR_DEVICE, "cuBLASLt has no algorithm for a GEMM of %lld x %lld x %lld, too large for "
                        "cuBLAS's cublasGemmEx", (long long)g->m, (long long)g->n, (long long)g->k);
    if (!c->blas) {
        if (thread_capturing())
            return FAIL(CMLP_ERR_DEVICE, "cuBLASLt has no algorithm for a GEMM of %lld x %lld x %lld, and cuBLAS "
                        "cannot start while a training step is being captured as a graph", (long long)g->m,
                        (long long)g->n, (long long)g->k);
        cublasHandle_t h = NULL;
        cublasStatus_t s = cublasCreate(&h);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasSetMathMode(h, CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
        if (s != CUBLAS_STATUS_SUCCESS) {
            if (h) cublasDestroy(h);
            return blas_fail(s, cudaGetLastError(), false, "cublasCreate (for a GEMM cuBLASLt has no algorithm for)",
                             g);
        }
        c->blas = h;
    }
    if ((uintptr_t)ws % 256) ws = NULL, ws_bytes = 0; /* cuBLAS's rule; without one it picks another kernel */
    const cublasComputeType_t ct =
        c->tf32 && g->ab == CUDA_R_32F ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const cublasOperation_t op_l = g->tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_r = g->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasStatus_t s = cublasSetStream(c->blas, stream_of(c));
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetWorkspace(c->blas, ws, ws_bytes);
    if (s == CUBLAS_STATUS_SUCCESS) /* column-major, as in plan_make: cuBLAS's A is our B */
        s = cublasGemmEx(c->blas, op_l, op_r, (int)g->n, (int)g->m, (int)g->k, &alpha, d_b, g->ab, (int)g->ldb, d_a,
                         g->ab, (int)g->lda, &beta, d_c, g->cd, (int)g->ldc, ct, CUBLAS_GEMM_DEFAULT);
    /* (its algorithm unknown: a split-K of its own may have added to C) */
    if (s != CUBLAS_STATUS_SUCCESS)
        return gemm_failed(s, beta, false, "cublasGemmEx (for a GEMM cuBLASLt has no algorithm for)", g, again);
    return CMLP_OK;
}

/* no_algo (may be NULL): set when cuBLASLt has no algorithm for this GEMM's epilogue (then
 * nothing ran); one without an epilogue goes to cuBLAS (blas_gemm). again (may be NULL): see
 * gemm_failed. */
static cmlp_status lt_gemm_once(cuda_ctx *c, const gemm_desc *g, float alpha, const void *d_a, const void *d_b,
                                float beta, void *d_c, const void *d_bias, bool *no_algo, int *again) {
    bool none = false;
    if (no_algo) *no_algo = false;
    if (g->m == 0 || g->n == 0) return CMLP_OK;
    if (g->k <= 0) return FAIL(CMLP_ERR_INVALID, "GEMM with k = %lld", (long long)g->k);
    CMLP_TRY_USE(c);
    /* a bias aligned to less than 16 bytes is read from the aligned slot (see bias_slot) */
    const void *bias_src = NULL;
    size_t bias_bytes = 0;
    if (d_bias && align_of(d_bias) < 16) {
        bias_bytes = (size_t)g->n * (g->cd == CUDA_R_32F ? 4 : 2);
        if (on_side(c) || !c->bias_slot || bias_bytes > BIAS_SLOT) { /* no fusing it: see gemm_bias */
            if (no_algo) *no_algo = true;
            return FAIL(CMLP_ERR_DEVICE,
                        "a fused bias of %lld values at an address aligned to %u bytes: cuBLASLt reads it 16 bytes "
                        "at a time, and the aligned slot holds %zu bytes",
                        (long long)g->n, align_of(d_bias), BIAS_SLOT);
        }
        bias_src = d_bias;
        d_bias = c->bias_slot;
    }
    unsigned al_a = align_of(d_a), al_b = align_of(d_b), al_c = align_of(d_c), al_bias = d_bias ? align_of(d_bias) : 0;
    size_t ws_bytes;
    void *ws = ws_of(c, &ws_bytes); /* the plan is chosen for the workspace it gets */
    uint64_t key[8] = {(uint64_t)g->m, (uint64_t)g->n, (uint64_t)g->k, (uint64_t)g->lda, (uint64_t)g->ldb,
                       (uint64_t)g->ldc,
                       (uint64_t)(g->ta != 0) | (uint64_t)(g->tb != 0) << 1 | (uint64_t)c->tf32 << 2 |
                           (uint64_t)on_side(c) << 3 |
                           (uint64_t)g->ab << 8 | (uint64_t)g->cd << 24 | (uint64_t)g->epilogue << 40,
                       (uint64_t)al_a | (uint64_t)al_b << 16 | (uint64_t)al_c << 32 | (uint64_t)al_bias << 48};
    pthread_mutex_lock(&c->lock);
    gemm_plan *p = NULL;
    for (int i = 0; i < NPLANS && !p; i++)
        if (c->plans[i].used && memcmp(c->plans[i].key, key, sizeof key) == 0) p = &c->plans[i];
    cmlp_status st = CMLP_OK;
    if (!p) { /* made aside, so that a key with no algorithm evicts no plan but one entry noting that */
        gemm_plan made;
        st = plan_make(c, &made, key, g, al_a, al_b, al_c, d_bias, ws_bytes, &none);
        if (st == CMLP_OK || none) {
            p = &c->plans[c->next_plan];
            c->next_plan = (c->next_plan + 1) % NPLANS;
            plan_free(p);
            if (st == CMLP_OK) *p = made;
            else *p = (gemm_plan){.used = true, .none = true};
            memcpy(p->key, key, sizeof key);
        } else {
            plan_free(&made); /* what a failed descriptor call left */
        }
    } else if (p->none) {
        none = true;
        if (g->epilogue != CUBLASLT_EPILOGUE_DEFAULT) /* (a plain GEMM goes to cuBLAS below) */
            st = FAIL(CMLP_ERR_DEVICE, "cuBLASLt has no algorithm for a GEMM of %lld x %lld x %lld", (long long)g->m,
                  (long long)g->n, (long long)g->k);
    }
    if (none && g->epilogue == CUBLASLT_EPILOGUE_DEFAULT) {
        none = false;
        st = blas_gemm(c, g, alpha, d_a, d_b, beta, d_c, ws, ws_bytes, again);
        pthread_mutex_unlock(&c->lock);
        if (st == CMLP_OK && c->sync_each) st = done(c, cudaSuccess, "cublasGemmEx");
        return st;
    }
    if (no_algo) *no_algo = none;
    if (st == CMLP_OK && bias_src) { /* in stream order under the lock: no other GEMM's copy comes between */
        cudaError_t e = cudaMemcpyAsync(c->bias_slot, bias_src, bias_bytes, cudaMemcpyDeviceToDevice, stream_of(c));
        if (e != cudaSuccess) st = cuda_fail(e, "copying a bias to its aligned slot", __FILE__, __LINE__);
    }
    if (st == CMLP_OK && g->epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
        cublasStatus_t s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &d_bias,
                                                          sizeof d_bias);
        if (s != CUBLAS_STATUS_SUCCESS)
            st = FAIL(CMLP_ERR_DEVICE, "setting a GEMM's bias failed: %s", cublasLtGetStatusString(s));
    }
    if (st == CMLP_OK) {
        cublasStatus_t s = cublasLtMatmul(c->lt, p->op, &alpha, d_b, p->a, d_a, p->b, &beta, d_c, p->c, d_c, p->c,
                                          &p->algo, ws, ws_bytes, stream_of(c));
        if (s != CUBLAS_STATUS_SUCCESS) st = gemm_failed(s, beta, p->rerun_safe, "cublasLtMatmul", g, again);
    }
    pthread_mutex_unlock(&c->lock);
    if (st == CMLP_OK && c->sync_each) st = done(c, cudaSuccess, "cublasLtMatmul");
    return st;
}

/* cuBLASLt (and cuBLAS) load a GEMM's kernels at their first launch (lazy loading), into device
 * memory the caching allocator may hold: as a kernel's launch does (KERNEL), a GEMM that found no
 * room has the cache given back to the device (outside the lock) and is made once more. Where a
 * pass may have added to C already (beta != 0 with an in-place split-K, or cuBLAS's algorithm),
 * it is not: the out-of-memory stands, and the caller's retry (a training step's, in smaller
 * micro-batches) finds the room. */
static cmlp_status lt_gemm(cuda_ctx *c, const gemm_desc *g, float alpha, const void *d_a, const void *d_b, float beta,
                           void *d_c, const void *d_bias, bool *no_algo) {
    int again = 0;
    cmlp_status st = lt_gemm_once(c, g, alpha, d_a, d_b, beta, d_c, d_bias, no_algo, &again);
    if (again && relaunch(c) && again == RERUN)
        st = lt_gemm_once(c, g, alpha, d_a, d_b, beta, d_c, d_bias, no_algo, NULL);
    return st;
}

static cmlp_status cu_gemm(void *ctx, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, const float *d_a,
                           int64_t lda, const float *d_b, int64_t ldb, float beta, float *d_c, int64_t ldc) {
    gemm_desc g = {ta, tb, m, n, k, lda, ldb, ldc, CUDA_R_32F, CUDA_R_32F, CUBLASLT_EPILOGUE_DEFAULT};
    return lt_gemm(ctx, &g, alpha, d_a, d_b, beta, d_c, NULL, NULL);
}

/* cuBLASLt's bias epilogue has failed to run (CUBLAS_STATUS_EXECUTION_FAILED) on GEMMs with a
 * side of 65535 x 32 or more, and its heuristic fails (INVALID_VALUE) for one with a side of 1,
 * which torch's addmm therefore does without: so does gemm_bias. */
#define TALL_GEMM ((int64_t)65535 * 32)

/* C = alpha op(A) op(B) with the bias (and ReLU) fused where cuBLASLt has an algorithm for
 * that. Where it has none, or a side is TALL_GEMM or more or 1 (rows of C contiguous): in fp32 the
 * GEMM, then the bias kernel; in half precision C's rows set to the bias, the GEMM adding to
 * them, then the ReLU, which gives the fused epilogue's values (the sum in fp32, rounded once). */
static cmlp_status gemm_bias(cuda_ctx *c, gemm_desc *g, float alpha, const void *d_a, const void *d_b, void *d_c,
                             const void *d_bias, int relu) {
    cmlp_status st;
    const bool fused = g->m < TALL_GEMM && g->n < TALL_GEMM && g->k < TALL_GEMM && g->m > 1 && g->n > 1 && g->k > 1;
    if (g->ldc != g->n || fused) {
        bool none;
        st = lt_gemm(c, g, alpha, d_a, d_b, 0.0f, d_c, d_bias, &none);
        if (st == CMLP_OK || !none || g->ldc != g->n) return st;
    }
    g->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    if (g->cd == CUDA_R_32F) {
        st = lt_gemm(c, g, alpha, d_a, d_b, 0.0f, d_c, NULL, NULL);
        return st != CMLP_OK ? st : KERNEL(c, cmlp_k_bias_act(d_c, d_bias, g->m, g->n, relu, stream_of(c)));
    }
    const int bf16 = g->cd == CUDA_R_16BF;
    st = KERNEL(c, cmlp_k_rows_half(d_c, d_bias, g->m, g->n, bf16, stream_of(c)));
    if (st == CMLP_OK) st = lt_gemm(c, g, alpha, d_a, d_b, 1.0f, d_c, NULL, NULL);
    if (st == CMLP_OK && relu) st = KERNEL(c, cmlp_k_rows_half(d_c, NULL, g->m, g->n, bf16, stream_of(c)));
    return st;
}

static cmlp_status cu_gemm_bias_act(void *ctx, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *d_a,
                                    int64_t lda, const float *d_b, int64_t ldb, float *d_c, int64_t ldc,
                                    const float *d_bias, int relu) {
    gemm_desc g = {ta, tb, m, n, k, lda, ldb, ldc, CUDA_R_32F, CUDA_R_32F,
                   relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS};
    return gemm_bias(ctx, &g, 1.0f, d_a, d_b, d_c, d_bias, relu);
}

static cudaDataType_t cuda_type(cmlp_dtype t) {
    return t == CMLP_DTYPE_F16 ? CUDA_R_16F : t == CMLP_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

static cmlp_status cu_gemm_half(void *ctx, int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha,
                                const uint16_t *d_a, int64_t lda, const uint16_t *d_b, int64_t ldb, cmlp_dtype ab,
                                float beta, void *d_c, cmlp_dtype c_type, int64_t ldc, const void *d_bias, int relu) {
    gemm_desc g = {ta, tb, m, n, k, lda, ldb, ldc, cuda_type(ab), cuda_type(c_type),
                   !d_bias ? CUBLASLT_EPILOGUE_DEFAULT : relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS};
    if (relu && !d_bias) return FAIL(CMLP_ERR_INVALID, "a GEMM's ReLU epilogue comes with its bias");
    if (d_bias && beta == 0.0f) return gemm_bias(ctx, &g, alpha, d_a, d_b, d_c, d_bias, relu);
    return lt_gemm(ctx, &g, alpha, d_a, d_b, beta, d_c, d_bias, NULL);
}

void cuda_plans_free(cuda_ctx *c) {
    for (int i = 0; i < NPLANS; i++) plan_free(&c->plans[i]);
}

void cuda_gemm_ops(cmlp_backend_i *b) {
    b->gemm = cu_gemm;
    b->gemm_bias_act = cu_gemm_bias_act;
    b->gemm_half = cu_gemm_half;
}
