"""The fake NCCL across processes: one `FakeNcclServer` (in the test process) holds the
`FakeWorld`; each rank's process talks to it through a `RemoteNccl` (its `NcclApi`).

A process that dies (SIGKILL) closes its connection, and the server marks every
communicator it owned dead in its clique, as NCCL's proxies see a peer vanish: the
peers' pending work then ends in ncclRemoteError. Buffers live in the ranks' memory:
a call ships its send buffer's bytes; its result bytes come back, and are written to
the rank's receive buffer, when an event covering the call is seen complete (as with a
GPU stream, a receive buffer holds the result only after the event). No pickle: a
message is a length-prefixed JSON header and a raw byte payload.

    server = FakeNcclServer(init_polls=1)       # test process; env KILN_FAKE_NCCL=server.address
    set_nccl_api(RemoteNccl(server.address))    # each rank, before init_process_group("nccl")
"""

from __future__ import annotations

import ctypes
import json
import socket
import struct
import threading

import ml_dtypes
import numpy as np

from kiln.distributed import nccl_api as api

_HEAD = struct.Struct("!II")  # header length, payload length
_ITEM = {code: np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name).itemsize
         for name, code in api.DTYPES.items()}
# buffered calls: (argument index of send, of recv, of count, of dtype, of comm)
_BUFFERED = {"all_reduce": (0, 1, 2, 3, 5), "broadcast": (0, 1, 2, 3, 5),
             "reduce": (0, 1, 2, 3, 6), "all_gather": (0, 1, 2, 3, 4),
             "reduce_scatter": (0, 1, 2, 3, 5), "send": (0, None, 1, 2, 4),
             "recv": (None, 0, 1, 2, 4)}
_MAKES_COMM = ("comm_init_rank_config", "comm_split", "comm_shrink", "comm_grow")


def _read(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _send_msg(sock: socket.socket, head: dict, payload: bytes = b"") -> None:
    raw = json.dumps(head).encode()
    sock.sendall(_HEAD.pack(len(raw), len(payload)) + raw + payload)


def _recv_msg(sock: socket.socket) -> tuple[dict, bytes]:
    hn, pn = _HEAD.unpack(_read(sock, _HEAD.size))
    head = json.loads(_read(sock, hn))
    return head, _read(sock, pn) if pn else b""


def _sizes(method: str, count: int, dtype: int, nranks: int) -> tuple[int, int]:
    """(send bytes, receive bytes) of a buffered call."""
    item = count * _ITEM[dtype]
    if method == "all_gather":
        return item, item * nranks
    if method == "reduce_scatter":
        return item * nranks, item
    return item, item


class FakeNcclServer:
    """Serves one `FakeWorld` to the ranks' `RemoteNccl`s (one thread per rank)."""

    def __init__(self, init_polls: int = 0):
        from tests.distributed.fake_nccl import FakeWorld

        self.world = FakeWorld(init_polls)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.address = "127.0.0.1:%d" % self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self.logs: list[list[str]] = []  # each connection's call log
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            conn.settimeout(None)
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from tests.distributed.fake_nccl import FakeNccl

        fake = FakeNccl(self.world)
        self.logs.append(fake.log)
        owned: set[int] = set()
        # id(op) -> (op, client address, server array, its number in the rank's stream)
        results: dict[int, tuple] = {}
        keep: list = []  # the server-side send arrays of calls not yet complete
        marks: dict[int, int] = {}  # event -> the number of calls enqueued before it
        posted = [0]
        try:
            while True:
                head, payload = _recv_msg(conn)
                reply, out = self._call(fake, head, payload, owned, results, keep, marks,
                                        posted)
                _send_msg(conn, reply, out)
        except (EOFError, OSError, ValueError):
            pass
        finally:
            conn.close()
            with self.world.lock:  # the process is gone: its ranks are dead everywhere
                for handle in owned:
                    comm = self.world.comms.get(handle)
                    if comm is not None and comm.clique is not None:
                        comm.aborted = True
                        comm.clique.dead.add(comm.rank)

    def _call(self, fake, head: dict, payload: bytes, owned, results, keep, marks, posted):
        method, args = head["m"], head["a"]
        if method == "_nranks":
            with self.world.lock:
                return {"r": self.world.comms[args[0]].clique.nranks}, b""
        if method == "event_destroy":
            marks.pop(args[0], None)
        if method == "event_record":
            event = fake.event_record(*args)
            marks[event] = posted[0]
            return {"r": event}, b""
        if method == "event_query":
            done = fake.event_query(args[0])
            deliver, out = [], []
            if done:  # every call enqueued before the event is complete: results land
                upto = marks.get(args[0], posted[0])
                for key in [k for k, e in results.items() if e[3] <= upto and e[0].done]:
                    op, addr, arr, _ = results.pop(key)
                    if not op.dropped:
                        deliver.append([addr, arr.nbytes])
                        out.append(arr.tobytes())
            return {"r": done, "deliver": deliver}, b"".join(out)
        if method in _BUFFERED:
            si, ri, ci, di, mi = _BUFFERED[method]
            with self.world.lock:
                nranks = self.world.comms[args[mi]].clique.nranks
            snd_n, rcv_n = _sizes(method, args[ci], args[di], nranks)
            call = list(args)
            sbuf = rbuf = None
            if si is not None:
                sbuf = np.frombuffer(payload, np.uint8).copy() if snd_n else np.zeros(1, np.uint8)
                call[si] = sbuf.ctypes.data
            if ri is not None:
                rbuf = np.zeros(max(rcv_n, 1), np.uint8)
                call[ri] = rbuf.ctypes.data
            res = getattr(fake, method)(*call)
            if res == api.SUCCESS:
                posted[0] += 1
                op = fake.pending[-1]
                keep.append((op, sbuf))
                root = op.args.get("root")
                if rbuf is not None and rcv_n and not (method == "reduce" and op.rank != root):
                    results[id(op)] = (op, args[ri], rbuf[:rcv_n], posted[0])
            keep[:] = [(o, b) for o, b in keep if not o.done]
            return {"r": res}, b""
        if method in ("comm_grow",) and args[2] is not None:
            args[2] = bytes.fromhex(args[2])
        if method == "comm_init_rank_config":
            args[1] = bytes.fromhex(args[1])
        res = getattr(fake, method)(*args)
        if method in _MAKES_COMM and res[1]:
            owned.add(res[1])
        if method in ("get_unique_id", "comm_get_unique_id"):
            res = (res[0], res[1].hex())
        return {"r": res}, b""

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)


