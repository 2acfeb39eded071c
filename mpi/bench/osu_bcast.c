/*
 * MPI_Bcast latency from rank 0, MPI_BYTE on MPI_COMM_WORLD, in the manner
 * of the OSU micro-benchmark osu_bcast: per size, warm-up calls, then
 * back-to-back timed calls between barriers; the latency is the mean per
 * call, averaged over the ranks (min and max over the ranks too), the
 * bandwidth the buffer's bytes over that mean. MPI_BYTE is a fixed-size
 * predefined type, which libaggbox_mpi serves (mpi/aggbox_mpi.c), so the
 * preloaded run of scripts/mpi_bench.sh goes through AggBox.
 *
 * After the timed calls every rank checks its buffer: the other ranks fill
 * theirs with a byte the root never sends before the timed calls, so a
 * buffer that holds the root's pattern came from the timed calls.
 *
 * Usage: osu_bcast [MAX_BYTES [ITERATIONS]]   (default 1 MiB, 200)
 * Sizes: 64 B to MAX_BYTES by 4×.
 * Output: "size_bytes avg_us min_us max_us mb_per_s" per size, as
 * osu_allreduce's.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "osu_common.h"

#define ROOT 0
/* Not a value of root_byte(): what the other ranks' buffers hold before the
 * timed calls. */
#define UNSENT_BYTE 0xff

/* The root's byte i at a size: differs between sizes and along the buffer,
 * and is never UNSENT_BYTE. */
static uint8_t root_byte(long bytes, long i) { return (uint8_t)((i * 7 + bytes / 64) % 251); }


static void check_buffer(const uint8_t *buf, long bytes, int rank)
{
    for (long i = 0; i < bytes; i++) {
        if (buf[i] != root_byte(bytes, i)) {
            fprintf(stderr, "osu_bcast: rank %d, %ld bytes: byte %ld is %u, want %u\n", rank, bytes, i, buf[i],
                    root_byte(bytes, i));
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
}

int main(int argc, char **argv)
{
    struct osu_run run = osu_init(&argc, &argv);
    int rank = run.rank, size = run.size, iterations = run.iterations;
    long max_bytes = run.max_bytes;
    uint8_t *buf = malloc((size_t)max_bytes);
    if (!buf) {
        fprintf(stderr, "osu_bcast: rank %d: out of memory for %ld bytes\n", rank, max_bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    osu_header(rank, size);
    for (long bytes = 64; bytes <= max_bytes; bytes *= 4) {
        int iters = timed_calls(bytes, iterations);
        if (rank == ROOT)
            for (long i = 0; i < bytes; i++) buf[i] = root_byte(bytes, i);
        for (int w = 0; w < 10; w++) MPI_Bcast(buf, (int)bytes, MPI_BYTE, ROOT, MPI_COMM_WORLD);
        if (rank != ROOT) memset(buf, UNSENT_BYTE, (size_t)bytes);
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        for (int i = 0; i < iters; i++) MPI_Bcast(buf, (int)bytes, MPI_BYTE, ROOT, MPI_COMM_WORLD);
        double us = (MPI_Wtime() - start) * 1e6 / iters;
        check_buffer(buf, bytes, rank);
        osu_report(bytes, us, rank, size);
        MPI_Barrier(MPI_COMM_WORLD);
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
