"""SDPA calls left as written, in graphs that may be differentiated twice: run as SDPA's math.

PyTorch's fused SDPA kernels (flash, memory-efficient, cuDNN, the CPU flash kernel) have no
double backward: a Hessian-vector product through a site the passes left as written (active
dropout, a mask that requires grad, is_causal computed at run time; nn.MultiheadAttention with a key_padding_mask, which Dynamo
records as one F.multi_head_attention_forward call that runs SDPA inside) fails inside
PyTorch ("derivative for aten::_scaled_dot_product_..._backward is not implemented"), and a
`sdpa_kernel(SDPBackend.MATH)` around the call no longer helps once the graph is compiled.
Where a graph may be differentiated twice, such calls become `sdpa_math` (and
`multi_head_attention_math`): SDPA's own math decomposition, differentiable at every order
(and N x N in memory, as eager math is). FlexAttention's calls that the passes left (a
score_mod that is not additive, e.g. soft-capping; its logsumexp read) become
bob_compile.flex.flex_math, the same function as math (under torch.func it is already
that: bob_compile/flex.py gives PyTorch's op its torch.func rules).

Dropout draws its mask where the graph runs (native_dropout, a draw the second order
replays: bob_compile/training/draws.py); the fused kernels draw inside, where no replay can
reach, so sites with active dropout are math in every graph that may be differentiated,
others only where the second order is computed (training route: its first order keeps
PyTorch's fused kernels, as stock compile does).
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..flex import flex_math
from .flex_attention import FLEX_ATTENTION
from .multi_head_forward import MHA_SIGNATURE
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


def multi_head_attention_math(*args, **kwargs):
    """F.multi_head_attention_forward with SDPA's math path inside."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.multi_head_attention_forward(*args, **kwargs)


def _sdpa_dropout(node):
    return _bound_arguments(node)["dropout_p"]


def _multihead_dropout(node):
    a = MHA_SIGNATURE.bind(*node.args, **node.kwargs)
    a.apply_defaults()
    return 0.0 if a.arguments["training"] is False else a.arguments["dropout_p"]


_AS_MATH = {target: (sdpa_math, _sdpa_dropout) for target in SDPA_TARGETS}
_AS_MATH[F.multi_head_attention_forward] = (multi_head_attention_math, _multihead_dropout)
_AS_MATH[FLEX_ATTENTION] = (flex_math, lambda node: 0.0)


def sdpa_calls_as_math(gm, report=None, only_dropout=False):
    """Point every SDPA, multi-head attention and FlexAttention call of `gm` and of its body
    graphs at its math (`only_dropout`: those whose dropout is active); note it on the
    call's site in `report`. Returns how many calls changed."""
    changed = 0
    for prefix, module in gm.named_modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        calls = [n for n in module.graph.nodes
                 if n.op == "call_function" and n.target in _AS_MATH]
        for node in calls:
            math, dropout = _AS_MATH[node.target]
            if only_dropout and _dropout_is_zero(dropout(node)):
                continue
            node.target = math
            changed += 1
            if report is not None:
                _note(report, f"{prefix}.{node.name}" if prefix else node.name,
                      "math" if math is flex_math else "SDPA's math", only_dropout)
        if calls:
            module.recompile()
    return changed


def _dropout_is_zero(p):
    return isinstance(p, (int, float)) and p == 0


def _note(report, name, math, only_dropout):
    where = ("in every order, so that the second order can replay dropout's mask"
             if only_dropout else "where the graph is differentiated twice")
    for site in report.sites:
        if site.node == name and not site.replaced:
            site.reason += f"; runs as {math} {where} (PyTorch's fused kernels have no double backward)"
