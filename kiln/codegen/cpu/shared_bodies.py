"""Kernel bodies that differ only in integer constants, compiled once per module.

A training step's kernels come in near-twins: the GEMM of a [512, 64] x [64, 65] logits
product and that of its gradient, [512, 65] x [65, 64], emit the same LLVM text but for
the 64s and 65s in their strides, trip counts and masks; AdamW's update of a [64, 256]
weight and of a [256, 64] one differ in the order of two extents. LLVM's pipeline and
code generation (most of a cold compile) then ran once per twin: the small GPT step's 53
distinct kernels are 44 shapes of code.

`merge_twins` (over the one-kernel modules a build deals to its threads) and
`share_module` (inside one module: a batch's members) group kernel bodies
(`define internal void @*.body`) whose text is equal once every integer literal is
blanked out (and their loop metadata nodes are equal), and where the members differ only
in literals that are plain i64 operands of integer arithmetic, comparisons, selects,
GEPs, phis or calls of non-intrinsics. Such a group gets ONE function,
`@FIRST.body.shared`, whose extra trailing i64 parameters stand for the literals that
differ (one parameter per distinct column of values), and each member's body becomes a
call of it with its own constants. Everything else (types, vector constants, alignments,
float constants, metadata) is equal across the group by construction, so each member
computes exactly what its own body did; only what LLVM can fold is less.

The shared function is `noinline` (as every body is) and `noduplicate`, which keeps
IPSCCP's function specialization from cloning it back per constant. What it costs at
run time: extents and strides are registers instead of immediates (measured in
benchmarks/results/cpu.md, section session10_lead).
"""

from __future__ import annotations

import re

# an integer literal token: not part of a name (%v64, @f_2, !3, i64, label7) nor a float
_LITERAL = re.compile(r"(?<![\w.%@!#$\-])(-?\d+)(?![\w.])")  # split: text, literal, text...
_HEADER = re.compile(r"define internal void @([\w.]+)\((.*?)\) ([a-z \"\-]+)\{\n")
_PARAM = re.compile(r"(ptr|i64|i32|i8|i1|float|double)(?: [a-z]+)* (%[\w.]+)")
_LOOP_REF = re.compile(r"!llvm\.loop !(\d+)")
_META_REF = re.compile(r"!(\d+)")
# lines whose i64 operands may be registers: integer arithmetic, icmp, select, GEP, phi,
# a call of a function that is not an intrinsic (whose arguments may be immediates only)
_SAFE_LINE = re.compile(
    r"\s*%[\w.]+ = (?:(?:add|sub|mul|sdiv|udiv|srem|urem|shl|lshr|ashr|and|or|xor)"
    r"(?: nuw| nsw| exact| disjoint)* i64 |icmp [a-z]+ i64 |select i1 [^,]+, i64 "
    r"|getelementptr (?:inbounds )?[^,\[<]+, ptr |phi i64 \[)"
    r"|\s*(?:%[\w.]+ = )?(?:tail )?call [^@]+@(?!llvm\.)[\w.]+\(")
# what may stand right before such an operand
_OPERAND_PREFIXES = ("i64 ", ", ", "[ ")
MAX_PARAMETERS = 24  # a group needing more differing constants than this is left alone


def share_module(module):
    """`module` with its own constant-only twin bodies (a batch's members) made calls of
    one shared body; the same object, changed in place (its functions list)."""
    bodies = [i for i, f in enumerate(module.functions) if _is_body(f)]
    if len(bodies) < 2:
        return module
    meta = _metadata_nodes(module.metadata)
    groups: dict = {}
    for i in bodies:
        p = _parse(module.functions[i], meta)
        if p is not None:
            groups.setdefault(p["key"], []).append((i, p))
    functions = list(module.functions)
    extra: list[str] = []
    for members in groups.values():
        shared = _shared([p for _, p in members]) if len(members) > 1 else None
        if shared is not None:
            extra.append(shared[0])
            for (i, _), call in zip(members, shared[1]):
                functions[i] = call
    if extra:
        module.functions = extra + functions
    return module


def merge_twins(parts: list) -> list:
    """`parts` (one kernel's Module each, in order) with each group of kernels whose bodies
    differ only in constants merged into ONE Module (at the first one's place) holding the
    shared body, each kernel's forwarding body and each kernel's other functions."""
    from kiln.codegen.cpu.ir_builder import Module

    keys = [part_key(p) for p in parts]
    first: dict = {}
    for i, k in enumerate(keys):
        if k is not None:
            first.setdefault(k, []).append(i)
    out, taken, apart = [], set(), set()
    for i, part in enumerate(parts):
        if i in taken:
            continue
        members = first.get(keys[i], [i]) if keys[i] is not None else [i]
        if len(members) < 2 or keys[i] in apart:
            out.append(part)
            continue
        group = [parts[j] for j in members]
        parsed = [_parse(_body_of(g), _metadata_nodes(g.metadata)) for g in group]
        # the merged module keeps the first's metadata: another's functions must not use theirs
        shared = None if any(_META_REF.search(f) for g in group[1:] for f in g.functions
                             if not _is_body(f)) else _shared(parsed)
        if shared is None:  # they differ where a register cannot stand: each alone
            apart.add(keys[i])
            out.append(part)
            continue
        taken.update(members)
        merged = Module(f32_math=part.f32_math)
        merged.text_weight = part.text_weight
        merged.metadata = list(part.metadata)  # the shared body's loops: the first's
        merged.functions = [shared[0]]
        for g, call in zip(group, shared[1]):
            for name, line in g.declarations.items():
                merged.declarations.setdefault(name, line)
            for f in g.functions:
                if _is_body(f):
                    merged.functions.append(call)
                elif g is part or not (g.helpers and _defined(f) in g.helpers):
                    merged.functions.append(f)  # ABI wrappers; the first's helpers
            merged.helpers |= g.helpers
        out.append(merged)
    return out


