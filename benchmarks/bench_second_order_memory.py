"""Where the memory of a compiled second-order step goes: a Sophia-H step (gradient with
create_graph, Hessian-vector product) of examples/sophia_h.py's GPT-2-small-shaped model
under bf16 autocast, through torch.compile(backend="flashbob") (--impl math: eagerly, under
SDPA's math, the only PyTorch attention with a double backward).

Per run: the median step time (CUDA events, after two untimed steps), the peak of
torch.cuda.max_memory_allocated over the timed steps, what each compiled order keeps for its
backward (the report's "keeping" lines), the values the second order's forward half keeps
grouped by shape and dtype (each storage counted once), and how many first-order backwards
had to recompute their residuals (a create_graph backward frees them: docs/routing.md,
"Memory of the second order").

    python benchmarks/bench_second_order_memory.py --batch-size 8 --seq-lens 1024 --out results/
    # the longest sequence one step fits (issue 40): B = 1, doubling T until out of memory
    python benchmarks/bench_second_order_memory.py --batch-size 1 --checkpoint \
        --seq-lens 8192 16384 32768 65536 131072 --reps 2 --out results/
    python benchmarks/bench_second_order_memory.py --impl math --batch-size 1 \
        --seq-lens 2048 4096 8192 16384 --reps 2 --out results/
    python benchmarks/bench_second_order_memory.py --compiler eager ...   # the eager route
    python benchmarks/bench_second_order_memory.py --activation-memory-budget 0.3 ...
        # PyTorch's partitioner knob (torch._functorch.config), which our orders honour
    python benchmarks/bench_second_order_memory.py --regions blocks ...   # each block once
    python benchmarks/bench_second_order_memory.py --cpp-wrapper ...   # inductor's C++ wrapper
    python benchmarks/bench_second_order_memory.py --mode reduce-overhead ...   # CUDA graphs

On CUDA each row also gives the host issue time of a step (from a synchronize to the
step's return, the GPU still busy) beside its GPU kernel time (torch.profiler, the self
time of every CUDA kernel and copy of one step): a ratio above 1 means the GPU waits for
the host (issue 40's "host-bound").
    python benchmarks/bench_second_order_memory.py --device cpu --n-layer 2 --n-embd 64 \\
        --n-head 2 --vocab-size 512 --seq-lens 64 --batch-size 2 --out /tmp/   # smoke run
"""
import argparse
import contextlib
import functools
import gc
import json
import pathlib
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import bob_compile.training.runtime as training_runtime
from bob_compile.backend import recent_reports
from profile_step import host_issue_ms, kernels_of  # noqa: E402  (benchmarks/)
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


class Checkpointed(torch.nn.Module):
    """A block run under torch.utils.checkpoint (non-reentrant): --checkpoint."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def measure(args, seq_len, watch):
    """One row at `seq_len`: time, peak memory, what each order keeps; or out of memory."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch._dynamo.reset()
    recent_reports.clear()
    watch.recomputes, watch.kept = 0, {}
    torch.manual_seed(0)
    with device:
        model = GPT(args.vocab_size, seq_len, args.n_layer, args.n_head, args.n_embd, sdpa=True)
    if args.checkpoint:
        model.h = torch.nn.ModuleList(Checkpointed(block) for block in model.h)
    params = list(model.parameters())
    if args.impl == "math":         # eager PyTorch, SDPA's math: the only double backward
        run, attention = model, functools.partial(sdpa_kernel, SDPBackend.MATH)
    else:
        options = {"regions": args.regions}
        if args.compiler:
            options["compiler"] = args.compiler
        run = torch.compile(model, backend="flashbob", dynamic=False, options=options,
                            mode=args.mode)
        attention = contextlib.nullcontext
    generator = torch.Generator(device=device).manual_seed(1)
    x, y = (torch.randint(args.vocab_size, (args.batch_size, seq_len), device=device,
                          generator=generator) for _ in range(2))

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16), attention():
            hutchinson_step(run, params, x, y, rademacher_like(params, generator))

    def synchronize():
        if cuda:
            torch.cuda.synchronize()
    row = dict(impl=args.impl, checkpoint=args.checkpoint, batch_size=args.batch_size,
               seq_len=seq_len, compiler=args.compiler, mode=args.mode, regions=args.regions,
               cpp_wrapper=args.cpp_wrapper,
               activation_memory_budget=args.activation_memory_budget)
    try:
        start = time.perf_counter()
        step()
        synchronize()
        row["first_step_s"] = time.perf_counter() - start
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
        if cuda:
            row.update(host_issue_ms=host_issue_ms(step, args.reps),
                       gpu_kernel_ms=sum(k["ms"] for k in kernels_of(step)))
            with torch.autocast(device.type, dtype=torch.bfloat16), attention():
                row["phases_gib"] = phase_memory(run, params, x, y,
                                                 rademacher_like(params, generator))
    except torch.OutOfMemoryError:
        row["out_of_memory"] = True
        return row
    row.update(median_ms=statistics.median(times),
               peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
               keeping=[line.strip() for r in recent_reports for line in r.text().splitlines()
                        if "keeping" in line],
               second_order_kept_mib={k: v / 2 ** 20 for k, v in sorted(
                   watch.kept.items(), key=lambda kv: -kv[1])},
               recomputed_first_order_backwards=watch.recomputes)
    return row


