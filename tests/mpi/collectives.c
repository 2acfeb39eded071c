/*
 * The MPI program of tests/mpi_collectives.rs (docs/MPI.md, "Tests"): every
 * call libaggbox_mpi serves, and some it must pass through, each checked on
 * every rank against a result computed locally from every rank's input
 * (MPI's arithmetic: int32 wraps). Rank 0 prints one line per call,
 * `result NAME COUNT FNV1A`, so that a run with the library and one without
 * can be compared line by line; every rank prints its mismatches and exits
 * 1 if it had any.
 *
 * After the sizes, the same calls on other communicators
 * (communicators()): a duplicate of MPI_COMM_WORLD; the even and the odd
 * world ranks each in reverse order (the test configures a job for the
 * even ones in that order, none for the odd ones), and a duplicate of it;
 * the same halves in world order (no job has that order).
 *
 * Usage: collectives [SIZE...]   (default 1 362 363 1448 10000)
 *        collectives float SIZE...  MPI_FLOAT MPI_SUM allreduce and reduce,
 *                                  each element within float_bound() of
 *                                  the exact sum (quantized when the
 *                                  library serves it)
 *        collectives float-repeat N SIZE...  per size, N MPI_FLOAT MPI_SUM
 *                                  calls, allreduce and reduce (roots in
 *                                  turn) alternating, the inputs' magnitude
 *                                  changing from call to call, each checked
 *                                  as above
 *        collectives repeat N SIZE...  per size, N allreduces (the ops in
 *                                  turn) and N broadcasts (roots in turn),
 *                                  each checked: enough calls of one size
 *                                  for the library's route trials
 *        collectives halves N      allreduces of N elements on
 *                                  MPI_COMM_WORLD, then on its lower and
 *                                  upper half in world order (the lower
 *                                  one's ranks are a prefix of the
 *                                  world's), then on MPI_COMM_WORLD again
 *        collectives kill-rank R   rank R dies (SIGALRM, no handler) after
 *                                  1 s of back-to-back allreduces; the
 *                                  others must fail, not hang: they exit 3
 *                                  if 60 s of calls went by without it
 *        collectives pause DIR N   10 allreduces and broadcasts of N
 *                                  elements (as repeat), then a pause: once
 *                                  every rank's calls completed, rank 0
 *                                  creates DIR/paused and every rank waits
 *                                  for DIR/resume (the test's, 120 s at
 *                                  most: exit 4), then the same calls again
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int rank, size, failures;

static const struct { const char *name; MPI_Op op; } OPS[] = {
    {"SUM", MPI_SUM}, {"MAX", MPI_MAX}, {"MIN", MPI_MIN}, {"PROD", MPI_PROD},
    {"BAND", MPI_BAND}, {"BOR", MPI_BOR}, {"BXOR", MPI_BXOR},
    {"LAND", MPI_LAND}, {"LOR", MPI_LOR},
};
#define NOPS (int)(sizeof OPS / sizeof OPS[0])

/* Rank r's input element i for op `k`: mixed signs and bits; PROD's small
 * enough that 8 ranks' product fits. `big` makes SUM leave int32. */
static int32_t input(int r, int i, int k, int big)
{
    uint32_t x = (uint32_t)(r + 1) * 2654435761u ^ (uint32_t)i * 40503u ^ (uint32_t)k * 97u;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    if (big) return (int32_t)(0x7ffffff0u - (x & 7)); /* 4 of these wrap */
    if (OPS[k].op == MPI_PROD) return (int32_t)(x % 5) - 2;
    if (OPS[k].op == MPI_SUM) return (int32_t)(x % 2000001u) - 1000000;
    if (OPS[k].op == MPI_LAND || OPS[k].op == MPI_LOR) return x % 5 ? (int32_t)x : 0; /* both answers occur */
    return (int32_t)x;
}

