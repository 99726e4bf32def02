"""Speed, memory and accuracy of softmax attention through second order, on one GPU.

Providers
- bob_compile: this package's kernels (bob_compile/kernels/triton_attention.py), one full second-order
  step assembled from the contract exactly as autograd runs it: in the form
  kernels.fold_bob picks (by default folded up to head dim 128, chain above), i.e.
  bob_compile_folded or bob_compile_chain;
- bob_compile_folded: the step in the folded form:
      o, lse = forward(q, k, v)                        # forward
      dq, dk, dv = backward(..., do, dlse=None)        # grad(o, (q,k,v), do, create_graph)
      gq, gk, gv, gdo, _ = bob_folded(..., gdq, gdk, gdv, dq)   # grad((dq,dk,dv), (q,k,v,do), ...)
- bob_compile_chain: the same step in the chain form:
      gq, gk, gv, go, glse, gdo, _ = bob(..., gdq, gdk, gdv)
      dq2, dk2, dv2 = backward(..., do=go, dlse=glse)  # cotangents of o and lse flow back
      results: gq + dq2, gk + dk2, gv + dv2, gdo
- torch_math: PyTorch eager, SDPBackend.MATH, forward + grad(create_graph=True) + grad
  (materializes L x S; run only where it fits in memory and time);
- torch_fused_first_order: PyTorch's native fused SDPA (default backend choice), forward +
  backward only: the first-order cost, for scale;
- bob_compile_first_order: this package's forward + backward, to check it is not slower
  than native (it calls the same fused kernels where they apply);
- op_forward_over_reverse: the Hessian-vector product of <o, dO> along (gq, gk, gv) by
  torch.func.jvp(torch.func.grad(...)) through the op (issue 13: <= 1.2x op_autograd at 16K);
- op_autograd / op_autograd_first_order: what a user runs, `bob_compile.attention` through
  autograd (the second-order step: forward, grad(create_graph=True), second grad w.r.t.
  q, k, v, dO; or forward + grad), host overhead included: compare op_autograd_first_order
  with torch_fused_first_order (issue 10: <= 1.1x at N=1K, <= 1.05x from 4K);
  op_autograd_folded / op_autograd_chain: op_autograd with BOB_COMPILE_DEV_BOB_FORM=folded / chain;
  op_autograd_sbar_split: op_autograd with BOB_COMPILE_DEV_SBAR_SPLIT=1 (gq's score-cotangent
  GEMM in two half-precision parts on every tile; its accuracy is measured when it runs);
  op_autograd_no_edge_split: with BOB_COMPILE_DEV_EDGE_SPLIT=0 (no GEMM split on the masked
  tiles either; its accuracy is always measured, as no_edge_split_*);
  op_autograd_calling_thread: op_autograd with its backwards on the calling thread;
  op_autograd_dropout: op_autograd with attention dropout p = 0.1 (every kernel regenerates
  the mask; issue 39: <= 1.15x op_autograd at 16K causal);
  op_autograd_softcap: op_autograd with the scores soft-capped at 50 (Gemma 2; issue 41:
  <= 1.25x op_autograd at 16K causal);
  op_autograd_bias / torch_math_bias: the step with a learned (1, H, N, N) bias, its
  cotangents included, through the op and through SDPA's math;
  op_autograd_python_node / op_autograd_first_order_python_node: with BOB_COMPILE_CPP_NODE=off
  (the op's Python autograd node where PyTorch's fused kernels run the first order; the
  script builds the C++ node, or loads it, before it times anything)
  (torch.autograd.set_multithreading_enabled(False): no hand-off to the autograd engine's
  device thread, which bounds short lengths; docs/measurements.md, "Host overhead").

FLOP convention (per visible (query, key) pair, d = head dim): forward 4d, backward 10d,
BoB 36d: the anchors' 50d per second-order step (4 + 10 + 36, FlashBoB's count), so that
TFLOP/s compare directly with docs/baselines.md. What runs differs from that count:
the folded form executes forward 4d + backward 10d + BoB 38d (row pass 22d, column pass
16d) = 52d; the chain form forward 4d + backward 10d + BoB 34d (row pass 18d + column pass
16d; or 24d with atomics) + second backward 14d (2 x 7 GEMM units with the deterministic dq
pass) = 62d.

Timing: median of CUDA-event times of single calls after warm-up, rotating over 2 input
sets (a call's host time counts in full: the GPU waits for its launches); and
`back_to_back_ms`, the mean of the same calls issued back to back between two events, as a
training loop issues them (host time below the GPU time of earlier calls is hidden).
With `--rounds R` every provider is measured R times in turn and its row pools them, so
that a slow spell of a shared host does not land on one provider only.
Memory: peak allocated during one step minus what was allocated before it (the inputs).

    python benchmarks/bench_attention.py --out results/ [--n 1024 4096 ...] [--d 64 128]
"""
import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time

