"""Soft-capped scores (params.softcap) in the blockwise path: every contract function
against reference.py's closed forms (themselves checked against autograd in
test_softcap_reference.py), in float64, with tiles small enough that odd lengths cross
their borders; and softcap=0 leaves every output bit for bit as it is without the field."""
import pytest
import torch

from bob_compile.kernels import blockwise, reference
from bob_compile.kernels.params import AttentionParams

F64 = dict(dtype=torch.float64)
SCALE = 0.41
TILES = (3, 4)      # odd lengths below end in partial tiles; causal ones cross the diagonal
CAPS = [0.7, 30.0]  # 0.7 bends the scores (a few units) hard, 30 barely


def randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, **F64) * scale


def mask_for(kind, g, B, Hq, L, S):
    """The (B, Hq, L, S) mask of a case (broadcast dims at stride 0), or None."""
    if kind == "bool":
        visible = torch.rand(L, S, generator=g) < 0.7
        visible[2] = False                       # a row that sees no key
        return visible.expand(B, Hq, L, S)
    if kind == "additive":
        additive = randn(g, 1, Hq, L, S)
        additive[..., 1, :3] = float("-inf")
        additive[..., 4, 5] = -1e9               # hidden too (params.HIDDEN_AT_OR_BELOW)
        return additive.expand(B, Hq, L, S)
    return None


# B, Hq, Hkv, L, S, E, Ev, causal, mask kind, dropout_p
CASES = [
    pytest.param(1, 2, 2, 11, 11, 8, 8, True, None, 0.0, id="causal"),
    pytest.param(2, 4, 2, 7, 13, 8, 5, False, None, 0.0, id="gqa-L<S-E!=Ev"),
    pytest.param(1, 4, 2, 13, 9, 6, 7, True, None, 0.0, id="causal-gqa-L>S"),
    pytest.param(1, 2, 1, 9, 10, 8, 8, True, "bool", 0.0, id="bool-mask-empty-row"),
    pytest.param(2, 2, 2, 10, 7, 8, 6, False, "additive", 0.0, id="additive-mask"),
    pytest.param(1, 4, 2, 11, 11, 8, 8, True, None, 0.2, id="causal-gqa-dropout"),
]


def problem(B, Hq, Hkv, L, S, E, Ev, causal, mask_kind, dropout_p, softcap, seed=0):
    """Inputs of scale ~1.5 (scores of a few units, which the cap bends), their params, the
    forward's o and lse, and three random tensors shaped like each of (q, k, v, o, lse)."""
    g = torch.Generator().manual_seed(seed)
    q, k = randn(g, B, Hq, L, E, scale=1.5), randn(g, B, Hkv, S, E, scale=1.5)
    v = randn(g, B, Hkv, S, Ev)
    params = AttentionParams(scale=SCALE, causal=causal, mask=mask_for(mask_kind, g, B, Hq, L, S),
                             dropout_p=dropout_p, dropout_seed=1234 if dropout_p else None,
                             softcap=softcap)
    o, lse = reference.forward(q, k, v, params)
    like = [tuple(randn(g, *t.shape) for _ in range(3)) for t in (q, k, v, o, lse)]
    return (q, k, v, o, lse), params, like


def contract_calls(primals, params, like):
    """(name, args) of every contract function but the bias ones, each with all its
    optional cotangents/tangents given, and again with some of them None."""
    q, k, v, o, lse = primals
    (gdq, tq, _), (gdk, tk, _), (gdv, tv, _), (do, to, tdo), (dlse, tlse, tdlse) = like
    dq = reference.backward(q, k, v, o, lse, do, dlse, params)[0]
    calls = [("forward", (q, k, v, params)), ("forward_output", (q, k, v, params))]
    for some in (lambda t: t, lambda t: None):      # all given; then these ones None
        calls += [
            ("backward", (q, k, v, o, lse, do, some(dlse), params)),
            ("bob", (q, k, v, o, lse, do, some(dlse), gdq, some(gdk), gdv, params)),
            ("bob", (q, k, v, o, lse, do, dlse, some(gdq), gdk, some(gdv), params)),
            ("bob_folded", (q, k, v, o, lse, do, some(dlse), some(gdq), gdk, gdv, None, params)),
            ("bob_folded", (q, k, v, o, lse, do, dlse, gdq, some(gdk), some(gdv), dq, params)),
            ("forward_jvp", (q, k, v, o, lse, some(tq), tk, some(tv), params)),
            ("forward_jvp", (q, k, v, o, lse, tq, some(tk), tv, params)),
            ("backward_jvp", (q, k, v, o, lse, do, dlse, some(tq), tk, some(tv), to, some(tlse),
                              tdo, some(tdlse), params)),
            ("backward_jvp", (q, k, v, o, lse, do, some(dlse), tq, some(tk), tv, some(to), tlse,
                              some(tdo), tdlse, params)),
        ]
    return calls


