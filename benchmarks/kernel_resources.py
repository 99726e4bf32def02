"""Registers, spills, shared memory and tensor-core instructions of the Triton kernels,
compiled ahead of time for the H200 (sm_90a) on any machine, no GPU needed.

Uses Triton's own ptxas (-v) and nvdisasm. Prints one line per kernel and launch config:
the configs are the ones the tuner picked on the H200, listed in main() below. With
--candidates: the shared memory of every candidate config of each launch site, in order.

    python benchmarks/kernel_resources.py [--candidates] [--dropout] [--softcap]
"""
import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
FLOAT_ARGS = ("qk_scale_log2", "scale", "keep_scale", "softcap")
FLOAT_TENSORS = ("LSE", "D", "TD", "TLSE")   # row statistics, fp32 whatever the inputs


def load_kernels():
    pkg = types.ModuleType("bob_compile_kernels_aot")
    pkg.__path__ = [os.path.join(ROOT, "bob_compile", "kernels")]
    sys.modules[pkg.__name__] = pkg
    return (importlib.import_module(pkg.__name__ + ".triton_bob"),
            importlib.import_module(pkg.__name__ + ".triton_backward"),
            importlib.import_module(pkg.__name__ + ".triton_forward_mode"))


def compile_for_sm90(fn, signature, constexprs, num_warps, num_stages):
    """(the compiled kernel, ptxas -v's report, the SASS listing) of a Triton function
    compiled for sm_90a on this machine."""
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([os.path.join(NVIDIA_BIN, "ptxas"), "-arch=sm_90a", "-v", ptx,
                                 "-o", cubin], capture_output=True, text=True).stderr
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(NVIDIA_BIN, "nvdisasm"), cubin],
                              capture_output=True, text=True).stdout
    return kernel, report, sass


