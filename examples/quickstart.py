"""Quickstart: an exact second-order step through a transformer compiled with flashbob.

    python examples/quickstart.py

1. Builds a tiny nanoGPT (2 blocks: one attends through F.scaled_dot_product_attention,
   the other through nanoGPT's hand-written attention with its causal `bias` buffer).
2. Compiles it with torch.compile(model, backend="flashbob"), dumping what the backend did.
3. Takes a Hutchinson Hessian-vector product, as Sophia-H does:
       grads = autograd.grad(loss, params, create_graph=True)
       hvp   = autograd.grad(grads, params, grad_outputs=z)
4. Checks loss, gradient and HVP against the same model run eagerly with math attention.
5. Prints the report (each attention site, the route) and the diff of the rewritten graph,
   then shows what stock torch.compile does with the same step.
Runs in about a minute on a CPU, most of it inductor compiling the forward, backward and
double backward; in float64 so that "exact" means ~1e-15. Exit status 1 on failure.
"""
import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import bob_compile.backend


class CausalSelfAttention(nn.Module):
    """nanoGPT's, with its two paths: flash (SDPA) and slow (written by hand)."""

    def __init__(self, n_embd, n_head, block_size, flash):
        super().__init__()
        self.n_head, self.n_embd, self.flash = n_head, n_embd, flash
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, flash):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, flash)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, n_embd=32, n_head=4, block_size=32):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size, flash) for flash in (True, False)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def hutchinson_hvp(model, params, idx, targets, z):
    loss = model(idx, targets)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    hvp = torch.autograd.grad(grads, params, grad_outputs=z)
    return [loss], grads, hvp


def max_error(got, ref):
    return max((g - r).abs().max().item() for g, r in zip(got, ref))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dump-dir", default="flashbob_dumps",
                        help="where flashbob writes each graph before/after, their diff and a report")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT().double()
    params = list(model.parameters())
    idx = torch.randint(0, 64, (4, 24))
    targets = torch.randint(0, 64, (4, 24))
    z = [torch.randint(0, 2, p.shape).double() * 2 - 1 for p in params]  # Rademacher

    with sdpa_kernel(SDPBackend.MATH):  # eager reference: the only SDPA kernel with a double backward
        reference = hutchinson_hvp(model, params, idx, targets, z)

    compiled = torch.compile(model, backend="flashbob", options={"dump_dir": args.dump_dir})
    result = hutchinson_hvp(compiled, params, idx, targets, z)

    ok = True
    for name, got, ref in zip(("loss", "gradient", "Hessian-vector product"), result, reference):
        err = max_error(got, ref)
        ok &= err <= 1e-9
        print(f"{name:23s} max |flashbob - eager math| = {err:.1e}  {'OK' if err <= 1e-9 else 'FAILED'}")

    report = bob_compile.backend.recent_reports[-1]
    ok &= len(report.replaced) == 2
    print()
    print(report.text())
    folder = os.path.join(args.dump_dir, (report.compile_id or "").replace("/", "_"))
    diff = open(os.path.join(folder, "graph.diff")).read()
    print(f"The rewritten graph ({folder}/graph.diff; before/after and report alongside):\n")
    print(diff)

    torch._dynamo.reset()
    try:
        hutchinson_hvp(torch.compile(model, backend="aot_eager"), params, idx, targets, z)
        print("stock torch.compile (backend='aot_eager': the AOTAutograd inductor uses): "
              "ran (unexpected)")
    except RuntimeError as e:
        print(f"stock torch.compile (backend='aot_eager': the AOTAutograd inductor uses) on the "
              f"same step: RuntimeError: "
              f"{str(e).splitlines()[0]}")

    print("all checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
