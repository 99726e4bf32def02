"""End-to-end second-order training steps on a GPT-2-small-shaped model: flashbob vs eager math.

The model is nanoGPT's GPT as in examples/sophia_h.py (12 layers, 12 heads, head dim 64,
n_embd 768, vocabulary 50304, tied LM head, no dropout), trained under bf16 autocast as
Sophia's and SASSHA's GPT-2 scripts do. Per sequence length N, these steps are timed:

  first_order     forward and gradient (what first-order training compiles)
  sophia_hessian  a Sophia-H step with its Hessian estimate: forward, gradient with
                  create_graph=True, Hessian-vector product with Rademacher z (double
                  backward), Hessian EMA update, Sophia update
  sophia_plain    a Sophia-H step without it: forward, gradient, Sophia update
  maml_outer      a MAML outer step: one inner SGD step on a support batch (gradient with
                  create_graph=True, fast weights through torch.func.functional_call), the
                  query loss at the fast weights, its gradient w.r.t. the initial weights
                  (through the inner step), Adam update

by these implementations:

  math      eager PyTorch under sdpa_kernel(SDPBackend.MATH), the only SDPA kernel with a
            double backward (it stores N x N attention matrices)
  eager     eager PyTorch with its default (fused) SDPA: first-order workloads only
  stock     torch.compile(model) with inductor: first-order workloads only (stock compile
            refuses a double backward, or for MAML silently drops its second-order terms)
  flashbob  torch.compile(model, backend="flashbob"): the same model, with attention
            replaced by this package's fused op
  flashbob_cudagraphs  the same with mode="reduce-overhead": inductor replays each compiled
            graph (forward, backward, double backward) as a CUDA graph, which removes the
            host's launch overhead where it dominates (batch 1, short sequences, MAML)

--maml-tasks adds the meta-learning rows: a 4-layer, width-256, 4-head GPT (vocabulary
--maml-vocab), one MAML meta-gradient over T-token tasks (one support and one query
sequence each, one inner SGD step with create_graph=True, the meta-gradient summed over
tasks), e.g. `--maml-tasks 128x32 256x8` for T=128 with 32 tasks and T=256 with 8. Its
implementations: math, flashbob (torch.func.functional_call), flashbob_cudagraphs (the same,
mode="reduce-overhead"), and flashbob_torchopt (the same step with torchopt's
differentiable FuncOptimizer) when torchopt is installed.

Timing: CUDA events around each step after warm-up (the first warm-up step includes
compilation and is reported separately), median of --reps. Peak memory:
torch.cuda.max_memory_allocated over the timed steps, model and optimizer state included.
Each row catches out-of-memory; an implementation that ran out of memory at some N is not
tried at larger N (its rows say so), so the sweep goes on with flashbob alone. At every N
where both ran, the Hessian-vector product of a fixed z at the initial weights is compared
(relative error of flashbob against math, both in the autocast dtype).

The JSON file (--out) is rewritten after every row, so a sweep cut short keeps what it
measured, and --resume measures only the rows it lacks (with --time-budget-s, the sweep fits
machines that stop a command after a fixed time). The table is printed last. Plot it with
benchmarks/plot_e2e.py.

    python benchmarks/bench_e2e.py --out results/bench_e2e.json             # full sweep, CUDA
    python benchmarks/bench_e2e.py --quick --out results/bench_e2e_quick.json
    python benchmarks/bench_e2e.py --out results/bench_e2e.json --resume --time-budget-s 480  # repeat until done
    python benchmarks/bench_e2e.py --device cpu --quick --out /tmp/e2e.json    # CPU smoke run

Needs torch >= 2.11 and this package installed (pip install -e .); no network, no
transformers.
"""
import argparse
import contextlib
import functools
import gc
import json
import pathlib
import platform
import statistics
import sys
import time

import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from sophia_h import GPT, SophiaH, hutchinson_step, rademacher_like  # noqa: E402  (the examples' nanoGPT, Sophia-H)
from run_record import run_record  # noqa: E402  (benchmarks/, the script's folder)

