"""`fused`: a group of nodes that one kernel computes, made by the fusion pass.

Its single region takes the group's external inputs and yields the values the group
materializes; `kind` says which template lowers it ("loop": pointwise, "reduction":
reductions with their producers and consumers over one domain, "gemm": a matrix
product with its epilogue). The op exists so that `kiln dump --stage optimized`
shows the groups and so that lowering reads them from the graph. `batch`, when set by
the batching pass (kiln/passes/batching.py), numbers the launch a small kernel shares
with the other members of its batch (adjacent `fused` nodes with the same number).
"""

from __future__ import annotations

from kiln.errors import KilnArgumentError, KilnBatchError, KilnVerifierError
from kiln.ir import ad
from kiln.ir.registry import CONTROL, REQUIRED, defop

FUSION_KINDS = ("loop", "reduction", "gemm")


@defop("fused", family="fusion", kind=CONTROL, num_regions=1, attrs={"kind": REQUIRED, "batch": None})
class fused:
    """A fusion group: region(*inputs) yields the group's materialized outputs."""

    def type(op, *inputs, kind, regions, batch=None):
        if kind not in FUSION_KINDS:
            raise KilnArgumentError(f"fused: kind must be one of {FUSION_KINDS}, got {kind!r}")
        if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 0):
            raise KilnBatchError(f"fused: batch must be a non-negative int launch number, got {batch!r}")
        (region,) = regions
        if region.param_types != list(inputs):
            raise KilnVerifierError("fused: the region's parameters must match the operands")
        return tuple(region.result_types)

    def reference(*inputs, kind, regions, batch=None):
        (body,) = regions
        return tuple(body(*inputs))

    def vjp(b, cts, xs, ys, *, regions, **_):
        """The group's region differentiated like the function it is."""
        return ad.fused_vjp(b, cts, xs, ys, regions=regions)
