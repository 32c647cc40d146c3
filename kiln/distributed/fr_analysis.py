"""`kiln fr`: read every rank's Flight Recorder dump and name what went wrong.

Collectives are matched across ranks by (group, sequence number). The report lists
missing dumps, groups whose membership differs between ranks, collectives whose op,
sizes, dtypes, reduce op or root differ (naming the ranks that differ from the
majority), and the first collective of each group that some members never joined:
the usual culprit of a hang.

    >>> report = analyze(load_dumps("/tmp/fr"))
    >>> print(format_report(report))
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re

from kiln.distributed.errors import FlightRecorderError
from kiln.distributed.flight_recorder import group_key

_NAME = re.compile(r"kiln_fr_rank(\d+)\.json$")
# what must agree across ranks, per collective (all_to_all splits and gather/scatter
# roots' buffers legitimately differ, so only the fields listed here are compared)
_FIELDS = ("op", "input_dtypes", "numel", "reduce_op", "root")


def load_dumps(directory: str) -> dict[int, dict]:
    """rank -> dump, from `kiln_fr_rank<R>.json` files; FlightRecorderError if none."""
    if not os.path.isdir(directory):
        raise FlightRecorderError("%s is not a directory" % directory,
                                  hint="pass the KILN_FR_DIR the job ran with")
    dumps: dict[int, dict] = {}
    for path in sorted(glob.glob(os.path.join(directory, "kiln_fr_rank*.json"))):
        match = _NAME.search(path)
        if not match:
            continue
        try:
            with open(path) as f:
                dump = json.load(f)
        except (OSError, ValueError) as err:
            raise FlightRecorderError("cannot read %s: %s" % (path, err)) from None
        if not isinstance(dump, dict) or not isinstance(dump.get("records"), list):
            raise FlightRecorderError("%s is not a kiln Flight Recorder dump" % path)
        dumps[int(match.group(1))] = dump
    if not dumps:
        raise FlightRecorderError("no kiln_fr_rank*.json dumps in %s" % directory,
                                  hint="dumps are written on failure, SIGUSR1 or "
                                  "pg.dump_flight_recorder() when KILN_FR_DIR is set")
    return dumps


def _signature(rec: dict) -> tuple:
    return tuple(json.dumps(rec.get(f)) for f in _FIELDS)


def _where(rec: dict) -> str:
    frames = rec.get("frames") or []
    if not frames:
        return "(no call site)"
    f = frames[0]
    text = "%s:%s in %s" % (f.get("file"), f.get("line"), f.get("function"))
    return text + (": " + f["source"] if f.get("source") else "")


def analyze(dumps: dict[int, dict]) -> dict:
    """The report as a JSON-able dict (see `format_report` for the text form)."""
    world = max(int(d.get("world_size", 0)) for d in dumps.values())
    world = max(world, max(dumps) + 1)
    report: dict = {"world_size": world, "dumps": sorted(dumps),
                    "missing_dumps": [r for r in range(world) if r not in dumps],
                    "membership": [], "mismatches": [], "never_joined": [], "failed_peers": [],
                    "epochs": [], "ranks": {}}
    views = collections.defaultdict(dict)  # group -> rank -> membership list
    for rank, dump in dumps.items():
        for name, info in (dump.get("groups") or {}).items():
            views[name][rank] = list(info.get("ranks", []))
    members_of = {}
    for name, by_rank in sorted(views.items()):
        counts = collections.Counter(json.dumps(v) for v in by_rank.values())
        members_of[name] = json.loads(counts.most_common(1)[0][0])
        if len(counts) > 1:
            report["membership"].append({"group": name, "views": {str(r): v for r, v in
                                                                  sorted(by_rank.items())}})
    # members of any epoch (a fault-tolerant group's joiners have uids past the world size)
    everyone = set(range(world)).union(*members_of.values())
    report["missing_dumps"] = sorted(everyone - set(dumps))
    for name, members in sorted(members_of.items()):
        by_rank = {}
        for rank in members:
            if rank in dumps:
                by_rank[rank] = {rec["seq"]: rec for rec in dumps[rank]["records"]
                                 if _key(rec) == name and not rec.get("p2p")}
        _analyze_group(report, name, members, by_rank,
                       {r: int(d.get("time_ns", 0)) for r, d in dumps.items()})
    _failed_peers(report, dumps, members_of)
    for rank, dump in sorted(dumps.items()):
        recs = [r for r in dump["records"] if not r.get("p2p")]
        stuck = [r for r in recs if r.get("state") in ("scheduled", "started")]
        failed = [r for r in recs if r.get("state") == "failed"]
        report["ranks"][str(rank)] = {
            "reason": dump.get("reason"), "records": len(recs),
            "in_flight": ["%s %s seq %d" % (r["group"], r["op"], r["seq"]) for r in stuck],
            "failed": ["%s %s seq %d: %s" % (r["group"], r["op"], r["seq"], r.get("error"))
                       for r in failed]}
    return report


def _key(rec: dict) -> str:
    return group_key(rec.get("group", ""), int(rec.get("epoch") or 0))


def _failed_peers(report: dict, dumps: dict[int, dict], members_of: dict) -> None:
    """Which global ranks their peers saw die (PeerFailure records, translated from
    group ranks through the membership of that group's epoch), and the epoch changes."""
    seen = collections.defaultdict(set)  # (global rank, group key) -> reporting ranks
    for rank, dump in dumps.items():
        for rec in dump["records"]:
            if rec.get("op") == "reconfigure":
                entry = {"group": rec.get("group"), "epoch": rec.get("epoch"),
                         "members": rec.get("members"), "removed": rec.get("removed"),
                         "joined": rec.get("joined"), "reason": rec.get("reason")}
                if entry not in report["epochs"]:
                    report["epochs"].append(entry)
                for dead in rec.get("removed") or []:  # left out: dead or unresponsive
                    seen[dead, group_key(rec.get("group", ""), int(rec.get("from_epoch") or 0))
                         ].add(rank)
            failed = rec.get("failed_rank")
            members = members_of.get(_key(rec))
            if isinstance(failed, int) and members and 0 <= failed < len(members):
                seen[members[failed], _key(rec)].add(rank)
    for (dead, group), reporters in sorted(seen.items()):
        if dead not in reporters:  # a rank does not report itself (an abort notice relayed)
            report["failed_peers"].append({"rank": dead, "group": group,
                                           "reported_by": sorted(reporters),
                                           "dumped": dead in dumps})
    report["epochs"].sort(key=lambda e: (e["group"] or "", e["epoch"] or 0))


def _analyze_group(report: dict, name: str, members: list[int], by_rank: dict,
                   dump_times: dict[int, int]) -> None:
    # a ring buffer may have dropped old records: only seqs every rank still covers
    # are compared (a rank with no record of the group covers everything)
    lows = [min(recs) for recs in by_rank.values() if recs]
    floor = max(lows) if lows else 0
    seqs = sorted({s for recs in by_rank.values() for s in recs if s >= floor})
    reported_absent = False
    for seq in seqs:
        present = {r: recs[seq] for r, recs in by_rank.items() if seq in recs}
        absent = [r for r in by_rank if seq not in by_rank[r]]
        if present:
            # a dump taken before anyone issued this collective cannot show it: not a culprit
            issued = min(rec.get("time_created_ns") or 0 for rec in present.values())
            absent = [r for r in absent if dump_times.get(r, 0) >= issued]
        classes = collections.defaultdict(list)
        for rank, rec in present.items():
            classes[_signature(rec)].append(rank)
        if len(classes) > 1:
            ordered = sorted(classes.values(), key=lambda rs: (-len(rs), rs))
            majority = ordered[0]
            ref = present[majority[0]]
            for odd_ranks in ordered[1:]:
                odd = present[odd_ranks[0]]
                fields = [f for f in _FIELDS if odd.get(f) != ref.get(f)]
                report["mismatches"].append({
                    "group": name, "seq": seq, "fields": fields, "ranks": sorted(odd_ranks),
                    "majority_ranks": sorted(majority),
                    "call": _describe(odd), "majority_call": _describe(ref),
                    "input_sizes": odd.get("input_sizes"),
                    "majority_input_sizes": ref.get("input_sizes"),
                    "where": _where(odd), "majority_where": _where(ref)})
        if absent and present and not reported_absent:
            reported_absent = True  # later ones are consequences of the first
            some = next(iter(present.values()))
            report["never_joined"].append({
                "group": name, "seq": seq, "op": some.get("op"), "ranks": sorted(absent),
                "waiting_ranks": sorted(present),
                "states": {str(r): rec.get("state") for r, rec in sorted(present.items())},
                "last_seq": {str(r): (max(by_rank[r]) if by_rank[r] else None) for r in absent},
                "call": _describe(some), "where": _where(some)})


def _describe(rec: dict) -> str:
    text = "%s(%s" % (rec.get("op"), ", ".join(
        "%s%s" % (d, s) for d, s in zip(rec.get("input_dtypes") or [], rec.get("input_sizes") or [])))
    for key in ("reduce_op", "root"):
        if rec.get(key) is not None:
            text += ", %s=%s" % (key, rec[key])
    return text + ")"


def format_report(report: dict) -> str:
    """A readable multi-section table of `analyze`'s report."""
    lines = ["kiln fr: dumps from ranks %s (world size %d)" % (
        ", ".join(map(str, report["dumps"])), report["world_size"])]
    if report["missing_dumps"]:
        lines.append("MISSING DUMPS: rank %s (dead before dumping, or KILN_FR_DIR differs)"
                     % ", ".join(map(str, report["missing_dumps"])))
    for item in report["membership"]:
        lines.append("GROUP MEMBERSHIP DISAGREES for '%s':" % item["group"])
        lines += ["  rank %s sees ranks %s" % (r, v) for r, v in item["views"].items()]
    if report["mismatches"]:
        lines.append("COLLECTIVES THAT DIFFER ACROSS RANKS:")
        lines.append("  %-18s %5s  %-12s %-14s %s" % ("group", "seq", "differs in", "ranks",
                                                      "call (vs majority)"))
        for m in report["mismatches"]:
            lines.append("  %-18s %5d  %-12s %-14s %s  vs  %s on ranks %s" % (
                m["group"], m["seq"], ",".join(m["fields"]), _ranks(m["ranks"]), m["call"],
                m["majority_call"], _ranks(m["majority_ranks"])))
            lines.append("      rank %d at %s" % (m["ranks"][0], m["where"]))
            lines.append("      rank %d at %s" % (m["majority_ranks"][0], m["majority_where"]))
    if report["never_joined"]:
        lines.append("RANKS THAT NEVER JOINED A COLLECTIVE (likely cause of a hang):")
        for n in report["never_joined"]:
            lines.append("  group '%s' seq %d %s: rank %s never called it (last seq %s); "
                         "ranks %s waited (%s)" % (
                             n["group"], n["seq"], n["call"], _ranks(n["ranks"]),
                             ", ".join("%s" % v for v in n["last_seq"].values()),
                             _ranks(n["waiting_ranks"]),
                             ", ".join(sorted(set(n["states"].values())))))
            lines.append("      called at %s" % n["where"])
    if report["failed_peers"]:
        lines.append("RANKS THEIR PEERS SAW FAIL (died, killed, or closed their connection):")
        for f in report["failed_peers"]:
            lines.append("  rank %d in group '%s': reported by ranks %s%s" % (
                f["rank"], f["group"], _ranks(f["reported_by"]),
                "" if f["dumped"] else "; it left no dump (killed?)"))
    if report["epochs"]:
        lines.append("MEMBERSHIP CHANGES (fault-tolerant groups):")
        for e in report["epochs"]:
            lines.append("  group '%s' epoch %s (%s): members %s, removed %s, joined %s" % (
                e["group"], e["epoch"], e["reason"], e["members"], e["removed"], e["joined"]))
    if not (report["missing_dumps"] or report["membership"] or report["mismatches"]
            or report["never_joined"] or report["failed_peers"]):
        lines.append("no problem found: every rank joined every collective with the same "
                     "arguments")
    lines.append("PER RANK:")
    lines.append("  %-5s %-8s %-9s %-7s %s" % ("rank", "records", "in flight", "failed",
                                                "dump reason"))
    for rank, info in report["ranks"].items():
        lines.append("  %-5s %-8d %-9d %-7d %s" % (rank, info["records"], len(info["in_flight"]),
                                                   len(info["failed"]), info["reason"]))
        for item in (info["in_flight"] + info["failed"])[:3]:
            lines.append("        %s" % item[:150])
    return "\n".join(lines)


def has_problems(report: dict) -> bool:
    return bool(report["missing_dumps"] or report["membership"] or report["mismatches"]
                or report["never_joined"] or report["failed_peers"])


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))
