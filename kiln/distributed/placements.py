"""Placements: how a tensor lies along one dim of a DeviceMesh (PyTorch DTensor's).

    Shard(dim)      the tensor is cut along `dim` into mesh-dim-size chunks, as
                    `torch.chunk` cuts it: chunk size ceil(n / k), the last ranks get
                    what is left (possibly nothing). Rank c holds chunk c.
    Replicate()     every rank holds the whole tensor.
    Partial(op)     every rank holds a value of the tensor's shape; the tensor is the
                    reduction of those values with `op` ("sum", "avg", "max", "min",
                    "prod") over the mesh dim: the state after a matmul of shards of the
                    contracted dim.

A tensor on an n-d mesh has one placement per mesh dim. Two mesh dims may shard the
same tensor dim: the later mesh dim then cuts the chunk of the earlier one (PyTorch's
nested sharding).

    >>> chunk_bounds(10, 4, 3)        # rank 3 of 4 holds rows 9..10 of 10
    (9, 10)
"""

from __future__ import annotations

from kiln.distributed.errors import PlacementError
# the placements are plain data of the IR's sharding rules (kiln/ir/sharding.py); the
# chunk arithmetic of sharded tensors lives here
from kiln.ir.sharding import PARTIAL_OPS, Partial, Placement, Replicate, Shard  # noqa: F401


def chunk_size(size: int, parts: int) -> int:
    """torch.chunk's chunk size: ceil(size / parts)."""
    return -(-size // parts) if parts else size


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk `index` of a dim of `size` cut into `parts` (torch.chunk:
    full chunks of ceil(size/parts), then the remainder, then empty chunks)."""
    step = chunk_size(size, parts)
    start = min(index * step, size)
    return start, min(start + step, size)


def is_even(size: int, parts: int) -> bool:
    return size % parts == 0


def normalize(placements, ndim: int, mesh_ndim: int, what: str = "tensor") -> tuple:
    """Placements checked against a tensor of rank `ndim` on a mesh of `mesh_ndim` dims;
    negative Shard dims made positive."""
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise PlacementError("%s: %d placement(s) %s for a mesh of %d dim(s); give one "
                             "placement per mesh dim" % (what, len(placements),
                                                         list(placements), mesh_ndim))
    out = []
    for p in placements:
        if not isinstance(p, Placement) or type(p) is Placement:
            raise PlacementError("%s: %r is not a placement; use Shard(dim), Replicate() or "
                                 "Partial(op)" % (what, p))
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise PlacementError("%s: Shard(%d) on a tensor of rank %d; the dim must be "
                                     "in [%d, %d)" % (what, p.dim, ndim, -ndim, ndim))
            p = Shard(p.dim % ndim)
        out.append(p)
    return tuple(out)


def local_bounds(shape: tuple, placements: tuple, mesh_shape: tuple,
                 coordinate: tuple) -> tuple[tuple[int, int], ...]:
    """[start, stop) per tensor dim of the block the rank at `coordinate` holds (nested
    sharding applied mesh dim by mesh dim, outermost first)."""
    bounds = [(0, int(s)) for s in shape]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            lo, hi = bounds[p.dim]
            a, b = chunk_bounds(hi - lo, mesh_shape[mesh_dim], coordinate[mesh_dim])
            bounds[p.dim] = (lo + a, lo + b)
    return tuple(bounds)


def local_shape(shape: tuple, placements: tuple, mesh_shape: tuple, coordinate: tuple) -> tuple:
    """The shape of the block the rank at `coordinate` holds."""
    return tuple(b - a for a, b in local_bounds(shape, placements, mesh_shape, coordinate))
