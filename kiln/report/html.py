"""`kiln report TRACE_DIR`: static HTML pages from compile traces (tlparse for kiln).

`index.html` lists every compile (function, process, backend, kernels, compile time,
why it recompiled) and each function's final cache statistics; one page per compile shows
the time of every stage, the guards, the recompile reason, artifact-cache hits, both
graphs drawn as SVG, the fusion groups, each kernel's Kernel IR, source and assembly,
and the IR after every stage. Pages are plain HTML and CSS (no script, nothing fetched):
they open from disk in any browser. Trace files are read as JSON and text only.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
from typing import Any

from kiln.errors import KilnError, KilnReportError
from kiln.report.drawing import graph_svg

MAX_TEXT_BYTES = 4 * 1024 * 1024  # per embedded file: a huge asm dump is cut, not inlined whole

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f8f8f8;border:1px solid #ddd;padding:.6em;overflow:auto;max-height:40em;font-size:12px}
details{margin:.3em 0}summary{cursor:pointer;font-family:monospace}
.graph{overflow:auto;border:1px solid #ddd;padding:.5em;max-height:60em;background:#fff}
.tag{display:inline-block;padding:0 .4em;border-radius:.3em;background:#eef;font-size:.85em;margin-right:.3em}
.muted{color:#777}
"""


def load_traces(trace_dir: str) -> tuple[list[dict], list[dict]]:
    """(compiles, stats): every compile.json below `trace_dir` and every stats file."""
    if not os.path.isdir(trace_dir):
        raise KilnReportError(f"kiln report: {trace_dir} is not a folder",
                              hint="run the program with KILN_TRACE_DIR=DIR, then kiln report DIR")
    compiles, stats = [], []
    for entry in sorted(os.listdir(trace_dir)):
        path = os.path.join(trace_dir, entry)
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "compile.json")):
            record = _read_json(os.path.join(path, "compile.json"))
            if isinstance(record, dict) and "function" in record:
                record["_folder"] = path
                record["_id"] = entry
                compiles.append(record)
        elif entry.endswith("-stats.json"):
            record = _read_json(path)
            if isinstance(record, dict) and isinstance(record.get("stats"), dict):
                stats.append(record)
    if not compiles:
        raise KilnReportError(f"kiln report: {trace_dir} holds no compile trace (no */compile.json)",
                              hint="run the program with KILN_TRACE_DIR=DIR (or kn.compile(..., "
                                   "trace_dir=DIR)), then kiln report DIR")
    compiles.sort(key=lambda r: (r.get("time") or 0, r["_id"]))
    return compiles, stats


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # a half-written or foreign file: skipped, as tlparse skips bad lines


def build_report(trace_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 use_dot: bool | None = None) -> str:
    """Write the HTML site for `trace_dir` (into `trace_dir/report` by default); returns
    the path of its index.html.

    >>> build_report("/tmp/trace")        # then open /tmp/trace/report/index.html
    """
    trace_dir = os.fspath(trace_dir)
    out_dir = os.fspath(out_dir) if out_dir is not None else os.path.join(trace_dir, "report")
    compiles, stats = load_traces(trace_dir)
    os.makedirs(out_dir, exist_ok=True)
    for record in compiles:
        page = _compile_page(record, use_dot)
        _write(os.path.join(out_dir, _page_name(record)), page)
    index = os.path.join(out_dir, "index.html")
    _write(index, _index_page(trace_dir, compiles, stats))
    return index


