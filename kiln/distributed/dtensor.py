"""DTensor: a global tensor whose data is spread over the ranks of a DeviceMesh.

    mesh = DeviceMesh((4,), ("tp",))
    w = distribute_tensor(weight, mesh, [Shard(1)])   # each rank keeps 1/4 of the columns
    w.to_local()                                      # this rank's block (a kn.Tensor)
    y = x @ w                                         # ops run shard-wise (sharding rules)
    y.redistribute(mesh, [Replicate()]).full_tensor()

The meaning is PyTorch's DTensor: `shape` is the global shape, `placements` one per mesh
dim, `to_local()` the block this rank holds (torch.chunk sizes for uneven shards),
`full_tensor()` the global value on every rank (a collective). Ops on DTensors pick a
strategy from the op's sharding rule (`kiln.distributed.sharding`), redistribute the
operands as it says and run the op on the local blocks.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kiln.distributed.errors import PlacementError
from kiln.distributed.mesh import DeviceMesh
from kiln.distributed.placements import (
    Partial, Placement, Replicate, Shard, local_bounds, local_shape, normalize,
)
from kiln.distributed.redistribute import Redistributor, _c, partition
from kiln.ir import dtypes as kd


def _array(x) -> np.ndarray:
    if isinstance(x, DTensor):
        raise PlacementError("expected a local tensor, got a DTensor; use .to_local() or "
                             ".full_tensor()")
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        return np.asarray(x.numpy())
    return np.asarray(x)


def _tensor(a: np.ndarray):
    from kiln.frontend.factories import tensor  # lazy: distributed sits below the frontend

    return tensor(_c(a))


class DTensor:
    """A tensor of global `shape` laid over `device_mesh` by `placements`; this rank
    holds `to_local()`. Build one with `distribute_tensor` or `DTensor.from_local`."""

    __slots__ = ("_local", "device_mesh", "placements", "shape", "dtype")

    def __init__(self, local: np.ndarray, mesh: DeviceMesh, placements: Sequence[Placement],
                 shape: Sequence[int]):
        self._local = _c(local)
        self.device_mesh = mesh
        self.shape = tuple(int(s) for s in shape)
        self.placements = normalize(placements, len(self.shape), mesh.ndim, "DTensor")
        self.dtype = kd.from_numpy(self._local.dtype)
        want = local_shape(self.shape, self.placements, mesh.shape, mesh.get_coordinate())
        if tuple(self._local.shape) != want:
            raise PlacementError(
                "DTensor of global shape %s with placements %s: this rank (mesh coordinate "
                "%s) must hold a block of shape %s, got %s" % (
                    list(self.shape), list(self.placements), mesh.get_coordinate(),
                    list(want), list(self._local.shape)),
                hint="give from_local the global shape= when shards are uneven")

    # -- construction ---------------------------------------------------------------------
    @staticmethod
    def from_local(local, mesh: DeviceMesh, placements: Sequence[Placement],
                   shape: Sequence[int] | None = None) -> "DTensor":
        """A DTensor from this rank's block. Without `shape`, the global shape assumes
        even shards (every rank's block has this rank's shape), as PyTorch does."""
        arr = _array(local)
        pl = normalize(placements, arr.ndim, mesh.ndim, "DTensor.from_local")
        if shape is None:
            shape = list(arr.shape)
            for i, p in enumerate(pl):
                if p.is_shard():
                    shape[p.dim] *= mesh.shape[i]
        return DTensor(arr, mesh, pl, shape)

    # -- PyTorch's DTensor API ------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def to_local(self):
        """This rank's block as a kn.Tensor (no communication)."""
        return _tensor(self._local)

    def local_array(self) -> np.ndarray:
        """This rank's block as a numpy array (shares memory; do not write). While an
        async checkpoint save holds the block (copy-on-write) the DTensor first takes a
        copy of its own, so a write through it never changes the checkpoint."""
        local = self._local
        if not local.flags.writeable:
            import sys

            staging = sys.modules.get("kiln.distributed.checkpoint.staging")
            own = staging.cow_copy(local) if staging is not None else None
            if own is not None:
                self._local = local = own
        return local

    def local_bounds(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) per dim of this rank's block in the global tensor."""
        return local_bounds(self.shape, self.placements, self.device_mesh.shape,
                            self.device_mesh.get_coordinate())

    def redistribute(self, device_mesh: DeviceMesh | None = None,
                     placements: Sequence[Placement] | None = None) -> "DTensor":
        """The same global tensor under `placements` (collectives over the mesh)."""
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        if mesh != self.device_mesh:
            raise PlacementError("redistribute: moving between meshes (%r -> %r) is not "
                                 "supported; redistribute on %r" % (self.device_mesh, mesh,
                                                                    self.device_mesh))
        if placements is None:
            placements = self.placements
        dst = normalize(placements, self.ndim, mesh.ndim, "redistribute")
        if dst == self.placements:
            return self
        local = Redistributor(mesh, self.shape, self._local).run(self.placements, dst)
        return DTensor(local, mesh, dst, self.shape)

    def full_tensor(self):
        """The global tensor on every rank (a kn.Tensor)."""
        rep = self.redistribute(self.device_mesh, [Replicate()] * self.device_mesh.ndim)
        return _tensor(rep._local)

    def numpy(self) -> np.ndarray:
        """`full_tensor()` as numpy (a collective)."""
        return self.full_tensor().numpy()

    def __repr__(self) -> str:
        return "DTensor(shape=%s, dtype=%s, placements=%s, mesh=%r)" % (
            list(self.shape), self.dtype, list(self.placements), self.device_mesh)

    # -- ops: each goes through the op's sharding rule --------------------------------------
    def _op(self, op: str, *others, **attrs) -> "DTensor":
        from kiln.distributed.sharding.dispatch import run_op

        return run_op(op, [self, *others], attrs)[0]

    def __add__(self, other):
        return self._op("add", _like(other, self))

    def __radd__(self, other):
        return _like(other, self)._op("add", self)

    def __sub__(self, other):
        return self._op("sub", _like(other, self))

    def __rsub__(self, other):
        return _like(other, self)._op("sub", self)

    def __mul__(self, other):
        return self._op("mul", _like(other, self))

    def __rmul__(self, other):
        return _like(other, self)._op("mul", self)

    def __truediv__(self, other):
        return self._op("div", _like(other, self))

    def __neg__(self):
        return self._op("neg")

    def __matmul__(self, other):
        return self._op("matmul", other)

    def relu(self):
        return self._op("relu")

    def gelu(self, approximate: str = "none"):
        return self._op("gelu", approximate=approximate)

    def sum(self, dim=None):
        axes = tuple(range(self.ndim)) if dim is None else (
            (dim,) if isinstance(dim, int) else tuple(dim))
        return self._op("reduce_sum", axes=tuple(a % self.ndim for a in axes))

    def softmax(self, dim: int = -1):
        return self._op("softmax", dim=dim)


