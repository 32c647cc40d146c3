"""The cost of PyTorch-style training in kiln: the tape's overhead on an eager forward,
and one nanoGPT training step (forward, backward, AdamW) eager, as kn.compile(model),
compiled whole (backward/step/zero_grad in one program), against the functional
kn.value_and_grad step and torch eager, in the same run.

    .venv/bin/python benchmarks/bench_torch_port.py [--repeats 15] [--out benchmarks/results/torch-port.md]

Every figure is the median of --repeats timed calls after 2 warm-up calls.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "nanogpt"))


def median_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "torch-port.md"))
    args = parser.parse_args(argv)

    import kiln as kn
    from kiln import nn, optim
    import model as gpt

    gpt.print = lambda *a, **k: None
    rows = []
    mlp = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x = kn.randn(64, 256, seed=0)
    taped = median_ms(lambda: mlp(x), args.repeats)
    with kn.no_grad():
        plain = median_ms(lambda: mlp(x), args.repeats)
    rows.append(("MLP 256-512-256 forward, batch 64, eager: tape on / no_grad", taped, plain))

    cfg = gpt.GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=4, n_embd=64)
    kn.manual_seed(0)
    model = gpt.GPT(cfg)
    idx = kn.randint(0, 65, (8, 64), seed=1)
    tgt = kn.randint(0, 65, (8, 64), seed=2)
    opt = optim.AdamW(model.parameters(), lr=1e-3)

    def torch_style(m):
        def step():
            _, loss = m(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    eager = median_ms(torch_style(model), args.repeats)
    compiled = median_ms(torch_style(kn.compile(model)), args.repeats)
    whole = kn.compile(torch_style(model))  # backward, step, zero_grad in one program
    whole_ms = median_ms(whole, args.repeats)
    params = dict(model.named_parameters())
    fopt = optim.AdamW(lr=1e-3)
    state = fopt.init(params)

    def loss_fn(p, i, t):
        return nn.functional_call(model, p, i, t)[1]

    @kn.compile
    def fstep(p, s, i, t):
        loss, g = kn.value_and_grad(loss_fn)(p, i, t)
        p, s = fopt.update(g, s, p)
        return loss, p, s

    box = {"p": params, "s": state}

    def functional():
        _, box["p"], box["s"] = fstep(box["p"], box["s"], idx, tgt)

    functional_ms = median_ms(functional, args.repeats)
    torch_ms = None
    try:
        import torch

        tcode = (ROOT / "examples" / "nanogpt" / "model.py").read_text()
        for a, b in (("import kiln as torch  # was: import torch", "import torch"),
                     ("import kiln.nn as nn  # was: import torch.nn as nn", "import torch.nn as nn"),
                     ("from kiln.nn import functional as F  # was: from torch.nn import functional as F",
                      "from torch.nn import functional as F")):
            tcode = tcode.replace(a, b)
        import types

        module = types.ModuleType("torch_gpt")
        module.print = lambda *a, **k: None
        sys.modules["torch_gpt"] = module  # dataclasses look their module up
        exec(compile(tcode, "torch_gpt", "exec"), module.__dict__)
        tmod = module.__dict__
        torch.set_num_threads(os.cpu_count() or 1)
        tmodel = tmod["GPT"](tmod["GPTConfig"](block_size=64, vocab_size=65, n_layer=2, n_head=4,
                                               n_embd=64))
        topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-3)
        ti, tt = torch.tensor(idx.numpy()), torch.tensor(tgt.numpy())

        def tstep():
            _, loss = tmodel(ti, tt)
            loss.backward()
            topt.step()
            topt.zero_grad(set_to_none=True)

        torch_ms = median_ms(tstep, args.repeats)
    except ImportError:
        pass
    rows.append(("nanoGPT 2x64 step, batch 8x64: eager tape / kn.compile(model) + eager AdamW",
                 eager, compiled))
    rows.append(("same step: kn.compile(whole torch-style step) / functional kn.compile("
                 "value_and_grad + update)", whole_ms, functional_ms))
    rows.append(("same step: kn.compile(whole torch-style step) / torch eager", whole_ms,
                 torch_ms))

    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines()
                       if l.startswith("Model name")), "unknown")
    lines = [f"# PyTorch-style training in kiln ({datetime.date.today()})", "",
             f"`{' '.join([Path(sys.executable).name, *sys.argv])}` on {model_name}, "
             f"{os.cpu_count()} CPUs; medians of {args.repeats} calls (ms), ratios in the same run.",
             "", "| what | first (ms) | second (ms) | first / second |", "|---|---|---|---|"]
    for what, a, b in rows:
        ratio = f"{a / b:.2f}" if b else "-"
        lines.append(f"| {what} | {a:.2f} | {b:.2f} | {ratio} |" if b is not None
                     else f"| {what} | {a:.2f} | - | - |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
