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
  query's dtype. The score may be soft-capped first, `c * tanh(a * score) [+ bias]`
  (Gemma 2: a = 1 / c): the op's softcap c, its scale multiplied by a c, applied in the
  kernels, exact at every order.

The BlockMask reaches the op as key intervals or tile by tile (block_masks.py), never
L x S. A bias that reads the query and key indices only through q_idx - kv_idx (ALiBi,
relative-position tables, T5's buckets) and requires no grad comes with the tiles as one row
of L + S - 1 values per distinct batch entry and head (kernels/block_sparse_masks.py); any
other bias is materialized at (B or 1, H or 1, L, S) with the BlockMask's mask folded in.
Other score_mods (anything else nonlinear in the score), and return_lse=True, run as math
with a warning: exact at every order, N x N in memory.

The passes (bob_compile/passes/flex_attention.py) put `flex_call` in place of the
higher-order op Dynamo records for torch.nn.attention.flex_attention (its arguments, the
BlockMask as a tuple, the mods as graphs taking their captured tensors as extra arguments),
and `flex_math` where the score_mod is not of those forms: the same function written as
math (N x N in memory), exact at every order.
"""
import dataclasses
import math
import warnings

import torch

from .attention import attention, attention_with_op_mask
from .block_masks import (Blocks, every_pair_blocks, key_intervals, may_synchronize,
                          over_indices, pack, reused_key_intervals, trace_mod, traced_once,
                          visible_pairs)
from . import block_masks
from .kernels import settings as kernel_settings
from .kernels.block_sparse_masks import BlockSparseMask

_ADD, _SUBTRACT = torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor
_MULTIPLY, _DIVIDE = torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor
_TANH = torch.ops.aten.tanh.default


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
    form = None if score_mod is None else score_mod_form(score_mod, query.dtype,
                                                         device=query.device)
    if isinstance(form, str) or return_lse:
        why = "return_lse=True" if not isinstance(form, str) else (
            f"its score_mod {getattr(score_mod, '__name__', score_mod)} {form} (only "
            f"[c tanh(score / c)] + bias(b, h, q_idx, kv_idx) runs fused)")
        warnings.warn(f"bob_compile.flex_attention runs this call as math, N x N in memory, "
                      f"exact at every order: {why}", stacklevel=2)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        output, logsumexp, _ = _math(query, key, value, score_mod, blocks, scale)
        return (output, logsumexp) if return_lse else output
    return _attend(query, key, value, blocks, score_mod, form, (), scale, enable_gqa)


# ------------------------------------------------------------------ the score_mod
@dataclasses.dataclass
class AdditiveScoreMod:
    """A score_mod that returns φ(score) + bias(b, h, q_idx, kv_idx) (identity: bias 0), with
    φ the identity or, softcap c > 0, c tanh(a score) = c tanh(a c score / c): the op's cap
    c on scores scaled by scale_factor = a c; and which indices its bias reads."""
    identity: bool
    reads_batch: bool
    reads_head: bool
    softcap: float = 0.0
    scale_factor: float = 1.0
    # the bias reads q_idx and kv_idx only through their difference (or not at all)
    relative: bool = False


def score_mod_form(score_mod, dtype, buffers=(), device=None):
    """AdditiveScoreMod for `score_mod(score, b, h, q_idx, kv_idx, *buffers)` when its
    traced graph is (soft-capped score) plus a term without the score, else a phrase saying
    what it does instead. `buffers`: tensors (real, fake or meta) standing for the captured
    tensors Dynamo passes as extra arguments; `device`: the call's (where the tensors the
    mod captures are). Traced once per score_mod and what it reads (traced_once)."""
    if buffers:
        return _score_mod_form(score_mod, dtype, buffers, device)
    return traced_once(score_mod, ("score_mod_form", dtype, str(device)),
                       lambda: _score_mod_form(score_mod, dtype, (), device))


def _score_mod_form(score_mod, dtype, buffers, device):
    graph = trace_mod(score_mod, buffers, dtype, device)
    if isinstance(graph, str):
        return f"could not be traced ({graph})"
    score, b, h = graph.find_nodes(op="placeholder")[:3]
    result = graph.output_node().args[0]
    if isinstance(result, (tuple, list)):
        result = result[0]
    capped = _softcap_of(result, score)
    if result is score or capped:
        return AdditiveScoreMod(True, False, False, *(capped or ()))
    if getattr(result, "target", None) in (_ADD, _SUBTRACT) and \
            result.kwargs.get("alpha", 1) == 1:
        first, second = result.args[:2]
        orders = [(first, second), (second, first)] if result.target is _ADD else [(first, second)]
        for term, bias in orders:
            capped = _softcap_of(term, score)
            if (term is score or capped) and not _reads(bias, score):
                return AdditiveScoreMod(False, bool(b.users), bool(h.users),
                                        *(capped or (0.0, 1.0)), _relative(graph))
    return "is not score (or c * tanh(a * score)) plus a term without the score"


def _relative(graph):
    """Whether a mod's graph reads q_idx and kv_idx only through one q_idx - kv_idx (or
    kv_idx - q_idx), or neither of them."""
    q_idx, kv_idx = graph.find_nodes(op="placeholder")[3:5]
    users = set(q_idx.users) | set(kv_idx.users)
    if not users:
        return True
    difference, = users if len(users) == 1 else (None,)
    return difference is not None and difference.target is _SUBTRACT and \
        not difference.kwargs and set(difference.args) == {q_idx, kv_idx}


def _softcap_of(node, score):
    """(c, a c) where `node` computes c * tanh(a * score) (a as a factor or a divisor, the
    factors in either order) for constants c > 0 and a > 0, else None."""
    outer = _times_constant(node)
    if outer is None or getattr(outer[0], "target", None) is not _TANH:
        return None
    inner = _times_constant(outer[0].args[0])
    if inner is None or inner[0] is not score:
        return None
    cap, slope = outer[1], inner[1]
    if not (cap > 0 and slope > 0):
        return None
    factor = cap * slope
    return cap, 1.0 if abs(factor - 1) < 1e-12 else factor


def _times_constant(node):
    """(x, c) where `node` is x * c, c * x or x / c (as x * (1 / c)) for a Python number c,
    else None."""
    if not isinstance(node, torch.fx.Node) or node.kwargs:
        return None
    if node.target is _MULTIPLY:
        x, c = node.args
        if isinstance(x, (int, float)):
            x, c = c, x
        return (x, float(c)) if isinstance(c, (int, float)) and isinstance(x, torch.fx.Node) \
            else None
    if node.target is _DIVIDE:
        x, c = node.args
        return (x, 1.0 / c) if isinstance(c, (int, float)) and c != 0 else None
    return None


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


def relative_bias(score_mod, query, L, S, form, buffers=()):
    """A relative score_mod's bias (form.relative) as (B or 1, H or 1, L + S - 1) in
    query's dtype: the pair (q, k) at q - k + S - 1 (kernels/block_sparse_masks.py),
    evaluated at one pair per difference."""
    score = torch.zeros((), dtype=query.dtype, device=query.device)

    def bias(b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx, kv_idx, *buffers)
    difference = torch.arange(-(S - 1), L, device=query.device)
    for in_dims in ((None, None, 0, 0), (None, 0, None, None), (0, None, None, None)):
        bias = torch.vmap(bias, in_dims=in_dims)      # the pairs, then heads, then batch
    batch = torch.arange(query.shape[0] if form.reads_batch else 1, device=query.device)
    heads = torch.arange(query.shape[1] if form.reads_head else 1, device=query.device)
    return bias(batch, heads, difference.clamp_min(0), (-difference).clamp_min(0)).to(
        query.dtype)


def additive_bias(score_mod, query, L, S, form=None, buffers=()):
    """score_mod's bias(b, h, q_idx, kv_idx) in query's dtype, at (B, H, L, S) with B or H 1
    where the bias does not read b or h. `form`: score_mod_form's, when known."""
    form = form if form is not None else score_mod_form(score_mod, query.dtype,
                                                        device=query.device)
    if isinstance(form, str):
        raise NotImplementedError(f"the score_mod {form}")
    score = torch.zeros((), dtype=query.dtype, device=query.device)

    def bias(b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx, kv_idx, *buffers)
    sizes = (query.shape[0] if form.reads_batch else 1,
             query.shape[1] if form.reads_head else 1, L, S)
    return over_indices(bias, sizes, query.device).to(query.dtype)


