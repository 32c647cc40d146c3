"""The `kiln` command line: `kiln dump`, and the distributed tools (`kiln launch`,
`kiln store`, `kiln fr`), which register themselves from kiln.distributed.

A command that fails on its input prints one line, `kiln <command>: error: ...`, to
stderr and exits 2 (argparse's convention for bad usage); tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kiln.errors import KilnFormatError

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

The graph is shown as exported; '--stage NAME' (optimized, kernels, source) arrives
with the compiler. A missing, corrupt, hostile or too-new file is reported in one
line on stderr with exit status 2; loading never runs code from the file."""

_DUMP_EPILOG = """\
examples:
  kiln dump mlp.kir
  kiln dump mlp.kir --format json | python -m json.tool
  kiln dump mlp.kir --format dot > mlp.dot && dot -Tsvg mlp.dot -o mlp.svg"""


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
                      help="output format (default: text)")
    dump.set_defaults(handler=dump_command)


def dump_command(args: argparse.Namespace) -> int:
    """Run `kiln dump`: print the archive, or one error line and return 2."""
    from kiln.ir.archive import read_archive

    try:
        archive = read_archive(args.file)
    except KilnFormatError as exc:
        print(f"kiln dump: error: {exc.message}", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(render_archive(archive, args.file, args.format))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="kiln: a compiler-first tensor framework. Inspect exported graphs, "
        "launch distributed jobs, analyze Flight Recorder dumps.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register(sub)
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
