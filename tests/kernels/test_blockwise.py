"""The blockwise PyTorch path against the closed-form reference, over random shapes, tile
sizes and the optional (None) cotangents and tangents; and its precision in low precision."""
import torch
from hypothesis import given, settings, strategies as st

from bob_compile.kernels import blockwise, reference
from bob_compile.kernels.params import AttentionParams


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@st.composite
def problems(draw):
    hkv = draw(st.integers(1, 2))
    return dict(
        B=draw(st.integers(1, 2)), Hkv=hkv, H=hkv * draw(st.integers(1, 3)),
        L=draw(st.integers(1, 13)), S=draw(st.integers(0, 13)),
        E=draw(st.integers(1, 6)), Ev=draw(st.integers(1, 6)),
        causal=draw(st.booleans()), scale=draw(st.floats(0.1, 2.0)),
        tiles=(draw(st.integers(1, 7)), draw(st.integers(1, 7))),
        present=draw(st.lists(st.booleans(), min_size=7, max_size=7)),
        dropout_p=draw(st.sampled_from([0.0, 0.0, 0.3, 0.9])),
    )


@settings(max_examples=60, deadline=None)
@given(problems())
def test_every_function_matches_reference(p):
    f64 = dict(dtype=torch.float64)
    q = torch.randn(p["B"], p["H"], p["L"], p["E"], **f64)
    k = torch.randn(p["B"], p["Hkv"], p["S"], p["E"], **f64)
    v = torch.randn(p["B"], p["Hkv"], p["S"], p["Ev"], **f64)
    params = AttentionParams(scale=p["scale"], causal=p["causal"], dropout_p=p["dropout_p"],
                             dropout_seed=torch.tensor(12345))
    o, lse = reference.forward(q, k, v, params)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    cot = [t if keep else None for t, keep in
           zip((torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)), p["present"])]
    tan = [t if keep else None for t, keep in
           zip([torch.randn_like(x) for x in (q, k, v, o, lse, do, dlse)], p["present"])]
    calls = [
        ("forward", (q, k, v, params)),
        ("backward", (q, k, v, o, lse, do, dlse if p["present"][3] else None, params)),
        ("bob", (q, k, v, o, lse, do, dlse, *cot, params)),
        ("bob_folded", (q, k, v, o, lse, do, dlse, *cot, None, params)),
        # R read from the first backward's dq (what autograd passes) instead of recomputed
        ("bob_folded", (q, k, v, o, lse, do, dlse, *cot,
                        reference.backward(q, k, v, o, lse, do, dlse, params)[0], params)),
        ("forward_jvp", (q, k, v, o, lse, *tan[:3], params)),
        ("backward_jvp", (q, k, v, o, lse, do, dlse, *tan, params)),
    ]
    with blockwise.tiles(*p["tiles"]):
        for name, args in calls:
            ours, ref = getattr(blockwise, name)(*args), getattr(reference, name)(*args)
            for a, b in zip(ours, ref):
                assert a.dtype == b.dtype, name
                torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=name)   # NaN fails


def test_rows_that_see_no_key_are_zero_not_nan():
    q, k, v = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 0, 3), torch.randn(1, 2, 0, 5)
    params = AttentionParams(scale=0.5, causal=True)
    o, lse = blockwise.forward(q, k, v, params)
    assert torch.equal(o, torch.zeros(1, 2, 4, 5)) and torch.isneginf(lse).all()
    outs = blockwise.bob(q, k, v, o, lse, torch.randn_like(o), None, torch.randn_like(q),
                         torch.randn_like(k), torch.randn_like(v), params)
    assert all(not torch.isnan(t).any() for t in outs)
    assert torch.equal(outs[0], torch.zeros_like(q))


def test_half_precision_accumulates_in_float32():
    """fp16 inputs: every output within a few fp16 ulps of the float64 answer."""
    with blockwise.tiles(16, 16):
        q, k, v = (torch.randn(1, 2, 37, 16).half() for _ in range(3))
        params = AttentionParams(scale=0.25, causal=True)
        o, lse = blockwise.forward(q, k, v, params)
        ref_o, ref_lse = reference.forward(q.double(), k.double(), v.double(), params)
        assert o.dtype == torch.float16 and lse.dtype == torch.float32
        assert rel_err(o, ref_o) < 2e-3 and rel_err(lse, ref_lse) < 1e-6
        do = torch.randn_like(o)
        g = [torch.randn_like(t) for t in (q, k, v)]
        ours = blockwise.bob(q, k, v, o, lse, do, None, *g, params)
        ref = reference.bob(*(t.double() for t in (q, k, v, o, lse, do)), None,
                            *(t.double() for t in g), params)
        for a, b in zip(ours, ref):
            assert rel_err(a, b) < 5e-3
