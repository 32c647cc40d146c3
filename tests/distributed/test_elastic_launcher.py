"""Elastic `kiln launch`: policies (abort, shrink, replace), limits, injected faults, events.

The workers are small scripts (no process group): they loop over steps calling
`report_step`, sleeping 20 ms, append each step to a log, and write a JSON file with
their environment when done. So these tests check the launcher alone; the group's
shrink and join are tested with the group.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import worker_env
from kiln.distributed import elastic
from kiln.distributed.errors import FaultInjectionError, LaunchError

WORKER = r'''
import json, os, sys, time
from kiln.distributed import elastic

out = sys.argv[1]
cfg = json.loads(sys.argv[2])
rank = int(os.environ["KILN_RANK"])
if cfg.get("form_group"):  # as a fault-tolerant group's first rendezvous does, before step 0
    from kiln.distributed.store import Store
    store = Store(os.environ["KILN_STORE"], os.environ["KILN_TOKEN"])
    if rank == 0:
        store.set("ft/view/0", "{}")
    store.wait(["ft/view/0"], timeout=20)
    store.close()
hooks = []
elastic.on_drop_conn(lambda: hooks.append(time.time()))
log = open(os.path.join(out, "steps_%d_%d.log" % (rank, os.getpid())), "w", buffering=1)
for step in range(cfg.get("steps", 40)):
    elastic.report_step(step)
    log.write("%d\n" % step)
    if rank == cfg.get("fail_rank") and step == cfg.get("fail_step"):
        sys.exit(cfg.get("fail_code", 1))
    time.sleep(0.02)
keys = ["KILN_RANK", "KILN_WORLD_SIZE", "KILN_JOIN", "KILN_REPLACES", "KILN_RESTART_COUNT",
        "KILN_LAUNCHER"]
info = {"env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid(), "end": time.time(),
        "drops": elastic.drop_count(), "hooks": len(hooks)}
with open(os.path.join(out, "done_%d_%d.json" % (rank, os.getpid())), "w") as f:
    json.dump(info, f)
'''


def launch(tmp_path: Path, *args: str, steps: int = 40, timeout: float = 30,
           **cfg) -> subprocess.CompletedProcess:
    """Run `kiln launch ARGS worker.py` in tmp_path; the workers write into tmp_path/out."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = worker_env(tmp_path, "unused")
    env.pop("KILN_TOKEN")  # the launcher makes one
    cmd = [sys.executable, "-m", "kiln.distributed", "launch", "--grace", "2", *args,
           str(script), str(out), json.dumps(dict(cfg, steps=steps))]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


def done(tmp_path: Path) -> dict[int, list[dict]]:
    """rank -> the done files of the processes that finished in that slot, by start."""
    result: dict[int, list[dict]] = {}
    for path in sorted((tmp_path / "out").glob("done_*.json")):
        info = json.loads(path.read_text())
        result.setdefault(int(info["env"]["KILN_RANK"]), []).append(info)
    return result


def steps_logged(tmp_path: Path, rank: int) -> list[list[int]]:
    """The steps each process of slot `rank` logged."""
    return [[int(s) for s in p.read_text().split()]
            for p in sorted((tmp_path / "out").glob("steps_%d_*.log" % rank))]


def events(path: Path, kind: str | None = None) -> list[dict]:
    report = json.loads(path.read_text())
    return [e for e in report["events"] if kind is None or e["kind"] == kind]


@pytest.mark.timeout(30)
def test_abort_stops_the_others_and_fails(tmp_path):
    proc = launch(tmp_path, "--nproc", "3", "--inject", "kill:rank=1,step=5", steps=300)
    assert proc.returncode == 128 + 9, proc.stderr
    assert "worker rank 1 (local rank 1, pid" in proc.stderr
    assert "killed by signal SIGKILL" in proc.stderr
    assert "terminated the other workers" in proc.stderr
    assert "job failed: rank 1 died (--on-failure abort)" in proc.stderr
    assert done(tmp_path) == {}  # nobody ran its 300 steps to the end


