"""The fake CUDA driver of tests/runtime/test_cuda_graphs.py, extended with device
memory that several processes share: what CUDA symmetric memory
(kiln/distributed/symmetric_cuda.py) and DLPack from CUDA producers
(kiln/runtime/dlpack.py) ask the driver for.

"Device memory" is a file under `root` (a test's temporary folder) mapped into the
process, so its address is one the host can read and write, as the fake needs; an IPC
handle carries the file's name, and `cuIpcOpenMemHandle` maps the file in another
process, as the real driver maps the exporter's pages. As in CUDA, a process cannot
open its own handle, and memory is device-only unless allocated managed
(`cuMemAllocManaged`): `cuPointerGetAttribute` tells which. Failures are injected by
name (`fail`), and `live()` says what this process still holds.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import types

from tests.runtime.test_cuda_graphs import FAIL, OK, FakeDriver

INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
INVALID_VALUE = 1


class FakeIpcHandle:
    """CUipcMemHandle: 64 opaque bytes at `getPtr()`."""

    def __init__(self):
        self._raw = (ctypes.c_char * 64)()

    def getPtr(self) -> int:  # noqa: N802  (the binding's name)
        return ctypes.addressof(self._raw)


class FakeMemoryDriver(FakeDriver):
    """FakeDriver plus memory (see the module docstring)."""

    CUipcMemHandle = FakeIpcHandle
    CUipcMem_flags = types.SimpleNamespace(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS=1)
    CUpointer_attribute = types.SimpleNamespace(CU_POINTER_ATTRIBUTE_MEMORY_TYPE=2,
                                                CU_POINTER_ATTRIBUTE_IS_MANAGED=8,
                                                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL=9)
    CUmemorytype = types.SimpleNamespace(CU_MEMORYTYPE_HOST=1, CU_MEMORYTYPE_DEVICE=2)
    _names = itertools.count()

    def __init__(self, root: str, devices: int = 1):
        super().__init__()
        self.root, self.devices = str(root), devices
        self.allocs: dict[int, tuple] = {}  # address -> (mmap, file name, bytes, managed)
        self.opened: dict[int, tuple] = {}  # address -> (mmap, file name)
        self.retained = 0
        self.copies: list[tuple] = []  # (kind, bytes, stream) of every copy

    @staticmethod
    def _address(mm: mmap.mmap) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(mm))

    def live(self) -> dict:
        return {"allocs": len(self.allocs), "opened": len(self.opened),
                "retained": self.retained}

    # -- context --------------------------------------------------------------------------
    def cuInit(self, flags):  # noqa: N802
        return (self._count("cuInit"),)

    def cuDeviceGetCount(self):  # noqa: N802
        return self._count("cuDeviceGetCount"), self.devices

    def cuDeviceGet(self, index):  # noqa: N802
        return self._count("cuDeviceGet"), index

    def cuDevicePrimaryCtxRetain(self, device):  # noqa: N802
        status = self._count("cuDevicePrimaryCtxRetain")
        self.retained += status == OK
        return status, ("ctx", device)

    def cuDevicePrimaryCtxRelease(self, device):  # noqa: N802
        self.retained -= 1
        return (self._count("cuDevicePrimaryCtxRelease"),)

    def cuCtxSetCurrent(self, context):  # noqa: N802
        return (self._count("cuCtxSetCurrent"),)

    def cuCtxSynchronize(self):  # noqa: N802
        return (self._count("cuCtxSynchronize"),)

    # -- memory ---------------------------------------------------------------------------
    def _alloc(self, what: str, nbytes: int, managed: bool):
        if self._count(what) != OK:
            return FAIL, 0
        name = "m%d-%d" % (os.getpid(), next(self._names))
        fd = os.open(os.path.join(self.root, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        address = self._address(mm)
        self.allocs[address] = (mm, name, nbytes, managed)
        return OK, address

    def cuMemAlloc(self, nbytes):  # noqa: N802
        return self._alloc("cuMemAlloc", nbytes, False)

    def cuMemAllocManaged(self, nbytes, flags):  # noqa: N802
        return self._alloc("cuMemAllocManaged", nbytes, True)

    def cuMemFree(self, address):  # noqa: N802
        status = self._count("cuMemFree")
        mm, name, _, _ = self.allocs.pop(int(address))
        mm.close()
        os.unlink(os.path.join(self.root, name))
        return (status,)

    def cuMemsetD8(self, address, value, nbytes):  # noqa: N802
        ctypes.memset(int(address), value, nbytes)
        return (self._count("cuMemsetD8"),)

    def _copy(self, kind: str, dst, src, nbytes, stream=None):
        status = self._count(kind)
        if status == OK:
            ctypes.memmove(int(dst), int(src), nbytes)
            self.copies.append((kind, nbytes, stream))
        return (status,)

    def cuMemcpyHtoD(self, dst, src, nbytes):  # noqa: N802
        return self._copy("cuMemcpyHtoD", dst, src, nbytes)

    def cuMemcpyDtoH(self, dst, src, nbytes):  # noqa: N802
        return self._copy("cuMemcpyDtoH", dst, src, nbytes)

    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):  # noqa: N802
        return self._copy("cuMemcpyDtoDAsync", dst, src, nbytes, stream)

    def cuPointerGetAttribute(self, attribute, pointer):  # noqa: N802
        status = self._count("cuPointerGetAttribute")
        address = int(pointer)
        for start, (_, _, nbytes, managed) in self.allocs.items():
            if start <= address < start + max(nbytes, 1):
                break
        else:
            return INVALID_VALUE, None
        attr = self.CUpointer_attribute
        value = {attr.CU_POINTER_ATTRIBUTE_IS_MANAGED: int(managed),
                 attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: 0,
                 attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE: 2}[attribute]
        return status, value

    # -- IPC ------------------------------------------------------------------------------
    def cuIpcGetMemHandle(self, address):  # noqa: N802
        status = self._count("cuIpcGetMemHandle")
        handle = FakeIpcHandle()
        name = self.allocs[int(address)][1].encode()
        ctypes.memmove(handle.getPtr(), name, len(name))
        return status, handle

    def cuIpcOpenMemHandle(self, handle, flags):  # noqa: N802
        status = self._count("cuIpcOpenMemHandle")
        if status != OK:
            return status, 0
        name = ctypes.string_at(handle.getPtr(), 64).rstrip(b"\0").decode()
        if any(a[1] == name for a in self.allocs.values()):
            return INVALID_CONTEXT, 0  # as CUDA: a process cannot open its own handle
        fd = os.open(os.path.join(self.root, name), os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        address = self._address(mm)
        self.opened[address] = (mm, name)
        return OK, address

    def cuIpcCloseMemHandle(self, address):  # noqa: N802
        status = self._count("cuIpcCloseMemHandle")
        mm, _ = self.opened.pop(int(address))
        mm.close()
        return (status,)
