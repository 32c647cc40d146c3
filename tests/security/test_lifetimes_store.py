"""Workers end, in bounded time, when their store is lost (issue 11, "Lifetimes").

Two ranks of a plain (not fault-tolerant) group run collectives that never touch the
store; the standalone `kiln store` they rendezvoused through is SIGKILLed. Their
heartbeat sees every store operation fail, and past its bound (2 x dead-after, at
least 5 s) the group fails with StoreLost (K225): the next collective raises and the
worker exits, instead of running on with nobody able to see it hang.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from tests.security.lifetimes import env

WORKER = r'''
import os, sys, time
import numpy as np
import kiln.distributed as dist
rank, addr, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
pg = dist.init_process_group(rank=rank, world_size=2, store=addr, timeout=4.0,
                             token=os.environ["KILN_TOKEN"], host_store=False)
buf = np.ones(4, np.float32)
end = time.monotonic() + 90
calls = 0
while time.monotonic() < end:
    try:
        pg.all_reduce(buf).wait()
    except dist.DistributedError as err:
        print("FAILED after %d calls: %s" % (calls, err), flush=True)
        sys.exit(5)
    calls += 1
    if calls == 20:
        open(os.path.join(out, "running_%d" % rank), "w").close()
    time.sleep(0.02)
print("never failed", flush=True)
'''


@pytest.mark.timeout(120)
def test_a_lost_store_ends_the_workers(tmp_path):
    token = secrets.token_hex(16)
    e = env(tmp_path, KILN_TOKEN=token)
    store = subprocess.Popen([sys.executable, "-m", "kiln.distributed", "store", "--port", "0"],
                             env=e, stdout=subprocess.PIPE, text=True)
    script = tmp_path / "store_worker.py"
    script.write_text(WORKER)
    workers = []
    try:
        line = store.stdout.readline()  # "kiln store: serving on HOST:PORT"
        assert "serving on" in line, line
        addr = line.split()[-1]
        workers = [subprocess.Popen([sys.executable, str(script), str(r), addr, str(tmp_path)],
                                    env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for r in range(2)]
        end = time.monotonic() + 60
        while not all((tmp_path / ("running_%d" % r)).exists() for r in range(2)):
            assert time.monotonic() < end and all(w.poll() is None for w in workers), \
                [w.poll() for w in workers]
            time.sleep(0.05)
        store.send_signal(signal.SIGKILL)
        store.wait(timeout=10)
        lost = time.monotonic()
        outputs = [w.communicate(timeout=60)[0] for w in workers]
        # bounded: dead-after 2 s here, so lost after 5 s plus a store timeout or two
        assert time.monotonic() - lost < 50
        for w, out in zip(workers, outputs):
            assert w.returncode == 5, out
            # the rank that saw it first fails the group, its peer may hear it as an abort
            assert "lost its store at %s" % addr in out, out
        assert any("[K225]" in out for out in outputs), outputs
    finally:
        for proc in [store] + workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