IMPLS = ("math", "eager", "stock", "flashbob", "flashbob_cudagraphs")
FIRST_ORDER_ONLY = ("eager", "stock")
WORKLOADS = ("first_order", "sophia_hessian", "sophia_plain", "maml_outer")
FIRST_ORDER_WORKLOADS = ("first_order", "sophia_plain")
GIB = 2 ** 30
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def flashbob_backend():
    """The backend callable; from the installed package, with a clear message otherwise."""
    try:
        from bob_compile.backend import flashbob
    except ImportError as error:
        sys.exit(f"bench_e2e: cannot import bob_compile.backend ({error}); run `pip install -e .` "
                 "in the repository first")
    return flashbob


# ----------------------------------------------------------------------------- the steps
def make_step(workload, model, params, batch, args, generator):
    """One full training step of `workload`, as a closure over its model and optimizer."""
    device = params[0].device
    autocast = torch.autocast(device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "float32")
    x, y, x_query, y_query = batch

    def apply(optimizer, grads):
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()

    if workload == "first_order":
        def first_order():
            with autocast:
                loss = model(x, y)
            torch.autograd.grad(loss, params)
        return first_order

    if workload in ("sophia_hessian", "sophia_plain"):
        optimizer = SophiaH(params, lr=6e-4)

        def sophia_hessian():
            with autocast:
                _, grads, h_hat, _ = hutchinson_step(model, params, x, y, rademacher_like(params, generator))
            optimizer.update_hessian(h_hat)
            apply(optimizer, grads)

        def sophia_plain():
            with autocast:
                loss = model(x, y)
            apply(optimizer, torch.autograd.grad(loss, params))
        return sophia_hessian if workload == "sophia_hessian" else sophia_plain

    optimizer = torch.optim.Adam(params, lr=1e-4)

    def maml_outer():
        with autocast:
            # named_parameters of a compiled model carry its "_orig_mod." prefix, which is
            # what functional_call on that compiled model expects; tied weights stay tied.
            named = dict(model.named_parameters())
            support_loss = functional_call(model, named, (x, y))
            grads = torch.autograd.grad(support_loss, list(named.values()), create_graph=True)
            fast = {name: p - args.inner_lr * g for (name, p), g in zip(named.items(), grads)}
            query_loss = functional_call(model, fast, (x_query, y_query))
        apply(optimizer, torch.autograd.grad(query_loss, params))
    return maml_outer


