"""Every derivative path through bob_compile.attention, against autograd through plain math
attention, in float64 (max error <= 1e-10).

Paths: autograd HVP (create_graph then a second grad), a MAML inner step, torch.func grad,
grad(grad), vjp, jvp, jvp(grad), vmap, vmap(grad), hessian and jacrev(jacrev); third order
in reverse and forward mode (grad of grad of grad, grad of jvp, jvp of jvp, jacfwd(jacfwd),
jvp of grad of grad).
Cases: causal and not, L != S both ways, Ev != E, a non-default scale, leading dims
(B, H) / (B,) / none, GQA, lengths that are no multiple of the (tiny) tiles, permuted
inputs, rows that see no key, and masks (attn_mask: key padding, general boolean,
additive with -inf and HF's finfo.min fill, broadcast in every leading dim; each also
combined with causal).
"""
import functools
from typing import Callable, NamedTuple

import pytest
import torch
from torch.func import grad, hessian, jacrev, jvp, vjp, vmap

from bob_compile.kernels.reference import sdpa_math as math_attention
from bob_compile import attention
from bob_compile.kernels import settings

TOL = 1e-10

# name -> (q shape, k shape, v shape, options); permuted inputs are built (B, L, H, E)
CASES = {
    "bhle_l_lt_s": ((2, 3, 7, 5), (2, 3, 9, 5), (2, 3, 9, 5), {}),
    "l_gt_s": ((2, 2, 11, 4), (2, 2, 6, 4), (2, 2, 6, 4), {}),
    "ev_ne_e": ((1, 2, 6, 5), (1, 2, 8, 5), (1, 2, 8, 3), {}),
    "batch_only": ((3, 7, 4), (3, 5, 4), (3, 5, 6), {}),
    "no_leading_dims": ((7, 4), (9, 4), (9, 4), {}),
    "gqa": ((2, 4, 6, 4), (2, 2, 7, 4), (2, 2, 7, 3), {"enable_gqa": True}),
    "scale": ((1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4), {"scale": 0.77}),
    "permuted": ((2, 3, 6, 4), (2, 3, 7, 4), (2, 3, 7, 4), {"permuted": True}),
    "no_visible_key": ((1, 2, 5, 4), (1, 2, 0, 4), (1, 2, 0, 3), {}),
    # masks: (kind, shape); padding hides the last keys of batch 1, all keys of batch 2
    "key_padding_mask": ((3, 2, 6, 4), (3, 2, 8, 4), (3, 2, 8, 4), {"mask": ("padding", (3, 1, 1, 8))}),
    "bool_mask": ((2, 3, 7, 5), (2, 3, 9, 5), (2, 3, 9, 5), {"mask": ("bool", (2, 3, 7, 9))}),
    "additive_mask": ((2, 2, 6, 4), (2, 2, 7, 4), (2, 2, 7, 4), {"mask": ("additive", (6, 7))}),
    "finfo_min_mask": ((2, 2, 6, 4), (2, 2, 6, 4), (2, 2, 6, 4), {"mask": ("finfo_min", (2, 1, 6, 6))}),
    "gqa_mask": ((2, 4, 6, 4), (2, 2, 7, 4), (2, 2, 7, 3), {"enable_gqa": True, "mask": ("bool", (2, 1, 6, 7))}),
    "no_leading_dims_mask": ((7, 4), (9, 4), (9, 4), {"mask": ("bool", (7, 9))}),
}


def make_mask(kind, shape):
    """A mask of SDPA's kinds, with a row (or batch) that sees no key where it can."""
    g = torch.Generator().manual_seed(7)
    if kind == "padding":        # an HF attention_mask as SDPA sees it: (B, 1, 1, S), True = token
        lengths = torch.tensor([shape[-1], shape[-1] - 3, 0])
        return (torch.arange(shape[-1]) < lengths[:, None]).view(shape)
    visible = torch.rand(shape, generator=g) > 0.35
    visible[..., 1, :] = False   # a row that sees no key
    if kind == "bool":
        return visible
    if kind == "additive":
        return torch.randn(shape, generator=g, dtype=torch.float64).masked_fill(~visible, -torch.inf)
    fill = torch.finfo(torch.float64).min   # HF eager: scores + mask, hidden keys at finfo.min
    return torch.zeros(shape, dtype=torch.float64).masked_fill(~visible, fill)


