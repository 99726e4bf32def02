"""Mask tensors for the Triton kernels: their kind, and what each (batch, head)'s mask is.

The kernels take a mask (bob_compile/kernels/params.py) as MASK, its kind as the constexpr MASK_KIND,
and a summary per (batch, head) as KEY_RANGE, (B, Hq, 1, 3 + 2L + 2S) int32:

    first, end   the keys any query sees are in [first, end) ([0, 0): none); the kernels
                 skip the key blocks outside it, so a padded batch costs its visible keys;
    structure    READ_THE_MASK, or KEYS_IN_RANGE: every query sees exactly [first, end)
                 (key padding), or KEYS_IN_RANGE_CAUSAL: query i sees exactly the keys of
                 [first, end) at or below i (padding and a top-left causal mask folded into
                 one tensor, as Hugging Face builds its 4-D masks); in both, the mask adds
                 nothing to a visible score. Such masks are applied from indices and never
                 read, and the causal form also skips the key blocks above the diagonal
                 (tiles.apply_mask_tile, key_loops_within_mask,
                 row_loops_within_mask). READ_THE_MASK_CAUSAL: any other mask whose rows
                 see no key above the diagonal (a causal mask with holes, packed sequences'
                 block-diagonal causal masks): read, with the blocks above the diagonal
                 skipped as well. KEY_INTERVALS: every query sees exactly its own interval
                 of keys and every key is seen by exactly an interval of queries (a sliding
                 window, causal packed documents, prefix-LM), the mask adding nothing to a
                 visible score: applied from the ranges below, never read.
    ranges       then, per query row, the (first, end) of the keys it sees, and per key,
                 the (first, end) of the queries that see it: a read mask's row block
                 loops over the key blocks its own rows see, and a key block over the
                 query blocks that see it (a sliding window or packed documents cost
                 their visible blocks, not the whole (causal) square).

The summary is computed on the device by every forward, by three small kernels (per-row
counts, per-column counts, then per (batch, head)) without a host synchronization; the
backwards of that call reuse it ("One summary per forward" below). Nothing about a mask's
contents is carried from one forward to the next, as a write through `.data` would not
show in its version counter and a CUDA graph's outputs reuse their memory.
`summarize_with_torch` is the same summary in PyTorch ops: the tests' reference, and the
fallback where Triton cannot build the kernels.
"""
import logging
import weakref

import torch
import triton
import triton.language as tl

from .block_sparse_masks import BlockSparseMask
from .interval_masks import (FROM_INDICES, KEY_INTERVALS, KEYS_IN_RANGE, KEYS_IN_RANGE_CAUSAL,
                             READ_THE_MASK, READ_THE_MASK_CAUSAL, KeyIntervals)
from .params import HIDDEN_AT_OR_BELOW
from .launching import fixed_plan, strides_of
from .tiles import blocks
from .tuning import BUILD_ERRORS, error_summary, interpreting

log = logging.getLogger("bob_compile.kernels")

# the kernels' MASK_KIND: a bool or an additive mask tensor, or a BlockSparseMask's tables
NO_MASK, BOOL_MASK, ADDITIVE_MASK, BLOCK_SPARSE_MASK = 0, 1, 2, 3


def mask_kind_and_tensor(params, fallback, reuse=False):
    """(MASK_KIND, the tensor to pass as MASK, KEY_RANGE = mask_summary(mask)): `fallback`
    (never read) for both without a mask. The caller's summary where params carries one;
    reuse=True (the backwards): the summary the last forward made of this very mask, if
    there is one (see "One summary per forward" below)."""
    mask = params.mask
    if mask is None:
        return NO_MASK, fallback, fallback
    if isinstance(mask, KeyIntervals):        # its summary is all there is (never read)
        return BOOL_MASK, mask.summary, mask.summary
    if isinstance(mask, BlockSparseMask):     # its summary made with it
        if mask.dtype == torch.float64:
            raise RuntimeError("bob_compile: a float64 relative bias reached the Triton "
                               "kernels, which take float32 (float64 calls run blockwise)")
        return BLOCK_SPARSE_MASK, mask.kernel_mask(), mask.kernel_summary()
    kind = BOOL_MASK if mask.dtype == torch.bool else ADDITIVE_MASK
    if params.mask_summary is not None:
        return kind, mask, params.mask_summary
    if not params.keep_mask_summary:
        return kind, mask, mask_summary(mask)
    return kind, mask, summary_of_forward(mask, reuse)


