"""Where forward over reverse waits for the host: host issue time, CUDA-event time, and one
step's timeline (kernel starts against launch calls).

For N = 128 and 16K (B = 1, H = 12, d = 64, causal, bf16): the Hessian-vector product by
`torch.func.jvp(torch.func.grad(f))` through the op, and reverse over reverse, each timed
as single calls: the host's time to issue the call (no synchronization) and the CUDA-event
time of the call. Then, at 16K: whether anything synchronizes (torch.cuda sync debug
mode), a cProfile of 20 steps (host functions by own time), and one step under the
profiler: each kernel's start and duration, each launch call's time, from the profiler's
first event.

    python benchmarks/host_timeline_forward_over_reverse.py
"""
import cProfile
import io
import pstats
import statistics
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import bob_compile


def steps(n):
    torch.manual_seed(0)
    q, k, v, do, gq, gk, gv = (torch.randn(1, 12, n, 64, device="cuda", dtype=torch.bfloat16)
                               for _ in range(7))

    def loss(q, k, v):
        return (bob_compile.attention(q, k, v, is_causal=True) * do).sum()

    def forward_over_reverse():
        return torch.func.jvp(torch.func.grad(loss, argnums=(0, 1, 2)), (q, k, v), (gq, gk, gv))

    def reverse_over_reverse():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = bob_compile.attention(qq, kk, vv, is_causal=True)
        g = torch.autograd.grad(o, (qq, kk, vv), do, create_graph=True)
        return torch.autograd.grad(g, (qq, kk, vv), (gq, gk, gv))
    return forward_over_reverse, reverse_over_reverse


def issue_and_event_ms(fn, reps=20):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    issue, total = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        issue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        total.append(start.elapsed_time(end))
    return statistics.median(issue), statistics.median(total)


def timeline(fn):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    origin = min(e.time_range.start for e in events)
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
           and e.time_range.elapsed_us() > 20]
    for e in sorted(gpu, key=lambda e: e.time_range.start):
        print(f"  kernel {e.name[:40]:40s} starts {(e.time_range.start - origin) / 1e3:7.2f} ms, "
              f"runs {e.time_range.elapsed_us() / 1e3:6.2f} ms")
    launches = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
                and ("LaunchKernel" in e.name or "cuLaunch" in e.name)]
    for e in sorted(launches, key=lambda e: e.time_range.start):
        print(f"  launch call at {(e.time_range.start - origin) / 1e3:7.2f} ms  {e.name[:40]}")


def main():
    for n in (128, 16384):
        forward_over_reverse, reverse_over_reverse = steps(n)
        for name, fn in (("forward over reverse", forward_over_reverse),
                         ("reverse over reverse", reverse_over_reverse)):
            issue, total = issue_and_event_ms(fn)
            print(f"N={n} {name}: host issue {issue:.2f} ms, events {total:.2f} ms")
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward_over_reverse()
    torch.cuda.set_sync_debug_mode(0)
    print("synchronizing calls:", [str(w.message)[:120] for w in caught
                                   if "Synchronization debug mode" not in str(w.message)])
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        forward_over_reverse()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())
    timeline(forward_over_reverse)


if __name__ == "__main__":
    main()
