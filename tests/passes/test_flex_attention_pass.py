"""The passes on torch.nn.attention.flex_attention calls (Dynamo's flex_attention
higher-order op), in float64 on the CPU: additive score_mods replaced by the op, others run
as math where the graph is differentiated, every order against an eager reference that
applies the same mask_mod and score_mod by broadcasting over index tensors (no vmap, no
BlockMask, no code under test).

On the CPU PyTorch's flex_attention refuses inputs that require grad (`_validate_device`),
so the fixture below lets it through; the backend then replaces the op. AOTAutograd runs
with aot_eager (test_inductor_compiles_a_replaced_site covers inductor)."""
import copy

import pytest
import torch
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from bob_compile.backend import flashbob, recent_reports
from bob_compile.passes import counters
from scenarios import (first_order, grad_of_grad, hutchinson_hvp, jvp_of_grad, maml_step,
                       max_error, vmap_of_grad)
from tiers import diagonal

OPTIONS = {"compiler": "aot_eager", "fallback": False}
TOLERANCE = 1e-9
B, H, E = 2, 2, 4
BLOCK = 16                 # smaller than the lengths: full, partial and empty blocks


@pytest.fixture(autouse=True)
def flex_on_the_cpu(monkeypatch, fresh_dynamo):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args, **kwargs: None)


# ---------------------------------------------------------------------------- masks and mods
# Each takes index tensors (0-d under FlexAttention's vmap; broadcast (B, H, L, S) grids in
# the reference), as attention-gym's recipes are written.
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):          # Mistral / Gemma 2 local layers
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 9)


def prefix_lm(b, h, q_idx, kv_idx):               # T5-style prefix LM: a 6-token prefix
    return (kv_idx < 6) | (q_idx >= kv_idx)


DOCUMENT_IDS = torch.tensor([0] * 7 + [1] * 13 + [2] * 3 + [3] * 14)   # packed, 37 tokens


def documents(b, h, q_idx, kv_idx):               # packed sequences, causal per document
    return (DOCUMENT_IDS[q_idx] == DOCUMENT_IDS[kv_idx]) & (q_idx >= kv_idx)


SLOPES = torch.tensor([0.5, 0.125], dtype=torch.float64)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def softcap_30(score, b, h, q_idx, kv_idx):        # Gemma 2's attention logit soft-capping
    return 30 * torch.tanh(score / 30)


def softcap_50(score, b, h, q_idx, kv_idx):
    return 50 * torch.tanh(score / 50)


