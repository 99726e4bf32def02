"""A FlexAttention BlockMask's visible pairs, for bob_compile's op.

A pair is visible when its (query block, key block) is listed as full, or listed as
partial and the mask_mod says so, as FlexAttention's compiled kernels apply a BlockMask (a
mask_mod alone does not define it: `BlockMask.from_kv_blocks` may list fewer blocks than its
pattern). Given to the op as

- key intervals (`key_intervals`: the kernels' int32 summary, bob_compile/kernels/
  interval_masks.py), where every query row sees one interval of keys and every key is seen
  by one interval of queries: a sliding window, causal packed documents, prefix-LM, causal.
  O(L + S) per distinct batch entry and head, made by evaluating the mask_mod on the listed
  partial blocks only, a chunk at a time;
- a boolean (B or 1, H or 1, L, S) mask otherwise (`visible_pairs`): O(L S);
- packed (`pack`, uint8) where the call is traced (a compiled graph): the block lists and
  the mask_mod's captured tensors, with a key naming the mask_mod in this process's
  registry (`register_mask_mod`); the ops resolve it when they run (`resolve`), to one of
  the two above. Nothing O(L S) lives in the graph or between its ops.
"""
import collections
import dataclasses
import functools
import hashlib
import logging
import math
import threading
import types
import weakref

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .kernels import block_sparse_masks
from .kernels.block_sparse_masks import EMPTY, FULL, BlockSparseMask
from .kernels.interval_masks import KeyIntervals, summary_of_intervals

log = logging.getLogger("bob_compile.flex")


# ------------------------------------------------------------------ the BlockMask
@dataclasses.dataclass
class Blocks:
    """What of a BlockMask decides the visible pairs: its lengths, block sizes, listed
    partial and full key blocks per query block, and its mask_mod (with the tensors it
    captured, passed as trailing arguments where Dynamo lifted them)."""
    seq_lengths: tuple
    block_size: tuple           # (query block, key block)
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    mask_mod: object
    mask_mod_buffers: tuple = ()
    # whether the mask_mod reads the batch index, the head index (mask_mod_reads)
    mask_mod_reads: tuple = (True, True)

    @classmethod
    def of(cls, block_mask):
        return cls(tuple(block_mask.seq_lengths), tuple(block_mask.BLOCK_SIZE),
                   block_mask.kv_num_blocks, block_mask.kv_indices,
                   block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                   block_mask.mask_mod, (), mask_mod_reads(block_mask.mask_mod,
                                                           device=block_mask.kv_indices.device))

    @classmethod
    def of_tuple(cls, block_tuple, mask_mod_buffers=(), mask_mod_reads=(True, True)):
        """From the tuple the higher-order op takes (BlockMask.as_tuple(): the lengths and
        the kv block tensors first; the block sizes and the mask_mod last)."""
        L, S, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices = block_tuple[:6]
        q_block, kv_block, mask_mod = block_tuple[-3:]
        return cls((L, S), (q_block, kv_block), kv_num_blocks, kv_indices, full_kv_num_blocks,
                   full_kv_indices, mask_mod, tuple(mask_mod_buffers), tuple(mask_mod_reads))


# mask_mod evaluations per chunk: bounds the index-sized intermediates (int64 for a
# document-id lookup) that evaluating a chunk makes, 32 MiB each (they add to the peak of
# the step where an op resolves a packed mask)
_EVALUATIONS_PER_CHUNK = 1 << 22


def visible_pairs(blocks, L, S, device, batch, heads):
    """The bool (B or 1, H or 1, L, S) mask `blocks` (a Blocks) applies to a (batch, heads,
    L, S) call, as FlexAttention applies it: every pair of its full blocks, the pairs of its
    partial blocks where the mask_mod says so, nothing elsewhere; the mask_mod evaluated at
    the call's batch entries and heads where it reads them (whatever the BlockMask's own
    sizes). Run eagerly, the mask_mod is evaluated on the listed partial blocks only (a
    sliding window's or packed documents' two or three per row of blocks: 1/40 of the
    pairs at 16K), which costs one host synchronization to list them; inside a traced graph
    or a CUDA graph capture, where none may be, over every pair a chunk of rows at a time."""
    mask_mod, partial, full, sizes, q_block, kv_block = _layout(blocks, L, S, device, batch,
                                                                heads)
    evaluate = _by_block if may_synchronize(partial) else _by_rows
    return evaluate(mask_mod, partial, full, sizes, L, S, q_block, kv_block, device)


