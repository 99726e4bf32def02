"""What an autograd node costs on the host: C++ against Python, around the same fused kernels.

Issue 10's remaining host overhead is the op's Python autograd node (docs/measurements.md,
"Host overhead"). This measures the option of a C++ node before building it into the op:
forward + `autograd.grad` of one tiny attention call (B = H = 1, N = 4, d = 8, causal,
float32, so that the kernels take microseconds) through

- native SDPA (`F.scaled_dot_product_attention`, PyTorch's own C++ node),
- a C++ `torch::autograd::Function` around PyTorch's CPU flash-attention forward and backward
  (the same kernels native SDPA runs here), compiled on first use with
  `torch.utils.cpp_extension.load_inline` (needs a C++ compiler and ninja),
- a Python `torch.autograd.Function` around the same two kernels (what the op's node costs
  at least: it also checks its inputs, keeps its call path and its lse).

CPU only: on the CPU autograd runs every node on the calling thread, so the rows differ only
in what the node itself costs (on CUDA both native and C++ nodes also pay the engine's device
thread hand-off, a Python node the GIL there too). Median of 5 runs of --calls calls each.

    python benchmarks/bench_autograd_node.py --out results/
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

CPP_SOURCE = r'''
#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// PyTorch's CPU flash attention (forward with its log-sum-exp, then its backward)
struct FusedAttention : public torch::autograd::Function<FusedAttention> {
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v,
                               bool causal, double scale) {
    auto out = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, {}, scale);
    ctx->save_for_backward({q, k, v, std::get<0>(out), std::get<1>(out)});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return {std::get<0>(out)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto g = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grads[0], s[0], s[1], s[2], s[3], s[4], 0.0, ctx->saved_data["causal"].toBool(), {},
        ctx->saved_data["scale"].toDouble());
    return {std::get<0>(g), std::get<1>(g), std::get<2>(g), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fused_attention(at::Tensor q, at::Tensor k, at::Tensor v, bool causal, double scale) {
  return FusedAttention::apply(q, k, v, causal, scale)[0];
}
'''


class PythonNode(torch.autograd.Function):
    """The same two kernels behind a Python node."""

    @staticmethod
    def forward(q, k, v, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, causal, scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.causal, ctx.scale = causal, scale

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None


def microseconds(fn, calls, warmup=300, runs=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times), times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    start = time.perf_counter()
    extension = load_inline("bob_compile_bench_fused_attention_node", cpp_sources=CPP_SOURCE,
                            functions=["fused_attention"], extra_cflags=["-O2"])
    build_s = time.perf_counter() - start
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 8, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 1, 4, 8)
    scale = 8 ** -0.5
    rows = {
        "native SDPA": lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do),
        "C++ autograd node": lambda: torch.autograd.grad(
            extension.fused_attention(q, k, v, True, scale), (q, k, v), do),
        "Python autograd node": lambda: torch.autograd.grad(
            PythonNode.apply(q, k, v, True, scale)[0], (q, k, v), do),
    }
    reference = rows["native SDPA"]()
    for name, fn in rows.items():
        for got, want in zip(fn(), reference):
            torch.testing.assert_close(got, want)
    results = []
    print(f"C++ node built (or loaded) in {build_s:.1f} s")
    print(f"{'forward + backward':24s} {'us/call':>8s} {'vs native':>9s}")
    native_us = None
    for name, fn in rows.items():
        us, runs = microseconds(fn, args.calls)
        native_us = native_us or us
        results.append(dict(row=name, us=us, runs_us=runs, ratio_to_native=us / native_us))
        print(f"{name:24s} {us:8.1f} {us / native_us:8.2f}x")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_autograd_node.json")
    with open(path, "w") as f:
        json.dump(dict(torch=torch.__version__, build_s=build_s, rows=results), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
