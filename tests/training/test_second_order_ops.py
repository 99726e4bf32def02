"""The compiled second order stays exact whatever ordinary ops the model holds.

Each case puts one op (or one attention site left as written) between two attention layers
and checks, in float64 against eager PyTorch (SDPA's math path), the Hessian-vector product
and a MAML meta-gradient through torch.compile(backend="flashbob"). Each failed before the
second order was built from the Dynamo graph's own VJP (docs/routing.md, "Why the second
order is built from the Dynamo graph"): silently wrong (unfold, det, complex, stft) or an
error inside PyTorch (flip, cumsum, max_pool, fft, batched HVPs, fused SDPA left as written).
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import bob_compile
from bob_compile import _compat
from bob_compile.backend import counters, recent_reports

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

WIDTH, SEQ = 8, 8
AOT_EAGER = {"compiler": "aot_eager", "fallback": False}
INDUCTOR = {"compiler": "inductor", "fallback": False}


class Attention(nn.Module):
    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2))


class Between(nn.Module):
    """attention, then `op` on the activations, then attention."""

    def __init__(self, op):
        super().__init__()
        self.first, self.second, self.op = Attention(), Attention(), op

    def forward(self, x):
        h = self.first(x)
        return self.second(h + self.op(h))


# ---------------------------------------------------------------------------- the ops
def sliding_windows(h):
    """Overlapping unfold windows (a sliding-window attention's keys), kept for backward."""
    windows = F.pad(h, (0, 0, 2, 0)).unfold(1, 3, 1)             # (B, T, D, 3), overlapping
    return (windows * windows.softmax(-1)).sum(-1)


def log_det(h):
    """A Glow-style log-determinant term of a matrix built from the activations."""
    m = h[:, :4, :4]
    return h * torch.logdet(m @ m.transpose(-1, -2) + torch.eye(4, dtype=h.dtype)).view(-1, 1, 1)


def det(h):
    return h * torch.det(h[:, :4, :4] + 2 * torch.eye(4, dtype=h.dtype)).view(-1, 1, 1)


def slogdet(h):
    return h * torch.linalg.slogdet(h[:, :4, :4] + 2 * torch.eye(4, dtype=h.dtype))[1].view(-1, 1, 1)


def complex_abs(h):
    c = torch.view_as_complex(h.unflatten(-1, (-1, 2)))
    return torch.view_as_real(c * c.abs()).flatten(-2)


def polar_square(h):
    magnitude, angle = h.chunk(2, -1)
    c = torch.polar(magnitude.abs() + 1, angle) ** 2
    return torch.cat([c.real, c.imag], -1)


def stft_power(h):
    window = torch.hann_window(8, dtype=h.dtype)
    spectrum = torch.stft(h.flatten(1), n_fft=8, hop_length=2, window=window, return_complex=True)
    return h * spectrum.abs().square().mean((-1, -2)).view(-1, 1, 1).tanh()


class HandWrittenGelu(torch.autograd.Function):
    """A user autograd.Function whose backward is written in differentiable ops: eager
    autograd differentiates it again; Dynamo traces its backward under no_grad."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return grad * (s + 1.702 * x * s * (1 - s))


def checkpointed(h):
    return torch.utils.checkpoint.checkpoint(lambda t: t.sin() * t, h, use_reentrant=False)


def conditional(h):
    return torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,))


OPS = {
    "unfold": sliding_windows,
    "logdet": log_det,
    "det": det,
    "slogdet": slogdet,
    "complex_abs": complex_abs,
    "polar_square": polar_square,
    "stft": stft_power,
    "flip": lambda h: h * h.flip(1),
    "fliplr": lambda h: h * torch.fliplr(h),
    "cumsum": lambda h: torch.cumsum(h * h, 1),
    "cumprod": lambda h: torch.cumprod(h, 1),
    "logcumsumexp": lambda h: torch.logcumsumexp(h * h, 1),
    "max_pool1d": lambda h: F.max_pool1d(h.transpose(1, 2), 3, 1, 1).transpose(1, 2) * h,
    # linalg.solve checks its inputs with an effectful op: the graphs carry effect tokens
    "linalg_solve": lambda h: torch.linalg.solve(
        h @ h.transpose(-1, -2) / WIDTH + 2 * torch.eye(SEQ, dtype=h.dtype), h),
    "autograd_function": HandWrittenGelu.apply,
    "checkpoint": checkpointed,
    "cond": conditional,
    "fft": lambda h: torch.fft.irfft(torch.fft.rfft(h * h, dim=1) * 2, n=h.shape[1], dim=1),
    "fft2": lambda h: torch.fft.ifft2(torch.fft.fft2(h.sin())).real * h,
}


# ---------------------------------------------------------------------------- scenarios
def loss_of(y):
    return y.square().mean() + y.sin().sum()


def hessian_vector_product(model, x):
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model(x)), params, create_graph=True)
    g = torch.Generator().manual_seed(5)
    vectors = [torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device) for p in params]
    return torch.autograd.grad(grads, params, vectors)


def maml(model, x, inner_lr=0.1):
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss_of(model(x[:1])), list(params.values()), create_graph=True)
    fast = {name: p - inner_lr * g for (name, p), g in zip(params.items(), grads)}
    return torch.autograd.grad(loss_of(functional_call(model, fast, (x[1:],))), list(params.values()))


def relative_error(actual, expected):
    a, e = torch.cat([t.reshape(-1) for t in actual]), torch.cat([t.reshape(-1) for t in expected])
    return ((a - e).norm() / e.norm()).item()


def batch():
    return torch.randn(2, SEQ, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def check(model, scenario, options=AOT_EAGER, tolerance=1e-9):
    x = batch()
    with sdpa_kernel(SDPBackend.MATH):
        expected = scenario(model, x)
    actual = scenario(torch.compile(model, backend="flashbob", options=options), x)
    assert relative_error(actual, expected) <= tolerance
    return expected


# the default tier: one of each kind of failure the first design had; the rest in `slow`
FAST = {("unfold", "maml"), ("logdet", "hessian_vector_product"), ("complex_abs", "maml"),
        ("stft", "hessian_vector_product"), ("cumsum", "hessian_vector_product"),
        ("max_pool1d", "maml"), ("fft", "hessian_vector_product"),
        ("autograd_function", "hessian_vector_product")}


def _tiered(names, scenarios):
    return [pytest.param(name, scenario, marks=() if (name, scenario.__name__) in FAST
                         else pytest.mark.slow, id=f"{name}-{scenario.__name__}")
            for name in names for scenario in scenarios]


@functools.cache
def dynamo_traces_autograd_functions():
    """Whether this torch's Dynamo puts the model's autograd.Function into the graph (2.13
    on: as autograd_function_apply, its backward traced under no_grad); 2.11 breaks the
    graph there (the Function's `apply` kept as a module attribute), and the Function runs
    in eager autograd, which differentiates it exactly."""
    targets = []

    def record(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    torch._dynamo.reset()
    torch.compile(Between(OPS["autograd_function"]).double(), backend=record)(batch())
    torch._dynamo.reset()
    return any("autograd_function_apply" in t for t in targets)


@pytest.mark.parametrize("name,scenario", _tiered(OPS, [hessian_vector_product, maml]))
def test_op_between_attention_layers(name, scenario):
    torch.manual_seed(0)
    model = Between(OPS[name]).double()
    check(model, scenario)
    if name == "autograd_function" and not dynamo_traces_autograd_functions():
        # the Function between the layers runs eagerly; its forward is a graph of its own
        # under no_grad (the inference route), the attention layers compiled around it
        assert {r.route for r in recent_reports} == {"training", "inference"}
        return
    assert {r.route for r in recent_reports} == {"training"}
    assert counters["compiled_second_order"] >= 1 and counters["eager_second_order"] == 0
    assert all(len(r.replaced) == 2 and not r.skipped for r in recent_reports)


@pytest.mark.parametrize("name", ["logdet", pytest.param("unfold", marks=pytest.mark.slow),
                                  pytest.param("cumsum", marks=pytest.mark.slow),
                                  pytest.param("fft", marks=pytest.mark.slow)])
def test_op_between_attention_layers_under_inductor(name):
    torch.manual_seed(0)
    check(Between(OPS[name]).double(), hessian_vector_product, INDUCTOR)
    assert counters["compiled_second_order"] == 1


def test_an_autograd_function_says_its_backward_is_differentiated():
    if not dynamo_traces_autograd_functions():
        pytest.skip("this torch's Dynamo runs autograd.Functions outside the graph")
    torch.manual_seed(0)
    check(Between(OPS["autograd_function"]).double(), hessian_vector_product)
    (report,) = recent_reports
    assert any("autograd.Function at autograd_function_apply" in n for n in report.notes)
    assert "note: autograd.Function" in report.text()


def test_stock_compile_drops_an_autograd_functions_second_order():
    """Why the rewrite exists: Dynamo's own graph, run as captured, is silently wrong."""
    if not dynamo_traces_autograd_functions():
        pytest.skip("this torch's Dynamo runs autograd.Functions outside the graph (exact)")
    torch.manual_seed(0)
    model, x = Between(OPS["autograd_function"]).double(), batch()
    with sdpa_kernel(SDPBackend.MATH):
        expected = hessian_vector_product(model, x)
        stock = hessian_vector_product(torch.compile(model, backend="eager"), x)
    assert relative_error(stock, expected) > 1e-2


# ---------------------------------------------------------------------------- batched
def hvp_batched_cotangents(model, x):
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_of(model(x)), params, create_graph=True)
    g = torch.Generator().manual_seed(5)
    vectors = [torch.randn(3, *p.shape, generator=g, dtype=p.dtype) for p in params]
    return torch.autograd.grad(grads, params, vectors, is_grads_batched=True)


def hessian_vectorized(model, x):
    """torch.autograd.functional.hessian(vectorize=True) of the loss in the input."""
    return [torch.autograd.functional.hessian(lambda z: loss_of(model(z)), x, vectorize=True)]


def jacobian_create_graph(model, x):
    """A vectorized Jacobian kept differentiable, then differentiated (a Jacobian penalty)."""
    z = x.detach().requires_grad_()
    jac = torch.autograd.functional.jacobian(lambda z: model(z).sum((-1, -2)), z,
                                             create_graph=True, vectorize=True)
    params = list(model.parameters())
    grads = torch.autograd.grad(jac.square().sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


@pytest.mark.parametrize("scenario", [hvp_batched_cotangents, hessian_vectorized,
                                      jacobian_create_graph], ids=lambda f: f.__name__)
def test_batched_second_order(scenario):
    """Legacy-vmap cotangents cannot enter compiled code: those backwards run the graph's
    VJP eagerly (exact; attention still fused)."""
    torch.manual_seed(0)
    check(Between(OPS["cumsum"]).double(), scenario)
    assert {r.route for r in recent_reports} == {"training"}


# ---------------------------------------------------------------------------- sites left as written
class LearnedBias(nn.Module):
    """A learned additive bias (T5-style relative positions as a parameter): the site is
    replaced, the op returns the bias's cotangents at every order."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(2, SEQ, SEQ) * 0.1)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return self.out(y.transpose(1, 2).flatten(-2)).tanh()


class MaskAndCausal(nn.Module):
    """attn_mask together with is_causal: both apply (as PyTorch's fused kernels do)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        keep = torch.rand(SEQ, SEQ, generator=torch.Generator().manual_seed(3)) > 0.3
        self.register_buffer("keep", keep | torch.eye(SEQ, dtype=torch.bool))

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2)).tanh()


def mask_and_causal_reference(model):
    """What MaskAndCausal computes, spelled for SDPA's math path (which refuses the pair)."""
    twin = MaskAndCausal().double()
    twin.load_state_dict(model.state_dict())
    twin.keep = model.keep & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()

    def forward(x):
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in twin.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=twin.keep)
        return twin.out(y.transpose(1, 2).flatten(-2)).tanh()
    twin.forward = forward
    return twin


