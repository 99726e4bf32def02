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
import dataclasses
import hashlib

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .kernels.interval_masks import KeyIntervals, summary_of_intervals


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
                   block_mask.mask_mod, (), mask_mod_reads(block_mask.mask_mod))

    @classmethod
    def of_tuple(cls, block_tuple, mask_mod_buffers=(), mask_mod_reads=(True, True)):
        """From the tuple the higher-order op takes (BlockMask.as_tuple(): the lengths and
        the kv block tensors first; the block sizes and the mask_mod last)."""
        L, S, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices = block_tuple[:6]
        q_block, kv_block, mask_mod = block_tuple[-3:]
        return cls((L, S), (q_block, kv_block), kv_num_blocks, kv_indices, full_kv_num_blocks,
                   full_kv_indices, mask_mod, tuple(mask_mod_buffers), tuple(mask_mod_reads))


# mask_mod evaluations per chunk: bounds the index-sized intermediates (int64 for a
# document-id lookup) that evaluating a chunk makes, 128 MiB each
_EVALUATIONS_PER_CHUNK = 1 << 24


def visible_pairs(blocks, L, S, device, batch, heads):
    """The bool (B or 1, H or 1, L, S) mask `blocks` (a Blocks) applies to a (batch, heads,
    L, S) call, as FlexAttention applies it: every pair of its full blocks, the pairs of its
    partial blocks where the mask_mod says so, nothing elsewhere; the mask_mod evaluated at
    the call's batch entries and heads where it reads them (whatever the BlockMask's own
    sizes). Run eagerly, the mask_mod is evaluated on the listed partial blocks only (a
    sliding window's or packed documents' two or three per row of blocks: 1/40 of the
    pairs at 16K), which costs one host synchronization to list them; inside a traced graph
    or a CUDA graph capture, where none may be, over every pair a chunk of rows at a time."""
    # a block longer than the call (flex_attention's mask for calls without one: lengths
    # (1, 1), blocks of 2^30) covers it once
    q_block, kv_block = min(blocks.block_size[0], L), min(blocks.block_size[1], S)
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
    evaluate = _by_block if _may_synchronize(partial) else _by_rows
    return evaluate(mask_mod, partial, full, sizes, L, S, q_block, kv_block, device)


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
    q_blocks, kv_blocks = partial.shape[-2:]
    visible = torch.zeros(*sizes, q_blocks * q_block, kv_blocks * kv_block, dtype=torch.bool,
                          device=device)
    tiles = visible.view(*sizes, q_blocks, q_block, kv_blocks, kv_block).permute(
        0, 1, 2, 4, 3, 5)                       # (B, H, q blocks, key blocks, rows, keys)
    if full is not None:
        tiles.copy_(full.expand(*sizes, -1, -1)[..., None, None].expand(tiles.shape))
    listed = partial.expand(*sizes, -1, -1).nonzero()          # (P, 4): the synchronization
    in_rows = torch.arange(q_block, device=device)
    in_keys = torch.arange(kv_block, device=device)
    evaluate = mask_mod
    for in_dims in ((None, None, None, 0), (None, None, 0, None), (0, 0, 0, 0)):
        evaluate = torch.vmap(evaluate, in_dims=in_dims)   # keys, rows, then blocks
    per_chunk = max(1, _EVALUATIONS_PER_CHUNK // (q_block * kv_block))
    for chunk in listed.split(per_chunk):
        b, h, row_block, key_block = chunk.unbind(1)
        rows = (row_block[:, None] * q_block + in_rows).clamp_max(L - 1)
        keys = (key_block[:, None] * kv_block + in_keys).clamp_max(S - 1)
        # rows past L and keys past S (the padding) are cut off below
        tiles[b, h, row_block, key_block] = evaluate(b, h, rows, keys).to(torch.bool)
    return visible[..., :L, :S]


def _may_synchronize(tensor):
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
def trace_mod(function, buffers=(), score_dtype=None):
    """A mod's aten graph: a score_mod's (score_dtype given: traced with score, b, h, q_idx,
    kv_idx) or a mask_mod's (b, h, q_idx, kv_idx), then `buffers` (tensors, real, fake or
    meta, or sizes, standing for what Dynamo passes as extra arguments); or why it could
    not be traced."""
    try:
        # traced as written, outside any torch.func level (the example inputs made there
        # too: made under a transform, make_fx takes them for constants); one-element
        # tensors, not 0-d ones (indexing a buffer with a 0-d index reads its value), one
        # per input (make_fx takes one tensor passed twice for one input); on the meta
        # device, where the buffers are, so that no value is read
        with torch._C._DisableFuncTorch():
            device = next((b.device for b in buffers if isinstance(b, torch.Tensor)), "cpu")
            examples = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(4)]
            if score_dtype is not None:
                examples.insert(0, torch.zeros(1, dtype=score_dtype, device=device))
            return make_fx(lambda *indices: function(*indices, *buffers))(*examples).graph
    except Exception as e:       # data-dependent Python control flow, unsupported ops
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def mask_mod_reads(mask_mod, buffers=()):
    """(reads the batch index, reads the head index) of `mask_mod(b, h, q_idx, kv_idx,
    *buffers)`, from its traced graph; both where it cannot be traced. FlexAttention
    evaluates a mask_mod at the call's own batch entry and head, whatever the BlockMask's
    batch and head sizes."""
    return index_reads(trace_mod(mask_mod, buffers))


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