/* MPI's result for element i: int32 arithmetic wraps. */
static int32_t expected(int i, int k, int big)
{
    uint32_t acc = (uint32_t)input(0, i, k, big);
    for (int r = 1; r < size; r++) {
        int32_t v = input(r, i, k, big), a = (int32_t)acc;
        MPI_Op op = OPS[k].op;
        if (op == MPI_SUM) acc += (uint32_t)v;
        else if (op == MPI_PROD) acc *= (uint32_t)v;
        else if (op == MPI_MAX) acc = (uint32_t)(v > a ? v : a);
        else if (op == MPI_MIN) acc = (uint32_t)(v < a ? v : a);
        else if (op == MPI_BAND) acc &= (uint32_t)v;
        else if (op == MPI_BOR) acc |= (uint32_t)v;
        else if (op == MPI_LAND) acc = a && v;
        else if (op == MPI_LOR) acc = a || v;
        else acc ^= (uint32_t)v;
    }
    return (int32_t)acc;
}

static uint64_t fnv1a(const void *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
    return h;
}

/* Counts the mismatches of got[..n] against want; rank 0 prints the
 * result line (`significant`: this rank has the result). */
static void check(const char *name, int n, const int32_t *got, const int32_t *want, int significant)
{
    int bad = 0, first = -1;
    if (significant)
        for (int i = 0; i < n; i++)
            if (got[i] != want[i]) { if (first < 0) first = i; bad++; }
    if (bad) {
        fprintf(stderr, "collectives: rank %d: %s n=%d: %d mismatches, first at %d: got %d want %d\n",
                rank, name, n, bad, first, got[first], want[first]);
        failures++;
    }
    if (rank == 0) printf("result %s %d %016llx\n", name, n, (unsigned long long)fnv1a(want, (size_t)n * 4));
}

