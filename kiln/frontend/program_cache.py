"""The whole-program compile cache: a traced graph's lowered program and machine code in
ONE on-disk entry, so a new process compiling the same function skips the graph passes,
fusion, lowering, per-kernel cache keys and LLVM.

Key: kiln's version, a hash of the source of every stage that turns a traced graph into
code (kiln/ir, kiln/passes, kiln/codegen, the Program and memory plan, this file and
graph_compile.py), the
backend and its options (`cache_key()`), the host CPU, the compile mode, and the traced
graph itself: its canonical text (`print_graph`: values named by position, attributes
sorted, regions and shape-variable constraints included) and every constant's dtype,
shape and bytes. The traced graph determines the program (kn.compile's guards decide
which graph a call traces to), so an equal key means an equal program.

Entry (kind "programs" of kiln/codegen/artifact_cache.py, sealed with the cache's HMAC
key like every entry): `u64 length | JSON | object code`. The JSON holds the program in
the data-only format of kiln/codegen/program_codec.py (no pickle, no eval; spliced in as a
JSON object, so the entry is parsed once), the kernel names in build order, whether
the backend's legalize pass left every kernel as it was (`legal`) and, when it did, the
backend's load hints (`hints`: which kernels share code, each distinct loop kernel's
per-stage work estimate; what a load would otherwise recompute by walking every kernel);
the object code is the backend's relocatable ELF, checked by
cache_elf before the loader sees it. Any entry that fails its tag, its structure, its
decoding or its loading is removed and rebuilt: it fails closed.

`STATS` counts what this process's cache did (tests read it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from kiln.errors import KilnError

KIND = "programs"
STATS = {"hits": 0, "misses": 0, "stores": 0, "corrupt": 0, "uncacheable": 0}
_SETTINGS = ("KILN_COMPLEX_GEMM",)
_SETTING_PACKAGES = ("kiln.ir.", "kiln.passes.", "kiln.codegen.")


def enabled(target, mode: str, device) -> bool:
    """Whether a compile may use the whole-program cache: host programs of a backend
    that caches object code, default mode (max-autotune measures on this machine), and
    not turned off with KILN_PROGRAM_CACHE=0."""
    return (device is None and mode == "default" and getattr(target, "caches_object_code", False)
            and os.environ.get("KILN_PROGRAM_CACHE", "1") != "0")


def program_key(graph, target, mode: str) -> str | None:
    """The cache key of compiling `graph` for `target`; None when the graph has no
    canonical text (an attribute the printer cannot write)."""
    from kiln._version import __version__
    from kiln.codegen import artifact_cache
    from kiln.frontend.kernel_cache import _host_cpu
    from kiln.ir.printer import print_graph

    try:
        text = print_graph(graph)
    except (TypeError, ValueError, KeyError):
        return None
    consts = hashlib.sha256()
    for name in sorted(graph.constants):
        array = graph.constants[name]
        consts.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        consts.update(array.tobytes())
    # settings the passes read from the environment (complex_decompose: the GEMM split)
    settings = "|".join(f"{name}={os.environ.get(name, '')}" for name in _SETTINGS)
    return artifact_cache.content_key(__version__, source_hash(), *target.cache_key(), _host_cpu(),
                                      mode, settings, module_settings(), text, consts.hexdigest())


def module_settings() -> str:
    """The compiler's switches and thresholds that differ from their defaults now: an
    upper-case module constant (bool, int, float, str) of a loaded kiln.ir / kiln.passes /
    kiln.codegen module whose value is not the literal its source assigns. A switch
    flipped at run time (`batching.ENABLED = False`, an autotune threshold) changes the
    programs compiled from then on, so it changes the key; defaults are covered by the
    source hash, and only deviations count, so the key does not depend on which modules
    happen to be loaded."""
    from kiln.frontend.compiler_source import SETTING_TYPES, compiler_state

    defaults = compiler_state().defaults
    out = []
    for name in sorted(n for n in sys.modules if n.startswith(_SETTING_PACKAGES)):
        table = defaults.get(name)
        if not table:
            continue
        module = vars(sys.modules[name])
        for attr, default in table.items():
            value = module.get(attr, default)
            if type(value) in SETTING_TYPES and value != default:
                out.append(f"{name}.{attr}={value!r}")
    return "\n".join(out)


def source_hash() -> str:
    """A hash of the content of every stage between a traced graph and machine code
    (kiln/ir, kiln/passes, kiln/codegen, the Program and memory plan, graph_compile.py
    and the cache's own files): a change to a pass or a lowering rule must invalidate
    cached programs. Read once per process, and memoized across processes by the
    files' stat (kiln/frontend/compiler_source.py says why that is sound)."""
    from kiln.frontend.compiler_source import compiler_state

    return compiler_state().digest


def load(key: str):
    """(program, kernel names, object code, legal, hints) from the entry under `key`, or
    None (absent, refused, or not loadable: a refused entry is removed, the caller
    rebuilds). `hints`: the entry's checked load hints (`_hints`) or None, as
    `load_kernels` takes them."""
    from kiln.codegen import artifact_cache
    from kiln.codegen.program_codec import CodecError, decode_program

    decoded: dict = {}

    def validate(payload: bytes) -> None:  # raises ValueError: the entry is refused
        if len(payload) < 8:
            raise ValueError("short entry")
        n = int.from_bytes(payload[:8], "little")
        if n > len(payload) - 8:
            raise ValueError("bad length")
        try:
            head = json.loads(payload[8:8 + n])
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ValueError("bad header") from None
        if not isinstance(head, dict) or not isinstance(head.get("names"), list) \
                or not isinstance(head.get("program"), dict) or type(head.get("legal")) is not bool:
            raise ValueError("bad header")
        try:  # CodecError is a ValueError; anything else a file provokes is refused too
            program = decode_program(head["program"])
        except (TypeError, KeyError, AttributeError, IndexError, OverflowError, ZeroDivisionError) as e:
            raise CodecError(f"program codec: {type(e).__name__}") from None
        names = head["names"]
        if not all(isinstance(name, str) and name in program.kernels for name in names) \
                or set(names) != set(program.kernels):
            raise CodecError("kernel names do not match the program")
        hints = _hints([program.kernels[name] for name in names], head.get("hints"))
        objects = payload[8 + n:]
        artifact_cache.VALIDATORS["objects"](objects)
        decoded.update(program=program, names=names, objects=objects, legal=head["legal"],
                       hints=hints if head["legal"] else None)

    before = artifact_cache.STATS["corrupt"]
    payload = artifact_cache.load(key, KIND, validate=validate)
    if payload is None:
        STATS["misses"] += 1
        if artifact_cache.STATS["corrupt"] > before:
            STATS["corrupt"] += 1
        return None
    STATS["hits"] += 1
    return decoded["program"], decoded["names"], decoded["objects"], decoded["legal"], decoded["hints"]


def encode(program) -> str | None:
    """The program in the cache's format, or None when it holds a value the format
    cannot hold or that does not come back equal (it is then simply not cached)."""
    from kiln.codegen.program_codec import CodecError, decode_program, encode_program, same_program

    try:
        text = encode_program(program)
        # the format must give back exactly this program: check before anyone relies on it
        if not same_program(decode_program(text), program):
            raise CodecError("program codec: the program does not round-trip")
    except (CodecError, RecursionError, ValueError, TypeError):
        STATS["uncacheable"] += 1
        return None
    return text


def all_legal(target, kernels: list) -> bool:
    """Whether `target` compiles every kernel as it is (its legalize pass, memoized by
    the backend, rewrote none): then a load need not legalize them again."""
    return all(target.legalize(k) is k for k in kernels)


def _hints(kernels: list, hints) -> tuple | None:
    """(distinct kernels, index, costs) from an entry's `hints`, the form checked (raises
    ValueError: the entry is refused); None when the entry has none. The index is
    `_distinct`'s: per kernel, the position of the first kernel with its code, numbered
    in order of first appearance; a kernel shares code only with a `_twins` of it."""
    if hints is None:
        return None
    if not isinstance(hints, dict) or set(hints) != {"index", "costs"}:
        raise ValueError("bad load hints")
    index, costs = hints["index"], hints["costs"]
    if not isinstance(index, list) or len(index) != len(kernels) or not isinstance(costs, list):
        raise ValueError("bad load hints")
    unique: list = []
    for kernel, i in zip(kernels, index):
        if type(i) is not int or not 0 <= i <= len(unique):
            raise ValueError("bad load hints")
        if i == len(unique):
            unique.append(kernel)
        elif not _twins(unique[i], kernel):
            raise ValueError("bad load hints")
    if len(costs) != len(unique) or not all(c is None or (isinstance(c, list) and len(c) < 1 << 16)
                                            for c in costs):
        raise ValueError("bad load hints")
    return unique, index, costs


def _twins(a, b) -> bool:
    """Whether `b` may run `a`'s code as far as a cheap look tells: the same kind of
    kernel, buffers (count, dtypes, roles) and size names."""
    return type(a) is type(b) and tuple(a.sizes) == tuple(b.sizes) and len(a.buffers) == len(b.buffers) \
        and all(x.dtype == y.dtype and x.role == y.role for x, y in zip(a.buffers, b.buffers))


def load_hints(target, kernels: list, legal: bool):
    """The backend's load hints for `kernels` (JSON data), or None: the backend has
    none, or a kernel is not legal as it is (a load legalizes, and hints describe the
    kernels the backend compiles)."""
    hints = getattr(target, "load_hints", None)
    if not legal or hints is None:
        return None
    index, costs = hints(kernels)
    return {"index": list(index), "costs": costs}


def store(key: str, text: str, names: list, objects: bytes, legal: bool = False,
          hints: dict | None = None) -> bool:
    """Write the entry (`text` from `encode`; `legal` from `all_legal`; `hints` from
    `load_hints`); False when the cache is disabled."""
    from kiln.codegen import artifact_cache

    # the program's JSON object is spliced in as is: the entry is parsed once on load
    head = ('{"names":' + json.dumps(list(names)) + ',"legal":' + json.dumps(bool(legal))
            + ',"hints":' + json.dumps(hints if legal else None) + ',"program":' + text + "}").encode()
    ok = artifact_cache.store(key, len(head).to_bytes(8, "little") + head + objects, KIND)
    STATS["stores"] += ok
    return ok


def load_kernels(target, program, names: list, objects: bytes, legal: bool = False,
                 hints: tuple | None = None):
    """The compiled kernels of a cached program, or None when the object code does not
    load (an entry from an incompatible build: the caller rebuilds and overwrites it).
    `legal`: the entry's kernels were found legal for this backend when it was stored
    (the key covers the backend's source and options, so they still are): the backend's
    legalize pass, a walk of every kernel, is skipped. `hints` (only with `legal`): the
    entry's checked load hints (`_hints`), which the backend takes instead of walking
    every kernel again."""
    try:
        kernels = [program.kernels[n] for n in names]
        if legal:
            return target.load_built_object_code(kernels, objects, hints)
        return target.load_object_code(kernels, objects)
    except (KilnError, OSError, RuntimeError, ValueError, KeyError):
        STATS["corrupt"] += 1
        return None
