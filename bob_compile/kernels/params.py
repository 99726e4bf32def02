"""The attention parameters every kernel takes besides its tensors, in one place.

Each implementation's contract functions (bob_compile/kernels/__init__.py) take one AttentionParams
after their tensors, and read the fields they need by name, so that a new parameter (a
sliding window, a mask) is one field here and one read per implementation, and passing
scale where causal belongs (or the reverse) is an error at once, not a wrong kernel.
"""
import torch

from .block_sparse_masks import BlockSparseMask
from .interval_masks import KeyIntervals

# A floating mask value at or below this hides its key, as -inf does. Masks filled with a
# large finite value (HF eager's finfo(dtype).min, the common -1e9) mean "hidden", but a
# row whose every key is so filled would otherwise come out as a uniform average of all its
# values: plain softmax rounds the scores away next to the fill, and an lse-based kernel
# (ours, PyTorch's fused ones) cannot even represent that row's lse (fill + log S rounds to
# the fill), so its derivatives would be wrong. With this rule such rows see no key and are
# zeros, as SDPA gives for -inf masks. exp(-1e4) is 0 in every dtype, so nothing else changes.
HIDDEN_AT_OR_BELOW = -1e4


class AttentionParams:
    """scale: the factor of the scores q·k (a float; SymFloat while tracing);
    causal: top-left causal mask (query i sees keys j <= i);
    mask: None, or a tensor of shape (B, Hq, L, S) (broadcast dims may have stride 0) that
    no derivative flows into: bool (True: the key is visible, SDPA's convention) or
    floating (added to the scaled scores; -inf, or any value <= HIDDEN_AT_OR_BELOW, hides
    a key); or a boolean mask given by its key intervals (interval_masks.KeyIntervals)
    or tile by tile (block_sparse_masks.BlockSparseMask), never L x S. It applies on top of
    causal;
    keep_mask_summary: whether the Triton kernels may keep this call's summary of its mask
    for the backwards of the same call (triton_masks.py, "One summary per forward"): only
    plain eager calls, where no compiled graph or CUDA graph owns the memory;
    mask_summary: the mask's summary (triton_masks.mask_summary) where the caller made it
    already (the C++ node keeps its forward's for the backwards: bob_compile/eager/node.py);
    dropout_p: the attention dropout's probability (0: none), with dropout_seed, the call's
    seed (an int64 tensor of one element, or an int): dropout.py;
    softcap: 0 (none) or c > 0: the scores are soft-capped before any mask applies,
    T = c tanh(U / c) with U = scale q·k (Gemma 2; docs/second-order.md, "Score transforms").
    Keyword-only, checked."""
    __slots__ = ("scale", "causal", "mask", "keep_mask_summary", "mask_summary", "dropout_p",
                 "dropout_seed", "softcap")

    def __init__(self, *, scale, causal, mask=None, keep_mask_summary=False, mask_summary=None,
                 dropout_p=0.0, dropout_seed=None, softcap=0.0):
        if causal is not True and causal is not False:
            raise TypeError(f"AttentionParams: causal must be a bool, got {causal!r}")
        if scale is True or scale is False:
            raise TypeError(f"AttentionParams: scale must be a number, got {scale!r}")
        if mask is not None and not (isinstance(mask, (torch.Tensor, KeyIntervals,
                                                       BlockSparseMask))
                                     and mask.dim() == 4):
            raise TypeError(f"AttentionParams: mask must be None, a 4-D tensor, "
                            f"KeyIntervals or BlockSparseMask, got "
                            f"{type(mask).__name__}{tuple(getattr(mask, 'shape', ()))}")
        self.scale, self.causal, self.mask = scale, causal, mask
        self.keep_mask_summary = keep_mask_summary
        if mask_summary is not None and mask is None:
            raise TypeError("AttentionParams: mask_summary without a mask")
        self.mask_summary = mask_summary
        if dropout_p and dropout_seed is None:
            raise TypeError("AttentionParams: dropout_p without a dropout_seed")
        if not 0.0 <= dropout_p <= 1.0:
            raise ValueError(f"AttentionParams: dropout_p must be in [0, 1], got {dropout_p!r}")
        self.dropout_p, self.dropout_seed = float(dropout_p), dropout_seed
        if not (softcap == 0 or softcap > 0):
            raise ValueError(f"AttentionParams: softcap must be 0 (none) or positive, got "
                             f"{softcap!r}")
        self.softcap = softcap

    def without_dropout(self):
        """The same parameters without dropout (self where it has none)."""
        if not self.dropout_p:
            return self
        return AttentionParams(scale=self.scale, causal=self.causal, mask=self.mask,
                               keep_mask_summary=self.keep_mask_summary,
                               mask_summary=self.mask_summary, softcap=self.softcap)

    def __repr__(self):
        mask = "None" if self.mask is None else f"<{self.mask.dtype} {tuple(self.mask.shape)}>"
        dropout = f", dropout_p={self.dropout_p!r}" if self.dropout_p else ""
        softcap = f", softcap={self.softcap!r}" if self.softcap else ""
        return (f"AttentionParams(scale={self.scale!r}, causal={self.causal!r}, mask={mask}"
                f"{dropout}{softcap})")

    def __eq__(self, other):
        return isinstance(other, AttentionParams) and \
            (self.scale, self.causal, self.dropout_p, self.softcap) == \
            (other.scale, other.causal, other.dropout_p, other.softcap) and \
            self.mask is other.mask and self.dropout_seed is other.dropout_seed

    def __hash__(self):
        return hash((self.scale, self.causal, id(self.mask), self.dropout_p,
                     id(self.dropout_seed), self.softcap))


# A learned bias (a floating mask that requires grad) gets cotangents. The implementations
# take the mask as (B, Hq, L, S) with the dims it broadcasts at stride 0 (ops.flat_mask), and
# return its cotangents in its own shape: those dims of size 1.
def mask_own_shape(mask):
    """The (B, Hq, L, S) mask's own shape: 1 on its broadcast (stride-0) dims."""
    return [1 if mask.stride(d) == 0 else n for d, n in enumerate(mask.shape)]


def sum_to_mask(t, mask):
    """A score-shaped cotangent t summed over the mask's broadcast dims (keepdim), where t
    still spans them: in mask_own_shape(mask)."""
    dims = [d for d in range(4) if mask.stride(d) == 0 and t.shape[d] > 1]
    return t.sum(dims, keepdim=True) if dims else t

