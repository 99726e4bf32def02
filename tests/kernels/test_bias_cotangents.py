"""An additive mask's cotangents (a learned bias): backward_bias and bob_folded_bias of the
reference and blockwise implementations against autograd through math attention with the
bias as an input, in float64. The mask reaches the kernels as (B, Hq, L, S) with its
broadcast dims at stride 0 (ops.flat_mask); its cotangents come back summed over them."""
import pytest
import torch

from bob_compile.kernels import blockwise, dropout, reference
from bob_compile.kernels.params import AttentionParams

F64 = dict(dtype=torch.float64)
# (B, Hq, Hkv, L, S, bias shape, causal, dropout_p)
CASES = [
    pytest.param(2, 3, 3, 9, 11, (2, 3, 9, 11), False, 0.0, id="full-bias"),
    pytest.param(2, 4, 2, 10, 10, (1, 4, 10, 10), True, 0.0, id="per-head-causal-gqa"),
    pytest.param(2, 2, 2, 7, 13, (1, 1, 7, 13), False, 0.3, id="shared-dropout"),
    pytest.param(1, 2, 1, 8, 5, (1, 2, 8, 1), True, 0.0, id="per-row-causal"),
]


def implementations():
    yield "reference", reference, None
    for tile in ((3, 4), (256, 256)):
        yield f"blockwise{tile}", blockwise, tile


@pytest.mark.parametrize("B,Hq,Hkv,L,S,bias_shape,causal,p", CASES)
def test_bias_cotangents_match_autograd_through_math(B, Hq, Hkv, L, S, bias_shape, causal, p):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, L, 8, generator=g, **F64)
    k, v = (torch.randn(B, Hkv, S, 8, generator=g, **F64) for _ in range(2))
    bias = torch.randn(*bias_shape, generator=g, **F64)
    do = torch.randn(B, Hq, L, 8, generator=g, **F64)
    gdq, gdk, gdv = (torch.randn(t.shape, generator=g, **F64) for t in (q, k, v))
    gdbias = torch.randn(bias.shape, generator=g, **F64)
    params = AttentionParams(scale=0.35, causal=causal, mask=bias.expand(B, Hq, L, S),
                             dropout_p=p, dropout_seed=torch.tensor(77) if p else None)
    z = dropout.keep_scale(params, (B, Hq, L, S), slice(0, L), slice(0, S), torch.float64, "cpu")

    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, do)]
    with torch.enable_grad():
        o = reference.sdpa_math(*leaves[:3], attn_mask=leaves[3], is_causal=causal, scale=0.35,
                                enable_gqa=Hq != Hkv, dropout_scale=z)
        first = torch.autograd.grad(o, leaves[:4], leaves[4], create_graph=True)
        second = torch.autograd.grad(first, leaves, (gdq, gdk, gdv, gdbias))
    o, lse = reference.forward(q, k, v, params)
    for name, impl, tile in implementations():
        with blockwise.tiles(*tile) if tile else torch.no_grad():
            got_first = impl.backward_bias(q, k, v, o, lse, do, None, params)
            got_second = impl.bob_folded_bias(q, k, v, o, lse, do, None, gdq, gdk, gdv, gdbias,
                                              None, params)
        for what, a, e in zip(("dq", "dk", "dv", "dbias"), got_first, first, strict=True):
            torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-9, msg=f"{name} {what}")
        gq, gk, gv, gdo, _, gbias = got_second
        for what, a, e in zip(("gq", "gk", "gv", "gbias", "gdo"), (gq, gk, gv, gbias, gdo),
                              second, strict=True):
            torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-9, msg=f"{name} {what}")


def test_without_a_bias_cotangent_the_folded_outputs_are_bob_folded_s():
    """gdmask None: the same five outputs as bob_folded (F gains nothing)."""
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 2, 6, 4, generator=g, **F64) for _ in range(4))
    bias = torch.randn(1, 1, 6, 6, generator=g, **F64)
    params = AttentionParams(scale=0.5, causal=True, mask=bias.expand(1, 2, 6, 6))
    o, lse = reference.forward(q, k, v, params)
    cot = [torch.randn(t.shape, generator=g, **F64) for t in (q, k, v)]
    with blockwise.tiles(4, 4):
        got = blockwise.bob_folded_bias(q, k, v, o, lse, do, None, *cot, None, None, params)
        want = blockwise.bob_folded(q, k, v, o, lse, do, None, *cot, None, params)
    for a, e in zip(got[:5], want, strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-10)
    assert got[5].shape == (1, 1, 6, 6)
