"""The custom ops as ops: schema, fake implementations (strides included), AOT dispatch,
vmap rules; gradcheck/gradgradcheck of the public function; gradcheck of the first
backward over all seven of its tensor inputs in the chain form (which proves attn_bob
independently of the forward chain), and over q, k, v, do, dlse with o and lse the
forward's in the folded form (attn_bob_folded)."""
import pytest
import torch

import bob_compile
from bob_compile.autograd import AttnBwdFn, AttnFn
from bob_compile import kernels
from bob_compile.kernels import settings

op = torch.ops.bob_compile


def permuted(b, h, n, e):
    """(B, H, N, E) seen through a transpose of (B, N, H, E): not contiguous."""
    return torch.randn(b, n, h, e, dtype=torch.float64).transpose(1, 2)


def first_order_state(causal, gqa=False):
    hkv = 1 if gqa else 3
    q, k, v = permuted(2, 3, 5, 4), permuted(2, hkv, 6, 4), permuted(2, hkv, 6, 2)
    o, lse = op.attn_fwd(q, k, v, None, 0.5, causal)
    do = permuted(2, 3, 5, 2)
    return q, k, v, o, lse, do


CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
GQA = pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])


def make_mask(kind):
    """None, or a (B, 1, L, S) mask for first_order_state's shapes, broadcast over heads."""
    g = torch.Generator().manual_seed(1)
    if kind is None:
        return None
    visible = torch.rand(2, 1, 5, 6, generator=g) > 0.3
    if kind == "bool":
        return visible
    return torch.randn(2, 1, 5, 6, generator=g, dtype=torch.float64).masked_fill(~visible, -torch.inf)


@pytest.mark.sweep
@CAUSAL
@GQA
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_opcheck_every_op_with_permuted_inputs(causal, gqa, mask_kind):
    """opcheck compares fake and real outputs (strides too) on non-contiguous inputs."""
    mask = make_mask(mask_kind)
    q, k, v, o, lse, do = first_order_state(causal, gqa)
    dlse = torch.randn_like(lse)
    g = [torch.randn_like(t) for t in (q, k, v)]
    t = [torch.randn_like(x) for x in (q, k, v, o, lse, do, dlse)]
    calls = [
        (op.attn_fwd, (q, k, v, mask, 0.5, causal)),
        (op.attn_bwd, (q, k, v, o, lse, do, None, mask, 0.5, causal)),
        (op.attn_bwd, (q, k, v, o, lse, do, dlse, mask, 0.5, causal)),
        (op.attn_bob, (q, k, v, o, lse, do, dlse, *g, mask, 0.5, causal)),
        (op.attn_bob, (q, k, v, o, lse, do, None, None, g[1], None, mask, 0.5, causal)),
        (op.attn_bob_folded, (q, k, v, o, lse, do, dlse, *g, None, mask, 0.5, causal)),
        (op.attn_bob_folded, (q, k, v, o, lse, do, None, g[0], None, g[2], None, mask, 0.5,
                              causal)),
        (op.attn_bob_folded, (q, k, v, o, lse, do, dlse, *g,
                              op.attn_bwd(q, k, v, o, lse, do, dlse, mask, 0.5, causal)[0],
                              mask, 0.5, causal)),
        (op.attn_fwd_jvp, (q, k, v, o, lse, *t[:3], mask, 0.5, causal)),
        (op.attn_bwd_jvp, (q, k, v, o, lse, do, dlse, *t, mask, 0.5, causal)),
        (op.attn_bwd_jvp, (q, k, v, o, lse, do, None, None, t[1], None, None, t[4], None, None,
                           mask, 0.5, causal)),
    ]
    if mask_kind == "additive":     # a learned bias: the derivatives take the mask as an input
        gmask = torch.randn_like(mask)
        calls += [
            (op.attn_bwd_bias, (q, k, v, o, lse, do, dlse, mask, 0.5, causal)),
            (op.attn_bob_folded_bias, (q, k, v, o, lse, do, dlse, *g, gmask, mask, 0.5,
                                       causal)),
            (op.attn_bob_folded_bias, (q, k, v, o, lse, do, None, g[0], None, None, None,
                                       mask, 0.5, causal)),
        ]
    for fn, args in calls:
        result = torch.library.opcheck(fn, args)
        assert set(result.values()) == {"SUCCESS"}, (fn, result)


def _dim_order(t):
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


@pytest.mark.parametrize("make", [permuted, lambda *shape: torch.randn(*shape, dtype=torch.float64)],
                         ids=["permuted", "contiguous"])
