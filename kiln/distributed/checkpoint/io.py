"""save / async_save / load of distributed checkpoints (see the package docstring)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import struct
import threading

import numpy as np

from kiln.distributed import rendezvous
from kiln.distributed.checkpoint import checksum
from kiln.distributed.checkpoint import manifest as mf
from kiln.distributed.checkpoint import staging
from kiln.distributed.dtensor import DTensor
from kiln.distributed.errors import CheckpointCorrupt, CheckpointError, StoreTimeout
from kiln.distributed.placements import Replicate, local_bounds
from kiln.distributed.redistribute import Redistributor
from kiln.io.safetensors_io import FILE_DTYPES
from kiln.ir import dtypes as kd

_PREFIX = "shard-"
_ST_CODES = {dtype: code for code, dtype in FILE_DTYPES.items()}  # numpy dtype -> safetensors


# -- the snapshot: what this rank writes, copied at the call --------------------------------
def _group(state: dict):
    for value in state.values():
        if isinstance(value, DTensor) and value.device_mesh.group is not None:
            return value.device_mesh.group
    return rendezvous.get_world() if rendezvous.is_initialized() else None


def _snapshot(state: dict, rank: int, held: list | None = None) -> list:
    """[(key, dtype, shape, placements text, [(offsets, block)])] for this rank (the
    blocks are the tensors' own memory; `_stage` copies them for an async save). When
    `held` is a list, it gets (block, kind) for each block that is a state value's own
    memory: kind "tensor" (a kn.Tensor's array), "dtensor" (a DTensor's local block) or
    "numpy" (an array of the state); the async save holds or copies them by kind."""
    from kiln.frontend.tensor import Tensor  # lazy: distributed sits below the frontend

    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError("save: the state must be a dict with string keys")
    items = []
    for key, value in state.items():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            own = value
            if any(p.is_partial() for p in value.placements):
                value = value.redistribute(mesh, [Replicate() if p.is_partial() else p
                                                  for p in value.placements])
            coord = mesh.get_coordinate()
            owner = all(coord[i] == 0 for i, p in enumerate(value.placements) if not p.is_shard())
            offsets = tuple(lo for lo, _ in value.local_bounds())
            local = value._local  # not local_array(): that unshares a held block
            blocks = [(offsets, local)] if owner else []
            if held is not None and owner and value is own:
                held.append((local, "dtensor"))
            items.append((key, value.dtype, value.shape, [str(p) for p in value.placements],
                          blocks))
        else:
            if isinstance(value, Tensor):  # its memory, without unsharing a held array
                raw = value._concrete("checkpoint save")
                arr = np.asarray(raw)
                kind = "tensor" if arr is raw else None
            else:
                arr = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
                kind = "numpy" if isinstance(value, np.ndarray) and arr is value else None
            dtype = kd.from_numpy(arr.dtype)
            blocks = [((0,) * arr.ndim, arr)] if rank == 0 else []
            if held is not None and blocks and kind is not None:
                held.append((arr, kind))
            items.append((key, dtype, arr.shape, [], blocks))
    return items


def _stage(items: list, keep: tuple = ()) -> tuple[list, np.ndarray | None]:
    """The items with every block but those in `keep` replaced by its copy in one
    staging buffer (the snapshot of an async save: one memcpy per block); and the
    buffer, to release."""
    kept = {id(a) for a in keep}
    copies, lease = staging.stage([block for *_, bl in items for _, block in bl
                                   if id(block) not in kept])
    it = iter(copies)
    return [(key, dtype, shape, pl, [(off, block if id(block) in kept else next(it))
                                     for off, block in bl])
            for key, dtype, shape, pl, bl in items], lease


_NONCES: dict = {}  # id(group) -> (group, nonce, saves so far)
_NONCE_LOCK = threading.Lock()


def _agree_save_id(group) -> str:
    """A save id every rank computes alike: a random nonce from rank 0 (broadcast once per
    group, at its first save), then a count of saves, so later saves need no
    communication before their snapshot returns."""
    key = id(group)
    with _NONCE_LOCK:
        entry = _NONCES.get(key)
        if entry is None or entry[0] is not group:
            token = np.frombuffer(os.urandom(8), np.uint8).copy()
            if group is not None and group.world_size > 1:
                group.broadcast(token, src=0).wait()
            entry = (group, token.tobytes().hex(), 0)
        _NONCES[key] = (group, entry[1], entry[2] + 1)
        return "%s%06d" % (entry[1], entry[2])


# -- writing ---------------------------------------------------------------------------
def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _safetensors_header(save_id: str, blocks: list) -> bytes:
    """The header that makes a rank's shard file a valid safetensors file: each block
    under its tensor's key, in write order (8-byte length, JSON padded to 8 bytes)."""
    header: dict = {"__metadata__": {"format": "kiln-checkpoint-shard", "save_id": save_id}}
    pos = 0
    for key, block in blocks:
        header[key] = {"dtype": _ST_CODES[block.dtype], "shape": list(block.shape),
                       "data_offsets": [pos, pos + block.nbytes]}
        pos += block.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_all(fd: int, buffers: list) -> None:
    """Write `buffers` (bytes-like) to `fd` in order with writev straight from their
    memory, as few calls as the kernel allows (it may write less than asked)."""
    todo = [m for m in (memoryview(b).cast("B") for b in buffers) if len(m)]
    first = 0
    while first < len(todo):
        done = os.writev(fd, todo[first:first + _IOV_MAX])
        while first < len(todo) and done >= len(todo[first]):
            done -= len(todo[first])
            first += 1
        if done:
            todo[first] = todo[first][done:]


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _write_shards(folder: str, save_id: str, rank: int, items: list) -> dict:
    """Write this rank's blocks into one safetensors file with one writev per up to
    IOV_MAX blocks, straight from their memory, and one fsync; meanwhile a second
    thread checksums the blocks (xxhash, hashlib and writev release the GIL). Returns
    this rank's part of the manifest."""
    part: dict = {}
    name = "%s%s-r%d.safetensors" % (_PREFIX, save_id, rank)
    blocks = [(key, np.require(block, requirements="C"))
              for key, _, _, _, bl in items for _, block in bl]
    head = _safetensors_header(save_id, blocks)
    data = [block.reshape(-1).view(np.uint8) for _, block in blocks]
    algo = checksum.default_algorithm()
    hash_of = checksum.function(algo)
    offset, shards = len(head), []
    for key, dtype, shape, placements, bl in items:
        entry = part.setdefault(key, {"dtype": mf.dtype_name(dtype), "shape": list(shape),
                                      "placements": placements, "shards": []})
        for offsets, block in bl:
            shard = {"file": name, "byte_offset": offset, "offsets": list(offsets),
                     "shape": list(block.shape), "nbytes": int(block.nbytes)}
            entry["shards"].append(shard)
            shards.append(shard)
            offset += int(block.nbytes)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kiln-ckpt-hash") as pool:
        digests = pool.submit(lambda: [hash_of(d) for d in data])
        try:
            fd = os.open(os.path.join(folder, name),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                         0o644)
            try:
                _write_all(fd, [head] + data)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            raise CheckpointError("save: cannot write %s in %s: %s" % (name, folder, err)) from None
        for shard, digest in zip(shards, digests.result()):
            shard[algo] = digest
    return part


def _merge(parts: list, save_id: str, world: int) -> dict:
    tensors: dict = {}
    for part in parts:
        for key, entry in part.items():
            merged = tensors.setdefault(key, {**entry, "shards": []})
            merged["shards"].extend(entry["shards"])
    return {"format": mf.FORMAT, "version": mf.VERSION, "save_id": save_id,
            "world_size": world, "tensors": tensors}


def _commit_manifest(folder: str, doc: dict) -> None:
    """manifest.json replaced atomically, then the files no manifest names removed."""
    mf.validate(doc, folder)  # never commit what load would refuse
    tmp = os.path.join(folder, ".manifest.%s.tmp" % doc["save_id"])
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, mf.MANIFEST))
    _fsync_dir(folder)
    keep = {s["file"] for t in doc["tensors"].values() for s in t["shards"]}
    for name in os.listdir(folder):
        if (name.startswith(_PREFIX) and name not in keep) or (
                name.startswith(".manifest.") and name.endswith(".tmp")):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def _finish(folder: str, save_id: str, rank: int, world: int, items: list, store,
            timeout: float) -> None:
    """Write this rank's shards, then agree through the store; rank 0 commits."""
    part = _write_shards(folder, save_id, rank, items)
    if world == 1 or store is None:
        _commit_manifest(folder, _merge([part], save_id, 1))
        return
    base = "kiln/ckpt/%s/" % save_id
    store.set(base + "part/%d" % rank, json.dumps(part))
    if rank == 0:
        keys = [base + "part/%d" % r for r in range(world)]
        try:
            store.wait(keys, timeout=timeout)
        except StoreTimeout:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            store.set(base + "done", "rank(s) %s never finished writing" % missing)
            raise CheckpointError("save to %s: rank(s) %s did not finish writing their shards "
                                  "within %.0f s; the previous checkpoint is kept"
                                  % (folder, missing, timeout)) from None
        parts = [json.loads(store.get(k).decode()) for k in keys]
        try:
            _commit_manifest(folder, _merge(parts, save_id, world))
        except BaseException as err:
            store.set(base + "done", "rank 0 could not commit: %s" % err)
            raise
        store.set(base + "done", "ok")
        return
    try:
        store.wait([base + "done"], timeout=timeout)
    except StoreTimeout:
        raise CheckpointError("save to %s: rank 0 did not commit the manifest within %.0f s; "
                              "the previous checkpoint is kept" % (folder, timeout)) from None
    verdict = store.get(base + "done").decode()
    if verdict != "ok":
        raise CheckpointError("save to %s failed: %s" % (folder, verdict))


