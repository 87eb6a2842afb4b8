"""The suite's PNG chart (matplotlib, optional): one panel per question.

1. save GB/s per state and tool, with the raw fsync'd write as the limit;
2. load GB/s per state and loader, with the raw read as the limit;
3. async save: time the caller is blocked, relative to a plain memory copy;
4. async save: slowdown of a CPU-bound loop on the main thread, with the targets;
5. distributed: aggregate GB/s against the number of ranks;
6. S3 test server: GB/s of each tool and of s3fs alone.
Error bars span min..max of the repeats; bars are medians.
"""

from __future__ import annotations

from pathlib import Path

SAVE_OPS = ["raw write+fsync", "safeckpt.save", "torch.save", "safetensors.save_file", "dcp.save"]
LOAD_OPS = ["raw read", "safeckpt.load (in place)", "safeckpt.load_state", "torch.load", "torch.load(mmap=True)",
            "safetensors.load_file", "dcp.load (in place)"]
COLORS = {"raw": "#9e9e9e", "safeckpt": "#1f77b4", "torch": "#ff7f0e", "safetensors": "#2ca02c",
          "dcp": "#d62728", "memcopy": "#9e9e9e", "s3fs": "#9e9e9e"}


def _color(op: str) -> str:
    for k in ("safeckpt", "dcp", "safetensors", "torch"):  # a tool named anywhere wins over the limits
        if k in op:
            return COLORS[k]
    for k, c in COLORS.items():
        if op.startswith(k):
            return c
    return "#8c564b"


def _gbps_bars(ax, cases: dict, ops: list[str], title: str) -> None:
    import numpy as np

    names = list(cases)
    width = 0.8 / len(ops)
    x = np.arange(len(names))
    for i, op in enumerate(ops):
        med, lo, hi = [], [], []
        for n in names:
            rec = cases[n]["ops"].get(op, {})
            b = cases[n]["bytes"] / 1e9
            if "median_s" in rec:
                m = b / rec["median_s"]
                med.append(m)
                lo.append(m - b / rec["max_s"])
                hi.append(b / rec["min_s"] - m)
            else:
                med.append(0.0), lo.append(0.0), hi.append(0.0)
        hatch = "//" if op.startswith("raw") else ("" if "mmap" not in op and "load_state" not in op else "..")
        ax.bar(x + (i - (len(ops) - 1) / 2) * width, med, width, yerr=[lo, hi], capsize=2, label=op,
               color=_color(op), hatch=hatch, edgecolor="white" if not hatch else "black", linewidth=0.3)
    ax.set_xticks(x, names, fontsize=9)
    ax.set_ylabel("GB/s (higher is better)")
    ax.set_title(title, fontsize=11)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    ax.grid(axis="y", alpha=0.3)


