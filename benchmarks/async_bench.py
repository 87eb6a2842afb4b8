#!/usr/bin/env python
"""Async saves: how long the caller is blocked, and what a background save costs a
CPU-bound Python loop running on the main thread meanwhile.

For a state, each repeat times, in this order:
* ``memcopy``: a plain copy of every tensor into preallocated host memory (the floor
  of any snapshot; the buffers are allocated and touched outside the timing), 3 times;
* ``safeckpt.save``: the blocking call, once (the cache flushed before), which the
  async calls are compared with: their blocked time, and the loop time they cost;
* ``safeckpt.async_save`` and ``dcp.async_save``: the wall time of the call (the
  caller is blocked until it returns), then a pure-Python loop spins on the main
  thread while the background save runs, for at most --window seconds ("with save"),
  and the same loop spins alone for about as long just before and just after ("alone";
  the mean of the two, so slow drift of a shared machine cancels out). After the
  window the caller just waits for the commit.
* a control (safeckpt only): the same loop in *another process* spins in the same
  windows as the main thread's (and is stopped between them), so both loops meet the
  same contention at the same moments. That loop shares no GIL with the save, so its
  slowdown is what the save costs through the CPU alone (on a 2-core machine that is
  busy with other work, no core is free for the writer); the difference, per repeat,
  is the GIL. The CPU time of this process's other threads in the window bounds it.

Slowdown = 1 - (iterations/s with save) / (iterations/s alone). safeckpt's first call
is a warm-up, reported apart ("first call"): it allocates its reusable staging buffers
then. DCP's default stager allocates on every call, so it gets no warm-up.

Standalone: ``python benchmarks/async_bench.py [--quick]``; ``run_all.py`` runs it as
part of the suite.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (bench_parser, MiB, default_dir, flatten, make_large_state, make_small_state,  # noqa: E402
                    remove, state_nbytes, summary)

SPIN_CHUNK = 2000  # loop iterations between two checks of the stop condition (~0.1 ms)
MEMCOPY_PER_REPEAT = 3


def spin(until: Callable[[], bool]) -> tuple[int, float]:
    """The CPU-bound "training step": pure Python arithmetic, holding the GIL, until
    ``until()`` is true. Returns (iterations, seconds)."""
    n = 0
    t0 = time.perf_counter()
    while not until():
        x = 0
        for i in range(SPIN_CHUNK):
            x += i * i
        n += SPIN_CHUNK
    return n, time.perf_counter() - t0


def spin_for(seconds: float) -> tuple[int, float]:
    deadline = time.perf_counter() + seconds
    return spin(lambda: time.perf_counter() >= deadline)


class MemCopy:
    """A plain copy of the state's tensors into preallocated (and touched) host memory."""

    def __init__(self, state: dict) -> None:
        srcs = list(flatten(state).values())
        self.pairs = [(torch.empty_like(t), t) for t in srcs]
        for d, _ in self.pairs:
            d.zero_()  # first-touch the pages outside the timing

    def __call__(self) -> None:
        for d, s in self.pairs:
            d.copy_(s)

    def timed(self) -> tuple[float, float]:
        """(wall, CPU) seconds of one copy."""
        w0, c0 = time.perf_counter(), time.process_time()
        self()
        return time.perf_counter() - w0, time.process_time() - c0


def start_safeckpt(state: dict, path: Path) -> Any:
    import safeckpt

    return safeckpt.async_save(state, str(path))


