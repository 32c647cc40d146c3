"""The compiler-source part of the whole-program cache key (kiln/frontend/compiler_source.py):
the content hash and the settings' default literals of every compiler file, memoized across
processes by the files' stat in a sealed record; a changed file always changes the hash."""

import hashlib
import os
import time

import pytest

from kiln.codegen import cache_trust
from kiln.frontend import compiler_source as cs

FILES = {"ir/ops/a.py": "LIMIT = 4  # a threshold\nNAME = 'x'\n", "ir/__init__.py": "",
         "passes/b.py": "ENABLED = True\nRATIO = 0.5\nnot_a_setting = 3\n",
         "codegen/cpu/c.py": "WIDTH = 8\nCALL = f(1)\n"}


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "kiln"
    for rel, text in {**FILES, **{f: f"# {f}\n" for f in cs.SOURCE_FILES}}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "ir" / "__pycache__").mkdir()
    (root / "ir" / "__pycache__" / "junk.py").write_text("IGNORED = 1\n")
    for k in cs.STATS:
        monkeypatch.setitem(cs.STATS, k, 0)
    return root


def oracle(root) -> str:
    """The hash computed from scratch: every file read, in the documented order."""
    rels = sorted(r for r in FILES) + list(cs.SOURCE_FILES)
    h = hashlib.sha256()
    for rel in rels:
        h.update(rel.encode() + b"\0" + hashlib.sha256((root / rel).read_bytes()).hexdigest().encode() + b"\n")
    return h.hexdigest()[:32]


def rewrite_same_stat_but_ctime(path, text: str) -> None:
    """Change the content keeping size and mtime (what a memo keyed by mtime alone
    would miss); the ctime the write sets is checked to differ (bounded retries)."""
    st = os.stat(path)
    assert len(text.encode()) == st.st_size
    for _ in range(100):
        time.sleep(0.01)  # file times are coarse: let the clock move past the old ctime
        path.write_text(text)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        if os.stat(path).st_ctime_ns != st.st_ctime_ns:
            return
    pytest.fail("the file's ctime did not change")


def test_hash_and_defaults_match_a_fresh_read(tree):
    state = cs.source_state(tree)
    assert state.digest == oracle(tree)
    assert state.defaults == {"kiln.ir.ops.a": {"LIMIT": 4, "NAME": "x"},
                              "kiln.passes.b": {"ENABLED": True, "RATIO": 0.5},
                              "kiln.codegen.cpu.c": {"WIDTH": 8}}
    assert cs.STATS["read"] == len(FILES) + len(cs.SOURCE_FILES)


def test_record_is_reused_and_a_changed_file_changes_the_hash(tree, monkeypatch):
    monkeypatch.setattr(cs, "QUIET_NS", -10 ** 12)  # every file counts as long settled
    first = cs.source_state(tree)
    total = len(FILES) + len(cs.SOURCE_FILES)
    assert cs.STATS == {"read": total, "recorded": 0}
    again = cs.source_state(tree)  # a new process would do the same: nothing is read
    assert again == first and cs.STATS == {"read": total, "recorded": total}
    rewrite_same_stat_but_ctime(tree / "passes" / "b.py", "ENABLED = Fals\nRATIO = 0.5\nnot_a_setting = 3\n")
    changed = cs.source_state(tree)
    assert cs.STATS["read"] == total + 1  # only the changed file
    assert changed.digest != first.digest and changed.digest == oracle(tree)
    assert changed.defaults["kiln.passes.b"] == {"RATIO": 0.5}  # `Fals` is no literal
    (tree / "ir" / "ops" / "new.py").write_text("EXTRA = 1\n")  # a file added
    added = cs.source_state(tree)
    assert added.digest not in (first.digest, changed.digest)
    assert added.defaults["kiln.ir.ops.new"] == {"EXTRA": 1}
    (tree / "ir" / "ops" / "new.py").unlink()  # and removed again
    assert cs.source_state(tree).digest == changed.digest


def test_a_file_written_just_now_is_not_recorded(tree):
    cs.source_state(tree)
    reads = cs.STATS["read"]
    cs.source_state(tree)  # every file was written within QUIET_NS: all read again
    assert cs.STATS["read"] == 2 * reads and cs.STATS["recorded"] == 0


