"""The "training" route: compiled forward, backward and double backward, exact at every order.

Float64 against eager PyTorch (SDPA under SDPBackend.MATH). The model x scenario matrix of
test_backend_scenarios.py runs this route with aot_eager; here: inductor in every order
(and proof that its code ran), MAML written three ways with one and two inner steps,
gradient penalties, third order, dropout, graphs the route refuses, dynamic shapes, dumps.
"""
import os
import re

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import bob_compile.training.runtime as training_runtime
from bob_compile.backend import counters, flashbob, recent_reports
from bob_compile.kernels import settings
from bob_compile.training.pairs import NotSupported
from models import CASES, SDPABlock, exact_twin, loss_of
from tiers import diagonal

AOT_EAGER = {"compiler": "aot_eager", "fallback": False}
INDUCTOR = {"compiler": "inductor", "fallback": False}
TOLERANCE = 1e-9

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def max_error(actual, expected):
    return max((a - e).abs().max().item() for a, e in zip(actual, expected, strict=True))


def math_sdpa():
    return sdpa_kernel(SDPBackend.MATH)


# ---------------------------------------------------------------------------- scenarios
def first_order(model, x):
    return torch.autograd.grad(loss_of(model(x)), list(model.parameters()))


def hessian_vector_product(model, x):
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model(x)), params, create_graph=True)
    vectors = [torch.full_like(p, 0.5) for p in params]
    return torch.autograd.grad(grads, params, grad_outputs=vectors)


def gradient_penalty(model, x):
    """WGAN-GP / R1 style: the loss plus the squared norm of its input gradient."""
    x = x.detach().requires_grad_()
    loss = loss_of(model(x))
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    return torch.autograd.grad(loss + gx.square().sum(), list(model.parameters()))


def maml(model, x, steps=1, inner_lr=0.1):
    params = dict(model.named_parameters())
    fast = dict(params)
    for _ in range(steps):
        inner = loss_of(functional_call(model, fast, (x[:1],)))
        grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
        fast = {name: p - inner_lr * g for (name, p), g in zip(fast.items(), grads)}
    return torch.autograd.grad(loss_of(functional_call(model, fast, (x[1:],))), list(params.values()))


# ---------------------------------------------------------------------------- inductor in every order
class CompiledRuns:
    """Counts the runs of every graph inductor compiles, by the order it belongs to."""

    def __init__(self):
        from torch._inductor.compile_fx import compile_fx_inner
        self.runs, self._inner, self._order = {}, compile_fx_inner, "first_order"

    def compile(self, graph, example_inputs, **kwargs):
        compiled = self._inner(graph, example_inputs, **kwargs)
        name = f"{self._order}.{'backward' if kwargs.get('is_backward') else 'forward'}"
        self.runs.setdefault(name, 0)

        def run(args):
            self.runs[name] += 1
            return compiled(args)
        run._boxed_call = True
        return run

    def ordered(self, original):
        def compile_second_order(graph_runtime, *args):
            self._order = "second_order"
            try:
                return original(graph_runtime, *args)
            finally:
                self._order = "first_order"   # Dynamo's next graph
        return compile_second_order


@pytest.fixture
def inductor_runs(monkeypatch):
    runs = CompiledRuns()
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx_inner", runs.compile)
    monkeypatch.setattr(training_runtime.TrainingGraph, "_compile",
                        runs.ordered(training_runtime.TrainingGraph._compile))
    return runs


# A create_graph backward runs the forward half of the second-order pair (the graph's VJP as
# a differentiable function) instead of the first-order backward; the second backward runs
# its backward half, and the first-order backward for the cotangent that reaches the
# outputs through the loss (an HVP of a nonlinear loss).
SECOND_ORDER_RUNS = {"first_order.forward", "second_order.forward", "second_order.backward",
                     "first_order.backward"}


@pytest.mark.parametrize("scenario,expected_runs", [
    (first_order, {"first_order.forward", "first_order.backward"}),
    (hessian_vector_product, SECOND_ORDER_RUNS),
    pytest.param(gradient_penalty, SECOND_ORDER_RUNS, marks=pytest.mark.slow),
    pytest.param(maml, SECOND_ORDER_RUNS, marks=pytest.mark.slow),
], ids=lambda x: getattr(x, "__name__", ""))
def test_inductor_code_runs_in_every_order(scenario, expected_runs, inductor_runs):
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    with math_sdpa():
        expected = scenario(exact_twin(model), x)
    actual = scenario(torch.compile(model, backend=flashbob, options=INDUCTOR), x)
    assert max_error(actual, expected) <= TOLERANCE
    assert {r.route for r in recent_reports} == {"training"}
    assert {name for name, n in inductor_runs.runs.items() if n > 0} == expected_runs, \
        inductor_runs.runs


