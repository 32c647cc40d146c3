"""The Metal simulator as a registered backend ("metal-sim") for the tests of this folder,
and the skip marker for what needs clang++-15."""

from __future__ import annotations

import pytest

from kiln.codegen.backend import register_backend, unregister_backend
from tests.codegen.metal.simulator import CLANG, sim_backend

needs_clang = pytest.mark.skipif(CLANG is None, reason="needs clang++-15 (Debian: apt-get install clang-15)")


@pytest.fixture(scope="session")
def sim(tmp_path_factory):
    """The simulator backend class, registered as target "metal-sim" (its `calls` record
    every kernel built, with the kind each ran as)."""
    if CLANG is None:
        pytest.skip("needs clang++-15 (Debian: apt-get install clang-15)")
    cls = sim_backend(str(tmp_path_factory.mktemp("metal-sim")))
    register_backend("metal-sim", cls)
    yield cls
    unregister_backend("metal-sim")
