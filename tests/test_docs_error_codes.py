"""docs/errors*.md and the code agree: a documented error code is raised somewhere in
kiln, and every error class kiln raises is documented, with its code and name.

Read from the source with `ast` (no imports), so error classes of modules that
`import kiln` does not load (the Triton backend's, the lowering's) count too."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _scan():
    """(classes defined with a `code = "Knnn"`: name -> code, names kiln raises or builds)."""
    classes, used = {}, set()
    for path in (ROOT / "kiln").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (isinstance(stmt, ast.Assign) and any(_name(t) == "code" for t in stmt.targets)
                            and isinstance(stmt.value, ast.Constant)
                            and re.fullmatch(r"K\d{3}", str(stmt.value.value))):
                        classes[node.name] = stmt.value.value
            elif isinstance(node, ast.Call) and _name(node.func):
                used.add(_name(node.func))
            elif isinstance(node, ast.Raise) and node.exc is not None and _name(node.exc):
                used.add(_name(node.exc))
    return classes, used


def _documented() -> dict[str, str]:
    text = "\n".join(p.read_text() for p in sorted(DOCS.glob("errors*.md")))
    rows = re.findall(r"^\|\s*(K\d{3})\s*\|\s*`(\w+)`", text, re.M)
    codes = [code for code, _ in rows]
    assert len(codes) == len(set(codes)), "a code is documented twice"
    return dict(rows)


def test_every_documented_code_is_a_class_kiln_raises():
    classes, used = _scan()
    for code, name in _documented().items():
        assert classes.get(name) == code, f"docs say {code} is {name}; the code says {classes.get(name)}"
        assert name in used, f"{code} ({name}) is documented but nothing in kiln raises it"


def test_every_error_kiln_raises_is_documented():
    classes, used = _scan()
    documented = _documented()
    for name, code in classes.items():
        if name in used:
            assert documented.get(code) == name, f"{code} ({name}) is raised but not in docs/errors*.md"


def test_the_scan_sees_errors_outside_what_import_kiln_loads():
    classes, used = _scan()
    assert classes["LoweringError"] == "K160" and classes["KilnIndexError"] == "K104"
    assert "KilnIndexError" in used
