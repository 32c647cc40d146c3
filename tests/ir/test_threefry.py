"""Threefry-2x32 (20 rounds), random_bits' reference: Random123's known-answer vectors
(also JAX's), and the blocked in-place form against a plain-Python scalar Threefry at
the block boundaries, for broadcast and 2-D counters."""

import numpy as np
import pytest

from kiln.ir.ops import creation
from kiln.ir.ops.creation import _ROTATIONS, threefry2x32

M32 = 0xFFFFFFFF


def scalar_threefry(k0, k1, x0, x1):
    """One counter, in Python ints (the oracle)."""
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = (x0 + ks[0]) & M32, (x1 + ks[1]) & M32
    for i in range(20):
        r = _ROTATIONS[i % 8]
        x0 = (x0 + x1) & M32
        x1 = (((x1 << r) | (x1 >> (32 - r))) & M32) ^ x0
        if i % 4 == 3:
            s = i // 4 + 1
            x0 = (x0 + ks[s % 3]) & M32
            x1 = (x1 + ks[(s + 1) % 3] + s) & M32
    return x0, x1


@pytest.mark.parametrize("key,counter,expected", [
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((M32, M32), (M32, M32), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
])
def test_known_answers(key, counter, expected):
    y0, y1 = threefry2x32(key[0], key[1], np.array([counter[0]], np.uint32), np.array([counter[1]], np.uint32))
    assert (int(y0[0]), int(y1[0])) == expected
    assert scalar_threefry(*key, *counter) == expected


def test_blocks_match_the_scalar_form_at_their_boundaries(monkeypatch):
    monkeypatch.setattr(creation, "_CHUNK", 64)  # several blocks and a partial last one
    rng = np.random.default_rng(0)
    n = 64 * 3 + 5
    x0 = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    y0, y1 = threefry2x32(0xDEADBEEF, 12345, x0, np.uint32(7))  # x1 broadcast
    for j in (0, 1, 63, 64, 65, 127, 128, 191, 192, n - 1):
        assert (int(y0[j]), int(y1[j])) == scalar_threefry(0xDEADBEEF, 12345, int(x0[j]), 7)
    grid = x0[:12].reshape(3, 4)
    g0, g1 = threefry2x32(1, 2, grid, np.zeros((3, 4), np.uint32))
    assert g0.shape == (3, 4) and (int(g0[2, 3]), int(g1[2, 3])) == scalar_threefry(1, 2, int(grid[2, 3]), 0)
    e0, e1 = threefry2x32(1, 2, np.zeros(0, np.uint32), np.zeros(0, np.uint32))
    assert e0.shape == e1.shape == (0,)
