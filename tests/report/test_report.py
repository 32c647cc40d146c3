"""Compile traces (KILN_TRACE_DIR / trace_dir=) and `kiln report`: the trace files hold what
the compiler did, and the HTML pages, opened in headless Chromium, show it."""

import json
import os
from html.parser import HTMLParser

import numpy as np
import pytest

import kiln as kn
from kiln.cli import main as kiln_main
from kiln.errors import KilnReportError
from kiln.report import build_report
from kiln.report.drawing import dot_available
from tests.report.chromium import dump_dom, needs_chromium, screenshot


def mlp(x, w, b):
    return kn.softmax(kn.gelu(x @ w + b), -1)


def _args(n=4):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, 8)).astype(np.float32),
            rng.standard_normal((8, 16)).astype(np.float32), np.zeros(16, np.float32))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One traced function compiled twice (a recompile), then a second function object
    compiling the same graph again (an artifact-cache hit)."""
    root = tmp_path_factory.mktemp("trace")
    saved = os.environ.get("KILN_CACHE_DIR")
    os.environ["KILN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    f = kn.compile(mlp, trace_dir=str(root))
    f(*_args(4)), f(*_args(4)), f(*_args(5))
    g = kn.compile(mlp, trace_dir=str(root))
    g(*_args(4))
    from kiln.report.trace import write_stats

    write_stats()
    records = [json.loads((root / d / "compile.json").read_text())
               for d in sorted(os.listdir(root)) if (root / d / "compile.json").exists()]
    yield root, records, f
    if saved is not None:
        os.environ["KILN_CACHE_DIR"] = saved


def test_trace_records_every_stage_kernel_guard_and_reason(traced):
    root, records, f = traced
    assert len(records) == 3
    first, second, third = sorted(records, key=lambda r: r["time"])
    assert first["function"] == "mlp" and first["backend"] == "cpu"
    names = [s["name"] for s in first["stages"]]
    assert names[0] == "exported" and "fuse" in names and "cse" in names
    assert all(isinstance(s["seconds"], float) for s in first["stages"])
    assert first["reason"] is None
    assert second["reason"] == f.stats()["recompiles"][0]["reason"]
    assert "dim 0 changed from 4 to 5" in second["reason"]
    from kiln.frontend.compile import guard_summary

    assert [first["guards"], second["guards"]] == [guard_summary(c.graph) for c in f.compiled_graphs()]
    assert first["artifact_cache"]["misses"] >= 1 and third["artifact_cache"]["hits"] == 1
    kernels = first["kernels"]
    assert [k["name"] for k in kernels] == list(f.compiled_graphs()[0].program.kernels)
    folder = root / _by_counter([d for d in os.listdir(root) if (root / d).is_dir()])[0]
    for k in kernels:
        source = (folder / k["source"]).read_text()
        asm = (folder / k["asm"]).read_text()
        assert "define" in source and "ret" in asm, k
    fused = [g for g in first["fusion_groups"]]
    assert len(fused) == len(kernels) and fused[0]["ops"] == ["matmul"] and fused[0]["kind"] == "gemm"
    stats = [json.loads(p.read_text()) for p in root.glob("*-stats.json")]
    assert sorted(s["stats"]["hits"] for s in stats) == [0, 1]


def test_env_var_traces_without_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_TRACE_DIR", str(tmp_path))
    kn.compile(lambda x: x * 2.0)(np.ones(3, np.float32))
    assert len(list(tmp_path.glob("*/compile.json"))) == 1
    monkeypatch.delenv("KILN_TRACE_DIR")
    kn.compile(lambda x: x * 3.0)(np.ones(3, np.float32))
    assert len(list(tmp_path.glob("*/compile.json"))) == 1


class _Dom(HTMLParser):
    def __init__(self, text):
        super().__init__()
        self.elements = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def find(self, tag=None, **attrs):
        return [a for t, a in self.elements if (tag is None or t == tag)
                and all(a.get(k.replace("_", "-")) == v or (v is True and k.replace("_", "-") in a)
                        for k, v in attrs.items())]

    def classes(self, name):
        return [a for _, a in self.elements if name in (a.get("class") or "").split()]


def _by_counter(names):
    """Trace folders (pid-name-N) or their pages in the order they were recorded: N counts
    the process's traces, so it need not start at 0 (other tests may have traced first)."""
    return sorted(names, key=lambda n: int(n.removesuffix(".html").rsplit("-", 1)[1]))


def _page_of(out, records, index):
    record = sorted(records, key=lambda r: r["time"])[index]
    pages = _by_counter([p for p in os.listdir(out) if p.endswith(".html") and p != "index.html"])
    return record, out / pages[index]


