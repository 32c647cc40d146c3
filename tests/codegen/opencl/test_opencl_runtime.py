"""The OpenCL runtime on the device here (PoCL): the opencl device kind with its caching
allocator (statistics, fraction limit), kernels taking device memory in place, program
binaries from the authenticated disk cache (and refused when not this device's),
`kiln dump --target opencl`, and clear errors for what is missing (no Intel GPU: xpu)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kiln as kn
from kiln.codegen import artifact_cache
from kiln.codegen.opencl.runtime import DeviceContext, all_devices, context, owns
from kiln.errors import KilnError
from tests.codegen.opencl.conftest import needs_device

pytestmark = needs_device


def test_opencl_tensors_live_in_device_memory_counted_by_its_allocator():
    before = kn.memory.memory_stats("opencl:0")["allocated_bytes.all.current"]
    x = kn.tensor(np.arange(1000, dtype=np.float32)).to("opencl")
    assert x.device == "opencl:0" and owns(context(), x._x)  # the SVM itself, not a host copy
    assert kn.memory.memory_stats("opencl:0")["allocated_bytes.all.current"] >= before + 4000
    np.testing.assert_array_equal((x * 2).cpu().numpy(), np.arange(1000, dtype=np.float32) * 2)


def test_memory_fraction_limit_refuses_past_the_device_share():
    total = int(all_devices()[0].global_mem_size)
    kn.memory.set_per_process_memory_fraction(0.001, "opencl:0")
    try:
        with pytest.raises(KilnError, match="K170"):
            kn.zeros(int(total * 0.002) // 4, dtype=kn.float32, device="opencl:0")
    finally:
        kn.memory.set_per_process_memory_fraction(1.0, "opencl:0")


def test_compiled_kernels_read_and_write_device_memory_in_place():
    x = kn.tensor(np.linspace(-1, 1, 513, dtype=np.float32)).to("opencl")
    out = kn.compile(lambda a: kn.exp(a) * 3, backend="opencl")(x)
    np.testing.assert_allclose(out.numpy(), np.exp(np.linspace(-1, 1, 513, dtype=np.float32)) * 3, rtol=1e-6)


def test_program_binaries_come_back_from_the_disk_cache_and_are_checked():
    source = "__kernel void kiln_cache_probe(__global float *a) { a[get_global_id(0)] += 1.0f; }\n"
    first = DeviceContext(all_devices()[0])
    first.program(source)
    assert first.stats == {"built": 1, "cached": 0} or first.stats["cached"] == 1
    second = DeviceContext(all_devices()[0])
    second.program(source)
    assert second.stats == {"built": 0, "cached": 1}
    blob = second._wrap(b"\x7fELF-binary")
    second._validate(blob)  # this device's entry passes
    other = blob.replace(second.identity.encode(), b"X" * len(second.identity.encode()))
    with pytest.raises(ValueError):
        second._validate(other)  # another device's or driver's entry is refused
    with pytest.raises(ValueError):
        second._validate(blob[:-3])  # a truncated one too
    assert artifact_cache.STATS["hits"] >= 1


def test_kiln_dump_prints_the_generated_opencl_c(tmp_path):
    path = tmp_path / "f.kir"
    kn.export(lambda x: kn.softmax(x, dim=-1), (kn.zeros(4, 8),)).save(str(path))
    done = subprocess.run([sys.executable, "-m", "kiln", "dump", str(path), "--target", "opencl", "--stage", "source"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "__kernel" in done.stdout and "barrier(CLK_LOCAL_MEM_FENCE)" in done.stdout


def test_xpu_without_an_intel_gpu_is_a_clear_error():
    from kiln.codegen.opencl.runtime import intel_gpus

    if intel_gpus():
        pytest.skip("this machine has an Intel GPU: xpu is available")
    with pytest.raises(KilnError, match="K381"):
        kn.zeros(3, device="xpu")
    with pytest.raises(KilnError, match="K400"):
        kn.compile(lambda a: a + 1, backend="xpu")(np.zeros(3, np.float32))


def test_compiled_intermediates_come_from_the_device_allocator():
    f = kn.compile(lambda a: kn.softmax(a * 2, dim=-1) + 1, backend="opencl")
    x = np.random.default_rng(1).standard_normal((64, 300)).astype(np.float32)
    out = f(x).numpy()
    e = np.exp(2 * x - (2 * x).max(-1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True) + 1, rtol=1e-5)
    assert owns(context(), f(x)._x)  # the output is a block of the device's SVM


def test_a_program_the_driver_rejects_is_k401_and_float64_without_fp64_is_k402():
    from kiln.codegen.opencl.emit import emit_kernel
    from kiln.codegen.opencl.runtime import OpenCLKernel

    with pytest.raises(KilnError, match="K401") as info:
        context().program("__kernel void broken(__global float *a) { a[0] = undeclared_name; }\n")
    assert "kiln dump --target opencl" in str(info.value)
    exported = kn.export(lambda a: a * 2, (kn.zeros(4, dtype=kn.float64),))
    from kiln.frontend.compile import compile_graph

    (kernel,) = compile_graph(exported.graph, "opencl", build=False).program.kernels.values()
    emitted = emit_kernel(kernel)
    assert emitted.uses_f64 and "cl_khr_fp64" in emitted.source
    ctx = context()
    no_fp64 = type("NoFp64", (), {"fp64": False, "device": ctx.device})()
    with pytest.raises(KilnError, match="K402"):
        OpenCLKernel(emitted, no_fp64, kernel)