import torch
from run_record import run_record  # noqa: E402  (benchmarks/, the script's folder)


def import_kernels():
    """The package's kernels, also from a plain checkout (the repository root on the path)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bob_compile.kernels import reference, triton_attention
    return triton_attention, reference


tri, reference = import_kernels()
# the kernels read BOB_COMPILE_* once; --variants changes them in-process, then reloads
kernel_settings = sys.modules[tri.__name__.rpartition(".")[0] + ".settings"]
kernels_package = sys.modules[tri.__name__.rpartition(".")[0]]
AttentionParams = importlib.import_module(tri.__name__.rpartition(".")[0] + ".params").AttentionParams
MIB = 2 ** 20


# --------------------------------------------------------------------------------------
# The steps
# --------------------------------------------------------------------------------------
def bob_step(q, k, v, do, gq, gk, gv, scale, causal, stage_times=None):
    """The step in the form autograd takes for these inputs."""
    step = bob_folded_step if kernels_package.fold_bob(q, k, v) else bob_chain_step
    return step(q, k, v, do, gq, gk, gv, scale, causal, stage_times)


class Stages:
    """CUDA events between the named stages of one step, into stage_times (name -> list of
    ms); does nothing when stage_times is None."""

    def __init__(self, stage_times):
        self.stage_times, self.marks = stage_times, []

    def mark(self, name=None):
        if self.stage_times is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))

    def done(self):
        if self.stage_times is None:
            return
        torch.cuda.synchronize()
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            self.stage_times.setdefault(name, []).append(a.elapsed_time(b))


def first_order_of_step(stages, q, k, v, do, scale, causal):
    """The forward and the first backward that start every second-order step."""
    stages.mark()
    params = AttentionParams(scale=scale, causal=causal)
    o, lse = tri.forward(q, k, v, params)
    stages.mark("forward")
    first = tri.backward(q, k, v, o, lse, do, None, params)
    stages.mark("backward")
    return params, o, lse, first


def bob_folded_step(q, k, v, do, gq, gk, gv, scale, causal, stage_times=None):
    """The folded form's step."""
    stages = Stages(stage_times)
    params, o, lse, first = first_order_of_step(stages, q, k, v, do, scale, causal)
    # R read from the first backward's dq, as autograd runs it
    bq, bk, bv, gdo, _ = tri.bob_folded(q, k, v, o, lse, do, None, gq, gk, gv, first[0], params)
    stages.mark("bob_folded")
    stages.done()
    return first, (bq, bk, bv, gdo)


def bob_chain_step(q, k, v, do, gq, gk, gv, scale, causal, stage_times=None):
    """The chain form's step."""
    stages = Stages(stage_times)
    params, o, lse, first = first_order_of_step(stages, q, k, v, do, scale, causal)
    bq, bk, bv, go, glse, gdo, _ = tri.bob(q, k, v, o, lse, do, None, gq, gk, gv, params)
    stages.mark("bob")
    dq2, dk2, dv2 = tri.backward(q, k, v, o, lse, go, glse, params)
    bq += dq2
    bk += dk2
    bv += dv2
    stages.mark("backward2")
    stages.done()
    return first, (bq, bk, bv, gdo)


