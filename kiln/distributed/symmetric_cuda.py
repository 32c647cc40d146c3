"""CUDA symmetric memory within a node: `symmetric_memory(shape, dtype, group,
device="cuda:N")`, the host version's API (kiln/distributed/symmetric_memory.py) over
GPU memory that every local rank maps.

    sym = dist.symmetric_memory((1024,), "float32", pg, device="cuda:0")
    sym.buffer.copy_from(x)              # this rank's buffer (a CudaView)
    sym.signal(1); sym.wait_signal(1)    # pairwise: "my writes are visible", "and yours"
    torch.from_dlpack(sym.peer(1))       # rank 1's buffer as a torch CUDA tensor, no copy
    sym.peer(1).numpy()                  # or copied to the host

Each rank allocates one block of device memory (`cuMemAlloc`): its signal pad
(`world` uint64 counters: pad[src] is written only by rank src) followed by its data,
zero-filled. It exports the block with the legacy IPC API (`cuIpcGetMemHandle`, a
64-byte handle), publishes the handle with its host name under a key of the group's
authenticated store, reads its peers' handles and maps their blocks
(`cuIpcOpenMemHandle`, lazy peer access: ranks on other GPUs of the node work too).

Why the legacy IPC API rather than `cuMemCreate` + `cuMemExportToShareableHandle`: its
handle is plain bytes that the store carries as is, while the POSIX-fd handle of the
VMM API must be passed between processes as a file descriptor (SCM_RIGHTS over a Unix
socket every rank would have to set up, or `pidfd_getfd`, which needs ptrace rights that
containers usually withhold); the fabric handle needs IMEX channels. Legacy IPC needs
nothing beyond the GPU device files.

A signal is synchronous and host-driven: `signal(dst)` waits for this context's
device work (so its writes to any buffer are done), then stores its counter into
pad[rank] of `dst`'s block with one 8-byte copy; `wait_signal(src)` reads its own
pad[src] back, polling with a growing sleep bounded by the timeout, and gives up early
when the group was aborted (PeerFailure naming the dead rank when it saw one die).
`close()` unmaps every peer's block (`cuIpcCloseMemHandle`) and frees this rank's own
(`cuMemFree`): after a peer was SIGKILLed the survivors' close leaves nothing mapped,
and the driver frees the dead rank's memory with its context. A view exported with
DLPack keeps the mappings alive until its consumer lets it go, even past `close()`.

The driver is passed in (`driver=`), so the logic is tested on a CPU machine with a
fake driver (tests/runtime/fake_cuda_memory.py); on a GPU it is `cuda.bindings.driver`.
There is no `all_reduce` here: reducing device memory needs a kernel, which is what
backend "nccl"'s all_reduce is.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import socket
import threading
import time

import numpy as np

from kiln.distributed.errors import CudaSymmetricMemoryError, SymmetricMemoryError
from kiln.distributed.symmetric_memory import SignalPads

_HANDLE = 64  # CU_IPC_HANDLE_SIZE
_ALIGN = 512  # the data starts this far into the block (after the signal pad)
_SEQ: dict[tuple[str, int], itertools.count] = {}  # (group, epoch) -> allocations made
_SEQ_LOCK = threading.Lock()


def _check(driver, result, what: str):
    """cuda-bindings returns (CUresult, *values): K254 on an error, else the values."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != driver.CUresult.CUDA_SUCCESS:
        raise CudaSymmetricMemoryError("CUDA symmetric memory: %s failed: %s" % (what, status))
    return values[0] if len(values) == 1 else (values or None)


