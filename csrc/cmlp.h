/* cmlp.h - the one public C API of cmlp: train multilayer perceptrons on the CPU or a GPU,
 * with every byte taken from a per-device caching allocator.
 *
 * Usage:
 *     cmlp_model *m = NULL;
 *     cmlp_optim *opt = NULL;
 *     int sizes[] = {784, 512, 256, 10};
 *     if (cmlp_model_init(&m, sizes, 4, cmlp_cpu(), 0) != CMLP_OK) puts(cmlp_last_error());
 *     cmlp_adam_config ac = cmlp_adam_defaults();
 *     cmlp_optim_init_adam(&opt, m, &ac);
 *     cmlp_data batch = {.x = images, .x_dtype = CMLP_DTYPE_F32, .y = labels, .n = 32};
 *     double loss;
 *     cmlp_model_zero_grad(m);
 *     cmlp_model_forward_backward(m, &batch, 1.0f / 32, 0.0f, CMLP_AMP_NONE, &loss);
 *     cmlp_optim_step(opt);
 *     cmlp_optim_free(opt);
 *     cmlp_model_free(m);
 *
 * Conventions: every fallible call returns a cmlp_status; on failure cmlp_last_error() holds a
 * thread-local "file:line: what happened" message and no output or state was changed unless
 * the function says otherwise (a model's activation workspace, scratch that the next call makes
 * again, may have gone back to the cache: a larger one is taken after the smaller one went back,
 * so that the peak is the larger one's alone). *_free(NULL) is a no-op. Host pointers given to
 * the library are only read during the call. Nothing here prints, exits or aborts.
 *
 * What the caller keeps to: a handle (model, optimizer, trainer) and the output and host-buffer
 * pointers a call writes or reads are valid, not NULL, unless a function says NULL is allowed
 * (several calls check and return CMLP_ERR_INVALID, but that is a courtesy, not the contract).
 * A handle is used by one thread at a time: two calls on one model (or on a model and its
 * optimizer or trainer) at once are a data race; different models train in different threads
 * freely. An optimizer and a trainer keep pointers to their model (and a trainer to its
 * optimizer): free the trainer, then the optimizers, then the model.
 */
#ifndef CMLP_H
#define CMLP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define CMLP_API __declspec(dllexport)
#else
#define CMLP_API __attribute__((visibility("default")))
#endif

/* ---- status ------------------------------------------------------------------------------ */

typedef enum cmlp_status {
    CMLP_OK = 0,
    CMLP_ERR_INVALID = 1,     /* a bad argument: shape, size, range, value */
    CMLP_ERR_NONFINITE = 2,   /* NaN or inf in an input that must be finite */
    CMLP_ERR_OOM = 3,         /* the allocator could not satisfy a request */
    CMLP_ERR_DEVICE = 4,      /* the device is unavailable or a device call failed */
    CMLP_ERR_STATE = 5,       /* a call out of order (e.g. optimizer of another model) */
    CMLP_ERR_INTERNAL = 6     /* a bug: an invariant did not hold */
} cmlp_status;

CMLP_API const char *cmlp_last_error(void);           /* thread-local; never NULL */
/* A message of cmlp_last_error() without the "file.c:line: " before it: what a user reads. */
CMLP_API const char *cmlp_error_text(const char *msg);
CMLP_API const char *cmlp_status_name(cmlp_status s); /* "CMLP_ERR_OOM", ... */

/* ---- devices ----------------------------------------------------------------------------- */

typedef enum cmlp_device_type { CMLP_DEVICE_CPU = 0, CMLP_DEVICE_CUDA = 1 } cmlp_device_type;

typedef struct cmlp_device {
    cmlp_device_type type;
    int index; /* 0 for the CPU */
} cmlp_device;

#define CMLP_MAX_CUDA_DEVICES 16
/* A model has at most this many layers (CMLP_MAX_LAYERS + 1 sizes). */
#define CMLP_MAX_LAYERS 64

CMLP_API cmlp_device cmlp_cpu(void);
/* Parses "cpu", "cuda", "cuda:N". CMLP_ERR_INVALID for an unknown string; CMLP_ERR_DEVICE when
 * the string is valid but the device is not there (the message says whether the build lacks
 * CUDA or the machine lacks a GPU). */
CMLP_API cmlp_status cmlp_device_parse(const char *s, cmlp_device *out);
CMLP_API cmlp_status cmlp_device_check(cmlp_device d); /* same checks for a parsed device */
/* The calling thread's current GPU: the one "cuda" without an index names (0 until set, in each
 * thread, as CUDA's current device is). Setting it checks that the GPU is there (which starts the
 * driver); reading it starts nothing. It is cmlp's own: CUDA's current device, which other
 * libraries read, is not changed. */
CMLP_API int cmlp_cuda_current_device(void);
CMLP_API cmlp_status cmlp_cuda_set_device(int index);
CMLP_API int cmlp_cuda_compiled(void);                  /* 1 when built with the CUDA backend */
/* The devices the CUDA driver reports (0 without a usable driver/GPU). The first call starts the
 * driver, which a process forked after it cannot use. */
CMLP_API int cmlp_cuda_device_count(void);
CMLP_API int cmlp_cuda_loadable(void); /* 1 when the CUDA backend's library loads (starts nothing) */
CMLP_API int cmlp_cuda_started(void);  /* 1 once the CUDA driver was asked for the devices */
/* 1 once GPU `index` was opened in this process (its context and allocator made: anything
 * allocated there, or its memory asked about); opens nothing. */
CMLP_API int cmlp_cuda_device_opened(int index);
/* The processes holding memory on device d, as its driver's management library (NVML) sees
 * them: up to cap (pid, bytes) pairs; *count is their number (which may exceed cap), or -1 where
 * it cannot tell (the CPU, no NVML). */
CMLP_API cmlp_status cmlp_device_processes(cmlp_device d, int64_t *pids, int64_t *bytes, int cap, int *count);
/* A GPU's properties (torch.cuda.get_device_properties' first fields). */
typedef struct cmlp_device_props {
    char name[256];
    int major, minor; /* compute capability */
    int64_t total_memory;
    int multi_processor_count, max_threads_per_multi_processor, warp_size;
    int64_t l2_cache_size;
    char uuid[40]; /* as NVML writes it, without "GPU-" */
} cmlp_device_props;
CMLP_API cmlp_status cmlp_cuda_device_properties(int index, cmlp_device_props *out);
/* The GPUs NVML reports, without starting the CUDA driver: their count, or -1 when NVML is not
 * there or fails, and the first cap of their UUIDs ("GPU-..."; valid for the process's life).
 * CUDA_VISIBLE_DEVICES is not applied. Asked once per process. */
#define CMLP_NVML_UUID_BYTES 96
#define CMLP_NVML_MAX_DEVICES 1024
CMLP_API int cmlp_nvml_devices(const char **uuids, int cap);
/* 1 in a process forked from one that had started CUDA: CUDA cannot be used in it (every use
 * fails and says to start processes with 'spawn'). */
CMLP_API int cmlp_cuda_forked(void);
/* Around a call that may use a GPU: the calling thread's current CUDA context before it (NULL
 * when CUDA was not started, or the thread has none), and putting that context back after it
 * when the call left another one current (a device's work makes its context current), so that
 * the thread's current device is what it was for other CUDA libraries, as torch's device guards
 * do. A thread with no context before keeps the one the call left. Starts nothing. */
