"""kn.profile: every launch recorded with the right name, stage, bytes and FLOPs (checked
against the shapes), collectives from a process group, the table, and a Chrome trace that
satisfies the Trace Event Format's schema."""

import json
import threading

import numpy as np
import pytest

import kiln as kn
from kiln.errors import KilnProfilerError
from kiln.runtime import profiler


def _gemm_then_add(a, b, c):
    return kn.matmul(a, b) + c


def test_launches_have_names_stages_bytes_and_flops():
    f = kn.compile(lambda x: kn.exp(x) * 2.0)
    g = kn.compile(_gemm_then_add)
    x = np.ones((64, 32), np.float32)
    a, b, c = np.ones((8, 16), np.float32), np.ones((16, 4), np.float32), np.ones((8, 4), np.float32)
    f(x), g(a, b, c)  # compile outside the window
    with kn.profile() as p:
        f(x)
        g(a, b, c)
        g(a, b, c)
    assert profiler.ACTIVE is None
    kernels = [e for e in p.events if e.stage == "kernel"]
    gemms = [e for e in p.events if e.stage == "gemm"]
    assert len(kernels) == 1 and len(gemms) == 2, p.events
    k = kernels[0]
    assert k.bytes == 2 * x.nbytes  # read x, write the result
    assert k.flops == 2 * x.size  # exp and mul per element
    assert k.duration_ns > 0 and k.start_ns >= 0 and k.thread_id == threading.get_ident()
    gm = gemms[0]
    assert gm.flops == 2 * 8 * 16 * 4 + 8 * 4  # the product and its fused bias epilogue
    assert gm.bytes == a.nbytes + b.nbytes + 2 * c.nbytes
    assert gm.program == "_gemm_then_add" and "_gemm_then_add" in gm.name
    assert gemms[1].start_ns >= gemms[0].start_ns + gemms[0].duration_ns

    rows = p.key_averages()
    assert {r["stage"] for r in rows} == {"kernel", "gemm"}
    assert next(r for r in rows if r["stage"] == "gemm")["calls"] == 2
    text = p.table()
    assert gm.name in text and "GFLOP/s" in text and "3 events" in text


def test_no_events_outside_a_profile_and_misuse():
    f = kn.compile(lambda x: x + 1.0)
    x = np.zeros(4, np.float32)
    with kn.profile() as p:
        pass
    f(x)
    assert p.events == []
    with pytest.raises(KilnProfilerError, match=r"\[K350\].*already entered"):
        with p:
            pass
    with kn.profile():
        with pytest.raises(KilnProfilerError, match="do not nest"):
            with kn.profile():
                pass
    open_profile = kn.profile()
    with pytest.raises(KilnProfilerError, match="still open"):
        open_profile.table()
    with pytest.raises(KilnProfilerError, match="sort_by"):
        p.table(sort_by="speed")


def test_threads_and_control_flow_are_recorded():
    body = kn.compile(lambda x: kn.cond(x.sum() > 0, lambda y: y * 2.0, lambda y: y - 1.0, x))
    x = np.ones(16, np.float32)
    body(x)
    with kn.profile() as p:
        t = threading.Thread(target=body, args=(x,), name="worker-7")
        t.start()
        t.join(timeout=60)
    assert not t.is_alive()
    assert {e.thread_name for e in p.events} == {"worker-7"}
    assert "control" in {e.stage for e in p.events}


def test_collectives_are_recorded():
    import kiln.distributed as dist

    pg = dist.init_process_group(rank=0, world_size=1, store="127.0.0.1:0", token="t", timeout=5.0)
    try:
        buf = np.ones(1024, np.float32)
        with kn.profile() as p:
            pg.all_reduce(buf).wait()
            pg.broadcast(buf, 0).wait()
    finally:
        dist.destroy_process_group()
    coll = [e for e in p.events if e.stage == "collective"]
    assert [e.name for e in coll] == ["all_reduce", "broadcast"], coll
    assert all(e.bytes == buf.nbytes for e in coll)
    assert coll[0].args["state"] == "completed"


def _check_trace_event_format(trace: dict) -> None:
    """The Trace Event Format (the JSON Object Format) as chrome://tracing and Perfetto read it."""
    assert set(trace) >= {"traceEvents"} and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    for e in trace["traceEvents"]:
        assert isinstance(e.get("name"), str) and e.get("ph") in ("X", "M"), e
        assert isinstance(e.get("pid"), int) and isinstance(e.get("tid"), int), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
            assert isinstance(e["dur"], (int, float)) and e["dur"] > 0, e
            assert isinstance(e.get("cat", ""), str) and isinstance(e.get("args", {}), dict)
        else:
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str)


def test_chrome_trace_is_valid_trace_event_json(tmp_path):
    f = kn.compile(lambda x: kn.softmax(x, -1))
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    f(x)
    with kn.profile() as p:
        for _ in range(3):
            f(x)
    path = p.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(open(path).read())
    _check_trace_event_format(trace)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(p.events) >= 3
    assert all(e["args"]["stage"] in ("kernel", "gemm", "extern") for e in spans)
    threads = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {e["tid"] for e in spans} <= threads


def test_chrome_trace_loads_in_a_browser(tmp_path):
    """chrome://tracing cannot be opened headless, so the trace is loaded the way a viewer
    reads it: fetched into a page and parsed by the browser's JSON parser; the page then
    writes what it found into the DOM."""
    from tests.report.chromium import BROWSER, dump_dom

    if BROWSER is None:
        pytest.skip("needs headless Chromium (Debian package `chromium`)")
    f = kn.compile(lambda x: kn.exp(x).sum())
    x = np.ones((8, 8), np.float32)
    f(x)
    with kn.profile() as p:
        f(x)
    trace_text = json.dumps(p.chrome_trace())
    page = tmp_path / "viewer.html"
    page.write_text(
        "<!DOCTYPE html><html><body><script id='t' type='application/json'>"
        + trace_text.replace("</", "<\\/") + "</script><pre id='out'></pre><script>"
        "const t = JSON.parse(document.getElementById('t').textContent);"
        "const spans = t.traceEvents.filter(e => e.ph === 'X' && typeof e.ts === 'number'"
        " && typeof e.dur === 'number' && e.dur > 0);"
        "document.getElementById('out').textContent = 'spans=' + spans.length + ' names=' +"
        " spans.map(e => e.name).join(',');</script></body></html>")
    dom = dump_dom(page, tmp_path)
    names = ",".join(e.name for e in p.events)
    assert f"spans={len(p.events)} names={names}" in dom
