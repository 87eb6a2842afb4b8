#!/usr/bin/env python
"""Save/load benchmark: safeckpt against its peers and against the disk itself.

Everything runs in one process, on one disk, in one run, so the numbers are
comparable.  For every state ("large": ~50 big fp32 tensors, "small": ~20,000
optimizer-like tensors of a few KiB) and every repeat, each tool saves the state
into a fresh folder under --dir, each of its loaders reads it back (page cache
dropped first when we are allowed to), the result is checked against the
original (outside the timing), and the folder is deleted.

Fairness rules:
* every save is timed up to durability: the tool's own call plus an fsync of
  every file it wrote and of the folders (nearly free for tools that fsync
  themselves; the whole cost for those that don't -- the "harness fsync" column);
* the physical limit is a plain fsync'd sequential write (os.write of 64 MiB
  buffers + os.fsync) of the same number of bytes, and a plain read of them
  into a preallocated buffer;
* loaders that hand back lazily mmap'd tensors (detected from /proc/self/maps)
  get every page touched inside the timing, so they are not credited for reads
  they have not done yet.

Usage (from the repository root):
    PYTHONPATH=src python benchmarks/save_load.py --quick      # CI smoke, seconds
    PYTHONPATH=src python benchmarks/save_load.py              # 1 GiB + 20k tensors, 3 repeats
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (HERE, MiB, Ctx, Tool, check_equal, cpu_snapshot, default_dir,  # noqa: E402
                    dirty_mib, disk_usage, drop_page_cache, empty_like_state, filesystem_of, flatten, preflight,
                    fmt_s, fsync_tree, make_large_state, make_small_state, make_tools,
                    other_cpu_share, proc_status, raw_read, raw_write, remove, safeckpt_save,
                    safetensors_save, setup_dcp, source_fingerprint, state_nbytes, summary, timed,
                    torch_save, dcp_save, touch_if_lazy)

# ----------------------------------------------------------------------------- one state


def run_case(case: str, state: dict, tools: list[Tool], repeat: int, workdir: Path,
             can_drop: list[bool], verify: bool, slow_op_s: float | None = None) -> dict:
    """Every tool saves and loads ``state`` ``repeat`` times (see the module docstring).
    With ``slow_op_s``, a tool whose first save took longer than that is not repeated
    (its row says "1 run"): a peer 10x slower than the rest needs no three-run median."""
    nbytes = state_nbytes(state)
    ctx = Ctx(state, empty_like_state(state), np.zeros(nbytes, dtype=np.uint8), nbytes)
    # Untimed warm-up: the first write of a run is often slower (fresh page-cache pages,
    # in a VM fresh guest memory), which would penalize whichever tool went first.
    warm = workdir / f"{case}-warmup.bin"
    raw_write(ctx, warm)
    raw_read(ctx, warm)
    warm.unlink()
    os.sync()
    res: dict[str, dict] = {}
    slow: set[str] = set()
    for r in range(repeat):
        for tool in tools:
            if tool.skip or tool.name in slow:
                continue
            path = workdir / f"{case}-{tool.name.split()[0]}-{r}{tool.suffix}"
            rec = res.setdefault(tool.name, {"kind": "save", "self_fsync": tool.self_fsync,
                                              "call_s": [], "fsync_s": [], "dirty_mib": [],
                                              "disk_bytes": 0, "error": None})
            try:
                os.sync()
                gc.collect()
                t_call, _ = timed(lambda: tool.save(ctx, path))
                rec["dirty_mib"].append(round(dirty_mib(), 1))
                t_sync, _ = timed(lambda: fsync_tree(path))
                rec["call_s"].append(t_call)
                rec["fsync_s"].append(t_sync)
                rec["disk_bytes"] = disk_usage(path)
                if slow_op_s is not None and r == 0 and t_call + t_sync > slow_op_s and not tool.name.startswith("raw"):
                    slow.add(tool.name)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                remove(path)
                continue
            for ld in tool.loaders:
                lrec = res.setdefault(ld.name, {"kind": "load", "in_place": ld.in_place,
                                                "writer": tool.name, "times": [], "lazy": False,
                                                "error": None})
                try:
                    if ld.in_place:
                        for t in flatten(ctx.dest).values():
                            t.zero_()
                    can_drop[0] = drop_page_cache() and can_drop[0]
                    out: dict = {}

                    def go() -> None:
                        out["v"] = ld.fn(ctx, path)
                        if out["v"] is not None:
                            out["lazy"] = touch_if_lazy(out["v"])

                    t, _ = timed(go)
                    lrec["times"].append(t)
                    lrec["lazy"] = lrec["lazy"] or out.get("lazy", False)
                    if verify and tool.save is not raw_write:
                        check_equal(state, ctx.dest if ld.in_place else out["v"])
                except Exception as e:
                    lrec["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                finally:
                    out.clear()
                    gc.collect()
            remove(path)
            os.sync()  # absorb delete/discard work before the next timing
            print(f"  [{case} r{r + 1}/{repeat}] {tool.name}: done", file=sys.stderr, flush=True)
    for name, rec in res.items():
        writer = name if rec["kind"] == "save" else rec["writer"]
        if writer in slow and repeat > 1:
            rec["single_run"] = f"1 run: its save took > {slow_op_s:g} s"
        if rec["kind"] == "save" and rec["call_s"]:
            totals = [a + b for a, b in zip(rec["call_s"], rec["fsync_s"])]
            rec.update(summary(totals))
            rec["fsync_median_s"] = statistics.median(rec["fsync_s"])
        elif rec["kind"] == "load" and rec["times"]:
            rec.update(summary(rec["times"]))
    return {"bytes": nbytes, "n_tensors": len(flatten(state)), "ops": res}


# ----------------------------------------------------------------------------- peak RSS

RSS_CHILD = {
    "safeckpt.save": safeckpt_save,
    "torch.save": torch_save,
    "safetensors.save_file": safetensors_save,
    "dcp.save": dcp_save,
}


def rss_child(args: argparse.Namespace) -> None:
    """In a fresh process: build the large state, save it once, print peak extra RSS."""
    # imports (and dcp's setup) happen before the baseline: their memory must not count
    if args.rss_child == "safeckpt.save":
        import safeckpt  # noqa: F401
    elif args.rss_child == "safetensors.save_file":
        import safetensors.torch  # noqa: F401
    elif args.rss_child == "dcp.save":
        setup_dcp()
    state = make_large_state(args.size_mib, args.n_large)
    nbytes = state_nbytes(state)
    ctx = Ctx(state, {}, np.zeros(0, np.uint8), nbytes, memoryview(b""))
    gc.collect()
    # Reset the kernel's peak-RSS mark (VmHWM) to the current RSS, so the peak measured
    # is the save's own, not an earlier one (import, state build); ru_maxrss as fallback.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    before = proc_status()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    RSS_CHILD[args.rss_child](ctx, Path(args.rss_path))
    after = proc_status()
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if hwm_reset:
        extra, how = after["VmHWM"] - before["VmRSS"], "VmHWM after reset - VmRSS before"
    else:
        extra, how = maxrss_after - max(maxrss_before, before["VmRSS"]), "ru_maxrss delta"
    print(json.dumps({"state_bytes": nbytes, "rss_before": before["VmRSS"], "extra_bytes": max(0, extra),
                      "method": how, "maxrss_before": maxrss_before, "maxrss_after": maxrss_after,
                      "status_before": before, "status_after": after}))


def measure_rss(tool: str, args: argparse.Namespace, workdir: Path) -> dict:
    path = workdir / f"rss-{tool.split('.')[0]}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_rss-child", tool,
           "--_rss-path", str(path), "--size-mib", str(args.size_mib), "--n-large", str(args.n_large)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode:
            return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"rc {p.returncode}"}
        return json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        remove(path)


# ----------------------------------------------------------------------------- report


def case_table(name: str, case: dict) -> str:
    ops, nbytes = case["ops"], case["bytes"]
    raw = {"save": ops.get("raw write+fsync", {}), "load": ops.get("raw read", {})}
    lines = [f"### {name}: {case['n_tensors']:,} tensors, {nbytes / MiB:,.1f} MiB",
             "",
             "| op | notes | median s | min–max s | GB/s | × raw | × raw (best) | harness fsync s | on disk MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for op, rec in ops.items():
        if "median_s" not in rec:
            lines.append(f"| {op} | | ERROR: {rec.get('error')} | | | | | | |")
            continue
        base = raw[rec["kind"]]
        ratio = f"{rec['median_s'] / base['median_s']:.2f}" if "median_s" in base else "–"
        best = f"{rec['min_s'] / base['min_s']:.2f}" if "min_s" in base else "–"
        if rec["kind"] == "save":
            extra = ("fsyncs itself: " + rec["self_fsync"], fmt_s(rec["fsync_median_s"]), f"{rec['disk_bytes'] / MiB:,.1f}")
        else:
            note = "in place" if rec["in_place"] else ("lazy mmap, pages touched" if rec["lazy"] else "new tensors")
            extra = (note, "", "")
        if rec.get("single_run"):
            extra = (f"{extra[0]}; **{rec['single_run']}**", *extra[1:])
        lines.append(f"| {op} | {extra[0]} | {fmt_s(rec['median_s'])} | {fmt_s(rec['min_s'])}–{fmt_s(rec['max_s'])}"
                     f" | {nbytes / rec['median_s'] / 1e9:.2f} | {ratio} | {best} | {extra[1]} | {extra[2]} |")
    lines.append("")
    # safeckpt / peer, op for op
    pairs = [("safeckpt.save", ["torch.save", "safetensors.save_file", "dcp.save"]),
             ("safeckpt.load (in place)", ["dcp.load (in place)", "torch.load", "torch.load(mmap=True)",
                                           "safetensors.load_file"]),
             ("safeckpt.load_state", ["torch.load", "torch.load(mmap=True)", "safetensors.load_file",
                                      "dcp.load (in place)"])]
    rows = []
    for mine, peers in pairs:
        if "median_s" not in ops.get(mine, {}):
            continue
        for peer in peers:
            if "median_s" in ops.get(peer, {}):
                m, p = ops[mine]["median_s"], ops[peer]["median_s"]
                rows.append(f"| {mine} | {peer} | {fmt_s(m)} | {fmt_s(p)} | {m / p:.2f} |")
    if rows:
        lines += ["safeckpt vs peers (time ratio; < 1 means safeckpt is faster):", "",
                  "| safeckpt op | peer op | safeckpt s | peer s | safeckpt / peer |",
                  "|---|---|---:|---:|---:|", *rows, ""]
    return "\n".join(lines)


def report(result: dict) -> str:
    env = result["env"]
    out = ["## safeckpt save/load benchmark", "",
           f"- {env['when']}, python {env['python']}, torch {env['torch']}, safetensors {env['safetensors']}, "
           f"safeckpt {env['safeckpt']}, {env['cpus']} CPUs",
           f"- dir `{env['dir']}` on {env['fs']['device']} ({env['fs']['fstype']}, mounted at {env['fs']['mount']})"
           + (" — **tmpfs: this measures RAM, not a disk**" if env['fs']['fstype'] in ("tmpfs", "ramfs") else ""),
           f"- page cache before loads: {'dropped (cold reads)' if env['cold_cache'] else '**warm cache** (could not drop)'}",
           f"- dcp: {env['dcp_mode']}; repeats: {result['repeat']} (median, min–max)",
           f"- CPU used by other processes during the run: {env['other_cpu_share']:.0%} of the machine "
           f"(load average at start {env['loadavg_start'][0]})"
           + (" — **the machine was busy: timings are skewed**" if env['other_cpu_share'] > 0.15 else ""),
           "- every save is timed to durability: call + harness fsync of every written file and folder; for peers "
           "that do not fsync (torch.save, safetensors) the harness fsync is their real cost of being durable",
           "- GB/s = payload tensor bytes (10^9) / median s; × raw = median / median of raw write+fsync (saves) "
           "or raw read (loads); × raw (best) = fastest run / fastest raw run (less sensitive to a noisy disk)",
           f"- safeckpt source fingerprint: {env.get('safeckpt_src', '?')}",
           ""]
    for name, case in result["cases"].items():
        out.append(case_table(name, case))
    if result.get("rss"):
        out += ["### peak extra RSS of one save of the large state (fresh process; peak RSS during the save − RSS before)", "",
                "| op | state MiB | extra RSS MiB | extra / state |", "|---|---:|---:|---:|"]
        for tool, r in result["rss"].items():
            if "error" in r:
                out.append(f"| {tool} | | ERROR: {r['error']} | |")
            else:
                out.append(f"| {tool} | {r['state_bytes'] / MiB:,.0f} | {r['extra_bytes'] / MiB:,.1f} | "
                           f"{r['extra_bytes'] / r['state_bytes']:.2f} |")
        out.append("")
    skipped = [f"{t}: {why}" for t, why in result["skipped"].items()]
    if skipped:
        out += ["Skipped: " + "; ".join(skipped), ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="large state total size (default 1024)")
    p.add_argument("--n-large", type=int, default=50, help="number of large tensors (default 50)")
    p.add_argument("--n-small", type=int, default=20000, help="number of small tensors (default 20000)")
    p.add_argument("--small-kib", type=int, default=8, help="mean size of a small tensor in KiB (default 8)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="64 MiB, 2000 small tensors, 1 repeat (CI smoke)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where to write (a temp folder is made inside; default: the current directory)")
    p.add_argument("--cases", default="large,small")
    p.add_argument("--tools", default=None, help="comma list among safeckpt,torch,safetensors,dcp")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocess measurement")
    p.add_argument("--no-verify", action="store_true", help="skip checking loaded tensors")
    p.add_argument("--json", type=Path, default=HERE / "results" / "save_load.json")
    p.add_argument("--_rss-child", dest="rss_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_rss-path", dest="rss_path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.size_mib, args.n_small, args.repeat = 64, 2000, 1
    return args


def main() -> int:
    args = parse_args()
    if args.rss_child:
        rss_child(args)
        return 0
    base = (args.dir or default_dir()).resolve()
    base.mkdir(parents=True, exist_ok=True)
    if not preflight(base, args.size_mib * MiB * 2.2):
        return 2
    fs = filesystem_of(base)
    load_start = os.getloadavg()
    cpu_start = cpu_snapshot()
    dcp_mode = setup_dcp()
    tools = make_tools(set(args.tools.split(",")) if args.tools else None)
    workdir = Path(tempfile.mkdtemp(prefix=".safeckpt-bench-", dir=base))
    can_drop = [True]
    cases = {}
    try:
        for case in args.cases.split(","):
            gc.collect()
            if case == "large":
                state = make_large_state(args.size_mib, args.n_large)
            elif case == "small":
                state = make_small_state(args.n_small, args.small_kib)
            else:
                raise SystemExit(f"unknown case {case!r}")
            print(f"case {case}: {len(flatten(state))} tensors, {state_nbytes(state) / MiB:.1f} MiB",
                  file=sys.stderr, flush=True)
            cases[case] = run_case(case, state, tools, args.repeat, workdir, can_drop, not args.no_verify)
            del state
        rss = {}
        if not args.no_rss and "large" in args.cases.split(","):
            wanted = ["safeckpt.save"] if args.quick else list(RSS_CHILD)
            for t in tools:
                if t.name in wanted and not t.skip:
                    print(f"peak RSS: {t.name}", file=sys.stderr, flush=True)
                    rss[t.name] = measure_rss(t.name, args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    try:
        import safeckpt
        sk_version = getattr(safeckpt, "__version__", "?")
    except Exception:
        sk_version = "unavailable"
    try:
        import safetensors
        st_version = safetensors.__version__
    except ImportError:
        st_version = "unavailable"
    result = {
        "env": {"safeckpt_src": source_fingerprint(), "when": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
                "torch": torch.__version__, "safetensors": st_version, "safeckpt": sk_version,
                "cpus": os.cpu_count(), "dir": str(base), "fs": fs, "cold_cache": can_drop[0],
                "dcp_mode": dcp_mode, "host": platform.node(),
                "other_cpu_share": other_cpu_share(cpu_start),
                "loadavg_start": [round(x, 2) for x in load_start],
                "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if not k.startswith("rss_")},
        "repeat": args.repeat,
        "cases": cases,
        "rss": rss,
        "skipped": {t.name: t.skip for t in tools if t.skip},
    }
    text = report(result)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result["markdown"] = text
    args.json.write_text(json.dumps(result, indent=1))
    print(f"(JSON: {args.json})", file=sys.stderr)
    errors = [f"{c}/{op}" for c, case in cases.items() for op, r in case["ops"].items() if r.get("error")]
    if errors:
        print(f"errors in: {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