# --------------------------------------------------------------------------------------
# One summary per forward
# --------------------------------------------------------------------------------------
# A forward's backward, BoB and second backward receive the very mask tensor the forward
# read (autograd saved it, and refuses it if it was changed in place since), so they reuse
# the forward's summary instead of making three more (a second-order step made four, each
# two launches and a read of the whole mask). The summary is kept per mask view: the object
# at the root of the view (`_base`), its version and address, and the view's geometry.
# Every forward summarizes afresh, so nothing is carried from one step to the next (a write
# through `.data` between steps does not show in the version); within a step, a backward
# then sees the summary of the mask its forward read. Only for plain eager calls
# (AttentionParams.keep_mask_summary): a summary kept from a compiled graph's call would be
# memory of its CUDA-graph pool that the graph does not account for (inductor's CUDA-graph
# trees refuse to record then), and never while a CUDA graph is being captured.
_forward_summaries = {}      # id(root) -> (weakref to root, key, summary)
_FORWARD_SUMMARIES_LIMIT = 64


def _summary_key(mask):
    root = mask._base if mask._base is not None else mask
    return root, (root._version, root.data_ptr(), mask.shape, mask.stride(),
                  mask.storage_offset(), mask.dtype, mask.device)


def summary_of_forward(mask, reuse):
    """mask_summary(mask); for a backward (reuse) the one its forward made, if kept."""
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return mask_summary(mask)
    root, key = _summary_key(mask)
    if reuse:
        kept = _forward_summaries.get(id(root))
        if kept is not None and kept[0]() is root and kept[1] == key:
            return kept[2]
    summary = mask_summary(mask)
    if len(_forward_summaries) >= _FORWARD_SUMMARIES_LIMIT:
        _forward_summaries.clear()
    _forward_summaries[id(root)] = (weakref.ref(root), key, summary)
    return summary


def has_relative_bias(params):
    """Whether the call's mask is tiles with a relative bias, which every kernel loop adds to
    its scores (RELATIVE: tiles.add_relative_bias), the mask applying as its summary says."""
    return isinstance(params.mask, BlockSparseMask) and params.mask.relative_bias is not None


def relative_flags(relative):
    """The part of a launch plan's flags (its tuning key) that a relative bias adds."""
    return ("relative",) if relative else ()


def mask_paths(kind):
    """A kernel's launches for a mask kind (tiles.py, MASK_PATH): one without a
    mask; with one, a launch for the (batch, head)s whose mask applies from indices and one
    for those whose mask is read."""
    return (0,) if kind == NO_MASK else (1, 2)


def mask_path_has_work(summary, path, kv_group=1):
    """Whether a MASK_PATH launch has any (batch, head) to do, from the summary (a host
    synchronization: only while a launch config is being tuned). kv_group > 1: a
    key-block-major kernel's, whose programs take a GQA group (the key-range launch only the
    groups whose heads' masks are all key ranges)."""
    structure = summary[..., 0, 2]
    from_indices = (structure[..., None] == structure.new_tensor(FROM_INDICES)).any(-1)
    if path == 1:
        return bool(from_indices.unflatten(1, (-1, kv_group)).all(-1).any())
    return bool((~from_indices).any())


def mask_path_work(summary, path, kv_group=1):
    """launch_plan's has_work for a kernel's MASK_PATH launch (None without a mask)."""
    return None if path == 0 else lambda: mask_path_has_work(summary, path, kv_group)


def mask_flags(kind, path=0):
    """The launch-key flags of a mask kind and path (none without a mask: unmasked keys
    unchanged)."""
    return () if kind == NO_MASK else (f"mask{kind}", f"path{path}")


def _stored(mask):
    """The mask's own elements: broadcast (stride-0) head and row dims read once; and
    whether its rows are the query rows themselves (not one row broadcast over all)."""
    base = mask
    for dim in (1, 2):
        if base.stride(dim) == 0:
            base = base.narrow(dim, 0, 1)
    return base, base.shape[2] > 1 or mask.shape[2] == 1


