"""Moving a sharded tensor's local block from one list of placements to another.

The algorithm works mesh dim by mesh dim, as PyTorch's redistribute does, and only
with the collectives of the mesh dims' process groups:

1. Partial dims that change are reduced: `reduce_scatter` straight into a Shard when
   no other mesh dim cuts that tensor dim, else `all_reduce` to Replicate.
2. Shard dims that change (or that sit inside a changing Shard of the same tensor dim)
   are gathered, innermost mesh dim first: `all_gather`, or one `all_to_all` for
   Shard(a) -> Shard(b) when both dims divide evenly and nothing else touches them.
3. New Shard dims are cut locally, outermost first (no communication).
4. New Partial dims keep the value on coordinate 0 and the reduction's identity
   elsewhere (sum: zeros, prod: ones; avg/max/min: the value everywhere).

Uneven shards (torch.chunk sizes) are padded to the chunk size for the fixed-size
collectives and trimmed after. `cost` estimates the bytes one rank sends for a move;
sharding strategies are ranked with it.
"""

from __future__ import annotations

import numpy as np

from kiln.distributed.placements import Replicate, chunk_bounds, chunk_size, local_bounds

# bytes moved per rank, as a fraction of the (block) size, for a group of n ranks
_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / (n * n),
}


def move_kind(src, dst) -> str | None:
    """The collective one mesh dim's move from `src` to `dst` needs (None: local)."""
    if src == dst or dst.is_replicate() and src.is_replicate():
        return None
    if src.is_replicate():
        return None  # cut locally, or partition locally
    if src.is_shard():
        if dst.is_shard():
            return "all_to_all"
        return "all_gather"
    if dst.is_shard():
        return "reduce_scatter"
    return "all_reduce"


def cost(nbytes: int, src: tuple, dst: tuple, mesh_shape: tuple) -> float:
    """Estimated bytes one rank sends to move a tensor of `nbytes` (global) from the
    placements `src` to `dst`."""
    total = 0.0
    for i, (a, b) in enumerate(zip(src, dst)):
        kind = move_kind(a, b)
        if kind is None:
            continue
        n = mesh_shape[i]
        cut = np.prod([mesh_shape[j] for j, p in enumerate(src) if j != i and p.is_shard()])
        total += nbytes / cut * _FACTOR[kind](n)
    return float(total)


