"""The NCCL layer kiln talks to, as an interface with two implementations.

`NcclApi` is a thin, one-to-one mirror of the libnccl calls kiln uses (init with a
config, split, shrink, grow, revoke, abort, the collectives, p2p, group start/end,
async errors) plus the three CUDA event calls needed to see a call complete on its
stream. It speaks raw NCCL: every method returns the `ncclResult_t` code (and the
call's outputs), buffers are device addresses (ints), communicators are opaque ints.
Checking results, polling nonblocking communicators and deadlines live one layer up,
in `kiln.distributed.nccl_comm`.

Implementations:

- `kiln.distributed.nccl_lib.LibNccl`: ctypes over the real `libnccl.so.2` (the
  `nvidia-nccl-cu12`/`-cu13` wheels) and the CUDA runtime's events (cuda-bindings).
- `tests/distributed/fake_nccl.py`: an in-process simulation of N ranks over host
  memory with failure injection, so the fault-tolerance logic runs without a GPU
  (torchcomms tests its backends the same way).
"""

from __future__ import annotations

import abc

import numpy as np

# ncclResult_t
SUCCESS = 0
UNHANDLED_CUDA_ERROR = 1
SYSTEM_ERROR = 2
INTERNAL_ERROR = 3
INVALID_ARGUMENT = 4
INVALID_USAGE = 5
REMOTE_ERROR = 6
IN_PROGRESS = 7

RESULT_NAMES = {
    SUCCESS: "ncclSuccess", UNHANDLED_CUDA_ERROR: "ncclUnhandledCudaError",
    SYSTEM_ERROR: "ncclSystemError", INTERNAL_ERROR: "ncclInternalError",
    INVALID_ARGUMENT: "ncclInvalidArgument", INVALID_USAGE: "ncclInvalidUsage",
    REMOTE_ERROR: "ncclRemoteError", IN_PROGRESS: "ncclInProgress",
}

# ncclRedOp_t
REDUCE_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

# ncclDataType_t, keyed by numpy dtype name (bfloat16 arrives as ml_dtypes' name)
DTYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}

SPLIT_NOCOLOR = -1  # NCCL_SPLIT_NOCOLOR: this rank takes no part in the new comm
SHRINK_DEFAULT = 0  # NCCL_SHRINK_DEFAULT: every survivor's pending work completes first
SHRINK_ABORT = 1  # NCCL_SHRINK_ABORT: pending work on the old comm is aborted
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES

# the libnccl symbols kiln calls; a library without one of them cannot serve kiln
REQUIRED_SYMBOLS = (
    "ncclGetVersion", "ncclGetUniqueId", "ncclGetErrorString", "ncclCommInitRankConfig",
    "ncclCommGetAsyncError", "ncclCommSplit", "ncclCommShrink", "ncclCommGrow",
    "ncclCommGetUniqueId", "ncclCommRevoke", "ncclCommAbort", "ncclCommDestroy",
    "ncclCommFinalize", "ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
    "ncclReduceScatter", "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd",
    "ncclCommWindowRegister", "ncclCommWindowDeregister", "ncclPutSignal", "ncclSignal",
    "ncclWaitSignal", "ncclMemAlloc", "ncclMemFree",
)
WIN_COLL_SYMMETRIC = 0x01  # NCCL_WIN_COLL_SYMMETRIC: every rank registers, collectively
MIN_VERSION = 22900  # ncclCommGrow and ncclCommGetUniqueId arrived in 2.29.0


def version_code(major: int, minor: int, patch: int) -> int:
    """NCCL_VERSION(major, minor, patch) for 2.9 and later: 2.32.3 -> 23203."""
    return major * 10000 + minor * 100 + patch


