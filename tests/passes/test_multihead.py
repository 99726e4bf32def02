"""nn.MultiheadAttention and the nn.Transformer* layers under flashbob (bob_compile/passes/multi_head_forward.py).

Dynamo records their attention as one F.multi_head_attention_forward call. Supported calls
must become bob_compile.multihead.multi_head_attention, run the fused op, and give the
first-order gradients, a Hutchinson HVP and a MAML step of eager math attention (float64,
within 1e-9); the others must stay as written, give eager's results, and say why.
"""
import re
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from bob_compile.autograd import AttnFn
from bob_compile.backend import flashbob, recent_reports
from bob_compile.multihead import multi_head_attention
from bob_compile.passes import counters, rewrite_attention
from scenarios import (first_order, grad_of_grad, hutchinson_hvp, jvp_of_grad, max_error,
                       maml_step)
from test_passes import capture, normalize_graph

# The rewrite is what these tests check: the graphs run as rewritten ("eager" compiler),
# which is exact at every order and fast to set up. The compiled routes run it too:
# test_transforms_compiled (aot) and test_training_route (training).
OPTIONS = {"compiler": "eager", "fallback": False}
COMPILED = {"compiler": "aot_eager", "fallback": False}
TOLERANCE = 1e-9
WIDTH, HEADS, BATCH, LENGTH, MEMORY = 8, 2, 2, 5, 7

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def causal_mask(n=LENGTH):
    """nn.Transformer.generate_square_subsequent_mask: 0 on and below the diagonal, -inf above."""
    return nn.Transformer.generate_square_subsequent_mask(n, dtype=torch.float64)


class Call(nn.Module):
    """module(*inputs, **fixed), its attention weights dropped: how models call these modules."""

    def __init__(self, module, **fixed):
        super().__init__()
        self.module, self.fixed = module, fixed

    def forward(self, *inputs):
        out = self.module(*inputs, **self.fixed)
        return out[0] if isinstance(out, tuple) else out


class SelfAttention(Call):
    """nn.MultiheadAttention(x, x, x)[0], need_weights left at its default (True)."""

    def __init__(self, attn_mask=None, key_padding_mask=None, **attention_kwargs):
        super().__init__(nn.MultiheadAttention(WIDTH, HEADS, **attention_kwargs),
                         attn_mask=attn_mask, key_padding_mask=key_padding_mask)

    def forward(self, x):
        return super().forward(x, x, x)


class CrossAttention(Call):
    """nn.MultiheadAttention(x, key, value), value defaulting to key (encoder-decoder)."""

    def __init__(self, **attention_kwargs):
        super().__init__(nn.MultiheadAttention(WIDTH, HEADS, **attention_kwargs))

    def forward(self, x, key, value=None):
        return super().forward(x, key, key if value is None else value)


class CausalEncoder(nn.Module):
    """nn.TransformerEncoder over a causal mask made in forward, as language models do."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=16, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[0], dtype=x.dtype)
        return self.encoder(x, mask=mask, is_causal=True)


class UsesWeights(nn.Module):
    """The attention weights feed the output (attention rollout, a weights penalty)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, HEADS)

    def forward(self, x):
        out, weights = self.attn(x, x, x)
        return out + weights.mean()


class StaticKV(nn.Module):
    """F.multi_head_attention_forward with precomputed keys and values (static_k/static_v),
    as incremental decoders call it."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, HEADS)
        self.k = nn.Parameter(torch.randn(BATCH * HEADS, MEMORY, WIDTH // HEADS))
        self.v = nn.Parameter(torch.randn(BATCH * HEADS, MEMORY, WIDTH // HEADS))

    def forward(self, x):
        a = self.attn
        return F.multi_head_attention_forward(
            x, x, x, WIDTH, HEADS, a.in_proj_weight, a.in_proj_bias, None, None, False, 0.0,
            a.out_proj.weight, a.out_proj.bias, training=self.training, need_weights=False,
            static_k=self.k, static_v=self.v)[0]


class CheckpointedLayer(nn.Module):
    """A TransformerEncoderLayer under activation checkpointing, its causal mask a buffer."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=16, dropout=0.0)
        self.register_buffer("mask", causal_mask())

    def forward(self, x):
        return checkpoint(lambda x: self.layer(x, src_mask=self.mask), x, use_reentrant=False)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def sequence(seed):
    return (randn(LENGTH, BATCH, WIDTH, seed=seed),)


def with_memory(seed):
    return randn(LENGTH, BATCH, WIDTH, seed=seed), randn(MEMORY, BATCH, WIDTH, seed=seed + 10)