def make_chart(result: dict, path: Path) -> str | None:
    """Draw the chart; returns None, or why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return "matplotlib is not installed (pip install 'safeckpt[bench]')"
    fig, axes = plt.subplots(2, 3, figsize=(20, 11))
    env = result["env"]
    fig.suptitle(f"safeckpt benchmark — {env['when']}, {env['versions']['cpus']} CPUs, {env['fs']['fstype']} on "
                 f"{env['fs']['device']}, medians of {result['config']['repeat']} (bars: min–max); other "
                 f"processes used {env['other_cpu_share']:.0%} of the CPU", fontsize=12)
    sl = result.get("saveload", {})
    if sl:
        _gbps_bars(axes[0, 0], sl, SAVE_OPS, "save (timed to durability)")
        _gbps_bars(axes[0, 1], sl, LOAD_OPS, "load (cold cache where droppable)")
    ax = axes[0, 2]
    asy = result.get("async", {})
    if asy:
        names = list(asy)
        x = np.arange(len(names))
        tools = ["memcopy", "safeckpt.async_save", "dcp.async_save"]
        w = 0.8 / len(tools)
        for i, t in enumerate(tools):
            vals, lo, hi = [], [], []
            for n in names:
                c = asy[n]
                mc = c["memcopy"]["median_s"]
                rec = c["memcopy"] if t == "memcopy" else c["tools"].get(t, {}).get("blocked")
                if rec:
                    vals.append(rec["median_s"] / mc)
                    lo.append((rec["median_s"] - rec["min_s"]) / mc)
                    hi.append((rec["max_s"] - rec["median_s"]) / mc)
                else:
                    vals.append(0), lo.append(0), hi.append(0)
            ax.bar(x + (i - 1) * w, vals, w, yerr=[lo, hi], capsize=2, label=t, color=_color(t))
        ax.axhline(1.2, color="k", ls="--", lw=1, label="target ≤ 1.2× memcopy")
        ax.set_yscale("log")
        ax.set_xticks(x, [f"{n}\n(memcopy {asy[n]['memcopy']['median_s'] * 1e3:.0f} ms)" for n in names], fontsize=9)
        ax.set_ylabel("blocked time ÷ memcopy (log; lower is better)")
        ax.set_title("async save: time the caller is blocked", fontsize=11)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax = axes[1, 0]
        series = [("safeckpt.async_save", "slowdown", "safeckpt.async_save", ""),
                  ("safeckpt.async_save", "control_slowdown", "safeckpt: same loop in another process (CPU only)",
                   "//"),
                  ("dcp.async_save", "slowdown", "dcp.async_save", "")]
        w = 0.8 / len(series)
        for i, (t, key, label, hatch) in enumerate(series):
            vals, lo, hi = [], [], []
            for n in names:
                s = asy[n]["tools"].get(t, {}).get(key)
                if s:
                    vals.append(100 * s["median"])
                    lo.append(100 * (s["median"] - s["min"]))
                    hi.append(100 * (s["max"] - s["median"]))
                else:
                    vals.append(0), lo.append(0), hi.append(0)
            ax.bar(x + (i - (len(series) - 1) / 2) * w, vals, w, yerr=[lo, hi], capsize=2, label=label,
                   color=_color(t), hatch=hatch, edgecolor="white" if not hatch else "black", linewidth=0.3,
                   alpha=0.6 if hatch else 1.0)
        for i, n in enumerate(names):
            target = 10 if n.startswith("small") else 5
            ax.plot([i - 0.45, i + 0.45], [target, target], "k--", lw=1,
                    label="safeckpt target" if i == 0 else None)
        ax.set_xticks(x, names, fontsize=9)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.35)
        ax.set_ylabel("% fewer loop iterations/s while the save runs (lower is better)")
        ax.set_title("async save: slowdown of a CPU-bound Python loop on the main thread", fontsize=11)
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    ax = axes[1, 1]
    dist = {int(w): r for w, r in result.get("dist", {}).items() if "ops" in r}
    if dist:
        worlds = sorted(dist)
        for op, style in [("raw write+fsync", "--"), ("safeckpt.save", "-"), ("dcp.save", "-"),
                          ("raw read", ":"), ("safeckpt.load (in place)", "-."), ("dcp.load (in place)", "-.")]:
            pts = [(w, dist[w]["bytes"] / dist[w]["ops"][op]["median_s"] / 1e9) for w in worlds if op in dist[w]["ops"]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=_color(op), label=op)
        ax.set_xticks(worlds)
        ax.set_xlabel("ranks (gloo, one process each, one local disk; total bytes constant)")
        ax.set_ylabel("aggregate GB/s")
        ax.set_title(f"distributed: {next(iter(dist.values()))['bytes'] / 2**20:,.0f} MiB sharded over the ranks",
                     fontsize=11)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[1, 2]
    s3 = result.get("s3", {})
    if "ops" in s3:
        ops = [o for o in ["s3fs put (raw bytes)", "safeckpt.save", "torch.save + s3fs put", "s3fs get (raw bytes)",
                           "safeckpt.load (in place)", "s3fs get + torch.load"] if o in s3["ops"]]
        vals = [s3["bytes"] / s3["ops"][o]["median_s"] / 1e9 for o in ops]
        ax.barh(range(len(ops)), vals, color=[_color(o) for o in ops])
        ax.set_yticks(range(len(ops)), ops, fontsize=9)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s (higher is better)")
        ax.set_title(f"S3 test server (moto, local): {s3['bytes'] / 2**20:,.0f} MiB", fontsize=11)
        ax.grid(axis="x", alpha=0.3)
    for a in axes.flat:
        if not a.has_data():
            a.set_axis_off()
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


if __name__ == "__main__":  # redraw from a saved result: python benchmarks/chart.py results/run_all.json [out.png]
    import json
    import sys

    src = Path(sys.argv[1])
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_name("chart.png")
    print(make_chart(json.loads(src.read_text()), dst) or dst)
