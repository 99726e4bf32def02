"""The attention passes on Dynamo-captured graphs: what is replaced, what must not be, and why.

Graphs are captured with a recording backend, rewritten by `rewrite_attention`, then run:
replaced sites must match SDPA math in float64, untouched ones must keep their nodes and
say why in the report.
"""
import copy
import operator
import re

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch.nn.attention import SDPBackend, sdpa_kernel

from bob_compile import _compat
from bob_compile.attention import attention
from bob_compile.kernels import reference
from bob_compile.passes import rewrite_attention
from bob_compile.passes.inference import use_native_sdpa
from bob_compile.passes.causal_mask import CausalTensorGuard, failing_guards
from attention_patterns import (MASKED_PATTERNS, MUST_NOT_MATCH, PATTERNS, RANDOM_PATTERNS,
                                SOFTCAPPED_PATTERNS)

B, H, L, E = 2, 2, 8, 4


def capture(fn, *args, dynamic=False):
    """The Dynamo graph(s) of fn(*args) and their example inputs, untouched."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append((copy.deepcopy(gm), list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=record, fullgraph=True, dynamic=dynamic)(*args)
    assert len(graphs) == 1
    return graphs[0]


def attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is attention]


def qkv(seed=0, lq=L, lk=L):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, E, generator=g, dtype=torch.float64) for n in (lq, lk, lk)]


def nanogpt_bias(n=16, dtype=torch.float64):
    return torch.tril(torch.ones(n, n, dtype=dtype)).view(1, 1, n, n)


def run_graph(gm, inputs):
    out = gm(*inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_is_replaced_and_exact(name):
    pattern, is_causal = PATTERNS[name]
    q, k, v = qkv()
    gm, inputs = capture(pattern, q, k, v, nanogpt_bias())
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True], report.text()
    (node,) = attention_nodes(gm)
    assert node.kwargs["is_causal"] is is_causal
    assert node.kwargs["scale"] == pytest.approx(E ** -0.5)
    assert not any(n.target in (F.softmax, torch.softmax) or n.target == "softmax"
                   for n in gm.graph.nodes), "the softmax must be gone"
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", sorted(RANDOM_PATTERNS))
def test_dropout_pattern_is_replaced_with_its_dropout(name):
    """The probabilities' active dropout goes into the op, which draws its own mask: the
    graph equals the op with that dropout, given the same generator state."""
    pattern, p = RANDOM_PATTERNS[name]
    q, k, v = qkv()
    gm, inputs = capture(pattern, q, k, v, nanogpt_bias())
    (site,) = rewrite_attention(gm, inputs).sites
    assert site.replaced and site.dropout == p and f"dropout_p={p:g}" in site.line()
    (node,) = attention_nodes(gm)
    assert node.kwargs["dropout_p"] == p
    assert not any(n.target is F.dropout for n in gm.graph.nodes), "the dropout must be gone"
    torch.manual_seed(3)
    ours = run_graph(gm, inputs)
    torch.manual_seed(3)
    expected = attention(q, k, v, dropout_p=p, scale=node.kwargs["scale"])
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(MASKED_PATTERNS))
def test_masked_pattern_is_replaced_with_its_mask_and_exact(name):
    """Not causal, so passed on as attn_mask: the written code's values and gradients
    (first and second order) whatever the mask holds."""
    pattern = MASKED_PATTERNS[name]
    q, k, v = qkv(lq=4) if name == "bottom_right_causal" else qkv()
    gm, inputs = capture(pattern, q, k, v, nanogpt_bias())
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    assert site.replaced and "mask=" in site.line(), report.text()
    (node,) = attention_nodes(gm)
    assert node.kwargs["is_causal"] is False and node.kwargs["attn_mask"] is not None

    def second_order(fn):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*xs, nanogpt_bias())
        grads = torch.autograd.grad(out.sin().sum(), xs, create_graph=True)
        return (out, *torch.autograd.grad(sum(g.square().sum() for g in grads), xs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(inputs)

    def compiled(q_, k_, v_, bias):
        # the graph's inputs in capture order, with q, k, v swapped for the differentiable ones
        swap = {id(q): q_, id(k): k_, id(v): v_}
        return run_graph(gm, [swap.get(id(t), t) for t in inputs])
    for ours, expected in zip(second_order(compiled), second_order(pattern)):
        torch.testing.assert_close(ours, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", sorted(SOFTCAPPED_PATTERNS))
def test_soft_capped_pattern_is_replaced_with_its_cap_and_exact(name):
    """c * tanh(scores / c) before the mask (Gemma 2): the op's softcap, the tanh and its
    factors gone, values and first and second derivatives those of math with the cap."""
    pattern, is_causal, cap = SOFTCAPPED_PATTERNS[name]
    q, k, v = (t * 4 for t in qkv())        # scores of several units: the cap bends them
    gm, inputs = capture(pattern, q, k, v, nanogpt_bias())
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    assert site.replaced and f"softcap={cap:g}" in site.line(), report.text()
    (node,) = attention_nodes(gm)
    assert node.kwargs["softcap"] == pytest.approx(cap)
    assert node.kwargs["is_causal"] is is_causal
    assert node.kwargs["scale"] == pytest.approx(E ** -0.5)
    assert not any(n.target is torch.tanh or n.target == "tanh" for n in gm.graph.nodes)

    def second_order(fn):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        grads = torch.autograd.grad(out.sin().sum(), xs, create_graph=True)
        return (out, *torch.autograd.grad(sum(g.square().sum() for g in grads), xs))
    positions = [next(i for i, t in enumerate(inputs) if t is x) for x in (q, k, v)]

    def compiled(*qkv_):
        args = list(inputs)
        for i, t in zip(positions, qkv_):
            args[i] = t
        return run_graph(gm, args)
    # (the written code's float32 softmax, in Gemma's case, is not the yardstick: math is)
    expected = second_order(lambda q, k, v: reference.sdpa_math(
        q, k, v, is_causal=is_causal, scale=E ** -0.5, softcap=cap))
    for ours, want in zip(second_order(compiled), expected):
        torch.testing.assert_close(ours, want, atol=1e-10, rtol=0)
    # a graph nothing differentiates keeps the op: SDPA has no cap
    use_native_sdpa(gm)
    assert len(attention_nodes(gm)) == 1


@pytest.mark.parametrize("name", sorted(MUST_NOT_MATCH))
def test_must_not_match(name):
    pattern, reason = MUST_NOT_MATCH[name]
    q, k, v = qkv(lq=4) if name == "bottom_right_causal" else qkv()
    gm, inputs = capture(pattern, q, k, v, nanogpt_bias())
    before = gm.print_readable(print_output=False)
    expected = pattern(q, k, v, nanogpt_bias())
    report = rewrite_attention(gm, inputs)
    assert not report.replaced and not attention_nodes(gm)
    assert gm.print_readable(print_output=False) == before
    if reason == "no softmax":
        assert not report.sites
    else:
        (site,) = report.sites
        assert reason in site.reason, site.reason
    if name != "dropout_in_place":  # random
        torch.testing.assert_close(run_graph(gm, inputs),
                                   expected[0] if isinstance(expected, tuple) else expected)


# ---------------------------------------------------------------------------- SDPA
def sdpa_with(mask=False, **kwargs):
    def f(q, k, v, attn_mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask if mask else None, **kwargs)
    return f


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True), dict(scale=0.3), dict(is_causal=True, scale=0.7),
    dict(attn_mask=None, dropout_p=0.0, is_causal=False), dict(enable_gqa=True),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sdpa_is_replaced(kwargs):
    q, k, v = qkv()
    if kwargs.get("enable_gqa"):
        k, v = k[:, :1], v[:, :1]
    gm, inputs = capture(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs), q, k, v)
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True]
    (node,) = attention_nodes(gm)
    assert node.kwargs == {"is_causal": kwargs.get("is_causal", False),
                           "scale": kwargs.get("scale"), "enable_gqa": kwargs.get("enable_gqa", False)}
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)


def test_sdpa_causal_attn_mask_becomes_is_causal():
    # HF sdpa_attention_forward passes the causal mask it built, as a bool or additive mask.
    def f(q, k, v):
        T = q.shape[-2]
        visible = torch.ones(T, T, dtype=torch.bool).tril()
        additive = torch.zeros(T, T, dtype=q.dtype).masked_fill(~visible, float("-inf"))
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=visible),
                F.scaled_dot_product_attention(q, k, v, attn_mask=additive[None, None]))
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v)
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True, True]
    assert [n.kwargs["is_causal"] for n in attention_nodes(gm)] == [True, True]
    assert not any(n.target in (torch.ones, torch.zeros) for n in gm.graph.nodes), "mask nodes erased"
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for out in gm(*inputs):
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_sdpa_arbitrary_mask_is_passed_on():
    """A mask that is not causal (here a graph input) becomes attention's attn_mask."""
    q, k, v = qkv()
    mask = torch.rand(L, L, dtype=torch.float64) > 0.5
    gm, inputs = capture(sdpa_with(mask=True), q, k, v, mask)
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    assert site.replaced and "mask=attn_mask" in site.line() and "not causal: graph input" in site.line()
    (node,) = attention_nodes(gm)
    assert node.kwargs["is_causal"] is False and node.kwargs["attn_mask"] is not None
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)


