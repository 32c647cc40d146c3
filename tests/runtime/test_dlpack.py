"""DLPack in and out without copying: the same memory address with numpy and torch (CPU)
both ways, writes through the other library's view seen by kiln, bfloat16 through kiln's
own structs, refusals as K382."""

import gc

import numpy as np
import pytest

import kiln as kn
from kiln.runtime.dlpack import KilnDLPackError

torch = pytest.importorskip("torch")


def test_numpy_in_and_out_share_the_address():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = kn.from_dlpack(a)
    assert t.numpy().ctypes.data == a.ctypes.data and t.shape == (3, 4)
    a[1, 2] = -5.0  # a write through numpy is seen by the kiln tensor
    assert t.numpy()[1, 2] == -5.0
    back = np.from_dlpack(t)
    assert back.ctypes.data == a.ctypes.data
    assert t.__dlpack_device__() == (1, 0)


def test_torch_in_and_out_share_the_address():
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    k = kn.from_dlpack(src)
    assert k.numpy().ctypes.data == src.data_ptr() and k.dtype == kn.float32
    src[0, 0] = 42.0
    assert k.numpy()[0, 0] == 42.0
    mine = kn.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = torch.from_dlpack(mine)
    assert out.data_ptr() == mine.numpy().ctypes.data
    out.mul_(10)  # torch writes into the kiln tensor's memory: kiln reads the new values
    np.testing.assert_array_equal(mine.numpy(), [[10.0, 20.0], [30.0, 40.0]])
    np.testing.assert_array_equal((mine + 1).numpy(), [[11.0, 21.0], [31.0, 41.0]])


def test_strided_torch_views_keep_their_strides():
    src = torch.arange(12, dtype=torch.int64).reshape(3, 4).T
    k = kn.from_dlpack(src)
    np.testing.assert_array_equal(k.numpy(), src.numpy())
    assert k.numpy().ctypes.data == src.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_low_precision_floats_cross_both_ways(dtype):
    src = torch.linspace(-2, 2, 8).to(dtype).reshape(2, 4)
    k = kn.from_dlpack(src)  # numpy's DLPack refuses these dtypes; kiln reads the struct
    assert k.numpy().ctypes.data == src.data_ptr()
    np.testing.assert_array_equal(k.to(kn.float32).numpy(), src.float().numpy())
    out = torch.from_dlpack(k)
    assert out.dtype == dtype and out.data_ptr() == src.data_ptr()
    del k, out
    gc.collect()
    assert src.float().abs().max().item() == 2.0  # the producer's memory is intact


def test_a_capsule_nobody_consumes_is_released():
    from kiln.runtime import dlpack

    t = kn.tensor([1.0, 2.0]).to(kn.bfloat16)
    before = len(dlpack._exported)
    capsule = t.__dlpack__()
    assert len(dlpack._exported) == before + 1
    del capsule
    assert len(dlpack._exported) == before


def test_refusals_are_K382():
    with pytest.raises(KilnDLPackError, match="K382.*not a DLPack producer"):
        kn.from_dlpack([1, 2, 3])

    class OnGpu:
        def __dlpack__(self, **_):
            raise AssertionError("never asked")

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

    with pytest.raises(KilnDLPackError, match="K382.*cuda:0 memory.*no cuda:0 device here"):
        kn.from_dlpack(OnGpu())  # this machine has no GPU

    class OnVulkan(OnGpu):
        def __dlpack_device__(self):
            return (7, 0)  # kDLVulkan: no kiln device kind

    with pytest.raises(KilnDLPackError, match="K382.*vulkan:0 memory.*no device"):
        kn.from_dlpack(OnVulkan())
    with pytest.raises(KilnDLPackError, match="K382.*device='cuda:0'.*is on cpu"):
        kn.from_dlpack(np.ones(2), device="cuda:0")
    with pytest.raises(KilnDLPackError, match="K382.*a copy to cuda:0 was asked"):
        kn.ones(2).__dlpack__(dl_device=(2, 0))
    with pytest.raises(kn.KilnError, match="K382.*require"):
        kn.from_dlpack(torch.ones(2, requires_grad=True))


def test_jax_arrays_come_in_without_copying():
    jnp = pytest.importorskip("jax.numpy", reason="needs jax (the peer extra)")
    a = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    t = kn.from_dlpack(a)
    np.testing.assert_array_equal(t.numpy(), np.asarray(a))
    assert t.numpy().ctypes.data == a.unsafe_buffer_pointer()


def test_cupy_device_arrays_come_in_on_their_gpu():
    cp = pytest.importorskip("cupy", reason="needs cupy and an NVIDIA GPU")
    k = kn.from_dlpack(cp.arange(3, dtype=cp.float32))  # device memory: one device copy
    assert k.device == "cuda:0" and k.numpy().tolist() == [0.0, 1.0, 2.0]
