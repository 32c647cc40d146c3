"""Recompile explanations, KILN_LOGS=recompiles / explain=True, strict=True, and
kn.compile(dynamic=True|None|False) (issue 21). Every explanation is asserted as text:
the argument by parameter name and pytree path, the dim, the guard, the user line."""

import inspect

import numpy as np
import pytest

import kiln as kn
from kiln.frontend.recompiles import KilnRecompileError

F32 = np.float32


def _line_of(fragment: str) -> int:
    """This file's line number holding `fragment` (where a guard comes from)."""
    lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    return next(i + 1 for i, line in enumerate(lines) if fragment in line and "_line_of" not in line)


def model(x, params):
    h = x * 2  # the first line that uses x
    return h @ params["layers"][1]["w"]  # the first line that uses the weight


def _params(cols):
    return {"layers": [{"w": np.ones((4, 4), F32)}, {"w": np.ones((4, cols), F32)}]}


def test_an_explanation_names_the_argument_path_dim_guard_and_source_line():
    f = kn.compile(model, dynamic=False)
    f(np.ones((3, 4), F32), _params(2))
    f(np.ones((3, 4), F32), _params(5))
    reason = f.stats()["recompiles"][0]["reason"]
    path = 'params["layers"][1]["w"]'
    assert f"argument `{path}` dim 1 changed from 2 to 5 (not declared dynamic)" in reason
    assert f"guard `{path}.shape[1] == 2` failed" in reason
    where = f"{__file__}:{_line_of('the first line that uses the weight')}"
    assert f"the guard comes from {where}: return h @ params" in reason
    assert f"(the first line that used `{path}`)" in reason
    f(np.ones((6, 4), F32), _params(5))
    reason = f.stats()["recompiles"][1]["reason"]
    assert "argument `x` dim 0 changed from 3 to 6" in reason and "`x.shape[0] == 3`" in reason
    assert f"{__file__}:{_line_of('the first line that uses x')}: h = x * 2" in reason


def test_dtype_rank_and_python_value_changes_are_explained():
    f = kn.compile(lambda x, scale: x * scale, dynamic=False)
    f(np.ones(3, F32), 2.0)
    f(np.ones(3, np.float64), 2.0)
    f(np.ones((3, 1), F32), 2.0)
    f(np.ones(3, F32), 0.5)
    reasons = [r["reason"] for r in f.stats()["recompiles"]]
    assert "argument `x` dtype changed from float32 to float64: guard `x.dtype == float32`" in reasons[0]
    assert "argument `x` rank changed from 1 to 2: guard `x.ndim == 1` failed" in reasons[1]
    assert "argument `scale` changed from 2.0 to 0.5: guard `scale == 2.0` failed" in reasons[2]


def test_a_changed_pytree_structure_is_explained():
    f = kn.compile(lambda xs: sum(xs[1:], xs[0]))
    f([np.ones(2, F32), np.ones(2, F32)])
    f([np.ones(2, F32), np.ones(2, F32), np.ones(2, F32)])
    assert "the argument structure changed" in f.stats()["recompiles"][0]["reason"]


def test_kiln_logs_recompiles_and_explain_print_each_recompile(monkeypatch, capsys):
    quiet = kn.compile(lambda x: x + 1, dynamic=False)
    quiet(np.ones(2, F32))
    quiet(np.ones(3, F32))
    assert capsys.readouterr().err == ""

    monkeypatch.setenv("KILN_LOGS", "graph_breaks,recompiles")
    logged = kn.compile(lambda x: x + 1, dynamic=False)
    logged(np.ones(2, F32))
    assert capsys.readouterr().err == ""  # the first compile is not a recompile
    logged(np.ones(3, F32))
    err = capsys.readouterr().err
    assert err.startswith("[kiln recompiles] <lambda> (") and "specialization 2" in err
    assert "argument `x` dim 0 changed from 2 to 3" in err

    monkeypatch.delenv("KILN_LOGS")
    explained = kn.compile(lambda x: x - 1, explain=True, dynamic=False)
    explained(np.ones(2, F32))
    explained(np.ones(2, np.float64))
    assert "dtype changed from float32 to float64" in capsys.readouterr().err