CMLP_API void *cmlp_cuda_ctx_save(void);
CMLP_API void cmlp_cuda_ctx_restore(void *saved);
CMLP_API const char *cmlp_cuda_version(void);           /* toolkit built with, e.g. "13.0"; NULL */
CMLP_API int cmlp_cuda_runtime_version(void);           /* e.g. 13000; 0 when not loaded */
/* Waits for the device's queued work. */
CMLP_API cmlp_status cmlp_device_synchronize(cmlp_device d);

/* ---- memory: one allocator per device ---------------------------------------------------- */

/* Statistics follow PyTorch's memory_stats: for each stat, for each pool (all, large, small),
 * the current value, the peak, the total increase and the total decrease. */
typedef enum cmlp_stat_kind {
    CMLP_STAT_ALLOCATION = 0,
    CMLP_STAT_ALLOCATED_BYTES,
    CMLP_STAT_REQUESTED_BYTES,
    CMLP_STAT_ACTIVE,
    CMLP_STAT_ACTIVE_BYTES,
    CMLP_STAT_SEGMENT,
    CMLP_STAT_RESERVED_BYTES,
    CMLP_STAT_INACTIVE_SPLIT,
    CMLP_STAT_INACTIVE_SPLIT_BYTES,
    CMLP_STAT_OVERSIZE_ALLOCATIONS, /* pool "all" only */
    CMLP_STAT_OVERSIZE_SEGMENTS,    /* pool "all" only */
    CMLP_STAT_KIND_COUNT
} cmlp_stat_kind;

typedef enum cmlp_pool { CMLP_POOL_ALL = 0, CMLP_POOL_LARGE = 1, CMLP_POOL_SMALL = 2, CMLP_POOL_COUNT } cmlp_pool;

typedef struct cmlp_stat {
    int64_t current, peak, allocated, freed;
} cmlp_stat;

typedef struct cmlp_memory_stats {
    cmlp_stat stat[CMLP_STAT_KIND_COUNT][CMLP_POOL_COUNT];
    int64_t num_alloc_retries;
    int64_t num_ooms;
    int64_t num_sync_all_streams;
    int64_t num_device_alloc;
    int64_t num_device_free;
    int64_t max_split_size; /* -1: unlimited */
    int64_t limit;          /* -1: no limit */
    int64_t total_memory;   /* physical memory of the device */
    int64_t largest_free_block; /* bytes, in the cache */
    int64_t num_raw_alloc_calls; /* raw device allocations attempted (the test hook counts these) */
} cmlp_memory_stats;

CMLP_API cmlp_status cmlp_memory_stats_get(cmlp_device d, cmlp_memory_stats *out);
CMLP_API cmlp_status cmlp_memory_reset_peak(cmlp_device d);
/* *peak = the most bytes allocated at once since the last restart (a window the trainer keeps
 * per epoch, beside the peaks of the statistics, which it leaves to the user); restart != 0
 * starts a new window at the bytes allocated now. */
CMLP_API cmlp_status cmlp_memory_window_peak(cmlp_device d, int restart, int64_t *peak);
/* Every statistic's allocated and freed totals and the event counts (retries, OOMs, device
 * allocations and frees) back to 0 (torch.cuda.reset_accumulated_memory_stats). */
CMLP_API cmlp_status cmlp_memory_reset_accumulated(cmlp_device d);
/* torch.cuda.mem_get_info: what the device could still give (its driver's free memory, which
 * memory cached by the allocator does not count in; on the CPU, the operating system's available
 * memory) and its total; free is -1 when the device cannot say. */
CMLP_API cmlp_status cmlp_memory_get_info(cmlp_device d, int64_t *free_bytes, int64_t *total_bytes);
CMLP_API cmlp_status cmlp_memory_empty_cache(cmlp_device d);
/* Whether the n requests (bytes each, in this order, none freed between) would be served on the
 * device now (*served 1): tried on a copy of its allocator, with its limit, settings, cache and
 * the memory the device has free, so that nothing changes. n <= CMLP_TRY_REQUESTS. */
#define CMLP_TRY_REQUESTS 16
CMLP_API cmlp_status cmlp_memory_try_requests(cmlp_device d, const int64_t *nbytes, int n, int *served);
/* limit < 0 removes the limit. A limit below what is reserved now is allowed: later
 * requests fail until enough is released. */
CMLP_API cmlp_status cmlp_memory_set_limit(cmlp_device d, int64_t limit);
/* Allocator settings, shared by every device (PyTorch's CachingAllocator options). */
#define CMLP_ROUNDUP_INTERVALS 16
typedef struct cmlp_alloc_settings {
    int64_t max_split_size;               /* bytes; -1: unlimited */
    double garbage_collection_threshold;  /* fraction of the limit; 0: off */
    int roundup_power2_divisions[CMLP_ROUNDUP_INTERVALS]; /* per interval [2^i, 2^(i+1)) MiB */
    int expandable_segments;
    int64_t large_segment_size;           /* bytes: the segment of a request over 1 MiB and under 10 MiB */
    int64_t max_non_split_rounding;       /* bytes an oversize block may exceed the request it serves by */
    double per_process_memory_fraction;   /* of each GPU's memory, set as its limit when it opens; -1: none */
    int backend_async;                    /* backend:cudaMallocAsync was asked for (and is not used) */
    /* PyTorch's options that change nothing here, kept as given for the snapshot's settings */
    int release_lock_on_cudamalloc, pinned_use_host_register, graph_capture_record_stream_reuse;
    int pinned_num_register_threads;
} cmlp_alloc_settings;

/* Parses "key:value,..." in PYTORCH_CUDA_ALLOC_CONF's syntax and replaces every setting (keys
 * not given return to their defaults). CMLP_ERR_INVALID names an unknown key or bad value;
 * nothing changes then. New settings apply to later requests; existing blocks stay. */
CMLP_API cmlp_status cmlp_memory_configure(const char *conf);
/* The settings an environment variable gave ("VAR=value", or NULL for none), as the caller applied
 * them at start-up with cmlp_memory_configure. When the first GPU opens, the first of
 * CMLP_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF that is set is read again (as
 * PyTorch reads them when CUDA starts): set or changed since, it is applied, unless
 * cmlp_memory_configure was called since; a bad one fails the GPU's opening (CMLP_ERR_INVALID). */
CMLP_API cmlp_status cmlp_memory_note_env(const char *applied);
CMLP_API cmlp_status cmlp_memory_parse_settings(const char *conf, cmlp_alloc_settings *out);
CMLP_API void cmlp_memory_get_settings(cmlp_alloc_settings *out);
/* The text the settings in force were parsed from ("" before any), malloc'd (NULL: no memory). */
CMLP_API char *cmlp_memory_settings_text(void);
/* 1 where caching is off for this process: CMLP_NO_MEMORY_CACHING=1 (or, where that is unset,
 * PYTORCH_NO_CUDA_MEMORY_CACHING=1, PyTorch's switch), read once. Every device's allocator then
 * reserves a segment of exactly the bytes of each request and returns it to the device when the
 * block is freed, keeping its statistics and limit: a memory checker (AddressSanitizer on the
 * CPU, compute-sanitizer on a GPU) sees each buffer's own bounds. Slow; for debugging. A trainer
 * then runs its steps eagerly (no CUDA graph). After cmlp_memory_set_caching, what it last set. */
