"""Argument checks of the collectives, run on the caller's thread before anything is sent.

Each check raises `CollectiveArgumentError` naming the op, the operand (with its dtype
and shape) and the rule broken.
"""

from __future__ import annotations

import zlib
from typing import Callable, Sequence

import numpy as np

from kiln.distributed import buffers
from kiln.distributed.buffers import Reducer, describe
from kiln.distributed.errors import CollectiveArgumentError


def buffer(op: str, name: str, obj, *, writeable: bool) -> np.ndarray:
    return buffers.as_array(obj, op, name, writeable=writeable)


def reducer(op: str, reduce_op: str, buf: np.ndarray) -> Reducer:
    dt = buffers.dtype_of(buf)
    return Reducer(buffers.check_reduce_op(op, reduce_op, dt), dt)


def rank(op: str, name: str, value, world_size: int) -> int:
    return buffers.check_rank(op, name, value, world_size)


def same_dtype(op: str, *named: tuple[str, np.ndarray]) -> None:
    buffers.check_same_dtype(op, list(named))


def slotted(op: str, name: str, output, inp: np.ndarray,
            world_size: int) -> tuple[np.ndarray, Callable[[], None]]:
    """An output of world_size slots of inp's size: one array, or a list of arrays.

    Returns the flat array to receive into and a function that copies it out to the
    list (a no-op for a single array).
    """
    if isinstance(output, (list, tuple)):
        if len(output) != world_size:
            raise CollectiveArgumentError("%s: %s is a list of %d buffers; the group has %d ranks"
                                          % (op, name, len(output), world_size))
        outs = [buffers.as_array(o, op, "%s[%d]" % (name, i), writeable=True)
                for i, o in enumerate(output)]
        for i, o in enumerate(outs):
            same_dtype(op, ("input", inp), ("%s[%d]" % (name, i), o))
            if o.size != inp.size:
                raise CollectiveArgumentError(
                    "%s: %s[%d] (%s) must have input's %d elements (%s)"
                    % (op, name, i, describe(o), inp.size, describe(inp)))
        staging = np.empty((world_size, inp.size), inp.dtype)

        def finish() -> None:
            for i, o in enumerate(outs):
                o.reshape(-1)[...] = staging[i]
        return staging, finish
    out = buffers.as_array(output, op, name, writeable=True)
    same_dtype(op, ("input", inp), (name, out))
    if out.size != world_size * inp.size:
        raise CollectiveArgumentError(
            "%s: %s (%s) must hold world_size * input.size = %d * %d = %d elements, has %d"
            % (op, name, describe(out), world_size, inp.size, world_size * inp.size, out.size),
            hint="e.g. np.empty((world_size, *input.shape), input.dtype)")
    return out, lambda: None


def slotted_input(op: str, name: str, input, out: np.ndarray, world_size: int) -> np.ndarray:
    """An input of world_size slots of out's size: one array or a list (stacked here)."""
    if isinstance(input, (list, tuple)):
        if len(input) != world_size:
            raise CollectiveArgumentError("%s: %s is a list of %d buffers; the group has %d ranks"
                                          % (op, name, len(input), world_size))
        ins = [buffers.as_array(a, op, "%s[%d]" % (name, i), writeable=False)
               for i, a in enumerate(input)]
        for i, a in enumerate(ins):
            same_dtype(op, ("output", out), ("%s[%d]" % (name, i), a))
            if a.size != out.size:
                raise CollectiveArgumentError("%s: %s[%d] (%s) must have output's %d elements"
                                              % (op, name, i, describe(a), out.size))
        return np.stack([a.reshape(-1) for a in ins]) if ins else np.empty(0, out.dtype)
    inp = buffers.as_array(input, op, name, writeable=False)
    same_dtype(op, ("output", out), (name, inp))
    if inp.size != world_size * out.size:
        raise CollectiveArgumentError(
            "%s: %s (%s) must hold world_size * output.size = %d * %d = %d elements, has %d"
            % (op, name, describe(inp), world_size, out.size, world_size * out.size, inp.size))
    return inp


def splits(op: str, name: str, arr: np.ndarray, sizes: Sequence[int] | None,
           world_size: int) -> list[int]:
    """Element counts per rank from split sizes along dim 0 (torch's all_to_all_single)."""
    rows = arr.shape[0] if arr.ndim else 1
    row = arr.size // rows if rows else int(np.prod(arr.shape[1:], dtype=np.int64))
    if sizes is None:
        if rows % world_size:
            raise CollectiveArgumentError(
                "%s: %s (%s) has %d rows, not divisible by the %d ranks; pass %s_split_sizes"
                % (op, name, describe(arr), rows, world_size, name))
        return [rows // world_size * row] * world_size
    sizes = list(sizes)
    if len(sizes) != world_size or not all(
            isinstance(s, (int, np.integer)) and s >= 0 for s in sizes):
        raise CollectiveArgumentError("%s: %s_split_sizes=%r must be %d non-negative ints"
                                      % (op, name, sizes, world_size))
    if sum(sizes) != rows:
        raise CollectiveArgumentError(
            "%s: %s_split_sizes=%r sum to %d but %s (%s) has %d rows"
            % (op, name, sizes, sum(sizes), name, describe(arr), rows))
    return [int(s) * row for s in sizes]


def split_spec(ranks: Sequence[int] | None, color, key, my_rank: int,
               world_size: int) -> tuple[int, int, int]:
    """(color, key, digest of the ranks list) of this rank for `ProcessGroup.split`."""
    if ranks is not None:
        if color is not None or key is not None:
            raise CollectiveArgumentError("split: pass either ranks or color/key, not both")
        ranks = list(ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(
                isinstance(r, (int, np.integer)) and 0 <= r < world_size for r in ranks):
            raise CollectiveArgumentError("split: ranks=%r must be distinct ranks in 0..%d"
                                          % (ranks, world_size - 1))
        digest = zlib.crc32(",".join(str(int(r)) for r in ranks).encode())
        if my_rank in ranks:
            return 0, ranks.index(my_rank), digest
        return -1, 0, digest
    if color is None:
        return -1, 0, 0
    if not isinstance(color, (int, np.integer)) or (
            key is not None and not isinstance(key, (int, np.integer))):
        raise CollectiveArgumentError("split: color=%r and key=%r must be ints" % (color, key))
    return int(color) if color >= 0 else -1, int(my_rank if key is None else key), 0
