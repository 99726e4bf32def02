"""CUDA graphs and functional_call: tensors standing in for parameters are not static.

Under a mode with CUDA graphs, a plain tensor in a module's parameter slot (MAML's fast
weights, put there by torch.func.functional_call) loses Dynamo's static-input mark, so that
CUDA graph trees copy it in per call instead of re-recording the graph; real parameters and
buffers keep the mark. Checked on the graphs the backend hands to its compilers (CPU: the
CUDA-graph replay itself is tests/gpu/test_gpu_training.py's)."""
import functools

import pytest
import torch
from torch.func import functional_call

from bob_compile import static_inputs
from bob_compile.backend import flashbob
from bob_compile.training import pairs


class BufferNet(torch.nn.Module):
    """Two linear layers and a registered buffer (a fixed offset)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.linspace(-1, 1, 4))

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x) + self.offset)).square().sum()


def static_marks(mode, call, model_class=BufferNet):
    """{input name: static mark} of each graph flashbob compiled, as its compilers saw it."""
    seen = []
    real = static_inputs.unmark_parameter_stand_ins

    def spy(gm, example_inputs):
        unmarked = real(gm, example_inputs)
        seen.append({n.name: n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
                     for n in gm.graph.find_nodes(op="placeholder")})
        return unmarked
    torch._dynamo.reset()
    model = model_class()
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



class ScaledNet(BufferNet):
    """BufferNet with a learned scale on its hidden layer, which the backward saves as it is."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2, 4))

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x) * self.scale + self.offset)).square().sum()


def static_inputs_compiled(call, model_class):
    """[(forward's, backward's) (placeholder names, names of the static inputs)] of every
    pair flashbob compiled under mode="reduce-overhead", in order, as inductor got them."""
    import torch._inductor.compile_fx as compile_fx
    compiled = []
    inner = compile_fx.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        compiled.append((names, [names[i] for i in kwargs.get("static_input_idxs", ())]))
        return inner(gm, example_inputs, **kwargs)
    compile_fx.compile_fx_inner = spy
    try:
        marks = static_marks("reduce-overhead", call, model_class)
    finally:
        compile_fx.compile_fx_inner = inner
    return marks, list(zip(compiled[::2], compiled[1::2]))


def test_compiled_halves_record_parameters_in_place_and_copy_everything_else():
    marks, pairs = static_inputs_compiled(maml_like, ScaledNet)
    support, query = ([i for i, mark in enumerate(graph.values()) if mark] for graph in marks)
    assert len(support) == 6 and len(query) == 1     # 5 parameters and the buffer; the buffer
    (forward_names, forward_static), (backward_names, _) = pairs[0]
    assert [forward_names.index(n) for n in forward_static] == support
    # compiled in this order: the support graph, its second order (during the inner grad),
    # the query graph (fast weights)
    (query_names, query_static), _ = pairs[2]
    assert len(query_names) == len(forward_names)
    assert [query_names.index(n) for n in query_static] == query
    for (names, static), (backward_names, backward_static) in pairs:
        # a saved primal is static in the backward only where it is in the forward: the
        # caller's x and MAML's fast weights come in anew at every call
        saved_primals = set(names) & set(backward_names)
        assert saved_primals, "every backward here reads some input"
        assert set(backward_static) & saved_primals <= set(static)
        assert not any(n.startswith("tangents") for n in backward_static)
    # the second order's pair: its inputs are the support graph's primals, then the
    # tangents; the parameters and the buffer stay in place, the batch and the tangent
    # are copied in
    (second_order_names, second_order_static), _ = pairs[1]
    assert [second_order_names.index(n) for n in second_order_static] == support


def hvp_and_maml(compiled, x):
    params = list(compiled.parameters())
    grads = torch.autograd.grad(compiled(x), params, create_graph=True)
    hvp = torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
    named = dict(compiled.named_parameters())
    grads = torch.autograd.grad(functional_call(compiled, named, (x,)), list(named.values()),
                                create_graph=True)
    fast = {name: p - 0.1 * g for (name, p), g in zip(named.items(), grads)}
    meta = torch.autograd.grad(functional_call(compiled, fast, (x,)), list(named.values()))
    return [*hvp, *meta]


def as_if_cuda_graphs(monkeypatch, on=True):
    """The backend and the pairs act as under a mode with CUDA graphs (aot_eager: none run)."""
    monkeypatch.setattr(static_inputs, "uses_cuda_graphs", lambda config: on)
    monkeypatch.setattr(pairs, "uses_cuda_graphs", lambda config: on)


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_compiled_outputs_carry_no_graph_past_the_step(monkeypatch, cuda_graphs):
    """Under CUDA graphs a replay returns the same output tensors at every step (the tree's
    cached outputs). The Functions hand back fresh aliases, so no step's autograd node, with
    the values a second order retains, lives on in that cache: the recording step freed them
    by then, and a tree finding them alive recorded the next graph again on every step
    (tests/gpu/test_gpu_training.py replays it). Without CUDA graphs the outputs go back
    as they are (no alias per output)."""
    as_if_cuda_graphs(monkeypatch, cuda_graphs)
    outputs = []
    real_pair = pairs._pair

    def recording_pair(*args, **kwargs):
        pair = real_pair(*args, **kwargs)
        forward = pair.forward

        def recorded(inputs):
            values = forward(inputs)
            outputs.extend(v for v in values if isinstance(v, torch.Tensor))
            return values
        pair.forward = recorded
        return pair
    monkeypatch.setattr(pairs, "_pair", recording_pair)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BufferNet().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    expected = hvp_and_maml(model, x)
    compiled = torch.compile(model, backend=flashbob, options={"compiler": "aot_eager"})
    for _ in range(2):
        actual = hvp_and_maml(compiled, x)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    carrying = [t for t in outputs if t.grad_fn is not None]
    assert (carrying == []) if cuda_graphs else carrying


def test_backward_static_inputs_are_the_parameters_and_their_views(monkeypatch):
    """Each compiled backward (first and second order) calls static, for CUDA graphs, exactly
    the inputs that live in a parameter's (or buffer's) memory: the parameter or a view of
    it (a transposed weight). Not the batch, and not a value the forward computed: under CUDA
    graphs that is the forward recording's output, which the tree tracks by itself."""
    as_if_cuda_graphs(monkeypatch)
    seen = []
    real_pair = pairs._pair

    def recording_pair(*args, **kwargs):
        pair = real_pair(*args, **kwargs)
        backward = pair.backward
        static = set(pairs._backward_static_inputs(pair.backward_graph, pair.forward_graph,
                                                   pair.static_inputs, pair.effect_tokens))

        def recorded(inputs):
            seen.append([(i in static, t.untyped_storage().data_ptr())
                         for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)])
            return backward(inputs)
        pair.backward = recorded
        return pair
    monkeypatch.setattr(pairs, "_pair", recording_pair)
    torch._dynamo.reset()
    model = BufferNet().double()
    compiled = torch.compile(model, backend=flashbob, options={"compiler": "aot_eager"})
    x = torch.randn(3, 4, dtype=torch.float64)
    hvp_and_maml(compiled, x)
    compiled(x).backward()
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert len(seen) >= 3 and any(static for inputs in seen for static, _ in inputs)
    for inputs in seen:
        assert [static for static, _ in inputs] == [ptr in fixed for _, ptr in inputs]