class PaddedTransformer(nn.Module):
    """nn.TransformerEncoderLayer and DecoderLayer with key padding masks."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        self.register_buffer("padding", torch.tensor([[False] * SEQ, [False] * (SEQ - 3) + [True] * 3]))

    def forward(self, x):
        padding = self.padding[-x.shape[0]:]         # MAML's query batch is the padded row
        memory = self.encoder(x, src_key_padding_mask=padding)
        return self.decoder(x, memory, tgt_key_padding_mask=padding,
                            memory_key_padding_mask=padding)


def test_learned_bias_is_replaced_and_exact():
    """HVP and MAML meta-gradient w.r.t. every parameter, the bias included."""
    torch.manual_seed(0)
    model = LearnedBias().double()
    for scenario in (hessian_vector_product, maml):
        check(model, scenario)
    assert recent_reports and all(len(r.replaced) == 1 and not r.skipped
                                  for r in recent_reports)


@pytest.mark.skipif(not _compat.sdpa_takes_mask_with_is_causal(),
                    reason="this torch refuses attn_mask with is_causal=True in SDPA itself")
def test_mask_and_is_causal_are_replaced_and_exact():
    torch.manual_seed(0)
    model = MaskAndCausal().double()
    x = batch()
    for scenario in (hessian_vector_product, maml):
        with sdpa_kernel(SDPBackend.MATH):
            expected = scenario(mask_and_causal_reference(model), x)
        actual = scenario(torch.compile(model, backend="flashbob", options=AOT_EAGER), x)
        assert relative_error(actual, expected) <= 1e-9
    assert all(len(r.replaced) == 1 and not r.skipped for r in recent_reports)


@pytest.mark.slow      # 25 s; the default tier's key-padding case: test_multihead.py
def test_transformer_layers_with_key_padding_masks():
    torch.manual_seed(0)
    model = PaddedTransformer().double().train()
    for scenario in (hessian_vector_product, maml):
        check(model, scenario)
    assert "training" in {r.route for r in recent_reports}
    assert all(r.replaced and not r.skipped for r in recent_reports)   # the padded sites too


class SDPADropout(nn.Module):
    """Attention dropout as models train with it: SDPA's dropout_p, and F.dropout on
    hand-written probabilities (nanoGPT, HF eager). `op=True`: the same model written with
    bob_compile.attention, which draws the same masks from the same generator state."""

    def __init__(self, op=False):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.op = op

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.op:
            y = bob_compile.attention(q, k, v, dropout_p=0.3, is_causal=True)
            z = bob_compile.attention(q, k, v, dropout_p=0.1, scale=0.5)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
            z = F.dropout((q @ k.transpose(-1, -2) * 0.5).softmax(-1), 0.1, self.training) @ v
        return self.out((y + z).transpose(1, 2).flatten(-2)).tanh()


@pytest.mark.parametrize("scenario", [hessian_vector_product, maml], ids=["hvp", "maml"])
@pytest.mark.parametrize("options", [AOT_EAGER, pytest.param(INDUCTOR, marks=pytest.mark.slow)],
                         ids=["aot_eager", "inductor"])
def test_attention_dropout_is_fused_and_its_masks_replayed(options, scenario):
    """Both sites become the op with their dropout; the second order replays the seeds the
    forward drew (a draw like any other: training/draws.py), so the compiled HVP and MAML
    meta-gradient equal the op's eager ones given the same generator state."""
    torch.manual_seed(0)
    model = SDPADropout().double()
    reference = SDPADropout(op=True).double()
    reference.load_state_dict(model.state_dict())
    x = batch()
    compiled = torch.compile(model, backend="flashbob", options=options)
    for run in range(2):
        torch.manual_seed(10 + run)
        expected = scenario(reference, x)
        torch.manual_seed(10 + run)
        actual = scenario(compiled, x)
        assert relative_error(actual, expected) <= 1e-9
    report = recent_reports[-1]
    assert report.route == "training" and counters["compiled_second_order"] >= 1
    assert sorted(site.dropout for site in report.replaced) == [0.1, 0.3]


