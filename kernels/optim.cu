/* optim.cu - the fused optimizer steps over flat parameter buffers: Adam and SGD (PyTorch's
 * rules). Each element is updated with the CPU backend's float operations in its order, so
 * both backends give the same bits. With found_inf set (an inf or NaN gradient under loss
 * scaling) the step changes nothing, decided on the device.
 */
#include "common.cuh"
#include "kernels.h"

/* ---- Adam ---- */

/* torch.maximum of two floats: a NaN in either gives a NaN */
__device__ __forceinline__ float max_nan(float a, float b) { return b > a || b != b ? b : a; }

struct adam_op {
    float *p;
    const float *g;
    float *m, *v;
    float *vmax; /* AMSGrad's running maximum of v, or NULL */
    float step_size, beta1, beta2, one_b1, one_b2, bc2_sqrt, eps, wd, decay;
    int maximize;
    const float *found_inf;
    const float *coef; /* when set: step_size, bc2_sqrt, decay, beta1 and one_b1 computed on the device */

    __device__ __forceinline__ bool begin() {
        if (found_inf && *found_inf != 0.0f) return true;
        if (coef) {
            step_size = coef[0];
            bc2_sqrt = coef[1];
            decay = coef[2];
            beta1 = coef[3];
            one_b1 = coef[4];
        }
        return false;
    }
    __device__ __forceinline__ void finish(bool) const {}

    /* vmi: AMSGrad's maximum, read and written only with vmax */
    __device__ __forceinline__ void update(float &pi, float gi, float &mi, float &vi, float &vmi) const {
        if (decay != 1.0f) pi = f_mul(pi, decay); /* decoupled weight decay (AdamW) */
        if (maximize) gi = -gi;
        if (wd != 0.0f) gi = f_add(gi, f_mul(wd, pi)); /* (as torch: none at 0, where an infinite weight makes NaN) */
        mi = f_add(f_mul(beta1, mi), f_mul(one_b1, gi));
        vi = f_add(f_mul(beta2, vi), f_mul(f_mul(one_b2, gi), gi));
        float d = vi;
        if (vmax) d = vmi = max_nan(vmi, vi);
        pi = f_sub(pi, f_div(f_mul(step_size, mi), f_add(f_div(f_sqrt(d), bc2_sqrt), eps)));
    }
    __device__ __forceinline__ bool one(int64_t i) const {
        float pi = p[i], mi = m[i], vi = v[i], vmi = vmax ? vmax[i] : 0.0f;
        update(pi, g[i], mi, vi, vmi);
        m[i] = mi;
        v[i] = vi;
        if (vmax) vmax[i] = vmi;
        p[i] = pi;
        return false;
    }
    __device__ __forceinline__ bool four(int64_t i) const {
        float4 p4 = *reinterpret_cast<const float4 *>(p + i), m4 = *reinterpret_cast<const float4 *>(m + i);
        float4 v4 = *reinterpret_cast<const float4 *>(v + i);
        float4 x4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (vmax) x4 = *reinterpret_cast<const float4 *>(vmax + i);
        const float4 g4 = *reinterpret_cast<const float4 *>(g + i);
        update(p4.x, g4.x, m4.x, v4.x, x4.x);
        update(p4.y, g4.y, m4.y, v4.y, x4.y);
        update(p4.z, g4.z, m4.z, v4.z, x4.z);
        update(p4.w, g4.w, m4.w, v4.w, x4.w);
        *reinterpret_cast<float4 *>(m + i) = m4;
        *reinterpret_cast<float4 *>(v + i) = v4;
        if (vmax) *reinterpret_cast<float4 *>(vmax + i) = x4;
        *reinterpret_cast<float4 *>(p + i) = p4;
        return false;
    }
};

static adam_op adam_make(float *p, const float *g, float *m, float *v, float *vmax, float step_size, float beta1,
                         float beta2, float one_b1, float one_b2, float bc2_sqrt, float eps, float weight_decay,
                         float decay, int maximize, const float *found_inf, const float *coef) {
    adam_op op;
    op.p = p;
    op.g = g;
    op.m = m;
    op.v = v;
    op.vmax = vmax;
    op.maximize = maximize;
    op.step_size = step_size;
    op.beta1 = beta1;
    op.beta2 = beta2;
    op.one_b1 = one_b1;
    op.one_b2 = one_b2;
    op.bc2_sqrt = bc2_sqrt;
    op.eps = eps;
    op.wd = weight_decay;
    op.decay = decay;
    op.found_inf = found_inf;
    op.coef = coef;
    return op;
}

