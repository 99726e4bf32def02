"""A learned additive bias (attn_mask that requires grad) through bob_compile.attention: every
order exact in float64 against autograd through math attention, the bias's own derivatives
included (first order, HVP, a MAML meta-gradient, forward over reverse, third order, vmap).
4-D inputs run the fused learned-bias derivatives (BiasAttnFn: attn_bwd_bias and
attn_bob_folded_bias; blockwise here, Triton on CUDA); other inputs run the closed-form
math, said once in the log (bob_compile/autograd.py, learned_bias_output)."""
import logging

import pytest
import torch
from torch.func import grad, jvp

import bob_compile
from bob_compile import autograd as bob_autograd
from bob_compile.kernels import dropout
from bob_compile.kernels.reference import sdpa_math

F64 = dict(dtype=torch.float64)
# (bias shape, causal, enable_gqa): T5's (1, H, L, S) from a bucket embedding, a learned
# (H, L, S) table, a per-query-row (L, 1) bias, a (B, 1, L, S) bias beside GQA
CASES = [((1, 4, 7, 9), False, False), ((4, 7, 9), True, False), ((7, 1), False, False),
         ((2, 1, 7, 9), True, True)]


def inputs(bias_shape, gqa, seed=0):
    g = torch.Generator().manual_seed(seed)
    hkv = 2 if gqa else 4
    q = torch.randn(2, 4, 7, 8, generator=g, **F64)
    k, v = (torch.randn(2, hkv, 9, 8, generator=g, **F64) for _ in range(2))
    bias = torch.randn(*bias_shape, generator=g, **F64)
    return q, k, v, bias