def math_step(q, k, v, do, gq, gk, gv, scale, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v, do = (t.detach().requires_grad_() for t in (q, k, v, do))
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                             scale=scale, enable_gqa=gqa(q, k))
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        return torch.autograd.grad((dq, dk, dv), (q, k, v, do), (gq, gk, gv))


def native_first_order(q, k, v, do, gq, gk, gv, scale, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                         enable_gqa=gqa(q, k))
    return torch.autograd.grad(o, (q, k, v), do)


def bob_first_order(q, k, v, do, gq, gk, gv, scale, causal):
    params = AttentionParams(scale=scale, causal=causal)
    o, lse = tri.forward(q, k, v, params)
    return tri.backward(q, k, v, o, lse, do, None, params)


def op_autograd(q, k, v, do, gq, gk, gv, scale, causal, dropout_p=0.0, softcap=None):
    import bob_compile
    q, k, v, do = (t.detach().requires_grad_() for t in (q, k, v, do))
    o = bob_compile.attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                              enable_gqa=gqa(q, k), softcap=softcap)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    return torch.autograd.grad((dq, dk, dv), (q, k, v, do), (gq, gk, gv))


DROPOUT_P = 0.1     # Hugging Face's default attn_pdrop / attention_dropout


def op_autograd_dropout(q, k, v, do, gq, gk, gv, scale, causal):
    return op_autograd(q, k, v, do, gq, gk, gv, scale, causal, dropout_p=DROPOUT_P)


SOFTCAP = 50.0      # Gemma 2's attn_logit_softcapping


def op_autograd_softcap(q, k, v, do, gq, gk, gv, scale, causal):
    return op_autograd(q, k, v, do, gq, gk, gv, scale, causal, softcap=SOFTCAP)


_BIASES = {}


def learned_bias(q, k):
    """A per-head learned bias (1, Hq, L, S) in q's dtype, requiring grad, made once per
    shape (not timed)."""
    key = (q.shape[1], q.shape[2], k.shape[2], q.dtype, q.device)
    if key not in _BIASES:
        g = torch.Generator(device=q.device).manual_seed(3)
        _BIASES[key] = torch.randn(1, *key[:3], generator=g, device=q.device,
                                   dtype=q.dtype).requires_grad_()
    return _BIASES[key]


def op_autograd_bias(q, k, v, do, gq, gk, gv, scale, causal):
    """op_autograd with a learned bias: the bias's cotangents (dS, and Sbar with the
    cotangent of dS in F) added into its shape by the kernels, every order."""
    import bob_compile
    bias = learned_bias(q, k)
    gbias = torch.ones_like(bias)
    q, k, v, do = (t.detach().requires_grad_() for t in (q, k, v, do))
    o = bob_compile.attention(q, k, v, attn_mask=bias, is_causal=causal, scale=scale,
                              enable_gqa=gqa(q, k))
    dq, dk, dv, dbias = torch.autograd.grad(o, (q, k, v, bias), do, create_graph=True)
    return torch.autograd.grad((dq, dk, dv, dbias), (q, k, v, do, bias), (gq, gk, gv, gbias))


