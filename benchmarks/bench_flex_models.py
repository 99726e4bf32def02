"""Sophia-H steps of models that write their attention with flex_attention: flashbob vs eager math.

Two models (issue 41's end-to-end rows), each a stack of pre-norm blocks whose attention is
`torch.nn.attention.flex_attention`:

  gemma2     Gemma 2's pattern: layers alternate a sliding window (--window keys, causal)
             and global causal attention, every layer's logits soft-capped
             (cap * tanh(score / cap), --softcap), RMSNorm, a gated MLP
  documents  nanoGPT over packed sequences: causal attention inside each document
             (documents of --min-doc to --max-doc tokens), LayerNorm, a GELU MLP

Per model and sequence length, one Sophia-H Hessian step (forward, gradient with
create_graph=True, Hessian-vector product with Rademacher z) is timed for:

  math      eager PyTorch, the same model with the mask (and soft-capping) written out
            densely before SDPA's math kernel, the only alternative with a double backward
  flashbob  torch.compile(model, backend="flashbob") of the flex_attention model: additive,
            soft-capped or absent score_mods run the fused op (the cap in its kernels:
            bob_compile/passes/flex_attention.py)

CUDA events after warm-up (the first step, with compilation, reported apart), median of
--reps; peak memory over the timed steps; the HVP's relative error of flashbob against math
at the same weights. Out of memory is caught per row. `--device cpu` runs a small smoke
version of the same code path (FlexAttention's CPU device check is lifted for it).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bob_compile  # noqa: E402,F401  (registers the flashbob backend)
from bench_e2e import Clock  # noqa: E402  (benchmarks/, the script's folder)
from run_record import run_record  # noqa: E402


# ----------------------------------------------------------------------------- the models
class Attention(nn.Module):
    """Causal self-attention through flex_attention (`mode` "flex") or through SDPA's math
    kernel with the same mask and soft-capping written out ("math")."""

    def __init__(self, width, heads, window=None, softcap=None):
        super().__init__()
        self.heads, self.window, self.softcap = heads, window, softcap
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x, masks, mode):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        key = "window" if self.window else "global"
        if mode == "flex":
            cap = self.softcap
            score_mod = None if cap is None else (
                lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap))
            y = flex_attention(q, k, v, score_mod=score_mod, block_mask=masks[key])
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            if self.softcap is not None:
                scores = self.softcap * torch.tanh(scores / self.softcap)
            scores = scores.masked_fill(~masks[key + "_dense"], float("-inf"))
            y = scores.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, width, heads, gemma, window=None, softcap=None):
        super().__init__()
        norm = (lambda: nn.RMSNorm(width)) if gemma else (lambda: nn.LayerNorm(width))
        self.norm1, self.norm2 = norm(), norm()
        self.attention = Attention(width, heads, window, softcap)
        self.gemma = gemma
        self.up = nn.Linear(width, (8 if gemma else 4) * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x, masks, mode):
        x = x + self.attention(self.norm1(x), masks, mode)
        h = self.up(self.norm2(x))
        if self.gemma:
            gate, h = h.chunk(2, -1)
            h = F.gelu(gate, approximate="tanh") * h
        else:
            h = F.gelu(h)
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self, kind, layers, width, heads, vocab, window, softcap):
        super().__init__()
        gemma = kind == "gemma2"
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            Block(width, heads, gemma, window if gemma and i % 2 == 0 else None,
                  softcap if gemma else None) for i in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens, targets, masks, mode):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, masks, mode)
        return F.cross_entropy(self.head(x).flatten(0, 1).float(), targets.flatten())


def make_masks(kind, T, args, device):
    """The BlockMasks (flex) and the same masks dense (math)."""
    rows, keys = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
    masks = {}
    if kind == "gemma2":
        window = args.window

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        masks["window"] = create_block_mask(sliding, None, None, T, T, device=device)
        masks["window_dense"] = (keys <= rows) & (rows - keys < window)
    else:
        g = torch.Generator().manual_seed(0)
        lengths = []
        while sum(lengths) < T:
            lengths.append(int(torch.randint(args.min_doc, args.max_doc + 1, (), generator=g)))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:T]
        ids = ids.to(device)

        def causal(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
    masks["global"] = create_block_mask(causal, None, None, T, T, device=device)
    masks["global_dense"] = causal(None, None, rows, keys)
    return masks


# ----------------------------------------------------------------------------- a step
def sophia_hessian_step(model, batch, masks, mode, dtype):
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast(batch[0].device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(*batch, masks, mode)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    g = torch.Generator(device=batch[0].device).manual_seed(1)
    zs = [torch.randint(0, 2, p.shape, generator=g, device=p.device).to(p.dtype) * 2 - 1
          for p in params]
    return torch.autograd.grad(grads, params, zs)


def measure(kind, impl, T, args, device, dtype):
    torch.manual_seed(0)
    model = Model(kind, args.n_layer, args.n_embd, args.n_head, args.vocab, args.window,
                  args.softcap).to(device)
    tokens = torch.randint(0, args.vocab, (args.batch_size, T + 1), device=device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    masks = make_masks(kind, T, args, device)
    mode = "flex" if impl == "flashbob" else "math"
    run = model if impl == "math" else torch.compile(model, backend="flashbob")

    def step():
        if impl == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return sophia_hessian_step(run, batch, masks, mode, dtype)
        return sophia_hessian_step(run, batch, masks, mode, dtype)
    row = dict(model=kind, impl=impl, T=T)
    try:
        start = time.perf_counter()
        hvp = step()
        sync(device)
        row["first_step_s"] = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        clock = Clock(device)
        times = [clock.time_ms(step) for _ in range(args.reps)]
        row["median_ms"] = sorted(times)[len(times) // 2]
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        row["hvp"] = [h.detach().float().cpu() for h in hvp]
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results")
    p.add_argument("--models", nargs="+", default=["gemma2", "documents"],
                   choices=["gemma2", "documents"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--min-doc", type=int, default=256)
    p.add_argument("--max-doc", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        # a smoke run of the same code path: FlexAttention refuses the CPU outside compile
        import torch.nn.attention.flex_attention as flex_module
        flex_module._validate_device = lambda *a, **k: None
    rows = []
    for kind in args.models:
        for T in args.seq_lens:
            pair = {impl: measure(kind, impl, T, args, device, dtype)
                    for impl in ("math", "flashbob")}
            if "hvp" in pair["math"] and "hvp" in pair["flashbob"]:
                got = torch.cat([h.flatten() for h in pair["flashbob"]["hvp"]])
                want = torch.cat([h.flatten() for h in pair["math"]["hvp"]])
                pair["flashbob"]["hvp_rel_err_vs_math"] = ((got - want).norm() / want.norm()).item()
            for row in pair.values():
                row.pop("hvp", None)
                rows.append(row)
    print(f"\n{'model':10s} {'T':>6s} {'impl':9s} {'ms':>9s} {'peak GiB':>9s} "
          f"{'first s':>8s} {'HVP err':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:10s} {r['T']:6d} {r['impl']:9s} {r['error']}")
            continue
        print(f"{r['model']:10s} {r['T']:6d} {r['impl']:9s} {r['median_ms']:9.2f} "
              f"{r.get('peak_gib', float('nan')):9.2f} {r['first_step_s']:8.1f} "
              f"{r.get('hvp_rel_err_vs_math', float('nan')):9.2e}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_flex_models.json")
    with open(path, "w") as f:
        json.dump(dict(meta=dict(**run_record(), device=str(device), args=vars(args)),
                       rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