_BODY_START = "define internal void @"


def _defined(function: str) -> str:
    head = function[:function.index("(")]
    return head[head.rindex("@") + 1:]


def _body_of(module) -> str:
    return next(f for f in module.functions if _is_body(f))


def _metadata_nodes(metadata: list[str]) -> dict:
    nodes = {}
    for line in metadata:
        m = re.match(r"!(\d+) = (.*)$", line)
        if m:
            nodes[m.group(1)] = m.group(2)
    return nodes


def _node_text(ref: str, meta: dict, depth: int = 0) -> str:
    """A loop metadata node with its own id and its children resolved (ids differ per
    kernel; contents are what must match)."""
    body = meta.get(ref, "?")
    if depth > 3:
        return body
    return _META_REF.sub(lambda m: "self" if m.group(1) == ref else
                         "{" + _node_text(m.group(1), meta, depth + 1) + "}", body)


def _parse(text: str, meta: dict) -> dict | None:
    """A kernel body's parts: header, parameters, its literals' values, and its key, the
    text with literals blanked and loop metadata resolved (None: not a kernel body)."""
    global _parsed_chars
    cached = _PARSED.get(text)
    if cached is None:
        cached = _parse_text(text)
        if _parsed_chars + len(text) > PARSED_CHARS:
            _PARSED.clear()
            _parsed_chars = 0
        _PARSED[text] = cached
        _parsed_chars += len(text)
    if cached is False:
        return None
    loops = "|".join(_node_text(r, meta) for r in cached["loop_refs"])
    return dict(cached, key=(cached["shape"], loops))


# function text -> its parse (or False): a build parses a kernel when it is fed and again
# when twins merge; the texts kept are bounded (a parse holds ~3 copies of its text)
_PARSED: dict = {}
PARSED_CHARS = 4_000_000
_parsed_chars = 0


def _parse_text(text: str):
    head = _HEADER.match(text)
    if head is None or not head.group(1).endswith(".body"):
        return False
    params = []
    for p in head.group(2).split(", "):
        m = _PARAM.fullmatch(p)
        if m is None:
            return False
        params.append((m.group(1), m.group(2)))
    body = text[head.end():]
    pieces = _LITERAL.split(body)  # one pass: the text between literals, and the literals
    shape = (head.group(2), head.group(3), _LOOP_REF.sub("!llvm.loop !?", "#".join(pieces[0::2])))
    return {"name": head.group(1), "params": params, "attrs": head.group(3), "head": head.group(0),
            "body": body, "values": pieces[1::2], "shape": shape,
            "loop_refs": _LOOP_REF.findall(body)}


def part_key(module) -> tuple | None:
    """What a one-kernel module's body must equal for it to share with another's: its
    key, loop metadata resolved (None for a module of no body, or of several)."""
    bodies = [f for f in module.functions if _is_body(f)]
    if len(bodies) != 1:
        return None
    parsed = _parse(bodies[0], _metadata_nodes(module.metadata))
    return None if parsed is None else parsed["key"]


def _is_body(function: str) -> bool:
    if not function.startswith(_BODY_START):
        return False
    head = _HEADER.match(function)
    return head is not None and head.group(1).endswith(".body")


def _safe(body: str, start: int) -> bool:
    """Whether the literal at `start` of `body` is an operand a register may replace."""
    line_start = body.rfind("\n", 0, start) + 1
    return (body[line_start:start].endswith(_OPERAND_PREFIXES)
            and _SAFE_LINE.match(body, line_start) is not None)


def _shared(group: list[dict]) -> tuple[str, list[str]] | None:
    """(the shared definition, each member's forwarding body), or None where a differing
    literal is not a plain i64 operand (or there are too many)."""
    first = group[0]
    starts = [m.start() for m in _LITERAL.finditer(first["body"])]
    columns: dict = {}  # tuple of the members' values -> parameter index
    slots: dict = {}  # literal position -> parameter index
    for k, start in enumerate(starts):
        column = tuple(g["values"][k] for g in group)
        if len(set(column)) == 1:
            continue
        if not _safe(first["body"], start):
            return None
        slots[k] = columns.setdefault(column, len(columns))
    if len(columns) > MAX_PARAMETERS:
        return None
    name = first["name"] + ".shared"
    pieces, last = [], 0
    for k, start in enumerate(starts):
        if k in slots:
            pieces.append(first["body"][last:start])
            pieces.append(f"%kiln.k{slots[k]}")
            last = start + len(first["values"][k])
    pieces.append(first["body"][last:])
    params = first["head"][first["head"].index("(") + 1:first["head"].rindex(")")]
    extra = "".join(f", i64 %kiln.k{j}" for j in range(len(columns)))
    definition = (f"define internal void @{name}({params}{extra}) {first['attrs'].strip()} noduplicate {{\n"
                  + "".join(pieces))
    forwarded = ", ".join(f"{ty} {ref}" for ty, ref in first["params"])
    calls = []
    for m, g in enumerate(group):
        consts = [None] * len(columns)
        for column, j in columns.items():
            consts[j] = column[m]
        args = ", ".join([forwarded] + [f"i64 {c}" for c in consts])
        calls.append(f"{g['head']}entry:\n  call void @{name}({args})\n  ret void\n}}")
    return definition, calls
