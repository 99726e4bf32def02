"""Attention dropout's keep mask (bob_compile/kernels/dropout.py, philox.py) and the closed
forms with dropout (reference.py) against autograd through math attention given the same
mask, at every order, in float64. The blockwise path is held to the reference with dropout
in test_blockwise.py, the Triton kernels in test_triton_interpret.py."""
import pytest
import torch
from torch.func import jvp

from bob_compile.kernels import dropout, philox, reference
from bob_compile.kernels.params import AttentionParams


def keep(p, shape, seed):
    params = AttentionParams(scale=1.0, causal=False, dropout_p=p, dropout_seed=torch.tensor(seed))
    return dropout.keep_mask(params, shape, slice(0, shape[2]), slice(0, shape[3]), "cpu")


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    """Within 4 standard deviations of 1 - p over 2**18 draws."""
    mask = keep(p, (2, 4, 128, 256), seed=7)
    n = mask.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(mask.double().mean().item() - (1 - p)) < 4 * sigma


def test_no_correlation_across_rows_keys_heads_batches_and_calls():
    """The keep indicators of neighbouring rows and keys (1 and 8 apart: within one Philox
    call's 2 x 2 group; 4 and 16 apart: across groups), heads, batch entries and two calls'
    seeds are uncorrelated (|corr| < 4 / sqrt(n)), and no two rows are equal."""
    mask = keep(0.5, (2, 2, 64, 512), seed=11).double()
    other_call = keep(0.5, (2, 2, 64, 512), seed=12).double()
    n = mask[0, 0].numel()

    def corr(a, b):
        a, b = a - a.mean(), b - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()
    bound = 4 / n ** 0.5
    for shift in (1, 4, 8, 16):      # rows and keys of one Philox call (8), and of others
        assert abs(corr(mask[0, 0, :-shift], mask[0, 0, shift:])) < bound
        assert abs(corr(mask[0, 0, :, :-shift], mask[0, 0, :, shift:])) < bound
    assert abs(corr(mask[0, 0], mask[0, 1])) < bound                    # heads
    assert abs(corr(mask[0, 0], mask[1, 0])) < bound                    # batch entries
    assert abs(corr(mask[0, 0], other_call[0, 0])) < bound              # calls
    rows = mask.reshape(-1, 512)
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]


def test_same_seed_same_mask_and_tiles_agree_with_the_whole():
    whole = keep(0.3, (1, 3, 20, 30), seed=5)
    assert torch.equal(whole, keep(0.3, (1, 3, 20, 30), seed=5))
    params = AttentionParams(scale=1.0, causal=False, dropout_p=0.3, dropout_seed=5)
    tile = dropout.keep_mask(params, (1, 3, 20, 30), slice(4, 11), slice(17, 30), "cpu")
    assert torch.equal(tile, whole[:, :, 4:11, 17:30])


