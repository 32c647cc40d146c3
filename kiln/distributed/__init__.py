"""kiln.distributed: process groups, collectives, the store, the Flight Recorder.

    import kiln.distributed as dist
    pg = dist.init_process_group()          # under `kiln launch --nproc N script.py`
    pg.all_reduce(x, op="sum").wait()       # in place, nonblocking until wait()
    sub = pg.split([0, 1])

See docs/distributed.md for the guide and docs/errors-distributed.md for the errors.
"""

from kiln.distributed.backend import Backend, CallContext
from kiln.distributed.buffers import REDUCE_OPS
from kiln.distributed.errors import (
    CheckpointCorrupt, CheckpointError, CheckpointManifestError, MeshError, PlacementError,
    ShardingRuleError,
    CollectiveArgumentError, CollectiveMismatch, CollectiveTimeout, DistributedError,
    FaultInjectionError, FlightRecorderError, GroupAborted, InvalidTimeout, LaunchError,
    MalformedFrame, MpiError, MpiLaunchError, MpiUnavailable, NcclError, NcclUnavailable,
    NcclWindowUnsupported, PeerFailure, SymmetricMemoryError, CudaSymmetricMemoryError,
    RendezvousError, StoreAuthError, StoreBadRequest,
    StoreError, StoreLost, StoreTimeout, WindowInvalidated,
)
from kiln.distributed import checkpoint
from kiln.distributed.dtensor import DTensor, distribute_tensor
from kiln.distributed.flight_recorder import FlightRecorder, recorder
from kiln.distributed.mesh import DeviceMesh, init_device_mesh
from kiln.distributed.placements import Partial, Placement, Replicate, Shard
from kiln.distributed.process_group import ProcessGroup
from kiln.distributed.rendezvous import (
    destroy_process_group, get_world, init_process_group, is_initialized,
)
from kiln.distributed.store import Store, StoreServer
from kiln.distributed.symmetric_memory import SymmetricMemory, symmetric_memory
from kiln.distributed.tcp_backend import TcpBackend
from kiln.distributed.window import Window
from kiln.distributed.work import Work

__all__ = [
    "Backend", "CallContext", "CollectiveArgumentError", "CollectiveMismatch",
    "CollectiveTimeout", "DistributedError", "FaultInjectionError", "FlightRecorder", "FlightRecorderError",
    "GroupAborted", "InvalidTimeout", "LaunchError", "MalformedFrame", "StoreBadRequest",
    "PeerFailure", "ProcessGroup", "REDUCE_OPS",
    "RendezvousError", "Store", "StoreAuthError", "StoreError", "StoreLost", "StoreServer", "StoreTimeout",
    "TcpBackend", "Window", "WindowInvalidated", "Work", "destroy_process_group", "get_world",
    "init_process_group", "is_initialized", "recorder",
    "DTensor", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "distribute_tensor",
    "checkpoint", "init_device_mesh", "CheckpointCorrupt", "CheckpointError",
    "CheckpointManifestError", "MeshError", "PlacementError", "ShardingRuleError",
    "SymmetricMemory", "symmetric_memory", "SymmetricMemoryError", "MpiError", "MpiLaunchError",
    "MpiUnavailable", "NcclError", "NcclUnavailable", "NcclWindowUnsupported",
    "CudaSymmetricMemoryError",
]