def version_text(code: int) -> str:
    """23203 -> '2.32.3'."""
    return "%d.%d.%d" % (code // 10000, code // 100 % 100, code % 100)


def result_name(code: int) -> str:
    """The ncclResult_t enumerator's name for `code`."""
    return RESULT_NAMES.get(code, "ncclResult(%d)" % code)


def nccl_dtype(dtype) -> int:
    """The ncclDataType_t of a numpy dtype, or -1 when NCCL has none (bool, complex)."""
    return DTYPES.get(np.dtype(dtype).name, -1)


class NcclApi(abc.ABC):
    """One process's view of libnccl (see the module docstring).

    Results are `ncclResult_t` ints; `comm` values are opaque nonzero ints (0 is the
    NULL communicator, e.g. after a split with SPLIT_NOCOLOR); `stream` and `event` are
    opaque ints too (0 is the default stream).
    """

    name: str = "abstract"

    @abc.abstractmethod
    def get_version(self) -> int:
        """ncclGetVersion: e.g. 23203."""

    @abc.abstractmethod
    def get_unique_id(self) -> tuple[int, bytes]:
        """ncclGetUniqueId: (result, the 128-byte id rank 0 hands to its peers)."""

    @abc.abstractmethod
    def get_error_string(self, result: int) -> str:
        """ncclGetErrorString."""

    @abc.abstractmethod
    def comm_init_rank_config(self, nranks: int, unique_id: bytes, rank: int,
                              blocking: bool) -> tuple[int, int]:
        """ncclCommInitRankConfig with config.blocking: (result, comm). A nonblocking
        init may return IN_PROGRESS with a valid comm: poll comm_get_async_error."""

    @abc.abstractmethod
    def comm_get_async_error(self, comm: int) -> tuple[int, int]:
        """ncclCommGetAsyncError: (result of the call, the comm's async state)."""

    @abc.abstractmethod
    def comm_split(self, comm: int, color: int, key: int, blocking: bool) -> tuple[int, int]:
        """ncclCommSplit: (result, new comm or 0 for SPLIT_NOCOLOR)."""

    @abc.abstractmethod
    def comm_shrink(self, comm: int, exclude: list[int], flags: int,
                    blocking: bool) -> tuple[int, int]:
        """ncclCommShrink: (result, new comm of the ranks not in `exclude`)."""

    @abc.abstractmethod
    def comm_get_unique_id(self, comm: int) -> tuple[int, bytes]:
        """ncclCommGetUniqueId: the id joiners pass to comm_grow (one rank asks)."""

    @abc.abstractmethod
    def comm_grow(self, comm: int, nranks: int, unique_id: bytes | None, rank: int,
                  blocking: bool) -> tuple[int, int]:
        """ncclCommGrow: members pass their comm, no id and rank -1; joiners pass comm 0,
        the id and their new rank. (result, new comm of `nranks` ranks)."""

    @abc.abstractmethod
    def comm_revoke(self, comm: int) -> int:
        """ncclCommRevoke: outstanding and later operations on `comm` stop with an error."""

    @abc.abstractmethod
    def comm_abort(self, comm: int) -> int:
        """ncclCommAbort: free `comm` now, whatever is pending (safe on nonblocking)."""

    @abc.abstractmethod
    def comm_finalize(self, comm: int) -> int:
        """ncclCommFinalize: flush pending work (nonblocking: poll the async error)."""

    @abc.abstractmethod
    def comm_destroy(self, comm: int) -> int:
        """ncclCommDestroy (after a finalize)."""

    @abc.abstractmethod
    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int,
                   comm: int, stream: int) -> int: ...

    @abc.abstractmethod
    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int,
                  comm: int, stream: int) -> int: ...

    @abc.abstractmethod
    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int,
               comm: int, stream: int) -> int: ...

    @abc.abstractmethod
    def all_gather(self, send: int, recv: int, send_count: int, dtype: int, comm: int,
                   stream: int) -> int: ...

    @abc.abstractmethod
    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype: int, op: int,
                       comm: int, stream: int) -> int: ...

    @abc.abstractmethod
    def send(self, buf: int, count: int, dtype: int, peer: int, comm: int,
             stream: int) -> int: ...

    @abc.abstractmethod
    def recv(self, buf: int, count: int, dtype: int, peer: int, comm: int,
             stream: int) -> int: ...

    # -- one-sided (NCCL 2.27 windows, 2.29 put/signal); offsets are in bytes ------------
    @abc.abstractmethod
    def comm_window_register(self, comm: int, buf: int, nbytes: int,
                             flags: int) -> tuple[int, int]:
        """ncclCommWindowRegister (collective over the comm; a nonblocking comm may
        return IN_PROGRESS: poll comm_get_async_error): (result, window handle)."""

    @abc.abstractmethod
    def comm_window_deregister(self, comm: int, win: int) -> int: ...

    @abc.abstractmethod
    def put_signal(self, send: int, count: int, dtype: int, peer: int, win: int,
                   offset: int, sig: int, ctx: int, comm: int, stream: int) -> int:
        """ncclPutSignal: write `count` elements at byte `offset` of `peer`'s part of
        window `win`, then add 1 to `peer`'s signal `sig` from this rank."""

    @abc.abstractmethod
    def signal(self, peer: int, sig: int, ctx: int, comm: int, stream: int) -> int:
        """ncclSignal: add 1 to `peer`'s signal `sig` from this rank (after this rank's
        earlier puts to `peer` on context `ctx`)."""

    @abc.abstractmethod
    def wait_signal(self, descs: list[tuple[int, int, int, int]], comm: int,
                    stream: int) -> int:
        """ncclWaitSignal: the stream waits until, for each (op_count, peer, sig, ctx),
        `op_count` more signals arrived from `peer`, and consumes them."""

    @abc.abstractmethod
    def mem_alloc(self, nbytes: int) -> int:
        """ncclMemAlloc: device memory NCCL can register in a window (0 on failure)."""

    @abc.abstractmethod
    def mem_free(self, addr: int) -> None: ...

    @abc.abstractmethod
    def copy_to_host(self, addr: int, nbytes: int) -> bytes:
        """The bytes at `addr` (device memory from mem_alloc) as the host sees them now."""

    @abc.abstractmethod
    def group_start(self) -> int: ...

    @abc.abstractmethod
    def group_end(self) -> int: ...

    @abc.abstractmethod
    def event_record(self, stream: int) -> int:
        """Create an event and record it on `stream`: done when everything enqueued on
        the stream before it is."""

    @abc.abstractmethod
    def event_query(self, event: int) -> bool:
        """True when the event's work is done (cudaEventQuery == cudaSuccess)."""

    @abc.abstractmethod
    def event_destroy(self, event: int) -> None: ...
