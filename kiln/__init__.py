"""kiln: a compiler-first tensor framework.

>>> import kiln as kn
>>> x = kn.randn(2, 3, seed=0)
>>> kn.trace(lambda x: kn.gelu(x) * 2, x)
"""

from kiln._version import __version__  # noqa: F401

from kiln.errors import (  # noqa: F401
    KilnError, KilnShapeError, KilnDTypeError, KilnArgumentError, KilnIndexError, KilnFormatError,
    KilnFormatVersionError, KilnParseError, KilnVerifierError, KilnTraceError,
    KilnConcretizationError, KilnShapeSpecError, KilnUnknownOpError, KilnGradientError,
)
from kiln.ir.dtypes import (  # noqa: F401
    DType, bool_, uint8, uint32, int8, int16, int32, int64, float8_e4m3fn, float8_e5m2,
    bfloat16, float16, float32, float64, complex64, promote_types, finfo, iinfo,
)
from kiln.ir.dtypes import bool_ as bool  # noqa: F401,A001  (kn.bool, as torch.bool)
from kiln.ir.graph import Graph  # noqa: F401
from kiln.ir.shapes import ShapeVar  # noqa: F401
from kiln.frontend.tensor import Tensor  # noqa: F401
from kiln.frontend import methods as _methods  # noqa: F401  (binds Tensor operators)
from kiln.frontend.functional import *  # noqa: F401,F403
from kiln.frontend.functional import abs, pow, round  # noqa: F401,A004
from kiln.frontend.reductions import *  # noqa: F401,F403
from kiln.frontend.reductions import all, any, max, min, sum  # noqa: F401,A004
from kiln.frontend.shape_ops import *  # noqa: F401,F403
from kiln.frontend.capture import capture  # noqa: F401,E402
from kiln.frontend.indexing import getitem as _getitem  # noqa: F401
from kiln.frontend.factories import *  # noqa: F401,F403
from kiln.frontend.specs import STATIC, TensorSpec, dynamic_spec  # noqa: F401
from kiln.frontend.tracing import trace  # noqa: F401
from kiln.frontend.export import ExportedProgram, export, load  # noqa: F401
from kiln.frontend.compile import CompiledFunction, compile  # noqa: F401,A004
from kiln.frontend import linalg  # noqa: F401
from kiln.frontend import collectives  # noqa: F401  (also registers `kiln dump --stage scheduled`)
from kiln.frontend.control_flow import cond, nonzero, switch, while_loop  # noqa: F401
from kiln.frontend.autodiff import grad, stop_gradient, value_and_grad, vjp  # noqa: F401
from kiln.frontend.moe import grouped_matmul  # noqa: F401
from kiln.frontend.lowp import quantize_fp8, quantize_mxfp8, quantize_nvfp4, scaled_matmul  # noqa: F401
from kiln.io import load_state_dict, save_state_dict  # noqa: F401  (safetensors)
from kiln.interop import from_torch  # noqa: F401  (torch is imported only when called)
from kiln.runtime.profiler import profile  # noqa: F401
from kiln.runtime.threads import get_num_threads, set_num_threads  # noqa: F401
from kiln.frontend.selection import (  # noqa: F401
    clone, contiguous, einsum, masked_fill, multinomial, one_hot, topk, tril, triu,
)
from kiln.frontend.tape import (  # noqa: F401
    enable_grad, inference_mode, is_grad_enabled, no_grad, set_grad_enabled,
)
from kiln.frontend.tensor import Device as device  # noqa: F401  (kn.device("cpu"), as torch)
from kiln.frontend.complex_ops import (  # noqa: F401,A004  (also binds z.real, z.imag, z.conj())
    angle, complex, conj, imag, is_complex, polar, real, view_as_complex, view_as_real,
)
# torch's dtype aliases, so `dtype=torch.long` ports as `dtype=kn.long`
from kiln.ir.dtypes import (  # noqa: F401,E402
    complex64 as cfloat, float16 as half, float32 as float, float64 as double, int16 as short,
    int32 as int, int64 as long,
)
from kiln.frontend import fft  # noqa: F401,E402  (kn.fft.fft, rfft, ..., as torch.fft)
from kiln import nn, optim  # noqa: F401,E402
from kiln.nn.functional import scaled_dot_product_attention  # noqa: F401,E402  (dropout: nn.rng keys)
from kiln import memory  # noqa: F401,E402  (kn.memory.memory_allocated(device), ...)
