"""Replace the attention of nn.MultiheadAttention and the nn.Transformer* layers.

On torch 2.13 Dynamo records nn.MultiheadAttention (and so TransformerEncoderLayer,
TransformerDecoderLayer, nn.Transformer) as one call, which sdpa.py and handwritten.py
cannot see into:

    # nn.MultiheadAttention(8, 2), called as attn(x, x, x); batch_first=True adds
    # x.transpose(1, 0) before the call and after [0]
    mha = torch.nn.functional.multi_head_attention_forward(x, x, x, 8, 2, in_proj_weight,
        in_proj_bias, None, None, False, 0.0, out_proj_weight, out_proj_bias, training=True,
        key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
        is_causal=False)
    attn_output = mha[0]
    attn_output_weights = mha[1]        # only where the caller uses the weights

Supported, and replaced by bob_compile.multihead.multi_head_attention: packed, separate
(kdim/vdim) and bias-free projections, bias_k/bias_v, add_zero_attn, batched and unbatched
inputs; dropout (passed to the op, which draws its mask: nodes.dropout_problem); the
attention weights unused (need_weights=False, or the weights are dropped); any attn_mask and
key_padding_mask (passed to the op as one mask; an attn_mask proven causal (causal_mask.py)
becomes is_causal=True instead, as does one that PyTorch ignores: is_causal=True with
need_weights=False and no key_padding_mask). Anything else stays as written and the report
says why. The modules' inference fast paths
(torch._native_multi_head_attention, torch._transformer_encoder_layer_fwd) run only
without autograd; they are reported and left alone.

nn.TransformerEncoder given a mask without is_causal checks the mask's values
(`_detect_is_causal_mask`, a Tensor.item()): a graph break, after which the whole encoder
runs uncompiled and no backend sees its attention. Pass is_causal=True (or False).
"""
import inspect

import torch
import torch.nn.functional as F
from torch import fx

from ..multihead import multi_head_attention
from .causal_mask import NotProven
from .erase import erase_unused
from .nodes import (arg, describe, dropout_problem, example, example_tensor, is_op, is_zero,
                    shape_text, user_code)
from .report import Site

MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
FAST_PATH_KERNELS = (torch._native_multi_head_attention, torch._transformer_encoder_layer_fwd)


class _Skip(Exception):
    """This call stays as written; the message says why."""


def rewrite_multihead(gm, prover, report):
    """Rewrite every supported multi-head attention call of `gm` in place; one Site per call
    and per fast-path kernel."""
    for node in [n for n in gm.graph.nodes if n.op == "call_function"]:
        if node.target in FAST_PATH_KERNELS:
            report.add(Site("multihead", node.name, user_code(node),
                            reason=f"torch.{node.target.__name__} is a native fused inference "
                                   f"kernel, no gradient needed"))
        elif node.target is F.multi_head_attention_forward:
            report.add(_rewrite_call(gm, node, prover, report))


def _rewrite_call(gm, node, prover, report):
    a = MHA_SIGNATURE.bind(*node.args, **node.kwargs)
    a.apply_defaults()
    a = a.arguments
    site = Site("multihead", node.name, user_code(node), scale="default",
                shapes=f"query{shape_text(a['query'])} key{shape_text(a['key'])} "
                       f"value{shape_text(a['value'])} heads={a['num_heads']}")
    try:
        _check_arguments(node, a)
        is_causal, proof, mask_nodes, masks = _masks(a, prover)
    except _Skip as e:
        site.reason = str(e)
        return site

    kwargs = {"is_causal": is_causal, **masks}
    site.mask = " + ".join(f"{name}{shape_text(m)}" for name, m in masks.items())
    if a["use_separate_proj_weight"]:
        kwargs["separate_proj_weights"] = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
    if a["bias_k"] is not None:
        kwargs.update(bias_k=a["bias_k"], bias_v=a["bias_v"])
    if a["add_zero_attn"]:
        kwargs["add_zero_attn"] = True
    if a["training"] is not False and not is_zero(a["dropout_p"]):
        kwargs["dropout_p"] = site.dropout = a["dropout_p"]
    with gm.graph.inserting_before(node):
        replacement = gm.graph.call_function(multi_head_attention, (
            a["query"], a["key"], a["value"], a["num_heads"], a["in_proj_weight"],
            a["in_proj_bias"], a["out_proj_weight"], a["out_proj_bias"]), kwargs)
    replacement.meta = dict(node.meta)
    if isinstance(example(node), tuple):  # the weights are None now
        replacement.meta["example_value"] = (example(node)[0], None)
    unused_weights = [u for u in node.users if is_op(u, "getitem") and u.args[1] == 1]
    node.replace_all_uses_with(replacement)
    erase_unused(gm.graph, [node, *unused_weights, *mask_nodes])
    replacement.name = node.name  # a smaller, readable diff
    site.replaced, site.is_causal = True, is_causal
    if proof is not None:
        site.causal_proof = f"attn_mask {proof.how}"
        report.guards.extend(g for g in proof.guards if g not in report.guards)
    elif is_causal:
        site.causal_proof = "is_causal=True, with which PyTorch ignores attn_mask's values"
    return site


