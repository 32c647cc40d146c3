"""Every collective and reduce op against numpy, for every kiln dtype, on 2..8 ranks."""

from __future__ import annotations

import pytest

from harness import check_all_ok, run_scenario


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_every_dtype(tmp_path, world):
    """All ops outstanding at once (nonblocking overlap), uneven and zero sizes,
    latency algorithms and forced ring/chain pipelines."""
    data = check_all_ok(run_scenario("collectives", world, tmp_path, timeout=55))
    assert all(d["works"] > 500 for d in data)


@pytest.mark.timeout(60)
def test_eight_ranks(tmp_path):
    """Non-power-of-two folding and deep trees, on a subset of dtypes to fit the box."""
    args = {"dtypes": ["bool", "int8", "bfloat16", "float8_e5m2", "float32", "complex64"],
            "sizes": [0, 21, 1003]}
    check_all_ok(run_scenario("collectives", 8, tmp_path, args=args, timeout=55))


@pytest.mark.timeout(60)
def test_large_buffers_use_pipelined_algorithms(tmp_path):
    check_all_ok(run_scenario("large", 3, tmp_path, timeout=55))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("halving", ["0", str(1 << 40)])
def test_four_ranks_ring_and_halving_doubling(tmp_path, halving):
    """Power-of-two groups run all_reduce past the ring threshold with recursive
    halving-doubling up to KILN_TCP_HALVING_BYTES, with the ring beyond: each forced
    here, with many small segments (uneven blocks) and with the default segments."""
    args = {"dtypes": ["bool", "int8", "bfloat16", "float32", "complex64"],
            "sizes": [0, 3, 21, 1003]}
    env = {"KILN_TCP_HALVING_BYTES": halving}
    check_all_ok(run_scenario("collectives", 4, tmp_path, args=args, env=env, timeout=55))
    check_all_ok(run_scenario("large", 4, tmp_path, env=env, timeout=55))
