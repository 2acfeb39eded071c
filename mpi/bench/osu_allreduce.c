/*
 * MPI_Allreduce latency and bandwidth, int32 MPI_SUM on MPI_COMM_WORLD, in
 * the manner of the OSU micro-benchmark osu_allreduce: per size, warm-up
 * calls, then back-to-back timed calls between barriers; the latency is the
 * mean per call, averaged over the ranks (min and max over the ranks too),
 * the bandwidth the vector's bytes over that mean. Run plain and with
 * LD_PRELOAD=libaggbox_mpi_*.so by scripts/mpi_bench.sh.
 *
 * Every rank checks the result of the last timed call at every size against
 * the known sum (element i of rank r is r + i), so a preloaded run that
 * prints numbers also returned what plain MPI returns.
 *
 * Usage: osu_allreduce [MAX_BYTES [ITERATIONS]]   (default 1 MiB, 200)
 * Sizes: 4 B to MAX_BYTES by 4×, then 87,200,000 B (21.8 M int32, the
 * gradient of a ResNet-34, docs/BENCHMARKS.md) when MAX_BYTES reaches it.
 * Output: "size_bytes avg_us min_us max_us mb_per_s" per size.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "osu_common.h"

/* The large-vector point of docs/BENCHMARKS.md: 21.8 M int32. */
#define LARGE_VECTOR_BYTES 87200000L

/* Ten warm-up calls hold the library's route trials (AGGBOX_MPI_ROUTE,
 * 8 calls per size by default), so the timed calls see the settled route;
 * the large-vector point, seconds per call, gets two. */
static int warmup_calls(long bytes) { return bytes >= LARGE_VECTOR_BYTES ? 2 : 10; }

/* Aborts the job unless out[..count] is the sum over `ranks` ranks of
 * rank + i (in range of int32 for the sizes here: 8 ranks × 21.8 M). */
static void check_sum(const int32_t *out, int count, int ranks, int rank, long bytes)
{
    int64_t rank_sum = (int64_t)ranks * (ranks - 1) / 2;
    for (int i = 0; i < count; i++) {
        int64_t want = rank_sum + (int64_t)ranks * i;
        if (out[i] != (int32_t)want) {
            fprintf(stderr, "osu_allreduce: rank %d, %ld bytes: element %d is %d, want %lld\n", rank, bytes, i,
                    out[i], (long long)want);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
}

int main(int argc, char **argv)
{
    struct osu_run run = osu_init(&argc, &argv);
    int rank = run.rank, size = run.size, iterations = run.iterations;
    long max_bytes = run.max_bytes;
    int32_t *buf = malloc((size_t)max_bytes), *out = malloc((size_t)max_bytes);
    if (!buf || !out) {
        fprintf(stderr, "osu_allreduce: rank %d: out of memory for %ld bytes\n", rank, max_bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (long i = 0; i < max_bytes / 4; i++) buf[i] = rank + (int32_t)i;
    osu_header(rank, size);
    long bytes = 4;
    while (bytes <= max_bytes) {
        int count = (int)(bytes / 4), iters = timed_calls(bytes, iterations);
        for (int w = 0; w < warmup_calls(bytes); w++)
            MPI_Allreduce(buf, out, count, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        for (int i = 0; i < iters; i++) MPI_Allreduce(buf, out, count, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        double us = (MPI_Wtime() - start) * 1e6 / iters;
        check_sum(out, count, size, rank, bytes);
        osu_report(bytes, us, rank, size);
        MPI_Barrier(MPI_COMM_WORLD);
        if (bytes < LARGE_VECTOR_BYTES && bytes * 4 > LARGE_VECTOR_BYTES && max_bytes >= LARGE_VECTOR_BYTES)
            bytes = LARGE_VECTOR_BYTES;
        else
            bytes *= 4;
    }
    free(buf);
    free(out);
    MPI_Finalize();
    return 0;
}
