"""FlexAttention's masks in a second-order step (issue 41): a sliding window and packed
documents, against the causal op on the same number of visible pairs.

Problem (the issue's): B = 1, H = 12, N = 16384, d = 64, bf16. Each row times one full
second-order step through autograd (forward, grad(create_graph=True), second grad w.r.t.
q, k, v, dO):
- `causal op`: bob_compile.attention(is_causal=True), the reference per visible pair;
- `sliding window (flex)`: bob_compile.flex_attention with a BlockMask of a causal window of
  --window keys (the mask's key intervals made per call from the listed partial blocks,
  applied from indices by the kernels; the column "mask, ms" times making them);
- `sliding window (flex, compiled)`: torch.nn.attention.flex_attention in a function
  compiled with backend="flashbob" (the BlockMask packed in the graph, resolved by each op);
- `sliding window (bool mask)`: the same mask passed to bob_compile.attention directly (the
  step without the BlockMask's materialization);
- `documents (flex)`, `documents (bool mask)`: packed documents of random lengths in
  [--min-doc, --max-doc], causal inside each;
- `sink + window`, `dilated window`: masks whose rows see more than one interval (4
  attention-sink keys beside the causal window; every other key of a causal window of
  2 --window), which reach the kernels tile by tile (kernels/block_sparse_masks.py);
- `causal + ALiBi (flex)`: a score_mod whose bias reads q_idx - kv_idx alone, which
  reaches the kernels as one row of 2N - 1 values per head with the causal tiles; against
  `causal + ALiBi (dense bias)`: the bias materialized (1, H, N, N) with the causal mask
  folded in, as bob_compile.attention takes it (what flex calls cost before).
Per row: the CUDA-event median, the visible pairs, the time per visible pair relative to
the causal op's (the issue's target: <= 1.15), the peak memory beyond the inputs, the host
time to issue a step (from a synchronize to its return) and the calls in a step that make
the host wait for the GPU (torch.cuda's sync debug mode), and for the flex rows the time to
make the mask's form from the BlockMask and the form's size.

The tile-by-tile and relative-bias forms are taken where the materialized mask would
exceed 1 GiB (block_masks.TILES_ABOVE_BYTES), the relative rows only with
BOB_COMPILE_DEV_RELATIVE_ROWS=1; --tiles-above-bytes 0 takes them at any size, to compare
them with the materialized mask at a length where both fit.

    python benchmarks/bench_flex.py --out results/ [--n 16384] [--window 1024]
    BOB_COMPILE_DEV_RELATIVE_ROWS=1 python benchmarks/bench_flex.py --n 8192 \
        --tiles-above-bytes 0
"""
import argparse
import json
import os
import sys
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bob_compile  # noqa: E402
from bob_compile import block_masks  # noqa: E402
from bench_masks import median_ms  # noqa: E402  (benchmarks/, the script's folder)
from profile_step import host_issue_ms  # noqa: E402
from run_record import run_record  # noqa: E402


