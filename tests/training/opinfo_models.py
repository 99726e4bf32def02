"""Each OpInfo op between two attention layers, as a model whose second order is checked.

PyTorch's OpInfo database (torch.testing._internal.common_methods_invocations.op_db)
describes every operator with sample inputs. For an op whose OpInfo supports gradgrad in
float64 on the CPU, `OpBetweenAttention` builds

    h = attention(x);   a_i = sample_i + W_i h   (each floating tensor the sample differentiates)
    y = op(a_1, ..., non-tensor and integer arguments as the sample has them)
    out = attention(h + sum_j U_j y_j)            (each floating or complex output; complex as
                                                    real and imaginary parts)

so that the op's inputs are activations, its outputs feed the rest of the model, and the
Hessian of a loss of `out` reaches every direction of the op's second derivative (W_i and
U_j are dense parameters). `classify` runs the Hessian-vector product eagerly and through
torch.compile(backend="flashbob") and says how the compiled one ran.
"""
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree

SEQ, WIDTH, HEADS = 4, 8, 2
FEATURES = SEQ * WIDTH
PERTURBATION = 1e-3     # relative size of the activations' share of each op input
TOLERANCE = 1e-9        # relative L2 error of the HVP against eager, float64


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(-2))


def _differentiable_outputs(value):
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
            and (t.is_floating_point() or t.is_complex()) and t.numel() > 0]


def _as_real(t):
    """float64 real values (complex as real and imaginary parts; ops that convert dtypes,
    `float` or `half`, back to float64 for the next layer)."""
    return (torch.stack([t.real, t.imag], -1) if t.is_complex() else t).to(torch.float64)


class OpBetweenAttention(nn.Module):
    def __init__(self, op, sample):
        super().__init__()
        self.before, self.after = Attention().double(), Attention().double()
        self.op, self.sample = op, sample
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        self.moving = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)
                       and x.requires_grad and x.is_floating_point()]
        self.into = nn.ParameterList(
            nn.Parameter(torch.randn(leaves[i].numel(), FEATURES, dtype=torch.float64)
                         * PERTURBATION * (leaves[i].detach().abs().mean() + 1) / math.sqrt(FEATURES))
            for i in self.moving)
        with torch.no_grad():
            outputs = _differentiable_outputs(self.call(self.leaves))
        # each output's share of the activations is O(1) at most, so that a large output
        # (erfcx, exp) does not saturate the next softmax and make the HVP ill-conditioned
        self.out_of = nn.ParameterList(
            nn.Parameter(torch.randn(FEATURES, _as_real(y).numel(), dtype=torch.float64)
                         / (math.sqrt(_as_real(y).numel()) * (1 + _as_real(y).abs().max().item())))
            for y in outputs)

    def call(self, leaves):
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.op.gradcheck_wrapper(self.op.get_op(), inp, *args, **kwargs)
        return self.sample.output_process_fn_grad(out)

    def forward(self, x):
        h = self.before(x)
        features = h.reshape(-1)
        leaves = list(self.leaves)
        for i, w in zip(self.moving, self.into):
            leaves[i] = leaves[i] + (w @ features).view(leaves[i].shape)
        outputs = _differentiable_outputs(self.call(leaves))
        mixed = sum(u @ _as_real(y).reshape(-1) for u, y in zip(self.out_of, outputs))
        return self.after(h + mixed.view(h.shape))


def hessian_vector_product(model, x, vectors):
    params = list(model.parameters())
    loss = model(x).square().sum()
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    pairs = [(g, v) for g, v in zip(grads, vectors) if g is not None and g.requires_grad]
    hvp = torch.autograd.grad([g for g, _ in pairs], params, [v for _, v in pairs],
                              allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if h is None else h).reshape(-1)
                      for p, h in zip(params, hvp)])


@dataclasses.dataclass
class Outcome:
    kind: str          # "compiled", "second order eager", "eager route", "graph break", "excluded"
    reason: str = ""
    error: float = 0.0
    tolerance: float = TOLERANCE   # looser where the op computes in a lower precision