def make_inputs(case, causal):
    qs, ks, vs, opts = CASES[case]
    opts = dict(opts)
    permuted = opts.pop("permuted", False)

    def rand(shape):
        if permuted:   # stored (B, L, H, E), seen as (B, H, L, E)
            b, h, n, e = shape
            return torch.randn(b, n, h, e, dtype=torch.float64).transpose(1, 2)
        return torch.randn(shape, dtype=torch.float64)
    q, k, v = rand(qs), rand(ks), rand(vs)
    if permuted:
        assert not q.is_contiguous()
    if "mask" in opts:
        opts["attn_mask"] = make_mask(*opts.pop("mask"))
    return (q, k, v), dict(opts, is_causal=causal)


class Setup(NamedTuple):
    inputs: tuple
    attn: Callable          # ours, options bound
    attn_ref: Callable      # plain math, options bound
    f: Callable             # scalar loss through ours
    f_ref: Callable         # the same loss through plain math


def setup(case, causal):
    inputs, kw = make_inputs(case, causal)
    attn, attn_ref = functools.partial(attention, **kw), functools.partial(math_attention, **kw)
    weight = torch.randn_like(attn_ref(*inputs))

    def loss_of(fn):   # non-trivial second derivative both through o (sin) and inside attention
        return lambda q, k, v: (torch.sin(fn(q, k, v)) * weight).sum()
    return Setup(inputs, attn, attn_ref, loss_of(attn), loss_of(attn_ref))


def assert_close(ours, ref):
    if isinstance(ref, torch.Tensor):
        assert ours.shape == ref.shape
        assert not torch.isnan(ours).any()
        err = (ours - ref).abs().max().item() if ref.numel() else 0.0
        assert err <= TOL, err
    else:
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref):
            assert_close(a, b)


params = pytest.mark.parametrize("case", list(CASES))
causal = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])


@params
@causal
def test_forward_matches_math(case, causal):
    inputs, attn, attn_ref, _, _ = setup(case, causal)
    assert_close(attn(*inputs), attn_ref(*inputs))


@params
@causal
def test_autograd_hvp(case, causal):
    inputs, attn, attn_ref, f, f_ref = setup(case, causal)
    vecs = [torch.randn_like(t) for t in inputs]

    def hvp(fn):
        xs = [t.clone().requires_grad_() for t in inputs]
        grads = torch.autograd.grad(fn(*xs), xs, create_graph=True)
        return torch.autograd.grad(grads, xs, grad_outputs=vecs, allow_unused=True,
                                   materialize_grads=True)
    assert_close(hvp(f), hvp(f_ref))


@params
@causal
def test_maml_inner_step(case, causal):
    """Fast weights q' = q - lr·∂f/∂q, then the outer gradient through the inner step."""
    inputs, attn, attn_ref, f, f_ref = setup(case, causal)

    def outer(fn):
        xs = [t.clone().requires_grad_() for t in inputs]
        (gq,) = torch.autograd.grad(fn(*xs), xs[0], create_graph=True)
        fast_q = xs[0] - 0.1 * gq
        return torch.autograd.grad(fn(fast_q, *xs[1:]), xs, allow_unused=True,
                                   materialize_grads=True)
    assert_close(outer(f), outer(f_ref))


@params
@causal
def test_func_grad_and_vjp(case, causal):
    inputs, attn, attn_ref, f, f_ref = setup(case, causal)
    assert_close(grad(f, argnums=(0, 1, 2))(*inputs), grad(f_ref, argnums=(0, 1, 2))(*inputs))
    o_ours, pull = vjp(attn, *inputs)
    o_ref, pull_ref = vjp(attn_ref, *inputs)
    ct = torch.randn_like(o_ref)
    assert_close(o_ours, o_ref)
    assert_close(pull(ct), pull_ref(ct))


