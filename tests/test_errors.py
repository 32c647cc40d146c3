"""One test per error code: provoke it through the public API and check the message.
Every code is documented in docs/errors*.md."""

import pathlib
import re
import zipfile

import numpy as np
import pytest

import kiln as kn
from kiln import errors
from kiln.ir.parser import parse_graph

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def test_every_error_code_is_documented():
    text = "\n".join(p.read_text() for p in DOCS.glob("errors*.md"))
    for code, cls in errors.all_error_classes().items():
        assert re.search(rf"\|\s*{code}\s*\|\s*`{cls.__name__}`", text), \
            f"{code} ({cls.__name__}) is not in docs/errors*.md"


def test_codes_are_stable_and_unique():
    classes = errors.all_error_classes()
    assert classes["K101"] is kn.KilnShapeError and classes["K141"] is kn.KilnConcretizationError
    assert all(re.fullmatch(r"K\d{3}", code) for code in classes)


def raises(cls, *fragments):
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(cls)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            result = self.ctx.__exit__(*exc)
            message = str(self.info.value)
            assert message.startswith(f"[{cls.code}]"), message
            for fragment in fragments:
                assert fragment in message, f"{fragment!r} not in {message!r}"
            return result

    return _Check()


def test_K101_shape():
    with raises(kn.KilnShapeError, "add", "f32[2, 3]", "f32[4]", "equal or 1"):
        kn.ones(2, 3) + kn.ones(4)
    with raises(kn.KilnShapeError, "reshape", "f32[2, 3]", "element counts"):
        kn.ones(2, 3).reshape(4, 2)


def test_K102_dtype():
    with raises(kn.KilnDTypeError, "and", "f32", "integer or bool"):
        kn.ones(2) & kn.ones(2)
    with raises(kn.KilnDTypeError, "dtype", "q7"):
        kn.ones(2).to("q7")


def test_K103_argument():
    with raises(kn.KilnArgumentError, "transpose", "out of range", "rank 2"):
        kn.ones(2, 3).transpose(0, 5)
    with raises(kn.KilnArgumentError, "gelu", "approximate"):
        kn.gelu(kn.ones(2), approximate="fast")


def test_K104_index():
    with raises(kn.KilnIndexError, "index 5", "size 3"):
        kn.ones(3)[5]
    with raises(kn.KilnIndexError, "take", "out of range"):
        kn.ones(3)[[0, 7]]


def test_K105_device():
    with raises(errors.KilnDeviceError, "device"):
        raise errors.KilnDeviceError("device: tensors on cpu and cuda:0")


def test_K106_unknown_op():
    from kiln.ir.emitter import EAGER

    with raises(kn.KilnUnknownOpError, "frobnicate"):
        EAGER.call("frobnicate", np.ones(2))


def test_K110_verifier():
    with raises(kn.KilnVerifierError, "neg", "f32[2]"):
        parse_graph("graph @g(%x: f32[2]) -> f32[3]\n  %0 = neg(%x) : f32[3]\n  return %0\n")


def test_K120_parse():
    with raises(kn.KilnParseError, "line 2", "frobnicate"):
        parse_graph("graph @g(%x: f32[2]) -> f32[2]\n  %0 = frobnicate(%x) : f32[2]\n  return %0\n")


def test_K130_format(tmp_path):
    bad = tmp_path / "bad.kir"
    bad.write_bytes(b"this is not a zip file")
    with raises(kn.KilnFormatError, "bad.kir"):
        kn.load(bad)


def test_K131_format_version(tmp_path):
    import json

    path = tmp_path / "new.kir"
    kn.export(lambda x: x * 2, (kn.ones(2),)).save(path)
    with zipfile.ZipFile(path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(entries["manifest.json"])
    manifest["format_version"] = 99
    entries["manifest.json"] = json.dumps(manifest).encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    with raises(kn.KilnFormatVersionError, "99", "1"):
        kn.load(path)


def test_K140_trace():
    leaked = []
    kn.trace(lambda x: leaked.append(x) or x, kn.ones(2))
    with raises(kn.KilnTraceError, "after its trace ended"):
        leaked[0] * 2


def test_K141_concretization():
    def f(x):
        while x.sum() < 10:
            x = x * 2
        return x

    with raises(kn.KilnConcretizationError, "while x.sum() < 10", "kn.while_loop", "test_errors.py"):
        kn.trace(f, kn.ones(2))


def test_K150_shape_spec():
    B = kn.ShapeVar("B", max=4)
    with raises(kn.KilnShapeSpecError, "dim 0", "B", "5", "B <= 4"):
        kn.trace(lambda x: x, kn.ones(5), dynamic_shapes={"x": kn.TensorSpec([B])})


def test_K160_lowering():
    from kiln.codegen.lower import LoweringError, lower_fused

    # a hand-made loop group holding a reduction: no loop kernel computes that
    graph = parse_graph("""
graph @g(%x: f32[4, 8]) -> f32[4]
  %0 = fused(%x) {kind="loop"} : f32[4]
    region(%1: f32[4, 8]):
      %2 = reduce_sum(%1) {axes=(1,)} : f32[4]
      yield %2
    end
  return %0
""")
    with raises(LoweringError, "reduce_sum", "fused kernel"):
        lower_fused(graph.body.nodes[0], "k")


def test_K170_memory():
    from kiln.runtime.allocator import Allocator, KilnMemoryError

    with raises(KilnMemoryError, "over the limit", "set_memory_fraction"):
        Allocator(memory_fraction=1e-9).empty((1 << 20,), np.float32)


def test_K180_recompile_limit():
    from kiln.frontend.compile import KilnRecompileLimitError

    f = kn.compile(lambda x: x + 1, backend="reference", recompile_limit=1)
    f(np.ones(2, np.float32))
    with raises(KilnRecompileLimitError, "recompile_limit=1", "dim 0 changed from 2 to 3", "ShapeVar"):
        f(np.ones(3, np.float32))
