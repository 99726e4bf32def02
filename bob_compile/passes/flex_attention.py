"""Replace FlexAttention's calls: the higher-order op Dynamo records for
torch.nn.attention.flex_attention.

    # flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask) in the user's code
    flex_attention = torch.ops.higher_order.flex_attention(q, k, v, score_mod_0,
        (L, S, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, ...,
         Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_fn_0), scale, kernel_options,
        (score_mod_buffers...), (mask_mod_buffers...))
    out = flex_attention[0]

score_mod_0 and mask_fn_0 are get_attr submodules taking the tensors the mods captured
as trailing arguments (docs/torch-behaviour.md, "flex_attention in Dynamo graphs").
PyTorch's op has no double backward (and no torch.func.grad rule), so:

- a score_mod additive in the score (none, ALiBi, relative-position tables, learned biases;
  bob_compile/flex.py reads its traced graph), the score soft-capped first or not
  (c * tanh(score / c): Gemma 2), becomes bob_compile.flex.flex_call: the op, with the
  BlockMask's mask and the bias materialized per call, in every route but inference, where
  the op goes back to PyTorch's (bob_compile/passes/inference.py);
- a call with any other score_mod (nonlinear in the score otherwise), or whose logsumexp
  or maximum is read, stays: PyTorch's op for the first order, bob_compile.flex.flex_math
  (all three outputs, exact, N x N in memory) wherever the graph is differentiated twice
  (sdpa_math.py) or under torch.func (flex.py's rules for the op), the report saying so.
"""
import dataclasses
import operator

import torch
import torch.nn.attention.flex_attention as flex_module
from torch import fx

from ..block_masks import EVERY_PAIR_KEY, index_reads, register_mask_mod, trace_mod
from ..flex import flex_call, relative_pays, score_mod_form
from .erase import erase_unused
from .nodes import example, example_tensor, shape_text, user_code
from .report import Site

FLEX_ATTENTION = torch.ops.higher_order.flex_attention


def rewrite_flex(gm, report):
    """Put flex_call in place of every FlexAttention call of `gm` whose score_mod is
    additive; one Site per call."""
    for node in [n for n in gm.graph.nodes
                 if n.op == "call_function" and n.target is FLEX_ATTENTION]:
        report.add(_rewrite_call(gm, node))


def _rewrite_call(gm, node):
    query, key, value, score_mod = node.args[:4]
    site = Site("flex_attention", node.name, user_code(node),
                shapes=f"q{shape_text(query)} k{shape_text(key)} v{shape_text(value)}",
                scale=f"{node.args[5]:.6g}" if isinstance(node.args[5], float) else "?")
    if any(not _is_output(u) and _is_read(u) for u in node.users):
        site.reason = ("the call's logsumexp or maximum is read (return_lse/return_aux); "
                       "flashbob's op gives the output only, so PyTorch's kernel stays (it "
                       "has no double backward)")
        return site
    form = _score_mod_form(gm, score_mod, query, node.args[7])
    if isinstance(form, str):
        site.reason = (f"the score_mod {form}; only [c * tanh(a * score)] + bias(b, h, q_idx, "
                       f"kv_idx) runs fused, so the call stays PyTorch's where nothing "
                       f"differentiates it twice")
        return site
    erase_unused(gm.graph, [n for u in node.users if not _is_output(u) for n in _downstream(u)])
    block_tuple, mask_buffers = node.args[4], node.args[8]
    mask_mod_graph = _mask_mod_graph(gm, block_tuple[-1], mask_buffers)
    masked = not _is_flex_default_mask(block_tuple, mask_mod_graph)
    # the BlockMask packed for the ops where nothing L x S comes with it (no bias, or a
    # relative one that requires no grad; a call without a BlockMask then packs every pair)
    relative = not form.identity and form.relative and not _learned(node.args[7]) and \
        _relative_pays(form, query, key)
    mask_mod_key = None
    if form.identity or relative:
        mask_mod_key = _registered(gm, block_tuple[-1]) if masked else \
            EVERY_PAIR_KEY if relative else None
    node.target = flex_call
    node.kwargs = {"additive": dataclasses.astuple(form), "masked": masked,
                   "mask_mod_reads": index_reads(mask_mod_graph),
                   "mask_mod_key": mask_mod_key}
    site.replaced = True
    site.enable_gqa = _heads(query) != _heads(key)
    blocks = "BlockMask (materialized per call)" if mask_mod_key is None else _RESOLVED
    bias = _RELATIVE_BIAS if relative and mask_mod_key is not None else \
        "score_mod's additive bias (materialized per call)"
    site.mask = ", ".join(what for what, present in (
        (blocks, masked), (bias, not form.identity)) if present)
    site.softcap = form.softcap
    if form.scale_factor != 1.0 and isinstance(node.args[5], float):   # c tanh(a score), a != 1/c
        site.scale = f"{node.args[5] * form.scale_factor:.6g}"
    return site


def _registered(gm, mask_fn):
    """The mask_mod's key in bob_compile.block_masks' registry (registered now), so that
    flex_call may hand the ops the BlockMask packed; None where it cannot be named."""
    if not (isinstance(mask_fn, fx.Node) and mask_fn.op == "get_attr"):
        return None
    return register_mask_mod(getattr(gm, mask_fn.target))


