"""Host (CPU) cost per call of the attention op on a problem too small to keep the GPU busy.

Issue 10's table as a benchmark. B=1, H=4, N=128, d=64, bf16 on CUDA by default: the GPU
work per call is a few microseconds, so the wall time per call is what Python, the
dispatcher, autograd and the kernel launches cost on the host. Rows:

    forward (no grad)        native SDPA                  | bob_compile.attention
    forward + backward       SDPA + autograd.grad         | bob_compile.attention + autograd.grad
    second order             SDPA, SDPBackend.MATH:       | bob_compile.attention:
                             o, grad(o, (q,k,v), dO, create_graph=True), then
                             grad((dq,dk,dv), (q,k,v,dO), (gq,gk,gv))

(native fused SDPA has no double backward; the math backend is the reference row there.)
Each row: `--calls` calls back to back after warm-up, one synchronize at the end, wall time
divided by the calls; the median of `--repeats` such runs is reported (all runs are in the
JSON). The runs of all rows are interleaved, one round of every row per repeat. Targets of issue 10 (H200): forward <= 2x native, forward+backward <= 1.5x native,
second order <= 600 us.

On a machine without a GPU, `--device cpu` (the default there) runs the same rows in float32
through the blockwise path, as a smoke test of the script and a measure of the Python layers.

    python benchmarks/bench_host_overhead.py                       # table + JSON
    python benchmarks/bench_host_overhead.py --profile             # + top host-time entries
    python benchmarks/bench_host_overhead.py --native-backends     # + native per backend
    python benchmarks/bench_host_overhead.py --variants BOB_COMPILE_NATIVE_BACKEND=flash
    python benchmarks/bench_host_overhead.py --stub-kernels    # + Python layers only
    python benchmarks/bench_host_overhead.py --phases          # + the step's phases, floors

On CUDA a "floor" row times a `torch.autograd.Function` that calls PyTorch's cuDNN forward
and backward and does nothing else: what any Python-level autograd node costs on this host
(the autograd engine then runs the backward on its device thread, which must take the GIL).

`--stub-kernels` adds bob_compile rows whose kernels are replaced by functions that only
allocate their outputs: what the Python layers (autograd Functions, op boundary, layout,
kernel selection) cost without any kernel launch or cuDNN call.

`--phases` times the op's second-order step by phase (the forward, the create_graph grad,
the second grad; host time, no synchronize between them), with the backward on the engine's
device thread and on the calling thread, beside floors of the autograd engine on this host:
a grad of `x * 2`, and the second order of `x.exp()` and of a Python autograd.Function that
only clones.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import bob_compile
from bob_compile.kernels import settings as kernel_settings
from run_record import run_record  # noqa: E402  (benchmarks/, the script's folder)

native_sdpa = None     # bob_compile.kernels.native_sdpa, for the floor row (CUDA)


# --------------------------------------------------------------------------------------
# What one call of each row does
# --------------------------------------------------------------------------------------
class Problem:
    def __init__(self, device, dtype, B, H, N, d, causal):
        self.causal = causal

        def make(grad=False):
            return torch.randn(B, H, N, d, device=device, dtype=dtype).requires_grad_(grad)
        self.q, self.k, self.v = make(), make(), make()
        self.qg, self.kg, self.vg, self.dog = make(True), make(True), make(True), make(True)
        self.do = make()
        self.gq, self.gk, self.gv = make(), make(), make()

    # forward, no grad
    def native_forward(self):
        with torch.no_grad():
            return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=self.causal)

    def ours_forward(self):
        with torch.no_grad():
            return bob_compile.attention(self.q, self.k, self.v, is_causal=self.causal)

    # forward + backward
    def native_forward_backward(self):
        o = F.scaled_dot_product_attention(self.qg, self.kg, self.vg, is_causal=self.causal)
        return torch.autograd.grad(o, (self.qg, self.kg, self.vg), self.do)

    def ours_forward_backward(self):
        o = bob_compile.attention(self.qg, self.kg, self.vg, is_causal=self.causal)
        return torch.autograd.grad(o, (self.qg, self.kg, self.vg), self.do)

    # forward + grad(create_graph=True) + grad
    def _second_order(self, attention):
        q, k, v, do = self.qg, self.kg, self.vg, self.dog
        o = attention(q, k, v, is_causal=self.causal)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        return torch.autograd.grad((dq, dk, dv), (q, k, v, do), (self.gq, self.gk, self.gv))

    def math_second_order(self):
        with sdpa_kernel(SDPBackend.MATH):
            return self._second_order(F.scaled_dot_product_attention)

    def ours_second_order(self):
        return self._second_order(bob_compile.attention)


class CudnnFunction(torch.autograd.Function):
    """The least a Python autograd.Function costs: PyTorch's cuDNN forward and backward,
    called exactly as the op's implementation calls them, and nothing else (one output,
    no checks, no double backward). The floor under the op's forward + backward row.
    (native_sdpa is imported by run_rows before the row is timed: an import
    statement here would add its own cost to every call.)"""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        scale = q.shape[-1] ** -0.5
        o, lse = native_sdpa.forward("cudnn", q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.causal = scale, causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*native_sdpa.backward("cudnn", q, k, v, o, lse, do, ctx.scale,
                                                   ctx.causal), None)


def floor_forward_backward(problem):
    o = CudnnFunction.apply(problem.qg, problem.kg, problem.vg, problem.causal)
    return torch.autograd.grad(o, (problem.qg, problem.kg, problem.vg), problem.do)


ROWS = [  # (row, provider, method)
    ("forward (no grad)", "native SDPA", "native_forward"),
    ("forward (no grad)", "bob_compile", "ours_forward"),
    ("forward + backward", "native SDPA", "native_forward_backward"),
    ("forward + backward", "bob_compile", "ours_forward_backward"),
    ("second order", "SDPA math", "math_second_order"),
    ("second order", "bob_compile", "ours_second_order"),
]
# issue 10: bob_compile against the native row (ratio) or an absolute bound (us, H200)
TARGETS = {"forward (no grad)": ("ratio", 2.0), "forward + backward": ("ratio", 1.5),
           "second order": ("us", 600.0)}
NATIVE_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------
def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(fn, device, calls, repeats, warmup):
    """Median (and all) of `repeats` runs of wall microseconds per call, `calls` calls per
    run, synchronized once at the end of each run."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    runs = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs), runs


