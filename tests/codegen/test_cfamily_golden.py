"""Golden MSL and OpenCL C over the scalar table and reduction kinds the two C-family
emitters share (kiln/codegen/cfamily): wrapping integer arithmetic, bitwise and bool
ops, math functions, float16 (Metal) and float64 (OpenCL), narrow/strided/outer
reductions. Written when the shared module was split out, from sources checked byte-
identical to the emitters' output before the split; a change shows up as a diff here.

    KILN_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/codegen/test_cfamily_golden.py
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

import kiln as kn
from kiln.codegen.cfamily import expr as cexpr
from kiln.codegen.metal import emit as metal_emit
from kiln.codegen.opencl import emit as opencl_emit
from kiln.frontend.stages import render_stage

GOLDEN = pathlib.Path(__file__).parent / "cfamily_golden"


def _t(shape, dtype):
    return kn.tensor(np.zeros(shape, dtype=dtype))


CASES = {
    "int_arith_i32": (lambda a, b: a * b + a - b - (-a) + a // (b + 100) + a % (b + 100), [(33, 5)] * 2, "int32"),
    "int_arith_i8": (lambda a, b: a * b - (-a) + (a & b) | (a ^ b), [(9, 5)] * 2, "int8"),
    "bool": (lambda a, b: (a & b) | (a ^ b), [(9, 9)] * 2, "bool"),
    "math": (lambda x: kn.floor(x) + kn.sin(x) + kn.log(kn.abs(x) + 1) + kn.round(x) + kn.atan2(x, x + 1)
             + kn.maximum(x, x * 2) + kn.erf(x), [(17, 9)], "float32"),
    "narrow_max": (lambda x: kn.amax(x, 1), [(64, 16)], "float32"),
    "strided_sum": (lambda x: kn.sum(x, 1), [(8, 100, 3)], "float32"),
    "outer_sum": (lambda x: kn.sum(x, 0), [(1000, 256)], "float32"),
}
WIDE = {"metal": "float16", "opencl": "float64"}  # each one's other float type


def _source(target: str, name: str, wide: bool) -> str:
    fn, shapes, dtype = CASES[name]
    dtype = WIDE[target] if wide else dtype
    return render_stage(kn.trace(fn, *[_t(s, dtype) for s in shapes]), "source", target)


PAGES = [(name, False) for name in sorted(CASES)] + [("math", True), ("narrow_max", True)]


@pytest.mark.parametrize("target", ["metal", "opencl"])
@pytest.mark.parametrize("name,wide", PAGES)
def test_golden(target, name, wide):
    path = GOLDEN / f"{name}{'_wide' if wide else ''}.{'metal' if target == 'metal' else 'cl'}"
    text = _source(target, name, wide)
    if os.environ.get("KILN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden {path.name}: run with KILN_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"generated {target} source for {name} changed; review and regenerate"


def test_both_backends_emit_through_the_shared_module():
    for mod, cast in ((metal_emit, "float(x)"), (opencl_emit, "((float)x)")):
        assert isinstance(mod.ExprEmitter({}, {}), cexpr.ExprEmitter)
        assert mod.DIALECT.cast("float", "x") == cast
    assert "kiln_floordiv" in metal_emit.PRELUDE
