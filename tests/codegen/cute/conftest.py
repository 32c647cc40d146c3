import importlib.util

import pytest

if importlib.util.find_spec("cutlass") is None:  # pragma: no cover - the dependency is declared
    pytest.skip("needs nvidia-cutlass-dsl (the CuTeDSL compiler)", allow_module_level=True)