def _forward(method: str):
    """A RemoteNccl method that sends its arguments as they are."""
    def call(self, *args):
        return self._rpc(method, *args)
    call.__name__ = method
    return call


class RemoteNccl(api.NcclApi):
    """One rank's NcclApi: every call is forwarded to a `FakeNcclServer`."""

    name = "fake-remote"

    def __init__(self, address: str, timeout: float = 60.0):
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._lock = threading.Lock()
        self._nranks: dict[int, int] = {}

    def _rpc(self, method: str, *args, payload: bytes = b""):
        with self._lock:
            _send_msg(self._sock, {"m": method, "a": list(args)}, payload)
            head, out = _recv_msg(self._sock)
        offset = 0
        for addr, n in head.get("deliver", ()):
            ctypes.memmove(addr, out[offset:offset + n], n)
            offset += n
        res = head["r"]
        return tuple(res) if isinstance(res, list) else res

    # calls whose arguments and results cross as they are
    get_version = _forward("get_version")
    get_error_string = _forward("get_error_string")
    comm_get_async_error = _forward("comm_get_async_error")
    comm_revoke = _forward("comm_revoke")
    comm_abort = _forward("comm_abort")
    comm_finalize = _forward("comm_finalize")
    comm_destroy = _forward("comm_destroy")
    group_start = _forward("group_start")
    group_end = _forward("group_end")
    event_record = _forward("event_record")
    event_query = _forward("event_query")

    def _buffered(self, method: str, *args):
        si, _, ci, di, mi = _BUFFERED[method]
        payload = b""
        if si is not None:
            comm = args[mi]
            if method == "reduce_scatter" and comm not in self._nranks:
                self._nranks[comm] = self._rpc("_nranks", comm)
            n, _ = _sizes(method, args[ci], args[di], self._nranks.get(comm, 1))
            payload = ctypes.string_at(args[si], n) if n else b""
        return self._rpc(method, *args, payload=payload)

    def get_unique_id(self):
        res, uid = self._rpc("get_unique_id")
        return res, bytes.fromhex(uid)

    def comm_init_rank_config(self, nranks, unique_id, rank, blocking):
        return self._rpc("comm_init_rank_config", nranks, unique_id.hex(), rank, blocking)

    def comm_split(self, comm, color, key, blocking):
        return self._rpc("comm_split", comm, color, key, blocking)

    def comm_shrink(self, comm, exclude, flags, blocking):
        return self._rpc("comm_shrink", comm, list(exclude), flags, blocking)

    def comm_get_unique_id(self, comm):
        res, uid = self._rpc("comm_get_unique_id", comm)
        return res, bytes.fromhex(uid)

    def comm_grow(self, comm, nranks, unique_id, rank, blocking):
        return self._rpc("comm_grow", comm, nranks,
                         None if unique_id is None else unique_id.hex(), rank, blocking)

    def all_reduce(self, send, recv, count, dtype, op, comm, stream):
        return self._buffered("all_reduce", send, recv, count, dtype, op, comm, stream)

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        return self._buffered("broadcast", send, recv, count, dtype, root, comm, stream)

    def reduce(self, send, recv, count, dtype, op, root, comm, stream):
        return self._buffered("reduce", send, recv, count, dtype, op, root, comm, stream)

    def all_gather(self, send, recv, send_count, dtype, comm, stream):
        return self._buffered("all_gather", send, recv, send_count, dtype, comm, stream)

    def reduce_scatter(self, send, recv, recv_count, dtype, op, comm, stream):
        return self._buffered("reduce_scatter", send, recv, recv_count, dtype, op, comm, stream)

    def send(self, buf, count, dtype, peer, comm, stream):
        return self._buffered("send", buf, count, dtype, peer, comm, stream)

    def recv(self, buf, count, dtype, peer, comm, stream):
        return self._buffered("recv", buf, count, dtype, peer, comm, stream)

    # windows are simulated in one process only (tests/distributed/test_nccl_window.py)
    def comm_window_register(self, comm, buf, nbytes, flags):
        return api.INVALID_USAGE, 0

    def comm_window_deregister(self, comm, win):
        return api.INVALID_USAGE

    def put_signal(self, send, count, dtype, peer, win, offset, sig, ctx, comm, stream):
        return api.INVALID_USAGE

    def signal(self, peer, sig, ctx, comm, stream):
        return api.INVALID_USAGE

    def wait_signal(self, descs, comm, stream):
        return api.INVALID_USAGE

    def mem_alloc(self, nbytes):
        return 0

    def mem_free(self, addr):
        return None

    def copy_to_host(self, addr, nbytes):
        raise NotImplementedError("the cross-process fake NCCL has no device memory")

    def event_destroy(self, event):
        return self._rpc("event_destroy", event)