static void reductions(int n)
{
    int32_t *in = malloc((size_t)n * 4), *out = malloc((size_t)n * 4), *want = malloc((size_t)n * 4);
    char name[64];
    for (int k = 0; k < NOPS; k++) {
        for (int i = 0; i < n; i++) { in[i] = input(rank, i, k, 0); want[i] = expected(i, k, 0); }
        snprintf(name, sizeof name, "allreduce-%s", OPS[k].name);
        MPI_Allreduce(in, out, n, MPI_INT, OPS[k].op, MPI_COMM_WORLD);
        check(name, n, out, want, 1);

        snprintf(name, sizeof name, "allreduce-inplace-int32_t-%s", OPS[k].name);
        memcpy(out, in, (size_t)n * 4);
        MPI_Allreduce(MPI_IN_PLACE, out, n, MPI_INT32_T, OPS[k].op, MPI_COMM_WORLD);
        check(name, n, out, want, 1);

        int root = (k + 1) % size; /* roots other than 0 too */
        snprintf(name, sizeof name, "reduce-root%d-%s", root, OPS[k].name);
        memset(out, 0, (size_t)n * 4);
        MPI_Reduce(in, out, n, MPI_INT, OPS[k].op, root, MPI_COMM_WORLD);
        check(name, n, out, want, rank == root);

        snprintf(name, sizeof name, "reduce-inplace-root%d-%s", root, OPS[k].name);
        memcpy(out, in, (size_t)n * 4);
        MPI_Reduce(rank == root ? MPI_IN_PLACE : in, rank == root ? out : NULL, n, MPI_INT, OPS[k].op, root, MPI_COMM_WORLD);
        check(name, n, out, want, rank == root);
    }
    /* SUM that leaves int32: MPI wraps; the library must match it. */
    int k = 0;
    for (int i = 0; i < n; i++) { in[i] = input(rank, i, k, 1); want[i] = expected(i, k, 1); }
    MPI_Allreduce(in, out, n, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    check("allreduce-SUM-wraps", n, out, want, 1);

    /* Broadcast of ints from the last rank. */
    for (int i = 0; i < n; i++) { want[i] = input(size - 1, i, 0, 0); out[i] = rank == size - 1 ? want[i] : 0; }
    MPI_Bcast(out, n, MPI_INT, size - 1, MPI_COMM_WORLD);
    check("bcast-int", n, out, want, 1);
    free(in); free(out); free(want);
}

/* `times` allreduces and broadcasts of n elements (see the usage). */
static void repeated(int times, int n)
{
    int32_t *in = malloc((size_t)n * 4), *out = malloc((size_t)n * 4), *want = malloc((size_t)n * 4);
    char name[64];
    for (int t = 0; t < times; t++) {
        int k = t % NOPS, root = t % size;
        for (int i = 0; i < n; i++) { in[i] = input(rank, i + t, k, 0); want[i] = expected(i + t, k, 0); }
        snprintf(name, sizeof name, "repeat%d-allreduce-%s", t, OPS[k].name);
        MPI_Allreduce(in, out, n, MPI_INT, OPS[k].op, MPI_COMM_WORLD);
        check(name, n, out, want, 1);
        for (int i = 0; i < n; i++) { want[i] = input(root, i + t, 0, 0); out[i] = rank == root ? want[i] : 0; }
        snprintf(name, sizeof name, "repeat%d-bcast-root%d", t, root);
        MPI_Bcast(out, n, MPI_INT, root, MPI_COMM_WORLD);
        check(name, n, out, want, 1);
    }
    free(in); free(out); free(want);
}

/* Calls the library must pass to PMPI unchanged: not int32, a user op.
 * Each still correct. Returns how many allreduces. */
static void user_sum(void *in, void *inout, int *len, MPI_Datatype *type)
{
    (void)type;
    for (int i = 0; i < *len; i++) ((int32_t *)inout)[i] += ((int32_t *)in)[i];
}

static int passed_through(void)
{
    int64_t l = rank + 1, lsum = 0;
    MPI_Allreduce(&l, &lsum, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    int32_t want = (int32_t)((int64_t)size * (size + 1) / 2), got = (int32_t)lsum;
    check("passthrough-int64", 1, &got, &want, 1);

    MPI_Op op;
    MPI_Op_create(user_sum, 1, &op);
    int32_t v = rank + 1;
    MPI_Allreduce(&v, &got, 1, MPI_INT, op, MPI_COMM_WORLD);
    check("passthrough-userop", 1, &got, &want, 1);
    MPI_Op_free(&op);
    return 2;
}

/* Op k of input(r, i, k, 0) folded over the world ranks r of `parity`
 * (-1: all of them); SUM and MAX only, whose result does not depend on the
 * order. */
static int32_t expected_of(int i, int k, int parity)
{
    int first = 1;
    uint32_t acc = 0;
    for (int r = 0; r < size; r++) {
        if (parity >= 0 && r % 2 != parity) continue;
        int32_t v = input(r, i, k, 0), a = (int32_t)acc;
        if (first) acc = (uint32_t)v;
        else if (OPS[k].op == MPI_SUM) acc += (uint32_t)v;
        else acc = (uint32_t)(v > a ? v : a);
        first = 0;
    }
    return (int32_t)acc;
}

/* Allreduce SUM of n elements on `comm`, whose processes are the world
 * ranks of `parity` (-1: all), checked. */
static void sum_on(MPI_Comm comm, const char *name, int n, int parity)
{
    int32_t *in = malloc((size_t)n * 4), *out = malloc((size_t)n * 4), *want = malloc((size_t)n * 4);
    for (int i = 0; i < n; i++) { in[i] = input(rank, i, 0, 0); want[i] = expected_of(i, 0, parity); }
    MPI_Allreduce(in, out, n, MPI_INT, MPI_SUM, comm);
    check(name, n, out, want, 1);
    free(in); free(out); free(want);
}

/* The calls of reductions() on communicators other than MPI_COMM_WORLD
 * (n elements): served where the configuration has a job whose workers are
 * the communicator's processes in its rank order, passed through
 * elsewhere, correct everywhere. Rank 0's lines are of the even half. */
static void communicators(int n)
{
    MPI_Comm dup, half, half_dup;
    MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    sum_on(dup, "comm-dup-world-SUM", n, -1);
    MPI_Comm_free(&dup);

    /* Each parity's ranks, highest world rank first. */
    int parity = rank % 2, half_rank, half_size;
    MPI_Comm_split(MPI_COMM_WORLD, parity, size - rank, &half);
    MPI_Comm_rank(half, &half_rank);
    MPI_Comm_size(half, &half_size);
    sum_on(half, "comm-half-reversed-SUM", n, parity);

    int32_t *in = malloc((size_t)n * 4), *out = malloc((size_t)n * 4), *want = malloc((size_t)n * 4);
    int k = 1; /* MAX, to the half's last rank (its lowest world rank) */
    for (int i = 0; i < n; i++) { in[i] = input(rank, i, k, 0); want[i] = expected_of(i, k, parity); }
    memset(out, 0, (size_t)n * 4);
    MPI_Reduce(in, out, n, MPI_INT, MPI_MAX, half_size - 1, half);
    check("comm-half-reversed-reduce-MAX", n, out, want, half_rank == half_size - 1);

    /* Broadcast from the half's rank 0: its highest world rank. */
    int root_world = parity;
    while (root_world + 2 < size) root_world += 2;
    for (int i = 0; i < n; i++) { want[i] = input(root_world, i, 0, 0); out[i] = half_rank == 0 ? want[i] : 0; }
    MPI_Bcast(out, n, MPI_INT, 0, half);
    check("comm-half-reversed-bcast", n, out, want, 1);
    free(in); free(out); free(want);

    MPI_Comm_dup(half, &half_dup);
    sum_on(half_dup, "comm-half-reversed-dup-SUM", n, parity);
    MPI_Comm_free(&half_dup);
    MPI_Comm_free(&half);

    /* The same processes in world order: no job has them in this order. */
    MPI_Comm_split(MPI_COMM_WORLD, parity, rank, &half);
    sum_on(half, "comm-half-world-order-SUM", n, parity);
    MPI_Comm_free(&half);
}

/* Rank r's float input element i of float call t: mixed signs, |x| < 143
 * times 1, 2 or 4 in turn, so that the largest magnitude, and with it the
 * adaptive scale, changes from call to call. */
static float finput(int r, int i, int t)
{
    return (float)(input(r, i + t, 0, 0) % 1000) / 7.0f * (float)(1 << (t % 3));
}

static double absd(double x) { return x < 0 ? -x : x; }

/* The spacing of floats at |x| (one unit in the last place). */
static double ulp(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint32_t exponent = (bits >> 23) & 0xff;
    if (exponent == 0) exponent = 1;
    uint32_t pow2_bits = exponent << 23; /* the float 2^(exponent - 127) */
    float pow2;
    memcpy(&pow2, &pow2_bits, 4);
    return (double)pow2 / 8388608.0; /* 2^23 */
}

/* The adaptive quantization scale of a SUM over `size` ranks whose
 * largest |x| is m (docs/RUNTIME.md, "Quantization"): the largest power of
 * two S <= 2^40 with size·(m·S + 0.5) < 2^31. */
static double adaptive_scale(double m)
{
    double s = 1099511627776.0; /* 2^40 */
    while (s > 1e-30 && size * (m * s + 0.5) >= 2147483648.0) s /= 2;
    return s;
}

/* How far a float SUM whose inputs' magnitudes add up to `mag` may be from
 * the exact sum, at the scale `scale`. AggBox (docs/RUNTIME.md,
 * "Quantization"): x·S is exact (S a power of two), so each rank's
 * rounding to 1/S is off by at most 0.5/S, the int32 sum is exact, and the
 * result's conversion to float adds half an ulp of it. MPI's own float sum
 * rounds at each of its size - 1 additions, half an ulp of a partial sum
 * (at most mag) each: within size ulps of mag. */
static double float_bound(double scale, double mag)
{
    return size * 0.5 / scale + size * ulp((float)mag);
}

/* Float call t (see finput) of n elements: an MPI_Allreduce (root < 0) or
 * an MPI_Reduce to `root`, each element checked against the exact sum
 * within float_bound at the adaptive scale of the call's inputs. */
static void float_call(int n, int t, int root)
{
    float *v = malloc((size_t)n * 4), *out = malloc((size_t)n * 4);
    double m = 0;
    for (int i = 0; i < n; i++) {
        v[i] = finput(rank, i, t);
        for (int r = 0; r < size; r++)
            if (absd(finput(r, i, t)) > m) m = absd(finput(r, i, t));
    }
    double scale = adaptive_scale(m);
    if (root < 0) MPI_Allreduce(v, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else MPI_Reduce(v, out, n, MPI_FLOAT, MPI_SUM, root, MPI_COMM_WORLD);
    if (root < 0 || rank == root) {
        int bad = 0, first = -1;
        double first_want = 0, first_bound = 0;
        for (int i = 0; i < n; i++) {
            double want = 0, mag = 0;
            for (int r = 0; r < size; r++) { want += finput(r, i, t); mag += absd(finput(r, i, t)); }
            double bound = float_bound(scale, mag);
            if (absd(out[i] - want) > bound) {
                if (first < 0) { first = i; first_want = want; first_bound = bound; }
                bad++;
            }
        }
        if (bad) {
            fprintf(stderr, "collectives: rank %d: float %s call %d n=%d: %d beyond the bound, first at %d: got %.9g want %.9g (bound %.3g)\n",
                    rank, root < 0 ? "allreduce" : "reduce", t, n, bad, first, out[first], first_want, first_bound);
            failures++;
        }
    }
    free(v); free(out);
}

/* `float SIZE`: an allreduce and a reduce to the last rank. */
static void floats(int n)
{
    float_call(n, 0, -1);
    float_call(n, 0, size - 1);
}

/* `float-repeat N SIZE`: N calls, allreduces and reduces alternating. */
static void floats_repeated(int times, int n)
{
    for (int t = 0; t < times; t++) float_call(n, t, t % 2 ? (t / 2) % size : -1);
}

/* Op k of input(r, i, k, 0) summed over the world ranks [lo, hi). */
static int32_t expected_range(int i, int k, int lo, int hi)
{
    uint32_t acc = 0;
    for (int r = lo; r < hi; r++) acc += (uint32_t)input(r, i, k, 0);
    return (int32_t)acc;
}

/* SUM allreduce of n elements on `comm`, the world ranks [lo, hi). */
static void sum_range(MPI_Comm comm, const char *name, int n, int lo, int hi)
{
    int32_t *in = malloc((size_t)n * 4), *out = malloc((size_t)n * 4), *want = malloc((size_t)n * 4);
    for (int i = 0; i < n; i++) { in[i] = input(rank, i, 0, 0); want[i] = expected_range(i, 0, lo, hi); }
    MPI_Allreduce(in, out, n, MPI_INT, MPI_SUM, comm);
    check(name, n, out, want, 1);
    free(in); free(out); free(want);
}

/* MPI_COMM_WORLD, its halves in world order, MPI_COMM_WORLD again. */
static void halves(int n)
{
    MPI_Comm half;
    int upper = rank >= size / 2, lo = upper ? size / 2 : 0, hi = upper ? size : size / 2;
    sum_range(MPI_COMM_WORLD, "halves-world-SUM", n, 0, size);
    MPI_Comm_split(MPI_COMM_WORLD, upper, rank, &half);
    sum_range(half, "halves-half-SUM", n, lo, hi);
    MPI_Comm_free(&half);
    sum_range(MPI_COMM_WORLD, "halves-world-again-SUM", n, 0, size);
}

/* Back-to-back allreduces while rank `victim` dies mid-way. */
static int kill_rank(int victim)
{
    enum { N = 1448 };
    static int32_t v[N];
    if (rank == victim) alarm(1);
    time_t start = time(NULL);
    long calls = 0;
    while (time(NULL) - start < 60) {
        for (int i = 0; i < N; i++) v[i] = rank;
        MPI_Allreduce(MPI_IN_PLACE, v, N, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        calls++;
    }
    fprintf(stderr, "collectives: rank %d: %ld calls in 60 s and no failure\n", rank, calls);
    return 3;
}

/* `pause DIR N` (see the usage). Every rank says whether the calls before
 * the pause were right. */
static int pause_between_calls(const char *dir, int n)
{
    char path[4096];
    repeated(10, n);
    fprintf(stderr, "collectives: rank %d: before the pause: %s\n", rank, failures ? "FAILED" : "ok");
    MPI_Barrier(MPI_COMM_WORLD); /* not intercepted: every rank's calls are done */
    if (rank == 0) {
        snprintf(path, sizeof path, "%s/paused", dir);
        FILE *f = fopen(path, "w");
        if (!f || fclose(f) != 0) {
            fprintf(stderr, "collectives: rank 0: cannot create %s\n", path);
            return 4;
        }
    }
    snprintf(path, sizeof path, "%s/resume", dir);
    for (int waited_ms = 0; access(path, F_OK) != 0; waited_ms += 10) {
        if (waited_ms >= 120000) {
            fprintf(stderr, "collectives: rank %d: no %s within 120 s\n", rank, path);
            return 4;
        }
        usleep(10000);
    }
    repeated(10, n);
    return failures ? 1 : 0;
}

int main(int argc, char **argv)
{
    /* The float runs enter through MPI_Init_thread, the others MPI_Init:
     * the library intercepts both. */
    int provided;
    if (argc > 1 && strncmp(argv[1], "float", 5) == 0) MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    else MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc == 3 && strcmp(argv[1], "kill-rank") == 0) {
        int rc = kill_rank(atoi(argv[2]));
        MPI_Finalize();
        return rc;
    }
    if (argc == 4 && strcmp(argv[1], "pause") == 0) {
        int rc = pause_between_calls(argv[2], atoi(argv[3]));
        fprintf(stderr, "collectives: rank %d: %s\n", rank, rc ? "FAILED" : "ok");
        MPI_Finalize();
        return rc;
    }
    if (argc == 3 && strcmp(argv[1], "halves") == 0) {
        halves(atoi(argv[2]));
        fprintf(stderr, "collectives: rank %d: %s\n", rank, failures ? "FAILED" : "ok");
        MPI_Finalize();
        return failures ? 1 : 0;
    }
    static const int DEFAULT_SIZES[] = {1, 362, 363, 1448, 10000};
    if (argc > 3 && strcmp(argv[1], "repeat") == 0) {
        for (int a = 3; a < argc; a++) repeated(atoi(argv[2]), atoi(argv[a]));
        fprintf(stderr, "collectives: rank %d: %s\n", rank, failures ? "FAILED" : "ok");
        MPI_Finalize();
        return failures ? 1 : 0;
    }
    if (argc > 3 && strcmp(argv[1], "float-repeat") == 0) {
        for (int a = 3; a < argc; a++) floats_repeated(atoi(argv[2]), atoi(argv[a]));
        fprintf(stderr, "collectives: rank %d: %s\n", rank, failures ? "FAILED" : "ok");
        MPI_Finalize();
        return failures ? 1 : 0;
    }
    if (argc > 1 && strcmp(argv[1], "float") == 0) {
        for (int a = 2; a < argc; a++) floats(atoi(argv[a]));
        fprintf(stderr, "collectives: rank %d: %s\n", rank, failures ? "FAILED" : "ok");
        MPI_Finalize();
        return failures ? 1 : 0;
    }
    if (argc > 1) {
        for (int a = 1; a < argc; a++) reductions(atoi(argv[a]));
    } else {
        for (size_t s = 0; s < sizeof DEFAULT_SIZES / sizeof DEFAULT_SIZES[0]; s++) reductions(DEFAULT_SIZES[s]);
    }
    int passed = passed_through();
    if (rank == 0) printf("passthrough-allreduce-calls %d\n", passed);
    communicators(1000);
    fprintf(stderr, "collectives: rank %d: %s\n", rank, failures ? "FAILED" : "ok");
    MPI_Finalize();
    return failures ? 1 : 0;
}
