/*
 * The C half of libaggbox_mpi_*.so (docs/MPI.md): MPI calls intercepted
 * through the PMPI profiling interface. Compiled once per MPI implementation
 * (`make mpi`), because only the implementation's own headers know what its
 * handles are (Open MPI: pointers to structs; MPICH: integers); this file
 * only compares handles and decides which calls AggBox serves. Everything
 * else (configuration, the communicator, counters) is the Rust half
 * (mpi/src/lib.rs), over the aggbox runtime.
 *
 * Served: MPI_Allreduce and MPI_Reduce of MPI_INT / MPI_INT32_T with
 * MPI_SUM, MPI_MAX, MPI_MIN, MPI_PROD, MPI_BAND, MPI_BOR, MPI_BXOR,
 * MPI_LAND, MPI_LOR (the `mpi` column of include/aggbox/ops.def; and
 * MPI_FLOAT MPI_SUM when AGGBOX_MPI_FLOAT=quantized); MPI_Bcast of
 * fixed-size predefined types; on MPI_COMM_WORLD and on every
 * intracommunicator whose processes are a configured job's workers in its
 * rank order, or, with jobs on demand, on every intracommunicator of at
 * least 2 processes, each joining a job of its own (found at the
 * communicator's first such call and cached on it as an attribute).
 * Anything else goes to the PMPI_ function unchanged and is counted. A call AggBox can serve still goes to PMPI where the ranks
 * measured PMPI faster for its kind and size (route_begin / route_end).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* mpi/src/lib.rs */
enum {
    AGGBOX_MPI_OK = 0,
    AGGBOX_MPI_OVERFLOW = 1,
    AGGBOX_MPI_ERROR = -1,
    AGGBOX_MPI_NOT_SERVED = -2,
    AGGBOX_MPI_PENDING = -3,
    AGGBOX_MPI_JOINED = -4,
    AGGBOX_MPI_JOIN_FAILED = -5,
};
enum { AGGBOX_MPI_RUN_KEY_BYTES = 128 };
/* How long a failing rank waits before it aborts the job: see fail(). */
enum { ABORT_GRACE_US = 250 * 1000 };
enum { CALL_ALLREDUCE = 0, CALL_REDUCE = 1, CALL_BCAST = 2 };
int aggbox_mpi_position(int rank, int size, uint32_t position[2]);
int aggbox_mpi_start(uint32_t round, uint32_t agg_seq);
int aggbox_mpi_comm_job(const int *world_ranks, int size, int rank, uint32_t position[2]);
int aggbox_mpi_comm_start(uint32_t round, uint32_t agg_seq);
int aggbox_mpi_on_demand(void);
int aggbox_mpi_run_key(char *out, size_t len);
int aggbox_mpi_join(int rank, int size, const char *run);
int aggbox_mpi_comm_joined(int all);
void aggbox_mpi_finalize(void);
void aggbox_mpi_count_passed(int call);
int aggbox_mpi_serves(size_t bytes);
int aggbox_mpi_serves_float(void);
int aggbox_mpi_allreduce_i32(int session, int32_t *buf, size_t len, int op, int call);
int aggbox_mpi_allreduce_f32(int session, float *buf, size_t len, int call);
int aggbox_mpi_bcast(int session, void *buf, size_t len, int root);
enum { ROUTE_PMPI = 1, ROUTE_TRIAL = 2 };
int aggbox_mpi_route(int session, int call, int is_float, size_t bytes);
int aggbox_mpi_trial(int session, int call, int is_float, size_t bytes, int route, double seconds, double *times);
void aggbox_mpi_settle(int session, int call, int is_float, size_t bytes, const double *agreed);

/* MPI_COMM_WORLD's session (the Rust half's first), once MPI_Init opened it. */
enum { WORLD_SESSION = 0 };
/* The attribute that caches on a communicator which session serves it
 * (AGGBOX_MPI_NOT_SERVED: none); MPI_Comm_dup copies it (same processes,
 * same order), MPI_Comm_free drops it with the communicator. */
static int session_keyval = MPI_KEYVAL_INVALID;

/* The AggBox op (its number in include/aggbox/ops.def, whose `mpi` column
 * names the MPI op each row serves) that computes MPI op `op` exactly as
 * MPI does on int32 (SUM and PROD up to overflow, which falls back), or
 * -1. */