def padding(batched=True):
    """nn.MultiheadAttention's key_padding_mask: True marks a padded key (the last two of the
    second sequence)."""
    hidden = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    hidden[1, -2:] = True
    return hidden if batched else hidden[1]


def per_head_mask():
    """A bool (N num_heads, L, S) attn_mask, True hiding a key; every query keeps itself."""
    hidden = torch.rand(BATCH * HEADS, LENGTH, LENGTH, generator=torch.Generator().manual_seed(3)) > 0.6
    return hidden & ~torch.eye(LENGTH, dtype=torch.bool)


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder over a padded batch (BERT-style: src_key_padding_mask, no
    causal mask), batch first."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=16, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x, src_key_padding_mask=padding())


def encoder_layer(norm_first, is_causal):
    layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=16, dropout=0.0, norm_first=norm_first)
    return Call(layer, src_mask=causal_mask(), is_causal=is_causal)


# name: (model, batch(seed) -> inputs, attention sites in one forward)
REPLACED = {
    "self_attention": (SelfAttention, sequence, 1),
    "batch_first": (lambda: SelfAttention(batch_first=True), lambda s: (randn(BATCH, LENGTH, WIDTH, seed=s),), 1),
    "unbatched": (SelfAttention, lambda s: (randn(LENGTH, WIDTH, seed=s),), 1),
    "no_bias": (lambda: SelfAttention(bias=False), sequence, 1),
    "bias_kv_zero_attn": (lambda: SelfAttention(add_bias_kv=True, add_zero_attn=True), sequence, 1),
    "dropout_in_eval": (lambda: SelfAttention(dropout=0.5).eval(), sequence, 1),
    "float_causal_mask": (lambda: SelfAttention(attn_mask=causal_mask()), sequence, 1),
    "bool_causal_mask": (lambda: SelfAttention(attn_mask=causal_mask().isinf()), sequence, 1),
    "cross_attention": (CrossAttention, with_memory, 1),
    "cross_kdim_vdim": (lambda: CrossAttention(kdim=4, vdim=6), lambda s: (
        randn(LENGTH, BATCH, WIDTH, seed=s), randn(MEMORY, BATCH, 4, seed=s + 1),
        randn(MEMORY, BATCH, 6, seed=s + 2)), 1),
    "encoder_layer_is_causal": (lambda: encoder_layer(norm_first=False, is_causal=True), sequence, 1),
    "encoder_layer_mask_only": (lambda: encoder_layer(norm_first=True, is_causal=False), sequence, 1),
    "decoder_layer": (lambda: Call(nn.TransformerDecoderLayer(WIDTH, HEADS, 16, dropout=0.0),
                                   tgt_mask=causal_mask(), tgt_is_causal=True), with_memory, 2),
    "encoder_stack": (CausalEncoder, sequence, 2),
    # masks passed to the op as they are
    "key_padding_mask": (lambda: SelfAttention(key_padding_mask=padding()), sequence, 1),
    "float_key_padding_mask": (lambda: SelfAttention(
        key_padding_mask=torch.zeros(BATCH, LENGTH, dtype=torch.float64).masked_fill(padding(), -torch.inf)),
        sequence, 1),
    "unbatched_key_padding_mask": (lambda: SelfAttention(key_padding_mask=padding(batched=False)),
                                   lambda s: (randn(LENGTH, WIDTH, seed=s),), 1),
    "causal_mask_and_key_padding": (lambda: SelfAttention(attn_mask=causal_mask().isinf(), key_padding_mask=padding()),
                                    sequence, 1),
    "non_causal_float_mask": (lambda: SelfAttention(attn_mask=randn(LENGTH, LENGTH, seed=0)), sequence, 1),
    "per_head_bool_mask_and_padding": (lambda: SelfAttention(attn_mask=per_head_mask(),
                                                             key_padding_mask=padding()), sequence, 1),
    "causal_mask_and_bias_kv": (lambda: SelfAttention(attn_mask=causal_mask(), add_bias_kv=True), sequence, 1),
    "padding_bias_kv_zero_attn": (lambda: SelfAttention(key_padding_mask=padding(), add_bias_kv=True,
                                                        add_zero_attn=True), sequence, 1),
    "padded_encoder_stack": (PaddedEncoder, lambda s: (randn(BATCH, LENGTH, WIDTH, seed=s),), 2),
    "transformer_batch_first": (lambda: Call(nn.Transformer(WIDTH, HEADS, 1, 1, 16, dropout=0.0, batch_first=True),
                                             tgt_mask=causal_mask(), tgt_is_causal=True),
                                lambda s: tuple(x.transpose(0, 1) for x in with_memory(s)[::-1]), 3),
}


