"""Every op kiln knows, one family per module; importing this package registers them."""

from kiln.ir.ops import control, creation, elementwise, reduction, shape  # noqa: F401