@pytest.mark.skipif(not _compat.sdpa_takes_mask_with_is_causal(),
                    reason="this torch refuses attn_mask with is_causal=True in SDPA itself")
def test_sdpa_mask_and_is_causal_both_apply():
    """A mask with is_causal=True: both apply (PyTorch's fused kernels combine them; SDPA's
    math path refuses the pair), so the site is replaced with both."""
    q, k, v = qkv()
    mask = torch.rand(L, L, dtype=torch.float64) > 0.5
    mask.fill_diagonal_(True)
    gm, inputs = capture(sdpa_with(mask=True, is_causal=True), q, k, v, mask)
    (site,) = rewrite_attention(gm, inputs).sites
    assert site.replaced and site.is_causal and "mask=attn_mask" in site.line()
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask & torch.ones(L, L, dtype=torch.bool).tril())
    torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_dropout_is_passed_on(causal):
    """SDPA's dropout_p goes to the op, which draws its own mask: the graph equals the op
    with that dropout, given the same generator state."""
    q, k, v = qkv()
    gm, inputs = capture(sdpa_with(dropout_p=0.25, is_causal=causal), q, k, v, nanogpt_bias())
    (site,) = rewrite_attention(gm, inputs).sites
    assert site.replaced and site.dropout == 0.25
    (node,) = attention_nodes(gm)
    assert node.kwargs["dropout_p"] == 0.25 and node.kwargs["is_causal"] is causal
    torch.manual_seed(5)
    ours = run_graph(gm, inputs)
    torch.manual_seed(5)
    torch.testing.assert_close(ours, attention(q, k, v, dropout_p=0.25, is_causal=causal),
                               atol=0, rtol=0)


