"""`kiln launch --engine mpi` and examples/train_ddp_ft.py on the mpi backend: four ranks
under mpirun with ULFM, rank 2 SIGKILLed mid-run; the survivors shrink in place, rank 0
spawns a replacement that joins with the state, every rank ends with identical
parameters and the loss curve of the fault-free run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpi_harness import needs_mpi

pytestmark = [needs_mpi, pytest.mark.timeout(240)]

JOB = '''
import json, sys
import numpy as np
import kiln.distributed as dist
pg = dist.init_process_group("mpi", timeout=20.0)
x = np.full(3, pg.rank + 1.0)
pg.all_reduce(x).wait()
open(sys.argv[1] + "/rank%d.json" % pg.rank, "w").write(json.dumps(
    {"x": x.tolist(), "world": pg.world_size, "backend": pg.backend.name}))
dist.destroy_process_group()
'''


def test_launch_engine_mpi_runs_the_script_on_n_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = subprocess.run([sys.executable, "-m", "kiln", "launch", "--engine", "mpi", "--nproc",
                           "3", str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = [json.loads((tmp_path / ("rank%d.json" % r)).read_text()) for r in range(3)]
    assert all(r == {"x": [6.0] * 3, "world": 3, "backend": "mpi"} for r in results)


@pytest.mark.parametrize("flags, words", [
    (["--inject", "kill:rank=1,step=2"], "--inject is not available"),
    (["--nnodes", "2"], "needs --hostfile"),
    (["--rdzv", "10.0.0.1:29500"], "--rdzv"),
])
def test_launch_engine_mpi_refuses_the_tcp_engine_options(tmp_path, capsys, flags, words):
    from kiln.cli import main

    assert main(["launch", "--engine", "mpi", "--nproc", "2", *flags, "job.py"]) == 2
    err = capsys.readouterr().err
    assert "K232" in err and words in err, err


def test_example_training_survives_kill_9_on_mpi(tmp_path):
    from examples.train_ddp_ft import main

    # more steps than on tcp: the replacement is spawned into the job (MPI_Comm_spawn, then
    # the new process starts Python and kiln: ~110-130 steps of this loop here) before it
    # joins at a step commit
    report = main(["--backend", "mpi", "--steps", "300", "--kill-step", "8",
                   "--out", str(tmp_path), "--timeout", "200"])
    assert report["ranks_finished"] == 4 and report["identical_parameters"]
    assert report["final_world_size"] == 4 and report["epochs"] == 2  # shrink, then grow
    assert report["max_rel_loss_diff_vs_fault_free"] < 1e-4
    assert 1 <= report["steps_lost"] <= 3
    assert report["joiner_joined_at_step"] > 8
    assert report["loss_last"] < report["loss_first"] / 3


def test_the_mpi_job_ends_by_itself_when_a_replacement_comes_after_the_last_step(tmp_path):
    """The kill lands at the last step: rank 0 spawns a replacement into a job that is about
    to end. The survivors redo the step and finish; the replacement joins at that final
    commit or is released; either way the job ends by itself (it once stayed in
    MPI_Finalize for good) and succeeds."""
    from examples import train_ddp_ft

    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "launch", "--engine", "mpi", "--nproc", "3",
         "--on-failure", "replace", "--max-restarts", "1", train_ddp_ft.__file__, "--worker",
         "--backend", "mpi", "--steps", "6", "--kill-self", "6:1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "killed_6.json").exists()  # rank 1 did die at the last step
    results = [json.loads(p.read_text()) for p in tmp_path.glob("rank_uid*.json")]
    assert len({r["digest"] for r in results}) == 1
    assert all(r["committed"] == 6 for r in results)
    joined = [r for r in results if r["joined"]]
    released = "the job ended before this replacement was admitted" in proc.stdout + proc.stderr
    assert released != bool(joined), (released, results)
    assert len(results) == 2 + len(joined)
