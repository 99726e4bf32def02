"""Graphs nothing differentiates: run their attention as PyTorch's own fused SDPA.

On the inference route (grad mode off, or no input requiring grad) no derivative of the
graph can be taken, so what flashbob adds, exact derivatives of every order, is never
used; the forward alone is the same function in PyTorch's fused SDPA, which inductor
lowers as stock torch.compile does (no custom-op call on the host, no log-sum-exp
output). Hand-written attention found by the passes then also runs fused, and
FlexAttention's calls go back to PyTorch's op (block-sparse, no mask materialized).
"""
import torch
import torch.nn.functional as F
from torch import fx

from ..attention import attention
from ..flex import flex_call
from .flex_attention import FLEX_ATTENTION
from .nodes import example_tensor


def _same_in_sdpa(node):
    """Whether SDPA computes exactly what this attention call does: no mask, or a boolean
    mask without is_causal (SDPA takes one of them). An additive mask stays ours: its
    values at or below -1e4 hide keys (bob_compile/kernels/params.py), which SDPA does not do for a
    row that every key is hidden from. Soft-capped scores stay ours: SDPA has no cap."""
    if node.kwargs.get("softcap"):
        return False
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    if mask is None:
        return True
    value = example_tensor(mask)
    return value is not None and value.dtype == torch.bool and not node.kwargs.get("is_causal")


def use_native_sdpa(gm):
    """Point every bob_compile.attention call of `gm` (and of its submodules' graphs, e.g.
    checkpointed bodies) at F.scaled_dot_product_attention, in place, where SDPA computes
    the same (_same_in_sdpa); the arguments are the same (query, key, value, attn_mask,
    is_causal, scale, enable_gqa); and every flex_call back at FlexAttention's op (the
    op's own arguments). Returns how many."""
    changed = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        calls = [n for n in module.graph.nodes if n.op == "call_function" and (
            (n.target is attention and _same_in_sdpa(n)) or n.target is flex_call)]
        for node in calls:
            if node.target is flex_call:
                node.target, node.kwargs = FLEX_ATTENTION, {}
            else:
                node.target = F.scaled_dot_product_attention
        if calls:
            module.recompile()
            changed += len(calls)
    return changed