@pytest.mark.timeout(30)
def test_shrink_lets_the_others_finish_and_records_the_death(tmp_path):
    report = tmp_path / "events.json"
    proc = launch(tmp_path, "--nproc", "3", "--on-failure", "shrink",
                  "--inject", "kill:rank=2,step=5", "--events-json", str(report))
    assert proc.returncode == 0, proc.stderr
    finished = done(tmp_path)
    assert sorted(finished) == [0, 1]
    # the step trigger is exact: the worker stands still in report_step(5) until killed
    assert steps_logged(tmp_path, 2) == [[0, 1, 2, 3, 4]]
    [died] = events(report, "died")
    assert died["rank"] == 2 and died["signal"] == "SIGKILL" and died["returncode"] == -9
    [injected] = events(report, "injected")
    assert injected["fault"] == "kill" and injected["step"] == 5
    assert injected["since_start"] <= died["since_start"]
    assert sorted(e["rank"] for e in events(report, "exited")) == [0, 1]
    data = json.loads(report.read_text())
    assert data["exit_code"] == 0 and data["on_failure"] == "shrink" and data["world_size"] == 3
    assert "2 of 3 workers go on (--on-failure shrink)" in proc.stderr
    assert "summary" in proc.stderr and "injected SIGKILL into rank 2" in proc.stderr
    assert "rank 2 (pid %d) died: killed by signal SIGKILL" % died["pid"] in proc.stderr


@pytest.mark.timeout(30)
def test_replace_starts_a_joiner_with_the_contract_environment(tmp_path):
    report = tmp_path / "events.json"
    proc = launch(tmp_path, "--nproc", "2", "--on-failure", "replace", "--max-restarts", "1",
                  "--inject", "kill:rank=1,step=3", "--events-json", str(report), steps=20,
                  form_group=True)
    assert proc.returncode == 0, proc.stderr
    finished = done(tmp_path)
    assert finished[0][0]["env"] == {"KILN_RANK": "0", "KILN_WORLD_SIZE": "2", "KILN_JOIN": None,
                                     "KILN_REPLACES": None, "KILN_RESTART_COUNT": "0",
                                     "KILN_LAUNCHER": "1"}
    [joiner] = finished[1]  # the original rank 1 was killed, so this is the replacement
    assert joiner["env"] == {"KILN_RANK": "1", "KILN_WORLD_SIZE": "2", "KILN_JOIN": "1",
                             "KILN_REPLACES": "1", "KILN_RESTART_COUNT": "1",
                             "KILN_LAUNCHER": "1"}
    [died] = events(report, "died")
    [replaced] = events(report, "replaced")
    assert replaced["pid"] == joiner["pid"] and replaced["replaces_pid"] == died["pid"]
    assert replaced["restart_count"] == 1 and replaced["joins"] is True
    assert "started a replacement for rank 1" in proc.stderr


@pytest.mark.timeout(30)
def test_replace_before_the_group_formed_takes_the_dead_ranks_place(tmp_path):
    # no first rendezvous yet (no ft/view/0): nobody could admit a joiner, so the
    # replacement runs in the dead worker's place, without KILN_JOIN
    report = tmp_path / "events.json"
    proc = launch(tmp_path, "--nproc", "2", "--on-failure", "replace", "--max-restarts", "1",
                  "--inject", "kill:rank=1,step=3", "--events-json", str(report), steps=20)
    assert proc.returncode == 0, proc.stderr
    [replacement] = done(tmp_path)[1]
    assert replacement["env"] == {"KILN_RANK": "1", "KILN_WORLD_SIZE": "2", "KILN_JOIN": None,
                                  "KILN_REPLACES": "1", "KILN_RESTART_COUNT": "1",
                                  "KILN_LAUNCHER": "1"}
    [replaced] = events(report, "replaced")
    assert replaced["joins"] is False and replaced["pid"] == replacement["pid"]
    assert "takes rank 1's place in the first rendezvous" in proc.stderr


