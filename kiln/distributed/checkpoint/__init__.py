"""Distributed checkpoints: every rank writes its own shards; load reshards.

    import kiln.distributed as dist
    dist.checkpoint.save({"w": w_dtensor, "step": kn.tensor(7)}, "ckpt/")
    fut = dist.checkpoint.async_save(state, "ckpt/")   # snapshot now, write in background
    fut.result()                                       # committed (or raises)
    dist.checkpoint.load(state, "ckpt/")               # into state's meshes and placements

Save: each rank writes the blocks it owns (a block replicated over a mesh dim is
written once, by coordinate 0; Partial values are reduced first; plain tensors by rank
0) into its own safetensors file with a checksum per block (XXH3-128, or SHA-256 without
xxhash: `checksum.py`), fsyncs it, and posts its
list of blocks to the store. Rank 0 then writes `manifest.json` (temp file, fsync, rename, fsync of the
folder) and only then deletes the previous save's files: a save that dies part-way
leaves the previous checkpoint whole and loadable. Load reads, on every rank, the
blocks of the files that overlap the block this rank needs under the target's
placements, so any world size and mesh can load any checkpoint.
"""

from kiln.distributed.checkpoint.io import async_save, load, save

__all__ = ["async_save", "load", "save"]
