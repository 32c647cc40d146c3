"""Subprocess roles for the compile-cache security tests: a victim compiling a function,
an attacker building a hostile object entry, and `kiln dump --stage asm --target cuda`
with the Triton sources it loads recorded. Each prints one JSON line.

    python tests/security/cache_worker.py run x2
    python tests/security/cache_worker.py plant x2 /tmp/marker
    python tests/security/cache_worker.py triton
"""

import json
import re
import sys

import numpy as np

FUNCTIONS = {"x2": lambda x: x * 2, "x3": lambda x: x * 3}
X = np.arange(8, dtype=np.float32)


def run(name: str) -> dict:
    import kiln as kn
    from kiln.codegen import artifact_cache

    out = kn.compile(FUNCTIONS[name])(X).numpy()
    return {"out": out.tolist(), "stats": dict(artifact_cache.STATS)}


def inject_creat(ir: str, marker: str) -> str:
    """LLVM IR whose every function first calls `creat(marker, 0600)`."""
    path = marker.encode() + b"\0"
    const = "".join(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\{b:02X}" for b in path)
    lines, pending = [], False
    for line in ir.splitlines():
        if pending and line.strip() and not re.match(r"^[\w.$-]+:", line):
            lines.append("  %kiln_planted = call i32 @creat(ptr @.kiln_marker, i32 384)")
            pending = False
        lines.append(line)
        if line.startswith("define ") and line.rstrip().endswith("{"):
            pending = True
    lines.append(f'@.kiln_marker = private constant [{len(path)} x i8] c"{const}"')
    lines.append("declare i32 @creat(ptr, i32)")
    return "\n".join(lines) + "\n"


def plant(name: str, marker: str) -> dict:
    """Compile `name` with its object code replaced by one that creates `marker` (the
    entry lands in this process's own KILN_CACHE_DIR, to be copied into a victim's)."""
    import kiln.codegen.cpu.jit as jit

    real = jit.object_code

    def hostile(mod, opt_level=3):
        return real(jit.parse(inject_creat(str(mod), marker)), opt_level)

    jit.object_code = hostile
    return run(name)


def triton_asm() -> dict:
    """PTX of a small graph for sm_90 (no GPU needed), with the Triton sources loaded."""
    import kiln as kn
    from kiln.codegen.triton import aot
    from kiln.frontend.stages import render_stage

    sources = []
    real = aot.load_source

    def recording(source, name=None):
        sources.append(source)
        return real(source, name)

    aot.load_source = recording
    graph = kn.trace(lambda x: (x * 2).exp(), kn.ones(256))
    asm = render_stage(graph, "asm", target="cuda")
    return {"asm": asm, "sources": sources}


if __name__ == "__main__":
    role = sys.argv[1]
    result = {"run": lambda: run(sys.argv[2]), "plant": lambda: plant(sys.argv[2], sys.argv[3]),
              "triton": triton_asm}[role]()
    print(json.dumps(result))