def _layout(blocks, L, S, device, batch, heads):
    """(mask_mod(b, h, q_idx, kv_idx) with the buffers bound, the listed partial and full
    blocks as (Bm, Hm, query blocks, key blocks) bool maps (full: None where the BlockMask
    has none), the (batch, heads) sizes to evaluate at, and the block sizes)."""
    # a block longer than the call (flex_attention's mask for calls without one: lengths
    # (1, 1), blocks of 2^30) covers it once: as the power of two at or above its length
    # (the tiles' blocks are powers of two)
    q_block, kv_block = (size if size < n else 1 << max(n - 1, 0).bit_length()
                         for size, n in zip(blocks.block_size, (L, S)))
    q_blocks, kv_blocks = -(-L // q_block), -(-S // kv_block)
    listed_batch, listed_heads = blocks.kv_num_blocks.shape[:2]
    reads_batch, reads_head = blocks.mask_mod_reads
    sizes = (batch if reads_batch else listed_batch, heads if reads_head else listed_heads)
    partial = _listed(blocks.kv_num_blocks[..., :q_blocks],
                      blocks.kv_indices[..., :q_blocks, :], kv_blocks, device)
    full = None
    if blocks.full_kv_num_blocks is not None:
        full = _listed(blocks.full_kv_num_blocks[..., :q_blocks],
                       blocks.full_kv_indices[..., :q_blocks, :], kv_blocks, device)
    buffers = blocks.mask_mod_buffers

    def mask_mod(b, h, q_idx, kv_idx):
        return blocks.mask_mod(b, h, q_idx, kv_idx, *buffers)
    return mask_mod, partial, full, sizes, q_block, kv_block


def _by_rows(mask_mod, partial, full, sizes, L, S, q_block, kv_block, device):
    """visible_pairs over every pair, a chunk of query rows at a time (no synchronization)."""
    visible = torch.empty(*sizes, L, S, dtype=torch.bool, device=device)
    rows = max(1, _EVALUATIONS_PER_CHUNK // (sizes[0] * sizes[1] * S))
    batch_index, head_index = (torch.arange(n, device=device) for n in sizes)
    keys = torch.arange(S, device=device)
    for first in range(0, L, rows):
        last = min(L, first + rows)
        of_row = torch.arange(first, last, device=device) // q_block

        def pairs(block_map):       # (Bm, Hm, rows, S) from (Bm, Hm, q blocks, key blocks)
            return block_map[..., of_row, :].repeat_interleave(kv_block, -1)[..., :S]
        seen = _over_index_vectors(mask_mod, (batch_index, head_index, torch.arange(
            first, last, device=device), keys)).to(torch.bool) & pairs(partial)
        if full is not None:
            seen = seen | pairs(full)
        visible[:, :, first:last] = seen
    return visible


def _by_block(mask_mod, partial, full, sizes, L, S, q_block, kv_block, device):
    """visible_pairs with the mask_mod evaluated on the listed partial blocks only (their
    list read on the host), written into the (batch, head, query block, key block) tiles of
    the padded mask, the full blocks' tiles set whole."""
    evaluated = ((b, h, row_block, key_block, seen) for b, h, row_block, key_block, _, _, seen
                 in _partial_tiles(mask_mod, partial.expand(*sizes, -1, -1), q_block, kv_block,
                                   L, S))
    return _written(evaluated, full, sizes, partial.shape[-2:], q_block, kv_block, L, S, device)


def _written(evaluated, full, sizes, block_counts, q_block, kv_block, L, S, device):
    """The bool (sizes, L, S) mask of the full blocks and the evaluated partial blocks
    (b, h, query block, key block, seen), written into the tiles of the padded mask."""
    q_blocks, kv_blocks = block_counts
    visible = torch.zeros(*sizes, q_blocks * q_block, kv_blocks * kv_block, dtype=torch.bool,
                          device=device)
    tiles = visible.view(*sizes, q_blocks, q_block, kv_blocks, kv_block).permute(
        0, 1, 2, 4, 3, 5)                       # (B, H, q blocks, key blocks, rows, keys)
    if full is not None:
        tiles.copy_(full.expand(*sizes, -1, -1)[..., None, None].expand(tiles.shape))
    for b, h, row_block, key_block, seen in evaluated:
        tiles[b, h, row_block, key_block] = seen        # rows past L, keys past S cut below
    return visible[..., :L, :S]


def _partial_tiles(mask_mod, partial, q_block, kv_block, L, S):
    """The listed partial blocks of `partial` ((B, H, query blocks, key blocks) bool) with
    the mask_mod evaluated on them, a chunk of blocks at a time: per chunk (b, h, query
    block, key block, rows, keys, seen), rows (n, q_block) and keys (n, kv_block) clamped to
    L - 1 and S - 1 (the padding of a last block repeats the last row or key), seen (n,
    q_block, kv_block) bool. Lists the blocks on the host (one synchronization)."""
    device = partial.device
    listed = partial.nonzero()          # (P, 4): the synchronization
    in_rows = torch.arange(q_block, device=device)
    in_keys = torch.arange(kv_block, device=device)
    evaluate = mask_mod
    for in_dims in ((None, None, None, 0), (None, None, 0, None), (0, 0, 0, 0)):
        evaluate = torch.vmap(evaluate, in_dims=in_dims)   # keys, rows, then blocks
    per_chunk = max(1, _EVALUATIONS_PER_CHUNK // (q_block * kv_block))
    for chunk in listed.split(per_chunk) if len(listed) else ():     # none: no empty chunk
        b, h, row_block, key_block = chunk.unbind(1)
        rows = (row_block[:, None] * q_block + in_rows).clamp_max(L - 1)
        keys = (key_block[:, None] * kv_block + in_keys).clamp_max(S - 1)
        yield b, h, row_block, key_block, rows, keys, evaluate(b, h, rows, keys).to(torch.bool)


# ------------------------------------------------------------------ as key intervals
def key_intervals(blocks, L, S, device, batch, heads, tiles_otherwise=False,
                  relative_bias=None, dense_up_to=0):
    """The key-interval summary (int32, (B or 1, H or 1, 1, 3 + 2L + 2S): kernels/
    interval_masks.py) of the mask `blocks` applies to a (batch, heads, L, S) call (the
    pairs of visible_pairs), or, where a query row sees more than one interval of keys or a
    key is seen by more than one interval of queries, None (tiles_otherwise: the mask tile
    by tile, a kernels/block_sparse_masks.BlockSparseMask, from the tiles already
    evaluated, which are kept until the verdict for that; the bool (B or 1, H or 1, L, S)
    mask instead where it takes at most `dense_up_to` bytes, or where the blocks are not
    powers of two). With a `relative_bias` ((B or 1, H or 1, L + S - 1):
    block_sparse_masks.py) the mask is tiles whatever the verdict, the bias with it (blocks
    that are not powers of two: the additive mask materialized, the bias where visible). The
    mask_mod is evaluated on the listed partial blocks only, a chunk at a time; nothing
    L x S is made. Host synchronizations (listing the blocks, the verdict, the distinct
    tiles): only where may_synchronize."""
    mask_mod, partial, full, sizes, q_block, kv_block = _layout(blocks, L, S, device, batch,
                                                                heads)
    partial = partial.expand(*sizes, -1, -1)
    q_blocks, kv_blocks = partial.shape[-2:]
    # per query row its keys' first, end and count, and per key its queries': the full
    # blocks' first, then the partial blocks' evaluated pairs added in
    rows = _stats_of_full_blocks(full, sizes, q_blocks, kv_blocks, q_block, kv_block, L, S,
                                 device)
    keys = _stats_of_full_blocks(None if full is None else full.transpose(-1, -2), sizes,
                                 kv_blocks, q_blocks, kv_block, q_block, S, L, device)
    heads_listed = sizes[1]
    evaluated = []
    for b, h, row_block, key_block, row_index, key_index, seen in _partial_tiles(
            mask_mod, partial, q_block, kv_block, L, S):
        # the padding past L or S repeats the last row or key: hidden here, not counted
        seen = seen & _inside(row_index, q_block)[:, :, None] & \
            _inside(key_index, kv_block)[:, None, :]
        if tiles_otherwise or relative_bias is not None:
            evaluated.append((b, h, row_block, key_block, seen))
        pair = (b * heads_listed + h)[:, None]
        _add_tile(rows, seen, pair * L + row_index, key_index, S)
        _add_tile(keys, seen.transpose(1, 2), pair * S + key_index, row_index, L)
    tileable = block_sparse_masks.powers_of_two((q_block, kv_block))
    if relative_bias is not None and tileable:
        return _tile_by_tile(evaluated, full, sizes, (q_blocks, kv_blocks), (q_block, kv_block),
                             rows, keys, L, S, device, relative_bias)
    if relative_bias is not None or not bool(block_sparse_masks.one_interval_each(rows) &
                                             block_sparse_masks.one_interval_each(keys)):
        if not tiles_otherwise and relative_bias is None:
            return None
        if sizes[0] * sizes[1] * L * S <= dense_up_to or not tileable:
            _say_dense(blocks.mask_mod)
            visible = _written(evaluated, full, sizes, (q_blocks, kv_blocks), q_block, kv_block,
                               L, S, device)
            return visible if relative_bias is None else _with_relative_bias(
                visible, relative_bias, L, S)
        _say_tiles(blocks.mask_mod)
        return _tile_by_tile(evaluated, full, sizes, (q_blocks, kv_blocks), (q_block, kv_block),
                             rows, keys, L, S, device)
    return summary_of_intervals(*(t.view(*sizes, -1) for t in rows[:2] + keys[:2]))


def _with_relative_bias(visible, relative_bias, L, S):
    """The additive mask of bool `visible` (..., L, S) and a relative bias (..., L + S - 1):
    the bias of q - k where visible, -inf elsewhere."""
    at = torch.arange(L, device=visible.device)[:, None] - \
        torch.arange(S, device=visible.device)[None, :] + S - 1
    return relative_bias[..., at].masked_fill(~visible, float("-inf"))


def _tile_by_tile(evaluated, full, sizes, block_counts, block_size, rows, keys, L, S, device,
                  relative_bias=None):
    """The BlockSparseMask of the full blocks and the evaluated partial ones (b, h, query
    block, key block, seen), with the rows' and keys' (first, end, count) stats."""
    entries = torch.full((*sizes, *block_counts), EMPTY, dtype=torch.int64, device=device)
    if full is not None:
        entries.masked_fill_(full.expand_as(entries), FULL)
    tiles = torch.zeros(0, *block_size, dtype=torch.bool, device=device)
    if evaluated:
        b, h, row_block, key_block, tiles = (torch.cat(parts) for parts in zip(*evaluated))
        entries[b, h, row_block, key_block] = torch.arange(len(b), device=device)
    return block_sparse_masks.build(entries, tiles, *(
        tuple(t.view(*sizes, -1) for t in stats) for stats in (rows, keys)), L, S, block_size,
        relative_bias)


# the blocks of a call without a BlockMask that has a relative bias: every pair visible
_EVERY_PAIR_BLOCK = 128


def every_pair(b, h, q_idx, kv_idx):
    return q_idx >= 0


def every_pair_blocks(L, S, device):
    """Blocks listing every (query block, key block) full, with a mask_mod registered under
    EVERY_PAIR_KEY: the mask of a call that has none, for its relative bias. Traceable."""
    q_blocks, kv_blocks = -(-L // _EVERY_PAIR_BLOCK), -(-S // _EVERY_PAIR_BLOCK)
    none = torch.zeros(1, 1, q_blocks, dtype=torch.int32, device=device)
    every = torch.arange(kv_blocks, dtype=torch.int32, device=device).expand(
        1, 1, q_blocks, kv_blocks)
    return Blocks((L, S), (_EVERY_PAIR_BLOCK, _EVERY_PAIR_BLOCK), none,
                  torch.zeros(1, 1, q_blocks, 1, dtype=torch.int32, device=device),
                  none + kv_blocks, every, _every_pair_module, (), (False, False))


_said = set()


def _say_dense(mask_mod):
    """Log, once per mask_mod, that its BlockMask is materialized (small, or odd blocks)."""
    _say(mask_mod, "is not one interval of keys per query (and of queries per key); it is "
         "materialized per call (at most TILES_ABOVE_BYTES, or blocks not powers of two)")


def _say_tiles(mask_mod):
    """Log, once per mask_mod, that its BlockMask is read tile by tile."""
    _say(mask_mod, "is not one interval of keys per query (and of queries per key); the "
         "kernels read it tile by tile (its distinct partial tiles stored once, no L*S "
         "tensor)")


def _say(mask_mod, what):
    name = getattr(mask_mod, "__qualname__", None) or type(mask_mod).__name__
    if (name, what) not in _said:
        _said.add((name, what))
        log.info("bob_compile: the BlockMask of mask_mod %s %s", name, what)


def _inside(index, block):
    """Which entries of a block's clamped indices (n, block) are real: those before the
    clamp repeated the last index."""
    first = index[:, :1]
    return index == first + torch.arange(block, device=index.device)


def _stats_of_full_blocks(full, sizes, row_blocks, col_blocks, row_block, col_block, rows,
                          cols, device):
    """(first, end, count) flat (B H rows) int64 views: per row, the columns [first, end)
    its full blocks span and how many ((cols, 0, 0) where none)."""
    flat = sizes[0] * sizes[1] * rows
    if full is None:
        return (torch.full((flat,), cols, dtype=torch.int64, device=device),
                torch.zeros(flat, dtype=torch.int64, device=device),
                torch.zeros(flat, dtype=torch.int64, device=device))
    full = full.expand(*sizes, row_blocks, col_blocks)
    starts = torch.arange(col_blocks, device=device) * col_block
    ends = (starts + col_block).clamp_max(cols)
    first = torch.where(full, starts, cols).amin(-1)
    end = torch.where(full, ends, 0).amax(-1)
    count = (full * (ends - starts)).sum(-1)
    of_row = torch.arange(rows, device=device) // row_block
    return tuple(t[..., of_row].reshape(flat).clone() for t in (first, end, count))


def _add_tile(stats, seen, flat_rows, columns, none):
    """Add evaluated tiles seen (n, rows, cols) to per-row (first, end, count) `stats` at
    flat_rows (n, rows); columns (n, cols) the (consecutive) column of each pair. A row's
    first and last visible columns are found as argmaxes over bytes, without an index-sized
    tensor per pair."""
    first, end, count = stats
    index = flat_rows.reshape(-1)
    seen_bytes = seen.to(torch.uint8)
    tile_count = seen_bytes.sum(-1, dtype=torch.int64)
    cols = seen.shape[-1]
    first_at = seen_bytes.argmax(-1)                          # the first True of each row
    last_at = cols - 1 - seen_bytes.flip(-1).argmax(-1)       # and its last
    sees = tile_count > 0
    tile_first = torch.where(sees, columns.gather(-1, first_at), none)
    tile_end = torch.where(sees, columns.gather(-1, last_at) + 1, 0)
    first.scatter_reduce_(0, index, tile_first.reshape(-1), "amin")
    end.scatter_reduce_(0, index, tile_end.reshape(-1), "amax")
    count.scatter_add_(0, index, tile_count.reshape(-1))


def may_synchronize(tensor):
    """Whether reading `tensor` on the host is allowed here: a plain tensor, outside any
    tracing (Dynamo, make_fx / AOTAutograd's fake and functional tensors, dispatch modes)
    and outside a CUDA graph capture."""
    if torch.compiler.is_compiling() or type(tensor) is not torch.Tensor:
        return False
    if torch._C._len_torch_dispatch_stack() > 0:
        return False
    return not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def _listed(num_blocks, indices, kv_blocks, device):
    """(..., query blocks, key blocks) bool: the blocks a row of the lists names."""
    listed = torch.arange(indices.shape[-1], device=device) < num_blocks[..., None]
    blocks = torch.zeros(*indices.shape[:-1], kv_blocks + 1, dtype=torch.bool, device=device)
    return blocks.scatter(-1, torch.where(listed, indices.long(), kv_blocks), True)[
        ..., :kv_blocks]



# ------------------------------------------------------------------ tracing a mod
def trace_mod(function, buffers=(), score_dtype=None, device=None):
    """A mod's aten graph: a score_mod's (score_dtype given: traced with score, b, h, q_idx,
    kv_idx) or a mask_mod's (b, h, q_idx, kv_idx), then `buffers` (tensors, real, fake or
    meta, or sizes, standing for what Dynamo passes as extra arguments); or why it could
    not be traced. The indices are made on the buffers' device, else on `device` (the
    call's: where the tensors a mod reads from its closure are, which it indexes), else on
    the CPU."""
    try:
        # traced as written, outside any torch.func level (the example inputs made there
        # too: made under a transform, make_fx takes them for constants); one-element
        # tensors, not 0-d ones (indexing a buffer with a 0-d index reads its value), one
        # per input (make_fx takes one tensor passed twice for one input); on the meta
        # device, where the buffers are, so that no value is read
        with torch._C._DisableFuncTorch():
            device = next((b.device for b in buffers if isinstance(b, torch.Tensor)),
                          device or "cpu")
            examples = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(4)]
            if score_dtype is not None:
                examples.insert(0, torch.zeros(1, dtype=score_dtype, device=device))
            return make_fx(lambda *indices: function(*indices, *buffers))(*examples).graph
    except Exception as e:       # data-dependent Python control flow, unsupported ops
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def mask_mod_reads(mask_mod, buffers=(), device=None):
    """(reads the batch index, reads the head index) of `mask_mod(b, h, q_idx, kv_idx,
    *buffers)`, from its traced graph; both where it cannot be traced. FlexAttention
    evaluates a mask_mod at the call's own batch entry and head, whatever the BlockMask's
    batch and head sizes. Traced once per mask_mod and what it reads (traced_once)."""
    if buffers:
        return index_reads(trace_mod(mask_mod, buffers, device=device))
    return traced_once(mask_mod, ("mask_mod_reads", str(device)),
                       lambda: index_reads(trace_mod(mask_mod, device=device)))


# traced_once: results kept per function (a few: an eager loop's mods)
_KEPT_TRACES = 32
_traces = collections.OrderedDict()


def traced_once(function, what, trace):
    """trace() (what a mod's traced graph says, named by `what`), kept for the next call with
    the same function where everything it reads can be told (_reads_of) and has not
    changed: the numbers and strings by value, the tensors by identity, dtype and shape
    (tracing takes milliseconds, an eager flex call's whole host budget). Else traced
    every call."""
    reads = _reads_of(function) if isinstance(function, types.FunctionType) else None
    if reads is None:
        return trace()
    tensors, scalars, functions = reads
    key = (id(function), what, scalars,
           tuple((id(t), t.dtype, tuple(t.shape), str(t.device)) for t in tensors))
    kept = _traces.get(key)
    if kept is not None and _alive(kept[0], (function, *functions)):
        return kept[1]
    result = trace()
    _keep(_traces, key, (_weak((function, *functions)), result), _KEPT_TRACES)
    return result


def index_reads(mask_mod_graph):
    """mask_mod_reads from the mask_mod's traced graph (or why it was not traced)."""
    if isinstance(mask_mod_graph, str):
        return True, True
    b, h = mask_mod_graph.find_nodes(op="placeholder")[:2]
    return bool(b.users), bool(h.users)



def over_indices(function, sizes, device, score=None):
    """function(b, h, q_idx, kv_idx) (or function(score, b, h, q_idx, kv_idx) with score of
    `sizes`) at every index of `sizes`."""
    return _over_index_vectors(function, [torch.arange(n, device=device) for n in sizes],
                               score)


def _over_index_vectors(function, indices, score=None):
    """function at every combination of the four index vectors (b, h, q_idx, kv_idx): one
    vmap per index, innermost the key's (as FlexAttention evaluates its mods)."""
    if score is None:
        for in_dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None),
                        (0, None, None, None)):
            function = torch.vmap(function, in_dims=in_dims)
        return function(*indices)
    for in_dims in ((0, None, None, None, 0), (0, None, None, 0, None), (0, None, 0, None, None),
                    (0, 0, None, None, None)):
        function = torch.vmap(function, in_dims=in_dims)
    return function(score, *indices)



# ------------------------------------------------------------------ packed, for traced calls
# A traced call (a compiled graph) cannot list the partial blocks on the host, and its graph
# should hold nothing L x S; so it hands the ops the BlockMask packed into one uint8 tensor
# (their mask argument takes one tensor), which they resolve when they run (`resolve`):
#
#   header (int64 words): _MAGIC, the mask_mod's key, L, S, query block, key block, reads
#       batch, reads head, whether full blocks are listed, whether a relative bias comes
#       last, the number of parts, then per part its dtype's code, its number of dims and
#       _MAX_DIMS sizes (1 beyond), and the byte offset of its data
#   the parts, each 8-byte aligned: kv_num_blocks, kv_indices, (full_kv_num_blocks,
#       full_kv_indices,) the mask_mod's captured tensors, (the relative bias)
#
# The mask_mod itself is named by its key in this process's registry: the SHA-256 of its
# graph's code, so that a graph compiled in another process (inductor's cache) names the
# same function, which the pass registers again before the graph runs.
_MAGIC = 0x626F625F626C6B73          # "bob_blks"
_FIXED_WORDS, _MAX_DIMS, _MAX_PARTS = 11, 6, 16
_PART_WORDS = 2 + _MAX_DIMS + 1
_HEADER_BYTES = 8 * (_FIXED_WORDS + _PART_WORDS * _MAX_PARTS)
_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
           torch.float16, torch.bfloat16, torch.float32, torch.float64)