def test_first_order_runs_no_second_order_code(inductor_runs):
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    compiled = torch.compile(model, backend=flashbob, options=INDUCTOR)
    for _ in range(2):
        first_order(compiled, x)
    assert inductor_runs.runs == {"first_order.forward": 2, "first_order.backward": 2}
    assert counters["compiled_second_order"] == 0


class HandsOnItsActivation(nn.Module):
    """A graph returning an activation that its own backward also reads (tanh saves its
    output), as each piece of a graph DDPOptimizer splits at gradient buckets does."""

    def __init__(self):
        super().__init__()
        self.block = SDPABlock()

    def forward(self, x):
        h = torch.tanh(self.block(x))
        return h, loss_of(h)


@pytest.mark.parametrize("options", [AOT_EAGER, INDUCTOR], ids=["aot_eager", "inductor"])
def test_an_output_also_saved_for_backward_stays_a_plain_backward(options):
    """Returned once, not twice: its gradient arrives as an output's, so a first-order
    backward runs the compiled backward (no second-order code), and the second order is exact."""
    model = HandsOnItsActivation().double()
    x, = CASES["sdpa"].batch(0)
    params = list(model.parameters())

    def loss(run):
        h, total = run(x)
        return total + h.square().mean()

    def hvp(run):
        grads = torch.autograd.grad(loss(run), params, create_graph=True)
        return torch.autograd.grad(grads, params, [torch.full_like(p, 0.5) for p in params])
    with math_sdpa():
        expected = torch.autograd.grad(loss(model), params), hvp(model)
    compiled = torch.compile(model, backend=flashbob, options=options)
    assert max_error(torch.autograd.grad(loss(compiled), params), expected[0]) <= TOLERANCE
    assert counters["compiled_second_order"] == 0
    assert max_error(hvp(compiled), expected[1]) <= TOLERANCE
    assert recent_reports[-1].route == "training"


def test_first_order_backward_frees_residuals_as_it_goes(monkeypatch):
    """As with stock compile: the compiled backward is the only holder of the forward's
    residuals, so each is freed after its last use, not at the end of the backward (the
    node's own saved tensors are released first), and may write into their memory (donated
    buffers); retain_graph=True keeps them, and runs the backward graph eagerly, exact."""
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    params = list(model.parameters())
    compiled = torch.compile(model, backend=flashbob, options=INDUCTOR)
    first_order(compiled, x)
    alive_after_backward, compiled_backward_ran = [], []
    original = training_runtime.ForwardFn.backward

    def watching(ctx, *grads):
        pair = ctx.graph.pair
        inner = pair.backward

        def run(args):
            keep = {id(p) for p in params} | {id(g) for g in grads} | {id(x)}   # held by us
            # one reference of ours to each residual's storage; whatever else holds one
            # after the backward (the node's saved tensors) keeps its memory
            storages = {a.untyped_storage().data_ptr(): a.untyped_storage()
                        for a in args if isinstance(a, torch.Tensor) and id(a) not in keep}
            assert storages
            assert pair.donates
            compiled_backward_ran.append(True)
            result = inner(args)
            alive_after_backward.append(sum(torch._C._storage_Use_Count(st._cdata) > 1
                                            for st in storages.values()))
            return result
        monkeypatch.setattr(pair, "backward", run)
        try:
            return original(ctx, *grads)
        finally:
            monkeypatch.setattr(pair, "backward", inner)
    monkeypatch.setattr(training_runtime.ForwardFn, "backward", staticmethod(watching))
    with math_sdpa():
        expected = first_order(model, x)
    loss = loss_of(compiled(x))
    compiled_backward_ran.clear()
    twice = [torch.autograd.grad(loss, params, retain_graph=True) for _ in range(2)]
    assert max_error(twice[0], expected) <= TOLERANCE and max_error(twice[1], expected) <= TOLERANCE
    assert not compiled_backward_ran           # retain_graph: never the donating code
    assert max_error(torch.autograd.grad(loss, params), expected) <= TOLERANCE
    assert compiled_backward_ran
    assert max_error(first_order(compiled, x), expected) <= TOLERANCE
    assert alive_after_backward[-1] == 0       # without it, nothing outlives its last use


