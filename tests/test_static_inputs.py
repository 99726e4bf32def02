"""CUDA graphs and functional_call: tensors standing in for parameters are not static.

Under a mode with CUDA graphs, a plain tensor in a module's parameter slot (MAML's fast
weights, put there by torch.func.functional_call) loses Dynamo's static-input mark, so that
CUDA graph trees copy it in per call instead of re-recording the graph; real parameters and
buffers keep the mark. Checked on the graphs the backend hands to its compilers (CPU: the
CUDA-graph replay itself is tests/test_gpu_training.py's)."""
import functools

import torch
from torch.func import functional_call

from bob_compile import static_inputs
from bob_compile.backend import flashbob


class BufferNet(torch.nn.Module):
    """Two linear layers and a registered buffer (a fixed offset)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.linspace(-1, 1, 4))

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x) + self.offset)).square().sum()


def static_marks(mode, call):
    """{input name: static mark} of each graph flashbob compiled, as its compilers saw it."""
    seen = []
    real = static_inputs.unmark_parameter_stand_ins

    def spy(gm, example_inputs):
        unmarked = real(gm, example_inputs)
        seen.append({n.name: n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
                     for n in gm.graph.find_nodes(op="placeholder")})
        return unmarked
    torch._dynamo.reset()
    model = BufferNet()
    compiled = torch.compile(model, backend=functools.partial(flashbob, mode=mode))
    original = static_inputs.unmark_parameter_stand_ins
    static_inputs.unmark_parameter_stand_ins = spy
    try:
        call(compiled)
    finally:
        static_inputs.unmark_parameter_stand_ins = original
    return seen


def maml_like(compiled):
    x = torch.randn(3, 4)
    named = dict(compiled.named_parameters())
    loss = functional_call(compiled, named, (x,))
    grads = torch.autograd.grad(loss, list(named.values()), create_graph=True)
    fast = {name: p - 0.1 * g for (name, p), g in zip(named.items(), grads)}
    functional_call(compiled, fast, (x,)).backward()


def test_fast_weights_lose_the_static_mark_parameters_and_buffers_keep_it():
    support, query = static_marks("reduce-overhead", maml_like)
    weights = [n for n in support if "_parameters_" in n]
    buffers = [n for n in support if "_buffers_" in n]
    assert len(weights) == 4 and len(buffers) == 1
    assert all(support[n] == "unguarded" for n in weights + buffers)   # nn.Parameters
    assert all(query[n] is None for n in weights)                      # fast weights
    assert all(query[n] == "unguarded" for n in buffers)


def test_without_cuda_graphs_nothing_changes():
    assert static_marks("default", maml_like) == []      # never called
    assert static_marks("max-autotune-no-cudagraphs", maml_like) == []
    assert static_inputs.uses_cuda_graphs(dict(triton_cudagraphs=False)) is False
