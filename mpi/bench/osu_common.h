/*
 * What the OSU-style latency programs (osu_allreduce.c, osu_bcast.c) share:
 * the start of a run, the number of timed calls per size and the report of
 * one size's mean, min and max over the ranks.
 */
#ifndef AGGBOX_OSU_COMMON_H
#define AGGBOX_OSU_COMMON_H

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

/* A program's run: this rank, the ranks, and its two arguments. */
struct osu_run {
    int rank, size;
    long max_bytes;  /* argv[1], default 1 MiB */
    int iterations;  /* argv[2], default 200 */
};

/* MPI_Init and the arguments `PROGRAM [MAX_BYTES [ITERATIONS]]`. */
static struct osu_run osu_init(int *argc, char ***argv)
{
    struct osu_run run;
    MPI_Init(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &run.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &run.size);
    run.max_bytes = *argc > 1 ? atol((*argv)[1]) : 1 << 20;
    run.iterations = *argc > 2 ? atoi((*argv)[2]) : 200;
    return run;
}

/* Fewer calls of the larger sizes, as OSU does, so that a run to the
 * 87.2 MB point takes minutes, not hours. */
static int timed_calls(long bytes, int iterations)
{
    if (bytes >= (1L << 20)) return iterations / 20 > 3 ? iterations / 20 : 3;
    if (bytes > 65536) return iterations / 4 > 10 ? iterations / 4 : 10;
    return iterations;
}

/* The header line rank 0 prints before the sizes. */
static void osu_header(int rank, int size)
{
    if (rank == 0) printf("# size_bytes avg_us min_us max_us mb_per_s (%d ranks)\n", size);
}

/* One size's line: `us` is this rank's mean µs per call; rank 0 prints the
 * mean over the ranks, their min and max, and bytes / mean (MB/s). */
static void osu_report(long bytes, double us, int rank, int size)
{
    double sum, min, max;
    MPI_Reduce(&us, &sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    MPI_Reduce(&us, &min, 1, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
    MPI_Reduce(&us, &max, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) printf("%ld %.2f %.2f %.2f %.2f\n", bytes, sum / size, min, max, bytes / (sum / size));
    fflush(stdout);
}

#endif
