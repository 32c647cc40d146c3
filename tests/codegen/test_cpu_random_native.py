"""random_bits on the CPU as native Threefry (cpu/random_native.py): bit-identical to the
op's numpy reference for every length, key and thread count, and what compiled programs
run for the op."""

from __future__ import annotations

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cpu import random_native
from kiln.codegen.cpu.backend import CpuBackend
from kiln.codegen.kernel_ir import template_externs
from kiln.frontend.dispatch import apply
from kiln.ir.ops.creation import random_bits

KEYS = [(0, 0), (1, 2), (0xFFFFFFFF, 0x12345678), (0x1BD11BDA, 0xFFFFFFFF)]


@pytest.mark.parametrize("n", [1, 2, 3, 31, 32, 33, 1000, 2 * random_native.SPLIT_COUNTERS + 1,
                               2 * random_native.SPLIT_COUNTERS + 34])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bits_equal_the_reference(n, threads):
    for key in KEYS:
        k = np.array(key, np.uint32)
        got = random_native.threefry_bits(k, (n,), threads=threads)
        np.testing.assert_array_equal(got, random_bits.reference(k, shape=(n,)))


def test_shapes_and_empty():
    k = np.array((5, 6), np.uint32)
    for shape in [(0,), (3, 0), (4, 5, 3), ()]:
        got = random_native.threefry_bits(k, shape)
        assert got.shape == shape and got.dtype == np.uint32
        np.testing.assert_array_equal(got, random_bits.reference(k, shape=shape))


def test_the_cpu_backend_runs_it_for_the_op():
    externs = template_externs(CpuBackend())
    assert externs["random_bits"] is random_native.run_random_bits
    key = np.array((3, 4), np.uint32)
    g = kn.compile(lambda key: apply("random_bits", key, shape=(3, 1001)))
    np.testing.assert_array_equal(g(key).numpy(), random_bits.reference(key, shape=(3, 1001)))


def test_compiled_dropout_matches_eager():
    from kiln import nn

    x = np.random.default_rng(0).standard_normal((256, 130)).astype(np.float32)
    drop = nn.Dropout(0.3)

    def f(x, key):
        with nn.rng(key):
            return drop(x)

    key = nn.random.key(7)
    np.testing.assert_array_equal(kn.compile(f)(x, key).numpy(), f(kn.tensor(x), key).numpy())