class CudaView:
    """One rank's buffer of a CUDA symmetric allocation: device memory, read and written
    with copies (`copy_from`, `numpy`) or by any CUDA library through DLPack
    (`torch.from_dlpack(view)`, `cupy.from_dlpack(view)`) or `__cuda_array_interface__`."""

    def __init__(self, owner: "CudaSymmetricMemory", rank: int, address: int):
        self._owner, self.rank, self.address = owner, rank, address
        self.shape, self.dtype, self.device = owner.shape, owner.dtype, owner.device
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def _live(self, what: str):
        if self._owner._closed:
            raise CudaSymmetricMemoryError("CUDA symmetric memory: %s of rank %d's buffer "
                                           "after close()" % (what, self.rank))
        return self._owner.driver

    def copy_from(self, data) -> None:
        """Write `data` (host memory, broadcast to the view's shape) into this buffer."""
        driver = self._live("copy_from")
        src = np.ascontiguousarray(np.broadcast_to(np.asarray(data, self.dtype), self.shape))
        _check(driver, driver.cuMemcpyHtoD(self.address, src.ctypes.data, self.nbytes),
               "cuMemcpyHtoD")

    def numpy(self) -> np.ndarray:
        """A host copy of this buffer (after this context's device work)."""
        driver = self._live("numpy")
        out = np.empty(self.shape, self.dtype)
        _check(driver, driver.cuCtxSynchronize(), "cuCtxSynchronize")
        _check(driver, driver.cuMemcpyDtoH(out.ctypes.data, self.address, self.nbytes),
               "cuMemcpyDtoH")
        return out

    @property
    def __cuda_array_interface__(self) -> dict:
        self._live("__cuda_array_interface__")
        return {"shape": tuple(self.shape), "typestr": self.dtype.str, "strides": None,
                "data": (self.address, False), "version": 3, "stream": None}

    def __dlpack_device__(self) -> tuple[int, int]:
        from kiln.runtime.dlpack import K_DLCUDA

        return K_DLCUDA, self.device.index or 0

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export without copying. Writes to the buffer go through synchronous copies
        and signals, so no stream has anything pending: any `stream` is served."""
        from kiln.runtime.dlpack import K_DLCUDA, KilnDLPackError, pointer_capsule

        self._live("__dlpack__")
        if copy:
            raise KilnDLPackError("__dlpack__(copy=True) of a CUDA symmetric-memory view: its "
                                  "point is the shared memory; copy on the consumer's side")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise KilnDLPackError("__dlpack__: a CUDA symmetric-memory view is on %s; a copy "
                                  "to device %r was asked" % (self.device, tuple(dl_device)),
                                  hint="use view.numpy() for a host copy")
        self._owner._exports += 1
        return pointer_capsule(self.address, tuple(self.shape), None, self.dtype,
                               K_DLCUDA, self.device.index or 0, self._owner,
                               self._owner._export_released)

    def __repr__(self) -> str:
        return "CudaView(rank=%d, shape=%s, dtype=%s, device=%s)" % (
            self.rank, self.shape, self.dtype, self.device)


class CudaSymmetricMemory(SignalPads):
    """A group's CUDA symmetric allocation on this rank; see the module docstring."""

    _what = "CUDA symmetric memory"

    def __init__(self, group, shape: tuple, dtype: np.dtype, device, driver, context,
                 addresses: list[int], timeout: float):
        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        self.shape, self.dtype, self.device, self.timeout = shape, dtype, device, timeout
        self.driver, self._context = driver, context
        self._blocks = addresses  # rank -> its block here (own: allocated; peers: mapped)
        self._views = [CudaView(self, r, a + _ALIGN) for r, a in enumerate(addresses)]
        self._sent = [0] * self.world_size
        self._seen = [0] * self.world_size
        self._word = np.zeros(1, np.uint64)  # the host side of a pad write
        self._read = np.zeros(1, np.uint64)  # and of a pad read
        self._closed = False
        self._exports = 0  # DLPack views a consumer still holds

    @property
    def buffer(self) -> CudaView:
        """This rank's buffer."""
        return self._views[self.rank]

    def peer(self, rank: int) -> CudaView:
        """Rank `rank`'s buffer, mapped here."""
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise SymmetricMemoryError("peer(%r): no such rank in a group of %d"
                                       % (rank, self.world_size))
        return self._views[rank]

    def _pad_address(self, owner: int, src: int) -> int:
        return self._blocks[owner] + 8 * src

    def signal(self, dst: int) -> None:
        """Tell rank `dst` that this rank's writes so far (device work included) are done."""
        self.peer(dst)
        driver = self._views[dst]._live("signal")
        _check(driver, driver.cuCtxSynchronize(), "cuCtxSynchronize")
        self._sent[dst] += 1
        self._word[0] = self._sent[dst]
        _check(driver, driver.cuMemcpyHtoD(self._pad_address(dst, self.rank),
                                           self._word.ctypes.data, 8),
               "cuMemcpyHtoD (signal pad)")

    def _pad(self, src: int) -> int:
        """The counter rank `src` stored in this rank's pad (one 8-byte device read)."""
        driver = self._views[src]._live("wait_signal")
        _check(driver, driver.cuMemcpyDtoH(self._read.ctypes.data,
                                           self._pad_address(self.rank, src), 8),
               "cuMemcpyDtoH (signal pad)")
        return int(self._read[0])

    def close(self) -> None:
        """Unmap the peers' blocks and free this rank's (deferred while a DLPack
        consumer still holds a view); the views fail (K254) from now on."""
        if not self._closed:
            self._closed = True
            if self._exports == 0:
                self._unmap()

    def _export_released(self) -> None:
        self._exports -= 1
        if self._closed and self._exports == 0:
            self._unmap()

    def _unmap(self) -> None:
        blocks, self._blocks = self._blocks, []
        _unmap_blocks(self.driver, self.rank, blocks, self._context)

    def __enter__(self) -> "CudaSymmetricMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


