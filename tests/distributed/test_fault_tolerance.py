"""Fault tolerance end to end: ranks die (SIGKILL), hang (SIGSTOP) or join while a
data-parallel loop runs (tests/distributed/ft_workers.py). Every test asserts that the
survivors reach the same epoch with identical state, that no committed step is lost
or applied twice (the state after n steps is exactly sum(1..n)), and, where a rank
died, that the Flight Recorder dumps exist and `kiln fr` names it.

Each scenario runs on the tcp backend and on the mpi backend (ULFM, under mpirun:
tests/distributed/mpi_harness.py), through the same Job interface."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.distributed import fr_analysis
from kiln.distributed.store import Store, StoreServer
from tests.distributed.harness import worker_env
from tests.distributed.mpi_harness import MpiJob, needs_mpi

WORKERS = Path(__file__).with_name("ft_workers.py")
pytestmark = pytest.mark.timeout(120)
BACKENDS = ["tcp", pytest.param("mpi", marks=needs_mpi)]


class Job:
    """`world` trainer processes (uids 0..world-1) plus joiners started later."""

    def __init__(self, tmp_path: Path, world: int, args: dict):
        self.tmp, self.world, self.args = tmp_path, world, args
        self.token = secrets.token_hex(16)
        self.server = StoreServer("127.0.0.1", 0, self.token)
        self.procs: list[subprocess.Popen] = []
        self.outs: list[Path] = []

    def start(self, uid: int) -> subprocess.Popen:
        out = self.tmp / ("result%d.json" % len(self.procs))
        proc = subprocess.Popen(
            [sys.executable, str(WORKERS), "trainer", str(uid), str(self.world),
             self.server.address, str(out), json.dumps(self.args)],
            env=worker_env(self.tmp, self.token), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.outs.append(out)
        return proc

    def start_all(self) -> None:
        for uid in range(self.world):
            self.start(uid)

    def add_joiner(self) -> None:
        """A replacement started by hand: it joins at the group's next step commit."""
        self.start(-1)

    def signal(self, uid: int, signum: int) -> None:
        self.procs[uid].send_signal(signum)

    def finished(self, uid: int) -> bool:
        return self.procs[uid].poll() is not None

    def store(self) -> Store:
        return Store(self.server.address, self.token, timeout=10.0)

    def finish(self, timeout: float = 60.0) -> list[dict | None]:
        """Wait for every process (one stopped by SIGSTOP is killed at the end); the
        results of those that finished, None for the others."""
        deadline = time.monotonic() + timeout
        results = []
        try:
            for proc, out in zip(self.procs, self.outs):
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                text = proc.stdout.read().decode(errors="replace")
                if out.exists():
                    res = json.loads(out.read_text())
                    assert res["ok"], "a process failed:\n%s\n%s" % (res["error"], text[-3000:])
                    results.append(res["data"])
                else:
                    results.append(None)
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
            self.server.close()
        return results


def make_job(tmp_path: Path, world: int, args: dict, backend: str):
    return (MpiJob if backend == "mpi" else Job)(tmp_path, world, args)


def run_job(tmp_path: Path, world: int, args: dict, steps: int | None, alive: int,
            backend: str = "tcp") -> list:
    """Run `world` trainers to the end; the survivors' results, checked."""
    job = make_job(tmp_path, world, args, backend)
    job.start_all()
    return check_survivors(job.finish(), steps, alive)


def check_survivors(results: list, steps: int | None, alive: int) -> list[dict]:
    """`steps`: how many steps every survivor committed (None: whatever they agree on)."""
    done = [r for r in results if r is not None]
    assert len(done) == alive, results
    steps = done[0]["committed"] if steps is None else steps
    want = [float(sum(range(1, steps + 1)))] * 4
    for r in done:
        assert r["x"] == want and r["committed"] == steps and r["step"] == steps, r
    assert len({(r["epoch"], tuple(r["members"])) for r in done}) == 1, done
    assert sorted(r["rank"] for r in done) == list(range(alive))
    return done


