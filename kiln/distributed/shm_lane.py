"""Shared-memory data lane between two ranks of a group on the same host.

On loopback every byte a TCP message carries is copied twice by the kernel (into the
sender's socket buffer, out of the receiver's), and with more ranks than cores those
copies are what a large collective spends its CPU on. This lane moves large payloads
through a memory segment both processes map instead (what NCCL's and MPI's intra-node
transports do): the sender copies a message into a free *slot* (a numpy copy, which
releases the GIL), and the socket carries only the message's header, with the slot
number in the high bits of its kind byte. The receiver copies the slot into the
posted buffer, or, for a receive posted with `borrow` (a reduction's operand), lends
the slot itself, which the reduction reads in place: one user-space copy per byte,
or none on the receiving side. Headers keep their order on the socket, so matching,
the stash and mismatch detection work exactly as for TCP payloads; the socket still
carries small messages, RMA, abort and goodbye notices, and its EOF is how a dead peer
is noticed.

Layout: one file per pair, a header page (magic, nonce) then two rings of `SLOTS`
slots of `slot_bytes` each (page-aligned), one per direction (the lower rank writes
ring 0).

Flow control is by credits: the sender starts owning every slot of its ring; the
receiver hands a slot back by writing its number (one byte) into a FIFO the sender
reads. The sender waits for a credit in `poll` (never spinning), waking every
`_TICK` to give up if the transport failed or closed; a dead receiver closes the
FIFO, which the sender sees as EOF. A slot is handed back once its message was
copied out, or once the reduction that borrowed it is done (`ShmMessage.release`).

Slot exhaustion: a message that came before its receive was posted (or a borrowed
one whose reader waits for another message first) keeps its slot. If every slot is
held that way the sender may wait for a credit while the receiver waits for the
message behind it (TCP would have read it into the stash), so when the receiver
thread finds every slot held and none comes back within `_SPILL_AFTER`, it copies
the newest message nobody is reading into memory of its own (`relieve`) and frees
its slot. Usually one does come back (the reader is busy with an older message: the
sender merely got ahead), and waiting for it is what flow control is for; a copy
made at once cost a 64 MB ring all_reduce 1-3 spills per call. Only callers reading
right now hold slots that cannot be spilled, and they free them without waiting for
anything.

Setup (`connect`, at rendezvous, over the already authenticated sockets): the lower
rank of each pair creates the segment file and the two credit FIFOs in /dev/shm
(random names that start with a hash of the job token, mode 0600, O_EXCL), writes a
random nonce in the file and sends path and nonce to the peer; the peer opens and
maps them, checks the nonce, and replies. Both sides unlink the files once the peer
has them open, so nothing is left behind after that even if a process is killed;
the mappings go away with `close` (or, if a reader still holds a slot's memory
then, once that memory is freed). If anything fails (the peer is on another host, no
/dev/shm, no space) the pair has no lane and everything goes over TCP as before;
KILN_TCP_SHM=0 disables the lane.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import select
import threading

import numpy as np

from kiln.distributed.protocol import recv_frame, send_frame

SHM_DIR = "/dev/shm"
SLOTS = 4  # per direction: the sender can be this many messages ahead
# smaller messages stay on the socket: their copies are cheap, a credit is not free;
# at least 64 KiB, what `Link.send` may write inline (not through the sender thread)
MIN_BYTES = 64 << 10
_MAGIC = b"kiln-shm-lane-1\0"
_PAGE = 4096
_TICK = 0.1  # a sender waiting for a credit checks the transport's state this often
_SPILL_AFTER = 0.01  # every slot held this long: spill one (see `relieve`)


def enabled() -> bool:
    return os.environ.get("KILN_TCP_SHM", "1") != "0"


class ShmLane:
    """One pair's segment, seen from one side: the ring this side writes (with its
    free slots and the FIFO their credits come back on) and the ring it reads (with
    the messages that hold a slot, and the FIFO that returns their credits)."""

    def __init__(self, mm: mmap.mmap, lower: bool, slot_bytes: int, credit_in: int,
                 credit_out: int):
        self.slots, self.slot_bytes = SLOTS, slot_bytes
        self._mm = mm

        def ring(index: int) -> list[np.ndarray]:
            start, stride = _ring(index, slot_bytes), _stride(slot_bytes)
            return [np.frombuffer(mm, np.uint8, slot_bytes, start + i * stride)
                    for i in range(SLOTS)]
        self._out, self._in = (ring(0), ring(1)) if lower else (ring(1), ring(0))
        self._credit_in, self._credit_out = credit_in, credit_out
        self._poller = select.poll()
        self._poller.register(credit_in, select.POLLIN)
        self._free = list(range(SLOTS - 1, -1, -1))  # slots of the out ring this side owns
        self._held: dict[int, ShmMessage] = {}  # in ring: slot -> message, arrival order
        self._lock = threading.Condition()  # notified when a slot is given back
        self.bytes_sent = self.bytes_received = self.messages_sent = self.spilled = 0

    def carries(self, nbytes: int) -> bool:
        return MIN_BYTES < nbytes <= self.slot_bytes

    # -- sending (the link's sender thread only) ----------------------------------------
    def put(self, header: bytes, view: memoryview, alive) -> bytes:
        """Copy the payload into a free slot (waiting for one while `alive()`); return
        the header to send in its place: the slot number (+1) in the kind's high bits."""
        out = self._out  # [] once closed
        while not self._free and out:
            try:
                with self._lock:  # not while `close` closes the descriptor
                    got = os.read(self._credit_in, 64) if self._out else b""
            except BlockingIOError:
                if not alive():
                    raise ConnectionAbortedError("the transport closed") from None
                self._poller.poll(_TICK * 1000)
                continue
            if not got:
                raise EOFError("shared-memory lane closed")
            self._free.extend(got)
        if not out:
            raise ConnectionAbortedError("the transport closed")
        slot = self._free.pop()
        n = len(view)
        out[slot][:n] = np.frombuffer(view, np.uint8)
        self.bytes_sent += n
        self.messages_sent += 1
        return bytes([header[0] | (slot + 1) << 4]) + header[1:]

    # -- receiving ----------------------------------------------------------------------
    def arrived(self, slot: int, nbytes: int) -> "ShmMessage":
        """The message whose header named `slot` (the receiver thread)."""
        if not 0 <= slot < self.slots or nbytes > self.slot_bytes or slot in self._held:
            raise ValueError("bad shared-memory slot %d (%d bytes)" % (slot, nbytes))
        ring = self._in
        if not ring:
            raise EOFError("shared-memory lane closed")
        msg = ShmMessage(self, slot, ring[slot][:nbytes])
        with self._lock:
            self._held[slot] = msg
        self.bytes_received += nbytes
        return msg

    def relieve(self) -> None:
        """Called by the receiver thread after each arrival: if every slot is held and
        none is given back within `_SPILL_AFTER`, spill the newest message nobody is
        reading (module docstring). Usually a reader frees a slot soon (the sender
        just got ahead, and waiting is the flow control working); the wait keeps
        those cases from paying a copy."""
        with self._lock:
            if len(self._held) < self.slots or self._lock.wait_for(
                    lambda: len(self._held) < self.slots, _SPILL_AFTER):
                return
            for msg in reversed(self._held.values()):
                if not msg.claimed:
                    # copied under the lock: a reader claiming it meanwhile waits for
                    # the copy, then reads the copy
                    msg.data = msg.data.copy()
                    self._give_back(msg)
                    self.spilled += 1
                    return

    def _give_back(self, msg: "ShmMessage") -> None:
        """Return msg's slot to the sender (with the lock held)."""
        del self._held[msg.slot]
        msg.held = False
        self._lock.notify()
        if self._credit_out >= 0:
            try:
                os.write(self._credit_out, bytes([msg.slot]))
            except OSError:
                pass  # the peer is gone: its socket's EOF fails the transport

    def close(self) -> None:
        """Close the FIFOs and unmap. A message a reader may still read keeps its own
        view of its slot (the peer cannot reuse a slot it was not given back), so the
        mapping then stays until the last such view is gone."""
        with self._lock:
            fds, self._credit_in, self._credit_out = (self._credit_in, self._credit_out), -1, -1
            self._out, self._in = [], []
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        try:
            self._mm.close()
        except BufferError:
            pass  # views remain: unmapped when they go


