"""Masks given tile by tile, never as an L x S tensor, with a relative-position bias or none.

A boolean mask that is not one interval of keys per query (interval_masks.py), such as a
dilated or strided pattern, several windows per row or a random block-sparse layout, is
carried as a FlexAttention BlockMask describes it: which (query block, key block) tiles are
empty, which are full, and the pairs of the partial ones. Memory O(L S / (block_q block_k))
for the tables plus block_q x block_k bytes per *distinct* partial tile (a dilated mask's
partial tiles are all alike: stored once). A bias that depends on the query and the key
only through q - k (ALiBi, relative-position tables, T5's buckets; flex.py finds such
score_mods) comes with it as one row of L + S - 1 values per (batch entry, head), added to
each visible score: then the mask is additive (its dtype float32), and a bias at or below
-1e4 hides its pair, as an additive mask's value does (params.HIDDEN_AT_OR_BELOW). The
kernels add it where they form their scores, in every loop (RELATIVE: tiles.
add_relative_bias), so that a mask of intervals keeps the loops that never read it.

One uint8 tensor holds it all, so that it passes through the ops as their mask argument
(ops.flat_mask knows it by its first word) and is saved for the backwards like any mask:

    header   HEADER_WORDS int64: MAGIC, Bm, Hm, L, S, block_q, block_k, q_blocks,
             key_blocks, then the byte offsets of the summary, the tables, the tiles and
             the bias (0: none), the bytes of one table, the number of tiles, the bias's
             bytes per value
    summary  int32 (Bm, Hm, 1, 3 + 2L + 2S): triton_masks.py's summary of the mask (its
             structure READ_THE_MASK or READ_THE_MASK_CAUSAL: the kernels loop over the key
             blocks each row block sees, and skip those above the diagonal where none is seen;
             with a bias, KEY_INTERVALS for the (batch, head)s whose rows and keys are
             intervals: applied from indices, the tiles never read, the bias added apart)
    tables   one per (batch entry, head), Bm x Hm of them, int32: log2 block_q, log2
             block_k (powers of two), key_blocks, the byte offsets from this table to the
             tiles and to its bias row (0: none), then the (q_blocks, key_blocks) entries:
             EMPTY, FULL, or the index of the tile
    tiles    (number of tiles, block_q, block_k) bool, rows past L and keys past S False
    bias     (Bm, Hm, L + S - 1): the bias of a pair (q, k) at q - k + S - 1, float32
             (float64 for float64 calls, which the Triton kernels never take)

Each part starts 8-byte aligned. The Triton kernels read a (batch, head)'s table through
their mask pointer (MASK_KIND BLOCK_SPARSE_MASK: tiles._read_block_sparse); the PyTorch
paths (blockwise, reference) index [:, :, rows, cols] tiles of it as of a mask tensor.
"""
import weakref

import torch

from .interval_masks import (KEY_INTERVALS, READ_THE_MASK, READ_THE_MASK_CAUSAL,
                             summary_length, summary_of_intervals)

EMPTY, FULL = -1, -2                 # a table entry that is not a tile's index
MAGIC = 0x656C69745F626F62          # "bob_tile", little-endian
HEADER_WORDS = 16
_TABLE_HEAD = 6                      # int32 words of a table before its entries


def powers_of_two(block_size):
    """Whether every block size is a power of two (what the kernels take)."""
    return all(n > 0 and n & (n - 1) == 0 for n in block_size)