def fr_names(tmp_path: Path, dead: list[int]) -> None:
    report = fr_analysis.analyze(fr_analysis.load_dumps(str(tmp_path / "fr")))
    named = {f["rank"] for f in report["failed_peers"]}
    assert set(dead) <= named, report["failed_peers"]
    # SIGKILL leaves no dump, but a rank that saw an earlier failure dumped before it died
    assert set(dead) & set(report["missing_dumps"]), report["missing_dumps"]
    text = fr_analysis.format_report(report)
    for uid in dead:
        assert "rank %d in group 'world" % uid in text, text


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "barrier", "all_to_all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_before_during_and_after_each_collective(tmp_path, kind, backend):
    # five ranks lose one at a time: before, during and after the step's collective
    kills = [{"uid": 4, "step": 3, "when": "before"}, {"uid": 3, "step": 6, "when": "during"},
             {"uid": 1, "step": 9, "when": "after"}]
    done = run_job(tmp_path, 5, {"steps": 12, "kind": kind, "kills": kills,
                              "numel": 1 << 16 if kind != "barrier" else 4},
                   12, 2, backend)
    assert done[0]["epoch"] == 3 and done[0]["members"] == [0, 2]
    assert [h["removed"] for h in done[0]["history"]] == [[4], [3], [1]]
    fr_names(tmp_path, [4, 3, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_no_vote_rolls_the_step_back_everywhere_and_it_is_done_again(tmp_path, backend):
    done = run_job(tmp_path, 3, {"steps": 6, "veto": {"uid": 1, "step": 3}}, 6, 3,
                   backend)
    assert all(r["rolled_back"] == 1 and r["epoch"] == 0 for r in done)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_while_the_step_commits(tmp_path, backend):
    done = run_job(tmp_path, 3, {"steps": 8, "kills": [{"uid": 2, "step": 4, "when": "commit"}]},
                   8, 2, backend)
    assert done[0]["epoch"] == 1
    fr_names(tmp_path, [2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_of_five_die_at_once(tmp_path, backend):
    kills = [{"uid": 1, "step": 5, "when": "during"}, {"uid": 3, "step": 5, "when": "before"}]
    done = run_job(tmp_path, 5, {"steps": 10, "kills": kills, "numel": 1 << 16}, 10, 3,
                   backend)
    assert done[0]["members"] == [0, 2, 4] and done[0]["epoch"] == 1
    assert done[0]["history"][0]["removed"] == [1, 3]
    fr_names(tmp_path, [1, 3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_hung_peer_is_caught_by_heartbeat_and_left_out(tmp_path, backend):
    job = make_job(tmp_path, 3, {"steps": 10, "timeout": 8,
                                 "kills": [{"uid": 1, "step": 4, "when": "stop"}]}, backend)
    job.start_all()
    began = time.monotonic()
    while time.monotonic() - began < 40:  # the survivors finish; the stopped one never does
        if all(job.finished(u) for u in (0, 2)):
            break
        time.sleep(0.1)
    job.signal(1, signal.SIGKILL)
    done = check_survivors(job.finish(), 10, 2)
    assert done[0]["members"] == [0, 2]
    assert "stopped heartbeating" in (done[0]["history"][0]["failure"] or "")
    fr_names(tmp_path, [1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_during_a_reconfiguration(tmp_path, backend):
    # uid 3 dies at step 4; the moment the survivors start forming epoch 1, uid 1 is killed
    job = make_job(tmp_path, 4, {"steps": 10, "numel": 1 << 16,
                                 "kills": [{"uid": 3, "step": 4, "when": "during"}]}, backend)
    job.start_all()
    store = job.store()
    store.wait(["ft/alive/1/0"], timeout=40)
    job.signal(1, signal.SIGKILL)
    done = check_survivors(job.finish(), 10, 2)
    assert done[0]["members"] == [0, 2]
    fr_names(tmp_path, [3, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_replacement_joins_receives_state_and_takes_part(tmp_path, backend):
    # on mpi, rank 0 spawns the replacement into the job after the shrink ("replace")
    job = make_job(tmp_path, 3, {"steps": 400, "sleep": 0.03, "finish_after_epoch": 2,
                                 "kills": [{"uid": 2, "step": 5, "when": "during"}],
                                 "replace": True}, backend)
    job.start_all()
    store = job.store()
    store.wait(["ft/view/1"], timeout=40)  # the shrink happened: start the replacement
    job.add_joiner()
    done = check_survivors(job.finish(), None, 3)
    joiner = done[2]
    assert joiner["uid"] == 3 and done[0]["members"] == [0, 1, 3]
    assert [h["reason"] for h in done[0]["history"]] == ["failure during step 5", "grow"]
    assert done[0]["history"][1]["joined"] == [3]


def test_joiner_that_dies_before_receiving_state(tmp_path):
    # tcp only: a process enters an MPI job only as a replacement spawned after a failure
    job = Job(tmp_path, 3, {"steps": 400, "sleep": 0.03, "joiner_dies": "before_state",
                            "finish_after_epoch": 2})
    job.start_all()
    job.store().wait(["ft/commit/0/2/decision"], timeout=40)
    job.start(-1)
    done = check_survivors(job.finish(), None, 3)
    assert done[0]["members"] == [0, 1, 2]
    reasons = [h["reason"] for h in done[0]["history"]]
    assert reasons[0] == "grow" and reasons[1].startswith("failure"), reasons
    fr_names(tmp_path, [3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_connection_dropped_and_reestablished(tmp_path, backend):
    done = run_job(tmp_path, 3, {"steps": 12, "drop_store_at": 3,
                              "kills": [{"uid": 2, "step": 6, "when": "during"}]},
                   12, 2, backend)
    assert all(r["store_drops"] == 1 for r in done)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sub_groups_are_rederived_from_the_survivors(tmp_path, backend):
    done = run_job(tmp_path, 5, {"steps": 10, "subgroup": True,
                              "kills": [{"uid": 2, "step": 4, "when": "during"}]},
                   10, 4, backend)
    for r in done:
        parity = [u for u in (0, 1, 3, 4) if u % 2 == r["uid"] % 2]
        assert r["sub"]["members"] == parity and r["sub"]["epoch"] == 1
        assert r["sub"]["rank"] == parity.index(r["uid"])
        assert r["sub"]["last_sum"] == float(sum(parity))  # it works at the new epoch


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_shrink_keeps_every_live_member(tmp_path, backend):
    done = run_job(tmp_path, 3, {"steps": 4, "explicit": True}, 4, 3, backend)
    assert all(r["explicit"] == [3, 1] for r in done)  # same members, next epoch


def test_rma_windows_are_invalidated_by_a_shrink_and_can_be_recreated(tmp_path):
    # tcp only: the mpi backend has no RMA windows (pg.window raises K201 there)
    done = run_job(tmp_path, 3, {"steps": 8, "window": True,
                              "kills": [{"uid": 1, "step": 3, "when": "during"}]},
                   8, 2)
    for r in done:
        assert "reconfigured to epoch 1" in r["old_window"], r["old_window"]
        left = r["members"][(r["rank"] - 1) % 2]  # its left neighbour put its uid here
        assert r["window_from"] == float(left)
