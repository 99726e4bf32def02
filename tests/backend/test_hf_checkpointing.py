"""Hugging Face gradient checkpointing: the attention inside the checkpointed layers is seen.

`model.gradient_checkpointing_enable()` makes Dynamo put every layer in the body of a
tag_activation_checkpoint higher-order op. The backend rewrites those bodies (see
bob_compile/passes/subgraphs.py) and reports their sites; it never says "0 attention sites" for them.
In training mode with checkpointing, transformers (5.x) builds its causal mask from the
position ids with packed-sequence detection (torch.diff, cumsum, advanced indexing), which
the causal-mask proof does not read: the mask is passed on as a general mask, and the sites
are replaced, exact at every order. Llama-family layers set a context variable in their
forward (transformers' hub kernels), which Dynamo traces only with
skip_fwd_side_effects_in_bwd_under_checkpoint, which flashbob sets (bob_compile/checkpointing.py);
without it those layers ran eagerly, on PyTorch's fused SDPA, and the second order failed.
"""
import copy
import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from bob_compile.backend import flashbob, recent_reports
from torch.nn.attention import SDPBackend, sdpa_kernel

from kept_bytes import FIRST, SECOND, kept_bytes
from tiers import diagonal

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


# the models, batches and losses of the padded-batch tests (RMSNorm in float64 there)
import test_hf_masks as hf  # noqa: E402


@functools.lru_cache(maxsize=None)
def eager_reference(name, padded):
    """(ids, mask, gradient, HVP) of the unchecked model, eager SDPA math: once per model
    and batch for all the implementations and checkpoint kinds."""
    ids, mask = hf.batch()
    if not padded:
        mask = torch.ones_like(mask)
    with sdpa_kernel(SDPBackend.MATH):
        grads, hvp = hf.gradients_and_hvp(hf.build(name).train(), ids, mask)
    return ids, mask, grads, hvp


def checkpointed(name, implementation, reentrant):
    model = hf.build(name, implementation)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()


@pytest.mark.parametrize("name,implementation,reentrant,padded", diagonal(
    ["gpt2", "llama", "mistral", "qwen2", "bert"], ["sdpa", "eager"], [False, True],
    [True, False], ids=str))
def test_checkpointed_models_are_replaced_and_exact(name, implementation, reentrant, padded):
    """Every architecture, both attention implementations, both checkpoint kinds, with and
    without padding: both layers' sites replaced, gradient and HVP equal to the same weights
    run eagerly through SDPA's math, without checkpointing."""
    ids, mask, grads, hvp = eager_reference(name, padded)
    compiled = torch.compile(checkpointed(name, implementation, reentrant), backend=flashbob,
                             options={"compiler": "aot_eager", "fallback": False})
    actual_grads, actual_hvp = hf.gradients_and_hvp(compiled, ids, mask)
    assert hf.max_error(actual_grads, grads) <= hf.TOL
    assert hf.max_error(actual_hvp, hvp) <= hf.TOL
    sites = [s for r in recent_reports for s in r.sites]
    assert len(sites) == 2 and all(s.replaced for s in sites), [r.text() for r in recent_reports]


def test_maml_through_checkpointed_llama():
    ids, mask = hf.batch()
    with sdpa_kernel(SDPBackend.MATH):
        expected = hf.maml_meta_gradient(hf.build("llama").train(), ids, mask)
    compiled = torch.compile(checkpointed("llama", "sdpa", False), backend=flashbob,
                             options={"compiler": "aot_eager", "fallback": False})
    assert hf.max_error(hf.maml_meta_gradient(compiled, ids, mask), expected) <= hf.TOL
    sites = [s for r in recent_reports for s in r.sites]
    assert sites and all(s.replaced for s in sites)


def test_replay_keeps_pytorchs_default_and_a_bad_value_is_an_error():
    """BOB_COMPILE_CHECKPOINT_SIDE_EFFECTS=replay: Dynamo's flag stays off (a fresh process,
    since the backend sets it when it is loaded); an unknown value names the valid ones."""
    code = ("import torch, bob_compile; "
            "print(torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint)")
    for value, printed in (("replay", "False"), ("", "True")):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=dict(os.environ, BOB_COMPILE_CHECKPOINT_SIDE_EFFECTS=value))
        assert done.returncode == 0 and done.stdout.strip() == printed, done.stderr[-2000:]
    from bob_compile import checkpointing
    with pytest.MonkeyPatch.context() as m:
        m.setenv("BOB_COMPILE_CHECKPOINT_SIDE_EFFECTS", "always")
        with pytest.raises(ValueError, match="use one of skip, replay"):
            checkpointing.trace_checkpointed_side_effects()


@pytest.mark.parametrize("reentrant", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradient_checkpointing_lowers_what_every_order_keeps(reentrant):
    """gradient_checkpointing_enable() saves memory at every compiled order, as it does for
    eager first order: the first order and the second order's forward half keep less than
    without it (the report's bytes), and the gradient and HVP stay exact."""
    ids, mask, grads, hvp = eager_reference("llama", True)
    kept = {}
    for checkpointing in (False, True):
        recent_reports.clear()
        model = checkpointed("llama", "sdpa", reentrant) if checkpointing else \
            hf.build("llama").train()
        compiled = torch.compile(model, backend=flashbob, options={"compiler": "aot_eager",
                                                                   "fallback": False})
        actual_grads, actual_hvp = hf.gradients_and_hvp(compiled, ids, mask)
        assert hf.max_error(actual_grads, grads) <= hf.TOL
        assert hf.max_error(actual_hvp, hvp) <= hf.TOL
        kept[checkpointing] = kept_bytes(FIRST), kept_bytes(SECOND)
        torch._dynamo.reset()
    (plain_first, plain_second), (first, second) = kept[False], kept[True]
    assert 0 < first < 0.5 * plain_first, kept
    assert 0 < second < plain_second, kept
