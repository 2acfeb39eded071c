/*
 * allreduce_points: plain MPI_Allreduce (SUM) of large vectors, the `openmpi`
 * and `openmpi-f32` backends of `aggbox-bench large` (experiment 9,
 * src/bin/aggbox-bench/large/), measured and checked as that benchmark
 * measures and checks Gloo (scripts/gloo_allreduce.py):
 *
 * - The input of rank r in call k (k = 0 first, warm-up included) is
 *   x[i] = ((i + 1000 r) mod 2001) - 1000 + k, so the sum over the ranks is
 *   known without communication; as float its values and sums are integers
 *   below 2^24, so the float result is exact too.
 * - Before each call the ranks meet in MPI_Barrier; t0/t1 are
 *   CLOCK_MONOTONIC seconds (as Python's time.monotonic(): one clock for
 *   every process of the machine, which MPI_Wtime does not promise) around
 *   the in-place MPI_Allreduce (Gloo's all_reduce is in place as well), so
 *   the time of a call is max(t1) - min(t0) over the ranks, computed by the
 *   caller from every rank's pair, exactly as for Gloo.
 * - After each call (outside t0..t1) every rank compares its result element
 *   by element with the known sum (`wrong`: mismatched elements) and takes
 *   its int64 sum (`sum`, which the caller checks again); rank 0 gathers
 *   every rank's (t0, t1, wrong, sum).
 *
 * Usage: allreduce_points int|float COUNT[,COUNT...] WARMUP REPS
 * Output (rank 0, stdout, one JSON object per line): first
 *   {"mpi": "<MPI_Get_library_version, first line>", "world": W, "dtype": "int32"|"float32"}
 * then one line per call:
 *   {"elements": N, "k": K, "warmup": true|false,
 *    "ranks": [{"t0": S, "t1": S, "wrong": N, "sum": N}, ...]}   (index = rank)
 * Exits 0, 2 when any result was wrong, 1 on a usage or allocation error.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double monotonic_secs(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Input of rank `rank` in call 0: ((i + 1000 rank) mod 2001) - 1000. */
static void fill_base(int32_t *x, long n, int rank)
{
    long j = (1000L * rank) % 2001;
    for (long i = 0; i < n; i++) {
        x[i] = (int32_t)(j - 1000);
        if (++j == 2001) j = 0;
    }
}

/* Allocation failures end the whole job: the other ranks would wait forever. */
static void *alloc_or_abort(size_t bytes, const char *what)
{
    void *p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "allreduce_points: cannot allocate %zu bytes for %s\n", bytes, what);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return p;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc != 5 || (strcmp(argv[1], "int") != 0 && strcmp(argv[1], "float") != 0)) {
        if (rank == 0) fprintf(stderr, "usage: %s int|float COUNT[,COUNT...] WARMUP REPS\n", argv[0]);
        MPI_Finalize();
        return 1;
    }
    int is_float = strcmp(argv[1], "float") == 0;
    int warmup = atoi(argv[3]), reps = atoi(argv[4]);
    if (rank == 0) {
        char version[MPI_MAX_LIBRARY_VERSION_STRING];
        int len;
        MPI_Get_library_version(version, &len);
        version[strcspn(version, "\n,")] = 0;
        printf("{\"mpi\": \"%s\", \"world\": %d, \"dtype\": \"%s\"}\n", version, world,
               is_float ? "float32" : "int32");
        fflush(stdout);
    }
    /* Per call, per rank: (t0, t1) and (wrong, sum), gathered on rank 0. */
    double *times = alloc_or_abort(2 * sizeof(double) * (size_t)world, "times");
    long long *checks = alloc_or_abort(2 * sizeof(long long) * (size_t)world, "checks");
    int bad = 0;
    char *counts = strdup(argv[2]);
    for (char *tok = strtok(counts, ","); tok; tok = strtok(NULL, ",")) {
        long n = atol(tok);
        if (n <= 0 || n > (1L << 30)) {
            if (rank == 0) fprintf(stderr, "allreduce_points: bad element count %s\n", tok);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        /* base: this rank's call-0 input; expect: the call-0 sum over the
         * ranks (call k adds world * k to both). */
        int32_t *base = alloc_or_abort((size_t)n * 4, "the input");
        int32_t *expect = alloc_or_abort((size_t)n * 4, "the expected sum");
        void *buf = alloc_or_abort((size_t)n * 4, "the vector");
        memset(expect, 0, (size_t)n * 4);
        for (int r = 0; r < world; r++) {
            fill_base(base, n, r);
            for (long i = 0; i < n; i++) expect[i] += base[i];
        }
        fill_base(base, n, rank);
        for (int k = 0; k < warmup + reps; k++) {
            if (is_float) {
                float *f = buf;
                for (long i = 0; i < n; i++) f[i] = (float)(base[i] + k);
            } else {
                int32_t *x = buf;
                for (long i = 0; i < n; i++) x[i] = base[i] + k;
            }
            MPI_Barrier(MPI_COMM_WORLD);
            double t[2];
            t[0] = monotonic_secs();
            int rc = MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, is_float ? MPI_FLOAT : MPI_INT, MPI_SUM,
                                   MPI_COMM_WORLD);
            t[1] = monotonic_secs();
            if (rc != MPI_SUCCESS) {
                fprintf(stderr, "allreduce_points: rank %d: MPI_Allreduce of %ld elements, call %d: error %d\n",
                        rank, n, k, rc);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
            long long c[2] = {0, 0}; /* wrong, sum */
            int32_t add = (int32_t)(world * k);
            if (is_float) {
                const float *f = buf;
                for (long i = 0; i < n; i++) {
                    c[0] += f[i] != (float)(expect[i] + add);
                    c[1] += (long long)f[i];
                }
            } else {
                const int32_t *x = buf;
                for (long i = 0; i < n; i++) {
                    c[0] += x[i] != expect[i] + add;
                    c[1] += x[i];
                }
            }
            bad |= c[0] != 0;
            MPI_Gather(t, 2, MPI_DOUBLE, times, 2, MPI_DOUBLE, 0, MPI_COMM_WORLD);
            MPI_Gather(c, 2, MPI_LONG_LONG, checks, 2, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
            if (rank == 0) {
                printf("{\"elements\": %ld, \"k\": %d, \"warmup\": %s, \"ranks\": [", n, k,
                       k < warmup ? "true" : "false");
                for (int r = 0; r < world; r++)
                    printf("%s{\"t0\": %.9f, \"t1\": %.9f, \"wrong\": %lld, \"sum\": %lld}", r ? ", " : "",
                           times[2 * r], times[2 * r + 1], checks[2 * r], checks[2 * r + 1]);
                printf("]}\n");
                fflush(stdout);
            }
        }
        free(base);
        free(expect);
        free(buf);
    }
    free(counts);
    free(times);
    free(checks);
    int any_bad;
    MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_LOR, MPI_COMM_WORLD);
    MPI_Finalize();
    return any_bad ? 2 : 0;
}
