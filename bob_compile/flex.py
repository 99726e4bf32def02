"""FlexAttention's description of a call (a BlockMask, a score_mod), run by bob_compile's op.

    from bob_compile import flex_attention
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=sliding_window)

takes torch.nn.attention.flex_attention's arguments and gives its result, differentiable at
every order (PyTorch's own flex_attention has no second derivative). What it runs: the
call's visible pairs and additive scores as one attention mask of bob_compile.attention:

- the mask a BlockMask applies: a pair is visible when its (query block, key block) is
  listed as full, or listed as partial and the mask_mod says so, as FlexAttention's compiled
  kernels apply it (a mask_mod alone does not define it: `BlockMask.from_kv_blocks` may list
  fewer blocks than its pattern; FlexAttention's eager path reads the mask_mod alone);
- a score_mod of the form `score + bias(b, h, q_idx, kv_idx)` (ALiBi, relative-position
  buffers, a learned bias: captured tensors that require grad get their gradients), checked
  on the function's traced graph; its bias is score_mod evaluated at score 0, in the
  query's dtype.

Both are materialized at the call's (B or 1, H or 1, L, S) shape: memory O(L S) per distinct
batch and head of the BlockMask, and of the bias where it reads b or h (broadcast once
otherwise), not the O(partial blocks) that reading the blocks in the kernels would cost.
Other score_mods (tanh soft-capping, anything nonlinear in the score), and return_lse=True,
run as math with a warning: exact at every order, N x N in memory.

The passes (bob_compile/passes/flex_attention.py) put `flex_call` in place of the
higher-order op Dynamo records for torch.nn.attention.flex_attention (its arguments, the
BlockMask as a tuple, the mods as graphs taking their captured tensors as extra arguments),
and `flex_math` where the score_mod is not additive: the same function written as math
(N x N in memory), exact at every order.
"""
import dataclasses
import math
import warnings

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from .attention import attention

_ADD, _SUBTRACT = torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor


# ------------------------------------------------------------------ the public call
def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None):
    """torch.nn.attention.flex_attention's call, through bob_compile.attention (module doc).

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev); score_mod None or any
    elementwise function of the score and indices; block_mask None or a BlockMask built for
    (L, S); scale defaults to 1 / sqrt(E). kernel_options (FlexAttention's Triton options)
    are ignored. Rows that see no key give zeros, as in FlexAttention. A score_mod that is
    not additive in the score, or return_lse=True, runs as math (exact at every order, N x N
    in memory), with a warning."""
    if query.dim() != 4:
        raise ValueError(f"bob_compile.flex_attention: query must be (B, H, L, E), got "
                         f"{tuple(query.shape)}")
    blocks = None
    if block_mask is not None:
        blocks = Blocks.of(block_mask)
        if blocks.seq_lengths != (query.shape[-2], key.shape[-2]):
            raise ValueError(f"bob_compile.flex_attention: the BlockMask was built for "
                             f"{blocks.seq_lengths} (query, key) lengths, the call has "
                             f"({query.shape[-2]}, {key.shape[-2]}); build it for the call's "
                             f"lengths")
    form = None if score_mod is None else score_mod_form(score_mod, query.dtype)
    if isinstance(form, str) or return_lse:
        why = "return_lse=True" if not isinstance(form, str) else (
            f"its score_mod {getattr(score_mod, '__name__', score_mod)} {form} (only "
            f"score + bias(b, h, q_idx, kv_idx) runs fused)")
        warnings.warn(f"bob_compile.flex_attention runs this call as math, N x N in memory, "
                      f"exact at every order: {why}", stacklevel=2)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        output, logsumexp, _ = _math(query, key, value, score_mod, blocks, scale)
        return (output, logsumexp) if return_lse else output
    return _attend(query, key, value, blocks, score_mod, form, (), scale, enable_gqa)


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


# ------------------------------------------------------------------ the score_mod
@dataclasses.dataclass
class AdditiveScoreMod:
    """A score_mod that returns score + bias(b, h, q_idx, kv_idx) (identity: bias 0), and
    which indices its bias reads."""
    identity: bool
    reads_batch: bool
    reads_head: bool


def score_mod_form(score_mod, dtype, buffers=()):
    """AdditiveScoreMod for `score_mod(score, b, h, q_idx, kv_idx, *buffers)` when its
    traced graph is additive in the score, else a phrase saying what it does instead.
    `buffers`: tensors (real, fake or meta) standing for the captured tensors Dynamo passes
    as extra arguments."""
    graph = trace_mod(score_mod, buffers, dtype)
    if isinstance(graph, str):
        return f"could not be traced ({graph})"
    score, b, h = graph.find_nodes(op="placeholder")[:3]
    result = graph.output_node().args[0]
    if isinstance(result, (tuple, list)):
        result = result[0]
    if result is score:
        return AdditiveScoreMod(True, False, False)
    if getattr(result, "target", None) in (_ADD, _SUBTRACT) and \
            result.kwargs.get("alpha", 1) == 1:
        operands = list(result.args[:2])
        if (operands[0] is score and not _reads(operands[1], score)) or \
                (result.target is _ADD and operands[1] is score and not _reads(operands[0], score)):
            return AdditiveScoreMod(False, bool(b.users), bool(h.users))
    return "is not score plus a term without the score"


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


