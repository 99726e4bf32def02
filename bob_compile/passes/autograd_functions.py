"""User autograd.Functions in graphs that may be differentiated twice: their backward as a
differentiable function, as eager autograd runs it.

Dynamo records `MyFunction.apply(x)` as the higher-order op

    autograd_function_apply(fwd_body, bwd_body, x, non_differentiable_idx=..., ...)

and traces the backward body under no_grad: it begins with `_set_grad_enabled(False)` and
ends with `_set_grad_enabled(True)` (torch 2.11-2.14). Eager autograd runs a Function's
backward with grad mode on under create_graph, so its ops are recorded and differentiated
again; under Dynamo's no_grad they are not, and a Hessian-vector product through the
Function silently loses every term of the backward's own derivative (stock
torch.compile(backend="eager") is 16 % off on a hand-written GELU). Here the backward bodies
lose those two nodes, and run in whatever grad mode the engine sets, as in eager.

(A backward marked @once_differentiable cannot be told apart in the graph: eager PyTorch
raises at its second derivative, where this takes the derivative of its ops as written.)
"""
import torch
from torch import fx

from .subgraphs import hop_name

_SET_GRAD_ENABLED = torch._C._set_grad_enabled


def differentiable_backwards(gm, report=None):
    """Rewrite the backward body of every autograd_function_apply of `gm` and of its body
    graphs (in place); note each in `report`. Returns how many."""
    changed = 0
    for prefix, module in list(gm.named_modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        for node in [n for n in module.graph.nodes if n.op == "call_function"]:
            if hop_name(node) != "autograd_function_apply":
                continue
            backward = node.args[1]
            body = getattr(module, backward.target, None)
            if not isinstance(body, fx.GraphModule) or not _drop_no_grad(body):
                continue
            changed += 1
            if report is not None:
                where = f"{prefix}.{node.name}" if prefix else node.name
                report.notes.append(f"autograd.Function at {where}: its backward is "
                                    f"differentiated as eager autograd would (Dynamo traced "
                                    f"it under no_grad)")
    return changed


def _drop_no_grad(body):
    """Remove the no_grad that Dynamo wraps around a backward body: its first call,
    _set_grad_enabled(False), and its last, _set_grad_enabled(True). Returns whether it
    was there."""
    calls = [n for n in body.graph.nodes if n.op not in ("placeholder", "output")]
    if len(calls) < 2:
        return False
    first, last = calls[0], calls[-1]
    if not (first.target is _SET_GRAD_ENABLED and first.args == (False,)
            and last.target is _SET_GRAD_ENABLED and last.args == (True,)):
        return False
    for node in (first, last):
        if node.users:
            return False
        body.graph.erase_node(node)
    body.recompile()
    return True