class StubKernels:
    """The kernel contract (bob_compile/kernels/__init__.py) with every function returning fresh
    uninitialized outputs: isolates the host cost of everything around the kernels."""

    @staticmethod
    def _like(*tensors):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)

    @staticmethod
    def forward(q, k, v, params):
        B, H, L, _ = q.shape
        return (q.new_empty((B, H, L, v.shape[-1])),
                q.new_empty((B, H, L), dtype=torch.float32))

    @staticmethod
    def forward_output(q, k, v, params):
        return StubKernels.forward(q, k, v, params)[0]

    @staticmethod
    def backward(q, k, v, o, lse, do, dlse, params):
        return StubKernels._like(q, k, v)

    @staticmethod
    def bob(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, params):
        return StubKernels._like(q, k, v, o, lse, do, lse)

    @staticmethod
    def bob_folded(q, k, v, o, lse, do, dlse, gdq, gdk, gdv, dq, params):
        return StubKernels._like(q, k, v, do, lse)


@contextlib.contextmanager
def stub_kernels():
    from bob_compile import kernels
    select, call_path = kernels.select, kernels.call_path
    kernels.select = lambda q, k, v: StubKernels
    kernels.call_path = lambda *args: None     # no CallPath: it would run the real kernels
    try:
        yield
    finally:
        kernels.select, kernels.call_path = select, call_path


