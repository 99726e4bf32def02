"""No intermediate of a full second-order step on the blockwise path has L·S elements per
head: every op output is recorded by a TorchDispatchMode and checked."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bob_compile import attention
from bob_compile.kernels import blockwise

B, H, N, E = 1, 2, 1024, 16


class LargestOutput(TorchDispatchMode):
    """Remembers the largest tensor any op produced, in elements per (batch, head)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() // (B * H) > self.largest:
                self.largest, self.op = t.numel() // (B * H), func
        return out


def second_order_step(attn, causal):
    """Forward, grad(create_graph=True), Hessian-vector product, and a forward-over-reverse
    HVP with torch.func, as a Sophia-H or MAML step would."""
    q, k, v = (torch.randn(B, H, N, E, requires_grad=True) for _ in range(3))
    weight = torch.randn(B, H, N, E)

    def loss(q, k, v):
        return (torch.sin(attn(q, k, v, is_causal=causal)) * weight).sum()
    grads = torch.autograd.grad(loss(q, k, v), (q, k, v), create_graph=True)
    torch.autograd.grad(grads, (q, k, v), grad_outputs=[torch.randn_like(g) for g in grads])
    primals = tuple(t.detach() for t in (q, k, v))
    torch.func.jvp(torch.func.grad(loss, argnums=(0, 1, 2)), primals,
                   tuple(torch.randn_like(t) for t in primals))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_blockwise_second_order_never_materializes_scores(causal):
    watch = LargestOutput()
    with blockwise.tiles(128, 128), watch:
        second_order_step(attention, causal)
    assert watch.largest < N * N, (watch.largest, watch.op)


def test_watchdog_catches_math_attention():
    """The check can fail: plain math attention materializes N×N."""
    from bob_compile.kernels.reference import sdpa_math as math_attention
    watch = LargestOutput()
    with watch:
        second_order_step(math_attention, causal=True)
    assert watch.largest >= N * N
