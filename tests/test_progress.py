"""Progress bars: drawn on a terminal (or KILN_PROGRESS=1) for autotuning and checkpoint
writes, silent in pipes and logs, and never in the way of the work's result or errors."""

import io

import numpy as np
import pytest

import kiln as kn
from kiln import progress as kp


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_enabled_follows_terminal_and_env(monkeypatch):
    monkeypatch.delenv("KILN_PROGRESS", raising=False)
    assert kp.enabled(_Tty()) and not kp.enabled(io.StringIO())
    monkeypatch.setenv("KILN_PROGRESS", "0")
    assert not kp.enabled(_Tty())
    monkeypatch.setenv("KILN_PROGRESS", "1")
    assert kp.enabled(io.StringIO())


@pytest.fixture
def shown(monkeypatch):
    """Bars forced on and drawn at once (no delay)."""
    monkeypatch.setenv("KILN_PROGRESS", "1")
    monkeypatch.setattr(kp, "DELAY_S", 0)


def test_progress_yields_everything_and_draws(shown, capsys):
    assert list(kp.progress(range(5), desc="tuning", unit="kernel")) == list(range(5))
    err = capsys.readouterr().err
    assert "tuning:" in err and "/5 " in err


def test_quiet_when_not_a_terminal(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("KILN_PROGRESS", raising=False)
    monkeypatch.setattr(kp, "DELAY_S", 0)
    assert list(kp.progress([1, 2, 3], desc="tuning")) == [1, 2, 3]
    kn.save_state_dict({"w": np.ones(4, np.float32)}, tmp_path / "w.safetensors")
    assert capsys.readouterr().err == ""


def test_checkpoint_write_shows_bytes_and_round_trips(shown, capsys, tmp_path):
    big = np.arange(1 << 20, dtype=np.float32)
    kn.save_state_dict({"big": big}, tmp_path / "ckpt.safetensors")
    err = capsys.readouterr().err
    assert "saving ckpt.safetensors" in err
    np.testing.assert_array_equal(kn.load_state_dict(tmp_path / "ckpt.safetensors")["big"].numpy(), big)


def test_write_errors_propagate(shown, tmp_path):
    def failing(path):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        kp.write_with_progress(failing, str(tmp_path / "x"), 100, "saving x")


def test_max_autotune_shows_a_bar(shown, capsys):
    f = kn.compile(lambda a, b: kn.relu(a @ b), mode="max-autotune")
    a, b = np.ones((32, 32), np.float32), np.ones((32, 32), np.float32)
    np.testing.assert_allclose(f(a, b).numpy(), np.maximum(a @ b, 0))
    assert "autotuning" in capsys.readouterr().err


def test_a_long_compile_shows_a_working_bar(shown, capsys, monkeypatch):
    from kiln.frontend import graph_compile as kc

    real = kc.compile_kernels

    def slow(*args, **kwargs):  # a build that lasts a few ticks
        import time
        time.sleep(3 * kp.POLL_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(kc, "compile_kernels", slow)
    f = kn.compile(lambda x: kn.exp(x) * 3)
    np.testing.assert_allclose(f(kn.ones(4)).numpy(), np.exp(np.ones(4, np.float32)) * 3, rtol=1e-6)
    err = capsys.readouterr().err
    assert "kiln: compiling" in err and "(1 kernel)" in err


def test_working_is_silent_for_short_work(monkeypatch, capsys):
    monkeypatch.setenv("KILN_PROGRESS", "1")
    with kp.working("short"):
        pass
    assert "short" not in capsys.readouterr().err


def test_no_tqdm_import_where_no_bar_can_show(tmp_path):
    """Off a terminal a compile never imports tqdm (~17 ms of a cold compile); on one it
    does, to draw the bar. A fresh process, as a user's first compile is."""
    import os
    import subprocess
    import sys

    code = ("import sys, io, numpy as np, kiln as kn\n"
            "from kiln import progress as kp\n"
            "kn.compile(lambda x: (x * 2).sum())(np.ones((4, 4), np.float32))\n"
            "print('tqdm' in sys.modules, end=' ')\n"
            "class T(io.StringIO):\n    def isatty(self): return True\n"
            "print(kp.enabled(T()), 'tqdm' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k != "KILN_PROGRESS"}
    env["KILN_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr
