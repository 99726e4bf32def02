"""Does flashbob replace attention, exactly, in Hugging Face architectures? A CPU check.

For each architecture (a one-layer model from a small config, random weights) and attention
implementation (sdpa, eager), with a right-padded batch and its attention_mask: the gradient
and a Hessian-vector product (random direction) of a cross-entropy loss, eager (SDPA's math
backend) against `torch.compile(model, backend="flashbob")` (aot_eager around the rewritten
graph, so that only attention differs), in float64 by default. Prints the sites replaced or
left alone (with the pass's reason) and both relative errors; exits 1 if an error exceeds
--tol. Architectures that compute their scores in float32 (HF's eager softmax, GPT-J's
upcast) differ from float64 eager by float32 rounding (~1e-8), not by the op.

    python benchmarks/check_hf_architectures.py                  # every architecture below
    python benchmarks/check_hf_architectures.py --models gptj opt --dtype float32
"""
import argparse
import sys

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bob_compile.backend import counters, recent_reports

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, max_position_embeddings=32)
GPTJ_LIKE = dict(n_embd=16, n_layer=1, n_head=2, rotary_dim=4, n_positions=32, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0)
SEQ2SEQ = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
               attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
               decoder_start_token_id=2)
# name: (model class, config class, config arguments beyond SMALL)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=1)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(num_key_value_heads=1, sliding_window=4)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=1)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_key_value_heads=1, head_dim=8)),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(resid_pdrop=0.0, embd_pdrop=0.0)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(num_key_value_heads=1, pad_token_id=0)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(num_key_value_heads=1, head_dim=8,
                                                         sliding_window=4)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(hidden_dropout=0.0)),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(ffn_dim=32, word_embed_proj_dim=16, dropout=0.0)),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(num_key_value_heads=1)),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", dict(
        num_key_value_heads=1, residual_dropout=0.0, embedding_dropout=0.0)),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", dict(num_key_value_heads=1)),
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(num_key_value_heads=1)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(num_key_value_heads=1)),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", GPTJ_LIKE),
    "codegen": ("CodeGenForCausalLM", "CodeGenConfig", dict(GPTJ_LIKE, n_ctx=32)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(n_layer=1, n_head=2)),
    # encoders (bidirectional padding) and encoder-decoders (padding in the encoder, padding
    # and causal in the decoder, the encoder's padding in cross attention)
    "bert": ("BertForMaskedLM", "BertConfig", dict(hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0)),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
        max_position_embeddings=40)),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig", dict(
        dim=16, hidden_dim=32, n_layers=1, n_heads=2, dropout=0.0, attention_dropout=0.0)),
    "bart": ("BartForConditionalGeneration", "BartConfig", SEQ2SEQ),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", SEQ2SEQ),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(
        d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0)),
}


def gradient_and_hvp(model, kwargs, labels):
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(**kwargs).logits
    loss = F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten())
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    used = [(g, p) for g, p in zip(grads, params) if g is not None]
    # a random direction: along ones, softmax's shift invariance can make the HVP ~0
    direction = [torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(i))
                 for i, (_, p) in enumerate(used)]
    hvps = torch.autograd.grad([g for g, _ in used], [p for _, p in used], direction,
                               allow_unused=True)
    return (torch.cat([g.detach().flatten() for g, _ in used]),
            torch.cat([(torch.zeros_like(p) if h is None else h).flatten()
                       for h, (_, p) in zip(hvps, used)]))


def check(transformers, name, implementation, dtype):
    model_name, config_name, extra = ARCHITECTURES[name]
    config = getattr(transformers, config_name)(**{**SMALL, **extra})
    torch.manual_seed(0)
    try:
        model = getattr(transformers, model_name)._from_config(
            config, attn_implementation=implementation, dtype=dtype).train()
    except (ValueError, ImportError) as e:
        return f"not offered by transformers: {str(e).splitlines()[0][:70]}", None
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, 5:] = 0
    kwargs, labels = dict(input_ids=ids, attention_mask=padding), ids
    if model_name.endswith("ConditionalGeneration"):        # a right-padded decoder batch too
        labels = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(2))
        decoder_padding = torch.ones(2, 6, dtype=torch.long)
        decoder_padding[1, 4:] = 0
        kwargs.update(decoder_input_ids=labels, decoder_attention_mask=decoder_padding)
    with sdpa_kernel(SDPBackend.MATH):
        expected = gradient_and_hvp(model, kwargs, labels)
    torch._dynamo.reset()
    counters.clear()
    recent_reports.clear()
    compiled = torch.compile(model, backend="flashbob", options={"compiler": "aot_eager"})
    got = gradient_and_hvp(compiled, kwargs, labels)
    errors = [((g - e).norm() / e.norm()).item() for e, g in zip(expected, got)]
    sites = [("replaced" if s.replaced else f"left alone: {s.reason}")
             for r in recent_reports for s in r.sites]
    return "; ".join(sites) or "no attention site found", errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
    ap.add_argument("--implementations", nargs="+", default=["sdpa", "eager"])
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument("--tol", type=float, default=None,
                    help="largest relative error accepted (default 1e-6 in float64, 1e-4 in float32)")
    args = ap.parse_args()
    import transformers
    dtype = getattr(torch, args.dtype)
    tol = args.tol or (1e-6 if dtype == torch.float64 else 1e-4)
    failed = False
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.dtype}")
    for name in args.models:
        for implementation in args.implementations:
            sites, errors = check(transformers, name, implementation, dtype)
            if errors is None:
                print(f"{name:11s} {implementation:5s} {sites}")
                continue
            bad = max(errors) > tol
            failed |= bad
            print(f"{name:11s} {implementation:5s} {'WRONG' if bad else 'ok':5s} gradient "
                  f"{errors[0]:.1e}  HVP {errors[1]:.1e}  {sites}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
