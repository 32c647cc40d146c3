"""One training step (forward + loss + backward + AdamW) of two MLPs with GELU, LayerNorm
and Dropout and of a small GPT (examples/nanogpt's model: 2 layers, 64 wide, 4 heads,
batch 16 x 32 tokens, cross-entropy): kiln compiled against the same step in kiln eager
mode, torch eager and torch.compile, side by side in one run.

    .venv/bin/python benchmarks/bench_train.py [--quick] [--out benchmarks/results/cpu.md]
        [--only GPT] [--rounds 10] [--baseline /tmp/base]   # kiln on another tree, same run

The kiln step is the one of examples/train_mlp.py: `kn.compile` of a function that calls
`kn.value_and_grad` of a `functional_call` loss and `AdamW.update`, so forward, backward
and the optimizer are one program. torch runs the same model (same weights) with
`loss.backward()` and `torch.optim.AdamW` (foreach off, as on CPU by default);
torch.compile compiles the model (forward and, through AOTAutograd, backward) and keeps
the optimizer eager, the usual recipe. The GPT is examples/nanogpt/model.py, run by torch from the same text
with its three import lines changed back (as tests/test_examples_nanogpt.py does).
Peers are optional (`pip install torch==2.13.0`).
Each implementation runs in its own process (their thread pools would fight in one); after
set-up and a warm-up alike (`warm_up`: 40 steps or 2 s, at least 0.3 s) they are timed
round-robin, a few steps of each in turn for 10 rounds, so the
machine's load falls on all alike; medians and minimums over the same rounds. First-call
times include tracing and compiling with empty caches.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

import numpy as np

import kiln as kn
from kiln import nn, optim
from kiln.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_section  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu.md")


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int, p: float, seed: int = 0):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d_in, hidden, seed=seed), nn.GELU(), nn.LayerNorm(hidden), nn.Dropout(p),
            nn.Linear(hidden, hidden, seed=seed + 1), nn.GELU(), nn.LayerNorm(hidden))
        self.head = nn.Linear(hidden, d_out, seed=seed + 2)

    def forward(self, x):
        return self.head(self.body(x))


def torch_mlp(d_in, hidden, d_out, p):
    import torch

    class TorchMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Linear(d_in, hidden), torch.nn.GELU(), torch.nn.LayerNorm(hidden),
                torch.nn.Dropout(p), torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                torch.nn.LayerNorm(hidden))
            self.head = torch.nn.Linear(hidden, d_out)

        def forward(self, x):
            return self.head(self.body(x))

    return TorchMLP()


GPT = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=65, dropout=0.0, bias=True)
GPT_BATCH = 16
GPT_LABEL = "GPT 2 layers x 64 wide, batch 16 x 32 tokens (examples/nanogpt)"


def workloads(quick: bool):
    """(label, batch, d_in, hidden, d_out); the GPT row has d_in = None."""
    yield "MLP 32 -> 128 -> 128 -> 8, batch 128 (examples/train_mlp.py)", 128, 32, 128, 8
    if quick:
        yield "MLP 256 -> 512 -> 512 -> 256, batch 256", 256, 256, 512, 256
    else:
        yield "MLP 512 -> 1024 -> 1024 -> 512, batch 512", 512, 512, 1024, 512
    yield GPT_LABEL, GPT_BATCH, None, GPT["n_embd"], GPT["vocab_size"]


def gpt_module(framework: str):
    """examples/nanogpt/model.py as a module, for kiln (as written) or torch."""
    import types

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "nanogpt",
                        "model.py")
    text = open(path).read()
    if framework == "torch":
        for line in text.splitlines():
            if "# was: " in line and "import" in line:
                text = text.replace(line, line.split("# was: ")[1])
    module = types.ModuleType(f"{framework}_nanogpt")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(text, path, "exec"), module.__dict__)
    module.print = lambda *a, **k: None  # the model prints its parameter count
    return module


def kiln_gpt(batch: int = GPT_BATCH):
    """(model, token ids, next-token targets) of the GPT row for kiln, seeded."""
    kn.manual_seed(0)
    module = gpt_module("kiln")
    model = module.GPT(module.GPTConfig(**GPT))
    x, y = (kn.tensor(t) for t in gpt_tokens(batch))
    return model, x, y


def gpt_tokens(batch: int = GPT_BATCH):
    """(token ids, next-token targets) of the GPT row as int64 numpy arrays, seeded."""
    rng = np.random.default_rng(0)
    return tuple(rng.integers(0, GPT["vocab_size"], (batch, GPT["block_size"])) for _ in range(2))


def kiln_gpt_step(compiled: bool = True):
    """The GPT row's kiln training step, ready to call as bench_train runs it (AdamW,
    weight decay 0.1): (step, params, optimizer state, x, y, key), where
    `step(params, state, x, y, key)` returns (params, state, loss). `compiled=False`
    gives the step uncompiled, for a script that times `kn.compile` itself."""
    model, x, y = kiln_gpt()
    opt = optim.AdamW(lr=1e-3, weight_decay=0.1)
    step = kiln_step_fn(model, opt)
    params = dict(model.named_parameters())
    return (kn.compile(step) if compiled else step), params, opt.init(params), x, y, nn.random.key(0)


def torch_gpt_step():
    """The same step in torch eager (seeded model, AdamW, the same tokens): a
    zero-argument function running one step."""
    import torch

    torch.manual_seed(0)
    module = gpt_module("torch")
    model = module.GPT(module.GPTConfig(**GPT))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    x, y = (torch.tensor(t) for t in gpt_tokens())

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()

    return step


def gpt_flops(batch: int) -> int:
    """Matrix-product FLOPs of one step (forward + backward = 3x forward)."""
    c, t, layers, v = GPT["n_embd"], GPT["block_size"], GPT["n_layer"], GPT["vocab_size"]
    per_token = layers * (2 * (3 * c * c + c * c + 8 * c * c) + 4 * t * c) + 2 * c * v
    return 3 * batch * t * per_token


def kiln_step_fn(model, opt):
    def loss_fn(params, x, y, key):
        with nn.rng(key):
            if not isinstance(model, MLP):  # the GPT returns (logits, loss)
                return nn.functional_call(model, params, x, y)[1]
            return F.mse_loss(nn.functional_call(model, params, x), y)

    def step(params, state, x, y, key):
        loss, grads = kn.value_and_grad(loss_fn)(params, x, y, key)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    return step


def setup_kiln(model, x, y):
    """(compiled step, eager step, first call s, max rel. diff of the parameters compiled
    vs eager after three steps from the same start)."""
    opt = optim.AdamW(lr=1e-3, weight_decay=0.1 if not isinstance(model, MLP) else 1e-2)
    step = kiln_step_fn(model, opt)
    compiled = kn.compile(step)
    keys = [nn.random.fold_in(nn.random.key(0), i) for i in range(3)]
    params = dict(model.named_parameters())
    state = opt.init(params)
    t0 = time.perf_counter()
    compiled(params, state, x, y, keys[0])
    first = time.perf_counter() - t0
    # correctness: three steps compiled and eager from the same start, same keys
    pc, sc, pe, se = params, state, params, state
    for key in keys:
        pc, sc, _ = compiled(pc, sc, x, y, key)
        pe, se, _ = step(pe, se, x, y, key)
    diff = max(float(np.max(np.abs(pc[k].numpy() - pe[k].numpy()))
                     / max(1e-6, float(np.max(np.abs(pe[k].numpy()))))) for k in pe)
    carry = [pc, sc]

    def run_compiled():
        carry[0], carry[1], _ = compiled(carry[0], carry[1], x, y, keys[0])

    def run_eager():
        carry[0], carry[1], _ = step(carry[0], carry[1], x, y, keys[0])

    return run_compiled, run_eager, first, diff


def setup_torch(model, x, y, use_compile):
    """(one torch step, first call s) of torch eager, or of torch.compile(model)."""
    import torch

    gpt = not isinstance(model, MLP)
    if gpt:
        tmodel = gpt_module("torch").GPT(gpt_module("torch").GPTConfig(**GPT))
    else:
        tmodel = torch_mlp(*_dims(model))
    tmodel.load_state_dict({k: torch.tensor(np.array(v.numpy()))
                            for k, v in model.state_dict().items()})
    run_model = torch.compile(tmodel) if use_compile else tmodel
    opt = torch.optim.AdamW(tmodel.parameters(), lr=1e-3, weight_decay=0.1 if gpt else 1e-2)
    tx, ty = torch.tensor(x.numpy()), torch.tensor(y.numpy())

    def step():
        opt.zero_grad(set_to_none=True)
        if gpt:
            loss = run_model(tx, ty)[1]
        else:
            loss = torch.nn.functional.mse_loss(run_model(tx), ty)
        loss.backward()
        opt.step()

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    return step, first


def _dims(model):
    return (model.body[0].in_features, model.body[0].out_features, model.head.out_features,
            model.body[3].p)


def fresh_caches() -> None:
    root = tempfile.mkdtemp(prefix="bench-train-caches-")
    for var in ("KILN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ[var] = os.path.join(root, var.lower())


# every implementation is warmed up alike before the timed rounds (as bench_cpu.py's):
# WARM_STEPS steps or WARM_MAX_S, and at least WARM_MIN_S. kiln's split rule times its
# first calls serial and split (the GPT step: serial trials in ~9 of its first 40 calls);
# with 3 warm-up steps those trials fell in the timed rounds, each right after a pause,
# where the cold first step makes whichever variant it timed look slower
WARM_STEPS, WARM_MIN_S, WARM_MAX_S = 40, 0.3, 2.0


def warm_up(step) -> int:
    """Run `step` until WARM_STEPS steps or WARM_MAX_S have passed, and WARM_MIN_S; the
    steps run."""
    start, n = time.perf_counter(), 0
    while True:
        step()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= WARM_MIN_S and (n >= WARM_STEPS or elapsed >= WARM_MAX_S):
            return n


def serve(impl: str, index: int, quick: bool) -> None:
    """A worker process holding one implementation of one workload: it sets up (first
    call timed), then answers `run N` on stdin with N step times (JSON, one line) and
    `eager N` with N kiln eager step times, until `quit`."""
    import json

    label, batch, d_in, hidden, d_out = list(workloads(quick))[index]
    if d_in is None:  # the GPT: token ids in, next-token ids as targets
        model, x, y = kiln_gpt(batch)
    else:
        model = MLP(d_in, hidden, d_out, p=0.1)
        x = kn.randn(batch, d_in, seed=1)
        y = kn.randn(batch, d_out, seed=2)
    info: dict = {}
    eager = None
    if impl == "kiln":
        step, eager, info["first call"], info["rel diff"] = setup_kiln(model, x, y)
    else:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        step, info["first call"] = setup_torch(model, x, y, use_compile=impl == "torch.compile")
    warm_up(step)
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd, _, count = line.strip().partition(" ")
        if cmd == "quit":
            return
        fn = eager if cmd == "eager" else step
        times = []
        for _ in range(int(count or 1)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(json.dumps(times), flush=True)


class Worker:
    """One `serve` process; `ask(line)` sends a command and reads its JSON answer."""

    def __init__(self, impl: str, index: int, quick: bool, baseline: str | None = None):
        import subprocess

        # "kiln-baseline": kiln's worker with another tree's root first on PYTHONPATH
        worker = "kiln" if impl == "kiln-baseline" else impl
        env = dict(os.environ, PYTHONPATH=os.path.abspath(baseline)) if impl == "kiln-baseline" else None
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--index", str(index)]
        self.impl = impl
        self.proc = subprocess.Popen(cmd + (["--quick"] if quick else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self):
        import json

        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().strip().splitlines() or ["failed"]
            raise RuntimeError(f"{self.impl}: {err[-1][:80]}")
        return json.loads(line)

    def ask(self, line: str):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, ValueError, Exception):
            self.proc.kill()
            self.proc.wait(timeout=60)


PAUSE_S = 0.2  # between implementations: OpenBLAS's and OpenMP's threads spin a while after work


def measure(impls: list[str], index: int, quick: bool, rounds: int = 0, baseline: str | None = None) -> dict:
    """Every implementation in its own process (their thread pools would fight in one),
    set up one after the other, then timed round-robin: each round runs a few steps of
    each in turn, so the machine's load falls on all of them alike."""
    row: dict = {}
    workers = []
    try:
        for impl in impls:
            try:
                workers.append(Worker(impl, index, quick, baseline))
            except RuntimeError as exc:
                row[f"{impl} error"] = str(exc)
        rounds, per_round = rounds or (4 if quick else 10), 3
        times: dict = {w.impl: [] for w in workers}
        for _ in range(rounds):
            for w in workers:
                time.sleep(PAUSE_S)
                times[w.impl] += w.ask(f"run {per_round}")
        for w in workers:
            for key, value in w.info.items():
                row[f"{w.impl} {key}" if key != "rel diff" else key] = value
            name = {"kiln": "kiln compiled", "torch": "torch eager",
                    "kiln-baseline": "kiln baseline compiled"}.get(w.impl, w.impl)
            row[name] = float(np.median(times[w.impl]))
            row[f"{name} min"] = float(np.min(times[w.impl]))
            if w.impl == "kiln":
                eager = w.ask(f"eager {2 if quick else 5}")
                row["kiln eager"], row["kiln eager min"] = float(np.median(eager)), float(np.min(eager))
    finally:
        for w in workers:
            w.close()
    return row


