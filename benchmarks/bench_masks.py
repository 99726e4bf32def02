"""Second-order steps with a padding mask (issue 12): a padded batch against the unmasked
op on the same visible pairs.

Problem (the issue's): B sequences with lengths uniform in [--min-len, --max-len], padded to
--max-len, causal, H heads, head dim d, bf16. Each row times one full second-order step
through `bob_compile.attention` and autograd (forward, grad(create_graph=True), second grad
w.r.t. q, k, v, dO):
- `padded, bool mask`: the batch with an HF-style key-padding mask (B, 1, 1, S), is_causal;
- `padded, general mask`: the same pattern as a materialized (B, 1, L, S) boolean mask;
- `padded, additive mask`: the same pattern as an additive (B, 1, 1, S) mask, finfo.min fill;
- `padded, HF 4-D mask`: padding and the causal mask in one (B, 1, L, S) boolean tensor,
  is_causal=False, as Hugging Face passes it (recognized as a key range with the causal
  mask folded in: applied from indices, key blocks above the diagonal skipped);
- `padded, 4-D mask read per tile`: the same with one more hidden pair per sequence, which
  no structure describes: the kernels read a mask tile wherever they form scores (the
  general path, on all but B of the same visible pairs);
- `padded, no mask`: the padded batch without a mask (the work a mask-blind kernel does);
- `per sequence, no mask`: the sum over sequences of the unmasked step at each own length
  (B = 1): exactly the visible pairs, but eight small launches' worth of host time;
- `no mask x visible share`: `padded, no mask` times visible pairs / padded pairs (queries of
  the padded rows included, as the mask lets them see the real keys): the unmasked op's time
  for the same number of visible pairs, the issue's reference for the masked rows.
CUDA-event medians after warm-up. Checks the masked steps against per-sequence unmasked
steps on the real tokens (the padded rows' outputs are excluded). `--profile` also prints
each padded row's GPU time per step by kernel (torch.profiler), host time excluded;
`--python-node` adds the structured masked rows through the Python autograd node (as masked
calls ran before they went through the C++ node); `--host` the host time per call where the
GPU work is negligible (B = 2, H = 4, N = 128), C++ node, Python node and no mask.

    python benchmarks/bench_masks.py --out results/ [--profile] [--python-node] [--host] [--short]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bob_compile  # noqa: E402
from bob_compile.eager import node as eager_node  # noqa: E402
from run_record import run_record  # noqa: E402  (benchmarks/, the script's folder)


def step(q, k, v, do, g, mask, causal, dropout_p=0.0):
    q, k, v, do = (t.detach().requires_grad_() for t in (q, k, v, do))
    o = bob_compile.attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)
    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    return torch.autograd.grad(grads, (q, k, v, do), g)


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_times_ms(fn, reps=3):
    """GPU time per call by kernel name (its first 70 characters), from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:70]] = per_kernel.get(event.name[:70], 0) + event.device_time
    return {kernel: us / reps / 1e3 for kernel, us in per_kernel.items()}


