/* cuda_emu.h - runs the kernels of kernels/ on the CPU, for tests on machines without a GPU.
 *
 * translate.py turns each kernels/<name>.cu into C++ that g++ compiles with this header
 * force-included (-include) and CMLP_EMU defined. A launch `k<<<grid, block, 0, s>>>(args)`
 * becomes `cmlp_emu::launcher(grid, block, 0, s, BOUND, "k")(k, args)`, which checks the
 * configuration as the driver would (grid and block limits, __launch_bounds__) and then runs
 * every block in turn. A block's threads are fibers on one OS thread: a thread runs until it
 * exits or waits at __syncthreads or a warp shuffle, and a wait is released when every thread
 * it waits for has arrived, so a kernel that reads shared memory before the barrier that
 * should protect it sees stale values here too. Shared memory is a static per kernel; atomics
 * are plain read-modify-writes (blocks never overlap). The fp32 helpers of common.cuh are
 * replaced by host code with the same IEEE semantics (round to nearest, subnormals flushed,
 * never fused), so results can be compared bit for bit with the CPU backend.
 *
 * Run under AddressSanitizer, an access outside a buffer is reported at the kernel's line;
 * UndefinedBehaviorSanitizer reports a misaligned float4/uchar4 access, which on a GPU is a
 * fault.
 */
#ifndef CMLP_CUDA_EMU_H
#define CMLP_CUDA_EMU_H

#include <cuda_runtime.h> /* host-side types only: dim3, float4, cudaError_t, cudaStream_t */

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

/* ---- qualifiers (host_defines.h makes most of them empty for a host compiler) ---- */
#undef __shared__
#define __shared__ static /* blocks run one at a time: one copy serves them all */
#define __launch_bounds__(...)

/* CUDA's math functions are global names on the device */
using std::isfinite;
using std::isinf;
using std::isnan;

extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

/* The order the blocks of a grid run in: 0 first to last, 1 last first; -1 reads it. Returns
 * the order before (C linkage: tests/c/test_kernels.c sets it). */
extern "C" int cmlp_emu_block_order(int order);

namespace cmlp_emu {

/* Runs body once per thread of every block (grid and block already validated). A kernel (by
 * name) whose first launch never waited at a barrier or shuffle runs its threads one after
 * another from then on, without fibers; should it wait later, the run stops with an error. */
void run_grid(dim3 grid, dim3 block, const std::function<void()> &body, const char *name);
/* The calling thread waits until every live thread of its block arrives. */
void block_barrier();
/* Warp exchange: every lane of mask (which must all arrive) publishes bits; the result is
 * the bits published by lane src. */
uint64_t warp_exchange(unsigned mask, uint64_t bits, int src);
int lane();
/* Validates a launch; records the error cudaGetLastError returns and prints why. */
bool launch_ok(dim3 grid, dim3 block, size_t shmem, unsigned bound, const char *name);

/* Where a launch goes once validated. Unset (the kernel tests): it runs at once. The emulated
 * runtime (cuda_runtime_emu.cpp) sets it to queue the launch on its stream, or record it into
 * the graph being captured there (an error once that capture is broken); `run` owns the
 * kernel's arguments. */
using submit_fn = cudaError_t (*)(cudaStream_t stream, std::function<void()> run, const char *name);
extern submit_fn submit_hook;
/* Set by the emulated runtime: false (and the launch fails) for a pointer argument that is
 * neither null nor device memory, which on a GPU is an illegal address. */
using pointer_check_fn = bool (*)(const void *p, const char *kernel, int index);
extern pointer_check_fn pointer_hook;
/* Set by the emulated runtime: loads a kernel's code on its first launch (each instantiation
 * its own, as CUDA's lazy loading); an error fails the launch. */
using load_fn = cudaError_t (*)(const void *kernel, const char *name);
extern load_fn load_hook;
void set_last_error(cudaError_t e);

template <class Tuple, size_t... I>
bool pointers_ok(const Tuple &t, const char *name, std::index_sequence<I...>) {
    bool ok = true;
    auto one = [&](const auto &v, int index) {
        if constexpr (std::is_pointer<std::decay_t<decltype(v)>>::value)
            ok = ok && pointer_hook((const void *)v, name, index);
    };
    (one(std::get<I>(t), (int)I), ...);
    return ok;
}

struct launcher {
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
    unsigned bound;
    const char *name;
    launcher(dim3 g, dim3 b, size_t s, cudaStream_t st, unsigned bd, const char *n)
        : grid(g), block(b), shmem(s), stream(st), bound(bd), name(n) {}
    template <class... P, class... A>
    void operator()(void (*kernel)(P...), A &&...args) const {
        if (!launch_ok(grid, block, shmem, bound, name)) return;
        /* the arguments are converted to the parameter types once, as a launch does, and
         * every thread gets its own copy */
        using params_t = std::tuple<std::decay_t<P>...>;
        auto params = std::make_shared<const params_t>(std::forward<A>(args)...);
        if (pointer_hook && !pointers_ok(*params, name, std::index_sequence_for<P...>{})) {
            set_last_error(cudaErrorInvalidValue);
            return;
        }
        if (load_hook)
            if (cudaError_t e = load_hook((const void *)kernel, name)) {
                set_last_error(e);
                return;
            }
        const dim3 g = grid, b = block;
        const char *n = name;
        std::function<void()> run = [g, b, kernel, params, n] {
            run_grid(g, b, [&] {
                params_t mine = *params;
                std::apply(kernel, mine);
            }, n);
        };
        if (!submit_hook) run();
        else if (cudaError_t e = submit_hook(stream, std::move(run), name)) set_last_error(e);
    }
};

template <class T>
T shfl(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffled values are up to 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof v);
    bits = warp_exchange(mask, bits, src);
    T r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
}