def build(make):
    torch.manual_seed(0)
    return make().double()


def compiled_run(scenario, model, inputs):
    """scenario on the flashbob-compiled model; also whether the fused op ran."""
    counters.clear()
    with mock.patch.object(AttnFn, "apply", wraps=AttnFn.apply) as fused:
        result = scenario(torch.compile(model, backend=flashbob, options=OPTIONS), inputs)
    return result, fused.called


@pytest.mark.parametrize("scenario", [first_order, hutchinson_hvp, maml_step], ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", sorted(REPLACED))
def test_replaced_and_exact(name, scenario):
    make, batch, sites = REPLACED[name]
    model = build(make)
    inputs = (batch(0), batch(1)) if scenario is maml_step else batch(0)
    with sdpa_kernel(SDPBackend.MATH):
        expected = scenario(model, inputs)
    actual, fused_op_ran = compiled_run(scenario, model, inputs)
    assert max_error(actual, expected) <= TOLERANCE
    assert fused_op_ran
    for report in recent_reports:
        assert [(s.kind, s.replaced) for s in report.sites] == [("multihead", True)] * sites, report.text()
    assert counters["multihead_replaced"] == sites * len(recent_reports)


@pytest.mark.parametrize("name", ["decoder_layer", "padded_encoder_stack"])
@pytest.mark.parametrize("scenario", [hutchinson_hvp, maml_step], ids=lambda f: f.__name__)
def test_training_route(scenario, name):
    make, batch, sites = REPLACED[name]
    model = build(make)
    inputs = (batch(0), batch(1)) if scenario is maml_step else batch(0)
    with sdpa_kernel(SDPBackend.MATH):
        expected = scenario(model, inputs)
    actual = scenario(torch.compile(model, backend=flashbob, options=COMPILED), inputs)
    assert max_error(actual, expected) <= TOLERANCE
    assert {r.route for r in recent_reports} == {"training"}
    assert all(len(r.replaced) == sites for r in recent_reports)


@pytest.mark.parametrize("name,proof", [
    ("float_causal_mask", "attn_mask from l_self_fixed_attn_mask_, checked at run time"),
    ("bool_causal_mask", "attn_mask from l_self_fixed_attn_mask_, checked at run time"),
    ("encoder_layer_is_causal", "is_causal=True, with which PyTorch ignores attn_mask's values"),
    ("encoder_stack", "is_causal=True, with which PyTorch ignores attn_mask's values"),
])
def test_how_causality_is_known(name, proof):
    """The report says how; the nodes that made the mask (in forward, or additive from a
    bool mask) are gone with the calls."""
    make, batch, sites = REPLACED[name]
    gm, inputs = capture(build(make), *batch(0))
    report = rewrite_attention(gm, inputs)
    assert [s.causal_proof for s in report.sites] == [proof] * sites
    targets = {n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
    assert multi_head_attention in targets and F.multi_head_attention_forward not in targets
    assert not targets & {torch.full, torch.triu, torch.zeros_like, "masked_fill_"}


def test_golden_rewritten_batch_first_graph():
    """batch_first=True: Dynamo records the module's transposes around the call."""
    model = build(REPLACED["batch_first"][0])
    gm, inputs = capture(model, *REPLACED["batch_first"][1](0))
    rewrite_attention(gm, inputs)
    text = normalize_graph(gm.print_readable(print_output=False))
    text = text.replace("transpose_1", "attn_output_1")    # torch 2.11's name for that node
    assert_expected_inline(re.sub(r"self_modules_module_(modules_)?", "", text), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f64[2, 5, 8]", L_parameters_in_proj_bias_: "f64[24]", L_parameters_in_proj_weight_: "f64[24, 8]", L_out_proj_parameters_weight_: "f64[8, 8]", L_out_proj_parameters_bias_: "f64[8]"):
        l_x_ = L_x_
        l_parameters_in_proj_bias_ = L_parameters_in_proj_bias_
        l_parameters_in_proj_weight_ = L_parameters_in_proj_weight_
        l_out_proj_parameters_weight_ = L_out_proj_parameters_weight_
        l_out_proj_parameters_bias_ = L_out_proj_parameters_bias_
        # File: <file> in forward, code: out = self.module(*inputs, **self.fixed)
        query: "f64[5, 2, 8]" = l_x_.transpose(1, 0);  l_x_ = None
        multi_head_attention_forward = bob_compile_multihead_multi_head_attention(query, query, query, 2, l_parameters_in_proj_weight_, l_parameters_in_proj_bias_, l_out_proj_parameters_weight_, l_out_proj_parameters_bias_, is_causal = False);  query = l_parameters_in_proj_weight_ = l_parameters_in_proj_bias_ = l_out_proj_parameters_weight_ = l_out_proj_parameters_bias_ = None
        attn_output: "f64[5, 2, 8]" = multi_head_attention_forward[0];  multi_head_attention_forward = None
        attn_output_1: "f64[2, 5, 8]" = attn_output.transpose(1, 0);  attn_output = None
        return (attn_output_1,)
""")


def test_changed_mask_runs_the_untouched_graph():
    """A mask proven causal from a module attribute is re-checked at run time."""
    model = build(REPLACED["float_causal_mask"][0])
    x, = sequence(0)
    compiled = torch.compile(model, backend=flashbob, options=OPTIONS)
    torch.testing.assert_close(compiled(x), model(x), atol=1e-12, rtol=0)
    model.fixed["attn_mask"].zero_()  # no longer causal: bidirectional attention
    with pytest.warns(UserWarning, match="no longer holds the causal mask"):
        torch.testing.assert_close(compiled(x), model(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("scenario", [grad_of_grad, jvp_of_grad], ids=lambda f: f.__name__)
def test_transforms_compiled(scenario):
    """torch.func inside the compiled function: AOTAutograd traces multi_head_attention."""
    make, batch, sites = REPLACED["bool_causal_mask"]
    model = build(make)
    params = {name: p.detach() for name, p in model.named_parameters()}
    with sdpa_kernel(SDPBackend.MATH):  # Dynamo traces SDPA's derivatives before flashbob runs
        expected = scenario(model, params, batch(0))
        actual = torch.compile(lambda p: scenario(model, p, batch(0)), backend=flashbob, options=COMPILED)(params)
    assert max_error(actual, expected) <= TOLERANCE
    assert [(r.route, len(r.replaced)) for r in recent_reports] == [("aot", sites)]


def test_dynamic_shapes_one_graph():
    """The encoder stack's mask is made from a symbolic length: one graph for every length."""
    model = build(CausalEncoder)
    compiled = torch.compile(model, backend=flashbob, dynamic=True, options=OPTIONS)
    for length in (5, 6, 9):
        x = randn(length, BATCH + 1, WIDTH, seed=length)
        with sdpa_kernel(SDPBackend.MATH):
            expected = hutchinson_hvp(model, (x,))
        assert max_error(hutchinson_hvp(compiled, (x,)), expected) <= TOLERANCE
    (report,) = recent_reports
    assert len(report.replaced) == 2 and "query[s" in report.replaced[0].shapes, report.text()


def test_inside_activation_checkpointing():
    """The checkpointed body is rewritten too; its mask is proven where it comes from."""
    model = build(CheckpointedLayer)
    x, = sequence(0)
    with sdpa_kernel(SDPBackend.MATH):
        expected = hutchinson_hvp(model, (x,))
    actual, fused_op_ran = compiled_run(hutchinson_hvp, model, (x,))
    assert max_error(actual, expected) <= TOLERANCE and fused_op_ran
    (report,) = recent_reports
    (site,) = report.sites
    assert site.replaced and site.node.endswith(".multi_head_attention_forward"), report.text()
    assert site.causal_proof.endswith("checked at run time"), report.text()


def test_inference_route():
    """eval() and no grad: under Dynamo nn.MultiheadAttention does not take its fast path
    (_is_make_fx_tracing() is true), so its F.multi_head_attention_forward is replaced."""
    model = build(REPLACED["batch_first"][0]).eval()
    x, = REPLACED["batch_first"][1](0)
    with torch.no_grad():
        actual = torch.compile(model, backend=flashbob, options=COMPILED)(x)
        torch.testing.assert_close(actual, model(x), atol=1e-12, rtol=0)
    assert [r.route for r in recent_reports] == ["inference"]
    assert counters["multihead_replaced"] == 1


# ---------------------------------------------------------------------------- left alone
# name: (model, reason in the report)
UNTOUCHED = {
    "weights_used": (UsesWeights, "the attention weights are used (attn_output_weights (getitem))"),
    "static_kv": (StaticKV, "static_k/static_v (precomputed keys and values) are given"),
}


@pytest.mark.parametrize("name", sorted(UNTOUCHED))
def test_left_alone_with_reason(name):
    make, reason = UNTOUCHED[name]
    model = build(make)
    inputs = sequence(0)

    def forward_and_grads(m, inputs):
        out = m(*inputs)
        return [out, *torch.autograd.grad(out.square().mean(), list(m.parameters()))]
    expected = forward_and_grads(model, inputs)
    actual, fused_op_ran = compiled_run(forward_and_grads, model, inputs)
    assert max_error(actual, expected) <= TOLERANCE
    assert not fused_op_ran
    (report,) = recent_reports
    (site,) = report.sites
    assert site.kind == "multihead" and not site.replaced and reason in site.reason, site.reason
    assert (counters["multihead_skipped"], counters["multihead_replaced"]) == (1, 0)


def test_dropout_in_training_goes_to_the_op():
    """nn.MultiheadAttention(dropout=0.5) in training: replaced, its dropout drawn by the op,
    so the compiled module equals multi_head_attention with that dropout given the same
    generator state, at every order (a Hessian-vector product)."""
    from bob_compile.multihead import multi_head_attention
    model = build(lambda: SelfAttention(dropout=0.5))
    mha = model.module
    (x,) = sequence(0)

    def eager(x):
        return multi_head_attention(x, x, x, HEADS, mha.in_proj_weight, mha.in_proj_bias,
                                    mha.out_proj.weight, mha.out_proj.bias, dropout_p=0.5)[0]

    def hvp(f):
        torch.manual_seed(4)
        params = list(model.parameters())
        grads = torch.autograd.grad(f(x).square().sum(), params, create_graph=True)
        return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
    compiled = torch.compile(model, backend=flashbob, options=OPTIONS)
    assert max_error(hvp(compiled), hvp(eager)) <= TOLERANCE
    (site,) = recent_reports[-1].sites
    assert site.replaced and site.dropout == 0.5


@pytest.mark.parametrize("kernel", ["_transformer_encoder_layer_fwd", "_native_multi_head_attention"])
def test_inference_fast_paths_are_reported(kernel):
    """An eval() TransformerEncoderLayer without grad runs PyTorch's fused inference kernel.
    nn.MultiheadAttention's own fast path never reaches a Dynamo graph (test_inference_route),
    so its kernel is called directly here."""
    layer = build(lambda: nn.TransformerEncoderLayer(WIDTH, HEADS, 16, dropout=0.0, batch_first=True)).eval()
    attn = layer.self_attn

    def native_attention(x):
        return torch._native_multi_head_attention(x, x, x, WIDTH, HEADS, attn.in_proj_weight, attn.in_proj_bias,
                                                  attn.out_proj.weight, attn.out_proj.bias)[0]
    run, reference = {"_transformer_encoder_layer_fwd": (layer, layer),
                      "_native_multi_head_attention": (native_attention, lambda x: attn(x, x, x)[0])}[kernel]
    x = randn(BATCH, LENGTH, WIDTH, seed=0)
    with torch.no_grad():
        actual, fused_op_ran = compiled_run(lambda f, x: f(x), run, x)
        torch.testing.assert_close(actual, reference(x), atol=1e-12, rtol=0)
    assert not fused_op_ran
    (report,) = recent_reports
    assert [(s.node, s.replaced, s.reason) for s in report.sites] == [
        (kernel, False, f"torch.{kernel} is a native fused inference kernel, no gradient needed")]


@pytest.mark.parametrize("appended", ["none", "bias_kv", "bias_kv_zero_attn"])
@pytest.mark.parametrize("padding_kind", [None, "bool", "float"])
@pytest.mark.parametrize("mask_kind", [None, "bool 2-D", "bool 3-D", "float 2-D"])
def test_masks_as_pytorch_applies_them(mask_kind, padding_kind, appended):
    """multi_head_attention called directly (the modules canonicalize their masks to float
    before F.multi_head_attention_forward; direct callers may pass bool): output and
    gradients equal PyTorch's, bool and float masks alike, with the keys bias_k/bias_v and
    add_zero_attn append."""
    if mask_kind is not None and padding_kind is not None and \
            (mask_kind.startswith("bool")) != (padding_kind == "bool"):
        pytest.skip("mixed mask types are deprecated in PyTorch")
    attn = build(lambda: nn.MultiheadAttention(WIDTH, HEADS, add_bias_kv=appended != "none",
                                               add_zero_attn=appended == "bias_kv_zero_attn"))
    (x,) = sequence(0)
    x.requires_grad_()
    hidden_keys = padding()
    masks = {}
    if mask_kind == "bool 2-D":
        masks["attn_mask"] = causal_mask().isinf()
    elif mask_kind == "bool 3-D":
        masks["attn_mask"] = per_head_mask()
    elif mask_kind == "float 2-D":
        masks["attn_mask"] = randn(LENGTH, LENGTH, seed=5)
    if padding_kind == "bool":
        masks["key_padding_mask"] = hidden_keys
    elif padding_kind == "float":
        masks["key_padding_mask"] = torch.zeros(BATCH, LENGTH, dtype=torch.float64).masked_fill(
            hidden_keys, -torch.inf)
    weights = (attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias)
    extra = dict(bias_k=attn.bias_k, bias_v=attn.bias_v) if attn.bias_k is not None else {}
    ours, _ = multi_head_attention(x, x, x, HEADS, *weights, add_zero_attn=attn.add_zero_attn,
                                   **extra, **masks)
    with sdpa_kernel(SDPBackend.MATH):
        theirs, _ = F.multi_head_attention_forward(
            x, x, x, WIDTH, HEADS, attn.in_proj_weight, attn.in_proj_bias, attn.bias_k,
            attn.bias_v, attn.add_zero_attn, 0.0, attn.out_proj.weight, attn.out_proj.bias,
            need_weights=False, **masks)
    inputs = [x, *attn.parameters()]
    expected = [theirs, *torch.autograd.grad(theirs.square().sum(), inputs)]
    actual = [ours, *torch.autograd.grad(ours.square().sum(), inputs)]
    assert max_error(actual, expected) <= TOLERANCE


class AnyCall(nn.Module):
    """nn.MultiheadAttention over (x, memory, memory) with the drawn call arguments."""

    def __init__(self, width, heads, module_kwargs, call_kwargs, batch_first):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=batch_first, **module_kwargs)
        self.call_kwargs = call_kwargs

    def forward(self, x, memory):
        return self.attn(x, memory, memory, **self.call_kwargs)[0].tanh()


@st.composite
def multi_head_calls(draw):
    """A module and its inputs: sizes, layout, appended keys, masks of either kind (every
    query keeps its first key: rows with no key are NaN in PyTorch's weights path)."""
    width, heads = draw(st.sampled_from([(8, 2), (12, 3), (8, 1)]))
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    self_attention = draw(st.booleans())
    source = length if self_attention else draw(st.integers(1, 7))
    batched = draw(st.booleans())
    batch_first = batched and draw(st.booleans())
    module_kwargs = dict(add_bias_kv=draw(st.booleans()), add_zero_attn=draw(st.booleans()))
    call_kwargs = dict(need_weights=draw(st.booleans()))
    boolean = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))

    def mask(shape, values):
        """bool (True hides), or additive: -inf where hidden, else `values` (a bias, or 0)."""
        hidden = torch.rand(shape, generator=g) < 0.3
        hidden[..., 0] = False
        if boolean:
            return hidden
        return values(shape).masked_fill(hidden, -torch.inf)
    if draw(st.booleans()):
        call_kwargs["attn_mask"] = mask(draw(st.sampled_from(
            [(length, source), ((batch if batched else 1) * heads, length, source)])),
            lambda shape: torch.randn(shape, generator=g, dtype=torch.float64))
    if draw(st.booleans()):
        call_kwargs["key_padding_mask"] = mask((batch, source) if batched else (source,),
                                               lambda shape: torch.zeros(shape, dtype=torch.float64))

    def shape(n):
        return (batch, n, width) if batch_first else (n, batch, width) if batched else (n, width)
    x = torch.randn(shape(length), generator=g, dtype=torch.float64)
    memory = x if self_attention else torch.randn(shape(source), generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = AnyCall(width, heads, module_kwargs, call_kwargs, batch_first).double()
    return model, (x, memory)


@pytest.mark.slow       # ~0.4 s an example
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(multi_head_calls())
def test_any_call_is_replaced_and_exact(call):
    """Random sizes, layouts, appended keys and masks: the site is replaced and the HVP
    equals eager math's."""
    model, inputs = call
    torch._dynamo.reset()
    with sdpa_kernel(SDPBackend.MATH):
        expected = hutchinson_hvp(model, inputs)
    actual, fused_op_ran = compiled_run(hutchinson_hvp, model, inputs)
    assert max_error(actual, expected) <= TOLERANCE
    assert fused_op_ran and counters["multihead_replaced"] >= 1
