"""Batch, group and instance normalization with torch.nn's names, arguments and running
statistics.

In training mode BatchNorm normalizes with the batch's statistics and updates its
`running_mean`/`running_var` buffers in place (the unbiased variance, torch's rule;
`momentum=None` is the cumulative average over `num_batches_tracked`); in eval mode it
normalizes with the running statistics. The buffers are updated by rebinding their
handles, so `kn.compile(model)` writes the new statistics back after each call, as an
eager call does.

    >>> bn = nn.BatchNorm2d(16)
    >>> y = bn(x)                         # training: batch statistics, buffers updated
    >>> bn.eval(); y = bn(x)              # running statistics
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError, KilnShapeError
from kiln.ir import dtypes as dt
from kiln.nn.module import Module


def _stats_axes(x) -> tuple:
    return (0,) + tuple(range(2, x.ndim))


def _channel_shape(x) -> tuple:
    return (1, -1) + (1,) * (x.ndim - 2)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training: bool = False,
               momentum: float | None = 0.1, eps: float = 1e-5, num_batches_tracked=None):
    """torch.nn.functional.batch_norm over dims (0, 2, ...) per channel (dim 1)."""
    from kiln.frontend.functional import _floating, rsqrt, to
    from kiln.frontend.reductions import mean, var
    from kiln.frontend.tape import no_grad

    x = _floating(input)
    if x.ndim < 2:
        raise KilnShapeError(f"batch_norm: expects [N, C, ...], got {x.dtype.short}{list(x.shape)}")
    axes = _stats_axes(x)
    if training:
        mu = mean(x, dim=axes)
        sigma2 = var(x, dim=axes, correction=0)
        if running_mean is not None or running_var is not None:
            count = 1
            for a in axes:
                count = count * x.shape[a]
            if isinstance(count, int) and count <= 1:
                raise KilnArgumentError(f"batch_norm: training needs more than one value per "
                                        f"channel, got input {list(x.shape)}")
            if momentum is None:  # cumulative moving average (a tensor: it also traces)
                from kiln.frontend.functional import maximum

                n = to(num_batches_tracked, x.dtype) if num_batches_tracked is not None else 1.0
                factor = 1.0 / maximum(n, 1.0)
            else:
                factor = float(momentum)
            with no_grad():
                unbiased = sigma2.detach() * (count / (count - 1))
                if running_mean is not None:
                    running_mean.mul_(1.0 - factor).add_(to(mu.detach() * factor, running_mean.dtype))
                if running_var is not None:
                    running_var.mul_(1.0 - factor).add_(to(unbiased * factor, running_var.dtype))
    else:
        if running_mean is None or running_var is None:
            raise KilnArgumentError("batch_norm: eval mode needs running_mean and running_var")
        mu, sigma2 = to(running_mean, x.dtype), to(running_var, x.dtype)
    shape = _channel_shape(x)
    y = (x - mu.reshape(*shape)) * rsqrt(sigma2.reshape(*shape) + eps)
    if weight is not None:
        y = y * to(weight, x.dtype).reshape(*shape)
    if bias is not None:
        y = y + to(bias, x.dtype).reshape(*shape)
    return y


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats: bool = True, momentum: float = 0.1, eps: float = 1e-5):
    """torch.nn.functional.instance_norm: each (sample, channel) over its spatial dims."""
    from kiln.frontend.functional import _floating

    x = _floating(input)
    if x.ndim < 3:
        raise KilnShapeError(f"instance_norm: expects [N, C, *spatial], got {list(x.shape)}")
    n, c = x.shape[0], x.shape[1]
    folded = x.reshape(1, n * c, *x.shape[2:])  # one "batch" whose channels are (n, c)

    def tiled(t):
        return None if t is None else t.reshape(1, c).expand(n, c).reshape(n * c)

    rm, rv = tiled(running_mean), tiled(running_var)
    y = batch_norm(folded, rm, rv, None, None, use_input_stats, momentum, eps)
    if use_input_stats and running_mean is not None:  # average the per-sample statistics
        from kiln.frontend.tape import no_grad

        with no_grad():
            running_mean.copy_(rm.reshape(n, c).mean(dim=0))
            running_var.copy_(rv.reshape(n, c).mean(dim=0))
    y = y.reshape(*x.shape)
    shape = _channel_shape(x)
    if weight is not None:
        y = y * weight.reshape(*shape)
    if bias is not None:
        y = y + bias.reshape(*shape)
    return y


def group_norm(input, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
    """torch.nn.functional.group_norm: channels split into `num_groups`, each normalized
    over its channels and spatial dims."""
    from kiln.frontend.functional import _floating, rsqrt
    from kiln.frontend.reductions import mean, var

    x = _floating(input)
    c = x.shape[1] if x.ndim >= 2 else None
    if x.ndim < 2 or not isinstance(c, int) or num_groups <= 0 or c % num_groups:
        raise KilnShapeError(f"group_norm: {num_groups} groups must divide the channels of "
                             f"{x.dtype.short}{list(x.shape)}")
    g = x.reshape(x.shape[0], num_groups, -1)
    mu = mean(g, dim=-1, keepdim=True)
    sigma2 = var(g, dim=-1, keepdim=True, correction=0)
    y = ((g - mu) * rsqrt(sigma2 + eps)).reshape(*x.shape)
    shape = _channel_shape(x)
    if weight is not None:
        y = y * weight.reshape(*shape)
    if bias is not None:
        y = y + bias.reshape(*shape)
    return y


class _NormBase(Module):
    dims: tuple = ()
    instance = False

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        from kiln.frontend.factories import ones, zeros
        from kiln.frontend.tensor import as_device

        as_device(device, type(self).__name__)
        dtype = dt.float32 if dtype is None else dtype
        self.num_features, self.eps, self.momentum = int(num_features), float(eps), momentum
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        self.weight = ones(num_features, dtype=dtype) if affine else None
        self.bias = zeros(num_features, dtype=dtype) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", zeros(num_features, dtype=dtype))
            self.register_buffer("running_var", ones(num_features, dtype=dtype))
            self.register_buffer("num_batches_tracked", zeros((), dtype=dt.int64))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def _check(self, x):
        if x.ndim not in self.dims:
            raise KilnShapeError(f"{type(self).__name__}: expects an input of rank "
                                 f"{' or '.join(map(str, self.dims))}, got {list(x.shape)}")
        channel = x.shape[0 if self.instance and x.ndim == self.dims[0] else 1]
        if channel != self.num_features and not (self.instance and not self.affine):
            raise KilnShapeError(f"{type(self).__name__}: expects {self.num_features} channels, "
                                 f"got input {list(x.shape)}")

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")


class _BatchNorm(_NormBase):
    def forward(self, x):
        self._check(x)
        use_batch = self.training or not self.track_running_stats
        if self.training and self.track_running_stats:
            with _no_grad():
                self.num_batches_tracked.add_(1)
        return batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                          use_batch, self.momentum, self.eps, self.num_batches_tracked)


def _no_grad():
    from kiln.frontend.tape import no_grad

    return no_grad()


class BatchNorm1d(_BatchNorm):
    """torch.nn.BatchNorm1d: [N, C] or [N, C, L]."""

    dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """torch.nn.BatchNorm2d: [N, C, H, W]."""

    dims = (4,)


class BatchNorm3d(_BatchNorm):
    """torch.nn.BatchNorm3d: [N, C, D, H, W]."""

    dims = (5,)


class _InstanceNorm(_NormBase):
    instance = True

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = False, track_running_stats: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def forward(self, x):
        self._check(x)
        unbatched = x.ndim == self.dims[0]
        if unbatched:
            x = x.unsqueeze(0)
        use_input = self.training or not self.track_running_stats
        y = instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                          use_input, self.momentum, self.eps)
        return y.squeeze(0) if unbatched else y


class InstanceNorm1d(_InstanceNorm):
    """torch.nn.InstanceNorm1d: [N, C, L] or unbatched [C, L]."""

    dims = (2, 3)


class InstanceNorm2d(_InstanceNorm):
    """torch.nn.InstanceNorm2d: [N, C, H, W] or unbatched [C, H, W]."""

    dims = (3, 4)


class InstanceNorm3d(_InstanceNorm):
    """torch.nn.InstanceNorm3d."""

    dims = (4, 5)


class GroupNorm(Module):
    """torch.nn.GroupNorm(num_groups, num_channels, eps, affine)."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        from kiln.frontend.factories import ones, zeros

        if num_groups <= 0 or num_channels % num_groups:
            raise KilnArgumentError(f"GroupNorm: num_channels ({num_channels}) must be divisible "
                                    f"by num_groups ({num_groups})")
        dtype = dt.float32 if dtype is None else dtype
        self.num_groups, self.num_channels, self.eps = int(num_groups), int(num_channels), float(eps)
        self.affine = bool(affine)
        self.weight = ones(num_channels, dtype=dtype) if affine else None
        self.bias = zeros(num_channels, dtype=dtype) if affine else None

    def forward(self, x):
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
