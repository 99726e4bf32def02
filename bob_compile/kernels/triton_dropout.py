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

# the CPU path's rounds and constants (philox.py): the same bits
PHILOX_ROUNDS = tl.constexpr(philox.ROUNDS)
PHILOX_MULTIPLIER = tl.constexpr(philox.MULTIPLIER)
PHILOX_KEY_STEP = tl.constexpr(philox.KEY_STEP)
GROUP = tl.constexpr(dropout.GROUP)   # rows and keys in blocks of 16: 2 x 2 elements a call


@triton.jit
def philox2x32(key, c0, c1):
    """Philox-2x32 of PHILOX_ROUNDS rounds (philox.py): two uint32 words of the uint32 counters (c0, c1)."""
    for _ in tl.static_range(PHILOX_ROUNDS):
        hi = tl.umulhi(c0, PHILOX_MULTIPLIER)
        c0, c1 = hi ^ key ^ c1, c0 * PHILOX_MULTIPLIER
        key = key + PHILOX_KEY_STEP
    return c0, c1


@triton.jit
def dropout_tile(seed_ptr, head, L, m0, n0, S, drop_threshold, keep_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Z (float32, [BLOCK_M, BLOCK_N]) of the query rows m0 .. m0 + BLOCK_M and the keys
    n0 .. n0 + BLOCK_N of query head `head` (b Hq + h). m0 and n0 are multiples of GROUP;
    rows and keys past the ends get values the caller masks."""
    seed = tl.load(seed_ptr)
    key = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_above = (((seed >> 32) & 0xFFFF) << 16).to(tl.uint32)
    # one counter per group (rows {i, i + 8}, keys {j, j + 8}): the group grid is
    # [BLOCK_M / 2, BLOCK_N / 2], numbered 8 I + r down and 8 J + s across (dropout.py)
    group_rows = (head.to(tl.int64) * ((L + GROUP - 1) // GROUP) + m0 // GROUP) * 8 \
        + tl.arange(0, BLOCK_M // 2)
    group_cols = n0 // GROUP * 8 + tl.arange(0, BLOCK_N // 2)
    groups = group_rows[:, None] * ((S + GROUP - 1) // GROUP * 8) + group_cols[None, :]
    w0, w1 = philox2x32(key, (groups & 0xFFFFFFFF).to(tl.uint32),
                        (groups >> 32).to(tl.uint32) | seed_above)
    # element (a, c) is half c of word a, kept where that half >= t: compared in place, the
    # high half as the word against t * 2**16, the low half shifted up to meet it
    t = tl.full((), drop_threshold, tl.int32).to(tl.uint32) << 16
    keep = tl.join(tl.join(w0 << 16 >= t, w0 >= t), tl.join(w1 << 16 >= t, w1 >= t))
    # stacked as [I, r, J, s, c, a]: move a and c in front of r and s. Only indices move:
    # each thread already holds its group's words
    keep = tl.reshape(keep, (BLOCK_M // GROUP, 8, BLOCK_N // GROUP, 8, 2, 2))
    keep = tl.reshape(tl.permute(keep, (0, 5, 1, 2, 4, 3)), (BLOCK_M, BLOCK_N))
    return tl.where(keep, keep_scale, 0.0)


def dropout_arguments(params, fallback):
    """The dropout arguments of a launch: (DROPOUT, SEED, drop_threshold, keep_scale), with
    `fallback` (any tensor) as SEED where the call has no dropout."""
    if not params.dropout_p:
        return False, fallback, 0, 0.0
    seed = params.dropout_seed
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(seed, dtype=torch.int64, device=fallback.device)
    return (True, seed, dropout.threshold(params.dropout_p),
            float(dropout.kept_scale(params.dropout_p)))


def dropout_flags(dropout):
    """The part of a launch plan's flags (its tuning key) that dropout adds: a kernel with
    dropout is another kernel, tuned apart."""
    return ("dropout",) if dropout else ()
