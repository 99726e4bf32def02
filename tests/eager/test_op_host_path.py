"""The two ways the autograd Functions reach the kernels (bob_compile/autograd.py).

In plain eager code they call the op's implementation directly (the custom-op dispatcher
round trip costs more than native SDPA's whole forward); wherever something could observe
the op (a dispatch or torch function mode, tracing, torch.func, legacy vmap, a tensor
subclass) they call torch.ops.bob_compile.*. Both must give bit-identical results, and the
op must stay visible to everything that looks for it.
"""
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import bob_compile
from bob_compile import _compat, autograd
from bob_compile.kernels.reference import sdpa_math

OPS = ("attn_fwd", "attn_bwd", "attn_bob", "attn_bob_folded", "attn_fwd_jvp", "attn_bwd_jvp")


class PassThrough(TorchFunctionMode):
    """A torch function mode that changes nothing (it sees the forward's op call; what runs
    inside a function it intercepted, such as autograd.grad, it does not see)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class OpLog(TorchDispatchMode):
    """A dispatch mode that changes nothing and lists the bob_compile ops it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "bob_compile":
            self.seen.append(func._opname)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def op_calls(monkeypatch):
    """Calls of torch.ops.bob_compile.* made by the autograd Functions."""
    calls = []
    real = torch.ops.bob_compile

    def counted(name):
        def call(*args):
            calls.append(name)
            return getattr(real, name)(*args)
        return call
    monkeypatch.setattr(autograd, "op", types.SimpleNamespace(**{n: counted(n) for n in OPS}))
    return calls


def second_order_step(causal):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 7, 4, dtype=torch.float64, requires_grad=True)
                   for _ in range(4))
    gq, gk, gv = (torch.randn(2, 3, 7, 4, dtype=torch.float64) for _ in range(3))
    o = bob_compile.attention(q, k, v, is_causal=causal)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    second = torch.autograd.grad((dq, dk, dv), (q, k, v, do), (gq, gk, gv))
    return (o, dq, dk, dv, *second)


@pytest.mark.parametrize("causal", [False, True])
def test_eager_skips_the_dispatcher_and_matches_the_op_bitwise(op_calls, causal):
    direct = second_order_step(causal)
    assert op_calls == []
    with OpLog() as log:
        through_op = second_order_step(causal)
    assert op_calls == log.seen == ["attn_fwd", "attn_bwd", "attn_bob_folded"]
    for a, b in zip(direct, through_op):
        assert torch.equal(a, b)


def _first_backward_inputs(dq):
    """The nodes AttnBwdFn's inputs o and lse lead to (None: detached)."""
    node = dq.grad_fn
    while type(node).__name__ == "ViewBackward0":   # forward-mode AD views the outputs
        node = node.next_functions[0][0]
    assert type(node).__name__ == "AttnBwdFnBackward"
    return [type(f).__name__ if f is not None else None for f, _ in node.next_functions[3:5]]