CMLP_API int cmlp_memory_caching_disabled(void);
/* Turns caching on (1) or off (0) for every allocator of the process, open or opened later
 * (torch.cuda.memory.caching_allocator_enable): each takes it up at its next request or free.
 * Off, requests are served as above; what the cache holds stays until freed blocks empty their
 * segments or empty_cache gives them back. Thread-safe. */
CMLP_API void cmlp_memory_set_caching(int on);

/* A snapshot: segments sorted by address, each owning blocks [first_block, first_block +
 * nblocks) of the block array, in address order. Free both arrays with
 * cmlp_memory_snapshot_free. */
typedef struct cmlp_segment_info {
    uint64_t address;
    int64_t total_size, allocated_size, active_size, requested_size;
    int pool; /* CMLP_POOL_LARGE or CMLP_POOL_SMALL */
    int expandable;
    int64_t first_block, nblocks;
    const char *what; /* what the segment (an expandable one's run: its first page) was made for, or NULL */
    int64_t context;  /* and the caller's context then, when recorded (as cmlp_block_info's), else 0 */
} cmlp_segment_info;

typedef struct cmlp_block_info {
    uint64_t address;
    int64_t size, requested_size;
    int allocated;    /* 1: active_allocated, 0: inactive */
    const char *what; /* allocated blocks: what the memory holds ("parameters", ...); else NULL */
    int64_t context;  /* allocated blocks: the caller's context (cmlp_memory_set_context) when
                         recorded (cmlp_memory_record_history), else 0 */
} cmlp_block_info;

CMLP_API cmlp_status cmlp_memory_snapshot(cmlp_device d, cmlp_segment_info **segments, int64_t *nsegments,
                                          cmlp_block_info **blocks, int64_t *nblocks);
CMLP_API void cmlp_memory_snapshot_free(cmlp_segment_info *segments, cmlp_block_info *blocks);
/* Checks every invariant of the device's allocator (blocks tile segments, free neighbours are
 * merged, pools hold exactly the free blocks, statistics equal the sums): CMLP_ERR_INTERNAL
 * with the first violation otherwise. */
CMLP_API cmlp_status cmlp_memory_validate(cmlp_device d);
/* Test hook: the k-th raw device allocation from now fails as if the device were full
 * (k = 1: the next one); k <= 0 disables it. */
CMLP_API cmlp_status cmlp_memory_fail_raw_alloc(cmlp_device d, int64_t k);

/* A raw block from the device's allocator (PyTorch's caching_allocator_alloc). */
CMLP_API cmlp_status cmlp_memory_alloc(cmlp_device d, size_t nbytes, void **out);
/* INVALID for a pointer cmlp_memory_alloc did not give (a model's memory among them). */
CMLP_API cmlp_status cmlp_memory_free(cmlp_device d, void *ptr);

/* Memory history, PyTorch's _record_memory_history: the allocator notes what it does, oldest
 * first, in a ring of up to max_entries entries (the oldest are overwritten). */
typedef enum cmlp_trace_action {
    CMLP_TRACE_ALLOC = 0,          /* a block handed out: addr, size = bytes requested */
    CMLP_TRACE_FREE_REQUESTED,     /* a block given back: addr, size = bytes requested */
    CMLP_TRACE_FREE_COMPLETED,     /* ... and reusable (at once: one stream per device) */
    CMLP_TRACE_SEGMENT_ALLOC,      /* memory reserved from the device: addr, size */
    CMLP_TRACE_SEGMENT_FREE,       /* ... returned to it */
    CMLP_TRACE_SEGMENT_MAP,        /* pages of an expandable segment mapped: addr, size */
    CMLP_TRACE_SEGMENT_UNMAP,      /* ... unmapped */
    CMLP_TRACE_OOM,                /* a request failed: size = bytes requested, device_free */
    CMLP_TRACE_SNAPSHOT,           /* a snapshot was taken: size = bytes allocated */
    CMLP_TRACE_ACTION_COUNT
} cmlp_trace_action;

typedef enum cmlp_history_mode {
    CMLP_HISTORY_OFF = 0,   /* nothing recorded */
    CMLP_HISTORY_STATE = 1, /* live blocks keep their context; no history */
    CMLP_HISTORY_ALL = 2    /* and every action is noted */
} cmlp_history_mode;

/* Which entries keep the caller's context: none, live blocks, + allocations, + frees. */
typedef enum cmlp_context_mode {
    CMLP_CONTEXT_NONE = 0,
    CMLP_CONTEXT_STATE = 1,
    CMLP_CONTEXT_ALLOC = 2,
    CMLP_CONTEXT_ALL = 3
} cmlp_context_mode;

typedef struct cmlp_trace_entry {
    int action;          /* cmlp_trace_action */
    uint64_t addr;       /* 0 for CMLP_TRACE_OOM and CMLP_TRACE_SNAPSHOT */
    int64_t size;
    int64_t time_us;     /* microseconds since the Unix epoch */
    const char *what;    /* blocks: what the memory holds; NULL for the rest */
    int64_t context;     /* the caller's context when kept, else 0 */
    int64_t device_free; /* CMLP_TRACE_OOM: bytes free under the memory limit when one is set, else
                            what the device said it had free (cmlp_memory_get_info) */
} cmlp_trace_entry;

/* Starts, changes or stops recording on a device. skip_actions: a bit per cmlp_trace_action not
 * to note. clear drops the entries noted so far (they are dropped too when max_entries shrinks
 * below their number, the oldest first). max_entries must be >= 1 unless the mode is OFF. */
CMLP_API cmlp_status cmlp_memory_record_history(cmlp_device d, cmlp_history_mode mode, cmlp_context_mode context,
                                                int64_t max_entries, uint32_t skip_actions, int clear);
/* A copy of the entries, oldest first; free it with cmlp_memory_history_free. */
CMLP_API cmlp_status cmlp_memory_history(cmlp_device d, cmlp_trace_entry **entries, int64_t *n);
/* cmlp_memory_snapshot and cmlp_memory_history at one instant (this snapshot's own entry, when
 * snapshots are noted, follows that history, as torch's: the next snapshot shows it). */
CMLP_API cmlp_status cmlp_memory_snapshot_history(cmlp_device d, cmlp_segment_info **segments, int64_t *nsegments,
                                                  cmlp_block_info **blocks, int64_t *nblocks,
                                                  cmlp_trace_entry **entries, int64_t *nentries);
CMLP_API void cmlp_memory_history_free(cmlp_trace_entry *entries);
/* The calling thread's context, noted with what the allocator does for it until changed (0:
 * none). The caller gives it meaning (the Python module: the Python stack of the call). */
CMLP_API void cmlp_memory_set_context(int64_t context);

/* ---- data -------------------------------------------------------------------------------- */

typedef enum cmlp_dtype {
    CMLP_DTYPE_F32 = 0,
    CMLP_DTYPE_U8 = 1,
    CMLP_DTYPE_F16 = 2,  /* IEEE binary16, stored as uint16_t */
    CMLP_DTYPE_BF16 = 3  /* bfloat16, stored as uint16_t */
} cmlp_dtype;

