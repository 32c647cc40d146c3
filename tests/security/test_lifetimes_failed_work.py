"""Failed collectives share no growing traceback (issue 11, finding 8).

A failed group fails every later call with its one stored error. `Work.wait()` used to
raise that object itself, and each raise added two frames to its traceback: a retry
loop leaked ~1.45 KB per call, forever. Now each raise is a fresh copy, and its message
says to call should_commit(). Measured in a real job: rank 1 dies, rank 0 makes 10,000
calls on the failed group under tracemalloc, then does what the message says.
"""

from __future__ import annotations

import traceback

import pytest

from kiln.distributed.errors import CollectiveTimeout, GroupAborted, PeerFailure
from kiln.distributed.work import Work
from tests.security.lifetimes import launched


@pytest.mark.timeout(120)
def test_ten_thousand_failed_collectives_keep_memory_flat(tmp_path):
    with launched(tmp_path, "--nproc", "2", "--on-failure", "shrink", mode="leak",
                  env_extra={"KILN_FR_BUFFER_SIZE": "200"}) as job:
        code, err = job.finish(timeout=110)
        assert code == 0, err
        [r] = job.results()[0]
    # 9,000 more failed calls: a few KB of noise at most (the leak was ~13 MB)
    assert r["at_10k"] - r["at_1k"] < 64 * 1024, r
    assert r["frames_10k"] == r["frames_1k"] < 20, r  # no frames piled up
    assert not r["same"]  # a fresh error object per raise
    assert r["type"] == "PeerFailure" and r["peer"] == 1
    assert "pg.should_commit()" in r["message"] and "[K202]" in r["message"]
    # what the message says works: the step is dropped, the survivor goes on alone
    assert r["committed"] is False and r["world"] == 1 and r["after"] == [2.0] * 4


def test_each_raise_is_a_copy_with_the_fields_and_the_origin():
    def fail():
        raise PeerFailure(3, "rank 3 of group 'world' closed its connection", group="world")

    try:
        fail()
    except PeerFailure as err:
        stored = err
    work = Work("all_reduce", 7, "world")
    work._finish(stored)
    raised = []
    for _ in range(3):
        with pytest.raises(PeerFailure) as info:
            work.wait()
        raised.append(info.value)
    first, second = raised[0], raised[2]
    assert first is not second and first is not stored
    assert (second.rank, second.group_name, second.code) == (3, "world", "K202")
    assert second.message == stored.message and second.hint == stored.hint
    assert second.__cause__ is stored  # where it happened, kept once
    assert len(traceback.extract_tb(stored.__traceback__)) == 2  # never re-raised: not grown
    assert "pg.should_commit()" in str(second)
    assert work.exception() is stored  # what is stored is not touched


def test_advice_follows_the_kind_of_group():
    work = Work("barrier", 0, "sub")
    work._finish(GroupAborted("group 'sub' aborted on rank 0: aborted by the user"))
    with pytest.raises(GroupAborted) as info:
        work.wait()
    assert info.value.__cause__ is None  # created without a traceback: nothing to chain
    text = str(info.value)
    assert text.startswith("[K206] group 'sub' aborted") and "should_commit()" in text

    class Plain:  # a group that is not fault-tolerant
        _sync_ft = None

    work = Work("barrier", 1, "world", Plain())
    work._finish(GroupAborted("group 'world' aborted"))
    with pytest.raises(GroupAborted) as info:
        work.wait()
    assert "not fault-tolerant: end the job" in str(info.value)
    assert "should_commit" not in str(info.value)


def test_a_timeout_copy_keeps_its_message_and_fields():
    # CollectiveTimeout is a TimeoutError, an OSError: its args are filled by __init__
    stored = CollectiveTimeout("all_reduce (seq 4, group 'world') did not complete within "
                               "2 s", rank=1)
    work = Work("all_reduce", 4, "world")
    work._finish(stored)
    with pytest.raises(CollectiveTimeout) as info:
        work.wait()
    fresh = info.value
    assert fresh is not stored and isinstance(fresh, TimeoutError) and fresh.rank == 1
    assert str(fresh).startswith(str(stored)) and "pg.should_commit()" in str(fresh)
    assert fresh.__cause__ is None  # never raised: nothing to chain
