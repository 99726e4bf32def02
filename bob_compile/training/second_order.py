"""The second order of a training graph: its VJP, taken by autograd's own formulas.

A create_graph backward (a Hessian-vector product, MAML) needs the gradients of the graph's
inputs as a function that can be differentiated again. That function is built from the
Dynamo graph itself (after the attention rewrite), not from the compiled backward:

    GraphVjp(primals, draws, tangents) = autograd.grad(graph(primals), primals, tangents,
                                                       create_graph=True)

with the forward's random draws replayed (draws.py). Run under AOTAutograd, this traces
every op's derivative exactly as eager autograd records it with create_graph=True, and the
double backward as eager autograd would take it: decompositions apply below autograd, at
every order, so no decomposed backward is ever differentiated. (Differentiating the
compiled backward graph instead was silently wrong wherever a first-order formula differs
from its differentiable form — det's backward through the LU factors, a saved output marked
non-differentiable — and failed on decompositions without derivatives: prims.rev under
flip and cumsum, max_pool's offsets, complex slice_scatter. docs/routing.md.)

`compile_graph_vjp` compiles GraphVjp as one AOTAutograd pair: its forward half recomputes
the forward and the gradients, its backward half is the second order, our fused BoB
kernels inside. `eager_vjp` evaluates the same function eagerly: for third order, batched
(legacy vmap) cotangents, and graphs whose pair does not compile.
"""
import contextlib
import operator

import torch
from torch import fx

from .draws import ReplayDraws
from .pairs import compile_pair


class GraphVjp(torch.nn.Module):
    """(*primals, *draws, *tangents) -> the gradient of each primal in `wanted`, zeros where
    the graph does not depend on it; tangents are the cotangents of the graph outputs
    `tangent_outputs`."""

    def __init__(self, graph_module, num_primals, draw_kinds, tangent_outputs, wanted):
        super().__init__()
        self.graph_module = graph_module
        self.num_primals, self.draw_kinds = num_primals, tuple(draw_kinds)
        self.tangent_outputs, self.wanted = list(tangent_outputs), list(wanted)

    def forward(self, *args, create_graph=True):
        n, d = self.num_primals, len(self.draw_kinds)
        primals, draws, tangents = args[:n], args[n:n + d], args[n + d:]
        with torch.enable_grad():
            outputs = self.recompute(primals, draws)
            pairs = [(outputs[i], t) for i, t in zip(self.tangent_outputs, tangents)
                     if isinstance(outputs[i], torch.Tensor) and outputs[i].requires_grad]
            wanted = [primals[i] for i in self.wanted]
            grads = torch.autograd.grad([o for o, _ in pairs], wanted, [t for _, t in pairs],
                                        create_graph=create_graph, allow_unused=True)
        return tuple(torch.zeros_like(p) if g is None else g for p, g in zip(wanted, grads))

    def recompute(self, primals, draws):
        """The graph's outputs, its random ops answered with `draws`."""
        if not self.draw_kinds:
            return _as_list(self.graph_module(*primals))
        replay = ReplayDraws(self.draw_kinds, draws)
        with replay:
            outputs = _as_list(self.graph_module(*primals))
        replay.finish()
        return outputs


def _as_list(outputs):
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def compile_graph_vjp(vjp, example_inputs, compiler, config_patches, what, static_inputs):
    """A CompiledPair of `vjp` (a GraphVjp), traced at `example_inputs` (their requires_grad
    says which inputs the second order differentiates). Raises NotSupported."""
    graph = fx.Graph()
    placeholders = [graph.placeholder(f"arg{i}") for i in range(len(example_inputs))]
    for node, value in zip(placeholders, example_inputs):
        node.meta["val"] = value
    root = torch.nn.Module()
    root.vjp = vjp
    call = graph.call_module("vjp", tuple(placeholders))
    graph.output(tuple(graph.call_function(operator.getitem, (call, i))
                       for i in range(len(vjp.wanted))))
    return compile_pair(fx.GraphModule(root, graph), example_inputs, compiler, config_patches,
                        what, static_inputs=static_inputs)


def eager_vjp(vjp, primals, draws, tangents, create_graph):
    """GraphVjp run eagerly: exact at every order (differentiable again when
    `create_graph`). Each primal that requires grad enters as a fresh view, so that its
    gradient is its own partial: autograd.grad with respect to the tensor itself would
    also follow paths by which another primal was computed from it (MAML's fast weights
    from the weights). The draws' ops reach the replay as they did the compiled
    forward's trace: with the Python dispatcher on (draws.py)."""
    from torch._dispatch.python import enable_python_dispatcher
    with torch.enable_grad():
        if create_graph:
            primals = [p.view_as(p) if _requires_grad(p) else p for p in primals]
        else:
            primals = [p.detach().requires_grad_(i in vjp.wanted)
                       if isinstance(p, torch.Tensor) else p for i, p in enumerate(primals)]
    with enable_python_dispatcher() if draws else contextlib.nullcontext():
        return vjp(*primals, *draws, *tangents, create_graph=create_graph)


def _requires_grad(x):
    return isinstance(x, torch.Tensor) and x.requires_grad


# ----------------------------------------------------------------------------- third order
def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, *unused):
    dims = tuple(range(-len(normalized_shape), 0))
    mean = input.mean(dims, keepdim=True)
    centered = input - mean
    out = centered * torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


class ExactBeyondSecondOrder(torch.overrides.TorchFunctionMode):
    """Eager autograd is not exact at third order for nn.LayerNorm: its double backward
    reads the saved mean and rstd, which native_layer_norm returns as non-differentiable
    (gradgradcheck of its gradient fails). Above second order, layer norm runs as its
    math in ordinary ops, exact at every order. (Other ops of this kind, which eager gets
    wrong at third order too: docs/routing.md.)"""

    _COMPOSITES = {torch.nn.functional.layer_norm: _layer_norm, torch.layer_norm: _layer_norm}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        composite = self._COMPOSITES.get(func)
        if composite is not None:
            return composite(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