def resources(fn, constexprs, num_warps, num_stages, dtype="bf16"):
    """ptxas' register/spill/stack report and the SASS matrix-instruction counts."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "SEED":        # dropout's seed: an int64 tensor
            signature[name] = "*i64"
        elif name.isupper() and name not in ("L", "S"):  # tensors: upper-case, but lengths
            signature[name] = ("*fp32" if name.endswith("_ACC") or name in FLOAT_TENSORS
                               else f"*{dtype}")
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    kernel, report, sass = compile_for_sm90(fn, signature, constexprs, num_warps, num_stages)
    number = lambda pattern: int(re.search(pattern, report).group(1))  # noqa: E731
    return dict(registers=number(r"Used (\d+) registers"),
                spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"),
                stack=number(r"(\d+) bytes stack frame"),
                shared=kernel.metadata.shared,
                hgmma=len(re.findall(r"\bHGMMA\b", sass)), hmma=len(re.findall(r"\bHMMA\b", sass)),
                mufu=len(re.findall(r"\bMUFU\.", sass)))


DROPOUT = False     # --dropout: the kernels as a call with attention dropout compiles them
SOFTCAP = 0         # --softcap (--softcap-newton): as a call with soft-capped scores compiles them


def causal_constexprs(fn, is_bob, d, block_m, block_n):
    """The constexprs of an unmasked causal call with every cotangent or tangent given, as
    autograd runs it (is_bob: False, True for the chain form's BoB, "fold", "fold_dq")."""
    attention = importlib.import_module("bob_compile_kernels_aot.triton_attention")
    consts = dict(HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_E=d, BLOCK_EV=d, BLOCK_M=block_m,
                  BLOCK_N=block_n, CAUSAL=True, MASK_KIND=0, MASK_PATH=0,
                  DOT_PRECISION="ieee", HAS_DLSE=False, SPLIT_SBAR=False,
                  SPLIT_EDGES=True,          # as a causal call runs
                  ROW_ATOMICS=False, DQ_ATOMICS=False,
                  HAS_TQ=True, HAS_TK=True, HAS_TV=True, HAS_TS=True, HAS_TLSE=True,
                  HAS_TDO=True,
                  # no learned bias: what a plain causal call compiles (dropout and a
                  # soft cap if asked)
                  DROPOUT=DROPOUT, SOFTCAP=SOFTCAP, HAS_DM=False, HAS_GDM=False, HAS_GM=False,
                  RELATIVE=False)
    if is_bob:
        consts.update(HAS_GDQ=True, HAS_GDK=True, HAS_GDV=True,
                      FOLD=is_bob in ("fold", "fold_dq"))
    # R read from the first backward's dq; heads wider than 64 read B from a forward
    consts.update(HAS_DQ=is_bob == "fold_dq",
                  HAS_B=is_bob == "fold_dq" and d > attention.ACCUMULATE_B_MAX_HEAD_DIM)
    return {name: value for name, value in consts.items() if name in fn.arg_names}


def candidates_shared_memory():
    """Shared memory of every candidate config of each unmasked launch site, in list order
    (bf16, causal): an untimed choice takes the first that builds on the device
    (tuning._first_that_builds), so each site needs one that fits the smallest
    device meant to run it (an A100: 163 KiB; consumer GPUs: about 99 KiB). Compiled for
    sm_90; other architectures' figures differ somewhat."""
    import torch
    bob, bwd, forward_mode = load_kernels()
    pkg = "bob_compile_kernels_aot."
    forward = importlib.import_module(pkg + "triton_forward")
    for module in (bob, bwd, forward, forward_mode):
        module.interpreting = lambda: False
    bf16 = torch.bfloat16
    print(f"{'launch site':18s} {'d':>4s}  shared memory of each candidate, KiB")
    for d in (64, 128):
        b = d > 64      # heads above 64 run the folded row pass with B read (fold=False list)
        sites = [
            ("forward", forward._forward_kernel, False, forward.forward_candidates(bf16, d, d)),
            ("bwd columns", bwd._column_kernel, False, bwd.column_candidates(bf16, d, d, False)),
            ("bwd dq", bwd._dq_kernel, False, bwd.dq_candidates(bf16, d, d)),
            ("bob rows (chain)", bob._row_kernel, True, bob.row_candidates(bf16, d, d, False)),
            ("bob cols (chain)", bob._column_kernel, True,
             bob.column_candidates(bf16, d, d, False)),
            ("fold rows dq", bob._row_kernel, "fold_dq",
             bob.row_candidates(bf16, d, d, not b, reads_dq=True)),
            ("fold cols causal", bob._column_kernel, "fold",
             bob.column_candidates(bf16, d, d, False, fold=True, causal=True)),
            ("fwd jvp", forward_mode._forward_jvp_kernel, False,
             forward_mode.forward_jvp_candidates(bf16, d, d)),
            ("bwd jvp rows", forward_mode._backward_jvp_rows_kernel, False,
             forward_mode.backward_jvp_row_candidates(bf16, d, d)),
            ("bwd jvp cols", forward_mode._backward_jvp_columns_kernel, False,
             forward_mode.backward_jvp_column_candidates(bf16, d, d)),
        ]
        for name, fn, is_bob, candidates in sites:
            kib = [resources(fn, causal_constexprs(fn, is_bob, d, c["BLOCK_M"], c["BLOCK_N"]),
                             c["num_warps"], c["num_stages"])["shared"] / 1024
                   for c in candidates]
            print(f"{name:18s} {d:4d}  " + ", ".join(f"{x:.0f}" for x in kib)
                  + f"   (smallest {min(kib):.0f})", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dropout", action="store_true",
                    help="compile the kernels with attention dropout on")
    ap.add_argument("--softcap", action="store_true",
                    help="compile the kernels with soft-capped scores")
    ap.add_argument("--softcap-newton", action="store_true",
                    help="soft-capped, tanh's reciprocal by Newton's iterations "
                         "(BOB_COMPILE_DEV_SOFTCAP_RECIPROCAL=newton)")
    ap.add_argument("--candidates", action="store_true",
                    help="the shared memory of every candidate of each launch site instead")
    args = ap.parse_args(argv)
    global DROPOUT, SOFTCAP
    DROPOUT, SOFTCAP = args.dropout, 2 if args.softcap_newton else int(args.softcap)
    if args.candidates:
        candidates_shared_memory()
        return
    bob, bwd, forward_mode = load_kernels()
    print(f"{'kernel':14s} {'d':>4s} {'tile MxN':>9s} {'warps':>5s} {'stages':>6s} {'regs':>5s} "
          f"{'spill st/ld B':>14s} {'stack':>6s} {'smem':>7s} {'HGMMA':>6s} {'HMMA':>5s} {'MUFU':>5s}")
    # (kernel, function, pick flags, {d: (BLOCK_M, BLOCK_N, warps, stages)}) as tuned on H200
    tuned = [
        ("bob rows", bob._row_kernel, True, {64: (64, 64, 4, 2), 128: (64, 32, 4, 2)}),
        ("bob columns", bob._column_kernel, True, {64: (64, 64, 4, 2), 128: (32, 64, 4, 2)}),
        ("folded rows", bob._row_kernel, "fold", {64: (64, 32, 4, 2), 128: (64, 32, 4, 2)}),
        ("folded rows", bob._row_kernel, "fold", {64: (64, 64, 8, 2), 128: (32, 64, 4, 2)}),
        # R read from the first backward's dq (HAS_DQ, what autograd runs): one accumulator
        # less; at d = 128 B is read too (HAS_B)
        ("fold rows dq", bob._row_kernel, "fold_dq", {64: (64, 32, 4, 2), 128: (64, 32, 4, 2)}),
        ("fold rows dq", bob._row_kernel, "fold_dq", {64: (64, 64, 4, 2), 128: (32, 64, 4, 2)}),
        ("fold rows dq", bob._row_kernel, "fold_dq", {64: (64, 64, 8, 2), 128: (64, 64, 8, 2)}),
        # the first candidates with dq at d = 64 since 2026-12-02 (three pipeline stages), and
        # without dq
        ("fold rows dq", bob._row_kernel, "fold_dq", {64: (128, 64, 8, 3)}),
        ("folded rows", bob._row_kernel, "fold", {64: (64, 32, 4, 3)}),
        ("folded cols", bob._column_kernel, "fold", {64: (64, 64, 4, 2), 128: (32, 64, 4, 2)}),
        ("bwd columns", bwd._column_kernel, False, {64: (32, 128, 4, 3), 128: (32, 64, 4, 2)}),
        ("bwd dq", bwd._dq_kernel, False, {64: (64, 64, 4, 2), 128: (64, 32, 4, 2)}),
        # forward mode, every tangent given: the first candidates (triton_forward_mode.py)
        ("fwd jvp", forward_mode._forward_jvp_kernel, False,
         {64: (64, 64, 4, 3), 128: (128, 64, 8, 2)}),
        ("bwd jvp rows", forward_mode._backward_jvp_rows_kernel, False,
         {64: (128, 64, 8, 3), 128: (128, 32, 8, 3)}),
        ("bwd jvp cols", forward_mode._backward_jvp_columns_kernel, False,
         {64: (64, 128, 8, 3), 128: (32, 128, 8, 3)}),
    ]
    for name, fn, is_bob, configs in tuned:
        for d, (bm, bn, warps, stages) in configs.items():
            r = resources(fn, causal_constexprs(fn, is_bob, d, bm, bn), warps, stages)
            print(f"{name:14s} {d:4d} {bm:4d}x{bn:<4d} {warps:5d} {stages:6d} {r['registers']:5d} "
                  f"{r['spill_stores']:6d}/{r['spill_loads']:<7d} {r['stack']:6d} "
                  f"{r['shared']:7d} {r['hgmma']:6d} {r['hmma']:5d} {r['mufu']:5d}")


if __name__ == "__main__":
    main()
