"""Attention written with einsum: which equations are q·kᵀ and P·v, in which layouts.

    scores = torch.einsum("bhqd,bhkd->bhqk", q, k)      # lucidrains, x-transformers, Perceiver
    out = torch.einsum("bhqk,bhkd->bhqd", probs, v)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)      # q, k kept (B, L, H, E): permuted here
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)     # output back in (B, L, H, Ev)

The op takes q (batch..., L, E), k (batch..., S, E), v (batch..., S, Ev) and returns
(batch..., L, Ev). For an equation we accept, `scores_layout` and `output_layout` give the
permutations that bring each operand to that layout (None where it is already there) and
the one that takes the op's output to the equation's output. Letters may be any; "..."
stands for the same leading dims on every operand. Equations that also sum over another
letter, take a diagonal, or broadcast differently are not attention and raise
NotAttention with the reason.
"""
import string


class NotAttention(Exception):
    """The einsum is not a q·kᵀ (or P·v) contraction; the message says why."""


def _letters(equation, ranks):
    """The equation's input terms and output term, with '...' spelled out as fresh
    capital letters (one per dim it covers, from the operands' ranks)."""
    equation = equation.replace(" ", "")
    if "->" not in equation:
        raise NotAttention(f"einsum {equation!r} has no explicit output")
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if len(terms) != len(ranks):
        raise NotAttention(f"einsum {equation!r} does not have {len(ranks)} operands")
    free = [c for c in string.ascii_uppercase if c not in equation]
    covered = {r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t}
    if len(covered) > 1:
        raise NotAttention(f"einsum {equation!r}: '...' covers different dims per operand")
    ellipsis = "".join(free[:max(covered.pop(), 0)]) if covered else ""
    terms = [t.replace("...", ellipsis) for t in terms]
    output = output.replace("...", ellipsis)
    for term, rank in zip(terms, ranks):
        if len(term) != rank or len(set(term)) != len(term):
            raise NotAttention(f"einsum {equation!r}: a term does not name each dim once")
    return terms, output


def _permutation(term, order):
    """The dims of `term` taken in `order` (a string of its letters), or None if identity."""
    perm = [term.index(c) for c in order]
    return None if perm == list(range(len(term))) else perm


def scores_layout(equation, rank_a, rank_b):
    """For einsum(equation, a, b) = a·bᵀ per batch: (perm of a to (batch..., L, E),
    perm of b to (batch..., S, E), number of batch dims). The output must be
    (batch..., L, S): the softmax then runs over the keys."""
    (a, b), out = _letters(equation, (rank_a, rank_b))
    contracted = [c for c in a if c in b and c not in out]
    rows = [c for c in a if c not in b]
    cols = [c for c in b if c not in a]
    batch = [c for c in out if c in a and c in b]
    if len(contracted) != 1 or len(rows) != 1 or len(cols) != 1:
        raise NotAttention(f"einsum {equation!r} is not one row index, one key index and one "
                           f"contracted index over batch dims")
    if any(c not in out for c in rows + cols) or len(out) != len(batch) + 2 \
            or out[-2:] != rows[0] + cols[0]:
        raise NotAttention(f"einsum {equation!r}: the output does not end in (queries, keys)")
    order = "".join(batch)
    return (_permutation(a, order + rows[0] + contracted[0]),
            _permutation(b, order + cols[0] + contracted[0]), len(batch))


def output_layout(equation, rank_p, rank_v, probs_first):
    """For einsum(equation, p, v) (or (v, p) when not probs_first) with p laid out
    (batch..., L, S): (perm of v to (batch..., S, Ev), perm of the op's (batch..., L, Ev)
    output to the equation's output)."""
    ranks = (rank_p, rank_v) if probs_first else (rank_v, rank_p)
    terms, out = _letters(equation, ranks)
    p, v = terms if probs_first else terms[::-1]
    batch, row, key = p[:-2], p[-2], p[-1]
    values = [c for c in v if c not in p]
    if len(values) != 1 or key not in v or key in out or set(v) != set(batch) | {key, *values}:
        raise NotAttention(f"einsum {equation!r} does not contract the probabilities' key "
                           f"dim with the values over the same batch dims")
    if sorted(out) != sorted(batch + row + values[0]):
        raise NotAttention(f"einsum {equation!r}: the output is not (batch, queries, values)")
    canonical = batch + row + values[0]
    return _permutation(v, batch + key + values[0]), _permutation(canonical, out)
