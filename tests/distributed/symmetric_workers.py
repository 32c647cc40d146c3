"""Scenarios of the host symmetric-memory tests (see harness.py; run like workers.py).

    python symmetric_workers.py SCENARIO RANK WORLD STORE_ADDR RESULT_JSON ARGS_JSON
"""

from __future__ import annotations

import hashlib
import os
import signal

import numpy as np

import kiln.distributed as dist
from workers import join, main, scenario


def leftovers() -> list[str]:
    """This job's symmetric-memory files in /dev/shm."""
    prefix = "kiln-" + hashlib.sha256(os.environ["KILN_TOKEN"].encode()).hexdigest()[:16]
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix + "-sym-"))


def last_rank_dies(sym, rank: int, world: int) -> None:
    """After a barrier the last rank SIGKILLs itself; the others' wait for its signal
    fails naming it (PeerFailure once the group saw it die, else the wait's timeout)."""
    sym.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        sym.wait_signal(world - 1, timeout=1.0)
        raise AssertionError("a dead rank signalled")
    except (dist.CollectiveTimeout, dist.PeerFailure) as exc:
        assert exc.rank == world - 1 and "rank %d" % (world - 1) in str(exc), exc


@scenario
def sym_basic(rank, world, addr, args):
    """Direct reads and writes of peers' buffers, signal pads, all_reduce vs numpy."""
    pg = join(rank, world, addr)
    sym = dist.symmetric_memory((3, 5), "float32", pg)
    assert sym.buffer.shape == (3, 5) and not sym.buffer.any()
    sym.buffer[:] = np.arange(15, dtype=np.float32).reshape(3, 5) * (rank + 1)
    sym.barrier()
    assert leftovers() == [], leftovers()  # rank 0 unlinked it before it signalled
    for r in range(world):  # every peer's buffer, read in place
        np.testing.assert_array_equal(sym.peer(r), np.arange(15).reshape(3, 5) * (r + 1))
    sym.barrier()  # nobody reads any more: now write into the next rank's buffer
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    sym.peer(nxt)[0, 0] = 100 + rank
    sym.signal(nxt)
    sym.wait_signal(prv)
    assert sym.buffer[0, 0] == 100 + prv, sym.buffer[0, 0]
    sums = {}
    for op, dtype, count in (("sum", "float64", 1001), ("max", "int32", 7), ("min", "int64", 3),
                             ("prod", "float32", 64),
                             ("sum", "float32", 100_003)):  # > 256 KiB: the chunked path
        arrays = [np.random.default_rng(r).integers(1, 4, count).astype(dtype)
                  for r in range(world)]
        with dist.symmetric_memory(count, dtype, pg) as s:
            s.buffer[:] = arrays[rank]
            got = s.all_reduce(op).copy()
        want = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}[op](
            np.stack(arrays), axis=0).astype(dtype)
        np.testing.assert_array_equal(got, want)
        sums["%s/%d" % (op, count)] = float(got.sum())
    sym.close()
    pg.barrier().wait()
    return {"sums": sums, "left": leftovers()}


@scenario
def sym_kill(rank, world, addr, args):
    """The last rank is SIGKILLed after setup: the others' wait for its signal fails
    naming it (PeerFailure once the group saw it die, else the wait's timeout); no
    segment is left in /dev/shm."""
    pg = join(rank, world, addr)
    sym = dist.symmetric_memory(1 << 16, "float32", pg)
    last_rank_dies(sym, rank, world)
    sym.close()
    return {"left": leftovers()}


def _fake_cuda(args):
    """The fake CUDA driver (tests/runtime/fake_cuda_memory.py): "device memory" is
    files under args["root"], shared by the ranks' processes."""
    from tests.runtime.fake_cuda_memory import FakeMemoryDriver

    return FakeMemoryDriver(args["root"])


@scenario
def sym_cuda_basic(rank, world, addr, args):
    """CUDA symmetric memory over the fake driver: handles through the store, peers'
    blocks mapped, reads and writes of peers' buffers, signal pads, a DLPack view that
    keeps its mapping past close(), nothing held after."""
    import gc

    pg = join(rank, world, addr)
    drv = _fake_cuda(args)
    sym = dist.symmetric_memory((3, 5), "float32", pg, device="cuda:0", driver=drv)
    assert sym.buffer.shape == (3, 5) and str(sym.buffer.device) == "cuda:0"
    assert not sym.buffer.numpy().any()  # zero-filled
    assert drv.live() == {"allocs": 1, "opened": world - 1, "retained": 1}, drv.live()
    sym.buffer.copy_from(np.arange(15, dtype=np.float32).reshape(3, 5) * (rank + 1))
    sym.barrier()
    for r in range(world):  # every peer's buffer, read through its mapping here
        np.testing.assert_array_equal(sym.peer(r).numpy(), np.arange(15).reshape(3, 5) * (r + 1))
    sym.barrier()  # nobody reads any more: now write into the next rank's buffer
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    theirs = sym.peer(nxt).numpy()
    theirs[0, 0] = 100 + rank
    sym.peer(nxt).copy_from(theirs)
    sym.signal(nxt)
    sym.wait_signal(prv)
    assert sym.buffer.numpy()[0, 0] == 100 + prv, sym.buffer.numpy()
    view = sym.peer(nxt)
    assert view.__cuda_array_interface__["data"] == (view.address, False)
    assert view.__dlpack_device__() == (2, 0)
    capsule = view.__dlpack__(stream=None)
    sym.barrier()
    sym.close()
    held = drv.live()  # the consumer of the capsule still reads the mapping
    try:
        view.numpy()
        raise AssertionError("a view read after close")
    except dist.errors.CudaSymmetricMemoryError as exc:
        assert exc.code == "K254" and "after close()" in str(exc)
    del capsule
    gc.collect()
    pg.barrier().wait()
    return {"held": held, "live": drv.live(), "opens": drv.calls.get("cuIpcOpenMemHandle", 0),
            "keys_left": pg.store.delete_prefix("sym-cuda/")}


@scenario
def sym_cuda_kill(rank, world, addr, args):
    """The last rank is SIGKILLed after setup: the others' wait for its signal fails
    naming it; their close() unmaps its block and frees their own."""
    pg = join(rank, world, addr)
    drv = _fake_cuda(args)
    sym = dist.symmetric_memory(1 << 12, "float32", pg, device="cuda:0", driver=drv)
    last_rank_dies(sym, rank, world)
    held = drv.live()
    sym.close()
    return {"held": held, "live": drv.live()}


if __name__ == "__main__":
    main()