def test_torch_2_11_spelling_of_eq():
    """torch 2.11 records `mask == 0` as call_method __eq__ (2.13: operator.eq)."""
    q, k, v = qkv()
    gm, inputs = capture(PATTERNS["nanogpt"][0], q, k, v, nanogpt_bias())
    (eq,) = [n for n in gm.graph.nodes if n.target in (operator.eq, "__eq__")]
    if eq.target is operator.eq:   # torch 2.13 captured it: respell it as 2.11 records it
        with gm.graph.inserting_before(eq):
            dunder = gm.graph.call_method("__eq__", eq.args)
        dunder.meta = dict(eq.meta)
        eq.replace_all_uses_with(dunder)
        gm.graph.erase_node(eq)
        gm.recompile()
    assert [n.op for n in gm.graph.nodes if n.target == "__eq__"] == ["call_method"]
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True], report.text()
    assert attention_nodes(gm)[0].kwargs["is_causal"] is True


@pytest.mark.parametrize("spelling", ["matmul_fn", "method", "div", "rmul", "scale_on_k", "no_transpose"])
def test_operator_spellings(spelling):
    def f(q, k, v):
        T = q.shape[-2]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        if spelling == "matmul_fn":
            s = torch.matmul(q, torch.transpose(k, -1, -2)) * 0.5
        elif spelling == "method":
            s = q.matmul(k.swapaxes(-2, -1)).mul(0.5)
        elif spelling == "div":
            s = torch.div(q @ k.permute(0, 1, 3, 2), 2.0)
        elif spelling == "rmul":
            s = 0.5 * (q @ k.mT)
        elif spelling == "scale_on_k":
            s = q @ (k.transpose(-2, -1) * 0.5)
        else:  # keys already laid out as k^T, as GPT-2's split_heads(k, k=True) did
            s = (q @ k.permute(0, 1, 3, 2).contiguous()) * 0.5
        s = torch.where(mask, s, float("-inf"))
        return torch.softmax(s, dim=3) @ v
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v)
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True], report.text()
    (node,) = attention_nodes(gm)
    assert node.kwargs["scale"] == 0.5 and node.kwargs["is_causal"] is True
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("scale_first", [True, False])
def test_negative_scale_only_before_the_mask(scale_first):
    def f(q, k, v):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        s = q @ k.transpose(-2, -1)
        if scale_first:
            s = (s * -0.5).masked_fill(mask, float("-inf"))
        else:  # -inf * -0.5 = +inf: not a mask any more
            s = s.masked_fill(mask, float("-inf")) * -0.5
        return s.softmax(-1) @ v
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v)
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    if scale_first:
        assert site.replaced and attention_nodes(gm)[0].kwargs["scale"] == -0.5
        with sdpa_kernel(SDPBackend.MATH):
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=-0.5)
        torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)
    else:
        assert not site.replaced and "which is not positive" in site.reason, site.reason