@pytest.mark.parametrize("loss,freed,forwards", [
    ("linear", True, 1), ("nonlinear", False, 1), ("penalty", True, 2)])
def test_a_create_graph_backward_frees_the_first_order_residuals(inductor_runs, loss, freed,
                                                                 forwards):
    """The VJP pair recomputes what the second order reads, so the compiled forward's
    residuals die at the create_graph backward instead of living with the graph through the
    double backward (the step's peak), where its cotangents do not require grad (a linear
    loss, or one inside the graph). A nonlinear loss outside the graph sends its second-order
    cotangent back through the first-order backward: kept there. A gradient penalty's loss
    term reaches the first-order backward of a freed node: the compiled forward recomputes
    them, exact.
    A plain backward after a create_graph one (retain_graph) is exact either way."""
    import weakref
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    params = list(model.parameters())
    vectors = [torch.full_like(p, 0.5) for p in params]

    def step(model, residuals=None):
        out = model(x)
        loss_value = loss_of(out) if loss == "nonlinear" else out.sum()
        if residuals is not None:
            held = {id(t) for t in (*params, x)}     # parameters may be residuals as they are
            residuals.extend(weakref.ref(t) for t in out.grad_fn.residuals.tensors
                             if id(t) not in held)
        grads = torch.autograd.grad(loss_value, params, create_graph=True)
        if residuals is not None:
            assert residuals and all(r() is None for r in residuals) == freed
        if loss == "penalty":
            second = torch.autograd.grad(loss_value + sum(g.square().sum() for g in grads),
                                         params, retain_graph=True)
        else:
            pairs = [(g, v) for g, v in zip(grads, vectors) if g.requires_grad]
            second = torch.autograd.grad([g for g, _ in pairs], params, [v for _, v in pairs],
                                         retain_graph=True, materialize_grads=True)
        return second, torch.autograd.grad(loss_value, params)
    with math_sdpa():
        expected = step(model)
    compiled = torch.compile(model, backend=flashbob, options=INDUCTOR)
    step(compiled)                    # compiles every order
    inductor_runs.runs.update(dict.fromkeys(inductor_runs.runs, 0))
    second, first = step(compiled, residuals=[])
    assert max_error(second, expected[0]) <= TOLERANCE
    assert max_error(first, expected[1]) <= TOLERANCE
    # the step's forward, the recompute for the penalty's loss term, and for the plain
    # backward after it where the residuals were freed
    assert inductor_runs.runs["first_order.forward"] == forwards + freed


def test_under_saved_tensor_hooks_the_residuals_are_saved_for_backward():
    """save_on_cpu, non-reentrant checkpointing and other saved-tensor hooks see every
    residual, as with stock compile (they are kept in the node's saved tensors)."""
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    compiled = torch.compile(model, backend=flashbob, options=INDUCTOR)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = compiled(x)
    assert out.grad_fn.residuals is None
    without_hooks = compiled(x)
    assert len(packed) >= len(without_hooks.grad_fn.residuals.tensors) > 0
    with math_sdpa():
        expected = hessian_vector_product(model, x)
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(out), params, create_graph=True)
    hvp = torch.autograd.grad(grads, params, [torch.full_like(p, 0.5) for p in params])
    assert max_error(hvp, expected) <= TOLERANCE


def test_a_residual_changed_in_place_is_an_error():
    """As for a SavedVariable: a residual written after the forward is refused, not read."""
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    compiled = torch.compile(model, backend=flashbob, options=INDUCTOR)
    out = compiled(x)
    out.grad_fn.residuals.tensors[0].add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss_of(out), list(model.parameters()))


# ---------------------------------------------------------------------------- MAML, three ways
def maml_compiled_functional_call(model, x, steps):
    """The functional model compiled, the meta-loss eager (torch.func MAML style)."""
    f = torch.compile(lambda params, x: functional_call(model, params, (x,)), backend=flashbob,
                      options=AOT_EAGER)
    params = dict(model.named_parameters())
    fast = dict(params)
    for _ in range(steps):
        grads = torch.autograd.grad(loss_of(f(fast, x[:1])), list(fast.values()), create_graph=True)
        fast = {name: p - 0.1 * g for (name, p), g in zip(fast.items(), grads)}
    return torch.autograd.grad(loss_of(f(fast, x[1:])), list(params.values()))


