"""Masks given as each query row's interval of keys, never as an L x S tensor.

A mask whose every query row sees one interval of keys [first, end) and every key is seen
by one interval of queries (a sliding window, causal packed documents, prefix-LM, a
causal or padding mask) is carried as the Triton kernels' summary of it
(triton_masks.py's KEY_RANGE with the structure KEY_INTERVALS):

    (B or 1, H or 1, 1, 3 + 2L + 2S) int32: first, end (the keys any query sees),
    KEY_INTERVALS, then each query row's (first, end) of its keys, then each key's (first,
    end) of the queries that see it ((S, 0) and (L, 0) where none)

O(L + S) per distinct batch entry and head. The ops take that int32 tensor where they take
a mask (ops.flat_mask; bob_compile/flex.py makes it from a BlockMask); AttentionParams
then holds a KeyIntervals, which the Triton kernels apply from indices (the mask is never
read) and the PyTorch paths (blockwise, reference) expand one tile at a time.
"""
import torch

# a summary's structure (triton_masks.py; the kernels test these numbers: tiles.py)
READ_THE_MASK, KEYS_IN_RANGE, KEYS_IN_RANGE_CAUSAL, READ_THE_MASK_CAUSAL, KEY_INTERVALS = 0, 1, 2, 3, 4
FROM_INDICES = (KEYS_IN_RANGE, KEYS_IN_RANGE_CAUSAL, KEY_INTERVALS)   # tiles.mask_from_indices


def summary_length(L, S):
    """The summary's last dimension for L query rows and S keys."""
    return 3 + 2 * L + 2 * S


def summary_of_intervals(row_first, row_end, key_first, key_end):
    """The int32 summary (..., 1, 3 + 2L + 2S) of a mask given by its rows' key intervals
    (..., L) and its keys' query intervals (..., S), empty ones as (S, 0) and (L, 0). The
    caller vouches that these describe one mask (each row's interval and each key's
    interval list the same visible pairs)."""
    first = row_first.amin(-1, keepdim=True) if row_first.shape[-1] else \
        row_first.new_zeros(*row_first.shape[:-1], 1)
    end = row_end.amax(-1, keepdim=True) if row_end.shape[-1] else first
    first = torch.minimum(first, end)
    structure = torch.full_like(first, KEY_INTERVALS)
    rows = torch.stack((row_first, row_end), -1).flatten(-2)
    keys = torch.stack((key_first, key_end), -1).flatten(-2)
    summary = torch.cat((first, end, structure, rows, keys), -1).to(torch.int32)
    return summary.unsqueeze(-2)


class KeyIntervals:
    """A boolean (B, Hq, L, S) mask held as its summary (module docstring): what
    AttentionParams.mask is for such a mask. Indexing it as [:, :, rows, cols] (slices)
    gives that tile of the mask; dense() the whole of it (tests, the reference)."""
    dtype = torch.bool
    requires_grad = False

    def __init__(self, summary, L, S):
        self.summary, self.L, self.S = summary, L, S
        self.shape = torch.Size((*summary.shape[:2], L, S))
        self.device = summary.device

    @classmethod
    def of(cls, summary, batch, heads, L, S):
        """From an int32 summary (B or 1, Hq or 1, 1, 3 + 2L + 2S), checked, for a call of
        `batch` entries and `heads` query heads."""
        expected = summary_length(L, S)
        if summary.dim() != 4 or summary.shape[2] != 1 or summary.shape[3] != expected \
                or summary.shape[0] not in (1, batch) or summary.shape[1] not in (1, heads):
            raise RuntimeError(
                f"bob_compile attention ops: an int32 mask is a mask's key intervals "
                f"(bob_compile/kernels/interval_masks.py), (B or 1, H or 1, 1, {expected}) "
                f"for {L} queries and {S} keys; got {tuple(summary.shape)}")
        return cls(summary.expand(batch, heads, 1, expected), L, S)

    def dim(self):
        return 4

    def _ranges(self, start, stop, offset):
        """(first, end) of entries start .. stop of the list at `offset` in the summary."""
        pairs = self.summary[:, :, 0, offset + 2 * start:offset + 2 * stop]
        return pairs[..., 0::2].long(), pairs[..., 1::2].long()

    def __getitem__(self, index):
        if not (isinstance(index, tuple) and len(index) == 4 and
                all(isinstance(i, slice) for i in index) and index[0] == slice(None) and
                index[1] == slice(None) and index[2].step is None and index[3].step is None):
            raise IndexError("KeyIntervals: index with [:, :, rows, cols] (slices)")
        rows = range(*index[2].indices(self.L))
        cols = range(*index[3].indices(self.S))
        first, end = self._ranges(rows.start, rows.stop, 3)
        keys = torch.arange(cols.start, cols.stop, device=self.device)
        return (keys >= first[..., None]) & (keys < end[..., None])

    def dense(self):
        return self[:, :, :, :]

    def __repr__(self):
        return f"KeyIntervals{tuple(self.shape)}"
