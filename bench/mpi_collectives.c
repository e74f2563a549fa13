/* mpi_collectives.c - the collectives a data-parallel step can sum and gather the reference
 * model's 535,818 gradients with, timed on the machine's MPI: one MPI_Allreduce; a reduce-scatter
 * as one MPI_Reduce_scatter or as an MPI_Reduce per part to its owner; a gather as one
 * MPI_Allgatherv or as an MPI_Bcast per part from its owner. Parts as cmlp cuts them (equal,
 * multiples of 64 floats). 300 calls each, twice; each section starts at a barrier, and rank 0
 * prints the slowest rank's mean time per call. The buffer holds zeros, so that repeated sums
 * stay finite and normal (no inf, no subnormal).
 *
 *     mpicc -O2 bench/mpi_collectives.c -o /tmp/mpi_collectives && mpirun -np 2 /tmp/mpi_collectives
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#define ITERS 300

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const int n = 535818, chunk = ((n + size - 1) / size + 63) / 64 * 64;
    float *buf = malloc(sizeof(float) * n);
    int *counts = malloc(sizeof(int) * size), *offsets = malloc(sizeof(int) * size);
    if (!buf || !counts || !offsets) MPI_Abort(MPI_COMM_WORLD, 1);
    for (int i = 0; i < n; i++) buf[i] = 0.0f;
    for (int r = 0; r < size; r++) {
        int lo = r * chunk < n ? r * chunk : n, hi = lo + chunk < n ? lo + chunk : n;
        offsets[r] = lo;
        counts[r] = hi - lo;
    }
    for (int pass = 0; pass < 2; pass++) {
        double t[6];
        MPI_Barrier(MPI_COMM_WORLD);
        t[0] = MPI_Wtime();
        for (int i = 0; i < ITERS; i++) MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        t[1] = MPI_Wtime();
        for (int i = 0; i < ITERS; i++)
            MPI_Reduce_scatter(MPI_IN_PLACE, buf, counts, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        t[2] = MPI_Wtime();
        for (int i = 0; i < ITERS; i++)
            for (int r = 0; r < size; r++)
                MPI_Reduce(r == rank ? MPI_IN_PLACE : buf + offsets[r], buf + offsets[r], counts[r], MPI_FLOAT,
                           MPI_SUM, r, MPI_COMM_WORLD);
        t[3] = MPI_Wtime();
        for (int i = 0; i < ITERS; i++)
            MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts, offsets, MPI_FLOAT, MPI_COMM_WORLD);
        t[4] = MPI_Wtime();
        for (int i = 0; i < ITERS; i++)
            for (int r = 0; r < size; r++) MPI_Bcast(buf + offsets[r], counts[r], MPI_FLOAT, r, MPI_COMM_WORLD);
        t[5] = MPI_Wtime();
        for (int k = 5; k > 0; k--) t[k] -= t[k - 1]; /* each section's time on this rank */
        t[0] = 0.0;
        MPI_Reduce(rank == 0 ? MPI_IN_PLACE : t, t, 6, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        for (int k = 1; k < 6; k++) t[k] += t[k - 1]; /* back to marks, from the slowest rank */
        if (rank == 0)
            printf("%d ranks, %d floats: allreduce %.0f us, reduce_scatter %.0f us, reduce per part %.0f us, "
                   "allgatherv %.0f us, bcast per part %.0f us\n",
                   size, n, (t[1] - t[0]) / ITERS * 1e6, (t[2] - t[1]) / ITERS * 1e6, (t[3] - t[2]) / ITERS * 1e6,
                   (t[4] - t[3]) / ITERS * 1e6, (t[5] - t[4]) / ITERS * 1e6);
    }
    free(buf);
    free(counts);
    free(offsets);
    MPI_Finalize();
    return 0;
}
