"""Strangers on the data ports during a real rendezvous of three processes, and again
during a `split`: an idle connection, 4 KB of `[` before authentication, garbage,
and a connection that knows the token but belongs to another epoch. The job must
succeed, with correct results, and no rank may print a traceback.

The test hosts the store. Each rank reads a peer's data-port address from the store
just before connecting to it; the ranks' store client (`GatedStore`) first waits
until the test has attached its strangers to that port, so the strangers always
arrive before the real peer (the case that once failed the rendezvous).

Run as a script, this file is one rank:  python test_servers_rendezvous.py RANK WORLD STORE OUT
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORLD = 3
_GATE = "test/strangers-on/"


# -- the rank (a subprocess) -------------------------------------------------------------
def _rank_main(rank: int, world: int, address: str, out: str) -> None:
    import numpy as np

    import kiln.distributed as dist
    from kiln.distributed.store import Store

    class GatedStore(Store):
        def get(self, key, timeout=None):
            if "/addr/" in key:  # about to connect to that data port: strangers first
                Store.wait(self, [_GATE + key], timeout=60)
            return Store.get(self, key, timeout)

    token = os.environ["KILN_TOKEN"]
    store = GatedStore(address, token, timeout=60)
    pg = dist.init_process_group(rank=rank, world_size=world, store=store, token=token,
                                 timeout=40, host_store=False)
    x = np.arange(8, dtype=np.float32) * (rank + 1)
    pg.all_reduce(x).wait()
    expected = np.arange(8, dtype=np.float32) * sum(range(1, world + 1))
    assert np.array_equal(x, expected), x
    sub = pg.split([0, 1])
    got = None
    if sub is not None:
        y = np.full(4, float(rank + 1), np.float64)
        sub.all_reduce(y).wait()
        assert np.array_equal(y, np.full(4, 3.0)), y
        got = y.tolist()
    pg.barrier().wait()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"sum": x.tolist(), "split": got}))


# -- the test ----------------------------------------------------------------------------
class Strangers:
    """Watches the store for data-port addresses; attaches hostile connections to each
    port, then opens the gate for the ranks that will connect there."""

    def __init__(self, store, token: str):
        self.store, self.token = store, token
        self.socks: list[socket.socket] = []
        self.ports: list[str] = []
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        seen = set()
        try:
            while not self.stop.wait(0.02):
                for key in self.store.list_keys("pg/"):
                    if "/addr/" in key and key not in seen:
                        seen.add(key)
                        self._attack(self.store.get(key).decode())
                        self.ports.append(key)
                        self.store.set(_GATE + key, b"1")
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.errors.append(err)

    def _attack(self, address: str) -> None:
        from kiln.distributed.protocol import client_handshake

        host, port = address.rsplit(":", 1)
        target = (host, int(port))

        def connect() -> socket.socket:
            sock = socket.create_connection(target, timeout=10)
            self.socks.append(sock)
            return sock

        connect()  # idle: says nothing, ever
        deep = connect()  # 4 KB of '[' (the whole pre-authentication allowance)
        deep.sendall(struct.pack("!II", 4096, 4088) + b"[" * 4088)
        connect().sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(64))
        stale = connect()  # knows the token, but is from an earlier epoch

        def stale_member() -> None:
            try:
                client_handshake(stale, self.token, "kiln-data", 10,
                                 hello={"group": "pg/world/e7", "rank": 1, "lane": 0,
                                        "epoch": 7})
            except Exception:  # noqa: BLE001 - refused or closed: both are fine
                pass
        threading.Thread(target=stale_member, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for sock in self.socks:
            sock.close()


def test_strangers_on_the_data_ports_do_not_fail_the_rendezvous(tmp_path):
    from kiln.distributed.store import Store, StoreServer

    token = secrets.token_hex(16)
    server = StoreServer("127.0.0.1", 0, token)
    watcher_store = Store(server.address, token, timeout=30)
    strangers = Strangers(watcher_store, token)
    env = dict(os.environ, KILN_TOKEN=token,
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    try:
        for rank in range(WORLD):
            cmd = [sys.executable, __file__, str(rank), str(WORLD), server.address,
                   str(tmp_path / ("rank%d.json" % rank))]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        outputs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            outputs.append(out.decode())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        strangers.close()
        watcher_store.close()
        server.close()
    assert strangers.errors == []
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, "rank %d failed:\n%s" % (rank, out[-3000:])
        assert "Traceback" not in out and "RecursionError" not in out, out[-3000:]
    # every data port of both rendezvous (world: ranks 0-2; split: ranks 0-1) was attacked
    assert sorted(strangers.ports) == ["pg/world.s0/e0/addr/0", "pg/world.s0/e0/addr/1",
                                       "pg/world/e0/addr/0", "pg/world/e0/addr/1",
                                       "pg/world/e0/addr/2"]
    results = [json.loads((tmp_path / ("rank%d.json" % r)).read_text()) for r in range(WORLD)]
    assert all(r["sum"] == [6.0 * i for i in range(8)] for r in results)
    assert [r["split"] for r in results] == [[3.0] * 4, [3.0] * 4, None]


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
