"""Host time of forward over reverse through the op under torch.func, against torch.func's
own floor: the same step through a bare pair of autograd.Functions of the same shape (a
forward with a jvp and a backward, the backward a Function with a jvp), every kernel
replaced by an empty tensor, so that only host work is timed. Runs on the CPU.

    python benchmarks/bench_func_host_floor.py
"""
import os
import sys

import torch

import bob_compile
from bob_compile import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_autograd_node import microseconds  # noqa: E402

q, k, v, do, tq, tk, tv = (torch.randn(1, 2, 16, 8) for _ in range(7))
lse_like = torch.zeros(1, 2, 16)


def stub_kernels():
    """Every op's implementation returns empty outputs of the right shapes."""
    def three(q, k, v):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ops.call_forward = lambda pick, q, k, v, *a, **kw: (torch.empty_like(q),
                                                        torch.empty_like(lse_like))
    ops.call_backward = lambda pick, q, k, v, *a, **kw: three(q, k, v)
    ops.call_forward_jvp = lambda pick, q, k, v, o, lse, *a, **kw: (torch.empty_like(o),
                                                                    torch.empty_like(lse))
    ops.call_backward_jvp = lambda pick, q, k, v, *a, **kw: three(q, k, v)


class BareBackward(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, o, lse, do):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_forward(*inputs)

    @staticmethod
    def jvp(ctx, *tangents):
        q = ctx.saved_tensors[0]
        return torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)


class BareForward(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v):
        return torch.empty_like(q), torch.empty_like(lse_like)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output)
        ctx.save_for_forward(*inputs, *output)

    @staticmethod
    def backward(ctx, do, dlse):
        return BareBackward.apply(*ctx.saved_tensors, do)

    @staticmethod
    def jvp(ctx, tq, tk, tv):
        *_, o, lse = ctx.saved_tensors
        return torch.empty_like(o), torch.empty_like(lse)


def loss_through_the_op(q, k, v):
    return (bob_compile.attention(q, k, v, is_causal=True) * do).sum()


def loss_through_bare_functions(q, k, v):
    return (BareForward.apply(q, k, v)[0] * do).sum()


def ms_per_step(loss):
    def step():
        return torch.func.jvp(torch.func.grad(loss, argnums=(0, 1, 2)), (q, k, v), (tq, tk, tv))
    return microseconds(step, calls=100, warmup=30, runs=7)[0] / 1e3


def main():
    stub_kernels()
    for round_ in range(2):
        for loss in (loss_through_the_op, loss_through_bare_functions):
            print(f"round {round_} {loss.__name__:28s} {ms_per_step(loss):.3f} ms per step")


if __name__ == "__main__":
    main()
