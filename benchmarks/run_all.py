#!/usr/bin/env python
"""The whole benchmark suite in one run, on one disk: safeckpt against its peers and
against the hardware's limits (``./run bench``).

    python benchmarks/run_all.py            # full: 1 GiB, 20,000 tensors, a transformer; ~17 min
    python benchmarks/run_all.py --quick    # CI smoke: tiny sizes, 1 repeat, asserts nothing about speed
    python benchmarks/run_all.py --big      # also the 4 GiB state (needs ~20 GiB RAM, ~10 GiB disk)

States: "large fp32"/"large bf16" (~50 tensors, 1 GiB each), "small" (20,000 optimizer-like
tensors, ~156 MiB), "transformer" (nn.TransformerEncoder, 4 layers, d_model 512, with
its AdamW state after one step). Sections (``--sections``, default all):
  saveload  save/load of every state by every tool (``save_load.py``'s rules: saves timed
            to durability, cold loads, lazy loads charged, every load verified)
  async     time the caller is blocked by an async save; slowdown of a CPU-bound loop
            on the main thread while the background save runs (``async_bench.py``)
  checksum  share of save/load time spent on checksums (``checksum_bench.py``)
  rss       peak extra RSS of one sync save, fresh process (``save_load.py``)
  dist      1, 2, 4 ranks over gloo, sharded large state (``dist_bench.py``)
  dcp       safeckpt.dcp's Writer/Reader against DCP's FileSystemWriter/Reader, 1 and 2
            ranks (``dcp_bench.py``)
  gpu       async snapshot of CUDA tensors into pinned buffers vs a pinned copy_, sync
            save from the GPU (``gpu_check.py``; skipped without CUDA)
  s3        the S3 test server (moto, started here) (``s3_bench.py``)
  incremental  10 saves of a 90%-frozen model: bytes and time, full vs incremental vs the
            peers; hashing overhead when nothing is shared (``incremental_bench.py``)
  tiered    local tier + S3 vs straight to S3: time blocked, time to durability
  nodes     2 simulated nodes x 2 ranks: straight to the durable root (a local folder, S3) vs
            node-local (+ peer replica) + durable: time blocked, time to durability (``nodes_bench.py``)
  share     a replicated (DDP) state loaded on 1, 2, 4 ranks, local folder and S3: bytes read from
            storage and time, shared reads vs not vs dcp.load (``share_bench.py``)
  plans     rank 0's work for the first save of a layout of 1,024 ranks x 2,000 pieces and for
            the next save of the same layout, which reuses the plan (``planner.py --repeated``)
  cli       the safeckpt command from a shell: ls, show and verify of a 10-checkpoint root, each
            a fresh process, against --help (``cli_bench.py``)
Writes benchmarks/results/run_all.json, run_all.md and chart.png (``--quick``: under
results/quick/), and prints Markdown tables ready for the README, ending with the targets.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (HERE, MiB, cpu_snapshot, default_dir, filesystem_of, flatten, preflight,  # noqa: E402
                    make_large_state, make_small_state, make_tools, make_transformer_state,
                    other_cpu_share, setup_dcp, source_fingerprint, state_nbytes, versions, busy_note,
                    freeze_heap)

SECTIONS = ["saveload", "async", "checksum", "rss", "dist", "dcp", "gpu", "s3", "incremental", "tiered", "nodes",
            "share", "plans", "cli"]
SECONDARY_LOADERS = {"safeckpt.load_state", "torch.load(mmap=True)"}


def config(args: argparse.Namespace) -> dict:
    if args.quick:
        c = dict(large_mib=16, n_large=50, n_small=500, small_kib=8, d_model=64, layers=2, repeat=1,
                 ranks=[2], dist_mib=16, s3_mib=8, rss_mib=[16], max_alone_s=0.3, window_s=0.3, slow_op_s=None,
                 inc_mib=16, inc_saves=3, tier_mib=8, nodes_mib=8, nodes_saves=1, dcp_ranks=[1], dcp_mib=16,
                 gpu_mib=256, share_ranks=[2], share_mib=16, share_s3_mib=8, plan_ranks=64, plan_tensors=200)
    else:
        c = dict(large_mib=1024, n_large=50, n_small=20000, small_kib=8, d_model=512, layers=4, repeat=3,
                 ranks=[1, 2, 4], dist_mib=1024, s3_mib=128, rss_mib=[256, 1024], max_alone_s=1.0, window_s=2.0,
                 slow_op_s=5.0, inc_mib=512, inc_saves=10, tier_mib=128, nodes_mib=1024, nodes_saves=3,
                 dcp_ranks=[1, 2], dcp_mib=1024, gpu_mib=4096, share_ranks=[1, 2, 4], share_mib=1024,
                 share_s3_mib=1024, plan_ranks=1024, plan_tensors=2000)
    if args.repeat:
        c["repeat"] = args.repeat
    if args.ranks:
        c["ranks"] = [int(x) for x in args.ranks.split(",")]
    if args.s3_mib:
        c["s3_mib"] = args.s3_mib
    c["big_mib"] = 4096 if args.big else None
    return c


def states(c: dict):
    """(name, maker, sections it is used in) in the order they run."""
    yield "large fp32", lambda: make_large_state(c["large_mib"], c["n_large"]), ("saveload", "async", "checksum")
    yield "large bf16", lambda: make_large_state(c["large_mib"], c["n_large"], dtype=torch.bfloat16), ("saveload",)
    yield "small", lambda: make_small_state(c["n_small"], c["small_kib"]), ("saveload", "async", "checksum")
    yield "transformer", lambda: make_transformer_state(c["d_model"], c["layers"]), ("saveload",)
    if c["big_mib"]:
        yield f"large fp32 {c['big_mib'] // 1024} GiB", lambda: make_large_state(c["big_mib"], c["n_large"]), \
            ("saveload", "async")


# ----------------------------------------------------------------------------- targets


def _t(name: str, state: str, goal: str, measured: float | None, ok_if: str, limit: float, unit: str,
       how: str, best: float | None = None, note: str = "") -> dict:
    """A target row: ``ok_if`` is ">=" or "<=" against ``limit``; ``best`` is the same
    ratio over the fastest runs (shown, and flagged when it disagrees)."""
    row = {"target": name, "state": state, "goal": goal, "measured": measured, "best": best, "how": how,
           "note": note, "ok_if": ok_if, "limit": limit, "unit": unit}
    if measured is None:
        return dict(row, met=None, margin="not measured")

    def ok(x: float) -> bool:
        return x >= limit if ok_if == ">=" else x <= limit

    def show(x: float) -> str:
        return f"{x:.1%}" if unit == "%" else (f"{x:,.0f} MiB" if unit == "MiB" else f"{x:.2f}{unit}")

    met = ok(measured)
    if unit == "%":
        margin = f"{abs(measured - limit) * 100:.1f} points {'under' if measured <= limit else 'over'}"
    elif unit == "MiB":
        margin = f"{abs(measured - limit):,.0f} MiB {'under' if measured <= limit else 'over'}"
    else:
        rel = measured / limit - 1
        margin = f"{abs(rel):.0%} {'above' if rel >= 0 else 'below'} the bound"
    if best is not None and ok(best) != met:
        note = (note + "; " if note else "") + f"best runs say {'met' if ok(best) else 'missed'} ({show(best)}): noisy"
    return dict(row, shown=show(measured), best_shown=show(best) if best is not None else "", met=met, margin=margin,
                note=note)


def compute_targets(res: dict) -> list[dict]:
    from async_bench import GIL_POINTS_LIMIT, blocked_limit
    from async_bench import figures as async_figures

    rows = []
    sl, asy, cks, rss = res.get("saveload", {}), res.get("async", {}), res.get("checksum", {}), res.get("rss", {})

    def ratio(case: str, raw: str, mine: str, key: str = "median_s") -> float | None:
        ops = sl.get(case, {}).get("ops", {})
        if key in ops.get(raw, {}) and key in ops.get(mine, {}):
            return ops[raw][key] / ops[mine][key]
        return None

    large_cases = [c for c in sl if c.startswith("large")]
    for case in large_cases:
        rows.append(_t("save ≥ 0.9× raw fsync'd write", case, "≥ 0.90×",
                       ratio(case, "raw write+fsync", "safeckpt.save"), ">=", 0.9, "×", "raw s ÷ safeckpt.save s",
                       ratio(case, "raw write+fsync", "safeckpt.save", "min_s")))
    if "small" in sl:
        rows.append(_t("save ≥ 0.8× raw fsync'd write", "small", "≥ 0.80×",
                       ratio("small", "raw write+fsync", "safeckpt.save"), ">=", 0.8, "×", "raw s ÷ safeckpt.save s",
                       ratio("small", "raw write+fsync", "safeckpt.save", "min_s")))
    for case in large_cases + (["small"] if "small" in sl else []):
        rows.append(_t("load in place ≥ 0.9× raw read", case, "≥ 0.90×",
                       ratio(case, "raw read", "safeckpt.load (in place)"), ">=", 0.9, "×",
                       "raw read s ÷ safeckpt.load s", ratio(case, "raw read", "safeckpt.load (in place)", "min_s")))
    for case, c in asy.items():
        sk = c["tools"].get("safeckpt.async_save", {}).get("blocked", {})
        d = c["tools"].get("dcp.async_save", {}).get("blocked", {})
        f, lim = async_figures(c), blocked_limit(case)
        rows.append(_t(f"async blocked ≤ {lim:.1f}× memcopy", case, f"≤ {lim:.2f}×", f["blocked_x"], "<=", lim, "×",
                       "blocked s ÷ the preallocated memcopies around it, per repeat", f["blocked_x_best"]))
        rows.append(_t("async blocked ≤ dcp.async_save's", case, "≤ 1.00×",
                       sk["median_s"] / d["median_s"] if sk and d else None, "<=", 1.0, "×",
                       "safeckpt blocked s ÷ dcp blocked s", sk["min_s"] / d["min_s"] if sk and d else None))
    for case, c in asy.items():
        f = async_figures(c)
        note = (f"main thread {f['slowdown']:.1%}, the same loop in another process {f['control_slowdown']:.1%}"
                if f["gil_points"] is not None else "")
        rows.append(_t(f"main-loop slowdown − another process's ≤ {GIL_POINTS_LIMIT:.0%} (points)", case,
                       f"≤ {GIL_POINTS_LIMIT * 100:.0f} points", f["gil_points"], "<=", GIL_POINTS_LIMIT, "%",
                       "(1 − loop it/s with save ÷ alone), main thread − other process", note=note))
    for case, c in cks.items():
        rows.append(_t("checksums < 10% of save time", case, "< 10%", max(0.0, c["save_share"]), "<=", 0.10, "%",
                       "(save − save without checksums) ÷ save",
                       note=f"xxh3 alone = {c['cpu_share_of_save']:.1%} of the save's time"))
    inc = res.get("incremental", {})
    if inc.get("tools"):
        full, mine = inc["tools"]["safeckpt full saves"], inc["tools"]["safeckpt incremental"]
        rows.append(_t("incremental: bytes written ≤ 0.2× a full save", f"{inc['frozen_share']:.0%} frozen",
                       "≤ 0.20×", mine["later_bytes"] / full["later_bytes"], "<=", 0.2, "×",
                       "bytes per save after the first ÷ full save's"))
        h = inc["nothing_shared"]
        rows.append(_t("incremental: hashing overhead < 10% when nothing is shared", "all tensors change",
                       "< 10%", h["hash_share"], "<=", 0.10, "%", "hashing alone s ÷ full save s",
                       note=f"incremental ÷ full save − 1 = {h['overhead']:+.1%} (disk noise dominates)"))
    from share_bench import share_figures

    for where, f in share_figures(res.get("share", {})).items():
        rows.append(_t("replicated load: bytes read ≤ 1.0× the checkpoint", f"{where}, {f['ranks']} ranks", "≤ 1.00×",
                       f["bytes_x"], "<=", 1.01, "×", "bytes all ranks read ÷ the state's bytes",
                       note="headers and the manifest make up the last 1%"))
        if where == "s3" and f["ranks"] >= 4:
            rows.append(_t("replicated load on S3, 4 ranks: ≤ 0.5× the time without sharing", f"{f['ranks']} ranks",
                           "≤ 0.50×", f["time_x"], "<=", 0.5, "×", "shared s ÷ not shared s", f["time_x_best"]))
    plans = res.get("plans", {}).get("sharded")
    if plans:
        rows.append(_t("rank 0, next save of an unchanged layout ≤ 0.1× the first", plans["shape"], "≤ 0.10×",
                       plans["ratio"], "<=", 0.1, "×", "CPU s of the next save ÷ the first's (plan, table, encode)",
                       note=f"first {plans['first']:.2f} s, next {plans['next']:.3f} s"))
    tier = res.get("tiered", {}).get("modes", {})
    if tier:
        direct, local = tier["straight to S3"], tier["local tier + S3"]
        rows.append(_t("local tier: training blocked ≤ 0.5× straight to S3", "large fp32", "≤ 0.50×",
                       local["blocked_s"] / direct["blocked_s"], "<=", 0.5, "×", "blocked s ÷ straight-to-S3 s"))
    if res.get("cli"):
        from cli_bench import LS_TARGET_S, N_CHECKPOINTS, ls_seconds

        rows.append(_t(f"safeckpt ls of a {N_CHECKPOINTS}-checkpoint root < {LS_TARGET_S} s (issue 28)", "cli",
                       f"< {LS_TARGET_S} s", ls_seconds(res["cli"]), "<=", LS_TARGET_S, " s",
                       "median wall time of a fresh process", best=ls_seconds(res["cli"], "min_s")))
    for key, r in rss.items():
        if key.startswith("safeckpt.save") and "extra_bytes" in r:
            rows.append(_t("peak extra RSS of a sync save < 256 MiB", f"large fp32 {r['state_bytes'] / MiB:,.0f} MiB",
                           "< 256 MiB", r["extra_bytes"] / MiB, "<=", 256, "MiB", "VmHWM − VmRSS before"))
    return rows


def targets_table(rows: list[dict]) -> str:
    lines = ["### targets (issues 5, 8, 9): target vs measured", "",
             "| target | state | goal | measured (medians) | best runs | met? | margin | measured as | note |",
             "|---|---|---|---:|---:|---|---|---|---|"]
    for r in rows:
        met = "–" if r["met"] is None else ("**met**" if r["met"] else "**missed**")
        lines.append(f"| {r['target']} | {r['state']} | {r['goal']} | {r.get('shown', '–')} | "
                     f"{r.get('best_shown', '')} | {met} | {r['margin']} | {r['how']} | {r.get('note', '')} |")
    met = sum(1 for r in rows if r["met"])
    missed = sum(1 for r in rows if r["met"] is False)
    lines += ["", f"{met} met, {missed} missed. Verdicts use medians; \"best runs\" is the same ratio over the "
              "fastest run of each side.", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- report


def header(res: dict) -> str:
    env, c = res["env"], res["config"]
    v = env["versions"]
    lines = ["## safeckpt benchmark suite", "",
             f"- {env['when']}, {'**--quick** (tiny sizes, smoke run: not for numbers), ' if c['quick'] else ''}"
             f"python {v['python']}, torch {v['torch']}, safetensors {v['safetensors']}, safeckpt {v['safeckpt']}, "
             f"moto {v['moto']}, s3fs {v['s3fs']}, {v['cpus']} CPUs, host `{v['host']}`",
             f"- dir `{env['dir']}` on {env['fs']['device']} ({env['fs']['fstype']}, mounted at {env['fs']['mount']})"
             + (" — **tmpfs: this measures RAM, not a disk**" if env['fs']['fstype'] in ("tmpfs", "ramfs") else ""),
             f"- page cache before loads: {'dropped (cold reads)' if env['cold_cache'] else '**warm cache** (could not drop)'}",
             f"- dcp: {env['dcp_mode']}; repeats: {c['repeat']} (median, min–max); torch threads {env['torch_threads']}",
             f"- CPU used by other processes during the run: {env['other_cpu_share']:.0%} of the machine "
             f"(load average {env['loadavg_start'][0]} at start, {env['loadavg_end'][0]} at end)"
             + busy_note(env["other_cpu_share"]),
             "- per section: " + ", ".join(f"{k} {v['seconds']:.0f} s (others {v['other_cpu_share']:.0%})"
                                           for k, v in env["sections"].items()),
             f"- whole run: {env['seconds']:.0f} s; safeckpt source fingerprint {env['safeckpt_src']}",
             "- saves are timed to durability (fsync of every file and folder; the harness fsyncs for tools that do "
             "not); GB/s = payload bytes (10^9) / median s; × raw = time ratio to the raw write/read (>1 slower)",
             ""]
    return "\n".join(lines)


def report(res: dict) -> str:
    from async_bench import async_table
    from checksum_bench import checksum_table
    from cli_bench import cli_table
    from dcp_bench import table as dcp_table
    from dist_bench import dist_table
    from gpu_check import gpu_table
    from incremental_bench import incremental_table, tiered_table
    from nodes_bench import nodes_table
    from s3_bench import s3_table
    from share_bench import share_table
    from save_load import case_table

    out = [header(res)]
    for name, case in res.get("saveload", {}).items():
        out.append(case_table(name, case))
    if res.get("async"):
        sync = {n: c["ops"]["safeckpt.save"]["median_s"] for n, c in res.get("saveload", {}).items()
                if "median_s" in c["ops"].get("safeckpt.save", {})}
        out.append(async_table(res["async"], sync))
    if res.get("checksum"):
        out.append(checksum_table(res["checksum"]))
    if res.get("rss"):
        out += ["### peak extra RSS of one sync save of the large state (fresh process; peak during the save − "
                "RSS before)", "", "| op | state MiB | extra RSS MiB | extra / state |", "|---|---:|---:|---:|"]
        for key, r in res["rss"].items():
            if "error" in r:
                out.append(f"| {key} | | ERROR: {r['error']} | |")
            else:
                out.append(f"| {key.split(' @')[0]} | {r['state_bytes'] / MiB:,.0f} | {r['extra_bytes'] / MiB:,.1f} | "
                           f"{r['extra_bytes'] / r['state_bytes']:.2f} |")
        out.append("")
    ran = res.get("env", {}).get("sections", {})
    tables = {"dist": dist_table, "dcp": dcp_table, "gpu": gpu_table, "s3": s3_table, "incremental": incremental_table,
              "tiered": tiered_table, "nodes": nodes_table, "share": share_table, "plans": plans_table,
              "cli": cli_table}
    for key, table in tables.items():
        if (key in ran) if key == "gpu" else res.get(key):
            out.append(table(res[key]))
    out.append(targets_table(res["targets"]))
    return "\n".join(out)


def plans_table(res: dict) -> str:
    lines = ["### rank 0's work, first save of a layout and the next save of the same layout (CPU s)", "",
             "| job | first save | next save | next ÷ first |", "|---|---:|---:|---:|"]
    for kind, r in res.items():
        lines.append(f"| {kind}, {r['shape']} | {r['first']:.2f} | {r['next']:.3f} | {r['ratio']:.3f} |")
    lines += ["", "First: assign writers, check the shards' tiling, build the tensor table, encode the manifest; next: "
              "compare the ranks' plan ids, refill the kept table with the new byte ranges and checksums, encode.", ""]
    return "\n".join(lines)


def run_plans(ranks: int, tensors: int) -> dict:
    import planner

    gc.collect()
    out = {}
    for kind, make in (("sharded", planner.sharded), ("replicated", planner.replicated)):
        with contextlib.redirect_stdout(sys.stderr):  # its progress, like the other sections'
            r = planner.repeated(kind, make, ranks, tensors)
        out[kind] = dict(r, shape=f"{ranks:,} ranks x {tensors:,} tensors")
        gc.collect()
    return out


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat: a smoke run (CI)")
    p.add_argument("--big", action="store_true", help="also the 4 GiB state (saveload and async)")
    p.add_argument("--repeat", type=int, default=None, help="repeats per measurement (default 3; quick 1)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list among {','.join(SECTIONS)}")
    p.add_argument("--ranks", default=None, help="world sizes of the dist section (default 1,2,4; quick 1,2)")
    p.add_argument("--s3-mib", type=int, default=None, help="state size on S3 (default 128; quick 8)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where to write (a temp folder is made inside; default: the current directory)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results[/quick])")
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--no-verify", action="store_true", help="skip checking loaded tensors")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    c = config(args)
    c["quick"] = args.quick
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose among {SECTIONS}")
    out_dir = args.out or (HERE / "results" / ("quick" if args.quick else ""))
    base = (args.dir or default_dir()).resolve()
    base.mkdir(parents=True, exist_ok=True)
    biggest = c["big_mib"] or c["large_mib"]
    if not preflight(base, biggest * MiB * 2.2):
        return 2
    fs = filesystem_of(base)
    load_start = os.getloadavg()
    started = time.monotonic()
    cpu_start = cpu_snapshot()
    dcp_mode = setup_dcp()
    workdir = Path(tempfile.mkdtemp(prefix=".safeckpt-bench-", dir=base))
    can_drop = [True]
    res: dict = {"config": c, "saveload": {}, "async": {}, "checksum": {}, "rss": {}, "dist": {}, "dcp": {},
                 "gpu": [], "s3": {}, "incremental": {}, "tiered": {}, "nodes": {}, "share": {}, "plans": {}, "cli": {}}
    timing: dict[str, dict] = {}

    def section(name: str):
        class _S:
            def __enter__(self):
                self.t0, self.cpu = time.monotonic(), cpu_snapshot()

            def __exit__(self, *exc):
                rec = timing.setdefault(name, {"seconds": 0.0, "other_cpu_share": 0.0, "_w": 0.0})
                dt = time.monotonic() - self.t0
                share = other_cpu_share(self.cpu)
                rec["other_cpu_share"] = (rec["other_cpu_share"] * rec["_w"] + share * dt) / (rec["_w"] + dt or 1)
                rec["_w"] += dt
                rec["seconds"] += dt
        return _S()

    try:
        from async_bench import run_async_case
        from checksum_bench import run_checksum_case
        from save_load import measure_rss, run_case

        tools = make_tools(None)
        freeze_heap()
        # the bf16 variant: one loader per tool (the full list runs on the fp32 state)
        bf16_tools = [dataclasses.replace(t, loaders=[ld for ld in t.loaders if ld.name not in SECONDARY_LOADERS])
                      for t in tools]
        for name, make, used in states(c):
            todo = [s for s in used if s in sections]
            if not todo:
                continue
            gc.collect()
            state = make()
            freeze_heap()
            print(f"state {name}: {len(flatten(state)):,} tensors, {state_nbytes(state) / MiB:,.1f} MiB",
                  file=sys.stderr, flush=True)
            if "saveload" in todo:
                with section("saveload"):
                    res["saveload"][name] = run_case(name.replace(" ", "-"), state,
                                                     bf16_tools if "bf16" in name else tools, c["repeat"],
                                                     workdir, can_drop, not args.no_verify, c["slow_op_s"])
            if "async" in todo:
                with section("async"):
                    res["async"][name] = run_async_case(name.replace(" ", "-"), state, c["repeat"], workdir,
                                                        max_alone_s=c["max_alone_s"], window_s=c["window_s"])
            if "checksum" in todo:
                with section("checksum"):
                    res["checksum"][name] = run_checksum_case(name.replace(" ", "-"), state, c["repeat"], workdir)
            del state
        gc.collect()
        if "rss" in sections:
            with section("rss"):
                wanted = ["safeckpt.save"] if args.quick else ["safeckpt.save", "torch.save", "safetensors.save_file",
                                                               "dcp.save"]
                for mib in c["rss_mib"]:
                    for tool in wanted if mib == min(c["rss_mib"]) else ["safeckpt.save"]:
                        print(f"peak RSS: {tool} @ {mib} MiB", file=sys.stderr, flush=True)
                        ns = argparse.Namespace(size_mib=mib, n_large=c["n_large"])
                        res["rss"][f"{tool} @{mib}"] = measure_rss(tool, ns, workdir)
        if "dist" in sections:
            from dist_bench import run_dist

            with section("dist"):
                res["dist"] = run_dist(c["ranks"], c["dist_mib"], c["n_large"], c["repeat"], workdir)
        if "dcp" in sections:
            from dcp_bench import run_dcp

            with section("dcp"):
                res["dcp"] = run_dcp(c["dcp_ranks"], c["dcp_mib"], c["n_large"], c["n_small"], c["repeat"], workdir)
        if "gpu" in sections:
            from gpu_check import run_gpu

            with section("gpu"):
                res["gpu"] = run_gpu(c["gpu_mib"], c["n_small"], c["repeat"], workdir)
        if "s3" in sections:
            from s3_bench import run_s3

            with section("s3"):
                print("  [s3] starting moto", file=sys.stderr, flush=True)
                res["s3"] = run_s3(c["s3_mib"], c["n_large"], c["repeat"], workdir, not args.no_verify)
        if "incremental" in sections:
            from incremental_bench import run_incremental

            with section("incremental"):
                res["incremental"] = run_incremental(c["inc_mib"], 40, c["inc_saves"], workdir)
        if "tiered" in sections:
            from incremental_bench import run_tiered

            with section("tiered"):
                res["tiered"] = run_tiered(c["tier_mib"], c["n_large"], c["inc_saves"], workdir)
        if "nodes" in sections:
            from nodes_bench import run_nodes

            with section("nodes"):
                res["nodes"] = run_nodes(c["nodes_mib"], c["nodes_saves"], workdir)
        if "share" in sections:
            from share_bench import run_share

            with section("share"):
                res["share"] = run_share(c["share_ranks"], c["share_mib"], c["n_large"], c["repeat"], workdir,
                                         c["share_s3_mib"])
        if "plans" in sections:
            with section("plans"):
                res["plans"] = run_plans(c["plan_ranks"], c["plan_tensors"])
        if "cli" in sections:
            from cli_bench import run_cli

            with section("cli"):
                res["cli"] = run_cli(max(c["repeat"], 3), workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for rec in timing.values():
        rec.pop("_w", None)
        rec["other_cpu_share"] = round(rec["other_cpu_share"], 3)
    res["env"] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "versions": versions(), "dir": str(base), "fs": fs,
                  "cold_cache": can_drop[0], "dcp_mode": dcp_mode, "torch_threads": torch.get_num_threads(),
                  "other_cpu_share": other_cpu_share(cpu_start), "sections": timing,
                  "loadavg_start": [round(x, 2) for x in load_start],
                  "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                  "seconds": time.monotonic() - started, "safeckpt_src": source_fingerprint()}
    res["targets"] = compute_targets(res)
    text = report(res)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "run_all.md").write_text(text)
    res["markdown"] = text
    (out_dir / "run_all.json").write_text(json.dumps(res, indent=1, default=str))
    if not args.no_chart:
        from chart import make_chart

        why = make_chart(res, out_dir / "chart.png")
        print(f"(chart: {why})" if why else f"(chart: {out_dir / 'chart.png'})", file=sys.stderr)
    print(f"(JSON: {out_dir / 'run_all.json'}; Markdown: {out_dir / 'run_all.md'}; "
          f"{res['env']['seconds']:.0f} s)", file=sys.stderr)
    errors = [f"saveload/{cn}/{op}" for cn, case in res["saveload"].items() for op, r in case["ops"].items()
              if r.get("error")]
    errors += [f"async/{cn}/{t}" for cn, case in res["async"].items() for t, r in case["tools"].items() if r.get("error")]
    errors += [f"dist/{w}" for w, r in res["dist"].items() if r.get("error") or r.get("errors")]
    errors += [f"dcp/{w}" for w, r in res["dcp"].items() if r.get("error") or r.get("errors")]
    errors += [f"s3/{op}" for op in res["s3"].get("errors", {})]
    errors += [f"rss/{k}" for k, r in res["rss"].items() if "error" in r]
    errors += [f"share/{where}/{w}" for where, ws in res["share"].items() for w, r in ws.items()
               if isinstance(r, dict) and (r.get("error") or any(o.get("errors") for o in r.get("ops", {}).values()))]
    for name in ("s3", "tiered", "nodes"):
        if res[name].get("error") and not res[name]["error"].startswith("skipped"):
            errors.append(name)
    if errors:
        print(f"errors in: {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