def maml_compiled_meta_loss(model, x, steps):
    """The whole meta-loss compiled, inner autograd.grad(create_graph=True) included."""
    params = dict(model.named_parameters())

    def meta_loss(params, x):
        fast = dict(params)
        for _ in range(steps):
            inner = loss_of(functional_call(model, fast, (x[:1],)))
            grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
            fast = {name: p - 0.1 * g for (name, p), g in zip(fast.items(), grads)}
        return loss_of(functional_call(model, fast, (x[1:],)))
    compiled = torch.compile(meta_loss, backend=flashbob, options=AOT_EAGER)
    return torch.autograd.grad(compiled(params, x), list(params.values()))


@pytest.mark.parametrize("how,steps", diagonal(
    ["compiled_module", "compiled_functional_call", "compiled_meta_loss"], [1, 2], ids=str))
def test_maml_stays_second_order(how, steps):
    model = CASES["nanogpt"].model()
    x = torch.cat([CASES["nanogpt"].batch(0)[0][:1], CASES["nanogpt"].batch(1)[0][:1]])
    with math_sdpa():
        expected = maml(exact_twin(model), x, steps)
        first_order_maml = maml(exact_twin(model), x.detach(), steps=0)
    if how == "compiled_module":
        actual = maml(torch.compile(model, backend=flashbob, options=AOT_EAGER), x, steps)
    elif how == "compiled_functional_call":
        actual = maml_compiled_functional_call(model, x, steps)
    else:
        actual = maml_compiled_meta_loss(model, x, steps)
    assert max_error(actual, expected) <= TOLERANCE
    assert max_error(first_order_maml, expected) > 1e-4, "the second-order terms must matter"
    # every forward through the model is a graph with its attention replaced (a compiled
    # meta-loss adds small graphs around the autograd.grad calls Dynamo breaks at)
    assert sum(len(r.replaced) for r in recent_reports) >= 1 and not any(r.skipped for r in recent_reports)
    assert "training" in {r.route for r in recent_reports if r.replaced}


# ---------------------------------------------------------------------------- third order
class HandWrittenLayerNorm(nn.Module):
    """nn.LayerNorm's math in ordinary ops: PyTorch's fused layer-norm derivative is wrong
    at third order (its double backward is not itself differentiated exactly), so the
    third-order reference cannot use it."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).square().mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def hand_written_norms(model):
    twin = exact_twin(model)
    for name, module in list(twin.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.LayerNorm):
                setattr(module, child_name, HandWrittenLayerNorm(child))
    return twin


def third_order(model, x):
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model(x)), params, create_graph=True)
    hvps = torch.autograd.grad(sum(g.square().sum() for g in grads), params, create_graph=True)
    return torch.autograd.grad(sum(h.square().sum() for h in hvps), params)


@pytest.mark.parametrize("name,form", [("sdpa", "folded"), ("nanogpt", "folded"),
                                       ("sdpa", "chain")])
def test_third_order_is_exact(monkeypatch, name, form):
    """Every order through the compiled runtime, with either factorization of the second
    order (docs/second-order.md)."""
    monkeypatch.setenv("BOB_COMPILE_DEV_BOB_FORM", form)
    settings.reload()
    model = CASES[name].model()
    x, = CASES[name].batch(0)
    with math_sdpa():
        expected = third_order(hand_written_norms(model), x)
    actual = third_order(torch.compile(model, backend=flashbob, options=AOT_EAGER), x)
    relative = max(((a - e).norm() / e.norm()).item() for a, e in zip(actual, expected))
    assert relative <= 1e-12
    assert {r.route for r in recent_reports} == {"training"}


# ---------------------------------------------------------------------------- dropout
class DropoutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.dropout = SDPABlock(), nn.Dropout(0.3)

    def forward(self, x):
        return torch.tanh(self.dropout(self.block(x)))


def test_dropout_draws_are_replayed_in_the_second_order():
    """A second-order step re-runs the forward: with new dropout draws the Hessian would
    mix two functions and lose its symmetry, u·Hv = v·Hu."""
    model = DropoutBlock().double().train()
    x, = CASES["sdpa"].batch(0)
    compiled = torch.compile(model, backend=flashbob, options=AOT_EAGER)
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(compiled(x)), params, create_graph=True)
    g = torch.Generator().manual_seed(3)
    u, v = ([torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params] for _ in range(2))
    hv = torch.autograd.grad(grads, params, v, retain_graph=True)
    hu = torch.autograd.grad(grads, params, u)
    u_hv = sum((a * b).sum() for a, b in zip(u, hv))
    v_hu = sum((a * b).sum() for a, b in zip(v, hu))
    assert abs(u_hv - v_hu) <= 1e-12 * abs(u_hv)
    assert recent_reports[-1].route == "training"


def test_dropout_under_inductor_equals_eager_with_the_same_seed():
    """Inductor compiles training graphs with aten's random ops (fallback_random), dropout
    as one op whose mask the forward returns and the replay takes: every order compiled,
    and the same draws as eager from the same seed, so gradient and HVP equal eager's."""
    model = DropoutBlock().double().train()
    x, = CASES["sdpa"].batch(0)
    compiled = torch.compile(model, backend=flashbob, options=INDUCTOR)
    for run in range(2):                 # the second run: everything already compiled
        torch.manual_seed(run)
        with sdpa_kernel(SDPBackend.MATH):
            expected = hessian_vector_product(model, x)
        torch.manual_seed(run)
        got = hessian_vector_product(compiled, x)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    assert recent_reports[-1].route == "training" and counters["fallback"] == 0
    assert counters["compiled_second_order"] == 1


