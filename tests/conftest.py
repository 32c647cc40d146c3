"""Test-wide setup: every cache kiln, Triton or PoCL might write goes to a temporary
folder, and hypothesis runs with a profile sized for a 2-core CI machine.

`make test` is derandomized (the same examples on every run, so a red CI is always
reproducible); KILN_HYPOTHESIS=explore draws fresh random examples, five times as many,
to hunt for new counterexamples (pin each one found with @example)."""

import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

_CACHE_ROOT = tempfile.mkdtemp(prefix="kiln-test-cache-")
for _var in ("KILN_CACHE_DIR", "TRITON_CACHE_DIR", "POCL_CACHE_DIR", "KILN_FR_DIR", "KILN_MEM_DIR"):
    os.environ[_var] = os.path.join(_CACHE_ROOT, _var.lower())
# parallel regions keep their thread count whatever the machine's other load (tests that
# count a launch's ranges stay deterministic); tests/runtime/test_threads.py turns the
# load-dependent count on where it tests it
os.environ.setdefault("KILN_DYNAMIC_THREADS", "0")

settings.register_profile("kiln", deadline=None, max_examples=40, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, max_examples=200,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("explore" if os.environ.get("KILN_HYPOTHESIS") == "explore" else "kiln")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kiln-cache"))
    yield


@pytest.fixture
def split_always():
    """Two threads, and every launch the cost model calls large enough splits (policy
    "always"): under the default "measure" the first calls' split trials decide, and on a
    loaded machine they can decide serial, so that a test of what a split launch does
    would find none."""
    import kiln as kn
    from kiln.runtime import threads

    before, policy = kn.get_num_threads(), threads.split_policy()
    kn.set_num_threads(2)
    threads.set_split_policy("always")
    yield
    kn.set_num_threads(before)
    threads.set_split_policy(policy)