def _unmap_blocks(driver, rank: int, blocks: list, context) -> None:
    """Close every mapped peer block, free our own, release the context; every step is
    tried even if one fails (a dead peer's handle), the first failure raised after."""
    failed = None
    for r, address in enumerate(blocks):
        if not address:
            continue
        call = driver.cuMemFree if r == rank else driver.cuIpcCloseMemHandle
        try:
            _check(driver, call(address), call.__name__)
        except CudaSymmetricMemoryError as exc:
            failed = failed or exc
    if context is not None:
        driver.cuDevicePrimaryCtxRelease(context[0])
    if failed is not None:
        raise failed


def _driver_and_context(driver, index: int):
    """The driver (cuda.bindings.driver unless given), with the device's primary context
    current; returns (driver, (device, context))."""
    if driver is None:
        from kiln.runtime.gpu_devices import _cuda

        try:
            driver = _cuda()
        except Exception as exc:  # no cuda-bindings, no driver, no GPU
            raise CudaSymmetricMemoryError("symmetric_memory(device='cuda:%d'): CUDA is not "
                                           "usable here (%s: %s)" % (index, type(exc).__name__,
                                                                     exc)) from None
    else:
        _check(driver, driver.cuInit(0), "cuInit")
    count = int(_check(driver, driver.cuDeviceGetCount(), "cuDeviceGetCount"))
    if index >= count:
        raise CudaSymmetricMemoryError("symmetric_memory: device cuda:%d does not exist: this "
                                       "machine has %d CUDA device(s)" % (index, count))
    device = _check(driver, driver.cuDeviceGet(index), "cuDeviceGet")
    context = _check(driver, driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    _check(driver, driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return driver, (device, context)


def cuda_symmetric_memory(shape: tuple, dtype: np.dtype, group, device, timeout: float,
                          driver=None) -> CudaSymmetricMemory:
    """The CUDA path of `symmetric_memory` (a collective call of every rank of `group`,
    all on one host); arguments checked by the caller."""
    index = device.index or 0
    driver, context = _driver_and_context(driver, index)
    world, rank = group.world_size, group.rank
    nbytes = _ALIGN + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if world * 8 > _ALIGN:
        raise SymmetricMemoryError("symmetric_memory: CUDA signal pads hold %d ranks, the "
                                   "group has %d" % (_ALIGN // 8, world))
    blocks = [0] * world
    try:
        own = int(_check(driver, driver.cuMemAlloc(nbytes), "cuMemAlloc(%d)" % nbytes))
        blocks[rank] = own
        _check(driver, driver.cuMemsetD8(own, 0, nbytes), "cuMemsetD8")
        _check(driver, driver.cuCtxSynchronize(), "cuCtxSynchronize")
        handle = _check(driver, driver.cuIpcGetMemHandle(own), "cuIpcGetMemHandle")
        raw = ctypes.string_at(handle.getPtr(), _HANDLE)
        with _SEQ_LOCK:
            seq = next(_SEQ.setdefault((group.name, group.epoch), itertools.count()))
        prefix = "sym-cuda/%s/e%d/%d/" % (group.name, group.epoch, seq)
        host = socket.gethostname()
        group.store.set(prefix + str(rank), json.dumps(
            {"host": host, "pid": os.getpid(), "bytes": nbytes, "handle": raw.hex()}))
        flags = int(driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        deadline = time.monotonic() + timeout
        for r in range(world):
            if r == rank:
                continue
            peer = json.loads(group.store.get(prefix + str(r),
                                              timeout=max(deadline - time.monotonic(), 0.05)))
            if peer["host"] != host or peer["bytes"] != nbytes:
                raise CudaSymmetricMemoryError(
                    "symmetric_memory: rank %d is on host %r with a %d-byte block, rank %d on %r "
                    "with %d: CUDA symmetric memory needs every rank on one host, same shape "
                    "and dtype" % (r, peer["host"], peer["bytes"], rank, host, nbytes))
            theirs = driver.CUipcMemHandle()
            ctypes.memmove(theirs.getPtr(), bytes.fromhex(peer["handle"]), _HANDLE)
            blocks[r] = int(_check(driver, driver.cuIpcOpenMemHandle(theirs, flags),
                                   "cuIpcOpenMemHandle (rank %d's block)" % r))
        group.barrier(timeout=max(deadline - time.monotonic(), 0.05)).wait()
        if rank == 0:  # every rank has read every handle
            group.store.delete_prefix(prefix)
    except BaseException:
        try:
            _unmap_blocks(driver, rank, blocks, context)
        except CudaSymmetricMemoryError:
            pass  # the first failure is the one to report
        raise
    return CudaSymmetricMemory(group, shape, dtype, device, driver, context, blocks, timeout)
