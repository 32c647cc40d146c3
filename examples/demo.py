"""`make demo`: compile example functions for the CPU, check them against eager mode,
measure them against numpy, then export a transformer block to a .kir file, reload
it, and show it at every compiler stage with `kiln dump`.
"""

import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kiln as kn  # noqa: E402
from transformer_block import example_inputs, transformer_block  # noqa: E402


def median_ms(fn, repeat=7):
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


# -- the examples: kiln code, and the same computation written with numpy ---------------

def chain(x, a, b):
    return kn.gelu(x * a + b, approximate="tanh") * kn.sigmoid(x)


def chain_np(x, a, b):
    v = x * a + b
    gelu = 0.5 * v * (1.0 + np.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))
    return gelu * (1.0 / (1.0 + np.exp(-x)))


def softmax(x):
    return kn.softmax(x, dim=-1)


def softmax_np(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def layer_norm(x, w, b):
    return kn.layer_norm(x, (x.shape[-1],), w, b)


def layer_norm_np(x, w, b):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def mlp(x, w1, b1, w2, b2):
    return kn.gelu(x @ w1 + b1, approximate="tanh") @ w2 + b2


def mlp_np(x, w1, b1, w2, b2):
    h = x @ w1 + b1
    h = 0.5 * h * (1.0 + np.tanh(0.7978845608028654 * (h + 0.044715 * h ** 3)))
    return h @ w2 + b2


def examples():
    n = 1 << 20
    yield "gelu(x*a+b)*sigmoid(x), 2^20", chain, chain_np, (
        kn.randn(n, seed=0), kn.randn(n, seed=1), kn.randn(n, seed=2))
    yield "softmax 1024x1024", softmax, softmax_np, (kn.randn(1024, 1024, seed=3),)
    yield "layer_norm 4096x1024", layer_norm, layer_norm_np, (
        kn.randn(4096, 1024, seed=4), kn.ones(1024), kn.zeros(1024))
    yield "MLP 256x512 -> 2048 -> 512", mlp, mlp_np, (
        kn.randn(256, 512, seed=5), kn.randn(512, 2048, seed=6) * 0.04, kn.zeros(2048),
        kn.randn(2048, 512, seed=7) * 0.02, kn.zeros(512))
    block_args = example_inputs(batch=8, seq=128, dim=64, hidden=256)
    yield "transformer block 8x128x64", transformer_block, None, block_args


def main() -> int:
    print(f"kiln {kn.__version__}: compiling for the CPU (LLVM), {os.cpu_count()} cores\n")
    print(f"{'example':34} {'compile':>9} {'kiln':>9} {'numpy':>9} {'speedup':>8}  max |err|")
    for name, fn, numpy_fn, args in examples():
        compiled = kn.compile(fn)
        start = time.perf_counter()
        got = compiled(*args)
        compile_ms = (time.perf_counter() - start) * 1e3
        want = fn(*args)  # eager mode: every op's numpy reference
        error = float(np.max(np.abs(got.numpy().astype(np.float64) - want.numpy())))
        scale = float(np.max(np.abs(want.numpy()))) or 1.0
        if not math.isfinite(error) or error > 1e-4 * scale:
            print(f"MISMATCH in {name}: compiled and eager differ by {error}")
            return 1
        kiln_ms = median_ms(lambda: compiled(*args))
        arrays = [a.numpy() for a in args]
        if numpy_fn is not None:
            numpy_ms = median_ms(lambda: numpy_fn(*arrays))
        else:
            numpy_ms = median_ms(lambda: fn(*args))  # kiln eager runs numpy op by op
        print(f"{name:34} {compile_ms:7.0f}ms {kiln_ms:7.2f}ms {numpy_ms:7.2f}ms "
              f"{numpy_ms / kiln_ms:7.1f}x  {error:.1e}")
    print("\n(numpy: the same computation as numpy expressions; for the transformer block, "
          "kiln's eager mode)")

    args = example_inputs()
    batch = kn.ShapeVar("B", min=1, max=1024)
    spec = {"x": kn.TensorSpec([batch, kn.STATIC, kn.STATIC])}
    out_dir = os.environ.get("KILN_DEMO_DIR") or tempfile.mkdtemp(prefix="kiln-demo-")
    path = os.path.join(out_dir, "transformer_block.kir")
    kn.export(transformer_block, args, dynamic_shapes=spec).save(path)
    print(f"\nexported transformer_block (batch dim B symbolic) to {path} "
          f"({os.path.getsize(path)} bytes)")
    loaded = kn.load(path)
    for batch_size in (2, 5):
        inputs = (kn.randn(batch_size, *args[0].shape[1:], seed=42),) + args[1:]
        error = float(np.max(np.abs(loaded(*inputs).numpy() - transformer_block(*inputs).numpy())))
        print(f"loaded program (compiled), batch {batch_size}: max |loaded - eager| = {error:.2e}")
        if error > 1e-4:
            print("MISMATCH between the loaded program and eager mode")
            return 1

    from kiln.frontend.stages import stage_names

    shown_whole = ("exported", "optimized", "kernels", "program")
    for stage in stage_names():
        dump = subprocess.run([sys.executable, "-m", "kiln", "dump", path, "--stage", stage],
                              capture_output=True, text=True)
        if dump.returncode:
            print(dump.stderr)
            return dump.returncode
        lines = dump.stdout.splitlines()
        if stage in shown_whole:
            print(f"\n== kiln dump {os.path.basename(path)} --stage {stage} ==")
            print(dump.stdout.rstrip())
        else:
            head = "\n    ".join(lines[:4])
            print(f"\n== --stage {stage}: {len(lines)} lines, starting with ==\n    {head}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