/* Mixed precision: GEMM inputs and stored activations in half precision, fp32 accumulation,
 * loss and softmax in fp32, master weights, gradients and optimizer state in fp32. */
typedef enum cmlp_amp { CMLP_AMP_NONE = 0, CMLP_AMP_FP16 = 1, CMLP_AMP_BF16 = 2 } cmlp_amp;

/* Host conversions with the library's rounding: round to nearest even, fp16 overflow to inf,
 * subnormals kept, NaN stays NaN. dtype is CMLP_DTYPE_F16 or CMLP_DTYPE_BF16. */
CMLP_API cmlp_status cmlp_convert_to_half(uint16_t *dst, const float *src, int64_t n, cmlp_dtype dtype);
CMLP_API cmlp_status cmlp_convert_from_half(float *dst, const uint16_t *src, int64_t n, cmlp_dtype dtype);

/* A batch or data set: x [n, features] row-major, y [n] or NULL, in host memory, or (on_device
 * != 0) in the memory of the model's device, where pos (when not NULL) is a device counter added
 * to every row position. uint8 images are normalised on the fly: ((x / 255) - mean) / std. */
typedef struct cmlp_data {
    const void *x;
    cmlp_dtype x_dtype;
    const int32_t *y;
    int64_t n;
    float mean, std;
    int on_device;
    const int64_t *pos;
} cmlp_data;

/* ---- model ------------------------------------------------------------------------------- */

typedef struct cmlp_model cmlp_model;

/* Linear layers sizes[0] -> sizes[1] -> ... -> sizes[nsizes-1], ReLU between them.
 * Parameters are initialised like nn.Linear, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), from seed. */
CMLP_API cmlp_status cmlp_model_init(cmlp_model **out, const int *sizes, int nsizes, cmlp_device d,
                                     uint64_t seed);
CMLP_API void cmlp_model_free(cmlp_model *m);
CMLP_API int cmlp_model_num_layers(const cmlp_model *m);  /* nsizes - 1 */
CMLP_API int cmlp_model_size(const cmlp_model *m, int i); /* sizes[i] */
CMLP_API int64_t cmlp_model_num_parameters(const cmlp_model *m);
/* 1 where the model holds a half-precision copy of its weights now (made by a mixed-precision
 * pass, kept for the next). */
CMLP_API int cmlp_model_half_weights_held(const cmlp_model *m);
CMLP_API cmlp_device cmlp_model_device(const cmlp_model *m);
/* Offsets into the flat parameter (and gradient) buffer: layer i's weight [out, in] starts at
 * weight_offset(i), its bias [out] at bias_offset(i). Weights of all layers come first. */
CMLP_API int64_t cmlp_model_weight_offset(const cmlp_model *m, int layer);
CMLP_API int64_t cmlp_model_bias_offset(const cmlp_model *m, int layer);
/* Copies between the flat buffers and host memory (num_parameters floats). set_params
 * rejects non-finite values. */
CMLP_API cmlp_status cmlp_model_get_params(const cmlp_model *m, float *host_out);
CMLP_API cmlp_status cmlp_model_set_params(cmlp_model *m, const float *host_in);
/* set_params without the check: another model's parameters as they are (a copy of a model that
 * diverged keeps its NaNs, as torch's deepcopy). */
CMLP_API cmlp_status cmlp_model_copy_params(cmlp_model *m, const float *host_in);
CMLP_API cmlp_status cmlp_model_get_grads(const cmlp_model *m, float *host_out);
CMLP_API cmlp_status cmlp_model_set_grads(cmlp_model *m, const float *host_in); /* any values */
CMLP_API cmlp_status cmlp_model_zero_grad(cmlp_model *m);
/* Multiplies every gradient by inv_scale (one fused pass) and sets *found_inf to 1 when any
 * result is inf or NaN, else 0. The gradients are unscaled either way (GradScaler.unscale_). */
CMLP_API cmlp_status cmlp_model_unscale_grads(cmlp_model *m, float inv_scale, int *found_inf);
/* torch.nn.utils.clip_grad_norm_ over all gradients: *total_norm = their norm_type-norm
 * (computed in double, rounded to float; any norm_type but NaN, as torch's: INFINITY for max |g|,
 * -INFINITY for min |g|, a negative p with a zero gradient gives 0, and 0 counts the weight and
 * bias tensors whose gradient is not all zeros, as torch's norm of the tensors' norms), then every
 * gradient is multiplied by min(1, max_norm / (total_norm + 1e-6)) (max_norm >= 0). A NaN or inf
 * norm scales the gradients by it (NaN) unless error_if_nonfinite, which makes it
 * CMLP_ERR_NONFINITE with nothing changed. */
CMLP_API cmlp_status cmlp_model_clip_grad_norm(cmlp_model *m, double max_norm, double norm_type,
                                               int error_if_nonfinite, double *total_norm);
/* torch.nn.utils.get_total_norm of the gradients: *total_norm as cmlp_model_clip_grad_norm
 * computes it, the gradients unchanged. */
CMLP_API cmlp_status cmlp_model_grad_norm(cmlp_model *m, double norm_type, double *total_norm);
/* torch.nn.utils.clip_grads_with_norm_: every gradient multiplied by min(1, max_norm /
 * (total_norm + 1e-6)), total_norm rounded to float first (a NaN or inf scales by it). */
CMLP_API cmlp_status cmlp_model_clip_grads_with_norm(cmlp_model *m, double max_norm, double total_norm);
/* torch.nn.utils.clip_grad_value_: every gradient clamped to [-clip_value, clip_value]
 * (clip_value >= 0; a NaN stays NaN). */
CMLP_API cmlp_status cmlp_model_clip_grad_value(cmlp_model *m, double clip_value);
/* Moves parameters and gradients (not optimizer state; see cmlp_optim_to) to another device. */
CMLP_API cmlp_status cmlp_model_to(cmlp_model *m, cmlp_device d);
/* Releases the activation workspace kept between calls (it grows to the largest batch). */
CMLP_API void cmlp_model_release_workspace(cmlp_model *m);

/* logits_out: host [n, classes]. Inputs are processed in chunks of at most chunk rows. */
CMLP_API cmlp_status cmlp_model_forward(cmlp_model *m, const cmlp_data *x, int64_t chunk,
                                        float *logits_out);
/* Mean cross-entropy (sum of per-sample losses in *loss_sum) and correct predictions. */
CMLP_API cmlp_status cmlp_model_evaluate(cmlp_model *m, const cmlp_data *xy, int64_t chunk,
                                         double *loss_sum, int64_t *correct);
/* Forward and backward of one batch (in fp32, or mixed precision with amp): ADDS grad_weight * (sum over samples of the gradient of
 * each sample's loss) to the gradient buffer. grad_weight = loss_scale / n gives the gradient
 * of loss_scale * mean loss. *loss_sum receives the unscaled sum of per-sample losses. */
CMLP_API cmlp_status cmlp_model_forward_backward(cmlp_model *m, const cmlp_data *xy,
                                                 float grad_weight, float label_smoothing,
                                                 cmlp_amp amp, double *loss_sum);

/* ---- optimizers -------------------------------------------------------------------------- */

typedef struct cmlp_optim cmlp_optim;