def torch_math_bias(q, k, v, do, gq, gk, gv, scale, causal):
    """The same step through SDPA's math (the alternative with a learned bias)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    bias = learned_bias(q, k)
    gbias = torch.ones_like(bias)
    q, k, v, do = (t.detach().requires_grad_() for t in (q, k, v, do))
    with sdpa_kernel(SDPBackend.MATH):
        mask = bias if not causal else bias.masked_fill(
            torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1),
            float("-inf"))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                             scale=scale, enable_gqa=gqa(q, k))
        dq, dk, dv, dbias = torch.autograd.grad(o, (q, k, v, bias), do, create_graph=True)
        return torch.autograd.grad((dq, dk, dv, dbias), (q, k, v, do, bias),
                                   (gq, gk, gv, gbias))


def op_autograd_calling_thread(q, k, v, do, gq, gk, gv, scale, causal):
    with torch.autograd.set_multithreading_enabled(False):
        return op_autograd(q, k, v, do, gq, gk, gv, scale, causal)


def op_autograd_first_order(q, k, v, do, gq, gk, gv, scale, causal):
    import bob_compile
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = bob_compile.attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa(q, k))
    return torch.autograd.grad(o, (q, k, v), do)


def op_forward_over_reverse(q, k, v, do, gq, gk, gv, scale, causal):
    """The Hessian-vector product of <attention(q, k, v), dO> along (gq, gk, gv), forward
    over reverse: torch.func.jvp of torch.func.grad through the op (attn_fwd, attn_bwd, then
    attn_fwd_jvp and attn_bwd_jvp). op_autograd is the same product reverse over reverse."""
    import bob_compile

    def loss(q, k, v):
        return (bob_compile.attention(q, k, v, is_causal=causal, scale=scale,
                                      enable_gqa=gqa(q, k)) * do).sum()
    return torch.func.jvp(torch.func.grad(loss, argnums=(0, 1, 2)), (q, k, v), (gq, gk, gv))


PROVIDERS = {"bob_compile": bob_step, "bob_compile_folded": bob_folded_step,
             "bob_compile_chain": bob_chain_step, "op_autograd": op_autograd,
             "op_autograd_folded": op_autograd, "op_autograd_chain": op_autograd,
             "op_autograd_sbar_split": op_autograd, "op_autograd_no_edge_split": op_autograd,
             "op_autograd_calling_thread": op_autograd_calling_thread,
             "op_autograd_dropout": op_autograd_dropout,
             "op_autograd_softcap": op_autograd_softcap,
             "op_autograd_bias": op_autograd_bias, "torch_math_bias": torch_math_bias,
             "op_forward_over_reverse": op_forward_over_reverse,
             "op_autograd_first_order": op_autograd_first_order,
             "op_autograd_python_node": op_autograd,
             "op_autograd_first_order_python_node": op_autograd_first_order,
             "torch_math": math_step,
             "torch_fused_first_order": native_first_order,
             "bob_compile_first_order": bob_first_order}


# --------------------------------------------------------------------------------------
def visible_pairs(n, causal):
    return n * (n + 1) // 2 if causal else n * n


def make_inputs(B, H, n, d, dtype, sets, kv_heads=None):
    """q, k, v, do, gq, gk, gv; k, v and their cotangents with kv_heads heads (GQA)."""
    heads = (H, kv_heads or H, kv_heads or H, H, H, kv_heads or H, kv_heads or H)
    return [tuple(torch.randn(B, h, n, d, device="cuda", dtype=dtype) for h in heads)
            for _ in range(sets)]


def gqa(q, k):
    return q.shape[1] != k.shape[1]


def measure(fn, inputs, scale, causal, reps, warmup):
    """Median ms over `reps` calls (rotating input sets), peak extra MiB, first-call s."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*inputs[0], scale, causal)  # compiles, and tunes at a new length bucket
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    for i in range(warmup):
        fn(*inputs[i % len(inputs)], scale, causal)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*inputs[0], scale, causal)
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / MIB
    del out
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs[i % len(inputs)], scale, causal)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    # back to back, as in a training loop: the host runs ahead of the GPU, so a host cost
    # below the GPU time of the calls before it is hidden (one synchronize at the end)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        fn(*inputs[i % len(inputs)], scale, causal)
    end.record()
    torch.cuda.synchronize()
    back_to_back = start.elapsed_time(end) / reps
    return statistics.median(times), peak_mib, first_call_s, times, back_to_back