class ShmMessage:
    """A received message whose payload is in a slot of the in ring (`data`; once
    spilled, a copy of its own). A reader `claim`s it, reads, then `release`s it,
    which gives the slot back."""

    __slots__ = ("lane", "slot", "data", "nbytes", "held", "claimed")

    def __init__(self, lane: ShmLane, slot: int, data: np.ndarray):
        self.lane, self.slot, self.data, self.nbytes = lane, slot, data, len(data)
        self.held, self.claimed = True, False

    def __len__(self) -> int:
        return self.nbytes

    def claim(self) -> np.ndarray:
        """The payload's bytes (uint8); not spilled or reused until `release`."""
        with self.lane._lock:
            self.claimed = True
            return self.data

    def release(self) -> None:
        with self.lane._lock:
            if self.held:
                self.lane._give_back(self)
            self.data = None

    def copy_to(self, view: memoryview) -> None:
        np.frombuffer(view, np.uint8)[:] = self.claim()
        self.release()


# -- setup at rendezvous ---------------------------------------------------------------
def _stride(slot_bytes: int) -> int:
    return -(-slot_bytes // _PAGE) * _PAGE  # slots start on page boundaries


def _ring(index: int, slot_bytes: int) -> int:
    """Offset of ring `index` (0: written by the lower rank); `_ring(2, ..)`: the size."""
    return _PAGE + index * SLOTS * _stride(slot_bytes)


def _create(token: str, slot_bytes: int) -> tuple[ShmLane, dict, list[str]] | None:
    """The lower rank's half: files, mapping and the offer to send (None: no lane)."""
    base = os.path.join(SHM_DIR, "kiln-%s-%s" % (
        hashlib.sha256(token.encode()).hexdigest()[:16], secrets.token_hex(16)))
    paths = [base, base + ".c0", base + ".c1"]
    fds: list[int] = []
    try:
        size = _ring(2, slot_bytes)
        fd = os.open(base, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fds.append(fd)
        nonce = secrets.token_bytes(16)
        os.ftruncate(fd, size)
        # allocate the ring this side writes now: a full /dev/shm fails here, not as a
        # SIGBUS on first touch (the peer allocates its own ring)
        os.posix_fallocate(fd, 0, _ring(1, slot_bytes))
        os.pwrite(fd, _MAGIC + nonce, 0)
        mm = mmap.mmap(fd, size)
        for path in paths[1:]:
            os.mkfifo(path, 0o600)
        # c0 returns credits of ring 0 (this side reads them); c1 carries this side's
        # credits for ring 1, opened read-write so opening needs no reader yet (the
        # peer reads it; this side never does)
        c0 = os.open(paths[1], os.O_RDONLY | os.O_NONBLOCK)
        fds.append(c0)
        c1 = os.open(paths[2], os.O_RDWR | os.O_NONBLOCK)
        fds.append(c1)
    except (OSError, ValueError):
        _discard(paths, fds)
        return None
    os.close(fd)
    lane = ShmLane(mm, True, slot_bytes, c0, c1)
    return lane, {"path": base, "nonce": nonce.hex(), "slots": SLOTS,
                  "slot_bytes": slot_bytes}, paths


def _accept(offer, slot_bytes: int) -> ShmLane | None:
    """The higher rank's half: open and check what the peer offered (None: no lane)."""
    if not isinstance(offer, dict):
        return None
    base, nonce = offer.get("path"), offer.get("nonce")
    if not (isinstance(base, str) and isinstance(nonce, str) and offer.get("slots") == SLOTS
            and offer.get("slot_bytes") == slot_bytes
            and os.path.dirname(base) == SHM_DIR and os.path.basename(base).startswith("kiln-")):
        return None
    paths = [base, base + ".c0", base + ".c1"]
    fds: list[int] = []
    try:
        size = _ring(2, slot_bytes)
        fd = os.open(base, os.O_RDWR | os.O_NOFOLLOW)
        fds.append(fd)
        if os.fstat(fd).st_size != size or os.pread(fd, 32, 0) != _MAGIC + bytes.fromhex(nonce):
            raise ValueError("not the segment the peer created")
        os.posix_fallocate(fd, _ring(1, slot_bytes), size - _ring(1, slot_bytes))
        mm = mmap.mmap(fd, size)
        c0 = os.open(paths[1], os.O_WRONLY | os.O_NONBLOCK)
        fds.append(c0)
        c1 = os.open(paths[2], os.O_RDONLY | os.O_NONBLOCK)
        fds.append(c1)
    except (OSError, ValueError):
        _discard([], fds)
        return None
    os.close(fd)
    _unlink(paths)  # both sides have everything open: nothing left to leak
    return ShmLane(mm, False, slot_bytes, c1, c0)


def _discard(paths: list[str], fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _unlink(paths)


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def connect(socks: dict, rank: int, token: str, slot_bytes: int,
            deadline: float) -> dict[int, ShmLane]:
    """Set up a lane with every peer on this host, over the threaded-lane sockets
    (authenticated, not yet used): returns {peer: lane} for the pairs that have one.

    Every pair exchanges an offer (lower -> higher; null when the lower has no lane to
    offer) and a reply, whatever happens, so both sides agree. The order (all offers
    out, then the lower peers' offers answered, then the replies read) needs no rank
    to wait for one that waits for it: offers are sent before anything is read."""
    use = enabled() and slot_bytes > MIN_BYTES
    lanes: dict[int, ShmLane] = {}
    offered: dict[int, tuple] = {}
    try:
        for peer in sorted(p for p in socks if p > rank):
            made = _create(token, slot_bytes) if use else None
            if made is not None:
                offered[peer] = made
            send_frame(socks[peer], {"shm": made[1] if made else None}, deadline=deadline)
        for peer in sorted(p for p in socks if p < rank):
            header, _ = recv_frame(socks[peer], deadline, max_size=4096)
            lane = _accept(header.get("shm"), slot_bytes) if use else None
            if lane is not None:
                lanes[peer] = lane
            send_frame(socks[peer], {"shm": lane is not None}, deadline=deadline)
        for peer in sorted(p for p in socks if p > rank):
            header, _ = recv_frame(socks[peer], deadline, max_size=4096)
            made = offered.pop(peer, None)
            if made is None:
                continue
            _unlink(made[2])  # the peer unlinked them already if it accepted
            if header.get("shm") is True:
                lanes[peer] = made[0]
            else:
                made[0].close()
    except BaseException:
        for lane, _, paths in offered.values():
            _unlink(paths)
            lane.close()
        for lane in lanes.values():
            lane.close()
        raise
    return lanes
