"""Sophia-H on a padded batch through a Hugging Face model: flashbob vs eager math (issue 12).

The model is transformers' GPT2LMHeadModel from a GPT2Config (GPT-2 small by default: 12
layers, 12 heads, n_embd 768; nothing is downloaded), attn_implementation="sdpa", trained
under bf16 autocast. The batch is --batch-size sequences with lengths uniform in
[--min-len, --max-len] (seeded), right-padded to --max-len, passed with the attention_mask
a tokenizer returns; the loss is the next-token cross-entropy on real tokens only. One
timed step is Sophia-H's step with its Hessian estimate: forward, gradient with
create_graph=True, Hessian-vector product with Rademacher z (double backward), the Hessian
EMA update and Sophia's update (examples/sophia_h.py).

Implementations:
  math      eager transformers under sdpa_kernel(SDPBackend.MATH), the only SDPA kernel with
            a double backward (it stores B x H x N x N attention matrices)
  flashbob  torch.compile(model, backend="flashbob"): HF's mask (padding and causal in one
            4-D tensor) is recognized on the device as a key range with the causal mask
            folded in, and the padded keys' blocks are skipped

Timing: CUDA events around each step after warm-up (the first step compiles and is reported
apart), median of --reps; peak memory over the timed steps (model and optimizer included).
An implementation that runs out of memory says so. The Hessian-vector products of both at
the initial weights are compared (relative L2, in the autocast dtype).

    python benchmarks/bench_hf_padded.py --out results/bench_hf_padded.json
    python benchmarks/bench_hf_padded.py --pdrop 0.1 --min-len 1024 --max-len 1024 \
        --out results/bench_hf_dropout.json      # GPT-2's default dropout, no padding
    python benchmarks/bench_hf_padded.py --device cpu --dtype float32 --n-layer 2 --n-head 2 \\
        --n-embd 32 --vocab-size 64 --min-len 8 --max-len 16 --reps 1 --out /tmp/p.json  # smoke
"""
import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from sophia_h import SophiaH, rademacher_like  # noqa: E402
from run_record import run_record  # noqa: E402  (benchmarks/, the script's folder)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build(args, device):
    from transformers import GPT2Config, GPT2LMHeadModel
    # --pdrop 0: one fixed function (the HVPs compare); 0.1: GPT2Config's defaults, as
    # people train it (attention, residual and embedding dropout)
    config = GPT2Config(vocab_size=args.vocab_size, n_positions=args.max_len, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=args.n_head, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=args.pdrop, embd_pdrop=args.pdrop, attn_pdrop=args.pdrop)
    torch.manual_seed(args.seed)  # the same weights for every implementation
    return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").to(device)


def padded_batch(args, device):
    """(input_ids, attention_mask, lengths): right padding, as a tokenizer's padding=True."""
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch_size,), generator=g)
    ids = torch.randint(1, args.vocab_size, (args.batch_size, args.max_len), generator=g)
    mask = (torch.arange(args.max_len)[None, :] < lengths[:, None]).long()
    return ids.to(device), mask.to(device), lengths.tolist()