@params
@causal
def test_func_grad_grad(case, causal):
    inputs, attn, attn_ref, f, f_ref = setup(case, causal)

    def second(fn):   # d/dq of sum(∂f/∂q): differentiates the backward
        return grad(lambda q, k, v: grad(fn, argnums=0)(q, k, v).sum(), argnums=(0, 1, 2))(*inputs)
    assert_close(second(f), second(f_ref))


@params
@causal
def test_func_jvp_and_jvp_grad(case, causal):
    inputs, attn, attn_ref, f, f_ref = setup(case, causal)
    tangents = tuple(torch.randn_like(t) for t in inputs)
    assert_close(jvp(attn, inputs, tangents), jvp(attn_ref, inputs, tangents))
    g, g_ref = grad(f, argnums=(0, 1, 2)), grad(f_ref, argnums=(0, 1, 2))
    assert_close(jvp(g, inputs, tangents), jvp(g_ref, inputs, tangents))   # forward-over-reverse HVP


@params
@causal
def test_vmap_and_vmap_grad(case, causal):
    inputs, attn, attn_ref, f, f_ref = setup(case, causal)
    q, k, v = inputs
    qs = torch.stack([q, 2 * q, -q])          # vmap over queries only: k, v unbatched
    assert_close(vmap(attn, in_dims=(0, None, None))(qs, k, v),
                 vmap(attn_ref, in_dims=(0, None, None))(qs, k, v))
    ks, vs = torch.stack([k, k.flip(-1)]), torch.stack([v, 0.5 * v])
    per_sample = (0, 0, 0)
    assert_close(vmap(grad(f, argnums=(0, 1, 2)), in_dims=per_sample)(qs[:2], ks, vs),
                 vmap(grad(f_ref, argnums=(0, 1, 2)), in_dims=per_sample)(qs[:2], ks, vs))


@params
@causal
def test_hessian_and_jacrev_jacrev(case, causal):
    inputs, attn, attn_ref, f, f_ref = setup(case, causal)
    q, k, v = inputs
    assert_close(hessian(f)(q, k, v), hessian(f_ref)(q, k, v))            # jacfwd(jacrev)
    assert_close(jacrev(jacrev(f, argnums=1), argnums=1)(q, k, v),
                 jacrev(jacrev(f_ref, argnums=1), argnums=1)(q, k, v))


