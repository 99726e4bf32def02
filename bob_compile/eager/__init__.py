"""The eager host accelerator: what runs a plain eager call of the op with less host time.

A plain eager call (no torch.func transform, no mode, plain tensors) whose first order
PyTorch's fused kernels compute, or that has a mask for the Triton kernels, runs through
C++ autograd nodes (node.py, csrc/native_node.cpp): forward, first backward and the folded
second order's first backward, with the kernels launched from C++ where a recorded program
of their launches exists (programs.py). A repeated call of a signature enters C++ from its
first line (`node.fast_entry`, which bob_compile.attention tries before anything else).

`output` is the one question the rest of the package asks, for a plain eager call
(bob_compile.attention establishes that): o of this call through the nodes, or None, and
then the op's autograd Functions (bob_compile/autograd.py) run it.
BOB_COMPILE_CPP_NODE=off makes every answer None; nothing outside this package changes.
The nodes call back into autograd.py for what they do not run themselves (node.py:
general_backward, bob_backward): this package depends on autograd.py, never the reverse.
"""
from . import node


def output(q, k, v, mask, scale, causal, needs_graph):
    """o of a plain eager call (autograd.plain_call) through the C++ nodes, with a graph
    where needs_graph, or None where they do not apply (see node.unmasked_output,
    node.masked_output)."""
    if mask is None:
        return node.unmasked_output(q, k, v, scale, causal, needs_graph)
    return node.masked_output(q, k, v, mask, scale, causal, needs_graph)