def synchronizing_calls(step):
    """How many calls in one step make the host wait for the GPU (torch.cuda's sync debug
    mode warns at each): a step that synchronizes leaves the GPU idle while the host issues
    what follows."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def second_order(attend, q, k, v, do, cotangents):
    q, k, v, do = (t.detach().requires_grad_() for t in (q, k, v, do))
    grads = torch.autograd.grad(attend(q, k, v), (q, k, v), do, create_graph=True)
    return torch.autograd.grad(grads, (q, k, v, do), cotangents)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--min-doc", type=int, default=1024)
    p.add_argument("--max-doc", type=int, default=4096)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tiles-above-bytes", type=int, default=None,
                   help="block_masks.TILES_ABOVE_BYTES for this run (default: the library's)")
    args = p.parse_args()
    # a flex row that fell back to math (N x N) would be timed as the op's: refuse it
    warnings.filterwarnings("error", message="bob_compile.flex_attention runs this call as math")
    if args.tiles_above_bytes is not None:
        block_masks.TILES_ABOVE_BYTES = args.tiles_above_bytes
    if not torch.cuda.is_available():
        print("bench_flex.py needs a CUDA device")
        return
    N, H, d, dev = args.n, args.heads, args.d, "cuda"
    g = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < N:
        lengths.append(int(torch.randint(args.min_doc, args.max_doc + 1, (), generator=g)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:N].to(dev)
    window = args.window

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def documents(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def sink_and_window(b, h, q_idx, kv_idx):
        return (kv_idx < 4) | sliding_window(b, h, q_idx, kv_idx)

    def dilated_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 2 * window) & ((q_idx - kv_idx) % 2 == 0)
    mask_mods = {"sliding window": sliding_window, "documents": documents,
                 "sink + window": sink_and_window, "dilated window": dilated_window}
    rows_, keys = torch.arange(N, device=dev)[:, None], torch.arange(N, device=dev)[None, :]
    dense = {name: mask_mod(None, None, rows_, keys) for name, mask_mod in mask_mods.items()}
    flex_block_masks = {name: create_block_mask(mask_mod, None, None, N, N, device=dev)
                        for name, mask_mod in mask_mods.items()}
    torch.manual_seed(0)
    q, k, v, do, *cot = (torch.randn(1, H, N, d, device=dev, dtype=torch.bfloat16)
                         for _ in range(7))

    def measure(name, attend, pairs):
        def step():
            second_order(attend, q, k, v, do, cot)
        step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ms = median_ms(step, args.reps)
        extra = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
        host = host_issue_ms(step, args.reps)
        syncs = synchronizing_calls(step)
        print(f"  {name}: {ms:.2f} ms, {extra:.0f} MiB beyond the inputs, host issue "
              f"{host:.2f} ms, {syncs} synchronizing calls", flush=True)
        return dict(row=name, ms=ms, visible_pairs=pairs, extra_mib=extra, host_issue_ms=host,
                    synchronizing_calls=syncs)

    causal_pairs = H * N * (N + 1) // 2
    results = [measure("causal op", lambda q, k, v: bob_compile.attention(q, k, v, is_causal=True),
                       causal_pairs)]
    for name in mask_mods:
        pairs = H * int(dense[name].sum())
        mask, block_mask = dense[name], flex_block_masks[name]
        results.append(measure(f"{name} (flex)", lambda q, k, v: bob_compile.flex_attention(
            q, k, v, block_mask=block_mask), pairs))
        blocks = block_masks.Blocks.of(block_mask)
        results[-1]["mask_ms"] = median_ms(lambda: block_masks.key_intervals(
            blocks, N, N, dev, 1, H, tiles_otherwise=True), args.reps)
        form = block_masks.key_intervals(blocks, N, N, dev, 1, H, tiles_otherwise=True)
        results[-1]["mask_form"] = "key intervals" if isinstance(form, torch.Tensor) else \
            f"tile by tile, {form.tiles.shape[0]} tiles"
        results[-1]["mask_mib"] = (form.numel() * form.element_size() if isinstance(
            form, torch.Tensor) else form.nbytes()) / 2 ** 20
        compiled = torch.compile(lambda q, k, v, block_mask: torch_flex_attention(
            q, k, v, block_mask=block_mask), backend="flashbob")
        results.append(measure(f"{name} (flex, compiled)",
                               lambda q, k, v, bm=block_mask: compiled(q, k, v, bm), pairs))
        results.append(measure(f"{name} (bool mask)", lambda q, k, v: bob_compile.attention(
            q, k, v, attn_mask=mask), pairs))
    slopes = torch.exp2(-8 * torch.arange(1, H + 1, device=dev) / H)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    causal_mask = create_block_mask(causal, None, None, N, N, device=dev)
    results.append(measure("causal + ALiBi (flex)", lambda q, k, v: bob_compile.flex_attention(
        q, k, v, score_mod=alibi, block_mask=causal_mask), causal_pairs))
    dense_bias = (slopes.view(1, H, 1, 1) * (keys - rows_)).to(torch.bfloat16).masked_fill(
        keys > rows_, float("-inf"))
    results.append(measure("causal + ALiBi (dense bias)", lambda q, k, v: bob_compile.attention(
        q, k, v, attn_mask=dense_bias), causal_pairs))
    per_pair = results[0]["ms"] / causal_pairs
    print(f"\nN={N} H={H} d={d} bf16, second-order step; window {window}, "
          f"{len(lengths)} documents")
    print(f"{'row':32s} {'ms':>8s} {'visible pairs':>14s} {'per pair vs causal':>19s} "
          f"{'extra MiB':>10s} {'host ms':>8s} {'syncs':>6s} {'mask, ms':>9s} {'mask MiB':>9s}"
          f"  form")
    for r in results:
        r["per_pair_vs_causal"] = r["ms"] / r["visible_pairs"] / per_pair
        materialize = f"{r['mask_ms']:9.2f} {r['mask_mib']:9.2f}  {r['mask_form']}" \
            if "mask_ms" in r else ""
        print(f"{r['row']:32s} {r['ms']:8.2f} {r['visible_pairs']:14.3g} "
              f"{r['per_pair_vs_causal']:19.2f} {r['extra_mib']:10.0f} "
              f"{r['host_issue_ms']:8.2f} {r['synchronizing_calls']:6d} {materialize}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_flex_{N}.json")
    with open(path, "w") as f:
        json.dump(dict(meta=dict(**run_record(), device=torch.cuda.get_device_name(),
                                 N=N, H=H, d=d, window=window, documents=lengths),
                       rows=results), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