def _prepare(state: dict, path: str, timeout: float | None, held: list | None = None):
    group = _group(state)
    rank = group.rank if group is not None else 0
    world = group.world_size if group is not None else 1
    items = _snapshot(state, rank, held)
    save_id = _agree_save_id(group)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise CheckpointError("save: cannot create %s: %s" % (path, err)) from None
    if timeout is None:
        timeout = max(60.0, group.timeout if group is not None else 0.0)
    store = group.store if group is not None else None
    return rank, world, items, save_id, store, timeout


_IN_FLIGHT: dict = {}  # folder -> the Future of the last async save into it


def _after_previous(path: str, timeout: float) -> None:
    """Wait for the async save still writing into `path` (its error is its caller's):
    saves into one folder commit in call order, and one never deletes the files of
    another that is still being written."""
    prev = _IN_FLIGHT.get(os.path.realpath(path))
    if prev is not None:  # its error is reported through its own future
        concurrent.futures.wait([prev], timeout=timeout)


def save(state: dict, path: str, *, timeout: float | None = None) -> None:
    """Write `state` (DTensors, kn.Tensors, arrays) to folder `path`; every rank calls
    it. Returns once the manifest is committed.

        >>> dist.checkpoint.save({"w": w, "b": b}, "ckpt")
    """
    rank, world, items, save_id, store, timeout = _prepare(state, path, timeout)
    _after_previous(path, timeout)
    _finish(path, save_id, rank, world, items, store, timeout)


