import sys
from pathlib import Path

# the multiprocess harness and worker scenarios are plain modules next to the tests
sys.path.insert(0, str(Path(__file__).parent))

import os  # noqa: E402

import pytest  # noqa: E402

_SHM = "/dev/shm"
_OMPI_PREFIX = "sm_segment."  # Open MPI's shared-memory transport


def _ompi_segments() -> set[str]:
    try:
        return {n for n in os.listdir(_SHM) if n.startswith(_OMPI_PREFIX)}
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def _no_mpi_segment_left():
    """Open MPI leaves its shared-memory segments behind when a test SIGKILLs a rank or
    stops mpirun (the dead rank cannot unlink its own): remove the ones this test's jobs
    made, so no test leaves a segment in /dev/shm. kiln's own segments are not touched:
    kiln must clean those itself, and its tests check that."""
    before = _ompi_segments()
    yield
    for name in _ompi_segments() - before:
        try:
            os.unlink(os.path.join(_SHM, name))
        except OSError:
            pass
