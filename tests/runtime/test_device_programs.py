"""Compiled programs on device tensors (kiln/runtime/device_programs.py): the program of
the arguments' device runs on that device's memory and returns tensors there, and no
host copy happens between its kernels — counted (kiln/runtime/transfers.py) and checked
kernel argument by kernel argument on the OpenCL device (PoCL: a real OpenCL device on
this CPU). The device-generic rules run on the fake device of test_device.py."""

import gc

import numpy as np
import pytest

import kiln as kn
from kiln.runtime import transfers
from kiln.runtime.device import KilnDeviceMismatchError, in_memory_of
from tests.runtime.test_device import FakeMemory, fake  # noqa: F401  (the fixture)


def _opencl_reason():
    from kiln.codegen.opencl.runtime import no_device_reason

    return no_device_reason()


needs_opencl = pytest.mark.skipif(_opencl_reason() is not None,
                                  reason=f"needs an OpenCL device: {_opencl_reason()}")


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((48, 32)).astype(np.float32),
            rng.standard_normal((32, 24)).astype(np.float32))


def _mlp(x, w):
    h = (x @ w).relu()
    return kn.softmax(h, -1) * 2 + 1, h.sum(-1)


def _mlp_ref(x, w):
    h = np.maximum(x @ w, 0)
    e = np.exp(h - h.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True) * 2 + 1, h.sum(-1)


@pytest.fixture
def kernel_args(monkeypatch):
    """Every buffer an OpenCL kernel is launched with, and whether it is the device's
    own SVM memory (what a GPU could take without a copy)."""
    from kiln.codegen.opencl import launcher, runtime

    seen = []
    plain = runtime.device_arg

    def spy(ctx, array):
        seen.append(array.size == 0 or runtime.owns(ctx, array))
        return plain(ctx, array)

    monkeypatch.setattr(runtime, "device_arg", spy)
    monkeypatch.setattr(launcher, "device_arg", spy)  # capture's enqueue loop imported it by name
    return seen


@needs_opencl
def test_multi_kernel_program_stays_on_the_opencl_device(kernel_args):
    from kiln.codegen.opencl.runtime import OpenCLKernel

    xs, ws = _data()
    x, w = kn.tensor(xs).to("opencl:0"), kn.tensor(ws).to("opencl:0")
    f = kn.compile(_mlp)  # the default backend: the arguments' device decides
    f(x, w)
    compiled = f.compiled_graphs()[0]
    launches = [s for s in compiled.program.steps if type(s).__name__ == "Launch"]
    assert len(launches) >= 2 and len(launches) == len(compiled.program.steps)
    assert all(isinstance(k, OpenCLKernel) for k in compiled.executable.kernels.values())
    kernel_args.clear()
    with transfers.counting() as seen:
        a, b = f(x, w)
    assert seen["host_to_device"] == seen["device_to_host"] == seen["host_operands"] == 0
    assert seen["device_to_device"] == 0
    # every buffer of every launch (inputs, the intermediate, outputs) is device memory
    assert len(kernel_args) >= 5 and all(kernel_args)
    assert a.device == b.device == "opencl:0"
    assert in_memory_of(a.device, a.numpy()) and in_memory_of(b.device, b.numpy())
    ra, rb = _mlp_ref(xs, ws)
    np.testing.assert_allclose(a.numpy(), ra, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.numpy(), rb, rtol=1e-4, atol=1e-4)
    with transfers.counting() as seen:  # the copy the user asks for, and only it
        host = b.to("cpu")
    assert seen["device_to_host"] == 1 and seen["device_to_host_bytes"] == b.numpy().nbytes
    assert host.device == "cpu" and not in_memory_of(kn.device("opencl:0"), host.numpy())
    np.testing.assert_array_equal(host.numpy(), b.numpy())


