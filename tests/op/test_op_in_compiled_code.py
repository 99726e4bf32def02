"""bob_compile.attention called inside user code that is compiled with a stock backend:
Dynamo keeps it as one graph node (allow_in_graph), so every backend can run it."""
import pytest
import torch
from torch.func import grad, jvp

from bob_compile.kernels.reference import sdpa_math as math_attention
from bob_compile import attention

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def make(causal=True):
    q, k, v = (torch.randn(2, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    w = torch.randn(2, 2, 6, 4, dtype=torch.float64)

    def loss(attn):
        return lambda q, k, v: (torch.tanh(attn(q, k, v, is_causal=causal)) * w).sum()
    return (q, k, v), loss(attention), loss(math_attention)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_first_order_under_stock_backends(backend):
    inputs, f, f_ref = make()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    xs = [t.clone().requires_grad_() for t in inputs]
    compiled(*xs).backward()
    ref = torch.func.grad(f_ref, argnums=(0, 1, 2))(*inputs)
    for x, r in zip(xs, ref):
        torch.testing.assert_close(x.grad, r, atol=1e-10, rtol=0)


def test_in_graph_torch_func_under_aot_eager():
    """compile(grad(grad(f))) and compile(jvp(grad(f))): the derivatives are traced into the
    AOT graph as our ops."""
    inputs, f, f_ref = make()
    second = lambda fn: grad(lambda q, k, v: grad(fn, argnums=1)(q, k, v).sum(), argnums=(0, 1, 2))
    got = torch.compile(second(f), backend="aot_eager", fullgraph=True)(*inputs)
    for a, b in zip(got, second(f_ref)(*inputs)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    tangents = tuple(torch.randn_like(t) for t in inputs)
    fwd_over_rev = lambda fn: (lambda *p: jvp(grad(fn, argnums=(0, 1, 2)), p, tangents)[1])
    got = torch.compile(fwd_over_rev(f), backend="aot_eager", fullgraph=True)(*inputs)
    for a, b in zip(got, fwd_over_rev(f_ref)(*inputs)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_double_backward_under_eager_backend():
    inputs, f, f_ref = make()
    compiled = torch.compile(f, backend="eager", fullgraph=True)

    def hvp(fn):
        xs = [t.clone().requires_grad_() for t in inputs]
        gs = torch.autograd.grad(fn(*xs), xs, create_graph=True)
        return torch.autograd.grad(gs, xs, grad_outputs=[torch.ones_like(g) for g in gs])
    for a, b in zip(hvp(compiled), hvp(f_ref)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
