"""Sophia-H on a small nanoGPT-style GPT, compiled with torch.compile(backend="flashbob").

The model is nanoGPT's: its attention is written by hand (q @ kᵀ · 1/√d, masked_fill with a
registered lower-triangular `bias` buffer, softmax, @ v), as in the Sophia and SASSHA
training code. It learns to predict the next byte of a text file that ships with this
repository (README.md by default).

Sophia-H (Liu et al., 2023, "Sophia: A Scalable Stochastic Second-order Optimizer for
Language Model Pre-training") preconditions an EMA of the gradient by an EMA of the Hessian
diagonal and clips the ratio:

    every k steps:  ĥ = z ⊙ (∇²L z),  z Rademacher          (Hutchinson estimate)
                    h ← β₂ h + (1 − β₂) ĥ
    every step:     m ← β₁ m + (1 − β₁) ∇L
                    θ ← θ − η λ θ
                    θ ← θ − η clip(m / max(γ h, ε), −1, 1)

The Hessian-vector product ∇²L z is a double backward through the whole model, attention
included: grads = autograd.grad(loss, params, create_graph=True), then
autograd.grad(grads, params, grad_outputs=z). That is the step users keep torch.compile off
for ("compile = False  # because of computing second-order derivative", SASSHA's GPT-2
config); here it is compiled.

Before and after training, the script checks the compiled model's loss, gradient and
Hessian-vector product against the same model run eagerly (hand-written math attention),
and exits with status 1 if they differ.

    python examples/sophia_h.py                   # tiny, CPU, ~55 s (mostly compiling)
    python examples/sophia_h.py --device cuda --dtype bfloat16 --block-size 1024 \\
        --n-layer 12 --n-head 12 --n-embd 768 --batch-size 4 --steps 100 --hess-interval 10
"""
import math
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import _common

REPO = pathlib.Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- the model
class CausalSelfAttention(nn.Module):
    """nanoGPT's attention; `sdpa=True` is nanoGPT's `flash` branch (one SDPA call)."""

    def __init__(self, n_embd, n_head, block_size, sdpa=False):
        super().__init__()
        self.n_head, self.n_embd, self.sdpa = n_head, n_embd, sdpa
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        if not sdpa:
            # nanoGPT's causal mask: a buffer, sliced to the sequence length in forward.
            self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                                 .view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, sdpa=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, sdpa)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT without dropout: token and position embeddings, blocks, tied LM head."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, sdpa=False):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, sdpa) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


# ----------------------------------------------------------------------------- Sophia-H
class SophiaH(torch.optim.Optimizer):
    """The Sophia update with a Hutchinson Hessian-diagonal EMA (Liu et al. 2023, Alg. 3).

    Defaults follow the paper's GPT-2 runs: β₁ = 0.96, β₂ = 0.99, ε = 1e-12, γ = 0.01 for
    Sophia-H. The caller supplies Hessian-diagonal estimates through update_hessian().
    """

    def __init__(self, params, lr=1e-3, betas=(0.96, 0.99), gamma=0.01, eps=1e-12, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, gamma=gamma, eps=eps, weight_decay=weight_decay))

    def _state(self, p):
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
            state["hessian"] = torch.zeros_like(p)
        return state

    # The updates are foreach ops: one kernel launch per op for all parameters, where a
    # loop over parameters launches ~10 per parameter (GPT-2 small: ~1,500 launches, about
    # 30 ms of host time per step on an H200 host, more than the step's GPU work).
    @torch.no_grad()
    def update_hessian(self, hessian_diagonals):
        """h ← β₂ h + (1 − β₂) ĥ, one estimate per parameter, in parameter order."""
        estimates = iter(hessian_diagonals)
        for group in self.param_groups:
            beta2 = group["betas"][1]
            hessians = [self._state(p)["hessian"] for p in group["params"]]
            torch._foreach_mul_(hessians, beta2)
            torch._foreach_add_(hessians, [next(estimates) for _ in hessians], alpha=1 - beta2)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, beta1 = group["lr"], group["betas"][0]
            exp_avgs = [self._state(p)["exp_avg"] for p in params]
            hessians = [self._state(p)["hessian"] for p in params]
            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_add_(exp_avgs, [p.grad for p in params], alpha=1 - beta1)
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            # Negative or tiny curvature gives a huge ratio: the clip turns it into a
            # sign-momentum step of size lr, Sophia's safeguard.
            denominators = torch._foreach_mul(hessians, group["gamma"])
            torch._foreach_clamp_min_(denominators, group["eps"])
            ratios = torch._foreach_div(exp_avgs, denominators)
            torch._foreach_clamp_min_(ratios, -1)
            torch._foreach_clamp_max_(ratios, 1)
            torch._foreach_add_(params, ratios, alpha=-lr)


def rademacher_like(tensors, generator):
    """±1 vectors, drawn on the tensors' device by `generator` (a generator of that device:
    drawing on the host would add a copy of every parameter to each Hessian step). One draw
    for all tensors, cut into views: a draw per tensor costs four launches per parameter."""
    sizes = [t.numel() for t in tensors]
    signs = torch.randint(0, 2, (sum(sizes),), device=tensors[0].device, generator=generator)
    signs = signs.to(tensors[0].dtype) * 2 - 1
    return [piece.view(t.shape).to(t.dtype) for piece, t in zip(signs.split(sizes), tensors)]


