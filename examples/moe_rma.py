"""Mixture-of-experts token routing with one-sided RMA windows.

    kiln launch --nproc 4 examples/moe_rma.py              # or: python -m kiln launch ...

Every rank holds `--tokens` tokens and owns `--experts-per-rank` experts (expert e lives
on rank e // experts_per_rank). One step of the layer:

1. a top-1 router picks each token's expert; the rank sorts its tokens by expert;
2. an all_gather of the per-expert counts tells every rank how many rows each sender
   has for each expert, so every sender computes where its rows go in every owner's
   receive window, with no further coordination;
3. each sender `put`s its rows for owner o into o's window at that offset and
   `signal`s o: the signal is applied after the put, so o sees the rows once it sees
   the signal;
4. each owner `wait_signal`s for all senders (it calls nothing to receive: its
   backend wrote the rows), applies each expert (a matmul), `put`s the results back
   into the sender's return window, and `signal`s it;
5. each sender `wait_signal`s for all owners, scales by the router's gate and un-sorts.

Rank 0 checks every rank's result against a single-process numpy computation of the
whole layer and prints OK with the time per step.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import kiln.distributed as dist


def layer_inputs(rank: int, tokens: int, dim: int, experts: int, seed: int):
    """This rank's tokens, and the router and expert weights (the same on every rank)."""
    x = np.random.default_rng(seed * 1000 + rank).standard_normal((tokens, dim))
    wrng = np.random.default_rng(seed)
    router = wrng.standard_normal((dim, experts))
    weights = wrng.standard_normal((experts, dim, dim)) / np.sqrt(dim)
    return x.astype(np.float32), router.astype(np.float32), weights.astype(np.float32)


def route(x: np.ndarray, router: np.ndarray):
    """Top-1 routing: each token's expert and its gate (the softmax probability)."""
    logits = x @ router
    expert = logits.argmax(1)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    gate = probs[np.arange(len(x)), expert] / probs.sum(1)
    return expert, gate.astype(np.float32)


def reference(x: np.ndarray, router: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The layer on one process, token by token."""
    expert, gate = route(x, router)
    return np.stack([gate[i] * (x[i] @ weights[e]) for i, e in enumerate(expert)])


def moe_step(pg, recv_win, back_win, x, router, weights, per_rank: int) -> np.ndarray:
    n, rank, dim = pg.world_size, pg.rank, x.shape[1]
    experts = n * per_rank
    expert, gate = route(x, router)
    order = np.argsort(expert, kind="stable")
    xs = np.ascontiguousarray(x[order])
    # counts[s, e]: rows rank s sends to expert e; the same table on every rank
    counts = np.empty((n, experts), np.int64)
    pg.all_gather(counts, np.bincount(expert, minlength=experts).astype(np.int64)).wait()
    owned = counts.reshape(n, n, per_rank)       # [sender, owner, local expert]
    per_owner = owned.sum(2)                     # rows sender -> owner
    # where sender s's rows start in owner o's receive window, and in s's sorted rows
    recv_row = np.cumsum(per_owner, 0) - per_owner
    send_row = np.cumsum(per_owner, 1) - per_owner
    works = []
    for o in range(n):
        rows = xs[send_row[rank, o]:send_row[rank, o] + per_owner[rank, o]]
        works.append(recv_win.put(o, rows, offset=int(recv_row[rank, o]) * dim))
        works.append(recv_win.signal(o))         # after the put, at o
    # as an owner: every sender's rows are here once every sender signalled
    recv_win.wait_signal(value=n)
    received = recv_win.local
    results = []
    for s in range(n):
        row = int(recv_row[s, rank])
        block = np.empty((per_owner[s, rank], dim), np.float32)
        for j in range(per_rank):
            count = int(owned[s, rank, j])
            start = row - int(recv_row[s, rank])
            block[start:start + count] = received[row:row + count] @ weights[rank * per_rank + j]
            row += count
        results.append(block)                    # kept alive until its put completed
        works.append(back_win.put(s, block, offset=int(send_row[s, rank]) * dim))
        works.append(back_win.signal(s))
    back_win.wait_signal(value=n)
    for w in works:
        w.wait()
    y = np.empty_like(x)
    y[order] = back_win.local[:len(x)] * gate[order, None]
    return y


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    pg = dist.init_process_group()
    n, tokens, dim, per_rank = pg.world_size, opts.tokens, opts.dim, opts.experts_per_rank
    # an owner may receive every token of every rank: windows sized for the worst case
    recv_win = pg.window(np.zeros((n * tokens, dim), np.float32))
    back_win = pg.window(np.zeros((tokens, dim), np.float32))
    times, ok = [], True
    for step in range(opts.steps):
        x, router, weights = layer_inputs(pg.rank, tokens, dim, n * per_rank, opts.seed + step)
        pg.barrier().wait()
        start = time.perf_counter()
        y = moe_step(pg, recv_win, back_win, x, router, weights, per_rank)
        times.append(time.perf_counter() - start)
        ok &= bool(np.allclose(y, reference(x, router, weights), rtol=1e-4, atol=1e-5))
    flags = np.array([ok], np.int32)
    pg.all_reduce(flags, op="min").wait()
    if pg.rank == 0:
        print("moe_rma: %d ranks x %d tokens, %d experts, dim %d: %.2f ms/step (median of %d)"
              % (n, tokens, n * per_rank, dim, 1e3 * float(np.median(times)), len(times)))
        print("OK" if flags[0] else "MISMATCH against the numpy reference", flush=True)
    recv_win.free()
    back_win.free()
    dist.destroy_process_group()
    return 0 if flags[0] else 1


if __name__ == "__main__":
    sys.exit(main())
