"""Launch-config candidates of the forward-mode kernels (attn_fwd_jvp, attn_bwd_jvp), A/B
through the user's step.

Forward over reverse (`torch.func.jvp(torch.func.grad(f))` through the op: issue 13's
<= 1.2x the reverse-over-reverse step) runs three forward-mode kernels whose candidate
lists (`bob_compile/kernels/triton_forward_mode.py`) were set before any GPU run. This times the step
(bench_attention's `op_forward_over_reverse`) with the current lists and with three-stage
configs added (the tuner choosing among each list, its decisions forgotten between
variants), in interleaved rounds, next to the reverse-over-reverse step (`op_autograd`).
B = 1, H = 12, bf16, causal and not.

    python benchmarks/bench_forward_mode_configs.py --out results/ [--n 16384] [--d 64]
"""
import os
import sys

import torch

from bob_compile.kernels import settings, triton_common
from bob_compile.kernels import triton_forward_mode as forward_mode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import op_autograd, op_forward_over_reverse  # noqa: E402
from bench_masks import median_ms  # noqa: E402
from bench_row_configs import ab_arguments, forget_tuning, write_results  # noqa: E402


def config(block_m, block_n, warps, stages):
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def main():
    args = ab_arguments(__doc__.split("\n\n")[0])
    real_rows, real_columns = forward_mode.row_candidates, forward_mode.column_candidates
    rows = real_rows(torch.bfloat16, args.d, args.d)
    columns = real_columns(torch.bfloat16, args.d, args.d)
    variants = {
        "current": (rows, columns),
        "plus three-stage": (rows + [config(128, 64, 8, 3), config(64, 64, 4, 3),
                                     config(128, 32, 8, 3)],
                             columns + [config(32, 64, 4, 3), config(64, 64, 8, 3),
                                        config(64, 32, 4, 3)]),
    }

    def force(row_configs, column_configs):
        """Only these lists at this head dim; no earlier decision remembered."""
        forward_mode.row_candidates = lambda dtype, e, ev: (
            row_configs if e == args.d else real_rows(dtype, e, ev))
        forward_mode.column_candidates = lambda dtype, e, ev: (
            column_configs if e == args.d else real_columns(dtype, e, ev))
        forget_tuning()

    results = []
    scale = args.d ** -0.5
    for causal in (True, False):
        torch.manual_seed(0)
        q, k, v, do, gq, gk, gv = (torch.randn(1, 12, args.n, args.d, device="cuda",
                                               dtype=torch.bfloat16) for _ in range(7))
        reverse_ms = median_ms(lambda: op_autograd(q, k, v, do, gq, gk, gv, scale, causal),
                               args.reps)
        for round_ in range(args.rounds):
            for name, lists in variants.items():
                force(*lists)
                ms = median_ms(lambda: op_forward_over_reverse(q, k, v, do, gq, gk, gv, scale,
                                                               causal), args.reps)
                chosen = {key: c for key, c in triton_common.TUNING_CACHE.entries.items()
                          if "jvp" in key}
                results.append(dict(causal=causal, round=round_, variant=name, ms=ms,
                                    reverse_over_reverse_ms=reverse_ms, chosen=chosen))
                print(f"causal={causal!s:5s} round {round_} {name:18s} forward over reverse "
                      f"{ms:7.2f} ms, reverse over reverse {reverse_ms:6.2f} ms "
                      f"({ms / reverse_ms:.3f}x)", flush=True)
    forward_mode.row_candidates, forward_mode.column_candidates = real_rows, real_columns
    settings.reload()
    print(f"wrote {write_results(args, 'bench_forward_mode_configs', results)}")


if __name__ == "__main__":
    main()