# ------------------------------------------------------------------ running the call
def _attend(query, key, value, blocks, score_mod, form, score_mod_buffers, scale, enable_gqa,
            mask_mod_key=None):
    L, S = query.shape[-2], key.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    biased = score_mod is not None and not form.identity
    mask = None
    softcap = 0.0
    if score_mod is not None and form.softcap:
        softcap, scale = form.softcap, scale * form.scale_factor
    if biased and form.relative and \
            relative_pays(form, query.shape[0], query.shape[1], L, S, query.dtype):
        relative = relative_bias(score_mod, query, L, S, form, score_mod_buffers)
        mask = None if relative.requires_grad else _relative_mask(
            blocks, relative, L, S, query, mask_mod_key)
        if mask is not None:
            return attention_with_op_mask(query, key, value, mask, scale, enable_gqa, softcap)
    if blocks is not None and not biased:
        mask = _mask_for_the_op(blocks, L, S, query, mask_mod_key)
        if mask is not None and mask.dtype != torch.bool:
            return attention_with_op_mask(query, key, value, mask, scale, enable_gqa, softcap)
    if blocks is not None and mask is None:
        mask = visible_pairs(blocks, L, S, query.device, *query.shape[:2])
    if biased:
        bias = additive_bias(score_mod, query, L, S, form, score_mod_buffers)
        mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    return attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa,
                     softcap=softcap)


