"""`kn.tensor` copies into the CPU caching allocator's blocks (placement.host_copy):
aligned like torch's tensors, counted by kn.memory, returned to the cache when the tensor
dies, still a copy (the source can change); small, non-C-ordered and object arrays keep
numpy's plain copy."""

import numpy as np

import kiln as kn
from kiln.runtime.placement import ALIGNED_MIN_BYTES


def _misaligned(shape, dtype=np.float32):
    """A C-ordered array starting 16 bytes past a 64-byte boundary, as numpy's large ones do."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.empty(n + 128, np.uint8)
    skip = (16 - buf.ctypes.data) % 64
    a = buf[skip:skip + n].view(dtype).reshape(shape)
    a[...] = np.arange(a.size, dtype=dtype).reshape(shape)
    assert a.ctypes.data % 64 == 16
    return a


def test_large_tensors_are_aligned_counted_copies():
    src = _misaligned((64, 256))
    before = kn.memory.memory_allocated("cpu")
    t = kn.tensor(src)
    got = t.numpy()
    assert got.ctypes.data % 64 == 0 and got.dtype == np.float32 and got.shape == (64, 256)
    np.testing.assert_array_equal(got, src)
    assert kn.memory.memory_allocated("cpu") - before == src.nbytes  # 64 KiB: a whole number of blocks
    src[0, 0] = -1.0  # a copy: the tensor keeps its value
    assert float(t.numpy()[0, 0]) == 0.0
    w = kn.tensor(_misaligned((1000, 3)))  # not a multiple of 512 bytes: the block's rounded size
    assert kn.memory.memory_allocated("cpu") - before == src.nbytes + 12288
    del t, got, w
    assert kn.memory.memory_allocated("cpu") == before
    out = (kn.tensor(src) * 2).numpy()  # eager ops and compiled programs take it as any array
    np.testing.assert_array_equal(out, src * 2)
    f = kn.compile(lambda x: x @ x.T)
    np.testing.assert_allclose(f(kn.tensor(src)).numpy(), src.astype(np.float64) @ src.T, rtol=1e-5)


def test_small_fortran_and_object_data_keep_plain_copies():
    small = np.arange(ALIGNED_MIN_BYTES // 8 - 1, dtype=np.float32)
    t = kn.tensor(small)
    assert t.numpy().base is None and np.array_equal(t.numpy(), small)
    f = np.asfortranarray(np.arange(40_000, dtype=np.float32).reshape(200, 200))
    tf = kn.tensor(f)
    assert tf.numpy().flags.f_contiguous and np.array_equal(tf.numpy(), f)
    assert kn.tensor([[1, 2], [3, 4]]).numpy().tolist() == [[1, 2], [3, 4]]
    conv = kn.tensor(_misaligned((64, 64)), dtype=kn.float16)  # a dtype conversion copies anyway
    assert conv.dtype == kn.float16 and float(conv.numpy()[1, 0]) == 64.0
