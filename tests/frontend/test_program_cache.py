"""The whole-program compile cache (kiln/frontend/program_cache.py): a compile whose traced
graph was compiled before loads the lowered program and its machine code from ONE entry
and runs no graph pass, no lowering and no LLVM; any change to the graph, the options or
kiln's version is a new entry; a damaged or planted entry is refused and rebuilt."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kiln as kn
from kiln.codegen import artifact_cache, cache_trust
from kiln.codegen.backends import get_backend
from kiln.frontend import program_cache

RNG = np.random.default_rng(7)
X = RNG.standard_normal((6, 8)).astype(np.float32)
W = RNG.standard_normal((8, 5)).astype(np.float32)


def model(x, w):
    """A GEMM with an epilogue, reductions, a softmax and a cond: Launch, Control and
    sub-program steps, GEMM and loop kernels in one program."""
    h = kn.gelu(x @ w + 1.5, approximate="tanh")
    s = h.sum(dim=-1)
    y = kn.cond(s.sum() > 0, lambda a: a * 2.0, lambda a: a - 1.0, s)
    return kn.softmax(h, dim=-1), y


def oracle(x, w, bias=1.5):
    z = x @ w + bias
    h = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    s = h.sum(-1)
    e = np.exp(h - h.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True), (s * 2 if s.sum() > 0 else s - 1)


def check(outputs, bias=1.5):
    want = oracle(X, W, bias)
    for got, ref in zip(outputs, want):
        np.testing.assert_allclose(got.numpy(), ref, rtol=2e-5, atol=2e-5)


class Counts:
    """How often the work a cache hit must skip ran: graph pipelines, lowering, LLVM."""

    def __init__(self, monkeypatch):
        from kiln.codegen import build_program as bp
        from kiln.codegen.cpu import jit
        from kiln.passes import manager

        self.n = {"pipeline": 0, "lower": 0, "llvm": 0}
        for owner, name, label in ((manager.Pipeline, "run", "pipeline"), (bp, "build_program", "lower"),
                                   (jit, "optimize", "llvm"), (jit, "_compile_alone", "llvm")):
            monkeypatch.setattr(owner, name, self._counting(getattr(owner, name), label))

    def _counting(self, fn, label):
        def counted(*args, **kwargs):
            self.n[label] += 1
            return fn(*args, **kwargs)
        return counted


@pytest.fixture
def stats(monkeypatch):
    for k in program_cache.STATS:
        monkeypatch.setitem(program_cache.STATS, k, 0)
    return program_cache.STATS


def entry_path(tmp_cache=None):
    root = artifact_cache.cache_dir()
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "programs"))
               for f in fs if f.endswith(".bin")]
    return path


def test_hit_skips_passes_lowering_and_llvm(stats, monkeypatch):
    check(kn.compile(model)(X, W))
    assert stats["stores"] == 1 and stats["hits"] == 0
    counts = Counts(monkeypatch)
    again = kn.compile(model)  # a new compiled function: nothing in memory to reuse
    check(again(X, W))
    assert stats["hits"] == 1 and stats["stores"] == 1
    assert counts.n == {"pipeline": 0, "lower": 0, "llvm": 0}
    check(again(X, W))  # and it keeps running
    # the optimized graph and stage dumps are made on demand, equal to a fresh compile's
    cg = again.compiled_graphs()[0]
    assert counts.n["pipeline"] == 0
    text = str(cg.optimized)
    assert counts.n["pipeline"] == 1 and "fused" in text and "decompose" in cg.stages


def test_changed_graph_or_constant_is_a_new_entry(stats):
    check(kn.compile(model)(X, W))

    def other(x, w):  # the same text but for one constant
        h = kn.gelu(x @ w + 2.5, approximate="tanh")
        s = h.sum(dim=-1)
        return kn.softmax(h, dim=-1), kn.cond(s.sum() > 0, lambda a: a * 2.0, lambda a: a - 1.0, s)

    check(kn.compile(other)(X, W), bias=2.5)
    assert stats["hits"] == 0 and stats["stores"] == 2


def test_key_covers_graph_constants_options_version_and_source(monkeypatch):
    graph = kn.trace(model, X, W)
    cpu = get_backend("cpu")
    key = program_cache.program_key(graph, cpu, "default")
    assert key == program_cache.program_key(kn.trace(model, X, W), cpu, "default")
    assert key != program_cache.program_key(graph, cpu, "max-autotune")
    other = type(cpu)(type(cpu.options)(opt_level=2))
    assert key != program_cache.program_key(graph, other, "default")
    with_const = kn.trace(lambda x: x + kn.asarray(np.arange(3, dtype=np.float32)), X[0, :3])
    if with_const.constants:  # constant data is hashed bit for bit, not only its name
        name = next(iter(with_const.constants))
        k1 = program_cache.program_key(with_const, cpu, "default")
        with_const.constants[name] = with_const.constants[name] + 1
        assert program_cache.program_key(with_const, cpu, "default") != k1
    from kiln.passes import batching

    monkeypatch.setattr(batching, "ENABLED", False)  # a switch flipped at run time
    assert key != program_cache.program_key(graph, cpu, "default")
    monkeypatch.setattr(batching, "ENABLED", True)  # back at its default: the same key
    assert key == program_cache.program_key(graph, cpu, "default")
    monkeypatch.setenv("KILN_COMPLEX_GEMM", "3m")  # a setting the passes read
    assert key != program_cache.program_key(graph, cpu, "default")
    monkeypatch.delenv("KILN_COMPLEX_GEMM")
    import kiln._version

    monkeypatch.setattr(kiln._version, "__version__", "0.0.0-test")
    assert key != program_cache.program_key(graph, cpu, "default")
    monkeypatch.undo()
    monkeypatch.setattr(program_cache, "source_hash", lambda: "another build")
    assert key != program_cache.program_key(graph, cpu, "default")


def test_new_version_recompiles(stats, monkeypatch):
    check(kn.compile(model)(X, W))
    import kiln._version

    monkeypatch.setattr(kiln._version, "__version__", "0.0.0-test")
    check(kn.compile(model)(X, W))
    assert stats["hits"] == 0 and stats["stores"] == 2


def seal_entry(path, payload: bytes) -> None:
    """Write `payload` as kiln would (a valid tag): what a bug in kiln could leave."""
    root = artifact_cache.cache_dir()
    key = os.path.basename(path)[:-4]
    with open(path, "wb") as f:
        f.write(cache_trust.seal(cache_trust.secret_key(root), program_cache.KIND, key, payload))


def read_entry(path):
    root = artifact_cache.cache_dir()
    key = os.path.basename(path)[:-4]
    payload = cache_trust.unseal(cache_trust.secret_key(root), program_cache.KIND, key,
                                 open(path, "rb").read())
    n = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + n]), payload[8 + n:]


def with_head(head: dict, objects: bytes) -> bytes:
    data = json.dumps(head).encode()
    return len(data).to_bytes(8, "little") + data + objects


def spoil_truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])


def spoil_planted(path):  # written by someone without the cache's key
    open(path, "wb").write(cache_trust.MAGIC + os.urandom(32) + b"\x10" + b"\0" * 64)


def spoil_not_json(path):
    seal_entry(path, (12).to_bytes(8, "little") + b"not json at all" + b"\0" * 16)


def spoil_foreign_class(path):  # a class name the format does not allow
    head, objects = read_entry(path)
    head["program"]["nodes"][0] = ["c", "Popen", [["l", ["sh", "-c", "echo owned"]]]]
    seal_entry(path, with_head(head, objects))


def spoil_forward_reference(path):
    head, objects = read_entry(path)
    nodes = head["program"]["nodes"]
    nodes[0] = ["f", "Add", [["n", len(nodes) - 1], ["n", 0]]]
    seal_entry(path, with_head(head, objects))


def spoil_legal_missing(path):  # an entry of the earlier layout
    head, objects = read_entry(path)
    del head["legal"]
    seal_entry(path, with_head(head, objects))


def spoil_program_as_text(path):  # the program as a JSON string: not this format
    head, objects = read_entry(path)
    head["program"] = json.dumps(head["program"])
    seal_entry(path, with_head(head, objects))


def spoil_objects(path):  # valid program, machine code that is not an object file
    head, objects = read_entry(path)
    seal_entry(path, with_head(head, b"\x7fELF" + b"\xff" * (len(objects) - 4)))


def spoil_names(path):  # kernel names that are not the program's
    head, objects = read_entry(path)
    head["names"] = head["names"][:-1] + ["kiln_nothing"]
    seal_entry(path, with_head(head, objects))


def spoil_hints_order(path):  # a kernel index that is not numbered in first-appearance order
    head, objects = read_entry(path)
    head["hints"]["index"] = [i + 1 for i in head["hints"]["index"]]
    seal_entry(path, with_head(head, objects))


def spoil_hints_twins(path):  # every kernel said to share the first one's code
    head, objects = read_entry(path)
    head["hints"]["index"] = [0] * len(head["hints"]["index"])
    head["hints"]["costs"] = head["hints"]["costs"][:1]
    seal_entry(path, with_head(head, objects))


def spoil_hints_costs(path):  # work estimates for one stage more than a loop kernel has
    head, objects = read_entry(path)
    costs = head["hints"]["costs"]
    k = next(i for i, c in enumerate(costs) if c is not None)
    costs[k] = costs[k] + [1]
    seal_entry(path, with_head(head, objects))


@pytest.mark.parametrize("spoil", [spoil_truncate, spoil_planted, spoil_not_json, spoil_foreign_class,
                                   spoil_forward_reference, spoil_objects, spoil_names,
                                   spoil_program_as_text, spoil_legal_missing, spoil_hints_order,
                                   spoil_hints_twins],
                         ids=lambda f: f.__name__[6:])
def test_bad_entry_is_refused_and_rebuilt(stats, monkeypatch, spoil):
    check(kn.compile(model)(X, W))
    path = entry_path()
    spoil(path)
    counts = Counts(monkeypatch)
    check(kn.compile(model)(X, W))  # refused: compiled again from the graph, right answers
    assert stats["hits"] == 0 and stats["corrupt"] == 1 and stats["stores"] == 2
    assert counts.n["pipeline"] == 1 and counts.n["llvm"] >= 1
    check(kn.compile(model)(X, W))  # and the rebuilt entry is used
    assert stats["hits"] == 1


@pytest.mark.parametrize("legal", [True, False])
def test_legal_programs_load_without_legalizing_again(stats, monkeypatch, legal):
    """The entry records whether the backend's legalize pass left every kernel as it was;
    a hit of such an entry skips the pass, and one recorded otherwise runs it."""
    from kiln.codegen.program_codec import decode_program

    check(kn.compile(model)(X, W))
    path = entry_path()
    head, objects = read_entry(path)
    cpu = get_backend("cpu")
    program = decode_program(head["program"])
    assert head["legal"] == all(cpu.legalize(k) is k for k in program.kernels.values())
    assert head["legal"]  # the CPU table has every scalar op this model uses
    head["legal"] = legal
    seal_entry(path, with_head(head, objects))
    calls = []
    real = type(cpu).legalize
    monkeypatch.setattr(type(cpu), "legalize", lambda self, k: calls.append(k) or real(self, k))
    check(kn.compile(model)(X, W))
    assert stats["hits"] == 1 and stats["corrupt"] == 0
    assert (len(calls) == 0) == legal and (legal or len(calls) >= len(head["names"]))


def test_work_estimates_that_do_not_fit_the_kernels_are_refused(stats, monkeypatch):
    """The form of the hints is checked on load; whether a loop kernel's estimates fit
    its stages only the backend knows: the kernels do not load, the program is compiled
    again and the entry replaced."""
    check(kn.compile(model)(X, W))
    spoil_hints_costs(entry_path())
    counts = Counts(monkeypatch)
    check(kn.compile(model)(X, W))
    assert stats["corrupt"] == 1 and stats["stores"] == 2 and counts.n["pipeline"] == 1
    check(kn.compile(model)(X, W))
    assert stats["hits"] == 2 and stats["corrupt"] == 1


def twin_layers(x, w1, w2, a, b):
    """Two layers of the same shapes (kernels identical but for their names), a reduction,
    a BLAS product in row panels with an epilogue and one on kiln's micro-kernel."""
    def layer(h, w):
        return kn.tanh(h @ w) * 2 + 1

    h = layer(layer(x, w1), w2)
    return h, kn.exp(h).sum(dim=0), kn.relu(a @ b + 1.0), a[:64, :128] @ b[:128, :64]