def hvp(f, primals, tangents):
    """Reverse over reverse: the Hessian of sum(f(...) * w) along `tangents`."""
    primals = [t.detach().requires_grad_() for t in primals]
    w = torch.randn_like(f(*primals), generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((f(*primals) * w).sum(), primals, create_graph=True)
    return torch.autograd.grad(grads, primals, tangents)


@pytest.mark.parametrize("bias_shape,causal,gqa", CASES)
def test_every_order_matches_math_with_the_bias_differentiated(bias_shape, causal, gqa):
    q, k, v, bias = inputs(bias_shape, gqa)

    def ours(q, k, v, bias):
        return bob_compile.attention(q, k, v, attn_mask=bias, is_causal=causal, enable_gqa=gqa)

    def math(q, k, v, bias):
        return sdpa_math(q, k, v, attn_mask=bias, is_causal=causal, enable_gqa=gqa)
    primals = (q, k, v, bias)
    tangents = [torch.randn_like(t, generator=torch.Generator().manual_seed(i))
                for i, t in enumerate(primals)]
    for a, b in zip(hvp(ours, primals, tangents), hvp(math, primals, tangents), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    # first order, and forward over reverse (torch.func), w.r.t. the bias too
    def loss(f):
        return lambda *args: (f(*args) ** 2).sum()
    for a, b in zip(grad(loss(ours), argnums=(0, 1, 2, 3))(*primals),
                    grad(loss(math), argnums=(0, 1, 2, 3))(*primals), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    _, ours_fr = jvp(grad(loss(ours), argnums=3), primals, tuple(tangents))
    _, math_fr = jvp(grad(loss(math), argnums=3), primals, tuple(tangents))
    torch.testing.assert_close(ours_fr, math_fr, atol=1e-10, rtol=1e-9)


def test_maml_meta_gradient_of_a_bias_parameter():
    """One inner SGD step on (a projection, a learned (H, L, S) bias), the meta-gradient of the
    query loss w.r.t. both initial values: the second order through the bias."""
    q, k, v, bias0 = inputs((4, 7, 9), False)
    w0 = torch.eye(8, **F64) + 0.1 * torch.randn(8, 8, generator=torch.Generator().manual_seed(5),
                                                 **F64)

    def meta_grads(attend):
        w, bias = w0.clone().requires_grad_(), bias0.clone().requires_grad_()
        inner = (attend(q @ w, k, v, bias) ** 2).sum()
        gw, gb = torch.autograd.grad(inner, (w, bias), create_graph=True)
        w1, b1 = w - 0.1 * gw, bias - 0.1 * gb
        outer = (attend(q @ w1, k, v, b1) * v[..., :7, :]).sum()
        return torch.autograd.grad(outer, (w, bias))
    ours = meta_grads(lambda q, k, v, b: bob_compile.attention(q, k, v, attn_mask=b))
    math = meta_grads(lambda q, k, v, b: sdpa_math(q, k, v, attn_mask=b))
    for a, b in zip(ours, math, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def test_with_dropout_the_bias_sees_the_calls_mask():
    """Dropout beside a learned bias: the bias's gradient is math's with the call's mask."""
    q, k, v, bias = inputs((4, 7, 9), False)
    bias.requires_grad_()
    torch.manual_seed(11)
    out = bob_compile.attention(q, k, v, attn_mask=bias, dropout_p=0.3)
    (ours,) = torch.autograd.grad(out.sum(), bias)
    torch.manual_seed(11)
    seed = dropout.draw_seed(q.device)
    params = bob_autograd.kernels.params.AttentionParams(scale=8 ** -0.5, causal=False,
                                                         dropout_p=0.3, dropout_seed=seed)
    z = dropout.keep_scale(params, (2, 4, 7, 9), slice(0, 7), slice(0, 9), torch.float64, "cpu")
    (want,) = torch.autograd.grad(sdpa_math(q, k, v, attn_mask=bias, dropout_scale=z).sum(),
                                  bias)
    torch.testing.assert_close(ours, want, atol=1e-10, rtol=1e-9)


def test_the_fallback_is_logged_once(caplog, monkeypatch):
    """Inputs without a batch dim (3-D) take the closed form, and say so once."""
    monkeypatch.setattr(bob_autograd, "_learned_bias_logged", False)
    q, k, v, bias = inputs((7, 9), False)
    bias.requires_grad_()
    with caplog.at_level(logging.WARNING, logger="bob_compile.autograd"):
        for _ in range(2):
            out = bob_compile.attention(q[0], k[0], v[0], attn_mask=bias)
    said = [r for r in caplog.records if "learned bias" in r.getMessage()]
    assert len(said) == 1 and "unfused" in said[0].getMessage()
    (got,) = torch.autograd.grad(out.sum(), bias)
    (want,) = torch.autograd.grad(sdpa_math(q[0], k[0], v[0], attn_mask=bias).sum(), bias)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)


def test_4d_inputs_run_the_learned_bias_ops(monkeypatch):
    """The first and second order of a 4-D CPU call are attn_bwd_bias and
    attn_bob_folded_bias (blockwise), not the closed form."""
    from bob_compile.kernels import blockwise
    calls = []
    for name in ("backward_bias", "bob_folded_bias"):
        original = getattr(blockwise, name)
        monkeypatch.setattr(blockwise, name, lambda *a, _f=original, _n=name: (
            calls.append(_n), _f(*a))[1])
    q, k, v, bias = inputs((4, 7, 9), False)
    hvp(lambda q, k, v, b: bob_compile.attention(q, k, v, attn_mask=b), (q, k, v, bias),
        [torch.ones_like(t) for t in (q, k, v, bias)])
    assert calls == ["backward_bias", "bob_folded_bias"]


def test_third_order_and_vmap_over_the_bias():
    """A third order (the gradient of an HVP's bias component) and torch.func.vmap of
    per-example bias gradients, against math."""
    q, k, v, bias = inputs((1, 4, 7, 9), True)

    def third(attend):
        b = bias.clone().requires_grad_()
        qq = q.clone().requires_grad_()
        (gb,) = torch.autograd.grad((attend(qq, k, v, b) ** 2).sum(), b, create_graph=True)
        (hb,) = torch.autograd.grad((gb ** 2).sum(), b, create_graph=True)
        return torch.autograd.grad(hb.sum(), (qq, b))
    ours = third(lambda q, k, v, b: bob_compile.attention(q, k, v, attn_mask=b, enable_gqa=True))
    math = third(lambda q, k, v, b: sdpa_math(q, k, v, attn_mask=b, enable_gqa=True))
    for a, b in zip(ours, math, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-8)

    def per_example(attend):
        def loss(b, q):
            return (attend(q[None], k[:1], v[:1], b) ** 2).sum()
        return torch.func.vmap(grad(loss), in_dims=(None, 0))(bias, q)
    torch.testing.assert_close(
        per_example(lambda q, k, v, b: bob_compile.attention(q, k, v, attn_mask=b,
                                                             enable_gqa=True)),
        per_example(lambda q, k, v, b: sdpa_math(q, k, v, attn_mask=b, enable_gqa=True)),
        atol=1e-10, rtol=1e-9)


def test_a_constant_mask_still_runs_the_fused_path(monkeypatch):
    """Must not take the closed form: the same float mask without grad."""
    monkeypatch.setattr(bob_autograd, "learned_bias_output",
                        lambda *a: pytest.fail("a constant mask took the learned-bias route"))
    q, k, v, bias = inputs((7, 9), False)
    torch.testing.assert_close(bob_compile.attention(q, k, v, attn_mask=bias),
                               sdpa_math(q, k, v, attn_mask=bias))


def test_compiled_hvp_through_the_op_with_a_bias_parameter():
    """torch.compile(backend="flashbob") of a module that calls the op with a learned
    (H, L, L) bias parameter: the HVP w.r.t. the projection and the bias equals math's."""
    q, k, v, bias = inputs((4, 7, 7), False)
    k, v = k[..., :7, :], v[..., :7, :]

    class Biased(torch.nn.Module):
        def __init__(self, attend):
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(8, **F64) + 0.1)
            self.bias = torch.nn.Parameter(bias.clone())
            self.attend = attend

        def forward(self, x):
            return self.attend(x @ self.w, k, v, self.bias)

    def hvp_of(model):
        params = list(model.parameters())
        grads = torch.autograd.grad((model(q) ** 2).sum(), params, create_graph=True)
        return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
    torch._dynamo.reset()
    compiled = torch.compile(Biased(lambda q, k, v, b: bob_compile.attention(
        q, k, v, attn_mask=b, is_causal=True)), backend="flashbob",
        options={"compiler": "aot_eager", "fallback": False})
    want = hvp_of(Biased(lambda q, k, v, b: sdpa_math(q, k, v, attn_mask=b, is_causal=True)))
    for a, b in zip(hvp_of(compiled), want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def test_an_expanded_bias_gets_its_own_gradient():
    """A bias that is itself a stride-0 view (a per-head parameter expanded over the batch):
    its gradient flows back through the expand (summed there), not summed twice."""
    q, k, v, table = inputs((1, 4, 7, 9), False)
    table.requires_grad_()

    def gradient(attend):
        out = attend(q, k, v, attn_mask=table.expand(2, 4, 7, 9))
        return torch.autograd.grad((out ** 2).sum(), table)[0]
    torch.testing.assert_close(gradient(bob_compile.attention), gradient(sdpa_math),
                               atol=1e-10, rtol=1e-9)
