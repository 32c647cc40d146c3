"""The per-call fast path of kn.compile (kiln/frontend/fast_dispatch.py,
kiln/runtime/fast_call.py): a prepared call per exact argument signature. Every call
is checked against numpy; each test changes what a guard checks between calls (shape,
dtype, strides, values, aliasing, scalars, dynamic sizes) and asserts the result is
still right and the cache did what the general path does."""

import gc
import threading

import numpy as np
import pytest

import kiln as kn
from kiln import ShapeVar, TensorSpec
from kiln.errors import KilnError, KilnTraceError
from kiln.frontend.fast_dispatch import FastCall, signature

F32 = np.float32


def _prepared(f) -> list:
    return [c for c in f._fast.values() if c]


def _rand(*shape, seed=0, dtype=F32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_a_repeated_signature_runs_its_prepared_call():
    f = kn.compile(lambda x: x * 2 + 1)
    x = _rand(4, 4)
    for i in range(4):
        np.testing.assert_allclose(f(kn.tensor(x + i)).numpy(), (x + i) * 2 + 1, rtol=1e-6)
    assert len(_prepared(f)) == 1
    stats = f.stats()
    assert stats["compiles"] == 1 and stats["hits"] == 3


def test_a_new_shape_or_dtype_recompiles_and_is_right():
    f = kn.compile(lambda x: kn.exp(x) - x, dynamic=False)
    for shape, dtype in [((4, 4), F32), ((4, 4), np.float64), ((5, 3), F32), ((4, 4), F32),
                         ((4, 4), np.float64)]:
        x = _rand(*shape, dtype=dtype)
        for _ in range(2):
            out = f(x)
            assert out.dtype == kn.float64 if dtype == np.float64 else out.dtype == kn.float32
            np.testing.assert_allclose(out.numpy(), np.exp(x) - x, rtol=1e-5)
    assert f.stats()["compiles"] == 3
    assert len(_prepared(f)) == 3


def test_strided_arguments_take_the_general_path_and_are_right():
    f = kn.compile(lambda x, y: x - 2 * y)
    x, y = _rand(6, 6, seed=1), _rand(6, 6, seed=2)
    f(x, y), f(x, y)  # prepared for contiguous (6, 6) arrays
    for xs, ys in [(x.T, y), (x, y.T), (x[:, ::-1], y[::-1]), (x.T, y.T), (x, y)]:
        np.testing.assert_allclose(f(xs, ys).numpy(), xs - 2 * ys, rtol=1e-6)
    assert f.stats()["compiles"] == 1


def test_an_input_mutated_in_place_is_read_again():
    f = kn.compile(lambda x: x.sum(dim=0) * x)
    t = kn.tensor(_rand(3, 5))
    for _ in range(3):
        want = t.numpy().sum(axis=0) * t.numpy()
        np.testing.assert_allclose(f(t).numpy(), want, rtol=1e-5)
        t.add_(1.5)  # kiln's in-place op
        t.numpy()[0, 0] = 7.0  # and a write through the shared array
    assert len(_prepared(f)) == 1


def test_dynamic_dims_get_one_prepared_call_per_size_and_keep_their_constraints():
    n = ShapeVar("N", min=2, max=16)
    f = kn.compile(lambda x: (x * x).sum(dim=-1), dynamic_shapes={"x": TensorSpec([n, 3])})
    for rows in (4, 7, 4, 7, 16, 4):
        x = _rand(rows, 3, seed=rows)
        np.testing.assert_allclose(f(x).numpy(), (x * x).sum(-1), rtol=1e-5)
    assert f.stats()["compiles"] == 1
    assert len(_prepared(f)) == 2  # 4 and 7 came back; 16, seen once, was not prepared
    for rows in (1, 17, 1):  # outside [2, 16]: the error every time, never a result
        with pytest.raises(KilnError, match="N"):
            f(_rand(rows, 3))


def test_automatic_dynamic_recompiles_clear_prepared_calls():
    f = kn.compile(lambda x: x + 1.0)
    for rows in (3, 3, 5, 5, 3, 9, 9):
        x = _rand(rows, 2, seed=rows)
        np.testing.assert_allclose(f(x).numpy(), x + 1.0, rtol=1e-6)
    assert f.stats()["compiles"] == 2  # static, then dim 0 symbolic


def test_size_guards_choose_per_size_on_the_fast_path():
    n = ShapeVar("N", min=1, max=64)

    def g(x):
        return x * 2.0 if x.shape[0] > 4 else x - 1.0

    f = kn.compile(g, dynamic_shapes={"x": TensorSpec([n, 3])})
    for rows in (6, 3, 6, 3, 8, 2, 6):
        x = _rand(rows, 3, seed=rows)
        want = x * 2.0 if rows > 4 else x - 1.0
        np.testing.assert_allclose(f(x).numpy(), want, rtol=1e-6, err_msg=f"rows={rows}")


def test_aliased_arguments_and_python_scalars_are_part_of_the_signature():
    f = kn.compile(lambda a, b, s: a * s + b)
    x, y = kn.tensor(_rand(4, seed=3)), kn.tensor(_rand(4, seed=4))
    for _ in range(2):
        for a, b, s in [(x, y, 2.0), (x, x, 2.0), (x, y, 3.0), (y, y, 3), (x, y, True)]:
            want = a.numpy() * s + b.numpy()
            np.testing.assert_allclose(f(a, b, s).numpy(), want, rtol=1e-6)
    assert signature((x, x, 2.0))[0] is None  # aliasing keeps the general path's own key
    assert signature((x, y, 2.0))[0] != signature((x, y, 2))[0]  # an int and a float differ


def test_outputs_handed_out_are_never_overwritten_and_memory_is_counted():
    f = kn.compile(lambda x: (x * 3, x + 1))
    x = _rand(64, seed=5)
    kept = [f(x + i) for i in range(5)]
    for i, (a, b) in enumerate(kept):
        np.testing.assert_allclose(a.numpy(), (x + i) * 3, rtol=1e-6)
        np.testing.assert_allclose(b.numpy(), x + i + 1, rtol=1e-6)
    assert len({id(t.numpy()) for pair in kept for t in pair}) == 10
    gc.collect()
    base = kn.memory.memory_allocated("cpu")
    a, b = f(x)
    assert kn.memory.memory_allocated("cpu") - base == 2 * 64 * 4  # counted while they live
    del a, b
    assert kn.memory.memory_allocated("cpu") == base


def test_programs_with_intermediates_and_pytree_results():
    def g(x, w):
        h = kn.softmax(x @ w, dim=-1)
        return {"p": h, "m": h.max(dim=-1)[0], "s": (h * 2).sum()}

    f = kn.compile(g)
    x, w = _rand(8, 16, seed=6), _rand(16, 5, seed=7)
    logits = x.astype(np.float64) @ w
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    for _ in range(3):
        out = f(x, w)
        np.testing.assert_allclose(out["p"].numpy(), p, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(out["m"].numpy(), p.max(-1), rtol=1e-4)
        np.testing.assert_allclose(out["s"].numpy(), 2 * p.sum(), rtol=1e-4)
    (call,) = _prepared(f)
    (part,) = [p for p in call.plan._parts if p[0] == "launches"]
    assert len(part[1]) > 1 and part[3] is not None  # several launches, one native call
    native = part[3]
    part[3] = None  # the same launches one ctypes call each: the same bits
    try:
        again = f(x, w)
    finally:
        part[3] = native
    for key in ("p", "m", "s"):
        np.testing.assert_array_equal(again[key].numpy(), out[key].numpy())


def test_control_flow_keeps_the_general_path():
    f = kn.compile(lambda p, x: kn.cond(p, lambda v: v * 2, lambda v: -v, x))
    x = _rand(5, seed=8)
    for flag in (True, False, True, False):
        np.testing.assert_allclose(f(np.array(flag), x).numpy(), x * 2 if flag else -x)
    assert not _prepared(f)


def test_concurrent_calls_from_threads_are_right():
    f = kn.compile(lambda x: kn.tanh(x) * x)
    f(_rand(32, 32)), f(_rand(32, 32))
    errors = []

    def work(seed):
        try:
            for i in range(200):
                x = _rand(32, 32, seed=seed * 1000 + i % 7)
                np.testing.assert_allclose(f(x).numpy(), np.tanh(x) * x, rtol=1e-5, atol=1e-6)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors


def test_a_profile_still_sees_every_kernel():
    f = kn.compile(lambda x: kn.exp(x).sum(dim=-1))
    x = _rand(16, 16)
    f(x), f(x)
    with kn.profile() as p:
        for _ in range(3):
            f(x)
    assert len(p.events) >= 3


def test_a_traced_tensor_still_raises():
    f = kn.compile(lambda x: x + 1)
    x = kn.ones(3)
    f(x), f(x)
    with pytest.raises(KilnTraceError, match="traced tensor"):
        kn.trace(lambda t: f(t), x)


def test_strict_mode_still_refuses_a_new_signature_every_time():
    f = kn.compile(lambda x: x * 2, strict=True)
    f(_rand(4)), f(_rand(4))
    for _ in range(2):
        with pytest.raises(KilnError):
            f(_rand(4, dtype=np.float64))


def test_the_attention_gemm_and_the_batched_gemm_match_numpy():
    scores = kn.compile(lambda q, k: q @ k.transpose(1, 2))
    batched = kn.compile(lambda a, b: a @ b)
    q, k = _rand(64, 32, 16, seed=9), _rand(64, 32, 16, seed=10)
    a, b = _rand(16, 32, 256, seed=11), _rand(16, 256, 64, seed=12)
    for _ in range(3):
        np.testing.assert_allclose(scores(q, k).numpy(), np.matmul(q.astype(np.float64), k.transpose(0, 2, 1)),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(batched(a, b).numpy(), np.matmul(a.astype(np.float64), b),
                                   rtol=1e-4, atol=1e-3)
    assert isinstance(_prepared(scores)[0], FastCall) and _prepared(batched)


def test_externs_and_pool_split_launches_run_inside_the_prepared_call():
    """random_bits (dropout's mask) is an extern; a large elementwise kernel is split over
    kiln's pool: both run inside the prepared call, and the result is the eager one."""
    from kiln import nn

    def g(params, x, key):
        h = kn.relu(x @ params["w"] + params["b"])
        h = nn.functional.dropout(h, 0.25, key=key)
        big = kn.exp(params["big"] * 0.5)  # 2 MiB: a caching-allocator output
        return {"h": h, "big": big}

    f = kn.compile(g)
    params = {"w": kn.tensor(_rand(16, 8, seed=13)), "b": kn.tensor(_rand(8, seed=14)),
              "big": kn.tensor(_rand(1 << 19, seed=15))}
    x = kn.tensor(_rand(32, 16, seed=16))
    for i in range(4):
        key = nn.random.fold_in(nn.random.key(0), i)
        want = g(params, x, key)
        got = f(params, x, key)
        np.testing.assert_allclose(got["h"].numpy(), want["h"].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["big"].numpy(), want["big"].numpy(), rtol=1e-6)
    (call,) = _prepared(f)
    kinds = {p[0] for p in call.plan._parts}
    assert "extern" in kinds and "launches" in kinds
    # (the large launch: the kernel's own call while its split is measured, then a record
    # of the native run; either way inside the prepared call, its result the eager one)


def test_a_training_step_with_pytree_arguments_matches_eager():
    from kiln import nn, optim

    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = optim.AdamW(lr=1e-2)

    def loss_fn(params, x, y):
        return ((nn.functional_call(model, params, x) - y) ** 2).mean()

    def step(params, state, x, y):
        loss, grads = kn.value_and_grad(loss_fn)(params, x, y)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    compiled = kn.compile(step)
    x, y = kn.tensor(_rand(16, 8, seed=17)), kn.tensor(_rand(16, 4, seed=18))
    params = dict(model.named_parameters())
    pc, sc = params, opt.init(params)
    pe, se = params, opt.init(params)
    for _ in range(4):
        pc, sc, lc = compiled(pc, sc, x, y)
        pe, se, le = step(pe, se, x, y)
        np.testing.assert_allclose(lc.numpy(), le.numpy(), rtol=1e-5)
    for name in pe:
        np.testing.assert_allclose(pc[name].numpy(), pe[name].numpy(), rtol=1e-4, atol=1e-6)
    assert _prepared(compiled)  # the nested signature was prepared


def test_a_prepared_call_holds_the_executors_arena_not_a_second_one():
    f = kn.compile(lambda x, w: kn.softmax(x @ w, dim=-1) @ w.T)
    x, w = _rand(64, 32, seed=19), _rand(32, 32, seed=20)
    f(x, w)
    program = f.compiled_graphs()[0].program
    assert program.storage  # the program has intermediates in arena storage
    allocator = f.compiled_graphs()[0].executable.allocator
    gc.collect()
    before = allocator.stats()["arena_bytes"]
    for _ in range(3):
        out = f(x, w)
    assert _prepared(f)
    assert allocator.stats()["arena_bytes"] <= before  # no second copy of the intermediates
    s = x.astype(np.float64) @ w
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), (p / p.sum(-1, keepdims=True)) @ w.T, rtol=1e-4, atol=1e-5)


def test_a_program_the_plan_does_not_cover_is_judged_once(monkeypatch):
    from kiln.frontend import fast_dispatch

    f = kn.compile(lambda p, x: kn.cond(p, lambda v: v * 2, lambda v: -v, x))
    x = _rand(5, seed=21)
    seen = []
    real = fast_dispatch.prepare
    monkeypatch.setattr(fast_dispatch, "prepare", lambda *a: seen.append(1) or real(*a))
    import kiln.frontend.compile as compile_module
    monkeypatch.setattr(compile_module, "prepare", fast_dispatch.prepare)
    for _ in range(6):
        np.testing.assert_allclose(f(np.array(True), x).numpy(), x * 2)
    assert len(seen) == 1 and list(f._fast.values()) == [False]


def _c64(*shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


@pytest.mark.parametrize("n", [16, 1 << 15])  # np.empty'd outputs, and the caching allocator's
def test_a_returned_view_of_a_buffer_made_for_the_call_is_handed_out_not_copied(n):
    """A complex result is the kernel's float32 pairs read as complex64 (a View step):
    the caller gets that memory itself (no copy of the output per call), on the general
    path and the prepared one, and no two calls' results share memory."""
    f = kn.compile(lambda z, w: kn.exp(z) * w + z * 0.5)
    z, w = _c64(n, seed=1), _c64(n, seed=2)
    kept = []
    for i in range(4):
        zi = z + np.complex64(i)
        out = f(zi, w).numpy()
        np.testing.assert_allclose(out, np.exp(zi) * w + zi * np.float32(0.5), rtol=2e-5, atol=2e-5)
        assert out.dtype == np.complex64 and not out.flags.owndata
        assert out.base is not None and out.base.nbytes == out.nbytes  # the buffer itself
        kept.append((zi, out))
    assert len(_prepared(f)) == 1  # calls 3 and 4 ran the prepared call
    for i, (_, a) in enumerate(kept):
        assert not any(np.shares_memory(a, b) for _, b in kept[i + 1:])
    kept[0][1][:] = 0  # the caller's own: writing it changes no other result
    for zi, out in kept[1:]:
        np.testing.assert_allclose(out, np.exp(zi) * w + zi * np.float32(0.5), rtol=2e-5, atol=2e-5)
    del kept, out
    gc.collect()
    base = kn.memory.memory_allocated("cpu")
    held = f(z, w)
    assert kn.memory.memory_allocated("cpu") - base == n * 8  # counted while it lives
    del held
    gc.collect()
    assert kn.memory.memory_allocated("cpu") == base


def test_two_views_of_one_buffer_returned_are_two_arrays():
    f = kn.compile(lambda x: ((x * 2).reshape(16), (x * 2).reshape(2, 8)))
    x = _rand(4, 4, seed=8)
    for _ in range(3):
        a, b = (t.numpy() for t in f(x))
        np.testing.assert_array_equal(a, (x * 2).reshape(16))
        np.testing.assert_array_equal(b, (x * 2).reshape(2, 8))
        assert not np.shares_memory(a, b)


def test_a_view_of_an_input_is_still_copied():
    f = kn.compile(lambda z: kn.view_as_real(z))
    z = _c64(6, seed=3)
    for _ in range(3):
        out = f(z).numpy()
        np.testing.assert_array_equal(out, z.view(np.float32).reshape(6, 2))
        assert not np.shares_memory(out, z)