static int aggbox_op(MPI_Op op)
{
    if (op == MPI_OP_NULL)
        return -1;
#define AGGBOX_OP(number, NAME, name, identity, combine, finish, floats, kernel, ring, mpi) \
    if (op == (mpi)) return number;
#include "aggbox/ops.def"
#undef AGGBOX_OP
    return -1;
}

/* Only SUM and PROD can leave int32 (and be clamped where MPI wraps). */
static int op_may_overflow(MPI_Op op) { return op == MPI_SUM || op == MPI_PROD; }

static int is_int32(MPI_Datatype t) { return t == MPI_INT || t == MPI_INT32_T; }

/* Types whose values are their bytes, for broadcast. */
static int is_plain(MPI_Datatype t)
{
    return t == MPI_BYTE || t == MPI_CHAR || t == MPI_SIGNED_CHAR || t == MPI_UNSIGNED_CHAR ||
           t == MPI_SHORT || t == MPI_UNSIGNED_SHORT || t == MPI_INT || t == MPI_UNSIGNED ||
           t == MPI_LONG || t == MPI_UNSIGNED_LONG || t == MPI_LONG_LONG || t == MPI_FLOAT ||
           t == MPI_DOUBLE || t == MPI_INT8_T || t == MPI_UINT8_T || t == MPI_INT16_T ||
           t == MPI_UINT16_T || t == MPI_INT32_T || t == MPI_UINT32_T || t == MPI_INT64_T ||
           t == MPI_UINT64_T;
}

/* MPI_ERRORS_ARE_FATAL is MPI_COMM_WORLD's default: a failed AggBox call
 * (its reason printed by the Rust half) ends the job rather than leaving
 * the ranks in different states. */
static void fail(const char *what)
{
    fprintf(stderr, "aggbox-mpi: %s failed; aborting the job\n", what);
    fflush(stderr);
    /* The launcher forwards a rank's stderr through its proxy, and an abort
     * tears the proxies down at once: what the rank wrote just before (the
     * reason above and the Rust half's) can be lost, leaving the user an
     * empty stderr. A moment lets the proxy pass it on first. */
    usleep(ABORT_GRACE_US);
    PMPI_Abort(MPI_COMM_WORLD, 1);
}

/*
 * Where a job's session starts: every rank of `comm` asked the node (the
 * round and contribution seq after everything an earlier run on the same
 * running node used: docs/MPI.md) and passes its answer as `mine`; the
 * ranks agree on the newest answer, so that all start at the same position
 * even if a RESULT reached the node between two ranks' queries. Rounds and
 * seqs are serial numbers that wrap, so the newest is rank 0's answer plus
 * the largest (signed) distance of any rank's answer from it: PMPI_Bcast of
 * rank 0's, PMPI_Allreduce(MAX) of the distances.
 */
static void agree(MPI_Comm comm, const uint32_t mine[2], uint32_t agreed[2], const char *what)
{
    uint32_t base[2] = { mine[0], mine[1] };
    int32_t ahead[2], most[2];
    if (PMPI_Bcast(base, 2, MPI_UINT32_T, 0, comm) != MPI_SUCCESS) fail(what);
    ahead[0] = (int32_t)(mine[0] - base[0]);
    ahead[1] = (int32_t)(mine[1] - base[1]);
    if (PMPI_Allreduce(ahead, most, 2, MPI_INT32_T, MPI_MAX, comm) != MPI_SUCCESS) fail(what);
    agreed[0] = base[0] + (uint32_t)most[0];
    agreed[1] = base[1] + (uint32_t)most[1];
}

/*
 * Jobs on demand: every rank of `comm` tried to join its job (`joined`:
 * AGGBOX_MPI_JOINED or AGGBOX_MPI_JOIN_FAILED); the job is used only if
 * every rank has it (MPI_MIN), else every rank falls back alike (or the
 * job is aborted, AGGBOX_MPI_FALLBACK=abort). The session's index, or
 * AGGBOX_MPI_NOT_SERVED, or AGGBOX_MPI_ERROR.
 */