def relative_pays(form, batch, heads, L, S, dtype):
    """Whether a relative bias goes to the kernels as rows rather than materialized: where
    BOB_COMPILE_DEV_RELATIVE_ROWS=1 and the materialized bias would take more than
    block_masks.TILES_ABOVE_BYTES (the materialized bias runs the kernels' plain read
    path, measured faster)."""
    if not kernel_settings.current().relative_rows:
        return False
    sizes = (batch if form.reads_batch else 1, heads if form.reads_head else 1, L, S)
    if not all(type(n) is int for n in sizes):
        return True
    return math.prod(sizes) * dtype.itemsize > block_masks.TILES_ABOVE_BYTES


def _relative_mask(blocks, relative, L, S, query, mask_mod_key):
    """The op's mask for a call with a relative bias (a learned one aside: it needs the
    materialized bias's cotangents): the BlockMask's (or every pair's) tiles with the bias,
    eagerly the tiles' data, in a traced call the BlockMask packed with the bias (the pass
    gives a call without a BlockMask EVERY_PAIR_KEY); None where neither can be had (the
    caller materializes)."""
    if blocks is None:
        blocks = every_pair_blocks(L, S, query.device)
    if may_synchronize(blocks.kv_num_blocks):
        return _as_op_mask(key_intervals(blocks, L, S, query.device, *query.shape[:2],
                                         relative_bias=relative))
    if mask_mod_key is not None and not (query.is_cuda and
                                         torch.cuda.is_current_stream_capturing()):
        return pack(blocks, mask_mod_key, relative)
    return None


def _as_op_mask(form):
    """A mask's form (block_masks.key_intervals) as the op's mask argument takes it: a
    BlockSparseMask as its uint8 data, a tensor as it is."""
    return form.data if isinstance(form, BlockSparseMask) else form


def _mask_for_the_op(blocks, L, S, query, mask_mod_key):
    """The BlockMask's mask for the op, without anything L x S where that can be had:
    eagerly its key intervals (int32) where its rows and keys are intervals, else its
    tile-by-tile form (uint8: kernels/block_sparse_masks.py); in a traced call whose
    mask_mod is registered (mask_mod_key), the BlockMask packed (uint8), which the ops
    resolve when they run. None otherwise (the caller materializes the mask)."""
    if may_synchronize(blocks.kv_num_blocks):
        return _as_op_mask(reused_key_intervals(blocks, L, S, query.device, *query.shape[:2]))
    if mask_mod_key is not None and not (query.is_cuda and
                                         torch.cuda.is_current_stream_capturing()):
        return pack(blocks, mask_mod_key)
    return None


def flex_call(query, key, value, score_mod, block_mask, scale, kernel_options,
              score_mod_other_buffers=(), mask_mod_other_buffers=(), *, additive, masked=True,
              mask_mod_reads=(True, True), mask_mod_key=None):
    """torch.ops.higher_order.flex_attention's call (same arguments; `block_mask` the
    BlockMask's tuple) through bob_compile.attention, for a score_mod additive in the score
    (`additive`: AdditiveScoreMod's fields as a tuple, found by the pass); `masked` False
    where the BlockMask is the one flex_attention makes when given none (every pair
    visible); `mask_mod_reads`: mask_mod_reads's, found by the pass; `mask_mod_key`: the
    mask_mod's key in block_masks' registry (the pass registers it), None where the
    BlockMask is to be materialized (graphs under CUDA graphs). Returns (output,): the
    op's first output; the pass puts it only where nothing reads the others (the
    logsumexp, the maximum)."""
    blocks = Blocks.of_tuple(block_mask, mask_mod_other_buffers, mask_mod_reads) \
        if masked else None
    return (_attend(query, key, value, blocks, score_mod, AdditiveScoreMod(*additive),
                    tuple(score_mod_other_buffers), scale,
                    enable_gqa=query.shape[1] != key.shape[1], mask_mod_key=mask_mod_key),)


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
        scores = over_indices(modified, scores.shape, query.device, score=scores)
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