def start_dcp(state: dict, path: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(state, checkpoint_id=str(path))


ASYNC_TOOLS: dict[str, Callable[[dict, Path], Any]] = {
    "safeckpt.async_save": start_safeckpt,
    "dcp.async_save": start_dcp,
}
# tools whose first call differs from the next ones (safeckpt allocates its reusable
# staging buffers then); DCP's default stager allocates on every call, so it gets none
WARM_UP = {"safeckpt.async_save"}


class ChildSpinner:
    """The same CPU-bound loop in another process (no shared GIL), counting into a
    shared 8-byte mapping: its slowdown while a save runs is CPU contention alone."""

    CODE = """
import mmap, struct, sys
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 8)
n = 0
while True:
    x = 0
    for i in range({chunk}):
        x += i * i
    n += {chunk}
    struct.pack_into("q", m, 0, n)
"""

    def __enter__(self) -> "ChildSpinner":
        import mmap
        import subprocess

        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.file = tempfile.NamedTemporaryFile(prefix="safeckpt-spin-", dir=folder)
        self.file.write(b"\0" * 8)
        self.file.flush()
        self.map = mmap.mmap(self.file.fileno(), 8)
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE.format(chunk=SPIN_CHUNK), self.file.name])
        deadline = time.monotonic() + 30
        while self.count() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.run(False)
        return self

    def count(self) -> int:
        return struct.unpack_from("q", self.map, 0)[0]

    def run(self, running: bool) -> None:
        """Let the loop run, or stop it (SIGCONT / SIGSTOP)."""
        import signal

        self.proc.send_signal(signal.SIGCONT if running else signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        self.run(True)
        self.proc.kill()
        self.proc.wait()
        self.map.close()
        self.file.close()


def one_async(start: Callable[[dict, Path], Any], state: dict, path: Path, alone_s: float,
              window_s: float, child: "ChildSpinner | None" = None) -> dict:
    """One async save with the loop on the main thread: the loop spins before the save,
    from the save's return for at most ``window_s`` (then the caller just waits for the
    commit, so a slow save does not stretch the run), and after it. ``child``: the same
    loop in another process spins in the same windows (and is stopped meanwhile), so
    both loops meet the same contention at the same moments; only the main thread's
    shares the save's GIL. Also the CPU time this process's other threads (the save's)
    used in the window: an upper bound of the GIL they could hold."""
    os.sync()
    gc.collect()
    counts: list[int] = []

    def mark(running: bool) -> None:
        if child is not None:
            counts.append(child.count())
            child.run(running)

    mark(True)
    n0, s0 = spin_for(alone_s)
    mark(False)
    t0, c0 = time.perf_counter(), time.process_time()
    fut = start(state, path)
    blocked, cpu = time.perf_counter() - t0, time.process_time() - c0
    until = time.perf_counter() + window_s
    mark(True)
    p0, m0 = time.process_time(), time.thread_time()
    n1, s1 = spin(lambda: fut.done() or time.perf_counter() >= until)
    others = (time.process_time() - p0) - (time.thread_time() - m0)
    mark(False)
    fut.result()
    total = time.perf_counter() - t0
    mark(True)
    n2, s2 = spin_for(alone_s)
    mark(False)
    alone, busy = (n0 + n2) / (s0 + s2), n1 / s1 if s1 > 0 else float("nan")
    rec = {"blocked_s": blocked, "blocked_cpu_s": cpu, "total_s": total, "window_s": s1, "alone_it_s": alone,
           "with_save_it_s": busy, "slowdown": 1 - busy / alone if s1 > 0 else float("nan"),
           "other_threads_cpu_s": others}
    if child is not None and s1 > 0:
        c = counts  # the child's counts at the ends of: alone, (stopped), window, (stopped), alone
        c_alone = ((c[1] - c[0]) + (c[5] - c[4])) / (s0 + s2)
        c_busy = (c[3] - c[2]) / s1
        rec["control"] = {"alone_it_s": c_alone, "with_save_it_s": c_busy, "slowdown": 1 - c_busy / c_alone}
    reported = getattr(fut, "blocked_seconds", None)
    if reported is not None:
        rec["reported_blocked_s"] = reported
    return rec


def run_async_case(case: str, state: dict, repeat: int, workdir: Path, tools: list[str] | None = None,
                   max_alone_s: float = 1.0, window_s: float = 2.0,
                   control_tools: tuple[str, ...] = ("safeckpt.async_save",)) -> dict:
    """Blocked time and main-loop slowdown for one state; see the module docstring."""
    tools = tools or list(ASYNC_TOOLS)
    nbytes = state_nbytes(state)
    copy = MemCopy(state)
    copy()  # warm
    res: dict[str, Any] = {"bytes": nbytes, "n_tensors": len(copy.pairs), "memcopy_s": [], "tools": {},
                           "window_s": window_s}
    spinner = ChildSpinner().__enter__() if control_tools else None
    for r in range(repeat + 1):  # r == 0: safeckpt's first call (allocates its staging buffers)
        gc.collect()
        for _ in range(MEMCOPY_PER_REPEAT):  # cheap, and the floor deserves a good estimate
            wall, _ = copy.timed()
            if r:
                res["memcopy_s"].append(wall)
        sync_s = time_sync_save(state, workdir / f"sync-{case}-{r}") if r else float("nan")
        for tool in tools:
            rec = res["tools"].setdefault(tool, {"runs": [], "control": [], "first": None, "error": None})
            if rec["error"] or (r == 0 and tool not in WARM_UP):
                continue
            path = workdir / f"async-{case}-{tool.split('.')[0]}-{r}"
            alone_s = min(max_alone_s, window_s)
            try:
                before = copy.timed()
                one = one_async(ASYNC_TOOLS[tool], state, path, alone_s, window_s,
                                spinner if tool in control_tools else None)
                after = copy.timed()
                one["memcopy_s"], one["memcopy_cpu_s"] = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
                one["sync_save_s"] = sync_s
                if r:
                    rec["runs"].append(one)
                    if "control" in one:
                        rec["control"].append(one["control"])
                else:
                    rec["first"] = one
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            finally:
                remove(path)
                os.sync()
            print(f"  [async {case} r{r}/{repeat}] {tool}: done", file=sys.stderr, flush=True)
    if spinner is not None:
        spinner.__exit__()
    del copy
    res["memcopy"] = summary(res.pop("memcopy_s"))
    for tool, rec in res["tools"].items():
        runs = rec["runs"]
        if not runs:
            continue
        rec["blocked"] = summary([x["blocked_s"] for x in runs])
        rec["total"] = summary([x["total_s"] for x in runs])
        rec["paired"] = {key: spread([f(x) for x in runs]) for key, f in (
            ("blocked_x", lambda x: x["blocked_s"] / x["memcopy_s"]),
            ("blocked_cpu_x", lambda x: x["blocked_cpu_s"] / x["memcopy_cpu_s"]),
            ("blocked_vs_sync", lambda x: x["blocked_s"] / x["sync_save_s"]),
            ("loop_lost_vs_sync", loop_lost_vs_sync))}
        gil = [x["slowdown"] - x["control"]["slowdown"] for x in runs if "control" in x]
        if gil:
            rec["paired"]["gil_points"] = spread(gil)
        rec["paired"]["other_threads_cpu_s"] = spread([x["other_threads_cpu_s"] for x in runs])
        for key, src in (("slowdown", runs), ("control_slowdown", rec["control"])):
            sl = [x["slowdown"] for x in src]
            if sl:
                rec[key] = {"median": statistics.median(sl), "min": min(sl), "max": max(sl), "runs": sl}
    release_staging()
    return res


def time_sync_save(state: dict, path: Path) -> float:
    """Seconds of one ``safeckpt.save`` of ``state`` (the blocking call), cache flushed before."""
    import safeckpt

    os.sync()
    t0 = time.perf_counter()
    safeckpt.save(state, str(path))
    took = time.perf_counter() - t0
    remove(path)
    os.sync()
    return took


def loop_lost_vs_sync(run: dict) -> float:
    """The loop's time an async save took (blocked, then its slowdown until the commit)
    ÷ the time the blocking ``safeckpt.save`` of the same repeat stops it for."""
    slowdown = run["slowdown"] if run["window_s"] > 0 else 0.0
    return (run["blocked_s"] + slowdown * (run["total_s"] - run["blocked_s"])) / run["sync_save_s"]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def release_staging() -> None:
    """Free safeckpt's reusable staging buffers (one copy of the state) once done."""
    try:
        import safeckpt.run.asyncsave as sa

        saver = getattr(sa, "_default", None)
        if saver is not None:
            saver.close()
    except Exception:  # noqa: BLE001 - best effort: memory, not correctness
        pass
    gc.collect()


BLOCKED_LIMIT = {"small": 1.5, "large": 1.2}  # × a plain memory copy (issue 27), by kind of state
GIL_POINTS_LIMIT = 0.03  # main-thread slowdown − the same loop's slowdown in another process


def blocked_limit(case: str) -> float:
    return BLOCKED_LIMIT["small" if case.startswith("small") else "large"]


def figures(c: dict, tool: str = "safeckpt.async_save") -> dict[str, float | None]:
    """The headline numbers of one state, as medians over repeats of ratios within a
    repeat: blocked time × the memcopies around it (wall, and CPU), the lowest of them,
    the loop's slowdown on the main thread and in another process, and their difference
    (the share of the loop's time the save took through the GIL)."""
    rec = c["tools"].get(tool, {})
    paired = rec.get("paired", {})
    b, cpu, gil = paired.get("blocked_x"), paired.get("blocked_cpu_x"), paired.get("gil_points")
    s, ctl = rec.get("slowdown", {}).get("median"), rec.get("control_slowdown", {}).get("median")
    return {"blocked_x": b["median"] if b else None, "blocked_x_best": b["min"] if b else None,
            "blocked_x_worst": b["max"] if b else None, "blocked_cpu_x": cpu["median"] if cpu else None,
            "slowdown": s, "control_slowdown": ctl, "gil_points": gil["median"] if gil else None,
            "gil_points_range": (gil["min"], gil["max"]) if gil else None}


def summary_lines(cases: dict[str, dict]) -> list[str]:
    """One line per state against issue 27's targets."""
    lines = ["### async save: against the targets", "",
             "| state | blocked × memcopy (range over repeats) | CPU × memcopy's CPU | target | main-thread slowdown | "
             "other-process slowdown | difference (range) | target |", "|---|---:|---:|---|---:|---:|---:|---|"]
    for name, c in cases.items():
        f = figures(c)
        if f["blocked_x"] is None:
            continue
        lim = blocked_limit(name)
        gil, span = f["gil_points"], f["gil_points_range"]
        cpu = f"{f['blocked_cpu_x']:.2f}×" if f["blocked_cpu_x"] is not None else "–"
        lines.append(f"| {name} | {f['blocked_x']:.2f}× ({f['blocked_x_best']:.2f}–{f['blocked_x_worst']:.2f}×) | {cpu} "
                     f"| ≤ {lim:.1f}× {'met' if f['blocked_x'] <= lim else 'missed'} | {_pct(f['slowdown'])} | "
                     f"{_pct(f['control_slowdown'])} | "
                     + (f"{gil * 100:+.1f} points ({span[0] * 100:+.1f} to {span[1] * 100:+.1f}) | "
                        f"≤ {GIL_POINTS_LIMIT * 100:.0f} points {'met' if gil <= GIL_POINTS_LIMIT else 'missed'} |"
                        if gil is not None and span is not None else "– | |"))
    return lines + ["", "Each ratio is taken within one repeat (blocked ÷ the memcopies just before and after it; "
                    "main-thread slowdown − the other process's in the same repeat), then the median over repeats.",
                    ""]


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def async_table(cases: dict[str, dict], sync_save_s: dict[str, float] | None = None) -> str:
    """Markdown: blocked time vs memcopy and DCP, and the main-loop slowdown."""
    sync_save_s = sync_save_s or {}
    lines = ["### async save: time the caller is blocked", "",
             "| state | MiB | tensors | op | blocked s median | min–max | × memcopy | range over repeats "
             "| × dcp.async_save | first call s | commit after s | blocked × sync save (range) "
             "| loop time lost × sync save (range) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in cases.items():
        mc = c["memcopy"]["median_s"]
        dcp_b = c["tools"].get("dcp.async_save", {}).get("blocked", {}).get("median_s")
        mc_vs_dcp = f"{mc / dcp_b:.2f}" if dcp_b else "–"
        lines.append(f"| {name} | {c['bytes'] / MiB:,.0f} | {c['n_tensors']:,} | memcopy (preallocated) | "
                     f"{mc:.3f} | {c['memcopy']['min_s']:.3f}–{c['memcopy']['max_s']:.3f} | 1.00 | | "
                     f"{mc_vs_dcp} |  |  |  |  |")
        for tool, rec in c["tools"].items():
            if "blocked" not in rec:
                lines.append(f"| {name} | | | {tool} | ERROR: {rec.get('error')} | | | | | | | | |")
                continue
            b, x = rec["blocked"], rec["paired"]["blocked_x"]
            vs_dcp = f"{b['median_s'] / dcp_b:.2f}" if dcp_b else "–"
            sync = sync_save_s.get(name)
            first = f"{rec['first']['blocked_s']:.3f}" if rec.get("first") else "–"
            vs, lost = rec["paired"].get("blocked_vs_sync"), rec["paired"].get("loop_lost_vs_sync")
            lines.append(f"| {name} | | | {tool} | {b['median_s']:.3f} | {b['min_s']:.3f}–{b['max_s']:.3f} | "
                         f"{x['median']:.2f} | {x['min']:.2f}–{x['max']:.2f} | {vs_dcp} | "
                         f"{first} | {rec['total']['median_s']:.3f} | "
                         + (f"{vs['median']:.2f} ({vs['min']:.2f}–{vs['max']:.2f}) | "
                            f"{lost['median']:.2f} ({lost['min']:.2f}–{lost['max']:.2f}) |" if vs and lost else
                            f"{b['median_s'] / sync:.2f} | – |" if sync else "– | – |"))
    lines += ["", "× memcopy = the median over repeats of blocked ÷ the memcopies just before and after the call "
              "(the memcopy row: its own median); commit after = from the call to the commit (the loop spins during "
              "the first seconds of it); × sync save = blocked ÷ the blocking safeckpt.save of the same state timed in the "
              "same repeat; loop time lost = blocked + the loop's slowdown × (commit after − blocked), what the async "
              "save cost the loop, against the whole blocking call, which stops it.", "",
              "### async save: slowdown of a CPU-bound Python loop on the main thread while the "
              "background save runs", "",
              "| state | op | loop it/s alone | loop it/s with save | slowdown median | min–max | "
              "same loop in another process: slowdown (CPU only) | difference ≈ the GIL | "
              "CPU of this process's other threads in the window | window s |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in cases.items():
        for tool, rec in c["tools"].items():
            if "slowdown" not in rec:
                continue
            runs = rec["runs"]
            alone = statistics.median(x["alone_it_s"] for x in runs)
            busy = statistics.median(x["with_save_it_s"] for x in runs)
            s = rec["slowdown"]
            ctl = rec.get("control_slowdown")
            ctl_s = f"{ctl['median']:.1%} ({ctl['min']:.1%}–{ctl['max']:.1%})" if ctl else "–"
            paired = rec["paired"].get("gil_points")
            gil = (f"{paired['median'] * 100:+.1f} points ({paired['min'] * 100:+.1f} to {paired['max'] * 100:+.1f})"
                   if paired else "–")
            win = statistics.median(x["window_s"] for x in runs)
            other = statistics.median(x["other_threads_cpu_s"] for x in runs)
            lines.append(f"| {name} | {tool} | {alone / 1e6:.2f} M | {busy / 1e6:.2f} M | {s['median']:.1%} | "
                         f"{s['min']:.1%}–{s['max']:.1%} | {ctl_s} | {gil} | {other * 1e3:.0f} ms | {win:.2f} |")
    lines += ["", "The loop runs while the save runs, for at most the window; the control runs the same loop in "
              "another process at the same moments (no shared GIL): its slowdown is CPU contention alone, the "
              "difference (per repeat: median, range) ≈ the GIL held by the save's Python code, which the CPU time "
              "of this process's other threads in the window bounds.", ""]
    return "\n".join(lines + summary_lines(cases))


def main() -> int:
    p = bench_parser(__doc__, "async.json")
    p.add_argument("--window", type=float, default=2.0, help="seconds the loop spins during a save (max)")
    args = p.parse_args()
    if args.quick:  # tiny unless asked: --quick --size-mib 256 --n-small 20000 keeps those
        given = {a.split("=")[0] for a in sys.argv[1:]}
        args.size_mib = args.size_mib if "--size-mib" in given else 16
        args.n_small = args.n_small if "--n-small" in given else 500
        args.repeat = args.repeat if "--repeat" in given else 1
        args.window = args.window if "--window" in given else 0.3
    base = (args.dir or default_dir()).resolve()
    workdir = Path(tempfile.mkdtemp(prefix=".safeckpt-bench-", dir=base))
    try:
        cases = {}
        for name, make in (("large", lambda: make_large_state(args.size_mib, 50)),
                           ("small", lambda: make_small_state(args.n_small, 8))):
            cases[name] = run_async_case(name, make(), args.repeat, workdir, max_alone_s=min(1.0, args.window),
                                         window_s=args.window)
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    print(async_table(cases))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(cases, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
