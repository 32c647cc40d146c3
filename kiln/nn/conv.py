"""Convolutions and pooling in 1, 2 and 3 dims, with torch.nn's names and arguments.

`conv1d/conv2d/conv3d` and `nn.Conv1d/2d/3d` are the N-d `convolution` primitive (its
vjp is the registry's) plus a bias; average pooling is a depthwise convolution with a
ones kernel; max pooling is the elementwise maximum of the kernel's strided slices of
the (-inf padded) input, so its gradient flows to the maxima through `max`'s vjp;
adaptive pooling reduces torch's bins dim by dim (they are products of intervals).

    >>> conv = nn.Conv1d(4, 8, kernel_size=3, padding=1)
    >>> y = F.max_pool2d(x, 2)
"""

from __future__ import annotations

import itertools
import math

from kiln.errors import KilnArgumentError, KilnShapeError
from kiln.nn import init
from kiln.nn.module import Module


def _tuple(value, n: int, name: str, op: str) -> tuple:
    out = (value,) * n if isinstance(value, int) else tuple(value)
    if len(out) != n or not all(isinstance(v, int) and v >= 0 for v in out):
        raise KilnArgumentError(f"{op}: {name} must be an int >= 0 or {n} of them, got {value!r}")
    return out


def _check_input(op: str, x, n: int):
    from kiln.frontend.functional import _floating

    x = _floating(x)
    if x.ndim != n + 2:
        raise KilnShapeError(f"{op}: expects a [N, C, {', '.join('DHW'[3 - n:])}] input "
                             f"(rank {n + 2}), got {x.dtype.short}{list(x.shape)}")
    return x


def _conv(op: str, n: int, x, weight, bias, stride, padding, dilation, groups):
    x = _check_input(op, x, n)
    if isinstance(padding, str):
        if padding == "valid":
            padding = 0
        elif padding == "same":
            k = tuple(weight.shape[2:])
            d = _tuple(dilation, n, "dilation", op)
            total = [di * (ki - 1) for di, ki in zip(d, k)]
            pads = tuple((t // 2, t - t // 2) for t in total)
            return _conv_padded(op, n, x, weight, bias, 1, pads, dilation, groups)
        else:
            raise KilnArgumentError(f"{op}: padding must be an int, a tuple, 'valid' or 'same'")
    p = _tuple(padding, n, "padding", op)
    return _conv_padded(op, n, x, weight, bias, stride, tuple((v, v) for v in p), dilation, groups)


def _conv_padded(op, n, x, weight, bias, stride, pads, dilation, groups):
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import add, to

    y = apply("convolution", x, to(weight, x.dtype), window_strides=_tuple(stride, n, "stride", op),
              padding=pads, rhs_dilation=_tuple(dilation, n, "dilation", op),
              feature_group_count=int(groups))
    if bias is not None:
        y = add(y, to(bias, x.dtype).reshape(-1, *([1] * n)))
    return y


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1):
    """torch.nn.functional.conv1d: input [N, C, L], weight [O, C/groups, K]."""
    return _conv("conv1d", 1, input, weight, bias, stride, padding, dilation, groups)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1):
    """torch.nn.functional.conv2d, also with padding='same'/'valid'."""
    return _conv("conv2d", 2, input, weight, bias, stride, padding, dilation, groups)


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1):
    """torch.nn.functional.conv3d: input [N, C, D, H, W], weight [O, C/groups, kD, kH, kW]."""
    return _conv("conv3d", 3, input, weight, bias, stride, padding, dilation, groups)


