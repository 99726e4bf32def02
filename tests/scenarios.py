"""The scenarios second-order users run, as functions of a model and its inputs.

Outside autograd (the compiled model is differentiated from outside): first order,
Sophia-H's Hutchinson HVP, a MAML step. Inside the graph (torch.func transforms compiled
with the model): grad(grad), jvp(grad), vmap(grad).
"""
import torch
from torch.func import functional_call, grad, jvp, vmap

from models import loss_of


def max_error(actual, expected):
    if isinstance(expected, dict):
        actual, expected = [actual[k] for k in expected], list(expected.values())
    return max((a - e).abs().max().item() for a, e in zip(actual, expected, strict=True))



def first_order(model, inputs):
    params = list(model.parameters())
    return torch.autograd.grad(loss_of(model(*inputs)), params)


def hutchinson_hvp(model, inputs):
    """Sophia-H / pytorch_optimizer's compute_hutchinson_hessian: H·z for Rademacher z."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model(*inputs)), params, create_graph=True)
    g = torch.Generator().manual_seed(1)
    zs = [torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1 for p in params]
    return torch.autograd.grad(grads, params, grad_outputs=zs)


def maml_step(model, inputs, inner_lr=0.1):
    """learn2learn-style MAML: adapt on the support batch, differentiate the query loss."""
    support, query = inputs
    params = dict(model.named_parameters())
    inner = loss_of(functional_call(model, params, support))
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {name: p - inner_lr * g for (name, p), g in zip(params.items(), grads)}
    outer = loss_of(functional_call(model, fast, query))
    return torch.autograd.grad(outer, list(params.values()))


def loss_function(model):
    return lambda params, *inputs: loss_of(functional_call(model, params, inputs))


def grad_of_grad(model, params, inputs):
    """d/dparams of |grad f|^2: a gradient penalty / Hessian-gradient product."""
    f = loss_function(model)

    def squared_gradient(p):
        return sum((g ** 2).sum() for g in grad(f)(p, *inputs).values())
    return grad(squared_gradient)(params)


def jvp_of_grad(model, params, inputs):
    """Forward-over-reverse Hessian-vector product."""
    f = loss_function(model)
    tangents = {name: torch.full_like(p, 0.01) for name, p in params.items()}
    return jvp(lambda p: grad(f)(p, *inputs), (params,), (tangents,))[1]


def vmap_of_grad(model, params, inputs):
    """Per-sample gradients."""
    f = loss_function(model)

    def per_sample(p, *sample):
        return grad(f)(p, *(x[None] for x in sample))
    return vmap(per_sample, in_dims=(None,) + (0,) * len(inputs))(params, *inputs)