@needs_opencl
def test_host_arrays_at_the_boundary_are_counted(kernel_args):
    """The counters are not blind: an eager result on the device (computed on the host)
    is copied in, and an explicitly host-compiled OpenCL program uses host operands."""
    xs, ws = _data(1)
    x, w = kn.tensor(xs).to("opencl:0"), kn.tensor(ws).to("opencl:0")
    f = kn.compile(_mlp)
    f(x, w)
    eager = w * 1.0  # on opencl:0, but numpy's memory
    assert eager.device == "opencl:0" and not in_memory_of(eager.device, eager.numpy())
    with transfers.counting() as seen:
        a, _ = f(x, eager)
    assert seen["host_to_device"] == 1 and seen["host_to_device_bytes"] == ws.nbytes
    np.testing.assert_allclose(a.numpy(), _mlp_ref(xs, ws)[0], rtol=1e-5, atol=1e-5)
    g = kn.compile(_mlp, backend="opencl")  # CPU tensors into an OpenCL program
    g(kn.tensor(xs), kn.tensor(ws))
    with transfers.counting() as seen:
        a, _ = g(kn.tensor(xs), kn.tensor(ws))
    assert a.device == "cpu"
    # x and w, used in place by PoCL (a GPU would copy them); the rest is the device's SVM
    assert seen["host_operands"] == 2 and seen["host_operands_bytes"] == xs.nbytes + ws.nbytes


@needs_opencl
def test_control_flow_and_externs_on_the_device_count_their_host_reads():
    xs = np.linspace(1.0, 4.0, 256, dtype=np.float32)

    def newton(a):
        def cond(i, y):  # data-dependent: a loop no pass can unroll
            return ((y * y - a).abs().max() > 1e-5) & (i < 30)

        def body(i, y):
            return i + 1, 0.5 * (y + a / y)
        return kn.while_loop(cond, body, (kn.tensor(0), a))[1]

    f = kn.compile(newton)
    a = kn.tensor(xs).to("opencl:0")
    f(a)
    with transfers.counting() as seen:
        y = f(a)
    assert y.device == "opencl:0"
    np.testing.assert_allclose(y.numpy(), np.sqrt(xs), rtol=1e-5)
    # only the loop's flag crosses: one bool per test of the condition (trips + 1)
    assert seen["device_to_host"] >= 3 and seen["device_to_host_bytes"] == seen["device_to_host"]
    assert seen["host_operands"] == seen["host_to_device"] == 0

    g = kn.compile(lambda v: kn.sort(v * 2.0, dim=-1)[0] + 1.0)  # sort is an extern
    v = kn.tensor(xs[::-1].copy()).to("opencl:0")
    g(v)
    with transfers.counting() as seen:
        r = g(v)
    assert r.device == "opencl:0" and in_memory_of(r.device, r.numpy())
    np.testing.assert_allclose(r.numpy(), np.sort(xs[::-1] * 2) + 1, rtol=1e-6)
    assert seen["device_to_host"] >= 1 and seen["host_to_device"] >= 1  # the sort's trip
    assert seen["host_operands"] == 0