def test_a_draw_the_backward_does_not_save_sends_the_graph_to_the_eager_route():
    """Dropout on an input that needs no gradient: its mask is not saved, and under
    inductor no output may be appended for it, so the graph runs eagerly (exact, same
    draws as eager from the same seed), with the reason in the report."""
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def f(x):
        return (nn.functional.dropout(x, 0.3, True) @ weight).sin().sum()

    x = torch.randn(3, 4, dtype=torch.float64)
    compiled = torch.compile(f, backend=flashbob, options=INDUCTOR)
    results = []
    for fn in (compiled, f):
        torch.manual_seed(0)
        grad, = torch.autograd.grad(fn(x), weight, create_graph=True)
        results.append((grad, *torch.autograd.grad(grad.sum(), weight)))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert recent_reports[-1].route == "eager"
    assert "does not save" in recent_reports[-1].route_reason


# ---------------------------------------------------------------------------- memory, autocast
def test_a_second_order_step_frees_its_graph_without_the_garbage_collector():
    """No reference cycle between a node and its own outputs: the double-backward values
    must go with the graph, as in eager autograd (a cycle leaked every Sophia-H step)."""
    import gc
    import weakref
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    compiled = torch.compile(model, backend=flashbob, options=AOT_EAGER)
    hessian_vector_product(compiled, x)   # compiles everything first
    gc.collect()
    gc.disable()
    try:
        params = list(model.parameters())
        grads = torch.autograd.grad(loss_of(compiled(x)), params, create_graph=True)
        torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params], retain_graph=True)
        alive = weakref.ref(grads[0])
        del grads
        assert alive() is None, "the create_graph gradients outlived their graph"
    finally:
        gc.enable()


def test_casts_under_autocast_are_differentiated_again():
    """Under autocast inductor's decompositions cast with prims.convert_element_type, which
    has no derivative: the double backward must still compile and run."""
    model = SDPABlock().float()
    x = CASES["sdpa"].batch(0)[0].float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = torch.compile(model, backend=flashbob, options=AOT_EAGER)
        params = list(model.parameters())
        grads = torch.autograd.grad(loss_of(compiled(x).float()), params, create_graph=True)
        hvp = torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])
        with math_sdpa():
            expected_grads = torch.autograd.grad(loss_of(model(x).float()), params, create_graph=True)
            expected = torch.autograd.grad(expected_grads, params, [torch.ones_like(p) for p in params])
    assert max(((a - e).norm() / e.norm()).item() for a, e in zip(hvp, expected)) <= 5e-2
    assert recent_reports[-1].route == "training" and counters["compiled_second_order"] == 1


# ---------------------------------------------------------------------------- what the route refuses
def test_input_mutation_runs_eagerly_with_a_reason():
    """BatchNorm in training updates its running statistics: the rewritten graph runs
    eagerly, and the report says why."""
    model = nn.Sequential(SDPABlock(), nn.BatchNorm1d(8)).double().train()
    x, = CASES["sdpa"].batch(0)
    with math_sdpa():
        expected = hessian_vector_product(exact_twin(model), x)
    actual = hessian_vector_product(torch.compile(model, backend=flashbob, options=AOT_EAGER), x)
    assert max_error(actual, expected) <= TOLERANCE
    (report,) = recent_reports
    assert report.route == "eager" and "mutates inputs" in report.route_reason


