"""Training graphs cut at their repeated blocks (bob_compile/training/regions.py).

Every distinct block compiles once and its alike run its code; the orders stay exact in
float64 against eager math (first order, HVP, MAML, third order); graphs that must not be
cut compile whole, with the reason in the report; a region the compiler refuses runs
eagerly alone.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bob_compile.backend import counters, flashbob, recent_reports
from bob_compile.training import regions as regions_module
from bob_compile.training.pairs import NotSupported
from models import GPT, SDPABlock, exact_twin, float_batch, token_batch
from test_training_route import (AOT_EAGER, TOLERANCE, first_order, hand_written_norms,
                                 hessian_vector_product, math_sdpa, maml, max_error, third_order)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def compiled(model, **options):
    return torch.compile(model, backend=flashbob,
                         options={**AOT_EAGER, "regions": "blocks", **options})


class NextToken(nn.Module):
    """A GPT trained to predict each next token of its input: one tensor in, the loss out
    (as the scenarios call a model)."""

    def __init__(self, n_layer):
        super().__init__()
        self.model = GPT(n_layer=n_layer)

    def forward(self, tokens):
        return self.model(tokens, tokens.roll(-1, dims=1))


class Stack(nn.Module):
    """`blocks` applied in turn to a float input: ViT / BERT-style encoders."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def report_of_last():
    (report,) = recent_reports
    return report


def compiled_hvp_is_exact(model, batch, **options):
    """Assert the compiled model's HVP equals eager math's in float64; its graph's report."""
    with math_sdpa():
        expected = hessian_vector_product(exact_twin(model), batch)
    actual = hessian_vector_product(compiled(model, **options), batch)
    assert max_error(actual, expected) <= TOLERANCE
    return report_of_last()


# ------------------------------------------------------------------- cut and shared, exact
@pytest.mark.parametrize("scenario", [first_order, hessian_vector_product, maml],
                         ids=lambda f: f.__name__)
def test_a_gpt_compiles_one_block_for_all_and_stays_exact(scenario):
    torch.manual_seed(0)
    model = NextToken(n_layer=3).double()
    batch, _ = token_batch(0)
    with math_sdpa():
        expected = scenario(exact_twin(model), batch)
    actual = scenario(compiled(model), batch)
    assert max_error(actual, expected) <= TOLERANCE
    report = recent_reports[-1]          # MAML's fast weights: a graph of their own
    # the embeddings, three blocks, the head and loss: one block's code serves all three
    assert report.regions == "5 regions cut at the repeated blocks, 3 compiled (2 run another's code)"
    assert any(line.startswith("region 1 (model.h.0) and 2 alike, forward and backward")
               for line in report.compiled), report.compiled
    assert counters["regions_shared"] == 2 * len(recent_reports)
    assert all(site.replaced for site in report.sites) and len(report.sites) == 3


def test_whole_graph_option_gives_the_same_result():
    torch.manual_seed(0)
    model = NextToken(n_layer=2).double()
    batch, _ = token_batch(1)
    report = compiled_hvp_is_exact(model, batch, regions="graph")
    assert report.regions is None
    assert not any(line.startswith("region") for line in report.compiled)


def test_third_order_through_regions():
    """Third order runs each region's VJP eagerly: still exact across the cut."""
    torch.manual_seed(0)
    model = Stack([SDPABlock() for _ in range(3)]).double()
    x, = float_batch(2)
    with math_sdpa():
        expected = third_order(hand_written_norms(model), x)
    actual = third_order(compiled(model), x)
    relative = max(((a - e).norm() / e.norm()).item() for a, e in zip(actual, expected))
    assert relative <= 1e-12
    # the first block reads the input, which does not require grad: it differs
    assert report_of_last().regions == "3 regions cut at the repeated blocks, 2 compiled (1 run another's code)"