typedef struct cmlp_adam_config {
    double lr, beta1, beta2, eps, weight_decay;
    /* 0: weight_decay is L2, added to the gradient (torch.optim.Adam); 1: it is decoupled, the
     * parameters multiplied by 1 - lr * weight_decay before the update (torch.optim.AdamW) */
    int decoupled_weight_decay;
    /* 1: AMSGrad, the denominator made of the largest exp_avg_sq so far (a third state buffer,
     * max_exp_avg_sq, torch's amsgrad=True) */
    int amsgrad;
    /* 1: the objective is maximized, each step taken along the gradient (torch's maximize=True) */
    int maximize;
} cmlp_adam_config;

typedef struct cmlp_sgd_config {
    double lr, momentum, dampening, weight_decay;
    int nesterov;
    int maximize; /* as Adam's */
} cmlp_sgd_config;

typedef enum cmlp_optim_kind { CMLP_OPTIM_ADAM = 0, CMLP_OPTIM_SGD = 1 } cmlp_optim_kind;

CMLP_API cmlp_adam_config cmlp_adam_defaults(void); /* PyTorch's: 1e-3, 0.9, 0.999, 1e-8, 0 */
CMLP_API cmlp_sgd_config cmlp_sgd_defaults(void);   /* lr 0.01, the rest 0 */
/* Validation as PyTorch: INVALID for lr < 0, eps < 0, betas outside [0, 1), weight_decay < 0,
 * momentum < 0, nesterov without momentum > 0 and dampening 0. The optimizer keeps a pointer to
 * the model: free the optimizer first. */
CMLP_API cmlp_status cmlp_optim_init_adam(cmlp_optim **out, cmlp_model *m, const cmlp_adam_config *c);
CMLP_API cmlp_status cmlp_optim_init_sgd(cmlp_optim **out, cmlp_model *m, const cmlp_sgd_config *c);
CMLP_API void cmlp_optim_free(cmlp_optim *o);
/* Replaces the hyperparameters (the same validation, and the rate times each parameter group's
 * scale finite in float32, but for Nesterov's needs, which, as in torch, only the init checks: a
 * schedule may take the momentum to 0, and Nesterov steps are then plain SGD's); the state is
 * kept. */
CMLP_API cmlp_status cmlp_optim_configure_adam(cmlp_optim *o, const cmlp_adam_config *c);
CMLP_API cmlp_status cmlp_optim_configure_sgd(cmlp_optim *o, const cmlp_sgd_config *c);
CMLP_API cmlp_optim_kind cmlp_optim_get_kind(const cmlp_optim *o);
/* One update from the model's gradient buffer. State is created at the first step. */
CMLP_API cmlp_status cmlp_optim_step(cmlp_optim *o);
CMLP_API double cmlp_optim_get_lr(const cmlp_optim *o);
CMLP_API cmlp_status cmlp_optim_set_lr(cmlp_optim *o, double lr);
/* The momentum a schedule moves (Adam's beta1, SGD's momentum; OneCycleLR), and setting it: like
 * the rate, a step on a device reads it there, so a captured step stays valid (SGD's buffer is
 * made at the next step that needs it). */
CMLP_API double cmlp_optim_get_momentum(const cmlp_optim *o);
CMLP_API cmlp_status cmlp_optim_set_momentum(cmlp_optim *o, double momentum);
/* State: the step count and up to three flat state buffers (Adam: exp_avg, exp_avg_sq and with
 * AMSGrad max_exp_avg_sq; SGD: momentum_buffer). nbuffers is 0 before the first step (or for plain
 * SGD). A buffer once made is kept when the settings stop using it (SGD's at momentum 0, AMSGrad's
 * when amsgrad is turned off), as torch keeps it in its state; one that a new setting needs is
 * made at the next step, from zeros (AMSGrad's maximum then starts from that step's exp_avg_sq).
 * SGD's momentum buffer is CMLP_MOMENTUM_UNSTARTED_BITS where it has not started (torch has none
 * for those parameters: a parameter group without momentum so far): a step with momentum starts
 * it there from the gradient, as torch's first step with momentum does; set_state takes those bits
 * there so too. Any other NaN is a buffer that has started and holds a NaN, which stays, as
 * torch's.
 * AMSGrad's maximum spans every part once one has amsgrad, and is negative where it has not
 * started (CMLP_VMAX_UNSTARTED; torch has none for those parameters: a parameter group without
 * amsgrad so far): its first step there takes that step's exp_avg_sq, as from zeros; set_state
 * takes negative values there so too. */
#define CMLP_VMAX_UNSTARTED (-1.4980391264f) /* the float of bytes 0xBF, as the buffer is filled */
/* the bits of bytes 0xFF, as the buffer is filled: a NaN no arithmetic on a GPU makes (its NaNs
 * are 0x7FFFFFFF) nor on the CPU from numbers (0xFFC00000), only from a NaN of these very bits */
#define CMLP_MOMENTUM_UNSTARTED_BITS 0xFFFFFFFFu
CMLP_API int64_t cmlp_optim_get_step(const cmlp_optim *o);
CMLP_API int cmlp_optim_num_buffers(const cmlp_optim *o);
/* The buffers of state it holds in memory now: also those a step skipped for inf/NaN gradients
 * made before any step counted (num_buffers is 0 until one does). */
CMLP_API int cmlp_optim_buffers_held(const cmlp_optim *o);
/* The buffers it holds once its next step is taken (those held, and those that step makes): what a
 * plan of that step counts (cmlp_plan_compute's optimizer_buffers). */
CMLP_API int cmlp_optim_buffers_planned(const cmlp_optim *o);
/* Whether its param groups' settings are in its device's memory now (a plan's "optimizer_parts"
 * request, made as the groups are given to it, is held). */
CMLP_API int cmlp_optim_parts_on_device(const cmlp_optim *o);
CMLP_API cmlp_status cmlp_optim_get_buffer(const cmlp_optim *o, int i, float *host_out);
/* Replaces the state: step count and nbuffers host buffers of num_parameters floats each
 * (nbuffers: 0, or 1 for SGD, 2 or 3 for Adam), finite (but for SGD's CMLP_MOMENTUM_UNSTARTED_BITS
 * where its buffer has not started; AMSGrad's maximum is negative where it has not). */
CMLP_API cmlp_status cmlp_optim_set_state(cmlp_optim *o, int64_t step, int nbuffers,
                                          const float *const *host_buffers);
/* set_state without the check of the values: another optimizer's state as it is (a copy of one
 * whose run diverged keeps its NaNs and infinities). */
CMLP_API cmlp_status cmlp_optim_copy_state(cmlp_optim *o, int64_t step, int nbuffers,
                                           const float *const *host_buffers);
CMLP_API cmlp_status cmlp_optim_to(cmlp_optim *o, cmlp_device d);
/* The model and the optimizers given (all of this model) move to d together, all or nothing:
 * when one cannot (out of memory there), what moved goes back and the first failure is reported.
 * Made under one hold of the caller's lock, no step in another thread sees them apart. */
CMLP_API cmlp_status cmlp_model_move(cmlp_model *m, cmlp_optim *const *opts, int nopts, cmlp_device d);
/* A parameter group's own hyperparameters (torch's per-group settings): a value of its own, or
 * NaN (for the integers, -1) where the part takes the optimizer's configuration (which a
 * schedule may move: OneCycleLR's momentum). momentum is Adam's beta1 or SGD's momentum; beta2,
 * eps and amsgrad are Adam's, dampening and nesterov SGD's; maximize either's. */
