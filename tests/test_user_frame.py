"""kiln.errors.user_frame: the innermost frame outside kiln's folder (what error
messages and recompile explanations point at), with its per-file answer remembered."""

import os

import kiln
from kiln import errors

KILN_DIR = os.path.dirname(os.path.abspath(kiln.__file__))


def _call_from(filename: str, code: str, env: dict):
    exec(compile(code, filename, "exec"), env)
    return env.get("result")


def test_frames_inside_kiln_are_skipped_and_the_user_frame_found():
    inner = os.path.join(KILN_DIR, "frontend", "fake_inner.py")  # a path under kiln/
    env = {"errors": errors}
    _call_from(inner, "def probe():\n    return errors.user_frame()\n", env)
    for _ in range(2):  # the second time from the remembered answers
        result = _call_from("/tmp/user_code.py", "result = probe()\n", env)
        assert result.f_code.co_filename == "/tmp/user_code.py"
        assert errors.user_frame(skip_kiln=False).f_code.co_filename == __file__
    assert errors._IN_KILN[inner] is True and errors._IN_KILN["/tmp/user_code.py"] is False


def test_a_relative_filename_is_judged_against_the_current_folder(tmp_path, monkeypatch):
    env = {"errors": errors}
    # a relative name resolves under kiln/ while the cwd is kiln's folder...
    _call_from("rel_probe.py", "def probe():\n    return errors.user_frame()\n", env)
    monkeypatch.chdir(KILN_DIR)
    frame = _call_from("/tmp/user_code2.py", "result = probe()\n", env)
    assert frame.f_code.co_filename == "/tmp/user_code2.py"  # rel_probe.py skipped as kiln's
    # ...and is the user's own frame once the cwd is elsewhere (never remembered)
    monkeypatch.chdir(tmp_path)
    frame = _call_from("/tmp/user_code2.py", "result = probe()\n", env)
    assert frame.f_code.co_filename == "rel_probe.py"
    assert "rel_probe.py" not in errors._IN_KILN
