"""`kiln dump`: every format on a saved file, and one error line with exit status 2
for every kind of bad file (missing, not a zip, corrupt, too new, hostile)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from kiln.cli import build_parser, main
from kiln.ir import dtypes as dt
from kiln.ir.archive import save_graph
from kiln.ir.emitter import GraphBuilder
from kiln.ir.graph import Graph
from kiln.ir.parser import parse_graph
from kiln.ir.render import graph_to_json
from kiln.ir.shapes import ShapeVar
from kiln.ir.types import TensorType


def mlp_graph() -> Graph:
    b = GraphBuilder()
    b.graph.name = "mlp"
    b.graph.shape_vars["B"] = B = ShapeVar("B", min=1, max=8192)
    x = b.add_input(TensorType(dt.float32, (B.symbol, 8)), "x")
    w = b.constant(np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4))
    h = b.call("dot_general", x, w, lhs_contracting=(1,), rhs_contracting=(0,))
    b.graph.body.results = [b.call("relu", h)]
    return b.graph


@pytest.fixture
def kir(tmp_path):
    path = tmp_path / "mlp.kir"
    save_graph(mlp_graph(), path, metadata={"producer": "test_cli"})
    return path


def test_dump_text_parses_back(kir, capsys):
    assert main(["dump", str(kir)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith(f"# {kir}: kiln.kir format 1, opset 1, written by kiln ")
    assert '# metadata: {"producer": "test_cli"}' in out
    graph = mlp_graph()
    assert parse_graph(out, constants=graph.constants).structurally_equal(graph)


def test_dump_json(kir, capsys):
    assert main(["dump", str(kir), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format_version"] == 1 and doc["metadata"] == {"producer": "test_cli"}
    assert doc["graph"] == graph_to_json(mlp_graph())


def test_dump_dot(kir, capsys):
    assert main(["dump", str(kir), "--format", "dot"]) == 0
    out = capsys.readouterr().out
    assert out.startswith('digraph "mlp" {') and out.rstrip().endswith("}")
    assert '[label="relu\\nf32[B, 4]", shape="box"]' in out


def test_help_describes_formats_and_the_coming_stage_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["dump", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for word in ("text", "json", "dot", "--stage", "kiln dump mlp.kir --format json"):
        assert word in out


def _bad_files(tmp_path, kir):
    good = kir.read_bytes()
    hostile = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(good)) as src, zipfile.ZipFile(hostile, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
        dst.writestr("../evil", b"x")
    files = {
        "missing": (None, "no such file"),
        "text": (b"graph @g() -> ()\n", "not a valid zip archive"),
        "truncated": (good[: len(good) // 2], "not a valid zip archive"),
        "corrupt": (good[:40] + bytes(b ^ 0xFF for b in good[40:80]) + good[80:], ""),
        "hostile": (hostile.getvalue(), "unsafe entry name '../evil'"),
    }
    paths = {}
    for name, (content, match) in files.items():
        path = tmp_path / f"{name}.kir"
        if content is not None:
            path.write_bytes(content)
        paths[name] = (path, match)
    return paths


@pytest.mark.parametrize("which", ["missing", "text", "truncated", "corrupt", "hostile", "newer"])
def test_bad_file_gives_one_line_and_exit_2(tmp_path, kir, capsys, which):
    if which == "newer":
        path = tmp_path / "newer.kir"
        with zipfile.ZipFile(kir) as src, zipfile.ZipFile(path, "w") as dst:
            for info in src.infolist():
                data = src.read(info)
                if info.filename == "manifest.json":
                    data = json.dumps(dict(json.loads(data), format_version=3)).encode()
                dst.writestr(info.filename, data)
        match = "written by format version 3"
    else:
        path, match = _bad_files(tmp_path, kir)[which]
    assert main(["dump", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n")
    assert err.startswith(f"kiln dump: error: [K13") and f"] {path}: " in err
    assert match in err


def test_python_dash_m_kiln_reports_a_bad_file_without_traceback(tmp_path):
    bad = tmp_path / "bad.kir"
    bad.write_bytes(b"PK\x03\x04 definitely not a zip")
    proc = subprocess.run([sys.executable, "-m", "kiln", "dump", str(bad)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kiln dump: error: [K130] {bad}: not a valid zip")
    assert "Traceback" not in proc.stderr


def test_python_dash_m_kiln_dumps_a_good_file(kir):
    proc = subprocess.run([sys.executable, "-m", "kiln", "dump", str(kir), "--format", "json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["graph"]["name"] == "mlp"


def test_dump_works_without_the_distributed_commands(monkeypatch, kir, capsys):
    monkeypatch.setitem(sys.modules, "kiln.distributed.commands", None)  # import fails
    parser = build_parser()
    args = parser.parse_args(["dump", str(kir), "--format", "text"])
    assert args.handler(args) == 0
    assert "graph @mlp" in capsys.readouterr().out
