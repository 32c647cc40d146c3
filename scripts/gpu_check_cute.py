"""The `--cute` part of scripts/gpu_check.py: kiln's CuTeDSL GEMMs on a real GPU.

Sections (markdown tables, like the rest of gpu_check):

1. numerics: every epilogue kiln fuses (none, bias, relu, gelu-tanh, silu, row and column
   scale, residual, all together) for bfloat16 and float16, an unaligned tail (M and N
   not multiples of the tile), a batched GEMM, and fp8 (e4m3, per-row x per-column
   scales: what kn.scaled_matmul's fp8 form runs), each against torch on the same GPU;
2. speed: bf16 TFLOP/s at 4096^3 and 8192^3 against torch.matmul (cuBLAS; the issue's
   target is >= 0.9x at 8192^3), the cost of the full epilogue over the bare GEMM (target
   < 3%), and fp8 against torch._scaled_mm.
3. the MoE grouped GEMM (kiln/codegen/cute/grouped_gemm.py, sm90_grouped.py): numerics with
   ragged and empty groups and the fused epilogue against torch, then 64 experts against a
   loop of per-expert torch.matmul calls (the issue's target: >= 1.5x).

How nvidia-cutlass-dsl reaches the GPU machine. The H200 image has no nvidia-cutlass-dsl
and reaches no package index; its dependencies (cuda-bindings, protobuf, typing-extensions)
are there. The four wheels for its python (3.12) are ~90 MiB, libs-cu12 alone 87 MiB (one
192 MB shared library): more than one device call carries (64 MiB with the working tree,
~6 MiB). So they travel in two calls while the machine stays warm (30 s after a call):

    # here, once (the folders must be git-ignored to be carried)
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 -d /tmp/cute-whl nvidia-cutlass-dsl==4.8.1 \\
        nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu12==4.8.1
    echo '/.cute-wheels-*/' >> .git/info/exclude
    python scripts/gpu_check_cute.py pack /tmp/cute-whl     # -> .cute-wheels-1/, .cute-wheels-2/ (< 56 MiB each)
    # device call 1, carry [".cute-wheels-1"]: park part 1 outside the tree (seconds)
    python3 scripts/gpu_check_cute.py stage .cute-wheels-1
    # device call 2 at once, carry [".cute-wheels-2"]: join, check sha256, install, run
    KILN_CUTE_WHEELS=/tmp/kiln-cute-wheels:.cute-wheels-2 python3 scripts/gpu_check.py --cute

`pack` cuts the wheels' bytes into pieces over the two folders, each with a manifest of
every wheel's size, sha256 and pieces; `ensure_cutlass` joins the pieces it finds in the
KILN_CUTE_WHEELS folders, checks each wheel against the manifest, installs them with
`pip --no-index --no-deps --target` into a temporary site folder and adds it (its .pth
file included) to this process. A missing piece (the machine went back between the two
calls) is named, with the remedy: both calls again. KILN_CUTE_WHEELS may also name one
folder of whole wheels. Kernels for the GPU's arch (sm_90a on an H200) are compiled
there, for the real tensors' layouts (kiln/codegen/cute/run.py), a few seconds each; the
block-scaled NVFP4/MXFP8 kernels are sm_100a-only and are reported as not run on Hopper.
"""

from __future__ import annotations

import importlib.util
import os

WHEELS = ("nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
          "nvidia-cutlass-dsl-libs-core==4.8.1", "nvidia-cutlass-dsl-libs-cu12==4.8.1")


PARTS = (".cute-wheels-1", ".cute-wheels-2")
STAGE = "/tmp/kiln-cute-wheels"  # part 1 on the GPU machine, kept while the machine stays warm
PART_LIMIT = 56 * 2 ** 20        # per call: 64 MiB carried, the working tree (~6 MiB) included
MANIFEST = "manifest.json"