def test_symbolic_scale_under_dynamic_shapes():
    # With dynamic shapes nanoGPT's 1/sqrt(k.size(-1)) is computed in the graph.
    q, k, v = qkv()
    gm, inputs = capture(PATTERNS["nanogpt"][0], q, k, v, nanogpt_bias(), dynamic=True)
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True], report.text()
    scale = attention_nodes(gm)[0].kwargs["scale"]
    assert isinstance(scale, torch.fx.Node), "scale should stay a graph value"
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------- causal masks
CAUSAL_MASKS = {
    # name: (scores -> masked scores), all top-left causal
    "tril_ones_eq0": lambda s, T: s.masked_fill(torch.tril(torch.ones(T, T)) == 0, float("-inf")),
    "triu_bool": lambda s, T: s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")),
    "not_tril": lambda s, T: s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")),
    "logical_not": lambda s, T: s.masked_fill(torch.ones(T, T).tril().bool().logical_not(), float("-inf")),
    "arange_lt": lambda s, T: s.masked_fill(torch.arange(T)[:, None] < torch.arange(T)[None, :], float("-inf")),
    "arange_ge_where": lambda s, T: torch.where(torch.arange(T).view(-1, 1) >= torch.arange(T), s, -1e30),
    "arange_shifted": lambda s, T: s.masked_fill(torch.arange(1, T + 1)[None, :] > torch.arange(T)[:, None] + 1, float("-inf")),
    "additive_triu_min": lambda s, T: s + torch.triu(torch.full((T, T), torch.finfo(s.dtype).min, dtype=s.dtype), 1),
    "additive_one_minus": lambda s, T: s + (1.0 - torch.tril(torch.ones(T, T, dtype=s.dtype))) * torch.finfo(s.dtype).min,
    "additive_where": lambda s, T: s + torch.where(torch.ones(T, T, dtype=torch.bool).tril(), 0.0, float("-inf")),
    "sliced_big_tril": lambda s, T: s.masked_fill(torch.ones(32, 32).tril()[None, None, :T, :T] == 0, float("-inf")),
}
NOT_CAUSAL_MASKS = {
    "tril_diagonal_1": (lambda s, T: s.masked_fill(torch.ones(T, T).tril(1) == 0, float("-inf")), "j <= i+1"),
    "triu_0": (lambda s, T: s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(), float("-inf")), "j <= i-1"),
    "anti_causal": (lambda s, T: s.masked_fill(torch.ones(T, T).tril() == 1, float("-inf")), "not causal"),
    "arange_eq": (lambda s, T: s.masked_fill(torch.arange(T)[:, None] == torch.arange(T)[None, :], float("-inf")), "row and a column"),
    "fill_minus_one": (lambda s, T: s.masked_fill(torch.ones(T, T).tril() == 0, -1.0), "fill value"),
    "slice_offset": (lambda s, T: s.masked_fill(torch.ones(32, 32).tril()[2:T + 2, :T] == 0, float("-inf")), "offset"),
    "row_broadcast": (lambda s, T: s.masked_fill(torch.ones(1, T).tril() == 0, float("-inf")), "does not end in"),
    "random": (lambda s, T: s.masked_fill(torch.rand(T, T) > 0.5, float("-inf")), "not something"),
}


