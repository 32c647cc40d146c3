"""DeviceMesh: the ranks of a process group laid out as an n-d array with named dims.

    mesh = DeviceMesh((2, 2), ("dp", "tp"))     # over the world group: ranks 0..3
    mesh.get_coordinate()                       # this rank's (dp, tp) position
    mesh["tp"]                                  # the 1-d sub-mesh of this rank's tp row
    mesh.get_group("dp")                        # the ProcessGroup along dp

Rank r of the group sits at `numpy.unravel_index(r, shape)` (row-major, as
`torch.distributed.init_device_mesh`). Every rank builds the mesh together: the
constructor makes one sub-group per mesh dim with `ProcessGroup.split` (a collective),
so meshes and sub-meshes are created in the same order on every rank. Without an
initialized process group, a mesh of one rank works in a single process (every
collective over it is the identity).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kiln.distributed import rendezvous
from kiln.distributed.errors import MeshError
from kiln.distributed.process_group import ProcessGroup


class DeviceMesh:
    """An n-d array of the ranks of `group` (default: the world group) with dim names.

        >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
        >>> mesh.size(), mesh.ndim, mesh["tp"].shape
        (4, 2, (2,))
    """

    def __init__(self, shape: Sequence[int] | int, names: Sequence[str] | None = None,
                 group: ProcessGroup | None = None, *, _dim_groups: list | None = None):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                for s in shape):
            raise MeshError("DeviceMesh: shape must be a non-empty tuple of positive ints, "
                            "got %r" % (shape,))
        names = tuple(names) if names is not None else tuple("dim%d" % i for i in range(len(shape)))
        if len(names) != len(shape) or len(set(names)) != len(names) or not all(
                isinstance(n, str) and n for n in names):
            raise MeshError("DeviceMesh: names %r must be %d distinct non-empty strings, one "
                            "per dim of shape %r" % (names, len(shape), shape))
        if group is None and rendezvous.is_initialized():
            group = rendezvous.get_world()
        size = int(np.prod(shape))
        world = group.world_size if group is not None else 1
        if size != world:
            raise MeshError("DeviceMesh: shape %r holds %d ranks but the process group has %d"
                            % (shape, size, world),
                            hint="make the product of the mesh shape the group's world size"
                            + ("" if group is not None else
                               " (no process group is initialized: call "
                               "kiln.distributed.init_process_group() first)"))
        self.shape, self.mesh_dim_names, self.group = shape, names, group
        rank = group.rank if group is not None else 0
        self._coordinate = tuple(int(c) for c in np.unravel_index(rank, shape))
        self._submeshes: dict[tuple, DeviceMesh] = {}
        if _dim_groups is not None:
            self._dim_groups = list(_dim_groups)
        elif group is None or len(shape) == 1:
            self._dim_groups = [group] * len(shape)  # one rank, or the group is the dim
        else:
            self._dim_groups = [self._split(group, (i,)) for i in range(len(shape))]

    def _split(self, group: ProcessGroup, dims: tuple) -> ProcessGroup:
        """The sub-group of the ranks that share this rank's coordinates off `dims`
        (collective over `group`: every rank calls it)."""
        coord = self._coordinate
        others = [i for i in range(len(self.shape)) if i not in dims]
        color = int(np.ravel_multi_index([coord[i] for i in others],
                                         [self.shape[i] for i in others])) if others else 0
        key = int(np.ravel_multi_index([coord[i] for i in dims], [self.shape[i] for i in dims]))
        return group.split(color=color, key=key)

    # -- PyTorch's DeviceMesh API ---------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """The number of ranks in the mesh, or along one mesh dim."""
        if mesh_dim is None:
            return int(np.prod(self.shape))
        return self.shape[self.dim_index(mesh_dim)]

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's position in the mesh."""
        return self._coordinate

    def get_local_rank(self, mesh_dim: int | str = 0) -> int:
        return self._coordinate[self.dim_index(mesh_dim)]

    def get_rank(self) -> int:
        return self.group.rank if self.group is not None else 0

    def dim_index(self, mesh_dim: int | str) -> int:
        """A mesh dim given by name or index, as an index."""
        if isinstance(mesh_dim, str):
            if mesh_dim not in self.mesh_dim_names:
                raise MeshError("DeviceMesh%r: no mesh dim named %r; its dims are %s"
                                % (self.shape, mesh_dim, ", ".join(self.mesh_dim_names)))
            return self.mesh_dim_names.index(mesh_dim)
        if not isinstance(mesh_dim, int) or not -self.ndim <= mesh_dim < self.ndim:
            raise MeshError("DeviceMesh%r: mesh dim %r is out of range for %d dim(s)"
                            % (self.shape, mesh_dim, self.ndim))
        return mesh_dim % self.ndim

    def get_group(self, mesh_dim: int | str = 0) -> ProcessGroup | None:
        """The ProcessGroup of the ranks along `mesh_dim` that share this rank's other
        coordinates (None in a single process without a process group)."""
        return self._dim_groups[self.dim_index(mesh_dim)]

    def __getitem__(self, names) -> "DeviceMesh":
        """The sub-mesh over the named dims that holds this rank (its other coordinates
        fixed). One name reuses that dim's group; several split a new group, which is a
        collective: every rank asks for the same sub-mesh in the same order."""
        names = (names,) if isinstance(names, (str, int)) else tuple(names)
        dims = tuple(self.dim_index(n) for n in names)
        if len(set(dims)) != len(dims):
            raise MeshError("DeviceMesh%r: sub-mesh %r names a dim twice" % (self.shape, names))
        if dims == tuple(range(self.ndim)):
            return self
        if dims in self._submeshes:
            return self._submeshes[dims]
        shape = tuple(self.shape[i] for i in dims)
        dim_names = tuple(self.mesh_dim_names[i] for i in dims)
        if len(dims) == 1:
            sub = DeviceMesh(shape, dim_names, self._dim_groups[dims[0]],
                             _dim_groups=[self._dim_groups[dims[0]]])
        else:
            group = self._split(self.group, dims) if self.group is not None else None
            sub = DeviceMesh(shape, dim_names, group,
                             _dim_groups=[self._dim_groups[i] for i in dims])
        self._submeshes[dims] = sub
        return sub

    def __eq__(self, other) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (self.shape == other.shape and self.mesh_dim_names == other.mesh_dim_names
                and self.group is other.group)

    def __hash__(self) -> int:
        return hash((self.shape, self.mesh_dim_names, id(self.group)))

    def __repr__(self) -> str:
        return "DeviceMesh(%s)" % ", ".join("%s=%d" % (n, s) for n, s in
                                            zip(self.mesh_dim_names, self.shape))


def init_device_mesh(shape: Sequence[int], names: Sequence[str] | None = None) -> DeviceMesh:
    """`DeviceMesh(shape, names)` over the world group (PyTorch's spelling)."""
    return DeviceMesh(shape, names)
