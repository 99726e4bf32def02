"""Call paths: what the Triton implementation runs for one call signature, decided once
(bob_compile/kernels/triton_attention.py), and the backwards that call a call path's kernels directly
where nothing records a graph (bob_compile/autograd.py).

Call paths exist for CUDA inputs. Here a CallPath's kernels are stood in for by the blockwise path
(and PyTorch's CPU flash kernels as the "native" first-order kernels), so that what is
tested on a CPU is which calls take a call path, and that they give what the general path
gives, bit for bit.
"""
import pytest
import torch

import bob_compile
from bob_compile import autograd, kernels
from bob_compile.kernels import blockwise, settings
from bob_compile.kernels.params import AttentionParams
from test_op_host_path import OpLog

triton_attention = pytest.importorskip("bob_compile.kernels.triton_attention")
from bob_compile.kernels import native_sdpa  # noqa: E402


def cpu_flash_forward(backend, q, k, v, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                       scale=scale)


def cpu_flash_forward_output(backend, q, k, v, scale, causal):
    return cpu_flash_forward(backend, q, k, v, scale, causal)[0]


def cpu_flash_backward(backend, q, k, v, o, lse, do, scale, causal):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, causal, scale=scale)


@pytest.fixture
def call_paths(monkeypatch):
    """Call paths for CPU inputs, their kernels blockwise (native=None) or CPU flash (native
    "cpu"); returns (set_native, calls): the CallPath methods called, by name, in order."""
    calls = []
    native = [None]
    monkeypatch.setattr(triton_attention, "attention_forward", blockwise.forward)
    monkeypatch.setattr(triton_attention, "attention_backward",
                        lambda *a, dq_atomics: blockwise.backward(*a))
    monkeypatch.setattr(triton_attention, "attention_bob",
                        lambda *a, row_atomics=False, fold=False, dq=None, keys_out=None:
                        blockwise.bob_folded(*a[:-1], dq, a[-1]) if fold else blockwise.bob(*a))
    monkeypatch.setattr(native_sdpa, "forward", cpu_flash_forward)
    monkeypatch.setattr(native_sdpa, "forward_output", cpu_flash_forward_output)
    monkeypatch.setattr(native_sdpa, "backward", cpu_flash_backward)

    class CountedPath(triton_attention.CallPath):
        __slots__ = ()

    for name in ("forward", "forward_output", "backward", "bob", "bob_folded"):
        def counted(self, *args, _name=name):
            calls.append(_name)
            return getattr(triton_attention.CallPath, _name)(self, *args)
        setattr(CountedPath, name, counted)

    def call_path(q, k, v, scale, causal):
        return CountedPath(native[0], AttentionParams(scale=scale, causal=causal),
                            settings.current())
    monkeypatch.setattr(kernels, "call_path", call_path)
    return native, calls


def inputs(causal_length=6, dtype=torch.float64):
    torch.manual_seed(0)
    return [torch.randn(2, 3, causal_length, 4, dtype=dtype, requires_grad=True)
            for _ in range(4)]


def second_order_step(q, k, v, do, causal=True):
    o = bob_compile.attention(q, k, v, is_causal=causal)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    cotangents = [torch.ones_like(t) * (i + 1) for i, t in enumerate((dq, dk, dv))]
    return (o, dq, dk, dv, *torch.autograd.grad((dq, dk, dv), (q, k, v, do), cotangents))


def first_order_step(q, k, v, do, causal=True):
    o = bob_compile.attention(q, k, v, is_causal=causal)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def spy(monkeypatch, cls, method="forward"):
    """The number of calls of cls.method (a staticmethod), in a list."""
    seen = []
    original = getattr(cls, method)

    def counted(*args):
        seen.append(1)
        return original(*args)
    monkeypatch.setattr(cls, method, staticmethod(counted))
    return seen