extern "C" cudaError_t cmlp_k_adam(float *p, const float *g, float *m, float *v, float *vmax, int64_t n,
                                   float step_size, float beta1, float beta2, float one_b1, float one_b2,
                                   float bc2_sqrt, float eps, float weight_decay, float decay, int maximize,
                                   const float *found_inf, const float *coef, cudaStream_t stream) {
    if (n < 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    const adam_op op = adam_make(p, g, m, v, vmax, step_size, beta1, beta2, one_b1, one_b2, bc2_sqrt, eps,
                                 weight_decay, decay, maximize, found_inf, coef);
    const int mis[5] = {cmlp_misalign(p, 4), cmlp_misalign(g, 4), cmlp_misalign(m, 4), cmlp_misalign(v, 4),
                        cmlp_misalign(vmax ? vmax : p, 4)};
    return cmlp_launch_map(op, n, mis, 5, stream);
}

/* ---- SGD ---- */

struct sgd_op {
    float *p;
    const float *g;
    float *buf;
    float lr, momentum, keep, wd;
    int nesterov, plain; /* plain: momentum == 0, buf untouched */
    int maximize;
    const float *found_inf;
    const float *coef; /* when set: lr = coef[0] and momentum = coef[1], computed on the device */

    __device__ __forceinline__ bool begin() {
        if (found_inf && *found_inf != 0.0f) return true;
        if (coef) {
            lr = coef[0];
            momentum = coef[1];
            plain = momentum == 0.0f;
        }
        return false;
    }
    __device__ __forceinline__ void finish(bool) const {}

    /* returns the new momentum buffer value (unused when plain) */
    __device__ __forceinline__ float update(float &pi, float gi, float bi) const {
        if (maximize) gi = -gi;
        if (wd != 0.0f) gi = f_add(gi, f_mul(wd, pi));
        if (plain) {
            pi = f_sub(pi, f_mul(lr, gi));
            return bi;
        }
        const float b = __float_as_uint(bi) == CMLP_K_MOMENTUM_UNSTARTED ? gi /* not started */
                                                                          : f_add(f_mul(momentum, bi), f_mul(keep, gi));
        pi = f_sub(pi, f_mul(lr, nesterov ? f_add(gi, f_mul(momentum, b)) : b));
        return b;
    }
    __device__ __forceinline__ bool one(int64_t i) const {
        float pi = p[i];
        const float b = update(pi, g[i], plain ? 0.0f : buf[i]);
        if (!plain) buf[i] = b;
        p[i] = pi;
        return false;
    }
    __device__ __forceinline__ bool four(int64_t i) const {
        float4 p4 = *reinterpret_cast<const float4 *>(p + i);
        const float4 g4 = *reinterpret_cast<const float4 *>(g + i);
        float4 b4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (!plain) b4 = *reinterpret_cast<const float4 *>(buf + i);
        b4.x = update(p4.x, g4.x, b4.x);
        b4.y = update(p4.y, g4.y, b4.y);
        b4.z = update(p4.z, g4.z, b4.z);
        b4.w = update(p4.w, g4.w, b4.w);
        if (!plain) *reinterpret_cast<float4 *>(buf + i) = b4;
        *reinterpret_cast<float4 *>(p + i) = p4;
        return false;
    }
};

extern "C" cudaError_t cmlp_k_sgd(float *p, const float *g, float *buf, int64_t n, float lr, float momentum,
                                  float keep, int nesterov, float weight_decay, int maximize,
                                  const float *found_inf, const float *coef, cudaStream_t stream) {
    if (n < 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    sgd_op op;
    op.p = p;
    op.g = g;
    op.buf = buf;
    op.lr = lr;
    op.momentum = momentum;
    op.keep = keep;
    op.wd = weight_decay;
    op.nesterov = nesterov;
    op.maximize = maximize;
    op.plain = momentum == 0.0f;
    op.found_inf = found_inf;
    op.coef = coef;
    /* buf takes part in the alignment only when it may be touched (with coef the momentum is the device's) */
    const bool touched = buf && (coef || !op.plain);
    const int mis[3] = {cmlp_misalign(p, 4), cmlp_misalign(g, 4), cmlp_misalign(touched ? buf : p, 4)};
    return cmlp_launch_map(op, n, mis, 3, stream);
}

__global__ void k_probe() {}

extern "C" cudaError_t cmlp_k_probe(void) {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, (const void *)k_probe);
}


/* ---- the step count and Adam's bias corrections, on the device ---- */

/* ---- the loss-scale update ----
 * As torch's _amp_update_scale_: with an inf/NaN the scale backs off and the tracker resets;
 * else after growth_interval finite steps it grows, unless the grown scale would not be finite
 * (the tracker resets either way). Products are formed in double and rounded to float. */
__device__ __forceinline__ void scale_update1(float *scale, int32_t *growth_tracker, bool found_inf,
                                              double growth_factor, double backoff_factor, int32_t growth_interval,
                                              long long *skipped) {
    if (found_inf) {
        *scale = (float)((double)*scale * backoff_factor);
        *growth_tracker = 0;
        if (skipped) ++*skipped;
        return;
    }
    const int32_t successful = *growth_tracker + 1;
    if (successful == growth_interval) {
        const float grown = (float)((double)*scale * growth_factor);
        if (isfinite(grown)) *scale = grown;
        *growth_tracker = 0;
    } else {
        *growth_tracker = successful;
    }
}

/* The step's rate and momentum (read before they move on) */
__device__ __forceinline__ const double *rate_of(const cmlp_k_rate &rate) {
    return rate.rates + 2 * (rate.next ? *rate.next : 0);
}

/* Adam's step size, sqrt(1 - beta2^t), decoupled decay factor, beta1 and 1 - beta1 of step t, in
 * double as the host computes them (no contraction: each operation rounded once) */
__device__ __forceinline__ void adam_coef(int64_t t, double lr, double beta1, double beta2, double decoupled_wd,
                                          float *coef) {
    const double bc1 = 1.0 - pow(beta1, (double)t), bc2 = 1.0 - pow(beta2, (double)t);
    coef[0] = (float)(lr / bc1);
    coef[1] = (float)sqrt(bc2);
    coef[2] = decoupled_wd != 0.0 ? (float)__dadd_rn(1.0, -__dmul_rn(lr, decoupled_wd)) : 1.0f;
    coef[3] = (float)beta1;
    coef[4] = (float)(1.0 - beta1);
}

__device__ __forceinline__ void prepare1(int64_t *step, float *coef, bool skip, const cmlp_k_rate &rate,
                                         double beta2, int adam, int64_t *pos, int64_t pos_add,
                                         const cmlp_k_scaler &scaler) {
    if (pos) *pos += pos_add; /* the next step's samples, skipped step or not */
    const long long k = rate.next ? *rate.next : 0;
    const double *r = rate_of(rate), lr = r[0], momentum = r[1];
    if (rate.next) ++*rate.next; /* the next step's rate, likewise */
    if (scaler.scale) /* the loss scale moves on the same verdict, in the same launch */
        scale_update1(scaler.scale, scaler.growth_tracker, skip, scaler.growth_factor, scaler.backoff_factor,
                      scaler.growth_interval, scaler.skipped);
    if (skip) return;
    const int64_t t = ++*step;
    if (adam) {
        adam_coef(t, lr, momentum, beta2, rate.decoupled_wd, coef);
    } else {
        coef[0] = (float)lr;
        coef[1] = (float)momentum;
    }
    for (int i = 0; i < rate.nparts; i++) { /* parameter groups: each part at its own rate and decay */
        const double *part = rate.parts + CMLP_PART_ARGS * i; /* NaN momentum or beta2: the step's */
        const double *row = rate.step_scales ? rate.step_scales + 2 * (k * rate.nparts + i) : nullptr;
        const double part_lr = __dmul_rn(lr, row ? row[0] : part[0]);
        const double part_momentum = row && !isnan(row[1]) ? row[1] : isnan(part[2]) ? momentum : part[2];
        float *pc = rate.part_coef + 5 * i;
        if (adam) {
            adam_coef(t, part_lr, part_momentum, isnan(part[3]) ? beta2 : part[3], part[1], pc);
        } else {
            pc[0] = (float)part_lr;
            pc[1] = (float)part_momentum;
        }
    }
}

__global__ void k_optim_prepare(int64_t *step, float *coef, const float *found_inf, cmlp_k_rate rate, double beta2,
                                int adam, int64_t *pos, int64_t pos_add, cmlp_k_scaler scaler) {
    prepare1(step, coef, found_inf && *found_inf != 0.0f, rate, beta2, adam, pos, pos_add, scaler);
}

struct prepare_args {
    int64_t *step;
    float *coef;
    cmlp_k_rate rate;
    double beta2;
    int64_t *pos, pos_add;
    cmlp_k_scaler scaler;
    unsigned int *blocks_done;
};

/* cmlp_k_map's loop over Adam with the coefficients of step *step + 1 at the rate of the moment;
 * the last block to finish moves *step and the rate on (every block has read them by then) and
 * does the rest of prepare1. */
__global__ void __launch_bounds__(CMLP_K_THREADS) k_adam_prepared(adam_op op, int64_t n, int64_t head, int64_t nvec,
                                                                   prepare_args a) {
    const bool skip = op.found_inf && *op.found_inf != 0.0f; /* the same in every thread */
    __shared__ float coef[5]; /* one thread per block computes them (double precision is slow on some GPUs) */
    if (!skip && threadIdx.x == 0) {
        const double *r = rate_of(a.rate);
        adam_coef(*a.step + 1, r[0], r[1], a.beta2, a.rate.decoupled_wd, coef);
    }
    __syncthreads();
    if (!skip) {
        op.step_size = coef[0];
        op.bc2_sqrt = coef[1];
        op.decay = coef[2];
        op.beta1 = coef[3];
        op.one_b1 = coef[4];
        (void)cmlp_map_elements(op, n, head, nvec);
    }
    __syncthreads(); /* the block is done (its thread 0 read *step and the rate before the first barrier) */
    if (threadIdx.x != 0) return;
    __threadfence();
    if (atomicAdd(a.blocks_done, 1u) != gridDim.x - 1) return;
    __threadfence();
    prepare1(a.step, a.coef, skip, a.rate, a.beta2, 1, a.pos, a.pos_add, a.scaler);
    *a.blocks_done = 0; /* for the next launch */
}

extern "C" cudaError_t cmlp_k_optim_prepare(int64_t *step, float *coef, const float *found_inf, cmlp_k_rate rate,
                                            double beta2, int adam, int64_t *pos, int64_t pos_add,
                                            const cmlp_k_scaler *scaler, cudaStream_t stream) {
    if (!step || !coef || !rate.rates) return cudaErrorInvalidValue;
    cmlp_k_scaler none = {};
    k_optim_prepare<<<1, 1, 0, stream>>>(step, coef, found_inf, rate, beta2, adam, pos, pos_add,
                                         scaler ? *scaler : none);
    return cudaGetLastError();
}

extern "C" cudaError_t cmlp_k_adam_prepared(float *p, const float *g, float *m, float *v, float *vmax, int64_t n,
                                            cmlp_k_rate rate, double beta2, float eps, float weight_decay,
                                            int maximize, const float *found_inf,
                                            int64_t *step, float *coef, int64_t *pos, int64_t pos_add,
                                            const cmlp_k_scaler *scaler, unsigned int *blocks_done,
                                            cudaStream_t stream) {
    if (n <= 0 || !step || !coef || !blocks_done || !rate.rates) return cudaErrorInvalidValue;
    /* step size, bias correction, decay and beta1: per block, from *step and the rate */
    const adam_op op = adam_make(p, g, m, v, vmax, 0.0f, 0.0f, (float)beta2, 0.0f, (float)(1.0 - beta2), 1.0f, eps,
                                 weight_decay, 1.0f, maximize, found_inf, nullptr);
    prepare_args a = {step, coef, rate, beta2, pos, pos_add, {}, blocks_done};
    if (scaler) a.scaler = *scaler;
    const int mis[5] = {cmlp_misalign(p, 4), cmlp_misalign(g, 4), cmlp_misalign(m, 4), cmlp_misalign(v, 4),
                        cmlp_misalign(vmax ? vmax : p, 4)};
    int64_t head, nvec;
    const unsigned int blocks = cmlp_map_split(n, mis, 5, &head, &nvec);
    k_adam_prepared<<<blocks, CMLP_K_THREADS, 0, stream>>>(op, n, head, nvec, a);
    return cudaGetLastError();
}

extern "C" cudaError_t cmlp_k_update_load(int adam) {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, (const void *)k_optim_prepare);
    if (e == cudaSuccess)
        e = cudaFuncGetAttributes(&attr, adam ? (const void *)cmlp_k_map<adam_op> : (const void *)cmlp_k_map<sgd_op>);
    if (e == cudaSuccess && adam) e = cudaFuncGetAttributes(&attr, (const void *)k_adam_prepared);
    return e;
}