def _holds(found: list, copy: bool | None) -> tuple[list, list]:
    """(copy-on-write holds, read-only holds) of the blocks `_snapshot` found for an
    async save with `copy`; the other blocks are copied at the call. A block held
    copy-on-write is held with the numpy arrays it is a view of, so that a write through
    one of them is redirected (or, through a user's numpy array, raises) as well."""
    cow, frozen = [], []
    if copy:
        return cow, frozen
    for block, kind in found:
        if kind == "tensor" or kind == "dtensor" and copy is None:
            if block.flags.c_contiguous:  # with the arrays it views (bases last): a
                base = block              # write through one of them is redirected too
                while isinstance(base, np.ndarray):
                    cow.append(base)
                    base = base.base
        elif copy is False:  # the explicit old behaviour: held as they are, writes raise
            frozen.append(block)
    return cow, frozen


def async_save(state: dict, path: str, *, timeout: float | None = None,
               copy: bool | None = None) -> concurrent.futures.Future:
    """Like `save`, but returns at once with a Future: a background thread writes and
    commits the values of the call while training goes on. Saves into one folder commit
    in call order.

    By default (`copy=None`) the blocks of kn.Tensors and DTensors are not copied but
    held copy-on-write until the future completes: read-only, and every kiln path that
    would write into one (`Tensor.numpy()`, `np.asarray(tensor)`, collectives on a
    tensor, `DTensor.local_array()`) first gives its tensor a fresh copy, so the loop
    sees its writes and the checkpoint the values of the call (kiln's in-place ops,
    optimizer steps and compiled write-back rebind the tensor to a new array and never
    write into a held one). numpy arrays of the state, which kiln cannot guard, are
    copied at the call into a reused staging buffer (`staging.py`). `copy=True` copies
    every block (the stall grows with the state); `copy=False` also writes the numpy
    arrays and DTensor blocks from their own memory, read-only until the future
    completes (an in-place write into them raises instead of changing the checkpoint).

        >>> fut = dist.checkpoint.async_save(state, "ckpt"); ...; fut.result()
    """
    found: list = []
    rank, world, items, save_id, store, timeout = _prepare(state, path, timeout, found)
    cow, frozen = _holds(found, copy)
    hold = staging.hold(cow, cow=True) + staging.hold(frozen)
    try:
        items, lease = _stage(items, tuple(cow + frozen))
    except BaseException:
        staging.unhold(hold)
        raise
    future: concurrent.futures.Future = concurrent.futures.Future()
    key = os.path.realpath(path)
    previous = _IN_FLIGHT.get(key)
    _IN_FLIGHT[key] = future

    def work():
        own_store, error = None, None
        try:
            if previous is not None:  # its error is reported through its own future
                concurrent.futures.wait([previous], timeout=timeout)
            own_store = store.clone() if store is not None else None  # its own connection
            _finish(path, save_id, rank, world, items, own_store, timeout)
        except BaseException as err:  # handed to the caller through the future
            error = err
        finally:  # cleaned up before the future completes: its waiter sees the buffer back
            staging.release(lease)
            staging.unhold(hold)
            if own_store is not None:
                own_store.close()
            if _IN_FLIGHT.get(key) is future:
                _IN_FLIGHT.pop(key, None)
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    future.set_running_or_notify_cancel()
    threading.Thread(target=work, name="kiln-checkpoint-" + save_id, daemon=True).start()
    return future


