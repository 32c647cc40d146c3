"""All-reduce and friends on every rank: run with `kiln launch --nproc 2 examples/distributed_allreduce.py`.

Each rank contributes its rank number; everyone ends with the sum, then a
sub-group of the even ranks averages, and rank 0 prints the results.
"""

import sys

import numpy as np

import kiln.distributed as dist


def main() -> int:
    pg = dist.init_process_group()            # rank, world size, store, token from kiln launch
    x = np.full(4, pg.rank, np.float32)
    work = pg.all_reduce(x, op="sum")        # nonblocking
    work.wait()
    expected = sum(range(pg.world_size))
    assert np.all(x == expected), x
    gathered = np.empty((pg.world_size, 2), np.int64)
    pg.all_gather(gathered, np.array([pg.rank, pg.rank * 10])).wait()
    evens = pg.split(list(range(0, pg.world_size, 2)))
    if evens is not None:
        y = np.array([float(pg.rank)])
        evens.all_reduce(y, op="avg").wait()
    if pg.rank == 0:
        print("rank 0: all_reduce ->", x.tolist(), "all_gather ->", gathered.tolist(), flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "--fail-rank" and pg.rank == int(sys.argv[2]):
        sys.exit(7)                          # show how kiln launch reports a failing worker
    pg.barrier().wait()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
