"""Compiled inference (no_grad): flashbob against stock torch.compile (inductor).

A stack of 4 transformer blocks (width 768, 12 heads, bf16) from tests/models.py, with SDPA
attention or nanoGPT's hand-written attention (causal mask from a registered buffer, so the
flashbob graph carries a causal-buffer guard), at B=1 T=128 (host-bound) and B=8 T=1024.
On the inference route flashbob runs attention as PyTorch's fused SDPA (bob_compile/passes/inference.py):
SDPA sites then cost what stock compile costs; hand-written sites become fused SDPA.
Microseconds per forward: CUDA events around 50 calls, median of 7, after 5 warm-up calls.

    python benchmarks/bench_inference_route.py --out results/
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import bob_compile  # noqa: E402,F401  (registers the backend name)
from models import NanoGPTAttention, NanoGPTBlock, SDPAAttention  # noqa: E402


def time_us(fn, x, calls=50):
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    runs = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn(x)
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / calls * 1000)
    return sorted(runs)[3]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_inference_route.py needs a CUDA device")
        return
    rows = []
    for name in ("sdpa", "handwritten"):
        for B, T in ((1, 128), (8, 1024)):
            torch.manual_seed(0)
            width = 768
            if name == "sdpa":
                def attention(dim):
                    return SDPAAttention(dim, heads=12)
            else:
                def attention(dim):
                    return NanoGPTAttention(dim, heads=12, block_size=T)
            model = nn.Sequential(*[NanoGPTBlock(width, attention) for _ in range(4)])
            model = model.cuda().to(torch.bfloat16).eval()
            x = torch.randn(B, T, width, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                torch._dynamo.reset()
                stock = torch.compile(model)
                stock_us = time_us(stock, x)
                reference = stock(x).float()
                torch._dynamo.reset()
                flashbob = torch.compile(model, backend="flashbob", options={"fallback": False})
                flashbob_us = time_us(flashbob, x)
                diff = (flashbob(x).float() - reference).abs().max().item()
            rows.append(dict(block=name, B=B, T=T, stock_us=stock_us, flashbob_us=flashbob_us,
                             max_abs_diff=diff))
            print(f"{name:12s} B={B} T={T:5d}  stock {stock_us:8.1f} us  flashbob "
                  f"{flashbob_us:8.1f} us  ({flashbob_us / stock_us:.2f}x)  max |diff| {diff:.3g}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_inference_route.json"), "w") as f:
        json.dump(dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__),
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