def test_strict_mode_turns_a_recompile_into_k321_with_the_explanation():
    f = kn.compile(model, strict=True)
    x = np.ones((3, 4), F32)
    f(x, _params(2))
    f(x, _params(2))  # cache hits are fine
    with pytest.raises(KilnRecompileError) as info:
        f(np.ones((5, 4), F32), _params(2))
    message = str(info.value)
    assert message.startswith("[K321]") and "strict=True" in message
    assert "argument `x` dim 0 changed from 3 to 5" in message and "guard `x.shape[0] == 3`" in message
    assert f.stats()["compiles"] == 1
    dynamic = kn.compile(model, strict=True, dynamic=True)  # dynamic dims need no recompile
    for n in (3, 5, 8):
        np.testing.assert_allclose(dynamic(np.ones((n, 4), F32), _params(2)).numpy(),
                                   np.full((n, 2), 8, F32))
    # x's dim 1 meets the static weight in the matmul: that dim is what the code needs static
    stats = dynamic.stats()
    assert stats["compiles"] == 1 and "`x` dim 1" in stats["dynamic_fallbacks"][0]
    assert stats["guards"][0][0] == "%x: f32, dim 0 dynamic (s0 in [2, inf)), dim 1 == 4 (not declared dynamic)"


def test_dynamic_true_compiles_once_for_every_size_and_guards_what_the_code_needs():
    f = kn.compile(lambda x, y: kn.softmax(x + y, dim=-1), dynamic=True)
    rng = np.random.default_rng(0)
    for n, m in ((3, 5), (7, 2), (20, 9)):
        x, y = rng.standard_normal((n, m)).astype(F32), rng.standard_normal((n, m)).astype(F32)
        want = np.exp(x + y) / np.exp(x + y).sum(-1, keepdims=True)
        np.testing.assert_allclose(f(x, y).numpy(), want, rtol=1e-5)
    stats = f.stats()
    assert stats["compiles"] == 1
    # duck sizing: x and y share their symbols, so `x + y` needs no broadcast
    assert stats["guards"][0] == ["%x: f32, dim 0 dynamic (s0 in [2, inf)), dim 1 dynamic (s1 in [2, inf))",
                                  "%y: f32, dim 0 dynamic (s0 in [2, inf)), dim 1 dynamic (s1 in [2, inf))"]
    # a size-1 dim broadcasts: it compiles static, with the reason
    x = rng.standard_normal((4, 6)).astype(F32)
    got = f(x, np.ones((1, 6), F32)).numpy()
    np.testing.assert_allclose(got, np.exp(x + 1) / np.exp(x + 1).sum(-1, keepdims=True), rtol=1e-5)
    assert "`y.shape[0] >= 2` of its dynamic dim failed" in f.stats()["recompiles"][0]["reason"]


def test_dims_that_shared_a_symbol_and_now_differ_recompile_with_the_reason():
    f = kn.compile(lambda x, y: x.sum() + y.sum(), dynamic=True)
    f(np.ones(4, F32), np.ones(4, F32))
    assert f(np.ones(5, F32), np.ones(7, F32)).item() == 12
    reason = f.stats()["recompiles"][0]["reason"]
    assert "`x.shape[0]` and `y.shape[0]` were equal (one symbol) and now differ" in reason
    assert "guard `x.shape[0] == y.shape[0]` failed" in reason
    assert f(np.ones(6, F32), np.ones(9, F32)).item() == 15
    assert f.stats()["compiles"] == 2


def test_code_that_needs_a_concrete_size_falls_back_to_static_dims():
    f = kn.compile(lambda x: x * int(x.shape[0]), dynamic=True)
    for n in (3, 4):
        np.testing.assert_array_equal(f(np.ones(n, F32)).numpy(), np.full(n, n, F32))
    stats = f.stats()
    assert stats["compiles"] == 2 and stats["dynamic_fallbacks"]
    assert "static dims: the code needs concrete sizes" in stats["dynamic_fallbacks"][0]


def test_dynamic_must_be_a_bool_or_none():
    with pytest.raises(kn.KilnError, match="dynamic must be True, False or None"):
        kn.compile(lambda x: x, dynamic="auto")
