"""Small helpers shared by the examples: arguments, timing, peak memory, numeric checks.

Each example stays readable on its own; this file only holds what would otherwise be
copied four times.
"""
import argparse
import contextlib
import math
import resource
import statistics
import sys
import time

import torch


def parser(description, **defaults):
    """An ArgumentParser with the flags every example has; `defaults` sets tiny CPU values."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="training precision; bfloat16 runs under torch.autocast (the numeric "
                        "checks always run in float32)")
    p.add_argument("--backend", default="flashbob",
                   help="torch.compile backend for the run; 'flashbob' is this package")
    p.add_argument("--steps", type=int, default=defaults.pop("steps", 10), help="training steps")
    p.add_argument("--seed", type=int, default=0)
    for name, value in defaults.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    return p


def device_of(args):
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: no CUDA device is visible to torch {torch.__version__}")
    return device


def autocast(args, device):
    """bf16 autocast when asked for, else nothing: parameters and optimizer state stay fp32."""
    if args.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Wall time of each step (synchronised on CUDA). The first step also pays for whatever
    was not compiled yet (the examples' checks compile most graphs before training)."""

    def __init__(self, device):
        self.device = device
        self.times = []

    @contextlib.contextmanager
    def step(self):
        sync(self.device)
        start = time.perf_counter()
        yield
        sync(self.device)
        self.times.append(time.perf_counter() - start)

    @property
    def last_ms(self):
        return 1e3 * self.times[-1]

    def summary(self, what="step"):
        if not self.times:
            return f"{what}: none run"
        first = f"first {what} {1e3 * self.times[0]:.1f} ms (with any compilation still pending)"
        if len(self.times) == 1:
            return first
        rest = self.times[1:]
        return f"{first}; median of the other {len(rest)}: {1e3 * statistics.median(rest):.1f} ms"


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device):
    """torch.cuda.max_memory_allocated on CUDA; on CPU torch keeps no allocator statistics,
    so say so and give the process's peak resident size (which includes torch itself)."""
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB (max_memory_allocated)"
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return f"n/a on CPU (process peak RSS {rss_mib:.0f} MiB, torch included)"


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


def rel_err(got, ref):
    """||got - ref|| / ||ref|| over all tensors together (one number per check)."""
    got, ref = flat(got), flat(ref)
    return (got - ref).norm().item() / max(ref.norm().item(), 1e-30)


def check(name, got, ref, tol):
    """Print one line comparing `got` with the reference `ref`; True when within `tol`."""
    err = rel_err(got, ref)
    ok = math.isfinite(err) and err <= tol
    print(f"check {name}: relative error {err:.2e} (tolerance {tol:.0e}) {'OK' if ok else 'FAILED'}")
    return ok


def finish(ok):
    """Exit non-zero when a check failed, so that CI and scripts notice."""
    if ok:
        print("all checks passed")
        return 0
    print("CHECK FAILED", file=sys.stderr)
    return 1


def attention_replaced(backend):
    """Print what flashbob did so far in this process; True if it replaced attention.

    A graph that flashbob left untouched would match eager math attention trivially, so the
    numeric checks only mean something together with this one. flashbob mirrors its counters
    into torch._dynamo.utils.counters["flashbob"]; other backends replace nothing (True)."""
    if backend != "flashbob":
        return True
    from torch._dynamo.utils import counters
    c = counters["flashbob"]
    replaced = c["sdpa_replaced"] + c["handwritten_replaced"]
    skipped = c["sdpa_skipped"] + c["handwritten_skipped"]
    ok = replaced > 0 and c["fallback"] == 0
    print(f"check flashbob rewrote attention: {replaced} site(s) replaced, {skipped} skipped, "
          f"{c['graphs']} graph(s) compiled, {c['fallback']} fallback(s) {'OK' if ok else 'FAILED'}")
    return ok
