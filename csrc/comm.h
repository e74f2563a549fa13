/* comm.h - the communicator of data parallelism. MPI itself lives in its own shared library,
 * _cmlp_mpi.so beside the extension (csrc/comm_mpi.c, built where an MPI implementation is
 * found, linked with it), loaded by comm.c when a process group is made: cmlp imports and runs
 * where there is no MPI at all. Ranks are MPI_COMM_WORLD's, as mpirun (or any launcher that
 * sets the MPI environment) starts them.
 */
#ifndef CMLP_COMM_H
#define CMLP_COMM_H

#include "backend.h"

#define CMLP_MPI_ABI 5

typedef enum cmlp_reduce_op {
    CMLP_REDUCE_SUM = 0,
    CMLP_REDUCE_MAX = 1,
    CMLP_REDUCE_MIN = 2,
    CMLP_REDUCE_PRODUCT = 3,
    CMLP_REDUCE_BAND = 4, /* the bitwise ones: of int64 only */
    CMLP_REDUCE_BOR = 5,
    CMLP_REDUCE_BXOR = 6
} cmlp_reduce_op;

/* Element types of host buffers a collective takes. */
typedef enum cmlp_comm_type { CMLP_COMM_F32 = 0, CMLP_COMM_F64 = 1, CMLP_COMM_I64 = 2 } cmlp_comm_type;

typedef struct cmlp_mpi_module {
    int abi; /* CMLP_MPI_ABI of the library */
    /* MPI_Init_thread (unless MPI is initialised already: then it is not finalised here either);
     * the rank and size of MPI_COMM_WORLD, and of the ranks on this machine (shared memory). */
    cmlp_status (*init)(int *rank, int *size, int *local_rank, int *local_size);
    /* In place, on host memory, every rank the same count, type and op. */
    cmlp_status (*all_reduce)(void *buf, int64_t count, cmlp_comm_type type, cmlp_reduce_op op);
    cmlp_status (*broadcast)(void *buf, int64_t bytes, int root);
    cmlp_status (*barrier)(void);
    /* MPI_Finalize where init initialised MPI; once, at the end of the process. It waits for every
     * rank to get there: with live (the group was not destroyed), a word on stderr when that takes
     * a while (a rank that waits for this one in a collective would wait forever). */
    void (*finalize)(int live);
    /* MPI_Abort on MPI_COMM_WORLD: every rank's process ends (a rank that fails alone would
     * otherwise leave the others waiting in a collective). */
    void (*abort)(int code);
    /* The library's version string (MPI_Get_library_version's first line). */
    void (*version)(char *out, size_t cap);
    /* In place, on host memory: rank r's part of buf, elements [r * chunk, (r + 1) * chunk) of
     * count (the last parts short or empty), to every rank. */
    cmlp_status (*all_gather)(void *buf, int64_t count, int64_t chunk, cmlp_comm_type type);
    /* In place, on host floats cut into parts as all_gather's: the sum over the ranks of rank
     * r's part ends in rank r's part of buf; what the other parts of buf hold is undefined. */
    cmlp_status (*reduce_scatter)(float *buf, int64_t count, int64_t chunk);
    /* seconds > 0: a collective that waits longer for the other ranks ends the job (MPI_Abort),
     * as torch's process-group timeout; 0: collectives wait as long as they take. */
    void (*set_timeout)(double seconds);
} cmlp_mpi_module;

typedef const cmlp_mpi_module *(*cmlp_mpi_entry_fn)(cmlp_error_fn set_error);

#endif /* CMLP_COMM_H */