def test_sdpa_dropout_left_as_written_runs_as_math_with_its_mask_replayed(monkeypatch):
    """Sites with active dropout left as written (nodes.dropout_problem: a dropout_p or
    training flag computed at run time; forced here): the SDPA call runs as SDPA's math in
    every order, its mask drawn as eager's math path draws it and, like the hand-written
    site's F.dropout, replayed by the second order: the same seed gives eager's HVP."""
    from bob_compile.passes import handwritten, sdpa
    for module in (sdpa, handwritten):
        monkeypatch.setattr(module, "dropout_problem", lambda p, training: "left (test)")
    torch.manual_seed(0)
    model = SDPADropout().double()
    x = batch()
    compiled = torch.compile(model, backend="flashbob", options=AOT_EAGER)
    for run in range(2):
        torch.manual_seed(10 + run)
        with sdpa_kernel(SDPBackend.MATH):
            expected = hessian_vector_product(model, x)
        torch.manual_seed(10 + run)
        actual = hessian_vector_product(compiled, x)
        assert relative_error(actual, expected) <= 1e-9
    assert recent_reports[-1].route == "training" and counters["compiled_second_order"] == 1
    reasons = [site.reason for site in recent_reports[-1].skipped]
    assert any("runs as SDPA's math in every order" in r for r in reasons), reasons


