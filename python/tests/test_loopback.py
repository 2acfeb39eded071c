"""The aggbox package on loopback: every participant of a socket-backend job
(W workers and the aggregator's application) is a thread of this process,
on 127.0.0.x, so no root and no network namespace is needed. Run by
tests/python_package.rs (`make test`), or by hand with the built package on
PYTHONPATH:

    PYTHONPATH=target/python/site /usr/bin/python3 -m unittest discover -s python/tests -p 'test_*.py' -v

Threads of one process also show that a call releases the GIL: a worker
blocked in a call holds no lock the others need to make theirs.
"""

import array
import os
import tempfile
import threading
import time
import unittest

import numpy as np
import torch

import aggbox
from reference import floats, ints, tolerance

WORKERS = 3
# A range of 64 ports of this process's own, so that parallel runs do not
# collide, below the kernel's ephemeral ports (32768..60999), so that no
# client socket holds one.
BASE_PORT = 10000 + (os.getpid() % 300) * 64
_next_port = [BASE_PORT]


def fresh_port() -> int:
    _next_port[0] += 1
    return _next_port[0]


def make_job(workers=WORKERS, deadline=10.0, quantization=None):
    """A socket-backend job on loopback: W worker communicators and the
    aggregator's (rank None), built at once (the aggregator first)."""
    job_port = fresh_port()
    data_port = fresh_port()
    peers = [f"127.0.0.{2 + r}:{data_port}" for r in range(workers)]
    kw = dict(backend="socket", deadline=deadline, mtu=1500)
    if quantization is not None:
        kw["quantization"] = quantization
    agg = aggbox.Communicator(7, peers, "127.0.0.1", job_port, None, **kw)
    ranks = [aggbox.Communicator(7, peers, "127.0.0.1", job_port, r, **kw) for r in range(workers)]
    return agg, ranks