class _ConvNd(Module):
    dims = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 device=None, dtype=None, seed: int | None = None) -> None:
        super().__init__()
        from kiln.frontend.tensor import as_device
        from kiln.ir import dtypes as dt

        name = type(self).__name__
        as_device(device, name)
        if padding_mode != "zeros":
            raise KilnArgumentError(f"{name}: padding_mode {padding_mode!r} is not supported; "
                                    "pad with F.pad first")
        if groups <= 0 or in_channels % groups or out_channels % groups:
            raise KilnArgumentError(f"{name}: in_channels ({in_channels}) and out_channels "
                                    f"({out_channels}) must be divisible by groups ({groups})")
        n = self.dims
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size = _tuple(kernel_size, n, "kernel_size", name)
        self.stride, self.dilation = _tuple(stride, n, "stride", name), _tuple(dilation, n, "dilation", name)
        self.padding = padding if isinstance(padding, str) else _tuple(padding, n, "padding", name)
        self.groups = int(groups)
        shape = (out_channels, in_channels // groups) + self.kernel_size
        k_weight, k_bias = init.layer_keys(seed, 2)
        dtype = dt.float32 if dtype is None else dtype
        self.weight = init.kaiming_uniform(shape, key=k_weight, dtype=dtype)  # torch's default
        if bias:
            fan_in = shape[1] * math.prod(self.kernel_size)
            bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0
            self.bias = init.uniform((out_channels,), -bound, bound, key=k_bias, dtype=dtype)
        else:
            self.bias = None

    def forward(self, x):
        return _conv(type(self).__name__, self.dims, x, self.weight, self.bias, self.stride,
                     self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, groups={self.groups}, "
                f"bias={self.bias is not None}")


class Conv1d(_ConvNd):
    """torch.nn.Conv1d (weight [out, in/groups, k], kaiming-uniform init)."""

    dims = 1


class Conv2d(_ConvNd):
    """torch.nn.Conv2d."""

    dims = 2


class Conv3d(_ConvNd):
    """torch.nn.Conv3d."""

    dims = 3


# -- pooling --------------------------------------------------------------------------------


def _pool_args(op, n, kernel_size, stride, padding):
    k = _tuple(kernel_size, n, "kernel_size", op)
    s = k if stride is None or stride == () else _tuple(stride, n, "stride", op)
    p = _tuple(padding, n, "padding", op)
    if any(pi * 2 > ki for pi, ki in zip(p, k)):
        raise KilnArgumentError(f"{op}: padding {p} must be at most half the kernel {k}")
    return k, s, p


def _max_pool(op: str, n: int, x, kernel_size, stride, padding, dilation=1, ceil_mode=False,
              return_indices=False):
    from kiln.frontend.dispatch import apply
    from kiln.frontend.functional import maximum
    from kiln.frontend.shape_ops import pad as kpad

    if return_indices or ceil_mode:
        raise KilnArgumentError(f"{op}: return_indices and ceil_mode are not supported")
    x = _check_input(op, x, n)
    k, s, p = _pool_args(op, n, kernel_size, stride, padding)
    d = _tuple(dilation, n, "dilation", op)
    if any(p):
        flat = [v for pi in reversed(p) for v in (pi, pi)]
        x = kpad(x, flat, value=float("-inf"))
    sizes = x.shape[2:]
    out = [(sz - di * (ki - 1) - 1) // si + 1 for sz, ki, si, di in zip(sizes, k, s, d)]
    if any(o <= 0 for o in out):
        raise KilnShapeError(f"{op}: the kernel {k} does not fit the input {list(x.shape)}")
    result = None
    for offset in itertools.product(*(range(ki) for ki in k)):
        start = (0, 0) + tuple(o * di for o, di in zip(offset, d))
        limit = tuple(x.shape[:2]) + tuple(st + (o - 1) * si + 1
                                           for st, o, si in zip(start[2:], out, s))
        piece = apply("slice", x, start=start, limit=limit, stride=(1, 1) + s)
        result = piece if result is None else maximum(result, piece)
    return result


def _avg_pool(op: str, n: int, x, kernel_size, stride, padding, ceil_mode=False,
              count_include_pad=True, divisor_override=None):
    from kiln.frontend.factories import ones
    from kiln.frontend.functional import div

    if ceil_mode:
        raise KilnArgumentError(f"{op}: ceil_mode is not supported")
    x = _check_input(op, x, n)
    k, s, p = _pool_args(op, n, kernel_size, stride, padding)
    channels = x.shape[1]
    kernel = ones(channels, 1, *k, dtype=x.dtype)
    pads = tuple((v, v) for v in p)
    total = _conv_padded(op, n, x, kernel, None, s, pads, 1, channels)
    if divisor_override:
        return div(total, float(divisor_override))
    if count_include_pad or not any(p):
        return div(total, float(math.prod(k)))
    counts = _conv_padded(op, n, ones(1, 1, *x.shape[2:], dtype=x.dtype), ones(1, 1, *k, dtype=x.dtype),
                          None, s, pads, 1, 1)
    return div(total, counts)


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    return _max_pool("max_pool1d", 1, input, kernel_size, stride, padding, dilation, ceil_mode,
                     return_indices)


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    return _max_pool("max_pool2d", 2, input, kernel_size, stride, padding, dilation, ceil_mode,
                     return_indices)


def max_pool3d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    return _max_pool("max_pool3d", 3, input, kernel_size, stride, padding, dilation, ceil_mode,
                     return_indices)


def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True):
    return _avg_pool("avg_pool1d", 1, input, kernel_size, stride, padding, ceil_mode,
                     count_include_pad)


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, divisor_override=None):
    return _avg_pool("avg_pool2d", 2, input, kernel_size, stride, padding, ceil_mode,
                     count_include_pad, divisor_override)


def avg_pool3d(input, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, divisor_override=None):
    return _avg_pool("avg_pool3d", 3, input, kernel_size, stride, padding, ceil_mode,
                     count_include_pad, divisor_override)


