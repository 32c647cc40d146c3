"""Every index-taking op checks its indices, eager and compiled (issue 21).

The registry walk finds every primitive that takes indices as a tensor (by the names of
its reference's parameters) and requires it in `INDEX_OPERANDS`, which says whether an
out-of-range index raises K104 or is clamped. Each checked primitive, and each
user-facing op built on them, is then run with indices past either end: eager, compiled
and exported-then-loaded, it must raise `KilnIndexError`, never return a value. The
in-range answers are compared with numpy (and torch for the losses, when installed)."""

import inspect

import numpy as np
import pytest

import kiln as kn
import kiln.nn.functional as F
from kiln.frontend.dispatch import apply
from kiln.ir import registry
from kiln.ir.ops.indices import INDEX_OPERANDS

INDEX_NAMES = {"indices", "index", "starts", "target", "targets", "labels", "positions"}

X = np.arange(15, dtype=np.float32).reshape(5, 3)


def _takes_indices(op) -> bool:
    params = []
    for rule in (op.reference, op.type_rule):
        if rule is not None:
            params += list(inspect.signature(rule).parameters)
    return bool(INDEX_NAMES & set(params))


def test_every_index_taking_primitive_of_the_registry_says_what_out_of_range_does():
    ops = registry.all_ops()
    found = {name for name, op in ops.items() if _takes_indices(op)}
    assert {"take", "take_along", "scatter_along", "check_index"} <= found
    missing = found - set(INDEX_OPERANDS)
    assert not missing, f"index-taking ops without an index rule in INDEX_OPERANDS: {missing}"
    for name, (position, rule) in INDEX_OPERANDS.items():
        assert name in ops, name
        assert rule in ("checked", "clamped")
    # every checked primitive has a case below, so a new one is exercised, not only listed
    assert {n for n, (_, r) in INDEX_OPERANDS.items() if r == "checked"} == set(PRIMITIVE_CASES)


# op -> (function of (x, idx) applying it, an in-range idx, numpy oracle of that call)
PRIMITIVE_CASES = {
    "take": (lambda x, i: apply("take", x, i, axis=0),
             np.array([4, -5, 1]), lambda x, i: np.take(x, i, axis=0)),
    "take_along": (lambda x, i: apply("take_along", x, i, axis=0),
                   np.array([[4, 0, -1]]), lambda x, i: np.take_along_axis(x, i % 5, axis=0)),
    "scatter_along": (lambda x, i: apply("scatter_along", x, i, kn.ones(1, 3), axis=0, mode="add"),
                      np.array([[4, 0, -1]]),
                      lambda x, i: x + (np.arange(5)[:, None] == i % 5)),
    "check_index": (lambda x, i: x[0:1] * apply("check_index", i, size=5, caller="user_op",
                                                 what="index", negative=True, ignore=None)[0],
                    np.array([4, -5]), lambda x, i: x[0:1] * 4),
}


def _out_of_range(good: np.ndarray) -> list[np.ndarray]:
    hi, lo = good.copy(), good.copy()
    hi.flat[0], lo.flat[-1] = 5, -6
    return [hi, lo]


def _modes(fn, x, i, tmp_path):
    """fn(x, i) eager, compiled, and exported then loaded."""
    yield "eager", lambda: fn(kn.tensor(x), kn.tensor(i))
    yield "compiled", lambda: kn.compile(fn)(x, i)

    def exported():
        path = tmp_path / "f.kir"
        good = np.zeros_like(i)  # exported with in-range indices, run with bad ones
        kn.export(fn, (x, good)).save(str(path))
        return kn.load(str(path))(x, i)

    yield "exported", exported


@pytest.mark.parametrize("name", list(PRIMITIVE_CASES))
def test_checked_primitives_raise_k104_eager_compiled_and_exported(name, tmp_path):
    fn, good, oracle = PRIMITIVE_CASES[name]
    for mode, run in _modes(fn, X, good, tmp_path):
        np.testing.assert_allclose(run().numpy(), oracle(X, good), err_msg=mode)
    for bad in _out_of_range(good):
        for mode, run in _modes(fn, X, bad, tmp_path):
            with pytest.raises(kn.KilnIndexError) as info:
                run()
            assert info.value.code == "K104"
            assert "out of range" in str(info.value), mode


def _ce_oracle(logits, target, ignore_index=-100):
    logp = logits - logits.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    keep = target != ignore_index
    picked = logp[np.arange(len(target))[keep], target[keep]]
    return -picked.mean()


LOGITS = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)