def run_all(fns):
    """Runs fns[i]() on a thread each; returns their results (or raises the
    first exception)."""
    results = [None] * len(fns)
    errors = [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a call hung for 60 s"
    for e in errors:
        if e is not None:
            raise e
    return results


class Collectives(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.agg, cls.ranks = make_job()

    @classmethod
    def tearDownClass(cls):
        for c in [cls.agg, *cls.ranks]:
            c.close()

    def allreduce_all(self, bufs, op, agg_buf):
        """Every worker allreduces its buffer, the aggregator takes part."""
        fns = [lambda c=c, b=b: c.allreduce(b, op=op) for c, b in zip(self.ranks, bufs)]
        fns.append(lambda: self.agg.allreduce(agg_buf, op=op))
        return run_all(fns)

    def test_attributes(self):
        self.assertEqual([c.rank for c in self.ranks], list(range(WORKERS)))
        self.assertIsNone(self.agg.rank)
        self.assertEqual(self.ranks[0].workers, WORKERS)
        self.assertEqual(self.ranks[0].job, 7)
        self.assertEqual(self.ranks[0].mtu, 1500)
        self.assertFalse(self.ranks[0].node_served)
        self.assertIn("rank=1", repr(self.ranks[1]))

    def test_int32_numpy_allreduce_equals_the_reference(self):
        n = 100_003
        for op, ref in [("sum", np.sum), ("max", np.max), ("min", np.min)]:
            bufs = [ints(r, n) for r in range(WORKERS)]
            want = ref(np.stack(bufs).astype(np.int64), axis=0).astype(np.int32)
            out = np.zeros(n, dtype=np.int32)
            clamped = self.allreduce_all(bufs, op, out)
            self.assertEqual(clamped, [False] * (WORKERS + 1))
            for r, b in enumerate(bufs):
                np.testing.assert_array_equal(b, want, err_msg=f"rank {r} {op}")
            np.testing.assert_array_equal(out, want, err_msg=f"aggregator {op}")

    def test_int32_logical_ops_of_the_op_table(self):
        n = 1_001
        self.assertEqual(aggbox.OPS[-2:], ["land", "lor"])
        for op, ref in [("land", np.all), ("lor", np.any)]:
            # rank r's element i is 0 where bit r of i is 0: both answers occur
            bufs = [np.where((np.arange(n) >> r) & 1 == 1, ints(r, n), 0).astype(np.int32) for r in range(WORKERS)]
            want = ref(np.stack(bufs) != 0, axis=0).astype(np.int32)
            self.assertTrue(0 < want.sum() < n, op)
            out = np.zeros(n, dtype=np.int32)
            clamped = self.allreduce_all(bufs, op, out)
            self.assertEqual(clamped, [False] * (WORKERS + 1))
            for r, b in enumerate(bufs):
                np.testing.assert_array_equal(b, want, err_msg=f"rank {r} {op}")
            np.testing.assert_array_equal(out, want, err_msg=f"aggregator {op}")

    def test_int32_sum_that_overflows_is_clamped_and_says_so(self):
        bufs = [np.full(10, 2**30, dtype=np.int32) for _ in range(WORKERS)]
        clamped = self.allreduce_all(bufs, "sum", np.zeros(10, dtype=np.int32))
        self.assertTrue(all(clamped))
        np.testing.assert_array_equal(bufs[0], np.full(10, 2**31 - 1, dtype=np.int32))

    def test_float32_mean_and_sum_within_the_documented_bound(self):
        n = 50_000
        for op in ["mean", "sum"]:
            bufs = [floats(r, n) for r in range(WORKERS)]
            exact = np.stack(bufs).astype(np.float64).sum(axis=0)
            if op == "mean":
                exact /= WORKERS
            m = float(max(np.abs(b).max() for b in bufs))
            bound = self.ranks[0].float_error_bound(m, mean=(op == "mean"))
            # Quantization, then one rounding to float32 (half an ulp).
            tol = tolerance(bound, exact)
            self.assertGreater(bound, 0.0)
            self.assertLess(bound, 1e-9 * WORKERS)
            self.allreduce_all(bufs, op, np.zeros(n, dtype=np.float32))
            for r, b in enumerate(bufs):
                err = np.abs(b.astype(np.float64) - exact)
                self.assertTrue(np.all(err <= tol), f"rank {r} {op}: max error {err.max()} vs bound {bound}")
                np.testing.assert_array_equal(b, bufs[0], err_msg="every rank has the same floats")

    def test_float_error_bound_follows_the_scale(self):
        c = self.ranks[0]
        s = aggbox.adaptive_quantization_scale(0.01, WORKERS)
        self.assertEqual(s, 2.0 ** round(np.log2(s)), "a power of two")
        self.assertLess(WORKERS * (0.01 * s + 0.5), 2**31)
        self.assertGreaterEqual(WORKERS * (0.01 * 2 * s + 0.5), 2**31)
        self.assertEqual(c.float_error_bound(0.01, mean=False), 0.5 * WORKERS / s)
        self.assertEqual(c.float_error_bound(0.01, mean=True), 0.5 / s)

    def test_broadcast_from_a_worker_and_from_the_aggregator(self):
        n = 30_001
        for root in [1, "aggregator"]:
            for dtype in [np.int32, np.float32]:
                msg = (np.arange(n) * 3.25 - 7).astype(dtype)
                bufs = [msg.copy() if root == r else np.zeros(n, dtype=dtype) for r in range(WORKERS)]
                agg_buf = msg.copy() if root == "aggregator" else np.zeros(n, dtype=dtype)
                fns = [lambda c=c, b=b: c.broadcast(b, root=root) for c, b in zip(self.ranks, bufs)]
                fns.append(lambda: self.agg.broadcast(agg_buf, root=root))
                run_all(fns)
                for b in [*bufs, agg_buf]:
                    np.testing.assert_array_equal(b, msg)

    def test_reduce_gives_the_aggregator_the_result_and_leaves_workers_alone(self):
        n = 1000
        bufs = [ints(r, n) for r in range(WORKERS)]
        copies = [b.copy() for b in bufs]
        out = np.zeros(n, dtype=np.int32)
        fns = [lambda c=c, b=b: c.reduce(b, op="sum") for c, b in zip(self.ranks, bufs)]
        fns.append(lambda: self.agg.reduce(out, op="sum"))
        run_all(fns)
        np.testing.assert_array_equal(out, np.stack(copies).sum(axis=0).astype(np.int32))
        for b, c in zip(bufs, copies):
            np.testing.assert_array_equal(b, c)

    def test_other_buffers_array_and_memoryview(self):
        bufs = [array.array("i", [r, 10 * r, -r]) for r in range(WORKERS)]
        out = memoryview(bytearray(12)).cast("i")
        self.allreduce_all(bufs, "sum", out)
        s = sum(range(WORKERS))
        self.assertEqual(list(bufs[0]), [s, 10 * s, -s])
        self.assertEqual(out.tolist(), [s, 10 * s, -s])

    def test_torch_tensors_in_place(self):
        n = 20_000
        bufs = [torch.from_numpy(ints(r, n)) for r in range(WORKERS)]
        want = torch.stack([torch.from_numpy(ints(r, n)) for r in range(WORKERS)]).sum(0, dtype=torch.int32)
        ptrs = [b.data_ptr() for b in bufs]
        self.allreduce_all(bufs, "sum", torch.zeros(n, dtype=torch.int32))
        for b, p in zip(bufs, ptrs):
            self.assertTrue(torch.equal(b, want))
            self.assertEqual(b.data_ptr(), p, "in place")
        # float32, a parameter that requires grad (the call writes its data).
        params = [torch.nn.Parameter(torch.from_numpy(floats(r, n))) for r in range(WORKERS)]
        ref = [torch.from_numpy(floats(r, n)).numpy() for r in range(WORKERS)]
        self.allreduce_all(params, "mean", torch.zeros(n))
        self.allreduce_all(ref, "mean", np.zeros(n, dtype=np.float32))
        for p in params:
            self.assertTrue(np.array_equal(p.detach().numpy(), ref[0]), "torch and numpy: the same floats")
        # broadcast of a 2-D tensor.
        msg = torch.arange(600, dtype=torch.float32).reshape(20, 30)
        bufs = [msg.clone() if r == 0 else torch.zeros(20, 30) for r in range(WORKERS)]
        agg_buf = torch.zeros(20, 30)
        fns = [lambda c=c, b=b: c.broadcast(b, root=0) for c, b in zip(self.ranks, bufs)]
        fns.append(lambda: self.agg.broadcast(agg_buf, root=0))
        run_all(fns)
        for b in [*bufs, agg_buf]:
            self.assertTrue(torch.equal(b, msg))

    def test_bad_buffers_raise_before_any_communication(self):
        c = self.ranks[0]
        cases = [
            (np.zeros(8, dtype=np.float64), TypeError, "format 'd'"),
            (np.zeros(8, dtype=np.int64), TypeError, "not an int32 or float32 buffer"),
            (np.zeros(16, dtype=np.int32)[::2], ValueError, "not C-contiguous"),
            (np.zeros((4, 4), dtype=np.float32).T, ValueError, "not C-contiguous"),
            ([1, 2, 3], TypeError, "does not support the buffer protocol"),
            (b"abcd", TypeError, "not an int32 or float32 buffer"),
        ]
        ro = np.zeros(8, dtype=np.int32)
        ro.flags.writeable = False
        cases.append((ro, ValueError, "read-only"))
        cases += [
            (torch.zeros(8, dtype=torch.float64), TypeError, "torch.float64"),
            (torch.zeros(8, dtype=torch.float16), TypeError, "torch.float16"),
            (torch.zeros(4, 4).t(), ValueError, "Tensor.contiguous"),
        ]
        for buf, exc, text in cases:
            for call in [c.allreduce, c.reduce, c.broadcast]:
                with self.assertRaises(exc, msg=f"{call.__name__}({type(buf).__name__})") as cm:
                    call(buf)
                self.assertIn(text, str(cm.exception))
                self.assertIn(call.__name__, str(cm.exception))
        with self.assertRaisesRegex(ValueError, "op 'xor' on float32"):
            c.allreduce(np.zeros(4, dtype=np.float32), op="xor")
        with self.assertRaisesRegex(ValueError, "op 'nope'"):
            c.allreduce(np.zeros(4, dtype=np.int32), op="nope")
        with self.assertRaisesRegex(ValueError, "root"):
            c.broadcast(np.zeros(4, dtype=np.int32), root="somebody")
        # Nothing was sent: the next collective still lines up on every rank.
        bufs = [np.full(5, r, dtype=np.int32) for r in range(WORKERS)]
        self.allreduce_all(bufs, "sum", np.zeros(5, dtype=np.int32))
        np.testing.assert_array_equal(bufs[0], np.full(5, sum(range(WORKERS)), dtype=np.int32))


class Failures(unittest.TestCase):
    def test_timeout_names_the_missing_rank(self):
        agg, ranks = make_job(workers=2, deadline=1.0)
        try:
            bufs = [np.ones(1000, dtype=np.int32), np.ones(1000, dtype=np.int32)]
            start = time.monotonic()
            errs = []

            def call(c, b):
                try:
                    c.allreduce(b)
                except aggbox.CommTimeoutError as e:
                    errs.append(e)

            # rank 1 never calls.
            run_all([lambda: call(ranks[0], bufs[0]), lambda: call(agg, np.zeros(1000, dtype=np.int32))])
            self.assertLess(time.monotonic() - start, 5.0)
            self.assertEqual(len(errs), 2, "rank 0 and the aggregator time out")
            for e in errs:
                self.assertIsInstance(e, aggbox.AggBoxError)
                self.assertIn("allreduce round 0 timed out: missing", str(e))
                self.assertEqual(e.round, 0)
            # The aggregator knows whose contributions are missing; rank 0
            # waits for the aggregator's results (socket backend).
            by_who = {("aggregator" in e.missing): e for e in errs}
            self.assertEqual(by_who[False].missing, ["rank 1"], str(by_who[False]))
            self.assertIn("missing rank 1;", str(by_who[False]))
            self.assertEqual(by_who[True].missing, ["aggregator"], str(by_who[True]))
        finally:
            for c in [agg, *ranks]:
                c.close()

    def test_lengths_that_differ_across_ranks_fail_every_call_within_its_deadline(self):
        agg, ranks = make_job(workers=2, deadline=1.0)
        try:
            outcomes = [None] * 3
            lens = [10_000, 9_000]

            def call(i, c, n):
                try:
                    c.allreduce(np.ones(n, dtype=np.int32))
                    outcomes[i] = "ok"
                except aggbox.AggBoxError as e:
                    outcomes[i] = e

            start = time.monotonic()
            run_all(
                [
                    lambda: call(0, ranks[0], lens[0]),
                    lambda: call(1, ranks[1], lens[1]),
                    lambda: call(2, agg, lens[0]),
                ]
            )
            self.assertLess(time.monotonic() - start, 5.0, "within the deadline, no hang")
            for i, o in enumerate(outcomes):
                self.assertIsInstance(o, aggbox.AggBoxError, f"participant {i}: {o}")
        finally:
            for c in [agg, *ranks]:
                c.close()

    def test_quantization_overflow_at_a_fixed_scale(self):
        agg, ranks = make_job(workers=2, quantization="fixed")
        try:
            # 2 workers × 20 at scale 1e8 = 4e9 > 2^31.
            bufs = [np.full(4, 20.0, dtype=np.float32) for _ in ranks]
            with self.assertRaises(aggbox.QuantizationOverflowError) as cm:
                run_all([lambda c=c, b=b: c.allreduce(b) for c, b in zip(ranks, bufs)] + [lambda: agg.allreduce(np.zeros(4, dtype=np.float32))])
            self.assertIn("overflowed int32", str(cm.exception))
        finally:
            for c in [agg, *ranks]:
                c.close()

    def test_a_closed_communicator_raises(self):
        agg, ranks = make_job(workers=1)
        with ranks[0] as c:
            pass
        with self.assertRaisesRegex(aggbox.CommClosedError, "closed"):
            c.allreduce(np.zeros(4, dtype=np.int32))
        with self.assertRaises(aggbox.CommClosedError):
            _ = c.rank
        self.assertIn("closed", repr(c))
        agg.close()

    def test_bad_arguments_and_configurations(self):
        with self.assertRaisesRegex(aggbox.ConfigError, "rank 5 but 2 workers"):
            aggbox.Communicator(7, ["127.0.0.2:1", "127.0.0.3:1"], "127.0.0.1", fresh_port(), 5)
        with self.assertRaisesRegex(ValueError, "not IPv4:PORT"):
            aggbox.Communicator(7, ["localhost"], "127.0.0.1", 1, 0)
        with self.assertRaisesRegex(ValueError, "backend"):
            aggbox.Communicator(7, ["127.0.0.2:1"], "127.0.0.1", 1, 0, backend="xdp")
        with self.assertRaisesRegex(ValueError, "quantization"):
            aggbox.Communicator(7, ["127.0.0.2:1"], "127.0.0.1", 1, 0, quantization="none")
        with self.assertRaisesRegex(ValueError, "deadline"):
            aggbox.Communicator(7, ["127.0.0.2:1"], "127.0.0.1", 1, 0, deadline=0)
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
            f.write('[[job]]\nid = 3\nport = 7600\nworkers = ["10.0.0.1", "10.0.0.300"]\nresult_port = 7601\n')
            f.flush()
            with self.assertRaises(aggbox.ConfigError) as cm:
                aggbox.Communicator.from_config(f.name, job=3, rank=0, aggregator="10.0.0.9")
            self.assertIn(":4: job[0].workers[1]", str(cm.exception))
        with self.assertRaisesRegex(aggbox.ConfigError, "No such file|not found|cannot read|reading"):
            aggbox.Communicator.from_config("/nonexistent/aggbox.toml", job=3, rank=0, aggregator="10.0.0.9")


class FromConfig(unittest.TestCase):
    def test_a_socket_job_from_a_configuration_file(self):
        job_port, data_port = fresh_port(), fresh_port()
        text = (
            f'[[job]]\nid = 5\nport = {job_port}\nworkers = ["127.0.0.2", "127.0.0.3"]\n'
            f"result_port = {job_port + 1000}\n"
        )
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
            f.write(text)
            f.flush()
            kw = dict(aggregator="127.0.0.1", data_port=data_port, backend="socket", mtu=1500)
            agg = aggbox.Communicator.from_config(f.name, job=5, rank=None, **kw)
            ranks = [aggbox.Communicator.from_config(f.name, job=5, rank=r, **kw) for r in range(2)]
            with self.assertRaisesRegex(aggbox.ConfigError, "data_port"):
                aggbox.Communicator.from_config(f.name, job=5, rank=0, aggregator="127.0.0.1")
            with self.assertRaisesRegex(aggbox.ConfigError, "no job 6"):
                aggbox.Communicator.from_config(f.name, job=6, rank=0, aggregator="127.0.0.1")
        bufs = [np.arange(5, dtype=np.int32) * (r + 1) for r in range(2)]
        out = np.zeros(5, dtype=np.int32)
        run_all([lambda: ranks[0].allreduce(bufs[0]), lambda: ranks[1].allreduce(bufs[1]), lambda: agg.allreduce(out)])
        np.testing.assert_array_equal(out, np.arange(5, dtype=np.int32) * 3)
        np.testing.assert_array_equal(bufs[1], out)
        self.assertEqual(ranks[1].job, 5)
        for c in [agg, *ranks]:
            c.close()


class Striped(unittest.TestCase):
    def test_a_vector_striped_over_two_jobs(self):
        ports = [fresh_port() for _ in range(2)]
        data_port = fresh_port()
        fresh_port()  # the second stripe's data sockets: data_port + 1
        text = "".join(
            f'[[job]]\nid = {5 + t}\nport = {p}\nworkers = ["127.0.0.2", "127.0.0.3"]\nresult_port = {p + 1000}\n\n'
            for t, p in enumerate(ports)
        )
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
            f.write(text)
            f.flush()
            kw = dict(job=[5, 6], aggregator="127.0.0.1", data_port=data_port, backend="socket", mtu=1500)
            agg = aggbox.Communicator.from_config(f.name, rank=None, **kw)
            ranks = [aggbox.Communicator.from_config(f.name, rank=r, **kw) for r in range(2)]
            with self.assertRaisesRegex(ValueError, "empty list"):
                aggbox.Communicator.from_config(f.name, rank=0, **{**kw, "job": []})
            with self.assertRaisesRegex(TypeError, "a job id"):
                aggbox.Communicator.from_config(f.name, rank=0, **{**kw, "job": "5"})
        try:
            self.assertEqual(ranks[0].jobs, [5, 6])
            self.assertEqual(ranks[0].job, 5)
            self.assertIn("jobs=[5, 6]", repr(ranks[1]))
            n = 10_001
            bufs = [ints(r, n) for r in range(2)]
            want = (ints(0, n).astype(np.int64) + ints(1, n)).astype(np.int32)
            out = np.zeros(n, dtype=np.int32)
            run_all([lambda: ranks[0].allreduce(bufs[0]), lambda: ranks[1].allreduce(bufs[1]), lambda: agg.allreduce(out)])
            for b in [*bufs, out]:
                np.testing.assert_array_equal(b, want)
            xs = [floats(r, n) for r in range(2)]
            exact = (xs[0].astype(np.float64) + xs[1]) / 2
            m = float(max(np.abs(x).max() for x in xs))
            tol = tolerance(ranks[0].float_error_bound(m, mean=True), exact)
            run_all([lambda: ranks[0].allreduce(xs[0], op="mean"), lambda: ranks[1].allreduce(xs[1], op="mean"), lambda: agg.allreduce(np.zeros(n, dtype=np.float32), op="mean")])
            for x in xs:
                self.assertTrue(np.all(np.abs(x - exact) <= tol))
            for dtype in [np.int32, np.float32]:
                msg = (np.arange(n) * 1.25 - 3).astype(dtype)
                bufs = [np.zeros(n, dtype=dtype), msg.copy()]
                agg_buf = np.zeros(n, dtype=dtype)
                run_all([lambda: ranks[0].broadcast(bufs[0], root=1), lambda: ranks[1].broadcast(bufs[1], root=1), lambda: agg.broadcast(agg_buf, root=1)])
                for b in [*bufs, agg_buf]:
                    np.testing.assert_array_equal(b, msg)
        finally:
            for c in [agg, *ranks]:
                c.close()


class FakeBucket:
    """What aggbox.torch.allreduce_hook uses of a dist.GradBucket."""

    def __init__(self, tensor):
        self.tensor = tensor

    def buffer(self):
        return self.tensor


class DdpHook(unittest.TestCase):
    """aggbox.torch.allreduce_hook called as DDP calls it, without DDP
    (tests/python_package.rs trains with DDP over namespaces)."""

    def test_which_tensors_aggbox_serves(self):
        import aggbox.torch as at

        self.assertTrue(at.served_by_aggbox(torch.zeros(3)))
        self.assertTrue(at.served_by_aggbox(torch.zeros(3, dtype=torch.int32)))
        for dtype in [torch.float64, torch.float16, torch.bfloat16, torch.int64]:
            self.assertFalse(at.served_by_aggbox(torch.zeros(3, dtype=dtype)), dtype)

    def test_other_dtypes_go_through_the_process_group(self):
        import torch.distributed as dist

        import aggbox.torch as at

        # A one-process Gloo group: the fallback's path, not its arithmetic
        # (4 ranks: tests/python_package.rs's DDP test, float64 head).
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fresh_port()}", rank=0, world_size=1)
        try:
            state = at.AllreduceState(comm=None)  # never used: no bucket goes to AggBox
            for dtype in [torch.float64, torch.float16, torch.int64]:
                t = (torch.arange(6) * 3).to(dtype)
                got = at.allreduce_hook(state, FakeBucket(t)).wait()
                self.assertTrue(torch.equal(got, (torch.arange(6) * 3).to(dtype)), dtype)
                self.assertEqual(got.dtype, dtype)
            self.assertEqual((state.aggbox_buckets, state.fallback_buckets), (0, 3))
        finally:
            dist.destroy_process_group()

    def test_the_hook_averages_a_bucket_and_reports_a_failure_through_its_future(self):
        import aggbox.torch as at

        agg, ranks = make_job(workers=2, deadline=1.0)
        try:
            # Every bucket through AggBox (no process group here for the
            # other route; one thread calls both ranks' hooks in turn, which
            # a trial, waited for in the hook, would not allow).
            states = [at.AllreduceState(c, route="aggbox") for c in ranks]
            n = 5000
            buckets = [torch.from_numpy(floats(r, n)) for r in range(2)]
            exact = (buckets[0].double() + buckets[1].double()) / 2
            m = float(max(b.abs().max() for b in buckets))
            futs = [at.allreduce_hook(s, FakeBucket(b)) for s, b in zip(states, buckets)]
            agg.allreduce(np.zeros(n, dtype=np.float32), op="mean")
            for f, b in zip(futs, buckets):
                got = f.wait()
                self.assertIs(got, b, "the future's value is the bucket, reduced in place")
                tol = tolerance(ranks[0].float_error_bound(m, mean=True), exact)
                self.assertTrue(bool(((got.double() - exact).abs() <= tol).all()))
            self.assertEqual([s.aggbox_buckets for s in states], [1, 1])
            # rank 1 and the aggregator never call: rank 0's future fails.
            fut = at.allreduce_hook(states[0], FakeBucket(torch.zeros(10)))
            with self.assertRaises(aggbox.CommTimeoutError):
                fut.wait()
            with self.assertRaisesRegex(TypeError, "cannot be pickled"):
                import pickle

                pickle.dumps(states[0])
        finally:
            for c in [agg, *ranks]:
                c.close()


class HookRoutes(unittest.TestCase):
    """The hook's route policies through a one-process Gloo group and a
    one-worker AggBox job (whose aggregator is a thread here): which path
    each bucket takes, not how fast (tests/python_package.rs trains with
    them over namespaces)."""

    def setUp(self):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fresh_port()}", rank=0, world_size=1)
        self.addCleanup(dist.destroy_process_group)

    def aggregator(self, agg, n, calls):
        """The aggregator's side of `calls` float32 means of n elements, on a thread."""
        t = threading.Thread(target=lambda: [agg.allreduce(np.zeros(n, dtype=np.float32), op="mean") for _ in range(calls)])
        t.start()
        return t

    def test_measure_alternates_trials_then_follows_the_settled_route(self):
        import aggbox.torch as at

        agg, (rank,) = make_job(workers=1, deadline=10.0)
        try:
            state = at.AllreduceState(rank, route="measure", trials=1)
            n = 3000  # 12000 bytes: the 8 KiB class
            b = torch.from_numpy(floats(0, n))
            want = b.clone()
            tol = tolerance(rank.float_error_bound(float(want.abs().max()), mean=True), want.double())
            # Warm-up and one trial each, alternating: AggBox first.
            server = self.aggregator(agg, n, 2)
            seen = []
            for _ in range(4):
                before = state.aggbox_buckets
                got = at.allreduce_hook(state, FakeBucket(b)).wait()
                seen.append("aggbox" if state.aggbox_buckets > before else "baseline")
                self.assertTrue(bool(((got.double() - want.double()).abs() <= tol).all()))
            server.join(30)
            self.assertEqual(seen, ["aggbox", "baseline"] * 2)
            self.assertEqual((state.aggbox_buckets, state.stepped_aside_buckets, state.trial_buckets), (2, 2, 4))
            routes = state.routes()
            self.assertEqual([(r["dtype"], r["log2_bytes"], r["size"]) for r in routes], [("float32", 13, "8 KiB")])
            settled = routes[0]["route"]
            self.assertIn(settled, ["aggbox", "baseline"])
            self.assertEqual(settled == "aggbox", routes[0]["aggbox_s"] < routes[0]["baseline_s"])
            # Settled: every later bucket of the class takes that route, untimed.
            # The aggregator reduces what the rank sends: n - 100 elements.
            server = self.aggregator(agg, n - 100, 3 if settled == "aggbox" else 0)
            for _ in range(3):
                at.allreduce_hook(state, FakeBucket(torch.from_numpy(floats(0, n - 100)))).wait()
            server.join(30)
            want_counts = (5, 2) if settled == "aggbox" else (2, 5)
            self.assertEqual((state.aggbox_buckets, state.stepped_aside_buckets), want_counts)
            self.assertEqual((state.trial_buckets, state.fallback_buckets), (4, 0))
            # int32 is a class of its own: its trials start with AggBox.
            self.assertEqual(state.tuner.pick(1, 4 * n), ("aggbox", True))
        finally:
            for c in [agg, rank]:
                c.close()

    def test_baseline_and_aggbox_policies_and_the_environment(self):
        import aggbox.torch as at

        agg, (rank,) = make_job(workers=1, deadline=10.0)
        try:
            base = at.AllreduceState(rank, route="baseline")
            for dtype in [torch.float32, torch.int32, torch.float64]:
                t = (torch.arange(600) * 3).to(dtype)
                got = at.allreduce_hook(base, FakeBucket(t)).wait()
                self.assertTrue(torch.equal(got, (torch.arange(600) * 3).to(dtype)))
            self.assertEqual((base.aggbox_buckets, base.stepped_aside_buckets, base.fallback_buckets), (0, 2, 1))
            self.assertEqual((base.trial_buckets, base.routes()), (0, []))

            every = at.AllreduceState(rank, route="aggbox")
            server = self.aggregator(agg, 600, 2)
            for _ in range(2):
                at.allreduce_hook(every, FakeBucket(torch.from_numpy(floats(0, 600)))).wait()
            server.join(30)
            self.assertEqual((every.aggbox_buckets, every.stepped_aside_buckets, every.trial_buckets), (2, 0, 0))

            os.environ[at.ENV_ROUTE] = "baseline"
            os.environ[at.ENV_TRIALS] = "5"
            try:
                s = at.AllreduceState(rank)
                self.assertEqual((s.route, s.tuner.trials), ("baseline", 5))
                self.assertEqual(at.AllreduceState(rank, route="measure").route, "measure", "the argument wins")
                # The backend's name of the baseline (they share the variable).
                os.environ[at.ENV_ROUTE] = "gloo"
                self.assertEqual(at.AllreduceState(rank).route, "baseline")
                os.environ[at.ENV_ROUTE] = "fastest"
                with self.assertRaisesRegex(ValueError, "policy 'fastest'"):
                    at.AllreduceState(rank)
                os.environ[at.ENV_ROUTE] = ""
                os.environ[at.ENV_TRIALS] = "x"
                with self.assertRaisesRegex(ValueError, "AGGBOX_TORCH_TRIALS"):
                    at.AllreduceState(rank)
            finally:
                del os.environ[at.ENV_ROUTE], os.environ[at.ENV_TRIALS]
            self.assertEqual(at.AllreduceState(rank).route, "measure", "the default")
        finally:
            for c in [agg, rank]:
                c.close()