def masked_attention(mask_fn):
    def f(q, k, v):
        s = (q @ k.transpose(-2, -1)) * 0.5
        return F.softmax(mask_fn(s, q.shape[-2]), dim=-1) @ v
    return f


@pytest.mark.parametrize("name", sorted(CAUSAL_MASKS))
def test_causal_mask_built_in_graph_is_proven(name):
    q, k, v = qkv()
    gm, inputs = capture(masked_attention(CAUSAL_MASKS[name]), q, k, v)
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True], report.text()
    assert report.sites[0].causal_proof == "mask built in the graph" and not report.guards
    assert [n.op for n in gm.graph.nodes] == ["placeholder"] * len(inputs) + ["call_function", "output"], \
        "the mask's nodes must be erased"
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", sorted(NOT_CAUSAL_MASKS))
def test_other_masks_are_not_causal(name):
    """Not proven causal (the report says why), so passed on as a general mask: the written
    code's values, except rows that see no key (NaN in plain softmax), which are zeros as in
    SDPA. A fill that does not hide its key (-1.0) leaves the site as written."""
    mask_fn, reason = NOT_CAUSAL_MASKS[name]
    torch.manual_seed(0)
    q, k, v = qkv()
    gm, inputs = capture(masked_attention(mask_fn), q, k, v)
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    if name == "fill_minus_one":
        assert not site.replaced and reason in site.reason, site.reason
        return
    assert site.replaced and not site.is_causal and reason in site.mask, site.line()
    torch.manual_seed(0)     # the random mask draws again when the graph runs
    ours = run_graph(gm, inputs)
    torch.manual_seed(0)
    written = masked_attention(mask_fn)(q, k, v)
    empty = written.isnan().all(-1, keepdim=True)
    torch.testing.assert_close(ours, written.masked_fill(empty, 0.0), atol=1e-12, rtol=0)


def test_mask_shared_by_two_layers():
    # Hugging Face builds one causal mask per forward and adds it in every layer.
    def f(q, k, v):
        T = q.shape[-2]
        mask = torch.triu(torch.full((T, T), float("-inf"), dtype=q.dtype), diagonal=1)
        h = F.softmax(q @ k.transpose(-2, -1) * 0.5 + mask, dim=-1) @ v
        return F.softmax(h @ k.transpose(-2, -1) * 0.5 + mask, dim=-1) @ v
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v)
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True, True], report.text()
    assert not any(n.target in (torch.full, torch.triu) for n in gm.graph.nodes)
    with sdpa_kernel(SDPBackend.MATH):
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
        expected = F.scaled_dot_product_attention(h, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)