def single_shot(fn, inputs, scale, causal):
    """One timed call with its peak memory, for lengths where every call costs a minute."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn(*inputs, scale, causal)
    end.record()
    torch.cuda.synchronize()
    del out
    return start.elapsed_time(end), (torch.cuda.max_memory_allocated() - base) / MIB


def stage_breakdown(step, inputs, scale, causal, reps):
    stages = {}
    for i in range(reps):
        step(*inputs[i % len(inputs)], scale, causal, stage_times=stages)
    return {k: statistics.median(v) for k, v in stages.items()}


PROVIDER_SETTINGS = ("BOB_COMPILE_DEV_BOB_SCHEDULE", "BOB_COMPILE_DEV_BWD_DQ", "BOB_COMPILE_DEV_BOB_FORM",
                     "BOB_COMPILE_CPP_NODE", "BOB_COMPILE_DEV_SBAR_SPLIT", "BOB_COMPILE_DEV_EDGE_SPLIT")


def clear_provider_settings():
    """The environment without the variables a provider sets (then the settings re-read)."""
    for key in PROVIDER_SETTINGS:
        os.environ.pop(key, None)
    kernel_settings.reload()


def accuracy(B, H, n, d, causal, dtype, sbar_split=False):
    """Relative L2 vs float64 of every output of the step (folded form; chain_* the chain
    form's; no_edge_split_* both with BOB_COMPILE_DEV_EDGE_SPLIT=0; split_* both with
    BOB_COMPILE_DEV_SBAR_SPLIT=1 where sbar_split), and of first order."""
    scale = 1.0 / math.sqrt(d)
    q, k, v, do, gq, gk, gv = make_inputs(B, H, n, d, dtype, 1)[0]
    first, second = bob_folded_step(q, k, v, do, gq, gk, gv, scale, causal)
    chain = bob_chain_step(q, k, v, do, gq, gk, gv, scale, causal)[1]
    variants = {"no_edge_split_": ("BOB_COMPILE_DEV_EDGE_SPLIT", "0")}
    if sbar_split:
        variants["split_"] = ("BOB_COMPILE_DEV_SBAR_SPLIT", "1")
    varied = {}
    for prefix, (variable, value) in variants.items():
        os.environ[variable] = value
        kernel_settings.reload()
        varied[prefix] = bob_folded_step(q, k, v, do, gq, gk, gv, scale, causal)[1]
        varied[prefix + "chain_"] = bob_chain_step(q, k, v, do, gq, gk, gv, scale, causal)[1]
        os.environ.pop(variable)
        kernel_settings.reload()
    params = AttentionParams(scale=scale, causal=causal)
    o, _ = tri.forward(q, k, v, params)
    x = [t.double() for t in (q, k, v, do, gq, gk, gv)]
    ro, rlse = reference.forward(x[0], x[1], x[2], params)
    rdq, rdk, rdv = reference.backward(x[0], x[1], x[2], ro, rlse, x[3], None, params)
    rb = reference.bob(x[0], x[1], x[2], ro, rlse, x[3], None, x[4], x[5], x[6], params)
    r2 = reference.backward(x[0], x[1], x[2], ro, rlse, rb[3], rb[4], params)
    exact = dict(o=ro, dq=rdq, dk=rdk, dv=rdv, gq=rb[0] + r2[0], gk=rb[1] + r2[1],
                 gv=rb[2] + r2[2], gdo=rb[5])
    ours = dict(o=o, dq=first[0], dk=first[1], dv=first[2], gq=second[0], gk=second[1],
                gv=second[2], gdo=second[3])
    for name, t in zip(("gq", "gk", "gv", "gdo"), chain):
        exact["chain_" + name], ours["chain_" + name] = exact[name], t
    for prefix, outputs in varied.items():
        for name, t in zip(("gq", "gk", "gv", "gdo"), outputs):
            exact[prefix + name], ours[prefix + name] = exact[name], t
    return {name: ((ours[name].double() - e).norm() / e.norm()).item()
            for name, e in exact.items()}


def use_provider_settings(prov):
    """The BOB_COMPILE_* settings a provider's name asks for, and only those."""
    clear_provider_settings()
    for form in ("folded", "chain"):
        if prov.split("@")[0].endswith("_" + form):
            os.environ["BOB_COMPILE_DEV_BOB_FORM"] = form
    if prov.endswith("_python_node"):
        os.environ["BOB_COMPILE_CPP_NODE"] = "off"
    if prov.endswith("_sbar_split"):
        os.environ["BOB_COMPILE_DEV_SBAR_SPLIT"] = "1"
    if prov.endswith("_no_edge_split"):
        os.environ["BOB_COMPILE_DEV_EDGE_SPLIT"] = "0"
    if "@" in prov:
        os.environ["BOB_COMPILE_DEV_BOB_SCHEDULE"], os.environ["BOB_COMPILE_DEV_BWD_DQ"] = \
            prov.split("@")[1].split(":")
    kernel_settings.reload()


