"""Every op kiln knows, one family per module; importing this package registers them."""

from kiln.ir.ops import autodiff, collective, control, creation, elementwise, fusion, linalg, lapack, moe, nn, layers, sampling, reduction, shape  # noqa: F401
from kiln.ir.ops import indices  # noqa: F401  (check_index; INDEX_OPERANDS)
from kiln.ir.ops import lowp  # noqa: F401  (quantizers and scaled_matmul)
from kiln.ir.ops import fft  # noqa: F401  (pocketfft extern calls)
from kiln.ir.ops import complex_view  # noqa: F401  (view_as_real / view_as_complex: zero-copy)
