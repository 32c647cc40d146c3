"""Fixtures of the runtime tests."""

import pytest

import kiln as kn


@pytest.fixture
def split_always():
    """Two threads, and every launch the cost model calls large enough splits (policy
    "always"): under the default "measure" the first calls' split trials decide, and on a
    loaded machine they can decide serial, so that a test of what a split launch does
    would find none."""
    from kiln.runtime import threads

    before, policy = kn.get_num_threads(), threads.split_policy()
    kn.set_num_threads(2)
    threads.set_split_policy("always")
    yield
    kn.set_num_threads(before)
    threads.set_split_policy(policy)
