"""Workers never outlive `kiln launch`, and the launcher never waits forever for one.

- SIGKILL of the launcher (nothing can be forwarded, nothing cleaned up): the kernel
  kills its workers (PR_SET_PDEATHSIG), even one that ignores SIGTERM and never touches
  kiln or the store (issue 11, finding 7).
- A worker SIGSTOPped from outside is shrunk away by its fault-tolerant group; the
  launcher sees the epoch without it, kills it and ends the job (finding 9).
- With --on-failure replace, a worker dying before the first rendezvous is replaced in
  the rendezvous itself, and the job succeeds with one restart (finding 10).

Every test is bounded, and kills every process it started on the way out.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.security.lifetimes import launched


@pytest.mark.timeout(90)
def test_sigkill_of_the_launcher_leaves_no_worker_behind(tmp_path):
    with launched(tmp_path, "--nproc", "3", mode="idle") as job:
        pids = job.wait_for("3 workers started", lambda: len(job.all_pids()) == 3 and
                            job.all_pids(), timeout=60)
        assert all(job.alive(pid) for pid in pids)
        job.launcher.send_signal(signal.SIGKILL)
        job.launcher.wait(timeout=10)
        # the workers ignore SIGTERM and touch nothing: only the kernel can end them
        job.wait_for("workers gone after the launcher's SIGKILL",
                     lambda: not any(job.alive(pid) for pid in pids), timeout=20)
        assert job.kill_leftovers() == []


@pytest.mark.timeout(120)
def test_externally_stopped_worker_is_removed_and_the_launcher_exits(tmp_path):
    report = tmp_path / "events.json"
    with launched(tmp_path, "--nproc", "3", "--on-failure", "shrink", "--events-json",
                  str(report), mode="train", steps=150) as job:
        job.wait_for("rank 1 committed step 5", lambda: job.steps(1) >= 5, timeout=90)
        [stopped] = job.pids()[1]
        os.kill(stopped, signal.SIGSTOP)  # Ctrl-Z or a debugger, from outside the launcher
        code, err = job.finish(timeout=90)
        assert code == 0, err
        assert "rank 1 (pid %d) was removed from the group at epoch 1" % stopped in err
        assert not job.alive(stopped)
        results = job.results()
        assert sorted(results) == [0, 2]
        want = float(sum(range(1, 151)))
        for [r] in results.values():
            assert r["x"] == want and r["committed"] == 150 and r["members"] == [0, 2]
        [died] = [e for e in json.loads(report.read_text())["events"] if e["kind"] == "died"]
        assert died["rank"] == 1 and died["pid"] == stopped
        assert died["removed_at_epoch"] == 1 and died["signal"] == "SIGKILL"
        assert job.kill_leftovers() == []


@pytest.mark.timeout(90)
def test_worker_left_stopped_after_the_others_finished_is_killed(tmp_path):
    # no fault-tolerant group to remove it: once every other worker is done, a worker
    # stopped from outside has nobody left to wake it; after --grace (2 s) it is killed
    report = tmp_path / "events.json"
    with launched(tmp_path, "--nproc", "3", "--on-failure", "shrink", "--events-json",
                  str(report), mode="selfstop") as job:
        code, err = job.finish(timeout=60)
        assert code == 0, err
        [stopped] = job.pids()[1]
        assert "rank 1 is still stopped from outside (SIGSTOP) for 2.0 s while every other " \
            "worker is done; killing it" in err
        assert not job.alive(stopped)
        events = json.loads(report.read_text())["events"]
        assert [(e["kind"], e["rank"]) for e in events if e["kind"] == "died"] == [("died", 1)]
        assert job.kill_leftovers() == []


@pytest.mark.timeout(120)
def test_replace_before_the_first_rendezvous_succeeds_with_one_restart(tmp_path):
    report = tmp_path / "events.json"
    with launched(tmp_path, "--nproc", "2", "--on-failure", "replace", "--max-restarts", "2",
                  "--events-json", str(report), mode="early", steps=20) as job:
        code, err = job.finish(timeout=100)
        assert code == 0, err
        data = json.loads(report.read_text())
        assert data["restarts"] == 1
        kinds = [(e["kind"], e["rank"]) for e in data["events"]]
        assert kinds.count(("died", 1)) == 1 and kinds.count(("replaced", 1)) == 1
        [died] = [e for e in data["events"] if e["kind"] == "died"]
        assert died["exit_code"] == 3
        [replaced] = [e for e in data["events"] if e["kind"] == "replaced"]
        assert replaced["joins"] is False
        results = job.results()
        assert sorted(results) == [0, 1] and len(results[1]) == 1
        assert results[1][0]["pid"] == replaced["pid"]
        for [r] in results.values():
            assert r["x"] == float(sum(range(1, 21))) and r["members"] == [0, 1]
        assert job.kill_leftovers() == []
