"""torch.nn.attention.flex_attention in a compiled model on CUDA (inductor, float32): the
passes' rewrite where PyTorch's own op is real (its Triton kernel runs the first order of
the sites left to it), HVP and MAML against the block's eager-math twin in float64."""
import pytest
import torch

from bob_compile.backend import flashbob, recent_reports
from flex_models import REPLACED, make, reference
from scenarios import maml_step

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]
OPTIONS = {"compiler": "inductor", "fallback": False}
# float32 on the GPU (our kernels and PyTorch's flex kernel) against float64 math
TOLERANCE = 1e-4


def hvp(model, inputs):
    params = list(model.parameters())
    grads = torch.autograd.grad(model(*inputs).square().mean(), params, create_graph=True)
    return torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])


def stock_inductor_refuses(model, x):
    """PyTorch's reason, where stock torch.compile cannot compile the model's flex_attention
    for a first-order step on this device (its Triton template finds no config: torch 2.11,
    float32, a soft-capping score_mod); None where it can."""
    try:
        torch.compile(model, backend="inductor")(x).square().mean().backward()
    except torch._inductor.exc.InductorError as e:
        if "NoValidChoicesError" not in str(e):
            raise
        return str(e).splitlines()[0][:200]
    finally:
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
    return None


def relative_error(actual, expected):
    return max(((a.double() - e).norm() / e.norm()).item()
               for a, e in zip(actual, expected, strict=True))


@pytest.mark.parametrize("name", ["sliding window + ALiBi", "causal + learned bias",
                                  "ALiBi alone, GQA", "soft-capping 30 + sliding window",
                                  "attention sink + sliding window"])
@pytest.mark.parametrize("scenario", [hvp, maml_step], ids=lambda f: f.__name__)
def test_flex_attention_every_order_on_cuda(name, scenario):
    model, batches = make(name, device="cuda", dtype=torch.float32, head_dim=16)
    if not REPLACED[name]:      # PyTorch's kernel runs this site's first order
        refused = stock_inductor_refuses(model, batches[0])
        if refused:
            pytest.skip(f"stock torch.compile cannot compile this flex_attention: {refused}")
    twin = reference(model).double()
    inputs = (tuple(batches[:1]), tuple(batches[1:])) if scenario is maml_step else batches[:1]
    twin_inputs = tuple(tuple(t.double() for t in i) for i in inputs) \
        if scenario is maml_step else [batches[0].double()]
    expected = scenario(twin, twin_inputs)
    actual = scenario(torch.compile(model, backend=flashbob, options=OPTIONS), inputs)
    error = relative_error(actual, expected)
    assert error <= TOLERANCE, (error, [r.text() for r in recent_reports])
    sites = [s for r in recent_reports for s in r.sites]
    assert sites and all(s.replaced == REPLACED[name] for s in sites), [s.line() for s in sites]
