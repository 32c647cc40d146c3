"""Headless Chromium for the report and trace tests: DOM dumps and screenshots of local
files, each run bounded and its whole process group ended (no browser left behind)."""

import os
import shutil
import signal
import struct
import subprocess
import zlib

import pytest

BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(n)), None)
needs_chromium = pytest.mark.skipif(
    BROWSER is None, reason="needs headless Chromium (Debian package `chromium`; `make install` "
                            "installs it where apt is available)")
TIMEOUT_S = 120


def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(tmp_path))
    command = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out, err = b"", b"timed out"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the renderer and zygote children too
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def dump_dom(path, tmp_path) -> str:
    """The DOM Chromium built from the page, serialized."""
    done = _run(["--dump-dom", f"file://{os.path.abspath(path)}"], tmp_path)
    dom = done.stdout.decode("utf-8", "replace")
    assert "<html" in dom, done.stderr.decode("utf-8", "replace")[-2000:]
    return dom


def screenshot(path, tmp_path, size=(1280, 2000)):
    """A PNG of the rendered page; returns (width, height, distinct byte values in the
    decoded pixel rows), so a blank page is told from a drawn one."""
    png = tmp_path / "shot.png"
    _run([f"--screenshot={png}", f"--window-size={size[0]},{size[1]}",
          f"file://{os.path.abspath(path)}"], tmp_path)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat, at = b"", 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind = data[at + 4:at + 8]
        if kind == b"IDAT":
            idat += data[at + 8:at + 8 + length]
        at += 12 + length
    pixels = zlib.decompress(idat)
    return width, height, len(set(pixels))