def _reads(value, node):
    """Whether `value` (an FX node or a constant) depends on `node`."""
    if not isinstance(value, torch.fx.Node):
        return False
    seen, stack = set(), [value]
    while stack:
        current = stack.pop()
        if current is node:
            return True
        if current in seen:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return False


def additive_bias(score_mod, query, L, S, form=None, buffers=()):
    """score_mod's bias(b, h, q_idx, kv_idx) in query's dtype, at (B, H, L, S) with B or H 1
    where the bias does not read b or h. `form`: score_mod_form's, when known."""
    form = form if form is not None else score_mod_form(score_mod, query.dtype)
    if isinstance(form, str):
        raise NotImplementedError(f"the score_mod {form}")
    score = torch.zeros((), dtype=query.dtype, device=query.device)

    def bias(b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx, kv_idx, *buffers)
    sizes = (query.shape[0] if form.reads_batch else 1,
             query.shape[1] if form.reads_head else 1, L, S)
    return _over_indices(bias, sizes, query.device).to(query.dtype)


def _over_indices(function, sizes, device, score=None):
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


# ------------------------------------------------------------------ running the call
def _attend(query, key, value, blocks, score_mod, form, score_mod_buffers, scale, enable_gqa):
    L, S = query.shape[-2], key.shape[-2]
    mask = None if blocks is None else visible_pairs(blocks, L, S, query.device,
                                                     *query.shape[:2])
    if score_mod is not None and not form.identity:
        bias = additive_bias(score_mod, query, L, S, form, score_mod_buffers)
        mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    return attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def flex_call(query, key, value, score_mod, block_mask, scale, kernel_options,
              score_mod_other_buffers=(), mask_mod_other_buffers=(), *, additive, masked=True,
              mask_mod_reads=(True, True)):
    """torch.ops.higher_order.flex_attention's call (same arguments; `block_mask` the
    BlockMask's tuple) through bob_compile.attention, for a score_mod additive in the score
    (`additive`: AdditiveScoreMod's fields as a tuple, found by the pass); `masked` False
    where the BlockMask is the one flex_attention makes when given none (every pair
    visible); `mask_mod_reads`: mask_mod_reads's, found by the pass. Returns (output,): the
    op's first output; the pass puts it only where nothing reads the others (the
    logsumexp, the maximum)."""
    blocks = Blocks.of_tuple(block_mask, mask_mod_other_buffers, mask_mod_reads) \
        if masked else None
    return (_attend(query, key, value, blocks, score_mod, AdditiveScoreMod(*additive),
                    tuple(score_mod_other_buffers), scale,
                    enable_gqa=query.shape[1] != key.shape[1]),)


def flex_math(query, key, value, score_mod, block_mask, scale, kernel_options,
              score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """torch.ops.higher_order.flex_attention's call as math, for any score_mod (_math).
    Returns the op's three outputs: the output, and the logsumexp and maximum of the rows'
    scores in base 2, as the op gives them."""
    blocks = Blocks.of_tuple(block_mask, mask_mod_other_buffers)
    output, logsumexp, maximum = _math(query, key, value, score_mod, blocks, scale,
                                       tuple(score_mod_other_buffers))
    return output, logsumexp / math.log(2), maximum / math.log(2)


def _math(query, key, value, score_mod, blocks, scale, score_mod_buffers=()):
    """FlexAttention's function in plain ops: the scores (B, H, L, S) through the score_mod
    (any), the pairs `blocks` hides (None: none) at -inf, softmax, times value; a row that
    sees no key gives zeros. Differentiable at every order, N x N in memory. Returns the
    output, and the rows' logsumexp and maximum of their scores (-inf for a row that sees
    none)."""
    L, S = query.shape[-2], key.shape[-2]
    groups = query.shape[1] // key.shape[1]
    if groups != 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    # in float32 at least, as FlexAttention's kernels compute the scores
    compute = torch.promote_types(query.dtype, torch.float32)
    scores = query.to(compute) @ key.to(compute).transpose(-1, -2) * scale
    if score_mod is not None:
        def modified(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, q_idx, kv_idx, *score_mod_buffers)
        scores = _over_indices(modified, scores.shape, query.device, score=scores)
    if blocks is not None:
        scores = scores.masked_fill(
            ~visible_pairs(blocks, L, S, query.device, *query.shape[:2]), float("-inf"))
    sees_a_key = (scores != float("-inf")).any(-1, keepdim=True)
    # rows that see no key: softmax of zeros, then zeroed (no NaN in any derivative)
    safe_scores = torch.where(sees_a_key, scores, 0.0)
    probabilities = torch.where(sees_a_key, torch.softmax(safe_scores, -1), 0.0)
    output = (probabilities @ value.to(compute)).to(query.dtype)
    unseen = torch.where(sees_a_key[..., 0], 0.0, float("-inf"))
    return output, safe_scores.logsumexp(-1) + unseen, safe_scores.amax(-1) + unseen


# ------------------------------------------------------------------ torch.func
def _register_functorch_rules():
    """PyTorch's flex_attention op has no rule for torch.func's grad, jvp and vmap (the
    call fails, eagerly and when Dynamo traces it); give it flex_math, the same function
    in ops torch.func differentiates and batches. Rules PyTorch defines are kept."""
    from torch._C._functorch import TransformType
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op
    for transform in (TransformType.Grad, TransformType.Jvp, TransformType.Vmap):
        if transform not in flex_op.py_kernels:
            flex_op.py_impl(transform)(lambda interpreter, *args: flex_math(*args))


_register_functorch_rules()