# --------------------------------------------------------------------------------------
# Pass 1: per query row, its visible keys' count, first, end, count at or below the
# diagonal, and count of entries exactly 0 (an additive mask's visible scores unchanged)
# --------------------------------------------------------------------------------------
@triton.jit
def _row_stats_kernel(MASK, STATS, smb, smh, sml, sme, num_heads, L, S,
                      BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, ADDITIVE: tl.constexpr):
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    offs_l = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    base = MASK + b.to(tl.int64) * smb + h.to(tl.int64) * smh
    count = tl.zeros([BLOCK_L], tl.int32)
    below = tl.zeros([BLOCK_L], tl.int32)
    zeros = tl.zeros([BLOCK_L], tl.int32)
    first = tl.zeros([BLOCK_L], tl.int32) + S
    end = tl.zeros([BLOCK_L], tl.int32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        inside = (offs_l[:, None] < L) & (offs_s[None, :] < S)
        ptrs = base + offs_l[:, None] * sml + offs_s[None, :] * sme
        if ADDITIVE:
            value = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32)
            visible = value > -1e4                      # bob_compile/kernels/params.py HIDDEN_AT_OR_BELOW
            zeros += tl.sum((value == 0).to(tl.int32), 1)
        else:
            visible = tl.load(ptrs, mask=inside, other=0) != 0
        seen = visible.to(tl.int32)
        count += tl.sum(seen, 1)
        below += tl.sum(tl.where(offs_s[None, :] <= offs_l[:, None], seen, 0), 1)
        keys = tl.broadcast_to(offs_s[None, :], [BLOCK_L, BLOCK_S])
        first = tl.minimum(first, tl.min(tl.where(visible, keys, S), 1))
        end = tl.maximum(end, tl.max(tl.where(visible, keys + 1, 0), 1))
    out = STATS + (pid_bh.to(tl.int64) * L + offs_l) * 5
    rows = offs_l < L
    tl.store(out, count, mask=rows)
    tl.store(out + 1, first, mask=rows)
    tl.store(out + 2, end, mask=rows)
    tl.store(out + 3, below, mask=rows)
    tl.store(out + 4, zeros, mask=rows)


strides_of(_row_stats_kernel, MASK="sm")


# --------------------------------------------------------------------------------------
# Pass 2: per (batch, head), the key range and whether every row is exactly it
# --------------------------------------------------------------------------------------
@triton.jit
def _not_intervals(stats, offs, n):
    """How many of the rows (or columns) offs of a statistics list of n see more than one
    interval: fewer visible entries than from their first to their last."""
    inside = offs < n
    count = tl.load(stats + offs * 5, mask=inside, other=0)
    first = tl.load(stats + offs * 5 + 1, mask=inside, other=0)
    end = tl.load(stats + offs * 5 + 2, mask=inside, other=0)
    return tl.sum((inside & (count != tl.maximum(end - first, 0))).to(tl.int32), 0)