typedef struct cmlp_part_settings {
    double momentum, beta2, eps, dampening;
    int nesterov, maximize, amsgrad;
} cmlp_part_settings;
CMLP_API cmlp_part_settings cmlp_part_settings_inherit(void); /* every field the optimizer's */

/* Parameter groups (torch's param_groups): n parts of the flat parameters, part i being
 * [ends[i - 1], ends[i]) (with ends[-1] = 0 and ends[n - 1] = the number of parameters), each
 * stepped at lr_scale[i] times the optimizer's rate and with its own weight decay (L2, or AdamW's
 * decoupled one, as the configuration says), which replaces the configuration's, and with
 * settings[i] (NULL: every part's settings the optimizer's; checked as the configuration is); a
 * step takes each part in a launch of its own. n = 0: one part, the configuration's weight decay
 * at the optimizer's rate. n <= CMLP_MAX_PARTS, and every part's rate, lr_scale[i] times the
 * optimizer's, finite in float32. A step on a device reads the scales and momenta there, so other
 * scales or momenta with the same ends, weight decays and other settings keep a captured step
 * valid. SGD's momentum buffer spans every part once one has momentum (NaN where it has not
 * started: a part's first step with momentum starts it from the gradient, as torch's), and
 * AMSGrad's maximum every part once one has amsgrad (CMLP_VMAX_UNSTARTED where it has not). */
#define CMLP_MAX_PARTS 65536
CMLP_API cmlp_status cmlp_optim_set_parts(cmlp_optim *o, int n, const int64_t *ends, const double *lr_scale,
                                          const double *weight_decay, const cmlp_part_settings *settings);
/* ZeRO stage 1 (torch.distributed.optim.ZeroRedundancyOptimizer): with on = 1 the optimizer keeps
 * state for this rank's part of the parameters only, part cmlp_dist_rank() of cmlp_dist_size()
 * parts of equal length (a multiple of 64 floats; the last ones shorter, or empty for tiny
 * models). It steps in a data-parallel trainer only (cmlp_optim_step refuses it): the trainer
 * sums each part's gradients on its owner (a reduce-scatter; with clipping, the parts' norms are
 * gathered too, and the total is the norm of theirs), each rank updates its part, and then every
 * rank's part is gathered (a collective). get_buffer then gives this rank's part in place and zeros elsewhere;
 * set_state keeps this rank's part of the full buffers it is given. Before the first step only;
 * on = 0 undoes it. */
CMLP_API cmlp_status cmlp_optim_shard(cmlp_optim *o, int on);
/* The number of parts (0: not sharded), [*lo, *hi), the parameters whose state is kept here, and
 * *chunk, the length of every part but the last ones (rank r's starts at r * chunk). */
CMLP_API int cmlp_optim_shards(const cmlp_optim *o, int64_t *lo, int64_t *hi, int64_t *chunk);

/* ---- training loop ----------------------------------------------------------------------- */

typedef struct cmlp_trainer cmlp_trainer;

typedef struct cmlp_train_config {
    int64_t batch_size;         /* samples per micro-batch the user asked for */
    int64_t accumulation_steps; /* micro-batches per optimizer step */
    int64_t microbatch_size;    /* rows computed at once; <= batch_size * accumulation_steps; 0 = batch_size */
    int shuffle;
    uint64_t seed;
    float label_smoothing;
    cmlp_amp amp;
    /* On out of memory inside a step: roll the step back, release cached memory, halve the
     * micro-batch (twice as many, equal) and retry the same effective batch (the update does
     * not change). After grow_interval good steps half as many (up to batch_size) are tried
     * again, and on out of memory the size that worked before, whose next growth then waits
     * twice as many good steps. */
    int auto_microbatch;
    int64_t grow_interval; /* >= 1; 0: 100 */
    /* Keep only each micro-batch's input and recompute layer outputs in backward. */
    int recompute;
    /* > 0: before each update the gradients' L2 norm (of the whole step, after unscaling) is
     * clipped to it, as torch.nn.utils.clip_grad_norm_ does; 0: no clipping. */
    double max_grad_norm;
} cmlp_train_config;

/* Dynamic loss scaling for fp16 (PyTorch's GradScaler): gradients are computed for
 * scale x loss, unscaled once per optimizer step, the step is skipped when any is inf or NaN,
 * and the scale moves by PyTorch's rule. */
typedef struct cmlp_scaler_state {
    int enabled;
    double scale; /* kept as a float32 value */
    double growth_factor, backoff_factor;
    int64_t growth_interval, growth_tracker;
} cmlp_scaler_state;

typedef struct cmlp_epoch_state {
    int64_t steps;       /* optimizer steps done this epoch */
    int64_t samples;     /* samples consumed this epoch */
    double loss_sum;     /* sum of per-sample losses this epoch, added in step order whatever the calls */
    int64_t total_steps; /* optimizer steps in the whole epoch */
    int64_t skipped;     /* steps skipped for inf/NaN gradients this epoch */
    int done;
    /* with max_grad_norm: the sum and count of the finite gradient norms (before clipping) */
    double grad_norm_sum;
    int64_t grad_norm_steps;
} cmlp_epoch_state;

CMLP_API cmlp_status cmlp_trainer_init(cmlp_trainer **out, cmlp_model *m, cmlp_optim *o,
                                       const cmlp_train_config *c);
CMLP_API void cmlp_trainer_free(cmlp_trainer *t);
CMLP_API int64_t cmlp_trainer_microbatch_size(const cmlp_trainer *t);
/* What the fit whose epochs follow will do beyond its epochs (its epoch count, validation samples
 * or -1, a hash of the validation set's contents, whether a schedule steps after each step):
 * data-parallel, every epoch's start compares them over the ranks with the other settings, since
 * each is a collective another rank would wait for (or, the validation set, a share of a whole
 * that every rank must have alike). A fit call starts here: a CUDA graph capture that failed in
 * the last one is tried again. */
CMLP_API void cmlp_trainer_set_fit_call(cmlp_trainer *t, int64_t epochs, int64_t validation_samples,
                                        uint64_t validation_hash, int per_step_schedule);
/* The loss scaler the trainer applies (disabled by default); validated like GradScaler. */
CMLP_API cmlp_status cmlp_trainer_set_scaler(cmlp_trainer *t, const cmlp_scaler_state *s);
CMLP_API void cmlp_trainer_get_scaler(const cmlp_trainer *t, cmlp_scaler_state *out);
CMLP_API int64_t cmlp_trainer_skipped_steps(const cmlp_trainer *t); /* since creation */
CMLP_API int64_t cmlp_trainer_oom_retries(const cmlp_trainer *t);   /* steps retried smaller */
/* Since creation, of the full steps on a device with graphs: out[0] captures kept (each also
 * ran its step), out[1] replays, out[2] captures dropped (the step ran eagerly, and so do the
 * later steps of its fit call). */
