"""`kn.compile` against eager mode, on both backends ("cpu": LLVM, "reference": the numpy
Kernel IR evaluator): op coverage per dtype with per-dtype tolerances, the
specialization cache and its stats, the recompile limit, value-dependent control flow,
fresh outputs, pytrees and Python scalars, and the CLI over an exported file.

LLVM compiles cost 0.1-1 s each here, so each test batches many ops into one function."""


import ml_dtypes
import numpy as np
import pytest

import kiln as kn
from kiln.frontend.compile import KilnRecompileLimitError
from tests.cli_helpers import kiln_cli

BACKENDS = ["cpu", "reference"]
NP = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
      "bfloat16": ml_dtypes.bfloat16, "int32": np.int32, "int64": np.int64, "bool": np.bool_}
FLOATS = ["float32", "float64", "float16", "bfloat16"]
TOL = {"float64": 1e-9, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def data(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith("int"):
        return rng.integers(-5, 6, shape).astype(NP[dtype])
    return (rng.standard_normal(shape) * 1.5).astype(NP[dtype])


def assert_matches(got, want, where=""):
    """Compiled output `got` equals eager `want` (kn.Tensor trees) within want's dtype."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want)
        for k in want:
            assert_matches(got[k], want[k], f"{where}.{k}")
        return
    if isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_matches(g, w, f"{where}[{i}]")
        return
    assert isinstance(got, kn.Tensor), where
    g, w = got.numpy(), want.numpy()
    assert g.dtype == w.dtype and g.shape == w.shape, (where, g.dtype, w.dtype, g.shape, w.shape)
    tol = TOL.get(str(w.dtype))
    if tol is None:
        np.testing.assert_array_equal(g, w, err_msg=where)
    else:
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol,
                                   equal_nan=True, err_msg=where)


def check(fn, *args, backend="cpu", **options):
    compiled = kn.compile(fn, backend=backend, **options)
    assert_matches(compiled(*args), fn(*args))
    return compiled


# -- op coverage ------------------------------------------------------------------------------

UNARY_FLOAT = ["exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "silu", "softplus",
               "erf", "expm1", "log1p", "atan", "sinh", "cosh"]
UNARY_ANY = ["abs", "neg", "relu", "sign"]


def elementwise(x, y):
    """Every elementwise op on x (any dtype) and y (broadcast against x)."""
    out = {}
    if x.dtype != kn.bool:
        for name in UNARY_ANY:
            out[name] = getattr(kn, name)(x)
        out.update(add=x + y, sub=x - y, mul=x * y, maximum=kn.maximum(x, y), minimum=kn.minimum(x, y),
                   scalar=x * 3 + 1, clamp=kn.clamp(x, -1, 2), where=kn.where(x > y, x, y),
                   fdiv=x // (kn.abs(y) + 1), mod=x % (kn.abs(y) + 1))
    for cmp in ("lt", "le", "eq", "ne", "gt", "ge"):
        out[cmp] = getattr(x, f"__{cmp}__")(y)
    if x.dtype in (kn.float32, kn.float64, kn.float16, kn.bfloat16):
        for name in UNARY_FLOAT:
            out[name] = getattr(kn, name)(x if name not in ("log", "sqrt", "rsqrt", "log1p") else kn.abs(x) + 0.5)
        out.update(div=x / (kn.abs(y) + 1), pow=kn.pow(kn.abs(x) + 1, y), floor=kn.floor(x * 1.5),
                   gelu=kn.gelu(x), gelu_tanh=kn.gelu(x, approximate="tanh"))
    elif x.dtype == kn.bool:
        out.update(and_=x & y, or_=x | y, not_=~x, as_f=x.to(kn.float32) * 2)
    else:
        out.update(xor=x ^ y, to_f=x.to(kn.float32) / 2, exp=kn.exp(x.to(kn.float32) * 0.1))
    return out


def reductions_and_shapes(x):
    out = {}
    numeric = x.dtype != kn.bool
    v = x if numeric else x.to(kn.int32)
    for d in (0, 1, 2, -1):
        for k in (False, True):
            out[f"sum{d}{k}"] = v.sum(dim=d, keepdim=k)
            out[f"max{d}{k}"] = v.max(dim=d, keepdim=k)[0]
            out[f"argmax{d}{k}"] = v.argmax(dim=d, keepdim=k)
            if x.dtype in (kn.float32, kn.float64, kn.float16, kn.bfloat16):
                out[f"mean{d}{k}"] = x.mean(dim=d, keepdim=k)
                out[f"var{d}{k}"] = x.var(dim=d, keepdim=k)
                out[f"lse{d}{k}"] = kn.logsumexp(x, dim=d, keepdim=k)
    out.update(sum02=v.sum(dim=(0, 2)), total=v.sum(), prod=v.prod(dim=1), min0=v.min(dim=0)[0],
               argmin=v.argmin(dim=2))
    out.update(reshape=x.reshape(5, -1), transpose=x.transpose(0, 2), permute=x.permute(2, 0, 1),
               mT=x.mT, expand=x[:, :1].expand(2, 3, 5), squeeze=x[:1].squeeze(0), unsqueeze=x.unsqueeze(1),
               cat=kn.cat([x, x], dim=1), stack=kn.stack([x, x], dim=0), split=kn.split(x, [1, 2], dim=1)[1],
               flip=x.flip(0), pad=kn.pad(x, (1, 2)), basic=x[1, ::2, 1:4], ellipsis=x[..., None, 2],
               fancy=x[:, [2, 0]], negative=x[:, -2:], gather=kn.gather(x, 2, kn.tensor(np.array([[[0, 4]] * 3] * 2))),
               index_select=kn.index_select(x, 1, kn.tensor(np.array([2, 1, 1]))))
    if numeric:
        out.update(bcast=x + v.sum(dim=1, keepdim=True), chain=(x.transpose(0, 1) * 2)[:, 1])
    return out


def nn_and_matmul(a, b, v, c, m):
    q = a.reshape(2, 5, 4)
    return dict(mm=a @ b, mv=a @ v, vm=v @ b, vv=v @ v, bmm=c @ c.mT, bcast=c @ b, tr=b.mT @ a.mT,
                epilogue=kn.relu(a @ b + b[0]) * 2 + (a @ b),
                softmax=kn.softmax(a, dim=-1), softmax0=kn.softmax(a, dim=0), log_softmax=kn.log_softmax(a, dim=-1),
                layer_norm=kn.layer_norm(a, (4,), v, v), layer_norm_plain=kn.layer_norm(a, (4,)),
                rms_norm=kn.rms_norm(a, (4,), v), gelu=kn.gelu(a), gelu_tanh=kn.gelu(a, approximate="tanh"),
                attention=kn.scaled_dot_product_attention(q, q * 0.5, q + 1),
                causal=kn.scaled_dot_product_attention(q, q, q, is_causal=True),
                masked=kn.scaled_dot_product_attention(q, q, q, attn_mask=m))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(NP))
def test_ops_match_eager(dtype, backend):
    x, y = kn.tensor(data(dtype, (2, 3, 5), 0)), kn.tensor(data(dtype, (5,), 1))

    def everything(x, y):
        return elementwise(x, y), reductions_and_shapes(x)

    check(everything, x, y, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_matmul_and_nn_composites_match_eager(dtype, backend):
    mask = np.tril(np.ones((5, 5), bool)) | np.eye(5, k=3, dtype=bool)
    args = [kn.tensor(data(dtype, s, i)) for i, s in enumerate([(10, 4), (4, 4), (4,), (3, 10, 4)])]
    check(nn_and_matmul, *args, kn.tensor(mask), backend=backend)


def test_transformer_block_matches_eager():
    from examples.transformer_block import example_inputs, transformer_block

    check(transformer_block, *example_inputs(batch=2, seq=8, dim=16, hidden=32))


# -- the specialization cache ----------------------------------------------------------------

def test_stats_count_compiles_hits_and_recompile_reasons():
    f = kn.compile(lambda x: kn.exp(x) * 2, backend="reference")
    x32 = np.ones((2, 3), np.float32)
    f(x32)
    f(x32)
    f(kn.tensor(x32))  # a kn.Tensor and an ndarray of one type share a specialization
    assert f.stats()["compiles"] == 1 and f.stats()["hits"] == 2
    f(x32.astype(np.float64))
    f(np.ones((4, 3), np.float32))
    stats = f.stats()
    assert stats["compiles"] == 3 and stats["specializations"] == 3
    reasons = [r["reason"] for r in stats["recompiles"]]
    assert "dtype changed from float32 to float64" in reasons[0]
    assert "dim 0 changed from 2 to 4" in reasons[1] and "not declared dynamic" in reasons[1]


def test_a_size_allowed_by_the_dynamic_spec_never_recompiles():
    B = kn.ShapeVar("B", min=1, max=64)
    f = kn.compile(lambda x, w: kn.softmax(x @ w, dim=-1), dynamic_shapes={"x": kn.TensorSpec([B, 8])})
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    for n in (1, 7, 64, 3):
        x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
        assert_matches(f(x, w), kn.softmax(kn.tensor(x) @ kn.tensor(w), dim=-1))
    assert f.stats()["compiles"] == 1 and f.stats()["hits"] == 3
    with pytest.raises(kn.KilnShapeSpecError, match="B"):
        f(np.ones((65, 8), np.float32), w)


def test_recompile_limit_fullgraph_raises_K180():
    # dynamic=False: every new size compiles (the default would make dim 0 symbolic)
    f = kn.compile(lambda x: x + 1, backend="reference", recompile_limit=2, dynamic=False)
    f(np.ones(1, np.float32))
    f(np.ones(2, np.float32))
    with pytest.raises(KilnRecompileLimitError) as info:
        f(np.ones(3, np.float32))
    message = str(info.value)
    assert message.startswith("[K180]") and "recompile_limit=2" in message and "dim 0" in message
    assert "ShapeVar" in message


def test_recompile_limit_without_fullgraph_falls_back_to_eager():
    f = kn.compile(lambda x: x * 3, backend="reference", recompile_limit=1, fullgraph=False)
    f(np.ones(1, np.float32))
    out = f(np.ones(4, np.float32))
    np.testing.assert_array_equal(out.numpy(), np.full(4, 3, np.float32))
    assert f.stats()["eager_calls"] == 1 and f.stats()["compiles"] == 1


def test_value_dependent_python_control_flow_raises_K141_at_the_users_line():
    def f(x):
        if x.sum() > 0:  # the line the error shows
            return x
        return -x

    with pytest.raises(kn.KilnConcretizationError) as info:
        kn.compile(f, backend="reference")(np.ones(3, np.float32))
    message = str(info.value)
    assert message.startswith("[K141]") and "test_compile.py" in message
    assert "if x.sum() > 0:" in message and "kn.cond" in message and "kn.while_loop" in message
    lenient = kn.compile(f, backend="reference", fullgraph=False)
    np.testing.assert_array_equal(lenient(-np.ones(3, np.float32)).numpy(), np.ones(3, np.float32))
    assert lenient.stats()["eager_calls"] == 1


# -- what calls get back -----------------------------------------------------------------------

def test_outputs_are_fresh_arrays():
    f = kn.compile(lambda x, y: (x, kn.exp(y) + 1, y.reshape(-1)))
    x, y = np.ones(3, np.float32), np.zeros((2, 2), np.float32)
    a, b, c = f(x, y)
    for out in (a, c):  # identity and view outputs never alias the inputs
        assert not np.shares_memory(out.numpy(), x) and not np.shares_memory(out.numpy(), y)
    b.numpy()[...] = 100
    a.numpy()[...] = -1
    a2, b2, _ = f(x, y)
    np.testing.assert_array_equal(b2.numpy(), np.full((2, 2), 2, np.float32))
    np.testing.assert_array_equal(a2.numpy(), x)
    np.testing.assert_array_equal(x, np.ones(3, np.float32))
    assert not np.shares_memory(b.numpy(), b2.numpy())


def test_pytree_arguments_and_results_and_baked_python_scalars():
    def f(params, scale, flag):
        h = params["x"] * scale
        return {"h": h, "pair": (h + params["b"][0], params["b"][1] * 2 if flag else h)}

    params = {"x": kn.randn(2, 3, seed=0), "b": [kn.randn(3, seed=1), kn.randn(2, 3, seed=2)]}
    compiled = kn.compile(f)
    assert_matches(compiled(params, 2.5, True), f(params, 2.5, True))
    assert_matches(compiled(params, 2.5, True), f(params, 2.5, True))
    assert compiled.stats()["compiles"] == 1 and compiled.stats()["hits"] == 1
    assert_matches(compiled(params, -1.0, False), f(params, -1.0, False))  # a new scalar: a new specialization
    assert compiled.stats()["compiles"] == 2
    assert "changed from 2.5 to -1.0" in compiled.stats()["recompiles"][0]["reason"]


# -- the command line over an exported file -------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("kir") / "mlp.kir"
    kn.export(lambda x, w, b: kn.softmax(kn.gelu(x @ w + b), dim=-1).sum(dim=0),
              (kn.randn(4, 8, seed=0), kn.randn(8, 6, seed=1), kn.randn(6, seed=2))).save(path)
    return path


def test_kiln_dump_prints_every_stage(exported):
    from kiln.frontend.stages import stage_names

    texts = {}
    for stage in stage_names():
        code, out, err = kiln_cli("dump", exported, "--stage", stage)
        assert code == 0 and out.strip(), (stage, err)
        texts[stage] = out
    assert 'fused(' in texts["optimized"] and "kernel " in texts["kernels"]
    assert texts["program"].startswith("program @") and "launch " in texts["program"]
    assert "define " in texts["source"]
    code, _, err = kiln_cli("dump", exported, "--stage", "nope")
    assert code == 2 and "unknown stage" in err


def test_kiln_run_with_npy_inputs(exported, tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(4, 8), (8, 6), (6,)]]
    paths = []
    for i, a in enumerate(arrays):
        paths.append(tmp_path / f"in{i}.npy")
        np.save(paths[-1], a)
    code, out, err = kiln_cli("run", exported, *paths, "--out", tmp_path / "out")
    assert code == 0, err
    got = np.load(tmp_path / "out" / "out0.npy")
    x, w, b = (kn.tensor(a) for a in arrays)
    np.testing.assert_allclose(got, kn.softmax(kn.gelu(x @ w + b), dim=-1).sum(dim=0).numpy(), rtol=1e-5)
    code, _, err = kiln_cli("run", exported, paths[0])
    assert code == 2 and "takes 3 inputs" in err


def test_kiln_bench_prints_timings(exported):
    code, out, err = kiln_cli("bench", exported, "--repeat", "2", "--backend", "reference")
    assert code == 0, err
    assert "compiled (median)" in out and "interpreter (median)" in out and "ms" in out