# -- loading -----------------------------------------------------------------------------
def _read_shard(folder: str, key: str, shard: dict, dtype: kd.DType, cache: dict) -> np.ndarray:
    name, start = shard["file"], shard["byte_offset"]
    if (name, start) in cache:
        return cache[name, start]
    path = mf.shard_path(folder, name)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(shard["nbytes"])
    except FileNotFoundError:
        raise CheckpointCorrupt("load: shard file %s of tensor %r is missing from %s"
                                % (name, key, folder)) from None
    except OSError as err:
        raise CheckpointCorrupt("load: cannot read shard %s of %r: %s" % (name, key, err)) from None
    if len(data) != shard["nbytes"]:
        raise CheckpointCorrupt("load: shard file %s of tensor %r holds %d of the block's %d "
                                "bytes at offset %d (truncated or replaced)"
                                % (name, key, len(data), shard["nbytes"], start))
    algo, want = checksum.of_shard(shard, "shard %r of %r" % (name, key))
    if checksum.digest(algo, data) != want:
        raise CheckpointCorrupt("load: the block of tensor %r at byte %d of shard file %s fails "
                                "its %s checksum" % (key, start, name, algo))
    arr = np.frombuffer(data, dtype=dtype.np_dtype).reshape(shard["shape"])
    cache[name, start] = arr
    return arr


def _assemble(folder: str, key: str, dtype: kd.DType, shards: list, bounds) -> np.ndarray:
    """The block [bounds) of tensor `key`, read from the shards that overlap it."""
    out = np.empty(tuple(hi - lo for lo, hi in bounds), dtype.np_dtype)
    cache: dict = {}
    for s in shards:
        lo = [max(b[0], o) for b, o in zip(bounds, s["offsets"])]
        hi = [min(b[1], o + n) for b, o, n in zip(bounds, s["offsets"], s["shape"])]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        arr = _read_shard(folder, key, s, dtype, cache)
        src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, s["offsets"]))
        dst = tuple(slice(a - b[0], c - b[0]) for a, c, b in zip(lo, hi, bounds))
        out[dst] = arr[src]
    return out


def load(state: dict, path: str) -> dict:
    """Read the checkpoint in `path` into `state`, resharding: each DTensor entry is
    replaced by one with the same mesh and placements holding the saved values; arrays
    are filled in place; other tensors are replaced. Returns `state`.

        >>> dist.checkpoint.load(state, "ckpt")     # any world size, any placements
    """
    tensors = mf.read(path)
    for key, target in list(state.items()):
        if key not in tensors:
            raise CheckpointError("load: the checkpoint in %s has no tensor %r (it holds %s)"
                                  % (path, key, ", ".join(sorted(tensors)) or "nothing"))
        dtype, shape, shards = tensors[key]
        if isinstance(target, DTensor):
            want_shape, want_dtype = target.shape, target.dtype
        else:
            arr = target.numpy() if hasattr(target, "numpy") else np.asarray(target)
            want_shape, want_dtype = tuple(arr.shape), kd.from_numpy(arr.dtype)
        if tuple(want_shape) != shape or want_dtype != dtype:
            raise CheckpointError("load: %r is %s%s in the checkpoint but %s%s in the state"
                                  % (key, dtype.name, list(shape), want_dtype.name,
                                     list(want_shape)))
        if isinstance(target, DTensor):
            mesh, pl = target.device_mesh, target.placements
            whole = tuple(Replicate() if p.is_partial() else p for p in pl)
            block = _assemble(path, key, dtype, shards,
                              local_bounds(shape, whole, mesh.shape, mesh.get_coordinate()))
            if whole != pl:
                block = Redistributor(mesh, shape, block).run(whole, pl)
            state[key] = DTensor(block, mesh, pl, shape)
        else:
            full = _assemble(path, key, dtype, shards, tuple((0, s) for s in shape))
            if isinstance(target, np.ndarray) and target.flags.writeable:
                np.copyto(target, full)
            else:
                from kiln.frontend.factories import tensor  # lazy: below the frontend

                state[key] = tensor(full)
    return state