def phase_memory(run, params, x, y, zs):
    """Per phase of the step (forward, create_graph backward, double backward): the memory
    it leaves allocated and its peak, both above what was allocated before the step, GiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    phases = {}

    def phase(name, fn):
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        phases[name] = dict(left=(torch.cuda.memory_allocated() - base) / 2 ** 30,
                            peak=(torch.cuda.max_memory_allocated() - base) / 2 ** 30)
        return result
    loss = phase("forward", lambda: run(x, y))
    grads = phase("create_graph backward",
                  lambda: torch.autograd.grad(loss, params, create_graph=True))
    phase("double backward", lambda: torch.autograd.grad(grads, params, grad_outputs=zs))
    return phases


def print_row(row):
    head = (f"{row['impl']}{' +checkpoint' if row['checkpoint'] else ''} B={row['batch_size']} "
            f"T={row['seq_len']} compiler={row['compiler'] or 'default'} "
            f"budget={row['activation_memory_budget']} mode={row['mode'] or 'default'}"
            f"{' cpp_wrapper' if row['cpp_wrapper'] else ''}"
            f"{' regions=' + row['regions'] if row['impl'] == 'flashbob' else ''}")
    if row.get("out_of_memory"):
        print(f"{head}: out of memory")
        return
    peak = f"{row['peak_gib']:.2f} GiB" if row["peak_gib"] is not None else "n/a"
    print(f"{head}: {row['median_ms']:.1f} ms per step (host clock after a synchronize), "
          f"peak {peak}, first step {row['first_step_s']:.1f} s, residual recomputes "
          f"{row['recomputed_first_order_backwards']}")
    if row.get("host_issue_ms") is not None:
        print(f"   host issue {row['host_issue_ms']:.1f} ms, GPU kernels "
              f"{row['gpu_kernel_ms']:.1f} ms per step: ratio "
              f"{row['host_issue_ms'] / row['gpu_kernel_ms']:.2f}")
    for name, p in (row.get("phases_gib") or {}).items():
        print(f"   {name}: peak +{p['peak']:.2f} GiB, leaves +{p['left']:.2f} GiB")
    for line in row["keeping"]:
        print("  ", line)
    if row["second_order_kept_mib"]:
        print("   the second order keeps (largest first):")
        for key, mib in list(row["second_order_kept_mib"].items())[:12]:
            print(f"     {key:34s} {mib:9.1f} MiB")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file or directory")
    p.add_argument("--impl", choices=["flashbob", "math"], default="flashbob")
    p.add_argument("--checkpoint", action="store_true",
                   help="every block under torch.utils.checkpoint (non-reentrant)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024],
                   help="one row each; after the first out of memory the longer ones are skipped")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--compiler", default=None, help="flashbob's compiler option (eager: the eager route)")
    p.add_argument("--regions", choices=["blocks", "graph"], default="graph",
                   help="flashbob's regions option: compile the graph whole (default, as "
                        "flashbob's) or each distinct block once")
    p.add_argument("--activation-memory-budget", type=float, default=None,
                   help="torch._functorch.config.activation_memory_budget for every compile")
    p.add_argument("--mode", default=None, help="torch.compile's mode (reduce-overhead: CUDA graphs)")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="torch._inductor.config.cpp_wrapper for every compile")
    p.add_argument("--compile-times", action="store_true",
                   help="print torch._dynamo's compile-time breakdown after each row")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.cpp_wrapper:
        import torch._inductor.config as inductor_config
        inductor_config.cpp_wrapper = True
    if args.activation_memory_budget is not None:
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = args.activation_memory_budget
    watch = SecondOrderWatch()
    out = pathlib.Path(args.out)
    if out.is_dir() or args.out.endswith("/"):
        tag = (f"_{args.impl}{'_checkpoint' if args.checkpoint else ''}_b{args.batch_size}"
               f"{'_' + args.mode if args.mode else ''}{'_cpp' if args.cpp_wrapper else ''}"
               f"{'_blocks' if args.regions == 'blocks' else ''}")
        out = out / f"bench_second_order_memory{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq_len in sorted(args.seq_lens):
        rows.append(measure(args, seq_len, watch))
        if args.compile_times:
            print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))
        gc.collect()                # the row's model and graphs, before the next length
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        out.write_text(json.dumps(dict(run=run_record(), rows=rows), indent=1))
        print_row(rows[-1])
        if rows[-1].get("out_of_memory"):
            break
    fits = [r["seq_len"] for r in rows if not r.get("out_of_memory")]
    print(f"longest T that ran: {max(fits) if fits else 'none'}")


if __name__ == "__main__":
    main()
