"""DLPack with CUDA producers and consumers (kiln/runtime/dlpack_cuda.py), on the fake
CUDA driver (tests/runtime/fake_cuda_memory.py) with a fake `cuda` device kind: the
logic only — the stream asked of the producer, zero-copy of host-visible (managed)
memory, one device copy of device-only memory, the producer's deleter called exactly
once, the capsule kiln exports. A real GPU runs torch CUDA tensors through it in
scripts/gpu_check_device.py."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

import kiln as kn
from kiln.runtime import device as devices
from kiln.runtime import dlpack, dlpack_cuda, transfers
from kiln.runtime.caching_allocator import RawMemory
from kiln.runtime.dlpack import DLDataType, DLDevice, DLManagedTensor, DLTensor, KilnDLPackError
from tests.runtime.fake_cuda_memory import FakeMemoryDriver


class FakeManagedMemory(RawMemory):
    """The fake kind's segments: the fake driver's managed memory."""

    def __init__(self, driver):
        self.driver = driver

    def alloc(self, nbytes: int):
        status, address = self.driver.cuMemAllocManaged(nbytes, 1)
        assert status == 0
        view = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), np.uint8, nbytes)
        return address, view, address

    def free(self, handle) -> None:
        self.driver.cuMemFree(handle)


@pytest.fixture
def cuda(tmp_path, monkeypatch):
    """A `cuda` device kind over the fake driver, in place of the real one."""
    driver = FakeMemoryDriver(tmp_path)
    driver.syncs = []
    saved = devices._KINDS.get("cuda")
    if saved is not None:
        devices.unregister_device_kind("cuda")
    devices.register_device_kind(
        "cuda", hardware="a fake GPU", raw_memory=lambda i: FakeManagedMemory(driver),
        total_memory=lambda i: 1 << 30, available=lambda: True, count=lambda: 1,
        dlpack_type=2, synchronize=driver.syncs.append)
    monkeypatch.setattr(dlpack_cuda, "cuda_driver", lambda: driver)
    yield driver
    gc.collect()
    devices.unregister_device_kind("cuda")
    if saved is not None:
        devices._KINDS["cuda"] = saved
        devices._RESOLVED.clear()


class Producer:
    """A CUDA DLPack producer as torch is one: `values` in fake device memory (managed
    or not), a DLManagedTensor built with ctypes whose deleter counts its calls."""

    def __init__(self, driver, values: np.ndarray, *, managed=False, kind=2, transpose=False):
        self.values = values.T if transpose else values
        status, self.address = (driver.cuMemAllocManaged(values.nbytes, 1) if managed
                                else driver.cuMemAlloc(values.nbytes))
        ctypes.memmove(self.address, np.ascontiguousarray(values).ctypes.data, values.nbytes)
        self.kind, self.transpose = kind, transpose
        self.streams, self.deleted = [], 0
        self._keep = []

    def __dlpack_device__(self):
        return (self.kind, 0)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        rows, cols = self.values.shape if not self.transpose else self.values.shape[::-1]
        shape = (ctypes.c_int64 * 2)(*self.values.shape)
        strides = (ctypes.c_int64 * 2)(*((1, cols) if self.transpose else (cols, 1)))
        managed = DLManagedTensor()
        managed.dl_tensor = DLTensor(self.address, DLDevice(self.kind, 0), 2,
                                     DLDataType(2, 32, 1), shape, strides, 0)

        @dlpack._DELETER
        def deleter(_):
            self.deleted += 1

        managed.deleter = deleter
        self._keep += [managed, shape, strides, deleter]
        return dlpack._capsule_new(ctypes.addressof(managed), b"dltensor", None)


def test_managed_memory_is_shared_and_the_deleter_runs_once(cuda):
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    for kind in (2, 13):  # kDLCUDA reported managed by the driver; kDLCUDAManaged
        p = Producer(cuda, values, managed=True, kind=kind)
        waits = cuda.calls.get("cuStreamSynchronize", 0)
        t = kn.from_dlpack(p)
        assert cuda.calls["cuStreamSynchronize"] == waits + 1  # the producer's work is done
        assert t.device == "cuda:0" and t.shape == (3, 4) and t.dtype == kn.float32
        assert t.numpy().ctypes.data == p.address  # the same memory
        assert p.streams == [1]  # DLPack's legacy default stream
        np.testing.assert_array_equal(t.numpy(), values)
        ctypes.c_float.from_address(p.address).value = -7.0  # the producer writes
        assert t.numpy()[0, 0] == -7.0
        # compiled programs on cuda:0 take it as device memory, without a copy
        assert devices.in_memory_of(kn.device("cuda:0"), t.numpy())
        np.testing.assert_array_equal((t * 2).numpy()[1], values[1] * 2)
        assert p.deleted == 0
        array = t.numpy()
        del t
        gc.collect()
        assert p.deleted == 0  # a view of the memory is still alive
        del array
        gc.collect()
        assert p.deleted == 1


def test_device_keyword_names_the_producers_device(cuda):
    values = np.ones((2, 2), np.float32)
    for device in ("cuda:0", "cuda", kn.device("cuda", 0)):
        p = Producer(cuda, values, managed=True, kind=13)
        assert kn.from_dlpack(p, device=device).numpy().ctypes.data == p.address
    p = Producer(cuda, values, managed=True)
    with pytest.raises(KilnDLPackError, match="K382.*device='cpu'.*is on cuda:0"):
        kn.from_dlpack(p, device="cpu")
    assert p.streams == []  # refused before the producer was asked for anything


def test_device_only_memory_is_copied_once_on_the_device(cuda):
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    p = Producer(cuda, values)
    with transfers.counting() as seen:
        t = kn.from_dlpack(p)
    assert t.device == "cuda:0" and t.numpy().ctypes.data != p.address
    np.testing.assert_array_equal(t.numpy(), values)
    assert p.deleted == 1  # released as soon as the copy is done
    assert seen["device_to_device"] == 1 and seen["device_to_device_bytes"] == 48
    assert [c[:2] for c in cuda.copies] == [("cuMemcpyDtoDAsync", 48)]
    ctypes.c_float.from_address(p.address).value = 99.0  # no longer shared
    assert t.numpy()[0, 0] == 0.0
    assert kn.memory.memory_allocated("cuda:0") >= 48  # a block of kiln's allocator
    del t
    gc.collect()
    assert p.deleted == 1


def test_copy_false_refuses_device_only_memory_and_releases_it(cuda):
    p = Producer(cuda, np.ones((2, 2), np.float32))
    with pytest.raises(KilnDLPackError, match="K382.*copy=False.*cannot be shared"):
        kn.from_dlpack(p, copy=False)
    gc.collect()
    assert p.deleted == 1
    q = Producer(cuda, np.ones((2, 2), np.float32), managed=True)
    t = kn.from_dlpack(q, copy=True)  # shareable, but a copy was asked
    assert t.numpy().ctypes.data != q.address and q.deleted == 1


def test_strided_device_memory_keeps_its_layout(cuda):
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = Producer(cuda, values, transpose=True)  # a (3, 4) column-major view
    t = kn.from_dlpack(p)
    np.testing.assert_array_equal(t.numpy(), values.T)
    shared = kn.from_dlpack(Producer(cuda, values, managed=True, transpose=True))
    np.testing.assert_array_equal(shared.numpy(), values.T)
    assert shared.numpy().strides == (4, 12)


def test_kiln_cuda_tensors_export_as_kdlcuda_after_the_device(cuda):
    t = kn.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device="cuda:0")
    assert t.__dlpack_device__() == (2, 0)
    capsule = t.__dlpack__(stream=7)
    assert cuda.syncs == [0]  # kiln's work done before any consumer stream uses it
    tensor = DLManagedTensor.from_address(dlpack._capsule_pointer(capsule, b"dltensor")).dl_tensor
    assert tensor.data == t.numpy().ctypes.data and tensor.device.device_type == 2
    assert [tensor.shape[i] for i in range(2)] == [2, 3]
    del capsule, tensor
    t.__dlpack__(stream=-1)  # "no synchronization"
    assert cuda.syncs == [0]
    host = np.from_dlpack(_Asking(t, dl_device=(1, 0)))  # managed memory read in place
    assert host.ctypes.data == t.numpy().ctypes.data
    with pytest.raises(KilnDLPackError, match="K382.*a copy to rocm:0 was asked"):
        t.__dlpack__(dl_device=(10, 0))
    copied = t.__dlpack__(copy=True)
    other = DLManagedTensor.from_address(dlpack._capsule_pointer(copied, b"dltensor")).dl_tensor
    assert other.data != t.numpy().ctypes.data and other.device.device_type == 2
    got = np.frombuffer((ctypes.c_float * 6).from_address(other.data), np.float32)
    np.testing.assert_array_equal(got, np.arange(6))


class _Asking:
    """A kiln tensor behind a consumer that asks for a given device."""

    def __init__(self, t, **kwargs):
        self.t, self.kwargs = t, kwargs

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__(**{**kwargs, **self.kwargs})

    def __dlpack_device__(self):
        return self.kwargs["dl_device"]