def test_programs_run_on_the_fake_device(fake):
    mem = kn.memory
    xs, ws = _data(2)
    x, w = kn.tensor(xs).to("fake"), kn.tensor(ws).to("fake")
    f = kn.compile(_mlp)
    f(x, w)
    gc.collect()
    before_fake, before_cpu = mem.memory_allocated("fake"), mem.memory_allocated("cpu")
    with transfers.counting() as seen:
        a, b = f(x, w)
    assert a.device == b.device == "fake:0"
    assert seen["host_to_device"] == seen["device_to_host"] == 0
    assert in_memory_of(a.device, a.numpy()) and in_memory_of(b.device, b.numpy())
    # the two results are blocks of the fake device (512 B granularity), not host memory
    grown = mem.memory_allocated("fake") - before_fake
    assert grown == -(-a.numpy().nbytes // 512) * 512 + -(-b.numpy().nbytes // 512) * 512
    assert mem.memory_allocated("cpu") - before_cpu < a.numpy().nbytes
    ra, rb = _mlp_ref(xs, ws)
    np.testing.assert_allclose(a.numpy(), ra, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.numpy(), rb, rtol=1e-4, atol=1e-4)
    # the same function on host tensors: a specialization of its own, results on the cpu
    c, _ = f(kn.tensor(xs), kn.tensor(ws))
    assert c.device == "cpu" and f.stats()["compiles"] == 2
    assert f.stats()["recompiles"][0]["reason"] == \
        "the arguments are on cpu (a program of its own per device)"
    np.testing.assert_array_equal(c.numpy(), a.numpy())


def test_mixed_devices_in_a_compiled_call_are_K380(fake):
    f = kn.compile(lambda x, y: x * y + 1)
    x = kn.ones(4, device="fake")
    with pytest.raises(KilnDeviceMismatchError, match=r"K380.*fake:0 and fake:1"):
        f(x, kn.ones(4, device="fake:1"))
    with pytest.raises(KilnDeviceMismatchError, match=r"K380.*argument 1 is on the cpu.*fake:0"):
        f(x, kn.ones(4))
    with pytest.raises(KilnDeviceMismatchError, match=r"K380.*argument 0 is on the cpu"):
        f(np.ones(4, np.float32), x)
    with transfers.counting() as seen:  # a 0-d CPU tensor joins, copied to the device
        y = f(x, kn.tensor(3.0))
    assert y.device == "fake:0" and seen["host_to_device"] == 1
    np.testing.assert_array_equal(y.numpy(), np.full(4, 4.0, np.float32))


def test_write_back_and_returned_arguments_stay_on_the_device(fake):
    def step(p, g):
        p.sub_(g * 0.5)
        return p.sum()

    f = kn.compile(step)
    p = kn.tensor(np.arange(6, dtype=np.float32)).to("fake")
    g = kn.ones(6, device="fake")
    s = f(p, g)
    assert s.device == p.device == "fake:0"
    np.testing.assert_allclose(p.numpy(), np.arange(6) - 0.5)
    np.testing.assert_allclose(s.item(), (np.arange(6) - 0.5).sum())


@needs_opencl
def test_capture_on_the_opencl_device_replays_in_device_memory(kernel_args):
    xs = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    x = kn.tensor(xs).to("opencl:0")
    g = kn.capture(lambda v: kn.gelu(v * 2 + 1) * kn.sigmoid(v), x)
    expected = kn.compile(lambda v: kn.gelu(v * 2 + 1) * kn.sigmoid(v))(kn.tensor(xs)).numpy()
    kernel_args.clear()
    with transfers.counting() as seen:
        y = g(x)
    assert y.device == "opencl:0" and in_memory_of(y.device, y.numpy())
    assert seen["host_operands"] == seen["host_to_device"] == seen["device_to_host"] == 0
    assert kernel_args and all(kernel_args)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(KilnDeviceMismatchError, match="K380.*captured on opencl:0"):
        g(kn.tensor(xs))


def test_a_strided_view_of_device_memory_is_made_dense_on_the_device(fake):
    """Kernels take dense buffers: a strided view into a device block (what DLPack or a
    backend may hand kiln) is copied on the device, counted, and computed right."""
    xs = np.arange(48, dtype=np.float32).reshape(6, 8)
    x = kn.tensor(xs).to("fake")
    strided = kn.Tensor._make(x.numpy()[:, ::2], None, x.device)  # a view, not a copy
    assert in_memory_of(x.device, strided.numpy()) and not strided.numpy().flags.c_contiguous
    f = kn.compile(lambda v: v * 2 + 1)
    f(strided)
    with transfers.counting() as seen:
        y = f(strided)
    assert seen["device_to_device"] == 1 and seen["host_to_device"] == 0
    np.testing.assert_array_equal(y.numpy(), xs[:, ::2] * 2 + 1)