def _page_name(record: dict) -> str:
    return f"{record['_id']}.html"


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _secs(value) -> str:
    return f"{value * 1e3:.1f} ms" if isinstance(value, (int, float)) else "—"


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _index_page(trace_dir: str, compiles: list[dict], stats: list[dict]) -> str:
    body = [f"<h1>kiln compile report</h1><p class=\"muted\">trace folder {_e(os.path.abspath(trace_dir))}"
            f" — {len(compiles)} compile(s)</p>", "<h2 id=\"compiles\">Compiles</h2>",
            "<table id=\"compile-table\"><tr><th>#</th><th>function</th><th>process</th><th>backend</th>"
            "<th>kernels</th><th>trace</th><th>compile</th><th>artifact cache</th><th>recompile reason</th></tr>"]
    for i, r in enumerate(compiles):
        cache = r.get("artifact_cache") or {}
        body.append(
            f"<tr class=\"compile-row\" data-function=\"{_e(r['function'])}\"><td>{i}</td>"
            f"<td><a href=\"{_e(_page_name(r))}\">{_e(r.get('qualname') or r['function'])}</a></td>"
            f"<td>{_e(r.get('pid'))}</td><td>{_e(r.get('backend'))}</td>"
            f"<td class=\"num\">{len(r.get('kernels') or [])}</td>"
            f"<td class=\"num\">{_secs((r.get('seconds') or {}).get('trace'))}</td>"
            f"<td class=\"num\">{_secs((r.get('seconds') or {}).get('compile'))}</td>"
            f"<td>{_e(cache.get('hits', 0))} hit(s), {_e(cache.get('misses', 0))} miss(es)</td>"
            f"<td>{_e(r.get('reason') or '')}</td></tr>")
    body.append("</table>")
    body.append("<h2 id=\"functions\">Functions at exit</h2>")
    if not stats:
        body.append("<p class=\"muted\">no stats file (the traced process had not exited)</p>")
    else:
        body.append("<table id=\"stats-table\"><tr><th>function</th><th>process</th><th>compiles</th>"
                    "<th>cache hits</th><th>eager calls</th><th>recompiles</th></tr>")
        for s in stats:
            st = s["stats"]
            reasons = "".join(f"<li>{_e(r.get('reason'))}</li>" for r in st.get("recompiles") or [])
            body.append(f"<tr class=\"stats-row\"><td>{_e(s.get('function'))}</td><td>{_e(s.get('pid'))}</td>"
                        f"<td class=\"num\">{_e(st.get('compiles'))}</td>"
                        f"<td class=\"num cache-hits\">{_e(st.get('hits'))}</td>"
                        f"<td class=\"num\">{_e(st.get('eager_calls'))}</td>"
                        f"<td><ul>{reasons}</ul></td></tr>")
        body.append("</table>")
    return _page("kiln compile report", body)


def _text(record: dict, filename: str | None) -> str:
    if not filename:
        return ""
    path = os.path.join(record["_folder"], os.path.basename(filename))  # never outside the folder
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        return f"(missing: {e.strerror})"
    text = data[:MAX_TEXT_BYTES].decode("utf-8", "replace")
    return text + ("\n... (cut at 4 MiB)" if len(data) > MAX_TEXT_BYTES else "")