@pytest.mark.parametrize("form", ["folded", "chain"])
def test_the_folded_second_backward_never_revisits_the_forward(monkeypatch, form):
    """In the folded form the first backward takes o and lse detached (the BoB folds their
    cotangents into q, k, v's), so the second backward's graph ends at AttnBwdFn; the chain
    form sends go and glse through the forward, so there they stay attached. Both exact."""
    from bob_compile.kernels import settings
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_FORM", form)
    settings.reload()
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    o = bob_compile.attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(torch.sin(o).sum(), (q, k, v), create_graph=True)
    attached = ["AttnFnBackward", "AttnFnBackward"]
    assert _first_backward_inputs(dq) == ([None, None] if form == "folded" else attached)
    got = torch.autograd.grad((dq * dq).sum() + dv.sum(), (q, k, v))

    def reference(q, k, v):
        return torch.softmax((q @ k.transpose(-2, -1) / 2).masked_fill(
            torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf")), -1) @ v
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    dq2, dk2, dv2 = torch.autograd.grad(torch.sin(reference(q2, k2, v2)).sum(), (q2, k2, v2),
                                        create_graph=True)
    want = torch.autograd.grad((dq2 * dq2).sum() + dv2.sum(), (q2, k2, v2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_forward_node_goes_with_the_second_backward():
    """With o and lse detached, the second backward no longer visits the forward's node (which
    used to release what it saved); once that backward has run, nothing of the first
    backward's graph may keep the forward's node, and all it saved, alive (a training loop
    keeps the last step's gradients while the next forward runs)."""
    import gc
    import weakref
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    w = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    o = bob_compile.attention(q, k, v, is_causal=True)
    forward_node = weakref.ref(o.grad_fn)
    grads = torch.autograd.grad((o * w).sum(), (q, k, v), create_graph=True)
    assert _first_backward_inputs(grads[0]) == [None, None]
    torch.autograd.grad(sum((g * g).sum() for g in grads), (q, k, v))
    del o
    gc.collect()
    assert forward_node() is None, "the first backward's graph keeps the forward's node alive"
    assert grads[0].grad_fn is not None        # while that graph itself is still held


def test_the_first_backward_keeps_o_and_lse_attached_for_forward_mode():
    """Under forward-mode AD the first backward's tangent needs those of o and lse."""
    import torch.autograd.forward_ad as fwAD
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    with fwAD.dual_level():
        o = bob_compile.attention(fwAD.make_dual(q, torch.randn_like(q)), k, v)
        dq, _, _ = torch.autograd.grad(o.sum(), (q, k, v), create_graph=True)
        assert _first_backward_inputs(dq) == ["AttnFnBackward", "AttnFnBackward"]


def test_a_torch_function_mode_sees_the_op(op_calls):
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    with PassThrough():
        bob_compile.attention(q, k, v)
    assert op_calls == ["attn_fwd"]


def test_traced_graphs_hold_the_ops():
    from torch.fx.experimental.proxy_tensor import make_fx
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))

    def step(q, k, v):
        o = bob_compile.attention(q, k, v, is_causal=True)
        return torch.autograd.grad(o.sum(), (q, k, v), create_graph=True)
    graph = make_fx(step, tracing_mode="fake")(q, k, v).graph
    targets = {str(n.target) for n in graph.nodes}
    assert {"bob_compile.attn_fwd.default", "bob_compile.attn_bwd.default"} <= targets


def test_vmap_and_subclasses_take_the_op(op_calls):
    """(Under torch.func.grad alone the forward runs below the transform on plain tensors,
    where nothing can see the op: either path is right there.)"""
    q, k, v = (torch.randn(3, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    batched = torch.func.vmap(lambda a, b, c: bob_compile.attention(a, b, c))(q, k, v)
    assert op_calls == ["attn_fwd"]
    assert torch.equal(batched, bob_compile.attention(q, k, v))

    class Sub(torch.Tensor):
        pass
    bob_compile.attention(q.as_subclass(Sub), k, v)
    assert op_calls == ["attn_fwd", "attn_fwd"]


def test_no_graph_is_recorded_where_none_is_needed():
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    assert bob_compile.attention(q, k, v).grad_fn is None
    q.requires_grad_()
    with torch.no_grad():
        assert bob_compile.attention(q, k, v).grad_fn is None
    o = bob_compile.attention(q, k, v)
    assert o.requires_grad and type(o.grad_fn).__name__ == "AttnFnBackward"


def test_calls_nothing_differentiates_skip_the_lse(monkeypatch):
    """Without grad the implementation's forward_output runs (PyTorch's fused forward then
    computes no lse); wherever a graph may be needed, the full forward."""
    from bob_compile.kernels import blockwise
    ran = []
    for name in ("forward", "forward_output"):
        real = getattr(blockwise, name)
        monkeypatch.setattr(blockwise, name,
                            lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    plain = bob_compile.attention(q, k, v, is_causal=True)
    q.requires_grad_()
    with torch.no_grad():
        no_grad = bob_compile.attention(q, k, v, is_causal=True)
    assert ran == ["forward_output", "forward", "forward_output", "forward"]
    ran.clear()
    with_graph = bob_compile.attention(q, k, v, is_causal=True)
    with PassThrough():
        bob_compile.attention(q.detach(), k, v, is_causal=True)   # through the op
    assert ran == ["forward", "forward"]
    assert torch.equal(plain, no_grad) and torch.equal(plain, with_graph)


def test_forward_mode_ad_still_gets_its_tangents():
    import torch.autograd.forward_ad as fwAD
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    t = torch.randn_like(q)
    with fwAD.dual_level():
        o = bob_compile.attention(fwAD.make_dual(q, t), k, v)
        tangent = fwAD.unpack_dual(o).tangent
    eps = 1e-6
    numeric = (bob_compile.attention(q + eps * t, k, v)
               - bob_compile.attention(q - eps * t, k, v)) / (2 * eps)
    assert tangent is not None and torch.allclose(tangent, numeric, atol=1e-7)


def test_function_forwards_take_every_argument_positionally():
    """_Fused.apply passes its arguments on unbound (Function.apply would bind them with
    inspect.signature, defaults filled in): a forward with a default or a keyword-only
    parameter would get too few arguments."""
    import inspect
    functions = [f for f in vars(autograd).values()
                 if isinstance(f, type) and issubclass(f, autograd._Fused) and f is not autograd._Fused]
    assert len(functions) == len(OPS)
    for function in functions:
        for parameter in inspect.signature(function.forward).parameters.values():
            assert parameter.kind is parameter.POSITIONAL_OR_KEYWORD, (function, parameter)
            assert parameter.default is parameter.empty, (function, parameter)


def test_torch_func_calls_skip_the_signature_binding(monkeypatch):
    """Under torch.func the Functions go to functorch's custom_function_call without
    Function.apply's per-call inspect.signature (four per forward-over-reverse step)."""
    import inspect
    bound = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda f, *a, **k: bound.append(f) or real(f, *a, **k))
    q, k, v, do, t = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(5))

    def loss(q, k, v):
        return (bob_compile.attention(q, k, v, is_causal=True) * do).sum()
    _, hvp = torch.func.jvp(torch.func.grad(loss), (q, k, v), (t, t, t))
    forwards = [f for f in bound if getattr(f, "__qualname__", "").endswith(".forward")]
    if _compat.FUNCTION_APPLY_BINDS_IN_C:
        # torch 2.14 binds inside the C apply: the signature is preset, never parsed per call
        assert forwards and all("__signature__" in vars(f) for f in forwards)
    else:
        assert not forwards
    assert torch.isfinite(hvp).all()


def test_jvp_rules_skip_the_jvp_level(monkeypatch):
    """Forward over reverse: the forward-mode ops called from the jvp rules (which run with
    forward gradients off at the jvp level) go below that level without functorch's
    per-level Function; only the user-facing Functions (forward, first backward) pass
    through custom_function_call. The product stays exact, and so does reverse over
    forward, where a grad level below the jvp level still records the tangent ops."""
    through = []
    real = autograd.custom_function_call
    monkeypatch.setattr(autograd, "custom_function_call",
                        lambda cls, *args: through.append(cls.__name__) or real(cls, *args))
    q, k, v, do, tq, tk, tv = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(7))

    def loss(attention):
        return lambda q, k, v: (attention(q, k, v, is_causal=True) * do).sum()

    ours = torch.func.jvp(torch.func.grad(loss(bob_compile.attention), argnums=(0, 1, 2)),
                          (q, k, v), (tq, tk, tv))
    assert "AttnFwdJvpFn" not in through and "AttnBwdJvpFn" not in through
    assert {"AttnFn", "AttnBwdFn"} <= set(through)
    exact = torch.func.jvp(torch.func.grad(loss(sdpa_math), argnums=(0, 1, 2)), (q, k, v),
                           (tq, tk, tv))
    torch.testing.assert_close(ours, exact)

    def grad_of_jvp(attention):
        return torch.func.grad(lambda q: torch.func.jvp(
            lambda q: loss(attention)(q, k, v), (q,), (tq,))[1].sin())(q)
    torch.testing.assert_close(grad_of_jvp(bob_compile.attention), grad_of_jvp(sdpa_math))


def test_profiler_names_the_ops():
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    with torch.profiler.profile() as prof:
        o = bob_compile.attention(q, k, v)
        torch.autograd.grad(o.sum(), (q, k, v))
    names = {e.key for e in prof.key_averages()}
    assert {"bob_compile::attn_fwd", "bob_compile::attn_bwd"} <= names


def test_only_plain_eager_calls_keep_their_mask_summary(monkeypatch):
    """AttentionParams.keep_mask_summary (triton_masks.py, "One summary per forward"): the
    calls the autograd Functions make directly may keep a mask's summary for their
    backwards; calls through the op (compiled graphs, whose memory a CUDA graph's pool may
    own; modes; torch.func) never do."""
    from bob_compile import kernels
    from bob_compile.kernels import blockwise
    kept = []

    def recording(name):
        def run(*args):
            kept.append((name, args[-1].keep_mask_summary))
            return getattr(blockwise, name)(*args)
        return run
    recorder = types.SimpleNamespace(**{name: recording(name) for name in (
        "forward", "forward_output", "backward", "bob", "bob_folded", "forward_jvp",
        "backward_jvp")})
    monkeypatch.setattr(kernels, "select", lambda q, k, v: recorder)
    q, k, v, do = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
                   for _ in range(4))
    mask = torch.rand(5, 5) > 0.3

    def second_order():
        o = bob_compile.attention(q, k, v, mask)
        grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        return torch.autograd.grad(grads, (q, k, v, do), [torch.ones_like(g) for g in grads])
    expected = second_order()
    assert [name for name, _ in kept] == ["forward", "backward", "bob_folded"]
    assert all(keep for _, keep in kept)
    kept.clear()
    with OpLog():                       # through the dispatcher: nothing kept
        actual = second_order()
    assert len(kept) == 3 and not any(keep for _, keep in kept)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
    kept.clear()
    bob_compile.attention(q, k, v)      # without a mask there is nothing to keep
    assert kept == [("forward", False)]
