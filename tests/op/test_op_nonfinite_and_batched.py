"""Two ways the op once gave wrong answers without any error, in float64 against autograd
through plain math attention (bob_compile/kernels/reference.py: sdpa_math).

Batched cotangents: torch's legacy vmap (`is_grads_batched=True`, and `vectorize=True` in
torch.autograd.functional) dropped the graph of the fused steps, so a derivative taken there
with create_graph=True was silently constant. Every such derivative must stay exact when
differentiated again, and vectorize=True must agree with vectorize=False.

Non-finite inputs: a NaN must reach every output row that sees it (it came out as zeros), as
in SDPA; rows that see no key are zeros, never NaN; infinities give what SDPA's math path
gives.
"""
import functools
import logging

import pytest
import torch
from torch.autograd.functional import hessian, jacobian

from bob_compile.kernels.reference import sdpa_math as math_attention
from bob_compile import attention, autograd

TOL = 1e-10

# name -> (q shape, k shape, v shape, options): tiny, since every Jacobian row is a vmap lane
CASES = {
    "heads": ((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 3), {}),
    "gqa": ((1, 4, 5, 3), (1, 2, 6, 3), (1, 2, 6, 2), {"enable_gqa": True}),
}
cases = pytest.mark.parametrize("case", list(CASES))
causal_or_not = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])


def setup(case, causal):
    """(inputs, ours, math): the attention functions with the case's options bound."""
    qs, ks, vs, opts = CASES[case]
    inputs = tuple(torch.randn(s, dtype=torch.float64) for s in (qs, ks, vs))
    kw = dict(opts, is_causal=causal)
    return inputs, functools.partial(attention, **kw), functools.partial(math_attention, **kw)


def leaves(inputs):
    return tuple(t.clone().requires_grad_() for t in inputs)


def loss_of(attn, weight):
    """A scalar loss whose second derivative also runs through o (sin), not only attention."""
    return lambda q, k, v: (torch.sin(attn(q, k, v)) * weight).sum()


def assert_close(ours, ref):
    if isinstance(ref, torch.Tensor):
        assert ours.shape == ref.shape
        assert torch.isfinite(ours).all()
        assert (ours - ref).abs().max().item() <= TOL
    else:
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref):
            assert_close(a, b)


# ----------------------------------------------------------------------------- legacy vmap
def batched_grad_then_grad(attn, inputs, weights):
    """Rows of the Jacobian of sin(o) by is_grads_batched, then a gradient of a weighted sum
    of them: the second step differentiates the batched first one."""
    xs = leaves(inputs)
    o = torch.sin(attn(*xs))
    eye = torch.eye(o.numel(), dtype=o.dtype).view(-1, *o.shape)
    rows = torch.autograd.grad(o, xs, grad_outputs=eye, is_grads_batched=True, create_graph=True)
    assert all(r.requires_grad for r in rows), "the batched derivative lost its graph"
    second = torch.autograd.grad(sum((r * w).sum() for r, w in zip(rows, weights)), xs)
    return [r.detach() for r in rows], second


@cases
@causal_or_not
def test_is_grads_batched_then_second_grad(case, causal):
    inputs, attn, attn_ref = setup(case, causal)
    o_numel = attn_ref(*inputs).numel()
    weights = [torch.randn(o_numel, *t.shape, dtype=t.dtype) for t in inputs]
    assert_close(batched_grad_then_grad(attn, inputs, weights),
                 batched_grad_then_grad(attn_ref, inputs, weights))


def jacobian_penalty_gradient(attn, inputs, vectorize):
    """A Jacobian-norm penalty (as in gradient-penalty regularizers) and its gradient."""
    xs = leaves(inputs)
    jac = jacobian(attn, xs, create_graph=True, vectorize=vectorize)
    penalty = sum(j.pow(2).sum() for j in jac)
    return [j.detach() for j in jac], torch.autograd.grad(penalty, xs)


@cases
@causal_or_not
def test_jacobian_penalty_gradient(case, causal):
    inputs, attn, attn_ref = setup(case, causal)
    ours = jacobian_penalty_gradient(attn, inputs, vectorize=True)
    assert_close(ours, jacobian_penalty_gradient(attn_ref, inputs, vectorize=True))
    assert_close(ours, jacobian_penalty_gradient(attn, inputs, vectorize=False))