_RESOLVED = "BlockMask (resolved by the op per call: key intervals or tiles)"
_RELATIVE_BIAS = "score_mod's relative bias (L + S - 1 values per head, in the kernels)"


def _relative_pays(form, query, key):
    q, k = example_tensor(query), example_tensor(key)
    if q is None or k is None or q.dim() != 4:
        return False
    return relative_pays(form, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.dtype)


def _learned(buffers):
    """Whether a mod's captured tensors (graph nodes) hold one that requires grad."""
    return any(getattr(example_tensor(b), "requires_grad", False) for b in buffers
               if isinstance(b, fx.Node))


def materialize_block_masks(gm, report=None, why=""):
    """Have every flex_call of `gm` (and of its subgraphs) materialize its BlockMask, where
    the ops cannot resolve a packed one: graphs run under CUDA graphs (resolving lists the
    blocks on the host), graphs that run their own torch.func transforms (its vmap over the
    mask_mod fails under them). `report`'s sites then say so, with `why`."""
    for module in gm.modules():
        calls = module.graph.find_nodes(op="call_function", target=flex_call) \
            if isinstance(module, fx.GraphModule) else ()
        for node in calls:
            node.kwargs = {**node.kwargs, "mask_mod_key": None}
        if calls:
            module.recompile()
    for site in report.sites if report is not None else ():
        if site.kind == "flex_attention" and site.mask:
            site.mask = site.mask.replace(_RESOLVED, f"BlockMask (materialized per call: {why})")
            site.mask = site.mask.replace(
                _RELATIVE_BIAS, f"score_mod's additive bias (materialized per call: {why})")


def _is_flex_default_mask(block_tuple, mask_mod_graph):
    """Whether the BlockMask is the one flex_attention makes when the call has none
    (_create_empty_block_mask: lengths (1, 1), one block of _LARGE_SPARSE_BLOCK_SIZE listed,
    noop_mask): every pair visible."""
    large = getattr(flex_module, "_LARGE_SPARSE_BLOCK_SIZE", 1 << 30)
    if tuple(block_tuple[:2]) != (1, 1) or tuple(block_tuple[-3:-1]) != (large, large) or \
            isinstance(mask_mod_graph, str):
        return False
    result = mask_mod_graph.output_node().args[0]
    return getattr(result, "target", None) in (torch.ops.aten.new_ones.default,
                                                torch.ops.aten.ones.default) and \
        result.kwargs.get("dtype") == torch.bool


def _is_output(user):
    """Whether a user of the op's node takes its first output (the attention output)."""
    return user.target is operator.getitem and user.args[1] == 0


def _is_read(node):
    """Whether `node`'s value reaches the graph's outputs or an impure call (Hugging Face
    converts the logsumexp it asks for to the value's dtype and then drops it)."""
    return any(n is not node and (n.op == "output" or n.is_impure()) for n in _downstream(node))


def _downstream(node):
    """`node` and every node that reads it, directly or not."""
    seen, stack = {}, [node]          # a dict: insertion-ordered, constant-time lookups
    while stack:
        current = stack.pop()
        if current not in seen:
            seen[current] = None
            stack.extend(current.users)
    return list(seen)


def _score_mod_form(gm, score_mod, query, buffers):
    if not (isinstance(score_mod, fx.Node) and score_mod.op == "get_attr"):
        return f"{score_mod} is not a graph the pass can read"
    examples = _meta_examples(buffers)
    if isinstance(examples, str):
        return examples
    dtype = example_tensor(query).dtype if example_tensor(query) is not None else torch.float32
    return score_mod_form(getattr(gm, score_mod.target), dtype, examples)


def _mask_mod_graph(gm, mask_fn, buffers):
    """The BlockMask's mask_mod graph traced to aten (trace_mod), or why it was not."""
    examples = _meta_examples(buffers)
    if isinstance(examples, str):
        return examples
    if not (isinstance(mask_fn, fx.Node) and mask_fn.op == "get_attr"):
        return f"{mask_fn} is not a graph the pass can read"
    return trace_mod(getattr(gm, mask_fn.target), examples)


def _meta_examples(buffers):
    """Meta tensors standing for a mod's captured tensors (graph nodes), or why not."""
    examples = []
    for buffer in buffers:
        value = example(buffer)
        if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
            # a size under dynamic shapes (a length the mod reads): its hint
            hint = value if isinstance(value, int) else value.node.hint
            if hint is None:
                return f"captures {buffer.name}, a size without a hint"
            examples.append(int(hint))
            continue
        if not isinstance(value, torch.Tensor):
            return f"captures {buffer}, which has no recorded tensor or size value"
        try:
            examples.append(torch.empty(tuple(int(s) for s in value.shape), dtype=value.dtype,
                                        device="meta"))
        except Exception:       # sizes that are symbolic without a hint
            return f"captures {buffer.name} of symbolic shape {tuple(value.shape)}"
    return tuple(examples)


def _heads(node):
    value = example_tensor(node)
    return None if value is None else value.shape[1]

