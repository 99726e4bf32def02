"""Our launch-config tuning against Triton's own `triton.autotune`, on one GPU.

The three heaviest launch sites of a second-order step (the Triton forward, BoB's row
kernel, BoB's column kernel; B=1, H=12, d=64, bf16, causal) at three lengths, the first
two in one of our tuning buckets (powers of two from 1K to 16K) and the third in another:

- ours: `bob_compile/kernels/tuning.py` times the site's candidate configs once per bucket
  (do_bench, 3 ms warm-up, 12 ms of runs each) and keeps the winner in memory and in a
  JSON file, so a new length in a known bucket costs no tuning;
- triton_autotune: the same kernels and candidates under `triton.autotune(configs,
  key=["L", "S"])`, which tunes again at every new (L, S) (do_bench's defaults).

Per length: the wall time of the first call (compiling the candidates the first time, in a
fresh Triton cache), the configs chosen, and the time of the kernels with those configs.
Each variant runs in a fresh process with empty caches.

    python benchmarks/bench_tuning.py --out results/        # both variants, table + JSON
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

LENGTHS = (4096, 6000, 16384)
B, H, D = 1, 12, 64
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def run_variant(which):
    """One variant in this process (fresh caches are set up by the parent); JSON rows."""
    import torch
    import triton

    from bob_compile.kernels import triton_attention as ta
    from bob_compile.kernels.params import AttentionParams
    from bob_compile.kernels import launching, triton_bob, triton_forward, tuning
    sites = {"_forward_kernel": ("rows", triton_forward.forward_candidates),
             # the chain form's row pass (attention_bob's default), as step() runs it
             "_row_kernel": ("rows",
                             lambda dt, e, ev: triton_bob.row_candidates(dt, e, ev, False)),
             "_column_kernel": ("columns",
                                lambda dt, e, ev: triton_bob.column_candidates(dt, e, ev, False))}
    scale = D ** -0.5

    def step(q, k, v, do, gq, gk, gv):
        params = AttentionParams(scale=scale, causal=True)
        o, lse = ta.attention_forward(q, k, v, params)
        ta.attention_bob(q, k, v, o, lse, do, None, gq, gk, gv, params)

    rows = []
    for n in LENGTHS:
        x = [torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
        if which == "ours":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(*x)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            bucket = tuning.length_bucket(n)
            chosen = {key[0]: {c: plan.kwargs[c] for c in CONFIG_KEYS}
                      for key, plan in tuning.TUNING_CACHE.chosen.items()
                      if key[-1] == bucket and key[0] in ("forward", "bob_rows", "bob_columns")}
            ms = triton.testing.do_bench(lambda: step(*x), warmup=5, rep=50)
            rows.append(dict(variant=which, n=n, first_call_s=first, chosen=chosen,
                             kernels_ms=ms, kernels="forward, row dot, BoB columns, BoB rows"))
            continue
        # triton.autotune: record the launches of one step, then tune each site with it
        captured = []
        launch = launching.LaunchPlan.__call__
        launching.LaunchPlan.__call__ = lambda plan, kernel, grid, **named: captured.append(
            (kernel, grid, launching.packer(kernel)(**named), dict(plan.kwargs)))
        try:
            step(*x)
        finally:
            launching.LaunchPlan.__call__ = launch
        first, launches, chosen = 0.0, [], {}
        for kernel, grid, args, kwargs in captured:
            name = kernel.fn.__name__
            if name not in sites:
                continue
            kind, candidates = sites[name]
            configs = [triton.Config(dict(BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"]),
                                     num_warps=c["num_warps"], num_stages=c["num_stages"])
                       for c in candidates(torch.bfloat16, D, D)]
            fixed = {k: v for k, v in kwargs.items() if k not in CONFIG_KEYS}
            tuned = triton.autotune(configs, key=["L", "S"])(kernel)
            block = "BLOCK_M" if kind == "rows" else "BLOCK_N"

            def tuned_grid(meta, n=n, block=block, heads=grid[1]):
                return triton.cdiv(n, meta[block]), heads

            def run(tuned=tuned, tuned_grid=tuned_grid, args=args, fixed=fixed):
                tuned[tuned_grid](*args, **fixed)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            first += time.perf_counter() - t0
            best = tuned.best_config
            chosen[name] = dict(BLOCK_M=best.kwargs["BLOCK_M"], BLOCK_N=best.kwargs["BLOCK_N"],
                                num_warps=best.num_warps, num_stages=best.num_stages)
            launches.append(run)
        ms = triton.testing.do_bench(lambda: [run() for run in launches], warmup=5, rep=50)
        rows.append(dict(variant=which, n=n, first_call_s=first, chosen=chosen, kernels_ms=ms,
                         kernels="forward, BoB columns, BoB rows"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--variant", choices=["ours", "triton_autotune"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant)))
        return
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench_tuning: needs a CUDA device (it tunes the Triton kernels on a GPU)")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for variant in ("ours", "triton_autotune"):
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(),
                   BOB_COMPILE_CACHE_DIR=tempfile.mkdtemp(),
                   BOB_COMPILE_TUNE="1" if variant == "ours" else "0")
        done = subprocess.run([sys.executable, __file__, "--variant", variant], env=env,
                              capture_output=True, text=True, check=True)
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, B=B, H=H, d=D,
                dtype="bfloat16", causal=True, lengths=LENGTHS)
    with open(os.path.join(args.out, "bench_tuning.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"{'variant':16s} {'N':>6s} {'first call s':>12s} {'kernels ms':>10s}  chosen")
    for r in rows:
        chosen = "; ".join(f"{k}: {c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"
                           for k, c in sorted(r["chosen"].items()))
        print(f"{r['variant']:16s} {r['n']:6d} {r['first_call_s']:12.2f} {r['kernels_ms']:10.3f}  {chosen}")


if __name__ == "__main__":
    main()
