"""`make demo`: trace a transformer block, export it to a .kir file, reload it, check it
against eager mode, and show the file with `kiln dump`.

The CPU compile pipeline (a later milestone) turns this into a compile-and-measure demo;
today exported programs run through kiln's reference interpreter.
"""

import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kiln as kn  # noqa: E402
from transformer_block import example_inputs, transformer_block  # noqa: E402


def main() -> int:
    args = example_inputs()
    batch = kn.ShapeVar("B", min=1, max=1024)
    spec = {"x": kn.TensorSpec([batch, kn.STATIC, kn.STATIC])}

    start = time.perf_counter()
    eager = transformer_block(*args)
    eager_ms = (time.perf_counter() - start) * 1e3
    print(f"eager transformer block: output {eager.dtype.short}{list(eager.shape)} in {eager_ms:.1f} ms")

    graph = kn.trace(transformer_block, *args, dynamic_shapes=spec)
    print("\n== traced graph (kn.trace) ==")
    print(graph)

    out_dir = os.environ.get("KILN_DEMO_DIR") or tempfile.mkdtemp(prefix="kiln-demo-")
    path = os.path.join(out_dir, "transformer_block.kir")
    program = kn.export(transformer_block, args, dynamic_shapes=spec)
    program.save(path)
    print(f"exported to {path} ({os.path.getsize(path)} bytes)")

    loaded = kn.load(path)
    for batch_size in (2, 5):
        inputs = (kn.randn(batch_size, *args[0].shape[1:], seed=42),) + args[1:]
        got = loaded(*inputs).numpy()
        want = transformer_block(*inputs).numpy()
        error = float(np.max(np.abs(got - want)))
        print(f"loaded program, batch {batch_size}: max |loaded - eager| = {error:.2e}")
        if error > 1e-5:
            print("MISMATCH between the loaded program and eager mode")
            return 1

    print(f"\n== kiln dump {os.path.basename(path)} ==", flush=True)
    return subprocess.call([sys.executable, "-m", "kiln", "dump", path])


if __name__ == "__main__":
    sys.exit(main())