def _like(value, ref: DTensor) -> DTensor:
    """A Python scalar or replicated array as a Replicate DTensor of ref's shape/dtype."""
    if isinstance(value, DTensor):
        return value
    arr = np.asarray(_array(value), dtype=ref.dtype.np_dtype)
    full = np.broadcast_to(arr, ref.shape)
    local = np.broadcast_to(arr, ref._local.shape) if arr.ndim == 0 else None
    if local is None:  # a full-size array: every rank holds it; cut this rank's block
        local = partition(_c(full), tuple(Replicate() for _ in ref.placements),
                          ref.device_mesh)
        return DTensor(local, ref.device_mesh, [Replicate()] * ref.device_mesh.ndim, ref.shape)
    return DTensor(_c(local), ref.device_mesh,
                   [p if p.is_shard() else Replicate() for p in ref.placements], ref.shape)


def distribute_tensor(tensor, device_mesh: DeviceMesh | None = None,
                      placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Spread `tensor` (a kn.Tensor or array of the global shape) over the mesh.

    As in PyTorch, the value of rank `src_data_rank` (of the mesh's group) is what gets
    distributed (a broadcast); `src_data_rank=None` uses each rank's own copy, which
    must then be equal. Default placements: Replicate on every mesh dim.

        >>> xs = distribute_tensor(x, mesh, [Shard(0)])
    """
    mesh = device_mesh if device_mesh is not None else DeviceMesh((1,), ("dim0",))
    full = np.array(_array(tensor), copy=True, order="C")  # the DTensor owns its blocks
    pl = normalize(placements if placements is not None else [Replicate()] * mesh.ndim,
                   full.ndim, mesh.ndim, "distribute_tensor")
    if src_data_rank is not None and mesh.group is not None and mesh.size() > 1:
        mesh.group.broadcast(full, src=src_data_rank).wait()
    return DTensor(partition(full, pl, mesh), mesh, pl, full.shape)


__all__ = ["DTensor", "Partial", "Replicate", "Shard", "distribute_tensor"]
