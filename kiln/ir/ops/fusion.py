"""`fused`: a group of nodes that one kernel computes, made by the fusion pass.

Its single region takes the group's external inputs and yields the values the group
materializes; `kind` says which template lowers it ("loop": pointwise, "reduction":
reductions with their producers and consumers over one domain, "gemm": a matrix
product with its epilogue). The op exists so that `kiln dump --stage optimized`
shows the groups and so that lowering reads them from the graph.
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError, KilnVerifierError
from kiln.ir import ad
from kiln.ir.registry import CONTROL, REQUIRED, defop

FUSION_KINDS = ("loop", "reduction", "gemm")


@defop("fused", family="fusion", kind=CONTROL, num_regions=1, attrs={"kind": REQUIRED})
class fused:
    """A fusion group: region(*inputs) yields the group's materialized outputs."""

    def type(op, *inputs, kind, regions):
        if kind not in FUSION_KINDS:
            raise KilnArgumentError(f"fused: kind must be one of {FUSION_KINDS}, got {kind!r}")
        (region,) = regions
        if region.param_types != list(inputs):
            raise KilnVerifierError("fused: the region's parameters must match the operands")
        return tuple(region.result_types)

    def reference(*inputs, kind, regions):
        (body,) = regions
        return tuple(body(*inputs))

    def vjp(b, cts, xs, ys, *, regions, **_):
        """The group's region differentiated like the function it is."""
        return ad.fused_vjp(b, cts, xs, ys, regions=regions)
