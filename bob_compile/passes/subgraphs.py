"""Attention inside the bodies of higher-order ops: rewrite it where that is exact, report
it where it is not.

Dynamo puts some code in a body graph that a higher-order op calls, e.g.

    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)  # and Hugging Face's
    model.gradient_checkpointing_enable()                              # gradient checkpointing
        -> tag_activation_checkpoint(wrap_body_0, x, *weights, *buffers)

A body that the op simply runs on its operands (checkpointing recomputes it, but it is the
same function) can be rewritten like the top-level graph. Its placeholders are the op's
operands, so a causal mask built or read outside the body is proven there (MaskProver's
`outer`), unless several calls share the body and may pass different masks.

Bodies of other higher-order ops (cond, while_loop, map, autograd_function_apply, whose
backward the user wrote, ...) stay as written; the attention sites in them are reported as
skipped, with the op's name. (FlexAttention's calls are flex_attention.py's.)
"""
import collections

import torch
from torch import fx

from .nodes import user_code
from .report import Site

# Higher-order ops that call their body once on their operands, by the position of the
# first operand (after the body and, for invoke_subgraph, its identifier).
TRANSPARENT = {"tag_activation_checkpoint": 1, "wrap": 1, "invoke_subgraph": 2}

def hop_name(node):
    target = node.target if isinstance(node, fx.Node) and node.op == "call_function" else None
    if not isinstance(target, torch._ops.HigherOrderOperator):
        return None
    return target.name() if callable(getattr(target, "name", None)) else target.__name__


def bodies(gm, node):
    """(attribute name, GraphModule) of each body graph the higher-order op `node` calls."""
    found = []
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "get_attr":
            body = getattr(gm, a.target, None)
            if isinstance(body, fx.GraphModule):
                found.append((a.target, body))
    return found


def rewrite_bodies(gm, prover, report, rewrite_graph, make_prover):
    """Rewrite the bodies of transparent higher-order ops of `gm` with
    rewrite_graph(body, body_prover, report), and report the sites in other bodies.
    Sites found in a body are named `<body>.<node>`."""
    hops = [n for n in gm.graph.nodes if hop_name(n) is not None]
    callers = collections.Counter(name for n in hops for name, _ in bodies(gm, n))
    done = set()
    for node in hops:
        name = hop_name(node)
        for attr, body in bodies(gm, node):
            if attr in done:
                continue
            done.add(attr)
            first_site = len(report.sites)
            if name in TRANSPARENT and node.args and node.args[0].op == "get_attr" \
                    and node.args[0].target == attr:
                outer = {}
                if callers[attr] == 1:
                    operands = node.args[TRANSPARENT[name]:]
                    placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
                    outer = {p: (prover, o) for p, o in zip(placeholders, operands)
                             if isinstance(o, fx.Node)}
                rewrite_graph(body, make_prover(body, outer), report)
            else:
                report_untouched(body, report, f"inside {name}, whose body flashbob does not "
                                                f"rewrite")
            for site in report.sites[first_site:]:
                site.node = f"{attr}.{site.node}"


def report_untouched(gm, report, reason):
    """Add a skipped Site for every attention site of `gm` and of the bodies it calls."""
    from .handwritten import attention_like_softmaxes
    from .multi_head_forward import FAST_PATH_KERNELS
    from .sdpa import SDPA_TARGETS
    kinds = {**{t: "sdpa" for t in SDPA_TARGETS}, **{t: "multihead" for t in FAST_PATH_KERNELS},
             torch.nn.functional.multi_head_attention_forward: "multihead"}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in kinds:
            report.add(Site(kinds[node.target], node.name, user_code(node), reason=reason))
    for softmax in attention_like_softmaxes(gm.graph):
        report.add(Site("handwritten", softmax.name, user_code(softmax), reason=reason))
    for node in gm.graph.nodes:
        if hop_name(node) is not None:
            for attr, body in bodies(gm, node):
                first_site = len(report.sites)
                report_untouched(body, report, reason)
                for site in report.sites[first_site:]:
                    site.node = f"{attr}.{site.node}"
