"""Hugging Face models with `attn_implementation="flex_attention"`: transformers calls
torch.nn.attention.flex_attention with a BlockMask (causal and padding, sliding windows),
a score_mod that adds nothing or soft-caps (Gemma 2), and asks for the logsumexp, which it
drops. The passes replace both by the op (the soft-cap applied in its kernels); every
order is checked against the same weights
through SDPA's math path (Llama) or HF's eager attention (Gemma 2, whose soft-capping SDPA
cannot express) in float64, the loss computed in float64 from the logits.

On the CPU PyTorch's flex_attention refuses inputs that require grad; the fixture lifts
that check (the backend replaces the op)."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention import flex_attention as flex_module

from bob_compile.backend import recent_reports
from test_hf_architectures import _gradient_and_hvp

transformers = pytest.importorskip("transformers")

OPTIONS = {"compiler": "aot_eager", "fallback": False}


@pytest.fixture(autouse=True)
def flex_on_the_cpu(monkeypatch, fresh_dynamo):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args, **kwargs: None)


def _model(name, attn_implementation):
    T = transformers
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    config = {
        "llama": lambda: T.LlamaConfig(**small),
        # soft-capped scores, and a sliding window (4) on alternate layers; weights of std
        # 0.5 and a cap of 1, so that the cap matters (HF's init and a cap of 50 change the
        # scores by 1e-7)
        "gemma2": lambda: T.Gemma2Config(**small, head_dim=8, sliding_window=4,
                                         attn_logit_softcapping=1.0,
                                         final_logit_softcapping=None, initializer_range=0.5),
    }[name]()
    cls = {"llama": T.LlamaForCausalLM, "gemma2": T.Gemma2ForCausalLM}[name]
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation=attn_implementation,
                            dtype=torch.float64).train()


_softmax = torch.nn.functional.softmax


def _softmax_in_the_input_dtype(x, dim=None, dtype=None, **kwargs):
    return _softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)


@pytest.mark.parametrize("name, reference, tol, replaced, checkpointing", [
    # 1e-6: the RMSNorms compute in float32; the compiled graph orders those float32 ops
    # otherwise than eager does (2e-7 in Gemma 2's HVP)
    ("llama", "sdpa", 1e-6, True, False),
    ("gemma2", "eager", 1e-6, True, False),
    # gradient_checkpointing_enable(): the calls inside the checkpointed bodies
    ("llama", "sdpa", 1e-6, True, True),
])
def test_flex_attention_models(monkeypatch, name, reference, tol, replaced, checkpointing):
    from bob_compile import block_masks
    from bob_compile.kernels.interval_masks import KeyIntervals
    resolved, resolve = [], block_masks.resolve
    monkeypatch.setattr(block_masks, "resolve",
                        lambda *args: resolved.append(resolve(*args)) or resolved[-1])
    ids = torch.randint(1, 32, (2, 10), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, 7:] = 0                  # right padding: every query still sees a key
    kwargs = dict(input_ids=ids, attention_mask=padding)
    with sdpa_kernel(SDPBackend.MATH), monkeypatch.context() as patch:
        # HF's eager attention takes its softmax in float32 whatever the input's dtype: the
        # reference's own error (9e-7 in the HVP, transformers 5.25) would hide ours
        patch.setattr(torch.nn.functional, "softmax", _softmax_in_the_input_dtype)
        expected = _gradient_and_hvp(_model(name, reference), kwargs, ids)
    model = _model(name, "flex_attention")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    actual = _gradient_and_hvp(torch.compile(model, backend="flashbob", options=OPTIONS),
                               kwargs, ids)
    for a, e in zip(actual, expected):
        assert ((a - e).norm() / e.norm()).item() <= tol
    sites = [s for r in recent_reports for s in r.sites]
    assert len(sites) == 2 and all(s.kind == "flex_attention" for s in sites)
    assert all(s.replaced == replaced for s in sites), [s.line() for s in sites]
    if replaced:    # causal (or windows) with padding: key intervals, resolved by the ops from
        # the packed lists
        assert all("resolved by the op" in s.mask for s in sites), [s.mask for s in sites]
        assert resolved and all(isinstance(m, KeyIntervals) for m in resolved)
    if checkpointing:       # found inside the checkpointed bodies ("<body>.<node>")
        assert all("." in s.node for s in sites), [s.node for s in sites]