def twin_oracle(x, w1, w2, a, b):
    h = np.tanh((np.tanh(x @ w1) * 2 + 1) @ w2) * 2 + 1
    return h, np.exp(h).sum(0), np.maximum(a @ b + 1.0, 0), a[:64, :128] @ b[:128, :64]


def test_a_hit_takes_the_entrys_load_hints(stats, monkeypatch):
    """The entry keeps which kernels share code and each loop kernel's work estimate; a
    hit uses them instead of hashing every kernel and walking its expressions, and
    computes the same numbers (the twins run their shared code; GEMMs on BLAS panels, on
    kiln's micro-kernel and as loops)."""
    from kiln.codegen.cpu import backend as cpu_backend
    from kiln.codegen.cpu import compiled as cpu_compiled
    from kiln.codegen.program_codec import decode_program

    w1, w2 = (RNG.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
    a, b = (RNG.standard_normal((256, 256)).astype(np.float32) for _ in range(2))
    first = kn.compile(twin_layers)(X, w1, w2, a, b)
    head, _ = read_entry(entry_path())
    program = decode_program(head["program"])
    kernels = [program.kernels[n] for n in head["names"]]
    index = head["hints"]["index"]
    assert index == cpu_backend._distinct(kernels)[1] and len(set(index)) < len(index)
    cpu = get_backend("cpu")
    unique = [kernels[index.index(i)] for i in range(len(set(index)))]
    plans = [cpu._plan(k, set()) for k in unique]
    assert head["hints"]["costs"] == [cpu_compiled.stage_costs(p.kernel)
                                      if isinstance(p.kernel, cpu_compiled.Kernel) else None for p in plans]
    assert any(c is not None for c in head["hints"]["costs"])
    assert {"blas" if p.blas else "micro" if p.micro else "loop" for k, p in zip(unique, plans)
            if isinstance(k, cpu_backend.GemmKernel)} == {"loop", "blas", "micro"}
    calls = []
    for owner, name in ((cpu_backend, "_distinct"), (cpu_compiled, "stage_costs")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    again = kn.compile(twin_layers)(X, w1, w2, a, b)
    assert stats["hits"] == 1 and stats["corrupt"] == 0 and calls == []
    for got, want, before in zip(again, twin_oracle(X, w1, w2, a, b), first):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-3)
        np.testing.assert_array_equal(got.numpy(), before.numpy())


def counting_verifier(monkeypatch) -> list:
    """Every graph kn.compile's trace or compile_graph verifies, appended to a list."""
    from kiln.frontend import graph_compile, tracing

    seen = []
    for module in (graph_compile, tracing):
        real = module.verify
        monkeypatch.setattr(module, "verify", lambda g, real=real: seen.append(g) or real(g))
    return seen


def test_a_hit_does_not_verify_the_traced_graph_again(stats, monkeypatch):
    """A traced graph equal (by its key) to one verified before its entry was stored is
    not verified again; a miss verifies it once, before the graph passes."""
    seen = counting_verifier(monkeypatch)
    check(kn.compile(model)(X, W))  # a miss: verified once
    assert stats["stores"] == 1 and len(seen) == 1
    check(kn.compile(model)(X, W))  # a hit: not again
    assert stats["hits"] == 1 and len(seen) == 1
    monkeypatch.setenv("KILN_PROGRAM_CACHE", "0")
    check(kn.compile(model)(X, W))  # no cache: verified
    assert len(seen) == 2


def test_a_malformed_traced_graph_is_refused_by_the_verifier(stats, monkeypatch):
    """kn.compile leaves verification to compile_graph: a trace that went wrong (here a
    result retyped behind the emitter's back) still gets the verifier's error, and
    nothing is stored for it."""
    from kiln.errors import KilnVerifierError
    from kiln.frontend import tracing
    from kiln.ir.types import TensorType

    real = tracing._trace_function

    def broken(*args):
        traced = real(*args)
        node = next(n for n in traced.graph.body.nodes if n.op == "tanh" or n.op == "exp")
        node.results[0].type = TensorType(kn.float64, node.results[0].type.shape)
        return traced

    monkeypatch.setattr(tracing, "_trace_function", broken)
    with pytest.raises(KilnVerifierError, match="results are typed f64"):
        kn.compile(lambda x: kn.exp(x) * 2.0)(X)
    assert stats["stores"] == 0


def test_disabled_by_environment(stats, monkeypatch):
    monkeypatch.setenv("KILN_PROGRAM_CACHE", "0")
    check(kn.compile(model)(X, W))
    check(kn.compile(model)(X, W))
    assert stats == {"hits": 0, "misses": 0, "stores": 0, "corrupt": 0, "uncacheable": 0}


WORKER = r"""
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
import kiln as kn
from kiln.frontend import program_cache
from kiln.passes import manager
from test_program_cache import X, W, model, oracle
runs = []
real = manager.Pipeline.run
manager.Pipeline.run = lambda self, *a, **k: runs.append(1) or real(self, *a, **k)
out = kn.compile(model)(X, W)
ok = all(np.allclose(o.numpy(), r, rtol=2e-5, atol=2e-5) for o, r in zip(out, oracle(X, W)))
print(json.dumps({{"ok": ok, "stats": program_cache.STATS, "pipelines": len(runs),
                  "lowering": "kiln.codegen.lower" in sys.modules}}))
"""


@pytest.mark.timeout(180)
def test_a_new_process_loads_the_program(tmp_path):
    env = dict(os.environ, KILN_CACHE_DIR=str(tmp_path / "cache"))
    code = WORKER.format(tests=os.path.dirname(__file__))
    results = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=150)
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = results
    assert first["ok"] and first["stats"]["stores"] == 1 and first["pipelines"] == 1
    assert second["ok"] and second["stats"]["hits"] == 1 and second["pipelines"] == 0
    # a hit does not even import the lowering (kiln.codegen.lower: ~2 ms, 7 from source)
    assert first["lowering"] and not second["lowering"]
