"""The folded BoB's row-pass (or column-pass) launch configs, measured as users run them:
through autograd.

For head dim d, the full second-order step through `bob_compile.attention` (forward,
`grad(create_graph=True)`, second `grad` w.r.t. q, k, v, dO; B = 1, H = 12, bf16) with each
candidate of `triton_bob.row_candidates` (folded form, R read from dq, as autograd runs it;
with --columns those of `triton_bob.column_candidates`, the folded column pass; or the
configs given with --configs) forced alone,
then with the tuner choosing among all of them (and which it chose). Rounds
are interleaved, so that a drift of the GPU's clocks hits every config alike; each row is
the CUDA-event median of --reps steps. Kernel-only timings of the same configs are
`bench_bob_tiles.py`'s; the two rankings can differ (the step's other kernels share the GPU's
caches with the row pass, and the tuner times the row launch alone).

    python benchmarks/bench_row_configs.py --out results/ [--n 16384] [--d 64] [--columns]
        [--causal both|yes|no] [--configs 64x128/8/3 ...] [--dropout 0.1]
"""
import argparse
import json
import os
import sys

import torch

from bob_compile.kernels import settings, triton_bob, tuning

sys.path.insert(0, os.path.dirname(__file__))
from bench_masks import median_ms, step  # noqa: E402


LAUNCH_PARAMETERS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def label(config):
    return (f"{config['BLOCK_M']}x{config['BLOCK_N']}, {config['num_warps']} warps, "
            f"{config['num_stages']} stages")


def ab_arguments(description, more=None):
    """The arguments of a launch-config A/B (this script, bench_forward_mode_configs.py);
    more(parser) adds a script's own."""
    ap = argparse.ArgumentParser(description=description)
    if more is not None:
        more(ap)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="results")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--columns", action="store_true",
                    help="the column pass's configs instead of the row pass's")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="attention dropout probability of the measured step")
    ap.add_argument("--configs", nargs="+", type=parse_config, default=None,
                    metavar="MxN/WARPS/STAGES",
                    help="these configs instead of the candidate list (e.g. 64x128/8/3)")
    return ap.parse_args()


def parse_config(text):
    """'64x128/8/3' -> BLOCK_M 64, BLOCK_N 128, 8 warps, 3 stages."""
    tile, warps, stages = text.split("/")
    block_m, block_n = tile.split("x")
    return dict(BLOCK_M=int(block_m), BLOCK_N=int(block_n), num_warps=int(warps),
                num_stages=int(stages))


def causal_cases(args):
    return {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]


def forget_tuning():
    """No launch decision remembered, in memory or from the cache file: the next calls
    tune again among the candidates in force."""
    tuning.TUNING_CACHE.entries = {}
    tuning._builds.clear()
    settings.reload()                            # forgets the launch plans


def write_results(args, name, rows):
    """rows of a launch-config A/B as results/<name>_d<d>_<n>.json."""
    os.makedirs(args.out, exist_ok=True)
    dropout = f"_dropout{args.dropout:g}" if getattr(args, "dropout", 0.0) else ""
    path = os.path.join(args.out, f"{name}_d{args.d}_{args.n}{dropout}.json")
    with open(path, "w") as f:
        json.dump(dict(n=args.n, d=args.d, device=torch.cuda.get_device_name(),
                       torch=torch.__version__, rows=rows), f, indent=1)
    return path


def main():
    args = ab_arguments(__doc__.split("\n\n")[0])
    attr = "column_candidates" if args.columns else "row_candidates"
    real = getattr(triton_bob, attr)
    # without --configs: the longest lists (non-causal columns, masked rows); unmasked
    # causal calls take the first column config, unmasked calls the first row config
    candidates = args.configs or (
        real(torch.bfloat16, args.d, args.d, False, fold=True) if args.columns
        else real(torch.bfloat16, args.d, args.d, True, reads_dq=True, masked=True))
    variants = {label(c): [c] for c in candidates}
    variants["tuned among all"] = candidates

    def force(configs):
        """Only `configs` for the folded pass at this head dim; nothing remembered."""
        def pick_rows(dtype, e, ev, fold, reads_dq=False, read=False, masked=False):
            return configs if fold and reads_dq and e == args.d and not read else real(
                dtype, e, ev, fold, reads_dq, read, masked)

        def pick_columns(dtype, e, ev, atomics, read=False, **form):
            return configs if not atomics and e == args.d and not read else real(
                dtype, e, ev, atomics, read, **form)
        setattr(triton_bob, attr, pick_columns if args.columns else pick_rows)
        forget_tuning()

    rows = []
    for causal in causal_cases(args):
        torch.manual_seed(0)
        q, k, v, do, *cotangents = (torch.randn(1, 12, args.n, args.d, device="cuda",
                                                dtype=torch.bfloat16) for _ in range(7))
        for round_ in range(args.rounds):
            for name, configs in variants.items():
                force(configs)
                ms = median_ms(lambda: step(q, k, v, do, cotangents, None, causal, args.dropout),
                               args.reps)
                site = "bob_columns" if args.columns else "bob_rows"
                chosen = [{param: plan.kwargs[param] for param in LAUNCH_PARAMETERS}
                          for memo, plan in tuning.TUNING_CACHE.chosen.items()
                          if memo[0] == site and memo[5] == causal]
                rows.append(dict(causal=causal, round=round_, variant=name, ms=ms,
                                 row_configs_chosen=chosen))
                print(f"{'causal' if causal else 'full':6s} {name:30s} {ms:8.3f} ms", flush=True)
    setattr(triton_bob, attr, real)
    settings.reload()
    path = write_results(args, "bench_column_configs" if args.columns else "bench_row_configs",
                         rows)
    print(f"\n{'':6s} {'column-pass config' if args.columns else 'row-pass config':30s} "
          + " ".join(f"round {r + 1:d}" for r in range(args.rounds)))
    for causal in causal_cases(args):
        for name in variants:
            ms = [r["ms"] for r in rows if r["causal"] == causal and r["variant"] == name]
            print(f"{'causal' if causal else 'full':6s} {name:30s} "
                  + " ".join(f"{m:7.2f}" for m in ms))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