CMLP_API void cmlp_trainer_graph_counts(const cmlp_trainer *t, int64_t out[3]);
CMLP_API cmlp_status cmlp_trainer_set_microbatch_size(cmlp_trainer *t, int64_t size);
/* Computes with a smaller micro-batch for now (auto micro-batching grows back to the set size). */
CMLP_API cmlp_status cmlp_trainer_start_microbatch(cmlp_trainer *t, int64_t size);
/* One optimizer step over all xy->n samples (the effective batch), computed in micro-batches
 * and normalised by xy->n; the gradients are replaced. *loss_mean: mean per-sample loss. */
CMLP_API cmlp_status cmlp_trainer_step(cmlp_trainer *t, const cmlp_data *xy, double *loss_mean);
/* With max_grad_norm: *norm = the gradients' L2 norm (before clipping) of the last step taken
 * by cmlp_trainer_step or cmlp_trainer_epoch_run, and 1; 0 before any (or without clipping). */
CMLP_API int cmlp_trainer_last_grad_norm(const cmlp_trainer *t, double *norm);
/* The epoch loop: begin validates the data set once and draws this epoch's order (seeded by
 * seed and the epoch number); the trainer keeps xy's pointers, which must stay valid until the
 * epoch is done. With same_data != 0 the caller promises that xy is the data set of the
 * previous epoch_begin, unchanged since (the next epoch of one fit): a copy the trainer keeps on
 * the device is then reused and only the order is copied again. run does up to max_steps
 * optimizer steps (<= 0: to the end) and updates *st. Effective batches are batch_size *
 * accumulation_steps samples; the last one may be shorter and is normalised by its own size. */
CMLP_API cmlp_status cmlp_trainer_epoch_begin(cmlp_trainer *t, const cmlp_data *xy, int same_data,
                                              cmlp_epoch_state *st);
CMLP_API cmlp_status cmlp_trainer_epoch_run(cmlp_trainer *t, int64_t max_steps, cmlp_epoch_state *st);
/* epoch_run with a learning rate per step (a schedule stepped with every optimizer step): the
 * call's k-th step trains at rate lr[k] and, when momentum is not NULL, momentum[k] (Adam's beta1,
 * SGD's momentum), for up to n <= CMLP_MAX_RATES steps (fewer at the end of the epoch); when
 * scales is not NULL (an optimizer with parameter groups, cmlp_optim_set_parts), part p of the
 * k-th step steps at lr[k] * scales[k * nparts + p] rather than at the part's own scale (groups
 * whose rates move apart), and when part_momenta is not NULL too (it needs scales), at momentum
 * part_momenta[k * nparts + p] (a NaN: as without it; groups whose momenta move apart). The
 * optimizer's own rate, momentum, scales and momenta are the same after the call as before. Off
 * the CPU they reach the device with the call's scalars: a captured step replays at each of them. */
#define CMLP_MAX_RATES 16
CMLP_API cmlp_status cmlp_trainer_epoch_run_rates(cmlp_trainer *t, const double *lr, const double *momentum,
                                                  const double *scales, const double *part_momenta, int64_t n,
                                                  cmlp_epoch_state *st);
/* The parts of the trainer's optimizer's parameter groups (0 without them): a row of scales. */
CMLP_API int cmlp_trainer_optim_parts(const cmlp_trainer *t);
/* What automatic micro-batching moves: the micro-batch in use, the one it grows back to, the
 * good steps counted since the last change of size (up to 1 at the target), the micro-batch the last growth started from
 * (0: none), which an out-of-memory on the grown size goes back to, and the good steps the next
 * growth waits for (grow_interval, doubled by each growth that ran out of memory at its first
 * step). A checkpoint keeps them; set checks 1 <= size <= target <= batch_size *
 * accumulation_steps, good_steps >= 0, 0 <= grown_from < size and grow_wait >= 0 (0:
 * grow_interval). */
CMLP_API void cmlp_trainer_get_microbatch_state(const cmlp_trainer *t, int64_t *size, int64_t *target,
                                                int64_t *good_steps, int64_t *grown_from, int64_t *grow_wait);
CMLP_API cmlp_status cmlp_trainer_set_microbatch_state(cmlp_trainer *t, int64_t size, int64_t target,
                                                       int64_t good_steps, int64_t grown_from, int64_t grow_wait);
/* The micro-batch the last step that completed ran with (0: none yet), of the steps with at least
 * its rows (an epoch's short last step runs one smaller micro-batch, whatever the size in use).
 * The one in use may be larger already: a growth is tried at the next step. */
CMLP_API int64_t cmlp_trainer_last_microbatch(const cmlp_trainer *t);
/* Epochs begun (each draws its order from the seed and this count); set to resume a run from a
 * checkpoint so that the next epoch shuffles as the original run's did (an epoch left unfinished
 * by a failure is abandoned). */
CMLP_API int64_t cmlp_trainer_epochs(const cmlp_trainer *t);
CMLP_API cmlp_status cmlp_trainer_set_epochs(cmlp_trainer *t, int64_t epochs);
/* Frees the copy of the epochs' data set the trainer keeps on the device (kept from one epoch to
 * the next for same_data; also freed by an epoch_begin on other data, and with the trainer). */
CMLP_API void cmlp_trainer_release_data(cmlp_trainer *t);

/* ---- data parallelism ------------------------------------------------------------------ */

/* One process per rank, started by mpirun (or any launcher that sets the MPI environment); the
 * group is MPI_COMM_WORLD. Collectives must be called by every rank in the same order, with the
 * same counts. A trainer made data-parallel (cmlp_trainer_set_distributed) splits each step's
 * samples between the ranks and sums their gradients before the update, which then equals one
 * process training on all of them. */
typedef enum cmlp_dist_kind { CMLP_DIST_MPI = 0, CMLP_DIST_NCCL = 1 } cmlp_dist_kind;
/* Loads MPI and initialises it if needed. backend: how gradients on devices other than the host
 * are summed (CMLP_DIST_NCCL: NCCL between GPUs, its id sent over MPI); the host's go over MPI. */
CMLP_API cmlp_status cmlp_dist_init(int backend, int *rank, int *size);
CMLP_API int cmlp_dist_initialized(void);
/* 1 in a process forked from one that had started MPI: it takes part in no collective. */
CMLP_API int cmlp_dist_orphaned(void);
CMLP_API int cmlp_dist_rank(void);       /* 0 without a group */
CMLP_API int cmlp_dist_size(void);       /* 1 without a group */
CMLP_API int cmlp_dist_local_rank(void); /* among the ranks of this machine */
CMLP_API int cmlp_dist_local_size(void);
CMLP_API int cmlp_dist_backend(void); /* -1 without a group */
/* In place on host memory. type: 0 float32, 1 float64, 2 int64; op: 0 sum, 1 max, 2 min. */
CMLP_API cmlp_status cmlp_dist_all_reduce(void *buf, int64_t count, int type, int op);
CMLP_API cmlp_status cmlp_dist_broadcast(void *buf, int64_t bytes, int root);
CMLP_API cmlp_status cmlp_dist_barrier(void);
CMLP_API void cmlp_dist_destroy(void);  /* the group ends; MPI stays initialised */
/* seconds > 0: an MPI collective that waits longer for the other ranks ends the job (MPI_Abort),
 * as torch's process-group timeout (a rank that ended, or hangs, would keep the others waiting
 * forever); 0 (the default): collectives wait as long as they take. */
