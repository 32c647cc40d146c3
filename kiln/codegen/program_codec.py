"""A `Program` (steps, buffers, memory plan, constants, Kernel IR) as JSON and back.

The whole-program compile cache (kiln/frontend/program_cache.py) stores a lowered program
with its machine code, so that a new process compiling the same graph skips the graph
passes, fusion and lowering. Its format is data only: a decoder that builds objects of a
closed list of classes (the runtime's steps, Kernel IR, dtypes, shape variables) field by
field, sympy expressions from a closed list of functions (`expr.func(*expr.args)`, sympy's
own rebuild rule), arrays from raw bytes with an explicit dtype. Nothing is unpickled or
evaluated; anything else in a file is `CodecError`.

Kernel IR expressions are DAGs (a Newton loop reuses a value many times), so objects are
written once into a node table and referred to by index: the text stays linear in the
DAG's size. Values the encoder does not know (an extern attribute of an unusual type)
raise `CodecError` too, and the caller then simply does not cache that program.

    text = encode_program(program)
    same = decode_program(text)        # equal steps, kernels, buffers, constants
"""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np
import sympy

from kiln.codegen import kernel_ir as kir
from kiln.ir.dtypes import DType, _BY_SHORT
from kiln.ir.shapes import ShapeVar, symbol
from kiln.runtime import program as rp

FORMAT = 1

# the only classes a file may name, by name; each is rebuilt with its init fields
CLASSES: dict[str, type] = {cls.__name__: cls for cls in (
    rp.Program, rp.BufferSpec, rp.Launch, rp.Extern, rp.Collective, rp.View, rp.Constant,
    rp.Control, kir.BufferParam, kir.Const, kir.Load, kir.IndexValue, kir.Op, kir.ReduceRef,
    kir.Acc, kir.Loop, kir.Reduce, kir.Store, kir.Kernel, kir.GemmKernel, kir.BatchKernel,
    ShapeVar)}
_FIELDS = {name: tuple(f.name for f in dataclasses.fields(cls) if f.init) for name, cls in CLASSES.items()}

# the sympy expression heads index and size expressions use
SYMPY_FUNCS: dict[str, type] = {f.__name__: f for f in (
    sympy.Add, sympy.Mul, sympy.Pow, sympy.Mod, sympy.floor, sympy.ceiling, sympy.Max,
    sympy.Min, sympy.Abs, sympy.sign)}


class CodecError(ValueError):
    """A value the program format cannot hold, or a file that is not a valid program."""


# -- encoding ---------------------------------------------------------------------------

# immutable all the way down: equal encodings may share one decoded object (a model's
# repeated layers lower to kernels equal but for their names, full of equal expressions)
_SHARED = frozenset(cls for cls in CLASSES.values() if cls.__module__ == kir.__name__) | {
    rp.BufferSpec, rp.Launch, rp.View, rp.Constant, ShapeVar}


class _Encoder:
    def __init__(self):
        self.nodes: list = []
        self.seen: dict[int, int] = {}
        self.by_text: dict[str, int] = {}
        self.keep: list = []  # ids stay unique while the objects live

    def ref(self, obj) -> list:
        key = id(obj)
        index = self.seen.get(key)
        if index is None:
            body = self.node(obj)
            shared = type(obj) in _SHARED or isinstance(obj, sympy.Basic)
            text = json.dumps(body, separators=(",", ":"), allow_nan=False) if shared else None
            index = self.by_text.get(text) if shared else None
            if index is None:
                index = len(self.nodes)
                self.nodes.append(body)
                if shared:
                    self.by_text[text] = index
            self.seen[key] = index
            self.keep.append(obj)
        return ["n", index]

    def node(self, obj) -> list:
        if isinstance(obj, sympy.Basic):
            return self.sympy_node(obj)
        name = type(obj).__name__
        if CLASSES.get(name) is not type(obj):
            raise CodecError(f"program codec: cannot store a {type(obj).__module__}.{name}")
        return ["c", name, [self.value(getattr(obj, f)) for f in _FIELDS[name]]]

    def sympy_node(self, e: sympy.Basic) -> list:
        if isinstance(e, sympy.Symbol):
            if e != symbol(e.name):  # kiln's symbols are integer, >= 0 (shapes.symbol)
                raise CodecError(f"program codec: symbol {e} has assumptions kiln does not use")
            return ["s", e.name]
        if isinstance(e, sympy.Integer):
            return ["i", int(e)]
        if isinstance(e, sympy.Rational):
            return ["q", int(e.p), int(e.q)]
        head = type(e).__name__
        if SYMPY_FUNCS.get(head) is not e.func:
            raise CodecError(f"program codec: cannot store the sympy expression {e}")
        return ["f", head, [self.value(a) for a in e.args]]

    def value(self, v):
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and type(v) is int:
            return v
        if type(v) is float:
            return ["F", v.hex()]  # exact, and NaN/inf survive
        if isinstance(v, DType):
            return ["D", v.short]
        if isinstance(v, tuple):
            return ["t", [self.value(x) for x in v]]
        if isinstance(v, list):
            return ["l", [self.value(x) for x in v]]
        if isinstance(v, dict):
            return ["d", [[self.value(k), self.value(x)] for k, x in v.items()]]
        if isinstance(v, np.ndarray):
            return self.array(v)
        if isinstance(v, np.generic):
            return ["g", v.dtype.str, base64.b64encode(v.tobytes()).decode()]
        if _field_names(type(v)) is not None or isinstance(v, sympy.Basic):
            return self.ref(v)
        raise CodecError(f"program codec: cannot store a value of type {type(v).__name__}")

    def array(self, a: np.ndarray) -> list:
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise CodecError(f"program codec: cannot store an array of dtype {a.dtype}")
        data = np.ascontiguousarray(a).tobytes()
        return ["a", a.dtype.str, list(a.shape), base64.b64encode(data).decode()]


