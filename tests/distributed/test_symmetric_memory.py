"""Host symmetric memory on 2 and 4 processes: direct peer reads and writes, signal
pads, all_reduce against numpy, no /dev/shm segment left after a SIGKILL. CUDA symmetric
memory on 3 processes over the fake CUDA driver (the logic: handles through the store,
mappings, signal pads, views, DLPack export, close and SIGKILL cleanup); a real GPU runs
it in scripts/gpu_check_nccl.py."""

from __future__ import annotations

import os
import secrets
import types
from pathlib import Path

import numpy as np

import pytest

from harness import check_all_ok, run_scenario

WORKERS = Path(__file__).with_name("symmetric_workers.py")


def sym_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if "-sym-" in f and f.startswith("kiln-")}


@pytest.mark.parametrize("world", [2, 4])
def test_direct_access_signals_and_all_reduce(tmp_path, world):
    before = sym_files()
    data = check_all_ok(run_scenario("sym_basic", world, tmp_path, workers=WORKERS,
                                     timeout=90))
    assert all(d["left"] == [] for d in data)
    assert len({tuple(sorted(d["sums"].items())) for d in data}) == 1  # all ranks agree
    assert sym_files() - before == set()


def test_sigkill_of_a_rank_leaves_no_segment(tmp_path):
    before = sym_files()
    results = run_scenario("sym_kill", 4, tmp_path, workers=WORKERS, timeout=90)
    assert results[3]["returncode"] == -9
    data = check_all_ok(results[:3])
    assert all(d["left"] == [] for d in data)
    assert sym_files() - before == set()


def test_bad_arguments_are_numbered_errors():
    import kiln.distributed as dist

    class OneRank:  # the allocation checks its arguments before any collective
        rank, world_size, timeout = 0, 1, 1.0

    with pytest.raises(dist.errors.SymmetricMemoryError) as info:
        dist.symmetric_memory((2, -1), "float32", OneRank())
    assert info.value.code == "K252" and "(2, -1)" in str(info.value)
    with pytest.raises(dist.errors.SymmetricMemoryError):
        dist.symmetric_memory(4, object, OneRank())


# -- CUDA symmetric memory over the fake driver (tests/runtime/fake_cuda_memory.py) --------

@pytest.mark.parametrize("world", [3])
def test_cuda_handles_mapping_signals_and_close(tmp_path, world):
    root = tmp_path / "gpu"
    root.mkdir()
    data = check_all_ok(run_scenario("sym_cuda_basic", world, tmp_path, workers=WORKERS,
                                     args={"root": str(root)}, timeout=90))
    for d in data:
        assert d["opens"] == world - 1  # every peer's block mapped once
        assert d["held"] == {"allocs": 1, "opened": world - 1, "retained": 1}  # a DLPack view
        assert d["live"] == {"allocs": 0, "opened": 0, "retained": 0}
        assert d["keys_left"] == 0  # rank 0 removed the handles from the store
    assert os.listdir(root) == []  # every block freed


def test_cuda_sigkill_of_a_rank_leaves_nothing_mapped_by_the_survivors(tmp_path):
    root = tmp_path / "gpu"
    root.mkdir()
    results = run_scenario("sym_cuda_kill", 3, tmp_path, workers=WORKERS,
                           args={"root": str(root)}, timeout=90)
    assert results[2]["returncode"] == -9
    for d in check_all_ok(results[:2]):
        assert d["held"] == {"allocs": 1, "opened": 2, "retained": 1}
        assert d["live"] == {"allocs": 0, "opened": 0, "retained": 0}
    assert len(os.listdir(root)) == 1  # the dead rank's block: its driver context frees it


class _OneRank:
    rank, world_size, timeout, name, epoch, is_aborted = 0, 1, 5.0, "solo", 0, False

    def __init__(self, store):
        self.store = store

    def barrier(self, timeout=None):
        return types.SimpleNamespace(wait=lambda: None)


@pytest.fixture
def one_rank():
    from kiln.distributed.store import Store, StoreServer

    token = secrets.token_hex(8)
    server = StoreServer("127.0.0.1", 0, token)
    store = Store(server.address, token)
    yield _OneRank(store)
    store.close()
    server.close()


def test_cuda_driver_failures_are_K254_and_free_what_was_made(tmp_path, one_rank):
    import kiln.distributed as dist
    from tests.runtime.fake_cuda_memory import FakeMemoryDriver

    drv = FakeMemoryDriver(tmp_path)
    drv.fail.add("cuIpcGetMemHandle")
    with pytest.raises(dist.errors.CudaSymmetricMemoryError) as info:
        dist.symmetric_memory(8, "float32", one_rank, device="cuda:0", driver=drv)
    assert info.value.code == "K254" and "cuIpcGetMemHandle" in str(info.value)
    assert drv.live() == {"allocs": 0, "opened": 0, "retained": 0} and os.listdir(tmp_path) == []
    with pytest.raises(dist.errors.CudaSymmetricMemoryError, match="K254.*cuda:3 does not exist"):
        dist.symmetric_memory(8, "float32", one_rank, device="cuda:3", driver=drv)
    with pytest.raises(dist.errors.SymmetricMemoryError, match="K252.*not metal"):
        dist.symmetric_memory(8, "float32", one_rank, device="metal:0")


def test_cuda_views_copy_and_export_by_dlpack(tmp_path, one_rank):
    import kiln.distributed as dist
    from kiln.runtime import dlpack
    from tests.runtime.fake_cuda_memory import FakeMemoryDriver

    drv = FakeMemoryDriver(tmp_path)
    with dist.symmetric_memory((2, 3), "int32", one_rank, device="cuda:0", driver=drv) as sym:
        sym.buffer.copy_from(np.arange(6).reshape(2, 3))
        sym.buffer.copy_from(7)  # a scalar broadcast to the shape, as numpy's fill
        np.testing.assert_array_equal(sym.buffer.numpy(), np.full((2, 3), 7))
        with pytest.raises(dist.errors.SymmetricMemoryError, match="K252.*peer\\(1\\)"):
            sym.peer(1)
        capsule = sym.buffer.__dlpack__()
        address = dlpack._capsule_pointer(capsule, b"dltensor")
        tensor = dlpack.DLManagedTensor.from_address(address).dl_tensor
        assert tensor.data == sym.buffer.address and tensor.device.device_type == 2
        assert [tensor.shape[i] for i in range(2)] == [2, 3] and tensor.dtype.bits == 32
    assert drv.live()["allocs"] == 1  # closed, but the capsule still holds the memory
    del capsule, tensor
    assert drv.live() == {"allocs": 0, "opened": 0, "retained": 0}


def test_the_gpu_check_section_runs_over_the_fake_driver(tmp_path):
    """scripts/gpu_check_symmetric.py's two-process path and its table, on this CPU
    machine (the numbers it prints here are the fake's; the GPU run is the real one)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_symmetric.py"
    done = subprocess.run([sys.executable, str(script), "--fake", str(tmp_path), "--elements",
                           "1024"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("| rank | setup ms | peer read") and len(lines) == 3
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == "ok" and cells[5] == "ok" and cells[6] == "not run", line
    assert os.listdir(tmp_path) == []  # both ranks freed their blocks
