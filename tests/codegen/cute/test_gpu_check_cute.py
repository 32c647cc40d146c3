"""scripts/gpu_check_cute.py's transport of the nvidia-cutlass-dsl wheels to the GPU
machine, which one device call cannot carry (~90 MiB against 64 MiB): `pack` cuts them
into two folders under a size limit, `stage` parks the first on the GPU machine, and
`ensure_cutlass` joins the pieces, checks each wheel's sha256 and installs them into a
site folder whose .pth files take effect. Here with small wheels and a small limit."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import os
import pathlib
import sys
import zipfile

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "scripts" / "gpu_check_cute.py"


@pytest.fixture()
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_cute_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_wheels(folder: pathlib.Path, sizes: dict) -> dict:
    """Files of random bytes named like wheels; their sha256 by name."""
    folder.mkdir()
    digests = {}
    for name, size in sizes.items():
        data = os.urandom(size)
        (folder / name).write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


def test_pack_splits_under_the_limit_and_assemble_joins_byte_exact(script, tmp_path):
    sizes = {"a-1.0-py3-none-any.whl": 700, "big-1.0-cp312-cp312-manylinux_2_28_x86_64.whl": 2500,
             "c-1.0-py3-none-any.whl": 300}
    digests = fake_wheels(tmp_path / "whl", sizes)
    folders = script.pack(str(tmp_path / "whl"), str(tmp_path), limit=2000)
    assert [os.path.basename(f) for f in folders] == list(script.PARTS)
    for folder in folders:
        pieces = [n for n in os.listdir(folder) if n != script.MANIFEST]
        assert sum(os.path.getsize(os.path.join(folder, n)) for n in pieces) <= 2000
        assert os.path.isfile(os.path.join(folder, script.MANIFEST))
    # the big wheel is cut across both folders
    assert any(n.startswith("big-") for n in os.listdir(folders[0]))
    assert any(n.startswith("big-") for n in os.listdir(folders[1]))
    staged = tmp_path / "staged"
    script.stage(folders[0], str(staged))
    out = tmp_path / "out"
    out.mkdir()
    joined = script.assemble([str(staged), folders[1]], str(out))
    assert sorted(os.path.basename(p) for p in joined) == sorted(sizes)
    for path in joined:
        assert hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest() == digests[os.path.basename(path)]


def test_a_missing_part_or_a_damaged_piece_is_named(script, tmp_path):
    fake_wheels(tmp_path / "whl", {"big-1.0-py3-none-any.whl": 3000})
    first, second = script.pack(str(tmp_path / "whl"), str(tmp_path), limit=2000)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError, match=r"piece big-1\.0-py3-none-any\.whl\.00 .* went back between the two calls"):
        script.assemble([second], str(out))  # call 1's part is gone: the machine was given back
    piece = pathlib.Path(second) / "big-1.0-py3-none-any.whl.01"
    data = piece.read_bytes()
    piece.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # one byte flipped
    with pytest.raises(RuntimeError, match="does not match its sha256"):
        script.assemble([first, second], str(out))
    with pytest.raises(ValueError, match="more than 2 parts of 1000"):
        script.pack(str(tmp_path / "whl"), str(tmp_path), limit=1000)


def tiny_wheel(path: pathlib.Path, module: str) -> None:
    """A pure-python wheel whose package sits in a subfolder that only its .pth puts on
    sys.path (as nvidia-cutlass-dsl's dsl_packages)."""
    dist = f"{module}-1.0.dist-info"
    files = {f"{module}_root/inner/{module}.py": "VALUE = 42\n", f"{module}.pth": f"{module}_root/inner\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: kiln-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    path.write_bytes(buf.getvalue())


def test_ensure_cutlass_installs_the_joined_wheels_with_their_pth(script, tmp_path, monkeypatch):
    module = "kilntinywheel"
    (tmp_path / "whl").mkdir()
    tiny_wheel(tmp_path / "whl" / f"{module}-1.0-py3-none-any.whl", module)
    first, second = script.pack(str(tmp_path / "whl"), str(tmp_path), limit=800)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("KILN_CUTE_WHEELS", os.pathsep.join([first, second]))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: real(module) if name == "cutlass" else real(name, *a))
    script.ensure_cutlass()  # "cutlass" here is the tiny wheel's module, found through its .pth
    assert importlib.import_module(module).VALUE == 42
    sys.modules.pop(module, None)


def test_without_wheels_it_says_how_they_travel(script, monkeypatch):
    hint = script.wheels_hint()
    assert all(w in hint for w in script.WHEELS) and "--python-version 3.12" in hint
    assert "gpu_check_cute.py pack" in hint and "stage .cute-wheels-1" in hint
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.delenv("KILN_CUTE_WHEELS", raising=False)
    with pytest.raises(RuntimeError, match="nvidia-cutlass-dsl is not installed here"):
        script.ensure_cutlass()
