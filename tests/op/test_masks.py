"""attn_mask: the public op's checks and semantics, vmap over masks, SDPA sites with masks
in compiled code (replaced, or kept where they must be), in float64 against plain math.
Every derivative order with masks is in test_op_derivatives.py (its mask cases); HF
models with padding in test_hf_masks.py."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import bob_compile
from bob_compile.backend import flashbob, recent_reports
from bob_compile.kernels import blockwise
from bob_compile.kernels.params import HIDDEN_AT_OR_BELOW
from bob_compile.kernels.reference import sdpa_math

FAST = {"compiler": "aot_eager", "fallback": False}


def qkv(b=2, h=2, L=5, S=6, e=4, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, n, e, generator=g, dtype=torch.float64, requires_grad=requires_grad)
            for n in (L, S, S)]


# ---------------------------------------------------------------------------- checks
@pytest.mark.parametrize("mask,error,match", [
    (torch.ones(5, 6, dtype=torch.long), RuntimeError, "bool .* or floating"),
    (torch.ones(4, 6, dtype=torch.bool), RuntimeError, "does not broadcast"),
    (torch.ones(3, 1, 5, 6, dtype=torch.bool), RuntimeError, "does not broadcast"),
    (torch.ones(1, 2, 2, 5, 6, dtype=torch.bool), RuntimeError, "does not broadcast"),  # more dims
    (torch.ones(2, 2, 5, 1, dtype=torch.bool), None, None),   # broadcasts: accepted
    (torch.ones(6, dtype=torch.bool), None, None),
    ("causal", TypeError, "must be a Tensor"),
])
def test_mask_checks_accept_broadcasts_and_errors_say_what_to_do(mask, error, match):
    q, k, v = qkv()
    if error is None:
        expected = sdpa_math(q, k, v, attn_mask=mask)
        torch.testing.assert_close(bob_compile.attention(q, k, v, attn_mask=mask), expected,
                                   atol=1e-12, rtol=0)
        return
    with pytest.raises(error, match=match):
        bob_compile.attention(q, k, v, attn_mask=mask)


def test_mask_and_is_causal_combine():
    q, k, v = qkv(L=6)
    mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    expected = sdpa_math(q, k, v, attn_mask=mask & torch.ones(6, 6, dtype=torch.bool).tril())
    torch.testing.assert_close(bob_compile.attention(q, k, v, attn_mask=mask, is_causal=True),
                               expected, atol=1e-12, rtol=0)


def test_finite_fills_hide_keys_and_empty_rows_are_zeros():
    """HF eager's finfo.min fill hides keys as -inf does; a row it fills entirely sees no
    key (zeros, as SDPA gives an empty row), at every order (not the uniform average that
    plain softmax's rounding produces, which no lse-based kernel can differentiate)."""
    q, k, v = qkv(requires_grad=True)
    fill = torch.zeros(5, 6, dtype=torch.float64)
    fill[1] = torch.finfo(torch.float64).min
    fill[2, 3:] = HIDDEN_AT_OR_BELOW
    as_bool = fill > HIDDEN_AT_OR_BELOW
    o = bob_compile.attention(q, k, v, attn_mask=fill)
    torch.testing.assert_close(o, bob_compile.attention(q, k, v, attn_mask=as_bool), atol=0, rtol=0)
    assert o[:, :, 1].abs().max() == 0
    (gq,) = torch.autograd.grad(o.sin().sum(), q, create_graph=True)
    (ggq,) = torch.autograd.grad(gq.square().sum(), q)
    assert gq[:, :, 1].abs().max() == 0 and ggq[:, :, 1].abs().max() == 0


def test_vmap_over_masks():
    q, k, v = qkv()
    masks = torch.rand(3, 2, 1, 5, 6, generator=torch.Generator().manual_seed(2)) > 0.4
    ours = torch.func.vmap(lambda m: bob_compile.attention(q, k, v, attn_mask=m))(masks)
    torch.testing.assert_close(ours, torch.stack([sdpa_math(q, k, v, attn_mask=m) for m in masks]),
                               atol=1e-12, rtol=0)
    both = torch.func.vmap(lambda q, m: bob_compile.attention(q, k, v, attn_mask=m))(
        torch.stack([q, 2 * q, -q]), masks)
    torch.testing.assert_close(both[1], sdpa_math(2 * q, k, v, attn_mask=masks[1]), atol=1e-12, rtol=0)


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 9), S=st.integers(1, 9), kind=st.sampled_from(["bool", "additive"]),
       broadcast=st.sampled_from(["full", "batch", "keys", "rows_keys"]), causal=st.booleans())