def assert_close(actual, expected, what):
    """Relative error of the whole tensor within 1e-10, with a floor for answers that are 0
    up to rounding (a per-row bias's cotangent); infinities (lse -inf on a row that sees no
    key) equal. NaN fails."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    finite = expected.isfinite()
    assert torch.equal(actual[~finite], expected[~finite]), what
    err = (actual[finite] - expected[finite]).norm().item()
    assert err <= 1e-10 * expected[finite].norm().item() + 1e-13, f"{what}: error {err:.2e}"


@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,E,Ev,causal,mask_kind,dropout_p", CASES)
def test_every_function_matches_reference(B, Hq, Hkv, L, S, E, Ev, causal, mask_kind,
                                          dropout_p, softcap):
    primals, params, like = problem(B, Hq, Hkv, L, S, E, Ev, causal, mask_kind, dropout_p,
                                    softcap)
    with blockwise.tiles(*TILES):
        for name, args in contract_calls(primals, params, like):
            ours, ref = getattr(blockwise, name)(*args), getattr(reference, name)(*args)
            if name == "forward_output":
                ours, ref = (ours,), (ref,)
            for i, (a, e) in enumerate(zip(ours, ref, strict=True)):
                assert_close(a, e, f"{name} output {i}")


# B, Hq, Hkv, L, S, bias shape (broadcast to B, Hq, L, S), causal, dropout_p
BIAS_CASES = [
    pytest.param(2, 2, 2, 9, 11, (2, 2, 9, 11), False, 0.0, id="full-bias"),
    pytest.param(2, 4, 2, 10, 10, (1, 4, 10, 10), True, 0.2, id="per-head-causal-gqa-dropout"),
    pytest.param(1, 2, 1, 7, 5, (1, 2, 7, 1), True, 0.0, id="per-row-causal"),
]


@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("B,Hq,Hkv,L,S,bias_shape,causal,dropout_p", BIAS_CASES)
def test_a_learned_bias_matches_reference(B, Hq, Hkv, L, S, bias_shape, causal, dropout_p,
                                          softcap):
    """backward_bias and bob_folded_bias (the bias after the cap: its cotangents are T's)."""
    g = torch.Generator().manual_seed(1)
    q, k = randn(g, B, Hq, L, 8, scale=1.5), randn(g, B, Hkv, S, 8, scale=1.5)
    v = randn(g, B, Hkv, S, 6)
    bias = randn(g, *bias_shape)
    params = AttentionParams(scale=SCALE, causal=causal, mask=bias.expand(B, Hq, L, S),
                             dropout_p=dropout_p, dropout_seed=1234 if dropout_p else None,
                             softcap=softcap)
    o, lse = reference.forward(q, k, v, params)
    do, dlse = randn(g, *o.shape), randn(g, *lse.shape)
    gdq, gdk, gdv, gdbias = (randn(g, *t.shape) for t in (q, k, v, bias))
    dq = reference.backward(q, k, v, o, lse, do, dlse, params)[0]
    calls = [
        ("backward_bias", (q, k, v, o, lse, do, dlse, params)),
        ("backward_bias", (q, k, v, o, lse, do, None, params)),
        ("bob_folded_bias", (q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdbias, None, params)),
        ("bob_folded_bias", (q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdbias, dq, params)),
        ("bob_folded_bias", (q, k, v, o, lse, do, None, None, gdk, None, gdbias, None, params)),
        ("bob_folded_bias", (q, k, v, o, lse, do, dlse, gdq, None, gdv, None, None, params)),
        ("bob_folded_bias", (q, k, v, o, lse, do, dlse, None, None, None, gdbias, None, params)),
    ]
    with blockwise.tiles(*TILES):
        for name, args in calls:
            ours, ref = getattr(blockwise, name)(*args), getattr(reference, name)(*args)
            for i, (a, e) in enumerate(zip(ours, ref, strict=True)):
                assert_close(a, e, f"{name} output {i}")


@pytest.mark.parametrize("mask_kind", [None, "additive"])
def test_softcap_zero_is_bit_identical_to_no_softcap(mask_kind):
    """softcap=0 is no cap at all (not a cap that rounds like none): every output equal bit
    for bit to that of params without the field. The additive mask also runs as a learned
    bias."""
    primals, zero_cap, like = problem(1, 4, 2, 9, 10, 8, 5, True, mask_kind, 0.2, softcap=0)
    no_cap = AttentionParams(scale=SCALE, causal=True, mask=zero_cap.mask, dropout_p=0.2,
                             dropout_seed=1234)
    calls = contract_calls(primals, zero_cap, like)
    if mask_kind is not None:
        q, k, v, o, lse = primals
        (gdq, _, _), (gdk, _, _), (gdv, _, _), (do, _, _), (dlse, _, _) = like
        gdbias = randn(torch.Generator().manual_seed(2), 1, *zero_cap.mask.shape[1:])
        calls += [("backward_bias", (q, k, v, o, lse, do, dlse, zero_cap)),
                  ("bob_folded_bias", (q, k, v, o, lse, do, dlse, gdq, gdk, gdv, gdbias, None,
                                       zero_cap))]
    with blockwise.tiles(*TILES):
        for name, args in calls:
            ours = getattr(blockwise, name)(*args)
            plain = getattr(blockwise, name)(*args[:-1], no_cap)
            if name == "forward_output":
                ours, plain = (ours,), (plain,)
            for i, (a, e) in enumerate(zip(ours, plain, strict=True)):
                assert torch.equal(a, e), f"{name} output {i}"
