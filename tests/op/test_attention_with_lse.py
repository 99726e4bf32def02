"""bob_compile.attention.attention_with_lse: the output and the log-sum-exp of the visible
scaled scores per row, both differentiable to any order (what context parallelism merges
attention over disjoint key sets with), float64 against math written out."""
import pytest
import torch

from bob_compile.attention import attention_with_lse


def math_with_lse(q, k, v, mask, causal, scale):
    s = scale * q @ k.transpose(-2, -1)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_output_and_lse_at_every_order(causal, padded):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 5, dtype=torch.float64, generator=g, requires_grad=True)
               for _ in range(3))
    mask = (torch.arange(7) < torch.tensor([7, 4])[:, None])[:, None, None, :] if padded else None
    weights = [torch.randn(2, 3, 7, 5, dtype=torch.float64, generator=g),
               torch.randn(2, 3, 7, dtype=torch.float64, generator=g)]

    def derivatives(fn):
        o, lse = fn(q, k, v, mask, causal, 0.4)
        loss = (weights[0] * o).sum() + (weights[1] * lse).sum() + (o ** 2).sum() \
            + (lse ** 2).sum()
        grads = torch.autograd.grad(loss, (q, k, v), create_graph=True)
        second = torch.autograd.grad(sum((x ** 2).sum() for x in grads), (q, k, v))
        return (o, lse, *grads, *second)

    def ours(q, k, v, mask, causal, scale):
        return attention_with_lse(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)

    for got, want in zip(derivatives(ours), derivatives(math_with_lse)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_learned_bias_refused():
    q = torch.randn(1, 1, 3, 2)
    bias = torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(NotImplementedError, match="learned bias"):
        attention_with_lse(q, q, q, attn_mask=bias)