def hutchinson_step(model, params, x, y, zs):
    """loss, ∇L and z ⊙ (∇²L z): one forward, a backward with create_graph, a double backward."""
    loss = model(x, y)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    hvps = torch.autograd.grad(grads, params, grad_outputs=zs)
    return loss.detach(), [g.detach() for g in grads], torch._foreach_mul(zs, hvps), hvps


# ----------------------------------------------------------------------------- data, check
def load_bytes(path, block_size):
    data = torch.frombuffer(bytearray(pathlib.Path(path).read_bytes()), dtype=torch.uint8).long()
    if data.numel() < block_size + 2:  # a short text: repeat it so one block fits
        data = data.repeat(math.ceil((block_size + 2) / data.numel()))
    return data


def get_batch(data, batch_size, block_size, device, generator):
    starts = torch.randint(data.numel() - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[i:i + block_size] for i in starts])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in starts])
    return x.to(device), y.to(device)


def check_against_eager(model, compiled, batch, z_generator, tol, when):
    """Compiled vs eager (hand-written math attention): loss, gradient, Hessian-vector product."""
    params = [p for p in model.parameters()]
    zs = rademacher_like(params, z_generator)
    with sdpa_kernel(SDPBackend.MATH):  # for --attention sdpa: the only kernel with a double backward
        ref_loss, ref_grads, _, ref_hvps = hutchinson_step(model, params, *batch, zs)
    loss, grads, _, hvps = hutchinson_step(compiled, params, *batch, zs)
    ok = _common.check(f"loss ({when})", [loss], [ref_loss], tol)
    ok &= _common.check(f"gradient ({when})", grads, ref_grads, tol)
    ok &= _common.check(f"Hessian-vector product ({when})", hvps, ref_hvps, tol)
    return ok


def main(argv=None):
    p = _common.parser(__doc__.split("\n\n")[0], steps=20, text=str(REPO / "README.md"), block_size=32,
                       batch_size=4, n_layer=2, n_head=2, n_embd=32, lr=3e-3, hess_interval=2,
                       weight_decay=0.1)
    p.add_argument("--attention", choices=["handwritten", "sdpa"], default="handwritten",
                   help="nanoGPT's hand-written attention, or its F.scaled_dot_product_attention branch")
    args = p.parse_args(argv)
    device = _common.device_of(args)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)  # batches are cut on the host
    z_generator = torch.Generator(device=device).manual_seed(args.seed)
    data = load_bytes(args.text, args.block_size)
    print(f"training on {data.numel()} bytes of {args.text}")

    model = GPT(256, args.block_size, args.n_layer, args.n_head, args.n_embd,
                sdpa=args.attention == "sdpa").to(device)
    params = [p for p in model.parameters()]
    compiled = torch.compile(model, backend=args.backend)
    optimizer = SophiaH(params, lr=args.lr, weight_decay=args.weight_decay)

    # fp32 kernels on CUDA may use TF32 internally; on CPU the blockwise path is plain fp32.
    tol = 1e-4 if device.type == "cpu" else 1e-2
    check_batch = get_batch(data, args.batch_size, args.block_size, device, generator)
    ok = check_against_eager(model, compiled, check_batch, z_generator, tol, "initial weights")

    print(f"\nSophia-H, {args.attention} attention, torch.compile(backend={args.backend!r}), {args.dtype}, "
          f"Hessian estimate every {args.hess_interval} steps:")
    plain_steps, hessian_steps = _common.StepTimer(device), _common.StepTimer(device)
    _common.reset_peak_memory(device)
    for step in range(args.steps):
        x, y = get_batch(data, args.batch_size, args.block_size, device, generator)
        with_hessian = step % args.hess_interval == 0
        timer = hessian_steps if with_hessian else plain_steps
        with timer.step():
            with _common.autocast(args, device):
                if with_hessian:
                    loss, grads, h_hat, _ = hutchinson_step(compiled, params, x, y,
                                                            rademacher_like(params, z_generator))
                    optimizer.update_hessian(h_hat)
                else:
                    loss = compiled(x, y)
                    grads = torch.autograd.grad(loss, params)
            for p, g in zip(params, grads):
                p.grad = g
            optimizer.step()
        print(f"step {step:4d}  loss {loss.item():.4f}  {timer.last_ms:8.1f} ms"
              + ("  (with Hessian estimate)" if with_hessian else ""))

    print(f"Hessian steps: {hessian_steps.summary()}")
    print(f"plain steps:   {plain_steps.summary()}")
    print(f"peak memory: {_common.peak_memory(device)}")
    ok &= check_against_eager(model, compiled, check_batch, z_generator, tol, "trained weights")
    ok &= _common.attention_replaced(args.backend)
    return _common.finish(ok)


if __name__ == "__main__":
    sys.exit(main())