def hessian_and_its_gradient(f, inputs, **options):
    """The Hessian of leaves, and the gradient of its squared norm."""
    xs = leaves(inputs)
    h = hessian(f, xs, **options)
    flat = [h_ij for row in h for h_ij in row]
    return [t.detach() for t in flat], torch.autograd.grad(sum(t.pow(2).sum() for t in flat), xs)


@cases
@causal_or_not
def test_vectorized_hessian(case, causal):
    inputs, attn, attn_ref = setup(case, causal)
    weight = torch.randn_like(attn_ref(*inputs))
    f, f_ref = loss_of(attn, weight), loss_of(attn_ref, weight)
    plain = hessian(f, inputs, vectorize=True)
    assert_close(plain, hessian(f_ref, inputs, vectorize=True))
    assert_close(plain, hessian(f, inputs, vectorize=False))
    ours = hessian_and_its_gradient(f, inputs, create_graph=True, vectorize=True)
    assert_close(ours, hessian_and_its_gradient(f_ref, inputs, create_graph=True, vectorize=True))
    assert_close(ours, hessian_and_its_gradient(f, inputs, create_graph=True, vectorize=False))


@cases
@causal_or_not
def test_vectorized_forward_mode(case, causal):
    """Forward-mode Jacobian and forward-over-reverse Hessian under legacy vmap: the
    tangents keep their graph to inputs that require grad, as builtin ops' tangents do
    (torch refuses create_graph=True with forward mode, but this graph is there anyway)."""
    inputs, attn, attn_ref = setup(case, causal)

    def jacobian_and_its_gradient(fn):
        xs = leaves(inputs)
        jac = jacobian(fn, xs, strategy="forward-mode", vectorize=True)
        return [j.detach() for j in jac], torch.autograd.grad(sum(j.pow(2).sum() for j in jac), xs)
    assert_close(jacobian_and_its_gradient(attn), jacobian_and_its_gradient(attn_ref))
    weight = torch.randn_like(attn_ref(*inputs))
    over_reverse = dict(vectorize=True, outer_jacobian_strategy="forward-mode")
    assert_close(hessian_and_its_gradient(loss_of(attn, weight), inputs, **over_reverse),
                 hessian_and_its_gradient(loss_of(attn_ref, weight), inputs, **over_reverse))


@causal_or_not
def test_forward_under_legacy_vmap_keeps_its_graph(causal):
    """The mechanism behind is_grads_batched, called directly on the forward."""
    (q, k, v), attn, attn_ref = setup("gqa", causal)
    qs = torch.stack([q, 2 * q, -q])

    def grads(fn):
        xs = leaves((qs, k, v))
        o = torch._vmap_internals._vmap(lambda q_: fn(q_, *xs[1:]))(xs[0])
        return torch.autograd.grad(torch.sin(o).sum(), xs)
    assert_close(grads(attn), grads(attn_ref))


def test_without_create_graph_the_fused_ops_run(monkeypatch, caplog):
    """The exact-math twins are for derivatives that will be differentiated again; a batched
    derivative that will not be keeps the fused ops. The switch is logged once."""
    def forbidden(*args):
        raise AssertionError("the unfused twin ran without create_graph")
    inputs, attn, attn_ref = setup("heads", True)
    with monkeypatch.context() as patch:
        for name in ("_backward_twin", "_bob_twin", "_forward_jvp_twin", "_backward_jvp_twin"):
            patch.setattr(autograd, name, forbidden)
        weight = torch.randn_like(attn_ref(*inputs))
        assert_close(hessian(loss_of(attn, weight), inputs, vectorize=True),
                     hessian(loss_of(attn_ref, weight), inputs, vectorize=True))

    monkeypatch.setattr(autograd, "_legacy_vmap_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="bob_compile.autograd"):
        weights = [torch.randn(30, *t.shape, dtype=t.dtype) for t in inputs]
        batched_grad_then_grad(attn, inputs, weights)
        batched_grad_then_grad(attn, inputs, weights)
    assert [r.getMessage().count("legacy vmap") for r in caplog.records] == [1]


# ----------------------------------------------------------------------------- NaN and inf
L, S = 7, 7   # conftest's tiles (4 queries x 3 keys) put row 3 / key 3 mid-tile
ROW, KEY = 3, 3


def nonfinite_inputs(where, value):
    """(q, k, v) with `value` at query ROW (where="q") or key KEY (where="k" or "v")."""
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (L, S, S))
    target = {"q": q, "k": k, "v": v}[where]
    target[0, 1, ROW if where == "q" else KEY, 1] = value
    return q, k, v