static int agree_joined(MPI_Comm comm, int joined, const char *what)
{
    int mine = joined == AGGBOX_MPI_JOINED, all = 0;
    if (PMPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, comm) != MPI_SUCCESS) fail(what);
    return aggbox_mpi_comm_joined(all);
}

/* MPI_COMM_WORLD's job on demand: rank 0's run key, broadcast, names the
 * run every rank joins. */
static void start_on_demand(int rank, int size)
{
    char run[AGGBOX_MPI_RUN_KEY_BYTES];
    memset(run, 0, sizeof run);
    if (rank == 0 && aggbox_mpi_run_key(run, sizeof run) != AGGBOX_MPI_OK) fail("MPI_Init");
    if (PMPI_Bcast(run, (int)sizeof run, MPI_CHAR, 0, MPI_COMM_WORLD) != MPI_SUCCESS) fail("MPI_Init");
    run[sizeof run - 1] = 0;
    int joined = aggbox_mpi_join(rank, size, run);
    if (joined == AGGBOX_MPI_ERROR) fail("MPI_Init");
    if (agree_joined(MPI_COMM_WORLD, joined, "MPI_Init") == AGGBOX_MPI_ERROR) fail("MPI_Init");
}

static int start(void)
{
    int rank, size;
    uint32_t mine[2] = { 0, 0 }, agreed[2];
    PMPI_Comm_rank(MPI_COMM_WORLD, &rank);
    PMPI_Comm_size(MPI_COMM_WORLD, &size);
    if (aggbox_mpi_on_demand()) {
        start_on_demand(rank, size);
    } else {
        if (aggbox_mpi_position(rank, size, mine) != AGGBOX_MPI_OK) fail("MPI_Init");
        agree(MPI_COMM_WORLD, mine, agreed, "MPI_Init");
        if (aggbox_mpi_start(agreed[0], agreed[1]) != AGGBOX_MPI_OK) fail("MPI_Init");
    }
    if (PMPI_Comm_create_keyval(MPI_COMM_DUP_FN, MPI_COMM_NULL_DELETE_FN, &session_keyval, NULL) != MPI_SUCCESS)
        fail("MPI_Init (an attribute key)");
    return MPI_SUCCESS;
}

/*
 * Which session serves `comm` (another communicator than MPI_COMM_WORLD),
 * found at its first call that AggBox could serve: every rank of it makes
 * that call with the same arguments, so every rank asks here at the same
 * moment, gets the same answer, and takes part in the agreement when the
 * job's session is new. The processes are named by their MPI_COMM_WORLD
 * ranks in `comm`'s rank order; the Rust half matches them to a job's
 * workers.
 */
static int find_session(MPI_Comm comm)
{
    int inter = 0, size, rank;
    if (PMPI_Comm_test_inter(comm, &inter) != MPI_SUCCESS || inter) return AGGBOX_MPI_NOT_SERVED;
    PMPI_Comm_size(comm, &size);
    PMPI_Comm_rank(comm, &rank);
    int *ranks = malloc(2 * (size_t)size * sizeof(int));
    if (!ranks) fail("a communicator's first call (out of memory)");
    int *world_ranks = ranks + size;
    for (int i = 0; i < size; i++) ranks[i] = i;
    MPI_Group group, world;
    PMPI_Comm_group(comm, &group);
    PMPI_Comm_group(MPI_COMM_WORLD, &world);
    PMPI_Group_translate_ranks(group, size, ranks, world, world_ranks);
    PMPI_Group_free(&group);
    PMPI_Group_free(&world);
    uint32_t mine[2] = { 0, 0 }, agreed[2];
    int session = aggbox_mpi_comm_job(world_ranks, size, rank, mine);
    free(ranks);
    if (session == AGGBOX_MPI_PENDING) {
        agree(comm, mine, agreed, "a communicator's first call");
        session = aggbox_mpi_comm_start(agreed[0], agreed[1]);
    } else if (session == AGGBOX_MPI_JOINED || session == AGGBOX_MPI_JOIN_FAILED) {
        session = agree_joined(comm, session, "a communicator's first call");
    }
    if (session == AGGBOX_MPI_ERROR) fail("a communicator's first call");
    return session;
}