def aligned(nbytes):
    return -(-nbytes // 8) * 8


class BlockSparseMask:
    """A boolean (B, Hq, L, S) mask held tile by tile, or with a relative bias an additive
    one (module docstring): what AttentionParams.mask is for such a mask. `data` is the one
    uint8 tensor; `sizes` the header's words after the magic (read from `data` where not
    given)."""
    requires_grad = False

    def __init__(self, data, sizes=None, batch=None, heads=None):
        if sizes is None:
            sizes = data[:8 * HEADER_WORDS].cpu().view(torch.int64).tolist()
            if sizes[0] != MAGIC:
                raise RuntimeError("bob_compile attention ops: a uint8 mask is a BlockMask "
                                   "packed by bob_compile.block_masks.pack or a tile-by-tile "
                                   "mask (kernels/block_sparse_masks.py); this one is neither")
            sizes = sizes[1:]
        self.data, self.sizes = data, tuple(sizes)
        (Bm, Hm, L, S, block_q, block_k, q_blocks, key_blocks, summary_at, tables_at, tiles_at,
         bias_at, table_bytes, tiles, bias_bytes) = self.sizes
        self.L, self.S, self.block_size = L, S, (block_q, block_k)
        batch, heads = batch or Bm, heads or Hm
        if Bm not in (1, batch) or Hm not in (1, heads):
            raise RuntimeError(f"bob_compile attention ops: a tile-by-tile mask of "
                               f"{(Bm, Hm)} batch entries and heads reached a call of "
                               f"{(batch, heads)}")
        self.shape = torch.Size((batch, heads, L, S))
        self.device = data.device
        width = summary_length(L, S)
        self.summary = data[summary_at:summary_at + 4 * Bm * Hm * width].view(
            torch.int32).view(Bm, Hm, 1, width)
        tables = data[tables_at:tables_at + Bm * Hm * table_bytes].view(torch.int32).view(
            Bm, Hm, table_bytes // 4)
        self.entries = tables[..., _TABLE_HEAD:_TABLE_HEAD + q_blocks * key_blocks].view(
            Bm, Hm, q_blocks, key_blocks)
        self.tiles = data[tiles_at:tiles_at + tiles * block_q * block_k].view(torch.bool).view(
            tiles, block_q, block_k)
        self.dtype = torch.bool if bias_at == 0 else torch.float32 if bias_bytes == 4 else \
            torch.float64
        self.relative_bias = data[bias_at:bias_at + bias_bytes * Bm * Hm * (L + S - 1)].view(
            self.dtype).view(Bm, Hm, L + S - 1) if bias_at else None
        self._tables_at, self._table_bytes = tables_at, table_bytes

    def for_call(self, batch, heads):
        """This mask for a call of `batch` entries and `heads` query heads (checked)."""
        if self.shape[:2] == (batch, heads):
            return self
        return BlockSparseMask(self.data, self.sizes, batch, heads)

    # ---------------------------------------------------------------- what the kernels take
    def kernel_mask(self):
        """(B, Hq, 1, 1) uint8 view whose element (b, h) is that (batch, head)'s table: the
        kernels' MASK (their b and h strides step from table to table, 0 on broadcast dims)."""
        Bm, Hm = self.summary.shape[:2]
        table = self._table_bytes
        return self.data[self._tables_at:].as_strided(
            (*self.shape[:2], 1, 1), (Hm * table if Bm > 1 else 0, table if Hm > 1 else 0,
                                      1, 1))

    def kernel_summary(self):
        return self.summary.expand(*self.shape[:2], 1, -1)

    # ---------------------------------------------------------------- as a mask tensor
    def dim(self):
        return 4

    def __getitem__(self, index):
        if not (isinstance(index, tuple) and len(index) == 4 and
                all(isinstance(i, slice) for i in index) and index[0] == slice(None) and
                index[1] == slice(None) and index[2].step is None and index[3].step is None):
            raise IndexError("BlockSparseMask: index with [:, :, rows, cols] (slices)")
        rows = torch.arange(*index[2].indices(self.L), device=self.device)
        cols = torch.arange(*index[3].indices(self.S), device=self.device)
        block_q, block_k = self.block_size
        entry = self.entries[..., (rows // block_q)[:, None], (cols // block_k)[None, :]]
        if self.tiles.shape[0]:
            in_tile = self.tiles[entry.clamp_min(0).long(), (rows % block_q)[:, None],
                                 (cols % block_k)[None, :]]
            visible = (entry == FULL) | ((entry >= 0) & in_tile)
        else:
            visible = entry == FULL
        if self.relative_bias is not None:
            bias = self.relative_bias[..., rows[:, None] - cols[None, :] + self.S - 1]
            visible = torch.where(visible, bias, float("-inf"))
        return visible.expand(*self.shape[:2], -1, -1)

    def dense(self):
        return self[:, :, :, :]

    def nbytes(self):
        return self.data.numel()

    def __repr__(self):
        return (f"BlockSparseMask{tuple(self.shape)}, blocks {self.block_size}, "
                f"{self.tiles.shape[0]} distinct partial tiles")


def built(data):
    """The BlockSparseMask whose data is this very tensor, built in this process and alive;
    else None (its header then tells: BlockSparseMask(data))."""
    kept = _built.get(id(data))
    return BlockSparseMask(data, kept[1]) if kept is not None and kept[0]() is data else None


_built = {}       # id(data) -> (weakref to data, its header's sizes): no header read


def build(entries, tiles, row_stats, key_stats, L, S, block_size, relative_bias=None):
    """The BlockSparseMask of tile `entries` ((Bm, Hm, q_blocks, key_blocks) int: EMPTY,
    FULL, or an index into `tiles`, (n, block_q, block_k) bool) whose rows' keys and keys'
    queries span `row_stats` and `key_stats` ((first, end, count), each (Bm, Hm, L) and
    (Bm, Hm, S) int: (S, 0, 0) and (L, 0, 0) where none), with `relative_bias` ((Bb, Hb,
    L + S - 1), its pair (q, k) at q - k + S - 1) or none. Identical tiles are stored once,
    and a partial tile that turns out empty or full becomes EMPTY or FULL."""
    device = entries.device
    block_q, block_k = block_size
    if not (powers_of_two(block_size)):
        raise ValueError(f"block_sparse_masks.build: blocks of {block_size}; the kernels "
                         f"take powers of two")
    entries, tiles = _distinct_tiles(entries.to(torch.int64), tiles)
    summary = _summary(row_stats, key_stats, L, S,
                       intervals_from_indices=relative_bias is not None)
    if relative_bias is not None:      # one table and one bias row per (batch entry, head)
        sizes = torch.broadcast_shapes(entries.shape[:2], relative_bias.shape[:2])
        entries = entries.expand(*sizes, -1, -1)
        summary = summary.expand(*sizes, -1, -1)
        relative_bias = relative_bias.to(torch.promote_types(
            relative_bias.dtype, torch.float32)).expand(*sizes, -1)
    Bm, Hm, q_blocks, key_blocks = entries.shape
    width = summary_length(L, S)
    table_bytes = aligned(4 * (_TABLE_HEAD + q_blocks * key_blocks))
    summary_at = 8 * HEADER_WORDS
    tables_at = summary_at + aligned(4 * Bm * Hm * width)
    tiles_at = tables_at + Bm * Hm * table_bytes
    bias_at = 0 if relative_bias is None else aligned(tiles_at + tiles.numel())
    bias_bytes = 0 if relative_bias is None else relative_bias.element_size()
    total = tiles_at + tiles.numel() if relative_bias is None else \
        bias_at + bias_bytes * relative_bias.numel()
    sizes = (Bm, Hm, L, S, block_q, block_k, q_blocks, key_blocks, summary_at, tables_at,
             tiles_at, bias_at, table_bytes, tiles.shape[0], bias_bytes)
    data = torch.zeros(total, dtype=torch.uint8, device=device)
    data[:summary_at].view(torch.int64).copy_(torch.tensor((MAGIC, *sizes)))
    data[summary_at:summary_at + 4 * summary.numel()].view(torch.int32).copy_(
        summary.reshape(-1))
    tables = data[tables_at:tiles_at].view(torch.int32).view(Bm, Hm, table_bytes // 4)
    # each table's offsets to the tiles and to its bias row, from where that table starts
    table_at = tables_at + table_bytes * torch.arange(Bm * Hm, device=device)
    to_bias = torch.zeros_like(table_at) if relative_bias is None else \
        bias_at + bias_bytes * (L + S - 1) * torch.arange(Bm * Hm, device=device) - table_at
    head = torch.stack((torch.full_like(table_at, block_q.bit_length() - 1),
                        torch.full_like(table_at, block_k.bit_length() - 1),
                        torch.full_like(table_at, key_blocks), tiles_at - table_at, to_bias,
                        torch.zeros_like(table_at)), -1)
    tables[..., :_TABLE_HEAD].copy_(head.view(Bm, Hm, _TABLE_HEAD))
    tables[..., _TABLE_HEAD:_TABLE_HEAD + q_blocks * key_blocks].copy_(entries.flatten(2))
    data[tiles_at:tiles_at + tiles.numel()].view(torch.bool).copy_(tiles.reshape(-1))
    if relative_bias is not None:
        data[bias_at:].view(relative_bias.dtype).copy_(relative_bias.reshape(-1))
    _built[id(data)] = (weakref.ref(data), sizes)
    weakref.finalize(data, _built.pop, id(data), None)
    return BlockSparseMask(data, sizes)


def _distinct_tiles(entries, tiles):
    """(entries, tiles) with each distinct tile stored once, a tile without a visible pair
    EMPTY and one with every pair visible FULL (a last block's tile, False past L or S,
    stays a tile). Tiles are grouped by a fingerprint of their bytes (a sort of n numbers,
    not of n rows of block_q x block_k), checked exactly; rows compared whole only where two
    tiles' fingerprints collide."""
    if tiles.shape[0] == 0:
        return entries, tiles
    flat = tiles.reshape(tiles.shape[0], -1)
    inverse = _groups(flat)
    first = _first_of_each_group(inverse)
    if not torch.equal(flat, flat[first[inverse]]):        # a collision: exact grouping
        inverse = torch.unique(flat, dim=0, return_inverse=True)[1]
        first = _first_of_each_group(inverse)
    distinct = flat[first]
    count = distinct.sum(-1)
    kept = (count > 0) & (count < distinct.shape[-1])
    status = torch.where(kept, torch.cumsum(kept, 0) - 1,
                         torch.where(count > 0, FULL, EMPTY))
    entries = torch.where(entries >= 0, status[inverse][entries.clamp_min(0)], entries)
    return entries, distinct[kept].view(-1, *tiles.shape[1:])


def _first_of_each_group(inverse):
    """For group numbers 0 .. g - 1 of n rows, the first row of each group."""
    n = inverse.shape[0]
    first = torch.full((int(inverse.max()) + 1,), n, device=inverse.device)
    return first.scatter_reduce(0, inverse, torch.arange(n, device=inverse.device), "amin")


def _groups(flat):
    """Group numbers of the rows of a (n, m) bool tensor by a 64-bit fingerprint: the
    weighted sum of their 8-byte words, odd pseudo-random weights, wrapping."""
    words = flat.shape[1] // 8 * 8
    packed = flat[:, :words].contiguous().view(torch.uint8).view(torch.int64) if words else \
        flat.new_zeros(flat.shape[0], 0, dtype=torch.int64)
    rest = flat[:, words:].to(torch.int64)
    columns = torch.cat((packed, rest), 1)
    generator = torch.Generator().manual_seed(0x5EED)
    weights = torch.randint(-(1 << 62), 1 << 62, (columns.shape[1],), generator=generator)
    fingerprint = (columns * (weights.to(flat.device) | 1)).sum(-1)
    return torch.unique(fingerprint, return_inverse=True)[1]


def _summary(row_stats, key_stats, L, S, intervals_from_indices=False):
    """triton_masks.py's summary of a mask held tile by tile: interval_masks'
    summary_of_intervals with the structure READ_THE_MASK_CAUSAL where no row sees a key
    above the diagonal, else READ_THE_MASK; with `intervals_from_indices` (a relative bias,
    which the kernels add apart from the mask: tiles.add_relative_bias), KEY_INTERVALS for
    the (batch, head)s whose rows each see one interval of keys and whose keys are each seen
    by one interval of queries (causal, a window, documents), applied from indices and never
    read."""
    row_first, row_end, row_count = row_stats
    key_first, key_end, key_count = key_stats
    summary = summary_of_intervals(row_first, row_end, key_first, key_end)
    rows = torch.arange(1, L + 1, device=row_end.device)
    below_only = ((row_count == 0) | (row_end <= rows)).all(-1)
    structure = torch.where(below_only, READ_THE_MASK_CAUSAL, READ_THE_MASK)
    if intervals_from_indices:
        intervals = one_interval_each(row_stats) & one_interval_each(key_stats)
        structure = torch.where(intervals, KEY_INTERVALS, structure)
    summary[..., 0, 2] = structure
    return summary


def one_interval_each(stats):
    """Whether the visible pairs of each row (or key) are the one interval [first, end) or
    none, over the last dim of (first, end, count): per (batch entry, head)."""
    first, end, count = stats
    return ((count == 0) | (count == end - first)).all(-1)
