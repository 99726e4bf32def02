"""Plot the JSON written by bench_attention.py: time and memory against N, one panel per
(head dim, causal), every provider.

    python benchmarks/plot_attention.py benchmarks/results/bench_attention_*.json \
        -o benchmarks/results/bench_attention.png

Needs matplotlib (pip install -e ".[bench]"); without it the script says so and exits.
"""
import argparse
import importlib.util
import json
import sys

PROVIDER_STYLE = {
    "bob_compile": ("bob_compile 2nd-order step", "C0", "o-"),
    "torch_math": ("PyTorch math 2nd-order step", "C3", "s-"),
    "torch_fused_first_order": ("PyTorch fused SDPA, 1st order", "C2", "^--"),
    "bob_compile_first_order": ("bob_compile, 1st order", "C1", "v:"),
}


def load_rows(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [r for r in json.load(f)["rows"] if not r.get("oom")]
    return rows


def plot(rows, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["d"], r["causal"]) for r in rows}, key=lambda x: (x[0], not x[1]))
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7.5), squeeze=False)
    for col, (d, causal) in enumerate(panels):
        for prov, (label, color, style) in PROVIDER_STYLE.items():
            pts = {}
            for r in rows:
                if r["provider"] == prov and r["d"] == d and r["causal"] == causal:
                    pts[r["n"]] = r  # later files win (e.g. the 1M run)
            if not pts:
                continue
            ns = sorted(pts)
            axes[0][col].plot(ns, [pts[n]["ms"] for n in ns], style, color=color, label=label,
                              ms=4)
            axes[1][col].plot(ns, [pts[n]["peak_extra_mib"] for n in ns], style, color=color,
                              label=label, ms=4)
        axes[0][col].set_title(f"d={d}, {'causal' if causal else 'non-causal'}, B=1 H=12 bf16")
        for row, ylabel in ((0, "ms (median)"), (1, "peak memory above inputs (MiB)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Softmax attention on one H200: second-order step vs first order")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="outputs of bench_attention.py")
    ap.add_argument("-o", "--out", default="attention.png")
    args = ap.parse_args()
    if importlib.util.find_spec("matplotlib") is None:
        print('plot_attention: matplotlib is not installed; no plot written '
              '(pip install -e ".[bench]")')
        return 0
    plot(load_rows(args.json), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