CMLP_API void cmlp_dist_set_timeout(double seconds);
/* Whether every collective first checks that the ranks make the same call (its kind, size,
 * element type and reduction, parts or root), in a collective of its own: ranks that do not all
 * get an error naming this rank's call (TORCH_DISTRIBUTED_DEBUG=DETAIL). */
CMLP_API void cmlp_dist_set_check(int on);
/* At the end of the process: MPI_Finalize if cmlp initialised MPI (it waits for every rank to get
 * there; where the group is still there, saying so on stderr after 10 s). */
CMLP_API void cmlp_dist_finalize(void);
CMLP_API void cmlp_dist_abort(int code); /* MPI_Abort: every rank's process ends */
CMLP_API void cmlp_dist_library_version(char *out, size_t cap);
/* on != 0: the trainer's steps are data-parallel over the process group (which must exist
 * while they run). Every rank calls epoch_begin with the same data set and the same settings;
 * batch_size is per rank, so an optimizer step takes batch_size * accumulation_steps * size
 * samples; each rank computes its share, and the loss and sample counts epoch_run reports are
 * the whole group's. cmlp_trainer_step takes each rank's own batch: the update is that of all
 * of them together. */
CMLP_API cmlp_status cmlp_trainer_set_distributed(cmlp_trainer *t, int on);

/* ---- planning ---------------------------------------------------------------------------- */

/* What a training run at micro-batch `batch` will hold, in requested bytes per category, and
 * the peak allocated and reserved bytes the device's allocator will show for it (a replay of
 * the run's requests under the current settings, on an empty cache). `data` is the data set a
 * fit keeps on a device other than the host (data_rows > 0), 0 on the CPU, where it stays in
 * host memory. */
/* What a planned request's block holds: the parameters and gradients, the optimizer's state,
 * the half-precision weights, a fit's data set, the step's buffers, the optimizer's param groups'
 * settings (counted in allocated_state; on a device, made as the groups are given to it). */
typedef enum {
    CMLP_HELD_MODEL,
    CMLP_HELD_STATE,
    CMLP_HELD_HALF,
    CMLP_HELD_DATA,
    CMLP_HELD_STEP,
    CMLP_HELD_PARTS,
} cmlp_plan_held;
enum { CMLP_PLAN_REQUESTS = 12 };

typedef struct cmlp_plan {
    int64_t parameters, gradients, optimizer_state, half_weights, activations, workspace, data;
    int64_t peak_allocated, peak_reserved;
    /* bytes of the step's buffers that lie in the gradients (counted there, not above): when
     * each optimizer step is one micro-batch, the first layer's weight gradient holds the
     * step's half weights and every buffer the step is done with before it writes that
     * gradient last, where they fit */
    int64_t in_gradients;
    /* the buffers of an evaluation after the step's went back (a validation chunk of eval_rows) */
    int64_t evaluation;
    /* what the device reserves from the moment it opens (CUDA's GEMM workspace), under the run
     * (peak_reserved is on top of it): a memory limit counts both */
    int64_t standing_reserved;
    /* the blocks that stay between steps as the allocator hands them out (rounded, the device
     * scalars after the gradients included): the parameters and gradients, the optimizer state,
     * the half-precision weights and a fit's data set; what a run at another micro-batch keeps
     * of what is allocated now */
    int64_t allocated_model, allocated_state, allocated_half, allocated_data;
    /* the run's requests up to its first step's buffers, in order, and what each holds */
    int nrequests;
    int64_t request_bytes[CMLP_PLAN_REQUESTS];
    cmlp_plan_held request_held[CMLP_PLAN_REQUESTS];
} cmlp_plan;

/* A GPU to plan for without opening it: its compute capability's major number (which sizes the
 * workspace block it holds from the moment it opens: see cuda_workspace.h) and its memory in
 * bytes (0: no bound). It is taken to have the virtual memory API (expandable segments), as a
 * data-center GPU has, and CUBLASLT_WORKSPACE_SIZE is read as a GPU opened here would. */
typedef struct {
    int major;
    int64_t total_memory;
} cmlp_gpu_desc;

/* optimizer_buffers: 2 for Adam (3 with AMSGrad), 1 for SGD with momentum, 0 for plain SGD; optimizer_shards: the
 * ranks a ZeroRedundancyOptimizer shards the state over (1: none; the plan is the first rank's,
 * whose part is the largest); optimizer_parts: the parameter groups' parts (cmlp_optim_set_parts'
 * n), whose settings a device keeps in its memory (counted with the optimizer state);
 * data_rows: the samples of a data set a fit copies to a device other than the host, data_row_bytes
 * each (uint8 images: the features; float32: 4 per feature), with their labels and, when
 * data_shuffled, their order (0 rows: none); loss_scaling: 1 with
 * a GradScaler; solo: 1 when every optimizer step is a single micro-batch of `batch` rows (no
 * accumulation). eval_rows > 0: the step is followed, after its buffers went back, by an
 * evaluation in chunks of eval_rows (a forward pass alone), whose input is staged
 * (eval_staged: uint8 images, or any on a GPU) or read in place, after each of `epochs` epochs (the
 * step's buffers taken again at the next one's start; epochs >= 1). eval_budget > 0: from the
 * evaluation on, the run is under a memory limit of that many bytes reserved on top of what the
 * device holds once open, as a fit under it is (a small evaluation whose pool can make no segment
 * there takes a piece of a cached large-pool block, cmlp_allocator_malloc_lent); a request that
 * finds no room under it is made as without it, so that peak_reserved is then over the budget
 * (and the segments later epochs would add stop at the limit, while it holds). The plan is for
 * device d, or, where gpu is not NULL, for the GPU it describes, which need not be here (d is
 * then not read). */
CMLP_API cmlp_status cmlp_plan_compute(const int *sizes, int nsizes, int64_t batch, int optimizer_buffers,
                                       int optimizer_shards, int optimizer_parts, cmlp_amp amp, int recompute,
                                       int loss_scaling, int solo, int64_t data_rows, int64_t data_row_bytes,
                                       int data_shuffled, int64_t eval_rows, int eval_staged, int64_t epochs,
                                       int64_t eval_budget, cmlp_device d, const cmlp_gpu_desc *gpu, cmlp_plan *out);

/* Trainer: on = 1 keeps the data set in host memory on any device (its batches staged from there,
 * as a single step's are) and frees a device copy made already; 0 (the default) copies it to a
 * device other than the host at an epoch's start, where there is room. */
CMLP_API void cmlp_trainer_set_host_data(cmlp_trainer *t, int on);
/* Whether the current epoch's data set is on the device. */
CMLP_API int cmlp_trainer_data_resident(const cmlp_trainer *t);
/* As cmlp_memory_try_requests on the trainer's device, with its copy of the data set freed first
 * where drop_data is 1 (what the requests would find were the batches staged from the host). */
CMLP_API cmlp_status cmlp_trainer_try_requests(cmlp_trainer *t, const int64_t *nbytes, int n, int drop_data,
                                               int *served);

/* ---- build ------------------------------------------------------------------------------- */

CMLP_API const char *cmlp_version(void);
CMLP_API const char *cmlp_blas_info(void); /* library, version and the kernel it runs */
CMLP_API const char *cmlp_compiler_info(void);

#ifdef __cplusplus
}
#endif
#endif /* CMLP_H */