# ----------------------------------------------------------------------------- measuring
class Clock:
    """CUDA events on CUDA (after a synchronize); perf_counter on CPU (smoke runs only)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time_ms(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)


def compile_flashbob(model, impl):
    mode = "reduce-overhead" if impl == "flashbob_cudagraphs" else None
    return torch.compile(model, backend=flashbob_backend(), dynamic=False, mode=mode)


def build(impl, seq_len, args, device):
    """A fresh model (the same initial weights for every implementation) and how to call it."""
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = GPT(args.vocab_size, seq_len, args.n_layer, args.n_head, args.n_embd,
                    sdpa=args.attention == "sdpa")
    params = list(model.parameters())
    torch._dynamo.reset()  # no recompiles across rows: each row compiles its own graphs
    if impl.startswith("flashbob"):
        _flashbob_counters(clear=True)
        return compile_flashbob(model, impl), params
    if impl == "stock":
        return torch.compile(model, dynamic=False), params
    return model, params


def make_batch(seq_len, args, device):
    generator = torch.Generator(device=device).manual_seed(args.seed + seq_len)

    def tokens():
        return torch.randint(args.vocab_size, (args.batch_size, seq_len), device=device, generator=generator)
    return tokens(), tokens(), tokens(), tokens()  # x, y, x_query, y_query


def hvp_probe(model, params, batch, args):
    """∇²L z for a fixed z at the initial weights, on the host (for the accuracy column)."""
    generator = torch.Generator(device=params[0].device).manual_seed(args.seed)
    zs = rademacher_like(params, generator)
    with torch.autocast(params[0].device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "float32"):
        hvps = hutchinson_step(model, params, batch[0], batch[1], zs)[3]
    return [h.detach().float().cpu() for h in hvps]


def measure(impl, workload, seq_len, args, device, want_probe):
    """One row: median step time and peak memory of `workload` by `impl` at `seq_len`."""
    model, params = build(impl, seq_len, args, device)
    batch = make_batch(seq_len, args, device)
    clock = Clock(device)
    probes = []
    with sdpa_kernel(SDPBackend.MATH) if impl == "math" else contextlib.nullcontext():
        step = make_step(workload, model, params, batch, args,
                         torch.Generator(device=device).manual_seed(args.seed + 1))
        # The first call compiles (flashbob); with a probe, the probe is that first call and
        # the step still runs once untimed before the timed ones.
        if want_probe:
            first_ms = clock.time_ms(lambda: probes.append(hvp_probe(model, params, batch, args)))
            step()
        else:
            first_ms = clock.time_ms(step)
        for _ in range(args.warmup - 1):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = [clock.time_ms(step) for _ in range(args.reps)]
    peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None
    row = dict(status="ok", median_ms=statistics.median(times), times_ms=times, first_call_ms=first_ms,
               peak_mem_gib=peak)
    if impl.startswith("flashbob"):
        row["flashbob_counters"] = _flashbob_counters()
    return row, (probes[0] if probes else None)


def _flashbob_counters(clear=False):
    """What flashbob did in this row: attention sites replaced/skipped, graphs, routes."""
    from torch._dynamo.utils import counters
    if clear:
        counters["flashbob"].clear()
    return dict(counters["flashbob"])


def _is_oom(error):
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def _free_memory(device):
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rel_err(got, ref):
    num = sum(((g - r).double().norm() ** 2).item() for g, r in zip(got, ref)) ** 0.5
    den = sum((r.double().norm() ** 2).item() for r in ref) ** 0.5
    return num / max(den, 1e-30)


# ----------------------------------------------------------------------------- MAML over tasks
MAML_IMPLS = ("math", "flashbob", "flashbob_cudagraphs", "flashbob_torchopt")


def maml_meta_gradient(impl, model, params, tasks, args):
    """One MAML meta-gradient: per task, one inner SGD step on the support sequence (with
    create_graph=True), then the query loss's gradient w.r.t. the initial weights; summed."""
    meta = [torch.zeros_like(p) for p in params]
    for x, y, x_query, y_query in tasks:
        if impl == "flashbob_torchopt":   # torchopt's differentiable SGD over functional_call
            import torchopt
            names, values = zip(*model.named_parameters())
            inner = torchopt.FuncOptimizer(torchopt.sgd(lr=args.inner_lr))
            fast = inner.step(functional_call(model, dict(zip(names, values)), (x, y)), values)
            query_loss = functional_call(model, dict(zip(names, fast)), (x_query, y_query))
        else:
            named = dict(model.named_parameters())
            grads = torch.autograd.grad(functional_call(model, named, (x, y)), list(named.values()),
                                        create_graph=True)
            fast = {name: p - args.inner_lr * g for (name, p), g in zip(named.items(), grads)}
            query_loss = functional_call(model, fast, (x_query, y_query))
        for m, g in zip(meta, torch.autograd.grad(query_loss, params)):
            m += g
    return meta


