"""Hugging Face architectures beyond tests/backend/test_hf_masks.py's, each with something of its own:

- Gemma: Dynamo restarts the compile once (AOTAutograd's pass that turns Python float
  scalars into tensors asks for it); the backend must let that through, not fall back.
- Falcon's eager attention: multi-query (one k/v head, broadcast by the matmuls); before
  transformers 5.25 with the scores divided in place (`attention_scores /= math.sqrt(...)`),
  since then HF's shared eager attention, whose softmax computes in float32 even in a
  float64 model. So the expected values are the same weights run through SDPA's math path
  in float64, whatever the implementation compiled.
- BART: the encoder's bidirectional padding, the decoder's padding and causal mask, and
  cross attention (L != S) under the encoder's padding, one compiled graph.
- GPT-2 as configured by default for training (embedding, residual and attention dropout
  0.1): the attention's dropout goes to the op, and under inductor every draw (dropout's
  masks, the op's seeds) is replayed in the second order, so every order equals eager from
  the same seed (eager with SDPA as the op, which draws the same masks).
Compiled with aot_eager around the rewritten graph, so that what differs from eager is
attention alone; the loss is computed in float64 from the logits (HF's own loss upcasts
to float32).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bob_compile.backend import counters

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             max_position_embeddings=32)


def _model(name, attn_implementation):
    T = transformers
    cls, config = {
        "gemma": (T.GemmaForCausalLM, lambda: T.GemmaConfig(
            **SMALL, num_attention_heads=2, num_key_value_heads=1, head_dim=8)),
        "bart": (T.BartForConditionalGeneration, lambda: T.BartConfig(
            vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, pad_token_id=0, decoder_start_token_id=2)),
        "falcon": (T.FalconForCausalLM, lambda: T.FalconConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            hidden_dropout=0.0, attention_dropout=0.0)),
    }[name]
    torch.manual_seed(0)
    return cls._from_config(config(), attn_implementation=attn_implementation,
                            dtype=torch.float64).train()


def _gradient_and_hvp(model, kwargs, labels):
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(**kwargs).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    grads = torch.autograd.grad(loss, params, create_graph=True)
    hvps = torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
    return torch.cat([g.detach().flatten() for g in grads]), torch.cat([h.flatten() for h in hvps])


@pytest.mark.sweep
@pytest.mark.parametrize("name, attn_implementation, tol", [
    ("gemma", "sdpa", 1e-6),      # 1e-6: Gemma's RMSNorm computes in float32
    ("falcon", "eager", 1e-10),
    ("bart", "sdpa", 1e-10),
    ("bart", "eager", 1e-10),
])
def test_replaced_and_exact(name, attn_implementation, tol):
    model = _model(name, attn_implementation)
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, 5:] = 0
    kwargs, labels = dict(input_ids=ids, attention_mask=padding), ids
    if name == "bart":      # a padded decoder batch: causal ∧ padding, and cross attention
        labels = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(2))
        decoder_padding = torch.ones(2, 6, dtype=torch.long)
        decoder_padding[1, 4:] = 0
        kwargs.update(decoder_input_ids=labels, decoder_attention_mask=decoder_padding)
    model.set_attn_implementation("sdpa")
    with sdpa_kernel(SDPBackend.MATH):
        expected = _gradient_and_hvp(model, kwargs, labels)
    model.set_attn_implementation(attn_implementation)
    compiled = torch.compile(model, backend="flashbob", options={"compiler": "aot_eager"})
    got = _gradient_and_hvp(compiled, kwargs, labels)
    sites = 3 if name == "bart" else 1     # one layer (BART: encoder, decoder, cross)
    kind = "sdpa" if attn_implementation == "sdpa" else "handwritten"
    assert counters[f"{kind}_replaced"] == sites and counters[f"{kind}_skipped"] == 0
    assert counters["fallback"] == 0 and counters["graphs"] == 1
    for e, g in zip(expected, got):
        assert ((g - e).norm() / e.norm()).item() < tol


@pytest.mark.sweep
def test_gemma2_soft_capped_eager_attention_is_replaced_and_exact():
    """Gemma 2's eager attention caps its scores (scores / c, tanh, * c) before the mask,
    a sliding window on one layer and global causal attention on the other: both sites
    become the op with its softcap, exact at every order against the same eager model
    (SDPA cannot cap). Weights of std 0.5 and a cap of 1: the cap changes the gradient and
    the HVP by 20-40 % here (at HF's init and Gemma's cap of 50, by 1e-7)."""
    config = transformers.Gemma2Config(**{**SMALL, "num_hidden_layers": 2},
                                       num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=8, sliding_window=4, attn_logit_softcapping=1.0,
                                       final_logit_softcapping=None, initializer_range=0.5)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM._from_config(
        config, attn_implementation="eager", dtype=torch.float64).train()
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, 5:] = 0
    kwargs = dict(input_ids=ids, attention_mask=padding)
    expected = _gradient_and_hvp(model, kwargs, ids)
    compiled = torch.compile(model, backend="flashbob", options={"compiler": "aot_eager"})
    got = _gradient_and_hvp(compiled, kwargs, ids)
    assert counters["handwritten_replaced"] == 2 and counters["handwritten_skipped"] == 0
    # 1e-6: Gemma's RMSNorm and eager softmax compute in float32
    for e, g in zip(expected, got):
        assert ((g - e).norm() / e.norm()).item() < 1e-6


def _sdpa_as_the_op(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    import bob_compile
    return bob_compile.attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 enable_gqa)


@pytest.mark.slow      # 35 s cold; dropout's replay in every order: test_training_route.py
@pytest.mark.parametrize("attn_pdrop", [0.0, 0.1])
def test_gpt2_with_dropout_every_order_compiled_and_equal_to_eager(attn_pdrop, monkeypatch):
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, attn_pdrop=attn_pdrop)   # resid, embd: 0.1
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().train()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    with sdpa_kernel(SDPBackend.MATH), monkeypatch.context() as patch:
        if attn_pdrop:
            patch.setattr(F, "scaled_dot_product_attention", _sdpa_as_the_op)
        expected = _gradient_and_hvp(model, dict(input_ids=ids), ids)
    compiled = torch.compile(model, backend="flashbob", options={"fallback": False})
    torch.manual_seed(5)
    got = _gradient_and_hvp(compiled, dict(input_ids=ids), ids)
    for e, g in zip(expected, got):
        assert ((g - e).norm() / e.norm()).item() < 1e-12
    assert counters["sdpa_replaced"] == 1 and counters["route_training"] == 1
    assert counters["compiled_second_order"] == 1
