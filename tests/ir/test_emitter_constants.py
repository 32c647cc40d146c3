"""GraphBuilder.constant: numpy data captured while tracing becomes the right constant."""

import gc
import weakref

import numpy as np

import kiln as kn
from kiln.ir.emitter import GraphBuilder


def test_the_constant_cache_keeps_its_arrays_alive():
    # the cache is keyed by id(array); were a (copied, non-contiguous) source array let go,
    # CPython could hand its id to a later array, which would then get the stale constant
    b = GraphBuilder()
    view = np.arange(6, dtype=np.float32)[::2]
    alive = weakref.ref(view)
    first = b.constant(view)
    del view
    gc.collect()
    assert alive() is not None
    assert b.constant(alive()) is first


def test_distinct_temporaries_become_distinct_constants():
    def f(x):
        for k in range(6):
            x = x + np.full(6, float(k), np.float32)[::2]  # strided views: copied, then freed
        return x

    graph = kn.trace(f, kn.zeros(3))
    assert sorted(float(a[0]) for a in graph.constants.values()) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    np.testing.assert_array_equal(kn.compile(f)(kn.zeros(3)).numpy(), np.full(3, 15.0))


def test_the_same_array_is_one_constant():
    table = np.arange(3, dtype=np.float32)
    graph = kn.trace(lambda x: x + table + table, kn.zeros(3))
    assert len(graph.constants) == 1