class GilReleased(unittest.TestCase):
    def test_other_threads_run_while_a_call_waits(self):
        agg, ranks = make_job(workers=2, deadline=2.0)
        try:
            ticks = [0]
            stop = threading.Event()

            def spin():
                while not stop.is_set():
                    ticks[0] += 1

            t = threading.Thread(target=spin)
            t.start()
            before = ticks[0]
            # rank 1 never calls: rank 0 waits out its 2 s deadline.
            with self.assertRaises(aggbox.CommTimeoutError):
                ranks[0].allreduce(np.ones(10, dtype=np.int32))
            during = ticks[0] - before
            stop.set()
            t.join()
            self.assertGreater(during, 10_000, "a Python thread kept running during the call")
        finally:
            for c in [agg, *ranks]:
                c.close()


if __name__ == "__main__":
    unittest.main()


class OverIPv6(unittest.TestCase):
    """The same socket-backend job with every address IPv6 (`[::1]:PORT`):
    exact int32 sums and a mixed-family job refused naming both forms."""

    def test_int32_allreduce_over_ipv6_loopback(self):
        job_port = fresh_port()
        peers = [f"[::1]:{fresh_port()}" for _ in range(WORKERS)]
        kw = dict(backend="socket", deadline=10.0, mtu=1500)
        agg = aggbox.Communicator(8, peers, "::1", job_port, None, **kw)
        ranks = [aggbox.Communicator(8, peers, "::1", job_port, r, **kw) for r in range(WORKERS)]
        try:
            bufs = [ints(r, 1000) for r in range(WORKERS)]
            fns = [lambda c=c, b=b: c.allreduce(b, op="sum") for c, b in zip(ranks, bufs)]
            fns.append(lambda: agg.allreduce(np.zeros(1000, dtype=np.int32), op="sum"))
            run_all(fns)
            want = np.sum([ints(r, 1000).astype(np.int64) for r in range(WORKERS)], axis=0)
            for b in bufs:
                self.assertTrue(np.array_equal(b.astype(np.int64), want))
        finally:
            for c in [agg, *ranks]:
                c.close()

    def test_a_peer_that_is_not_an_address_names_the_forms(self):
        with self.assertRaisesRegex(ValueError, r"IPv4:PORT or \[IPv6\]:PORT"):
            aggbox.Communicator(8, ["::1:5000"], "::1", fresh_port(), 0)
