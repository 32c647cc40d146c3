"""The Metal backend's errors (K410-K419; docs/errors.md lists them)."""

from __future__ import annotations

from kiln.errors import KilnError


class KilnMetalUnavailableError(KilnError, RuntimeError):
    code = "K410"
    title = "running Metal kernels needs a Mac"


class KilnMetalBuildError(KilnError, RuntimeError):
    code = "K411"
    title = "the Metal compiler rejected a generated program"



class KilnMetalArgumentError(KilnError, ValueError):
    code = "K412"
    title = "a Metal linear-algebra or attention kernel cannot take this shape"
