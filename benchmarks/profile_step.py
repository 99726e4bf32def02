"""Where one second-order attention step spends its time, kernel by kernel (issue 42).

The step of bench_attention.py (forward through `bob_compile.attention`, gradient with
create_graph=True, second gradient with respect to q, k, v), B=1, bf16, per sequence length
and causal or not:

  step        CUDA events around the step, median of --reps after a warm-up
  host        the host's issue time of the step: from a synchronize to the step's return,
              the GPU still busy (a step whose host time exceeds its kernels' is host-bound)
  kernels     torch.profiler over one step: each CUDA kernel's GPU time and launch count

Made for the short-sequence question (at 1K a causal step took longer than a non-causal
one): launches, host time and per-kernel time side by side. With --dropout or --softcap,
the same step with attention dropout or soft-capped scores: which passes the feature slows
(issues 39 and 41).

    python benchmarks/profile_step.py --seq-lens 1024 4096 --out results/
    python benchmarks/profile_step.py --seq-lens 16384 --causal yes --dropout 0.1
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bob_compile  # noqa: E402
from bench_e2e import Clock  # noqa: E402  (benchmarks/, the script's folder)
from run_record import run_record  # noqa: E402


def step_of(n, causal, args):
    options = dict(dropout_p=args.dropout) if args.dropout else {}
    if args.softcap:
        options["softcap"] = args.softcap
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do, *cotangents = (
        torch.randn(1, args.heads, n, args.head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=g, requires_grad=i < 3) for i in range(7))

    def step():
        o = bob_compile.attention(q, k, v, is_causal=causal, **options)
        grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        torch.autograd.grad(grads, (q, k, v), cotangents)
    return step


def host_issue_ms(step, reps):
    """Median host time to issue one step: from a synchronize to the step's return, the GPU
    still busy."""
    host = []
    for _ in range(reps):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        step()
        host.append(1e3 * (time.perf_counter() - begin))
    torch.cuda.synchronize()
    return statistics.median(host)


def kernels_of(step):
    """Each CUDA kernel (and copy) of one step, longest first: name, GPU ms (torch.profiler's
    self CUDA time), launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sorted(({"name": e.key, "ms": e.self_device_time_total / 1e3, "launches": e.count}
                   for e in prof.key_averages() if e.device_type.name == "CUDA"),
                  key=lambda k: -k["ms"])


def measure(step, reps):
    for _ in range(3):
        step()
    clock = Clock(torch.device("cuda"))
    times = [clock.time_ms(step) for _ in range(reps)]
    host = host_issue_ms(step, reps)
    kernels = kernels_of(step)
    return dict(step_ms=statistics.median(times), host_ms=host,
                kernel_ms=sum(k["ms"] for k in kernels),
                launches=sum(k["launches"] for k in kernels), kernels=kernels)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--top", type=int, default=8, help="kernels printed per row")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout p")
    p.add_argument("--softcap", type=float, default=0.0, help="soft-capping c (0: none)")
    p.add_argument("--out", default="results")
    args = p.parse_args()
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = []
    for n in args.seq_lens:
        for causal in causal_values:
            row = dict(N=n, causal=causal, dropout=args.dropout, softcap=args.softcap,
                       **measure(step_of(n, causal, args), args.reps))
            rows.append(row)
            print(f"N={n} causal={causal} dropout={args.dropout} softcap={args.softcap}: "
                  f"step {row['step_ms']:.3f} ms, host issue {row['host_ms']:.3f} ms, "
                  f"kernels {row['kernel_ms']:.3f} ms in {row['launches']} launches")
            for k in row["kernels"][:args.top]:
                print(f"   {k['ms']:8.3f} ms x{k['launches']:<3d} {k['name'][:90]}")
    os.makedirs(args.out, exist_ok=True)
    name = "profile_step" + (f"_dropout{args.dropout}" if args.dropout else "") + \
        (f"_softcap{args.softcap:g}" if args.softcap else "")
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(dict(run=run_record(), device=torch.cuda.get_device_name(), rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
