"""Plot the JSON of benchmarks/bench_e2e.py.

A sweep over sequence lengths: one column per workload (Sophia-H step with Hessian
estimate, plain Sophia-H step, MAML outer step), time on top, peak memory below, math and
flashbob as two lines; where math ran out of memory, an "x" on the top edge marks the first
length it failed at. MAML meta-gradients over tasks (--maml-tasks rows): one panel per
JSON file (each panel one run), a group of bars per task configuration, one bar per
implementation, labelled with its speedup over eager math of the same run.

    python benchmarks/plot_e2e.py benchmarks/results/bench_e2e.json [--out plot.png]
    python benchmarks/plot_e2e.py benchmarks/results/bench_e2e_training_maml*.json \
        --out benchmarks/results/bench_e2e_training_maml.png

Needs matplotlib; without it the script says so and exits with status 0 (nothing to plot
is not an error of the benchmark).
"""
import argparse
import json
import pathlib
import sys

STYLE = {"math": dict(color="tab:red", linestyle="--", marker="o", label="eager, SDPBackend.MATH"),
         "flashbob": dict(color="tab:blue", linestyle="-", marker="s", label='torch.compile(backend="flashbob")')}
TITLES = {"sophia_hessian": "Sophia-H step with Hessian estimate",
          "sophia_plain": "Sophia-H step without it",
          "maml_outer": "MAML outer step"}


def series(rows, workload, impl, key):
    """(N, value) of the rows that ran; and the first N where this implementation ran out of memory."""
    ok = sorted((r["seq_len"], r[key]) for r in rows
                if r["workload"] == workload and r["impl"] == impl and r["status"] == "ok" and r.get(key) is not None)
    oom = sorted(r["seq_len"] for r in rows if r["workload"] == workload and r["impl"] == impl and r["status"] == "oom")
    return ok, (oom[0] if oom else None)


def plot(results, png_path):
    """Write the figure for `results` (the parsed JSON) to png_path; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    rows, meta = results["rows"], results["meta"]
    workloads = [w for w in TITLES if any(r["workload"] == w for r in rows)]
    seq_lens = sorted({r["seq_len"] for r in rows})
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7.5), squeeze=False)
    for col, workload in enumerate(workloads):
        for row, (key, ylabel) in enumerate((("median_ms", "median step time (ms)"),
                                             ("peak_mem_gib", "peak memory (GiB)"))):
            ax = axes[row][col]
            if not any(series(rows, workload, impl, key)[0] for impl in STYLE):
                # e.g. peak memory of a CPU smoke run, which torch does not measure
                ax.text(0.5, 0.5, f"no {ylabel} in this file", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
                continue
            for impl, style in STYLE.items():
                points, oom_at = series(rows, workload, impl, key)
                if points:
                    ax.plot(*zip(*points), **style)
                if oom_at is not None:
                    ax.plot([oom_at], [1.0], transform=ax.get_xaxis_transform(), marker="x", markersize=10,
                            color=style["color"], clip_on=False, linestyle="none")
                    ax.annotate(f"{impl}: out of memory", (oom_at, 1.0), xycoords=("data", "axes fraction"),
                                xytext=(0, -14), textcoords="offset points", ha="center", fontsize=8,
                                color=style["color"])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(seq_lens, [f"{n:,}" for n in seq_lens], fontsize=8)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            if row == 0:
                ax.set_title(TITLES[workload])
    axes[0][0].legend(fontsize=8, loc="best")
    args = meta.get("args", {})
    fig.suptitle(f"GPT {args.get('n_layer')}L/{args.get('n_head')}H/{args.get('n_embd')}, "
                 f"B={args.get('batch_size')}, {args.get('dtype')} autocast, {args.get('attention')} attention; "
                 f"{meta.get('device')}, torch {meta.get('torch')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return True


MAML_STYLE = {"math": ("tab:red", "eager, SDPBackend.MATH"),
              "flashbob": ("tab:blue", 'backend="flashbob"'),
              "flashbob_cudagraphs": ("tab:green", 'backend="flashbob", mode="reduce-overhead"'),
              "flashbob_torchopt": ("tab:purple", '"flashbob" + torchopt FuncOptimizer')}


def plot_maml(runs, png_path):
    """Bars of the maml_tasks rows of each run in `runs` (parsed JSONs); False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, results in zip(axes[0], runs):
        rows = [r for r in results["rows"] if r["workload"] == "maml_tasks" and r["status"] == "ok"]
        configs = sorted({(r["seq_len"], r["tasks"]) for r in rows})
        impls = [i for i in MAML_STYLE if any(r["impl"] == i for r in rows)]
        width = 0.8 / max(len(impls), 1)
        for k, impl in enumerate(impls):
            color, label = MAML_STYLE[impl]
            for c, config in enumerate(configs):
                by = {r["impl"]: r for r in rows if (r["seq_len"], r["tasks"]) == config}
                if impl not in by:
                    continue
                ms = by[impl]["median_ms"]
                x = c + (k - (len(impls) - 1) / 2) * width
                ax.bar(x, ms, width, color=color, label=label if c == 0 else None)
                if impl != "math" and "math" in by:
                    ax.annotate(f"{by['math']['median_ms'] / ms:.2f}x", (x, ms), ha="center",
                                va="bottom", fontsize=8)
        ax.set_xticks(range(len(configs)), [f"T={t}, {n} tasks" for t, n in configs])
        ax.set_ylabel("ms per meta-gradient (median)")
        meta = results["meta"]
        ax.set_title(f"{meta.get('device')}, torch {meta.get('torch')}, {meta.get('date', '')[:16]}",
                     fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("MAML meta-gradient, 4-layer GPT (width 256, 4 heads),\none inner SGD step "
                 "with create_graph=True per task", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="output of bench_e2e.py (several: MAML runs only)")
    p.add_argument("--out", help="PNG to write (default: the first JSON's path with .png)")
    args = p.parse_args(argv)
    png = pathlib.Path(args.out) if args.out else pathlib.Path(args.json[0]).with_suffix(".png")
    runs = [json.loads(pathlib.Path(f).read_text()) for f in args.json]
    maml = [all(r["workload"] == "maml_tasks" for r in run["rows"]) for run in runs]
    if len(runs) > 1 and not all(maml):
        p.error("several JSON files are plotted side by side only when they hold MAML rows alone")
    if not (plot_maml(runs, png) if all(maml) else plot(runs[0], png)):
        print("plot_e2e: matplotlib is not installed; no plot written (pip install matplotlib)")
        return 0
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
