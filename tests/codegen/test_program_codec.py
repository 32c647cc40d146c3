"""The data-only program format of the whole-program cache (kiln/codegen/program_codec.py):
real programs come back equal (steps, Kernel IR, buffers, memory plan, constants), and a
file can only name the format's own classes and sympy heads."""

import json

import numpy as np
import pytest
import sympy

import kiln as kn
from kiln.codegen.program_codec import CodecError, decode_program, encode_program, same_program
from kiln.frontend.graph_compile import compile_graph
from kiln.ir.dtypes import float32, int64
from kiln import TensorSpec
from kiln.ir.shapes import ShapeVar, symbol
from kiln.runtime.program import BufferSpec, Control, Extern, Program


def program_of(fn, *args, **kw):
    return compile_graph(kn.trace(fn, *args, **kw), "cpu", build=False).program


def assert_same(a: Program, b: Program) -> None:
    assert (a.name, a.inputs, a.outputs, a.buffers, a.storage, a.release_after, a.shape_vars) == \
        (b.name, b.inputs, b.outputs, b.buffers, b.storage, b.release_after, b.shape_vars)
    assert a.kernels == b.kernels and len(a.steps) == len(b.steps)
    for k, v in a.constants.items():
        assert v.dtype == b.constants[k].dtype and v.tobytes() == b.constants[k].tobytes()
    for s, t in zip(a.steps, b.steps):
        if isinstance(s, Control):
            assert (s.op, s.inputs, s.outputs) == (t.op, t.inputs, t.outputs)
            for x, y in zip(s.bodies, t.bodies, strict=True):
                assert_same(x, y)
        else:
            assert s == t
    assert same_program(a, b)


def newton(a):
    return kn.while_loop(lambda i, y: i < 5, lambda i, y: (i + 1, 0.5 * (y + a / y)),
                         (kn.asarray(np.int32(0)), a))[1]


@pytest.mark.parametrize("fn, args, kw", [
    (lambda x, w: kn.softmax(kn.gelu(x @ w), dim=-1).sum(dim=0),
     (np.ones((4, 8), np.float32), np.ones((8, 3), np.float32)), {}),
    (newton, (np.full(16, 2.0, np.float32),), {}),
    (lambda x: kn.cond(x.sum() > 0, lambda a: a * 2, lambda a: -a, x) + kn.asarray(np.arange(6.0, dtype=np.float32)),
     (np.ones(6, np.float32),), {}),
    (lambda x: (x * 3).sum(dim=1), (np.ones((5, 7), np.float32),),
     {"dynamic_shapes": {"x": TensorSpec([ShapeVar("B", min=1, max=64), 7])}}),
], ids=["gemm-softmax", "while-loop", "cond-constant", "symbolic"])
def test_real_programs_round_trip(fn, args, kw):
    program = program_of(fn, *args, **kw)
    text = encode_program(program)
    again = decode_program(text)
    assert_same(program, again)
    assert encode_program(again) == text


def test_extern_attributes_round_trip():
    B = symbol("B")
    attrs = {"axes": (0, 2), "dtype": float32, "size": 3 * B + 1, "nan": float("nan"),
             "inf": float("-inf"), "flag": True, "name": "x", "none": None,
             "scalar": np.float32(1.5), "table": np.arange(6, dtype=np.int64).reshape(2, 3),
             "half": sympy.Rational(1, 2), "nested": [(1, "a"), {"k": 2}]}
    program = Program("p", [0], [1], {0: BufferSpec(float32, (B, 4)), 1: BufferSpec(int64, (B,))},
                      [Extern("argsort", attrs, (0,), (1,))], {}, shape_vars={"B": ShapeVar("B", 1, 9)})
    again = decode_program(encode_program(program))
    got = again.steps[0].attrs
    assert got["size"] == 3 * B + 1 and got["dtype"] == float32 and got["half"] == sympy.Rational(1, 2)
    assert np.isnan(got["nan"]) and got["inf"] == float("-inf") and got["nested"] == [(1, "a"), {"k": 2}]
    assert type(got["scalar"]) is np.float32 and got["scalar"] == 1.5
    assert got["table"].dtype == np.int64 and got["table"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert again.shape_vars == program.shape_vars and again.buffers == program.buffers
    assert same_program(program, again)
    attrs["table"] = attrs["table"] + 1  # a different constant is a different program
    assert not same_program(program, again)


@pytest.mark.parametrize("value", [lambda: 1, {1, 2}, np.array([object()], dtype=object),
                                   sympy.Symbol("q", real=True), sympy.sin(symbol("B"))],
                         ids=["function", "set", "object-array", "foreign-symbol", "sympy-sin"])
def test_values_the_format_cannot_hold_raise(value):
    program = Program("p", [], [], {}, [Extern("x", {"v": value}, (), ())], {})
    with pytest.raises(CodecError):
        encode_program(program)


def doc_of(fn, *args):
    return json.loads(encode_program(program_of(fn, *args)))


@pytest.mark.parametrize("spoil", [
    lambda d: d["nodes"].__setitem__(0, ["c", "Popen", [["l", ["sh"]]]]),
    lambda d: d["nodes"].__setitem__(0, ["c", "Launch", [0]]),  # wrong field count
    lambda d: d["nodes"].__setitem__(0, ["f", "Function", [["i", 1]]]),
    lambda d: d["nodes"].__setitem__(0, ["f", "Add", [["n", 5], ["i", 1]]]),  # forward reference
    lambda d: d["nodes"].__setitem__(0, ["s", "__import__('os')"]),
    lambda d: d.__setitem__("root", ["n", 0]),  # a root that is not a program
    lambda d: d.__setitem__("format", 99),
    lambda d: d["nodes"].append(["c", "Constant", [0, ["a", "|O", [1], "AAAAAAAAAAA="]]]),
    lambda d: d["nodes"].append(["c", "Constant", [0, ["a", "<f4", [4], "AAAA"]]]),  # short data
    lambda d: d["nodes"].append(["c", "Const", [["F", "0x1p99999"], ["D", "f32"]]]),  # overflow
], ids=["foreign-class", "field-count", "sympy-head", "forward-ref", "symbol-name", "root",
        "format", "object-dtype", "short-array", "float-overflow"])
def test_decoder_refuses_what_kiln_does_not_write(spoil):
    doc = doc_of(lambda x: (x * 2).sum(), np.ones(4, np.float32))
    spoil(doc)
    with pytest.raises(CodecError):
        decode_program(json.dumps(doc))
    with pytest.raises(CodecError):
        decode_program(b"\xff\xfe not json")
