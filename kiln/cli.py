"""The `kiln` command line: `kiln dump`, and the distributed tools (`kiln launch`,
`kiln store`, `kiln fr`), which register themselves from kiln.distributed."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="kiln: a compiler-first tensor framework. Inspect exported graphs, "
        "launch distributed jobs, analyze Flight Recorder dumps.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from kiln.dump import register as register_dump

    register_dump(sub)
    from kiln.distributed.commands import register as register_distributed

    register_distributed(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