def test_mask_follows_its_definition_element_by_element():
    """Each element's 16 bits, computed one at a time from dropout.py's definition: the
    group of rows {i, i + 8} and keys {j, j + 8} of a 16-block shares one Philox-2x32 call,
    element (a, c) is half c of word a; the seed's bits 32-47 sit above the counter's."""
    B, H, L, S, p, seed = 2, 3, 35, 21, 0.45, 2 ** 45 + 2 ** 33 + 7
    mask = keep(p, (B, H, L, S), seed)
    threshold = dropout.threshold(p)
    for b, h, i, j in [(0, 0, 0, 0), (0, 0, 8, 8), (1, 2, 34, 20), (1, 1, 17, 9), (0, 2, 23, 15)]:
        head, (big_i, a, r), (big_j, c, s_) = b * H + h, (i // 16, i // 8 % 2, i % 8), \
            (j // 16, j // 8 % 2, j % 8)
        group = ((head * -(-L // 16) + big_i) * 8 + r) * (8 * -(-S // 16)) + 8 * big_j + s_
        words = philox.philox2x32(seed % 2 ** 32, torch.tensor([group % 2 ** 32]),
                                  torch.tensor([group // 2 ** 32 + (seed // 2 ** 32) * 2 ** 16]))
        bits = words[a].item() >> (16 * c) & 0xFFFF
        assert mask[b, h, i, j].item() == (bits >= threshold), (b, h, i, j)


def test_philox_matches_random123s_known_answers():
    """The round function: Philox-2x32-10 against Random123's kat_vectors (counter, key ->
    words); the mask draws the same rounds, seven of them (philox.py)."""
    for (c0, c1), key, expected in [((0, 0), 0, (0xFF1DAE59, 0x6CD10DF2)),
                                    ((2 ** 32 - 1, 2 ** 32 - 1), 2 ** 32 - 1, (0x2C3F628B, 0xAB4FD7AD)),
                                    ((0x243F6A88, 0x85A308D3), 0x13198A2E, (0xDD7CE038, 0xF62A4C12))]:
        words = philox.philox2x32(key, torch.tensor([c0]), torch.tensor([c1]), rounds=10)
        assert tuple(w.item() for w in words) == expected


def avalanche_z(rounds, samples=1 << 13):
    """z-scores (96 x 64) of how often flipping one input bit (32 of c0, 32 of c1, 32 of the
    key) flips each of the 64 output bits of `rounds` Philox-2x32 rounds, against 1/2."""
    g = torch.Generator().manual_seed(rounds)
    c0, c1, key = (torch.randint(0, 2 ** 32, (samples,), generator=g) for _ in range(3))
    bits = torch.arange(32)

    def output_bits(key, c0, c1):
        w0, w1 = philox.philox2x32(key, c0, c1, rounds)
        return torch.cat([w0[:, None] >> bits & 1, w1[:, None] >> bits & 1], 1)
    base, z = output_bits(key, c0, c1), []
    for which in range(3):
        for bit in range(32):
            flipped = [key, c0, c1]
            flipped[(which + 1) % 3] = flipped[(which + 1) % 3] ^ (1 << bit)
            rate = (output_bits(*flipped) != base).double().mean(0)
            z.append((rate - 0.5) * 2 * samples ** 0.5)
    return torch.stack(z)


def test_seven_philox_rounds_flip_every_output_bit_half_the_time():
    """Why seven rounds are enough (philox.py): one flipped bit of the counter or the key
    flips each output bit with probability 1/2 within sampling error; four rounds are
    told apart (the test's power)."""
    z = avalanche_z(philox.ROUNDS)
    assert philox.ROUNDS >= 7
    assert z.abs().max() < 5 and 0.9 < (z ** 2).mean() < 1.1
    assert avalanche_z(4).abs().max() > 10


def test_a_call_too_large_for_the_counter_is_refused():
    with pytest.raises(ValueError, match="split the batch"):
        dropout.check_counter_range((4096, 64, 2 ** 20, 2 ** 20))
    dropout.check_counter_range((1, 12, 2 ** 20, 2 ** 20))


def test_p_zero_and_one():
    params = AttentionParams(scale=1.0, causal=False, dropout_p=1.0, dropout_seed=1)
    z = dropout.keep_scale(params, (1, 1, 3, 4), slice(0, 3), slice(0, 4), torch.float64, "cpu")
    assert torch.equal(z, torch.zeros(1, 1, 3, 4, dtype=torch.float64))
    params = AttentionParams(scale=1.0, causal=False)
    assert dropout.keep_scale(params, (1, 1, 3, 4), slice(0, 3), slice(0, 4),
                              torch.float64, "cpu") is None
    with pytest.raises(TypeError, match="dropout_p without a dropout_seed"):
        AttentionParams(scale=1.0, causal=False, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        AttentionParams(scale=1.0, causal=False, dropout_p=1.5, dropout_seed=1)


# ----------------------------------------------------------------------------- closed forms
SHAPES = [  # B, Hq, Hkv, L, S, E, Ev, causal
    (1, 2, 2, 7, 7, 8, 8, True),
    (2, 4, 2, 5, 9, 8, 4, False),
]


def close(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.25, 0.8])
def test_closed_forms_with_dropout_equal_autograd_through_math(shape, p):
    """forward, backward, bob, bob_folded, forward_jvp, backward_jvp with dropout against
    autograd (and forward-mode AD) through math attention with the same Z."""
    B, Hq, Hkv, L, S, E, Ev, causal = shape
    g = torch.Generator().manual_seed(0)
    f64 = dict(dtype=torch.float64)
    q, k, v = (torch.randn(*s, generator=g, **f64) for s in
               ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev)))
    do = torch.randn(B, Hq, L, Ev, generator=g, **f64)
    scale = 0.4
    params = AttentionParams(scale=scale, causal=causal, dropout_p=p, dropout_seed=torch.tensor(99))
    z = dropout.keep_scale(params, (B, Hq, L, S), slice(0, L), slice(0, S), torch.float64, "cpu")
    assert 0 < (z == 0).sum() < z.numel()

    def math(q, k, v):
        return reference.sdpa_math(q, k, v, is_causal=causal, scale=scale, enable_gqa=Hq != Hkv,
                                   dropout_scale=z)
    o, lse = reference.forward(q, k, v, params)
    close((o,), (math(q, k, v),))
    # first order
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        first = torch.autograd.grad(math(*qkv), qkv, do, create_graph=True)
    close(reference.backward(q, k, v, o, lse, do, None, params), first)
    # second order: the VJP of the first, w.r.t. q, k, v and dO
    gdq, gdk, gdv = (torch.randn(t.shape, generator=g, **f64) for t in (q, k, v))
    do_leaf = do.clone().requires_grad_()
    with torch.enable_grad():
        grads = torch.autograd.grad(math(*qkv), qkv, do_leaf, create_graph=True)
        want = torch.autograd.grad(grads, [*qkv, do_leaf], (gdq, gdk, gdv))
    gq, gk, gv, gdo, _ = reference.bob_folded(q, k, v, o, lse, do, None, gdq, gdk, gdv, None,
                                              params)
    close((gq, gk, gv, gdo), want)
    gq, gk, gv, go, glse, gdo, _ = reference.bob(q, k, v, o, lse, do, None, gdq, gdk, gdv, params)
    dq2, dk2, dv2 = reference.backward(q, k, v, o, lse, go, glse, params)
    close((gq + dq2, gk + dk2, gv + dv2, gdo), want)
    # forward mode: the forward's and the backward's tangents
    tq, tk, tv, tdo = (torch.randn(t.shape, generator=g, **f64) for t in (q, k, v, do))
    _, want_to = jvp(math, (q, k, v), (tq, tk, tv))
    to, tlse = reference.forward_jvp(q, k, v, o, lse, tq, tk, tv, params)
    close((to,), (want_to,))

    def first_order(q, k, v, do):
        return torch.func.vjp(math, q, k, v)[1](do)
    _, want_t = jvp(first_order, (q, k, v, do), (tq, tk, tv, tdo))
    close(reference.backward_jvp(q, k, v, o, lse, do, None, tq, tk, tv, to, tlse, tdo, None,
                                 params), want_t)
