"""The fault-tolerance scenarios of test_fault_tolerance.py on backend "nccl", over the
fake NCCL served from this process to the rank processes (fake_nccl_remote.py): ranks
die by SIGKILL during a collective and during a commit, a replacement joins, sub-groups
are re-derived (a deliberate end of epoch with nobody excluded is covered there and by
the grow: "shrink (none excluded)"). The same checks as on tcp and mpi (every
survivor at the same epoch with state exactly sum(1..steps)), plus how each process
made its communicators: in place by ncclCommShrink / ncclCommGrow / ncclCommSplit after
the first init, never by a second ncclCommInitRankConfig."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.fake_nccl_remote import FakeNcclServer
from tests.distributed.harness import worker_env
from tests.distributed.test_fault_tolerance import Job, check_survivors, fr_names

WORKERS = Path(__file__).with_name("nccl_ft_workers.py")
pytestmark = pytest.mark.timeout(120)


class NcclJob(Job):
    """A Job whose trainers run on nccl over one FakeNcclServer."""

    def __init__(self, tmp_path: Path, world: int, args: dict):
        super().__init__(tmp_path, world, args)
        self.fake = FakeNcclServer(init_polls=1)

    def start(self, uid: int) -> subprocess.Popen:
        out = self.tmp / ("result%d.json" % len(self.procs))
        env = worker_env(self.tmp, self.token, {"KILN_FAKE_NCCL": self.fake.address})
        proc = subprocess.Popen(
            [sys.executable, str(WORKERS), "nccl_trainer", str(uid), str(self.world),
             self.server.address, str(out), json.dumps(self.args)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.outs.append(out)
        return proc

    def finish(self, timeout: float = 60.0) -> list:
        try:
            return super().finish(timeout)
        finally:
            self.fake.close()


def run(tmp_path: Path, world: int, args: dict, steps: int | None, alive: int) -> list:
    job = NcclJob(tmp_path, world, args)
    job.start_all()
    return check_survivors(job.finish(), steps, alive)


def hows(result: dict, group: str = "pg/world") -> list[str]:
    return [h["how"] for h in result["nccl"] if h["group"] == group]


def test_sigkill_during_a_collective_shrinks_the_communicator_in_place(tmp_path):
    kills = [{"uid": 3, "step": 3, "when": "during"}, {"uid": 1, "step": 6, "when": "after"}]
    done = run(tmp_path, 4, {"steps": 8, "kills": kills, "numel": 1 << 12}, 8, 2)
    assert done[0]["members"] == [0, 2] and done[0]["epoch"] == 2
    assert [h["removed"] for h in done[0]["history"]] == [[3], [1]]
    for r in done:
        assert hows(r) == ["init", "shrink", "shrink"], r["nccl"]
    fr_names(tmp_path, [3, 1])


def test_sigkill_while_the_step_commits(tmp_path):
    done = run(tmp_path, 3, {"steps": 6, "kills": [{"uid": 2, "step": 3, "when": "commit"}]},
               6, 2)
    assert done[0]["epoch"] == 1
    assert all(hows(r) == ["init", "shrink"] for r in done)


def test_replacement_joins_by_nccl_comm_grow(tmp_path):
    job = NcclJob(tmp_path, 3, {"steps": 400, "sleep": 0.03, "finish_after_epoch": 2,
                                "kills": [{"uid": 2, "step": 4, "when": "during"}]})
    job.start_all()
    job.store().wait(["ft/view/1"], timeout=40)  # the shrink happened: start the replacement
    job.add_joiner()
    done = check_survivors(job.finish(), None, 3)
    assert done[2]["uid"] == 3 and done[0]["members"] == [0, 1, 3]
    assert [h["reason"] for h in done[0]["history"]] == ["failure during step 4", "grow"]
    for r in done[:2]:
        assert hows(r) == ["init", "shrink", "shrink (none excluded) + grow"], r["nccl"]
    assert hows(done[2]) == ["join"]  # the replacement never ran ncclCommInitRankConfig


def test_sub_groups_are_split_then_shrunk_with_the_world(tmp_path):
    done = run(tmp_path, 4, {"steps": 6, "subgroup": True,
                             "kills": [{"uid": 2, "step": 3, "when": "during"}]}, 6, 3)
    for r in done:
        parity = [u for u in (0, 1, 3) if u % 2 == r["uid"] % 2]
        assert r["sub"]["members"] == parity and r["sub"]["epoch"] == 1
        assert r["sub"]["last_sum"] == float(sum(parity))  # it works at the new epoch
        sub = "pg/world.s0.c%d" % (r["uid"] % 2)
        # the even sub-group lost uid 2; the odd one lost nobody, and shrinks all the same
        # (its communicator ends with the epoch)
        again = "shrink" if r["uid"] % 2 == 0 else "shrink (none excluded)"
        assert hows(r, sub) == ["split", again], r["nccl"]
