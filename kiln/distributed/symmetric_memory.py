"""Host symmetric memory: one buffer per rank that every rank of a same-host group maps,
reads and writes directly, with signal pads to synchronise.

    sym = kiln.distributed.symmetric_memory((1024,), "float32", pg)
    sym.buffer[:] = x                 # this rank's buffer
    sym.signal(1); sym.wait_signal(1)  # pairwise: "my writes are visible", "and yours"
    sym.peer(1)[:8]                   # rank 1's buffer, read in place
    sym.all_reduce("sum")             # every rank's buffer becomes the reduction

Layout (one /dev/shm file for the group): a header page (magic, nonce), the signal
pads (`world * world` uint64 counters: pad[dst, src] is written only by src), then one
page-aligned region per rank. Rank 0 creates the file (random name starting with a
hash of the job token, mode 0600, O_EXCL) and broadcasts its path and nonce over the
group; once every rank has mapped it (a barrier) rank 0 unlinks it, so after setup a
killed rank leaves nothing behind: the memory goes with the last mapping.

A signal is a single writer's counter stored after the data it covers (x86-64 keeps
stores in order; one aligned 8-byte store is atomic); `wait_signal` polls with a
growing sleep, bounded by the timeout, and gives up early if the group was aborted
(PeerFailure naming the dead rank when the group saw one die).
"""

from __future__ import annotations

import abc
import hashlib
import mmap
import os
import secrets
import time

import numpy as np

from kiln.distributed.errors import (
    CollectiveTimeout, GroupAborted, PeerFailure, SymmetricMemoryError,
)