@pytest.mark.parametrize("scenario", [hessian_vector_product, maml], ids=lambda f: f.__name__)
def test_a_second_order_that_cannot_compile_runs_eagerly(scenario, monkeypatch, caplog):
    """The second order compiles on first use, inside a backward; if that fails, the same
    function runs eagerly (exact, with a warning and a line in the report), instead of
    raising out of the user's backward."""
    def refuse(*args, **kwargs):
        raise NotSupported("it mutates inputs (simulated)")
    monkeypatch.setattr(training_runtime, "compile_graph_vjp", refuse)
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    with math_sdpa():
        expected = scenario(exact_twin(model), x)
    compiled = torch.compile(model, backend=flashbob, options=AOT_EAGER)
    with caplog.at_level("WARNING", logger="bob_compile.training"):
        for _ in range(2):          # the refusal is remembered: no second attempt, same result
            assert max_error(scenario(compiled, x), expected) <= TOLERANCE
    assert {r.route for r in recent_reports} == {"training"}
    warnings = [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "mutates inputs (simulated)" in warnings[0].getMessage()
    assert any("runs eagerly (NotSupported: it mutates inputs (simulated))" in r.text()
               for r in recent_reports)
    assert counters["eager_second_order"] == 1


# ---------------------------------------------------------------------------- shapes
def test_new_lengths_do_not_recompile_the_second_order():
    model = CASES["nanogpt"].model()
    compiled = torch.compile(model, backend=flashbob, options=AOT_EAGER)
    for seq in (5, 6, 7, 8, 9):
        x, = CASES["nanogpt"].batch(seq, seq)
        with math_sdpa():
            assert max_error(hessian_vector_product(compiled, x),
                             hessian_vector_product(model, x)) <= TOLERANCE
    assert len(recent_reports) == 2, "one static graph, then one dynamic graph"
    assert counters["compiled_second_order"] == 2


# ---------------------------------------------------------------------------- reports and dumps
def test_report_and_dump_name_the_compiled_graphs_of_every_order(tmp_path):
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    compiled = torch.compile(model, backend=flashbob,
                             options={**AOT_EAGER, "dump_dir": str(tmp_path)})
    first_order(compiled, x)
    folder = tmp_path / "0_0"
    assert {"first_order.forward.py", "first_order.backward.py"} <= set(os.listdir(folder))
    assert "compiled: forward and backward" in (folder / "report.txt").read_text()
    hessian_vector_product(compiled, x)
    for half in ("forward", "backward"):
        assert "bob_compile" in (folder / f"second_order.{half}.py").read_text(), half
    assert "attn_bob" in (folder / "second_order.backward.py").read_text()
    assert "the VJP as a differentiable function (second order)" in recent_reports[-1].text()


def _kept_by_the_forward(compiled, x):
    """Bytes the compiled forward keeps for its backward beyond its inputs and outputs,
    measured at run time: the storage of every tensor autograd packs (views of one storage
    once), less the inputs', parameters' and outputs' own."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = compiled(x)
    known = {t.untyped_storage().data_ptr() for t in (x, out, *compiled.parameters())}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed}
    return sum(n for pointer, n in storages.items() if pointer not in known)


def test_report_says_what_each_order_keeps_and_how_long_it_compiled(tmp_path):
    """Each compiled order's line says the bytes its forward keeps for the backward (what a
    step's memory is made of) and its compile time; the dump's report.txt has every order."""
    model = SDPABlock().double()
    x, = CASES["sdpa"].batch(0)
    compiled = torch.compile(model, backend=flashbob,
                             options={**AOT_EAGER, "dump_dir": str(tmp_path)})
    kept = _kept_by_the_forward(compiled, x)
    hessian_vector_product(compiled, x)
    report = (tmp_path / "0_0" / "report.txt").read_text()
    first, second = (re.search(rf"{order}: forward half \d+ ops, backward half \d+ ops, keeping "
                               r"([\d.]+) (bytes|KiB|MiB|GiB) for the backward, compiled in "
                               r"[\d.]+ s", report) for order in
                     ("forward and backward", r"the VJP as a differentiable function \(second order\)"))
    assert first and second, report
    number, unit = first.groups()
    scale = {"bytes": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}[unit]
    assert kept > 0 and abs(float(number) * scale - kept) <= 0.05 * scale + 0.01 * kept, (kept, report)
