"""`kiln.nn`: modules (layers with their weights) in PyTorch's shape, trained the JAX way.

    >>> from kiln import nn
    >>> model = nn.Sequential(nn.Linear(4, 32, seed=0), nn.GELU(), nn.Linear(32, 1, seed=1))
    >>> params = dict(model.named_parameters())       # a pytree kn.grad differentiates
    >>> y = nn.functional_call(model, params, x)       # forward with those tensors

See docs/nn.md for the guide: modules, state dicts, Dropout keys, optimizers and a
compiled training step.
"""

from kiln.nn import functional, init, random, utils  # noqa: F401
from kiln.nn.attention import MultiheadAttention  # noqa: F401
from kiln.nn.layers import (  # noqa: F401
    GELU, Dropout, Embedding, Identity, LayerNorm, Linear, ReLU, RMSNorm, Sigmoid, SiLU, Softmax,
    Tanh,
)
from kiln.nn.module import IncompatibleKeys, Module, functional_call  # noqa: F401
from kiln.nn.containers import ModuleDict, ModuleList, Sequential  # noqa: F401
from kiln.nn.conv import (  # noqa: F401
    AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d, AdaptiveMaxPool1d, AdaptiveMaxPool2d,
    AdaptiveMaxPool3d, AvgPool1d, AvgPool2d, AvgPool3d, Conv1d, Conv2d, Conv3d, MaxPool1d,
    MaxPool2d, MaxPool3d,
)
from kiln.nn.norm import (  # noqa: F401
    BatchNorm1d, BatchNorm2d, BatchNorm3d, GroupNorm, InstanceNorm1d, InstanceNorm2d,
    InstanceNorm3d,
)
from kiln.nn.parameter import Parameter  # noqa: F401
from kiln.nn.resample import GLU, Upsample  # noqa: F401
from kiln.nn.transformer import (  # noqa: F401
    TransformerDecoder, TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer,
)
from kiln.nn.random import rng  # noqa: F401
from kiln.nn.compiled import CompiledModule  # noqa: F401
