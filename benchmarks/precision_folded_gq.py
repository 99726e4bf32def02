"""Where the folded BoB's gq and gdo errors come from, in a float64 simulation (CPU, no GPU
needed).

gq = s (Omega - E B) - alpha dq with Omega = Sbar k + dS gdk, B = P k (docs/second-order.md,
"The folded form"). The kernels round some intermediates to bf16 before a GEMM; this script
applies one rounding at a time to otherwise exact float64 math (bf16 inputs, causal,
B = 1, H = 2, N = 2048, d = 64 by default) and prints gq's and gdo's relative L2 error for
each; the last rows keep the diagonal's tiles unrounded, as BOB_COMPILE_DEV_EDGE_SPLIT does.

    python benchmarks/precision_folded_gq.py [--n 2048] [--d 64] [--heads 2]
"""
import argparse

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    f64, n, d = torch.float64, args.n, args.d

    def bf16(t):
        return t.to(torch.bfloat16).to(f64)
    q, k, v, do, gdq, gdk, gdv = (bf16(torch.randn(1, args.heads, n, d, dtype=f64))
                                  for _ in range(7))
    scale = d ** -0.5
    above = torch.ones(n, n, dtype=torch.bool).triu(1)
    P = (q @ k.transpose(-1, -2) * scale).masked_fill(above, float("-inf")).softmax(-1)
    o = P @ v
    delta = do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True)   # dP - D
    dS = P * delta
    F = scale * (gdq @ k.transpose(-1, -2) + q @ gdk.transpose(-1, -2))
    sbar = P * (do @ gdv.transpose(-1, -2) + F * delta)                  # alpha- and E-free
    alpha, E = (P * F).sum(-1, keepdim=True), sbar.sum(-1, keepdim=True)
    dq = scale * dS @ k

    def gq_with(sbar_=sbar, ds_=dS, p_=P, dq_=dq):
        return scale * (sbar_ @ k + ds_ @ gdk - E * (p_ @ k)) - alpha * dq_
    exact = gq_with()

    def rel(x):
        return ((x - exact).norm() / exact.norm()).item()
    # the tiles of 128 queries x 64 keys that the causal diagonal crosses (the row pass's
    # masked tiles), where BOB_COMPILE_DEV_EDGE_SPLIT keeps Sbar, dS and P unrounded
    i = torch.arange(n)
    row_block, key_block = i[:, None] // 128, i[None, :] // 64
    diagonal = (key_block >= row_block * 2) & (key_block <= row_block * 2 + 1)

    def off_diagonal(t):
        return torch.where(diagonal, t, bf16(t))
    rows = [("the output's own rounding", bf16(exact)),
            ("Sbar before its GEMM with k", gq_with(sbar_=bf16(sbar))),
            ("dS before its GEMM with gdk", gq_with(ds_=bf16(dS))),
            ("P before B = P k", gq_with(p_=bf16(P))),
            ("dq (R read from the first backward)", gq_with(dq_=bf16(dq))),
            ("all of the above", bf16(gq_with(bf16(sbar), bf16(dS), bf16(P), bf16(dq)))),
            ("all but Sbar", bf16(gq_with(sbar, bf16(dS), bf16(P), bf16(dq)))),
            ("all, diagonal tiles split (the default)",
             bf16(gq_with(off_diagonal(sbar), off_diagonal(dS), bf16(P), bf16(dq))))]
    print(f"gq relative L2 error, one bf16 rounding at a time (N={n}, d={d}, causal)")
    for name, value in rows:
        print(f"  {name:42s} {rel(value):.2e}")

    # gdo = P gdv + A v - alpha o, A = P F (the row pass; o is the forward's bf16 output)
    A = P * F

    def gdo_with(p_=P, a_=A, o_=o):
        return p_ @ gdv + a_ @ v - alpha * o_
    exact = gdo_with()
    rows = [("the output's own rounding", bf16(exact)),
            ("P before its GEMM with gdv", gdo_with(p_=bf16(P))),
            ("A before its GEMM with v", gdo_with(a_=bf16(A))),
            ("o (the forward's output)", gdo_with(o_=bf16(o))),
            ("all of the above", bf16(gdo_with(bf16(P), bf16(A), bf16(o)))),
            ("all, diagonal tiles split (the default)",
             bf16(gdo_with(off_diagonal(P), off_diagonal(A), bf16(o))))]
    print("gdo relative L2 error, likewise")
    for name, value in rows:
        print(f"  {name:42s} {rel(value):.2e}")


if __name__ == "__main__":
    main()
