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
GROUP = tl.constexpr(dropout.PER_CALL)   # keys of a row decided by one Philox call


@triton.jit
def _halves(word):
    """A uint32 word's low and high 16 bits, as int32."""
    return (word & 0xFFFF).to(tl.int32), (word >> 16).to(tl.int32)


@triton.jit
def dropout_tile(seed_ptr, row0, offs_m, n0, S, drop_threshold, keep_scale,
                 BLOCK_N: tl.constexpr):
    """Z (float32, [BLOCK_M, BLOCK_N]) of the query rows offs_m and the keys n0 .. n0 + BLOCK_N
    of one (batch, query head) whose rows start at row0 = (b H + h) L. n0 is a multiple of
    GROUP; rows and keys past the ends get values the caller masks."""
    seed = tl.load(seed_ptr)
    groups_per_row = (S + GROUP - 1) // GROUP
    offs_g = n0 // GROUP + tl.arange(0, BLOCK_N // GROUP)
    counters = (row0 + offs_m.to(tl.int64))[:, None] * groups_per_row + offs_g[None, :]
    w0, w1, w2, w3 = tl.randint4x(seed, counters, PHILOX_ROUNDS)
    u0, u1 = _halves(w0)
    u2, u3 = _halves(w1)
    u4, u5 = _halves(w2)
    u6, u7 = _halves(w3)
    # [M, N/8, 2, 2, 2] whose last three indices (x, y, z) hold number 4x + 2y + z: a join
    # adds its index last, so the outermost join is z, the innermost x
    numbers = tl.join(tl.join(tl.join(u0, u4), tl.join(u2, u6)),
                      tl.join(tl.join(u1, u5), tl.join(u3, u7)))
    numbers = tl.reshape(numbers, (offs_m.shape[0], BLOCK_N))
    return tl.where(numbers >= drop_threshold, keep_scale, 0.0)


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