def general_path(step, monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setattr(kernels, "call_path", lambda q, k, v, scale, causal: None)
        return step(*args)


def test_first_order_backward_runs_its_call_path_without_the_backward_function(call_paths,
                                                                              monkeypatch):
    native, calls = call_paths
    backward_function = spy(monkeypatch, autograd.AttnBwdFn)
    ours = first_order_step(*inputs())
    assert calls == ["forward", "backward"]
    assert backward_function == []             # no AttnBwdFn: nothing differentiates dq
    expected = general_path(first_order_step, monkeypatch, *inputs())
    for a, b in zip(ours, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form", ["folded", "chain"])
def test_second_order_records_its_graph_then_runs_its_call_path(call_paths, monkeypatch, form):
    """grad(create_graph=True) needs AttnBwdFn's node (its backward is the BoB); the final
    backward records nothing, so the BoB (and, in the chain form, the second backward) run
    the call path's kernels directly, without AttnBobFn/AttnBobFoldedFn."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_FORM", form)
    settings.reload()
    native, calls = call_paths
    backward_function = spy(monkeypatch, autograd.AttnBwdFn)
    bob_function = spy(monkeypatch, autograd.AttnBobFn)
    folded_function = spy(monkeypatch, autograd.AttnBobFoldedFn)
    ours = second_order_step(*inputs())
    assert backward_function == [1] and bob_function == [] and folded_function == []
    # folded: nothing reaches o and lse, so the forward's backward does not run again
    assert calls == (["forward", "backward", "bob_folded"] if form == "folded"
                     else ["forward", "backward", "bob", "backward"])
    expected = general_path(second_order_step, monkeypatch, *inputs())
    for a, b in zip(ours, expected):
        assert torch.equal(a, b)


def test_hvp_through_a_model_runs_a_plain_backward_for_the_cotangent_of_o(call_paths,
                                                                        monkeypatch):
    """A Hessian-vector product through a model whose loss is not linear in o: in the folded
    form the cotangent reaching o from the rest of the model is the only one there, so the
    forward's backward runs once more without an lse cotangent (on CUDA: PyTorch's fused
    backward); the chain form merges it with the BoB's (go, glse), dlse included."""
    native, calls = call_paths
    dlse_seen = []
    monkeypatch.setattr(triton_attention, "attention_backward",
                        lambda *a, dq_atomics: dlse_seen.append(a[6]) or blockwise.backward(*a))

    def hvp():
        q, k, v, _ = inputs()
        o = bob_compile.attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(o.square().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(grads, (q, k, v), [torch.ones_like(g) for g in grads])
    folded = hvp()
    assert calls == ["forward", "backward", "bob_folded", "backward"]
    assert dlse_seen == [None, None]
    calls.clear()
    dlse_seen.clear()
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_FORM", "chain")
    settings.reload()
    chain = hvp()
    assert calls == ["forward", "backward", "bob", "backward"]
    assert dlse_seen[0] is None and dlse_seen[1] is not None
    for a, b in zip(folded, chain):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_native_first_order_and_a_refusal(call_paths, monkeypatch):
    """With PyTorch's kernels as the call path's first order, results match the general path
    to rounding; a refusal by them falls back to the general path, exactly."""
    native, calls = call_paths
    native[0] = "cpu"
    expected = general_path(first_order_step, monkeypatch, *inputs(dtype=torch.float32))
    ours = first_order_step(*inputs(dtype=torch.float32))
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    def refuses(*args):
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")
    monkeypatch.setattr(native_sdpa, "backward", refuses)
    monkeypatch.setattr(native_sdpa, "failed", set())
    monkeypatch.setattr(triton_attention, "_call_paths", {"stale": None})
    ours = first_order_step(*inputs(dtype=torch.float32))
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert triton_attention._call_paths == {}        # every call path is decided again


def test_kernels_the_cpp_node_does_not_know_stay_in_python(call_paths, cpp_node):
    """A call path whose first order is a kernel the C++ node does not run (here the
    fixture's "cpu") takes the Python path, built node or not (it raised ValueError once
    the node was loaded: the suite's result then depended on whether a cached build was
    ready when this module ran)."""
    native, calls = call_paths
    native[0] = "cpu"
    ours = first_order_step(*inputs(dtype=torch.float32))
    assert calls == ["forward", "backward"]
    assert type(ours[0].grad_fn).__name__ != "CppFunction"
    q, k, v, do = inputs(dtype=torch.float32)
    expected = torch.autograd.grad(
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)
    for a, b in zip(ours[1:], expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_deterministic_algorithms_keep_pytorchs_backward_out(call_paths, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the first-order backward runs our
    kernels (PyTorch's fused backwards accumulate dq with atomics, and native SDPA then
    avoids cuDNN); with warn_only=True, or without it, PyTorch's backward runs."""
    native, calls = call_paths
    native[0] = "cpu"
    ran = []
    monkeypatch.setattr(native_sdpa, "backward",
                        lambda *a: ran.append(1) or cpu_flash_backward(*a))
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        for deterministic, warn_only, expected in ((True, False, []), (True, True, [1]),
                                                   (False, False, [1])):
            ran.clear()
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
            ours = first_order_step(*inputs(dtype=torch.float32))
            assert ran == expected, (deterministic, warn_only)
            want = general_path(first_order_step, monkeypatch, *inputs(dtype=torch.float32))
            for a, b in zip(ours, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        # the contract's own backward (the op's general path), PyTorch's kernel applying
        monkeypatch.setattr(native_sdpa, "backend_for", lambda *a: "cpu")
        q, k, v, do = (t.detach() for t in inputs(dtype=torch.float32))
        params = AttentionParams(scale=0.5, causal=True)
        o, lse = blockwise.forward(q, k, v, params)
        for deterministic, expected in ((True, []), (False, [1])):
            ran.clear()
            torch.use_deterministic_algorithms(deterministic)
            triton_attention.backward(q, k, v, o, lse, do, None, params)
            assert ran == expected
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_backwards_under_a_mode_or_the_profiler_call_the_op(call_paths):
    """What observes ops sees them: a dispatch mode around the backward sees attn_bwd, and
    the profiler names it, as without call paths."""
    native, calls = call_paths
    q, k, v, do = inputs()
    o = bob_compile.attention(q, k, v, is_causal=True)
    with OpLog() as log:
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    assert log.seen == ["attn_bwd"]
    with torch.profiler.profile() as prof:
        torch.autograd.grad(o, (q, k, v), do)
    assert "bob_compile::attn_bwd" in {event.key for event in prof.key_averages()}


def test_no_call_path_for_a_mask_or_other_ranks(call_paths):
    native, calls = call_paths
    q, k, v, do = inputs()
    mask = torch.rand(6, 6) > 0.3
    first = bob_compile.attention(q, k, v, mask)
    torch.autograd.grad(first, (q, k, v), do)
    bob_compile.attention(q[0], k[0], v[0])            # rank 3
    assert calls == []


def test_call_paths_are_decided_once_per_signature(monkeypatch):
    monkeypatch.setattr(kernels, "select", lambda q, k, v: triton_attention)
    decided = []
    real_backend = native_sdpa.backend_for
    monkeypatch.setattr(native_sdpa, "backend_for",
                        lambda *a: decided.append(1) or real_backend(*a))
    monkeypatch.setattr(triton_attention, "_call_paths", {})
    q = torch.randn(1, 2, 5, 8)
    first = triton_attention.call_path(q, q, q, 0.5, True)
    assert isinstance(first, triton_attention.CallPath) and first.native is None   # not CUDA
    assert triton_attention.call_path(q, q, q, 0.5, True) is first and decided == [1]
    assert triton_attention.call_path(q, q, q, 0.5, False) is not first
    assert triton_attention.call_path(q[..., :0, :], q, q, 0.5, False) is None      # L = 0
    settings.reload()
    assert triton_attention.call_path(q, q, q, 0.5, True) is not first


def test_cpu_inputs_have_no_call_path():
    q = torch.randn(1, 1, 3, 4)
    assert kernels.call_path(q, q, q, 0.5, False) is None
