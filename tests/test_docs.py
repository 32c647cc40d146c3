"""The ```python blocks of the user guide run, in order, one namespace per page, so the
docs cannot go stale. (```py blocks are display-only.)"""

import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted(p for p in (ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("page", [p for p in PAGES if BLOCK.search(p.read_text())],
                         ids=lambda p: p.name)
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = "\n\n".join(BLOCK.findall(page.read_text()))
    script = tmp_path / f"{page.stem}_examples.py"
    script.write_text(source)
    runpy.run_path(str(script), run_name="__docs__")