/* x with a subnormal replaced by a zero of the same sign (the .ftz of PTX) */
inline float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
/* Values pass through memory so that the compiler can neither fuse nor keep extra precision. */
inline float rounded(volatile float r) { return r; }

} /* namespace cmlp_emu */

inline void __syncthreads() { cmlp_emu::block_barrier(); }
inline void __threadfence() {} /* blocks run one after another */
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int o) {
    return cmlp_emu::shfl(mask, v, cmlp_emu::lane() ^ o);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src) {
    return cmlp_emu::shfl(mask, v, src & 31);
}

template <class T>
T atomicAdd(T *p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}

inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline double __dsub_rn(double a, double b) {
    volatile double r = a - b;
    return r;
}
inline double __dmul_rn(double a, double b) {
    volatile double r = a * b;
    return r;
}
inline double __dadd_rn(double a, double b) {
    volatile double r = a + b;
    return r;
}
inline double __ddiv_rn(double a, double b) {
    volatile double r = a / b;
    return r;
}

/* ---- the fp32 helpers of common.cuh, on the host ---- */
inline float f_add(float a, float b) { return cmlp_emu::ftz(cmlp_emu::rounded(cmlp_emu::ftz(a) + cmlp_emu::ftz(b))); }
inline float f_sub(float a, float b) { return cmlp_emu::ftz(cmlp_emu::rounded(cmlp_emu::ftz(a) - cmlp_emu::ftz(b))); }
inline float f_mul(float a, float b) { return cmlp_emu::ftz(cmlp_emu::rounded(cmlp_emu::ftz(a) * cmlp_emu::ftz(b))); }
inline float f_div(float a, float b) { return cmlp_emu::ftz(cmlp_emu::rounded(cmlp_emu::ftz(a) / cmlp_emu::ftz(b))); }
inline float f_sqrt(float a) { return cmlp_emu::ftz(cmlp_emu::rounded(std::sqrt(cmlp_emu::ftz(a)))); }
inline bool f_gt(float a, float b) { return cmlp_emu::ftz(a) > cmlp_emu::ftz(b); }
inline bool f_gtu(float a, float b) { return !(cmlp_emu::ftz(a) <= cmlp_emu::ftz(b)); }
inline bool f_eq(float a, float b) { return cmlp_emu::ftz(a) == cmlp_emu::ftz(b); }
inline double f_to_double(float a) { return (double)cmlp_emu::ftz(a); }
inline float f_from_double(double a) { return cmlp_emu::ftz(cmlp_emu::rounded((float)a)); }

#endif /* CMLP_CUDA_EMU_H */