# ---------------------------------------------------------------------------- the op itself
@pytest.mark.parametrize("is_causal", [False, True])
def test_scale_zero_is_finite_and_exact_at_second_order(is_causal):
    """scale=0.0: every key weighs the same. The folded BoB read the first backward's dq
    as dq / scale (NaN); it now multiplies instead."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
               for _ in range(3))

    def second_order(attention):
        o = attention(q, k, v, scale=0.0, is_causal=is_causal)
        grads = torch.autograd.grad(o.sin().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(sum((t * t).sum() for t in grads), (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        expected = second_order(F.scaled_dot_product_attention)
    actual = second_order(bob_compile.attention)
    for a, e in zip(actual, expected):
        assert a.isfinite().all()
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- errors
def test_an_error_in_a_compiled_order_names_flashbob_the_graph_and_the_workaround(monkeypatch):
    from bob_compile.training import runtime

    def failing(*args):
        raise RuntimeError("simulated kernel failure")
    model = Between(OPS["flip"]).double()
    compiled = torch.compile(model, backend="flashbob", options=AOT_EAGER)
    x = batch()
    original = runtime.SecondOrderFn.forward

    def forward(ctx, graph, pair, wanted, *inputs):
        monkeypatch.setattr(pair, "forward", failing)
        return original(ctx, graph, pair, wanted, *inputs)
    monkeypatch.setattr(runtime.SecondOrderFn, "forward", staticmethod(forward))
    with pytest.raises(RuntimeError, match="simulated kernel failure") as raised:
        hessian_vector_product(compiled, x)
    note = "\n".join(getattr(raised.value, "__notes__", []))
    assert "flashbob" in note and "graph 0/0" in note and "'compiler': 'eager'" in note