def print_kernel_times(name, fn, reps=3):
    """GPU time per step by kernel name: where a row's time goes, without the host's."""
    per_kernel = kernel_times_ms(fn, reps)
    print(f"\n{name}: GPU kernels {sum(per_kernel.values()):.3f} ms per step")
    for kernel, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {ms:7.3f} ms  {kernel}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--profile", action="store_true",
                   help="also print each padded row's GPU time per step by kernel")
    p.add_argument("--python-node", action="store_true",
                   help="also time the structured masked rows through the Python autograd "
                        "node (what ran before masked calls went through the C++ node)")
    p.add_argument("--host", action="store_true",
                   help="also print the host time per masked call at a size where the GPU "
                        "work is negligible (B=2, H=4, N=128): C++ node, Python node, no mask")
    p.add_argument("--tag", default="", help="suffix of the JSON file's name")
    p.add_argument("--short", action="store_true",
                   help="only the rows of the issue's two ratios (key padding, HF 4-D, read "
                        "per tile, no mask): fewer kernels to build and tune")
    p.add_argument("--summary-per-call", action="store_true",
                   help="summarize the mask in every op call, as before the backwards reused "
                        "their forward's summary (for comparison)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_masks.py needs a CUDA device")
        return
    if args.summary_per_call:
        from bob_compile.kernels import triton_masks
        triton_masks.summary_of_forward = lambda mask, reuse: triton_masks.mask_summary(mask)
    dev, dtype, causal = "cuda", torch.bfloat16, True
    B, H, S, d = args.batch, args.heads, args.max_len, args.d
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (B,), generator=g).tolist()
    visible = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    key_mask = visible[:, None, None, :].to(dev)
    general = key_mask.expand(B, 1, S, S).contiguous()
    additive = torch.zeros(B, 1, 1, S, device=dev, dtype=dtype).masked_fill(
        ~key_mask, torch.finfo(dtype).min)
    hf_4d = general & torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    unstructured = hf_4d.clone()
    for b, n in enumerate(lengths):
        unstructured[b, 0, n - 1, 0] = False      # one hidden pair: no key range describes it
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, d, device=dev, dtype=dtype) for _ in range(4))
    cot = tuple(torch.randn(B, H, S, d, device=dev, dtype=dtype) for _ in range(3))

    rows = {}
    first_step_s = {}       # the first step of each row: launch-config tuning included
    if args.python_node:
        for name, mask, is_causal in (("padded, bool mask (Python node)", key_mask, causal),
                                      ("padded, HF 4-D mask (Python node)", hf_4d, False)):
            with python_node():
                rows[name] = median_ms(lambda: step(q, k, v, do, cot, mask, is_causal),
                                       args.reps)
    for name, mask, is_causal in (
            ("padded, bool mask", key_mask, causal), ("padded, general mask", general, causal),
            ("padded, additive mask", additive, causal), ("padded, HF 4-D mask", hf_4d, False),
            ("padded, 4-D mask read per tile", unstructured, False),
            ("padded, no mask", None, causal)):
        if args.short and name in SHORT_SKIPS:
            continue
        start = time.perf_counter()
        step(q, k, v, do, cot, mask, is_causal)
        torch.cuda.synchronize()
        first_step_s[name] = time.perf_counter() - start
        # the C++ autograd node builds in the background from the first call: no row is
        # timed through the Python node beside a compiler (a training run has it built)
        eager_node.extension(wait=True)
        rows[name] = median_ms(lambda: step(q, k, v, do, cot, mask, is_causal), args.reps)
        print(f"{name}: {rows[name]:.3f} ms (first step {first_step_s[name]:.1f} s)", flush=True)
        if args.profile:
            print_kernel_times(name, lambda: step(q, k, v, do, cot, mask, is_causal))

    def per_sequence():
        for b, n in enumerate(lengths):
            sl = (slice(b, b + 1), slice(None), slice(0, n))
            step(q[sl], k[sl], v[sl], do[sl], tuple(c[sl] for c in cot), None, causal)
    if not args.short:
        rows["per sequence, no mask"] = median_ms(per_sequence, args.reps)

    # correctness: the masked step on each sequence's real tokens equals the unmasked step there
    worst = 0.0
    real = visible[:, None, :, None].to(dev)      # padded rows send no cotangent anywhere
    for mask, is_causal in ((key_mask, causal), (hf_4d, False)):
        masked = step(q, k, v, do * real, tuple(c * real for c in cot), mask, is_causal)
        for b, n in enumerate(lengths):
            sl = (slice(b, b + 1), slice(None), slice(0, n))
            alone = step(q[sl], k[sl], v[sl], do[sl], tuple(c[sl] for c in cot), None, causal)
            for ours, ref in zip(masked, alone):
                a, r = ours[sl].double(), ref.double()
                worst = max(worst, ((a - r).norm() / r.norm()).item())

    # visible (query, key) pairs under causal ∧ key padding: every query row i sees keys
    # j <= i with j < n, padded rows included
    pairs = sum(n * (n + 1) // 2 + (S - n) * n for n in lengths) * H
    padded_pairs = B * H * S * (S + 1) // 2
    rows["no mask x visible share"] = rows["padded, no mask"] * pairs / padded_pairs
    reference = rows["no mask x visible share"]
    result = dict(meta=dict(**run_record(), device=torch.cuda.get_device_name(), torch=torch.__version__, B=B,
                            H=H, S=S, d=d, lengths=lengths, causal=causal, dtype=str(dtype),
                            visible_pairs=pairs, reps=args.reps),
                  rows=[dict(row=name, ms=ms, ratio_to_visible_share=ms / reference,
                             first_step_s=first_step_s.get(name))
                        for name, ms in rows.items()],
                  general_vs_structured=rows["padded, 4-D mask read per tile"]
                  / rows["padded, HF 4-D mask"],
                  masked_vs_per_sequence_rel_l2=worst)
    if args.host:
        result["host_us"] = host_times()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_masks{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"B={B} H={H} S={S} d={d} lengths={lengths} visible pairs={pairs:,}")
    print(f"masked step vs per-sequence unmasked on real tokens: rel L2 {worst:.2e}")
    print(f"{'row':32s} {'ms':>9s} {'vs visible share':>16s} {'first step':>11s}")
    for name, ms in rows.items():
        first = f"{first_step_s[name]:10.1f}s" if name in first_step_s else ""
        print(f"{name:32s} {ms:9.3f} {ms / reference:9.2f}x {first:>18s}")
    print(f"general (read per tile) vs structured (HF 4-D): "
          f"{result['general_vs_structured']:.2f}x")
    for name, us in result.get("host_us", {}).items():
        print(f"host per call, {name:44s} {us:8.1f} us")


# rows --short leaves out (the same pattern in other tensors, and eight unpadded calls)
SHORT_SKIPS = ("padded, general mask", "padded, additive mask")


class python_node:
    """Masked calls through the Python autograd node (the C++ node declines them)."""

    def __enter__(self):
        self.module = eager_node
        self.real = eager_node.masked_output, eager_node.fast_entry
        eager_node.masked_output = lambda *a: None
        eager_node.fast_entry = None

    def __exit__(self, *exc):
        self.module.masked_output, self.module.fast_entry = self.real


def host_times(calls=200):
    """Host time per call (µs) where the GPU work is negligible: `calls` calls issued back to
    back, then one synchronization, per row."""
    B, H, N, d, dtype = 2, 4, 128, 64, torch.bfloat16
    q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(4))
    cot = tuple(torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
    key_mask = (torch.arange(N, device="cuda")[None, :] < torch.tensor([N, N - 40],
                                                                        device="cuda")[:, None])
    key_mask = key_mask[:, None, None, :]

    def first_order(mask):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = bob_compile.attention(qq, kk, vv, attn_mask=mask, is_causal=True)
        torch.autograd.grad(o, (qq, kk, vv), do)

    def timed(fn):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    out = {}
    for order, fn in (("forward + backward", first_order),
                      ("second-order step", lambda m: step(q, k, v, do, cot, m, True))):
        out[f"{order}, key mask, C++ node"] = timed(lambda: fn(key_mask))
        with python_node():
            out[f"{order}, key mask, Python node"] = timed(lambda: fn(key_mask))
        out[f"{order}, no mask"] = timed(lambda: fn(None))
    return out


if __name__ == "__main__":
    main()
