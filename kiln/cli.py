"""The `kiln` command line: `kiln dump`, `kiln run`, `kiln bench`, `kiln mem`, and the distributed
tools (`kiln launch`, `kiln store`, `kiln fr`), which register themselves from
kiln.distributed.

A command that fails on its input prints one line, `kiln <command>: error: ...`, to
stderr and exits 2 (argparse's convention for bad usage); tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kiln.errors import KilnError, KilnFormatError

_DUMP_DESCRIPTION = """\
Print a .kir file (written by kn.export(...).save() or kiln.ir.archive.save_graph).

formats:
  text   the graph in kiln's text IR, preceded by '#' comment lines with the file's
         versions and metadata (the output parses back with kiln.ir.parser)
  json   {"file": ..., "format_version": ..., "opset_version": ..., "kiln_version": ...,
          "metadata": {...}, "graph": {...}}: inputs, shape variables, nodes with
         operands, results, attributes (in text IR syntax) and nested regions,
         outputs, and constants (dtype and shape)
  dot    Graphviz DOT of the dataflow: inputs, ops, constants and outputs as
         distinct shapes, control-flow regions as clusters

The graph is shown as exported unless '--stage NAME' asks for a later stage of the
compiler (see the list below; '--target' picks the backend). A missing, corrupt, hostile or too-new file is reported in one
line on stderr with exit status 2; loading never runs code from the file."""

_DUMP_EPILOG = """\
examples:
  kiln dump mlp.kir
  kiln dump mlp.kir --format json | python -m json.tool
  kiln dump mlp.kir --format dot > mlp.dot && dot -Tsvg mlp.dot -o mlp.svg
  kiln dump mlp.kir --stage optimized       # fusion groups
  kiln dump mlp.kir --stage kernels         # Kernel IR
  kiln dump mlp.kir --stage source --target cpu   # LLVM IR
  kiln dump mlp.kir --stage source --target cuda  # Triton source
  kiln dump mlp.kir --stage asm --target cuda:sm_100   # PTX, built without a GPU
  kiln dump mlp.kir --stage asm --target rocm     # AMDGCN (gfx942)
  kiln dump mlp.kir --stage source --target opencl   # OpenCL C (Intel XPU, PoCL)"""