@contextlib.contextmanager
def environment(assignments):
    """Set BOB_COMPILE_* variables for a block and make the kernels read them again."""
    saved = {name: os.environ.get(name) for name in assignments}
    os.environ.update(assignments)
    kernel_settings.reload()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        kernel_settings.reload()


def parse_variant(text):
    assignments = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if not name.startswith("BOB_COMPILE_") or not _:
            raise SystemExit(f"--variants: expected BOB_COMPILE_NAME=VALUE[,...], got {text!r}")
        assignments[name] = value
    return assignments


def run_rows(problem, args, device):
    """Every row's runs, interleaved: each of the --repeats rounds times every row once, so
    that a host's drift (clocks, the engine thread's wake-ups) reaches all rows alike."""
    entries = []

    def add(row, provider, fn, note="", context=contextlib.nullcontext):
        entries.append(dict(row=row, provider=provider, fn=fn, note=note, context=context))

    for row, provider, method in ROWS:
        add(row, provider, getattr(problem, method))
    if device.type == "cuda" and problem.q.dtype in (torch.float16, torch.bfloat16):
        global native_sdpa
        from bob_compile.kernels import native_sdpa
        add("forward + backward", "autograd.Function around cuDNN (floor)",
            lambda: floor_forward_backward(problem),
            note="a Python autograd.Function with PyTorch's cuDNN calls and nothing else")
    if args.native_backends and device.type == "cuda":
        for name, backend in NATIVE_BACKENDS.items():
            for row, method in (("forward (no grad)", "native_forward"),
                                ("forward + backward", "native_forward_backward")):
                add(row, f"native SDPA [{name}]", getattr(problem, method),
                    context=lambda backend=backend: sdpa_kernel(backend))
    for text in args.variants:
        for row, provider, method in ROWS:
            if provider == "bob_compile":
                add(row, f"bob_compile [{text}]", getattr(problem, method),
                    context=lambda text=text: environment(parse_variant(text)))
    if args.calling_thread_backward:
        # PyTorch runs a CUDA backward on its device thread, and a Python autograd node there
        # must take the GIL; torch.autograd.set_multithreading_enabled(False) (thread-local)
        # runs the backward on the calling thread instead
        for row, provider, method in ROWS:
            if row != "forward (no grad)":
                add(row, f"{provider} [backward on the calling thread]", getattr(problem, method),
                    note="torch.autograd.set_multithreading_enabled(False)",
                    context=lambda: torch.autograd.set_multithreading_enabled(False))
    if args.stub_kernels:
        for row, provider, method in ROWS:
            if provider == "bob_compile":
                add(row, "bob_compile [stub kernels]", getattr(problem, method),
                    note="kernels replaced by output allocation", context=stub_kernels)

    for e in entries:
        e["runs"] = []
        with e["context"]():
            try:
                time_per_call(e["fn"], device, 1, 1, args.warmup)
            except RuntimeError as error:  # e.g. a native backend that does not support this
                print(f"  {e['row']:20s} {e['provider']:44s} unavailable: "
                      f"{str(error).splitlines()[0][:80]}")
                e["runs"] = None
    live = [e for e in entries if e["runs"] is not None]
    for _ in range(args.repeats):
        for e in live:
            with e["context"]():
                e["runs"] += time_per_call(e["fn"], device, args.calls, 1, 3)[1]
    rows = []
    for e in live:
        us = statistics.median(e["runs"])
        rows.append(dict(row=e["row"], provider=e["provider"], us=us, runs_us=e["runs"],
                         note=e["note"]))
        print(f"  {e['row']:20s} {e['provider']:44s} {us:10.1f} us", flush=True)
    return rows


