"""Hessian-vector products with torch.func, compiled with torch.compile(backend="flashbob").

Two standard ways to write an HVP of a loss over a model with scaled_dot_product_attention:

    forward-over-reverse:  jvp(grad(loss), (params,), (v,))[1]
    reverse-over-reverse:  grad(lambda p: <grad(loss)(p), v>)(params)

Here each is a whole function handed to torch.compile, so the derivatives are taken *inside*
the compiled graph, and the top eigenvalue of the Hessian is estimated by power iteration
(as PyHessian and sharpness studies do). Both HVPs are checked against the same functions run
eagerly with math attention; the script exits with status 1 if they differ.

    python examples/func_hvp.py                   # tiny, CPU
    python examples/func_hvp.py --device cuda --seq-len 2048 --d-model 256 --n-heads 4 \\
        --n-layers 4 --steps 20
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

import _common


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, seq_len, d_model, n_heads, n_layers):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_heads) for _ in range(n_layers)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.ln(self.blocks(x)))


def make_hvps(model):
    """The loss as a function of a parameter dict, and its two HVPs."""
    def loss(params, x, y):
        logits = functional_call(model, params, (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def hvp_forward_over_reverse(params, x, y, v):
        return jvp(lambda p: grad(loss)(p, x, y), (params,), (v,))[1]

    def hvp_reverse_over_reverse(params, x, y, v):
        def gradient_dot_v(p):
            g = grad(loss)(p, x, y)
            return sum((g[name] * v[name]).sum() for name in g)
        return grad(gradient_dot_v)(params)

    return hvp_forward_over_reverse, hvp_reverse_over_reverse


def dot(a, b):
    return sum((a[name] * b[name]).sum() for name in a)


def normalized(v):
    norm = dot(v, v).sqrt()
    return {name: t / norm for name, t in v.items()}


def convergence(estimates, tolerance=1e-3):
    """A line on whether power iteration settled: the last step's relative change. (The
    estimate is the eigenvalue of largest magnitude; power iteration converges at the rate
    of the ratio of the two largest, which can be slow.)"""
    if len(estimates) < 2:
        return "power iteration: one step only, no word on convergence (use --steps)"
    change = abs(estimates[-1] - estimates[-2]) / max(abs(estimates[-1]), 1e-30)
    if change <= tolerance:
        return (f"power iteration converged: the estimate {estimates[-1]:.5f} changed by "
                f"{change:.1e} (relative) in the last step")
    return (f"power iteration NOT converged after {len(estimates)} steps: the estimate still "
            f"changed by {change:.1e} (relative) in the last step; run more --steps for the "
            f"eigenvalue itself (the HVP checks below do not depend on it)")


def main(argv=None):
    p = _common.parser(__doc__.split("\n\n")[0], steps=10, vocab=32, seq_len=16, batch_size=4,
                       d_model=32, n_heads=2, n_layers=2)
    p.add_argument("--compiler", choices=["inductor", "aot_eager"],
                   help="what flashbob compiles these graphs with (its 'compiler' option); default: "
                        "inductor on CUDA, aot_eager on CPU, where inductor's C++ code generation "
                        "for these graphs takes minutes on two cores")
    args = p.parse_args(argv)
    device = _common.device_of(args)
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.seq_len, args.d_model, args.n_heads, args.n_layers).to(device)
    params = {name: t.detach() for name, t in model.named_parameters()}
    x = torch.randint(args.vocab, (args.batch_size, args.seq_len), device=device)
    y = torch.randint(args.vocab, (args.batch_size, args.seq_len), device=device)

    eager_fwd_rev, eager_rev_rev = make_hvps(model)
    # Graphs that differentiate themselves go through AOTAutograd inside flashbob, which then
    # hands the whole graph (the attention op's derivatives included) to `compiler`.
    options = None
    if args.backend == "flashbob":
        options = {"compiler": args.compiler or ("inductor" if device.type == "cuda" else "aot_eager")}
    compiled_fwd_rev = torch.compile(eager_fwd_rev, backend=args.backend, options=options)
    compiled_rev_rev = torch.compile(eager_rev_rev, backend=args.backend, options=options)

    # Why MATH around the compiled calls too: Dynamo traces torch.func transforms by running
    # them on fake tensors *before* any backend sees the graph, and SDPA's default kernels
    # (flash, efficient, cuDNN, CPU flash) have no derivative of their backward, so tracing
    # grad(grad(...)) or jvp(grad(...)) over SDPA fails there. Under MATH it traces; flashbob
    # then replaces the SDPA node with its own op, so the math kernel never runs
    # (docs/torch-behaviour.md).
    def math_attention():
        return sdpa_kernel(SDPBackend.MATH)

    print(f"power iteration for the top Hessian eigenvalue, "
          f"torch.compile(backend={args.backend!r}, options={options}):")
    v = normalized({name: torch.randn_like(t) for name, t in params.items()})
    fwd_rev_timer, rev_rev_timer = _common.StepTimer(device), _common.StepTimer(device)
    _common.reset_peak_memory(device)
    estimates = []
    for step in range(args.steps):
        with math_attention(), _common.autocast(args, device):
            with fwd_rev_timer.step():
                hv = compiled_fwd_rev(params, x, y, v)
            with rev_rev_timer.step():
                hv_rev = compiled_rev_rev(params, x, y, v)
        eigenvalue = dot(v, hv).item()
        estimates.append(eigenvalue)
        print(f"step {step:3d}  eigenvalue estimate {eigenvalue:10.5f}  "
              f"jvp(grad) {fwd_rev_timer.last_ms:8.1f} ms  grad(grad) {rev_rev_timer.last_ms:8.1f} ms  "
              f"relative gap {_common.rel_err(hv_rev.values(), hv.values()):.1e}")
        v = normalized(hv)
    print(convergence(estimates))
    print(f"jvp(grad):  {fwd_rev_timer.summary('HVP')}")
    print(f"grad(grad): {rev_rev_timer.summary('HVP')}")
    print(f"peak memory: {_common.peak_memory(device)}")

    # The checks run in float32 without autocast; on CUDA the kernels may use TF32 inside.
    tol = 1e-4 if device.type == "cpu" else 1e-2
    with math_attention():
        reference = eager_fwd_rev(params, x, y, v)
        ok = _common.check("jvp(grad) HVP vs eager math attention",
                           compiled_fwd_rev(params, x, y, v).values(), reference.values(), tol)
        ok &= _common.check("grad(grad) HVP vs eager math attention",
                            compiled_rev_rev(params, x, y, v).values(), reference.values(), tol)
        ok &= _common.check("eager grad(grad) vs eager jvp(grad) (the two formulas agree)",
                            eager_rev_rev(params, x, y, v).values(), reference.values(), tol)
    ok &= _common.attention_replaced(args.backend)
    return _common.finish(ok)


if __name__ == "__main__":
    sys.exit(main())
