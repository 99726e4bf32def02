"""Launch configs of the BoB's row and column kernels, folded and chain form, on one GPU.

For each head dim (64, 128) and form, times `attention_bob` (kernels alone, B = 1, H = 12,
causal, bf16) with each candidate row-pass config (the column pass at its first candidate),
then each column-pass config with the best row config, and splits one call of the best
pair into its kernels with torch.profiler. This is how the folded form's head-dim limit
(bob_compile/kernels/triton_attention.py, FOLDED_MAX_HEAD_DIM) and its candidates were chosen
(docs/measurements.md, "The folded form").

    python benchmarks/bench_bob_tiles.py --n 16384 --out results/bob_tile_sweep_16k.json
"""
import argparse
import json
import os

os.environ["BOB_COMPILE_TUNE"] = "0"    # each config is forced, one at a time

import torch  # noqa: E402

from bob_compile.kernels import settings, triton_attention, triton_bob  # noqa: E402
from bob_compile.kernels.params import AttentionParams  # noqa: E402
from bench_masks import median_ms  # noqa: E402  (benchmarks/ is the script's folder)


def config(block_m, block_n, warps):
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=2)


ROWS = {64: [config(64, 32, 4), config(64, 64, 4), config(128, 32, 8), config(128, 64, 8),
             config(64, 64, 8)],
        128: [config(64, 32, 4), config(64, 32, 8), config(128, 32, 8), config(64, 64, 8),
              config(64, 16, 4)]}
COLUMNS = {64: [config(64, 64, 4), config(64, 128, 8), config(32, 128, 8)],
           128: [config(32, 64, 4), config(64, 32, 4), config(64, 64, 8)]}


def forced(row, column):
    """Only these configs are candidates (the settings reload forgets earlier choices)."""
    triton_bob.row_candidates = lambda *args: [row]
    triton_bob.column_candidates = lambda *args: [column]
    settings.reload()


def timed_or_error(fn):
    try:
        return median_ms(fn, reps=5)
    except Exception as e:      # a config Triton cannot build for this head dim
        return repr(e)[:80]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--out", default="bob_tile_sweep.json")
    args = ap.parse_args()
    results = []
    for d in (64, 128):
        torch.manual_seed(0)
        q, k, v, do, gq, gk, gv = (torch.randn(1, 12, args.n, d, device="cuda",
                                               dtype=torch.bfloat16) for _ in range(7))
        params = AttentionParams(scale=d ** -0.5, causal=True)
        o, lse = triton_attention.forward(q, k, v, params)
        dq = triton_attention.backward(q, k, v, o, lse, do, None, params)[0]
        for fold in (True, False):
            form = "fold" if fold else "chain"

            def run():
                # the folded row pass reads R from the first backward's dq, as autograd runs it
                return triton_bob.attention_bob(q, k, v, o, lse, do, None, gq, gk, gv, params,
                                                fold=fold, dq=dq if fold else None)
            row_ms = {}
            for row in ROWS[d]:
                forced(row, COLUMNS[d][0])
                row_ms[str(row)] = timed_or_error(run)
                print(d, form, "row", row, row_ms[str(row)], flush=True)
            best_row = min((r for r in ROWS[d] if isinstance(row_ms[str(r)], float)),
                           key=lambda r: row_ms[str(r)])
            for column in COLUMNS[d]:
                forced(best_row, column)
                ms = timed_or_error(run)
                print(d, form, "col", column, "(row", best_row, ")", ms, flush=True)
                results.append(dict(d=d, fold=fold, row=best_row, col=column, ms=ms))
            forced(best_row, COLUMNS[d][0])
            run()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if "kernel" in e.key:
                    print(d, form, "kernel", e.key[:40], f"{e.device_time_total / 3 / 1e3:.3f} ms")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