def maml_sweep(args, device):
    rows = []
    autocast = torch.autocast(device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "float32")
    for config in args.maml_tasks:
        seq_len, num_tasks = (int(v) for v in config.split("x"))
        for impl in args.maml_impls:
            row = dict(workload="maml_tasks", impl=impl, seq_len=seq_len, tasks=num_tasks)
            try:
                torch.manual_seed(args.seed)
                with torch.device(device):
                    base = GPT(args.maml_vocab, seq_len, args.maml_n_layer, args.maml_n_head,
                               args.maml_n_embd, sdpa=args.attention == "sdpa")
                params = list(base.parameters())
                torch._dynamo.reset()
                model = base if impl == "math" else compile_flashbob(base, impl)
                generator = torch.Generator(device=device).manual_seed(args.seed + seq_len)
                tasks = [tuple(torch.randint(args.maml_vocab, (1, seq_len), device=device,
                                             generator=generator) for _ in range(4))
                         for _ in range(num_tasks)]
                clock = Clock(device)
                with sdpa_kernel(SDPBackend.MATH) if impl == "math" else contextlib.nullcontext(), autocast:
                    step = functools.partial(maml_meta_gradient, impl, model, params, tasks, args)
                    first_ms = clock.time_ms(step)
                    for _ in range(args.warmup - 1):
                        step()
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    times = [clock.time_ms(step) for _ in range(args.reps)]
                row.update(status="ok", median_ms=statistics.median(times), times_ms=times,
                           first_call_ms=first_ms,
                           peak_mem_gib=torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None)
            except Exception as error:  # noqa: BLE001  (a row must never end the sweep)
                row.update(status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
            _free_memory(device)
            rows.append(row)
            print(_row_line(row), flush=True)
    return rows


def maml_table(rows):
    lines = ["\nmaml_tasks  (MAML meta-gradient, one inner step per task; ms per meta-gradient)"]
    by = {(r["impl"], r["seq_len"], r["tasks"]): r for r in rows}
    for seq_len, tasks in sorted({(r["seq_len"], r["tasks"]) for r in rows}):
        math_row = by.get(("math", seq_len, tasks))
        cells = []
        for impl in MAML_IMPLS:
            r = by.get((impl, seq_len, tasks))
            if r is None:
                continue
            if r["status"] != "ok":
                cells.append(f"{impl} {r['status']}")
                continue
            speedup = (f" ({math_row['median_ms'] / r['median_ms']:.2f}x math)"
                       if impl != "math" and math_row and math_row["status"] == "ok" else "")
            cells.append(f"{impl} {r['median_ms']:.1f}{speedup}")
        lines.append(f"T={seq_len:5d} x {tasks:3d} tasks | " + " | ".join(cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the sweep
def sweep(args, device, out_path, meta, previous_rows=()):
    """Measure every (N, workload, implementation) row; rows in `previous_rows` that ran (or
    failed) are kept as they are, so that a sweep cut short can be resumed."""
    done = {(r["workload"], r["impl"], r["seq_len"]): r for r in previous_rows
            if r["status"] in ("ok", "oom", "error")}
    rows, failed_at, probes = [], {}, {}
    start = time.monotonic()
    for seq_len in args.seq_lens:
        for workload in args.workloads:
            for impl in args.impls:
                row = dict(workload=workload, impl=impl, seq_len=seq_len, batch_size=args.batch_size)
                if (workload, impl, seq_len) in done:
                    row = done[workload, impl, seq_len]
                    if row["status"] != "ok":
                        failed_at[impl, workload] = f"{row['status']} at N={seq_len}"
                    rows.append(row)
                    print(_row_line(row) + "  [kept from --out]", flush=True)
                    continue
                if args.time_budget_s and time.monotonic() - start > args.time_budget_s:
                    failed_at.setdefault((impl, workload), f"time budget of {args.time_budget_s:.0f} s spent")
                if impl in FIRST_ORDER_ONLY and workload not in FIRST_ORDER_WORKLOADS:
                    continue  # no double backward: nothing to time
                if (impl, workload) in failed_at:
                    row.update(status=f"skipped: {failed_at[impl, workload]}")
                    rows.append(row)
                    print(_row_line(row), flush=True)
                    continue
                # The accuracy probe: once per N, on the Hessian step, where both run in this call.
                want_probe = workload == "sophia_hessian" and {"math", "flashbob"} <= set(args.impls) \
                    and ("math", workload) not in failed_at and (impl == "math" or "math" in probes)
                try:
                    result, probe = measure(impl, workload, seq_len, args, device, want_probe)
                    row.update(result)
                    if probe is not None:
                        probes[impl] = probe
                except Exception as error:  # noqa: BLE001  (a row must never end the sweep)
                    message = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}" if str(error) \
                        else type(error).__name__
                    if _is_oom(error):
                        row.update(status="oom", error=message)
                        failed_at[impl, workload] = f"oom at N={seq_len}"
                    else:
                        row.update(status="error", error=message)
                        failed_at[impl, workload] = f"error at N={seq_len}"
                    error = None  # drop the traceback (and the tensors its frames hold)
                _free_memory(device)
                if impl == "flashbob" and "math" in probes and "flashbob" in probes:
                    row["hvp_rel_err_vs_math"] = rel_err(probes["flashbob"], probes["math"])
                if workload == "sophia_hessian" and impl == args.impls[-1]:
                    probes.clear()
                rows.append(row)
                print(_row_line(row), flush=True)
                out_path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return rows


def _row_line(row):
    head = f"N={row['seq_len']:6d} {row['workload']:15s} {row['impl']:9s}" + (
        f" x{row['tasks']} tasks" if "tasks" in row else "")
    if row["status"] != "ok":
        return f"{head} {row['status']}" + (f" ({row['error']})" if row.get("error") else "")
    peak = f"{row['peak_mem_gib']:7.2f} GiB" if row["peak_mem_gib"] is not None else "   n/a"
    err = f"  HVP rel err vs math {row['hvp_rel_err_vs_math']:.1e}" if "hvp_rel_err_vs_math" in row else ""
    return (f"{head} median {row['median_ms']:9.1f} ms  peak {peak}  "
            f"(first call, with compilation: {row['first_call_ms'] / 1e3:.1f} s){err}")


def table(rows, args):
    """Per workload: math vs flashbob time and memory per N; plus Sophia-H amortised over k."""
    by = {(r["workload"], r["impl"], r["seq_len"]): r for r in rows}

    def cell_ms(r):
        return f"{r['median_ms']:.1f}" if r and r["status"] == "ok" else (r["status"].split(":")[0] if r else "-")

    def cell_gib(r):
        if r and r["status"] == "ok":
            return f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "n/a"
        return r["status"].split(":")[0] if r else "-"

    def ratio(a, b, key):
        if a and b and a["status"] == b["status"] == "ok" and a[key] and b[key]:
            return f"{a[key] / b[key]:.2f}x"
        return "-"

    lines = []
    for workload in args.workloads:
        impls = [i for i in args.impls if i not in FIRST_ORDER_ONLY or workload in FIRST_ORDER_WORKLOADS]
        others = [i for i in impls if i != "flashbob"]
        lines.append(f"\n{workload}  (B={args.batch_size}, {args.dtype}, {args.attention} attention)")
        lines.append(f"{'N':>7} | " + " ".join(f"{i + ' ms':>11}" for i in impls) + " | "
                     + " ".join(f"{'vs ' + i:>9}" for i in others) + " | "
                     + " ".join(f"{i + ' GiB':>12}" for i in impls) + " | HVP rel err")
        for n in args.seq_lens:
            r = {i: by.get((workload, i, n)) for i in impls}
            f = r.get("flashbob")
            err = f"{f['hvp_rel_err_vs_math']:.1e}" if f and "hvp_rel_err_vs_math" in f else ""
            lines.append(f"{n:>7} | " + " ".join(f"{cell_ms(r[i]):>11}" for i in impls) + " | "
                         + " ".join(f"{ratio(r[i], f, 'median_ms'):>9}" for i in others) + " | "
                         + " ".join(f"{cell_gib(r[i]):>12}" for i in impls) + f" | {err}")
    if {"sophia_hessian", "sophia_plain"} <= set(args.workloads):
        k = args.hess_interval
        lines.append(f"\nSophia-H training step, Hessian estimate every k={k} steps: "
                     f"(Hessian step + {k - 1} plain steps) / {k}, in ms")
        lines.append(f"{'N':>7} | {'math':>9} {'flashbob':>9} {'speedup':>8}")
        for n in args.seq_lens:
            amortised = {}
            for impl in IMPLS:
                h, p = by.get(("sophia_hessian", impl, n)), by.get(("sophia_plain", impl, n))
                if h and p and h["status"] == p["status"] == "ok":
                    amortised[impl] = (h["median_ms"] + (k - 1) * p["median_ms"]) / k
            m, f = amortised.get("math"), amortised.get("flashbob")
            lines.append(f"{n:>7} | {m and f'{m:.1f}' or '-':>9} {f and f'{f:.1f}' or '-':>9} "
                         f"{(m and f) and f'{m / f:.2f}x' or '-':>8}")
    return "\n".join(lines)


def metadata(args, device):
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(
        benchmark="bench_e2e", **run_record(),
        torch=torch.__version__, triton=triton_version, python=platform.python_version(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        args=vars(args))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write (a directory gets bench_e2e.json)")
    p.add_argument("--quick", action="store_true",
                   help="fast subset: N in {1024, 2048}, 1 warm-up step, 3 timed steps; with "
                        "--device cpu a tiny float32 model (2 layers, width 32, N in {32, 64})")
    p.add_argument("--seq-lens", type=int, nargs="+",
                   default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--workloads", nargs="*", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=50304, help="GPT-2's 50257, padded as in nanoGPT")
    p.add_argument("--attention", choices=["sdpa", "handwritten"], default="sdpa",
                   help="nanoGPT's SDPA branch, or its hand-written attention (which keeps a "
                        "float N x N causal-mask buffer per layer, as nanoGPT does)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="autocast dtype")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    p.add_argument("--reps", type=int, default=5, help="timed steps; the median is reported")
    p.add_argument("--inner-lr", type=float, default=1e-3, help="MAML inner SGD step size")
    p.add_argument("--hess-interval", type=int, default=10,
                   help="k of the amortised Sophia-H table (Sophia's default is 10)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new row after this many seconds (rows left say so); for "
                        "machines that stop a command after a fixed time")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows already measured in --out (same model and dtype) and "
                        "measure only the others; with --time-budget-s, a long sweep runs as "
                        "several shorter commands")
    p.add_argument("--maml-tasks", nargs="*", default=[], metavar="TxTASKS",
                   help="MAML meta-learning rows, e.g. 128x32 256x8 (sequence length x tasks)")
    p.add_argument("--maml-impls", nargs="+", choices=MAML_IMPLS, default=list(MAML_IMPLS))
    p.add_argument("--maml-n-layer", type=int, default=4)
    p.add_argument("--maml-n-head", type=int, default=4)
    p.add_argument("--maml-n-embd", type=int, default=256)
    p.add_argument("--maml-vocab", type=int, default=512)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only for a smoke run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        tiny = args.device == "cpu"
        quick = dict(seq_lens=[32, 64] if tiny else [1024, 2048], warmup=1, reps=3)
        if tiny:
            quick.update(n_layer=2, n_head=2, n_embd=32, vocab_size=256, dtype="float32",
                         maml_n_layer=1, maml_n_head=2, maml_n_embd=32, maml_vocab=64)
        for key, value in quick.items():   # what the command line set explicitly wins
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    args.warmup = max(args.warmup, 1)
    args.impls = [i for i in IMPLS if i in args.impls]  # math first: the probe compares against it
    args.seq_lens = sorted(args.seq_lens)
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_e2e: no CUDA device (use --device cpu for a smoke run)")
    if "flashbob" in args.impls:
        flashbob_backend()  # fail now, not after the math rows
    out_path = pathlib.Path(args.out)
    if out_path.is_dir():
        out_path = out_path / "bench_e2e.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    meta = metadata(args, device)
    previous_rows = []
    if args.resume and out_path.exists():
        previous = json.loads(out_path.read_text())
        same = ("batch_size", "n_layer", "n_head", "n_embd", "vocab_size", "attention", "dtype")
        changed = [k for k in same if previous["meta"]["args"].get(k) != getattr(args, k)]
        if changed:
            sys.exit(f"bench_e2e: --resume: {out_path} was measured with other {', '.join(changed)}")
        previous_rows = previous["rows"]
    print(f"bench_e2e: torch {meta['torch']}, triton {meta['triton']}, {meta['device']}; "
          f"GPT {args.n_layer}L/{args.n_head}H/{args.n_embd}, B={args.batch_size}, {args.dtype}, "
          f"{args.attention} attention; N in {args.seq_lens}", flush=True)
    rows = sweep(args, device, out_path, meta, previous_rows) if args.workloads else []
    maml_rows = maml_sweep(args, device) if args.maml_tasks else []
    out_path.write_text(json.dumps(dict(meta=meta, rows=rows + maml_rows), indent=1))
    print(table(rows, args))
    if maml_rows:
        print(maml_table(maml_rows))
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
