"""Fixtures of the Triton backend tests.

`triton_interp`: one interpreter worker process for the session (TRITON_INTERPRET must be
set before triton is imported, so the interpreted kernels run there while this process
compiles ahead of time). `aot_kinds`: every generated kernel kind compiled once for sm_90
and gfx942 (about a second per compile, so the session shares them)."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = str(pathlib.Path(__file__).resolve().parents[3])
# the tests pin Triton's FP-fusion default, so its compile cache and output never depend on it
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")


@pytest.fixture(scope="session")
def triton_interp():
    pytest.importorskip("triton", reason="the Triton backend tests need the triton package")
    pytest.importorskip("torch", reason="Triton's interpreter needs CPU torch (the test extra torch==2.13.0)")
    from tests.codegen.triton.interp_worker import InterpreterWorker

    worker = InterpreterWorker(ROOT)
    yield worker
    worker.close()


@pytest.fixture(scope="session")
def aot_kinds(tmp_path_factory):
    """{(kind, target): (EmittedKernel, Artifact)} for every kernel kind."""
    pytest.importorskip("triton", reason="the Triton backend tests need the triton package")
    from kiln.codegen.triton.backend import TritonBackend
    from kiln.ir import dtypes as dt
    from tests.codegen.triton import kernels as K

    cases = {
        "pointwise": K.pointwise(),
        "inner_persistent": K.softmax(33),
        "inner_looped": K.softmax(5000),
        "outer_persistent": K.column_sum(rows=40),
        "outer_looped": K.column_sum(),
        "full_persistent": K.full_sum(rows=7),
        "full_looped": K.full_sum(),
        "gemm_f32": K.gemm(),
        # large enough that the tile selector picks tensor-core tiles (wgmma / MFMA)
        "gemm_f16": K.gemm(dt.float16, m=1024, n=1024, k=512, epilogue="residual"),
    }
    old = os.environ.get("KILN_CACHE_DIR")
    os.environ["KILN_CACHE_DIR"] = str(tmp_path_factory.mktemp("aot-cache"))
    try:
        out = {}
        for target in ("sm_90", "gfx942"):
            backend = TritonBackend(f"{'cuda' if target.startswith('sm') else 'rocm'}:{target}")
            for kind, kernel in cases.items():
                out[kind, target] = (backend.emit(kernel), backend.artifact(kernel))
        return out
    finally:
        if old is None:
            del os.environ["KILN_CACHE_DIR"]
        else:
            os.environ["KILN_CACHE_DIR"] = old