# --------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+",
                    default=[1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="key/value heads (grouped-query attention; default: --heads)")
    ap.add_argument("--math-max-n", type=int, default=8192)
    ap.add_argument("--max-step-seconds", type=float, default=60.0,
                    help="skip larger N once one step of a provider takes longer")
    ap.add_argument("--single-shot-n", type=int, default=1 << 30,
                    help="from this N on, time one call only (kernels already compiled at "
                         "smaller N in this process), with its peak memory")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every provider this many times, in turn; rows pool the "
                         "single calls of all rounds and take the median back-to-back time")
    ap.add_argument("--accuracy-n", type=int, default=2048)
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--variants", nargs="+", default=[],
                    help="extra bob_compile_chain rows as BOB_SCHEDULE:BWD_DQ pairs, e.g. atomic:two_pass")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention: needs a CUDA device (it times the Triton kernels on a GPU)")
    os.makedirs(args.out, exist_ok=True)
    dtype = torch.bfloat16
    node_build_s = None
    if any(p.startswith("op_") for p in args.providers):
        # the op's C++ node builds in the background on first use: have it ready first
        from bob_compile.eager import node as eager_node
        start = time.perf_counter()
        node_ready = eager_node.extension(wait=True) is not None
        node_build_s = time.perf_counter() - start
        print(f"C++ node {'ready' if node_ready else 'NOT built'} in {node_build_s:.1f} s")
    B, H = args.batch, args.heads
    causals = {"both": [True, False], "yes": [True], "no": [False]}[args.causal]
    rows = []
    json_path = os.path.join(args.out, f"bench_attention{args.tag}.json")
    meta = dict(**run_record(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                dtype=str(dtype), B=B, H=H, kv_heads=args.kv_heads or H,
                flop_convention="per visible pair: fwd 4d, bwd 10d, BoB 36d (step 50d)",
                env={k: v for k, v in os.environ.items() if k.startswith("BOB_COMPILE")},
                cpp_node_build_or_load_s=node_build_s)

    for d in args.d:
        for causal in causals:
            slow = set()
            for n in args.n:
                scale = 1.0 / math.sqrt(d)
                sets = 2 if n <= 65536 else 1
                inputs = make_inputs(B, H, n, d, dtype, sets, args.kv_heads)
                pairs = B * H * visible_pairs(n, causal)
                providers = args.providers + [f"bob_compile_chain@{x}" for x in args.variants]
                reps = 10 if n <= 16384 else (4 if n <= 65536 else 2)
                warmup = 2 if n <= 65536 else 0
                # rounds: every provider once per round, in turn, so that a slow spell of the
                # host or GPU lands on all of them rather than on one
                runs = {}
                for _ in range(args.rounds if n < args.single_shot_n else 1):
                    for prov in providers:
                        if prov in slow or (prov == "torch_math" and n > args.math_max_n):
                            continue
                        use_provider_settings(prov)
                        try:
                            if n >= args.single_shot_n:
                                ms, mib = single_shot(PROVIDERS[prov.split("@")[0]], inputs[0],
                                                      scale, causal)
                                run = (ms, mib, float("nan"), [ms], float("nan"))
                            else:
                                run = measure(PROVIDERS[prov.split("@")[0]], inputs, scale,
                                              causal, reps, warmup)
                        except torch.OutOfMemoryError:
                            rows.append(dict(provider=prov, n=n, d=d, causal=causal, oom=True))
                            torch.cuda.empty_cache()
                            slow.add(prov)
                            continue
                        runs.setdefault(prov, []).append(run)
                        if run[0] > args.max_step_seconds * 1e3:
                            slow.add(prov)
                for prov in providers:
                    if prov not in runs:
                        continue
                    times = [t for run in runs[prov] for t in run[3]]
                    ms = statistics.median(times)
                    back_to_back = statistics.median(run[4] for run in runs[prov])
                    mib, first_s = runs[prov][0][1], runs[prov][0][2]
                    order = 50 if prov.startswith(("bob_compile", "op_autograd", "op_forward",
                                                   "torch_math")) \
                        and "first_order" not in prov else 14
                    row = dict(provider=prov, n=n, d=d, causal=causal, ms=ms, times_ms=times,
                               back_to_back_ms=back_to_back, rounds=len(runs[prov]),
                               peak_extra_mib=mib, first_call_s=first_s,
                               tflops=order * d * pairs / (ms * 1e-3) / 1e12)
                    if prov.startswith("bob_compile") and order == 50 and n < args.single_shot_n:
                        use_provider_settings(prov)     # the stages run this provider again
                        row["stages_ms"] = stage_breakdown(PROVIDERS[prov.split("@")[0]],
                                                           inputs, scale, causal,
                                                           min(reps, 3) if n <= 65536 else 1)
                    rows.append(row)
                    print(f"{prov:24s} d={d:3d} causal={causal!s:5s} N={n:7d} {ms:10.2f} ms "
                          f"({back_to_back:.2f} back to back) "
                          f"{mib:9.1f} MiB {row['tflops']:6.1f} TFLOP/s first {first_s:5.1f} s "
                          f"{row.get('stages_ms', '')}", flush=True)
                del inputs
                torch.cuda.empty_cache()
                with open(json_path, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)

    clear_provider_settings()       # the last provider's settings must not reach the rest
    if args.accuracy_n:
        acc = {}
        for causal in causals:
            for d in args.d:
                acc[f"d{d}_causal{int(causal)}"] = accuracy(
                    1, 4, args.accuracy_n, d, causal, dtype,
                    sbar_split="op_autograd_sbar_split" in args.providers)
                print("accuracy", d, causal, {k: f"{v:.2e}" for k, v in acc[f'd{d}_causal{int(causal)}'].items()})
        meta["accuracy_rel_l2_vs_float64"] = dict(n=args.accuracy_n, B=1, H=4, results=acc)
    try:
        from bob_compile.kernels import tuning
        meta["tuned_configs"] = tuning.TUNING_CACHE._load()
    except ImportError:         # no Triton
        pass
    with open(json_path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plot_attention import plot
        plot(rows, os.path.join(args.out, f"bench_attention{args.tag}.png"))
    except ImportError:
        print("matplotlib missing: plot later with benchmarks/plot_attention.py")
    print_table(rows)


def print_table(rows):
    print(f"\n{'provider':24s} {'d':>4s} {'causal':>6s} {'N':>8s} {'ms':>10s} {'b2b ms':>8s} "
          f"{'MiB':>9s} {'TFLOP/s':>8s}")
    for r in rows:
        if r.get("oom"):
            print(f"{r['provider']:24s} {r['d']:4d} {r['causal']!s:>6s} {r['n']:8d} {'OOM':>10s}")
            continue
        print(f"{r['provider']:24s} {r['d']:4d} {r['causal']!s:>6s} {r['n']:8d} {r['ms']:10.2f} "
              f"{r.get('back_to_back_ms', float('nan')):8.2f} {r['peak_extra_mib']:9.1f} "
              f"{r['tflops']:8.1f}")


if __name__ == "__main__":
    main()