_MAGIC = b"kilnsym1"
_PAGE = mmap.PAGESIZE
_YIELDS = 200  # sched_yield polls before a wait starts sleeping
_SMALL = 256 << 10  # all_reduce up to this: every rank reduces everything
_REDUCE = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def _round_up(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


class SignalPads(abc.ABC):
    """`wait_signal` and `barrier` over a subclass's signal pads (host and CUDA symmetric
    memory): the subclass reads the counter rank `src` stored for this rank (`_pad`),
    writes its own into a peer's (`signal`) and checks ranks (`peer`)."""

    _what = "symmetric memory"

    @abc.abstractmethod
    def _pad(self, src: int) -> int:
        """The counter rank `src` last stored into this rank's pad."""

    def wait_signal(self, src: int, timeout: float | None = None) -> None:
        """Wait for rank `src`'s next signal to this rank (bounded by `timeout`)."""
        self.peer(src)
        self._seen[src] += 1
        want = self._seen[src]
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        step, yields = 2e-5, _YIELDS
        while self._pad(src) < want:
            if yields:  # the peer is usually microseconds away: give up the core first
                yields -= 1
                os.sched_yield()
                continue
            if self.group.is_aborted:
                cause = self.group._error
                if isinstance(cause, PeerFailure):
                    raise PeerFailure(cause.rank, "%s wait_signal(%d) on rank %d: rank %d of "
                                      "group %s failed" % (self._what, src, self.rank,
                                                           cause.rank, self.group.name),
                                      group=self.group.name) from cause
                raise GroupAborted("%s wait_signal(%d): the group %s was aborted"
                                   % (self._what, src, self.group.name)) from cause
            if time.monotonic() >= deadline:
                raise CollectiveTimeout("%s: rank %d waited for signal %d from rank %d past "
                                        "its timeout" % (self._what, self.rank, want, src),
                                        rank=src)
            time.sleep(step)
            step = min(step * 2, 1e-3)

    def barrier(self, timeout: float | None = None) -> None:
        """Every rank's writes before the barrier are visible to every rank after it."""
        for r in range(self.world_size):
            if r != self.rank:
                self.signal(r)
        for r in range(self.world_size):
            if r != self.rank:
                self.wait_signal(r, timeout)


class SymmetricMemory(SignalPads):
    """A group's mapped segment; see the module docstring. Close it (or use `with`)."""

    def __init__(self, group, shape: tuple[int, ...], dtype: np.dtype, mm: mmap.mmap,
                 timeout: float):
        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        self.shape, self.dtype, self.timeout = shape, dtype, timeout
        self._mm = mm
        n = self.world_size
        self._pads = np.frombuffer(mm, np.uint64, n * n, _PAGE).reshape(n, n)
        region = _round_up(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        base = _PAGE + _round_up(n * n * 8)
        count = int(np.prod(shape, dtype=np.int64))
        self._bufs = [np.frombuffer(mm, dtype, count, base + r * region).reshape(shape)
                      for r in range(n)]
        self._sent = [0] * n
        self._seen = [0] * n

    @property
    def buffer(self) -> np.ndarray:
        """This rank's buffer (a view of the shared segment)."""
        return self._bufs[self.rank]

    def peer(self, rank: int) -> np.ndarray:
        """Rank `rank`'s buffer, readable and writable in place."""
        if not 0 <= rank < self.world_size:
            raise SymmetricMemoryError("peer(%r): no such rank in a group of %d"
                                       % (rank, self.world_size))
        return self._bufs[rank]

    def signal(self, dst: int) -> None:
        """Tell rank `dst` that this rank's writes so far are visible."""
        self.peer(dst)
        self._sent[dst] += 1
        self._pads[dst, self.rank] = self._sent[dst]

    def _pad(self, src: int) -> int:
        return int(self._pads[self.rank, src])

    def all_reduce(self, op: str = "sum", timeout: float | None = None) -> np.ndarray:
        """Reduce every rank's buffer elementwise into all of them, in place; returns
        this rank's buffer. Rank r reduces chunk r of every buffer into its own, in place,
        and writes it into every peer's buffer (no rank touches another's chunk, so two
        barriers and no scratch). Up to 256 KiB every rank reduces all of it, in rank
        order, into its own buffer."""
        if op not in _REDUCE:
            raise SymmetricMemoryError("all_reduce: op %r is not one of %s"
                                       % (op, ", ".join(_REDUCE)))
        flats = [b.reshape(-1) for b in self._bufs]
        if flats[0].nbytes <= _SMALL:  # latency-bound
            self.barrier(timeout)
            acc = flats[0].copy()
            for f in flats[1:]:
                _REDUCE[op](acc, f, out=acc)
            self.barrier(timeout)  # nobody reads the inputs any more
            flats[self.rank][:] = acc
            return self.buffer
        bounds = np.linspace(0, flats[0].size, self.world_size + 1).astype(np.int64)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        self.barrier(timeout)  # every rank's input is in place
        # chunk [lo, hi) of every buffer is read and written by this rank only
        mine = flats[self.rank][lo:hi]
        for r, f in enumerate(flats):
            if r != self.rank:
                _REDUCE[op](mine, f[lo:hi], out=mine)
        for r, f in enumerate(flats):
            if r != self.rank:
                f[lo:hi] = mine
        self.barrier(timeout)  # every chunk is written everywhere
        return self.buffer

    def close(self) -> None:
        """Unmap this rank's view (the memory goes with the last mapping)."""
        if self._mm is not None:
            self._pads = self._bufs = None
            try:
                self._mm.close()
            except BufferError:  # a view the caller kept: freed with it
                pass
            self._mm = None

    def __enter__(self) -> "SymmetricMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _device(device):
    """`device=` as a kiln Device: "cpu" (the /dev/shm segment) or "cuda:N"."""
    from kiln.errors import KilnError
    from kiln.runtime.device import Device

    try:
        dev = Device(device)
    except KilnError as exc:
        raise SymmetricMemoryError("symmetric_memory(device=%r): %s" % (device, exc)) from None
    if dev.type not in ("cpu", "cuda"):
        raise SymmetricMemoryError("symmetric_memory(device=%r): symmetric memory is on the "
                                   "host ('cpu') or on CUDA ('cuda:N'), not %s"
                                   % (device, dev.type))
    return dev


def symmetric_memory(shape, dtype, group, *, timeout: float | None = None, device=None,
                     driver=None):
    """Allocate a symmetric buffer of `shape`/`dtype` on every rank of `group` (a
    collective call; all ranks on one host). Zero-filled. `device="cuda:N"`: in GPU
    memory mapped through CUDA IPC (kiln/distributed/symmetric_cuda.py; `driver` is
    cuda.bindings.driver unless a test gives a fake)."""
    try:
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise SymmetricMemoryError("symmetric_memory(%r, %r): %s" % (shape, dtype, exc)) from None
    if any(s < 0 for s in shape) or dt.hasobject or dt.itemsize == 0:
        raise SymmetricMemoryError("symmetric_memory: shape %r with dtype %s is not a "
                                   "plain buffer" % (shape, dt))
    timeout = group.timeout if timeout is None else timeout
    if device is not None:
        dev = _device(device)
        if dev.type == "cuda":
            from kiln.distributed.symmetric_cuda import cuda_symmetric_memory

            return cuda_symmetric_memory(shape, dt, group, dev, timeout, driver)
    n = group.world_size
    size = _PAGE + _round_up(n * n * 8) + n * _round_up(int(np.prod(shape)) * dt.itemsize)
    msg = np.zeros(256, np.uint8)
    path = None
    if group.rank == 0:
        prefix = "kiln-" + hashlib.sha256(group._token.encode()).hexdigest()[:16]
        path = "/dev/shm/%s-sym-%s" % (prefix, secrets.token_hex(8))
        nonce = secrets.token_bytes(16)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mm[:len(_MAGIC) + 16] = _MAGIC + nonce
        blob = nonce + path.encode()
        msg[0], msg[1:1 + len(blob)] = len(blob), np.frombuffer(blob, np.uint8)
    try:
        group.broadcast(msg, src=0, timeout=timeout).wait()
        if group.rank != 0:
            blob = msg[1:1 + int(msg[0])].tobytes()
            nonce, path = blob[:16], blob[16:].decode()
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise SymmetricMemoryError("symmetric_memory: rank %d cannot open rank 0's "
                                           "segment %s (%s): are all ranks on one host?"
                                           % (group.rank, path, exc)) from None
            try:
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            if mm[:len(_MAGIC) + 16] != _MAGIC + nonce:
                mm.close()
                raise SymmetricMemoryError("symmetric_memory: segment %s is not the one "
                                           "rank 0 made" % path)
        group.barrier(timeout=timeout).wait()
    finally:
        if group.rank == 0:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return SymmetricMemory(group, shape, dt, mm, timeout)