def test_rank_2_inputs():
    def f(q, k, v):
        return torch.softmax(q @ k.T / 2.0, dim=-1) @ v
    q, k, v = (t[0, 0] for t in qkv())
    q.requires_grad_()
    gm, inputs = capture(f, q, k, v)
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True], report.text()
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "transpose"]
    out = run_graph(gm, inputs)
    (dq,) = torch.autograd.grad(out.square().sum(), q)
    torch.testing.assert_close(out, f(q, k, v), atol=1e-12, rtol=0)
    torch.testing.assert_close(dq, torch.autograd.grad(f(q, k, v).square().sum(), q)[0], atol=1e-12, rtol=0)


def test_causal_buffer_guard():
    bias = nanogpt_bias()
    q, k, v = qkv()
    gm, inputs = capture(PATTERNS["nanogpt"][0], q, k, v, bias)
    report = rewrite_attention(gm, inputs)
    (guard,) = report.guards
    assert isinstance(guard, CausalTensorGuard) and guard.holds(inputs)
    assert guard.holds(inputs), "second check: the cached fast path"
    bias[0, 0, 0, 3] = 1.0  # in place: the version counter changes
    assert not guard.holds(inputs)
    bias[0, 0, 0, 3] = 0.0
    assert guard.holds(inputs)
    swapped = list(inputs)
    swapped[next(i for i, t in enumerate(inputs) if t is bias)] = torch.ones_like(bias)
    assert not guard.holds(swapped)


def test_guards_of_a_graph_are_checked_together():
    bias, other = nanogpt_bias(), nanogpt_bias()
    guards = [CausalTensorGuard(0, "a", 1.0, 0.0), CausalTensorGuard(1, "b", 1.0, 0.0),
              CausalTensorGuard(0, "a again", 1.0, 0.0), CausalTensorGuard(2, "not a tensor", 1.0, 0.0)]
    assert failing_guards(guards, (bias, other, None)) == guards[3:]
    other[..., 0, 1] = 1.0
    assert failing_guards(guards, (bias, other, None)) == [guards[1], guards[3]]
    assert failing_guards(guards[:1], (other,)) == guards[:1]


def test_buffer_that_is_not_causal_is_passed_on():
    """No causal kernels and no guard: the buffer is read as a mask on every call."""
    q, k, v = qkv()
    buffer = torch.ones(1, 1, 16, 16)
    gm, inputs = capture(PATTERNS["nanogpt"][0], q, k, v, buffer)
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    assert site.replaced and "is not a lower-triangular mask" in site.mask and not report.guards
    torch.testing.assert_close(run_graph(gm, inputs), PATTERNS["nanogpt"][0](q, k, v, buffer),
                               atol=1e-12, rtol=0)
    buffer[..., 3] = 0       # read at run time: still what the written code gives
    torch.testing.assert_close(run_graph(gm, inputs), PATTERNS["nanogpt"][0](q, k, v, buffer),
                               atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------- masks written in place
def _bool_causal(q):
    T = q.shape[-2]
    return torch.ones(q.shape[0], 1, T, T, dtype=torch.bool).tril()


def _set_last_keys(keep):
    keep[0, :, :, -3:] = False


def _fill_through_view(keep):
    keep.view(keep.shape[0], -1)[:, :3].fill_(False)


def _out_argument(keep):
    torch.logical_and(keep, torch.zeros_like(keep), out=keep)


def _in_place_operator(keep):
    keep &= torch.zeros_like(keep)


def _in_place_method(keep):
    keep.logical_not_()


def _through_data(keep):
    keep.data[1, 0, 0, 1] = True


def _aten_in_place(keep):
    torch.ops.aten.fill_.Scalar(keep, True)


# The mask is built causal in the graph, then edited before the attention reads it: the
# proof must see the write and refuse (issue: a hand-edited mask was taken for causal).
MASK_WRITES = {
    "setitem": _set_last_keys,
    "fill_through_view": _fill_through_view,
    "out_argument": _out_argument,
    "in_place_operator": _in_place_operator,
    "in_place_method": _in_place_method,
    "through_data": _through_data,
    "aten_in_place": _aten_in_place,
}


@pytest.mark.parametrize("name", sorted(MASK_WRITES))
@pytest.mark.parametrize("where", ["sdpa", "handwritten"])
def test_mask_written_in_place_is_not_causal(name, where):
    write = MASK_WRITES[name]

    def f(q, k, v):
        keep = _bool_causal(q)
        write(keep)
        if where == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return F.softmax((q @ k.transpose(-2, -1) * 0.5).masked_fill(~keep, float("-inf")), dim=-1) @ v
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v)
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    # not provably causal, so passed on as a mask: exact whatever was written
    assert site.replaced and "writes in place to" in site.mask, site.line()
    (node,) = attention_nodes(gm)
    assert node.kwargs["is_causal"] is False and node.kwargs["attn_mask"] is not None
    with sdpa_kernel(SDPBackend.MATH):
        written = f(q, k, v)
    empty = written.isnan().all(-1, keepdim=True)     # rows that see no key: zeros, as SDPA
    torch.testing.assert_close(run_graph(gm, inputs), written.masked_fill(empty, 0.0),
                               atol=1e-12, rtol=0)


