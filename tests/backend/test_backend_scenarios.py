"""Second-order training through compiled models: every model × every scenario, exact.

Models (tests/models.py): SDPA block, nanoGPT block, Hugging Face eager block (GQA, additive
mask, float32 softmax), ViT block, 2-layer GPT. Scenarios: first order, Hutchinson HVP,
one MAML step (torch.func.functional_call + outer gradient), and torch.compile of
grad(grad(f)), jvp(grad(f)) and vmap(grad(f)). Each compares float64 results with eager
under SDPBackend.MATH (max error <= 1e-9) and checks that flashbob replaced every
attention site. AOTAutograd runs with aot_eager here (inductor is covered in
test_backend.py): the routing and the traced derivative graphs are the same.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bob_compile.backend import flashbob, recent_reports
from models import CASES, exact_twin
from scenarios import (first_order, grad_of_grad, hutchinson_hvp, jvp_of_grad, maml_step,
                       max_error, vmap_of_grad)
from tiers import diagonal

OPTIONS = {"compiler": "aot_eager", "fallback": False}
TOLERANCE = 1e-9


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def assert_attention_replaced(case, route):
    assert recent_reports, "flashbob compiled nothing"
    for report in recent_reports:
        assert len(report.replaced) == case.sites and not report.skipped, report.text()
        assert report.route == route, report.text()


# ---------------------------------------------------------------------------- outside autograd
def scenario_inputs(case, scenario):
    return (case.batch(0), case.batch(1)) if scenario is maml_step else case.batch(0)


@pytest.mark.parametrize("name,scenario", diagonal(
    sorted(CASES), [first_order, hutchinson_hvp, maml_step],
    ids=lambda v: v if isinstance(v, str) else v.__name__))
def test_differentiated_from_outside(name, scenario):
    case = CASES[name]
    model = case.model()
    inputs = scenario_inputs(case, scenario)
    with sdpa_kernel(SDPBackend.MATH):
        expected = scenario(exact_twin(model), inputs)
        if scenario is maml_step:
            assert_stock_compile_fails_maml(model, inputs, expected)
    actual = scenario(torch.compile(model, backend=flashbob, options=OPTIONS), inputs)
    assert max_error(actual, expected) <= TOLERANCE
    assert_attention_replaced(case, route="training")


def assert_stock_compile_fails_maml(model, inputs, expected):
    """Stock AOTAutograd refuses this double backward, or drops its second-order term
    without an error (test_stock_compile_silently_first_order below); never exact."""
    try:
        stock = maml_step(torch.compile(model, backend="aot_eager"), inputs)
    except RuntimeError as e:
        assert "does not currently support double backward" in str(e)
    else:
        assert max_error(stock, expected) > 1e-4, "stock torch.compile was expected to be wrong"
    torch._dynamo.reset()


def test_stock_compile_silently_first_order():
    """docs/torch-behaviour.md, with attention: MAML over a plain weight tensor. Stock compile returns
    a wrong outer gradient and no error; flashbob returns the exact one."""
    def loss(w, x):
        q = (x @ w).view(2, 8, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).square().mean()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 8, generator=g, dtype=torch.float64)
    w0 = torch.randn(8, 8, generator=g, dtype=torch.float64) * 0.5

    def maml(compiled_loss):
        w = w0.clone().requires_grad_()
        gw, = torch.autograd.grad(compiled_loss(w, x), w, create_graph=True)
        return torch.autograd.grad(compiled_loss(w - 0.1 * gw, x), w)[0]

    with sdpa_kernel(SDPBackend.MATH):
        expected = maml(loss)
        stock = maml(torch.compile(loss, backend="aot_eager"))
    assert (stock - expected).abs().max() > 1e-3
    torch._dynamo.reset()
    exact = maml(torch.compile(loss, backend=flashbob, options=OPTIONS))
    assert (exact - expected).abs().max() <= TOLERANCE
    assert recent_reports and all(r.replaced for r in recent_reports)


# ---------------------------------------------------------------------------- inside the graph
@pytest.mark.parametrize("name,scenario", diagonal(
    sorted(n for n, case in CASES.items() if case.transforms), [grad_of_grad, jvp_of_grad, vmap_of_grad],
    ids=lambda v: v if isinstance(v, str) else v.__name__))
def test_transforms_compiled(name, scenario):
    case = CASES[name]
    model = case.model()
    inputs = case.batch(0)
    params = {name: p.detach() for name, p in model.named_parameters()}
    # Dynamo traces SDPA's derivative with fake tensors before any backend runs; only the
    # MATH kernel has a double backward (docs/torch-behaviour.md). After the rewrite it is unused.
    with sdpa_kernel(SDPBackend.MATH):
        expected = scenario(exact_twin(model), params, inputs)
        compiled = torch.compile(lambda p: scenario(model, p, inputs), backend=flashbob, options=OPTIONS)
        actual = compiled(params)
    assert max_error(actual, expected) <= TOLERANCE
    assert_attention_replaced(case, route="aot")
