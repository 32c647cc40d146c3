"""kiln's error hierarchy.

Every error a user can provoke is a `KilnError` subclass with a stable code
(`K101`, ...). A message says what went wrong in the user's terms (the op, the
operand types, the rule broken) and, where there is one, the fix. `docs/errors.md`
lists every code; a test checks that each code here is documented there.
"""

from __future__ import annotations

import linecache
import os
import sys
import types

_REGISTRY: dict[str, type["KilnError"]] = {}


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""

    code = "K100"
    title = "kiln error"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            if cls.code in _REGISTRY and _REGISTRY[cls.code] is not cls:
                raise RuntimeError(f"error code {cls.code} used twice")
            _REGISTRY[cls.code] = cls

    def __init__(self, message: str, *, hint: str | None = None, where: str | None = None):
        self.message = message
        self.hint = hint
        self.where = where
        text = f"[{self.code}] {message}"
        if where:
            text += f"\n  at {where}"
        if hint:
            text += f"\n  hint: {hint}"
        super().__init__(text)


_REGISTRY[KilnError.code] = KilnError


class KilnShapeError(KilnError, ValueError):
    code = "K101"
    title = "incompatible shapes"


class KilnDTypeError(KilnError, TypeError):
    code = "K102"
    title = "unsupported or mismatched dtype"


class KilnArgumentError(KilnError, ValueError):
    code = "K103"
    title = "invalid argument or attribute"


class KilnIndexError(KilnError, IndexError):
    code = "K104"
    title = "index out of range"


class KilnDeviceError(KilnError, ValueError):
    code = "K105"
    title = "device mismatch or unknown device"


class KilnUnknownOpError(KilnError, KeyError):
    code = "K106"
    title = "unknown op"

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class KilnVerifierError(KilnError):
    code = "K110"
    title = "malformed graph"


class KilnParseError(KilnError, ValueError):
    code = "K120"
    title = "cannot parse kiln IR text"


class KilnFormatError(KilnError, ValueError):
    code = "K130"
    title = "malformed or unreadable .kir file"


class KilnFormatVersionError(KilnFormatError):
    code = "K131"
    title = ".kir file written by a newer kiln"


class KilnTraceError(KilnError):
    code = "K140"
    title = "cannot trace this function"


class KilnConcretizationError(KilnTraceError, TypeError):
    code = "K141"
    title = "a traced tensor's value was needed in Python"


class KilnShapeSpecError(KilnError, ValueError):
    code = "K150"
    title = "input violates the declared dynamic shape spec"


class KilnGradientError(KilnError, ValueError):
    code = "K190"
    title = "cannot differentiate this function"


# -- low precision: quantization and scaled GEMMs (K420-K429) ------------------------------


class KilnQuantizeError(KilnError, ValueError):
    code = "K420"
    title = "cannot quantize this tensor in this format"


class KilnScaledMatmulError(KilnError, ValueError):
    code = "K421"
    title = "scaled_matmul operands and scales do not fit one format"


# -- kernel batching (K455-K459) ----------------------------------------------------------


class KilnBatchError(KilnError, ValueError):
    code = "K455"
    title = "a kernel batch is malformed"


# -- PyTorch idioms: mutation and tape autograd (K300-K319) --------------------------------


class KilnInPlaceError(KilnError, ValueError):
    code = "K300"
    title = "an in-place op cannot keep the tensor's shape or dtype"


class KilnBackwardError(KilnError, RuntimeError):
    code = "K301"
    title = "tape autograd misuse"


class KilnTracedStateError(KilnTraceError):
    code = "K302"
    title = "a traced function changed state it did not receive as an argument"


# -- ecosystem: safetensors, torch import, profiler, compile reports (K340-K359) ------------


class KilnSafetensorsError(KilnFormatError):
    code = "K340"
    title = "malformed or hostile safetensors file"


class KilnStateDictError(KilnArgumentError):
    code = "K341"
    title = "a state dict that cannot be saved"


class KilnTorchImportError(KilnError, ValueError):
    code = "K345"
    title = "a PyTorch module could not be imported"


class KilnUnsupportedTorchOpError(KilnTorchImportError):
    code = "K346"
    title = "an ATen op kiln has no mapping for"


class KilnProfilerError(KilnError, RuntimeError):
    code = "K350"
    title = "profiler misuse"


class KilnReportError(KilnError, ValueError):
    code = "K355"
    title = "no compile trace to report on"


# -- the compile cache (K360-K364) -----------------------------------------------------------


class KilnCacheError(KilnError, PermissionError):
    code = "K360"
    title = "unsafe compile cache directory"


class KilnCacheWarning(UserWarning):
    """The compile cache is disabled for this process (unsafe or unwritable folder);
    compiling still works, without reusing machine code across processes."""


class KilnUnknownBackendError(KilnArgumentError):
    code = "K370"
    title = "no registered backend serves this target"


class KilnBackendContractError(KilnError, TypeError):
    code = "K371"
    title = "a backend breaks the backend contract"


class KilnNotLegalizableError(KilnDTypeError):
    code = "K372"
    title = "a scalar op is neither native to a backend nor legalizable"


class KilnUnknownStageError(KilnArgumentError):
    code = "K373"
    title = "unknown compiler stage"


class KilnTemplateError(KilnArgumentError):
    code = "K374"
    title = "unknown Kernel IR template kind"


def all_error_classes() -> dict[str, type[KilnError]]:
    """Every registered error class by code (the registry `docs/errors.md` mirrors)."""
    return dict(sorted(_REGISTRY.items()))


_KILN_DIR = os.path.dirname(os.path.abspath(__file__))


_IN_KILN: dict[str, bool] = {}  # code filename -> inside kiln's folder (abspath is ~1.5 us)


def user_frame(skip_kiln: bool = True) -> types.FrameType | None:
    """The innermost stack frame outside kiln itself: the user's line."""
    frame = sys._getframe(1)
    while frame is not None:
        if not skip_kiln:
            return frame
        name = frame.f_code.co_filename
        inside = _IN_KILN.get(name)
        if inside is None:
            inside = os.path.abspath(name).startswith(_KILN_DIR + os.sep)
            if os.path.isabs(name):  # a relative name's meaning follows the cwd
                _IN_KILN[name] = inside
        if not inside:
            return frame
        frame = frame.f_back
    return None


def user_location() -> str | None:
    """`file:line: source` of the user's innermost frame, or None."""
    frame = user_frame()
    if frame is None:
        return None
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    source = linecache.getline(filename, lineno).strip()
    where = f"{filename}:{lineno}"
    return f"{where}: {source}" if source else where
