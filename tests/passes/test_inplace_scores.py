"""Hand-written attention that scales or masks its scores in place (bob_compile/passes/inplace.py).

Each spelling is replaced and exact in every order (float64, against the same function run
eagerly); writes that another name could observe (a view of the scores, an item
assignment) leave the site as written, and the results still equal eager.
"""
import math
import operator

import pytest
import torch

from bob_compile.backend import counters
from bob_compile.passes.inplace import functionalize_temporaries
from bob_compile import training

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OPTIONS = {"compiler": "aot_eager", "fallback": False}


def divide_in_place(q, k, v, mask):
    # Falcon (transformers' eager attention): `attention_scores /= math.sqrt(self.head_dim)`
    scores = q @ k.transpose(-1, -2)
    scores /= math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


def div_method(q, k, v, mask):
    scores = q @ k.transpose(-1, -2)
    scores.div_(math.sqrt(q.shape[-1]))
    return scores.softmax(-1) @ v


def masked_fill_result_discarded(q, k, v, mask):
    # tutorial style: the in-place fill's result is not used, the softmax reads `scores`
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores.masked_fill_(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def add_mask_in_place(q, k, v, mask):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores += mask.to(scores.dtype) * -1e9
    return scores.softmax(-1) @ v


def multi_query_broadcast(q, k, v, mask):
    # Falcon's multi-query attention: one k/v head, broadcast by the matmuls
    k, v = k[:, :1], v[:, :1]
    scores = q @ k.transpose(-1, -2)
    scores /= math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


def item_assignment(q, k, v, mask):
    # must not match: a write through an index (a view of the scores)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores[..., 0] = 0.0
    return scores.softmax(-1) @ v


def write_through_a_view(q, k, v, mask):
    # must not match: the softmax reads a view taken before the in-place division
    scores = q @ k.transpose(-1, -2)
    flat = scores.view(-1, scores.shape[-1])
    scores /= math.sqrt(q.shape[-1])
    return flat.softmax(-1).view(scores.shape) @ v


def _inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    mask = torch.rand(5, 5) > 0.6
    mask.fill_diagonal_(False)      # every row sees a key
    return q, k, v, mask


def _all_orders(fn, q, k, v, mask):
    out = fn(q, k, v, mask)
    grads = torch.autograd.grad((out * out.detach().cos()).sum(), (q, k, v), create_graph=True)
    hvps = torch.autograd.grad(sum((g * g.detach().sin()).sum() for g in grads), (q, k, v))
    return (out, *grads, *hvps)


@pytest.mark.parametrize("fn, replaced", [
    (divide_in_place, 1), (div_method, 1), (masked_fill_result_discarded, 1),
    (add_mask_in_place, 1), (multi_query_broadcast, 1),
    (item_assignment, 0), (write_through_a_view, 0)])
def test_in_place_scores_every_order(fn, replaced):
    q, k, v, mask = _inputs()
    expected = _all_orders(fn, q, k, v, mask)
    got = _all_orders(torch.compile(fn, backend="flashbob", options=OPTIONS), q, k, v, mask)
    assert counters["handwritten_replaced"] == replaced
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


def test_only_private_temporaries_are_rewritten():
    # s = x @ y; s /= 2; s.mul_(3) (a temporary: out of place); x.add_(1) (an input: kept)
    x, y = torch.randn(3, 3), torch.randn(3, 3)
    graph = torch.fx.Graph()
    px, py = graph.placeholder("x"), graph.placeholder("y")
    s = graph.call_function(operator.matmul, (px, py))
    halved = graph.call_function(operator.itruediv, (s, 2.0))
    tripled = graph.call_method("mul_", (halved, 3.0))
    read_after = graph.call_method("sum", (s,))       # reads the value after both writes
    bumped = graph.call_method("add_", (px, 1.0))
    graph.output((tripled, read_after, bumped))
    value = x @ y
    for node, recorded in ((px, x), (py, y), (s, value), (halved, value), (tripled, value),
                           (read_after, value.sum()), (bumped, x)):
        node.meta["example_value"] = recorded
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    expected = gm(x.clone(), y)
    assert functionalize_temporaries(gm) == 2
    gm.recompile()
    assert halved.target is operator.truediv and tripled.target == "mul"
    assert bumped.target == "add_" and read_after.args[0] is tripled
    for e, g in zip(expected, gm(x.clone(), y)):
        torch.testing.assert_close(g, e)


def test_inductor_attention_fusion_is_off_while_a_training_graph_compiles():
    from torch._inductor.fx_passes import fuse_attention
    check = fuse_attention._sfdp_params_check
    with training.without_inductor_attention_fusion():
        assert fuse_attention._sfdp_params_check(None) is False
    assert fuse_attention._sfdp_params_check is check