def _tolerance(outputs):
    """TOLERANCE, or ten roundings of the least precise dtype among the op's outputs (an op
    that casts, `float` or `half`, computes its part of the HVP in that precision)."""
    eps = [torch.finfo(t.real.dtype if t.is_complex() else t.dtype).eps for t in outputs]
    return max([TOLERANCE] + [10 * e for e in eps if e > torch.finfo(torch.float64).eps])


def _sparse(leaves):
    return any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in leaves)


def first_sample(op):
    for sample in op.sample_inputs("cpu", torch.float64, requires_grad=True):
        leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
        if _sparse(leaves):
            continue
        if any(isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
               and t.numel() > 0 for t in leaves):
            return sample
    return None


def _graph_breaks():
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


def _dynamo_fails_without_us(model, x, vectors):
    torch._dynamo.reset()
    try:
        with sdpa_kernel(SDPBackend.MATH):
            hessian_vector_product(torch.compile(model, backend="eager"), x, vectors)
    except Exception:      # noqa: BLE001
        return True
    return False


def _reason(text):
    """A reason without the graph's name: "graph 0/0: it mutates inputs" -> "it mutates inputs"."""
    head, _, rest = text.partition(": ")
    return rest if head.startswith(("graph ", "the second order of graph ")) else text


def classify(op, compile_options):
    """How the compiled second order of `op` between attention layers ran, against eager.
    Raises where eager works and the compiled route does not (the test's failure)."""
    from bob_compile.backend import counters, recent_reports
    sample = first_sample(op)
    if sample is None:
        return Outcome("excluded", "no dense floating sample input requires grad")
    torch.manual_seed(0)
    model = OpBetweenAttention(op, sample)
    x = torch.randn(1, SEQ, WIDTH, dtype=torch.float64)
    vectors = [torch.randn_like(p) for p in model.parameters()]
    try:
        with sdpa_kernel(SDPBackend.MATH):
            torch.manual_seed(1)
            expected = hessian_vector_product(model, x, vectors)
            torch.manual_seed(2)
            again = hessian_vector_product(model, x, vectors)
    except Exception as e:       # noqa: BLE001 (what eager cannot do is not ours to do)
        return Outcome("excluded", f"eager second order fails: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:120] if str(e) else ''}")
    if not expected.isfinite().all():
        return Outcome("excluded", "eager HVP is not finite at the sample")
    if not torch.equal(expected, again):
        return Outcome("excluded", "draws random numbers (the replay of draws is checked by "
                                   "tests/training/test_training_route.py)")
    with torch.no_grad():
        tolerance = _tolerance(_differentiable_outputs(model.call(model.leaves)))
    torch._dynamo.reset()
    recent_reports.clear()
    counters.clear()
    breaks = _graph_breaks()
    compiled = torch.compile(model, backend="flashbob", options=compile_options)
    torch.manual_seed(1)
    try:
        actual = hessian_vector_product(compiled, x, vectors)
    except Exception as e:
        if not _dynamo_fails_without_us(model, x, vectors):
            raise
        return Outcome("excluded", f"Dynamo itself fails on it (backend='eager' too): "
                                   f"{type(e).__name__}")
    error = ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()
    reports = list(recent_reports)
    eager_routes = [r for r in reports if r.route == "eager"]
    if eager_routes:
        outcome = Outcome("eager route", _reason(eager_routes[0].route_reason))
    elif counters["eager_second_order"]:
        lines = [line.partition("runs eagerly (")[2].rstrip(")") for r in reports
                 for line in r.compiled if "runs eagerly" in line]
        outcome = Outcome("second order eager", _reason(lines[0]) if lines else "")
    elif _graph_breaks() > breaks:
        outcome = Outcome("graph break", "Dynamo runs part of the model outside a graph")
    elif counters["compiled_second_order"]:
        outcome = Outcome("compiled")
    else:
        outcome = Outcome("graph break", "no training graph took the second order")
    outcome.error, outcome.tolerance = error, tolerance
    return outcome
