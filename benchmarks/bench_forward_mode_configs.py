"""Launch configs of the forward-mode kernels (attn_fwd_jvp, attn_bwd_jvp's row and column
passes), one kernel's configs forced one at a time through the user's step.

Forward over reverse (`torch.func.jvp(torch.func.grad(f))` through the op: issue 13's
<= 1.2x the reverse-over-reverse step) runs three forward-mode kernels. For each, every
config below is forced alone while the other two kernels keep the tuner's choice among
their lists (`bob_compile/kernels/triton_forward_mode.py`), decisions forgotten between
configs. Each row reports the step's CUDA-event median (host time included, so noisier)
and the forced kernel's own GPU time per step from the profiler; rounds are interleaved.
First, the step's GPU time by kernel, with the lists as they are, next to reverse over
reverse (`op_autograd`). B = 1, H = 12, bf16.

    python benchmarks/bench_forward_mode_configs.py --out results/ [--n 16384] [--d 64|128]
        [--causal both|yes|no] [--kernels rows columns] [--configs 32x128/8/3 ...]
"""
import os
import statistics
import sys

import torch

from bob_compile.kernels import triton_attention
from bob_compile.kernels import triton_forward_mode as forward_mode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import op_autograd, op_forward_over_reverse  # noqa: E402
from bench_masks import kernel_times_ms, median_ms, print_kernel_times  # noqa: E402
from bench_row_configs import (ab_arguments, causal_cases, forget_tuning, label,  # noqa: E402
                               write_results)


def configs(*tiles):
    return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in tiles]


# head dim -> candidates function -> (its kernel's name in the profiler, the configs to force).
# At d = 128 the operand tiles are twice as wide: fewer rows per program, and the configs
# with the fewest spills (benchmarks/kernel_resources.py) next to the rest.
SWEEPS = {
    64: {
        "forward_jvp_candidates": ("_forward_jvp_kernel", configs(
            (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3), (64, 32, 4, 2), (64, 64, 4, 2),
            (128, 64, 8, 3), (64, 32, 4, 4))),
        "backward_jvp_row_candidates": ("_backward_jvp_rows_kernel", configs(
            (128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3),
            (128, 32, 8, 3))),
        "backward_jvp_column_candidates": ("_backward_jvp_columns_kernel", configs(
            (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2),
            (64, 128, 8, 4), (32, 128, 8, 3), (64, 64, 8, 2))),
    },
    128: {
        "forward_jvp_candidates": ("_forward_jvp_kernel", configs(
            (128, 32, 8, 2), (128, 32, 8, 3), (128, 16, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2),
            (64, 16, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3), (32, 32, 4, 1))),
        "backward_jvp_row_candidates": ("_backward_jvp_rows_kernel", configs(
            (128, 32, 8, 2), (128, 16, 8, 2), (64, 16, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2),
            (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 3), (32, 32, 4, 1))),
        "backward_jvp_column_candidates": ("_backward_jvp_columns_kernel", configs(
            (16, 128, 8, 2), (16, 64, 4, 2), (16, 64, 8, 2), (32, 64, 8, 2), (32, 128, 8, 2),
            (32, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (32, 32, 4, 2), (32, 128, 8, 3),
            (32, 128, 4, 2), (16, 128, 4, 2), (16, 32, 4, 1))),
    },
}


def kernel_ms(fn, kernel, reps=5):
    """GPU time per call of the kernels whose name starts with `kernel`."""
    return sum(ms for name, ms in kernel_times_ms(fn, reps).items() if name.startswith(kernel))


def main():
    args = ab_arguments(__doc__.split("\n\n")[0], lambda ap: ap.add_argument(
        "--kernels", nargs="+", default=None, metavar="NAME",
        help="only the kernels whose names contain one of these (e.g. rows columns)"))
    sweeps = {name: (kernel, args.configs or candidates)
              for name, (kernel, candidates) in SWEEPS[args.d].items()
              if args.kernels is None or any(part in kernel for part in args.kernels)}
    real = {name: getattr(forward_mode, name) for name in SWEEPS[args.d]}

    def force(name, config):
        """Only `config` for this kernel at this head dim; nothing remembered."""
        for other, function in real.items():
            setattr(forward_mode, other, function)
        if name is not None:
            setattr(forward_mode, name, lambda dtype, e, ev: (
                [config] if e == args.d else real[name](dtype, e, ev)))
        forget_tuning()
        triton_attention._forward_mode_failed.clear()   # back to the kernels

    results = []
    scale = args.d ** -0.5
    for causal in causal_cases(args):
        torch.manual_seed(0)
        q, k, v, do, gq, gk, gv = (torch.randn(1, 12, args.n, args.d, device="cuda",
                                               dtype=torch.bfloat16) for _ in range(7))

        def step():
            return op_forward_over_reverse(q, k, v, do, gq, gk, gv, scale, causal)

        def reverse():
            return op_autograd(q, k, v, do, gq, gk, gv, scale, causal)

        force(None, None)
        step()
        reverse()
        print_kernel_times(f"reverse over reverse, causal={causal}", reverse)
        print_kernel_times(f"forward over reverse, causal={causal}", step)
        for round_ in range(args.rounds):
            force(None, None)
            results.append(dict(causal=causal, round=round_, kernel="tuned",
                                ms=median_ms(step, args.reps),
                                reverse_over_reverse_ms=median_ms(reverse, args.reps)))
            print(f"causal={causal!s:5s} round {round_} tuned: forward over reverse "
                  f"{results[-1]['ms']:.2f} ms, reverse over reverse "
                  f"{results[-1]['reverse_over_reverse_ms']:.2f} ms", flush=True)
            for name, (kernel, candidates) in sweeps.items():
                for config in candidates:
                    force(name, config)
                    try:
                        ms, own_ms = median_ms(step, args.reps), kernel_ms(step, kernel)
                    except Exception as e:
                        print(f"  {kernel} {label(config)}: {type(e).__name__}")
                        continue
                    if triton_attention._forward_mode_failed:   # e.g. out of shared memory
                        print(f"  {kernel} {label(config)}: does not build (see the log)")
                        continue
                    results.append(dict(causal=causal, round=round_, kernel=kernel,
                                        config=config, ms=ms, kernel_ms=own_ms))
                    print(f"  {kernel:30s} {label(config):28s} step {ms:6.2f} ms, "
                          f"kernel {own_ms:6.3f} ms", flush=True)
        print(f"\ncausal={causal}: medians over rounds")
        for name, (kernel, candidates) in sweeps.items():
            for config in candidates:
                mine = [r for r in results if r["causal"] == causal
                        and r["kernel"] == kernel and r["config"] == config]
                if mine:
                    print(f"  {kernel:30s} {label(config):28s} "
                          f"step {statistics.median(r['ms'] for r in mine):6.2f} ms, kernel "
                          f"{statistics.median(r['kernel_ms'] for r in mine):6.3f} ms")
    force(None, None)
    print(f"wrote {write_results(args, 'bench_forward_mode_configs', results)}")


if __name__ == "__main__":
    main()
