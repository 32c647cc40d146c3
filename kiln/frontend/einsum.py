"""`kn.einsum`: Einstein summation over kiln ops.

The equation is parsed once (numpy's and torch's grammar: `ab,bc->ac`, an implicit
output of the labels seen once, in alphabetical order, and `...` for broadcast dims).
Two operands contract as one batched matmul (batch labels first, the contracted labels
flattened into one dim), the way opt_einsum and torch lower a pair; more operands
contract left to right, keeping the labels a later operand or the output still needs.
Everything is reshape/permute/matmul/sum, so it traces, compiles and differentiates.
"""

from __future__ import annotations

import string

from kiln.errors import KilnArgumentError, KilnShapeError
from kiln.ir.shapes import numel


def _parse(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise KilnArgumentError(f"einsum: the equation {equation!r} names {len(terms)} operands "
                                f"but {len(ranks)} were given")
    spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in eq]
    ell = 0
    out_terms = []
    for term, rank in zip(terms, ranks):
        if term.count("...") > 1 or "." in term.replace("...", ""):
            raise KilnArgumentError(f"einsum: bad ellipsis in {term!r}")
        letters = term.replace("...", "")
        if not all(c.isalpha() for c in letters):
            raise KilnArgumentError(f"einsum: labels must be letters, got {term!r}")
        if "..." in term:
            n = rank - len(letters)
            if n < 0:
                raise KilnShapeError(f"einsum: {term!r} has more labels than the operand's rank {rank}")
            ell = max(ell, n)
            term = term.replace("...", "".join(spare[ell - n:ell]) if n else "")
        elif len(term) != rank:
            raise KilnShapeError(f"einsum: {term!r} has {len(term)} labels for an operand of rank {rank}")
        if len(set(term)) != len(term):
            raise KilnArgumentError(f"einsum: a label repeated within one operand ({term!r}, a "
                                    "diagonal) is not supported; use kn.diagonal-free forms")
        out_terms.append(term)
    ell_labels = "".join(spare[:ell])
    if arrow:
        if rhs.count("...") > 1:
            raise KilnArgumentError(f"einsum: bad ellipsis in the output {rhs!r}")
        out = rhs.replace("...", ell_labels)
        seen = set("".join(out_terms))
        bad = [c for c in out if c not in seen]
        if bad or len(set(out)) != len(out):
            raise KilnArgumentError(f"einsum: output labels {rhs!r} must be distinct and appear "
                                    "in an operand")
    else:
        joined = "".join(t for t in out_terms)
        once = sorted(c for c in set(joined) if joined.count(c) == 1 and c not in ell_labels)
        out = ell_labels + "".join(once)
    return out_terms, out


def _sum_unused(x, term: str, keep: set):
    from kiln.frontend.reductions import sum as ksum

    drop = [i for i, c in enumerate(term) if c not in keep]
    if drop:
        x = ksum(x, dim=tuple(drop))
        term = "".join(c for c in term if c in keep)
    return x, term


def _pair(a, ta: str, b, tb: str, keep: set):
    """Contract two operands; the result carries the labels in `keep` that they hold."""
    from kiln.frontend.functional import matmul
    from kiln.frontend.shape_ops import expand, permute, reshape

    batch = [c for c in ta if c in tb and c in keep]
    contract = [c for c in ta if c in tb and c not in keep]
    left = [c for c in ta if c not in tb]
    right = [c for c in tb if c not in ta]
    size = {}
    for t, x in ((ta, a), (tb, b)):
        for c, d in zip(t, x.shape):
            if c in size and isinstance(size[c], int) and isinstance(d, int) and d != size[c]:
                if size[c] == 1:
                    size[c] = d
                elif d != 1:
                    raise KilnShapeError(f"einsum: label {c!r} has sizes {size[c]} and {d}")
            else:
                size.setdefault(c, d)
    a = permute(a, [ta.index(c) for c in batch + left + contract])
    b = permute(b, [tb.index(c) for c in batch + contract + right])
    bs = [size[c] for c in batch]
    a = expand(a, *(bs + [size[c] for c in left + contract]))
    b = expand(b, *(bs + [size[c] for c in contract + right]))
    ls, ks, rs = ([size[c] for c in g] for g in (left, contract, right))
    a = reshape(a, *bs, numel(ls), numel(ks))
    b = reshape(b, *bs, numel(ks), numel(rs))
    out = reshape(matmul(a, b), *bs, *ls, *rs)
    return out, "".join(batch + left + right)


def contract(equation: str, operands: list):
    from kiln.frontend.shape_ops import permute

    if not operands:
        raise KilnArgumentError("einsum: needs at least one operand")
    terms, out = _parse(equation, [t.ndim for t in operands])
    x, tx = operands[0], terms[0]
    for k in range(1, len(operands)):
        later = set(out).union(*terms[k + 1:])
        y, ty = operands[k], terms[k]
        x, tx = _sum_unused(x, tx, later | set(ty))
        y, ty = _sum_unused(y, ty, later | set(tx))
        x, tx = _pair(x, tx, y, ty, later)
    x, tx = _sum_unused(x, tx, set(out))
    return permute(x, [tx.index(c) for c in out]) if tx != out else x
