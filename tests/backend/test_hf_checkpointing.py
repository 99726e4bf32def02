"""Hugging Face gradient checkpointing: the attention inside the checkpointed layers is seen.

`model.gradient_checkpointing_enable()` makes Dynamo put every GPT-2 layer in the body of
a tag_activation_checkpoint higher-order op. The backend rewrites those bodies (see
bob_compile/passes/subgraphs.py) and reports their sites; it never says "0 attention sites" for them.
In training mode with checkpointing, transformers (5.x) builds its causal mask from the
position ids with packed-sequence detection (torch.diff, cumsum, advanced indexing), which
the causal-mask proof does not read: the mask is passed on as a general mask, and the sites
are replaced, exact at every order.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from bob_compile.backend import flashbob, recent_reports

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def gpt2(attn_implementation):
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel._from_config(
        config, attn_implementation=attn_implementation).double()


def hvp(model, idx):
    params = list(model.parameters())
    logits = model(input_ids=idx).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])


def test_attention_inside_checkpointed_layers_is_replaced_and_exact():
    reference = gpt2("eager")
    model = copy.deepcopy(reference)
    model.gradient_checkpointing_enable()
    model.train()
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = hvp(reference, idx)
    actual = hvp(torch.compile(model, backend=flashbob, options={"compiler": "aot_eager"}), idx)
    assert max((a - e).abs().max().item() for a, e in zip(actual, expected)) <= 1e-9
    sites = [s for r in recent_reports for s in r.sites]
    assert len(sites) == 2, [r.text() for r in recent_reports]
    assert all(s.node.startswith("wrap_body_") and s.kind == "handwritten" for s in sites)
    assert all(s.replaced for s in sites), [r.text() for r in recent_reports]