_mask_mods = {}              # key -> mask_mod(b, h, q_idx, kv_idx, *buffers)


def register_mask_mod(mask_mod):
    """The key under which packed BlockMasks name `mask_mod` (a GraphModule, as Dynamo
    records a BlockMask's mask_mod), registered in this process; None where its graph holds
    constants of its own (its code alone would not name it)."""
    if not isinstance(mask_mod, torch.fx.GraphModule) or \
            mask_mod.graph.find_nodes(op="get_attr"):
        return None
    key = int.from_bytes(hashlib.sha256(mask_mod.code.encode()).digest()[:7], "little")
    _mask_mods[key] = mask_mod
    return key


_every_pair_module = torch.fx.symbolic_trace(every_pair)
EVERY_PAIR_KEY = register_mask_mod(_every_pair_module)


def pack(blocks, key, relative_bias=None):
    """`blocks` (a Blocks whose mask_mod is registered under `key`), and a relative bias
    ((B or 1, H or 1, L + S - 1): kernels/block_sparse_masks.py) or none, as one uint8
    tensor, traceable (no host synchronization); None where it cannot be packed: sizes that
    are not plain ints, a captured value that is not a tensor, too many parts."""
    lists = [blocks.kv_num_blocks, blocks.kv_indices]
    has_full = blocks.full_kv_num_blocks is not None
    if has_full:
        lists += [blocks.full_kv_num_blocks, blocks.full_kv_indices]
    parts = lists + list(blocks.mask_mod_buffers)
    if relative_bias is not None:
        parts.append(relative_bias)
    sizes = (*blocks.seq_lengths, *blocks.block_size)
    if len(parts) > _MAX_PARTS or not all(type(n) is int for n in sizes) or not all(
            isinstance(t, torch.Tensor) and t.dtype in _DTYPES and t.dim() <= _MAX_DIMS
            and all(type(n) is int for n in t.shape) for t in parts):
        return None
    words = [_MAGIC, key, *sizes, *map(int, blocks.mask_mod_reads), int(has_full),
             int(relative_bias is not None), len(parts)]
    offset = _HEADER_BYTES
    for t in parts:
        words += [_DTYPES.index(t.dtype), t.dim(), *t.shape, *[1] * (_MAX_DIMS - t.dim()),
                  offset]
        offset += _padded_bytes(t)
    words += [0] * (_HEADER_BYTES // 8 - len(words))
    return torch.ops.bob_compile.pack_block_mask(parts, words)


# One op packs, so that the ops' `resolve` can tell a packed mask by what it was packed
# from: a compiled graph packs its BlockMask anew at every call (and the second order's
# VJP pair once more), and reading a packed mask's bytes to key its form is a host
# synchronization on a GPU. Packed from the same tensors, none of them written since
# (their versions), the form made for them is taken without reading anything.
@torch.library.custom_op("bob_compile::pack_block_mask", mutates_args=())
def _pack_block_mask(parts: list[torch.Tensor], words: list[int]) -> torch.Tensor:
    device = parts[0].device
    data = [_header(tuple(words), device)]
    for t in parts:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        data += [raw, _zeros(-raw.numel() % 8, device)]
    packed = torch.cat(data)
    _remember_sources(packed, parts, words)
    return packed


@_pack_block_mask.register_fake
def _(parts, words):
    return parts[0].new_empty(_HEADER_BYTES + sum(map(_padded_bytes, parts)),
                              dtype=torch.uint8)


def _padded_bytes(part):
    """A part's bytes in the packed tensor: its own, then zeros to an 8-byte boundary."""
    return block_sparse_masks.aligned(part.numel() * part.dtype.itemsize)


@functools.lru_cache(maxsize=64)
def _header(words, device):
    """The header's bytes on `device`, copied there once per header (a copy per call would
    wait for the device)."""
    return torch.tensor(words, dtype=torch.int64).view(torch.uint8).to(device)


@functools.lru_cache(maxsize=16)
def _zeros(n, device):
    return torch.zeros(n, dtype=torch.uint8, device=device)


def _source_key(tensor):
    """A part's tensor as resolve's key names it: the tensor it views (the graph's input,
    which the compiled code may view afresh at every call), its version and its geometry."""
    base = tensor if tensor._base is None else tensor._base
    return base, (id(base), base._version, tensor.data_ptr(), tuple(tensor.shape),
                  tuple(tensor.stride()), tensor.dtype)


def _remember_sources(packed, parts, words):
    bases, keys = zip(*map(_source_key, parts))
    _sources_of_packed[id(packed)] = (weakref.ref(packed), (tuple(keys), tuple(words)), bases)
    weakref.finalize(packed, _sources_of_packed.pop, id(packed), None)


def resolve(packed, batch, heads, L, S):
    """The mask a packed BlockMask applies to a (batch, heads, L, S) call, as the ops take
    it: KeyIntervals where its rows and keys are intervals, else a BlockSparseMask (tile by
    tile) or, up to TILES_ABOVE_BYTES, the materialized (batch, heads, L, S) view
    (key_intervals). Reads the packed bytes and lists the partial blocks on the host,
    except where the form of a mask packed from the same tensors is kept (a loop reusing
    its BlockMask: read at its first call only). A tile-by-tile mask's own data (what
    bob_compile.flex_attention passes eagerly) is taken as it is."""
    if packed.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "bob_compile: a packed BlockMask cannot be resolved while a CUDA graph is "
            "captured (it lists the mask's blocks on the host); flashbob materializes "
            "BlockMasks in graphs compiled with CUDA graphs: compile this model with "
            "flashbob's own mode (e.g. mode='reduce-overhead') rather than capturing it")
    built = block_sparse_masks.built(packed)
    if built is not None:
        return _checked_lengths(built.for_call(batch, heads), L, S)
    identity = (id(packed), packed._version, packed.data_ptr(), batch, heads, L, S)
    kept = _by_packed.get(identity)
    if kept is not None and kept[0]() is packed:        # a later op of the same call
        return kept[1]
    call = (batch, heads, L, S, str(packed.device))
    sources = _sources_of_packed.get(id(packed))
    if sources is not None and (sources[0]() is not packed or packed._version):
        sources = None                   # another tensor now, or written since it was packed
    if sources is not None:              # packed from tensors whose form is known: no read
        kept = _by_sources.get((sources[1], call))
        if kept is not None and _alive(kept[0], sources[2]):
            return _resolved(packed, identity, kept[1], batch, heads, L, S)
    cached = packed.numel() <= _CONTENT_KEYED_BYTES
    data = (packed if cached else packed[:_HEADER_BYTES]).cpu()
    words = data[:min(data.numel(), _HEADER_BYTES) // 8 * 8].view(torch.int64).tolist()
    if words and words[0] == block_sparse_masks.MAGIC:
        return _checked_lengths(BlockSparseMask(packed, words[1:block_sparse_masks.HEADER_WORDS],
                                                batch, heads), L, S)
    if not words or words[0] != _MAGIC:
        raise RuntimeError("bob_compile attention ops: a uint8 mask is a BlockMask packed by "
                           "bob_compile.block_masks.pack or a tile-by-tile mask "
                           "(kernels/block_sparse_masks.py); this one is neither")
    key, mask_L, mask_S, q_block, kv_block, reads_batch, reads_head, has_full, has_bias, n = \
        words[1:_FIXED_WORDS]
    mask_mod = _mask_mods.get(key)
    if mask_mod is None:
        raise RuntimeError(f"bob_compile: the mask_mod of a packed BlockMask (key {key:#x}) "
                           f"is not registered in this process (the flashbob pass registers "
                           f"it when it compiles the graph)")
    if (mask_L, mask_S) != (L, S):
        raise RuntimeError(f"bob_compile: a BlockMask packed for {(mask_L, mask_S)} (query, "
                           f"key) lengths reached a call of {(L, S)}")
    parts = []
    for p in range(n):
        code, ndim, *rest = words[_FIXED_WORDS + _PART_WORDS * p:][:_PART_WORDS]
        shape, offset = rest[:ndim], rest[-1]
        dtype = _DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize
        parts.append(packed[offset:offset + nbytes].view(dtype).view(shape))
    lists = parts[:4] if has_full else parts[:2] + [None, None]
    relative_bias = parts.pop() if has_bias else None
    blocks = Blocks((L, S), (q_block, kv_block), *lists, mask_mod,
                    tuple(parts[4 if has_full else 2:]), (bool(reads_batch), bool(reads_head)))
    # each op of a step resolves the same packed mask, and each step packs it anew: its
    # form is kept by content (the bytes read above: block lists, captured tensors, the
    # mask_mod's key)
    content = (hashlib.blake2b(data.numpy().tobytes(), digest_size=16).digest(), *call) \
        if cached else None
    form = _by_content.get(content) if cached else None
    if form is None:
        form = key_intervals(blocks, L, S, packed.device, batch, heads, tiles_otherwise=True,
                             relative_bias=relative_bias, dense_up_to=TILES_ABOVE_BYTES)
        if cached and _small(form):
            _keep(_by_content, content, form)
    if sources is not None and _small(form):
        _keep(_by_sources, (sources[1], call), (_weak(sources[2]), form))
    return _resolved(packed, identity, form, batch, heads, L, S)


def _resolved(packed, identity, form, batch, heads, L, S):
    """The op's mask of a packed BlockMask's form, kept for the later ops of the call."""
    if isinstance(form, BlockSparseMask):
        mask = form.for_call(batch, heads)
    elif form.dtype != torch.int32:         # materialized: bool, or additive with a bias
        mask = form.expand(batch, heads, L, S)
    else:
        mask = KeyIntervals.of(form, batch, heads, L, S)
    # for the later ops of this call
    _by_packed[identity] = (weakref.ref(packed), mask)
    weakref.finalize(packed, _by_packed.pop, identity, None)
    return mask


def _checked_lengths(mask, L, S):
    if (mask.L, mask.S) != (L, S):
        raise RuntimeError(f"bob_compile: a tile-by-tile mask of {(mask.L, mask.S)} (query, "
                           f"key) lengths reached a call of {(L, S)}")
    return mask


# ------------------------------------------------------------------ kept across calls
# A training loop attends with the same BlockMask call after call: key intervals (small)
# are kept, a few at a time, and found again by what they were made from. A packed mask by
# the identity and version of the tensors it was packed from (no read at all), else by its
# bytes (resolve: read once per packed tensor, whose mask the later ops of its call find
# by the tensor's identity while it lives); an eager call's by the identity and version of
# every tensor its pairs depend on (reused_key_intervals).
# A mask that is not intervals (or a relative bias, flex.py) is materialized where that
# takes at most this many bytes, read tile by tile beyond: the materialized mask runs the
# kernels' plain read path, which measured faster than the tiles' (docs/measurements.md)
TILES_ABOVE_BYTES = 1 << 30
_CONTENT_KEYED_BYTES = 64 << 20      # larger packed masks (a dense captured buffer) not kept,
_KEPT = 8                            # nor larger tile-by-tile forms
_by_content = collections.OrderedDict()
_by_packed = collections.OrderedDict()
_by_sources = collections.OrderedDict()
_sources_of_packed = {}      # id(packed) -> (weakref to it, its sources' key, the sources)
_by_identity = collections.OrderedDict()


_kept_lock = threading.Lock()     # the autograd engine's threads resolve masks too


def _keep(kept, key, value, limit=_KEPT):
    with _kept_lock:
        kept[key] = value
        kept.move_to_end(key)
        while len(kept) > limit:
            kept.popitem(last=False)


def _small(form):
    """Whether a mask's form is small enough to keep across calls: key intervals, tiles up
    to _CONTENT_KEYED_BYTES; never an L x S bool mask."""
    if isinstance(form, BlockSparseMask):
        return form.nbytes() <= _CONTENT_KEYED_BYTES
    return form.dtype == torch.int32


def reused_key_intervals(blocks, L, S, device, batch, heads):
    """key_intervals(..., tiles_otherwise=True): the int32 summary or the BlockSparseMask,
    kept for the next call with the same BlockMask, mask_mod and tensors, none of them
    modified since (their versions), and the same values of the numbers and strings the
    mask_mod reads, where small (_small). Kept only where everything the mask_mod reads can
    be told (_reads_of: its closure, defaults and the globals it names, through the plain
    functions it reaches, as and_masks/or_masks compose them), or for a graph of Dynamo's,
    which reads only its arguments; anything else is evaluated every call."""
    sources = _sources(blocks)
    if sources is None:
        return key_intervals(blocks, L, S, device, batch, heads, tiles_otherwise=True,
                             dense_up_to=TILES_ABOVE_BYTES)
    tensors, constants, functions = sources
    values = tuple(b if isinstance(b, (int, float, bool)) else int(b)
                   for b in blocks.mask_mod_buffers if not isinstance(b, torch.Tensor))
    key = (id(blocks.mask_mod), tuple((id(t), t._version) for t in tensors), values,
           constants, L, S, batch, heads, str(device))
    reached = (blocks.mask_mod, *functions, *tensors)
    kept = _by_identity.get(key)
    if kept is not None and _alive(kept[0], reached):
        with _kept_lock:
            if key in _by_identity:
                _by_identity.move_to_end(key)
        return kept[1]
    form = key_intervals(blocks, L, S, device, batch, heads, tiles_otherwise=True,
                         dense_up_to=TILES_ABOVE_BYTES)
    if _small(form):
        _keep(_by_identity, key, (_weak(reached), form))
    return form


_SCALAR_TYPES = (int, float, bool, str, bytes, type(None))
# modules a mask_mod may name whose attributes it reads as library code (torch.where,
# math.pi); a user's module may hold state (config.window) that no key would see
_LIBRARY_MODULES = ("torch", "math", "operator", "functools", "numpy", "builtins")


def _sources(blocks):
    """(the tensors the pairs of `blocks` depend on: block lists, captured buffers, the
    tensors its mask_mod reads; the numbers and strings its mask_mod reads; the functions it
    reaches), or None where that cannot be told (see reused_key_intervals)."""
    mask_mod = blocks.mask_mod
    tensors = [t for t in (blocks.kv_num_blocks, blocks.kv_indices, blocks.full_kv_num_blocks,
                           blocks.full_kv_indices, *blocks.mask_mod_buffers)
               if isinstance(t, torch.Tensor)]
    if isinstance(mask_mod, torch.fx.GraphModule):     # Dynamo's: what it reads is passed
        return None if mask_mod.graph.find_nodes(op="get_attr") else (tensors, (), [])
    if not isinstance(mask_mod, types.FunctionType):
        return None
    reads = _reads_of(mask_mod)
    return None if reads is None else (tensors + reads[0], reads[1], reads[2])


def _reads_of(function):
    """(tensors, scalar values, functions) that a plain function reads from its closure, its
    defaults and the globals its code names (nested functions' code included), through
    every plain function, functools.partial and tuple it reaches that way (and_masks/or_masks
    keep their mask_mods in a closure tuple); the scalars (with the functions' ids) in a
    fixed order, for a key. None where it reaches anything else: a list, a dict, an object,
    a user's module, an empty cell."""
    tensors, scalars, functions, seen = [], [], [], set()
    stack = [function]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, _SCALAR_TYPES):
            scalars.append((type(value).__name__, value))
        elif id(value) in seen:
            continue
        elif isinstance(value, types.ModuleType):
            if value.__name__.split(".")[0] not in _LIBRARY_MODULES:
                return None
        elif isinstance(value, (tuple, frozenset)):
            seen.add(id(value))
            stack.extend(value)
        elif isinstance(value, functools.partial):
            seen.add(id(value))
            stack.extend((value.func, *value.args, *value.keywords.values()))
        elif isinstance(value, types.FunctionType):
            seen.add(id(value))
            # which function is reached (a global helper rebound to another function between
            # calls): by id in the key (kept keys stay plain values: Dynamo may trace this
            # and guard on them), checked by identity where kept (_alive)
            scalars.append(("function", id(value)))
            functions.append(value)
            reached = _function_reads(value)
            if reached is None:
                return None
            stack.extend(reached)
        elif not _library_function(value):
            return None
    return tensors, tuple(scalars), functions


def _weak(objects):
    return [weakref.ref(o) for o in objects]


def _alive(refs, objects):
    """Whether weak references `refs` still name exactly `objects` (no id reused)."""
    return len(refs) == len(objects) and all(r() is o for r, o in zip(refs, objects))


def _function_reads(function):
    """What a plain function reads besides its arguments: its closure's cells, defaults and
    the globals its code (and its nested functions' code) names; a library function's
    (PyTorch's, Python's) closure only, its globals being the library's. None for an empty
    cell."""
    read = []
    for cell in function.__closure__ or ():
        try:
            read.append(cell.cell_contents)
        except ValueError:          # an empty cell
            return None
    if _library_function(function):
        return read
    read += list(function.__defaults__ or ()) + list((function.__kwdefaults__ or {}).values())
    codes, names = [function.__code__], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    namespace = function.__globals__
    return read + [namespace[n] for n in sorted(names) if n in namespace]


def _library_function(value):
    """PyTorch's, Python's or NumPy's own callables (torch.where, abs, math.floor): they
    read no user state."""
    module = getattr(value, "__module__", None) or ""
    return callable(value) and module.split(".")[0] in _LIBRARY_MODULES \
        and not isinstance(value, torch.nn.Module)