def main() -> int:
    fresh_caches()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller second model, fewer repeats")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results file ('' to only print)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--only", default="", help="run the workloads whose label contains this")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (3 steps each; default 10)")
    parser.add_argument("--baseline", help="another kiln tree's root: its compiled step timed in the "
                        "same rounds (e.g. `git archive <commit> | tar -x -C /tmp/base`)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve(args.worker, args.index, args.quick)
        return 0
    impls = ["kiln"] + (["kiln-baseline"] if args.baseline else [])
    if not args.no_peers:
        try:
            import torch  # noqa: F401

            impls += ["torch"] + ([] if args.no_torch_compile else ["torch.compile"])
        except ImportError:
            pass
    rows = []
    for index, (label, batch, d_in, hidden, d_out) in enumerate(workloads(args.quick)):
        if args.only not in label:
            continue
        row = {"workload": label,
               "flops": gpt_flops(batch) if d_in is None else
               3 * 2 * batch * (d_in * hidden + hidden * hidden + hidden * d_out)}
        row["load"] = os.getloadavg()[0]
        row.update(measure(impls, index, args.quick, args.rounds, args.baseline))
        rows.append(row)
        print(render_row(row), flush=True)
    table = render(rows, args)
    print(table)
    for r in rows:
        if "kiln baseline compiled" in r:
            print(f"{r['workload']}: kiln baseline ({args.baseline}) {r['kiln baseline compiled'] * 1e3:.3f} "
                  f"ms median, {r['kiln baseline compiled min'] * 1e3:.3f} min; this tree "
                  f"{r['kiln compiled'] * 1e3:.3f}, {r['kiln compiled min'] * 1e3:.3f}")
    if args.out:
        write_section(args.out, "bench_train", table)
    return 0


COLS = ["kiln compiled", "kiln eager", "torch eager", "torch.compile"]


def render_row(r) -> str:
    return f"| {r['workload']} | " + " | ".join(
        f"{r[c] * 1e3:.3f}" if c in r else "—" for c in COLS) + " |"


def render(rows, args) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    load = os.getloadavg()
    row_loads = ", ".join(f"{r['load']:.1f}" for r in rows if "load" in r)
    versions = f"numpy {np.__version__}" + "".join(
        f", {m} {sys.modules[m].__version__}" for m in ("torch",) if m in sys.modules)
    lines = [
        "## Training step: kiln.compile vs kiln eager, torch eager and torch.compile (bench_train.py)",
        "",
        f"- command: `.venv/bin/python benchmarks/bench_train.py{' --quick' if args.quick else ''}`",
        f"- machine: {os.cpu_count()} cores, {cpu}; load average before each row {row_loads}, "
        f"at the end {load[0]:.2f}",
        f"- date: {datetime.date.today().isoformat()}; {versions}",
        "- step: forward (Linear, GELU, LayerNorm, Dropout 0.1, Linear, GELU, LayerNorm, Linear) "
        "+ MSE + backward + AdamW; kiln: `kn.compile` of `value_and_grad` + `AdamW.update` "
        "(one program), torch: `loss.backward()` + `torch.optim.AdamW`, torch.compile: "
        "`torch.compile(model)` with the optimizer eager",
        f"- GPT: examples/nanogpt/model.py with {GPT}, batch {GPT_BATCH}, cross-entropy, "
        "AdamW(lr=1e-3, weight_decay=0.1) on every parameter; the same steps otherwise",
        "",
        "Median milliseconds per step (lower is better), implementations timed round-robin.",
        "",
        "| workload | " + " | ".join(COLS) + " | kiln compiled GFLOP/s | eager / compiled "
        "| best torch / kiln | compiled vs eager (params after 3 steps) |",
        "|---" * (len(COLS) + 5) + "|",
    ]
    for r in rows:
        cells = [f"{r[c] * 1e3:.3f}" if c in r else "—" for c in COLS]
        if "kiln compiled" not in r:
            lines.append(f"| {r['workload']} | " + " | ".join(cells) + " | — | — | — | "
                         f"{r.get('kiln error', '—')} |")
            continue
        peers = [r[c] for c in ("torch eager", "torch.compile") if c in r]
        ratio = f"{min(peers) / r['kiln compiled']:.2f}x" if peers else "—"
        lines.append(f"| {r['workload']} | " + " | ".join(cells)
                     + f" | {r['flops'] / r['kiln compiled'] / 1e9:.1f}"
                     + f" | {r['kiln eager'] / r['kiln compiled']:.0f}x | {ratio} | "
                     + f"{r['rel diff']:.1e} |")
    lines += ["", "Fastest step (minimum over the same repeats), milliseconds: less disturbed by "
              "other jobs on a shared machine than the median.", "",
              "| workload | " + " | ".join(COLS) + " | best torch / kiln |",
              "|---" * (len(COLS) + 2) + "|"]
    for r in rows:
        lows = {c: r.get(f"{c} min") for c in COLS}
        cells = [f"{v * 1e3:.3f}" if v is not None else "—" for v in lows.values()]
        peers = [lows[c] for c in ("torch eager", "torch.compile") if lows[c] is not None]
        ratio = f"{min(peers) / lows['kiln compiled']:.2f}x" if peers and lows["kiln compiled"] \
            else "—"
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "First-call times (trace + compile + first step, caches empty), seconds:", "",
              "| workload | kiln | torch.compile |", "|---|---|---|"]
    for r in rows:
        tc = f"{r['torch.compile first call']:.2f}" if "torch.compile first call" in r else \
            r.get("torch.compile error", "—")
        if "kiln compiled" not in r:
            lines.append(f"| {r['workload']} | {r.get('kiln error', '—')} | {tc} |")
            continue
        lines.append(f"| {r['workload']} | {r['kiln first call']:.2f} | {tc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