/* The session that serves `comm`, or AGGBOX_MPI_NOT_SERVED. */
static int comm_session(MPI_Comm comm)
{
    if (comm == MPI_COMM_WORLD) return WORLD_SESSION;
    if (comm == MPI_COMM_NULL || session_keyval == MPI_KEYVAL_INVALID) return AGGBOX_MPI_NOT_SERVED;
    void *cached = NULL;
    int found = 0;
    if (PMPI_Comm_get_attr(comm, session_keyval, &cached, &found) != MPI_SUCCESS) return AGGBOX_MPI_NOT_SERVED;
    if (found) return (int)(intptr_t)cached;
    int session = find_session(comm);
    PMPI_Comm_set_attr(comm, session_keyval, (void *)(intptr_t)session);
    return session;
}

/* A served call's route (AggBox or PMPI) and, for a trial, when it began. */
struct routed {
    int session, call, is_float, route;
    size_t bytes;
    double start;
};

static double seconds_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Asks the Rust half which route a call AggBox can serve takes: every rank
 * gets the same answer (docs/MPI.md, "AggBox or PMPI"). */
static struct routed route_begin(int session, int call, int is_float, size_t bytes)
{
    struct routed r = { session, call, is_float, aggbox_mpi_route(session, call, is_float, bytes), bytes, 0.0 };
    if (r.route & ROUTE_TRIAL) r.start = seconds_now();
    return r;
}

/* After a trial: reports its time; after a class's last trial every rank
 * of `comm` is here in the same call, and the ranks agree on the slowest
 * rank's times, which settle the class alike everywhere. */
static void route_end(const struct routed *r, MPI_Comm comm)
{
    if (!(r->route & ROUTE_TRIAL)) return;
    double mine[2], agreed[2];
    if (!aggbox_mpi_trial(r->session, r->call, r->is_float, r->bytes, r->route, seconds_now() - r->start, mine)) return;
    if (PMPI_Allreduce(mine, agreed, 2, MPI_DOUBLE, MPI_MAX, comm) != MPI_SUCCESS) fail("agreeing on a call's route");
    aggbox_mpi_settle(r->session, r->call, r->is_float, r->bytes, agreed);
}

int MPI_Init(int *argc, char ***argv)
{
    int rc = PMPI_Init(argc, argv);
    return rc != MPI_SUCCESS ? rc : start();
}

int MPI_Init_thread(int *argc, char ***argv, int required, int *provided)
{
    int rc = PMPI_Init_thread(argc, argv, required, provided);
    return rc != MPI_SUCCESS ? rc : start();
}

int MPI_Finalize(void)
{
    aggbox_mpi_finalize();
    if (session_keyval != MPI_KEYVAL_INVALID) PMPI_Comm_free_keyval(&session_keyval);
    return PMPI_Finalize();
}

/* The session that serves a reduction of `count` elements of `type` with
 * `op` on `comm`, or AGGBOX_MPI_NOT_SERVED; the same answer on every rank,
 * as every rank passes the same arguments to a collective (the
 * communicator is looked at last: its first look is collective). */
static int reduction_session(int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm)
{
    int served = 0;
    if (count <= 0) return AGGBOX_MPI_NOT_SERVED;
    if (is_int32(type)) served = aggbox_op(op) >= 0 && aggbox_mpi_serves((size_t)count * 4);
    else if (type == MPI_FLOAT) served = op == MPI_SUM && aggbox_mpi_serves_float() && aggbox_mpi_serves((size_t)count * 4);
    return served ? comm_session(comm) : AGGBOX_MPI_NOT_SERVED;
}

/* Reduces buf[..count] in place on every rank; AGGBOX_MPI_OVERFLOW means
 * the int32 result was clamped and the caller reruns with PMPI. */
static int reduce_in_place(int session, void *buf, int count, MPI_Datatype type, MPI_Op op, int call)
{
    if (type == MPI_FLOAT) return aggbox_mpi_allreduce_f32(session, buf, (size_t)count, call);
    return aggbox_mpi_allreduce_i32(session, buf, (size_t)count, aggbox_op(op), call);
}