@pytest.mark.timeout(30)
def test_replace_is_limited_by_max_restarts(tmp_path):
    # every process in slot 1 exits 1 at step 2: one replacement, then the job fails
    report = tmp_path / "events.json"
    proc = launch(tmp_path, "--nproc", "2", "--on-failure", "replace", "--max-restarts", "1",
                  "--events-json", str(report), steps=200, fail_rank=1, fail_step=2,
                  fail_code=3)
    assert proc.returncode == 3, proc.stderr
    assert "job failed: rank 1 died and the --max-restarts 1 replacements are used up" \
        in proc.stderr
    assert [e["kind"] for e in events(report) if e["rank"] == 1] == ["died", "replaced", "died"]
    assert [e["exit_code"] for e in events(report, "died")] == [3, 3]
    assert len(steps_logged(tmp_path, 1)) == 2


@pytest.mark.timeout(30)
def test_kill_by_time_and_min_size(tmp_path):
    report = tmp_path / "events.json"
    proc = launch(tmp_path, "--nproc", "3", "--on-failure", "shrink", "--min-size", "3",
                  "--inject", "kill:rank=0,after=1s", "--events-json", str(report), steps=300)
    assert proc.returncode == 128 + 9, proc.stderr
    assert "only 2 of 3 workers are live, fewer than --min-size 3" in proc.stderr
    [injected] = events(report, "injected")
    # after=1s: never early; the upper bound allows a launcher scheduled late on a loaded
    # machine, and still comes before the 300 steps (6 s at least) would end
    assert injected["rank"] == 0 and 1.0 <= injected["since_start"] < 1.0 + 4.0
    assert "step" not in injected
    assert done(tmp_path) == {}


@pytest.mark.timeout(30)
def test_stop_then_continue_the_stopped_worker_finishes_later(tmp_path):
    report = tmp_path / "events.json"
    proc = launch(tmp_path, "--nproc", "2", "--on-failure", "shrink",
                  "--inject", "stop:rank=1,after=500ms,for=1.5s", "--events-json", str(report))
    assert proc.returncode == 0, proc.stderr
    finished = done(tmp_path)
    assert sorted(finished) == [0, 1]
    stop, cont = events(report, "injected")
    assert (stop["fault"], cont["fault"], stop["for"]) == ("stop", "cont", 1.5)
    # it was held until continued (its 40 steps take 0.8 s, the stop came at 0.5 s); not
    # compared with rank 0's end: the two workers' start-up can differ by most of a second
    assert finished[1][0]["end"] >= cont["time"]
    # continued after the 1.5 s; the upper bound leaves room for a launcher that a loaded
    # machine schedules late (CI runs about 2x slower than an idle machine)
    assert 1.4 <= cont["since_start"] - stop["since_start"] < 1.5 + 3.0
    assert events(report, "died") == []


@pytest.mark.timeout(30)
def test_stopped_for_good_is_killed_when_the_others_are_done(tmp_path):
    report = tmp_path / "events.json"
    proc = launch(tmp_path, "--nproc", "2", "--on-failure", "shrink",
                  "--inject", "stop:rank=0,step=3", "--events-json", str(report), steps=15)
    assert proc.returncode == 0, proc.stderr
    assert sorted(done(tmp_path)) == [1]
    [died] = events(report, "died")
    assert died["rank"] == 0 and died["signal"] == "SIGKILL"
    assert "rank 0 is still stopped by --inject while every other worker is done" in proc.stderr