@triton.jit
def _summary_kernel(STATS, COLUMN_STATS, SUMMARY, L, S, QUERIES, BLOCK_L: tl.constexpr,
                    ROWS_ARE_QUERIES: tl.constexpr, ADDITIVE: tl.constexpr):
    pid_bh = tl.program_id(0)
    stats = STATS + pid_bh.to(tl.int64) * L * 5
    zero = tl.zeros([], tl.int32)     # loop-carried scalars must start as tensors
    first = zero + S
    end = zero
    for l0 in range(0, L, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        rows = offs_l < L
        first = tl.minimum(first, tl.min(tl.load(stats + offs_l * 5 + 1, mask=rows, other=S), 0))
        end = tl.maximum(end, tl.max(tl.load(stats + offs_l * 5 + 2, mask=rows, other=0), 0))
    first = tl.minimum(first, end)
    # No row sees a key outside [first, end): one that sees as many keys as the range holds
    # sees exactly the range; one that sees none above the diagonal and as many as
    # [first, min(end, row + 1)) holds sees exactly that.
    not_range = zero
    not_causal = zero
    not_below = zero
    not_intervals = zero
    adds = zero
    for l0 in range(0, L, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        rows = offs_l < L
        count = tl.load(stats + offs_l * 5, mask=rows, other=0)
        below = tl.load(stats + offs_l * 5 + 3, mask=rows, other=0)
        zeros = tl.load(stats + offs_l * 5 + 4, mask=rows, other=0)
        in_causal_range = tl.maximum(tl.minimum(end, offs_l + 1) - first, 0)
        not_range += tl.sum((rows & (count != end - first)).to(tl.int32), 0)
        off_causal = (count != in_causal_range) | (below != count)
        not_causal += tl.sum((rows & off_causal).to(tl.int32), 0)
        not_below += tl.sum((rows & (below != count)).to(tl.int32), 0)
        not_intervals += _not_intervals(stats, offs_l, L)
        adds += tl.sum((rows & (zeros != count)).to(tl.int32), 0)
    columns = COLUMN_STATS + pid_bh.to(tl.int64) * S * 5
    if ROWS_ARE_QUERIES:    # and each key's queries an interval too
        for s0 in range(0, S, BLOCK_L):
            not_intervals += _not_intervals(columns, s0 + tl.arange(0, BLOCK_L), S)
    structure = tl.where(not_range == 0, 1, 0)
    if ROWS_ARE_QUERIES:
        structure = tl.where((structure == 0) & (not_causal == 0), 2, structure)
        structure = tl.where((structure == 0) & (not_intervals == 0), 4, structure)
    if ADDITIVE:
        structure = tl.where(adds == 0, structure, 0)
    if ROWS_ARE_QUERIES:    # read, but no row sees a key above the diagonal
        structure = tl.where((structure == 0) & (not_below == 0), 3, structure)
    out = SUMMARY + pid_bh.to(tl.int64) * (3 + 2 * QUERIES + 2 * S)
    tl.store(out, first)
    tl.store(out + 1, end)
    tl.store(out + 2, structure)
    # each query's (first, end) of its keys (one row broadcast: that row's, for every query)
    for l0 in range(0, QUERIES, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        rows = offs_l < QUERIES
        source = offs_l
        if not ROWS_ARE_QUERIES:
            source = offs_l * 0
        tl.store(out + 3 + 2 * offs_l, tl.load(stats + source * 5 + 1, mask=rows), mask=rows)
        tl.store(out + 4 + 2 * offs_l, tl.load(stats + source * 5 + 2, mask=rows), mask=rows)
    # each key's (first, end) of the queries that see it (one row broadcast: all or none)
    for s0 in range(0, S, BLOCK_L):
        offs_s = s0 + tl.arange(0, BLOCK_L)
        keys = offs_s < S
        if ROWS_ARE_QUERIES:
            seen_first = tl.load(columns + offs_s * 5 + 1, mask=keys)
            seen_end = tl.load(columns + offs_s * 5 + 2, mask=keys)
        else:
            seen = tl.load(columns + offs_s * 5, mask=keys, other=0) > 0
            seen_first = tl.where(seen, 0, QUERIES)
            seen_end = tl.where(seen, QUERIES, 0)
        tl.store(out + 3 + 2 * QUERIES + 2 * offs_s, seen_first, mask=keys)
        tl.store(out + 4 + 2 * QUERIES + 2 * offs_s, seen_end, mask=keys)


strides_of(_summary_kernel)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------
_build_failed = []      # set once if Triton cannot build the summary kernels here


def mask_summary(mask):
    """KEY_RANGE for a (B, Hq, L, S) mask view (see the module docstring): (B, Hq, 1, 3)
    int32, broadcast heads as stride 0."""
    if _build_failed:
        return summarize_with_torch(mask)
    base, rows_are_queries = _stored(mask)
    B, Hm, Lm, S = base.shape
    additive = base.dtype != torch.bool
    stats = torch.empty((B, Hm, Lm, 5), device=mask.device, dtype=torch.int32)
    column_stats = torch.empty((B, Hm, S, 5), device=mask.device, dtype=torch.int32)
    L = mask.shape[2]
    # only fresh tensors, views and Triton launches: the C++ node records and replays the
    # stage (bob_compile/eager/programs.py), and CUDA graphs capture it
    summary = torch.empty((B, Hm, 1, 3 + 2 * L + 2 * S), device=mask.device, dtype=torch.int32)
    block_l, block_s = (16, 32) if interpreting() else (32, 128)
    try:
        rows = fixed_plan(("mask_row_stats", block_l, block_s, additive), lambda: dict(
            BLOCK_L=block_l, BLOCK_S=block_s, ADDITIVE=additive, num_warps=4))
        rows(_row_stats_kernel, (blocks(Lm, block_l), B * Hm), MASK=base, STATS=stats,
             num_heads=Hm, L=Lm, S=S)
        # the same statistics of the columns: each key's first and last query that sees it
        rows(_row_stats_kernel, (blocks(S, block_l), B * Hm), MASK=base.transpose(2, 3),
             STATS=column_stats, num_heads=Hm, L=S, S=Lm)
        heads = fixed_plan(("mask_summary", block_l, rows_are_queries, additive), lambda: dict(
            BLOCK_L=block_l * 8, ROWS_ARE_QUERIES=rows_are_queries, ADDITIVE=additive,
            num_warps=4))
        heads(_summary_kernel, (B * Hm, 1), STATS=stats, COLUMN_STATS=column_stats,
              SUMMARY=summary, L=Lm, S=S, QUERIES=L)
    except BUILD_ERRORS as e:
        _build_failed.append(e)
        log.warning("Triton mask-summary kernels failed to build (%s); summarizing masks "
                    "with PyTorch ops", error_summary(e))
        return summarize_with_torch(mask)
    return summary.expand(mask.shape[0], mask.shape[1], 1, summary.shape[-1])


def summarize_with_torch(mask):
    """mask_summary in PyTorch ops (about 30 small kernels)."""
    base, rows_are_queries = _stored(mask)
    visible = base if base.dtype == torch.bool else base > HIDDEN_AT_OR_BELOW
    L, S = base.shape[2], base.shape[3]
    count = visible.sum(-1, dtype=torch.int32)                   # (B, Hm, L) keys per row
    seen = visible.any(dim=2)                                    # (B, Hm, S)
    keys = torch.arange(S, device=mask.device, dtype=torch.int32)
    first = torch.where(seen, keys, S).amin(-1)
    end = torch.where(seen, keys + 1, 0).amax(-1)
    first = torch.minimum(first, end)
    range_only = (count == (end - first)[..., None]).all(-1)
    structure = torch.where(range_only, KEYS_IN_RANGE, READ_THE_MASK)
    row_first, row_end = _ranges_along(visible, -1)              # (B, Hm, L) each
    if rows_are_queries:
        column_first, column_end = _ranges_along(visible, -2)    # (B, Hm, S) each
        rows = torch.arange(1, L + 1, device=mask.device, dtype=torch.int32)
        in_causal_range = (torch.minimum(end[..., None], rows) - first[..., None]).clamp_min(0)
        at_or_below = visible.tril().sum(-1, dtype=torch.int32)
        range_causal = ((count == in_causal_range) & (at_or_below == count)).all(-1)
        structure = torch.where(range_causal & ~range_only, KEYS_IN_RANGE_CAUSAL, structure)
        # every row and every column one interval (or empty)
        intervals = ((count == (row_end - row_first).clamp_min(0)).all(-1)
                     & (visible.sum(-2, dtype=torch.int32)
                        == (column_end - column_first).clamp_min(0)).all(-1))
        structure = torch.where((structure == READ_THE_MASK) & intervals, KEY_INTERVALS,
                                structure)
    if base.dtype != torch.bool:
        adds_nothing = ((base == 0).sum(-1, dtype=torch.int32) == count).all(-1)
        structure = torch.where(adds_nothing, structure, READ_THE_MASK)
    if rows_are_queries:
        below_only = (at_or_below == count).all(-1)
        structure = torch.where((structure == READ_THE_MASK) & below_only,
                                READ_THE_MASK_CAUSAL, structure)
    summary = torch.stack((first, end, structure.to(torch.int32)), -1)[:, :, None, :]
    # the per-query and per-key ranges (one row broadcast over the queries: that row's range
    # for every query, and all of them or none for each key)
    queries = mask.shape[2]
    row_ranges = torch.stack((row_first, row_end), -1)
    if rows_are_queries:
        column_ranges = torch.stack((column_first, column_end), -1)
    else:
        row_ranges = row_ranges.expand(-1, -1, queries, -1)
        column_ranges = torch.stack((torch.where(seen, 0, queries),
                                     torch.where(seen, queries, 0)), -1)
    ranges = torch.cat((summary, row_ranges.to(torch.int32).flatten(2)[:, :, None],
                        column_ranges.to(torch.int32).flatten(2)[:, :, None]), -1)
    return ranges.expand(mask.shape[0], mask.shape[1], 1, ranges.shape[-1])


def _ranges_along(visible, dim):
    """Per row (dim=-1: its keys) or column (dim=-2: its queries) of a bool mask, the first
    visible entry and one past the last; (n, 0) where none (n: the length along dim)."""
    n = visible.shape[dim]
    positions = torch.arange(n, device=visible.device, dtype=torch.int32)
    positions = positions if dim == -1 else positions[:, None]
    return (torch.where(visible, positions, n).amin(dim),
            torch.where(visible, positions + 1, 0).amax(dim))
