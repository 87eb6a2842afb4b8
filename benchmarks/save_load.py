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
import bisect
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
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

MiB = 1 << 20
RAW_CHUNK = 64 * MiB
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- states


def make_large_state(total_mib: int, n: int, seed: int = 0) -> dict:
    """~n fp32 matrices of 4096 columns (16 KiB rows) totalling about total_mib."""
    g = torch.Generator().manual_seed(seed)
    rows = max(1, (total_mib * MiB) // (n * 4096 * 4))
    return {"model": {f"w{i:03d}": torch.randn(rows, 4096, generator=g) for i in range(n)}}


def make_small_state(n: int, avg_kib: int, seed: int = 1) -> dict:
    """n optimizer-like fp32 tensors (exp_avg / exp_avg_sq pairs) of 1/4..7/4 x avg_kib."""
    g = torch.Generator().manual_seed(seed)
    base = avg_kib * 256 // 4  # numel of avg_kib/4 KiB
    state: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(n):
        numel = base * (1 + (i * 7919) % 7)  # deterministic spread, mean 4*base
        state.setdefault(f"p{i // 2:05d}", {})["exp_avg" if i % 2 == 0 else "exp_avg_sq"] = (
            torch.randn(numel, generator=g)
        )
    return {"optim": {"state": state}}


def flatten(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts of tensors -> {"a.b.c": tensor} (already-flat dicts pass through)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj
    return out


def state_nbytes(state: dict) -> int:
    return sum(t.nbytes for t in flatten(state).values())


def empty_like_state(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: empty_like_state(v) for k, v in obj.items()}
    return torch.zeros_like(obj) if isinstance(obj, torch.Tensor) else obj


def check_equal(expected: dict, got: Any) -> None:
    a, b = flatten(expected), flatten(got)
    if a.keys() != b.keys():
        missing, extra = sorted(a.keys() - b.keys())[:3], sorted(b.keys() - a.keys())[:3]
        raise AssertionError(f"keys differ: missing {missing}, unexpected {extra}")
    for k, t in a.items():
        if not torch.equal(t, b[k]):
            raise AssertionError(f"tensor {k!r} differs after load")


# ----------------------------------------------------------------------------- disk helpers


def fsync_tree(path: Path) -> None:
    """fsync every file under path (or path itself), then the folders, then the parent."""
    dirs = [path.parent]
    if path.is_dir():
        for root, _, files in os.walk(path):
            dirs.append(Path(root))
            for name in files:
                _fsync(Path(root, name), os.O_RDONLY)
    else:
        _fsync(path, os.O_RDONLY)
    for d in dirs:
        _fsync(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a checkpoint (file or folder) if it exists."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def disk_usage(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; False when not permitted (warm cache)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dirty_mib() -> float:
    """System-wide Dirty + Writeback pages: what a 'save' left unflushed."""
    try:
        vals = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":")
                vals[k] = int(v.split()[0])
        return (vals.get("Dirty", 0) + vals.get("Writeback", 0)) / 1024
    except OSError:
        return float("nan")


def filesystem_of(path: Path) -> dict:
    """Mount point, device and type of the filesystem holding path (longest /proc/mounts match)."""
    path_s = str(path.resolve())
    best = {"mount": "", "device": "?", "fstype": "?"}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                inside = path_s == mnt or path_s.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best["mount"]):
                    best = {"mount": mnt, "device": dev, "fstype": fstype}
    except OSError:
        pass
    st = os.statvfs(path)
    best["free_gib"] = round(st.f_bavail * st.f_frsize / 2**30, 1)
    return best


class FileBackedDetector:
    """Tells whether a tensor's memory is a file mapping (lazy mmap load) via /proc/self/maps."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.rows: list[tuple[int, int, bool]] = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    name = parts[5].strip() if len(parts) > 5 else ""
                    file_backed = name.startswith("/") and not name.startswith("/dev/zero")
                    self.starts.append(lo)
                    self.rows.append((lo, hi, file_backed))
        except OSError:
            pass

    def __call__(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        i = bisect.bisect_right(self.starts, ptr) - 1
        return i >= 0 and self.rows[i][0] <= ptr < self.rows[i][1] and self.rows[i][2]


def touch_if_lazy(result: Any) -> bool:
    """Fault in every page of mmap-backed tensors; True if any were lazy."""
    tensors = [t for t in flatten(result).values() if t.numel()]
    is_file = FileBackedDetector()
    lazy = [t for t in tensors if is_file(t)]
    for t in lazy:
        t.reshape(-1).view(torch.uint8)[::4096].sum()
    return bool(lazy)


# ----------------------------------------------------------------------------- tools
# A writer saves `state` at `path` (a file or a folder it creates).  A loader reads
# `path` back and returns a new state, or fills ctx.dest in place and returns None.


@dataclass
class Ctx:
    state: dict
    dest: dict  # preallocated, same structure: the target of in-place loads
    raw_buf: np.ndarray  # preallocated target of the raw read
    nbytes: int
    raw_src: memoryview = field(  # what the raw write writes, made outside the timing
        default_factory=lambda: memoryview(np.random.default_rng(0).integers(0, 256, RAW_CHUNK, dtype=np.uint8)))


def raw_write(ctx: Ctx, path: Path) -> None:
    """Physical limit: sequential os.write of 64 MiB buffers, then os.fsync."""
    buf = ctx.raw_src
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = ctx.nbytes
        while left:
            left -= os.write(fd, buf[: min(left, RAW_CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(ctx: Ctx, path: Path) -> None:
    """Physical limit: read the same bytes into a preallocated buffer."""
    view = memoryview(ctx.raw_buf)
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < ctx.nbytes:
            n = f.readinto(view[off : off + RAW_CHUNK])
            if not n:
                raise EOFError(f"{path}: short read at {off}")
            off += n


def safeckpt_save(ctx: Ctx, path: Path) -> None:
    import safeckpt

    safeckpt.save(ctx.state, str(path))


def safeckpt_load(ctx: Ctx, path: Path) -> None:
    import safeckpt

    safeckpt.load(ctx.dest, str(path))


def safeckpt_load_state(ctx: Ctx, path: Path) -> dict:
    import safeckpt

    return safeckpt.load_state(str(path))


def torch_save(ctx: Ctx, path: Path) -> None:
    torch.save(ctx.state, path)


def torch_load(ctx: Ctx, path: Path) -> dict:
    return torch.load(path, weights_only=True)


def torch_load_mmap(ctx: Ctx, path: Path) -> dict:
    return torch.load(path, weights_only=True, mmap=True)


def safetensors_save(ctx: Ctx, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(flatten(ctx.state), path)


def safetensors_load(ctx: Ctx, path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def dcp_save(ctx: Ctx, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(ctx.state, checkpoint_id=str(path))  # FileSystemWriter(sync_files=True)


def dcp_load(ctx: Ctx, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(ctx.dest, checkpoint_id=str(path))


@dataclass
class Loader:
    name: str
    fn: Callable[[Ctx, Path], Any]
    in_place: bool


@dataclass
class Tool:
    name: str  # also the save op's name
    save: Callable[[Ctx, Path], None]
    suffix: str  # file name suffix of what save writes ("" = folder)
    self_fsync: str
    loaders: list[Loader] = field(default_factory=list)
    skip: str | None = None  # reason the tool is unavailable


def setup_dcp() -> str:
    """dcp runs without a process group in recent torch; else init a gloo group of 1."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as d:
        try:
            dcp.save({"x": torch.zeros(2)}, checkpoint_id=d)
            return "no process group"
        except Exception:
            store = dist.FileStore(os.path.join(d, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            return "gloo group of 1 (FileStore)"


def make_tools(only: set[str] | None) -> list[Tool]:
    try:
        import safeckpt  # noqa: F401

        missing = [f for f in ("save", "load", "load_state") if not hasattr(safeckpt, f)]
        sk_skip = f"safeckpt lacks {missing}" if missing else None
    except Exception as e:  # still being written
        sk_skip = f"import safeckpt failed: {e!r}"
    try:
        import safetensors  # noqa: F401

        st_skip = None
    except ImportError:
        st_skip = "safetensors not installed"
    tools = [
        Tool("raw write+fsync", raw_write, ".bin", "yes",
             [Loader("raw read", raw_read, True)]),
        Tool("safeckpt.save", safeckpt_save, "", "yes (by design)",
             [Loader("safeckpt.load (in place)", safeckpt_load, True),
              Loader("safeckpt.load_state", safeckpt_load_state, False)], sk_skip),
        Tool("torch.save", torch_save, ".pt", "no, harness does",
             [Loader("torch.load", torch_load, False),
              Loader("torch.load(mmap=True)", torch_load_mmap, False)]),
        Tool("safetensors.save_file", safetensors_save, ".safetensors", "no, harness does",
             [Loader("safetensors.load_file", safetensors_load, False)], st_skip),
        Tool("dcp.save", dcp_save, "", "yes (sync_files)",
             [Loader("dcp.load (in place)", dcp_load, True)]),
    ]
    if only:
        tools = [t for t in tools if t.name.split(".")[0].split(" ")[0] in only or t.name.startswith("raw")]
    return tools


# ----------------------------------------------------------------------------- timing


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "runs_s": times}


def run_case(case: str, state: dict, tools: list[Tool], repeat: int, workdir: Path,
             can_drop: list[bool], verify: bool) -> dict:
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
    for r in range(repeat):
        for tool in tools:
            if tool.skip:
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


def proc_status() -> dict[str, int]:
    """Vm*/Rss* lines of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k.startswith(("Vm", "Rss")) and v.strip().endswith("kB"):
                out[k] = int(v.split()[0]) * 1024
    return out


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


def fmt_s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


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


def cpu_snapshot() -> tuple[float, float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its children, wall)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def other_cpu_share(start: tuple[float, float, float]) -> float:
    """Share of the machine's CPU time that other processes used since ``start``:
    a busy neighbour makes every timing here unreliable."""
    end = cpu_snapshot()
    wall = end[2] - start[2]
    other = (end[0] - start[0]) - (end[1] - start[1])
    return round(max(0.0, other) / (wall * (os.cpu_count() or 1)), 3) if wall > 0 else 0.0


def source_fingerprint() -> str:
    """sha256 (12 hex) of safeckpt's .py files, to tie results to a version of the code."""
    import hashlib

    try:
        import safeckpt
    except Exception:
        return "unavailable"
    h = hashlib.sha256()
    root = Path(safeckpt.__file__).parent
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return f"{h.hexdigest()[:12]} ({root})"


def default_dir() -> Path:
    """A folder on the filesystem of the current directory (not /tmp, often tmpfs)."""
    return Path.cwd()


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
    fs = filesystem_of(base)
    if fs["fstype"] in ("tmpfs", "ramfs"):
        print(f"WARNING: {base} is on {fs['fstype']}: results measure memory, not a disk", file=sys.stderr)
    need = (args.size_mib * MiB) * 2.2
    if fs["free_gib"] * 2**30 < need:
        print(f"not enough free space in {base}: {fs['free_gib']} GiB free, ~{need / 2**30:.1f} GiB needed",
              file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    if load_start[0] > (os.cpu_count() or 1) / 2:
        print(f"WARNING: load average {load_start[0]:.1f} on {os.cpu_count()} CPUs: other work will "
              "skew the timings", file=sys.stderr)
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
