"""`LibNccl`: the `NcclApi` over the real libnccl.so.2, through ctypes.

Why ctypes and not nccl4py: the layer kiln needs is a one-to-one mirror of 29 C calls
(`kiln.distributed.nccl_api`) that a fake implements too; nccl4py wraps them in its own
Communicator objects and cuda.core stream types, which kiln would have to wrap again
and which a fake could not mirror call for call. ctypes adds no dependency, and the
signatures below are read from the 2.32 `nccl.h` shipped in the wheel.

The library is found at KILN_NCCL_LIBRARY, else in the `nvidia-nccl-cu12`/`-cu13`
wheel (`nvidia/nccl/lib`), else by the loader's search (`libnccl.so.2`). It loads on a
machine without a GPU (version, unique ids); creating a communicator needs one.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from kiln.distributed import nccl_api as api
from kiln.distributed.errors import NcclUnavailable

_INT_MIN = -(2 ** 31)


class UniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes."""

    _fields_ = [("internal", ctypes.c_char * api.UNIQUE_ID_BYTES)]


class Config(ctypes.Structure):
    """ncclConfig_t as of NCCL 2.32 (ncclConfig_v23100); unset fields are INT_MIN/NULL,
    as NCCL_CONFIG_INITIALIZER leaves them."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint),
                ("version", ctypes.c_uint), ("blocking", ctypes.c_int),
                ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p),
                ("splitShare", ctypes.c_int), ("trafficClass", ctypes.c_int),
                ("commName", ctypes.c_char_p)] + [
        (name, ctypes.c_int) for name in (
            "collnetEnable", "CTAPolicy", "shrinkShare", "nvlsCTAs", "nChannelsPerNetPeer",
            "nvlinkCentricSched", "graphUsageMode", "numRmaCtx", "maxP2pPeers",
            "graphStreamOrdering", "launchOrderImplicit", "numRmaSig", "rmaEagerInit",
            "hostCftMode", "nvlsHostMode")]


class WaitSignalDesc(ctypes.Structure):
    """ncclWaitSignalDesc_t (2.29): wait for `opCnt` signals `sigIdx` from `peer`."""

    _fields_ = [("opCnt", ctypes.c_int), ("peer", ctypes.c_int), ("sigIdx", ctypes.c_int),
                ("ctx", ctypes.c_int)]


def make_config(blocking: bool) -> Config:
    """NCCL_CONFIG_INITIALIZER with `blocking` set."""
    cfg = Config()
    for name, ctype in Config._fields_[3:]:
        if ctype is ctypes.c_int:
            setattr(cfg, name, _INT_MIN)
    cfg.size, cfg.magic = ctypes.sizeof(Config), 0xCAFEBEEF
    cfg.version = api.version_code(2, 32, 3)
    cfg.blocking = 1 if blocking else 0
    return cfg


def library_candidates() -> list[str]:
    """Where libnccl.so.2 is looked for, in order."""
    found = []
    env = os.environ.get("KILN_NCCL_LIBRARY")
    if env:
        found.append(env)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "nccl" / "lib" / "libnccl.so.2"
        if lib.exists():
            found.append(str(lib))
    found.append("libnccl.so.2")
    return found


def load_library() -> ctypes.CDLL:
    """The first libnccl that loads and has every symbol kiln calls at a version new
    enough (2.29: grow); `NcclUnavailable` (K251) naming what is missing otherwise."""
    tried = []
    for path in library_candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            tried.append("%s (%s)" % (path, exc))
            continue
        missing = [s for s in api.REQUIRED_SYMBOLS if not hasattr(lib, s)]
        version = ctypes.c_int(0)
        if "ncclGetVersion" not in missing:
            lib.ncclGetVersion(ctypes.byref(version))
        if missing or version.value < api.MIN_VERSION:
            raise NcclUnavailable(
                "%s is NCCL %s, which lacks %s (kiln needs NCCL >= %s)" % (
                    path, api.version_text(version.value),
                    ", ".join(missing) or "ncclCommGrow's semantics",
                    api.version_text(api.MIN_VERSION)))
        return lib
    raise NcclUnavailable("no libnccl.so.2 could be loaded; tried: " + "; ".join(tried))


def require_gpu() -> int:
    """The number of CUDA GPUs; `NcclUnavailable` (K251) naming the hardware if none
    (creating an NCCL communicator needs one: the library alone is not enough)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        raise NcclUnavailable("an NCCL communicator needs an NVIDIA GPU and the CUDA driver; "
                              "cuda-bindings is not installed to find one") from None
    count = 0
    try:
        (status,) = driver.cuInit(0)
        if status == driver.CUresult.CUDA_SUCCESS:
            status, count = driver.cuDeviceGetCount()
    except Exception as exc:  # noqa: BLE001 - no driver library: cuda-bindings raises
        raise NcclUnavailable("an NCCL communicator needs an NVIDIA CUDA GPU; this machine "
                              "has no CUDA driver (%s)" % exc) from None
    if status != driver.CUresult.CUDA_SUCCESS or count == 0:
        raise NcclUnavailable("an NCCL communicator needs an NVIDIA CUDA GPU; this machine "
                              "has none (cuInit/cuDeviceGetCount: %s, %d devices)"
                              % (getattr(status, "name", status), int(count)))
    return int(count)


