"""Learned additive biases through torch.compile(backend="flashbob"), float64 against eager
math: Hugging Face T5 (its relative-position bias from a bucket embedding, added to the
scores through SDPA's attn_mask or, in "eager", written out) and a learned-ALiBi model (one
slope per head, a parameter). Every site is replaced; the HVP and the MAML meta-gradient
w.r.t. every parameter, the bias's own included, equal eager math's."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bob_compile.backend import flashbob, recent_reports

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
OPTIONS = {"compiler": "aot_eager", "fallback": False}


def t5(attn_implementation):
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                   num_heads=2, relative_attention_num_buckets=8,
                                   dropout_rate=0.0)
    torch.manual_seed(0)
    model = transformers.T5EncoderModel._from_config(
        config, attn_implementation=attn_implementation).double()
    with torch.no_grad():    # a trained bias, not the near-zero initial one
        for module in model.modules():
            if hasattr(module, "relative_attention_bias"):
                module.relative_attention_bias.weight.normal_()
    for module in model.modules():      # T5's layer norm upcasts to float32, even float64
        if type(module).__name__ == "T5LayerNorm":
            module.forward = lambda x, m=module: m.weight * x * torch.rsqrt(
                x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
    return model


class LearnedAlibi(nn.Module):
    """Causal attention with ALiBi's linear distance penalty, one learned slope per head."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.slopes = nn.Parameter(torch.tensor([0.5, 0.25]))
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        n = x.shape[1]
        distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).to(x.dtype)
        # the causal mask inside the bias (SDPA refuses attn_mask with is_causal=True)
        bias = (self.slopes[:, None, None] * distance).masked_fill(distance > 0, -torch.inf)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).flatten(-2)).tanh()


def hvp_and_maml(model, loss_of):
    """The HVP along a random direction, and a MAML meta-gradient (one inner SGD step)."""
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss_of(model), params, create_graph=True, allow_unused=True,
                                materialize_grads=True)
    g = torch.Generator().manual_seed(5)
    hvp = torch.autograd.grad(grads, params, [torch.randn(p.shape, generator=g, dtype=p.dtype)
                                              for p in params], allow_unused=True,
                              materialize_grads=True)
    grads = torch.autograd.grad(loss_of(model), params, create_graph=True, allow_unused=True,
                                materialize_grads=True)
    fast = {n: p - 0.1 * gr for n, p, gr in zip(names, params, grads)}
    meta = torch.autograd.grad(
        loss_of(lambda *a, **kw: torch.func.functional_call(model, fast, a, kw)), params,
        allow_unused=True, materialize_grads=True)
    return [*hvp, *meta]


def relative_error(actual, expected):
    a = torch.cat([t.reshape(-1) for t in actual])
    e = torch.cat([t.reshape(-1) for t in expected])
    return ((a - e).norm() / e.norm()).item()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_t5_relative_position_bias(implementation):
    model = t5(implementation)
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(0))

    def loss_of(m):
        return torch.sin(m(input_ids=ids).last_hidden_state).sum()
    with sdpa_kernel(SDPBackend.MATH):
        expected = hvp_and_maml(model, loss_of)
    actual = hvp_and_maml(torch.compile(model, backend=flashbob, options=OPTIONS), loss_of)
    assert relative_error(actual, expected) <= 1e-9
    sites = [s for r in recent_reports for s in r.sites]
    assert sites and all(s.replaced for s in sites), [s.reason for s in sites]


def test_learned_alibi_slopes():
    torch.manual_seed(0)
    model = LearnedAlibi().double()
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss_of(m):
        return (m(x) ** 2).sum()
    with sdpa_kernel(SDPBackend.MATH):
        expected = hvp_and_maml(model, loss_of)
    actual = hvp_and_maml(torch.compile(model, backend=flashbob, options=OPTIONS), loss_of)
    assert relative_error(actual, expected) <= 1e-9
    sites = [s for r in recent_reports for s in r.sites]
    assert sites and all(s.replaced for s in sites)