def test_a_region_the_compiler_refuses_runs_eagerly_alone(monkeypatch):
    """The refusal is the region's (here the head and loss): the blocks stay compiled, the
    result exact."""
    from bob_compile import training
    real = training.compile_pair

    def refuse_the_head(gm, example_inputs, compiler, config_patches, what, **kwargs):
        if what.endswith("region 3"):
            raise NotSupported("it mutates inputs (simulated)")
        return real(gm, example_inputs, compiler, config_patches, what, **kwargs)
    monkeypatch.setattr(training, "compile_pair", refuse_the_head)
    torch.manual_seed(0)
    model = NextToken(n_layer=2).double()
    batch, _ = token_batch(2)
    report = compiled_hvp_is_exact(model, batch)
    assert report.route == "training"
    assert "region 3, every order: runs eagerly (it mutates inputs (simulated))" in report.compiled
    assert any(line.startswith("region 1 (model.h.0) and 1 alike, the VJP as a differentiable")
               for line in report.compiled), report.compiled
    assert counters["eager_region"] == 1


# ------------------------------------------------------------------- what must not be cut
class AddsIntoItsOwn(nn.Module):
    """A block writing into a tensor it made itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        x = x * 1.0
        h = self.lin(x)
        return h.add_(torch.tanh(x))


class WritesIntoPrevious(nn.Module):
    """A block writing into the tensor it was given: the previous region's output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        # x: the previous block's output; written through a view, which the rewrite of
        # in-place ops on private temporaries (passes/inplace.py) leaves as written
        x.view(-1).mul_(2.0)
        return self.lin(x) + x


@pytest.mark.parametrize("blocks, why", [
    (lambda: [SDPABlock()], None),                                   # nothing repeats
    (lambda: [SDPABlock(), nn.Linear(16, 16)], None),                # two classes, one each
    (lambda: [nn.Linear(16, 32), nn.Linear(32, 16)],
     "whole graph: no two blocks have the same graph"),              # shapes differ
    (lambda: [nn.Linear(16, 16), WritesIntoPrevious(), WritesIntoPrevious()],
     "whole graph: an in-place op writes into memory another region owns"),
])
def test_graphs_that_must_not_be_cut_compile_whole(blocks, why):
    torch.manual_seed(0)
    model = Stack(blocks()).double()
    x, = float_batch(3)
    report = compiled_hvp_is_exact(model, x)
    assert report.regions == why
    assert not any(line.startswith("region") for line in report.compiled)


def test_an_in_place_write_inside_one_block_is_cut():
    """Writing into a tensor the block made itself stays inside its region."""
    torch.manual_seed(0)
    model = Stack([AddsIntoItsOwn() for _ in range(3)]).double()
    x, = float_batch(4)
    assert compiled_hvp_is_exact(model, x).regions.startswith("3 regions cut")


def test_symbolic_shapes_compile_whole():
    torch.manual_seed(0)
    model = Stack([SDPABlock() for _ in range(2)]).double()
    run = torch.compile(model, backend=flashbob, options={**AOT_EAGER, "regions": "blocks"},
                        dynamic=True)
    for seq in (8, 12):
        x, = float_batch(5, seq=seq)
        with math_sdpa():
            expected = hessian_vector_product(exact_twin(model), x)
        assert max_error(hessian_vector_product(run, x), expected) <= TOLERANCE
    assert recent_reports[-1].regions == "whole graph: its shapes are symbolic"


# ------------------------------------------------------------------- signatures
def _region_for(fn):
    gm = torch.fx.symbolic_trace(fn)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    placeholders = gm.graph.find_nodes(op="placeholder")
    return regions_module.Region(regions_module._region_module(gm, nodes, placeholders, nodes[-1:]),
                                 placeholders, nodes[-1:], None)


def test_signatures_tell_alike_regions_from_different_ones():
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    def scaled(a):
        return torch.tanh(a) * 2.0
    one, two = _region_for(scaled), _region_for(scaled)
    sig = regions_module.signature
    assert sig(one, [x]) == sig(two, [x.detach().clone().requires_grad_()])
    assert sig(one, [x]) != sig(one, [x.detach()])                      # requires_grad
    assert sig(one, [x]) != sig(one, [x.float()])                       # dtype
    assert sig(one, [x]) != sig(one, [x.t()])                           # shape and strides

    def scaled_other(a):
        return torch.tanh(a) * 3.0
    assert sig(one, [x]) != sig(_region_for(scaled_other), [x])        # a constant

    def nan_filled(a):
        return torch.nan_to_num(a, nan=math.nan) + a[..., 1:2]
    assert sig(_region_for(nan_filled), [x]) == sig(_region_for(nan_filled), [x])


