"""SDPA calls left as written, in graphs that may be differentiated twice: run as SDPA's math.

PyTorch's fused SDPA kernels (flash, memory-efficient, cuDNN, the CPU flash kernel) have no
double backward: a Hessian-vector product through a site the passes left as written (active
dropout, a mask that requires grad, is_causal computed at run time) fails inside PyTorch
("derivative for aten::_scaled_dot_product_..._backward is not implemented"), and a
`sdpa_kernel(SDPBackend.MATH)` around the call no longer helps once the graph is compiled.
Where a graph may be differentiated twice, such calls become `sdpa_math`: SDPA's own math
decomposition, differentiable at every order (and N x N in memory, as eager math is).

Dropout draws its mask where the graph runs (native_dropout, a draw the second order
replays: bob_compile/training/draws.py); the fused kernels draw inside, where no replay can
reach, so sites with active dropout are math in every graph that may be differentiated,
others only where the second order is computed (training route: its first order keeps
PyTorch's fused kernels, as stock compile does).
"""
import torch

from .sdpa import SDPA_TARGETS, _bound_arguments


def sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """F.scaled_dot_product_attention through its math decomposition. A mask together with
    is_causal means both (what the fused kernels compute; the math op refuses the pair)."""
    if attn_mask is not None and is_causal:
        L, S = query.shape[-2], key.shape[-2]
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        attn_mask = (attn_mask & causal if attn_mask.dtype == torch.bool
                     else torch.where(causal, attn_mask, float("-inf")))
        is_causal = False
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa)[0]


def sdpa_calls_as_math(gm, report=None, only_dropout=False):
    """Point every SDPA call of `gm` and of its body graphs at sdpa_math (`only_dropout`:
    those with dropout_p other than 0); note it on the call's site in `report`. Returns
    how many calls changed."""
    changed = 0
    for prefix, module in gm.named_modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        calls = [n for n in module.graph.nodes
                 if n.op == "call_function" and n.target in SDPA_TARGETS]
        for node in calls:
            if only_dropout and _dropout_is_zero(_bound_arguments(node)["dropout_p"]):
                continue
            node.target = sdpa_math
            changed += 1
            if report is not None:
                _note(report, f"{prefix}.{node.name}" if prefix else node.name, only_dropout)
        if calls:
            module.recompile()
    return changed


def _dropout_is_zero(p):
    return isinstance(p, (int, float)) and p == 0


def _note(report, name, only_dropout):
    where = ("in every order, so that the second order can replay dropout's mask"
             if only_dropout else "where the graph is differentiated twice")
    for site in report.sites:
        if site.node == name and not site.replaced:
            site.reason += f"; runs as SDPA's math {where} (PyTorch's fused kernels have no double backward)"
