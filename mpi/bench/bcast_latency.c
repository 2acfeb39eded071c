/*
 * MPI_Bcast latency of one call at a time, MPI_INT from rank 0, timed as
 * the OSU micro-benchmark osu_bcast times it: every timed call is followed
 * by a barrier, so each starts with the ranks as a barrier leaves them, out
 * of step (the root's data can reach a rank before that rank calls), as in
 * a program that does other work between its broadcasts. osu_bcast.c's
 * calls run back to back instead, where a rank is mostly in its call before
 * the data comes and consecutive calls overlap.
 *
 * Before each timed call the root writes a pattern of that call and the
 * other ranks overwrite their buffer; after it every rank checks its buffer
 * (outside the timed interval), so every timed call delivered the root's
 * data.
 *
 * Usage: bcast_latency [ITERATIONS [COUNT...]]   (default 1000; 1 362 2242:
 * one datagram of 4 B, one full datagram at MTU 1500, seven datagrams)
 * Output per count: "count size_bytes avg_us min_us max_us root_us": the
 * mean µs per call of each rank averaged over the ranks, their min and
 * max, and the root's (which waits for every rank's acknowledgement under
 * libaggbox_mpi).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define ROOT 0
#define WARMUP 10
/* Not a value of root_value(): what the other ranks' buffers hold before a
 * call. */
#define UNSENT -1

/* Element i of call `call`: differs between calls and along the buffer,
 * never UNSENT. */
static int root_value(int call, long i) { return (int)((i * 7 + call) % 1000003); }

/* One call of `count` ints, its buffer prepared before and checked after;
 * returns its duration in µs. */
static double one_call(int *buf, int count, int call, int rank)
{
    for (long i = 0; i < count; i++) buf[i] = rank == ROOT ? root_value(call, i) : UNSENT;
    double start = MPI_Wtime();
    MPI_Bcast(buf, count, MPI_INT, ROOT, MPI_COMM_WORLD);
    double us = (MPI_Wtime() - start) * 1e6;
    for (long i = 0; i < count; i++) {
        if (buf[i] != root_value(call, i)) {
            fprintf(stderr, "bcast_latency: rank %d, %d ints, call %d: element %ld is %d, want %d\n", rank, count,
                    call, i, buf[i], root_value(call, i));
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    return us;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int iterations = argc > 1 ? atoi(argv[1]) : 1000;
    int default_counts[] = {1, 362, 2242};
    int ncounts = argc > 2 ? argc - 2 : 3;
    if (iterations < 1) {
        if (rank == ROOT) fprintf(stderr, "usage: bcast_latency [ITERATIONS [COUNT...]]\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (rank == ROOT) printf("# count size_bytes avg_us min_us max_us root_us (%d ranks)\n", size);
    for (int c = 0; c < ncounts; c++) {
        int count = argc > 2 ? atoi(argv[2 + c]) : default_counts[c];
        int *buf = count > 0 ? malloc((size_t)count * sizeof(int)) : NULL;
        if (!buf) {
            fprintf(stderr, "bcast_latency: rank %d: no buffer of %d ints\n", rank, count);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        for (int w = 0; w < WARMUP; w++) one_call(buf, count, w, rank);
        double total = 0;
        for (int i = 0; i < iterations; i++) total += one_call(buf, count, WARMUP + i, rank);
        double us = total / iterations, sum, min, max;
        MPI_Reduce(&us, &sum, 1, MPI_DOUBLE, MPI_SUM, ROOT, MPI_COMM_WORLD);
        MPI_Reduce(&us, &min, 1, MPI_DOUBLE, MPI_MIN, ROOT, MPI_COMM_WORLD);
        MPI_Reduce(&us, &max, 1, MPI_DOUBLE, MPI_MAX, ROOT, MPI_COMM_WORLD);
        if (rank == ROOT) printf("%d %ld %.2f %.2f %.2f %.2f\n", count, (long)count * 4, sum / size, min, max, us);
        fflush(stdout);
        free(buf);
    }
    MPI_Finalize();
    return 0;
}
