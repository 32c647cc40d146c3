"""Distributed checkpoints: round trip, resharding 4 -> 2 -> 3 ranks, async save while
training continues (in the 4-rank job), a rank SIGKILLed mid-save, corrupt/missing shards and hostile
manifests refused with numbered errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import kiln as kn
from kiln.distributed import checkpoint
from kiln.distributed.errors import CheckpointCorrupt, CheckpointError, CheckpointManifestError

from tests.distributed.harness import check_all_ok, run_scenario

WORKERS = Path(__file__).with_name("checkpoint_workers.py")


def _values(version=0):
    from tests.distributed.checkpoint_workers import values

    return values(version)


def _plain(path):
    """Load into whole arrays in this (single) process."""
    state = {"w": np.zeros((7, 5), np.float32), "m": np.zeros((6, 9), np.float32),
             "steps": np.zeros(10, np.int64)}
    checkpoint.load(state, str(path))
    return state


def test_save_on_4_load_on_2_and_3(tmp_path):
    path = str(tmp_path / "ckpt")
    # the same 4 ranks then async_save into a second folder while training goes on
    data = check_all_ok(run_scenario("save_world", 4, tmp_path, workers=WORKERS,
                                     args={"path": path, "async_path": path + "_async"},
                                     timeout=90.0))
    # one shard file per rank (each holds its blocks of w, m and, on rank 0, steps)
    assert data[0]["files"] == 4
    for world in (2, 3):
        check_all_ok(run_scenario("load_world", world, tmp_path / str(world), workers=WORKERS,
                                  args={"path": path}, timeout=90.0))
    got = _plain(path)
    for key, want in _values().items():
        np.testing.assert_array_equal(got[key], want)


def test_rank_killed_mid_save_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_scenario("killed_mid_save", 4, tmp_path, workers=WORKERS,
                           args={"path": path}, timeout=90.0)
    assert results[2]["returncode"] == -9
    for rank in (0, 1, 3):
        assert results[rank]["ok"], results[rank].get("error", "") + results[rank]["output"]
        assert "K245" in results[rank]["data"]["error"]
    assert "rank(s) [2]" in results[0]["data"]["error"]
    got = _plain(path)  # version 0, whole
    for key, want in _values(0).items():
        np.testing.assert_array_equal(got[key], want)


def _saved(tmp_path):
    path = str(tmp_path / "one")
    state = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
             "t": kn.tensor(np.array([1.5, 2.5], np.float32)), "s": np.int64(3)}
    checkpoint.save(state, path)
    return path, json.loads(Path(path, "manifest.json").read_text())


def test_single_process_round_trip_and_second_save_cleans_up(tmp_path):
    path, doc = _saved(tmp_path)
    state = {"a": np.zeros((3, 4), np.float32), "t": kn.zeros(2), "s": np.zeros((), np.int64)}
    checkpoint.load(state, path)
    np.testing.assert_array_equal(state["a"], np.arange(12).reshape(3, 4))
    np.testing.assert_array_equal(state["t"].numpy(), [1.5, 2.5])
    assert int(state["s"]) == 3
    checkpoint.save({"a": np.ones((3, 4), np.float32)}, path)
    files = [n for n in os.listdir(path) if n.startswith("shard-")]
    assert len(files) == 1  # the previous save's files are gone once the new one commits
    # a rank's shard file is a safetensors file (each block under its tensor's key)
    from kiln.io.safetensors_io import load_safetensors

    np.testing.assert_array_equal(load_safetensors(os.path.join(path, files[0]))["a"],
                                  np.ones((3, 4), np.float32))
    with pytest.raises(CheckpointError, match="K245.*no tensor 't'"):
        checkpoint.load({"t": np.zeros(2, np.float32)}, path)
    with pytest.raises(CheckpointError, match="K245.*float32\\[3, 4\\].*float32\\[4, 3\\]"):
        checkpoint.load({"a": np.zeros((4, 3), np.float32)}, path)


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_corrupt_and_missing_shards_are_named(tmp_path, monkeypatch, algo):
    from kiln.distributed.checkpoint import checksum

    if not checksum.available(algo):
        pytest.skip("the xxhash package is not installed (pip install 'kiln[checkpoint]')")
    monkeypatch.setattr(checksum, "default_algorithm", lambda: algo)
    path, doc = _saved(tmp_path)
    assert checksum.of_shard(doc["tensors"]["a"]["shards"][0], "a") == (
        algo, checksum.digest(algo, np.arange(12, dtype=np.float32).reshape(3, 4).tobytes()))
    shard = doc["tensors"]["a"]["shards"][0]["file"]
    start = doc["tensors"]["a"]["shards"][0]["byte_offset"]  # after the safetensors header
    target = {"a": np.zeros((3, 4), np.float32)}
    raw = bytearray(Path(path, shard).read_bytes())
    raw[start + 5] ^= 0xFF
    Path(path, shard).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupt, match="K246.*tensor 'a' at byte %d of shard file %s "
                       "fails its %s checksum" % (start, shard, algo)):
        checkpoint.load(target, path)
    Path(path, shard).write_bytes(bytes(raw[:start + 10]))
    with pytest.raises(CheckpointCorrupt, match="holds 10 of the block's 48 bytes.*truncated"):
        checkpoint.load(target, path)
    os.unlink(Path(path, shard))
    with pytest.raises(CheckpointCorrupt, match="%s of tensor 'a' is missing" % shard):
        checkpoint.load(target, path)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["tensors"]["a"]["shards"][0].update(file="../escape.bin"), "not a plain file"),
    (lambda d: d["tensors"]["a"]["shards"][0].update(file="/etc/passwd"), "not a plain file"),
    (lambda d: d["tensors"]["a"].update(shape=[2, 4]), "lies outside"),
    (lambda d: d["tensors"]["a"].update(shape=[4, 4]), "hold 12 of its 16"),
    (lambda d: d["tensors"]["a"].update(dtype="object"), "unknown dtype 'object'"),
    (lambda d: d["tensors"]["a"]["shards"][0].update(nbytes=10 ** 12), "declares"),
    (lambda d: d["tensors"]["a"]["shards"].append(dict(d["tensors"]["a"]["shards"][0])),
     "overlap"),
    (lambda d: d["tensors"]["a"].update(shape=[-3, 4]), "non-negative ints"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["tensors"]["a"]["shards"][0].update(byte_offset=-1), "byte_offset -1"),
    (lambda d: d["tensors"]["t"]["shards"][0].update(
        byte_offset=d["tensors"]["a"]["shards"][0]["byte_offset"] + 8), "share bytes"),
    (lambda d: [s.pop(a, None) for s in d["tensors"]["a"]["shards"]
                for a in ("xxh3_128", "sha256")], "one checksum"),
    (lambda d: d["tensors"]["a"]["shards"][0].update(sha256="ab", xxh3_128="cd"),
     "one checksum"),
    (lambda d: d["tensors"]["a"]["shards"][0].update(
        {a: "not hex" for a in ("xxh3_128", "sha256") if a in d["tensors"]["a"]["shards"][0]}),
     "one checksum"),
])
def test_hostile_manifests_are_refused(tmp_path, edit, message):
    path, doc = _saved(tmp_path)
    edit(doc)
    Path(path, "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointManifestError, match="K247.*" + message):
        checkpoint.load({"a": np.zeros((3, 4), np.float32)}, path)


def test_symlink_out_of_the_folder_is_refused(tmp_path):
    path, doc = _saved(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 48)
    shard = doc["tensors"]["a"]["shards"][0]["file"]
    os.unlink(Path(path, shard))
    os.symlink(outside, Path(path, shard))
    with pytest.raises(CheckpointManifestError, match="outside the checkpoint folder"):
        checkpoint.load({"a": np.zeros((3, 4), np.float32)}, path)


def test_no_manifest_is_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="holds no committed checkpoint"):
        checkpoint.load({}, str(tmp_path))


def test_async_saves_into_one_folder_commit_in_call_order(tmp_path):
    path = str(tmp_path / "chain")
    futures = [checkpoint.async_save({"a": np.full((64, 256), i, np.float32)}, path)
               for i in range(4)]
    checkpoint.save({"a": np.full((64, 256), 9, np.float32)}, path)  # waits for them
    assert all(f.done() and f.exception() is None for f in futures)
    state = {"a": np.zeros((64, 256), np.float32)}
    checkpoint.load(state, path)
    assert np.all(state["a"] == 9)
    assert len([n for n in os.listdir(path) if n.startswith("shard-")]) == 1


def test_write_all_survives_short_writes_and_many_buffers(tmp_path, monkeypatch):
    from kiln.distributed.checkpoint import io

    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 255, size=int(n), dtype=np.uint8)
               for n in rng.integers(0, 40, size=2500)]  # more than IOV_MAX, some empty
    real = os.writev
    calls = []

    def short(fd, bufs):  # the kernel may write less than asked: at most 1000 bytes a call
        calls.append(len(bufs))
        return real(fd, [memoryview(b"".join(bytes(b) for b in bufs)[:1000])])

    monkeypatch.setattr(io.os, "writev", short)
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        io._write_all(fd, [b"head"] + buffers)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"head" + b"".join(b.tobytes() for b in buffers)
    assert max(calls) <= io._IOV_MAX and len(calls) > 1


def test_async_snapshot_is_taken_at_the_call_and_its_staging_buffer_reused(tmp_path):
    from kiln.distributed.checkpoint import staging

    staging.clear()
    path = str(tmp_path / "ck")
    big = np.full((1024, 8192), 1.0, np.float32)  # 32 MiB: the copy is split over threads
    small = np.arange(5, dtype=np.int64)
    fut = checkpoint.async_save({"big": big, "small": small, "s": np.float64(2.5)}, path)
    big[:] = 7.0  # training goes on: the save holds the values of the call
    small[:] = -1
    fut.result(timeout=120)
    state = {"big": np.zeros_like(big), "small": np.zeros_like(small),
             "s": np.zeros((), np.float64)}
    checkpoint.load(state, path)
    assert np.all(state["big"] == 1.0) and state["small"].tolist() == [0, 1, 2, 3, 4]
    assert float(state["s"]) == 2.5
    (lease,) = staging._POOL.idle  # handed back when the write ended
    fut = checkpoint.async_save({"big": big, "small": small, "s": np.float64(3.5)}, path)
    fut.result(timeout=120)
    assert len(staging._POOL.idle) == 1 and staging._POOL.idle[0] is lease  # reused
    checkpoint.load(state, path)
    assert np.all(state["big"] == 7.0) and state["small"].tolist() == [-1] * 5
    staging.clear()
    assert not staging._POOL.idle


def test_async_save_without_copy_writes_in_place_and_guards_the_arrays(tmp_path):
    from kiln.distributed import DeviceMesh, Shard, distribute_tensor
    from kiln.distributed.checkpoint import staging

    mesh = DeviceMesh((1,), ("dp",))
    path = str(tmp_path / "ck")
    w = distribute_tensor(np.arange(12, dtype=np.float32).reshape(3, 4), mesh, [Shard(0)])
    steps = np.arange(3, dtype=np.int64)
    t = kn.tensor(np.array([1.5, 2.5], np.float32))  # kn.Tensors are copied either way
    staging.clear()
    # a save still in flight into the folder: this one's writer waits for it, so the
    # arrays are certainly still being saved while the test writes to them
    import concurrent.futures

    from kiln.distributed.checkpoint import io

    blocker: concurrent.futures.Future = concurrent.futures.Future()
    io._IN_FLIGHT[os.path.realpath(path)] = blocker
    fut = checkpoint.async_save({"w": w, "steps": steps, "t": t}, path, copy=False)
    with pytest.raises(ValueError, match="read-only"):
        steps += 10  # the training loop may not change what is being written
    with pytest.raises(ValueError, match="read-only"):
        w.local_array()[0, 0] = 5.0
    assert not fut.done()
    blocker.set_result(None)
    fut.result(timeout=120)
    assert steps.flags.writeable and w.local_array().flags.writeable  # released
    state = {"w": np.zeros((3, 4), np.float32), "steps": np.zeros(3, np.int64),
             "t": np.zeros(2, np.float32)}
    checkpoint.load(state, path)
    np.testing.assert_array_equal(state["w"], np.arange(12).reshape(3, 4))
    assert state["steps"].tolist() == [0, 1, 2]
    assert state["t"].tolist() == [1.5, 2.5]
    # holds nest: two saves in flight keep the array read-only until both end
    token1, token2 = staging.hold([steps]), staging.hold([steps])
    staging.unhold(token1)
    assert not steps.flags.writeable
    staging.unhold(token2)
    assert steps.flags.writeable
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    staging.unhold(staging.hold([frozen]))
    assert not frozen.flags.writeable  # read-only before: read-only after


@pytest.mark.parametrize("world", [1, 2])
def test_default_async_save_is_copy_on_write_while_every_write_path_runs(tmp_path, world):
    """No copy of the tensors' blocks at the call; eager in-place ops, compiled
    write-back, the fused optimizer step, writes through .numpy()/np.asarray, an
    in-place all_reduce and writes into a DTensor's local block all run while the save
    is in flight: the checkpoint equals a synchronous save at the call, the loop sees
    its writes, and the holds end with the save."""
    results = check_all_ok(run_scenario("cow_world", world, tmp_path, workers=WORKERS,
                                        args={"path": str(tmp_path / "ck")}, timeout=90.0))
    for data in results:
        assert data["cow"] and data["in_flight"] and data["released"], data
        assert all(data["seen"].values()), data["seen"]
        assert data["same"] and data["at_call"], data


def test_async_save_copy_true_copies_and_an_array_taken_before_the_call_is_guarded(tmp_path):
    """copy=True: nothing held (the old staging copy); the default: an array taken out of
    a tensor before the call is read-only until the save ends (a write raises rather
    than change the checkpoint), and the tensor hands out a fresh copy meanwhile."""
    import concurrent.futures

    from kiln.distributed.checkpoint import io

    path = str(tmp_path / "ck")
    t = kn.tensor(np.arange(6, dtype=np.float32))
    early = t.numpy()
    for copy in (True, None):
        blocker: concurrent.futures.Future = concurrent.futures.Future()
        io._IN_FLIGHT[os.path.realpath(path)] = blocker
        fut = checkpoint.async_save({"t": t}, path, copy=copy)
        if copy:
            assert early.flags.writeable  # copied at the call: not held
            early[0] = 10.0  # the checkpoint keeps the value of the call
        else:
            with pytest.raises(ValueError, match="read-only"):
                early[1] = 20.0
            fresh = t.numpy()
            assert fresh is not early and fresh.flags.writeable
            fresh[1] = 30.0
        blocker.set_result(None)
        fut.result(timeout=120)
        state = {"t": np.zeros(6, np.float32)}
        checkpoint.load(state, path)
        want = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] if copy else [10.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert state["t"].tolist() == want
    assert early.flags.writeable and t.numpy().tolist()[:2] == [10.0, 30.0]
