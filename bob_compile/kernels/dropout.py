"""Attention dropout's keep mask, regenerated wherever it is needed, never stored.

With dropout, the attention output is o = (P ∘ Z) V, where P = softmax(scores) and
Z = keep / (1 - p) (SDPA's semantics: kept probabilities scaled up so that the output's
expectation is unchanged). Z is a constant of the call: every order sees the same one, so
each kernel regenerates it, per (batch, head, query, key), from the call's seed:

    keep(b, h, i, j) = randint(seed, ((b H + h) L + i) S + j) >= threshold(p)

with `randint` Triton's counter-based `tl.randint` (philox.py: the same bits here), H the
query heads, L and S the lengths, and threshold(p) = round(p 2**32): an element is dropped
with probability threshold / 2**32, p to within 2**-33. The seed is an int64 tensor of one
element drawn from PyTorch's generator on the inputs' device per call (`draw_seed`), so that
torch.manual_seed reproduces a run, and a CUDA graph records the draw and replays a fresh
seed each time.

Where Z enters the math (docs/second-order.md, "Dropout"): where P meets V (o, dV, and their
derivatives) and on dP = Z ∘ (dO Vᵀ); the softmax's own terms (lse, D = rowsum(dO ∘ o)) are
unchanged.
"""
import torch

from . import philox

_TWO_TO_32 = 2 ** 32


def threshold(p):
    """The uint32 threshold below which an element is dropped."""
    return min(round(p * _TWO_TO_32), _TWO_TO_32)


def draw_seed(device):
    """A fresh seed for one call, from PyTorch's generator on `device`."""
    return torch.randint(0, 2 ** 62, (), device=device, dtype=torch.int64)


def seed_value(seed):
    """The seed as a Python int (a tensor is read: the CPU path, tests)."""
    return int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed)


def keep_scale(params, shape, rows, cols, dtype, device):
    """Z on the tile (:, :, rows, cols) (slices) of a call whose (batch, query heads, L, S) are
    `shape`: keep / (1 - p) in `dtype`, (B, H, rows, cols); None without dropout."""
    if not params.dropout_p:
        return None
    return keep_mask(params, shape, rows, cols, device).to(dtype) * kept_scale(params.dropout_p)


def kept_scale(p):
    """1 / (1 - p), the factor of a kept probability (0 at p = 1: nothing is kept, and the
    output is 0, as F.dropout gives)."""
    return 0.0 if p >= 1 else 1.0 / (1.0 - p)


def keep_mask(params, shape, rows, cols, device):
    """The bool keep mask of the tile (see keep_scale), as the kernels draw it."""
    B, H, L, S = shape
    index = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1, 1)
    i = torch.arange(rows.start, rows.stop, device=device, dtype=torch.int64).view(-1, 1)
    j = torch.arange(cols.start, cols.stop, device=device, dtype=torch.int64)
    words = philox.randint(seed_value(params.dropout_seed), (index * L + i) * S + j)
    return words >= threshold(params.dropout_p)