# user-facing op -> (fn(x, idx), in-range idx, out-of-range idxs, oracle or None)
USER_CASES = {
    "index_select": (lambda x, i: kn.index_select(x, 0, i) * 2, np.array([0, 4]),
                     [np.array([0, 5]), np.array([-6, 0])], lambda x, i: x[i] * 2),
    "gather": (lambda x, i: kn.gather(x, 1, i) + 1, np.array([[0, 2]] * 5),
               [np.array([[0, 3]] * 5), np.array([[-4, 0]] * 5)],
               lambda x, i: np.take_along_axis(x, i, 1) + 1),
    "embedding": (lambda x, i: F.embedding(i, x) * 2, np.array([[1, 4], [0, 0]]),
                  [np.array([[1, 5], [0, 0]])], lambda x, i: x[i] * 2),
    "scatter_add": (lambda x, i: kn.scatter_add(x, 0, i, kn.ones(1, 3)), np.array([[4, 0, 1]]),
                    [np.array([[5, 0, 1]]), np.array([[0, -6, 1]])],
                    lambda x, i: x + (np.arange(5)[:, None] == i)),
    "scatter": (lambda x, i: kn.scatter(x, 0, i, kn.zeros(1, 3)), np.array([[4, 0, 1]]),
                [np.array([[9, 0, 1]])],
                lambda x, i: np.where(np.arange(5)[:, None] == i, 0, x)),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t), np.array([0, 4, 2]),
                      [np.array([0, 5, 2]), np.array([0, -1, 2])],
                      lambda x, t: _ce_oracle(x, t)),
    "cross_entropy(ignore_index=-1)": (
        lambda x, t: F.cross_entropy(x, t, ignore_index=-1), np.array([0, -1, 2]),
        [np.array([0, -2, 2]), np.array([5, -1, 2])], lambda x, t: _ce_oracle(x, t, -1)),
    "nll_loss": (lambda x, t: F.nll_loss(F.log_softmax(x, 1), t), np.array([1, 4, 3]),
                 [np.array([1, 4, 7]), np.array([-1, 4, 3])], lambda x, t: _ce_oracle(x, t)),
    "take_along_dim": (lambda x, i: kn.take_along_dim(x, i, 1) + 1, np.array([[0], [2], [-1], [1], [0]]),
                       [np.array([[0], [3], [0], [0], [0]]), np.array([[0], [0], [-4], [0], [0]])],
                       lambda x, i: np.take_along_axis(x, i % 3, 1) + 1),
    "one_hot": (lambda x, i: kn.one_hot(i, 5) * 2, np.array([0, 4, 2]),
                [np.array([0, 5, 2]), np.array([-1, 0, 0])],
                lambda x, i: (np.arange(5) == i[:, None]) * 2),
}


@pytest.mark.parametrize("name", list(USER_CASES))
def test_user_facing_index_ops_raise_k104_eager_compiled_and_exported(name, tmp_path):
    fn, good, bads, oracle = USER_CASES[name]
    x = LOGITS if "entropy" in name or "nll" in name else X
    for mode, run in _modes(fn, x, good, tmp_path):
        np.testing.assert_allclose(run().numpy(), oracle(x, good), rtol=1e-5, err_msg=mode)
    for bad in bads:
        for mode, run in _modes(fn, x, bad, tmp_path):
            with pytest.raises(kn.KilnIndexError) as info:
                run()
            assert info.value.code == "K104", mode


def test_cross_entropy_names_the_op_the_target_and_the_class_count():
    with pytest.raises(kn.KilnIndexError) as info:
        F.cross_entropy(kn.tensor(LOGITS), kn.tensor(np.array([0, 5, 2])))
    text = str(info.value)
    assert "cross_entropy" in text and "target 5" in text and "5 entries" in text
    assert "[0, 5)" in text  # class targets are never counted from the end


def test_cross_entropy_matches_torch_and_raises_where_torch_raises():
    torch = pytest.importorskip("torch", reason="torch (a test-only dependency) is not installed")
    t = np.array([0, 4, 2])
    want = torch.nn.functional.cross_entropy(torch.from_numpy(LOGITS), torch.from_numpy(t))
    got = kn.compile(F.cross_entropy)(LOGITS, t)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)
    for bad in (np.array([0, 5, 2]), np.array([0, -1, 2])):
        with pytest.raises((IndexError, RuntimeError)):
            torch.nn.functional.cross_entropy(torch.from_numpy(LOGITS), torch.from_numpy(bad))
        with pytest.raises(kn.KilnIndexError):
            kn.compile(F.cross_entropy)(LOGITS, bad)


def test_an_index_check_is_a_step_before_the_kernels_in_the_compiled_program():
    """No kernel reads a class index that was not checked: the check is an extern step
    and the loss's kernels read its result."""
    graph = kn.trace(F.cross_entropy, LOGITS, np.array([0, 4, 2]))
    checks = [n for n in graph.walk() if n.op == "check_index"]
    assert len(checks) == 1 and checks[0].attrs["size"] == 5
    assert checks[0].attrs["negative"] is False and checks[0].attrs["ignore"] == -100
    from kiln.frontend.compile import compile_graph

    program = compile_graph(graph, "cpu").program.format()
    assert "check_index" in program


def test_dynamic_slices_clamp_their_starts_instead():
    assert INDEX_OPERANDS["dynamic_slice"][1] == "clamped"

    def f(x, s):
        return apply("dynamic_slice", x, s, kn.tensor(np.array(0, dtype=np.int64)), sizes=(2, 3)) * 1

    for start, want in ((9, X[3:5]), (-4, X[0:2]), (1, X[1:3])):
        s = np.array(start, dtype=np.int64)
        np.testing.assert_allclose(f(kn.tensor(X), kn.tensor(s)).numpy(), want)
        np.testing.assert_allclose(kn.compile(f)(X, s).numpy(), want)


def test_take_along_dim_broadcasts_and_flattens_as_torch():
    torch = pytest.importorskip("torch", reason="torch (a test-only dependency) is not installed")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for idx, dim in ((np.array([[0, 2, 1, 1]]), 0), (np.array([[3], [0], [1]]), 1),
                     (np.array([5, 11, 0]), None)):
        want = torch.take_along_dim(torch.from_numpy(x), torch.from_numpy(idx), dim).numpy()
        np.testing.assert_array_equal(kn.take_along_dim(kn.tensor(x), kn.tensor(idx), dim).numpy(), want)
        compiled = kn.compile(lambda x, i: kn.take_along_dim(x, i, dim))
        np.testing.assert_array_equal(compiled(x, idx).numpy(), want)