def _check_arguments(node, a):
    """_Skip unless multi_head_attention computes this call exactly, the mask aside."""
    for name in ("need_weights", "is_causal", "add_zero_attn", "use_separate_proj_weight"):
        if not isinstance(a[name], bool):
            raise _Skip(f"{name} is computed at run time ({describe(a[name])}), not a Python bool")
    if a["static_k"] is not None or a["static_v"] is not None:
        raise _Skip("static_k/static_v (precomputed keys and values) are given")
    if a["training"] is not False and not is_zero(a["dropout_p"]):
        problem = dropout_problem(a["dropout_p"], a["training"])
        if problem is not None:
            raise _Skip(problem)
    if a["need_weights"]:
        readers = [u for u in node.users if not is_op(u, "getitem") or (u.args[1] != 0 and u.users)]
        if readers:
            raise _Skip(f"the attention weights are used ({', '.join(describe(u) for u in readers)}); "
                        f"need_weights=False, or dropping them, lets flashbob replace it")


def _masks(a, prover):
    """(is_causal, MaskProof or None, mask nodes to erase, the masks passed on) for the
    replacement, or _Skip."""
    mask, padding = a["attn_mask"], a["key_padding_mask"]
    masks = {} if padding is None else {"key_padding_mask": padding}
    if mask is None:  # (is_causal=True without a mask raises in PyTorch)
        return False, None, [], masks
    query, key = example_tensor(a["query"]), example_tensor(a["key"])
    if query is None or key is None:
        raise _Skip("query or key has no recorded tensor value")
    scores_size = (query.shape[0], key.shape[0])  # (L, S): sequence first, batched or not
    if a["is_causal"] and padding is None and not a["need_weights"]:
        # PyTorch runs SDPA with is_causal=True and never reads the mask: erase it if it is
        # built in the graph (a proof finds those nodes, and that nothing writes to them).
        try:
            return True, None, _causal_mask_proof(prover, mask, scores_size).nodes, masks
        except NotProven:
            return True, None, [], masks
    if a["bias_k"] is None and not a["add_zero_attn"]:
        # (with those PyTorch pads the mask so that every query sees the appended keys)
        try:
            proof = _causal_mask_proof(prover, mask, scores_size)
            return True, proof, proof.nodes, masks
        except NotProven:
            pass
    # any other mask: its values, as PyTorch applies them (is_causal is then only a hint)
    return False, None, [], {"attn_mask": mask, **masks}


def _causal_mask_proof(prover, mask, scores_size):
    """MaskProof that attn_mask is causal: additive if float, True = masked if bool."""
    from_bool = _additive_from_bool(mask)
    if from_bool is not None:
        bool_mask, fill, nodes = from_bool
        prover.masking_value(fill)
        proof = prover.prove(bool_mask, "masked", scores_size)
        proof.nodes.extend(nodes)
        return proof
    value = example_tensor(mask)
    kind = "masked" if value is not None and value.dtype == torch.bool else "additive"
    return prover.prove(mask, kind, scores_size)


def _additive_from_bool(mask):
    """(bool mask, fill value, nodes) where `mask` is a bool mask made additive, as
    nn.MultiheadAttention and nn.TransformerEncoderLayer record it (F._canonical_mask):

        zeros_like = torch.zeros_like(attn_mask, dtype=torch.float64)
        mask = zeros_like.masked_fill_(attn_mask, -inf)

    else None. The fill writes in place: the zeros must have no other reader, and the result
    no other users than multi-head attention calls (which do not write to it)."""
    if not (isinstance(mask, fx.Node) and mask.op == "call_method" and mask.target == "masked_fill_"):
        return None
    zeros = mask.args[0]
    if not (is_op(zeros, "zeros_like") and len(zeros.users) == 1
            and all(u.target is F.multi_head_attention_forward for u in mask.users)):
        return None
    return arg(mask, 1, "mask"), arg(mask, 2, "value"), [mask, zeros]
