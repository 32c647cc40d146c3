"""Skip marker for the tests that run kernels on an OpenCL device."""

from __future__ import annotations

import pytest

from kiln.codegen.opencl.runtime import no_device_reason

_REASON = no_device_reason()
needs_device = pytest.mark.skipif(_REASON is not None, reason=f"needs an OpenCL device: {_REASON}")