@needs_chromium
@pytest.mark.parametrize("engine", ["kiln", "graphviz"])
def test_report_pages_in_chromium(traced, tmp_path, engine):
    if engine == "graphviz" and not dot_available():
        pytest.skip("needs Graphviz `dot` (Debian package graphviz) for the Graphviz drawing")
    root, records, f = traced
    out = tmp_path / "site"
    index = build_report(root, out, use_dot=(engine == "graphviz"))
    dom = _Dom(dump_dom(index, tmp_path))
    rows = dom.classes("compile-row")
    assert len(rows) == 3 and {r["data-function"] for r in rows} == {"mlp"}
    assert len(dom.classes("stats-row")) == 2
    links = [a["href"] for a in dom.find("a") if a.get("href", "").endswith(".html")]
    assert len(links) == 3 and all((out / h).exists() for h in links)

    record, page = _page_of(out, records, 1)
    text = dump_dom(page, tmp_path)
    dom = _Dom(text)
    for section in ("times", "guards", "recompile", "cache", "graphs", "fusion", "kernels", "stages"):
        assert dom.find(id=section), section
    stages = [a["data-stage"] for a in dom.classes("stage-time")]
    assert stages[:len(record["stages"])] == [s["name"] for s in record["stages"]]
    assert [a["data-kernel"] for a in dom.classes("kernel")] == [k["name"] for k in record["kernels"]]
    assert len(dom.classes("kernel-asm")) == len(record["kernels"])
    assert len(dom.classes("fusion-group")) == len(record["fusion_groups"])
    assert "dim 0 changed from 4 to 5" in text
    for key in ("exported", "optimized"):
        box = dom.find(id=f"graph-{key}")
        assert box and box[0]["data-engine"] == engine
    folder = root / _by_counter([d for d in os.listdir(root) if (root / d).is_dir()])[1]
    layout = json.loads((folder / "graph-exported.json").read_text())
    nodes = [a for a in dom.find("g") if "node" in (a.get("class") or "").split()]
    assert len(nodes) >= len(layout["nodes"])  # both graphs drawn; the first has them all
    width, height, variety = screenshot(page, tmp_path)
    assert (width, height) == (1280, 2000) and variety > 16  # drawn, not blank


@needs_chromium
def test_hostile_trace_text_is_escaped(traced, tmp_path):
    root, records, f = traced
    evil = tmp_path / "trace"
    folder = evil / "1-evil-0"
    folder.mkdir(parents=True)
    record = dict(records[0], function="<script>alert(1)</script>", qualname="<img src=x onerror=1>",
                  files={"program": "../../../../etc/passwd"}, kernels=[], stages=[
                      {"name": "<b>x</b>", "file": "../../etc/hostname", "seconds": 0.1}])
    (folder / "compile.json").write_text(json.dumps(record))
    index = build_report(evil)
    for page in (index, folder.parent / "report" / "1-evil-0.html"):
        dom = _Dom(dump_dom(page, tmp_path))
        assert not dom.find("script") and not dom.find("img") and not dom.find("b")
    text = (folder.parent / "report" / "1-evil-0.html").read_text()
    assert "root:" not in text and "missing" in text  # paths never leave the trace folder


def test_report_errors_and_cli(traced, tmp_path, capsys):
    with pytest.raises(KilnReportError, match=r"\[K355\].*no compile trace"):
        build_report(tmp_path)
    with pytest.raises(KilnReportError, match="not a folder"):
        build_report(tmp_path / "absent")
    assert kiln_main(["report", str(tmp_path)]) == 2
    assert "K355" in capsys.readouterr().err
    root, _, _ = traced
    assert kiln_main(["report", str(root), "-o", str(tmp_path / "o"), "--no-dot"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "o" / "index.html")
    pages = _by_counter([p.name for p in (tmp_path / "o").glob("*.html") if p.name != "index.html"])
    assert 'data-engine="kiln"' in (tmp_path / "o" / pages[0]).read_text()


def test_unwritable_trace_dir_warns_and_compiles(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the trace folder should go")
    f = kn.compile(lambda x: x * 2.0, trace_dir=str(blocker))
    with pytest.warns(RuntimeWarning, match="could not write the compile trace"):
        out = f(np.ones(3, np.float32))
    np.testing.assert_array_equal(out.numpy(), np.full(3, 2.0, np.float32))


def test_trace_dir_of_a_compiled_module(tmp_path):
    """kn.compile(module, trace_dir=) records like a function's (not only KILN_TRACE_DIR)."""
    model = kn.nn.Linear(8, 4)
    fast = kn.compile(model, trace_dir=str(tmp_path))
    fast(kn.randn(2, 8, seed=0))
    records = [json.loads((tmp_path / d / "compile.json").read_text())
               for d in os.listdir(tmp_path) if (tmp_path / d / "compile.json").exists()]
    assert len(records) == 1 and records[0]["backend"] == "cpu"
