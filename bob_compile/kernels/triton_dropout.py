"""Attention dropout's Z in Triton, one tile at a time (dropout.py defines the mask; the
CPU path and the oracle draw the same bits with philox.py).

A kernel with DROPOUT on takes SEED (a pointer to the call's int64 seed), drop_threshold (t)
and keep_scale (1 / (1 - p')) and, where P meets V or dO Vᵀ meets P, multiplies by the tile's
Z: keep_scale where the element is kept, 0 where it is dropped. Nothing is stored: each
kernel, each order, regenerates the same Z from the seed and the element's indices.
"""
import torch
import triton
import triton.language as tl

from . import dropout, philox

PHILOX_ROUNDS = tl.constexpr(philox.ROUNDS)   # the CPU path's rounds: the same bits
GROUP = tl.constexpr(dropout.GROUP)   # rows and keys in blocks of 16: 2 x 2 elements a call


@triton.jit
def dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold, keep_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Z (float32, [BLOCK_M, BLOCK_N]) of the query rows m0 .. m0 + BLOCK_M and the keys
    n0 .. n0 + BLOCK_N of query head `head` (b Hq + h). m0 and n0 are multiples of GROUP;
    rows and keys past the ends get values the caller masks."""
    seed = tl.load(seed_ptr)
    # one counter per group (rows {i, i + 8}, keys {j, j + 8}): the group grid is
    # [BLOCK_M / 2, BLOCK_N / 2], numbered 8 I + r down and 8 J + s across (dropout.py)
    group_rows = (head.to(tl.int64) * ((L + GROUP - 1) // GROUP) + m0 // GROUP) * 8 \
        + tl.arange(0, BLOCK_M // 2)
    group_cols = n0 // GROUP * 8 + tl.arange(0, BLOCK_N // 2)
    counters = group_rows[:, None] * ((S + GROUP - 1) // GROUP * 8) + group_cols[None, :]
    w0, w1, w2, w3 = tl.randint4x(seed, counters, PHILOX_ROUNDS)
    # word 2a + c is row i + 8a, key j + 8c: stack them as [I, r, J, s, c, a], then move a and
    # c in front of r and s. Only indices move: each thread already holds its group's words
    words = tl.join(tl.join(w0, w1), tl.join(w2, w3))
    words = tl.reshape(words, (BLOCK_M // GROUP, 8, BLOCK_N // GROUP, 8, 2, 2))
    words = tl.reshape(tl.permute(words, (0, 5, 1, 2, 4, 3)), (BLOCK_M, BLOCK_N))
    # t as the int32 of its bits (t < 2**32; an argument above 2**31 would be an int64)
    threshold = tl.full((), drop_threshold, tl.int32).to(tl.uint32, bitcast=True)
    return tl.where(words >= threshold, keep_scale, 0.0)


def dropout_arguments(params, fallback):
    """The dropout arguments of a launch: (DROPOUT, SEED, drop_threshold, keep_scale), with
    `fallback` (any tensor) as SEED where the call has no dropout."""
    if not params.dropout_p:
        return False, fallback, 0, 0.0
    seed = params.dropout_seed
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(seed, dtype=torch.int64, device=fallback.device)
    threshold = dropout.threshold(params.dropout_p)
    return (True, seed, threshold - (threshold >> 31 << 32),    # t's bits as an int32
            float(dropout.kept_scale(params.dropout_p)))


def dropout_flags(dropout):
    """The part of a launch plan's flags (its tuning key) that dropout adds: a kernel with
    dropout is another kernel, tuned apart."""
    return ("dropout",) if dropout else ()
