"""Processes of the fault-tolerance tests (see test_fault_tolerance.py).

    python ft_workers.py trainer UID WORLD STORE_ADDR RESULT_JSON ARGS_JSON   (UID -1: a joiner)

`trainer` runs a data-parallel loop whose result is known exactly: the state after
n committed steps is sum(1..n) (every rank contributes the step number, averaged),
whoever died or joined on the way. A rank kills itself with SIGKILL at a chosen step
and point (before, during or after a chosen collective, during the commit).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import numpy as np

import kiln.distributed as dist
from workers import SCENARIOS, main
from kiln.distributed import DistributedError


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def start(pg, kind: str, g: np.ndarray):
    """Start one collective of `kind` that leaves the step's average gradient in g;
    returns (work, finish)."""
    if kind == "all_reduce":
        return pg.all_reduce(g, op="avg"), lambda: None
    if kind == "broadcast":  # every rank holds the same g already
        return pg.broadcast(g, src=0), lambda: None
    if kind == "barrier":
        return pg.barrier(), lambda: None
    if kind == "all_to_all":
        out = np.empty(pg.world_size * g.size, g.dtype)
        work = pg.all_to_all(out, np.tile(g, pg.world_size))

        def finish():
            g[:] = out.reshape(pg.world_size, -1).mean(axis=0)
        return work, finish
    raise ValueError(kind)


def trainer(uid, world, addr, args):
    joiner = uid < 0
    # a joiner is started "by hand": the job's store and token, no rank or world size
    pg = dist.init_process_group(rank=None if joiner else uid,
                                 world_size=None if joiner else world, store=addr,
                                 token=os.environ["KILN_TOKEN"], timeout=args.get("timeout", 10),
                                 host_store=False, fault_tolerant=True, join=joiner,
                                 min_size=args.get("min_size", 1))
    me = pg.global_ranks[pg.rank]
    state = {"x": np.zeros(4, np.float64), "step": np.zeros(1, np.int64)}

    def load(arrays):
        state.update({k: v.copy() for k, v in arrays.items()})

    if joiner and args.get("joiner_dies") == "before_state":
        die()
    pg.register_state(lambda: state, load)
    if joiner and args.get("joiner_dies") == "after_state":
        die()
    sub = pg.split(color=me % 2, key=me) if args.get("subgroup") else None
    win = pg.window(np.zeros(4, np.float32)) if args.get("window") else None
    kills = {(k["uid"], k["step"]): k for k in args.get("kills", [])}
    steps, epochs, failures, store_drops, sub_sums = args["steps"], [], 0, 0, []
    vetoed = False
    began = time.monotonic()
    while True:
        if pg.epoch >= args.get("finish_after_epoch", 1 << 30) and steps == args["steps"]:
            # three more steps once the awaited membership changes happened (whenever a
            # loaded machine lets them); every member, a joiner too, sees the new epoch
            # first at the same committed step, so they agree on the last step
            steps = pg.committed_step + 3
        if pg.committed_step >= steps:
            break
        step = pg.committed_step + 1
        kill = kills.get((me, step))
        g = np.full(args.get("numel", 4), float(step))
        try:
            if kill and kill["when"] == "before":
                die()
            if kill and kill["when"] == "stop":  # hung: alive to the kernel, silent to peers
                os.kill(os.getpid(), signal.SIGSTOP)
            work, finish = start(pg, args.get("kind", "all_reduce"), g)
            if kill and kill["when"] == "during":
                time.sleep(0.01)  # its messages are on the way: the peers are inside it
                die()
            work.wait()
            finish()
            if sub is not None:  # the sub-group's own collective: the parity's sum of uids
                h = np.array([float(me)])
                sub.all_reduce(h).wait()
                sub_sums.append(float(h[0]))
            if kill and kill["when"] == "after":
                die()
        except DistributedError:
            failures += 1
        if kill and kill["when"] == "commit":
            die()
        if args.get("sleep"):
            time.sleep(args["sleep"])
        if step == args.get("drop_store_at") and store_drops == 0:
            # cut the store connections under the group's feet: they must reconnect
            for client in (pg.store, pg._ft.membership.store._store):
                client._sock.shutdown(socket.SHUT_RDWR)
            store_drops += 1
        veto = args.get("veto")  # this member says no once: the step is done again
        ok = not (veto and veto["uid"] == me and veto["step"] == step and not vetoed)
        vetoed = vetoed or not ok
        if pg.should_commit(ok):
            state["x"] += g[:4]
            state["step"][0] = step

        epochs.append(pg.epoch)
    data = {"uid": me, "rank": pg.rank, "world_size": pg.world_size, "epoch": pg.epoch,
            "x": state["x"].tolist(), "step": int(state["step"][0]),
            "committed": pg.committed_step, "failures": failures, "store_drops": store_drops,
            "rolled_back": pg._ft.rolled_back,
            "members": list(pg.global_ranks), "history": pg._ft.history,
            "seconds": time.monotonic() - began}
    if sub is not None:
        data["sub"] = {"members": list(sub.global_ranks), "epoch": sub.epoch,
                       "rank": sub.rank, "last_sum": sub_sums[-1]}
    if win is not None:  # the old epoch's window is dead; a new one works
        try:
            win.put((pg.rank + 1) % pg.world_size, np.ones(4, np.float32))
            data["old_window"] = "usable"
        except dist.WindowInvalidated as err:
            data["old_window"] = str(err)
        fresh = pg.window(np.zeros(4, np.float32))
        fresh.put((pg.rank + 1) % pg.world_size, np.full(4, float(me), np.float32)).wait()
        fresh.signal((pg.rank + 1) % pg.world_size).wait()
        fresh.wait_signal(timeout=10)
        data["window_from"] = float(fresh.local[0])
    if args.get("explicit"):  # every member shrinks, then grows (admitting any joiner)
        data["explicit"] = [pg.shrink(), pg.epoch]
    dist.destroy_process_group()
    return data


SCENARIOS["trainer"] = trainer

if __name__ == "__main__":
    main()
