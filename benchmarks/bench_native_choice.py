"""Which fused first-order kernel: the backend native SDPA picks (inputs requiring grad), and
the GPU time of PyTorch's cuDNN and FA2 forward + backward as the op's implementation calls
them (`bob_compile/kernels/native_sdpa.py`: forward, backward).

B=1, H=12, bf16; each entry is the mean of 20 calls back to back between two CUDA events
after 3 warm-up calls (GPU-bound: the host runs ahead).

    python benchmarks/bench_native_choice.py --out results/
"""
import argparse
import json
import os

import torch

from bob_compile.kernels import native_sdpa

BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}   # torch._fused_sdp_choice


def gpu_ms(fn, calls=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[128, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args()
    rows = []
    for d in args.d:
        for n in args.n:
            for causal in (True, False):
                q, k, v, do = (torch.randn(1, args.heads, n, d, device="cuda",
                                           dtype=torch.bfloat16) for _ in range(4))
                wants_grad = q.detach().requires_grad_()
                choice = torch._fused_sdp_choice(wants_grad, wants_grad, wants_grad, None, 0.0,
                                                 causal)
                row = dict(d=d, n=n, causal=causal, native_choice=BACKENDS.get(choice, choice))
                scale = d ** -0.5
                for backend in ("cudnn", "flash"):
                    def step(backend=backend):
                        o, lse = native_sdpa.forward(backend, q, k, v, scale, causal)
                        return native_sdpa.backward(backend, q, k, v, o, lse, do,
                                                                 scale, causal)
                    row[f"{backend}_ms"] = gpu_ms(step)
                rows.append(row)
                print(f"d={d:3d} N={n:6d} causal={causal!s:5s} native picks "
                      f"{row['native_choice']:6s} cuDNN {row['cudnn_ms']:.3f} ms  "
                      f"FA2 {row['flash_ms']:.3f} ms", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_native_choice.json")
    with open(path, "w") as f:
        json.dump(dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                 B=1, H=args.heads), rows=rows), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
