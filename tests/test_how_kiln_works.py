"""docs/how-kiln-works.md is generated from the real compiler: it must be current."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_walkthrough_page_is_current():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "gen_how_kiln_works.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = (ROOT / "docs" / "how-kiln-works.md").read_text()
    assert gen.render() == page, (
        "docs/how-kiln-works.md is stale: run `.venv/bin/python scripts/gen_how_kiln_works.py` "
        "and review the diff (it shows what the change did to every compiler stage)")
