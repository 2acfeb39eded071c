"""One rank of tests/python_package.rs's torch-backend ring test: 4 ranks
in namespaces run `dist.init_process_group("aggbox")` on jobs of the
node's file, the star striped over two of them, with a ring beside it
(AGGBOX_TORCH_CONFIG, AGGBOX_TORCH_JOB=14,15,
AGGBOX_TORCH_RING, AGGBOX_TORCH_PIN_DIR with {rank}, a threshold), every
rank's host serving the ring. Int32 and float32 SUM allreduces below and
above the threshold must be exact (floats within the documented bound),
the communicator's `served` must show both algorithms, and the process
group's counters every call served by AggBox.

    netns_torch_ring.py --rank R --world W --master-addr A --master-port P --ring-len N --threshold T
"""

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import aggbox.torch as at
from reference import float_tolerance, rank_parser


def main():
    ap = rank_parser()
    ap.add_argument("--ring-len", type=int, required=True)
    ap.add_argument("--threshold", type=int, required=True)
    a = ap.parse_args()
    dist.init_process_group(
        "aggbox", init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank, world_size=a.world,
        timeout=timedelta(seconds=60),
    )
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, at.ProcessGroupAggBox), type(pg)
    jobs = pg.communicator.jobs
    assert len(jobs) == 2, f"the star striped over the two jobs asked for: {jobs}"
    before = pg.communicator.served
    small, large = max(1, a.threshold // 4), a.ring_len
    calls = 0
    for n in (small, large, small, large):
        x = torch.arange(n, dtype=torch.int32) + a.rank
        dist.all_reduce(x)
        want = np.arange(n, dtype=np.int64) * a.world + sum(range(a.world))
        assert np.array_equal(x.numpy(), want.astype(np.int32)), f"int32 allreduce of {n} differs"
        # float32 inputs (as the tensors hold them), summed exactly in float64
        values = [np.random.default_rng([r, n]).normal(0, 1, n).astype(np.float32).astype(np.float64) for r in range(a.world)]
        y = torch.tensor(values[a.rank], dtype=torch.float32)
        dist.all_reduce(y)
        exact = np.sum(values, axis=0)
        err = np.abs(y.numpy().astype(np.float64) - exact)
        bound = float_tolerance(pg, "float32", "sum", values, exact)
        assert np.all(err <= bound), f"float32 allreduce of {n}: error {np.max(err - bound)} over the bound"
        calls += 2
    served = pg.communicator.served
    star, ring = served["star"] - before["star"], served["ring"] - before["ring"]
    assert ring == 4 and star == 4, f"star {star} and ring {ring} calls: the large ones go to the ring ({served})"
    paths = {k: v for k, v in pg.stats().items() if k[0] == "allreduce"}
    assert paths == {("allreduce", "aggbox"): calls}, f"every allreduce served by AggBox: {pg.stats()}"
    print(f"ok: served star {star} ring {ring}", flush=True)
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
