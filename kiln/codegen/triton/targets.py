"""GPU targets of the Triton backend, by name, and how a user names them.

This module imports nothing heavy (no triton), so `supports()`, option parsing and
error messages work where triton is not installed.

A kiln target name is an architecture: "sm_80", "sm_90", "sm_100" (NVIDIA, 32-wide
warps) or "gfx90a", "gfx942", "gfx950" (AMD, 64-wide wavefronts). A *backend spec*
is what a user passes to `kn.compile(backend=...)` or `kiln dump --target`:

    "cuda"            -> sm_90   (H100/H200)      "rocm"            -> gfx942 (MI300)
    "cuda:sm_100"     -> sm_100                   "rocm:gfx950"     -> gfx950
    "sm_80", "gfx90a" -> that architecture

The vendor default is what ahead-of-time compilation and `kiln dump` use. When kernels
run on a GPU of this machine, a spec without an explicit architecture compiles for the
GPU that is present instead (an A100 gets sm_80 code, not sm_90 code it cannot load).
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError, KilnError

# name -> (triton backend, triton arch, warp size): the arguments of triton's GPUTarget.
ARCHS: dict[str, tuple[str, int | str, int]] = {
    "sm_80": ("cuda", 80, 32),
    "sm_90": ("cuda", 90, 32),
    "sm_100": ("cuda", 100, 32),
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
}
VENDORS = {"cuda": "cuda", "rocm": "hip"}
DEFAULT_ARCH = {"cuda": "sm_90", "rocm": "gfx942"}


class KilnNoGpuError(KilnError, RuntimeError):
    """Kernels were compiled for a GPU backend but this machine cannot run them."""

    code = "K165"
    title = "no GPU of the requested kind on this machine"


def vendor_of(arch: str) -> str:
    """"cuda" or "rocm" for a kiln architecture name."""
    return "cuda" if ARCHS[arch][0] == "cuda" else "rocm"


def split_spec(spec: str) -> tuple[str, str | None]:
    """(vendor, explicit arch or None) of a backend spec; raises K103 on a bad spec.

        >>> split_spec("cuda:sm_100"), split_spec("rocm"), split_spec("gfx90a")
        (('cuda', 'sm_100'), ('rocm', None), ('rocm', 'gfx90a'))
    """
    vendor, _, arch = spec.partition(":")
    if not arch and vendor in ARCHS:
        return vendor_of(vendor), vendor
    if vendor not in VENDORS:
        raise KilnArgumentError(f"unknown GPU target {spec!r}", hint=_targets_hint())
    if not arch:
        return vendor, None
    if arch not in ARCHS or vendor_of(arch) != vendor:
        raise KilnArgumentError(f"{vendor!r} has no architecture {arch!r}", hint=_targets_hint())
    return vendor, arch


def resolve_arch(spec: str) -> str:
    """The architecture a spec compiles for ahead of time: explicit, else the vendor default."""
    vendor, arch = split_spec(spec)
    return arch or DEFAULT_ARCH[vendor]


def supports(target: str) -> bool:
    try:
        split_spec(target)
    except KilnArgumentError:
        return False
    return True


def _targets_hint() -> str:
    cuda = ", ".join(a for a in ARCHS if vendor_of(a) == "cuda")
    rocm = ", ".join(a for a in ARCHS if vendor_of(a) == "rocm")
    return (f"use 'cuda' (default {DEFAULT_ARCH['cuda']}), 'rocm' (default {DEFAULT_ARCH['rocm']}), "
            f"'cuda:ARCH' with ARCH in {cuda}, or 'rocm:ARCH' with ARCH in {rocm}")
