/*
 * MPI_Allreduce latency, int32 MPI_SUM on MPI_COMM_WORLD, in the manner of
 * the OSU micro-benchmark osu_allreduce: per size, warm-up calls, then
 * back-to-back timed calls between barriers; the latency is the mean per
 * call, averaged over the ranks (min and max over the ranks too). Run
 * plain and with LD_PRELOAD=libaggbox_mpi_*.so by scripts/mpi_bench.sh.
 *
 * Usage: osu_allreduce [MAX_BYTES [ITERATIONS]]   (default 1 MiB, 200)
 * Output: "size_bytes avg_us min_us max_us" per size, 4 B to MAX_BYTES by 4×.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    long max_bytes = argc > 1 ? atol(argv[1]) : 1 << 20;
    int iterations = argc > 2 ? atoi(argv[2]) : 200;
    int32_t *buf = malloc((size_t)max_bytes), *out = malloc((size_t)max_bytes);
    for (long i = 0; i < max_bytes / 4; i++) buf[i] = rank + (int32_t)i;
    if (rank == 0) printf("# size_bytes avg_us min_us max_us (%d ranks)\n", size);
    for (long bytes = 4; bytes <= max_bytes; bytes *= 4) {
        int count = (int)(bytes / 4);
        /* Fewer calls of the largest sizes, as OSU does. */
        int iters = bytes > 65536 ? (iterations / 4 > 10 ? iterations / 4 : 10) : iterations;
        for (int w = 0; w < 10; w++) MPI_Allreduce(buf, out, count, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        for (int i = 0; i < iters; i++) MPI_Allreduce(buf, out, count, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        double us = (MPI_Wtime() - start) * 1e6 / iters, sum, min, max;
        MPI_Reduce(&us, &sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        MPI_Reduce(&us, &min, 1, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
        MPI_Reduce(&us, &max, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) printf("%ld %.2f %.2f %.2f\n", bytes, sum / size, min, max);
        MPI_Barrier(MPI_COMM_WORLD);
    }
    free(buf);
    free(out);
    MPI_Finalize();
    return 0;
}
