"""The C++ autograd nodes on CUDA (bob_compile/eager/node.py): the same kernels as the op's
Python node, so the same results at every order (the same bits but where PyTorch's fused
backwards accumulate dq with atomics), with no Python in a first-order backward nor in a
folded create_graph backward, and the BoB launched from C++ once a program of its launches
was recorded. The nodes' plumbing at every order in float64: test_native_node.py."""
import pytest
import torch

import bob_compile
from bob_compile.eager.node import general_backward
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
        lambda *a: calls.append(a[5] is None) or general_backward(*a))
    try:
        name, ours = step(q, k, v, do, vs, causal, gqa)
    finally:
        cpp_node.set_general_backward(general_backward)
    assert name == "CppFunction"
    assert calls == []     # the create_graph backward is the second node (folded form)
    monkeypatch.setenv("BOB_COMPILE_CPP_NODE", "off")
    settings.reload()
    name, python_node = step(q, k, v, do, vs, causal, gqa)
    assert name != "CppFunction"
    for a, b in zip(ours[:2], python_node[:2]):        # o, without grad and with
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(ours, python_node, strict=True):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b)


def randn_like_views(g, *shapes, dtype):
    """Tensors of these (B, H, N, E) shapes as permuted views of (B, N, H, E) memory."""
    return [torch.randn(b, n, h, e, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
            for b, h, n, e in shapes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bob_from_programs(cpp_node, dtype, causal, gqa, head_dim):
    """The first BoB of a signature runs in Python and is recorded; the next ones launch the
    same kernels from C++ (B = P k for wide heads from the fused forward, as Python's): the
    same bits. Cotangents that specialize otherwise (misaligned) go back to Python, with the
    same results."""
    from bob_compile.eager import node as eager_node
    g = torch.Generator(device="cuda").manual_seed(1)
    kv = 2 if gqa else 4
    q, k, v, do = randn_like_views(g, (2, 4, 200, head_dim), (2, kv, 200, head_dim),
                                   (2, kv, 200, head_dim), (2, 4, 200, head_dim), dtype=dtype)
    q, k, v, do = (t.requires_grad_() for t in (q, k, v, do))
    o = bob_compile.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    g1 = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    assert type(g1[0].grad_fn).__name__ == "CppFunction"
    vs = [torch.randn(t.shape, device="cuda", dtype=dtype, generator=g) for t in g1]
    stages = []
    cpp_node.set_triton_stage(lambda *a: stages.append(a[-1]) or eager_node.run_triton_stage(*a))
    try:
        torch.autograd.grad(g1, (q, k, v, do), vs, retain_graph=True)    # compiles, tunes
        cpp_node.forget_programs()
        stages.clear()
        in_python = torch.autograd.grad(g1, (q, k, v, do), vs, retain_graph=True)
        assert stages == [True] and cpp_node.program_count() == 1
        from_program = torch.autograd.grad(g1, (q, k, v, do), vs, retain_graph=True)
        assert stages == [True]
        for a, b in zip(from_program, in_python, strict=True):
            assert a.stride() == b.stride()
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # a cotangent one element off 16-byte alignment: not the program's specialization
        misaligned = torch.empty(vs[0].numel() + 1, device="cuda", dtype=dtype)[1:]
        misaligned = misaligned.view(vs[0].shape).copy_(vs[0])
        again = torch.autograd.grad(g1, (q, k, v, do), [misaligned, *vs[1:]], retain_graph=True)
        assert len(stages) == 2
        for a, b in zip(again, in_python, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # only dk's cotangent: another signature (dq's and dv's GEMMs skipped), another program
        in_python = torch.autograd.grad(g1[1], (q, k, v, do), vs[1], retain_graph=True)
        torch.autograd.grad(g1[1], (q, k, v, do), vs[1], retain_graph=True)
        made = len(stages)
        from_program = torch.autograd.grad(g1[1], (q, k, v, do), vs[1])
        assert len(stages) == made and cpp_node.program_count() == 2
        for a, b in zip(from_program, in_python, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        cpp_node.set_triton_stage(eager_node.run_triton_stage)


def test_programs_are_forgotten_on_reload(cpp_node, reread_settings):
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, do = randn_like_views(g, *[(1, 2, 128, 64)] * 4, dtype=torch.bfloat16)
    q.requires_grad_()
    for _ in range(2):
        o = bob_compile.attention(q, k, v)
        (dq,) = torch.autograd.grad(o, q, do, create_graph=True)
        torch.autograd.grad(dq, q, torch.ones_like(dq))
    assert cpp_node.program_count() >= 1
    settings.reload()
    assert cpp_node.program_count() == 0


def python_lines(monkeypatch):
    """A list that grows by one for each bob_compile.attention call that runs its Python
    lines (not the C++ entry)."""
    import sys
    module = sys.modules["bob_compile.attention"]
    calls = []
    real = module._check_inputs
    monkeypatch.setattr(module, "_check_inputs", lambda *a: calls.append(1) or real(*a))
    return calls


def test_repeated_calls_take_the_cpp_entry(cpp_node, monkeypatch):
    """From its second call on, a signature's calls run from the C++ entry: the same kernels
    as attention()'s Python lines, so the same bits; with and without grad."""
    from bob_compile.eager import node as eager_node
    calls = python_lines(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = randn_like_views(g, *[(2, 4, 130, 64)] * 4, dtype=torch.bfloat16)
    q.requires_grad_()
    cpp_node.forget_routes()
    first = bob_compile.attention(q, k, v, is_causal=True)
    again = bob_compile.attention(q, k, v, is_causal=True)
    with torch.no_grad():
        without_grad = bob_compile.attention(q, k, v, is_causal=True)
    assert len(calls) == 1 and type(again.grad_fn).__name__ == "CppFunction"
    monkeypatch.setattr(eager_node, "fast_entry", None)
    python = bob_compile.attention(q, k, v, is_causal=True)
    assert len(calls) == 2
    for a in (again, without_grad, python):
        assert a.stride() == first.stride()
        torch.testing.assert_close(a, first, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(again, q, do)[0],
                               torch.autograd.grad(python, q, do)[0])


# ----------------------------------------------------------------------------- masked calls
def mask_of(kind, B, Hq, L, S, g, dtype):
    """(mask, is_causal) of one kind, as models pass them: key padding (HF's attention_mask
    as (B, 1, 1, S)) with is_causal, the same additive, HF's 4-D padding-and-causal mask,
    and a random 4-D pattern (read per tile)."""
    lengths = torch.tensor([S, S - 37, S // 2 + 5][:B], device="cuda")
    key = (torch.arange(S, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    if kind == "key padding":
        return key, True
    if kind == "additive":
        return torch.zeros(key.shape, device="cuda", dtype=dtype).masked_fill(
            ~key, torch.finfo(dtype).min), True
    if kind == "hf 4-d":
        return key & torch.ones(L, S, dtype=torch.bool, device="cuda").tril(), False
    return torch.rand(B, Hq, L, S, device="cuda", generator=g) > 0.3, False


def masked_step(q, k, v, do, vs, mask, causal, gqa):
    """As step() above, with a mask."""
    def attend(q, k, v):
        return bob_compile.attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    with torch.no_grad():
        without_grad = attend(q, k, v)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = attend(q, k, v)
    first = torch.autograd.grad(o, (q, k, v), do)
    o = attend(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    second = torch.autograd.grad(grads, (q, k, v), vs)
    return type(o.grad_fn).__name__, (without_grad, o, *first, *second)


@pytest.mark.parametrize("kind", ["key padding", "additive", "hf 4-d", "read per tile"])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_masked_calls_from_programs(cpp_node, monkeypatch, kind, gqa, head_dim):
    """A masked call's stages (forward with the mask's summary, first backward, folded BoB)
    run in the C++ nodes: by Python while a signature compiles and tunes, recorded once its
    launches are replayable, then from programs, with no Python: the same bits as the Python
    node, in the same layouts."""
    from bob_compile.eager import node as eager_node
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(4)
    kv = 2 if gqa else 4
    q, k, v, do = randn_like_views(g, (3, 4, 200, head_dim), (3, kv, 200, head_dim),
                                   (3, kv, 200, head_dim), (3, 4, 200, head_dim), dtype=dtype)
    vs = [torch.randn(t.shape, device="cuda", dtype=dtype, generator=g) for t in (q, k, v)]
    mask, causal = mask_of(kind, 3, 4, 200, 200, g, dtype)
    stages = []
    cpp_node.set_triton_stage(
        lambda *a: stages.append(a[0]) or eager_node.run_triton_stage(*a))
    try:
        for _ in range(3):      # compiles and tunes; records; replays
            masked_step(q, k, v, do, vs, mask, causal, gqa)
        stages.clear()
        name, ours = masked_step(q, k, v, do, vs, mask, causal, gqa)
    finally:
        cpp_node.set_triton_stage(eager_node.run_triton_stage)
    assert name == "CppFunction" and stages == [] and cpp_node.program_count() >= 3
    monkeypatch.setattr(eager_node, "masked_output", lambda *a: None)
    monkeypatch.setattr(eager_node, "fast_entry", None)
    name, python_node = masked_step(q, k, v, do, vs, mask, causal, gqa)
    assert name != "CppFunction"
    for a, b in zip(ours, python_node, strict=True):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_masked_calls_in_the_node_at_every_order(cpp_node, monkeypatch):
    """Through the C++ node, a masked call's third order (the BoB differentiated: Python's
    math twin) equals the Python node's, and a mask modified in place before the backward is
    refused, as autograd refuses it there."""
    from bob_compile.eager import node as eager_node
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = randn_like_views(g, *[(2, 2, 70, 32)] * 3, dtype=torch.float32)
    mask, _ = mask_of("key padding", 2, 2, 70, 70, g, torch.float32)

    def third_order():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = bob_compile.attention(qq, kk, vv, attn_mask=mask, is_causal=True)
        (dq,) = torch.autograd.grad(o.square().sum(), qq, create_graph=True)
        (gk,) = torch.autograd.grad(dq.square().sum(), kk, create_graph=True)
        return type(o.grad_fn).__name__, torch.autograd.grad(gk.sum(), (qq, kk, vv))

    name, ours = third_order()
    assert name == "CppFunction"
    monkeypatch.setattr(eager_node, "masked_output", lambda *a: None)
    monkeypatch.setattr(eager_node, "fast_entry", None)
    name, python_node = third_order()
    assert name != "CppFunction"
    for a, b in zip(ours, python_node, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    qq = q.detach().requires_grad_()
    changed = mask.clone()
    o = bob_compile.attention(qq, k, v, attn_mask=changed, is_causal=True)
    assert type(o.grad_fn).__name__ == "CppFunction"
    changed[0, 0, 0, 3] = False
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


def test_repeated_masked_calls_take_the_cpp_entry(cpp_node, monkeypatch):
    """From its second call on, a masked signature's calls (the mask's dtype, shape and
    strides included) run from the C++ entry: the same bits as attention()'s Python lines;
    a mask that requires grad (a learned bias) is left to the Python lines, which return its
    gradient."""
    calls = python_lines(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v, do = randn_like_views(g, *[(2, 4, 130, 64)] * 4, dtype=torch.bfloat16)
    q.requires_grad_()
    mask, _ = mask_of("key padding", 2, 4, 130, 130, g, torch.bfloat16)
    cpp_node.forget_routes()
    first = bob_compile.attention(q, k, v, attn_mask=mask, is_causal=True)
    again = bob_compile.attention(q, k, v, attn_mask=mask, is_causal=True)
    with torch.no_grad():
        without_grad = bob_compile.attention(q, k, v, attn_mask=mask, is_causal=True)
    assert len(calls) == 1 and type(again.grad_fn).__name__ == "CppFunction"
    other = bob_compile.attention(q, k, v, attn_mask=mask.expand(2, 1, 130, 130), is_causal=True)
    assert len(calls) == 2          # another mask shape: another route
    for a in (again, without_grad, other):
        torch.testing.assert_close(a, first, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(again, q, do)[0],
                               torch.autograd.grad(first, q, do)[0], rtol=0, atol=0)
    # a mask that requires grad is a learned bias: the C++ entry leaves it to the Python
    # lines, whose Function returns its cotangent (the closed form's, up to fp32 rounding)
    bias = mask.float().requires_grad_()
    learned = bob_compile.attention(q, k, v, attn_mask=bias, is_causal=True)
    assert len(calls) == 3 and type(learned.grad_fn).__name__ != "CppFunction"
    gq, gbias = torch.autograd.grad(learned, (q, bias), do)
    hidden = torch.ones(130, 130, dtype=torch.bool, device="cuda").triu(1)
    causal = torch.zeros(130, 130, dtype=torch.float64, device="cuda").masked_fill(
        hidden, float("-inf"))
    ref_bias, ref_q = (t.detach().double().requires_grad_() for t in (bias, q))
    ref = torch.nn.functional.scaled_dot_product_attention(ref_q, k.double(), v.double(),
                                                           attn_mask=ref_bias + causal)
    want_q, want_bias = torch.autograd.grad(ref, (ref_q, ref_bias), do.double())
    for got, want in ((gq, want_q), (gbias, want_bias)):
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2