def rows_that_see(where, causal):
    """Output rows (of batch 0, head 1) that see the planted value."""
    if where == "q":
        return torch.arange(L) == ROW
    return torch.arange(L) >= KEY if causal else torch.ones(L, dtype=torch.bool)


def assert_same_values(ours, ref):
    """Non-finite at the same places and of the same kind; equal elsewhere."""
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    assert torch.equal(torch.isposinf(ours), torch.isposinf(ref))
    assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert (ours[finite] - ref[finite]).abs().max().item() <= TOL


def loss_and_grads(attn, inputs, weight):
    xs = leaves(inputs)
    loss = (attn(*xs) * weight).sum()
    return loss.detach(), torch.autograd.grad(loss, xs)


nonfinite_place = pytest.mark.parametrize("where", ["q", "k", "v"])


@nonfinite_place
@causal_or_not
def test_nan_reaches_every_row_that_sees_it(where, causal):
    q, k, v = nonfinite_inputs(where, float("nan"))
    o = attention(q, k, v, is_causal=causal)
    o_ref = math_attention(q, k, v, is_causal=causal)
    sees = rows_that_see(where, causal)
    assert torch.isnan(o[0, 1, sees]).any(-1).all(), "a row that sees the NaN is not NaN"
    if where != "v":
        # a NaN value also reaches rows that give it probability 0 (0 * NaN), in SDPA's math
        # path everywhere and here in a partly masked tile; queries and keys never do
        assert torch.isfinite(o[0, 1, ~sees]).all()
        assert torch.isfinite(o[:, 0]).all()
        assert_same_values(o, o_ref)

    weight = torch.randn_like(o_ref)
    loss, grads = loss_and_grads(attention, (q, k, v), weight)
    assert not torch.isfinite(loss)
    dq = grads[0]
    assert torch.isnan(dq[0, 1, sees]).any(-1).all(), "dq is finite on a row that sees the NaN"
    assert torch.isfinite(dq[:, 0]).all() and torch.isfinite(grads[1][:, 0]).all()
    if not causal:   # with a mask, math attention also spreads NaN through masked pairs (0 * NaN)
        _, grads_ref = loss_and_grads(math_attention, (q, k, v), weight)
        for g, g_ref in zip(grads, grads_ref):
            assert_same_values(g, g_ref)


@causal_or_not
def test_nan_query_that_sees_no_key_gives_zeros(causal):
    """No key (S == 0): zeros, never NaN, even for a NaN query, like SDPA."""
    q = torch.full((1, 2, 4, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 0, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 0, 5, dtype=torch.float64, requires_grad=True)
    o = attention(q, k, v, is_causal=causal)
    assert torch.equal(o, torch.zeros(1, 2, 4, 5, dtype=torch.float64))
    dq, = torch.autograd.grad(o.sum(), q)
    assert torch.equal(dq, torch.zeros_like(q))


@nonfinite_place
@pytest.mark.parametrize("value", [float("inf"), -float("inf")], ids=["+inf", "-inf"])
@causal_or_not
def test_infinities_give_what_math_attention_gives(where, value, causal):
    q, k, v = nonfinite_inputs(where, value)
    assert_same_values(attention(q, k, v, is_causal=causal),
                       math_attention(q, k, v, is_causal=causal))
    if not causal:   # see test_nan_reaches_every_row_that_sees_it
        weight = torch.randn(1, 2, L, 4, dtype=torch.float64)
        _, grads = loss_and_grads(attention, (q, k, v), weight)
        _, grads_ref = loss_and_grads(math_attention, (q, k, v), weight)
        for g, g_ref in zip(grads, grads_ref):
            assert_same_values(g, g_ref)


def test_row_whose_scores_are_all_minus_inf_is_zero_like_sdpa():
    """Every score of row ROW is -inf (a -inf query entry against positive key entries):
    SDPA's math path gives that row zeros (its safe softmax), and so do we."""
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (L, S, S))
    q[0, 1, ROW] = torch.tensor([-float("inf"), 0.0, 0.0, 0.0])
    k[..., 0] = k[..., 0].abs() + 0.1
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o_sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    o = attention(q, k, v)
    assert torch.equal(o[0, 1, ROW], torch.zeros(4, dtype=torch.float64))
    assert_same_values(o, o_sdpa)
