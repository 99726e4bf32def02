"""Attention dropout's keep mask, regenerated wherever it is needed, never stored.

With dropout, the attention output is o = (P ∘ Z) V, where P = softmax(scores) and
Z = keep / (1 - p) (SDPA's semantics: kept probabilities scaled up so that the output's
expectation is unchanged). Z is a constant of the call: every order sees the same one, so
each kernel regenerates it, per (batch, head, query, key), from the call's seed.

One Philox call (Triton's `tl.randint4x`, 10 rounds: philox.py, the same bits here) gives
four 32-bit words, which decide a 2 x 2 group of elements: rows i and i + 8 and keys j and
j + 8 of one head, 32 bits each. Rows and keys are numbered in blocks of 16, i = 16 I + 8 a + r
and j = 16 J + 8 c + s (a, c in {0, 1}; r, s in 0 .. 7), and

    words = randint4x(seed, ((n L16 + I) 8 + r) S8 + 8 J + s)     n = b H + h, the head
    u(b, h, i, j) = words[2 a + c]                                 L16 = ceil(L / 16)
    keep(b, h, i, j) = u >= t,     t = round(p 2**32)              S8 = 8 ceil(S / 16)

with H the query heads and L, S the lengths. An element is dropped with probability
p' = t / 2**32 (p to within 2**-33; PyTorch's CUDA flash kernel rounds p to 2**-8), and a kept
one is scaled by 1 / (1 - p'), so that E[Z] = 1 exactly.

Why this grouping: Philox is the kernels' cost per element, and a call must serve several
elements that one GPU thread holds, or the tile's words travel between threads (through
shared memory, every tile, every pass). The matrix units' accumulator gives each thread rows
i and i + 8 of a 16-row slab, and columns j and j + 8 among others, whichever way round a
kernel computes its tile ([queries, keys] in the row passes, [keys, queries] in the column
passes). A group of rows {i, i + 8} x keys {j, j + 8} is held by one thread in both
orientations, so Triton lays the Philox words out where the tile needs them and moves none.
The seed is an int64 tensor of one element drawn from PyTorch's generator on the inputs'
device per call (`draw_seed`), so that torch.manual_seed reproduces a run, and a CUDA graph
records the draw and replays a fresh seed each time.

Where Z enters the math (docs/second-order.md, "Dropout"): where P meets V (o, dV, and their
derivatives) and on dP = Z ∘ (dO Vᵀ); the softmax's own terms (lse, D = rowsum(dO ∘ o)) are
unchanged.
"""
import torch

from . import philox

BITS = 32                       # random bits per element: a whole word
GROUP = 16                      # rows and keys come in blocks of 16: two 8-apart pairs
_LEVELS = 2 ** BITS


def threshold(p):
    """t: an element is kept where its random word, unsigned, is >= t (t < 2**32: at p = 1
    kept_scale is 0, so what the word decides no longer matters)."""
    return min(round(p * _LEVELS), _LEVELS - 1)


def dropped_fraction(p):
    """p', the probability that an element is dropped: p rounded to a multiple of 2**-32."""
    return 1.0 if p >= 1 else threshold(p) / _LEVELS


def draw_seed(device):
    """A fresh seed for one call, from PyTorch's generator on `device`."""
    return torch.randint(0, 2 ** 62, (), device=device, dtype=torch.int64)


def seed_value(seed):
    """The seed as a Python int (a tensor is read: the CPU path, tests)."""
    return int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed)


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
    call per group of rows {i, i + 8} and keys {j, j + 8} (16-blocks), one word each. Drawn
    for the 16-blocks around the tile, as a kernel's tile draws them, then cut to it."""
    B, H, L, S = shape
    r0, r1 = rows.start // GROUP * GROUP, -(-rows.stop // GROUP) * GROUP
    c0, c1 = cols.start // GROUP * GROUP, -(-cols.stop // GROUP) * GROUP
    heads = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1, 1)
    # the groups of the blocks: 8 I + r down, 8 J + s across (consecutive over the blocks)
    group_rows = (heads * -(-L // GROUP) + r0 // GROUP) * 8 + torch.arange(
        (r1 - r0) // 2, device=device, dtype=torch.int64).view(-1, 1)
    group_cols = c0 // GROUP * 8 + torch.arange((c1 - c0) // 2, device=device, dtype=torch.int64)
    counters = group_rows * (-(-S // GROUP) * 8) + group_cols
    words = torch.stack(philox.randint4x(seed_value(params.dropout_seed), counters), -1)
    # word 2a + c is row i + 8a, key j + 8c: (I, r, J, s, a, c) -> (I, a, r, J, c, s)
    words = words.view(B, H, (r1 - r0) // GROUP, 8, (c1 - c0) // GROUP, 8, 2, 2)
    words = words.permute(0, 1, 2, 6, 3, 4, 7, 5).reshape(B, H, r1 - r0, c1 - c0)
    tile = words[:, :, rows.start - r0:rows.stop - r0, cols.start - c0:cols.stop - c0]
    return tile >= threshold(params.dropout_p)
