"""Devices without a GPU: a fake device kind registered here (its memory is host memory,
but it is a distinct device) exercises placement, mismatch errors, `.to` copies and the
per-device allocator statistics for real; CUDA/ROCm are checked to say what hardware
they need."""

import gc

import numpy as np
import pytest

import kiln as kn
from kiln.runtime.caching_allocator import RawMemory
from kiln.runtime.device import (
    KilnDeviceMismatchError, as_device, KilnDeviceRegistryError, KilnDeviceUnavailableError,
    register_device_kind, unregister_device_kind,
)


class FakeMemory(RawMemory):
    """Host memory, counted, so a test sees what the fake device was asked for."""
    taken = 0

    def alloc(self, nbytes):
        FakeMemory.taken += nbytes
        return super().alloc(nbytes)

    def free(self, handle):
        FakeMemory.taken -= handle.nbytes


@pytest.fixture
def fake():
    copies = []
    FakeMemory.taken = 0

    def copy(dst, src):
        copies.append(src.nbytes)
        np.copyto(dst, src)

    register_device_kind("fake", hardware="a fake accelerator", raw_memory=lambda i: FakeMemory(),
                         total_memory=lambda i: 64 << 20, available=lambda: True,
                         count=lambda: 2, copy=copy)
    try:
        yield copies
    finally:
        gc.collect()
        unregister_device_kind("fake")


def test_device_value_type():
    d = kn.device("cuda:1")
    assert d == "cuda:1" and d.type == "cuda" and d.index == 1 and str(d) == "cuda:1"
    assert kn.device("cuda", 1) == d and hash(d) == hash("cuda:1")
    assert repr(d) == "device(type='cuda', index=1)"
    assert kn.device("cpu").index is None and kn.device(kn.device("rocm")) == "rocm"
    torch = pytest.importorskip("torch")
    assert kn.device(torch.device("cuda", 2)) == "cuda:2"
    with pytest.raises(kn.KilnError, match="K105.*unknown device 'tpu'"):
        kn.device("tpu")
    with pytest.raises(kn.KilnError, match="K105.*malformed"):
        kn.device("cuda:x")


@pytest.mark.parametrize("where, needs", [("cuda:0", "NVIDIA GPU"), ("rocm", "AMD GPU"),
                                          ("metal", "Apple GPU"), ("xpu:0", "Intel GPU")])
def test_missing_hardware_is_K381_naming_it(where, needs):
    with pytest.raises(KilnDeviceUnavailableError, match=f"K381.*'{where}'.*{needs}"):
        kn.ones(2, device=where)


def test_placement_rules_on_a_fake_device(fake):
    x = kn.tensor([1.0, 2.0, 3.0], device="fake")
    assert x.device == "fake:0" and x.device.type == "fake"  # index 0 when none is given
    y = (x * 2 + 1).exp().sum()
    assert y.device == "fake:0"
    np.testing.assert_allclose(y.item(), np.exp([3.0, 5.0, 7.0]).sum(), rtol=1e-6)
    w = kn.ones(3, 2, device="fake:0")
    assert (x @ w).device == "fake:0"
    assert kn.softmax(x, dim=0).device == "fake:0" and x[1:].device == "fake:0"
    assert kn.zeros_like(x).device == "fake:0" and kn.randn(2, device="fake:1").device == "fake:1"
    assert kn.arange(3, device="fake").device == "fake:0"
    assert (x + kn.tensor(2.0)).device == "fake:0"  # a 0-d CPU tensor mixes, as in PyTorch
    assert (x + 2.0).device == "fake:0"


def test_mixed_devices_are_K380_naming_both(fake):
    x = kn.ones(3, device="fake")
    with pytest.raises(KilnDeviceMismatchError, match=r"K380\] add: .*cpu and fake:0"):
        kn.ones(3) + x
    with pytest.raises(KilnDeviceMismatchError, match=r"K380\] matmul: .*fake:0 and fake:1"):
        kn.matmul(x.reshape(1, 3), kn.ones(3, 1, device="fake:1"))
    with pytest.raises(KilnDeviceUnavailableError, match="K381.*has 2 fake device"):
        x.to("fake:2")


