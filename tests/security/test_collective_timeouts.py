"""Timeouts a caller gives a collective or a wait are checked like the store's (K220):
NaN, infinities, zero, negative and absurd values never reach a deadline computation
(`time.monotonic() + nan` never expires), and the group stays usable afterwards."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kiln.distributed as dist
from kiln.distributed import InvalidTimeout

BAD = [math.nan, math.inf, -math.inf, -1.0, 0, 10 ** 400, 1e9, "30", True]


@pytest.fixture(scope="module")
def pg():
    group = dist.init_process_group(rank=0, world_size=1, store="127.0.0.1:0", token="t",
                                    timeout=30)
    try:
        yield group
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_collective_and_wait_timeouts_are_checked(pg, bad):
    x = np.arange(4, dtype=np.float32)
    with pytest.raises(InvalidTimeout, match=r"all_reduce\(timeout=\)") as info:
        pg.all_reduce(x, timeout=bad)
    assert info.value.code == "K220"
    with pytest.raises(InvalidTimeout, match=r"barrier\(timeout=\)"):
        pg.barrier(timeout=bad)
    work = pg.all_reduce(x)
    with pytest.raises(InvalidTimeout, match=r"wait\(timeout=\)"):
        work.wait(timeout=bad)
    assert work.wait(timeout=10)
    assert pg.all_reduce(x, timeout=5).wait()  # the group is still usable
    np.testing.assert_array_equal(x, np.arange(4, dtype=np.float32))
