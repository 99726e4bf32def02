"""Where the memory of a compiled second-order step goes: a Sophia-H step (gradient with
create_graph, Hessian-vector product) of examples/sophia_h.py's GPT-2-small-shaped model
under bf16 autocast, through torch.compile(backend="flashbob").

Per run: the median step time (CUDA events, after two untimed steps), the peak of
torch.cuda.max_memory_allocated over the timed steps, what each compiled order keeps for its
backward (the report's "keeping" lines), the values the second order's forward half keeps
grouped by shape and dtype (each storage counted once), and how many first-order backwards
had to recompute their residuals (a create_graph backward frees them: docs/routing.md,
"Memory of the second order").

    python benchmarks/bench_second_order_memory.py --batch-size 8 --seq-len 1024 --out results/
    python benchmarks/bench_second_order_memory.py --compiler eager ...   # the eager route
    python benchmarks/bench_second_order_memory.py --activation-memory-budget 0.3 ...
        # PyTorch's partitioner knob (torch._functorch.config), which our orders honour
    python benchmarks/bench_second_order_memory.py --device cpu --n-layer 2 --n-embd 64 \\
        --n-head 2 --vocab-size 512 --seq-len 64 --batch-size 2 --out /tmp/   # smoke run
"""
import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

import bob_compile.training.runtime as training_runtime
from bob_compile.backend import recent_reports
from run_record import run_record  # noqa: E402  (benchmarks/, the script's folder)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from sophia_h import GPT, hutchinson_step, rademacher_like  # noqa: E402


class SecondOrderWatch:
    """Counts first-order backwards that recompute their residuals, and records the values
    the last second-order forward half kept (shape and dtype -> bytes, storages once)."""

    def __init__(self):
        self.recomputes, self.kept = 0, {}
        first_order_inputs = training_runtime._first_order_inputs
        second_order_forward = training_runtime.SecondOrderFn.forward

        def counting(ctx, *args):
            self.recomputes += bool(ctx.residuals is not None and ctx.residuals.released)
            return first_order_inputs(ctx, *args)

        def recording(ctx, *args):
            outputs = second_order_forward(ctx, *args)
            self.kept, seen = {}, set()
            for t in ctx.second_order_saved:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    key = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                    self.kept[key] = self.kept.get(key, 0) + t.untyped_storage().nbytes()
            return outputs
        training_runtime._first_order_inputs = counting
        training_runtime.SecondOrderFn.forward = staticmethod(recording)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file or directory")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--compiler", default=None, help="flashbob's compiler option (eager: the eager route)")
    p.add_argument("--activation-memory-budget", type=float, default=None,
                   help="torch._functorch.config.activation_memory_budget for every compile")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.activation_memory_budget is not None:
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = args.activation_memory_budget
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    watch = SecondOrderWatch()
    torch.manual_seed(0)
    with device:
        model = GPT(args.vocab_size, args.seq_len, args.n_layer, args.n_head, args.n_embd, sdpa=True)
    params = list(model.parameters())
    options = {"compiler": args.compiler} if args.compiler else None
    compiled = torch.compile(model, backend="flashbob", dynamic=False, options=options)
    generator = torch.Generator(device=device).manual_seed(1)
    x, y = (torch.randint(args.vocab_size, (args.batch_size, args.seq_len), device=device,
                          generator=generator) for _ in range(2))

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            hutchinson_step(compiled, params, x, y, rademacher_like(params, generator))

    def synchronize():
        if cuda:
            torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    synchronize()
    first_s = time.perf_counter() - start
    step()
    synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    row = dict(batch_size=args.batch_size, seq_len=args.seq_len, compiler=args.compiler,
               activation_memory_budget=args.activation_memory_budget,
               median_ms=statistics.median(times), first_step_s=first_s,
               peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
               keeping=[line.strip() for r in recent_reports for line in r.text().splitlines()
                        if "keeping" in line],
               second_order_kept_mib={k: v / 2 ** 20 for k, v in sorted(
                   watch.kept.items(), key=lambda kv: -kv[1])},
               recomputed_first_order_backwards=watch.recomputes)
    out = pathlib.Path(args.out)
    if out.is_dir() or args.out.endswith("/"):
        out = out / f"bench_second_order_memory_{args.batch_size}x{args.seq_len}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(run=run_record(), row=row), indent=1))
    peak = f"{row['peak_gib']:.2f} GiB" if row["peak_gib"] is not None else "n/a"
    print(f"B={args.batch_size} T={args.seq_len} compiler={args.compiler or 'default'} "
          f"budget={args.activation_memory_budget}: "
          f"{row['median_ms']:.1f} ms per step (host clock after a synchronize), peak {peak}, "
          f"first step {first_s:.1f} s, residual recomputes {watch.recomputes}")
    for line in row["keeping"]:
        print("  ", line)
    print("   the second order keeps (largest first):")
    for key, mib in list(row["second_order_kept_mib"].items())[:12]:
        print(f"     {key:34s} {mib:9.1f} MiB")


if __name__ == "__main__":
    main()
