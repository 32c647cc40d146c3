"""The OpenCL backend's errors (K400-K409; docs/errors.md lists them)."""

from __future__ import annotations

from kiln.errors import KilnError


class KilnOpenCLUnavailableError(KilnError, RuntimeError):
    code = "K400"
    title = "no OpenCL runtime or device here"


class KilnOpenCLBuildError(KilnError, RuntimeError):
    code = "K401"
    title = "the OpenCL compiler rejected a generated program"


class KilnOpenCLFeatureError(KilnError, RuntimeError):
    code = "K402"
    title = "the OpenCL device lacks a feature the kernel needs"


class KilnOpenCLLaunchError(KilnError, RuntimeError):
    code = "K403"
    title = "an OpenCL kernel launch or transfer failed"