def record_file(tree) -> str:
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(os.environ["KILN_CACHE_DIR"])
               for f in fs if f.endswith(".rec")]
    return path


@pytest.mark.parametrize("spoil", ["garbage", "other key", "bad field"])
def test_bad_record_is_refused_and_rebuilt(tree, monkeypatch, spoil):
    monkeypatch.setattr(cs, "QUIET_NS", -10 ** 12)
    first = cs.source_state(tree)
    path = record_file(tree)
    name = os.path.basename(path)[:-4]
    if spoil == "garbage":
        open(path, "wb").write(b"not a record")
    elif spoil == "other key":  # hashes that lie, sealed by someone without the cache's key
        lie = b'{"format":1,"files":{}}'
        open(path, "wb").write(cache_trust.seal(os.urandom(32), cs.KIND, name, lie))
    else:  # sealed with the right key (what a bug could leave), but not a valid record
        secret = cache_trust.secret_key(os.environ["KILN_CACHE_DIR"])
        open(path, "wb").write(cache_trust.seal(secret, cs.KIND, name, b'{"format":1,"files":{"x":[1,2,3]}}'))
    reads = cs.STATS["read"]
    assert cs.source_state(tree) == first
    assert cs.STATS["read"] == 2 * reads  # nothing trusted from the bad record
    cs.source_state(tree)
    assert cs.STATS["read"] == 2 * reads  # and it was written again


def test_no_cache_folder_reads_every_file(tree, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KILN_CACHE_DIR", str(blocker))
    monkeypatch.setattr(cs, "QUIET_NS", -10 ** 12)
    with pytest.warns(Warning, match="compile cache disabled"):
        first = cs.source_state(tree)
    assert first.digest == oracle(tree)
    reads = cs.STATS["read"]
    assert cs.source_state(tree) == first and cs.STATS["read"] == 2 * reads


def test_installed_compiler_state_matches_its_files():
    """The real kiln tree: the cached state is the hash of the files as they are."""
    import pathlib

    root = pathlib.Path(cs.__file__).resolve().parents[1]
    state = cs.source_state(root)
    h = hashlib.sha256()
    for rel, path, _ in cs._files(root):
        h.update(rel.encode() + b"\0" + hashlib.sha256(open(path, "rb").read()).hexdigest().encode() + b"\n")
    assert state.digest == h.hexdigest()[:32]
    assert "kiln.passes.batching" in state.defaults and "ENABLED" in state.defaults["kiln.passes.batching"]


def test_setting_lines_are_found_as_a_line_anchored_regex_finds_them():
    """The defaults regex jumps from newline to newline; oracle: the plain `^...$` (re.M)
    form over edge cases (first and last line without a newline, trailing blanks,
    comments, CRLF, indented and lower-case names, `#` inside a value) and over every
    compiler file of this kiln."""
    import pathlib
    import re

    plain = re.compile(r"^([A-Z][A-Z0-9_]*) = (.+?)\s*(?:#.*)?$", re.M)

    def oracle(text):
        found = {}
        for m in plain.finditer(text):
            try:
                import ast

                value = ast.literal_eval(m.group(2))
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if type(value) in cs.SETTING_TYPES:
                found[m.group(1)] = value
        return found

    cases = ["FIRST = 1\nx = 2\n  INDENTED = 3\nLAST = 'end'", "A = 2  \t# note\r\nB = 'x#y'  # c\n\nC = 1.5",
             "D = (1, 2)\nE = True   \n\n\nF = 'a'#b\nlower = 4\nG_2 = -7\nH =8\n", "", "\n", "I = 1"]
    root = pathlib.Path(cs.__file__).resolve().parents[1]
    cases += [pathlib.Path(path).read_text(encoding="utf-8", errors="replace") for _, path, _ in cs._files(root)]
    assert cs._literal_defaults(cases[0]) == {"FIRST": 1, "LAST": "end"}
    assert cs._literal_defaults(cases[1]) == {"A": 2, "C": 1.5}
    for text in cases:
        assert cs._literal_defaults(text) == oracle(text)