class LibNccl(api.NcclApi):
    """The real NCCL (see the module docstring)."""

    name = "libnccl"

    def __init__(self, lib: ctypes.CDLL | None = None):
        self.lib = lib if lib is not None else load_library()
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        self._cudart = None

    # -- management ------------------------------------------------------------------------
    def get_version(self) -> int:
        version = ctypes.c_int(0)
        self.lib.ncclGetVersion(ctypes.byref(version))
        return version.value

    def get_unique_id(self) -> tuple[int, bytes]:
        uid = UniqueId()
        res = self.lib.ncclGetUniqueId(ctypes.byref(uid))
        return res, ctypes.string_at(ctypes.addressof(uid), api.UNIQUE_ID_BYTES)

    def get_error_string(self, result: int) -> str:
        return self.lib.ncclGetErrorString(ctypes.c_int(result)).decode()

    @staticmethod
    def _uid(unique_id: bytes) -> UniqueId:
        if len(unique_id) != api.UNIQUE_ID_BYTES:
            raise ValueError("an NCCL unique id has %d bytes, not %d"
                             % (api.UNIQUE_ID_BYTES, len(unique_id)))
        uid = UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, api.UNIQUE_ID_BYTES)
        return uid

    def comm_init_rank_config(self, nranks, unique_id, rank, blocking):
        require_gpu()
        comm, cfg = ctypes.c_void_p(), make_config(blocking)
        res = self.lib.ncclCommInitRankConfig(ctypes.byref(comm), ctypes.c_int(nranks),
                                              self._uid(unique_id), ctypes.c_int(rank),
                                              ctypes.byref(cfg))
        return res, comm.value or 0

    def comm_get_async_error(self, comm):
        state = ctypes.c_int(0)
        res = self.lib.ncclCommGetAsyncError(ctypes.c_void_p(comm), ctypes.byref(state))
        return res, state.value

    def comm_split(self, comm, color, key, blocking):
        new, cfg = ctypes.c_void_p(), make_config(blocking)
        res = self.lib.ncclCommSplit(ctypes.c_void_p(comm), ctypes.c_int(color),
                                     ctypes.c_int(key), ctypes.byref(new), ctypes.byref(cfg))
        return res, new.value or 0

    def comm_shrink(self, comm, exclude, flags, blocking):
        new, cfg = ctypes.c_void_p(), make_config(blocking)
        ranks = (ctypes.c_int * max(len(exclude), 1))(*exclude)
        res = self.lib.ncclCommShrink(ctypes.c_void_p(comm), ranks, ctypes.c_int(len(exclude)),
                                      ctypes.byref(new), ctypes.byref(cfg), ctypes.c_int(flags))
        return res, new.value or 0

    def comm_get_unique_id(self, comm):
        uid = UniqueId()
        res = self.lib.ncclCommGetUniqueId(ctypes.c_void_p(comm), ctypes.byref(uid))
        return res, ctypes.string_at(ctypes.addressof(uid), api.UNIQUE_ID_BYTES)

    def comm_grow(self, comm, nranks, unique_id, rank, blocking):
        if not comm:  # a joiner creates its first communicator here
            require_gpu()
        new, cfg = ctypes.c_void_p(), make_config(blocking)
        uid = ctypes.byref(self._uid(unique_id)) if unique_id is not None else None
        res = self.lib.ncclCommGrow(ctypes.c_void_p(comm or None), ctypes.c_int(nranks), uid,
                                    ctypes.c_int(rank), ctypes.byref(new), ctypes.byref(cfg))
        return res, new.value or 0

    def comm_revoke(self, comm):
        return self.lib.ncclCommRevoke(ctypes.c_void_p(comm), ctypes.c_int(0))

    def comm_abort(self, comm):
        return self.lib.ncclCommAbort(ctypes.c_void_p(comm))

    def comm_finalize(self, comm):
        return self.lib.ncclCommFinalize(ctypes.c_void_p(comm))

    def comm_destroy(self, comm):
        return self.lib.ncclCommDestroy(ctypes.c_void_p(comm))

    # -- collectives (device addresses, enqueued on `stream`) --------------------------------
    def all_reduce(self, send, recv, count, dtype, op, comm, stream):
        return self.lib.ncclAllReduce(ctypes.c_void_p(send), ctypes.c_void_p(recv),
                                      ctypes.c_size_t(count), ctypes.c_int(dtype),
                                      ctypes.c_int(op), ctypes.c_void_p(comm),
                                      ctypes.c_void_p(stream))

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        return self.lib.ncclBroadcast(ctypes.c_void_p(send), ctypes.c_void_p(recv),
                                      ctypes.c_size_t(count), ctypes.c_int(dtype),
                                      ctypes.c_int(root), ctypes.c_void_p(comm),
                                      ctypes.c_void_p(stream))

    def reduce(self, send, recv, count, dtype, op, root, comm, stream):
        return self.lib.ncclReduce(ctypes.c_void_p(send), ctypes.c_void_p(recv),
                                   ctypes.c_size_t(count), ctypes.c_int(dtype),
                                   ctypes.c_int(op), ctypes.c_int(root),
                                   ctypes.c_void_p(comm), ctypes.c_void_p(stream))

    def all_gather(self, send, recv, send_count, dtype, comm, stream):
        return self.lib.ncclAllGather(ctypes.c_void_p(send), ctypes.c_void_p(recv),
                                      ctypes.c_size_t(send_count), ctypes.c_int(dtype),
                                      ctypes.c_void_p(comm), ctypes.c_void_p(stream))

    def reduce_scatter(self, send, recv, recv_count, dtype, op, comm, stream):
        return self.lib.ncclReduceScatter(ctypes.c_void_p(send), ctypes.c_void_p(recv),
                                          ctypes.c_size_t(recv_count), ctypes.c_int(dtype),
                                          ctypes.c_int(op), ctypes.c_void_p(comm),
                                          ctypes.c_void_p(stream))

    def send(self, buf, count, dtype, peer, comm, stream):
        return self.lib.ncclSend(ctypes.c_void_p(buf), ctypes.c_size_t(count),
                                 ctypes.c_int(dtype), ctypes.c_int(peer),
                                 ctypes.c_void_p(comm), ctypes.c_void_p(stream))

    def recv(self, buf, count, dtype, peer, comm, stream):
        return self.lib.ncclRecv(ctypes.c_void_p(buf), ctypes.c_size_t(count),
                                 ctypes.c_int(dtype), ctypes.c_int(peer),
                                 ctypes.c_void_p(comm), ctypes.c_void_p(stream))

    # -- one-sided ---------------------------------------------------------------------------
    def comm_window_register(self, comm, buf, nbytes, flags):
        win = ctypes.c_void_p()
        res = self.lib.ncclCommWindowRegister(ctypes.c_void_p(comm), ctypes.c_void_p(buf),
                                              ctypes.c_size_t(nbytes), ctypes.byref(win),
                                              ctypes.c_int(flags))
        return res, win.value or 0

    def comm_window_deregister(self, comm, win):
        return self.lib.ncclCommWindowDeregister(ctypes.c_void_p(comm), ctypes.c_void_p(win))

    def put_signal(self, send, count, dtype, peer, win, offset, sig, ctx, comm, stream):
        return self.lib.ncclPutSignal(ctypes.c_void_p(send), ctypes.c_size_t(count),
                                      ctypes.c_int(dtype), ctypes.c_int(peer),
                                      ctypes.c_void_p(win), ctypes.c_size_t(offset),
                                      ctypes.c_int(sig), ctypes.c_int(ctx), ctypes.c_uint(0),
                                      ctypes.c_void_p(comm), ctypes.c_void_p(stream))

    def signal(self, peer, sig, ctx, comm, stream):
        return self.lib.ncclSignal(ctypes.c_int(peer), ctypes.c_int(sig), ctypes.c_int(ctx),
                                   ctypes.c_uint(0), ctypes.c_void_p(comm),
                                   ctypes.c_void_p(stream))

    def wait_signal(self, descs, comm, stream):
        arr = (WaitSignalDesc * max(len(descs), 1))(*[WaitSignalDesc(*d) for d in descs])
        return self.lib.ncclWaitSignal(ctypes.c_int(len(descs)), arr, ctypes.c_void_p(comm),
                                       ctypes.c_void_p(stream))

    def mem_alloc(self, nbytes):
        ptr = ctypes.c_void_p()
        res = self.lib.ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return (ptr.value or 0) if res == api.SUCCESS else 0

    def mem_free(self, addr):
        self.lib.ncclMemFree(ctypes.c_void_p(addr))

    def copy_to_host(self, addr, nbytes):
        rt = self._rt()
        out = ctypes.create_string_buffer(nbytes)
        (err,) = rt.cudaMemcpy(ctypes.addressof(out), addr, nbytes,
                               rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        if int(err) != 0:
            raise NcclUnavailable("cudaMemcpy (device to host) failed: %s" % err)
        return out.raw

    def group_start(self):
        return self.lib.ncclGroupStart()

    def group_end(self):
        return self.lib.ncclGroupEnd()

    # -- CUDA events (cuda-bindings' runtime) ------------------------------------------------
    def _rt(self):
        if self._cudart is None:
            from cuda.bindings import runtime  # optional: only where a GPU runs NCCL
            self._cudart = runtime
        return self._cudart

    def event_record(self, stream):
        rt = self._rt()
        err, event = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
        if int(err) != 0:
            raise NcclUnavailable("cudaEventCreate failed: %s" % err)
        (err,) = rt.cudaEventRecord(event, stream)
        if int(err) != 0:
            raise NcclUnavailable("cudaEventRecord failed: %s" % err)
        return int(event)

    def event_query(self, event):
        rt = self._rt()
        (err,) = rt.cudaEventQuery(rt.cudaEvent_t(event))
        return int(err) == 0

    def event_destroy(self, event):
        rt = self._rt()
        rt.cudaEventDestroy(rt.cudaEvent_t(event))