def test_outputs_are_dense_in_the_order_of_their_input_fake_and_real(make):
    """o and the cotangents keep the memory order of q/k/v/o/do (so that the transpose
    after attention and the gradient into it cost no copy), rows are contiguous, and the
    fake implementations say exactly that."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v, do = make(2, 3, 5, 4), make(2, 3, 6, 4), make(2, 3, 6, 2), make(2, 3, 5, 2)
    o, lse = op.attn_fwd(q, k, v, None, 0.5, True)
    g = (make(2, 3, 5, 4), make(2, 3, 6, 4), make(2, 3, 6, 2))
    calls = [(op.attn_fwd, (q, k, v, None, 0.5, True), (q, None)),
             (op.attn_bwd, (q, k, v, o, lse, do, None, None, 0.5, True), (q, k, v)),
             (op.attn_bob, (q, k, v, o, lse, do, lse, *g, None, 0.5, True),
              (q, k, v, o, None, do, None))]
    for fn, args, likes in calls:
        real = fn(*args)
        with FakeTensorMode() as mode:
            fake = fn(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        for r, f, like in zip(real, fake, likes, strict=True):
            assert f.stride() == r.stride() and f.dtype == r.dtype, fn
            assert r.untyped_storage().nbytes() == r.numel() * r.element_size(), fn  # dense
            if like is None:
                assert r.is_contiguous(), fn
            else:
                assert _dim_order(r) == _dim_order(like), fn
    assert o.transpose(1, 2).is_contiguous() == q.transpose(1, 2).is_contiguous()


def test_raw_op_has_no_autograd_and_says_so():
    """Autograd lives in bob_compile.autograd; differentiating the bare op is a clear error."""
    q, k, v = (torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True) for _ in range(3))
    o, _ = op.attn_fwd(q, k, v, None, 1.0, False)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        o.sum().backward()


@CAUSAL
@GQA
def test_gradcheck_and_gradgradcheck(causal, gqa):
    hkv = 1 if gqa else 2
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, hkv, 7, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, hkv, 7, 2, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v):
        return bob_compile.attention(q, k, v, is_causal=causal, scale=0.6, enable_gqa=gqa)
    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))


@pytest.mark.sweep
@CAUSAL
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_gradcheck_first_backward_over_all_seven_inputs(monkeypatch, causal, mask_kind):
    """In the chain form, attn_bob is the VJP of attn_bwd w.r.t. q, k, v, o, lse, do and
    dlse."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_FORM", "chain")
    settings.reload()
    mask = make_mask(mask_kind)
    q, k, v, = first_order_state(causal, gqa=True)[:3]
    o, lse = op.attn_fwd(q, k, v, mask, 0.5, causal)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, o, lse, do, dlse)]
    assert torch.autograd.gradcheck(
        lambda *a: AttnBwdFn.apply(*a, mask, 0.5, causal, 0.0, None, 0.0), inputs)


@pytest.mark.sweep
@CAUSAL
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_gradcheck_first_backward_through_the_forward_folded(causal, mask_kind):
    """In the folded form (the default), attn_bob_folded is the VJP of attn_bwd w.r.t. q, k,
    v, do and dlse where o and lse are attn_fwd(q, k, v)'s, as AttnFn.backward calls it."""
    mask = make_mask(mask_kind)
    q, k, v, o, lse, _ = first_order_state(causal, gqa=True)
    assert kernels.fold_bob(q, k, v)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, do, dlse)]

    def first_backward(q, k, v, do, dlse):
        o, lse = AttnFn.apply(q, k, v, mask, 0.5, causal, 0.0, None, 0.0)
        return AttnBwdFn.apply(q, k, v, o, lse, do, dlse, mask, 0.5, causal, 0.0, None, 0.0)
    assert torch.autograd.gradcheck(first_backward, inputs)


@pytest.mark.parametrize("form,schedule,folds", [
    ("auto", "two_pass", True), ("folded", "two_pass", True), ("chain", "two_pass", False),
    ("auto", "atomic", False), ("folded", "atomic", False)])
def test_which_form_the_second_order_takes(monkeypatch, form, schedule, folds):
    """BOB_COMPILE_DEV_BOB_FORM decides; auto folds on the blockwise path, and on the Triton
    kernels up to head dim 128 (where folding was measured faster); the atomic BoB schedule
    exists in the chain form only."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_FORM", form)
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_SCHEDULE", schedule)
    settings.reload()
    q = torch.randn(1, 2, 3, 128)
    assert kernels.fold_bob(q, q, q) is folds


def test_triton_kernels_fold_up_to_head_dim_128():
    triton_attention = pytest.importorskip("bob_compile.kernels.triton_attention")
    meta = lambda d: torch.empty(1, 1, 8, d, device="meta")  # noqa: E731
    assert triton_attention.folded_bob_pays(meta(64), meta(64))
    assert triton_attention.folded_bob_pays(meta(32), meta(48))
    assert triton_attention.folded_bob_pays(meta(128), meta(128))
    assert triton_attention.folded_bob_pays(meta(64), meta(128))
    assert not triton_attention.folded_bob_pays(meta(256), meta(256))
    assert not triton_attention.folded_bob_pays(meta(128), meta(160))


def test_first_order_keeps_lse_cotangent_none():
    """Ordinary training passes dlse=None (no zero tensor is allocated for it)."""
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is op.attn_bwd.default:
                seen.append(args[6])
            return func(*args, **(kwargs or {}))
    q, k, v = (torch.randn(1, 1, 4, 2, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with Spy():
        o, _ = AttnFn.apply(q, k, v, None, 1.0, True, 0.0, None, 0.0)
        o.sum().backward()
    assert seen == [None]
