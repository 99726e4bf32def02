"""Hugging Face models called with an attention_mask, as HF training code calls them.

transformers builds the mask inside the model (padding ∧ causal, sliding windows for
Mistral, bidirectional padding for BERT): a boolean 4-D mask for SDPA
(attn_implementation="sdpa"), an additive one with finfo.min fills for its hand-written
`eager` attention. flashbob passes either on to bob_compile.attention (bob_compile/passes/sdpa.py,
bob_compile/passes/handwritten.py), so the sites are replaced whatever the padding, and every order is
exact (float64) against the same weights run eagerly through SDPA's math path. (Not
against HF eager itself: its softmax computes in float32 even in a float64 model, and with
left padding its fully masked rows are NaN; bob_compile gives those rows zeros, as SDPA
does.) The models' RMSNorm also computes in float32; the tests make it float64 so that
only attention's exactness is measured.
"""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bob_compile.backend import counters, flashbob, recent_reports
from tiers import diagonal

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TOL = 1e-9
SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             max_position_embeddings=32)


def _configs():
    return {
        "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            **SMALL, num_attention_heads=4, num_key_value_heads=2)),         # GQA
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(
            **SMALL, num_attention_heads=4, num_key_value_heads=2, sliding_window=4)),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
            **SMALL, num_attention_heads=4, num_key_value_heads=2)),
        "bert": (transformers.BertForMaskedLM, transformers.BertConfig(
            **SMALL, num_attention_heads=2, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)),
    }


def _exact_rms_norms(model):
    """RMSNorm in the model's own dtype (HF upcasts to float32, even from float64)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            def forward(x, module=module):
                return module.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                       + module.variance_epsilon)
            module.forward = forward
    return model


def build(name, attn_implementation="sdpa"):
    """A fresh model (the same weights on every call; deepcopy would keep the RMSNorm
    forwards bound to the original's weights)."""
    cls, config = _configs()[name]
    torch.manual_seed(0)
    return _exact_rms_norms(
        cls._from_config(config, attn_implementation=attn_implementation).double())


def batch():
    """Three sequences: unpadded, right-padded and left-padded."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 32, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, :3] = 0
    return ids, mask


def loss_of(model, ids, mask):
    """Logits of real tokens only, as a padded batch's loss is taken."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    return (torch.sin(logits) * mask[..., None]).sum()


def gradients_and_hvp(model, ids, mask):
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model, ids, mask), params, create_graph=True,
                                allow_unused=True, materialize_grads=True)
    hvp = torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params],
                              allow_unused=True, materialize_grads=True)
    return [g.detach() for g in grads], hvp


def maml_meta_gradient(model, ids, mask):
    """One inner SGD step on the fast weights, the outer gradient through it."""
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss_of(model, ids, mask), params, create_graph=True,
                                allow_unused=True, materialize_grads=True)
    fast = {n: p - 0.1 * g for n, p, g in zip(names, params, grads)}
    outer = loss_of(lambda **kw: torch.func.functional_call(model, fast, (), kw), ids, mask)
    return torch.autograd.grad(outer, params, allow_unused=True, materialize_grads=True)


def max_error(actual, expected):
    return max((a - e).abs().max().item() for a, e in zip(actual, expected, strict=True))


@pytest.mark.parametrize("name,implementation", diagonal(
    ["gpt2", "llama", "mistral", "qwen2", "bert"], ["sdpa", "eager"], ids=str))
def test_padded_batches_are_replaced_and_exact(name, implementation):
    model = build(name, implementation)
    ids, mask = batch()
    with sdpa_kernel(SDPBackend.MATH):
        grads, hvp = gradients_and_hvp(build(name), ids, mask)       # the sdpa twin
    compiled = torch.compile(model, backend=flashbob,
                             options={"compiler": "aot_eager", "fallback": False})
    actual_grads, actual_hvp = gradients_and_hvp(compiled, ids, mask)
    assert max_error(actual_grads, grads) <= TOL
    assert max_error(actual_hvp, hvp) <= TOL
    sites = [s for r in recent_reports for s in r.sites]
    assert len(sites) == 2 and all(s.replaced for s in sites), [r.text() for r in recent_reports]


@pytest.mark.parametrize("name,implementation", [("llama", "eager")])
def test_the_all_ones_mask_a_tokenizer_returns(name, implementation):
    model = build(name, implementation)
    ids, mask = batch()
    mask = torch.ones_like(mask)
    with sdpa_kernel(SDPBackend.MATH):
        grads, hvp = gradients_and_hvp(build(name), ids, mask)
    compiled = torch.compile(model, backend=flashbob,
                             options={"compiler": "aot_eager", "fallback": False})
    actual_grads, actual_hvp = gradients_and_hvp(compiled, ids, mask)
    assert max_error(actual_grads, grads) <= TOL and max_error(actual_hvp, hvp) <= TOL
    sites = [s for r in recent_reports for s in r.sites]
    assert len(sites) == 2 and all(s.replaced for s in sites)


@pytest.mark.parametrize("name,implementation", [("mistral", "eager")])
def test_maml_through_a_padded_batch(name, implementation):
    model = build(name, implementation)
    ids, mask = batch()
    with sdpa_kernel(SDPBackend.MATH):
        expected = maml_meta_gradient(build(name), ids, mask)
    compiled = torch.compile(model, backend=flashbob,
                             options={"compiler": "aot_eager", "fallback": False})
    assert max_error(maml_meta_gradient(compiled, ids, mask), expected) <= TOL
    assert all(s.replaced for r in recent_reports for s in r.sites)


def test_tensor_constants_keep_derived_graphs_compiled():
    """Mistral's graphs hold its sliding window as a 0-d tensor constant: the second order,
    traced from the same graph, must compile with it rather than run eagerly."""
    model = build("mistral")
    ids, mask = batch()
    compiled = torch.compile(model, backend=flashbob,
                             options={"compiler": "aot_eager", "fallback": False})
    gradients_and_hvp(compiled, ids, mask)
    assert counters["compiled_second_order"] >= 1 and counters["eager_second_order"] == 0
    assert {r.route for r in recent_reports} == {"training"}, [r.text() for r in recent_reports]