def encode_program(program: rp.Program) -> str:
    """`program` as JSON text (CodecError for a value the format cannot hold)."""
    enc = _Encoder()
    root = enc.ref(program)
    return json.dumps({"format": FORMAT, "nodes": enc.nodes, "root": root},
                      separators=(",", ":"), allow_nan=False)


_NAMES: dict[type, tuple | None] = {}


def _field_names(cls: type) -> tuple | None:
    """The field names of dataclass `cls` (None: not a dataclass), asked once per class:
    `same_program` compares ~10^4 objects of a few dozen classes."""
    names = _NAMES.get(cls)
    if names is None and cls not in _NAMES:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls)) \
            if dataclasses.is_dataclass(cls) else None
    return names


def same_program(a: rp.Program, b: rp.Program) -> bool:
    """Equal programs: fields, steps (sub-programs recursively), Kernel IR, and constants
    bit for bit (arrays have no `==` that answers one bool). Kernel IR is a DAG (a traced
    random-bits expression shares its subtrees many times over): pairs already found equal
    are remembered, so the walk is linear in the DAG, where dataclass `==` re-walks every
    shared subtree (exponential)."""
    return _Same().value(a, b)


class _Same:
    def __init__(self):
        self.equal: set[tuple[int, int]] = set()
        self.keep: list = []  # the ids above stay unique while compared

    def value(self, x, y) -> bool:
        if x is y:
            return True
        if type(x) is not type(y):
            return False
        if isinstance(x, np.ndarray):
            return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        if isinstance(x, np.generic):
            return x.dtype == y.dtype and x.tobytes() == y.tobytes()
        if isinstance(x, float) and x != x:
            return y != y
        if isinstance(x, (tuple, list)):
            return len(x) == len(y) and all(self.value(p, q) for p, q in zip(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(self.value(v, y[k]) for k, v in x.items())
        names = _field_names(type(x))
        if names is None and not isinstance(x, sympy.Basic):
            return bool(x == y)
        pair = (id(x), id(y))
        if pair in self.equal:
            return True
        if names is None:
            same = x == y
        else:
            same = all(self.value(getattr(x, f), getattr(y, f)) for f in names)
        if same:
            self.equal.add(pair)
            self.keep.append((x, y))
        return bool(same)


# -- decoding ---------------------------------------------------------------------------

class _Decoder:
    def __init__(self, nodes: list):
        if not isinstance(nodes, list):
            raise CodecError("program codec: no node table")
        self.nodes = nodes
        self.built: list = [None] * len(nodes)
        self.done = [False] * len(nodes)

    def ref(self, index):
        # nodes are written after everything they refer to, so an entry may only refer
        # backwards: no recursion into unbuilt nodes, no cycles
        if type(index) is not int or not 0 <= index < len(self.nodes) or not self.done[index]:
            raise CodecError("program codec: bad node reference")
        return self.built[index]

    def build_all(self) -> None:
        for i, body in enumerate(self.nodes):
            self.built[i] = self.node(body)
            self.done[i] = True

    def node(self, body):
        tag = _tag(body)
        if tag == "c":
            _, name, values = _shape(body, 3)
            cls = CLASSES.get(name) if isinstance(name, str) else None
            if cls is None or not isinstance(values, list) or len(values) != len(_FIELDS[name]):
                raise CodecError(f"program codec: bad object {str(name)[:40]}")
            value = self.value
            args = [value(v) for v in values]  # init fields, in order
            try:
                return cls(*args)
            except (TypeError, ValueError) as e:
                raise CodecError(f"program codec: bad {name}: {e}") from None
        if tag == "s":
            _, name = _shape(body, 2)
            if not isinstance(name, str) or not name.isidentifier():
                raise CodecError("program codec: bad symbol")
            return symbol(name)
        if tag == "i":
            _, n = _shape(body, 2)
            return sympy.Integer(_int(n))
        if tag == "q":
            _, p, q = _shape(body, 3)
            if _int(q) == 0:
                raise CodecError("program codec: bad rational")
            return sympy.Rational(_int(p), _int(q))
        if tag == "f":
            _, head, args = _shape(body, 3)
            func = SYMPY_FUNCS.get(head) if isinstance(head, str) else None
            if func is None or not isinstance(args, list):
                raise CodecError(f"program codec: bad sympy head {str(head)[:40]}")
            values = [self.value(a) for a in args]
            if not all(isinstance(a, (sympy.Basic, int)) for a in values):
                raise CodecError("program codec: bad sympy argument")
            try:
                return _rebuild(func, values)
            except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
                raise CodecError(f"program codec: bad {head}: {e}") from None
        raise CodecError("program codec: bad node")

    def value(self, v):
        kind = type(v)
        if kind is list and len(v) == 2 and v[0] == "n":  # the common case, inline
            index = v[1]
            if type(index) is int and 0 <= index < len(self.nodes) and self.done[index]:
                return self.built[index]
            raise CodecError("program codec: bad node reference")
        if v is None or kind is bool or kind is str or kind is int:
            return v
        tag = _tag(v)
        if tag == "D" and len(v) == 2 and type(v[1]) is str and v[1] in _BY_SHORT:
            return _BY_SHORT[v[1]]
        if tag == "t" and len(v) == 2 and type(v[1]) is list:
            value = self.value
            return tuple([value(x) for x in v[1]])
        if tag == "n":
            return self.ref(_shape(v, 2)[1])
        if tag == "F":
            try:
                return float.fromhex(_shape(v, 2)[1])
            except (TypeError, ValueError, OverflowError):
                raise CodecError("program codec: bad float") from None
        if tag == "D":
            short = _shape(v, 2)[1]
            if short not in _BY_SHORT:
                raise CodecError("program codec: bad dtype")
            return _BY_SHORT[short]
        if tag in ("t", "l"):
            items = _shape(v, 2)[1]
            if not isinstance(items, list):
                raise CodecError("program codec: bad sequence")
            out = [self.value(x) for x in items]
            return tuple(out) if tag == "t" else out
        if tag == "d":
            pairs = _shape(v, 2)[1]
            if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                raise CodecError("program codec: bad mapping")
            try:
                return {self.value(k): self.value(x) for k, x in pairs}
            except TypeError:
                raise CodecError("program codec: bad mapping key") from None
        if tag == "a":
            _, dtype, shape, data = _shape(v, 4)
            dt, raw = _np_dtype(dtype), _b64(data)
            if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
                raise CodecError("program codec: bad array shape")
            if int(np.prod(shape, dtype=np.int64)) * dt.itemsize != len(raw):
                raise CodecError("program codec: array size does not match its shape")
            return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
        if tag == "g":
            _, dtype, data = _shape(v, 3)
            dt, raw = _np_dtype(dtype), _b64(data)
            if len(raw) != dt.itemsize:
                raise CodecError("program codec: bad scalar")
            return np.frombuffer(raw, dtype=dt)[0]
        raise CodecError("program codec: bad value")


def _rebuild(func, args: list):
    """The expression `func(*args)` for args taken from a canonical expression, rebuilt
    as it was written: sums and products by sympy's `_from_args`, other heads with
    `evaluate=False` (no re-sorting or re-simplifying: Max/Min/Mod evaluation costs up to
    ~10 ms each; the cache stores a program only after it came back equal)."""
    if func is sympy.Add or func is sympy.Mul:
        if len(args) < 2 or not all(isinstance(a, sympy.Expr) for a in args):
            raise CodecError("program codec: bad sum or product")
        return func._from_args(args)
    return func(*args, evaluate=False)


def _tag(v):
    if not isinstance(v, list) or not v or not isinstance(v[0], str):
        raise CodecError("program codec: bad entry")
    return v[0]


def _shape(v: list, n: int) -> list:
    if len(v) != n:
        raise CodecError(f"program codec: bad {v[0]!r} entry")
    return v


def _int(n) -> int:
    if type(n) is not int:
        raise CodecError("program codec: bad integer")
    return n


def _np_dtype(text) -> np.dtype:
    if not isinstance(text, str) or len(text) > 8:
        raise CodecError("program codec: bad array dtype")
    try:
        dt = np.dtype(text)
    except TypeError:
        raise CodecError("program codec: bad array dtype") from None
    if dt.hasobject or dt.fields is not None or dt.itemsize == 0:
        raise CodecError("program codec: bad array dtype")
    return dt


def _b64(text) -> bytes:
    if not isinstance(text, str):
        raise CodecError("program codec: bad data")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise CodecError("program codec: bad data") from None


def decode_program(text: str | bytes | dict) -> rp.Program:
    """The Program `encode_program` wrote (its text, or that text already parsed by
    `json.loads` as part of a larger document); CodecError for anything else."""
    if isinstance(text, dict):
        doc = text
    else:
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise CodecError("program codec: not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CodecError("program codec: unknown format")
    dec = _Decoder(doc.get("nodes"))
    try:
        dec.build_all()
        program = dec.value(doc.get("root"))
    except RecursionError:
        raise CodecError("program codec: nesting too deep") from None
    if not isinstance(program, rp.Program):
        raise CodecError("program codec: the root is not a program")
    return program
