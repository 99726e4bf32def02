"""The C++ autograd node of the first order on CUDA (bob_compile/native_node.py): the same
PyTorch kernels as the op's Python node, so the same results at every order (the same bits
but where PyTorch's fused backwards accumulate dq with atomics), with no Python in a
first-order backward. The node's plumbing at every order in float64: test_native_node.py."""
import pytest
import torch

import bob_compile
from bob_compile.autograd import native_node_backward
from bob_compile.kernels import settings

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def step(q, k, v, do, vs, causal, gqa):
    """forward without grad, forward, first-order grads, and a second-order step (fresh
    leaves each time)."""
    with torch.no_grad():
        without_grad = bob_compile.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = bob_compile.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    first = torch.autograd.grad(o, (q, k, v), do)
    o = bob_compile.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    second = torch.autograd.grad(grads, (q, k, v), vs)
    return type(o.grad_fn).__name__, (without_grad, o, *first, *second)


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_same_results_as_the_python_node(cpp_node, reread_settings, monkeypatch, backend,
                                         dtype, causal, gqa):
    monkeypatch.setenv("BOB_COMPILE_NATIVE_BACKEND", backend)
    settings.reload()
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)
    # q, k, v as permuted views of (B, L, H, E) projections, as models make them
    q = randn(2, 300, 4, 64).transpose(1, 2)
    k, v = (randn(2, 300, 2 if gqa else 4, 64).transpose(1, 2) for _ in range(2))
    do = randn(2, 300, 4, 64).transpose(1, 2)
    vs = [randn(*t.shape) for t in (q, k, v)]

    calls = []
    cpp_node.set_general_backward(
        lambda *a: calls.append(a[5] is None) or native_node_backward(*a))
    try:
        name, ours = step(q, k, v, do, vs, causal, gqa)
    finally:
        cpp_node.set_general_backward(native_node_backward)
    assert name == "CppFunction"
    assert calls == [False]     # the create_graph backward only
    monkeypatch.setenv("BOB_COMPILE_CPP_NODE", "off")
    settings.reload()
    name, python_node = step(q, k, v, do, vs, causal, gqa)
    assert name != "CppFunction"
    for a, b in zip(ours[:2], python_node[:2]):        # o, without grad and with
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(ours, python_node, strict=True):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b)