def _compile_page(r: dict, use_dot: bool | None) -> str:
    name = r.get("qualname") or r["function"]
    seconds = r.get("seconds") or {}
    files = r.get("files") or {}
    body = [f"<p><a href=\"index.html\">&larr; all compiles</a></p>",
            f"<h1>{_e(name)} <span class=\"tag\">{_e(r.get('backend'))}</span>"
            f"<span class=\"tag\">{_e(r.get('mode'))}</span></h1>",
            f"<p class=\"muted\">defined at {_e(r.get('source') or 'unknown')}, process {_e(r.get('pid'))}</p>"]
    body.append("<h2 id=\"times\">Compile times</h2><table id=\"stage-times\">"
                "<tr><th>stage</th><th>time</th></tr>")
    for stage in r.get("stages") or []:
        body.append(f"<tr class=\"stage-time\" data-stage=\"{_e(stage['name'])}\"><td>{_e(stage['name'])}</td>"
                    f"<td class=\"num\">{_secs(stage.get('seconds'))}</td></tr>")
    build = None
    if isinstance(seconds.get("compile"), (int, float)):
        build = max(seconds["compile"] - (seconds.get("passes") or 0), 0.0)
    body.append(f"<tr class=\"stage-time\" data-stage=\"lower+build\"><td>lower, codegen and build</td>"
                f"<td class=\"num\">{_secs(build)}</td></tr>")
    body.append(f"<tr><th>total</th><th class=\"num\">{_secs((seconds.get('trace') or 0) + (seconds.get('compile') or 0))}"
                "</th></tr></table>")
    body.append("<h2 id=\"guards\">Guards</h2><ul>")
    body.extend(f"<li class=\"guard\"><code>{_e(g)}</code></li>" for g in r.get("guards") or [])
    body.append("</ul>")
    reason = r.get("reason")
    body.append("<h2 id=\"recompile\">Recompile reason</h2>"
                + (f"<p class=\"reason\">{_e(reason)}</p>" if reason else
                   "<p class=\"muted\">first compile of this function</p>"))
    cache = r.get("artifact_cache") or {}
    body.append(f"<h2 id=\"cache\">Artifact cache</h2><p class=\"cache\">{_e(cache.get('hits', 0))} hit(s), "
                f"{_e(cache.get('misses', 0))} miss(es), {_e(cache.get('writes', 0))} write(s) during this "
                "compile (machine code reused from the on-disk cache on a hit)</p>")
    body.append("<h2 id=\"graphs\">Graphs</h2>")
    for key, title in (("exported", "traced graph"), ("optimized", "after the passes (fusion groups)")):
        dot = _text(r, files.get(f"dot:{key}"))
        try:
            layout = json.loads(_text(r, files.get(f"layout:{key}")) or "{}")
        except ValueError:
            layout = {}
        svg, engine = graph_svg(dot, layout, use_dot)
        body.append(f"<h3>{_e(title)} <span class=\"tag engine\">{_e(engine)}</span></h3>"
                    f"<div class=\"graph\" id=\"graph-{key}\" data-engine=\"{engine}\">{svg}</div>")
    body.append("<h2 id=\"fusion\">Fusion groups</h2><table id=\"fusion-table\">"
                "<tr><th>group</th><th>kind</th><th>ops</th><th>result</th></tr>")
    for g in r.get("fusion_groups") or []:
        body.append(f"<tr class=\"fusion-group\"><td>{_e(g.get('index'))}</td><td>{_e(g.get('kind'))}</td>"
                    f"<td><code>{_e(' → '.join(g.get('ops') or []))}</code></td><td><code>{_e(g.get('result'))}"
                    "</code></td></tr>")
    body.append("</table>")
    body.append(f"<h2 id=\"kernels\">Kernels ({len(r.get('kernels') or [])})</h2>")
    for k in r.get("kernels") or []:
        body.append(f"<div class=\"kernel\" data-kernel=\"{_e(k['name'])}\"><h3>{_e(k['name'])} "
                    f"<span class=\"tag\">{_e(k.get('kind'))}</span></h3>")
        for part, label in (("ir", "Kernel IR"), ("source", "source"), ("asm", "assembly")):
            if k.get(part):
                opened = " open" if part == "ir" else ""
                body.append(f"<details class=\"kernel-{part}\"{opened}><summary>{label}</summary>"
                            f"<pre>{_e(_text(r, k[part]))}</pre></details>")
        body.append("</div>")
    body.append("<h2 id=\"stages\">IR after each stage</h2>")
    for stage in r.get("stages") or []:
        body.append(f"<details class=\"stage-ir\" data-stage=\"{_e(stage['name'])}\"><summary>{_e(stage['name'])}"
                    f"</summary><pre>{_e(_text(r, stage.get('file')))}</pre></details>")
    body.append(f"<details class=\"stage-ir\" data-stage=\"program\"><summary>runtime program</summary>"
                f"<pre>{_e(_text(r, files.get('program')))}</pre></details>")
    return _page(f"{name} — kiln compile", body)


# -- the `kiln report` command ------------------------------------------------------------

_DESCRIPTION = """\
Turn a compile trace folder into static HTML pages (tlparse for kiln).

Record one by running a program with KILN_TRACE_DIR=DIR (or kn.compile(fn, trace_dir=DIR)):
every compile writes DIR/<pid>-<function>-<n>/ with each stage's IR, the graphs, every
kernel's Kernel IR, source and assembly, fusion groups, compile times, guards, recompile
reasons and cache hits. This command writes DIR/report/index.html (or -o OUT) with one
page per compile; graphs are drawn by Graphviz when `dot` is installed, else by kiln."""


def register(subparsers) -> None:
    """Add `kiln report` to the `kiln` command line."""
    report = subparsers.add_parser("report", help="HTML pages of a KILN_TRACE_DIR compile trace",
                                   description=_DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_argument("trace_dir", metavar="TRACE_DIR", help="the folder KILN_TRACE_DIR named")
    report.add_argument("-o", "--out", default=None, help="output folder (default TRACE_DIR/report)")
    report.add_argument("--no-dot", action="store_true",
                        help="draw graphs with kiln's layered drawing even when Graphviz is installed")
    report.set_defaults(handler=report_command)


def report_command(args) -> int:
    try:
        index = build_report(args.trace_dir, args.out, use_dot=False if args.no_dot else None)
    except (KilnError, OSError) as e:
        print(f"kiln report: error: {e}", file=sys.stderr)
        return 2
    print(index)
    return 0
