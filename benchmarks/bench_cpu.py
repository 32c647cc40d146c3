"""kiln.compile on the CPU against numpy, torch (eager and torch.compile) and jax.jit,
side by side in one run, on the workloads of the CPU pipeline issue.

    .venv/bin/python benchmarks/bench_cpu.py [--quick] [--out benchmarks/results/cpu.md]

Peers are optional: torch and jax are measured when importable (`pip install
torch==2.13.0 jax`). Every implementation is warmed up alike, then all are timed
round-robin in one process (medians and minimums); the table also gives the machine's copy bandwidth and BLAS GFLOP/s as ceilings, and kiln's
cold and warm (new process, disk cache) compile times.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

import kiln as kn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import median_s, write_section  # noqa: E402
from bench_complex import chain_k as cchain_k, chain_np as cchain_np  # noqa: E402

GELU_C = 0.7978845608028654
# torch.compile could not compile the 20-step unrolled Newton loop within 120 s on this
# machine (the CPU pipeline issue measured 162 s for 14 steps): not attempted here
TORCH_COMPILE_SKIP = {"newton": "Inductor needs over 120 s to compile the 20-step unrolled "
                                "loop here (14 steps took 162 s)",
                      "cchain": "Inductor runs complex tensors eagerly (no complex codegen)",
                      "cgemm": "Inductor runs complex tensors eagerly (no complex codegen)"}


BARE_BLAS = {"gemm": lambda x, w, b: x @ w, "mlp": lambda x, w1, b1, w2, b2: (x @ w1) @ w2}


# -- workloads: (name, kiln fn, numpy fn, torch fn, jax fn, make inputs, bytes, flops) ----

def chain_k(x, a, b):
    return kn.gelu(x * a + b) * kn.sigmoid(x)


def erf_np(z):
    """numpy has no erf: Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7), vectorized."""
    t = 1.0 / (1.0 + 0.3275911 * np.abs(z))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(z) * (1.0 - poly * np.exp(-z * z))


def chain_np(x, a, b):
    v = x * a + b
    return (0.5 * v * (1 + erf_np(v * np.float32(0.7071067811865476)))) / (1 + np.exp(-x))


def softmax_k(x):
    return kn.softmax(x, dim=-1)


def softmax_np(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def layer_norm_k(x, w, b):
    return kn.layer_norm(x, (x.shape[-1],), w, b)


def layer_norm_np(x, w, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-5) * w + b


def gemm_k(x, w, b):
    return kn.relu(x @ w + b)


def gemm_np(x, w, b):
    return np.maximum(x @ w + b, 0)


def mlp_k(x, w1, b1, w2, b2):
    return kn.gelu(x @ w1 + b1) @ w2 + b2


def ssq_k(x):
    return (x * x).sum()


def ssq_np(x):
    return np.dot(x, x)


def attention_k(q, k, v):
    return kn.scaled_dot_product_attention(q, k, v)


def attention_np(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    return softmax_np(s) @ v


def newton_k(x):
    y = x
    for _ in range(20):
        y = 0.5 * (y + x / y)
    return y


def newton_np(x):
    y = x
    for _ in range(20):
        y = 0.5 * (y + x / y)
    return y


def torch_fns():
    import torch
    import torch.nn.functional as F

    return {
        "chain": lambda x, a, b: F.gelu(x * a + b) * torch.sigmoid(x),
        "softmax": lambda x: torch.softmax(x, dim=-1),
        "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
        "gemm": lambda x, w, b: torch.relu(x @ w + b),
        "mlp": lambda x, w1, b1, w2, b2: F.gelu(x @ w1 + b1) @ w2 + b2,
        "ssq": lambda x: (x * x).sum(),
        "attention": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        "newton": newton_np,
        "cchain": lambda z, w: torch.exp(z) * w + z * 0.5 - torch.abs(z),
        "cgemm": lambda a, b: a @ b,
    }


def jax_fns():
    import jax
    import jax.numpy as jnp

    def softmax(x):
        return jax.nn.softmax(x, axis=-1)

    return {
        "chain": lambda x, a, b: jax.nn.gelu(x * a + b, approximate=False) * jax.nn.sigmoid(x),
        "softmax": softmax,
        "layer_norm": lambda x, w, b: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(
            x.var(-1, keepdims=True) + 1e-5) * w + b,
        "gemm": lambda x, w, b: jax.nn.relu(x @ w + b),
        "mlp": lambda x, w1, b1, w2, b2: jax.nn.gelu(x @ w1 + b1, approximate=False) @ w2 + b2,
        "ssq": lambda x: (x * x).sum(),
        "attention": lambda q, k, v: softmax(q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(q.shape[-1])) @ v,
        "newton": newton_np,
        "cchain": lambda z, w: jnp.exp(z) * w + z * 0.5 - jnp.abs(z),
        "cgemm": lambda a, b: a @ b,
    }


def workloads(quick: bool):
    rng = np.random.default_rng(0)

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    big = 1 << (20 if quick else 24)
    yield "chain", f"gelu(x*a+b)*sigmoid(x), 2^{big.bit_length() - 1}", chain_k, chain_np, \
        (r(big), r(big), r(big)), 16 * big, 0
    yield "chain", "same chain, 4096 elements (call overhead)", chain_k, chain_np, \
        (r(4096), r(4096), r(4096)), 16 * 4096, 0
    n = 1024 if quick else 4096
    yield "softmax", f"softmax {n}x{n}", softmax_k, softmax_np, (r(n, n),), 8 * n * n, 0
    rows = 2048 if quick else 8192
    yield "layer_norm", f"layer_norm {rows}x1024", layer_norm_k, layer_norm_np, \
        (r(rows, 1024), r(1024), r(1024)), 8 * rows * 1024, 0
    m = 1024 if quick else 2048
    yield "gemm", f"matmul+bias+relu {m}^3", gemm_k, gemm_np, \
        (r(m, m), r(m, m, scale=m ** -0.5), r(m)), 0, 2 * m ** 3
    yield "mlp", "MLP 512x1024 -> 4096 -> 1024 (gelu)", mlp_k, None, \
        (r(512, 1024), r(1024, 4096, scale=0.03), r(4096), r(4096, 1024, scale=0.015), r(1024)), \
        0, 2 * 2 * 512 * 1024 * 4096
    s = 1 << (22 if quick else 25)
    yield "ssq", f"sum of squares 2^{s.bit_length() - 1}", ssq_k, ssq_np, (r(s),), 4 * s, 0
    yield "attention", "attention 8 heads x 1024 x 64", attention_k, attention_np, \
        (r(8, 1024, 64), r(8, 1024, 64), r(8, 1024, 64)), 0, 4 * 8 * 1024 * 1024 * 64
    yield "newton", "20-step Newton sqrt over 2^20", newton_k, newton_np, \
        (np.abs(r(1 << 20)) + 0.5,), 8 * (1 << 20), 0

    def c(*shape):  # complex64: elementwise as float32 pairs (the `complex` pass), matmul as cgemm
        return (r(*shape) + 1j * r(*shape)).astype(np.complex64)

    cn = 1 << (20 if quick else 22)
    yield "cchain", f"complex exp(z)*w + z*0.5 - abs(z), 2^{cn.bit_length() - 1}", cchain_k, \
        cchain_np, (c(cn), c(cn)), 24 * cn, 0
    cm = 256 if quick else 512
    yield "cgemm", f"complex64 matmul {cm}^3", lambda a, b: a @ b, \
        lambda a, b: a @ b, (c(cm, cm), c(cm, cm)), 0, 8 * cm ** 3


def ceilings(repeat: int) -> tuple[float, float]:
    a = np.ones(1 << 25, np.float32)
    b = np.empty_like(a)
    copy = median_s(lambda: np.copyto(b, a), repeat)
    m = np.ones((2048, 2048), np.float32)
    gemm = median_s(lambda: m @ m, max(3, repeat // 2))
    return 2 * a.nbytes / copy / 1e9, 2 * 2048 ** 3 / gemm / 1e9


def compile_times() -> tuple[float, float]:
    """Cold compile of the MLP after import, and warm (new process, disk cache)."""
    script = (
        "import time, kiln as kn, numpy as np\n"
        "import kiln.codegen.cpu\n"
        "f = kn.compile(lambda x, w1, b1, w2, b2: kn.gelu(x @ w1 + b1) @ w2 + b2)\n"
        "args = [np.ones(s, np.float32) for s in [(8, 64), (64, 256), (256,), (256, 64), (64,)]]\n"
        "t = time.perf_counter(); f.__call__  # noqa\n"
        "from kiln.frontend.compile import compile_graph\n"
        "from kiln.frontend.tracing import trace_function\n"
        "t = time.perf_counter()\n"
        "compile_graph(trace_function(f.fn, tuple(args)).graph)\n"
        "print(time.perf_counter() - t)\n")
    env = dict(os.environ, KILN_CACHE_DIR=tempfile.mkdtemp(prefix="kiln-bench-cache-"))
    run = lambda: float(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                       text=True, check=True).stdout.split()[-1])
    return run(), run()


def import_time() -> float:
    out = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); import kiln; "
                          "print(time.perf_counter() - t)"], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def fresh_caches() -> None:
    """Compile caches start empty, so first-call times are cold for kiln and the peers."""
    root = tempfile.mkdtemp(prefix="bench-caches-")
    for var in ("KILN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ[var] = os.path.join(root, var.lower())


def settle(fn, min_calls: int, budget_s: float, max_calls: int = 200) -> int:
    """Warm-up: call `fn` at least `min_calls` times and until `budget_s` has passed, at
    most `max_calls` (the same rule for every implementation: caches, allocator, kiln's
    split measurement, Inductor's and XLA's first runs). Returns the number of calls made."""
    t0, n = time.perf_counter(), 0
    while n < min_calls or (time.perf_counter() - t0 < budget_s and n < max_calls):
        fn()
        n += 1
    return n


# each turn first runs its implementation untimed for TURN_WARM_S: the previous one's
# threads spin on a while after its calls (OpenBLAS's workers ~0.1 s, OpenMP's), and after
# a pause the cores are slow to come back; timed at once, whichever ran next shared its
# cores with them (kiln's 2048^3 GEMM: 92 ms median against 59 minimum), and a pause
# before each turn instead made every memory-bound row ~1.5x slower for all
TURN_WARM_S = 0.12


def interleaved(fns: dict, rounds: int, seed: int = 0) -> dict:
    """{name: (median, minimum)} seconds per call: `rounds` rounds, every implementation
    once per round in a shuffled order; a turn runs its implementation untimed for
    TURN_WARM_S (at least one call), then times a block of calls lasting ~20 ms (one call
    for slower ones), so a minute of machine noise hits every implementation alike and
    none is timed beside another's spinning threads."""
    calls = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        calls[name] = max(1, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
    times: dict = {name: [] for name in fns}

    def block(name, fn):
        n = calls[name]
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times[name].append((time.perf_counter() - t0) / n)

    turns(fns, rounds, block, seed)
    return {name: (float(np.median(v)), float(np.min(v))) for name, v in times.items()}


def turns(fns: dict, rounds: int, timed, seed: int = 0) -> None:
    """`rounds` rounds, every implementation once per round in a shuffled order: a turn
    runs it untimed for TURN_WARM_S (at least one call), then `timed(name, fn)`."""
    order = list(fns)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            while time.perf_counter() - t0 < TURN_WARM_S:
                fn()
            timed(name, fn)


def main() -> int:
    fresh_caches()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--only", help="comma-separated workload keys (chain, softmax, gemm, ...)")
    args = parser.parse_args()
    rounds = 5 if args.quick else 7
    peers = {}
    if not args.no_peers:
        try:
            import torch

            torch.set_num_threads(os.cpu_count() or 1)
            torch.set_grad_enabled(False)
            peers["torch"] = (torch, torch_fns())
        except ImportError:
            pass
        try:
            import jax

            peers["jax"] = (jax, jax_fns())
        except ImportError:
            pass
    only = set(args.only.split(",")) if args.only else None
    rows, notes = [], []
    for key, label, kfn, npfn, inputs, nbytes, flops in workloads(args.quick):
        if only and key not in only:
            continue
        kiln_fn = kn.compile(kfn)
        t0 = time.perf_counter()
        out = kiln_fn(*inputs)
        first = {"kiln first call": time.perf_counter() - t0}
        expect = (npfn or kfn)(*[np.asarray(i) for i in inputs])
        expect = expect.numpy() if hasattr(expect, "numpy") else expect
        expect = np.asarray(expect, np.complex128 if np.iscomplexobj(expect) else np.float64)
        err = float(np.max(np.abs(out.numpy() - expect)) / max(1.0, float(np.max(np.abs(expect)))))
        np_fn = npfn or (lambda *a: kfn(*[kn.asarray(x) for x in a]))
        fns = {"kiln": lambda: kiln_fn(*inputs), "numpy": lambda: np_fn(*inputs)}
        if key in BARE_BLAS:  # the matrix products alone: what a free epilogue costs nothing over
            fns["BLAS alone"] = lambda: BARE_BLAS[key](*inputs)
        if "torch" in peers:
            torch, tfns = peers["torch"]
            tin = [torch.from_numpy(i) for i in inputs]
            fns["torch eager"] = lambda: tfns[key](*tin)
            if key in TORCH_COMPILE_SKIP:
                notes.append(f"torch.compile not run on '{label}': {TORCH_COMPILE_SKIP[key]}")
            else:
                compiled = torch.compile(tfns[key])
                t0 = time.perf_counter()
                compiled(*tin)
                first["torch.compile first call"] = time.perf_counter() - t0
                fns["torch.compile"] = lambda: compiled(*tin)
        if "jax" in peers:
            jax, jfns = peers["jax"]
            jin = [jax.numpy.asarray(i) for i in inputs]
            jitted = jax.jit(jfns[key])
            t0 = time.perf_counter()
            jitted(*jin).block_until_ready()
            first["jax.jit first call"] = time.perf_counter() - t0
            fns["jax.jit"] = lambda: jitted(*jin).block_until_ready()
        warm = {name: settle(fn, 1 if name == "numpy" else 5, 0.25) for name, fn in fns.items()}
        timed = interleaved(fns, rounds)
        result = {"workload": label, "rel err": err, "warm-up calls": warm, **first}
        result.update({name: med for name, (med, _) in timed.items()})
        result.update({f"{name} min": low for name, (_, low) in timed.items()})
        result["rate"] = (f"{nbytes / result['kiln'] / 1e9:.1f} GB/s" if nbytes
                          else f"{flops / result['kiln'] / 1e9:.0f} GFLOP/s")
        rows.append(result)
        print(label, {k: (f"{v * 1e3:.3f} ms" if isinstance(v, float) and k != "rel err" else v)
                      for k, v in result.items() if k != "workload"}, flush=True)
    copy_gbs, blas_gflops = ceilings(9)
    cold, warm = compile_times()
    imp = import_time()
    table = render(rows, copy_gbs, blas_gflops, cold, warm, imp, args)
    if notes:
        table += "\n" + "\n".join(f"- {n}" for n in sorted(set(notes))) + "\n"
    print(table)
    if args.out:
        write_section(args.out, "bench_cpu", table)
    return 0


def render(rows, copy_gbs, blas_gflops, cold, warm, imp, args) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    load = os.getloadavg()
    cols = ["kiln", "numpy", "torch eager", "torch.compile", "jax.jit"]
    blas = [r for r in rows if "BLAS alone" in r]
    flags = "".join(f" --{a}" for a in ("quick",) if getattr(args, a)) + (f" --only {args.only}" if args.only else "")
    lines = [
        "## kiln.compile vs numpy, torch and jax (bench_cpu.py)",
        "",
        f"- command: `.venv/bin/python benchmarks/bench_cpu.py{flags}`",
        f"- machine: {os.cpu_count()} cores, {cpu}; load average at the end {load[0]:.2f}",
        f"- date: {datetime.date.today().isoformat()}; numpy {np.__version__}"
        + "".join(f", {m} {__import__(m).__version__}" for m in ("torch", "jax") if m in sys.modules),
        f"- ceilings: copy bandwidth {copy_gbs:.1f} GB/s (np.copyto of 128 MiB, read + write), "
        f"numpy float32 GEMM 2048^3 {blas_gflops:.0f} GFLOP/s",
        f"- compile: `import kiln` {imp * 1e3:.0f} ms; MLP compile cold {cold * 1e3:.0f} ms, "
        f"warm from the disk cache in a new process {warm * 1e3:.0f} ms",
        "- method: after its first call, every implementation is warmed up alike (at least 5 "
        "calls and 0.25 s), then all are timed round-robin in one process (shuffled order, "
        f"each turn {TURN_WARM_S} s untimed, then a timed block of ~20 ms)",
        "",
        "Milliseconds per call, median (minimum) over the rounds (lower is better); `x` is the "
        "best peer's time over kiln's, by medians (by minimums).",
        "",
        "| workload | " + " | ".join(cols) + " | kiln rate | best peer / kiln | kiln rel. error |",
        "|---" * (len(cols) + 4) + "|",
    ]
    for r in rows:
        cells = [f"{r[c] * 1e3:.3f} ({r[c + ' min'] * 1e3:.3f})" if c in r else "—" for c in cols]
        peers = [c for c in cols[1:] if c in r]
        ratio = (f"{min(r[c] for c in peers) / r['kiln']:.2f}x "
                 f"({min(r[c + ' min'] for c in peers) / r['kiln min']:.2f}x)") if peers else "—"
        lines.append(f"| {r['workload']} | " + " | ".join(cells)
                     + f" | {r['rate']} | {ratio} | {r['rel err']:.1e} |")
    if blas:
        lines += ["", "GEMM epilogues: kiln against the bare BLAS products (numpy float32 matmul "
                  "alone, no bias or activation), same run, median (minimum):", "",
                  "| workload | kiln (ms) | BLAS alone (ms) | BLAS / kiln |", "|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['kiln'] * 1e3:.3f} ({r['kiln min'] * 1e3:.3f}) | "
                  f"{r['BLAS alone'] * 1e3:.3f} ({r['BLAS alone min'] * 1e3:.3f}) | "
                  f"{r['BLAS alone'] / r['kiln']:.2f}x ({r['BLAS alone min'] / r['kiln min']:.2f}x) |"
                  for r in blas]
    lines += ["", "First-call times (trace + compile + run, every compile cache empty at the "
              "start), seconds:", "",
              "| workload | kiln | torch.compile | jax.jit |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['kiln first call']:.2f} | "
                     + " | ".join(f"{r[c]:.2f}" if c in r else "—"
                                  for c in ("torch.compile first call", "jax.jit first call")) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