def test_to_round_trips_copy_through_the_device(fake):
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = kn.tensor(data)
    on = x.to("fake")
    assert on.device == "fake:0" and fake == [48]  # the kind's copy function moved 48 bytes
    assert not np.shares_memory(on.numpy(), x.numpy())
    back = on.to("cpu", kn.float64)
    assert back.device == "cpu" and back.dtype == kn.float64
    np.testing.assert_array_equal(back.numpy(), data)
    assert on.cpu().device == "cpu" and x.cpu() is x and on.to("fake:0") is on
    other = on.to(kn.device("fake", 1))
    assert other.device == "fake:1"
    like = x.to(other)  # torch's .to(tensor): its dtype and its device
    assert like.device == "fake:1" and other.to(x).device == "cpu"
    np.testing.assert_array_equal(other.numpy(), data)


def test_allocator_statistics_follow_tensors_on_the_fake_device(fake):
    mem = kn.memory
    base = mem.memory_allocated("fake")
    x = kn.tensor(np.ones(1000, np.float32)).to("fake")  # a 4000 B copy: a 4096 B block
    assert mem.memory_allocated("fake") - base == 4096
    assert mem.memory_reserved("fake") == 2 << 20 == FakeMemory.taken  # one small segment
    y = x * 3  # an eager result (numpy's memory), counted at its exact size
    assert mem.memory_allocated("fake") - base == 4096 + 4000
    del x
    assert mem.memory_allocated("fake") - base == 4000
    assert mem.max_memory_allocated("fake") - base == 8096
    stats = mem.memory_stats("fake")
    assert stats["allocated_bytes.all.current"] == mem.memory_allocated("fake")
    assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] == 0
    del y
    assert mem.empty_cache("fake") == 2 << 20 and FakeMemory.taken == 0
    assert mem.memory_reserved("fake") == 0
    mem.reset_peak_memory_stats("fake")
    assert mem.max_memory_allocated("fake") == mem.memory_allocated("fake")


def test_fraction_limit_on_the_fake_device_is_K170_with_figures(fake):
    kn.memory.set_per_process_memory_fraction(0.5, "fake")  # 32 MiB of 64
    keep = kn.zeros(4 << 20, dtype=kn.uint8).to("fake")  # a 20 MiB large segment
    with pytest.raises(kn.KilnError) as info:
        kn.zeros(17 << 20, dtype=kn.uint8).to("fake")  # 20 + 18 MiB segments > 32 MiB
    message = str(info.value)
    assert message.startswith("[K170] fake:0: copying a uint8[17825792] tensor needs 17.0 MiB")
    assert "4.0 MiB (4194304 bytes) in use" in message
    assert "16.0 MiB (16777216 bytes) cached" in message
    assert "32.0 MiB (33554432 bytes) allowed (0.5 of fake:0's 64.0 MiB" in message
    assert kn.memory.memory_stats("fake")["num_ooms"] == 1
    assert kn.memory.get_per_process_memory_fraction("fake") == 0.5
    del keep


def test_registry_refuses_a_second_registration(fake):
    with pytest.raises(KilnDeviceRegistryError, match="K383.*already registered"):
        register_device_kind("fake", hardware="x", raw_memory=RawMemory, total_memory=len,
                             available=lambda: True)
    with pytest.raises(KilnDeviceRegistryError, match="K383.*must be callable"):
        register_device_kind("other", hardware="x", raw_memory=None, total_memory=len,
                             available=lambda: True)


def test_cpu_eager_tensors_count_and_free():
    mem = kn.memory
    base = mem.memory_allocated()
    x = kn.ones(256, 256)  # 256 KiB
    assert mem.memory_allocated("cpu") - base == 256 * 1024
    y = x.reshape(-1)  # a view: no new memory
    assert mem.memory_allocated() - base == 256 * 1024
    del x, y
    assert mem.memory_allocated() == base
    assert mem.memory_stats("cpu")["allocated_bytes.all.current"] == base