def test_tensor_constants_compare_by_identity():
    """Two blocks reading their own constant tensor (equal values or not) must not share
    code: the compiled one would read the first block's."""
    x = torch.randn(2, 3, dtype=torch.float64)
    first, second = torch.ones(3), torch.ones(3)

    class Reads(nn.Module):
        def __init__(self, constant):
            super().__init__()
            self.constant = constant

        def forward(self, a):
            return a * self.constant
    one = torch.fx.symbolic_trace(Reads(first))
    two = torch.fx.symbolic_trace(Reads(second))

    def region(gm):
        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        placeholders = gm.graph.find_nodes(op="placeholder")
        return regions_module.Region(gm, placeholders, nodes[-1:], None)
    assert regions_module.signature(region(one), [x]) != regions_module.signature(region(two), [x])
    assert regions_module.signature(region(one), [x]) == regions_module.signature(region(one), [x])


def test_dump_names_each_regions_files(tmp_path):
    torch.manual_seed(0)
    model = Stack([SDPABlock() for _ in range(3)]).double()
    x, = float_batch(6)
    hessian_vector_product(compiled(model, dump_dir=str(tmp_path)), x)
    (folder,) = tmp_path.iterdir()
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith("region"))
    assert names == [f"region{i}.{order}.{half}.py" for i in (0, 1)
                     for order in ("first_order", "second_order") for half in ("backward", "forward")]


class AutocastAroundTheLastBlocks(nn.Module):
    """A context the model enters itself around some blocks (autocast off, as Hugging Face's
    rotary embeddings do around their own math): a cut inside it would compile those
    blocks outside it."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(SDPABlock() for _ in range(3))

    def forward(self, x):
        x = self.blocks[0](x)
        with torch.autocast("cpu", enabled=False):
            for block in self.blocks[1:]:
                x = block(x)
        return x


def test_no_cut_inside_a_context_the_graph_enters():
    torch.manual_seed(0)
    model = AutocastAroundTheLastBlocks().double()
    x, = float_batch(7)
    assert compiled_hvp_is_exact(model, x).regions == (
        "whole graph: a block begins or ends inside an autocast or grad-mode context the "
        "graph enters itself")


# ------------------------------------------------------------------- Hugging Face models
@pytest.mark.parametrize("name, tol", [
    ("llama", 1e-6),        # HF's RMSNorm computes in float32, even in a float64 model
    ("gpt2", TOLERANCE)])
def test_hugging_face_decoders_compile_one_layer_for_all(name, tol):
    """A Llama's or GPT-2's layers, three of them, padded batch: one compiled layer, the
    gradient and HVP exact against the same model under SDPA's math."""
    transformers = pytest.importorskip("transformers")
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=3, num_attention_heads=2,
                                          num_key_value_heads=1, max_position_embeddings=32)
        model_class, layers = transformers.LlamaForCausalLM, "model.layers"
    else:
        config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=3,
                                         n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model_class, layers = transformers.GPT2LMHeadModel, "transformer.h"
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation="sdpa",
                                     dtype=torch.float64).train()
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, 6:] = 0

    def gradient_and_hvp(m):
        params = list(m.parameters())
        logits = m(input_ids=ids, attention_mask=padding).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        grads = torch.autograd.grad(loss, params, create_graph=True)
        hvps = torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
        return grads, hvps
    with math_sdpa():
        expected = gradient_and_hvp(model)
    actual = gradient_and_hvp(compiled(model))
    for e, a in zip(expected, actual):
        assert max_error(a, e) <= tol
    report = report_of_last()
    assert report.regions.endswith("compiled (2 run another's code)"), report.regions
    assert any(line.startswith(f"region 1 ({layers}.0) and 2 alike, the VJP")
               for line in report.compiled), report.compiled
    assert all(site.replaced for site in report.sites) and len(report.sites) == 3
