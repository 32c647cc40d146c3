"""Flight Recorder dumps and `kiln fr`: each deliberate fault is named correctly."""

from __future__ import annotations

import json

import pytest

from harness import check_all_ok, run_scenario
from kiln.distributed.commands import main as cli


def fr(capsys, directory, *flags):
    code = cli(["fr", str(directory), *flags])
    return code, capsys.readouterr().out


@pytest.mark.timeout(60)
def test_mismatched_size_dtype_and_op_are_named(tmp_path, capsys):
    data = check_all_ok(run_scenario("mismatch", 3, tmp_path))
    for outcome in data:  # at run time every rank's Work failed, none hung
        assert outcome == {"size": "CollectiveMismatch", "dtype": "CollectiveMismatch",
                           "op": "CollectiveMismatch"}
    code, out = fr(capsys, tmp_path / "fr", "--json")
    assert code == 1
    report = json.loads(out)
    by_group = {m["group"]: m for m in report["mismatches"]}
    assert set(by_group) == {"world.s0.c0", "world.s1.c0", "world.s2.c0"}
    size, dtype, op = by_group["world.s0.c0"], by_group["world.s1.c0"], by_group["world.s2.c0"]
    assert size["ranks"] == [1] and size["fields"] == ["numel"]
    assert size["input_sizes"] == [[1004]] and size["majority_input_sizes"] == [[1000]]
    assert dtype["ranks"] == [1] and dtype["fields"] == ["input_dtypes"]
    assert "int32" in dtype["call"] and "float32" in dtype["majority_call"]
    assert op["ranks"] == [1] and "op" in op["fields"]
    assert op["call"].startswith("broadcast") and op["majority_call"].startswith("all_reduce")
    assert "workers.py" in op["where"] and "sub.broadcast" in op["where"]
    assert report["missing_dumps"] == [] and report["membership"] == []
    code, text = fr(capsys, tmp_path / "fr")
    assert "COLLECTIVES THAT DIFFER ACROSS RANKS" in text and "broadcast(float32[1000]" in text


@pytest.mark.timeout(60)
def test_rank_that_skips_a_collective_is_the_culprit(tmp_path, capsys):
    data = check_all_ok(run_scenario("hang", 3, tmp_path, args={"timeout": 1.5}))
    assert data[1] == {"dumped": True}  # rank 1's watcher got the request and dumped
    code, out = fr(capsys, tmp_path / "fr", "--json")
    report = json.loads(out)
    assert code == 1 and report["mismatches"] == []
    [hang] = report["never_joined"]
    assert hang["group"] == "world" and hang["seq"] == 2 and hang["op"] == "all_reduce"
    assert hang["ranks"] == [1] and hang["waiting_ranks"] == [0, 2]
    assert "pg.all_reduce(x, timeout=" in hang["where"]
    code, text = fr(capsys, tmp_path / "fr")
    assert "rank 1 never called it" in text


def _dump(rank, world, groups, records):
    return {"version": 1, "rank": rank, "world_size": world, "pid": 1, "host": "h",
            "reason": "test", "time_ns": 10 ** 19, "groups": groups, "records": records}


def _rec(seq, op="all_reduce", group="world", numel=4):
    return {"id": seq, "group": group, "epoch": 0, "seq": seq, "op": op,
            "input_sizes": [[numel]], "input_dtypes": ["float32"], "output_sizes": [[numel]],
            "output_dtypes": ["float32"], "state": "completed", "time_created_ns": 1,
            "time_started_ns": 1, "time_completed_ns": 2, "timeout_s": 1.0, "frames": [],
            "error": None, "numel": numel, "reduce_op": "sum"}


def test_missing_dump_and_membership_disagreement(tmp_path, capsys):
    world = {"ranks": [0, 1, 2], "rank": 0, "epoch": 0, "backend": "tcp"}
    sub_a = {"ranks": [0, 1], "rank": 0, "epoch": 0, "backend": "tcp"}
    sub_b = {"ranks": [0, 2], "rank": 0, "epoch": 0, "backend": "tcp"}
    for rank, sub in ((0, sub_a), (1, sub_b)):
        (tmp_path / ("kiln_fr_rank%d.json" % rank)).write_text(json.dumps(
            _dump(rank, 3, {"world": world, "world.s0": sub}, [_rec(0), _rec(1)])))
    code, out = fr(capsys, tmp_path, "--json")
    report = json.loads(out)
    assert code == 1 and report["missing_dumps"] == [2]
    [disagree] = report["membership"]
    assert disagree["group"] == "world.s0" and disagree["views"] == {"0": [0, 1], "1": [0, 2]}
    code, text = fr(capsys, tmp_path)
    assert "MISSING DUMPS: rank 2" in text and "GROUP MEMBERSHIP DISAGREES" in text


def test_clean_dumps_report_nothing_and_bad_dirs_fail(tmp_path, capsys):
    world = {"ranks": [0, 1], "rank": 0, "epoch": 0, "backend": "tcp"}
    for rank in (0, 1):
        (tmp_path / ("kiln_fr_rank%d.json" % rank)).write_text(json.dumps(
            _dump(rank, 2, {"world": world}, [_rec(0), _rec(1)])))
    code, text = fr(capsys, tmp_path)
    assert code == 0 and "no problem found" in text
    assert cli(["fr", str(tmp_path / "nope")]) == 2
    (tmp_path / "kiln_fr_rank0.json").write_text("{not json")
    assert cli(["fr", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_recorder_ring_buffer_is_bounded_and_json(tmp_path):
    import numpy as np

    from kiln.distributed.flight_recorder import FlightRecorder

    rec = FlightRecorder(capacity=3)
    a = np.zeros(4, np.float32)
    for seq in range(5):
        r = rec.record(group="g", epoch=0, seq=seq, op="all_reduce", inputs=[a], outputs=[a],
                       timeout=1.0, frames=[[__file__, 1, "f"]])
        rec.started(r)
        rec.completed(r)
    path = rec.dump(str(tmp_path), reason="test")
    dump = json.loads(open(path).read())
    assert [r["seq"] for r in dump["records"]] == [2, 3, 4]
    assert dump["records"][0]["state"] == "completed"
    assert dump["records"][0]["frames"][0]["function"] == "f"
