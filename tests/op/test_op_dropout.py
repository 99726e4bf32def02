"""bob_compile.attention(..., dropout_p=p): SDPA's dropout, exact at every order against
autograd through math attention given the same keep mask, in float64; the mask regenerated
from a per-call seed drawn from PyTorch's generator (torch.manual_seed reproduces a call)."""
import pytest
import torch
from torch.func import grad, jvp, vmap

from bob_compile import attention
from bob_compile.kernels import dropout
from bob_compile.kernels.params import AttentionParams
from bob_compile.kernels.reference import sdpa_math

TOL = 1e-10
P = 0.3


def inputs(shape_q=(2, 3, 7, 5), shape_kv=(2, 3, 9, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
            for s in (shape_q, shape_kv, shape_kv)]


def math_with_the_calls_mask(generator_seed, q, k, v, p=P, **options):
    """Math attention with the keep mask that a call made right after
    torch.manual_seed(generator_seed) drew (the seed is its first draw)."""
    torch.manual_seed(generator_seed)
    seed = dropout.draw_seed(q.device)
    B, H, L, S = *q.shape[:-1], k.shape[-2]
    params = AttentionParams(scale=1.0, causal=False, dropout_p=p, dropout_seed=seed)
    z = dropout.keep_scale(params, (B, H, L, S), slice(0, L), slice(0, S), q.dtype, q.device)
    return sdpa_math(q, k, v, dropout_scale=z, **options)


def ours(generator_seed, q, k, v, p=P, **options):
    torch.manual_seed(generator_seed)
    return attention(q, k, v, dropout_p=p, **options)


def close(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=TOL, rtol=0)


@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"scale": 0.6},
                                     {"attn_mask": "padding"}], ids=["plain", "causal", "scale", "mask"])
def test_every_order_equals_math_with_the_same_mask(options):
    q, k, v = inputs()
    if options.get("attn_mask") == "padding":
        mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
        mask[1, ..., 6:] = False
        options = {"attn_mask": mask}
    o, want = ours(3, q, k, v, **options), math_with_the_calls_mask(3, q, k, v, **options)
    close((o,), (want,))
    do = torch.randn_like(o)
    g1 = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    w1 = torch.autograd.grad(want, (q, k, v), do, create_graph=True)
    close(g1, w1)
    vs = [torch.randn_like(t) for t in g1]
    close(torch.autograd.grad(g1, (q, k, v), vs), torch.autograd.grad(w1, (q, k, v), vs))


def test_maml_step_and_forward_over_reverse():
    q, k, v = inputs()
    w = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)

    def meta_loss(attend, w):
        inner = attend(7, q @ w, k, v).square().sum()
        (g,) = torch.autograd.grad(inner, w, create_graph=True)
        return attend(8, q @ (w - 0.1 * g), k, v).sum()
    close(torch.autograd.grad(meta_loss(ours, w), w),
          torch.autograd.grad(meta_loss(math_with_the_calls_mask, w), w))

    def loss(attend, q):
        return attend(9, q, k.detach(), v.detach()).square().sum()
    tangent = torch.randn_like(q)
    qd = q.detach()
    _, ours_t = jvp(grad(lambda x: loss(ours, x)), (qd,), (tangent,))
    _, want_t = jvp(grad(lambda x: loss(math_with_the_calls_mask, x)), (qd,), (tangent,))
    close((ours_t,), (want_t,))


def test_a_seed_reproduces_a_call_bit_for_bit_and_calls_differ():
    q, k, v = inputs()
    a, b, c = ours(1, q, k, v), ours(1, q, k, v), attention(q, k, v, dropout_p=P)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_keep_rate_of_the_output():
    """Values one: each output element is the mean of its row's kept, scaled ones."""
    q = torch.zeros(1, 4, 64, 8, dtype=torch.float64)
    k = torch.zeros(1, 4, 512, 8, dtype=torch.float64)
    v = torch.ones(1, 4, 512, 1, dtype=torch.float64)
    o = attention(q, k, v, dropout_p=0.25)
    n = 4 * 64 * 512
    assert abs(o.mean().item() - 1.0) < 4 * (0.25 / 0.75 / n) ** 0.5


def test_p_zero_is_no_dropout_and_p_one_zeros():
    q, k, v = inputs()
    torch.testing.assert_close(attention(q, k, v, dropout_p=0.0), attention(q, k, v),
                               atol=0, rtol=0)
    o = attention(q, k, v, dropout_p=1.0)
    assert torch.equal(o, torch.zeros_like(o))
    assert all(torch.equal(g, torch.zeros_like(g))
               for g in torch.autograd.grad(o.sum(), (q, k, v)))


@pytest.mark.parametrize("bad, error", [(-0.1, ValueError), (1.5, ValueError),
                                        (torch.tensor(0.1), TypeError), ("0.1", TypeError)])
def test_bad_probabilities_are_refused(bad, error):
    q, k, v = inputs()
    with pytest.raises(error, match="dropout"):
        attention(q, k, v, dropout_p=bad)


def test_positional_arguments_as_in_sdpa():
    q, k, v = inputs()
    torch.manual_seed(2)
    positional = attention(q, k, v, None, P, True)
    torch.testing.assert_close(positional, ours(2, q, k, v, is_causal=True), atol=0, rtol=0)


def test_vmap_randomness_as_for_other_random_ops():
    """As F.dropout under vmap: refused by default; "same" draws one mask for every vmapped
    call, "different" one each; each is the mask of an unbatched call with its seed."""
    q, k, v = (t.detach() for t in inputs())
    same_inputs = (q[:1].expand(3, -1, -1, -1), k[:1].expand(3, -1, -1, -1),
                   v[:1].expand(3, -1, -1, -1))

    def call(q, k, v):
        return attention(q, k, v, dropout_p=0.5)
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(call)(*same_inputs)
    torch.manual_seed(4)
    same = vmap(call, randomness="same")(*same_inputs)
    assert torch.equal(same[0], same[1]) and torch.equal(same[0], same[2])
    close((same[0],), (ours(4, *(t[:1] for t in same_inputs), p=0.5)[0],))
    different = vmap(call, randomness="different")(*same_inputs)
    assert not torch.equal(different[0], different[1])