def test_writes_to_other_tensors_do_not_block_the_proof():
    def f(q, k, v):
        keep = _bool_causal(q)
        scratch = torch.zeros(3)
        scratch.add_(1.0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep), scratch
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v)
    assert [s.replaced for s in rewrite_attention(gm, inputs).sites] == [True]


def test_causal_buffer_written_in_the_graph_is_not_trusted():
    def f(q, k, v, bias):
        # the forward writes the buffer before reading it (a no-op on these values, so the
        # buffer still looks causal when compiling: only the write can tell)
        bias[:, :, 0, 0] = q[0, 0, 0, 0].detach() * 0 + 1
        return PATTERNS["nanogpt"][0](q, k, v, bias)
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v, nanogpt_bias())
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    assert site.replaced and not site.is_causal and "writes in place to" in site.mask
    assert not report.guards     # read as a mask on every call, not trusted as causal


# ---------------------------------------------------------------------------- what counts as a site
def capped_by_a_computed_factor(q, k, v):
    # a soft-cap whose factor is computed from the values: not a constant cap (left alone)
    scores = (q @ k.transpose(-2, -1)) * 0.5
    cap = v.detach().abs().amax() + 1.0
    scores = torch.tanh(scores / cap) * cap
    return F.softmax(scores, dim=-1) @ v


def with_long_chain(q, k, v):
    # many score ops between the product and the softmax, and an unsupported bias at the end
    scores = (q @ k.transpose(-2, -1)).float().double() * 0.5 / 1.0 * 1.0
    return F.softmax(scores + torch.cos(scores.detach()), dim=-1) @ v


@pytest.mark.parametrize("pattern", [capped_by_a_computed_factor, with_long_chain],
                         ids=lambda f: f.__name__)
def test_every_softmax_over_attention_scores_is_reported(pattern):
    q, k, v = qkv()
    gm, inputs = capture(pattern, q, k, v)
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    assert not site.replaced and site.reason
    assert "0 attention site(s) replaced, 1 skipped" in report.text()


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(E, 3)
        self.weight = torch.nn.Parameter(torch.randn(E, 3, dtype=torch.float64))

    def forward(self, h):
        return F.softmax(self.head(h), dim=-1), F.softmax(h @ self.weight, dim=-1)


def test_softmax_over_logits_is_not_an_attention_site():
    """A softmax over a product with a parameter (a classifier's logits) is not attention,
    nor is one whose input an attention computed several layers back."""
    model = Classifier().double()

    def f(q, k, v):
        h = F.scaled_dot_product_attention(q, k, v)
        return model(torch.nn.functional.layer_norm(h, (E,)))
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v)
    report = rewrite_attention(gm, inputs)
    assert [s.kind for s in report.sites] == ["sdpa"] and report.sites[0].replaced, report.text()