def print_table(rows):
    native = {r["row"]: r["us"] for r in rows if r["provider"] in ("native SDPA", "SDPA math")}
    width = max(28, *(len(r["provider"]) for r in rows))
    print(f"\n{'':20s} {'provider':{width}s} {'us/call':>10s} {'vs native':>10s} {'target':>14s}")
    for r in rows:
        ratio = r["us"] / native[r["row"]] if r["row"] in native else float("nan")
        r["ratio_to_native"] = ratio
        target = ""
        if r["provider"].startswith("bob_compile"):
            kind, bound = TARGETS[r["row"]]
            target = f"<= {bound:g}x native" if kind == "ratio" else f"<= {bound:g} us"
        print(f"{r['row']:20s} {r['provider']:{width}s} {r['us']:10.1f} {ratio:9.2f}x "
              f"{target:>14s}")


# --------------------------------------------------------------------------------------
# Profiles of the second-order step
# --------------------------------------------------------------------------------------
def profile_second_order(problem, device, steps, top):
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(3):
        problem.ours_second_order()
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            problem.ours_second_order()
        synchronize(device)
    print(f"\nTop host-time entries, {steps} second-order steps (torch.profiler, CPU self time; "
          f"divide by {steps} for per step):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def cprofile_second_order(problem, device, steps, top):
    import cProfile
    import pstats
    for _ in range(3):
        problem.ours_second_order()
    synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        problem.ours_second_order()
    synchronize(device)
    profiler.disable()
    print(f"\nTop Python functions, {steps} second-order steps (cProfile, by own time):")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)


# --------------------------------------------------------------------------------------
# Phases of the second-order step, and the autograd engine's floors
# --------------------------------------------------------------------------------------
class _Clone(torch.autograd.Function):
    """x.clone() whose backward is itself: a Python node at every order, doing nothing."""
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return _Clone.apply(g)


def phases(problem, device, steps, repeats):
    """{name: median us per step}: the op's second-order step by phase, and the floors."""
    q, k, v, do = problem.qg, problem.kg, problem.vg, problem.dog
    cot = (problem.gq, problem.gk, problem.gv)
    x = torch.randn(16, device=device, requires_grad=True)
    x_cot = torch.randn(16, device=device, requires_grad=True)
    floors = {
        "grad of x * 2": lambda: torch.autograd.grad(x * 2, x, x_cot),
        "second order of x.exp()": lambda: torch.autograd.grad(
            torch.autograd.grad(x.exp(), x, x_cot, create_graph=True), (x, x_cot), x_cot),
        "second order of a Python Function (clone)": lambda: torch.autograd.grad(
            torch.autograd.grad(_Clone.apply(x), x, x_cot, create_graph=True), x_cot, x_cot),
    }
    results = {}
    for thread, multithreading in (("device thread", True), ("calling thread", False)):
        with torch.autograd.set_multithreading_enabled(multithreading):
            runs = {name: [] for name in ("forward", "create_graph grad", "second grad")}
            for _ in range(repeats):
                total = dict.fromkeys(runs, 0.0)
                for i in range(steps + 10):
                    if i == 10:
                        synchronize(device)
                        total = dict.fromkeys(runs, 0.0)
                    t0 = time.perf_counter()
                    o = bob_compile.attention(q, k, v, is_causal=problem.causal)
                    t1 = time.perf_counter()
                    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
                    t2 = time.perf_counter()
                    torch.autograd.grad(grads, (q, k, v, do), cot)
                    t3 = time.perf_counter()
                    total["forward"] += t1 - t0
                    total["create_graph grad"] += t2 - t1
                    total["second grad"] += t3 - t2
                for name in runs:
                    runs[name].append(total[name] / steps * 1e6)
            for name, values in runs.items():
                results[f"bob_compile step: {name} [{thread}]"] = statistics.median(values)
            for name, fn in floors.items():
                results[f"{name} [{thread}]"] = statistics.median(
                    time_per_call(fn, device, steps, repeats, 10)[1])
    print("\nSecond-order step by phase (host us per step, no synchronize between phases), "
          "and floors of the autograd engine:")
    for name, us in results.items():
        print(f"  {name:68s} {us:8.1f} us")
    return results