def _adaptive(op: str, n: int, x, output_size, reduce: str):
    from kiln.frontend.reductions import amax, mean
    from kiln.frontend.shape_ops import cat, narrow

    x = _check_input(op, x, n)
    sizes = (output_size,) * n if isinstance(output_size, int) or output_size is None \
        else tuple(output_size)
    if len(sizes) != n:
        raise KilnArgumentError(f"{op}: output_size must be an int or {n} of them")
    outs = [x.shape[axis] if out is None else int(out) for axis, out in zip(range(2, 2 + n), sizes)]
    if all(isinstance(d, int) and isinstance(o, int) and o > 0 and d % o == 0
           for d, o in zip(x.shape[2:], outs)):
        # equal bins on every axis: one reshape and ONE reduction over every bin's extent
        # (a global pool is a row reduction of H*W, not a reduction over H then over W)
        shape, dims = list(x.shape[:2]), []
        for size, out in zip(x.shape[2:], outs):
            shape += [size] if out == 1 else [out, size // out]
            dims.append(len(shape) - 1)
        r = x.reshape(*shape)
        r = mean(r, dim=tuple(dims), keepdim=True) if reduce == "avg" else amax(r, dim=tuple(dims), keepdim=True)
        return r.reshape(*x.shape[:2], *outs)
    for axis, out in zip(range(2, 2 + n), sizes):
        size = x.shape[axis]
        out = size if out is None else int(out)
        if not isinstance(size, int) or out <= 0:
            raise KilnShapeError(f"{op}: needs static input sizes and output sizes > 0")
        if size % out == 0:  # equal bins: one reshape and reduction
            shape = list(x.shape)
            shape[axis:axis + 1] = [out, size // out]
            r = x.reshape(*shape)
            x = mean(r, dim=axis + 1) if reduce == "avg" else amax(r, dim=axis + 1)
            continue
        pieces = []
        for i in range(out):  # torch's bins: [floor(i*D/O), ceil((i+1)*D/O))
            lo, hi = (i * size) // out, -((-(i + 1) * size) // out)
            piece = narrow(x, axis, lo, hi - lo)
            pieces.append(mean(piece, dim=axis, keepdim=True) if reduce == "avg"
                          else amax(piece, dim=axis, keepdim=True))
        x = cat(pieces, dim=axis)
    return x


def adaptive_avg_pool1d(input, output_size):
    return _adaptive("adaptive_avg_pool1d", 1, input, output_size, "avg")


def adaptive_avg_pool2d(input, output_size):
    return _adaptive("adaptive_avg_pool2d", 2, input, output_size, "avg")


def adaptive_avg_pool3d(input, output_size):
    return _adaptive("adaptive_avg_pool3d", 3, input, output_size, "avg")


def adaptive_max_pool1d(input, output_size, return_indices=False):
    return _adaptive("adaptive_max_pool1d", 1, input, output_size, "max")


def adaptive_max_pool2d(input, output_size, return_indices=False):
    return _adaptive("adaptive_max_pool2d", 2, input, output_size, "max")


def adaptive_max_pool3d(input, output_size, return_indices=False):
    return _adaptive("adaptive_max_pool3d", 3, input, output_size, "max")


class _Pool(Module):
    """A pooling layer: its function with the constructor's arguments."""

    fn = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()
        import inspect

        names = [p for p in inspect.signature(type(self).fn).parameters][1:]
        if len(args) > len(names):
            raise KilnArgumentError(f"{type(self).__name__}: too many arguments")
        self.options = dict(zip(names, args), **kwargs)
        unknown = set(self.options) - set(names)
        if unknown:
            raise KilnArgumentError(f"{type(self).__name__}: unknown argument(s) {sorted(unknown)}")

    def forward(self, x):
        return type(self).fn(x, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.items())


def _pool_class(name: str, fn) -> type:
    return type(name, (_Pool,), {"fn": staticmethod(fn), "__doc__": f"torch.nn.{name}."})


MaxPool1d, MaxPool2d, MaxPool3d = (_pool_class(f"MaxPool{i}d", f)
                                   for i, f in ((1, max_pool1d), (2, max_pool2d), (3, max_pool3d)))
AvgPool1d, AvgPool2d, AvgPool3d = (_pool_class(f"AvgPool{i}d", f)
                                   for i, f in ((1, avg_pool1d), (2, avg_pool2d), (3, avg_pool3d)))
AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = (
    _pool_class(f"AdaptiveAvgPool{i}d", f) for i, f in
    ((1, adaptive_avg_pool1d), (2, adaptive_avg_pool2d), (3, adaptive_avg_pool3d)))
AdaptiveMaxPool1d, AdaptiveMaxPool2d, AdaptiveMaxPool3d = (
    _pool_class(f"AdaptiveMaxPool{i}d", f) for i, f in
    ((1, adaptive_max_pool1d), (2, adaptive_max_pool2d), (3, adaptive_max_pool3d)))