def test_attention_in_a_checkpointed_body_is_rewritten():
    def block(q, k, v, bias):
        return PATTERNS["nanogpt"][0](q, k, v, bias) + F.scaled_dot_product_attention(q, k, v)

    def f(q, k, v, bias):
        return torch.utils.checkpoint.checkpoint(block, q, k, v, bias, use_reentrant=False)
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v, nanogpt_bias())
    report = rewrite_attention(gm, inputs)
    assert [(s.node.split(".")[0], s.replaced) for s in report.sites] == [("wrap_body_0", True)] * 2
    assert report.sites[1].causal_proof.startswith("mask from l_bias_"), report.text()
    assert len(report.guards) == 1 and report.guards[0].holds(inputs)
    body = gm.wrap_body_0
    assert len(attention_nodes(body)) == 2 and not attention_nodes(gm)
    with sdpa_kernel(SDPBackend.MATH):
        expected = block(q, k, v, nanogpt_bias())
    torch.testing.assert_close(run_graph(gm, inputs), expected, atol=1e-12, rtol=0)


def test_attention_in_other_higher_order_ops_is_reported():
    mha = torch.nn.MultiheadAttention(E, 1).double()

    def f(q, k, v):
        return torch.cond(q.sum() > 0, lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                          lambda q, k, v: F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
                          + mha(q[0], k[0], v[0], need_weights=False)[0], (q, k, v))
    q, k, v = qkv()
    gm, inputs = capture(f, q, k, v)
    before = gm.print_readable(print_output=False)
    report = rewrite_attention(gm, inputs)
    assert gm.print_readable(print_output=False) == before
    assert sorted(s.kind for s in report.sites) == ["handwritten", "multihead", "sdpa"]
    assert all(not s.replaced and "inside cond" in s.reason for s in report.sites), report.text()


def test_flex_attention_is_reported():
    from torch.nn.attention.flex_attention import flex_attention

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda score, b, h, i, j: score * 2)
    q, k, v = (t.float() for t in qkv())
    gm, inputs = capture(f, q, k, v)
    report = rewrite_attention(gm, inputs)
    (site,) = report.sites
    assert site.kind == "flex_attention" and not site.replaced and "score_mod" in site.reason


# ---------------------------------------------------------------------------- graph hygiene
def test_functorch_side_effect_nodes_survive():
    """Only matched nodes are erased: graph-wide DCE would drop these user-less calls."""
    def f(q):
        def loss(q):
            return (F.softmax((q @ q.transpose(-2, -1)) * 0.5, dim=-1) @ q).square().sum()
        return torch.func.grad(loss)(q)
    q, _, _ = qkv()
    gm, inputs = capture(f, q)
    side_effects = [n.target for n in gm.graph.nodes if n.op == "call_function" and not n.users]
    assert side_effects, "expected functorch calls without users"
    report = rewrite_attention(gm, inputs)
    assert [s.replaced for s in report.sites] == [True]
    assert [n.target for n in gm.graph.nodes if n.op == "call_function" and not n.users] == side_effects
    torch.testing.assert_close(run_graph(gm, inputs), f(q))


def normalize_graph(text):
    """Stable across checkouts and torch versions: no paths, line numbers or dtype details."""
    text = re.sub(r"# File: \S+:\d+ in (\w+), code:", r"# File: <file> in \1, code:", text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"


def test_golden_rewritten_nanogpt_graph():
    q, k, v = qkv()
    gm, inputs = capture(PATTERNS["nanogpt"][0], q, k, v, nanogpt_bias())
    rewrite_attention(gm, inputs)
    assert_expected_inline(normalize_graph(gm.print_readable(print_output=False)), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f64[2, 2, 8, 4]", L_k_: "f64[2, 2, 8, 4]", L_bias_: "f64[1, 1, 16, 16]", L_v_: "f64[2, 2, 8, 4]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_bias_ = L_bias_
        l_v_ = L_v_
        # File: <file> in nanogpt, code: return att @ v
        matmul_1: "f64[2, 2, 8, 4]" = bob_compile_attention_attention(l_q_, l_k_, l_v_, is_causal = True, scale = 0.5, enable_gqa = False);  l_q_ = l_k_ = l_v_ = None
        return (matmul_1,)
""")