class Redistributor:
    """Runs the moves of one tensor on this rank; `mesh` gives groups and coordinates."""

    def __init__(self, mesh, shape: tuple, local: np.ndarray):
        self.mesh, self.shape, self.local = mesh, tuple(int(s) for s in shape), local
        self.coord = mesh.get_coordinate()

    def _extent(self, placements, dim: int) -> int:
        lo, hi = local_bounds(self.shape, placements, self.mesh.shape, self.coord)[dim]
        return hi - lo

    def run(self, src: tuple, dst: tuple) -> np.ndarray:
        cur = list(src)
        nd = len(cur)
        touches = lambda d, skip: any(  # noqa: E731  (does any other mesh dim cut dim d?)
            j != skip and (cur[j].is_shard(d) or dst[j].is_shard(d)) for j in range(nd))
        # 1. reduce the Partial dims that change
        for i in range(nd):
            if cur[i].is_partial() and cur[i] != dst[i]:
                op = cur[i].reduce_op
                if dst[i].is_shard() and not touches(dst[i].dim, i):
                    self._reduce_scatter(i, dst[i].dim, op, cur)
                    cur[i] = dst[i]
                else:
                    self._all_reduce(i, op)
                    cur[i] = Replicate()
        # 2. gather the Shard dims that cannot stay, innermost first
        keep = self._kept(cur, dst)
        for i in reversed(range(nd)):
            if cur[i].is_shard() and not keep[i]:
                a = cur[i].dim
                if (dst[i].is_shard() and not touches(a, i) and not touches(dst[i].dim, i)
                        and self._even_all_to_all(i, a, dst[i].dim, cur)):
                    cur[i] = dst[i]
                    continue
                self._all_gather(i, a, cur)
                cur[i] = Replicate()
        # 3. cut new Shard dims, outermost first; 4. partition new Partial dims
        for i in range(nd):
            if dst[i].is_shard() and cur[i].is_replicate():
                d = dst[i].dim
                lo, hi = chunk_bounds(self.local.shape[d], self.mesh.shape[i], self.coord[i])
                index = [slice(None)] * self.local.ndim
                index[d] = slice(lo, hi)
                self.local = _c(self.local[tuple(index)])
                cur[i] = dst[i]
            elif dst[i].is_partial() and cur[i].is_replicate():
                op = dst[i].reduce_op
                if op in ("sum", "prod") and self.coord[i] != 0:
                    fill = 0 if op == "sum" else 1
                    self.local = np.full_like(self.local, fill)
                cur[i] = dst[i]
        return self.local

    @staticmethod
    def _kept(cur: list, dst: tuple) -> list[bool]:
        """Shard dims that may stay: unchanged, and no outer mesh dim changes how the
        same tensor dim is cut (nested chunks would move)."""
        keep = []
        for i, p in enumerate(cur):
            ok = p.is_shard() and dst[i] == p
            if ok:
                d = p.dim
                ok = all(cur[j] == dst[j] or not (cur[j].is_shard(d) or dst[j].is_shard(d))
                         for j in range(i))
            keep.append(ok)
        return keep

    # -- the collectives, over mesh dim i's group ---------------------------------------
    def _group(self, i: int):
        return self.mesh.get_group(i)

    def _all_reduce(self, i: int, op: str) -> None:
        group = self._group(i)
        if group is None or group.world_size == 1:
            return
        buf = np.array(self.local, copy=True, order="C")
        group.all_reduce(buf, op=op).wait()
        self.local = buf

    def _all_gather(self, i: int, d: int, cur: list) -> None:
        """Rebuild the block mesh dim i cut along tensor dim d."""
        group, n = self._group(i), self.mesh.shape[i]
        before = list(cur)
        before[i] = Replicate()
        parent = self._extent(before, d)
        step = chunk_size(parent, n)
        if group is None or n == 1:
            return
        padded = _pad_to(self.local, d, step)
        out = np.empty((n,) + padded.shape, padded.dtype)
        group.all_gather(out, padded).wait()
        parts = []
        for c in range(n):
            lo, hi = chunk_bounds(parent, n, c)
            parts.append(np.take(out[c], np.arange(hi - lo), axis=d))
        self.local = _c(np.concatenate(parts, axis=d))

    def _reduce_scatter(self, i: int, d: int, op: str, cur: list) -> None:
        group, n = self._group(i), self.mesh.shape[i]
        size = self.local.shape[d]
        lo, hi = chunk_bounds(size, n, self.coord[i])
        if group is None or n == 1:
            return
        step = chunk_size(size, n)
        padded = _pad_to(self.local, d, step * n)
        slots = _c(np.stack(np.split(padded, n, axis=d)))
        out = np.empty(slots.shape[1:], slots.dtype)
        group.reduce_scatter(out, slots, op=op).wait()
        self.local = _c(np.take(out, np.arange(hi - lo), axis=d))

    def _even_all_to_all(self, i: int, a: int, b: int, cur: list) -> bool:
        """Shard(a) -> Shard(b) over mesh dim i in one all_to_all, when both divide."""
        group, n = self._group(i), self.mesh.shape[i]
        before = list(cur)
        before[i] = Replicate()
        if group is None or self._extent(before, a) % n or self.local.shape[b] % n:
            return False
        slots = _c(np.stack(np.split(self.local, n, axis=b)))
        out = np.empty_like(slots)
        group.all_to_all(out, slots).wait()
        self.local = _c(np.concatenate(list(out), axis=a))
        return True


def _c(x) -> np.ndarray:
    """x as a C-contiguous array, 0-d kept 0-d (np.ascontiguousarray makes it 1-d)."""
    return np.require(x, requirements="C")


def _pad_to(x: np.ndarray, axis: int, length: int) -> np.ndarray:
    """x zero-padded at the end of `axis` to `length`, C-contiguous."""
    extra = length - x.shape[axis]
    if extra <= 0:
        return _c(x)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return _c(np.pad(x, widths))


def partition(full: np.ndarray, placements: tuple, mesh) -> np.ndarray:
    """This rank's local value of `full` (the same on every rank) under `placements`."""
    return Redistributor(mesh, full.shape, full).run(
        tuple(Replicate() for _ in placements), tuple(placements))


__all__ = ["Redistributor", "cost", "move_kind", "partition"]
