"""Attention dropout's keep mask, regenerated wherever it is needed, never stored.

With dropout, the attention output is o = (P ∘ Z) V, where P = softmax(scores) and
Z = keep / (1 - p) (SDPA's semantics: kept probabilities scaled up so that the output's
expectation is unchanged). Z is a constant of the call: every order sees the same one, so
each kernel regenerates it, per (batch, head, query, key), from the call's seed.

One Philox-2x32-7 call (philox.py) gives two 32-bit words, whose four 16-bit halves decide
a 2 x 2 group of elements: rows i and i + 8 and keys j and j + 8 of one head. Rows and keys
are numbered in blocks of 16, i = 16 I + 8 a + r and j = 16 J + 8 c + s (a, c in {0, 1};
r, s in 0 .. 7), the group's number is

    g = ((n L16 + I) 8 + r) S8 + 8 J + s       n = b H + h, the head; L16 = ceil(L / 16),
                                                S8 = 8 ceil(S / 16)
and, with the call's 48-bit seed,

    words = philox2x32(key = seed mod 2**32, counter = (g mod 2**32, g div 2**32 + 2**16 (seed div 2**32)))
    u(b, h, i, j) = half c of word a (half 0: the low 16 bits)
    keep(b, h, i, j) = u >= t,     t = round(p 2**16)

with H the query heads and L, S the lengths (g < 2**48: B H L S < 2**46, checked). An element
is dropped with probability p' = t / 2**16 (p to within 2**-17; PyTorch's CUDA flash kernel
rounds p to 2**-8), and a kept one is scaled by 1 / (1 - p'), so that E[Z] = 1 exactly.

Why this grouping: Philox is the kernels' cost per element, and a call must serve several
elements that one GPU thread holds, or the tile's words travel between threads (through
shared memory, every tile, every pass). The matrix units' accumulator gives each thread rows
i and i + 8 of a 16-row slab, and columns j and j + 8 among others, whichever way round a
kernel computes its tile ([queries, keys] in the row passes, [keys, queries] in the column
passes). A group of rows {i, i + 8} x keys {j, j + 8} is held by one thread in both
orientations (larger groups are not), so Triton lays the Philox words out where the tile
needs them and moves none. Why 16 bits and Philox-2x32: four elements need 64 bits, one
2x32 call, where 32 bits each took a 4x32 call (Triton's tl.randint4x) of twice the
integer work; compiled for sm_90a, a probe loop (two GEMMs and the mask per tile) spends
400 SASS instructions and 30 registers on the mask instead of 584 and 73
(benchmarks/dropout_mask_cost.py).
The seed is an int64 tensor of one element, below 2**48, drawn from PyTorch's generator on
the inputs' device per call (`draw_seed`), so that torch.manual_seed reproduces a run, and a
CUDA graph records the draw and replays a fresh seed each time.

Where Z enters the math (docs/second-order.md, "Dropout"): where P meets V (o, dV, and their
derivatives) and on dP = Z ∘ (dO Vᵀ); the softmax's own terms (lse, D = rowsum(dO ∘ o)) are
unchanged.
"""
import torch

from . import philox

BITS = 16                       # random bits per element: half a word
GROUP = 16                      # rows and keys come in blocks of 16: two 8-apart pairs
SEED_BITS = 48                  # 32 for Philox's key, 16 above the counter's 48
COUNTER_BITS = 48
_LEVELS = 2 ** BITS
_WORD = 2 ** 32 - 1


def threshold(p):
    """t: an element is kept where its 16 random bits, unsigned, are >= t (t < 2**16: at
    p = 1 kept_scale is 0, so what the bits decide no longer matters)."""
    return min(round(p * _LEVELS), _LEVELS - 1)


def dropped_fraction(p):
    """p', the probability that an element is dropped: p rounded to a multiple of 2**-16."""
    return 1.0 if p >= 1 else threshold(p) / _LEVELS


def draw_seed(device):
    """A fresh seed for one call, from PyTorch's generator on `device`."""
    return torch.randint(0, 2 ** SEED_BITS, (), device=device, dtype=torch.int64)


def seed_value(seed):
    """The seed as a Python int (a tensor is read: the CPU path, tests)."""
    return int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed)


def check_counter_range(shape):
    """The groups of a (B, H, L, S) call must be numbered below 2**48 (COUNTER_BITS); checked
    where every call enters the ops (ops._params)."""
    B, H, L, S = shape
    groups = B * H * -(-L // GROUP) * 8 * -(-S // GROUP) * 8
    if groups > 2 ** COUNTER_BITS:
        raise ValueError(f"attention dropout over B*H = {B * H} heads of {L} x {S} pairs "
                         f"numbers more dropout groups than its generator's counter holds "
                         f"(2**{COUNTER_BITS}); split the batch or run without dropout")


def keep_scale(params, shape, rows, cols, dtype, device):
    """Z on the tile (:, :, rows, cols) (slices) of a call whose (batch, query heads, L, S) are
    `shape`: keep / (1 - p') in `dtype`, (B, H, rows, cols); None without dropout."""
    if not params.dropout_p:
        return None
    return keep_mask(params, shape, rows, cols, device).to(dtype) * kept_scale(params.dropout_p)


def kept_scale(p):
    """1 / (1 - p'), the factor of a kept probability (0 where p' = 1: nothing is kept, and
    the output is 0, as F.dropout gives at p = 1)."""
    dropped = dropped_fraction(p)
    return 0.0 if dropped >= 1 else 1.0 / (1.0 - dropped)


def keep_mask(params, shape, rows, cols, device):
    """The bool keep mask of the tile (see keep_scale), as the kernels draw it: one Philox
    call per group of rows {i, i + 8} and keys {j, j + 8} (16-blocks), 16 bits each. Drawn
    for the 16-blocks around the tile, as a kernel's tile draws them, then cut to it."""
    B, H, L, S = shape
    r0, r1 = rows.start // GROUP * GROUP, -(-rows.stop // GROUP) * GROUP
    c0, c1 = cols.start // GROUP * GROUP, -(-cols.stop // GROUP) * GROUP
    heads = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1, 1)
    # the groups of the blocks: 8 I + r down, 8 J + s across (consecutive over the blocks)
    group_rows = (heads * -(-L // GROUP) + r0 // GROUP) * 8 + torch.arange(
        (r1 - r0) // 2, device=device, dtype=torch.int64).view(-1, 1)
    group_cols = c0 // GROUP * 8 + torch.arange((c1 - c0) // 2, device=device, dtype=torch.int64)
    groups = group_rows * (-(-S // GROUP) * 8) + group_cols
    seed = seed_value(params.dropout_seed) % 2 ** SEED_BITS
    w0, w1 = philox.philox2x32(seed & _WORD, groups & _WORD,
                               (groups >> 32) | (seed >> 32 << 16))
    # element (a, c) of a group is half c of word a: (I, r, J, s, a, c) -> (I, a, r, J, c, s)
    halves = torch.stack([w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16], -1)
    halves = halves.view(B, H, (r1 - r0) // GROUP, 8, (c1 - c0) // GROUP, 8, 2, 2)
    halves = halves.permute(0, 1, 2, 6, 3, 4, 7, 5).reshape(B, H, r1 - r0, c1 - c0)
    tile = halves[:, :, rows.start - r0:rows.stop - r0, cols.start - c0:cols.stop - c0]
    return tile >= threshold(params.dropout_p)
