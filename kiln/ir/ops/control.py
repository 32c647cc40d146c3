"""Structured control flow: `cond` (N-way: `switch` is cond with an index) and
`while_loop`. Their regions are sub-graphs with their own parameters; operands a
branch closes over are explicit operands, so every region is self-contained.

For these ops the type rule also receives `regions` (the Region objects) and the
reference receives `regions` as callables (arrays in, list of arrays out).
"""

from __future__ import annotations

from kiln.errors import KilnDTypeError, KilnShapeError, KilnVerifierError
from kiln.ir import ad
from kiln.ir import dtypes as dt
from kiln.ir.registry import CONTROL, defop


def _describe(types) -> str:
    return "(" + ", ".join(map(str, types)) + ")"


@defop("cond", family="control", kind=CONTROL, num_regions=None)
class cond:
    """Run region `index` (clamped into [0, n-1]; a bool index picks region 1 when
    true, so `cond(pred, false_branch, true_branch)`) on the remaining operands."""

    def type(op, index, *operands, regions):
        if index.rank != 0 or not (index.dtype.is_integer or index.dtype.is_bool):
            raise KilnDTypeError(f"cond: the branch index must be a bool or integer scalar, got {index}")
        if not regions:
            raise KilnVerifierError("cond: needs at least one branch region")
        results = None
        for k, region in enumerate(regions):
            if region.param_types != list(operands):
                raise KilnVerifierError(
                    f"cond: branch {k} takes {_describe(region.param_types)} but the operands are "
                    f"{_describe(operands)}")
            if results is None:
                results = region.result_types
            elif region.result_types != results:
                for i, (a, b) in enumerate(zip(results, region.result_types)):
                    if a != b:
                        raise KilnShapeError(
                            f"cond: branch {k} output {i} is {b} but branch 0 output {i} is {a}; "
                            "every branch must return the same types")
                raise KilnShapeError(
                    f"cond: branch {k} returns {len(region.result_types)} outputs, branch 0 "
                    f"returns {len(results)}; every branch must return the same types")
        return tuple(results)

    def reference(index, *operands, regions):
        k = min(max(int(index), 0), len(regions) - 1)
        return tuple(regions[k](*operands))

    def vjp(b, cts, xs, ys, *, regions, **attrs):
        """A cond on the same index over each branch's backward (which recomputes its
        branch's forward): only the taken branch runs, forward and backward."""
        return ad.cond_vjp(b, cts, xs, ys, regions=regions, **attrs)


@defop("while_loop", family="control", kind=CONTROL, num_regions=2, attrs={"max_trips": None})
class while_loop:
    """Regions (cond, body): while cond(*carried) is true, carried = body(*carried).

    `max_trips`, when set, promises the loop runs at most that many trips (the frontend's
    `max_iterations=` builds the counter into cond); autodiff sizes the buffers of saved
    carries by it, and the reference stops there."""

    def type(op, *carried, regions, max_trips=None):
        if max_trips is not None and (not isinstance(max_trips, int) or isinstance(max_trips, bool)
                                      or max_trips < 0):
            raise KilnVerifierError(f"while_loop: max_trips must be a non-negative int, got "
                                    f"{max_trips!r}")
        cond_region, body = regions
        carried = list(carried)
        if cond_region.param_types != carried or body.param_types != carried:
            raise KilnVerifierError(
                f"while_loop: cond and body must take the carried types {_describe(carried)}, "
                f"got {_describe(cond_region.param_types)} and {_describe(body.param_types)}")
        if len(cond_region.result_types) != 1 or cond_region.result_types[0].rank != 0 \
                or cond_region.result_types[0].dtype != dt.bool_:
            raise KilnDTypeError(f"while_loop: cond must return one bool scalar, returns "
                                 f"{_describe(cond_region.result_types)}")
        if body.result_types != carried:
            raise KilnShapeError(f"while_loop: body returns {_describe(body.result_types)} but the "
                                 f"carried values are {_describe(carried)}; they must match")
        return tuple(carried)

    def reference(*carried, regions, max_trips=None):
        cond_fn, body_fn = regions
        trips = 0
        while (max_trips is None or trips < max_trips) and bool(cond_fn(*carried)[0]):
            carried = tuple(body_fn(*carried))
            trips += 1
        return tuple(carried)

    def vjp(b, cts, xs, ys, *, regions, saved=None, max_trips=None):
        """With a trip bound: the trips in reverse from the carries the forward saved
        (see kiln/ir/ad.py); without one, a KilnGradientError."""
        return ad.while_loop_vjp(b, cts, xs, ys, regions=regions, saved=saved, max_trips=max_trips)
