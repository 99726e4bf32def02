"""Replace `F.scaled_dot_product_attention` calls by `bob_compile.attention`.

Dynamo records `F.scaled_dot_product_attention` (it *is* torch._C._nn.scaled_dot_product_attention)
with the user's args and kwargs as written, on torch 2.11 and 2.13:

    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)              # nanoGPT (flash path)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                       scale=self.scaling, is_causal=True)  # HF sdpa_attention_forward
    y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)            # HF with GQA

Supported: attn_mask None; a mask proven causal (causal_mask.py; the site then becomes
is_causal=True, the cheapest kernels); any other bool or floating mask that does not
require grad (HF padding, sliding windows, ...: passed on as attention's attn_mask, exact
whatever it holds; with is_causal=True too, both apply, as in PyTorch's fused kernels);
dropout_p a constant (HF passes attn_pdrop in training, 0.0 outside it; the op draws the
mask itself: nodes.dropout_problem); is_causal and enable_gqa given as Python bools; scale
None, a constant, or a number computed in the graph (dynamic shapes); a floating mask that
requires grad (a learned bias: T5's relative positions, ALiBi slopes as parameters), which
the op differentiates, never proven causal. Anything else stays SDPA and the report says
why.
"""
import torch
import torch.nn.functional as F

from ..attention import attention
from .causal_mask import NotProven
from .erase import erase_unused
from .nodes import (describe, dropout_problem, example_tensor, is_number, is_symbolic_number,
                    is_zero, mask_problem, shape_text, user_code)
from .report import Site

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
             "enable_gqa": False}


def _bound_arguments(node):
    bound = dict(_DEFAULTS)
    bound.update(zip(_PARAMETERS, node.args))
    bound.update(node.kwargs)
    return bound


def scale_text(scale):
    if scale is None:
        return "default"
    return f"{scale:.6g}" if is_number(scale) else f"{scale.name} (computed)"


def rewrite_sdpa(gm, prover, report):
    """Rewrite every supported SDPA call of `gm` in place; add one Site per call to `report`."""
    for node in [n for n in gm.graph.nodes
                 if n.op == "call_function" and n.target in SDPA_TARGETS]:
        a = _bound_arguments(node)
        q, k, v = a["query"], a["key"], a["value"]
        site = Site("sdpa", node.name, user_code(node),
                    shapes=f"q{shape_text(q)} k{shape_text(k)} v{shape_text(v)}")
        proof = mask = None
        reason = _unsupported_argument(a)
        if reason is None and a["attn_mask"] is not None:
            try:
                proof = _causal_mask_proof(prover, a)
            except NotProven as e:
                mask = a["attn_mask"]
                problem = mask_problem(mask)
                reason = f"attn_mask {problem}" if problem else None
                site.mask = f"attn_mask {describe(mask)} (not causal: {e})"
        if reason is not None:
            site.reason = reason
            report.add(site)
            continue

        is_causal = a["is_causal"] or proof is not None
        kwargs = {"is_causal": is_causal, "scale": a["scale"], "enable_gqa": a["enable_gqa"]}
        if mask is not None:
            kwargs["attn_mask"] = mask
        if not is_zero(a["dropout_p"]):
            kwargs["dropout_p"] = a["dropout_p"]
            site.dropout = a["dropout_p"]
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(attention, (q, k, v), kwargs)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        erase_unused(gm.graph, [node] + (proof.nodes if proof else []))
        replacement.name = node.name  # the user's variable: a smaller, readable diff
        site.replaced, site.is_causal, site.enable_gqa = True, is_causal, a["enable_gqa"]
        site.scale = scale_text(a["scale"])
        if proof:
            site.causal_proof = f"attn_mask {proof.how}"
            report.guards.extend(g for g in proof.guards if g not in report.guards)
        report.add(site)


def _unsupported_argument(a):
    dropout_p = a["dropout_p"]
    if not is_zero(dropout_p):
        problem = dropout_problem(dropout_p, True)
        if problem is not None:
            return problem
    if not isinstance(a["is_causal"], bool):
        return f"is_causal is computed at run time ({describe(a['is_causal'])}), not a Python bool"
    if not isinstance(a["enable_gqa"], bool):
        return f"enable_gqa is computed at run time ({describe(a['enable_gqa'])})"
    scale = a["scale"]
    if not (scale is None or is_number(scale) or is_symbolic_number(scale)):
        return f"scale is {describe(scale)}, not a number"
    return None


def _causal_mask_proof(prover, a):
    mask, q, k = a["attn_mask"], example_tensor(a["query"]), example_tensor(a["key"])
    mask_value = example_tensor(mask)
    if mask_value is None or q is None or k is None:
        raise NotProven(f"{describe(mask)} has no recorded tensor value")
    kind = "visible" if mask_value.dtype == torch.bool else "additive"
    return prover.prove(mask, kind, (q.shape[-2], k.shape[-2]))