@pytest.mark.timeout(30)
def test_drop_conn_the_worker_reconnects(tmp_path):
    report = tmp_path / "events.json"
    proc = launch(tmp_path, "--nproc", "2", "--inject", "drop-conn:rank=1,after=500ms",
                  "--events-json", str(report), steps=60)
    assert proc.returncode == 0, proc.stderr
    finished = done(tmp_path)
    assert (finished[1][0]["drops"], finished[1][0]["hooks"]) == (1, 1)
    assert (finished[0][0]["drops"], finished[0][0]["hooks"]) == (0, 0)
    [injected] = events(report, "injected")
    [reconnected] = events(report, "reconnected")
    assert injected["fault"] == "drop-conn" and reconnected["rank"] == 1
    assert reconnected["since_start"] >= injected["since_start"]


@pytest.mark.timeout(30)
def test_sigterm_reaches_the_workers_and_the_launcher_never_hangs(tmp_path):
    # a worker that ignores SIGTERM is SIGKILLed after --grace
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print('ready', flush=True)\ntime.sleep(60)\n")
    env = worker_env(tmp_path, "unused")
    env.pop("KILN_TOKEN")
    launcher = subprocess.Popen([sys.executable, "-m", "kiln.distributed", "launch", "--nproc",
                                 "2", "--grace", "1", str(script)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""  # two workers share the pipe: their lines may interleave ("readyready\n\n")
    while seen.count("ready") < 2:
        line = launcher.stdout.readline()
        assert line, "the launcher's output ended before both workers were ready: %r" % seen
        seen += line
    t0 = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=20)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("spec, rule", [
    ("kill", "the kind before ':' must be one of kill, stop, drop-conn"),
    ("crash:rank=1,step=2", "the kind before ':' must be one of"),
    ("kill:step=2", "rank=R is required"),
    ("kill:rank=1", "give exactly one trigger, step=S or after=T"),
    ("kill:rank=1,step=2,after=1s", "give exactly one trigger"),
    ("kill:rank=1,after=3", "after= must be a duration with a unit"),
    ("kill:rank=-1,step=2", "rank= must be a non-negative integer"),
    ("kill:rank=1,step=x", "step= must be a non-negative integer"),
    ("kill:rank=1,rank=2,step=1", "rank= is given twice"),
    ("kill:rank=1,after=1s,for=2s", "kill does not take for="),
    ("stop:rank=1,after=1s,for=0s", "for= must be longer than 0 s"),
    ("drop-conn:rank=1,,after=1s", "'' is not key=value"),
])
def test_bad_inject_specs_name_the_spec_and_the_rule(spec, rule):
    with pytest.raises(FaultInjectionError) as info:
        elastic.parse_fault(spec)
    assert info.value.code == "K213" and isinstance(info.value, LaunchError)
    assert repr(spec) in str(info.value) and rule in str(info.value)


def test_good_inject_specs():
    assert elastic.parse_fault("stop:rank=3,after=250ms,for=2s") == elastic.Fault(
        "stop", 3, "stop:rank=3,after=250ms,for=2s", after=0.25, duration=2.0)
    assert elastic.parse_fault("drop-conn:rank=0,step=7").step == 7


@pytest.mark.timeout(30)
def test_bad_inject_on_the_command_line_and_bad_policy_settings(tmp_path):
    proc = launch(tmp_path, "--nproc", "2", "--inject", "kill:rank=2,step=1")
    assert proc.returncode == 2
    assert "[K213] bad --inject spec 'kill:rank=2,step=1': rank 2 is not in the job" in proc.stderr
    proc = launch(tmp_path, "--nproc", "2", "--inject", "kill:rank=0,after=1")
    assert proc.returncode == 2 and "after= must be a duration with a unit" in proc.stderr
    proc = launch(tmp_path, "--nproc", "2", "--min-size", "3")
    assert proc.returncode == 2 and "--min-size must be between 1 and the job's 2" in proc.stderr
    assert not list((tmp_path / "out").glob("*"))  # nothing was started


def test_report_step_is_a_no_op_outside_kiln_launch(monkeypatch):
    monkeypatch.delenv("KILN_LAUNCHER", raising=False)
    assert elastic.launch_info() is None
    for step in range(3):
        elastic.report_step(step)
    assert elastic.drop_count() == 0
