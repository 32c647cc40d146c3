"""`kiln mem`: the kiln processes of this user on this host and what each holds per
device (the figures each publishes, kiln/runtime/memory_tracking.py)."""

from __future__ import annotations

import argparse
import json

from kiln.memory_limits import human

_DESCRIPTION = """\
List the kiln processes of this user on this host and the memory each holds, per
device: allocated (live tensors and runtime buffers), reserved (allocated plus what the
caching allocator keeps for reuse), their peaks, and the per-process limit.

Each kiln process publishes its figures (refreshed within a quarter second of a change)
as a JSON file in $KILN_MEM_DIR, else $XDG_RUNTIME_DIR/kiln-mem, else /tmp/kiln-mem-UID;
files of processes that have exited are ignored."""


def register(subparsers) -> None:
    """Add `kiln mem` to the `kiln` command line."""
    mem = subparsers.add_parser("mem", help="memory held by each kiln process, per device",
                                description=_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mem.add_argument("--json", action="store_true", help="print the records as JSON")
    mem.add_argument("--dir", default=None, help="the folder to read (default: as above)")
    mem.set_defaults(handler=mem_command)


def _short(nbytes: int) -> str:
    return human(nbytes).split(" (")[0]


def mem_command(args: argparse.Namespace) -> int:
    from kiln.runtime.memory_tracking import read_processes

    records = read_processes(args.dir)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    if not records:
        print("no kiln process is publishing memory figures")
        return 0
    header = f"{'PID':>8}  {'DEVICE':<8} {'ALLOCATED':>10} {'RESERVED':>10} {'PEAK ALLOC':>10} " \
             f"{'PEAK RES':>10} {'LIMIT':>10}  COMMAND"
    print(header)
    for record in records:
        devices = record["devices"] or {"-": {}}
        for i, (device, f) in enumerate(sorted(devices.items())):
            cells = [_short(f[k]) if k in f else "-" for k in
                     ("allocated", "reserved", "peak_allocated", "peak_reserved", "limit")]
            command = record["command"][:60] if i == 0 else ""
            print(f"{record['pid']:>8}  {device:<8} " + " ".join(f"{c:>10}" for c in cells)
                  + f"  {command}")
    return 0
