"""`kiln report TRACE_DIR`: the HTML pages of every compile a traced run recorded."""

from __future__ import annotations

import argparse
import sys

from kiln.errors import KilnError

_DESCRIPTION = """\
Turn a compile trace folder into static HTML pages (tlparse for kiln).

Record one by running a program with KILN_TRACE_DIR=DIR (or kn.compile(fn, trace_dir=DIR)):
every compile writes DIR/<pid>-<function>-<n>/ with each stage's IR, the graphs, every
kernel's Kernel IR, source and assembly, fusion groups, compile times, guards, recompile
reasons and cache hits. This command writes DIR/report/index.html (or -o OUT) with one
page per compile; graphs are drawn by Graphviz when `dot` is installed, else by kiln."""


def register(subparsers) -> None:
    """Add `kiln report` to the `kiln` command line."""
    report = subparsers.add_parser("report", help="HTML pages of a KILN_TRACE_DIR compile trace",
                                   description=_DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_argument("trace_dir", metavar="TRACE_DIR", help="the folder KILN_TRACE_DIR named")
    report.add_argument("-o", "--out", default=None, help="output folder (default TRACE_DIR/report)")
    report.add_argument("--no-dot", action="store_true",
                        help="draw graphs with kiln's layered drawing even when Graphviz is installed")
    report.set_defaults(handler=report_command)


def report_command(args) -> int:
    from kiln.report.html import build_report

    try:
        index = build_report(args.trace_dir, args.out, use_dot=False if args.no_dot else None)
    except (KilnError, OSError) as e:
        print(f"kiln report: error: {e}", file=sys.stderr)
        return 2
    print(index)
    return 0