RELATIVE = torch.randn(2 * 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def relative_buffer(score, b, h, q_idx, kv_idx):   # a relative-position bias table
    return score + RELATIVE[q_idx - kv_idx + 64]


class FlexBlock(torch.nn.Module):
    """A projection, flex_attention with the given mods, a projection; `learned_bias`
    adds a parameter table read by the score_mod (its gradient flows through the op)."""

    def __init__(self, length, mask_mod, score_mod, kv_heads=H, learned_bias=False):
        super().__init__()
        self.length, self.kv_heads, self.reference = length, kv_heads, False
        self.qkv = torch.nn.Linear(E * H, E * (H + 2 * kv_heads))
        self.out = torch.nn.Linear(E * H, E * H)
        self.mask_mod, self.base_score_mod = mask_mod, score_mod
        self.table = torch.nn.Parameter(0.1 * torch.randn(H, length, length)) \
            if learned_bias else None
        self.block_mask = None if mask_mod is None else create_block_mask(
            mask_mod, None, None, length, length, device="cpu", BLOCK_SIZE=BLOCK)

    @property
    def modifies_scores(self):
        return self.base_score_mod is not None or self.table is not None

    def score_mod(self, score, b, h, q_idx, kv_idx):
        if self.base_score_mod is not None:
            score = self.base_score_mod(score, b, h, q_idx, kv_idx)
        if self.table is not None:
            score = score + self.table[h, q_idx, kv_idx]
        return score

    def heads(self, x):
        q, k, v = self.qkv(x).split([E * H, E * self.kv_heads, E * self.kv_heads], -1)
        return [t.unflatten(-1, (-1, E)).transpose(1, 2) for t in (q, k, v)]

    def forward(self, x):
        q, k, v = self.heads(x)
        if self.reference:
            y = self.math(q, k, v)
        else:
            y = flex_attention(q, k, v, score_mod=self.score_mod if self.modifies_scores else None,
                               block_mask=self.block_mask, enable_gqa=self.kv_heads != H)
        return self.out(y.transpose(1, 2).flatten(-2)).tanh()

    def math(self, q, k, v):
        """The same attention in eager math: the mods evaluated on broadcast index grids."""
        k, v = (t.repeat_interleave(H // self.kv_heads, 1) for t in (k, v))
        L = q.shape[-2]
        b, h, q_idx, kv_idx = (torch.arange(n).view([-1 if i == d else 1 for i in range(4)])
                               for d, n in enumerate((B, H, L, L)))
        scores = q @ k.transpose(-1, -2) / E ** 0.5
        scores = self.score_mod(scores, b, h, q_idx, kv_idx) if self.modifies_scores else scores
        if self.mask_mod is not None:
            scores = scores.masked_fill(~self.mask_mod(b, h, q_idx, kv_idx), float("-inf"))
        return scores.softmax(-1) @ v


def reference(model):
    """The model's twin with the same parameters, attention in eager math."""
    twin = copy.deepcopy(model)
    twin.reference = True
    return twin


CASES = {   # name: (length, mask_mod, score_mod, kv heads, learned bias)
    "causal": (29, causal, None, H, False),
    "sliding window + ALiBi": (45, sliding_window, alibi, H, False),
    "documents": (37, documents, None, H, False),
    "prefix-LM + relative buffer": (33, prefix_lm, relative_buffer, H, False),
    "causal + learned bias": (23, causal, None, H, True),
    "ALiBi alone, GQA": (19, None, alibi, 1, False),
    "soft-capping 30 + sliding window": (45, sliding_window, softcap_30, H, False),
    "soft-capping 50 + causal": (29, causal, softcap_50, H, False),
}
REPLACED = {name: case[2] not in (softcap_30, softcap_50) for name, case in CASES.items()}


def make(name):
    length, mask_mod, score_mod, kv_heads, learned = CASES[name]
    torch.manual_seed(0)
    model = FlexBlock(length, mask_mod, score_mod, kv_heads, learned).double()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(B, length, E * H, dtype=torch.float64, generator=g) for _ in range(2)]
    return model, batches


def assert_report(name):
    assert recent_reports, "flashbob compiled nothing"
    sites = [s for r in recent_reports for s in r.sites]
    assert sites and all(s.kind == "flex_attention" for s in sites)
    if REPLACED[name]:
        assert all(s.replaced for s in sites), [s.line() for s in sites]
    else:
        assert all(not s.replaced and "is not score plus a term" in s.reason
                   and "runs as math" in s.reason for s in sites), [s.line() for s in sites]


# ---------------------------------------------------------------------------- every order
@pytest.mark.parametrize("name,scenario", diagonal(
    list(CASES), [first_order, hutchinson_hvp, maml_step],
    ids=lambda v: v if isinstance(v, str) else v.__name__))
def test_differentiated_from_outside(name, scenario):
    model, batches = make(name)
    inputs = (tuple(batches[:1]), tuple(batches[1:])) if scenario is maml_step else batches[:1]
    expected = scenario(reference(model), inputs)
    actual = scenario(torch.compile(model, backend=flashbob, options=OPTIONS), inputs)
    assert max_error(actual, expected) <= TOLERANCE
    assert_report(name)


@pytest.mark.parametrize("name,scenario", diagonal(
    ["sliding window + ALiBi", "soft-capping 30 + sliding window"],
    [jvp_of_grad, grad_of_grad, vmap_of_grad],
    ids=lambda v: v if isinstance(v, str) else v.__name__))
def test_transforms_compiled(name, scenario):
    """torch.func inside the compiled function (the "aot" route): replaced sites run the
    op; the others PyTorch's op, whose torch.func rules bob_compile gives (its math:
    PyTorch has none, and Dynamo fails tracing the op under a transform without them)."""
    model, batches = make(name)
    params = {n: p.detach() for n, p in model.named_parameters()}
    expected = scenario(reference(model), params, batches[:1])
    compiled = torch.compile(lambda p: scenario(model, p, batches[:1]), backend=flashbob,
                             options=OPTIONS)
    assert max_error(compiled(params), expected) <= TOLERANCE
    assert all(r.route == "aot" for r in recent_reports)
    sites = [s for r in recent_reports for s in r.sites]
    assert sites and all(s.replaced == REPLACED[name] for s in sites)


def test_inductor_compiles_a_replaced_site():
    model, batches = make("sliding window + ALiBi")
    expected = hutchinson_hvp(reference(model), batches[:1])
    actual = hutchinson_hvp(torch.compile(model, backend=flashbob, options={"fallback": False}),
                            batches[:1])
    assert max_error(actual, expected) <= TOLERANCE
    assert_report("sliding window + ALiBi")


# ---------------------------------------------------------------------------- routes
def test_inference_keeps_pytorchs_op():
    """Nothing differentiates an inference graph: the call goes back to PyTorch's op
    (block-sparse, no mask materialized), the report still naming the site."""
    model, batches = make("sliding window + ALiBi")
    with torch.no_grad():
        expected = reference(model)(batches[0])
        actual = torch.compile(model, backend=flashbob, options=OPTIONS)(batches[0])
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9)
    report, = recent_reports
    assert report.route == "inference" and counters["inference_native_sdpa"] == 1
    assert "FlexAttention" in report.route_reason and report.sites[0].replaced


def test_a_read_logsumexp_keeps_the_call_and_its_second_order_is_math():
    """return_lse: the op gives the output only, so the call stays PyTorch's (first order),
    and runs as math where the graph is differentiated twice: the HVP through the
    logsumexp is exact."""
    model, batches = make("causal")

    def with_lse(model, x):
        q, k, v = model.heads(x)
        if model.reference:
            L = q.shape[-2]
            visible = torch.ones(L, L, dtype=torch.bool).tril()
            scores = (q @ k.transpose(-1, -2) / E ** 0.5).masked_fill(~visible, float("-inf"))
            out, lse = scores.softmax(-1) @ v, scores.logsumexp(-1)
        else:
            out, lse = flex_attention(q, k, v, block_mask=model.block_mask, return_lse=True)
        return out.sin().sum() + lse.square().sum()

    def hvp(function, params):
        grads = torch.autograd.grad(function(batches[0]), params, create_graph=True)
        return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
    twin = reference(model)
    expected = hvp(lambda x: with_lse(twin, x), list(twin.qkv.parameters()))
    compiled = torch.compile(lambda x: with_lse(model, x), backend=flashbob, options=OPTIONS)
    actual = hvp(compiled, list(model.qkv.parameters()))
    assert max_error(actual, expected) <= TOLERANCE
    site, = [s for r in recent_reports for s in r.sites]
    assert not site.replaced and "logsumexp" in site.reason and "runs as math" in site.reason