# --------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed run")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per row (median)")
    ap.add_argument("--warmup", type=int, default=20,
                    help="untimed calls first (the first ones compile and tune kernels)")
    ap.add_argument("--native-backends", action="store_true",
                    help="CUDA: also native SDPA forced to each fused backend (cudnn, flash, "
                         "efficient), to see what each costs on the host (these rows include "
                         "the sdpa_kernel context manager's own few microseconds)")
    ap.add_argument("--variants", nargs="+", default=[],
                    help="extra bob_compile rows with BOB_COMPILE_* settings, e.g. "
                         "BOB_COMPILE_NATIVE_BACKEND=flash or BOB_COMPILE_NATIVE_BACKEND=none")
    ap.add_argument("--calling-thread-backward", action="store_true",
                    help="add rows with torch.autograd.set_multithreading_enabled(False): the "
                         "backward on the calling thread, not PyTorch's device thread")
    ap.add_argument("--stub-kernels", action="store_true",
                    help="also bob_compile rows with every kernel replaced by the allocation "
                         "of its outputs (the Python layers' own cost)")
    ap.add_argument("--phases", action="store_true",
                    help="also time the op's second-order step by phase, and the autograd "
                         "engine's floors on this host (see above)")
    ap.add_argument("--profile", action="store_true",
                    help="print the top host-time entries (torch.profiler, CPU self time) of "
                         "the second-order step")
    ap.add_argument("--cprofile", action="store_true",
                    help="also print the top Python functions of the step (cProfile)")
    ap.add_argument("--profile-steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default 1 on CPU: tiny problems gain nothing "
                         "from more, and spinning threads make the timings noisy)")
    ap.add_argument("--out", default="bench_results",
                    help="a folder (bench_host_overhead<tag>.json inside) or a .json path")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(0)
    problem = Problem(device, dtype, args.batch, args.heads, args.n, args.d, args.causal)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: B={args.batch} H={args.heads} N={args.n} d={args.d} {dtype} "
          f"causal={args.causal}; {args.calls} calls per run, median of {args.repeats} runs")

    # the op's C++ node (CUDA) builds in the background on first use: have it ready first
    start = time.perf_counter()
    node_ready = device.type == "cuda" and bob_compile.eager.node.extension(wait=True) is not None
    node_build_s = time.perf_counter() - start
    if device.type == "cuda":
        print(f"C++ node {'ready' if node_ready else 'NOT built'} in {node_build_s:.1f} s "
              f"(compare: --variants BOB_COMPILE_CPP_NODE=off)")

    rows = run_rows(problem, args, device)
    print_table(rows)
    step_phases = phases(problem, device, args.calls, args.repeats) if args.phases else None

    meta = dict(**run_record(), device=name, torch=torch.__version__, dtype=str(dtype), B=args.batch,
                H=args.heads, N=args.n, d=args.d, causal=args.causal, calls=args.calls,
                repeats=args.repeats, warmup=args.warmup, threads=torch.get_num_threads(),
                python=sys.version.split()[0], cpp_node=node_ready,
                cpp_node_build_or_load_s=node_build_s,
                env={k: v for k, v in os.environ.items() if k.startswith("BOB_COMPILE")},
                targets={k: dict(kind=v[0], bound=v[1]) for k, v in TARGETS.items()})
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    path = args.out if args.out.endswith(".json") else os.path.join(
        args.out, f"bench_host_overhead{args.tag}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows, phases_us=step_phases), f, indent=1)
    print(f"\nwrote {path}")

    if args.profile:
        profile_second_order(problem, device, args.profile_steps, args.top)
    if args.cprofile:
        cprofile_second_order(problem, device, args.profile_steps, args.top)


if __name__ == "__main__":
    main()
