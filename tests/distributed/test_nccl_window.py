"""RMA windows on backend "nccl" over the fake NCCL (ranks as threads): pg.window on
NCCL registered windows, put by ncclPutSignal, signal through the signal pad, NCCL's
signal counts consumed by ncclWaitSignal; get/accumulate and slots other than 0 are
K253; results against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.distributed.errors import NcclWindowUnsupported, WindowInvalidated
from tests.distributed.test_nccl_backend import groups, run_ranks  # noqa: F401 - fixture


def test_ring_put_then_signal_lands_before_the_waiter_wakes(groups):  # noqa: F811
    n = 3
    pgs, apis = groups(n)

    def body(r):
        pg = pgs[r]
        win = pg.window(np.zeros(64, np.float32))
        right = (r + 1) % n
        # many puts, then one signal: the waiter must see all of them
        for k in range(8):
            pg_data = np.full(8, 100.0 * r + k, np.float32)
            win.put(right, pg_data, offset=8 * k)
        win.signal(right).wait()
        win.wait_signal(timeout=10)
        got = win.local.copy()
        pg.barrier().wait()  # nobody frees while a peer may still reach its window
        win.free()
        return got

    outs = run_ranks(n, body)
    for r in range(n):
        left = (r - 1) % n
        want = np.repeat(100.0 * left + np.arange(8), 8).astype(np.float32)
        np.testing.assert_array_equal(outs[r], want)
    for a in apis:
        assert a.log.count("ncclCommWindowRegister") == 2  # the buffer and the signal pad
        assert a.log.count("ncclPutSignal") == 9  # 8 puts + the signal's pad record
        assert "ncclWaitSignal" in a.log and "ncclCommWindowDeregister" in a.log


def test_signals_from_every_peer_add_up(groups):  # noqa: F811
    n = 4
    pgs, _ = groups(n)

    def body(r):
        pg = pgs[r]
        win = pg.window(np.zeros(n, np.int64))
        if r == 0:  # rank 0 collects one value from everyone, signalled twice each
            win.wait_signal(value=2 * (n - 1), timeout=10)
            got = win.local.copy()
        else:
            win.put(0, np.array([10 * r], np.int64), offset=r).wait()
            win.signal(0, value=2).wait()
            got = None
        pg.barrier().wait()
        return got

    got = run_ranks(n, body)[0]
    np.testing.assert_array_equal(got, [0, 10, 20, 30])


def test_get_accumulate_and_other_slots_are_k253(groups):  # noqa: F811
    pgs, _ = groups(2)

    def body(r):
        win = pgs[r].window(np.zeros(4, np.float64))
        errs = []
        for call in (lambda: win.get(1 - r, 0, 2).wait(),
                     lambda: win.accumulate(1 - r, np.ones(2)).wait(),
                     lambda: win.signal(1 - r, slot=3).wait()):
            with pytest.raises(NcclWindowUnsupported) as info:
                call()
            errs.append(info.value)
        pgs[r].barrier().wait()
        win.free()
        with pytest.raises(WindowInvalidated):
            win.put(1 - r, np.ones(1))
        return errs

    for errs in run_ranks(2, body):
        assert [e.code for e in errs] == ["K253"] * 3
        assert "no one-sided get" in str(errs[0]) and "slot 3" in str(errs[2])


def test_a_dead_target_fails_the_put(groups):  # noqa: F811
    pgs, apis = groups(2)
    wins = run_ranks(2, lambda r: pgs[r].window(np.zeros(4, np.float32)))
    apis[1].world.kill(pgs[1].backend.comm.handle)
    from kiln.distributed.errors import DistributedError
    with pytest.raises(DistributedError) as info:
        wins[0].put(1, np.ones(4, np.float32)).wait(timeout=5)
    assert "ncclRemoteError" in str(info.value) or "ncclPutSignal" in str(info.value)
