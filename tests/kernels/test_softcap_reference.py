"""Soft-capped scores (T = c tanh(U / c), Gemma 2) in reference.py's closed forms, against
autograd and torch.func through plain math (reference.sdpa_math with softcap), float64.

The closed forms are the oracle of every kernel test, so they are checked here against
derivatives nobody wrote by hand: backward against autograd's gradient, bob_folded against
the double backward, the chain-form bob against the VJP of the closed-form backward taken
with o and lse as inputs, forward_jvp/backward_jvp against torch.func.jvp, and the bias
cotangents against autograd with the additive mask as an input."""
import pytest
import torch
from torch.func import grad, jvp, vjp

from bob_compile.kernels import reference
from bob_compile.kernels.params import AttentionParams

CASES = [  # B, Hq, Hkv, L, S, E, Ev, causal, softcap
    (1, 2, 2, 7, 7, 8, 8, True, 1.5),
    (2, 4, 2, 5, 9, 8, 4, False, 0.8),
    (1, 2, 1, 9, 6, 4, 8, True, 30.0),
]


def inputs(B, Hq, Hkv, L, S, E, Ev, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    # scores of a few units: the cap bends them (tanh'' far from 0 at c = 0.8 .. 1.5)
    return (randn(B, Hq, L, E, scale=1.5), randn(B, Hkv, S, E, scale=1.5),
            randn(B, Hkv, S, Ev), randn(B, Hq, L, Ev), randn(B, Hq, L))


def close(actual, expected, what):
    err = ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()
    assert err < 1e-10, f"{what}: relative error {err:.2e}"


def math_out(q, k, v, causal, scale, softcap, mask=None):
    return reference.sdpa_math(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                               enable_gqa=q.shape[1] != k.shape[1], softcap=softcap)


@pytest.mark.parametrize("case", CASES)
def test_forward_backward_and_folded_bob_are_autograds(case):
    *dims, causal, softcap = case
    q, k, v, do, _ = inputs(*dims)
    scale = 0.41
    params = AttentionParams(scale=scale, causal=causal, softcap=softcap)
    o, lse = reference.forward(q, k, v, params)
    close(o, math_out(q, k, v, causal, scale, softcap), "o")

    def loss(q, k, v):
        return (math_out(q, k, v, causal, scale, softcap) * do).sum()
    expected = grad(loss, argnums=(0, 1, 2))(q, k, v)
    actual = reference.backward(q, k, v, o, lse, do, None, params)
    for name, a, e in zip("qkv", actual, expected):
        close(a, e, f"d{name}")

    # the folded BoB: the VJP of (q, k, v, do) -> (dq, dk, dv), o and lse the forward's
    gdq, gdk, gdv = (torch.randn_like(t) for t in (q, k, v))

    def first(q, k, v, do):
        return torch.func.grad(lambda q, k, v: (math_out(q, k, v, causal, scale, softcap)
                                                * do).sum(), argnums=(0, 1, 2))(q, k, v)
    _, pull = vjp(first, q, k, v, do)
    expected = pull((gdq, gdk, gdv))
    actual = reference.bob_folded(q, k, v, o, lse, do, None, gdq, gdk, gdv, None, params)
    for name, a, e in zip(("gq", "gk", "gv", "gdo"), actual, expected):
        close(a, e, name)


@pytest.mark.parametrize("case", CASES[:2])
def test_chain_bob_is_the_vjp_of_the_closed_form_backward(case):
    """With o and lse inputs of the backward, its VJP by autograd through the closed form
    (the same function differentiated, not the hand-written BoB)."""
    *dims, causal, softcap = case
    q, k, v, do, dlse = inputs(*dims)
    params = AttentionParams(scale=0.41, causal=causal, softcap=softcap)
    o, lse = reference.forward(q, k, v, params)
    o, lse = o + 0.1 * torch.randn_like(o), lse + 0.05    # any o and lse: they are inputs
    cot = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
    _, pull = vjp(lambda *a: reference.backward(*a, params), q, k, v, o, lse, do, dlse)
    expected = pull(cot)
    actual = reference.bob(q, k, v, o, lse, do, dlse, *cot, params)
    for name, a, e in zip(reference.BOB_OUTPUTS, actual, expected):
        close(a, e, name)


@pytest.mark.parametrize("case", CASES[:2])
def test_forward_mode_is_torch_func_jvp(case):
    *dims, causal, softcap = case
    q, k, v, do, dlse = inputs(*dims)
    params = AttentionParams(scale=0.41, causal=causal, softcap=softcap)
    o, lse = reference.forward(q, k, v, params)
    tq, tk, tv = (torch.randn_like(t) for t in (q, k, v))
    (_, _), (to_e, tlse_e) = jvp(lambda q, k, v: reference.forward(q, k, v, params),
                                 (q, k, v), (tq, tk, tv))
    to, tlse = reference.forward_jvp(q, k, v, o, lse, tq, tk, tv, params)
    close(to, to_e, "to")
    close(tlse, tlse_e, "tlse")
    tdo, tdlse = torch.randn_like(do), torch.randn_like(dlse)

    def first(q, k, v, do, dlse):
        o, lse = reference.forward(q, k, v, params)
        return reference.backward(q, k, v, o, lse, do, dlse, params)
    _, expected = jvp(first, (q, k, v, do, dlse), (tq, tk, tv, tdo, tdlse))
    actual = reference.backward_jvp(q, k, v, o, lse, do, dlse, tq, tk, tv, to, tlse, tdo, tdlse,
                                    params)
    for name, a, e in zip(("tdq", "tdk", "tdv"), actual, expected):
        close(a, e, name)


def test_a_learned_bias_after_the_cap():
    """T = φ(U) + M: the bias's cotangents (first order, and the folded BoB's) by autograd."""
    q, k, v, do, _ = inputs(1, 2, 2, 6, 7, 8, 8)
    bias = torch.randn(1, 2, 6, 7, dtype=torch.float64)
    params = AttentionParams(scale=0.41, causal=False, mask=bias, softcap=1.2)
    o, lse = reference.forward(q, k, v, params)

    def first(q, k, v, bias):
        return grad(lambda q, k, v, b: (math_out(q, k, v, False, 0.41, 1.2, b) * do).sum(),
                    argnums=(0, 1, 2, 3))(q, k, v, bias)
    expected = first(q, k, v, bias)
    actual = reference.backward_bias(q, k, v, o, lse, do, None, params)
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), actual, expected):
        close(a, e, name)
    cot = tuple(torch.randn_like(t) for t in (q, k, v, bias))
    _, pull = vjp(first, q, k, v, bias)
    expected = pull(cot)
    actual = reference.bob_folded_bias(q, k, v, o, lse, do, None, *cot, None, params)
    for name, a, e in zip(("gq", "gk", "gv", "gdo", "gdlse", "gbias"), actual,
                          (*expected[:3], None, None, expected[3])):
        if e is not None:
            close(a, e, name)


def test_no_cap_is_the_plain_attention():
    q, k, v, do, _ = inputs(1, 2, 2, 5, 5, 4, 4)
    plain = reference.forward(q, k, v, AttentionParams(scale=0.5, causal=True))
    capped = reference.forward(q, k, v, AttentionParams(scale=0.5, causal=True, softcap=0.0))
    assert all(torch.equal(a, b) for a, b in zip(plain, capped))
    with pytest.raises(ValueError, match="softcap"):
        AttentionParams(scale=0.5, causal=True, softcap=-1.0)
