"""What attention dropout's keep mask costs a kernel, compiled ahead of time for sm_90a (no
GPU needed): a probe loop shaped like the forward (per key tile: S = q kᵀ, Z, then (S Z) k),
compiled without the mask, with the mask as bob_compile draws it (triton_dropout.dropout_tile:
Philox-2x32 of philox.ROUNDS rounds, 16 bits per element) and with the earlier definition (Triton's
tl.randint4x, Philox-4x32-10, 32 bits per element, the same 2 x 2 groups). Prints registers,
spills, the convert_layouts left in the TTGIR (a mask whose words moved between threads
would add some) and the SASS instruction count of each.

    python benchmarks/dropout_mask_cost.py
"""
import collections
import re

import triton
import triton.language as tl

from bob_compile.kernels.triton_dropout import dropout_tile
from kernel_resources import compile_for_sm90  # noqa: E402  (benchmarks/, the script's folder)

BLOCK_M, BLOCK_N, HEAD_DIM, WARPS, STAGES = 128, 64, 64, 8, 2


@triton.jit
def _mask_4x32(seed_ptr, m0, n0, S, drop_threshold, keep_scale, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The earlier definition: one tl.randint4x call per 2 x 2 group, a word per element."""
    seed = tl.load(seed_ptr)
    rows = (m0 // 16) * 8 + tl.arange(0, BLOCK_M // 2)
    cols = n0 // 16 * 8 + tl.arange(0, BLOCK_N // 2)
    counters = rows.to(tl.int64)[:, None] * ((S + 15) // 16 * 8) + cols[None, :]
    w0, w1, w2, w3 = tl.randint4x(seed, counters, 10)
    words = tl.join(tl.join(w0, w1), tl.join(w2, w3))
    words = tl.reshape(words, (BLOCK_M // 16, 8, BLOCK_N // 16, 8, 2, 2))
    words = tl.reshape(tl.permute(words, (0, 5, 1, 2, 4, 3)), (BLOCK_M, BLOCK_N))
    threshold = tl.full((), drop_threshold, tl.int32).to(tl.uint32, bitcast=True)
    return tl.where(words >= threshold, keep_scale, 0.0)


@triton.jit
def _probe(SEED, Q, K, OUT, L, S, drop_threshold, keep_scale, MASK: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    offs_m, offs_d = m0 + tl.arange(0, BLOCK_M), tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(0, S, BLOCK_N):
        k = tl.load(K + (n0 + tl.arange(0, BLOCK_N))[:, None] * HEAD_DIM + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        if MASK == 1:
            s = s * dropout_tile(SEED, tl.program_id(1), L, m0, n0, S, drop_threshold, keep_scale,
                                 BLOCK_M, BLOCK_N)
        if MASK == 2:
            s = s * _mask_4x32(SEED, m0, n0, S, drop_threshold, keep_scale, BLOCK_M, BLOCK_N)
        acc += tl.dot(s.to(tl.bfloat16), k)
    tl.store(OUT + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc)


def compiled_cost(mask):
    signature = dict(SEED="*i64", Q="*bf16", K="*bf16", OUT="*fp32", L="i32", S="i32",
                     drop_threshold="i32", keep_scale="fp32", MASK="constexpr",
                     BLOCK_M="constexpr", BLOCK_N="constexpr", HEAD_DIM="constexpr")
    kernel, report, sass = compile_for_sm90(
        _probe, signature, dict(MASK=mask, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM),
        WARPS, STAGES)
    opcodes = collections.Counter(
        m.group(1).split(".")[0] for m in re.finditer(
            r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    return dict(registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", report).group(1)),
                convert_layouts=kernel.asm["ttgir"].count("convert_layout"),
                instructions=sum(opcodes.values()), opcodes=opcodes)


def main():
    print(f"probe: {BLOCK_M}x{BLOCK_N} tiles, d = {HEAD_DIM}, {WARPS} warps, {STAGES} stages, sm_90a")
    base = None
    for name, mask in (("no mask", 0), ("Philox-2x32, 16 bits (ours)", 1),
                       ("Philox-4x32, 32 bits (before)", 2)):
        cost = compiled_cost(mask)
        base = base or cost
        top = ", ".join(f"{op} {n}" for op, n in cost["opcodes"].most_common(5))
        print(f"{name:30s} registers {cost['registers']:3d} (+{cost['registers'] - base['registers']:3d})"
              f"  spills {cost['spill_bytes']:4d} B  convert_layouts {cost['convert_layouts']}"
              f"  instructions {cost['instructions']:5d} (+{cost['instructions'] - base['instructions']:4d})"
              f"  [{top}]")


if __name__ == "__main__":
    main()