def register(subparsers) -> None:
    """Add `kiln dump` to the `kiln` parser's subcommands.

    >>> register(parser.add_subparsers())   # then: kiln dump FILE.kir --format json
    """
    dump = subparsers.add_parser(
        "dump", help="print an exported .kir graph as text, JSON or DOT",
        description=_DUMP_DESCRIPTION, epilog=_DUMP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    dump.add_argument("file", metavar="FILE.kir", help="the archive to print")
    dump.add_argument("--format", choices=("text", "json", "dot"), default="text",
                      help="output format (default: text; json and dot show the exported graph)")
    dump.add_argument("--stage", default="exported", metavar="NAME",
                      help="compiler stage to show (default: exported); one of: "
                      + ", ".join(_stage_names()))
    dump.add_argument("--target", default="cpu",
                      help="backend for code stages (default: cpu): cpu, cuda or rocm, optionally with "
                           "an architecture (cuda:sm_80|sm_90|sm_100, rocm:gfx90a|gfx942|gfx950); "
                           "cuda/rocm also show the stages ttir, ttgir, llir; opencl (or xpu) shows "
                           "opencl-c and spir")
    dump.set_defaults(handler=dump_command)

    run = subparsers.add_parser(
        "run", help="run an exported .kir program on inputs from .npy files",
        description="Run FILE.kir compiled, with one .npy file per input (read without "
        "pickle); outputs are written as out0.npy, out1.npy, ... into --out, or summarized.")
    run.add_argument("file", metavar="FILE.kir")
    run.add_argument("inputs", nargs="*", metavar="INPUT.npy")
    run.add_argument("--out", metavar="DIR", help="write outputs here as .npy files")
    run.add_argument("--backend", default="cpu", help="cpu (default) or reference")
    run.set_defaults(handler=run_command)

    bench = subparsers.add_parser(
        "bench", help="time an exported .kir program, compiled and interpreted",
        description="Run FILE.kir on random inputs of its input types and print the median "
        "time of the compiled program and of the reference interpreter.")
    bench.add_argument("file", metavar="FILE.kir")
    bench.add_argument("--size", action="append", default=[], metavar="VAR=N",
                       help="value of a symbolic dim, e.g. --size B=64 (default: its minimum, at least 1)")
    bench.add_argument("--repeat", type=int, default=20, help="timed runs (default 20)")
    bench.add_argument("--backend", default="cpu")
    bench.set_defaults(handler=bench_command)


def _stage_names() -> list[str]:
    from kiln.frontend.stages import stage_names

    return stage_names()


def _fail(command: str, message: str) -> int:
    print(f"kiln {command}: error: {message}", file=sys.stderr)
    return 2


def dump_command(args: argparse.Namespace) -> int:
    """Run `kiln dump`: print the archive, or one error line and return 2."""
    from kiln.ir.archive import read_archive

    try:
        archive = read_archive(args.file)
    except KilnFormatError as exc:
        return _fail("dump", f"[{exc.code}] {exc.message}")
    try:
        if args.stage == "exported":
            text = render_archive(archive, args.file, args.format)
        else:
            if args.format != "text":
                return _fail("dump", f"--format {args.format} shows the exported graph; "
                             f"stage {args.stage!r} prints as text")
            from kiln.frontend.stages import render_stage

            text = render_stage(archive.graph, args.stage, args.target)
    except KilnError as exc:
        return _fail("dump", f"[{exc.code}] {args.file}: {exc.message}")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `kiln dump x.kir | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


def render_archive(archive, label: str, fmt: str) -> str:
    """The text `kiln dump` prints for a loaded archive in format `fmt`.

    >>> render_archive(read_archive("m.kir"), "m.kir", "text")   # '# m.kir: ...\\ngraph @...'
    """
    from kiln.ir.dtypes import from_numpy
    from kiln.ir.render import graph_to_dot, graph_to_json
    from kiln.ir.types import TensorType

    if fmt == "dot":
        return graph_to_dot(archive.graph)
    info = {"file": label, "format_version": archive.format_version,
            "opset_version": archive.opset_version, "kiln_version": archive.kiln_version}
    if fmt == "json":
        doc = dict(info, metadata=archive.metadata, graph=graph_to_json(archive.graph))
        return json.dumps(doc, indent=2) + "\n"
    label = json.dumps(label)[1:-1]  # a file name is shown on one line, whatever it holds
    lines = [f"# {label}: kiln.kir format {archive.format_version}, opset "
             f"{archive.opset_version}, written by kiln {archive.kiln_version}"]
    if archive.metadata:
        lines.append("# metadata: " + json.dumps(archive.metadata, sort_keys=True))
    for name in sorted(archive.graph.constants):
        array = archive.graph.constants[name]
        kind = TensorType(from_numpy(array.dtype), array.shape)
        lines.append(f"# constant {json.dumps(name)}: {kind}")
    # each comment stays one line: json escapes newlines inside names and values
    return "\n".join(lines) + "\n" + str(archive.graph)


def run_command(args: argparse.Namespace) -> int:
    """Run `kiln run`: load the program and inputs, run it compiled, save or show outputs."""
    import numpy as np

    from kiln.frontend.compile import compile_graph
    from kiln.ir.archive import read_archive

    try:
        graph = read_archive(args.file).graph
        arrays = []
        for path in args.inputs:
            try:
                arrays.append(np.load(path, allow_pickle=False))
            except (OSError, ValueError) as exc:
                return _fail("run", f"{path}: not a readable .npy file ({exc})")
        if len(arrays) != len(graph.inputs):
            return _fail("run", f"{args.file} takes {len(graph.inputs)} inputs "
                         f"({', '.join(str(v.type) for v in graph.inputs)}), got {len(arrays)}")
        outputs = compile_graph(graph, args.backend).run(arrays)
    except KilnError as exc:
        return _fail("run", f"[{exc.code}] {exc.message}")
    for i, out in enumerate(outputs):
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            np.save(os.path.join(args.out, f"out{i}.npy"), out, allow_pickle=False)
        print(f"out{i}: {out.dtype}{list(out.shape)}"
              + (f" -> {os.path.join(args.out, f'out{i}.npy')}" if args.out else f" {np.array2string(out, threshold=8)}"))
    return 0


def bench_command(args: argparse.Namespace) -> int:
    """Run `kiln bench`: medians of the compiled program and of the interpreter."""
    import time

    import numpy as np

    from kiln.frontend.compile import compile_graph
    from kiln.ir.archive import read_archive
    from kiln.ir.interpret import run_graph
    from kiln.ir.shapes import evaluate

    try:
        graph = read_archive(args.file).graph
        sizes = {}
        for item in args.size:
            name, _, value = item.partition("=")
            if not value.isdigit():
                return _fail("bench", f"--size {item!r} must look like NAME=INT")
            sizes[name] = int(value)
        for name, var in graph.shape_vars.items():
            sizes.setdefault(name, max(var.min, var.multiple_of, 1))
        rng = np.random.default_rng(0)
        arrays = []
        for v in graph.inputs:
            shape = tuple(evaluate(d, sizes) for d in v.type.shape)
            data = rng.standard_normal(shape) if v.type.dtype.is_inexact else rng.integers(0, 4, shape)
            arrays.append(np.asarray(data).astype(v.type.dtype.np_dtype))
        start = time.perf_counter()
        compiled = compile_graph(graph, args.backend)
        compiled.run(arrays)
        compile_ms = (time.perf_counter() - start) * 1e3

        def median(fn):
            times = []
            for _ in range(max(args.repeat, 1)):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return float(np.median(times)) * 1e3

        ms_compiled = median(lambda: compiled.run(arrays))
        ms_interp = median(lambda: run_graph(graph, *arrays))
    except KilnError as exc:
        return _fail("bench", f"[{exc.code}] {exc.message}")
    print(f"{args.file}: sizes {sizes or '{}'}, backend {args.backend}")
    print(f"  compile + first run  {compile_ms:10.3f} ms")
    print(f"  compiled (median)    {ms_compiled:10.3f} ms")
    print(f"  interpreter (median) {ms_interp:10.3f} ms   ({ms_interp / max(ms_compiled, 1e-9):.1f}x)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="kiln: a compiler-first tensor framework. Inspect exported graphs, "
        "launch distributed jobs, analyze Flight Recorder dumps.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register(sub)
    from kiln.report.html import register as register_report

    register_report(sub)
    from kiln.runtime.mem_command import register as register_mem

    register_mem(sub)
    try:
        from kiln.distributed.commands import register as register_distributed
    except ImportError:  # kiln.distributed is optional to `kiln dump`
        register_distributed = None
    if register_distributed is not None:
        register_distributed(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `kiln` entry point; returns the exit status.

    >>> main(["dump", "mlp.kir", "--format", "dot"])   # 0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