def test_masks_of_any_shape_at_second_order(L, S, kind, broadcast, causal):
    q, k, v = qkv(L=L, S=S, requires_grad=True)
    shape = {"full": (2, 2, L, S), "batch": (2, 1, L, S), "keys": (2, 1, 1, S),
             "rows_keys": (L, S)}[broadcast]
    g = torch.Generator().manual_seed(L * 10 + S)
    visible = torch.rand(shape, generator=g) > 0.3
    mask = visible if kind == "bool" else torch.randn(shape, generator=g, dtype=torch.float64
                                                      ).masked_fill(~visible, -torch.inf)

    def second_order(attn):
        o = attn(q, k, v, attn_mask=mask, is_causal=causal)
        grads = torch.autograd.grad(o.sin().sum(), (q, k, v), create_graph=True)
        return (o, *torch.autograd.grad(sum(x.square().sum() for x in grads), (q, k, v)))
    with blockwise.tiles(4, 4):     # lengths cross tile borders
        ours = second_order(bob_compile.attention)
    for a, b in zip(ours, second_order(sdpa_math)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


# ---------------------------------------------------------------------------- compiled SDPA sites
needs_fresh_dynamo = pytest.mark.usefixtures("fresh_dynamo")


def padded_attention(q, k, v, lengths):
    """An SDPA call with a key-padding mask built in the graph (BERT-style)."""
    keep = torch.arange(k.shape[-2]) < lengths[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


@needs_fresh_dynamo
def test_sdpa_with_a_padding_mask_is_replaced_and_exact_at_second_order():
    q, k, v = qkv(requires_grad=True)
    lengths = torch.tensor([6, 2])

    def hvp(fn):
        o = fn(q, k, v, lengths)
        grads = torch.autograd.grad(o.sin().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(sum(x.square().sum() for x in grads), (q, k, v))
    compiled = torch.compile(padded_attention, backend=flashbob, options=FAST)
    expected = hvp(lambda q, k, v, n: sdpa_math(
        q, k, v, attn_mask=(torch.arange(6) < n[:, None])[:, None, None, :]))
    for a, b in zip(hvp(compiled), expected):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    (site,) = recent_reports[-1].sites
    assert site.replaced and "mask=attn_mask" in site.line()


@needs_fresh_dynamo
def test_sdpa_with_a_learned_bias_is_replaced_and_differentiated():
    """A mask that requires grad (a learned bias) is passed on: the HVP w.r.t. the query and
    the bias equals eager math's."""
    q, k, v = qkv(requires_grad=True)
    bias = (0.3 * torch.randn(5, 6, dtype=torch.float64)).requires_grad_()

    def biased(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def hvp(f):
        grads = torch.autograd.grad((f(q, k, v, bias) ** 2).sum(), (q, bias), create_graph=True)
        return torch.autograd.grad(grads, (q, bias), [torch.ones_like(g) for g in grads])
    compiled = torch.compile(biased, backend=flashbob, options=FAST)
    for a, b in zip(hvp(compiled), hvp(lambda *a: sdpa_math(*a[:3], attn_mask=a[3])),
                    strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    (site,) = recent_reports[-1].sites
    assert site.replaced and "mask=attn_mask" in site.line()


@needs_fresh_dynamo
def test_a_learned_bias_holding_the_causal_pattern_is_not_proven_causal():
    """Must not become is_causal: a bias that requires grad, even one that holds 0 below
    the diagonal and -inf above it now, keeps its gradient (which is not zero below)."""
    q, k, v = qkv(L=5, S=5, requires_grad=True)
    bias = torch.zeros(5, 5, dtype=torch.float64).masked_fill(
        torch.ones(5, 5, dtype=torch.bool).triu(1), -torch.inf).requires_grad_()

    def biased(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out = torch.compile(biased, backend=flashbob, options=FAST)(q, k, v, bias)
    (gb,) = torch.autograd.grad((out ** 2).sum(), bias)
    (want,) = torch.autograd.grad((sdpa_math(q, k, v, attn_mask=bias) ** 2).sum(), bias)
    torch.testing.assert_close(gb, want, atol=1e-10, rtol=1e-9)
    assert gb.tril().abs().sum() > 0
    (site,) = recent_reports[-1].sites
    assert site.replaced and not site.is_causal and "learned bias" in site.mask
