"""Attention dropout's keep mask, regenerated wherever it is needed, never stored.

With dropout, the attention output is o = (P ∘ Z) V, where P = softmax(scores) and
Z = keep / (1 - p) (SDPA's semantics: kept probabilities scaled up so that the output's
expectation is unchanged). Z is a constant of the call: every order sees the same one, so
each kernel regenerates it, per (batch, head, query, key), from the call's seed.

One Philox call (Triton's `tl.randint4x`, 10 rounds: philox.py, the same bits here) gives
128 random bits, which decide 8 neighbouring keys of a row, 16 bits each:

    words = randint4x(seed, ((b H + h) L + i) G + j // 8)        G = ceil(S / 8) per row
    u(b, h, i, j) = 16 bits number j % 8 of words (word (j % 8) // 2, low half first)
    keep(b, h, i, j) = u >= t,     t = round(p 2**16)

with H the query heads and L, S the lengths. An element is dropped with probability
p' = t / 2**16 (p to within 2**-17; PyTorch's CUDA flash kernel rounds p to 2**-8), and a kept
one is scaled by 1 / (1 - p'), so that E[Z] = 1 exactly. Philox is the kernels' cost per
element: 16 bits per element instead of a whole call per element makes it 8 times cheaper.
The seed is an int64 tensor of one element drawn from PyTorch's generator on the inputs'
device per call (`draw_seed`), so that torch.manual_seed reproduces a run, and a CUDA graph
records the draw and replays a fresh seed each time.

Where Z enters the math (docs/second-order.md, "Dropout"): where P meets V (o, dV, and their
derivatives) and on dP = Z ∘ (dO Vᵀ); the softmax's own terms (lse, D = rowsum(dO ∘ o)) are
unchanged.
"""
import torch

from . import philox

BITS = 16                       # random bits per element
PER_CALL = 128 // BITS          # elements of a row decided by one Philox call (4 words)
_LEVELS = 2 ** BITS


def threshold(p):
    """t: an element is kept where its 16 random bits, as an integer, are >= t."""
    return min(round(p * _LEVELS), _LEVELS)


def dropped_fraction(p):
    """p', the probability that an element is dropped: p rounded to a multiple of 2**-16."""
    return threshold(p) / _LEVELS


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
    call per PER_CALL columns, its words cut into 16-bit numbers in column order."""
    B, H, L, S = shape
    groups_per_row = -(-S // PER_CALL)
    first, last = cols.start // PER_CALL, -(-cols.stop // PER_CALL)
    index = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1, 1)
    i = torch.arange(rows.start, rows.stop, device=device, dtype=torch.int64).view(-1, 1)
    group = torch.arange(first, last, device=device, dtype=torch.int64)
    words = philox.randint4x(seed_value(params.dropout_seed),
                             (index * L + i) * groups_per_row + group)
    halves = [part for word in words for part in (word & 0xFFFF, word >> BITS)]
    numbers = torch.stack(halves, -1).flatten(-2)        # (B, H, rows, groups * PER_CALL)
    start = cols.start - first * PER_CALL
    return numbers[..., start:start + cols.stop - cols.start] >= threshold(params.dropout_p)