@pytest.mark.parametrize("form", ["folded", "chain"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_third_order_falls_back_to_exact_math(monkeypatch, causal, form):
    """Third order is unfused, but exact: d/dq of an HVP, through either form's BoB
    (docs/second-order.md) and its closed-form twin."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_FORM", form)
    settings.reload()
    inputs, _, _, f, f_ref = setup("gqa", causal)

    def third(fn):
        return grad(lambda q, k, v: grad(lambda *a: grad(fn, argnums=0)(*a).sum(), argnums=1)(q, k, v).sum(),
                    argnums=(0, 1, 2))(*inputs)
    assert_close(third(f), third(f_ref))


@pytest.mark.parametrize("case", ["gqa", "permuted", "no_leading_dims"])
def test_reverse_over_forward(case):
    """grad of a jvp, and jacrev(jacfwd): the tangent ops differentiated in reverse mode
    (through their exact math twins)."""
    inputs, attn, attn_ref, f, f_ref = setup(case, True)
    tangents = tuple(torch.randn_like(t) for t in inputs)

    def grad_of_jvp(fn):
        return grad(lambda *p: torch.sin(jvp(fn, p, tangents)[1]).sum(), argnums=(0, 1, 2))(*inputs)
    assert_close(grad_of_jvp(attn), grad_of_jvp(attn_ref))
    q, k, v = inputs
    assert_close(jacrev(torch.func.jacfwd(f, argnums=2), argnums=2)(q, k, v),
                 jacrev(torch.func.jacfwd(f_ref, argnums=2), argnums=2)(q, k, v))


@pytest.mark.parametrize("form", ["folded", "chain"])
@pytest.mark.parametrize("case", ["gqa", "permuted", "key_padding_mask"])
def test_forward_over_forward_and_over_second_order(monkeypatch, case, form):
    """Forward mode over a derivative op (jvp of the tangent ops, jacfwd(jacfwd), a jvp of
    a grad of a grad through either form's BoB): third order, through the exact math
    twins' forward mode."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_FORM", form)
    settings.reload()
    inputs, attn, attn_ref, f, f_ref = setup(case, True)
    q, k, v = inputs
    tq, tk, tv = (torch.randn_like(t) for t in inputs)

    def jvp_of_jvp(fn):
        return jvp(lambda v: jvp(lambda q, k: fn(q, k, v), (q, k), (tq, tk))[1], (v,), (tv,))[1]
    assert_close(jvp_of_jvp(attn), jvp_of_jvp(attn_ref))
    assert_close(torch.func.jacfwd(torch.func.jacfwd(f, argnums=1), argnums=1)(q, k, v),
                 torch.func.jacfwd(torch.func.jacfwd(f_ref, argnums=1), argnums=1)(q, k, v))

    def jvp_of_hvp(fn):
        def hvp(q, k, v):
            return grad(lambda *a: (grad(fn, argnums=(0, 1, 2))(*a)[0] * tq).sum(),
                        argnums=(0, 1, 2))(q, k, v)
        return jvp(hvp, inputs, (tq, tk, tv))[1]
    assert_close(jvp_of_hvp(f), jvp_of_hvp(f_ref))


def _record_first_backward_dq(monkeypatch):
    """Whether each folded BoB call got the first backward's dq (autograd keeps it: the row
    pass then reads R = dS k from it)."""
    from bob_compile.kernels import blockwise
    given, real = [], blockwise.bob_folded

    def recorded(*args):
        given.append(args[10] is not None)      # (q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params)
        return real(*args)
    monkeypatch.setattr(blockwise, "bob_folded", recorded)
    return given


@pytest.mark.parametrize("case", ["gqa", "key_padding_mask"])
def test_autograd_third_order_through_the_bob_that_read_dq(monkeypatch, case):
    """d/dq of an autograd HVP (create_graph twice): the BoB got dq from the first backward,
    and its own backward (the closed-form twin, which derives R itself) is still exact."""
    given = _record_first_backward_dq(monkeypatch)
    inputs, _, _, f, f_ref = setup(case, True)

    def third(fn):
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        gq, gk, gv = torch.autograd.grad(fn(q, k, v), (q, k, v), create_graph=True)
        hvp = torch.autograd.grad(gq.sum() + (gk * gk).sum() + gv.sum(), (q, k, v),
                                  create_graph=True)
        return torch.autograd.grad(sum((h * h).sum() for h in hvp), (q, k, v))
    assert_close(third(f), third(f_ref))
    assert given and all(given)


def test_dq_changed_in_place_before_the_second_grad(monkeypatch):
    """A dq modified in place after the first backward is not read (autograd's version
    counter says so): the BoB recomputes R, and the second order stays exact."""
    given = _record_first_backward_dq(monkeypatch)
    (q, k, v), kw = make_inputs("bhle_l_lt_s", True)

    def steps(attn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = attn(*leaves, **kw)
        dq, dk, dv = torch.autograd.grad(torch.sin(o).sum(), leaves, create_graph=True)
        first = torch.autograd.grad((dq * dq).sum() + (dk * dv).sum(), leaves, retain_graph=True)
        dq.mul_(2)
        second = torch.autograd.grad((dq * dq).sum() + (dk * dv).sum(), leaves)
        return first + second
    assert_close(steps(attention), steps(math_attention))
    assert given == [True, False]