def test_compiled_buffers_come_from_the_cpu_allocator():
    f = kn.compile(lambda x: (x * 2).exp() + 1)
    x = kn.randn(64, 64, seed=0)  # 16 KiB: a small output, np.empty counted by the allocator
    f(x)  # compile; the first call's buffers settle in the cache
    gc.collect()
    base = kn.memory.memory_allocated()
    out = f(x)
    assert kn.memory.memory_allocated() - base == 16384  # the output's bytes, while it lives
    np.testing.assert_allclose(out.numpy(), np.exp(x.numpy() * 2) + 1, rtol=1e-5)
    del out
    assert kn.memory.memory_allocated() == base
    # past 1 MiB an output is a block of the caching allocator: a dropped one is the next
    # call's (a small one's address is glibc's to choose, so it is not asserted)
    big = kn.randn(1024, 512, seed=1)  # 2 MiB
    f(big)
    gc.collect()
    base = kn.memory.memory_allocated()
    out = f(big)
    assert kn.memory.memory_allocated() - base == 2 << 20
    address = out.numpy().ctypes.data
    np.testing.assert_allclose(out.numpy(), np.exp(big.numpy() * 2) + 1, rtol=1e-5)
    del out
    assert kn.memory.memory_allocated() == base
    reserved = kn.memory.memory_reserved()
    again = f(big)  # the dropped output's block is reused
    assert again.numpy().ctypes.data == address and kn.memory.memory_reserved() == reserved


def test_runtime_memory_fraction_sets_the_cpu_allocator_limit():
    kn.runtime.set_memory_fraction(0.5)
    try:
        assert kn.memory.get_per_process_memory_fraction("cpu") == 0.5
        assert kn.memory.memory_stats()["limit_bytes"] == kn.runtime.memory_stats()["limit_bytes"]
    finally:
        kn.memory.set_per_process_memory_fraction(1.0)
    assert kn.runtime.memory_stats()["limit_bytes"] == kn.memory.memory_stats()["total_bytes"]


def test_a_model_trains_on_the_fake_device(fake):
    torch = pytest.importorskip("torch")
    kn.manual_seed(0)
    model = kn.nn.Linear(4, 3).to("fake")
    assert {p.device for p in model.parameters()} == {"fake:0"}
    assert all(p.requires_grad for p in model.parameters())
    w0 = model.weight.numpy().copy()
    b0 = model.bias.numpy().copy()
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    loss = (model(kn.tensor(x, device="fake")) ** 2).mean()
    assert loss.device == "fake:0"
    loss.backward()
    assert model.weight.grad.device == "fake:0" and model.bias.grad.device == "fake:0"
    kn.optim.SGD(model.parameters(), lr=0.1).step()
    assert model.weight.device == "fake:0"
    # the oracle: the same step in torch
    tw = torch.tensor(w0, requires_grad=True)
    tb = torch.tensor(b0, requires_grad=True)
    ((torch.tensor(x) @ tw.T + tb) ** 2).mean().backward()
    np.testing.assert_allclose(model.weight.numpy(), (tw - 0.1 * tw.grad).detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    back = model.cpu()
    assert back is model and model.bias.device == "cpu"


def _present(kind: str) -> bool:
    try:
        as_device(kind)
    except kn.KilnError:
        return False
    return True


@pytest.mark.skipif(not _present("cuda"), reason="needs an NVIDIA GPU (and its driver)")
def test_cuda_managed_tensors_round_trip_and_count():
    from cuda.bindings import driver

    x = kn.tensor(np.arange(1 << 20, dtype=np.float32), device="cuda")
    assert x.device == "cuda:0" and x.is_cuda
    assert kn.memory.memory_allocated("cuda") >= 4 << 20
    free_before = driver.cuMemGetInfo()[1]
    y = (x * 2).cpu()
    np.testing.assert_array_equal(y.numpy(), np.arange(1 << 20, dtype=np.float32) * 2)
    del x
    released = kn.memory.empty_cache("cuda")
    assert released > 0 and driver.cuMemGetInfo()[1] >= free_before


@pytest.mark.skipif(not _present("rocm"), reason="needs an AMD GPU (and the HIP runtime)")
def test_rocm_managed_tensors_round_trip():
    x = kn.tensor([1.0, 2.0, 3.0], device="rocm")
    assert x.device == "rocm:0"
    np.testing.assert_array_equal((x + 1).cpu().numpy(), [2.0, 3.0, 4.0])