def wheels_hint() -> str:
    """How nvidia-cutlass-dsl reaches a GPU machine that cannot reach a package index."""
    return ("nvidia-cutlass-dsl is not installed here. Its wheels (~90 MiB: "
            f"{', '.join(WHEELS)}, for python 3.12) travel in two device calls: here `pip download --no-deps "
            "--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 "
            "-d /tmp/cute-whl ...` and `python scripts/gpu_check_cute.py pack /tmp/cute-whl` (folders "
            f"{' and '.join(PARTS)}, git-ignored); call 1 carries {PARTS[0]} and runs `python3 "
            f"scripts/gpu_check_cute.py stage {PARTS[0]}`; call 2, at once, carries {PARTS[1]} and sets "
            f"KILN_CUTE_WHEELS={STAGE}:{PARTS[1]}. See this script's docstring.")


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pack(wheel_dir: str, root: str = ".", limit: int = PART_LIMIT) -> list:
    """Cut the wheels of `wheel_dir` into the folders PARTS under `root`, at most `limit`
    bytes of pieces each (ValueError when they do not fit in two); returns the folders."""
    import glob
    import json
    import shutil

    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    if not wheels:
        raise ValueError(f"no .whl files in {wheel_dir}")
    total = sum(os.path.getsize(w) for w in wheels)
    if total > limit * len(PARTS):
        raise ValueError(f"the wheels are {total} bytes, more than {len(PARTS)} parts of {limit}")
    folders = [os.path.join(root, p) for p in PARTS]
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    manifest, part, used = {}, 0, 0
    for wheel in wheels:
        name, size = os.path.basename(wheel), os.path.getsize(wheel)
        pieces = []
        with open(wheel, "rb") as f:
            offset = 0
            while offset < size:
                if used == limit:
                    part, used = part + 1, 0
                n = min(size - offset, limit - used)
                piece = f"{name}.{len(pieces):02d}"
                with open(os.path.join(folders[part], piece), "wb") as out:
                    out.write(f.read(n))
                pieces.append(piece)
                offset, used = offset + n, used + n
        manifest[name] = {"size": size, "sha256": _sha256(wheel), "pieces": pieces}
    for folder in folders:
        with open(os.path.join(folder, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    return folders


def stage(folder: str, stage_dir: str = STAGE) -> None:
    """Device call 1: copy part `folder` (pieces and manifest) to `stage_dir`, outside the tree."""
    import shutil

    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        raise RuntimeError(f"{folder} holds no {MANIFEST}: carry a folder made by `gpu_check_cute.py pack`")
    os.makedirs(stage_dir, exist_ok=True)
    for name in os.listdir(folder):
        shutil.copyfile(os.path.join(folder, name), os.path.join(stage_dir, name))


def assemble(folders, out_dir: str) -> list:
    """The wheels of a `pack` joined from the pieces in `folders` into `out_dir`, each
    checked against the manifest; RuntimeError naming a missing piece or a bad wheel."""
    import json

    manifests = [os.path.join(f, MANIFEST) for f in folders if os.path.isfile(os.path.join(f, MANIFEST))]
    if not manifests:
        raise RuntimeError(f"no {MANIFEST} in {', '.join(folders)}")
    with open(manifests[0]) as f:
        manifest = json.load(f)
    paths = []
    for name, entry in sorted(manifest.items()):
        path = os.path.join(out_dir, name)
        with open(path, "wb") as out:
            for piece in entry["pieces"]:
                found = [os.path.join(f, piece) for f in folders if os.path.isfile(os.path.join(f, piece))]
                if not found:
                    raise RuntimeError(f"piece {piece} of {name} is in none of {', '.join(folders)}: the GPU "
                                       "machine went back between the two calls (it stays warm 30 s); run "
                                       "`stage` and this call again, the second at once")
                with open(found[0], "rb") as f:
                    out.write(f.read())
        if os.path.getsize(path) != entry["size"] or _sha256(path) != entry["sha256"]:
            raise RuntimeError(f"{name} joined from its pieces does not match its sha256 in {MANIFEST}")
        paths.append(path)
    return paths


def install_wheels(spec: str) -> str:
    """Install the wheels that `spec` names (folders joined by os.pathsep: pack parts, or
    one folder of whole wheels) into a temporary site folder and add it to this process
    (its .pth files included); returns the folder."""
    import glob
    import site
    import subprocess
    import sys
    import tempfile

    folders = [f for f in spec.split(os.pathsep) if f]
    target = tempfile.mkdtemp(prefix="kiln-cute-site-")
    if any(os.path.isfile(os.path.join(f, MANIFEST)) for f in folders):
        wheels = assemble(folders, tempfile.mkdtemp(prefix="kiln-cute-wheels-"))
    else:
        wheels = sorted(w for f in folders for w in glob.glob(os.path.join(f, "*.whl")))
    if not wheels:
        raise RuntimeError(f"KILN_CUTE_WHEELS={spec}: no wheels there. {wheels_hint()}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--target", target, *wheels], check=True, timeout=600)
    site.addsitedir(target)
    importlib.invalidate_caches()
    return target


def ensure_cutlass() -> None:
    """Import nvidia-cutlass-dsl, installing it from $KILN_CUTE_WHEELS when given; raise
    RuntimeError with `wheels_hint()` when it is not available."""
    if importlib.util.find_spec("cutlass") is None and os.environ.get("KILN_CUTE_WHEELS"):
        install_wheels(os.environ["KILN_CUTE_WHEELS"])
    if importlib.util.find_spec("cutlass") is None:
        raise RuntimeError(wheels_hint())


def _epilogues(m, n, out_dtype):
    """name -> (GemmKernel builder arguments, torch reference of the epilogue)."""
    from kiln.codegen.kernel_ir import IN, Acc, BufferParam, Const, Load, Op
    from kiln.ir import dtypes as dt
    from kiln.ir.shapes import symbol

    f32 = dt.float32
    gi, gj = symbol("gi"), symbol("gj")

    def op(name, *args, dtype=f32):
        return Op(name, tuple(args), dtype)

    bias = op("convert", Load("bias", gj, out_dtype))
    rs, cs = Load("row_scale", gi, f32), Load("col_scale", gj, f32)
    res = op("convert", Load("res", gi * n + gj, out_dtype))

    def gelu(t):
        inner = op("mul", op("add", t, op("mul", op("mul", op("mul", t, t), t), Const(0.044715, f32))),
                   Const(0.7978845608028654, f32))
        return op("mul", op("mul", t, Const(0.5, f32)), op("add", op("tanh", inner), Const(1.0, f32)))

    def silu(t):
        return op("div", t, op("add", Const(1.0, f32), op("exp", op("neg", t))))

    acc = Acc(f32)
    all_ops = op("add", op("max", op("add", gelu(op("mul", op("mul", op("add", acc, bias), rs), cs)),
                                     silu(op("add", acc, bias))), Const(0.0, f32)), res)
    exprs = {
        "none": acc,
        "bias": op("add", acc, bias),
        "bias + relu": op("max", op("add", acc, bias), Const(0.0, f32)),
        "bias + gelu(tanh)": gelu(op("add", acc, bias)),
        "bias + silu": silu(op("add", acc, bias)),
        "row x column scale": op("mul", op("mul", acc, rs), cs),
        "residual add": op("add", acc, res),
        "all of them": all_ops,
    }
    extra = (BufferParam("bias", out_dtype, (n,), IN), BufferParam("row_scale", f32, (m,), IN),
             BufferParam("col_scale", f32, (n,), IN), BufferParam("res", out_dtype, (m, n), IN))

    def torch_ref(name, torch, acc, t):
        b, r, c, rr = t["bias"].float(), t["row_scale"][:, None], t["col_scale"][None, :], t["res"].float()
        g = torch.nn.functional.gelu
        return {"none": lambda: acc, "bias": lambda: acc + b, "bias + relu": lambda: torch.relu(acc + b),
                "bias + gelu(tanh)": lambda: g(acc + b, approximate="tanh"),
                "bias + silu": lambda: torch.nn.functional.silu(acc + b),
                "row x column scale": lambda: acc * r * c, "residual add": lambda: acc + rr,
                "all of them": lambda: torch.relu(g((acc + b) * r * c, approximate="tanh")
                                                  + torch.nn.functional.silu(acc + b)) + rr}[name]()

    return exprs, extra, torch_ref


def _kernel(m, n, k, in_dtype, out_dtype, expr, extra, batch=1, b_rows=True):
    from kiln.codegen.kernel_ir import IN, OUT, BufferParam, GemmKernel, Op
    from kiln.ir import dtypes as dt

    used = {x.buffer for x in _loads(expr)}
    bufs = (BufferParam("a", in_dtype, (batch, m, k), IN),
            BufferParam("b", in_dtype, (batch, k, n) if b_rows else (batch, n, k), IN),
            *[e for e in extra if e.name in used], BufferParam("y", out_dtype, (batch, m, n), OUT))
    epi = Op("convert", (expr,), out_dtype) if out_dtype != dt.float32 else expr
    b_strides = (k * n, n, 1) if b_rows else (k * n, 1, k)
    return GemmKernel("gpu_check", bufs, (), "a", "b", "y", batch, m, n, k, (m * k, k, 1), b_strides, epi,
                      dt.float32)


def _loads(expr):
    from kiln.codegen.kernel_ir import Load, walk

    return [x for x in walk(expr) if isinstance(x, Load)]


def _inputs(torch, kernel, gen):
    arrays = {}
    for buf in kernel.buffers:
        shape = tuple(int(d) for d in buf.shape)
        tdtype = getattr(torch, buf.dtype.name)
        if buf.dtype.itemsize == 1:  # float8: small values, exactly representable
            arrays[buf.name] = (torch.randn(shape, generator=gen, device="cuda") * 2).to(tdtype)
        else:
            arrays[buf.name] = torch.randn(shape, generator=gen, device="cuda").to(tdtype)
    return arrays


def numerics(torch, report, table, arch, quick: bool) -> None:
    from cuda.bindings import driver

    from kiln.codegen.cute.run import GemmLauncher
    from kiln.ir import dtypes as dt

    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    cases = [(dt.bfloat16, 512, 768, 1024, 1), (dt.float16, 384, 256, 512, 1)]
    if not quick:
        cases += [(dt.bfloat16, 333, 200, 1024, 1), (dt.float16, 256, 512, 256, 4)]  # tail; batched
    for dtype, m, n, k, batch in cases:
        exprs, extra, torch_ref = _epilogues(m, n, dtype)
        for name, expr in exprs.items():
            kern = _kernel(m, n, k, dtype, dtype, expr, extra, batch)
            t = _inputs(torch, kern, gen)
            GemmLauncher(kern, arch, (128, 128), t)(t, stream)
            torch.cuda.synchronize()
            acc = (t["a"].double() @ t["b"].double()).float()
            ref = torch_ref(name, torch, acc, t).to(t["y"].dtype).float()
            err = (t["y"].float() - ref).abs().max().item()
            scale = ref.abs().max().item() or 1.0
            tol = 2 ** -6 if dtype == dt.bfloat16 else 2 ** -9
            rows.append([f"{dtype.name} {batch}x{m}x{n}x{k}", name, f"{err:.3g}", f"{err / scale:.2e}",
                         "ok" if err <= tol * scale * 4 else "FAIL"])
    # fp8 with per-row x per-column scales (kn.scaled_matmul's fp8 form), b K-major
    from kiln.codegen.kernel_ir import IN, Acc, BufferParam, Load, Op
    from kiln.ir.shapes import symbol

    m = n = k = 1024
    f32 = dt.float32
    expr = Op("mul", (Op("mul", (Acc(f32), Load("sa", symbol("gi"), f32)), f32), Load("sb", symbol("gj"), f32)), f32)
    extra = (BufferParam("sa", f32, (m,), IN), BufferParam("sb", f32, (n,), IN))
    kern = _kernel(m, n, k, dt.float8_e4m3fn, dt.bfloat16, expr, extra, b_rows=False)
    t = _inputs(torch, kern, gen)
    t["sa"], t["sb"] = t["sa"].abs() + 0.5, t["sb"].abs() + 0.5
    GemmLauncher(kern, arch, (128, 128), t)(t, stream)
    torch.cuda.synchronize()
    acc = (t["a"][0].double() @ t["b"][0].double().T).float()
    ref = (acc * t["sa"][:, None] * t["sb"][None, :]).to(torch.bfloat16).float()
    err = (t["y"][0].float() - ref).abs().max().item()
    rows.append(["float8_e4m3fn 1024^3 -> bf16", "row x column scale", f"{err:.3g}",
                 f"{err / ref.abs().max().item():.2e}", "ok" if err <= 2 ** -6 * ref.abs().max().item() * 4 else "FAIL"])
    report.add("CuTeDSL GEMM numerics (vs torch on this GPU)",
               table(["problem", "epilogue", "max abs err", "relative", "verdict"], rows))


def executor_launch(torch, report, table, arch, quick: bool) -> None:
    """The path a compiled program takes on cuda (kiln/codegen/cute/launch.py): one
    CuteGemmKernel with M symbolic, launched on device addresses for several M."""
    import dataclasses

    from kiln.codegen.cute.launch import CuteGemmKernel
    from kiln.codegen.cute.select import Choice
    from kiln.ir import dtypes as dt
    from kiln.ir.shapes import dim_function, symbol

    n, k = 768, 1024
    exprs, extra, torch_ref = _epilogues(symbol("M"), n, dt.bfloat16)
    kern = dataclasses.replace(_kernel(symbol("M"), n, k, dt.bfloat16, dt.bfloat16, exprs["all of them"], extra),
                               sizes=("M",))
    launched = CuteGemmKernel(kern, Choice("cute", "gpu check", arch, (128, 128)))
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for m in ((512, 333) if quick else (512, 333, 4096, 1)):
        t = {b.name: torch.randn(tuple(dim_function(d)({"M": m}) for d in b.shape), generator=gen,
                                 device="cuda").to(getattr(torch, b.dtype.name)) for b in kern.buffers}
        launched.launch_pointers([t[b.name].data_ptr() for b in kern.buffers], {"M": m},
                                 torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        acc = (t["a"].double() @ t["b"].double()).float()
        ref = torch_ref("all of them", torch, acc, t).to(torch.bfloat16).float()
        err, scale = (t["y"].float() - ref).abs().max().item(), ref.abs().max().item() or 1.0
        rows.append([f"bf16 {m}x{n}x{k}", f"{err:.3g}", f"{err / scale:.2e}",
                     "ok" if err <= 2 ** -6 * scale * 4 else "FAIL"])
    report.add(f"CuTeDSL GEMM through the executor's launch path (one compile for every M, "
               f"{launched.compile_seconds:.1f} s)", table(["problem", "max abs err", "relative", "verdict"], rows))


def speed(torch, report, table, bench_ms, arch, quick: bool) -> None:
    from cuda.bindings import driver

    from kiln.codegen.cute.run import GemmLauncher
    from kiln.codegen.cute.select import choose
    from kiln.ir import dtypes as dt

    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for size in ((4096,) if quick else (4096, 8192)):
        exprs, extra, _ = _epilogues(size, size, dt.bfloat16)
        flops = 2.0 * size ** 3
        times = {}
        for name in ("none", "all of them"):
            kern = _kernel(size, size, size, dt.bfloat16, dt.bfloat16, exprs[name], extra)
            picked = choose(kern, "sm_" + arch[3:-1])
            t = _inputs(torch, kern, gen)
            launch = GemmLauncher(kern, arch, picked.tile, t)
            times[name] = bench_ms(lambda: launch(t, stream))
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen)
        cublas = bench_ms(lambda: torch.matmul(a, b))
        tf = lambda ms: flops / ms / 1e9  # noqa: E731
        rows.append([f"bf16 {size}^3", f"{tf(times['none']):.0f}", f"{tf(cublas):.0f}",
                     f"{cublas / times['none']:.2f}x", f"{(times['all of them'] / times['none'] - 1) * 100:+.1f}%"])
    report.add("CuTeDSL GEMM speed (TFLOP/s)",
               table(["problem", "kiln CuTeDSL", "torch.matmul", "kiln / cuBLAS", "full epilogue cost"], rows))
    if hasattr(torch, "_scaled_mm"):
        size = 4096 if quick else 8192
        from kiln.codegen.kernel_ir import Acc
        from kiln.ir import dtypes as kdt

        kern = _kernel(size, size, size, kdt.float8_e4m3fn, kdt.bfloat16, Acc(kdt.float32), (), b_rows=False)
        t = _inputs(torch, kern, gen)
        launch = GemmLauncher(kern, arch, choose(kern, "sm_" + arch[3:-1]).tile, t)
        ours = bench_ms(lambda: launch(t, stream))
        one = torch.ones((), device="cuda")
        theirs = bench_ms(lambda: torch._scaled_mm(t["a"][0], t["b"][0].T, scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16))
        tf = lambda ms: 2.0 * size ** 3 / ms / 1e9  # noqa: E731
        report.add("CuTeDSL fp8 GEMM speed (TFLOP/s)",
                   table(["problem", "kiln CuTeDSL", "torch._scaled_mm", "ratio"],
                         [[f"e4m3 {size}^3 -> bf16", f"{tf(ours):.0f}", f"{tf(theirs):.0f}", f"{theirs / ours:.2f}x"]]))


def run(torch, report, table, bench_ms, quick: bool) -> None:
    """Every CuTeDSL section; each failure is reported in its table, the rest still runs."""
    ensure_cutlass()
    props = torch.cuda.get_device_properties(0)
    arch = {9: "sm_90a", 10: "sm_100a"}.get(props.major)
    if arch is None:
        raise RuntimeError(f"kiln's CuTeDSL GEMMs are for sm_90a and sm_100a; this GPU is sm_{props.major}{props.minor}")
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    for title, part in (("CuTeDSL GEMM numerics", lambda: numerics(torch, report, table, arch, quick)),
                        ("CuTeDSL GEMM through the executor's launch path",
                         lambda: executor_launch(torch, report, table, arch, quick)),
                        ("CuTeDSL GEMM speed", lambda: speed(torch, report, table, bench_ms, arch, quick))):
        try:
            part()
        except Exception as exc:  # one part failing must not hide the others
            report.failed(title, exc)
    try:
        grouped(torch, report, table, bench_ms, arch, quick)
    except Exception as exc:
        report.failed("CuTeDSL grouped GEMM", exc)
    if arch != "sm_100a":
        report.add("CuTeDSL block-scaled GEMM (NVFP4, MXFP8)",
                   f"**not run**: the block-scaled kernels (sm100_blockscaled.py) use tcgen05 block-scaled MMAs, "
                   f"sm_100a only; this GPU ({props.name}) is {arch}")


def grouped(torch, report, table, bench_ms, arch, quick: bool) -> None:
    from cuda.bindings import driver

    from kiln.codegen.cute.run import GroupedLauncher

    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    # numerics: ragged + empty groups, silu + bias + router scale, both weight layouts
    sizes = torch.tensor([300, 0, 17, 1024, 5, 0, 130, 64], dtype=torch.int32, device="cuda")
    t, k, n, e = int(sizes.sum()), 512, 384, len(sizes)
    for transpose in (False, True):
        x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
        w = torch.randn(e, n, k, device="cuda", generator=gen).bfloat16() if transpose else \
            torch.randn(e, k, n, device="cuda", generator=gen).bfloat16()
        bias = torch.randn(e, n, device="cuda", generator=gen).bfloat16()
        rs = torch.rand(t, device="cuda", generator=gen)
        y = torch.zeros(t, n, device="cuda", dtype=torch.bfloat16)
        GroupedLauncher(arch, x, w, y, sizes, bias=bias, row_scale=rs, activation="silu", transpose_rhs=transpose)(
            x, w, y, sizes, stream, bias=bias, row_scale=rs)
        torch.cuda.synchronize()
        ref, start = torch.empty(t, n, device="cuda"), 0
        for i, size in enumerate(sizes.tolist()):
            we = (w[i].T if transpose else w[i]).float()
            ref[start:start + size] = torch.nn.functional.silu(x[start:start + size].float() @ we + bias[i].float()) \
                * rs[start:start + size, None]
            start += size
        err = (y.float() - ref.bfloat16().float()).abs().max().item()
        rows.append([f"ragged {sizes.tolist()}, w {'[E, N, K]' if transpose else '[E, K, N]'}", f"{err:.3g}",
                     "ok" if err <= 2 ** -6 * 4 * ref.abs().max().item() else "FAIL"])
    report.add("CuTeDSL grouped GEMM numerics (silu + bias + router scale, vs torch)",
               table(["groups", "max abs err", "verdict"], rows))
    # speed: 64 experts, balanced, against a loop of per-expert matmuls
    e, t, k, n = 64, (4096 if quick else 16384), 2048, 1408
    sizes = torch.full((e,), t // e, dtype=torch.int32, device="cuda")
    x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
    w = torch.randn(e, k, n, device="cuda", generator=gen).bfloat16()
    y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    launch = GroupedLauncher(arch, x, w, y, sizes)
    ours = bench_ms(lambda: launch(x, w, y, sizes, stream))
    chunks = x.split(t // e)

    def loop():
        for i in range(e):
            torch.matmul(chunks[i], w[i])

    theirs = bench_ms(loop)
    tf = lambda ms: 2.0 * t * k * n / ms / 1e9  # noqa: E731
    report.add("CuTeDSL grouped GEMM speed (TFLOP/s)",
               table(["problem", "kiln CuTeDSL", "per-expert torch.matmul loop", "speed-up"],
                     [[f"{e} experts, {t} rows, K={k}, N={n}", f"{tf(ours):.0f}", f"{tf(theirs):.0f}",
                       f"{theirs / ours:.2f}x"]]))


def main(argv=None) -> int:
    """`pack WHEEL_DIR` (here) and `stage FOLDER` (device call 1); the check itself runs
    from scripts/gpu_check.py --cute."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("pack", help=f"cut downloaded wheels into {' and '.join(PARTS)}").add_argument("wheel_dir")
    sub.add_parser("stage", help=f"device call 1: park a part in {STAGE}").add_argument("folder")
    args = parser.parse_args(argv)
    if args.verb == "pack":
        for folder in pack(args.wheel_dir):
            size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
            print(f"{folder}: {size / 2 ** 20:.1f} MiB")
    else:
        stage(args.folder)
        print(f"staged {args.folder} in {STAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
