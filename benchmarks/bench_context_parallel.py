"""A second-order attention step over a sequence split across GPUs (issue 43's rows).

One attention layer's step, as bench_attention.py times it (forward, gradient with
create_graph=True, second gradient with respect to q, k, v), B=1, H=12, d=64, causal:

  one GPU     bob_compile.attention on the whole sequence (rank 0 alone)
  R ranks     bob_compile.context_parallel.attention, each rank its head-tail shard
              (PyTorch's load-balanced order), NCCL; the step time is the slowest rank's

Per sequence length: median step time over --reps after a warm-up, the speedup over one
GPU, peak memory per rank, and the share of the step the collectives take (torch.profiler
on rank 0: the NCCL kernels' GPU time against the step's). `--device cpu --ranks 2` runs a
smoke version on gloo (float32, small lengths). Results: --out/bench_context_parallel.json.

    python benchmarks/bench_context_parallel.py --seq-lens 262144 --ranks 2
    python benchmarks/bench_context_parallel.py --seq-lens 1048576 --ranks 4 --skip-one-gpu
"""
import argparse
import json
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bob_compile  # noqa: E402
from bob_compile import context_parallel  # noqa: E402
from bench_e2e import Clock  # noqa: E402  (benchmarks/, the script's folder)
from profile_step import kernels_of  # noqa: E402
from run_record import run_record  # noqa: E402


def step_of(attend, q, k, v, do, cotangents):
    def step():
        o = attend(q, k, v)
        grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        torch.autograd.grad(grads, (q, k, v), cotangents)
    return step


def inputs(n, args, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    make = lambda grad: torch.randn(1, args.heads, n, args.head_dim, device=device,  # noqa: E731
                                    dtype=dtype, generator=g, requires_grad=grad)
    return [make(True) for _ in range(3)], make(False), [make(False) for _ in range(3)]


def timed(step, clock, reps):
    step()      # warm-up: kernels compiled, tuned
    return [clock.time_ms(step) for _ in range(reps)]


def collective_share(step, device):
    """GPU time of the NCCL kernels over the GPU time of all kernels in one step."""
    if device.type != "cuda":
        return None
    kernels = kernels_of(step)
    total = sum(k["ms"] for k in kernels)
    nccl = sum(k["ms"] for k in kernels if "nccl" in k["name"].lower())
    return nccl / total if total else None


def rank_main(rank, ranks, args, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=ranks)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    clock = Clock(device)
    rows = []
    for N in args.seq_lens:
        row = dict(N=N, ranks=ranks)
        n = N // ranks
        (q, k, v), do, cot = inputs(n, args, device, seed=rank)

        def attend(q, k, v):
            return context_parallel.attention(q, k, v, is_causal=True, order="head-tail")
        step = step_of(attend, q, k, v, do, cot)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        try:
            times = torch.tensor(timed(step, clock, args.reps), device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)    # the slowest rank sets the pace
            row["step_ms"] = statistics.median(times.tolist())
            row["collective_share"] = collective_share(step, device)
            if cuda:
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        except torch.OutOfMemoryError:
            row["step_ms"] = "out of memory"
        del q, k, v, do, cot
        if rank == 0:
            rows.append(row)
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def one_gpu(N, args):
    device = torch.device(args.device)
    (q, k, v), do, cot = inputs(N, args, device, seed=0)
    step = step_of(lambda q, k, v: bob_compile.attention(q, k, v, is_causal=True),
                   q, k, v, do, cot)
    try:
        return statistics.median(timed(step, Clock(device), args.reps))
    except torch.OutOfMemoryError:
        return "out of memory"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[262144])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-one-gpu", action="store_true", help="no single-GPU reference row")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="results")
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"--ranks {args.ranks} needs as many GPUs; this machine has "
                 f"{torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(args.ranks, args, port, results), nprocs=args.ranks)
    rows = results.get()
    for row in rows:
        row["one_gpu_ms"] = None if args.skip_one_gpu else one_gpu(row["N"], args)
        if isinstance(row["one_gpu_ms"], float) and isinstance(row["step_ms"], float):
            row["speedup"] = row["one_gpu_ms"] / row["step_ms"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_context_parallel.json"), "w") as f:
        json.dump(dict(run=run_record(), device=args.device, rows=rows), f, indent=1)
    print(f"{'N':>9} {'ranks':>5} {'step ms':>10} {'one GPU ms':>11} {'speedup':>8} "
          f"{'NCCL share':>10} {'peak GiB':>9}")
    for r in rows:
        fmt = lambda x, spec: format(x, spec) if isinstance(x, float) else str(x)  # noqa: E731
        print(f"{r['N']:>9} {r['ranks']:>5} {fmt(r['step_ms'], '10.1f'):>10} "
              f"{fmt(r['one_gpu_ms'], '11.1f'):>11} {fmt(r.get('speedup'), '8.2f'):>8} "
              f"{fmt(r['collective_share'], '10.2f'):>10} {fmt(r.get('peak_gib'), '9.2f'):>9}")


if __name__ == "__main__":
    main()
