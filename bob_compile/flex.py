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
otherwise), not the O(partial blocks) that
reading the blocks in the kernels would cost. Other score_mods (tanh soft-capping, anything
nonlinear in the score) are refused with NotImplementedError, never approximated.
"""
import math

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention.flex_attention import create_mask

from .attention import attention

_ADD, _SUBTRACT = torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None):
    """torch.nn.attention.flex_attention's call, through bob_compile.attention (module doc).

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev); score_mod None or
    additive in the score; block_mask None or a BlockMask built for (L, S); scale defaults
    to 1 / sqrt(E). kernel_options (FlexAttention's Triton options) are ignored;
    return_lse is not supported. Rows that see no key give zeros, as in FlexAttention."""
    if return_lse:
        raise NotImplementedError("bob_compile.flex_attention: return_lse=True is not supported; "
                                  "call torch.nn.attention.flex_attention for the logsumexp")
    if query.dim() != 4:
        raise ValueError(f"bob_compile.flex_attention: query must be (B, H, L, E), got "
                         f"{tuple(query.shape)}")
    L, S = query.shape[-2], key.shape[-2]
    mask = None
    if block_mask is not None:
        mask = visible_pairs(block_mask, L, S, query.device)
    if score_mod is not None:
        bias = additive_bias(score_mod, query, L, S)
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf"))
        mask = bias
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    return attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def visible_pairs(block_mask, L, S, device):
    """The bool (B or 1, H or 1, L, S) mask a BlockMask applies to an L x S call."""
    if tuple(block_mask.seq_lengths) != (L, S):
        raise ValueError(f"bob_compile.flex_attention: the BlockMask was built for "
                         f"{tuple(block_mask.seq_lengths)} (query, key) lengths, the call has "
                         f"({L}, {S}); build it for the call's lengths")
    q_block, kv_block = block_mask.BLOCK_SIZE
    kv_blocks = -(-S // kv_block)

    def pairs(num_blocks, indices):
        """The listed blocks, expanded to the pairs they cover."""
        listed = torch.arange(indices.shape[-1], device=device) < num_blocks[..., None]
        blocks = torch.zeros(*indices.shape[:-1], kv_blocks + 1, dtype=torch.bool, device=device)
        blocks.scatter_(-1, torch.where(listed, indices.long(), kv_blocks), True)
        blocks = blocks[..., :kv_blocks]
        return blocks.repeat_interleave(q_block, -2).repeat_interleave(kv_block, -1)[..., :L, :S]

    batch, heads = block_mask.kv_num_blocks.shape[:2]
    partial = pairs(block_mask.kv_num_blocks, block_mask.kv_indices)
    visible = partial & create_mask(block_mask.mask_mod, batch, heads, L, S, device)
    if block_mask.full_kv_num_blocks is not None:
        visible = visible | pairs(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return visible


def additive_bias(score_mod, query, L, S):
    """score_mod's bias(b, h, q_idx, kv_idx) in query's dtype, when score_mod(score, ...) =
    score + bias (checked on its traced graph), at (B, H, L, S) with B or H 1 where the bias
    does not read b or h; else NotImplementedError."""
    graph, problem = _traced(score_mod, query.dtype)
    problem = problem or _not_additive(graph)
    if problem:
        raise NotImplementedError(
            f"bob_compile.flex_attention: the score_mod {getattr(score_mod, '__name__', score_mod)} "
            f"{problem}; only score + bias(b, h, q_idx, kv_idx) is supported (ALiBi, relative "
            f"biases); soft-capping and other nonlinear score_mods are not yet")
    _, b, h = graph.find_nodes(op="placeholder")[:3]
    score = torch.zeros((), dtype=query.dtype, device=query.device)

    def bias(b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx, kv_idx)
    # one vmap per index, innermost the key's (as FlexAttention evaluates its mods)
    for in_dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None),
                    (0, None, None, None)):
        bias = torch.vmap(bias, in_dims=in_dims)
    sizes = (query.shape[0] if b.users else 1, query.shape[1] if h.users else 1, L, S)
    return bias(*[torch.arange(n, device=query.device) for n in sizes]).to(query.dtype)


def _traced(score_mod, dtype):
    """(score_mod's aten graph, None), or (None, why it could not be traced)."""
    try:
        # traced as written, outside any torch.func level (the example inputs made there
        # too: made under a transform, make_fx takes them for constants); one-element
        # tensors, not 0-d ones (indexing a buffer with a 0-d index reads its value), one
        # per input (make_fx takes one tensor passed twice for one input)
        with torch._C._DisableFuncTorch():
            examples = [torch.zeros(1, dtype=dtype),
                        *(torch.zeros(1, dtype=torch.int64) for _ in range(4))]
            return make_fx(score_mod)(*examples).graph, None
    except Exception as e:       # data-dependent Python control flow, unsupported ops
        return None, (f"could not be traced ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})")


def _not_additive(graph):
    """None when the graph returns score + (a value that does not read score) or
    score - (such a value); else what it does instead."""
    score = graph.find_nodes(op="placeholder")[0]
    result = graph.output_node().args[0]
    if isinstance(result, (tuple, list)):
        result = result[0]
    if result is score:
        return None
    if getattr(result, "target", None) in (_ADD, _SUBTRACT) and \
            result.kwargs.get("alpha", 1) == 1:
        operands = list(result.args[:2])
        if operands[0] is score and not _reads(operands[1], score):
            return None
        if result.target is _ADD and operands[1] is score and not _reads(operands[0], score):
            return None
    return "is not score plus a term without the score"


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
