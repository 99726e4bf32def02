"""MAML through the meta-learning libraries people use, compiled with flashbob: exact
(float64, against eager math attention) and second order, with the fused op in every graph.

- higher (innerloop_ctx): a compiled module cannot be handed to higher (it recurses into
  the compiled wrapper with any backend), so the recipe is to compile the patched
  functional model that innerloop_ctx yields;
- torchopt MetaSGD: the compiled module, its parameters updated in place by the
  differentiable optimizer;
- torchopt FuncOptimizer: a compiled functional_call, parameters as a dict.
Two inner steps each, so the outer gradient goes through two create_graph backwards.
"""
import pytest
import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from bob_compile.backend import flashbob, recent_reports
from models import CASES, exact_twin, loss_of

OPTIONS = {"compiler": "aot_eager", "fallback": False}
INNER_STEPS = 2

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def tasks():
    case = CASES["nanogpt"]
    return torch.cat([case.batch(0)[0][:1], case.batch(1)[0][:1]])   # support, query


def compiled(fn):
    return torch.compile(fn, backend=flashbob, options=OPTIONS)


def higher_maml(model, compile_fn, x):
    higher = pytest.importorskip("higher")
    inner_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with higher.innerloop_ctx(model, inner_opt, copy_initial_weights=False) as (fmodel, diffopt):
        f = compile_fn(fmodel)
        for _ in range(INNER_STEPS):
            diffopt.step(loss_of(f(x[:1])))
        outer = loss_of(f(x[1:]))
    return torch.autograd.grad(outer, list(model.parameters()))


def torchopt_meta_sgd(model, compile_fn, x):
    torchopt = pytest.importorskip("torchopt")
    initial = list(model.parameters())
    state = torchopt.extract_state_dict(model)
    inner_opt = torchopt.MetaSGD(model, lr=0.1)
    f = compile_fn(model)
    for _ in range(INNER_STEPS):
        inner_opt.step(loss_of(f(x[:1])))
    grads = torch.autograd.grad(loss_of(f(x[1:])), initial)
    torchopt.recover_state_dict(model, state)
    return grads


def torchopt_func_optimizer(model, compile_fn, x):
    torchopt = pytest.importorskip("torchopt")
    names, params = zip(*model.named_parameters())
    # the weights as a tuple (torch 2.11's autograd.grad, which FuncOptimizer calls, takes no dict)
    f = compile_fn(lambda p, x: functional_call(model, dict(zip(names, p)), (x,)))
    inner_opt = torchopt.FuncOptimizer(torchopt.sgd(lr=0.1))
    fast = params
    for _ in range(INNER_STEPS):
        fast = inner_opt.step(loss_of(f(fast, x[:1])), fast)
    return torch.autograd.grad(loss_of(f(fast, x[1:])), list(params))


@pytest.mark.parametrize("recipe", [higher_maml, torchopt_meta_sgd, torchopt_func_optimizer],
                         ids=lambda f: f.__name__)
def test_meta_learning_library_maml(recipe):
    model, x = CASES["nanogpt"].model(), tasks()
    with sdpa_kernel(SDPBackend.MATH):
        expected = recipe(exact_twin(model), lambda m: m, x)
    actual = recipe(model, compiled, x)
    assert max((a - e).abs().max().item() for a, e in zip(actual, expected, strict=True)) <= 1e-9
    assert recent_reports and all(r.route == "training" and len(r.replaced) == 1 and not r.skipped
                                  for r in recent_reports), [r.text() for r in recent_reports]