int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
    int session = reduction_session(count, datatype, op, comm);
    if (session < 0) {
        aggbox_mpi_count_passed(CALL_ALLREDUCE);
        return PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
    }
    size_t bytes = (size_t)count * 4;
    struct routed route = route_begin(session, CALL_ALLREDUCE, datatype == MPI_FLOAT, bytes);
    if (route.route & ROUTE_PMPI) {
        int rc = PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
        route_end(&route, comm);
        return rc;
    }
    void *input = NULL; /* the input the PMPI rerun needs after an overflow */
    if (sendbuf != MPI_IN_PLACE) {
        memcpy(recvbuf, sendbuf, bytes);
        input = (void *)sendbuf;
    } else if (is_int32(datatype) && op_may_overflow(op)) {
        input = malloc(bytes ? bytes : 1);
        if (!input) fail("MPI_Allreduce (out of memory)");
        memcpy(input, recvbuf, bytes);
    }
    int status = reduce_in_place(session, recvbuf, count, datatype, op, CALL_ALLREDUCE);
    int rc = MPI_SUCCESS;
    if (status == AGGBOX_MPI_OVERFLOW) rc = PMPI_Allreduce(input, recvbuf, count, datatype, op, comm);
    else if (status != AGGBOX_MPI_OK) fail("MPI_Allreduce");
    if (sendbuf == MPI_IN_PLACE) free(input);
    route_end(&route, comm);
    return rc;
}

/* The job's RESULTs go to every worker (a node-served job has no other
 * consumer), so MPI_Reduce is an allreduce into a scratch copy whose result
 * only the root keeps; the caller's buffers stay untouched until then, so
 * an overflow reruns the original call. */
int MPI_Reduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype, MPI_Op op, int root, MPI_Comm comm)
{
    int rank = -1;
    int session = reduction_session(count, datatype, op, comm);
    if (session >= 0) PMPI_Comm_rank(comm, &rank);
    /* MPI_IN_PLACE off the root is erroneous: PMPI reports it. */
    if (session < 0 || (sendbuf == MPI_IN_PLACE && rank != root)) {
        aggbox_mpi_count_passed(CALL_REDUCE);
        return PMPI_Reduce(sendbuf, recvbuf, count, datatype, op, root, comm);
    }
    size_t bytes = (size_t)count * 4;
    struct routed route = route_begin(session, CALL_REDUCE, datatype == MPI_FLOAT, bytes);
    if (route.route & ROUTE_PMPI) {
        int rc = PMPI_Reduce(sendbuf, recvbuf, count, datatype, op, root, comm);
        route_end(&route, comm);
        return rc;
    }
    void *scratch = malloc(bytes ? bytes : 1);
    if (!scratch) fail("MPI_Reduce (out of memory)");
    memcpy(scratch, sendbuf == MPI_IN_PLACE ? recvbuf : sendbuf, bytes);
    int status = reduce_in_place(session, scratch, count, datatype, op, CALL_REDUCE);
    int rc = MPI_SUCCESS;
    if (status == AGGBOX_MPI_OK) {
        if (rank == root) memcpy(recvbuf, scratch, bytes);
    } else if (status == AGGBOX_MPI_OVERFLOW) {
        rc = PMPI_Reduce(sendbuf, recvbuf, count, datatype, op, root, comm);
    } else {
        fail("MPI_Reduce");
    }
    free(scratch);
    route_end(&route, comm);
    return rc;
}

int MPI_Bcast(void *buffer, int count, MPI_Datatype datatype, int root, MPI_Comm comm)
{
    int size = 0, session = AGGBOX_MPI_NOT_SERVED;
    if (count > 0 && is_plain(datatype)) PMPI_Type_size(datatype, &size);
    if (size > 0 && aggbox_mpi_serves((size_t)count * (size_t)size)) session = comm_session(comm);
    if (session < 0) {
        aggbox_mpi_count_passed(CALL_BCAST);
        return PMPI_Bcast(buffer, count, datatype, root, comm);
    }
    size_t bytes = (size_t)count * (size_t)size;
    struct routed route = route_begin(session, CALL_BCAST, 0, bytes);
    int rc = MPI_SUCCESS;
    if (route.route & ROUTE_PMPI) rc = PMPI_Bcast(buffer, count, datatype, root, comm);
    else if (aggbox_mpi_bcast(session, buffer, bytes, root) != AGGBOX_MPI_OK) fail("MPI_Bcast");
    route_end(&route, comm);
    return rc;
}