def hessian_step(model, params, ids, mask, zs):
    """loss, ∇L and ∇²L z for next-token cross-entropy on the real tokens."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)     # padded targets ignored
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                           ignore_index=-100)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    hvps = torch.autograd.grad(grads, params, grad_outputs=zs)
    return loss.detach(), [g.detach() for g in grads], hvps


def run(impl, args, device, ids, mask):
    """Timings and the first step's Hessian-vector product of one implementation."""
    model = build(args, device)
    params = list(model.parameters())
    runner = model
    if impl == "flashbob":
        from bob_compile.backend import flashbob
        runner = torch.compile(model, backend=flashbob)
    optimizer = SophiaH(params, lr=6e-4)
    autocast = torch.autocast(device.type, dtype=DTYPES[args.dtype],
                              enabled=args.dtype != "float32")
    z_generator = torch.Generator(device=device).manual_seed(args.seed)
    first_hvp = None

    def step():
        nonlocal first_hvp
        zs = rademacher_like(params, z_generator)
        with autocast, (sdpa_kernel(SDPBackend.MATH) if impl == "math" else nullcontext()):
            _, grads, hvps = hessian_step(runner, params, ids, mask, zs)
        if first_hvp is None:
            first_hvp = [h.detach().float().clone() for h in hvps]
        optimizer.update_hessian(torch._foreach_mul(zs, hvps))
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    step()
    sync()
    first_s = time.perf_counter() - start
    step()                                        # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.reps):
        sync()
        start = time.perf_counter()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            sync()
            times.append(begin.elapsed_time(end))
        else:
            step()
            times.append(1e3 * (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None
    row = dict(ms=statistics.median(times), first_step_s=first_s, peak_gib=peak)
    if impl == "flashbob":
        from bob_compile.backend import recent_reports
        sites = [s for r in recent_reports for s in r.sites]
        row["sites_replaced"] = sum(s.replaced for s in sites)
        row["sites_left"] = sum(not s.replaced for s in sites)
    return row, first_hvp


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench_hf_padded.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pdrop", type=float, default=0.0,
                   help="GPT-2's attention, residual and embedding dropout (0.1: its defaults); "
                        "the HVPs of math and flashbob then draw different masks and are not "
                        "compared")
    p.add_argument("--impls", nargs="+", default=["math", "flashbob"],
                   choices=["math", "flashbob"])
    args = p.parse_args(argv)
    device = torch.device(args.device)
    ids, mask, lengths = padded_batch(args, device)
    rows, hvps = {}, {}
    for impl in args.impls:
        try:
            rows[impl], hvps[impl] = run(impl, args, device, ids, mask)
        except torch.OutOfMemoryError:
            rows[impl] = dict(error="out of memory")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = dict(meta=dict(**run_record(), device=str(device) if device.type != "cuda" else
                            torch.cuda.get_device_name(), torch=torch.__version__,
                            dtype=args.dtype, batch_size=args.batch_size, lengths=lengths,
                            max_len=args.max_len, n_layer=args.n_layer, n_head=args.n_head,
                            n_embd=args.n_embd, real_tokens=sum(lengths), pdrop=args.pdrop),
                  rows=rows)
    if len(hvps) == 2 and not args.pdrop:
        num = sum(((a - b) ** 2).sum() for a, b in zip(hvps["flashbob"], hvps["math"]))
        den = sum((b ** 2).sum() for b in hvps["math"])
        result["hvp_rel_l2_flashbob_vs_math"] = (num / den).sqrt().item()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"GPT-2 ({args.n_layer} layers, n_embd {args.n_embd}), batch {args.batch_size}, "
          f"lengths {lengths} padded to {args.max_len}, {args.dtype}")
    for impl, row in rows.items():
        if "error" in row:
            print(f"{impl:9s} {row['error']}")
            continue
        peak = f"{row['peak_gib']:.2f} GiB" if row["peak_gib"] is not None else ""
        sites = (f"  {row['sites_replaced']} attention sites fused, {row['sites_left']} left"
                 if "sites_replaced" in row else "")
        print(f"{impl:9s} {row['ms']:9.1f} ms  {peak:>10s}  (first step "
              f"{row['first_step_s']:.1f} s){sites}")
    if "math" in rows and "flashbob" in rows and "ms" in rows["math"] and "ms" in rows["flashbob"]:
        print(f"speedup {rows['math']['ms'] / rows['flashbob']['ms']:.2f}x")
    if "hvp_rel_l2_flashbob_vs_math" in result:
        print(f"Hessian-vector product, flashbob vs math: rel L2 "
              f"{result['hvp_rel_l2_flashbob_vs_math']:.2e}")


if __name__ == "__main__":
    main()
